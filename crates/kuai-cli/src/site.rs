//! What `kuai server` answers for a site on HTTP/3, HTTP/2 and HTTP/1.1: one response for
//! every protocol (`hq-interop` answers on its own; HTTP/0.9 has no heads). A directory site
//! is [`kuai_http::ServeDir`]; the demo site is generated.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body::Frame;
use kuai_http::FileBody;
use kuai_http::fs::content_type;

use crate::hq::{self, Site};

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

/// The response to `method` on `path` with the request's `headers`, with kuai's `server`
/// header and, when given, `alt-svc`.
pub async fn response(
    site: &Site,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    alt_svc: Option<&str>,
) -> Response<RespBody> {
    let mut resp = match site {
        Site::Dir(root) => kuai_http::ServeDir::new(root.clone())
            .respond(method, path, headers)
            .await
            .map(RespBody::Served),
        Site::Demo => demo(method, path).await,
    };
    let h = resp.headers_mut();
    h.insert(header::SERVER, HeaderValue::from_static("kuai"));
    if let Some(a) = alt_svc.and_then(|a| HeaderValue::from_str(a).ok()) {
        h.insert(header::ALT_SVC, a);
    }
    resp
}

async fn demo(method: &Method, path: &str) -> Response<RespBody> {
    let mut resp = Response::new(RespBody::Bytes(None));
    if method != Method::GET && method != Method::HEAD {
        *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    let (ctype, len, body) = match hq::resolve(&Site::Demo, path).await {
        None => {
            let msg = Bytes::from_static(b"404 not found\n");
            *resp.status_mut() = StatusCode::NOT_FOUND;
            ("text/plain", msg.len() as u64, RespBody::Bytes(Some(msg)))
        }
        Some(hq::Body::Bytes(b)) => (content_type(path), b.len() as u64, RespBody::Bytes(Some(b))),
        Some(hq::Body::Pattern(n)) => {
            let block = crate::demo::pattern_block().clone();
            ("application/octet-stream", n, RespBody::Pattern(block, n))
        }
        // The demo site has no files; should it get some, they stream as they are.
        Some(hq::Body::File(f, n)) => (content_type(path), n, RespBody::Served(FileBody::file(f))),
    };
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if method != Method::HEAD {
        *resp.body_mut() = body;
    }
    resp
}
