//! A reverse proxy: [`Proxy`] is a `tower` service that forwards each request to one of a
//! set of backends over HTTP/1.1 or cleartext HTTP/2, so a [`Server`](crate::Server) in
//! front of it is a gateway that takes HTTP/3, HTTP/2 and HTTP/1.1 from clients.
//!
//! - Connections to backends are pooled (HTTP/1.1 keep-alive; one multiplexed HTTP/2
//!   connection per backend); requests go round robin or to the backend with the fewest
//!   outstanding ([`Balance`]).
//! - Bodies stream both ways under backpressure: nothing is gathered in memory. A client
//!   that goes away drops its request to the backend.
//! - A request that never left (the connection failed first) goes to the next backend,
//!   whatever its method; an idempotent one without a body also after its connection failed
//!   before a response head came (RFC 9110 §9.2.2).
//! - A backend that fails [`ProxyBuilder::max_fails`] times in a row rests for
//!   [`ProxyBuilder::fail_timeout`] (passive checks); [`HealthCheck`] asks it for a path
//!   every so often (active checks).
//! - Hop-by-hop header fields are removed both ways; `Forwarded` (RFC 7239),
//!   `X-Forwarded-For`, `X-Forwarded-Proto` and `Via` are added; a request that arrived in
//!   0-RTT carries `Early-Data: 1` (RFC 8470 §5.1), and a backend's 425 goes back to the
//!   client, which retries after its handshake. (The server itself answers 425 to
//!   non-idempotent requests in 0-RTT unless told otherwise.)
//! - A backend that fails gives 502, one that does not answer in time 504; the reason is
//!   logged (target `kuai_http::proxy`). The response carries an [`UpstreamTiming`]
//!   extension, which the server's access log prints.
//!
//! ```no_run
//! # async fn run(tls: rustls::ServerConfig) -> Result<(), kuai_http::Error> {
//! use kuai_http::proxy::{Proxy, Upstream};
//! let proxy = Proxy::builder()
//!     .upstream("http://127.0.0.1:8080".parse::<Upstream>()?)
//!     .upstream("h2c://127.0.0.1:8081".parse::<Upstream>()?)
//!     .build()?;
//! let listener = kuai_http::Listener::bind("0.0.0.0:443".parse().unwrap(), tls).await?;
//! kuai_http::Server::new(proxy).serve(listener).await
//! # }
//! ```

mod backend;
mod body;
pub(crate) mod h1;
mod headers;
#[cfg(test)]
mod tests;
mod websocket;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};

use self::backend::{Backend, Failure, Reason};
pub use self::body::ProxyBody;
use self::body::{Outstanding, UpBody};
use crate::{Body, ConnInfo, EarlyData, Error};

/// HTTP/2 windows toward a backend: a stream's as the server's own toward clients.
const H2_STREAM_WINDOW: u32 = 256 * 1024;
/// Requests at once on one HTTP/2 connection to a backend; more open another connection.
const H2_STREAMS_PER_CONNECTION: usize = 64;
/// The connection's window holds every stream's whole window: responses a slow client
/// has not read yet (each up to a stream's window, held by the proxy) cannot use up the
/// connection's window and stop the responses of every other client on it.
const H2_CONNECTION_WINDOW: u32 = H2_STREAM_WINDOW * H2_STREAMS_PER_CONNECTION as u32;

/// How the proxy talks to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UpstreamProtocol {
    /// HTTP/1.1 (`http://`), a pool of keep-alive connections.
    Http1,
    /// HTTP/2 without TLS, with prior knowledge (`h2c://`): one connection, many streams.
    H2c,
}

/// A backend's address: `http://HOST:PORT` (HTTP/1.1) or `h2c://HOST:PORT` (cleartext
/// HTTP/2). The port defaults to 80; a path is not allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    protocol: UpstreamProtocol,
    authority: String,
}

impl Upstream {
    /// How the proxy talks to it.
    pub fn protocol(&self) -> UpstreamProtocol {
        self.protocol
    }

    /// `host:port`, what the proxy connects to.
    pub fn authority(&self) -> &str {
        &self.authority
    }
}

impl FromStr for Upstream {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self, Error> {
        let bad = |reason| Error::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let protocol = match uri.scheme_str() {
            Some("http") => UpstreamProtocol::Http1,
            Some("h2c") => UpstreamProtocol::H2c,
            _ => return Err(bad("an upstream is http://HOST:PORT or h2c://HOST:PORT")),
        };
        let auth = uri.authority().ok_or_else(|| bad("no host"))?;
        if auth.host().is_empty() || auth.as_str().contains('@') {
            return Err(bad("no host"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad("an upstream has no path"));
        }
        let port = auth.port_u16().unwrap_or(80);
        Ok(Self {
            protocol,
            authority: format!("{}:{port}", auth.host()),
        })
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = match self.protocol {
            UpstreamProtocol::Http1 => "http",
            UpstreamProtocol::H2c => "h2c",
        };
        write!(f, "{scheme}://{}", self.authority)
    }
}

/// Which backend takes a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Balance {
    /// Each in turn.
    #[default]
    RoundRobin,
    /// The one with the fewest requests outstanding (sent, and not answered to the last
    /// byte); ties in turn.
    LeastOutstanding,
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Balance::RoundRobin => "round-robin",
            Balance::LeastOutstanding => "least-outstanding",
        })
    }
}

impl FromStr for Balance {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "round-robin" | "rr" => Ok(Balance::RoundRobin),
            "least-outstanding" | "least" => Ok(Balance::LeastOutstanding),
            _ => Err(Error::Config(format!(
                "balance {s:?}: round-robin or least-outstanding"
            ))),
        }
    }
}

/// Active health checks: a `GET` of `path` on every backend each `interval`; a backend that
/// answers other than 2xx or 3xx within `timeout`, or not at all, gets no requests until
/// it passes again.
#[derive(Debug, Clone)]
pub struct HealthCheck {
    /// The path asked for (`/healthz`, say).
    pub path: String,
    /// Time between checks.
    pub interval: Duration,
    /// How long an answer may take.
    pub timeout: Duration,
}

impl HealthCheck {
    /// Checks `path` every 5 s, allowing 2 s for the answer.
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
        }
    }
}

/// Why a backend's response failed part-way (an HTTP/1.1 framing or connection error).
#[derive(Debug)]
pub struct UpstreamError(h1::Error);

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "upstream: {}", self.0)
    }
}

impl std::error::Error for UpstreamError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.0)
    }
}

/// Which backend answered a proxied request and how long it took to its response head: an
/// extension of the response.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UpstreamTiming {
    /// The backend (`host:port`).
    pub backend: Arc<str>,
    /// From sending the request (the last attempt) to the response head.
    pub elapsed: Duration,
}

/// Timeouts and limits of a proxy.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    connect_timeout: Duration,
    response_timeout: Duration,
    max_idle: usize,
    idle_timeout: Duration,
    max_fails: u32,
    fail_timeout: Duration,
    max_conns: usize,
    max_tunnels: usize,
    max_tunnels_per_address: usize,
    /// Full proxies in front (`kuai lb`): a client from one counts by address and port.
    proxies: Vec<std::net::IpAddr>,
    /// Request fields with `_` in their names go to backends (see
    /// [`ProxyBuilder::underscores_in_headers`]).
    underscores: bool,
}

/// Builds a [`Proxy`].
#[derive(Debug)]
pub struct ProxyBuilder {
    upstreams: Vec<Upstream>,
    balance: Balance,
    options: Options,
    health: Option<HealthCheck>,
    via: String,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl ProxyBuilder {
    /// Adds a backend.
    pub fn upstream(mut self, u: Upstream) -> Self {
        self.upstreams.push(u);
        self
    }

    /// How backends are picked (round robin by default).
    pub fn balance(mut self, b: Balance) -> Self {
        self.balance = b;
        self
    }

    /// Time allowed for a TCP connection to a backend (5 s by default); past it the next
    /// backend is tried, and 504 answered when none is left.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.options.connect_timeout = d;
        self
    }

    /// Time allowed from sending a request to its response head (60 s by default), then
    /// 504, counted from the request body's last progress: an upload that keeps moving is
    /// not cut off, and a client whose body stops coming that long gets 408 (the backend is
    /// not blamed); and, once the head came, between two pieces of the response body while the
    /// client waits for more (then the response is cut off, as nginx's
    /// `proxy_read_timeout` does).
    pub fn response_timeout(mut self, d: Duration) -> Self {
        self.options.response_timeout = d;
        self
    }

    /// Idle HTTP/1.1 connections kept per backend (128 by default).
    pub fn max_idle_per_backend(mut self, n: usize) -> Self {
        self.options.max_idle = n;
        self
    }

    /// Connections open to one backend at most (1024 by default): HTTP/1.1 ones, idle or
    /// busy, and HTTP/2 ones (WebSocket tunnels not counted: see
    /// [`max_websockets`](Self::max_websockets)). A request that finds them all
    /// busy waits for one within the connect timeout, then goes to the next backend, or is
    /// answered 503; a busy backend is not counted as failing. HTTP/2 connections past the
    /// cap carry more than their share of requests instead.
    pub fn max_connections_per_backend(mut self, n: usize) -> Self {
        self.options.max_conns = n.max(1);
        self
    }

    /// WebSocket tunnels open at once through the proxy (4096 by default), and from one
    /// client address (an IPv6 address's /64; 512 by default). Each holds a backend
    /// connection of its own (and, from HTTP/1.1, the client's), counted in no other limit:
    /// past either cap an upgrade is answered 503.
    pub fn max_websockets(mut self, total: usize, per_address: usize) -> Self {
        self.options.max_tunnels = total.max(1);
        self.options.max_tunnels_per_address = per_address.max(1);
        self
    }

    /// Addresses of full proxies in front of the server (`kuai lb`'s): every client arrives
    /// from one of them on a port of its own, so a client from there counts by address and
    /// port for the per-address WebSocket cap, not as one with every other client of the
    /// proxy (which caps its flows per client address itself).
    pub fn proxies(mut self, proxies: Vec<std::net::IpAddr>) -> Self {
        self.options.proxies = proxies;
        self
    }

    /// How long an idle connection is kept (50 s by default, under the 60–75 s after
    /// which common servers close theirs).
    pub fn idle_timeout(mut self, d: Duration) -> Self {
        self.options.idle_timeout = d;
        self
    }

    /// Failures in a row (connection refused or lost, timeouts) after which a backend rests
    /// (1 by default, as nginx's `max_fails`).
    pub fn max_fails(mut self, n: u32) -> Self {
        self.options.max_fails = n;
        self
    }

    /// How long a failing backend rests (10 s by default); when every backend rests, they
    /// are tried all the same.
    pub fn fail_timeout(mut self, d: Duration) -> Self {
        self.options.fail_timeout = d;
        self
    }

    /// Active health checks (none by default).
    pub fn health_check(mut self, h: HealthCheck) -> Self {
        self.health = Some(h);
        self
    }

    /// Records each backend's response times and errors in `metrics` (see
    /// [`crate::metrics`]).
    pub fn metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Whether request fields whose names hold `_` go to the backends (not by default, as
    /// nginx's `underscores_in_headers off`). A backend that maps field names to variables
    /// (CGI, WSGI, PHP: `X_Real_IP` and `X-Real-IP` both become `HTTP_X_REAL_IP`) would
    /// otherwise take a client's `X_Real_IP` or `X_Forwarded_Proto` for the gateway's own.
    pub fn underscores_in_headers(mut self, allow: bool) -> Self {
        self.options.underscores = allow;
        self
    }

    /// The name this proxy gives itself in `Via` ("kuai" by default).
    pub fn via_name(mut self, name: impl Into<String>) -> Self {
        self.via = name.into();
        self
    }

    /// The proxy. Active health checks start here, so this runs inside a tokio runtime
    /// when [`health_check`](Self::health_check) was set.
    pub fn build(self) -> Result<Proxy, Error> {
        if self.upstreams.is_empty() {
            return Err(Error::Config("a proxy needs at least one upstream".into()));
        }
        if !self.via.bytes().all(|b| b.is_ascii_graphic()) || self.via.is_empty() {
            return Err(Error::Config(format!(
                "the Via name {:?} is not one token",
                self.via
            )));
        }
        let epoch = Instant::now();
        let inner = Arc::new(Inner {
            backends: self
                .upstreams
                .into_iter()
                .map(|u| {
                    let mut b = Backend::new(u, epoch);
                    if let Some(m) = &self.metrics {
                        b.metrics = Some(m.upstream(b.name.clone()));
                    }
                    Arc::new(b)
                })
                .collect(),
            balance: self.balance,
            next: AtomicUsize::new(0),
            options: self.options,
            via_values: ["0.9", "1.0", "1.1", "2", "3"].map(|v| {
                HeaderValue::from_str(&format!("{v} {}", self.via)).expect("checked above")
            }),
            tunnels: Arc::default(),
        });
        if let Some(h) = self.health {
            let rt = tokio::runtime::Handle::try_current()
                .map_err(|_| Error::Config("health checks need a tokio runtime".into()))?;
            for b in &inner.backends {
                rt.spawn(health_checks(Arc::downgrade(&inner), b.clone(), h.clone()));
            }
        }
        Ok(Proxy { inner })
    }
}

/// A reverse proxy in front of one or more backends; see the [module](self) docs.
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.inner.backends.iter().map(|b| &*b.name).collect();
        f.debug_struct("Proxy").field("backends", &names).finish()
    }
}

struct Inner {
    backends: Vec<Arc<Backend>>,
    balance: Balance,
    next: AtomicUsize,
    options: Options,
    /// `Via` values for HTTP/0.9, 1.0, 1.1, 2 and 3.
    via_values: [HeaderValue; 5],
    /// WebSocket tunnels open, for their caps.
    tunnels: Arc<websocket::Tunnels>,
}

impl Proxy {
    /// A builder with no upstream yet.
    pub fn builder() -> ProxyBuilder {
        ProxyBuilder {
            upstreams: Vec::new(),
            balance: Balance::default(),
            options: Options {
                connect_timeout: Duration::from_secs(5),
                response_timeout: Duration::from_secs(60),
                max_idle: 128,
                idle_timeout: Duration::from_secs(50),
                max_fails: 1,
                fail_timeout: Duration::from_secs(10),
                max_conns: 1024,
                max_tunnels: 4096,
                max_tunnels_per_address: 512,
                proxies: Vec::new(),
                underscores: false,
            },
            health: None,
            via: "kuai".into(),
            metrics: None,
        }
    }

    /// Forwards `req` and returns the backend's response, or the proxy's 502 or 504.
    pub async fn forward(&self, req: Request<Body>) -> Response<ProxyBody> {
        self.inner.clone().forward(req).await
    }
}

impl tower_service::Service<Request<Body>> for Proxy {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The request's future itself is boxed, not a block awaiting it: that would be as
        // large again, and the forwarding future (kilobytes) moved into it once more.
        Box::pin(Answer {
            forward: self.inner.clone().forward(req),
        })
    }
}

pin_project_lite::pin_project! {
    /// A forwarding future as the service's.
    struct Answer<F> {
        #[pin]
        forward: F,
    }
}

impl<F: Future<Output = Response<ProxyBody>>> Future for Answer<F> {
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().forward.poll(cx).map(Ok)
    }
}

/// The request as it goes upstream, less its body.
struct Head {
    method: Method,
    /// The target in origin form (path and query), as HTTP/1.1 sends it.
    origin: Uri,
    /// The client's authority: `Host` for HTTP/1.1, `:authority` for HTTP/2.
    authority: Option<http::uri::Authority>,
    host: Option<HeaderValue>,
    headers: http::HeaderMap,
    /// Another attempt may need the fields again, so the first gets a copy.
    keep: bool,
    /// The client sent `TE: trailers`: it goes on to an HTTP/2 backend, where it is the one
    /// TE allowed (RFC 9113 §8.2.2) and gRPC servers require it.
    te_trailers: bool,
}

impl Head {
    /// The request for a backend of `protocol`.
    fn request(&mut self, body: UpBody, protocol: UpstreamProtocol) -> Request<UpBody> {
        let headers = if self.keep {
            self.headers.clone()
        } else {
            std::mem::take(&mut self.headers)
        };
        let mut r = Request::new(body);
        *r.method_mut() = self.method.clone();
        *r.headers_mut() = headers;
        self.target(&mut r, protocol);
        r
    }

    /// Points a request (new, or back unsent from another backend) at a backend of
    /// `protocol`: HTTP/1.1 sends the path (origin form) and `Host`; HTTP/2 the absolute
    /// URI's parts as pseudo-header fields, the authority as `:authority` and no `Host`
    /// (RFC 9113 §8.3.1).
    fn target(&mut self, r: &mut Request<UpBody>, protocol: UpstreamProtocol) {
        match protocol {
            UpstreamProtocol::Http1 => {
                *r.uri_mut() = self.origin.clone();
                *r.version_mut() = http::Version::HTTP_11;
                // The value moves when no other attempt needs it (a request back from an
                // HTTP/2 backend brought it back).
                let host = if self.keep {
                    self.host.clone()
                } else {
                    self.host.take()
                };
                if let Some(h) = host {
                    r.headers_mut().insert(header::HOST, h);
                }
                // Hop-by-hop on HTTP/1.1, where it would need a `Connection: te` too.
                r.headers_mut().remove(header::TE);
            }
            UpstreamProtocol::H2c => {
                // Every forwarded request has an authority (`upstream_head`).
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(http::uri::Scheme::HTTP);
                parts.authority = self.authority.clone();
                parts.path_and_query = self.origin.path_and_query().cloned();
                if let Ok(u) = Uri::from_parts(parts) {
                    *r.uri_mut() = u;
                }
                *r.version_mut() = http::Version::HTTP_2;
                if self.te_trailers {
                    r.headers_mut()
                        .insert(header::TE, HeaderValue::from_static("trailers"));
                }
                if let Some(h) = r.headers_mut().remove(header::HOST)
                    && self.host.is_none()
                {
                    self.host = Some(h);
                }
            }
        }
    }
}

/// Most backends one request is tried on.
const MAX_ATTEMPTS: usize = 8;

impl Inner {
    async fn forward(self: Arc<Self>, mut req: Request<Body>) -> Response<ProxyBody> {
        let info = req.extensions().get::<ConnInfo>().copied();
        let early = req.extensions().get::<EarlyData>().is_some();
        let ws = websocket::ask(&mut req).map(|ask| {
            let drain = req.extensions().get::<crate::server::Drain>().cloned();
            let busy = req.extensions().get::<crate::server::Busy>().cloned();
            (ask, drain, busy)
        });
        // A reverse proxy is no tunnel to anywhere: a CONNECT that is not a WebSocket's
        // extended CONNECT (RFC 9220, RFC 8441) is refused here, not sent to a backend
        // whose 2xx would turn the connection into a tunnel (RFC 9110 §9.3.6).
        if ws.is_none() && req.method() == http::Method::CONNECT {
            return local(StatusCode::METHOD_NOT_ALLOWED, "CONNECT is not proxied");
        }
        let (parts, body) = req.into_parts();
        let Some(mut head) = self.upstream_head(parts, info, early) else {
            return local(StatusCode::BAD_REQUEST, "cannot forward this request");
        };
        if let Some((ask, drain, busy)) = ws {
            let client = info.map(|i| i.remote);
            return self.websocket(head, body, ask, drain, busy, client).await;
        }
        let idempotent = head.method.is_idempotent();
        let (up, mut watch) = UpBody::new(body);
        // The body until a backend took the request; a request that comes back unsent
        // brings it back.
        let mut unsent = Some(up);
        let mut returned: Option<Request<UpBody>> = None;
        let mut last: Option<Reason> = None;
        let mut tried = [usize::MAX; MAX_ATTEMPTS];
        for attempt in 0..MAX_ATTEMPTS.min(self.backends.len()) {
            let Some(i) = self.pick(&tried[..attempt]) else {
                break;
            };
            tried[attempt] = i;
            let b = &self.backends[i];
            let protocol = b.upstream.protocol();
            let r = if let Some(mut r) = returned.take() {
                // Back unsent from another backend, fields and body as they were.
                head.target(&mut r, protocol);
                r
            } else if let Some(up) = unsent.take() {
                head.request(up, protocol)
            } else if idempotent && head.keep && watch.ended_empty() {
                // After a failed exchange: only an idempotent request without a body goes
                // again (RFC 9110 §9.2.2).
                let (up, w) = UpBody::new(Body::empty());
                watch = w;
                head.request(up, protocol)
            } else {
                break;
            };
            let outstanding = Outstanding::new(b);
            let start = Instant::now();
            match b.send(r, &self.options).await {
                Ok(resp) => {
                    b.on_success();
                    if let Some(m) = &b.metrics {
                        m.answered(start.elapsed());
                    }
                    return self.downstream(resp, b, start.elapsed(), outstanding);
                }
                Err(Failure::NotSent(back, why)) if why.is_saturation() => {
                    tracing::debug!(
                        target: "kuai_http::proxy", backend = %b.name, reason = %why,
                        "backend busy"
                    );
                    returned = Some(*back);
                    last = Some(why);
                }
                Err(Failure::NotSent(back, why)) => {
                    b.on_failure(&self.options);
                    self.log_failure(b, &why, &head, true);
                    returned = Some(*back);
                    last = Some(why);
                }
                Err(Failure::Sent(why)) => {
                    b.on_failure(&self.options);
                    self.log_failure(b, &why, &head, false);
                    last = Some(why);
                }
                Err(Failure::Client(why)) => {
                    tracing::debug!(
                        target: "kuai_http::proxy", backend = %b.name, method = %head.method,
                        path = head.origin.path(), reason = %why, "request body failed"
                    );
                    if let Reason::ClientBodyTimeout(_) = why {
                        return local(
                            StatusCode::REQUEST_TIMEOUT,
                            "the request body stopped coming",
                        );
                    }
                    if watch.client_too_large() {
                        return local(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "the request body is larger than allowed",
                        );
                    }
                    return local(StatusCode::BAD_REQUEST, "the request body failed");
                }
            }
        }
        match last {
            Some(why) if why.is_saturation() => local(
                StatusCode::SERVICE_UNAVAILABLE,
                "every upstream connection is busy",
            ),
            Some(why) if why.is_timeout() => local(
                StatusCode::GATEWAY_TIMEOUT,
                "the upstream did not answer in time",
            ),
            _ => local(StatusCode::BAD_GATEWAY, "the upstream failed"),
        }
    }

    fn log_failure(&self, b: &Backend, why: &Reason, head: &Head, unsent: bool) {
        if let Some(m) = &b.metrics {
            m.failed(why.kind());
        }
        tracing::warn!(
            target: "kuai_http::proxy", backend = %b.name, method = %head.method,
            path = head.origin.path(), unsent, reason = %why, "upstream request failed"
        );
    }

    /// A backend `fit` for the request, available ones first, in turn.
    fn pick_where(&self, fit: impl Fn(&Backend) -> bool) -> Option<Arc<Backend>> {
        let n = self.backends.len();
        let start = self.next.fetch_add(1, Relaxed) % n;
        let fits = (0..n)
            .map(|k| &self.backends[(start + k) % n])
            .filter(|b| fit(b));
        let mut fallback = None;
        for b in fits {
            if b.is_available() {
                return Some(b.clone());
            }
            fallback.get_or_insert_with(|| b.clone());
        }
        fallback
    }

    /// The backend for the next attempt, of those not `tried`: an available one first
    /// (by the balance), else a resting one, in case every backend rests.
    fn pick(&self, tried: &[usize]) -> Option<usize> {
        let n = self.backends.len();
        let start = self.next.fetch_add(1, Relaxed) % n;
        let mut best: Option<(bool, usize, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            if tried.contains(&i) {
                continue;
            }
            let b = &self.backends[i];
            let load = match self.balance {
                Balance::RoundRobin => 0,
                Balance::LeastOutstanding => b.outstanding.load(Relaxed),
            };
            // Ties keep the round-robin order: the first found stays.
            let key = (!b.is_available(), load, i);
            if best.is_none_or(|(r, l, _)| (key.0, key.1) < (r, l)) {
                best = Some(key);
            }
        }
        best.map(|(_, _, i)| i)
    }

    /// The request head as it goes to a backend (RFC 9110 §7.6): hop-by-hop fields out,
    /// forwarding fields in, the client's authority kept.
    fn upstream_head(
        &self,
        parts: http::request::Parts,
        info: Option<ConnInfo>,
        early: bool,
    ) -> Option<Head> {
        let http::request::Parts {
            method,
            uri,
            mut headers,
            version,
            ..
        } = parts;
        // Only web targets go on (an HTTP/3 request may name another scheme, whose :path
        // need not be an absolute path: "GET * HTTP/1.1" would reach the backend).
        if uri
            .scheme_str()
            .is_some_and(|s| !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("https"))
        {
            return None;
        }
        // Read before the hop-by-hop fields go (a `Connection: host` would take it). More
        // than one Host, or one that is no authority, is refused (RFC 9112 §3.2), and so is
        // an authority with userinfo (RFC 9110 §4.2.4): a backend could read either its own
        // way.
        let mut hosts = headers.get_all(header::HOST).iter();
        let host_field = match (hosts.next(), hosts.next()) {
            (None, _) => None,
            (Some(h), None) => Some(http::uri::Authority::try_from(h.as_bytes()).ok()?),
            (Some(_), Some(_)) => return None,
        };
        // No authority at all (HTTP/1.1 without Host, which RFC 9112 §3.2 answers 400;
        // HTTP/1.0 or HTTP/0.9): not forwarded. A backend would see no Host, or over h2c
        // an authority made up for it, and could take the request for one of its own
        // hosts (an internal one, or "localhost").
        let authority = match uri.authority() {
            Some(a) => a.clone(),
            None => host_field?,
        };
        // An empty host is no authority either (RFC 9110 §4.2.1).
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return None;
        }
        let authority = Some(authority);
        let te_trailers = headers::asks_for_trailers(&headers);
        headers::strip_hop_by_hop(&mut headers);
        if !self.options.underscores {
            headers::strip_underscored(&mut headers);
        }
        // Content-Length as one number: the client's list form ("5, 5") or repeated equal
        // lines, which the server side accepted (RFC 9110 §8.6), would make an HTTP/2
        // backend reset the stream. (An HTTP/1.1 backend gets the gateway's own framing.)
        if let Some(n) = headers::content_length(&headers) {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        // The gateway sends the body as it comes without waiting for a 100 (the client got
        // its own from the gateway's server): a backend told to expect one could answer
        // first and take the body that follows for the next request.
        headers.remove(header::EXPECT);
        let host = match &authority {
            Some(a) => Some(HeaderValue::from_str(a.as_str()).ok()?),
            None => None,
        };
        // Fields a backend may take for the gateway's word, which a client could set: the
        // client's X-Real-IP goes (the gateway sets its own when it knows the address), and
        // so do X-Forwarded-Host and -Port (the Host field and Forwarded's host say where
        // the request was sent). Also when the proxy runs without the connection's facts
        // (a service of the caller's own server): nothing the client made up passes then.
        headers.remove(X_REAL_IP);
        headers.remove(X_FORWARDED_HOST);
        headers.remove(X_FORWARDED_PORT);
        if let Some(info) = info {
            let ip = info.remote.ip().to_canonical();
            if headers
                .get_all(header::FORWARDED)
                .iter()
                .any(|v| !headers::forwarded_is_closed(v.as_bytes()))
            {
                headers.remove(header::FORWARDED);
            }
            let addr = headers::forwarded_for(ip);
            headers::append_list(&mut headers, X_FORWARDED_FOR, addr.clone());
            headers.insert(X_REAL_IP, addr);
            headers::append_list(
                &mut headers,
                header::FORWARDED,
                headers::forwarded_element(ip, authority.as_ref().map(|a| a.as_str())),
            );
        }
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        // The protocol the request came in with: the connection's, which an HTTP/3
        // request's version does not always say.
        let version = match info.map(|i| i.protocol) {
            Some(crate::Protocol::Http3) => http::Version::HTTP_3,
            Some(crate::Protocol::Http2) => http::Version::HTTP_2,
            Some(crate::Protocol::Http11) => http::Version::HTTP_11,
            Some(crate::Protocol::Http09) => http::Version::HTTP_09,
            None => version,
        };
        headers::append_value(&mut headers, header::VIA, self.via(version));
        // RFC 8470 §5.1: the backend learns the request came in early data, and may answer
        // 425.
        if early {
            headers.insert(EARLY_DATA, HeaderValue::from_static("1"));
        }
        let origin = match uri.path_and_query() {
            // The request target as a backend reads it (RFC 9112 §3.2): an absolute path,
            // or `*` for a server-wide OPTIONS. An HTTP/1.1 `GET *` or a `:path` of `?x=1`
            // over HTTP/2 (which the http crate takes, reading its path as "/", where
            // routes matched it) is refused, not passed on for a backend to read its way.
            Some(p)
                if p.as_str().starts_with('/')
                    || (p.as_str() == "*" && method == http::Method::OPTIONS) =>
            {
                Uri::from(p.clone())
            }
            Some(_) => return None,
            None => Uri::from_static("/"),
        };
        // A retry after a failed exchange needs the fields again (see `forward`).
        let keep = method.is_idempotent() && self.backends.len() > 1;
        Some(Head {
            method,
            origin,
            authority,
            host,
            headers,
            keep,
            te_trailers,
        })
    }

    /// `Via` for a message received with `version`, as this proxy names itself.
    fn via(&self, version: http::Version) -> &HeaderValue {
        let i = match version {
            http::Version::HTTP_09 => 0,
            http::Version::HTTP_10 => 1,
            http::Version::HTTP_2 => 3,
            http::Version::HTTP_3 => 4,
            _ => 2,
        };
        &self.via_values[i]
    }

    /// A backend's response as it goes to the client.
    fn downstream(
        &self,
        resp: Response<backend::Received>,
        b: &Arc<Backend>,
        elapsed: Duration,
        outstanding: Outstanding,
    ) -> Response<ProxyBody> {
        let (mut parts, body) = resp.into_parts();
        headers::strip_response_fields(&mut parts.headers);
        headers::append_value(&mut parts.headers, header::VIA, self.via(parts.version));
        parts.version = http::Version::default();
        parts.extensions.insert(UpstreamTiming {
            backend: b.name.clone(),
            elapsed,
        });
        let idle = self.options.response_timeout;
        Response::from_parts(parts, ProxyBody::upstream(body, outstanding, idle))
    }
}

// Built at compile time: `from_static` outside a constant checks the name on every call.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PORT: HeaderName = HeaderName::from_static("x-forwarded-port");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
const EARLY_DATA: HeaderName = HeaderName::from_static("early-data");

/// The proxy's own answer.
fn local(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::local(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Checks `b` every `h.interval` while the proxy lives.
async fn health_checks(proxy: std::sync::Weak<Inner>, b: Arc<Backend>, h: HealthCheck) {
    // A zero period would make the timer panic; a check every millisecond is as often as
    // anything reasonable asks.
    let mut tick = tokio::time::interval(h.interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = proxy.upgrade() else {
            return;
        };
        let mut options = inner.options.clone();
        options.response_timeout = h.timeout;
        options.connect_timeout = options.connect_timeout.min(h.timeout);
        let (Ok(origin), Ok(authority)) = (
            Uri::try_from(h.path.as_str()),
            http::uri::Authority::try_from(b.upstream.authority()),
        ) else {
            tracing::warn!(target: "kuai_http::proxy", path = h.path, "health check path is not a path");
            return;
        };
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::USER_AGENT,
            HeaderValue::from_static("kuai-health-check"),
        );
        let mut head = Head {
            method: Method::GET,
            origin,
            host: HeaderValue::from_str(authority.as_str()).ok(),
            authority: Some(authority),
            headers,
            keep: false,
            te_trailers: false,
        };
        let req = head.request(UpBody::new(Body::empty()).0, b.upstream.protocol());
        drop(inner);
        let ok = match b.send(req, &options).await {
            Ok(resp) => {
                let ok = resp.status().is_success() || resp.status().is_redirection();
                // Read the answer out so the connection goes back to the pool: within the
                // check's time and up to 64 KiB, or the connection is dropped with it.
                let mut body = resp.into_body();
                let read_out = async {
                    let mut left = 64 * 1024usize;
                    while let Some(Ok(f)) = http_body_util::BodyExt::frame(&mut body).await {
                        let n = f.data_ref().map_or(0, |d| d.len());
                        left = left.checked_sub(n)?;
                    }
                    Some(())
                };
                let _ = tokio::time::timeout(h.timeout, read_out).await;
                ok
            }
            // Every connection busy with requests: the backend is working.
            Err(Failure::NotSent(_, why)) if why.is_saturation() => continue,
            Err(_) => false,
        };
        b.set_check(ok);
    }
}
