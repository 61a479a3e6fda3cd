//! [`ServeDir`]: a directory's files as a `tower` service.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::{Frame, SizeHint};

use crate::fs::{FileChunks, Found, StaticDir, content_type};

/// Answers GET and HEAD requests with the files below a directory: what
/// [`StaticDir`] allows (404 for anything else, missing or forbidden alike), with the status,
/// validators and byte range that [`crate::answer()`] picks; 405 for other methods.
///
/// It is a [`tower_service::Service`], so it can stand behind any server that takes one, or
/// inside a router as the fallback for static assets.
#[derive(Debug, Clone)]
pub struct ServeDir {
    dir: StaticDir,
}

impl ServeDir {
    /// Serves the files below `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            dir: StaticDir::new(root),
        }
    }

    /// The answer to a request with this method, target (its path, and its query if any)
    /// and headers. A directory named without its final `/` gets a 301 to the name with
    /// it, the query kept.
    pub async fn respond(
        &self,
        method: &Method,
        target: &str,
        headers: &http::HeaderMap,
    ) -> Response<FileBody> {
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        if method != Method::GET && method != Method::HEAD {
            let mut r = Response::new(FileBody::empty());
            *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return r;
        }
        let file = match self.dir.find(path).await {
            Some(Found::File(f)) => f,
            Some(Found::Directory) => {
                if let Some(r) = to_directory(path, query) {
                    return r;
                }
                return not_found();
            }
            None => return not_found(),
        };
        match file.answer(method, headers, content_type(path)) {
            Ok((answer, chunks)) => {
                let body = chunks.map_or_else(FileBody::empty, FileBody::file);
                let mut r = Response::new(body);
                *r.status_mut() = answer.status;
                *r.headers_mut() = answer.headers;
                r
            }
            Err(_) => {
                let mut r = Response::new(FileBody::empty());
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                r
            }
        }
    }
}

fn not_found() -> Response<FileBody> {
    let mut r = Response::new(FileBody::bytes(Bytes::from_static(b"404 not found\n")));
    *r.status_mut() = StatusCode::NOT_FOUND;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(14u64));
    r
}

/// 301 from a directory named without its final `/` to the name with it. The location is
/// relative (RFC 9110 §10.2.2 allows it): the last segment and a `/`, resolved against the
/// request's own URL, so it is right behind a router that took a prefix off the path too.
/// `./` first, so that a segment with a `:` is not read as a scheme (RFC 3986 §4.2).
fn to_directory(path: &str, query: Option<&str>) -> Option<Response<FileBody>> {
    let last = path.rsplit('/').next().filter(|s| !s.is_empty())?;
    let location = match query {
        Some(q) => format!("./{last}/?{q}"),
        None => format!("./{last}/"),
    };
    let location = HeaderValue::from_str(&location).ok()?;
    let mut r = Response::new(FileBody::empty());
    *r.status_mut() = StatusCode::MOVED_PERMANENTLY;
    let h = r.headers_mut();
    h.insert(header::LOCATION, location);
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(0u64));
    Some(r)
}

impl<B> tower_service::Service<Request<B>> for ServeDir {
    type Response = Response<FileBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<FileBody>, Infallible>> + Send>>;

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
        Box::pin(async move { Ok(this.respond(&method, &target, &headers).await) })
    }
}

/// The body of a [`ServeDir`] response: nothing, a short message, or a file (or a range of
/// it) read in chunks as the sender takes them.
pub struct FileBody {
    inner: Inner,
}

enum Inner {
    Bytes(Option<Bytes>),
    File { chunks: FileChunks, left: u64 },
}

impl FileBody {
    /// No body.
    pub fn empty() -> Self {
        Self {
            inner: Inner::Bytes(None),
        }
    }

    /// Bytes in memory.
    pub fn bytes(b: Bytes) -> Self {
        Self {
            inner: Inner::Bytes((!b.is_empty()).then_some(b)),
        }
    }

    /// A file's chunks.
    pub fn file(chunks: FileChunks) -> Self {
        let left = chunks.len();
        Self {
            inner: Inner::File { chunks, left },
        }
    }
}

impl http_body::Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.get_mut().inner {
            Inner::Bytes(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::File { chunks, left } => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                let Some(chunk) = ready!(chunks.poll_next(cx)) else {
                    return Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())));
                };
                let chunk = chunk?;
                *left = left.saturating_sub(chunk.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Bytes(b) => b.is_none(),
            Inner::File { left, .. } => *left == 0,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Bytes(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::File { left, .. } => SizeHint::with_exact(*left),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tower_service::Service;

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("kuai-serve-dir-{}-{name}", std::process::id()));
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("index.html"), b"<p>home</p>").unwrap();
        std::fs::write(d.join("sub/data.bin"), (0..=255u8).collect::<Vec<_>>()).unwrap();
        std::fs::write(d.join(".secret"), b"no").unwrap();
        Dir(d)
    }

    async fn call(s: &mut ServeDir, req: Request<()>) -> (StatusCode, http::HeaderMap, Bytes) {
        let resp = s.call(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        (
            parts.status,
            parts.headers,
            body.collect().await.unwrap().to_bytes(),
        )
    }

    fn get(path: &str) -> http::request::Builder {
        Request::get(path)
    }

    #[tokio::test]
    async fn serves_files_ranges_and_refusals() {
        let d = dir("all");
        let mut s = ServeDir::new(&d.0);
        let (status, h, body) = call(&mut s, get("/").body(()).unwrap()).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"<p>home</p>"[..]));
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let (status, h, body) = call(
            &mut s,
            get("/sub/data.bin?x=1")
                .header("range", "bytes=250-")
                .body(())
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(&body[..], &[250, 251, 252, 253, 254, 255]);
        assert_eq!(h[header::CONTENT_RANGE], "bytes 250-255/256");
        let etag = h[header::ETAG].clone();
        let (status, _, body) = call(
            &mut s,
            get("/sub/data.bin")
                .header("if-none-match", etag)
                .body(())
                .unwrap(),
        )
        .await;
        assert_eq!((status, body.len()), (StatusCode::NOT_MODIFIED, 0));
        let head = Request::head("/sub/data.bin").body(()).unwrap();
        let (status, h, body) = call(&mut s, head).await;
        assert_eq!((status, body.len()), (StatusCode::OK, 0));
        assert_eq!(h[header::CONTENT_LENGTH], "256");
        for path in ["/.secret", "/missing", "/sub/../.secret", "/sub/data.bin/"] {
            let (status, _, _) = call(&mut s, get(path).body(()).unwrap()).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        }
        // A directory named without its `/`: sent to the name with it, the query kept.
        std::fs::write(d.0.join("sub/index.html"), b"<a href=data.bin>").unwrap();
        for (path, to) in [("/sub", "./sub/"), ("/sub?v=2", "./sub/?v=2")] {
            let (status, h, body) = call(&mut s, get(path).body(()).unwrap()).await;
            assert_eq!(status, StatusCode::MOVED_PERMANENTLY, "{path}");
            assert_eq!(
                (&h[header::LOCATION], body.len()),
                (&to.parse().unwrap(), 0)
            );
        }
        let (status, h, _) = call(&mut s, get("/sub/").body(()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let post = Request::post("/index.html").body(()).unwrap();
        let (status, h, _) = call(&mut s, post).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(h[header::ALLOW], "GET, HEAD");
    }
}
