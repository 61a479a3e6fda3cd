//! The server: one `tower` service answers HTTP/3 (and HTTP/0.9 for interop tests) on a QUIC
//! endpoint and HTTP/2 and HTTP/1.1 on a TCP listener, normally on the same port.
//!
//! ```no_run
//! # async fn run() -> Result<(), kuai_http::Error> {
//! # let (certs, key) = (vec![], rustls::pki_types::PrivateKeyDer::Pkcs8(vec![].into()));
//! use kuai_http::{Listener, Server, ServeDir};
//!
//! let tls = kuai_http::server_tls(certs, key)?;
//! let listener = Listener::bind("[::]:443".parse().unwrap(), tls).await?;
//! Server::new(ServeDir::new("/srv/www")).serve(listener).await
//! # }
//! ```
//!
//! Every response over TCP carries `Alt-Svc: h3=":PORT"; ma=86400` unless the service set
//! one, so browsers move to HTTP/3. Requests carry a [`ConnInfo`] extension (the client's
//! address and the protocol) and, when their head arrived in 0-RTT, [`EarlyData`]: a
//! request in early data may be a replay (RFC 8446 §8), so by default the server answers
//! 425 (Too Early, RFC 8470 §5.2) to one whose method is not idempotent, and the client
//! sends it again after the handshake.
//!
//! [`Handle::shutdown`] stops it gracefully: no new connections, GOAWAY on HTTP/3 and
//! HTTP/2, HTTP/1.1 connections closed after their current response, and whatever is left
//! after [`Limits::drain_timeout`] closed. The proxy's WebSocket tunnels are part of the
//! drain too (after an HTTP/1.1 upgrade they outlive their connection's task).

mod certs;
mod h3;
mod hq;
mod tcp;
#[cfg(test)]
pub(crate) mod tests;

#[cfg(feature = "fuzzing")]
pub use hq::request_path as hq_request_path;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::{Notify, watch};

use crate::{Body, BoxError, Error};

pub use certs::Certificates;
pub use kuai_h3::EarlyData;

/// ALPN of HTTP/3.
pub const ALPN_H3: &[u8] = kuai_h3::ALPN;
/// ALPN of HTTP/0.9 over QUIC, as the QUIC interop runner uses it.
pub const ALPN_HQ: &[u8] = b"hq-interop";
/// ALPN of HTTP/2 over TLS.
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN of HTTP/1.1 over TLS.
pub const ALPN_H1: &[u8] = b"http/1.1";

/// What the server allows a client, so that idle, slow and stalled connections cannot hold
/// its sockets and memory (slowloris and its kin). The defaults follow nginx where it has
/// one.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Limits {
    /// TCP connections held at once, TLS handshakes included. At the cap a new connection
    /// makes room by closing the oldest one with no request in flight (in its handshake,
    /// waiting for or reading a request head, or idle between requests), as nginx reuses its
    /// idle connections; if every connection has a request in flight it is closed at once.
    /// (QUIC connections are bounded by the endpoint.)
    pub max_connections: usize,
    /// TCP connections held at once from one client address (an IPv6 address's /64). At
    /// this cap a new connection from that address closes its oldest one with no request in
    /// flight, or is closed at once, so one address cannot push everyone else's connections
    /// out. Generous by default: many clients can share an address behind a NAT.
    pub max_connections_per_address: usize,
    /// TCP: the TLS handshake must end within this.
    pub handshake_timeout: Duration,
    /// TCP: the first request head must be complete this long after the handshake, a later
    /// HTTP/1.1 head this long after its first byte (nginx's client_header_timeout).
    /// HTTP/3: a request head this long after its stream opened.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed (nginx's
    /// keepalive_timeout); HTTP/2 and HTTP/3 with a GOAWAY.
    pub idle_timeout: Duration,
    /// TCP: a connection that waits on its client this long without progress is closed:
    /// a response the client stopped taking (nginx's send_timeout), or, over HTTP/1.1, a
    /// request body a service reads that stopped coming (nginx's client_body_timeout). The
    /// time a service takes to answer, and a streaming response with nothing to send, do
    /// not count; nor does the request body of an extended CONNECT tunnel. HTTP/2 and
    /// HTTP/3: a request body that stops coming for this long while the service reads it
    /// ends that request alone (its body fails with [`Error::Timeout`](crate::Error)).
    /// HTTP/3 and HTTP/0.9: a response whose next write (or, once all is written, whose
    /// delivery) waits this long has its stream reset with H3_REQUEST_CANCELLED; the
    /// connection's other streams go on.
    pub send_timeout: Duration,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (nginx's http2_max_concurrent_streams).
    /// HTTP/3's bound is QUIC's stream limit, in the endpoint's transport configuration.
    pub h2_max_concurrent_streams: u32,
    /// HTTP/2 PING after this long without a frame from the client; `None`: no pings.
    pub h2_keepalive_interval: Option<Duration>,
    /// A PING unanswered this long closes the connection.
    pub h2_keepalive_timeout: Duration,
    /// Largest request head in bytes: HTTP/1.1 start line and header lines, HTTP/2
    /// SETTINGS_MAX_HEADER_LIST_SIZE, HTTP/3 SETTINGS_MAX_FIELD_SECTION_SIZE (field sizes
    /// + 32 each). Past it, 431 or the stream is reset.
    pub max_header_size: usize,
    /// Most header lines in an HTTP/1.1 request; past it, 431.
    pub max_headers: usize,
    /// Largest request body in bytes; `None`: no limit (the body streams to the service
    /// under flow control, so the server holds little of it whatever its length). A
    /// request declaring more is answered 413; one sending more gets
    /// [`Error::BodyTooLarge`] from its body.
    pub max_request_body: Option<u64>,
    /// After [`Handle::shutdown`], requests in flight have this long to finish.
    pub drain_timeout: Duration,
    /// What the TCP connections of a listener may be granted together, in bytes: HTTP/2
    /// connection windows (request data a client may send before the service reads it,
    /// 1 MiB each) and response buffers (256 KiB each). Past it, new connections get
    /// HTTP/2's default 64 KiB windows and a 64 KiB response buffer, and those already open
    /// keep theirs. It bounds what clients can make the TCP side hold to this plus
    /// `max_connections` small grants. (HTTP/3's bound is the QUIC endpoint's
    /// `MemoryBudget`.)
    pub tcp_memory_budget: u64,
}

impl Limits {
    /// The limits with every timeout at most ten years: "never" written as `Duration::MAX`
    /// would overflow the deadlines made from it.
    fn clamped(mut self) -> Self {
        const NEVER: Duration = Duration::from_secs(10 * 365 * 86_400);
        for d in [
            &mut self.handshake_timeout,
            &mut self.header_timeout,
            &mut self.idle_timeout,
            &mut self.send_timeout,
            &mut self.h2_keepalive_timeout,
            &mut self.drain_timeout,
        ] {
            *d = (*d).min(NEVER);
        }
        if let Some(d) = &mut self.h2_keepalive_interval {
            *d = (*d).min(NEVER);
        }
        self
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_connections_per_address: 512,
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(75),
            send_timeout: Duration::from_secs(60),
            h2_max_concurrent_streams: 128,
            h2_keepalive_interval: Some(Duration::from_secs(30)),
            h2_keepalive_timeout: Duration::from_secs(20),
            max_header_size: 64 * 1024,
            max_headers: 100,
            max_request_body: None,
            drain_timeout: Duration::from_secs(10),
            tcp_memory_budget: 512 << 20,
        }
    }
}

/// The protocol a request came over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Protocol {
    /// HTTP/3 over QUIC.
    Http3,
    /// HTTP/2 over TLS over TCP.
    Http2,
    /// HTTP/1.1 over TLS over TCP.
    Http11,
    /// HTTP/0.9 over QUIC (ALPN `hq-interop`), for the QUIC interop runner.
    Http09,
}

impl Protocol {
    /// Its ALPN name.
    pub fn alpn(self) -> &'static str {
        match self {
            Protocol::Http3 => "h3",
            Protocol::Http2 => "h2",
            Protocol::Http11 => "http/1.1",
            Protocol::Http09 => "hq-interop",
        }
    }
}

/// Facts about the connection a request came on, in the request's extensions.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ConnInfo {
    /// The client's address (for QUIC, where its last packet came from).
    pub remote: SocketAddr,
    /// The protocol.
    pub protocol: Protocol,
}

/// Where a [`Server`] listens: a QUIC endpoint and, beside it, a TCP listener with its TLS
/// configuration.
pub struct Listener {
    endpoint: kuai::Endpoint,
    tcp: Option<(tokio::net::TcpListener, Arc<rustls::ServerConfig>)>,
}

impl Listener {
    /// Listens on `addr` for HTTP/3 over UDP and for HTTP/2 and HTTP/1.1 over TCP on the same
    /// port (with port 0, one port free for both). `tls` is the configuration for both (for
    /// example from [`server_tls`]; its ALPN list is set here); certificates by SNI come
    /// from its certificate resolver.
    pub async fn bind(addr: SocketAddr, tls: rustls::ServerConfig) -> Result<Self, Error> {
        Self::bind_with(addr, tls, kuai::Endpoint::builder()).await
    }

    /// [`bind`](Self::bind) with the QUIC endpoint made from `endpoint` (its subscribers,
    /// workers, qlog directory...); its server configuration is set here, from `tls`.
    pub async fn bind_with(
        addr: SocketAddr,
        tls: rustls::ServerConfig,
        endpoint: kuai::EndpointBuilder,
    ) -> Result<Self, Error> {
        let mut quic_tls = tls.clone();
        quic_tls.alpn_protocols = vec![ALPN_H3.to_vec()];
        let quic = kuai::ServerConfig::from_rustls(quic_tls);
        // With port 0 the UDP port the kernel picks may be taken on TCP: try a few.
        let tries = if addr.port() == 0 { 8 } else { 1 };
        let mut last = None;
        for _ in 0..tries {
            let endpoint = endpoint
                .clone()
                .server(quic.clone())
                .bind(addr)
                .map_err(|source| Error::Bind { addr, source })?;
            let port = endpoint.local_addr()?.port();
            let tcp_addr = SocketAddr::new(addr.ip(), port);
            match tokio::net::TcpListener::bind(tcp_addr).await {
                Ok(l) => return Ok(Self::new(endpoint).with_tcp(l, tls)),
                Err(source) => {
                    endpoint.close(0, b"");
                    last = Some(Error::Bind {
                        addr: tcp_addr,
                        source,
                    });
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::Io(std::io::ErrorKind::AddrInUse.into())))
    }

    /// HTTP/3 on `endpoint` (built with a server configuration whose ALPN list has `h3`,
    /// and `hq-interop` for HTTP/0.9); no TCP.
    pub fn new(endpoint: kuai::Endpoint) -> Self {
        Self {
            endpoint,
            tcp: None,
        }
    }

    /// Also serves HTTP/2 and HTTP/1.1 on `listener`, with `tls` (its ALPN list is set to
    /// `h2`, `http/1.1`).
    pub fn with_tcp(
        mut self,
        listener: tokio::net::TcpListener,
        mut tls: rustls::ServerConfig,
    ) -> Self {
        tls.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_H1.to_vec()];
        self.tcp = Some((listener, Arc::new(tls)));
        self
    }

    /// The QUIC endpoint's address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The TCP listener's address, if there is one.
    pub fn tcp_local_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.tcp.as_ref().map(|(l, _)| l.local_addr())
    }

    /// The QUIC endpoint.
    pub fn endpoint(&self) -> &kuai::Endpoint {
        &self.endpoint
    }
}

/// A TLS 1.3 server configuration presenting `certs` (leaf first) with `key`, with kuai's
/// crypto provider: what [`Listener::bind`] needs.
pub fn server_tls(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<rustls::ServerConfig, Error> {
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    // Resumption and 0-RTT for many clients, not rustls's 256 (see kuai::session).
    tls.session_storage = kuai::session::SessionCache::with_defaults();
    Ok(tls)
}

/// Stops a [`Server`] gracefully (see the module documentation). Clones stop the same
/// server.
#[derive(Clone, Debug)]
pub struct Handle(Arc<watch::Sender<bool>>);

impl Handle {
    /// Begins the graceful shutdown; [`Server::serve`] returns when it is over.
    pub fn shutdown(&self) {
        self.0.send_replace(true);
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_shutting_down(&self) -> bool {
        *self.0.borrow()
    }
}

/// A server of one `tower` service over every protocol. See the module documentation.
pub struct Server<S> {
    service: S,
    limits: Limits,
    alt_svc_max_age: Option<Duration>,
    alt_svc_port: Option<u16>,
    refuse_unsafe_early_data: bool,
    handle: Handle,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

/// Response bodies as the protocol fronts send them.
pub(crate) type ReplyBody = UnsyncBoxBody<Bytes, BoxError>;
type Handler = dyn Fn(Request<Body>) -> Pin<Box<dyn Future<Output = Response<ReplyBody>> + Send>>
    + Send
    + Sync;

impl<S, B> Server<S>
where
    S: tower_service::Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Buf + Send,
    B::Error: Into<BoxError>,
{
    /// A server of `service` with the default [`Limits`].
    pub fn new(service: S) -> Self {
        Self {
            service,
            limits: Limits::default(),
            alt_svc_max_age: Some(Duration::from_secs(86400)),
            alt_svc_port: None,
            refuse_unsafe_early_data: true,
            handle: Handle(Arc::new(watch::channel(false).0)),
            metrics: None,
        }
    }

    /// Sets the limits.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// How long clients may remember the HTTP/3 advertisement (`ma` of Alt-Svc, one day by
    /// default); `None`: no Alt-Svc header.
    pub fn alt_svc_max_age(mut self, max_age: Option<Duration>) -> Self {
        self.alt_svc_max_age = max_age;
        self
    }

    /// The UDP port Alt-Svc names (`None`, the default: the listener's): the port clients
    /// reach HTTP/3 at when it is not the one the server binds, behind a port mapping or a
    /// UDP load balancer (`kuai lb`).
    pub fn alt_svc_port(mut self, port: Option<u16>) -> Self {
        self.alt_svc_port = port;
        self
    }

    /// Whether requests in 0-RTT with a method that is not idempotent are answered 425
    /// (the default) rather than passed to the service, which then must guard against
    /// replays itself (see [`EarlyData`]).
    pub fn refuse_unsafe_early_data(mut self, on: bool) -> Self {
        self.refuse_unsafe_early_data = on;
        self
    }

    /// Counts requests (by protocol and status, and those in flight) in `metrics`; see
    /// [`crate::metrics`].
    pub fn metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// A handle that shuts the server down.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Serves until the endpoint is closed or [`Handle::shutdown`] is called and the
    /// connections are drained.
    pub async fn serve(self, listener: Listener) -> Result<(), Error> {
        let Listener { endpoint, tcp } = listener;
        let shared = self.into_shared(endpoint.local_addr()?.port());
        let tcp = tcp.map(|(l, tls)| {
            let guard = shared.tasks.guard();
            tokio::spawn(tcp::serve(l, tls, shared.clone(), guard))
        });
        let shutdown = shared.shutdown.clone();
        loop {
            tokio::select! {
                c = endpoint.accept() => match c {
                    Some(c) => {
                        let guard = shared.tasks.guard();
                        tokio::spawn(quic_connection(c, shared.clone(), guard));
                    }
                    None => break,
                },
                _ = shared.shutting_down() => break,
            }
        }
        // No new QUIC connections; the TCP accept loop stops on the same signal.
        endpoint.set_server_config(None);
        if !*shutdown.borrow() {
            // The endpoint closed under us: nothing is left to drain over QUIC.
            if let Some(t) = tcp {
                t.abort();
            }
            return Ok(());
        }
        let drain = shared.limits.drain_timeout + Duration::from_secs(1);
        if tokio::time::timeout(drain, shared.tasks.idle())
            .await
            .is_err()
        {
            tracing::info!("connections still open after the drain timeout: closed");
        }
        endpoint.close(kuai_h3::Code::NO_ERROR.0, b"server shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        Ok(())
    }

    /// Serves until `signal` completes, then shuts down gracefully.
    pub async fn serve_with_shutdown(
        self,
        listener: Listener,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        let handle = self.handle();
        let watcher = tokio::spawn(async move {
            signal.await;
            handle.shutdown();
        });
        let r = self.serve(listener).await;
        watcher.abort();
        r
    }

    /// The state the protocol fronts share, for a server whose HTTP/3 port is `port`.
    pub(crate) fn into_shared(self, port: u16) -> Arc<Shared> {
        let port = self.alt_svc_port.unwrap_or(port);
        let alt_svc = self.alt_svc_max_age.and_then(|ma| {
            HeaderValue::from_str(&format!("h3=\":{port}\"; ma={}", ma.as_secs())).ok()
        });
        let service = Mutex::new(self.service);
        let handler: Box<Handler> = Box::new(move |req| {
            let mut svc = service.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let head = req.method() == Method::HEAD;
            Box::pin(async move {
                let r = async {
                    std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
                    svc.call(req).await
                };
                match r.await {
                    Ok(resp) => {
                        // The body a Content-Length promises is checked as it goes (none
                        // is sent after HEAD, 1xx, 204 or 304: RFC 9110 §6.4.1).
                        let s = resp.status();
                        let bodiless = head
                            || s.is_informational()
                            || s == StatusCode::NO_CONTENT
                            || s == StatusCode::NOT_MODIFIED;
                        let left = if bodiless {
                            None
                        } else {
                            resp.headers()
                                .get(header::CONTENT_LENGTH)
                                .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
                                .and_then(|v| v.parse::<u64>().ok())
                        };
                        resp.map(|inner| ToBytes { inner, left }.boxed_unsync())
                    }
                    Err(e) => {
                        let e: BoxError = e.into();
                        tracing::warn!(error = %e, "service failed");
                        local(StatusCode::INTERNAL_SERVER_ERROR)
                    }
                }
            })
        });
        Arc::new(Shared {
            handler,
            limits: self.limits.clamped(),
            alt_svc,
            refuse_unsafe_early_data: self.refuse_unsafe_early_data,
            shutdown: self.handle.0.subscribe(),
            tasks: Arc::new(Tasks::default()),
            metrics: self.metrics,
        })
    }
}

pin_project_lite::pin_project! {
    /// A service's response body with its data as `Bytes` (no copy when it already is) and its
    /// errors boxed; its size hint kept, so HTTP/1.1 and HTTP/2 send a content-length for a body
    /// of known length. A body that ends short of the response's Content-Length, or goes
    /// past it, fails there: every protocol then tells the client the response was cut
    /// (HTTP/3 and HTTP/2 reset the stream, HTTP/1.1 closes the connection), where HTTP/3
    /// and HTTP/2 would have ended the stream as if it were whole.
    struct ToBytes<B> {
        #[pin]
        inner: B,
        // What the Content-Length still promises.
        left: Option<u64>,
    }
}

impl<B> http_body::Body for ToBytes<B>
where
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let f = std::task::ready!(this.inner.poll_frame(cx));
        let Some(left) = this.left else {
            return std::task::Poll::Ready(f.map(|r| {
                r.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                    .map_err(Into::into)
            }));
        };
        std::task::Poll::Ready(match f {
            Some(Ok(frame)) => {
                let frame = frame.map_data(|mut d| d.copy_to_bytes(d.remaining()));
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                if n > *left {
                    *this.left = None;
                    return std::task::Poll::Ready(Some(Err(
                        "response body longer than its Content-Length".into(),
                    )));
                }
                *left -= n;
                Some(Ok(frame))
            }
            Some(Err(e)) => Some(Err(e.into())),
            None if *left > 0 => {
                *this.left = None;
                Some(Err("response body shorter than its Content-Length".into()))
            }
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// One QUIC connection: HTTP/3, or HTTP/0.9 for `hq-interop`.
async fn quic_connection(connecting: kuai::Connecting, shared: Arc<Shared>, _guard: TaskGuard) {
    let remote = connecting.remote_address();
    // Serve at once: a 0-RTT request is answered in 0.5-RTT.
    let conn = match connecting.into_0rtt() {
        Ok((conn, _)) => Ok(conn),
        Err(c) => c.await,
    };
    match conn {
        Ok(conn) if conn.alpn().as_deref() == Some(ALPN_HQ) => hq::serve(conn, &shared).await,
        Ok(conn) => h3::serve(conn, &shared).await,
        // Debug, as over TCP: one Initial from any (spoofed) address can make a handshake
        // fail, so at info a flood would be as many log lines (the metrics count them).
        Err(e) => tracing::debug!(%remote, error = %e, "handshake failed"),
    }
}

/// The `Date` field for now (RFC 9110 §5.6.7), formatted once a second per thread.
pub(crate) fn date_now() -> HeaderValue {
    use std::cell::RefCell;
    thread_local! {
        static DATE: RefCell<(u64, Option<HeaderValue>)> = const { RefCell::new((0, None)) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, value)| {
        if *at != secs || value.is_none() {
            *at = secs;
            *value = HeaderValue::from_str(&httpdate::fmt_http_date(now)).ok();
        }
        value.clone().unwrap_or(HeaderValue::from_static(""))
    })
}

/// What the protocol fronts share: the service, the limits, the shutdown signal.
pub(crate) struct Shared {
    handler: Box<Handler>,
    pub(crate) limits: Limits,
    alt_svc: Option<HeaderValue>,
    refuse_unsafe_early_data: bool,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) tasks: Arc<Tasks>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Shared {
    /// The answer to `req`: the service's, or the server's own when the request may not
    /// reach it (425, 413); with Alt-Svc when it goes over TCP.
    pub(crate) async fn respond(
        &self,
        mut req: Request<Body>,
        info: ConnInfo,
    ) -> Response<ReplyBody> {
        let early = req.extensions().get::<EarlyData>().is_some();
        // RFC 8470 §5.2 and RFC 9110 §9.2.2: a request in early data whose method is not
        // idempotent is not processed; 425 asks the client to send it again after the
        // handshake.
        if early && self.refuse_unsafe_early_data && !req.method().is_idempotent() {
            return local(StatusCode::TOO_EARLY);
        }
        if let Some(limit) = self.limits.max_request_body {
            let declared = req
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > limit) {
                return local(StatusCode::PAYLOAD_TOO_LARGE);
            }
        }
        req.extensions_mut().insert(info);
        if req.method() == Method::CONNECT || req.headers().contains_key(header::UPGRADE) {
            // What answers an upgrade may keep its tunnel beyond the response.
            req.extensions_mut().insert(Drain {
                tasks: self.tasks.clone(),
                shutdown: self.shutdown.clone(),
                timeout: self.limits.drain_timeout,
            });
        }
        let mut resp = (self.handler)(req).await;
        if matches!(info.protocol, Protocol::Http2 | Protocol::Http11)
            && let Some(a) = &self.alt_svc
            && !resp.headers().contains_key(header::ALT_SVC)
        {
            resp.headers_mut().insert(header::ALT_SVC, a.clone());
        }
        resp
    }

    /// Resolves once a graceful shutdown begins.
    pub(crate) async fn shutting_down(&self) {
        shutdown_begun(&self.shutdown).await;
    }
}

/// Resolves once `shutdown` says a graceful shutdown began.
async fn shutdown_begun(shutdown: &watch::Receiver<bool>) {
    let mut rx = shutdown.clone();
    if rx.wait_for(|v| *v).await.is_err() {
        // Every handle is gone: no one can shut the server down any more.
        std::future::pending::<()>().await;
    }
}

/// A response the server makes itself: the status, its reason as a short text body.
fn local(status: StatusCode) -> Response<ReplyBody> {
    let text = format!("{status}\n");
    let mut r = Response::new(
        http_body_util::Full::new(Bytes::from(text))
            .map_err(|e: Infallible| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// What the access log says of a request (target `kuai_http::access`): one line, written by
/// [`AccessLog::write`].
pub(crate) struct AccessLog {
    pub(crate) info: ConnInfo,
    pub(crate) method: Method,
    /// The request's target (its bytes shared with the request's, not copied).
    target: Option<http::uri::PathAndQuery>,
    pub(crate) status: u16,
    pub(crate) bytes: u64,
    pub(crate) start: Instant,
    pub(crate) early: bool,
    /// A proxied request's backend and its time to the response head.
    pub(crate) upstream: Option<crate::proxy::UpstreamTiming>,
    /// Counts the request (in flight now, by status when it ends).
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl AccessLog {
    pub(crate) fn new(
        shared: &Shared,
        info: ConnInfo,
        method: Method,
        uri: &http::Uri,
        early: bool,
    ) -> Self {
        let metrics = shared.metrics.clone();
        if let Some(m) = &metrics {
            m.request_started();
        }
        Self {
            info,
            method,
            target: uri.path_and_query().cloned(),
            status: 0,
            bytes: 0,
            start: Instant::now(),
            early,
            upstream: None,
            metrics,
        }
    }

    /// Takes the status and the upstream timing from the response head.
    pub(crate) fn response<B>(&mut self, resp: &Response<B>) {
        self.status = resp.status().as_u16();
        self.upstream = resp
            .extensions()
            .get::<crate::proxy::UpstreamTiming>()
            .cloned();
    }

    /// The request's path, its first [`LOGGED_PATH`] bytes: a client can put a path of
    /// the whole header limit in the compression table once and name it in a byte per
    /// request, so the log would take 64 KiB for each request of a few bytes.
    pub(crate) fn path(&self) -> &str {
        let p = self.target.as_ref().map_or("/", |t| t.path());
        if p.len() <= LOGGED_PATH {
            return p;
        }
        // A path is ASCII once parsed as a URI; the boundary check keeps this safe anyway.
        let mut end = LOGGED_PATH;
        while !p.is_char_boundary(end) {
            end -= 1;
        }
        &p[..end]
    }

    pub(crate) fn write(&self) {
        let full = self.target.as_ref().map_or(1, |t| t.path().len());
        let path_bytes = (full > LOGGED_PATH).then_some(full);
        let (upstream, upstream_ms) = match &self.upstream {
            Some(u) => (Some(&*u.backend), Some(u.elapsed.as_millis() as u64)),
            None => (None, None),
        };
        tracing::info!(
            target: "kuai_http::access",
            remote = %self.info.remote, proto = self.info.protocol.alpn(), method = %self.method,
            path = self.path(), path_bytes, status = self.status, bytes = self.bytes,
            ms = self.start.elapsed().as_millis() as u64, early_data = self.early,
            upstream, upstream_ms, "request"
        );
    }
}

/// Bytes of a request's path the access log keeps (with `path_bytes`, the whole length,
/// when it was cut).
const LOGGED_PATH: usize = 1024;

impl Drop for AccessLog {
    fn drop(&mut self) {
        if let Some(m) = &self.metrics {
            m.request_ended(self.info.protocol, self.status);
        }
    }
}

/// Connection tasks still running, for the drain.
#[derive(Default)]
pub(crate) struct Tasks {
    count: AtomicUsize,
    idle: Notify,
}

impl Tasks {
    pub(crate) fn guard(self: &Arc<Self>) -> TaskGuard {
        self.count.fetch_add(1, Relaxed);
        TaskGuard(self.clone())
    }

    async fn idle(&self) {
        loop {
            let n = self.idle.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.count.load(Relaxed) == 0 {
                return;
            }
            n.await;
        }
    }
}

/// A running connection task.
pub(crate) struct TaskGuard(Arc<Tasks>);

/// The server's drain, for a task a handler starts that outlives its response (the
/// proxy's WebSocket tunnel after an HTTP/1.1 upgrade, when the connection's own task has
/// ended): an extension of a request that asks to upgrade or CONNECT.
#[derive(Clone)]
pub(crate) struct Drain {
    tasks: Arc<Tasks>,
    shutdown: watch::Receiver<bool>,
    timeout: Duration,
}

impl Drain {
    /// Counts a task in the drain while the guard lives.
    pub(crate) fn join(&self) -> DrainGuard {
        DrainGuard {
            _task: self.tasks.guard(),
            drain: self.clone(),
        }
    }
}

/// A request's place among its connection's requests in flight, for a handler that answers
/// it with a tunnel outliving the response (HTTP/2 extended CONNECT, RFC 8441: hyper drops
/// the response body at once): while a clone lives the connection is not idle, so its idle
/// timeout does not close it under a busy tunnel. An extension of such a request.
#[derive(Clone)]
pub(crate) struct Busy(#[allow(dead_code)] pub(crate) Arc<dyn Send + Sync>);

/// A task the server's drain waits for (see [`Drain`]).
pub(crate) struct DrainGuard {
    _task: TaskGuard,
    drain: Drain,
}

impl DrainGuard {
    /// Resolves when the drain timeout has passed after a shutdown began: the task should
    /// end then, as the connections do.
    pub(crate) async fn over(&self) {
        shutdown_begun(&self.drain.shutdown).await;
        tokio::time::sleep(self.drain.timeout).await;
    }

    /// Resolves when the server begins shutting down.
    pub(crate) async fn begun(&self) {
        shutdown_begun(&self.drain.shutdown).await;
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Relaxed) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Requests of a connection in flight, and since when there have been none: for the idle
/// timeout and the drain of HTTP/3 and HTTP/0.9 connections.
pub(crate) struct InFlight {
    count: AtomicUsize,
    idle_since: Mutex<tokio::time::Instant>,
    changed: Notify,
}

impl InFlight {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            count: AtomicUsize::new(0),
            idle_since: Mutex::new(tokio::time::Instant::now()),
            changed: Notify::new(),
        })
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.count.load(Relaxed) == 0
    }

    pub(crate) fn idle_since(&self) -> tokio::time::Instant {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves when a request begins or ends.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await
    }

    /// Resolves when no request is in flight. (One task per connection waits on
    /// [`changed`](Self::changed) or this, so a wake-up is never lost: `notify_one` keeps it.)
    pub(crate) async fn drained(&self) {
        while !self.is_idle() {
            self.changed().await;
        }
    }
}

/// One request in flight, for as long as it lives.
pub(crate) struct RequestGuard(Arc<InFlight>);

impl RequestGuard {
    pub(crate) fn new(f: &Arc<InFlight>) -> Self {
        f.count.fetch_add(1, Relaxed);
        f.changed.notify_one();
        Self(f.clone())
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = tokio::time::Instant::now();
        self.0.count.fetch_sub(1, Relaxed);
        self.0.changed.notify_one();
    }
}
