//! [`Router`]: several sites on one server, chosen by the request's host and path prefix,
//! each served by a service of its own (a [`Proxy`](crate::Proxy) to a pool of backends, a
//! [`ServeDir`](crate::ServeDir), an axum `Router`...).
//!
//! The host comes from the request (`:authority` or `Host`, without the port); a name is
//! exact or a wildcard one label deep (`*.example.com`). A request for no known host goes to
//! the default host, or gets 421 Misdirected Request (RFC 9110 §15.5.20) when there is
//! none. Within a host the longest matching prefix wins; none matching gives 404.
//!
//! ```
//! use kuai_http::{Router, ServeDir};
//! let router = Router::new()
//!     .route(&["example.com", "*.example.com"], "/", ServeDir::new("/srv/www"))
//!     .route(&["example.com"], "/static/", ServeDir::new("/srv/static"))
//!     .strip_prefix(true)
//!     .default_host("example.com");
//! # let _ = router;
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;

use crate::{Body, BoxError};

/// A response body of any route.
pub type RouteBody = UnsyncBoxBody<Bytes, BoxError>;

type Handler = Arc<
    dyn Fn(Request<Body>) -> Pin<Box<dyn Future<Output = Response<RouteBody>> + Send>>
        + Send
        + Sync,
>;

struct Route {
    prefix: String,
    strip: bool,
    handler: Handler,
}

struct Host {
    /// Lower case; `*.` + a domain for a wildcard.
    names: Vec<String>,
    /// Longest prefix first.
    routes: Vec<Route>,
}

/// Routes requests to services by host and path prefix; see the [module](self) docs.
#[derive(Clone, Default)]
pub struct Router {
    hosts: Arc<Vec<Host>>,
    default: Option<usize>,
    /// The route added last (host index, prefix), for [`Router::strip_prefix`].
    last: Option<(usize, String)>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_map();
        for h in self.hosts.iter() {
            let prefixes: Vec<&str> = h.routes.iter().map(|r| r.prefix.as_str()).collect();
            d.entry(&h.names, &prefixes);
        }
        d.finish()
    }
}

impl Router {
    /// No routes yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn hosts_mut(&mut self) -> &mut Vec<Host> {
        Arc::get_mut(&mut self.hosts).expect("a router is built before it is cloned")
    }

    /// Serves requests for `hosts` whose path starts with `prefix` with `service`. The
    /// first call for a set of names makes it a host; later calls naming any of them add
    /// routes to it.
    pub fn route<S, B>(mut self, hosts: &[&str], prefix: &str, service: S) -> Self
    where
        S: tower_service::Service<Request<Body>, Response = Response<B>>
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: http_body::Body + Send + 'static,
        B::Data: Buf + Send,
        B::Error: Into<BoxError>,
    {
        let names: Vec<String> = hosts
            .iter()
            .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
            .collect();
        let handler = boxed(service);
        let list = self.hosts_mut();
        let i = match list
            .iter()
            .position(|h| h.names.iter().any(|n| names.contains(n)))
        {
            Some(i) => {
                for n in names {
                    if !list[i].names.contains(&n) {
                        list[i].names.push(n);
                    }
                }
                i
            }
            None => {
                list.push(Host {
                    names,
                    routes: Vec::new(),
                });
                list.len() - 1
            }
        };
        let routes = &mut list[i].routes;
        routes.retain(|r| r.prefix != prefix);
        self.last = Some((i, prefix.to_owned()));
        let routes = &mut self.hosts_mut()[i].routes;
        routes.push(Route {
            prefix: prefix.to_owned(),
            strip: false,
            handler,
        });
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        self
    }

    /// Whether the route added last passes its path on without its prefix (`/api/` +
    /// `v1/x` reaches its service as `/v1/x`); off by default.
    pub fn strip_prefix(mut self, on: bool) -> Self {
        if let Some((i, prefix)) = self.last.clone()
            && let Some(r) = self.hosts_mut()[i]
                .routes
                .iter_mut()
                .find(|r| r.prefix == prefix)
        {
            r.strip = on;
        }
        self
    }

    /// Requests for a host no route names go to `name`'s routes (without a default they
    /// get 421).
    pub fn default_host(mut self, name: &str) -> Self {
        let name = name.to_ascii_lowercase();
        self.default = self.hosts.iter().position(|h| h.names.contains(&name));
        self
    }

    fn host_of(&self, req: &Request<Body>) -> Option<&Host> {
        let authority = req.uri().host().map(str::to_owned).or_else(|| {
            let h = req.headers().get(http::header::HOST)?.to_str().ok()?;
            Some(
                h.parse::<http::uri::Authority>()
                    .map(|a| a.host().to_owned())
                    .unwrap_or_else(|_| h.to_owned()),
            )
        });
        if let Some(host) = authority {
            let host = host.trim_end_matches('.').to_ascii_lowercase();
            let wildcard = host
                .split_once('.')
                .map(|(_, parent)| format!("*.{parent}"));
            for h in self.hosts.iter() {
                if h.names.contains(&host) {
                    return Some(h);
                }
            }
            if let Some(w) = wildcard {
                for h in self.hosts.iter() {
                    if h.names.contains(&w) {
                        return Some(h);
                    }
                }
            }
        }
        self.default.and_then(|i| self.hosts.get(i))
    }

    /// The answer to `req`.
    pub async fn handle(&self, mut req: Request<Body>) -> Response<RouteBody> {
        let Some(host) = self.host_of(&req) else {
            return plain(
                StatusCode::MISDIRECTED_REQUEST,
                "no site here by that name\n",
            );
        };
        // Routes match the path as the files handler reads it (escapes decoded, empty and
        // dot segments resolved): "//private/x", "/./private/x" or "/%70rivate/x" went to
        // the route for "/" and reached the same file as "/private/x", past whatever guarded
        // "/private/" (as nginx matches locations on the normalized path).
        let Some(path) = normalized_path(req.uri().path()) else {
            return plain(StatusCode::BAD_REQUEST, "bad path\n");
        };
        let Some(route) = host
            .routes
            .iter()
            .find(|r| prefix_matches(&r.prefix, &path))
        else {
            return plain(StatusCode::NOT_FOUND, "not found\n");
        };
        if route.strip
            && let Some(uri) = stripped(req.uri(), &path, &route.prefix)
        {
            *req.uri_mut() = uri;
        }
        (route.handler)(req).await
    }
}

/// `path` normalized for matching (RFC 3986 §6.2.2): percent-escapes decoded (but for `/`,
/// which stays `%2F` inside its segment, so it draws no boundary), empty and `.` segments
/// dropped, `..` taking the segment before it, a final `/` kept. Borrowed when already in
/// that form; `None` for a `..` above the root or a malformed escape.
fn normalized_path(path: &str) -> Option<std::borrow::Cow<'_, str>> {
    let plain = !path.contains('%')
        && !path.contains("//")
        && !path.contains("/./")
        && !path.contains("/../")
        && !path.ends_with("/.")
        && !path.ends_with("/..");
    if plain && path.starts_with('/') {
        return Some(std::borrow::Cow::Borrowed(path));
    }
    let mut segments: Vec<String> = Vec::new();
    let mut directory = false;
    for raw in path.split('/').skip(usize::from(path.starts_with('/'))) {
        directory = false;
        let segment = decode_segment(raw)?;
        match segment.as_str() {
            "" | "." => directory = true,
            ".." => {
                segments.pop()?;
                directory = true;
            }
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if directory || segments.is_empty() {
        out.push('/');
    }
    Some(std::borrow::Cow::Owned(out))
}

/// One path segment with its escapes decoded, `/` (and `%`) escaped again.
fn decode_segment(raw: &str) -> Option<String> {
    if !raw.contains('%') {
        return Some(raw.to_owned());
    }
    let mut out = Vec::with_capacity(raw.len());
    for b in crate::fs::percent_decode_bytes(raw)? {
        match b {
            b'/' => out.extend_from_slice(b"%2F"),
            b'%' => out.extend_from_slice(b"%25"),
            b => out.push(b),
        }
    }
    // Bytes that are not UTF-8 stay escaped as they came.
    Some(String::from_utf8(out).unwrap_or_else(|_| raw.to_owned()))
}

/// Whether `path` is under `prefix` (`/api/` takes `/api/x`; `/api` takes `/api` and
/// `/api/x`, not `/apix`).
fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// `uri` with `prefix` taken off its `path` (normalized; the rest stays absolute), and its
/// query kept.
fn stripped(uri: &Uri, path: &str, prefix: &str) -> Option<Uri> {
    let rest = path.strip_prefix(prefix.trim_end_matches('/'))?;
    let mut rest = if rest.starts_with('/') {
        rest.to_owned()
    } else {
        format!("/{rest}")
    };
    if let Some(q) = uri.query() {
        rest.push('?');
        rest.push_str(q);
    }
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(rest.parse().ok()?);
    Uri::from_parts(parts).ok()
}

fn plain(status: StatusCode, text: &'static str) -> Response<RouteBody> {
    let mut r = Response::new(
        http_body_util::Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|e: Infallible| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r
}

fn boxed<S, B>(service: S) -> Handler
where
    S: tower_service::Service<Request<Body>, Response = Response<B>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Buf + Send,
    B::Error: Into<BoxError>,
{
    Arc::new(move |req| {
        let mut svc = service.clone();
        Box::pin(async move {
            let r = async {
                std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
                svc.call(req).await
            };
            match r.await {
                Ok(resp) => resp.map(|b| {
                    b.map_frame(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                        .map_err(Into::into)
                        .boxed_unsync()
                }),
                Err(e) => {
                    let e: BoxError = e.into();
                    tracing::warn!(error = %e, "route service failed");
                    plain(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n")
                }
            }
        })
    })
}

impl tower_service::Service<Request<Body>> for Router {
    type Response = Response<RouteBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RouteBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.handle(req).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_at_segment_boundaries() {
        assert!(prefix_matches("/", "/x"));
        assert!(prefix_matches("/api/", "/api/v1"));
        assert!(prefix_matches("/api", "/api"));
        assert!(prefix_matches("/api", "/api/v1"));
        assert!(!prefix_matches("/api", "/apix"));
        assert!(!prefix_matches("/api/", "/api"));
        let u: Uri = "/api/v1/x?q=1".parse().unwrap();
        assert_eq!(stripped(&u, u.path(), "/api/").unwrap(), "/v1/x?q=1");
        assert_eq!(stripped(&u, u.path(), "/api").unwrap(), "/v1/x?q=1");
        let u: Uri = "/api".parse().unwrap();
        assert_eq!(stripped(&u, u.path(), "/api").unwrap(), "/");
        let u: Uri = "//api/./v1/%78?q".parse().unwrap();
        let p = normalized_path(u.path()).unwrap();
        assert_eq!(stripped(&u, &p, "/api/").unwrap(), "/v1/x?q");
    }

    #[test]
    fn paths_are_matched_normalized() {
        let n = |p| normalized_path(p).map(|c| c.into_owned());
        assert_eq!(n("/private/s.txt").as_deref(), Some("/private/s.txt"));
        assert!(matches!(
            normalized_path("/a/b/"),
            Some(std::borrow::Cow::Borrowed(_))
        ));
        for (raw, want) in [
            ("//private/s.txt", "/private/s.txt"),
            ("/./private/s.txt", "/private/s.txt"),
            ("/%70rivate/s.txt", "/private/s.txt"),
            ("/x/../private/s.txt", "/private/s.txt"),
            ("/private/.", "/private/"),
            ("/private/x/..", "/private/"),
            ("/private%2Fs.txt", "/private%2Fs.txt"),
            ("/a%25b", "/a%25b"),
            ("/%E4%B8%AD", "/\u{4e2d}"),
            ("/%FF", "/%FF"),
            ("/", "/"),
            ("//", "/"),
        ] {
            assert_eq!(n(raw).as_deref(), Some(want), "{raw}");
        }
        assert_eq!(n("/../x"), None);
        assert_eq!(n("/%zz"), None);
        assert!(prefix_matches("/private/", &n("/%70rivate/s.txt").unwrap()));
        assert!(!prefix_matches(
            "/private/",
            &n("/private%2Fs.txt").unwrap()
        ));
    }
}

#[cfg(test)]
mod guarded {
    use super::*;

    /// A 403 for everything.
    #[derive(Clone)]
    struct Forbidden;

    impl tower_service::Service<Request<Body>> for Forbidden {
        type Response = Response<RouteBody>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Response<RouteBody>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<Body>) -> Self::Future {
            std::future::ready(Ok(plain(StatusCode::FORBIDDEN, "no\n")))
        }
    }

    /// A route guarding a sub-prefix of a directory served below "/" cannot be gone around
    /// with another spelling of the same path: the files handler decodes escapes and skips
    /// empty and dot segments, and so does the matching.
    #[tokio::test]
    async fn a_guarded_prefix_holds_for_every_spelling_of_its_paths() {
        let root = std::env::temp_dir().join(format!("kuai-router-{}", std::process::id()));
        std::fs::create_dir_all(root.join("private")).unwrap();
        std::fs::write(root.join("private/s.txt"), b"secret").unwrap();
        std::fs::write(root.join("open.txt"), b"open").unwrap();
        let router = Router::new()
            .route(&["a.test"], "/", crate::ServeDir::new(&root))
            .route(&["a.test"], "/private/", Forbidden);
        let status = |path: &str| {
            let router = router.clone();
            let mut req = Request::new(Body::empty());
            *req.uri_mut() = path.parse().unwrap();
            req.headers_mut()
                .insert(http::header::HOST, "a.test".parse().unwrap());
            async move { router.handle(req).await.status() }
        };
        for path in [
            "/private/s.txt",
            "//private/s.txt",
            "/./private/s.txt",
            "/%70rivate/s.txt",
            "/open.txt/../private/s.txt",
        ] {
            assert_eq!(status(path).await, StatusCode::FORBIDDEN, "{path}");
        }
        assert_eq!(status("/open.txt").await, StatusCode::OK);
        assert_eq!(status("/../private/s.txt").await, StatusCode::BAD_REQUEST);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
