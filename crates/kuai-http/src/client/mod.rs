//! The client: one API over HTTP/3, HTTP/2 and HTTP/1.1 that picks the fastest way to each
//! server and remembers what it learned.
//!
//! ```no_run
//! # async fn run() -> Result<(), kuai_http::Error> {
//! let client = kuai_http::Client::new()?;
//! let resp = client.get("https://example.com/").send().await?;
//! println!("{} over {:?}", resp.status(), resp.protocol());
//! let body = resp.bytes().await?;
//! # Ok(()) }
//! ```
//!
//! How it connects (in [`Mode::Auto`], the default): HTTP/3 first, to the port the server
//! advertised with Alt-Svc or else the URL's own; a TCP connection (HTTP/2, or HTTP/1.1 if
//! the server has no HTTP/2) joins the race after 1.5 × the round-trip time last measured
//! to that server, 250 ms when none is known, and never later than QUIC's first Initial
//! retransmission would be, in the manner of draft-ietf-happy-happyeyeballs-v3. When QUIC
//! fails at once (the server's host answers that nothing listens on the UDP port), TCP
//! starts at once. Whichever connects first carries the request. A name with several
//! addresses gets them in turn, IPv6 and IPv4 interleaved (RFC 8305 §4), the one that
//! answered last first: the next address is tried when one fails, or beside it once it has
//! gone 250 ms unanswered (§5), and the first connection wins.
//!
//! What it learns: Alt-Svc advertisements from HTTP/2 and HTTP/1.1 responses (the next
//! connection goes to HTTP/3 there; a TCP connection already open is replaced by HTTP/3
//! for later requests; an advertisement holds on the network it was learnt on unless it
//! says `persist=1`, RFC 7838 §2.2); HTTP/3 that failed where TCP worked is marked broken for that
//! server on that network (the local address and default route) for 5 minutes, doubling
//! to 48 hours, so later connections go straight to TCP; the round-trip time to each
//! server. With [`ClientBuilder::state_file`] this survives the process. Sessions resume
//! and safe requests (GET, HEAD, OPTIONS) go in 0-RTT when a ticket from an earlier connection allows
//! (sessions are kept in memory only).
//!
//! Servers are verified against the system's trust store unless told otherwise.

mod conn;
pub(crate) mod state;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use http_body_util::BodyExt;

use crate::server::{ALPN_H1, ALPN_H2, ALPN_H3, ALPN_HQ};
use crate::{Body, ConnectError, Error, Protocol};
pub use conn::RequestBody;
use conn::{Conn, QuicConn};
use state::{Origin, State};

/// Which protocols the client uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// HTTP/3 raced against TCP (see the module documentation).
    #[default]
    Auto,
    /// HTTP/3 only.
    Http3,
    /// HTTP/2 over TCP only.
    Http2,
    /// HTTP/1.1 over TCP only.
    Http11,
    /// HTTP/0.9 over QUIC (`hq-interop`), for interop tests.
    Http09,
}

/// Builds a [`Client`].
#[must_use]
pub struct ClientBuilder {
    mode: Mode,
    system_roots: bool,
    roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    insecure: bool,
    connect_timeout: Duration,
    race_delay: Option<Duration>,
    state_file: Option<PathBuf>,
    h1_max_connections: usize,
    early_data: bool,
    user_agent: Option<HeaderValue>,
    transport: Option<kuai::TransportConfig>,
    keylog: Option<Arc<dyn rustls::KeyLog>>,
    qlog_dir: Option<PathBuf>,
    resolve: HashMap<Origin, Vec<SocketAddr>>,
    redirects: u32,
    pool_idle: Duration,
    h2_keep_alive: Option<(Duration, Duration)>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            system_roots: true,
            roots: Vec::new(),
            insecure: false,
            connect_timeout: Duration::from_secs(10),
            race_delay: None,
            state_file: None,
            h1_max_connections: 6,
            early_data: true,
            user_agent: Some(HeaderValue::from_static(concat!(
                "kuai/",
                env!("CARGO_PKG_VERSION")
            ))),
            transport: None,
            keylog: None,
            qlog_dir: None,
            resolve: HashMap::new(),
            redirects: 10,
            pool_idle: Duration::from_secs(90),
            h2_keep_alive: Some((Duration::from_secs(20), Duration::from_secs(10))),
        }
    }
}

impl ClientBuilder {
    /// Which protocols to use ([`Mode::Auto`] by default).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Also trusts `cert` (a CA or a server's own certificate).
    pub fn add_root_certificate(
        mut self,
        cert: rustls::pki_types::CertificateDer<'static>,
    ) -> Self {
        self.roots.push(cert);
        self
    }

    /// Whether the system's trust store is used (yes by default).
    pub fn system_roots(mut self, on: bool) -> Self {
        self.system_roots = on;
        self
    }

    /// Accepts any server certificate: no protection against an attacker on the path. Only
    /// for tests.
    pub fn danger_accept_invalid_certs(mut self, on: bool) -> Self {
        self.insecure = on;
        self
    }

    /// How long connecting may take, every protocol tried included (10 s by default).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long HTTP/3 goes alone before TCP joins the race (by default 1.5 × the last RTT
    /// to the server, 250 ms when none is known, at most 1 s).
    pub fn race_delay(mut self, d: Duration) -> Self {
        self.race_delay = Some(d);
        self
    }

    /// Keeps what the client learns (Alt-Svc, broken HTTP/3, RTTs) in this file, and starts
    /// from what it holds.
    pub fn state_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.state_file = Some(path.into());
        self
    }

    /// HTTP/1.1 connections per origin at most (6 by default, as browsers).
    pub fn http1_max_connections(mut self, n: usize) -> Self {
        self.h1_max_connections = n.max(1);
        self
    }

    /// Whether safe requests (GET, HEAD, OPTIONS) go in 0-RTT when a session allows (yes by default).
    pub fn early_data(mut self, on: bool) -> Self {
        self.early_data = on;
        self
    }

    /// The `user-agent` header (`kuai/VERSION` by default; `None`: none).
    pub fn user_agent(mut self, ua: Option<HeaderValue>) -> Self {
        self.user_agent = ua;
        self
    }

    /// QUIC transport settings (congestion control, windows, ...).
    pub fn transport(mut self, t: kuai::TransportConfig) -> Self {
        self.transport = Some(t);
        self
    }

    /// Logs TLS secrets through `keylog` (for Wireshark).
    pub fn keylog(mut self, keylog: Arc<dyn rustls::KeyLog>) -> Self {
        self.keylog = Some(keylog);
        self
    }

    /// Writes a qlog trace of each QUIC connection into `dir`.
    pub fn qlog_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.qlog_dir = Some(dir.into());
        self
    }

    /// Connects to `addr` for `host:port` instead of resolving it (curl's `--resolve`).
    /// Called again for the same `host:port`, adds an address: they are tried in the order
    /// given, each next one when the one before fails or has not answered within 250 ms.
    pub fn resolve(mut self, host: &str, port: u16, addr: SocketAddr) -> Self {
        let addrs = self
            .resolve
            .entry((host.to_ascii_lowercase(), port))
            .or_default();
        if !addrs.contains(&addr) {
            addrs.push(addr);
        }
        self
    }

    /// Follows at most `n` redirects (10 by default; 0: none), to other servers and
    /// protocols too: 303, and 301 or 302 after a POST, go on as GET without the body; 307
    /// and 308 send the request again as it was, when its body is in memory (a streamed
    /// body cannot be sent twice: the redirect is the answer then). A redirect past the
    /// limit, or to a URL that is not `https`, is [`Error::Redirect`].
    pub fn redirects(mut self, n: u32) -> Self {
        self.redirects = n;
        self
    }

    /// How long an origin's connections stay open with no request (90 s, as reqwest's
    /// pool): past it they are closed the next time the client connects anywhere, so a
    /// client that talks to many origins over its life does not hold them all.
    pub fn pool_idle_timeout(mut self, t: Duration) -> Self {
        self.pool_idle = t;
        self
    }

    /// HTTP/2 PINGs every `interval` on each connection, and the connection closed (its
    /// requests failed) when one is not answered within `timeout`: a server or path that
    /// went silently away is found within `interval + timeout` (20 s + 10 s by default),
    /// rather than when TCP gives up many minutes later. `None`: no PINGs. (HTTP/3 has
    /// QUIC's idle timeout and keep-alives instead.)
    pub fn http2_keep_alive(mut self, ping: Option<(Duration, Duration)>) -> Self {
        self.h2_keep_alive = ping;
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, Error> {
        let alpn: &[u8] = if self.mode == Mode::Http09 {
            ALPN_HQ
        } else {
            ALPN_H3
        };
        let mut quic = if self.insecure {
            kuai::ClientConfig::insecure(&[alpn])
        } else {
            let mut roots = rustls::RootCertStore::empty();
            if self.system_roots {
                let found = rustls_native_certs::load_native_certs();
                for e in &found.errors {
                    tracing::debug!(error = %e, "system trust store");
                }
                let (added, _) = roots.add_parsable_certificates(found.certs);
                tracing::debug!(added, "system trust anchors");
            }
            for c in &self.roots {
                roots.add(c.clone())?;
            }
            kuai::ClientConfig::with_roots(roots, &[alpn])
        }
        .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?;
        if let Some(t) = self.transport {
            quic.transport(t);
        }
        let mut tcp_tls = (*quic.proto_tls()).clone();
        tcp_tls.enable_early_data = false;
        if let Some(k) = &self.keylog {
            tcp_tls.key_log = k.clone();
            let mut q = (*quic.proto_tls()).clone();
            q.key_log = k.clone();
            let transport = quic.proto_mut().transport.clone();
            quic = kuai::ClientConfig::from_rustls(q);
            quic.proto_mut().transport = transport;
        }
        Ok(Client {
            inner: Arc::new(Inner {
                mode: self.mode,
                connect_timeout: self.connect_timeout,
                race_delay: self.race_delay,
                h1_max: self.h1_max_connections,
                early_data: self.early_data,
                user_agent: self.user_agent,
                quic,
                tcp_tls: Arc::new(tcp_tls),
                qlog_dir: self.qlog_dir,
                endpoints: Mutex::new([None, None]),
                slots: Mutex::new(HashMap::new()),
                state: Mutex::new(State::load(self.state_file.as_deref())),
                resolve: self.resolve,
                redirects: self.redirects,
                insecure: self.insecure,
                pool_idle: self.pool_idle,
                h2_keep_alive: self.h2_keep_alive,
                swept: Mutex::new(Instant::now()),
            }),
        })
    }
}

/// An HTTP client over HTTP/3, HTTP/2 and HTTP/1.1 with a connection pool per origin.
/// Cheap to clone: clones share the pool and what was learned.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    mode: Mode,
    connect_timeout: Duration,
    race_delay: Option<Duration>,
    h1_max: usize,
    early_data: bool,
    user_agent: Option<HeaderValue>,
    quic: kuai::ClientConfig,
    tcp_tls: Arc<rustls::ClientConfig>,
    qlog_dir: Option<PathBuf>,
    /// QUIC endpoints, IPv4 and IPv6, made on first use.
    endpoints: Mutex<[Option<kuai::Endpoint>; 2]>,
    slots: Mutex<HashMap<Origin, Arc<tokio::sync::Mutex<Slot>>>>,
    state: Mutex<State>,
    resolve: HashMap<Origin, Vec<SocketAddr>>,
    redirects: u32,
    /// Certificates are not checked (`danger_accept_invalid_certs`).
    insecure: bool,
    /// See [`ClientBuilder::pool_idle_timeout`].
    pool_idle: Duration,
    /// See [`ClientBuilder::http2_keep_alive`].
    h2_keep_alive: Option<(Duration, Duration)>,
    /// When idle origins were last closed.
    swept: Mutex<Instant>,
}

/// HTTP/3 being set up beside a TCP connection: resolves to whether it came up. Requests
/// wait for it until `until` at most (those that come while the one that started it waits,
/// as a page's first requests do), later ones go over TCP at once.
#[derive(Clone)]
struct Upgrade {
    rx: tokio::sync::watch::Receiver<Option<bool>>,
    until: tokio::time::Instant,
}

/// The connections to one origin.
#[derive(Default)]
struct Slot {
    h3: Option<Arc<Conn>>,
    tcp: Option<Arc<Conn>>,
    /// When a request last asked for a connection here.
    last_used: Option<Instant>,
    /// HTTP/3 being set up beside a TCP connection (after an Alt-Svc, or a lost race):
    /// `Some(true)` once it is in `h3`.
    upgrade: Option<Upgrade>,
}

/// When each step of a request was done, from the moment it was sent for.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct Timings {
    /// Name resolution (zero on a connection already open, or with `resolve`).
    pub dns: Duration,
    /// The connection was up: the QUIC handshake, or TCP's and then TLS's.
    pub connect: Duration,
    /// TCP only: the TCP connection (TLS took `connect - tcp`).
    pub tcp: Option<Duration>,
    /// The response head arrived.
    pub first_byte: Duration,
    /// The body was read to its end (once it has been).
    pub total: Option<Duration>,
    /// The request went on a connection already open.
    pub reused: bool,
}

/// A response: its head, a body that streams, how it came and when.
pub struct Response {
    head: http::response::Parts,
    body: Body,
    protocol: Protocol,
    remote: SocketAddr,
    conn: Arc<Conn>,
    timings: Timings,
    start: Instant,
    url: Uri,
    redirects: u32,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response")
            .field("url", &self.url)
            .field("status", &self.head.status)
            .field("protocol", &self.protocol)
            .field("remote", &self.remote)
            .finish()
    }
}

/// Facts about the connection a response came on.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// The protocol.
    pub protocol: Protocol,
    /// The server's address.
    pub remote: SocketAddr,
    /// The TLS cipher suite.
    pub cipher_suite: Option<String>,
    /// The TLS session was resumed.
    pub resumed: bool,
    /// QUIC only: requests went in 0-RTT, and whether the server took them (`None`: none
    /// did, or the handshake is not over).
    pub early_data: Option<bool>,
    /// QUIC only: the connection's statistics now.
    pub quic: Option<kuai::ConnectionStats>,
}

impl Response {
    /// The status.
    pub fn status(&self) -> StatusCode {
        self.head.status
    }

    /// The header fields.
    pub fn headers(&self) -> &HeaderMap {
        &self.head.headers
    }

    /// The HTTP version.
    pub fn version(&self) -> Version {
        self.head.version
    }

    /// The protocol it came over.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The server's address.
    pub fn remote_addr(&self) -> SocketAddr {
        self.remote
    }

    /// The URL it answers (after redirects).
    pub fn url(&self) -> &Uri {
        &self.url
    }

    /// Redirects followed to get it.
    pub fn redirects(&self) -> u32 {
        self.redirects
    }

    /// When each step was done (`total` once the body has been read).
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Facts about the connection, and its QUIC statistics now.
    pub fn connection(&self) -> ConnectionInfo {
        let tls = self.conn.tls_info();
        let (early_data, quic) = match &*self.conn {
            Conn::Quic(q) => {
                let st = q.quic.stats();
                let early = st.zero_rtt_attempted.then_some(st.zero_rtt_accepted);
                (early, Some(st))
            }
            _ => (None, None),
        };
        ConnectionInfo {
            protocol: self.protocol,
            remote: self.remote,
            cipher_suite: tls.cipher_suite,
            resumed: tls.resumed,
            early_data,
            quic,
        }
    }

    /// The next piece of the body; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, Error> {
        loop {
            match self.body.frame().await {
                None => {
                    if self.timings.total.is_none() {
                        self.timings.total = Some(self.start.elapsed());
                    }
                    return Ok(None);
                }
                Some(Err(e)) => return Err(e),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data()
                        && !d.is_empty()
                    {
                        return Ok(Some(d));
                    }
                }
            }
        }
    }

    /// The whole body.
    pub async fn bytes(mut self) -> Result<Bytes, Error> {
        let mut out = BytesMut::new();
        while let Some(c) = self.chunk().await? {
            if out.is_empty() && self.body_is_done() {
                return Ok(c);
            }
            out.extend_from_slice(&c);
        }
        Ok(out.freeze())
    }

    fn body_is_done(&self) -> bool {
        http_body::Body::is_end_stream(&self.body)
    }

    /// The whole body as text (invalid UTF-8 replaced).
    pub async fn text(self) -> Result<String, Error> {
        let b = self.bytes().await?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// The response as an `http::Response` with a streaming body.
    pub fn into_http(self) -> http::Response<Body> {
        http::Response::from_parts(self.head, self.body)
    }
}

/// A request being built; [`send`](Self::send) sends it.
#[must_use]
pub struct RequestBuilder {
    client: Client,
    req: Result<Request<RequestBody>, Error>,
}

impl RequestBuilder {
    /// Adds a header field.
    pub fn header<K, V>(mut self, name: K, value: V) -> Self
    where
        HeaderName: TryFrom<K>,
        HeaderValue: TryFrom<V>,
    {
        if let Ok(req) = &mut self.req {
            match (HeaderName::try_from(name), HeaderValue::try_from(value)) {
                (Ok(n), Ok(v)) => {
                    req.headers_mut().append(n, v);
                }
                _ => {
                    self.req = Err(Error::InvalidUrl {
                        url: req.uri().to_string(),
                        reason: "invalid header field",
                    })
                }
            }
        }
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<RequestBody>) -> Self {
        if let Ok(req) = &mut self.req {
            *req.body_mut() = body.into();
        }
        self
    }

    /// Sends the request; the response once its head arrived.
    pub async fn send(self) -> Result<Response, Error> {
        self.client.execute(self.req?).await
    }
}

impl Client {
    /// A client with the defaults: [`Mode::Auto`], the system's trust store, no state file.
    pub fn new() -> Result<Self, Error> {
        Self::builder().build()
    }

    /// Builds a client with other settings.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// A GET request for `url`.
    pub fn get(&self, url: &str) -> RequestBuilder {
        self.request(Method::GET, url)
    }

    /// A request with `method` for `url`.
    pub fn request(&self, method: Method, url: &str) -> RequestBuilder {
        let req = url
            .parse::<Uri>()
            .map_err(|_| Error::InvalidUrl {
                url: url.to_string(),
                reason: "not a URL",
            })
            .map(|uri| {
                let mut r = Request::new(RequestBody::empty());
                *r.method_mut() = method;
                *r.uri_mut() = uri;
                r
            });
        RequestBuilder {
            client: self.clone(),
            req,
        }
    }

    /// Closes every connection (the next request opens new ones; sessions stay for
    /// resumption and 0-RTT), and writes a change to the state file that waits (changes
    /// are written at most once a second, and when the client goes).
    pub fn close_connections(&self) {
        lock(&self.inner.state).flush();
        let slots = std::mem::take(&mut *lock(&self.inner.slots));
        for s in slots.into_values() {
            if let Ok(s) = s.try_lock() {
                for c in [&s.h3, &s.tcp].into_iter().flatten() {
                    if let Conn::Quic(q) = &**c {
                        q.quic.close(0, b"done");
                    }
                }
            }
        }
    }

    /// Waits a little (a few round trips, 300 ms at most) for the session tickets of open
    /// QUIC connections, so that a short exchange leaves the next connection something to
    /// resume with.
    pub async fn await_session_tickets(&self) {
        let conns: Vec<Arc<Conn>> = {
            let slots = lock(&self.inner.slots);
            slots
                .values()
                .filter_map(|s| s.try_lock().ok().and_then(|s| s.h3.clone()))
                .collect()
        };
        for c in conns {
            if let Conn::Quic(q) = &*c {
                let bound = (q.quic.stats().path.rtt * 3)
                    .clamp(Duration::from_millis(20), Duration::from_millis(300));
                let _ = tokio::time::timeout(bound, q.quic.session_ticket()).await;
            }
        }
    }

    /// Sends `req` (its URI absolute, `https`), following redirects as the client was built
    /// to.
    pub async fn execute(&self, req: Request<RequestBody>) -> Result<Response, Error> {
        let start = Instant::now();
        let mut req = req;
        let mut redirects = 0;
        loop {
            let next = (redirects < self.inner.redirects)
                .then(|| req.try_clone_for_redirect())
                .flatten();
            let limited = self.inner.redirects > 0 && redirects == self.inner.redirects;
            let mut resp = self.execute_once(req, start).await?;
            resp.redirects = redirects;
            let status = resp.status();
            let location = resp
                .headers()
                .get(header::LOCATION)
                .and_then(|l| l.to_str().ok())
                // The redirect codes of RFC 9110 §15.4; not 304, nor 300 (a choice for the
                // user), 305 and 306 (deprecated and unused: curl and browsers do not follow
                // them) or codes no RFC defines.
                .filter(|_| matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308));
            let Some((method, headers, body)) = next else {
                // One more to follow, past the limit: a loop, most likely (as curl's
                // --max-redirs, an error rather than the redirect as the answer).
                if let Some(location) = location.filter(|_| limited) {
                    return Err(Error::Redirect {
                        location: location.to_owned(),
                        reason: "too many redirects",
                    });
                }
                return Ok(resp);
            };
            let Some(location) = location else {
                return Ok(resp);
            };
            // A target the client cannot fetch (not https: no downgrade; not a URL) is
            // an error, as with `curl --proto-redir https`.
            let url = match join(resp.url(), location) {
                Ok(u) if u.scheme_str() == Some("https") => u,
                Ok(_) => {
                    return Err(Error::Redirect {
                        location: location.to_owned(),
                        reason: "not https",
                    });
                }
                Err(_) => {
                    return Err(Error::Redirect {
                        location: location.to_owned(),
                        reason: "not a URL",
                    });
                }
            };
            // RFC 9110 §15.4: 303 (and, as browsers do, 301 and 302 after a POST) go on as
            // GET without a body; 307 and 308 repeat the request.
            let as_get = status == StatusCode::SEE_OTHER
                || (method == Method::POST && matches!(status.as_u16(), 301 | 302));
            let mut r = Request::new(if as_get {
                RequestBody::empty()
            } else {
                match body {
                    Some(b) => b,
                    // A streamed body cannot go again: the redirect is the answer.
                    None => return Ok(resp),
                }
            });
            *r.method_mut() = if as_get && method != Method::HEAD {
                Method::GET
            } else {
                method
            };
            *r.uri_mut() = url;
            *r.headers_mut() = headers;
            if as_get {
                for h in [
                    header::CONTENT_LENGTH,
                    header::CONTENT_TYPE,
                    header::TRANSFER_ENCODING,
                ] {
                    r.headers_mut().remove(h);
                }
            }
            // Credentials stay with the origin they were meant for, and so does a Host
            // the caller set (the next origin's own authority goes instead, as curl does).
            // The client speaks to no proxy, so a Proxy-Authorization the caller set is a
            // credential of the origin too.
            if origin_of(r.uri()).ok() != origin_of(resp.url()).ok() {
                for h in [
                    header::AUTHORIZATION,
                    header::PROXY_AUTHORIZATION,
                    header::COOKIE,
                    header::HOST,
                ] {
                    r.headers_mut().remove(h);
                }
            }
            drop(resp);
            redirects += 1;
            req = r;
        }
    }

    /// Closes the connections of origins that had no request for the pool's idle timeout
    /// and none in flight (a response being read holds its connection), looked at most
    /// every third of that timeout.
    fn close_idle_origins(&self) {
        let idle = self.inner.pool_idle;
        let now = Instant::now();
        {
            let mut swept = lock(&self.inner.swept);
            if now.duration_since(*swept) < idle / 3 {
                return;
            }
            *swept = now;
        }
        let unused = |c: &Option<Arc<Conn>>| c.as_ref().is_none_or(|c| Arc::strong_count(c) == 1);
        lock(&self.inner.slots).retain(|_, slot| {
            if Arc::strong_count(slot) > 1 {
                return true;
            }
            let Ok(s) = slot.try_lock() else { return true };
            let quiet = s.last_used.is_none_or(|t| now.duration_since(t) >= idle);
            !(quiet && s.upgrade.is_none() && unused(&s.h3) && unused(&s.tcp))
        });
    }

    /// The HTTP/3 alternative learned for `origin`. For a name pinned to addresses
    /// (`ClientBuilder::resolve`) only one on the same host: an advertisement from a test
    /// server must not steer the pinned name to another host, nor outlive the pin for it.
    ///
    /// Nor one that moves a server on an unprivileged port to a privileged one (RFC 7838
    /// §9.1 worries about the reverse as well, but a move to a system port is what would let
    /// a page's server aim its visitors' QUIC packets at other services of a host: Chromium
    /// refuses the same).
    ///
    /// `network`: the network the connection would go out on ([`state::network_id`]), or
    /// `None` beside an open TCP connection to the origin (on the network it was made on).
    fn alternative(&self, origin: &Origin, network: Option<&str>) -> Option<state::AltSvc> {
        let alt = lock(&self.inner.state).alt_svc(origin, network)?;
        let other_host = !alt.host.is_empty() && !alt.host.eq_ignore_ascii_case(&origin.0);
        if other_host && self.inner.resolve.contains_key(origin) {
            return None;
        }
        if origin.1 >= 1024 && alt.port < 1024 {
            return None;
        }
        Some(alt)
    }

    async fn execute_once(
        &self,
        mut req: Request<RequestBody>,
        start: Instant,
    ) -> Result<Response, Error> {
        let uri = req.uri().clone();
        let origin = origin_of(&uri)?;
        if let Some(ua) = &self.inner.user_agent
            && !req.headers().contains_key(header::USER_AGENT)
        {
            req.headers_mut().insert(header::USER_AGENT, ua.clone());
        }
        let (conn, mut timings) = self.connection(&origin, start).await?;
        let again = req.try_clone_for_retry();
        // A request the server refused unprocessed may go again whatever its method.
        let unsent = match again {
            None => req.try_clone_unprocessed(),
            Some(_) => None,
        };
        let resp = match conn.send(req).await {
            Ok(r) => r,
            // The server took none of it: refused after its GOAWAY (RFC 9114 §5.2), or
            // H3_REQUEST_REJECTED (§8.1). Once more on a new connection.
            Err(e) if e.is_unprocessed() && (again.is_some() || unsent.is_some()) => {
                tracing::debug!(error = %e, "refused unprocessed: the request goes on a new connection");
                self.forget(&origin, &conn);
                let (c, t) = self.connection(&origin, start).await?;
                timings = t;
                let req = again.or(unsent).expect("checked");
                let resp = c.send(req).await?;
                return Ok(self.response(resp, c, timings, start, uri, &origin));
            }
            // The connection went away before this request was taken (closed, GOAWAY), or
            // a kept-alive HTTP/1.1 connection closed as the request went out: once more
            // on a new one, when the request can be sent again (idempotent, its body
            // replayable).
            Err(e) if again.is_some() && (!conn.is_usable() || matches!(e, Error::Stale(_))) => {
                tracing::debug!(error = %e, "connection gone: the request goes on a new one");
                self.forget(&origin, &conn);
                let (c, t) = self.connection(&origin, start).await?;
                timings = t;
                let resp = c.send(again.expect("checked")).await?;
                return Ok(self.response(resp, c, timings, start, uri, &origin));
            }
            Err(e) => return Err(e),
        };
        Ok(self.response(resp, conn, timings, start, uri, &origin))
    }

    fn response(
        &self,
        resp: http::Response<Body>,
        conn: Arc<Conn>,
        mut timings: Timings,
        start: Instant,
        url: Uri,
        origin: &Origin,
    ) -> Response {
        timings.first_byte = start.elapsed();
        let protocol = conn.protocol();
        // Alt-Svc is learned only from a server whose certificate was checked (it is kept
        // on disk), and for a name pinned to addresses only on the same host (see
        // `alternative`); over HTTP/3 as well, where a `clear` or `ma=0` must end what an
        // alternative's own responses say is gone.
        if !self.inner.insecure
            && let Some(v) = resp.headers().get(header::ALT_SVC)
            && let Ok(v) = v.to_str()
        {
            let network = state::network_id(conn.remote());
            lock(&self.inner.state).learn_alt_svc(origin, v, &network);
        }
        if let Conn::Quic(q) = &*conn {
            let rtt = q.quic.stats().path.rtt;
            lock(&self.inner.state).remember_rtt(q.quic.remote_address(), rtt);
        }
        let (head, body) = resp.into_parts();
        Response {
            head,
            body,
            protocol,
            remote: conn.remote(),
            conn,
            timings,
            start,
            url,
            redirects: 0,
        }
    }

    fn forget(&self, origin: &Origin, conn: &Arc<Conn>) {
        let slot = lock(&self.inner.slots).get(origin).cloned();
        if let Some(slot) = slot
            && let Ok(mut s) = slot.try_lock()
        {
            if s.h3.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                s.h3 = None;
            }
            if s.tcp.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                s.tcp = None;
            }
        }
    }

    /// A connection to `origin`: one already open, or a new one.
    async fn connection(
        &self,
        origin: &Origin,
        start: Instant,
    ) -> Result<(Arc<Conn>, Timings), Error> {
        self.close_idle_origins();
        let slot = lock(&self.inner.slots)
            .entry(origin.clone())
            .or_default()
            .clone();
        let mut s = slot.lock().await;
        s.last_used = Some(Instant::now());
        let reused = Timings {
            reused: true,
            ..Timings::default()
        };
        if let Some(c) = s.h3.as_ref().filter(|c| c.is_usable()) {
            return Ok((c.clone(), reused));
        }
        s.h3 = None;
        if s.tcp.as_ref().is_some_and(|c| c.is_usable()) {
            let advertised = if self.inner.mode == Mode::Auto {
                self.alternative(origin, None)
            } else {
                None
            };
            // HTTP/3 on its way beside it: wait for it a little, as long as the request
            // that started it does.
            if let Some(Upgrade { mut rx, until }) = s.upgrade.clone() {
                if tokio::time::Instant::now() < until {
                    drop(s);
                    let _ = tokio::time::timeout_at(until, rx.wait_for(Option::is_some)).await;
                    s = slot.lock().await;
                    if let Some(c) = s.h3.as_ref().filter(|c| c.is_usable()) {
                        return Ok((c.clone(), reused));
                    }
                }
            } else if let Some(alt) = advertised {
                // The server advertised HTTP/3 over the TCP connection: set it up for the
                // next requests.
                let (tx, rx) = tokio::sync::watch::channel(None);
                let remote = s.tcp.as_ref().map(|c| c.remote());
                let wait = self.race_delay_for(remote);
                s.upgrade = Some(Upgrade {
                    rx: rx.clone(),
                    until: tokio::time::Instant::now() + wait,
                });
                let this = self.clone();
                let origin = origin.clone();
                let slot2 = slot.clone();
                tokio::spawn(async move {
                    let r = this.upgrade(&origin, alt, remote).await;
                    let ok = r.is_some();
                    let mut s = slot2.lock().await;
                    if let Some(c) = r {
                        s.h3 = Some(c);
                    }
                    s.upgrade = None;
                    let _ = tx.send(Some(ok));
                });
                drop(s);
                let mut rx = rx;
                let _ = tokio::time::timeout(wait, rx.wait_for(Option::is_some)).await;
                s = slot.lock().await;
                if let Some(c) = s.h3.as_ref().filter(|c| c.is_usable()) {
                    return Ok((c.clone(), reused));
                }
            }
            if let Some(c) = s.tcp.as_ref().filter(|c| c.is_usable()) {
                return Ok((c.clone(), reused));
            }
        }
        s.tcp = None;
        let (conn, timings, upgrade) = tokio::time::timeout(
            self.inner.connect_timeout,
            self.connect(origin, start, &slot),
        )
        .await
        .map_err(|_| Error::Timeout {
            what: "connecting",
            after: self.inner.connect_timeout,
        })??;
        match conn.protocol() {
            Protocol::Http3 | Protocol::Http09 => s.h3 = Some(conn.clone()),
            _ => s.tcp = Some(conn.clone()),
        }
        if upgrade.is_some() {
            s.upgrade = upgrade;
        }
        Ok((conn, timings))
    }

    /// HTTP/3 to `alt` beside an open TCP connection; marks it broken when it fails.
    async fn upgrade(
        &self,
        origin: &Origin,
        alt: state::AltSvc,
        tcp_remote: Option<SocketAddr>,
    ) -> Option<Arc<Conn>> {
        let host = if alt.host.is_empty() {
            &origin.0
        } else {
            &alt.host
        };
        // Checked before any lookup: a broken mark saves the alternative's DNS query too.
        let known = tcp_remote.map(state::network_id);
        if let Some(n) = &known
            && lock(&self.inner.state).is_broken(origin, n)
        {
            return None;
        }
        let addr = match tcp_remote {
            Some(a) if alt.host.is_empty() => SocketAddr::new(a.ip(), alt.port),
            _ => match self.resolve(host, alt.port).await {
                Ok(a) => a,
                Err(e) => {
                    // Marked like any other failure: not looked up again per request.
                    tracing::info!(origin = %origin.0, alternative = %host, error = %e, "HTTP/3 alternative not found: marked broken");
                    if let Some(n) = &known {
                        lock(&self.inner.state).mark_broken(origin, n);
                    }
                    return None;
                }
            },
        };
        if let Some(tcp) = tcp_remote
            && !alternative_in_scope(tcp, addr)
        {
            // Marked too, so that it is not looked up again per request.
            if let Some(n) = &known {
                lock(&self.inner.state).mark_broken(origin, n);
            }
            return None;
        }
        let network = known.unwrap_or_else(|| state::network_id(addr));
        if lock(&self.inner.state).is_broken(origin, &network) {
            return None;
        }
        let r = tokio::time::timeout(
            self.inner.connect_timeout,
            self.connect_quic(addr, &origin.0, false, None),
        )
        .await;
        match r {
            Ok(Ok(c)) => {
                lock(&self.inner.state).mark_working(origin, &network, addr);
                Some(Arc::new(c))
            }
            _ => {
                tracing::info!(origin = %origin.0, %addr, "HTTP/3 advertised but not reachable: marked broken");
                lock(&self.inner.state).mark_broken(origin, &network);
                None
            }
        }
    }

    async fn resolve(&self, host: &str, port: u16) -> Result<SocketAddr, Error> {
        Ok(self.resolve_all(host, port).await?[0])
    }

    /// `host`'s addresses, never none: the resolver's order with the two families
    /// interleaved, the resolver's first family first (RFC 8305 §4).
    async fn resolve_all(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Error> {
        if let Some(a) = self.inner.resolve.get(&(host.to_ascii_lowercase(), port)) {
            return Ok(a.clone());
        }
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            return Ok(vec![SocketAddr::new(ip, port)]);
        }
        let addrs = tokio::net::lookup_host((bare, port))
            .await
            .map_err(|source| Error::Resolve {
                host: host.to_string(),
                source,
            })?;
        let addrs = interleave_families(addrs.collect());
        if addrs.is_empty() {
            return Err(Error::Resolve {
                host: host.to_string(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        Ok(addrs)
    }

    /// How long HTTP/3 goes alone before TCP joins: 1.5 × the RTT last seen to `addr` but
    /// not under 100 ms (RFC 8305 §5 and §8's Minimum Connection Attempt Delay: on a fast
    /// path a fraction of a millisecond would start TCP at every scheduling hiccup), or
    /// 250 ms; at most 1 s (a first Initial is sent again after 3 × 333 ms, RFC 9002 §6.2.2).
    fn race_delay_for(&self, addr: Option<SocketAddr>) -> Duration {
        if let Some(d) = self.inner.race_delay {
            return d;
        }
        let rtt = addr.and_then(|a| lock(&self.inner.state).rtt(a));
        rtt.map_or(Duration::from_millis(250), |r| {
            (r * 3 / 2).max(MIN_RACE_DELAY)
        })
        .min(Duration::from_secs(1))
    }

    fn endpoint(&self, addr: SocketAddr) -> Result<kuai::Endpoint, Error> {
        let mut eps = lock(&self.inner.endpoints);
        let i = usize::from(addr.is_ipv6());
        if let Some(ep) = &eps[i] {
            return Ok(ep.clone());
        }
        let any: SocketAddr = if addr.is_ipv6() {
            "[::]:0".parse().expect("address")
        } else {
            "0.0.0.0:0".parse().expect("address")
        };
        let mut b = kuai::Endpoint::builder();
        if let Some(d) = &self.inner.qlog_dir {
            b = b.qlog_dir(d);
        }
        let ep = b
            .bind(any)
            .map_err(|source| Error::Bind { addr: any, source })?;
        eps[i] = Some(ep.clone());
        Ok(ep)
    }

    /// A QUIC connection to `addr` for `host`. In 0-RTT (when a session allows) only with
    /// `early`: a session is looked up by server name, so one from another server of the same
    /// name would make a "connection" to an address where nothing may listen, and win the
    /// race against TCP with nothing behind it.
    /// A QUIC connection to `addr`; `heard` is set once any datagram came back during
    /// the handshake (a race that TCP won tells a silent UDP path from a slow one by it).
    async fn connect_quic(
        &self,
        addr: SocketAddr,
        host: &str,
        early: bool,
        heard: Option<Arc<AtomicBool>>,
    ) -> Result<Conn, Error> {
        let ep = self.endpoint(addr)?;
        let connecting = ep
            .connect_with(self.inner.quic.clone(), addr, host)
            .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?;
        let http09 = self.inner.mode == Mode::Http09;
        let (quic, accepted) = if self.inner.early_data && early {
            match connecting.into_0rtt() {
                Ok((c, a)) => (c, Some(a)),
                Err(c) => (c.await.map_err(Error::Quic)?, None),
            }
        } else if let Some(heard) = heard {
            (handshake_noting_answers(connecting, &heard).await?, None)
        } else {
            (connecting.await.map_err(Error::Quic)?, None)
        };
        Ok(Conn::Quic(QuicConn::new(quic, accepted, http09).await?))
    }

    async fn connect_tcp(&self, addr: SocketAddr, host: &str) -> Result<Conn, Error> {
        let alpn: &[&[u8]] = match self.inner.mode {
            Mode::Http2 => &[ALPN_H2],
            Mode::Http11 => &[ALPN_H1],
            _ => &[ALPN_H2, ALPN_H1],
        };
        conn::connect_tcp(
            addr,
            host,
            &self.inner.tcp_tls,
            alpn,
            self.inner.h1_max,
            self.inner.connect_timeout,
            self.inner.h2_keep_alive,
        )
        .await
    }

    /// A new connection to `origin`, to each of its addresses in turn in the manner of
    /// Happy Eyeballs (RFC 8305 §5, draft-ietf-happy-happyeyeballs-v3 §6): the next address
    /// is tried when the one before failed, or beside it once it has gone
    /// [`ATTEMPT_DELAY`] without an answer; the first connection wins and the other
    /// attempts are dropped. `localhost` that resolves to `::1` before `127.0.0.1` reaches a
    /// server that listens on IPv4 only, as curl does.
    async fn connect(
        &self,
        origin: &Origin,
        start: Instant,
        slot: &Arc<tokio::sync::Mutex<Slot>>,
    ) -> Result<(Arc<Conn>, Timings, Option<Upgrade>), Error> {
        let mut addrs = self.resolve_all(&origin.0, origin.1).await?;
        let dns = start.elapsed();
        if let [addr] = addrs[..] {
            return self.connect_addr(origin, addr, start, dns, slot).await;
        }
        // The address that answered last goes first (draft-ietf-happy-happyeyeballs-v3 §4
        // sorts by what the client has seen work).
        if let Some(i) = lock(&self.inner.state)
            .answered(origin)
            .and_then(|a| addrs.iter().position(|&b| b == a))
        {
            addrs[..=i].rotate_right(1);
        }
        let mut attempts = tokio::task::JoinSet::new();
        let mut next = addrs.into_iter();
        let mut last_err = None;
        loop {
            if let Some(addr) = next.next() {
                let (this, origin, slot) = (self.clone(), origin.clone(), slot.clone());
                attempts.spawn(async move {
                    let r = this.connect_addr(&origin, addr, start, dns, &slot).await;
                    if r.is_ok() {
                        lock(&this.inner.state).note_answered(&origin, addr);
                    }
                    r
                });
            }
            let more = next.len() > 0;
            let done = tokio::select! {
                r = attempts.join_next() => r,
                _ = tokio::time::sleep(ATTEMPT_DELAY), if more => continue,
            };
            match done {
                Some(Ok(Ok(c))) => return Ok(c),
                Some(Ok(Err(e))) => {
                    tracing::debug!(origin = %origin.0, error = %e, "address failed: the next one");
                    last_err = Some(e);
                }
                Some(Err(e)) => last_err = Some(Error::Io(std::io::Error::other(e.to_string()))),
                None => {}
            }
            if !more && attempts.is_empty() {
                return Err(last_err.unwrap_or_else(|| Error::Resolve {
                    host: origin.0.clone(),
                    source: std::io::ErrorKind::NotFound.into(),
                }));
            }
        }
    }

    /// A new connection to `origin` at `addr` as the mode says, racing HTTP/3 against TCP
    /// in [`Mode::Auto`].
    async fn connect_addr(
        &self,
        origin: &Origin,
        addr: SocketAddr,
        start: Instant,
        dns: Duration,
        slot: &Arc<tokio::sync::Mutex<Slot>>,
    ) -> Result<(Arc<Conn>, Timings, Option<Upgrade>), Error> {
        let host = &origin.0;
        let mut t = Timings {
            dns,
            ..Timings::default()
        };
        let fail = |http3, tcp| Error::Connect(Box::new(ConnectError { addr, http3, tcp }));
        match self.inner.mode {
            Mode::Http2 | Mode::Http11 => {
                let c = self
                    .connect_tcp(addr, host)
                    .await
                    .map_err(|e| fail(None, Some(e)))?;
                t.connect = start.elapsed();
                t.tcp = Some(t.connect);
                return Ok((Arc::new(c), t, None));
            }
            Mode::Http3 | Mode::Http09 => {
                let early = lock(&self.inner.state).h3_worked(origin, addr);
                // A host that refuses the UDP port fails the attempt at once (the next
                // address, or the error), not after the connect timeout.
                let c = tokio::select! {
                    r = self.connect_quic(addr, host, early, None) => r,
                    _ = udp_refused(addr) => {
                        Err(Error::Io(std::io::ErrorKind::ConnectionRefused.into()))
                    }
                }
                .map_err(|e| fail(Some(e), None))?;
                match &c {
                    // Up in 0-RTT before the server said a word: closed if its handshake
                    // does not complete within the connect timeout, so that requests
                    // waiting for it fail then rather than at QUIC's idle timeout.
                    Conn::Quic(q) if q.in_early_data() => {
                        let network = state::network_id(addr);
                        self.watch_early(q, Box::pin(udp_refused(addr)), origin.clone(), network);
                    }
                    _ => lock(&self.inner.state).note_h3_worked(origin, addr),
                }
                t.connect = start.elapsed();
                return Ok((Arc::new(c), t, None));
            }
            Mode::Auto => {}
        }
        // HTTP/3 where the server said, or on the same port; unless broken on this network
        // (the network as the route to the origin shows it; checked before any lookup).
        let network = state::network_id(addr);
        let alt = self.alternative(origin, Some(&network));
        let broken = lock(&self.inner.state).is_broken(origin, &network);
        // An alternative on another host is looked up within the race delay: TCP does not
        // wait longer than that for a name HTTP/3 may not even need. One that does not
        // resolve, or not in time, marks HTTP/3 broken like any failure to reach it, so
        // that the next connections do not wait for it again.
        let h3_addr = match &alt {
            _ if broken => None,
            Some(a) if a.host.is_empty() => Some(SocketAddr::new(addr.ip(), a.port)),
            Some(a) => {
                let within = self.race_delay_for(None);
                match tokio::time::timeout(within, self.resolve(&a.host, a.port)).await {
                    // Not this host's loopback for a server elsewhere, nor "any": the
                    // server would aim this client's packets at its own machine.
                    Ok(Ok(r)) if !alternative_in_scope(addr, r) => {
                        tracing::info!(origin = %host, alternative = %a.host, address = %r, "HTTP/3 alternative on this machine for a server elsewhere: not used, marked broken");
                        lock(&self.inner.state).mark_broken(origin, &network);
                        None
                    }
                    Ok(Ok(r)) => Some(r),
                    r => {
                        tracing::info!(origin = %host, alternative = %a.host, timed_out = r.is_err(), "HTTP/3 alternative not found: marked broken, TCP");
                        lock(&self.inner.state).mark_broken(origin, &network);
                        None
                    }
                }
            }
            None => Some(addr),
        };
        let Some(h3_addr) = h3_addr else {
            tracing::debug!(origin = %host, "HTTP/3 marked broken on this network or not at hand: TCP");
            let c = self
                .connect_tcp(addr, host)
                .await
                .map_err(|e| fail(None, Some(e)))?;
            t.connect = start.elapsed();
            return Ok((Arc::new(c), t, None));
        };
        let this = self.clone();
        let h = host.clone();
        // 0-RTT only where this origin's HTTP/3 completed a handshake before.
        let early = lock(&self.inner.state).h3_worked(origin, h3_addr);
        let heard = Arc::new(AtomicBool::new(false));
        let heard_by_quic = heard.clone();
        let quic_start = tokio::time::Instant::now();
        // Aborted when this attempt is dropped (another address won, or the connect
        // timeout ran out), unless handed on to go on in the background.
        let mut quic = AbortOnDrop(tokio::spawn(async move {
            this.connect_quic(h3_addr, &h, early, Some(heard_by_quic))
                .await
        }));
        let mut refused: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(udp_refused(h3_addr));
        let delay = self.race_delay_for(Some(h3_addr));
        let quic_err = tokio::select! {
            r = &mut quic => match flatten(r) {
                Ok(c) => {
                    self.quic_up(&c, refused, origin, &network, h3_addr);
                    t.connect = start.elapsed();
                    return Ok((Arc::new(c), t, None));
                }
                Err(e) => Some(e),
            },
            _ = refused.as_mut() => {
                quic.abort();
                Some(Error::Io(std::io::ErrorKind::ConnectionRefused.into()))
            }
            _ = tokio::time::sleep(delay) => None,
        };
        if let Some(e) = quic_err {
            tracing::debug!(origin = %host, error = %e, "HTTP/3 failed at once: TCP");
            let c = self
                .connect_tcp(addr, host)
                .await
                .map_err(|tcp| fail(Some(e), Some(tcp)))?;
            t.connect = start.elapsed();
            return Ok((Arc::new(c), t, None));
        }
        tracing::debug!(origin = %host, ?delay, "HTTP/3 not up yet: racing TCP");
        let tcp = self.connect_tcp(addr, host);
        tokio::pin!(tcp);
        tokio::select! {
            r = &mut quic => match flatten(r) {
                Ok(c) => {
                    self.quic_up(&c, refused, origin, &network, h3_addr);
                    t.connect = start.elapsed();
                    Ok((Arc::new(c), t, None))
                }
                Err(e) => {
                    let c = tcp.await.map_err(|tcp| fail(Some(e), Some(tcp)))?;
                    t.connect = start.elapsed();
                    Ok((Arc::new(c), t, None))
                }
            },
            r = &mut tcp => match r {
                Ok(c) => {
                    t.connect = start.elapsed();
                    // Not one datagram back while TCP connected: UDP looks blocked. Marked
                    // now, not at the attempt's timeout, which a short-lived client (one
                    // `kuai get`) never lives to see.
                    let silent = || !heard.load(Relaxed);
                    let mut marked = false;
                    if quic_start.elapsed() >= SILENT_AFTER && silent() {
                        tracing::info!(origin = %origin.0, "HTTP/3 silent where TCP connected: marked broken");
                        lock(&self.inner.state).mark_broken(origin, &network);
                        marked = true;
                    }
                    // HTTP/3 goes on in the background: up, it takes the next requests
                    // (and clears the mark); failed, it is marked broken here.
                    let this = self.clone();
                    let origin = origin.clone();
                    let slot = slot.clone();
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    tokio::spawn(async move {
                        let attempt = async {
                            if !marked {
                                tokio::select! {
                                    r = &mut quic => return r,
                                    () = tokio::time::sleep_until(quic_start + SILENT_AFTER) => {}
                                }
                                if !heard.load(Relaxed) {
                                    tracing::info!(origin = %origin.0, "HTTP/3 silent where TCP connected: marked broken");
                                    lock(&this.inner.state).mark_broken(&origin, &network);
                                    marked = true;
                                }
                            }
                            (&mut quic).await
                        };
                        let r = tokio::time::timeout(this.inner.connect_timeout, attempt).await;
                        let ok = match r {
                            Ok(r) => match flatten(r) {
                                Ok(c) => {
                                    this.quic_up(&c, refused, &origin, &network, h3_addr);
                                    slot.lock().await.h3 = Some(Arc::new(c));
                                    true
                                }
                                Err(e) => {
                                    if !marked {
                                        tracing::info!(origin = %origin.0, error = %e, "HTTP/3 failed where TCP worked: marked broken");
                                        lock(&this.inner.state).mark_broken(&origin, &network);
                                    }
                                    false
                                }
                            },
                            Err(_) => {
                                quic.abort();
                                if !marked {
                                    tracing::info!(origin = %origin.0, "HTTP/3 did not connect where TCP did: marked broken");
                                    lock(&this.inner.state).mark_broken(&origin, &network);
                                }
                                false
                            }
                        };
                        let mut s = slot.lock().await;
                        s.upgrade = None;
                        drop(s);
                        let _ = tx.send(Some(ok));
                    });
                    // It had its head start and lost: later requests take TCP at once
                    // and move to HTTP/3 when it comes up.
                    let until = tokio::time::Instant::now();
                    Ok((Arc::new(c), t, Some(Upgrade { rx, until })))
                }
                Err(tcp_err) => match flatten(quic.await) {
                    Ok(c) => {
                        t.connect = start.elapsed();
                        Ok((Arc::new(c), t, None))
                    }
                    Err(e) => Err(fail(Some(e), Some(tcp_err))),
                },
            },
        }
    }
}

/// One QUIC connection carrying HTTP/3 (or HTTP/0.9), for callers that set up and drive
/// their connections themselves (the QUIC interop runner's client, which migrates, updates
/// keys and resumes on its own terms). [`Client`] does all of that for everyone else.
pub struct QuicConnection {
    conn: Arc<Conn>,
}

impl QuicConnection {
    /// HTTP/3 on `quic` (ALPN `h3`). With `early`, the connection is still in its
    /// handshake, opened in 0-RTT: safe requests go at once, others wait for it.
    pub async fn http3(
        quic: kuai::Connection,
        early: Option<kuai::ZeroRttAccepted>,
    ) -> Result<Self, Error> {
        Ok(Self {
            conn: Arc::new(Conn::Quic(QuicConn::new(quic, early, false).await?)),
        })
    }

    /// HTTP/0.9 on `quic` (ALPN `hq-interop`).
    pub async fn http09(
        quic: kuai::Connection,
        early: Option<kuai::ZeroRttAccepted>,
    ) -> Result<Self, Error> {
        Ok(Self {
            conn: Arc::new(Conn::Quic(QuicConn::new(quic, early, true).await?)),
        })
    }

    /// Sends `req` (its URI absolute); the response once its head arrived.
    pub async fn send(&self, req: Request<RequestBody>) -> Result<Response, Error> {
        let start = Instant::now();
        let url = req.uri().clone();
        let resp = self.conn.send(req).await?;
        let (head, body) = resp.into_parts();
        Ok(Response {
            head,
            body,
            protocol: self.conn.protocol(),
            remote: self.conn.remote(),
            conn: self.conn.clone(),
            timings: Timings {
                reused: true,
                first_byte: start.elapsed(),
                ..Timings::default()
            },
            start,
            url,
            redirects: 0,
        })
    }
}

impl Client {
    /// HTTP/3 connected at `h3_addr`: a connection opened in 0-RTT is watched until its
    /// handshake shows the server is there (whichever way it won, at once, in the race
    /// with TCP or after it); any other marks HTTP/3 working for the origin here.
    fn quic_up(
        &self,
        c: &Conn,
        refused: Pin<Box<dyn Future<Output = ()> + Send>>,
        origin: &Origin,
        network: &str,
        h3_addr: SocketAddr,
    ) {
        match c {
            Conn::Quic(q) if q.in_early_data() => {
                self.watch_early(q, refused, origin.clone(), network.to_owned())
            }
            _ => lock(&self.inner.state).mark_working(origin, network, h3_addr),
        }
    }

    /// Watches a connection opened in 0-RTT until its handshake completes: when the server's
    /// host refuses the UDP port (the server went away, or never had HTTP/3 there) or the
    /// handshake does not complete within the connect timeout, HTTP/3 is marked broken for
    /// the origin on this network and the connection closed, so its requests fail at once
    /// and those that may be sent again go over TCP.
    fn watch_early(
        &self,
        q: &QuicConn,
        refused: Pin<Box<dyn Future<Output = ()> + Send>>,
        origin: Origin,
        network: String,
    ) {
        let this = self.clone();
        let quic = q.quic.clone();
        let mut handshake = q.handshake.clone();
        tokio::spawn(async move {
            let failed = tokio::select! {
                _ = handshake.wait_for(Option::is_some) => quic.close_reason().is_some(),
                _ = refused => true,
                _ = tokio::time::sleep(this.inner.connect_timeout) => true,
            };
            if failed {
                tracing::info!(origin = %origin.0, "HTTP/3 in 0-RTT got no handshake: marked broken");
                lock(&this.inner.state).mark_broken(&origin, &network);
                quic.close(0, b"no handshake");
            } else {
                lock(&this.inner.state).mark_working(&origin, &network, quic.remote_address());
            }
        });
    }
}

/// The least time HTTP/3 goes alone before TCP joins when the delay comes from a
/// remembered RTT (RFC 8305 §8 recommends 100 ms).
const MIN_RACE_DELAY: Duration = Duration::from_millis(100);

/// How long one address goes unanswered before the next joins it (RFC 8305 §5's
/// recommended Connection Attempt Delay).
const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// `addrs` without repeats, alternating between IPv6 and IPv4 from the family of the first
/// (RFC 8305 §4, with a First Address Family Count of one).
fn interleave_families(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let mut seen = Vec::with_capacity(addrs.len());
    for a in addrs {
        if !seen.contains(&a) {
            seen.push(a);
        }
    }
    let Some(first) = seen.first().map(SocketAddr::is_ipv6) else {
        return seen;
    };
    let (mut lead, mut other): (Vec<_>, Vec<_>) =
        seen.into_iter().partition(|a| a.is_ipv6() == first);
    lead.reverse();
    other.reverse();
    let mut out = Vec::with_capacity(lead.len() + other.len());
    loop {
        match (lead.pop(), other.pop()) {
            (None, None) => return out,
            (a, b) => out.extend(a.into_iter().chain(b)),
        }
    }
}

fn flatten(r: Result<Result<Conn, Error>, tokio::task::JoinError>) -> Result<Conn, Error> {
    r.unwrap_or_else(|e| Err(Error::Io(std::io::Error::other(e.to_string()))))
}

/// Resolves when the host at `addr` answers that nothing listens on that UDP port (ICMP port
/// unreachable); never otherwise. A connected UDP socket sends one byte, which a QUIC
/// server drops as too short to be a packet.
async fn udp_refused(addr: SocketAddr) {
    let any: SocketAddr = if addr.is_ipv6() {
        "[::]:0".parse().expect("address")
    } else {
        "0.0.0.0:0".parse().expect("address")
    };
    let probe = async {
        let s = tokio::net::UdpSocket::bind(any).await.ok()?;
        s.connect(addr).await.ok()?;
        s.send(&[0]).await.ok()?;
        let mut b = [0u8; 64];
        loop {
            match s.recv(&mut b).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Some(()),
                Err(_) => return None,
                Ok(_) => {}
            }
        }
    };
    if probe.await.is_none() {
        std::future::pending::<()>().await;
    }
}

/// Whether an alternative at `alt` may stand for a server reached at `origin`: not at an
/// unspecified address, and on loopback only for a server on loopback.
fn alternative_in_scope(origin: SocketAddr, alt: SocketAddr) -> bool {
    !alt.ip().is_unspecified() && (!alt.ip().is_loopback() || origin.ip().is_loopback())
}

fn origin_of(uri: &Uri) -> Result<Origin, Error> {
    let bad = |reason| Error::InvalidUrl {
        url: uri.to_string(),
        reason,
    };
    if uri.scheme_str() != Some("https") {
        return Err(bad("only https URLs"));
    }
    let authority = uri.authority().ok_or_else(|| bad("no host"))?;
    // Userinfo would go out in Host and :authority, which RFC 9114 §4.3.1 forbids (and
    // RFC 9110 §4.2.4 deprecates in https URLs); credentials go in a header instead.
    if authority.as_str().contains('@') {
        return Err(bad(
            "credentials in the URL (set an Authorization header instead)",
        ));
    }
    // The http crate checks a port's characters, not its range: "host:70000" or "host:x"
    // must not quietly become 443.
    // (`Authority::port` is `None` for those too.) An empty port is the default one
    // (RFC 3986 §3.2.3).
    let a = authority.as_str();
    let after_host = a.rfind(']').map_or(a, |i| &a[i + 1..]);
    let port = match after_host.rsplit_once(':') {
        None | Some((_, "")) => 443,
        Some((_, p)) => p.parse::<u16>().map_err(|_| bad("bad port"))?,
    };
    let host = uri.host().ok_or_else(|| bad("no host"))?;
    // An IPv6 literal's brackets belong to the URL (RFC 3986 §3.2.2), not to the name
    // resolved and checked against the certificate.
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Ok((host.to_ascii_lowercase(), port))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `location` (a Location header) resolved against `base` (RFC 3986 §5.2): absolute (the
/// scheme matched without regard to case), scheme-relative, absolute-path, relative-path
/// (dot segments removed, §5.2.4) and query-only references; the fragment dropped.
fn join(base: &Uri, location: &str) -> Result<Uri, Error> {
    let bad = |reason| Error::InvalidUrl {
        url: location.to_string(),
        reason,
    };
    let location = location.split('#').next().unwrap_or("");
    // A scheme: letters, digits, "+", "-" or "." after a first letter, then ":" (§3.1).
    if let Some((scheme, rest)) = location.split_once(':')
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    {
        let s = format!("{}:{rest}", scheme.to_ascii_lowercase());
        return s.parse().map_err(|_| bad("not a URL"));
    }
    if let Some(rest) = location.strip_prefix("//") {
        let scheme = base.scheme_str().unwrap_or("https");
        return format!("{scheme}://{rest}")
            .parse()
            .map_err(|_| bad("not a URL"));
    }
    let authority = base
        .authority()
        .ok_or_else(|| bad("no authority to resolve against"))?;
    let scheme = base.scheme_str().unwrap_or("https");
    let (loc_path, loc_query) = match location.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (location, None),
    };
    let (path, query) = if loc_path.is_empty() {
        // Same path; the reference's query, or the base's when it has none (§5.2.2).
        (
            base.path().to_string(),
            loc_query.or(base.query()).map(str::to_string),
        )
    } else if loc_path.starts_with('/') {
        (remove_dot_segments(loc_path), loc_query.map(str::to_string))
    } else {
        // Merged with the base path's directory (§5.2.3).
        let p = base.path();
        let dir = &p[..=p.rfind('/').unwrap_or(0)];
        let merged = if dir.is_empty() {
            format!("/{loc_path}")
        } else {
            format!("{dir}{loc_path}")
        };
        (remove_dot_segments(&merged), loc_query.map(str::to_string))
    };
    let s = match query {
        Some(q) => format!("{scheme}://{authority}{path}?{q}"),
        None => format!("{scheme}://{authority}{path}"),
    };
    s.parse().map_err(|_| bad("not a URL"))
}

/// How long an HTTP/3 attempt may hear nothing at all from the server while TCP connects
/// before HTTP/3 counts as blocked on this network: longer than the race delay when no RTT
/// is known (so TCP has connected in the meantime), and many round trips of any path that
/// has one. A server that answers later clears the mark when its handshake completes.
const SILENT_AFTER: Duration = Duration::from_millis(250);

/// Awaits `connecting`, setting `heard` once any datagram has come back.
async fn handshake_noting_answers(
    mut connecting: kuai::Connecting,
    heard: &AtomicBool,
) -> Result<kuai::Connection, Error> {
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = &mut connecting => {
                heard.store(true, Relaxed);
                return r.map_err(Error::Quic);
            }
            _ = tick.tick(), if !heard.load(Relaxed) => {
                if connecting.stats().udp_rx_datagrams > 0 {
                    heard.store(true, Relaxed);
                }
            }
        }
    }
}

/// A task that ends when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    fn abort(&self) {
        self.0.abort();
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

/// RFC 3986 §5.2.4: "." and ".." segments of an absolute path resolved; never above "/".
fn remove_dot_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    for (i, seg) in segments.iter().enumerate() {
        match *seg {
            "." => {
                if i == last {
                    out.push("");
                }
            }
            ".." => {
                out.pop();
                if i == last {
                    out.push("");
                }
            }
            s => out.push(s),
        }
    }
    format!("/{}", out.join("/"))
}

trait RetryClone {
    fn try_clone_for_retry(&self) -> Option<Request<RequestBody>>;
    fn try_clone_unprocessed(&self) -> Option<Request<RequestBody>>;
    fn try_clone_for_redirect(&self) -> Option<(Method, HeaderMap, Option<RequestBody>)>;
}

impl RetryClone for Request<RequestBody> {
    /// A copy when the body is in memory and the method may be sent twice.
    fn try_clone_for_retry(&self) -> Option<Request<RequestBody>> {
        if !self.method().is_idempotent() {
            return None;
        }
        self.try_clone_unprocessed()
    }

    /// A copy when the body is in memory, whatever the method: for a request the server
    /// says it did not process.
    fn try_clone_unprocessed(&self) -> Option<Request<RequestBody>> {
        let body = self.body().try_clone()?;
        let mut r = Request::new(body);
        *r.method_mut() = self.method().clone();
        *r.uri_mut() = self.uri().clone();
        *r.headers_mut() = self.headers().clone();
        Some(r)
    }

    /// What a redirect needs of the request: its method, headers and, when in memory, body.
    fn try_clone_for_redirect(&self) -> Option<(Method, HeaderMap, Option<RequestBody>)> {
        Some((
            self.method().clone(),
            self.headers().clone(),
            self.body().try_clone(),
        ))
    }
}

#[cfg(test)]
mod tests;
