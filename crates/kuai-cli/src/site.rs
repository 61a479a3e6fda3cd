//! What `kuai server` serves: a directory ([`kuai_http::ServeDir`]) or the built-in demo
//! site, as one `tower` service that `kuai_http::Server` runs over HTTP/3, HTTP/2, HTTP/1.1
//! and HTTP/0.9.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use kuai_http::fs::content_type;
use kuai_http::{FileBody, ServeDir};

use crate::demo;

/// Where responses come from.
#[derive(Clone)]
pub enum Site {
    /// Files under a directory.
    Dir(PathBuf),
    /// The built-in demo site.
    Demo,
}

/// A response body: nothing, bytes in memory, a file (through [`FileBody`]), or the demo
/// site's generated pattern.
pub enum RespBody {
    Bytes(Option<Bytes>),
    Served(FileBody),
    Pattern(Bytes, u64),
}

impl http_body::Body for RespBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            RespBody::Bytes(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::Served(b) => Pin::new(b).poll_frame(cx),
            RespBody::Pattern(block, left) => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                let n = (*left).min(block.len() as u64) as usize;
                *left -= n as u64;
                Poll::Ready(Some(Ok(Frame::data(block.slice(..n)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Bytes(b) => b.is_none(),
            RespBody::Served(b) => b.is_end_stream(),
            RespBody::Pattern(_, left) => *left == 0,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            RespBody::Bytes(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            RespBody::Served(b) => b.size_hint(),
            RespBody::Pattern(_, left) => http_body::SizeHint::with_exact(*left),
        }
    }
}

/// The site as a `tower` service, with kuai's `server` header on every response.
#[derive(Clone)]
pub struct SiteService(Arc<Inner>);

enum Inner {
    Dir(ServeDir),
    Demo,
}

impl SiteService {
    pub fn new(site: &Site) -> Self {
        Self(Arc::new(match site {
            Site::Dir(root) => Inner::Dir(ServeDir::new(root.clone())),
            Site::Demo => Inner::Demo,
        }))
    }

    /// The response to `method` on `target` (the path, and the query if any) with the
    /// request's `headers`.
    pub async fn response(
        &self,
        method: &Method,
        target: &str,
        headers: &http::HeaderMap,
    ) -> Response<RespBody> {
        let mut resp = match &*self.0 {
            Inner::Dir(dir) => dir
                .respond(method, target, headers)
                .await
                .map(RespBody::Served),
            Inner::Demo => {
                let path = target.split('?').next().unwrap_or(target);
                demo_response(method, path)
            }
        };
        resp.headers_mut()
            .insert(header::SERVER, HeaderValue::from_static("kuai"));
        resp
    }
}

impl<B> tower_service::Service<Request<B>> for SiteService {
    type Response = Response<RespBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RespBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let method = req.method().clone();
        let target = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let headers = req.headers().clone();
        Box::pin(async move { Ok(this.response(&method, &target, &headers).await) })
    }
}

fn demo_response(method: &Method, path: &str) -> Response<RespBody> {
    let mut resp = Response::new(RespBody::Bytes(None));
    if method != Method::GET && method != Method::HEAD {
        *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    let (ctype, len, body) = match demo::lookup(path) {
        None => {
            let msg = Bytes::from_static(b"404 not found\n");
            *resp.status_mut() = StatusCode::NOT_FOUND;
            ("text/plain", msg.len() as u64, RespBody::Bytes(Some(msg)))
        }
        Some(demo::Page::Bytes(b)) => {
            (content_type(path), b.len() as u64, RespBody::Bytes(Some(b)))
        }
        Some(demo::Page::Pattern(n)) => {
            let block = demo::pattern_block().clone();
            ("application/octet-stream", n, RespBody::Pattern(block, n))
        }
    };
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if method != Method::HEAD {
        *resp.body_mut() = body;
    }
    resp
}
