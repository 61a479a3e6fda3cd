//! The connections a [`Client`](super::Client) holds: HTTP/3 and HTTP/0.9 over QUIC, HTTP/2
//! and HTTP/1.1 over TLS over TCP, each sending a request and handing back the response head
//! and a [`Body`] that streams.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body::Frame;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};

use crate::server::{ALPN_H1, ALPN_H2};
use crate::{Body, BoxError, ConnectError, Error, Protocol};

/// A request body: nothing, bytes in memory (which a request sent in 0-RTT and refused can
/// send again), or a stream (for example a file being uploaded).
pub struct RequestBody(Inner);

enum Inner {
    Bytes(Option<Bytes>),
    Stream(UnsyncBoxBody<Bytes, BoxError>),
}

impl RequestBody {
    /// No body.
    pub fn empty() -> Self {
        Self(Inner::Bytes(None))
    }

    /// A body that streams from `body` (for an upload: a [`FileBody`](crate::FileBody)).
    pub fn wrap<B>(body: B) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(Inner::Stream(body.map_err(Into::into).boxed_unsync()))
    }

    /// A copy, when the body is in memory.
    pub(crate) fn try_clone(&self) -> Option<Self> {
        match &self.0 {
            Inner::Bytes(b) => Some(Self(Inner::Bytes(b.clone()))),
            Inner::Stream(_) => None,
        }
    }

    fn is_empty(&self) -> bool {
        matches!(&self.0, Inner::Bytes(None))
    }
}

impl Default for RequestBody {
    fn default() -> Self {
        Self::empty()
    }
}

impl From<Bytes> for RequestBody {
    fn from(b: Bytes) -> Self {
        Self(Inner::Bytes((!b.is_empty()).then_some(b)))
    }
}

impl From<Vec<u8>> for RequestBody {
    fn from(v: Vec<u8>) -> Self {
        Bytes::from(v).into()
    }
}

impl From<String> for RequestBody {
    fn from(s: String) -> Self {
        Bytes::from(s).into()
    }
}

impl From<&'static str> for RequestBody {
    fn from(s: &'static str) -> Self {
        Bytes::from_static(s.as_bytes()).into()
    }
}

impl std::fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Inner::Bytes(b) => write!(f, "RequestBody({} bytes)", b.as_ref().map_or(0, Bytes::len)),
            Inner::Stream(_) => f.write_str("RequestBody(stream)"),
        }
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().0 {
            Inner::Bytes(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Stream(s) => Pin::new(s).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Bytes(b) => b.is_none(),
            Inner::Stream(s) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.0 {
            Inner::Bytes(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            Inner::Stream(s) => s.size_hint(),
        }
    }
}

/// Facts about a TLS connection over TCP.
#[derive(Clone, Debug, Default)]
pub(crate) struct TlsInfo {
    pub cipher_suite: Option<String>,
    pub resumed: bool,
}

/// A connection to one origin.
pub(crate) enum Conn {
    Quic(QuicConn),
    H2 {
        send: hyper::client::conn::http2::SendRequest<RequestBody>,
        info: TlsInfo,
        remote: SocketAddr,
    },
    H1(H1Pool),
}

/// A QUIC connection with HTTP/3 (or HTTP/0.9) on it.
pub(crate) struct QuicConn {
    pub quic: kuai::Connection,
    /// `None`: HTTP/0.9 (`hq-interop`).
    pub h3: Option<kuai_h3::Client>,
    /// `None` while the handshake runs; then whether early data was accepted.
    pub handshake: watch::Receiver<Option<bool>>,
    /// Opened in 0-RTT.
    pub early: bool,
}

impl QuicConn {
    /// Starts HTTP/3 (or HTTP/0.9) on `quic`; `accepted` resolves when a handshake begun in
    /// 0-RTT completes.
    pub async fn new(
        quic: kuai::Connection,
        accepted: Option<kuai::ZeroRttAccepted>,
        http09: bool,
    ) -> Result<Self, Error> {
        let early = accepted.is_some();
        let (tx, handshake) = watch::channel(if early { None } else { Some(false) });
        if let Some(a) = accepted {
            tokio::spawn(async move {
                let ok = a.await;
                let _ = tx.send(Some(ok));
            });
        }
        let h3 = if http09 {
            None
        } else {
            Some(kuai_h3::Client::new(quic.clone(), kuai_h3::Config::default()).await?)
        };
        Ok(Self {
            quic,
            h3,
            handshake,
            early,
        })
    }

    /// Waits for the handshake when the connection is still in 0-RTT.
    async fn handshake_done(&self) {
        let mut rx = self.handshake.clone();
        let _ = rx.wait_for(Option::is_some).await;
    }

    pub(crate) fn in_early_data(&self) -> bool {
        self.handshake.borrow().is_none()
    }
}

/// HTTP/1.1 connections to one origin: one request at a time each, up to a limit (as
/// browsers do), kept for the next request when a response was read to its end.
pub(crate) struct H1Pool {
    remote: SocketAddr,
    host: String,
    connector: tokio_rustls::TlsConnector,
    idle: Arc<Mutex<Vec<hyper::client::conn::http1::SendRequest<RequestBody>>>>,
    slots: Arc<Semaphore>,
    pub info: TlsInfo,
    /// How long a new connection may take (the client's connect timeout).
    connect_timeout: std::time::Duration,
    /// A new connection to `remote` failed: the pool is not used again, so the next request
    /// makes a new connection the whole way (the name resolved again, every address, HTTP/3
    /// raced) instead of knocking on this address for ever.
    broken: std::sync::atomic::AtomicBool,
}

impl Conn {
    /// Whether a new request may go on it.
    pub fn is_usable(&self) -> bool {
        match self {
            Conn::Quic(q) => {
                q.quic.close_reason().is_none() && !q.h3.as_ref().is_some_and(|h| h.is_going_away())
            }
            Conn::H2 { send, .. } => !send.is_closed(),
            Conn::H1(p) => !p.broken.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    pub fn protocol(&self) -> Protocol {
        match self {
            Conn::Quic(q) if q.h3.is_none() => Protocol::Http09,
            Conn::Quic(_) => Protocol::Http3,
            Conn::H2 { .. } => Protocol::Http2,
            Conn::H1(_) => Protocol::Http11,
        }
    }

    pub fn remote(&self) -> SocketAddr {
        match self {
            Conn::Quic(q) => q.quic.remote_address(),
            Conn::H2 { remote, .. } => *remote,
            Conn::H1(p) => p.remote,
        }
    }

    pub fn tls_info(&self) -> TlsInfo {
        match self {
            Conn::Quic(q) => {
                let st = q.quic.stats();
                TlsInfo {
                    cipher_suite: st.cipher_suite.map(str::to_owned),
                    resumed: st.resumed,
                }
            }
            Conn::H2 { info, .. } => info.clone(),
            Conn::H1(p) => p.info.clone(),
        }
    }

    /// Sends `req` (its URI absolute) and returns the response head with a streaming body.
    pub async fn send(&self, req: Request<RequestBody>) -> Result<Response<Body>, Error> {
        match self {
            Conn::Quic(q) => match &q.h3 {
                Some(h3) => send_h3(q, h3, req).await,
                None => send_hq(q, req).await,
            },
            Conn::H2 { send, .. } => {
                let mut send = send.clone();
                send.ready().await?;
                let resp = send.send_request(req).await?;
                Ok(resp.map(|b| Body::hyper(b, None)))
            }
            Conn::H1(pool) => pool.send(req).await,
        }
    }
}

/// The head of `parts` again, for sending a request a second time.
fn head_of(parts: &http::request::Parts) -> Request<()> {
    let mut r = Request::new(());
    *r.method_mut() = parts.method.clone();
    *r.uri_mut() = parts.uri.clone();
    *r.headers_mut() = parts.headers.clone();
    r
}

async fn send_h3(
    q: &QuicConn,
    h3: &kuai_h3::Client,
    req: Request<RequestBody>,
) -> Result<Response<Body>, Error> {
    let (parts, body) = req.into_parts();
    // Only safe methods go in 0-RTT (RFC 8470 §2.1: early data can be replayed, and an
    // idempotent PUT or DELETE replayed later can undo what came between), and only what can
    // be sent again if the server refuses the early data.
    let again = body.try_clone();
    if q.in_early_data() && (!parts.method.is_safe() || again.is_none()) {
        q.handshake_done().await;
        // The handshake never completed (the 0-RTT attempt got no answer and was given
        // up): nothing of this request left, so it may go on another connection.
        if q.quic.stats().handshake_duration.is_none() {
            return Err(Error::Connect(Box::new(ConnectError {
                addr: q.quic.remote_address(),
                http3: q.quic.close_reason().map(Error::Quic),
                tcp: None,
            })));
        }
    }
    let mut body = Some(body);
    for attempt in 0..2 {
        let b = match body.take() {
            Some(b) => b,
            None => again
                .as_ref()
                .and_then(RequestBody::try_clone)
                .unwrap_or_default(),
        };
        // A stream opened before the handshake completes is a 0-RTT stream, and the
        // server's refusal can land at any step: while the head is written or the stream
        // finished as much as while the response is awaited.
        let early = q.in_early_data();
        let answer = async {
            let stream = h3.send_request(head_of(&parts)).await?;
            let (send, mut recv) = stream.split();
            send_body(send, b)?;
            let resp = recv.recv_response().await?;
            Ok::<_, kuai_h3::Error>((resp, recv))
        }
        .await;
        match answer {
            // Sent in 0-RTT and refused: the server never saw it; again after the handshake.
            Err(kuai_h3::Error::ZeroRttRejected) if attempt == 0 && again.is_some() => {
                q.handshake_done().await;
                continue;
            }
            Err(e) => return Err(e.into()),
            // The server took the early data but would not risk processing this request
            // before the handshake: again after it, never in early data (RFC 8470 §5.2).
            Ok((resp, mut recv))
                if early
                    && attempt == 0
                    && again.is_some()
                    && resp.status() == http::StatusCode::TOO_EARLY =>
            {
                recv.stop(kuai_h3::Code::REQUEST_CANCELLED);
                q.handshake_done().await;
                continue;
            }
            Ok((resp, recv)) => {
                let mut resp = resp.map(|()| Body::h3(recv, None));
                *resp.version_mut() = Version::HTTP_3;
                return Ok(resp);
            }
        }
    }
    Err(Error::H3(kuai_h3::Error::ZeroRttRejected))
}

/// Ends the request stream at once when `b` is empty; otherwise streams `b` from a task of
/// its own (a failure there resets the stream, which the response side then reports).
fn send_body(mut send: kuai_h3::SendHalf, b: RequestBody) -> Result<(), kuai_h3::Error> {
    if b.is_empty() {
        return send.finish();
    }
    tokio::spawn(async move {
        let mut b = b;
        let r: Result<(), BoxError> = async {
            while let Some(frame) = b.frame().await {
                let frame = frame?;
                match frame.into_data() {
                    Ok(d) => send.send_data(d).await?,
                    Err(f) => {
                        if let Ok(t) = f.into_trailers() {
                            send.send_trailers(&t).await?;
                        }
                    }
                }
            }
            send.finish()?;
            Ok(())
        }
        .await;
        if let Err(e) = r {
            tracing::debug!(error = %e, "request body not sent");
            send.reset(kuai_h3::Code::REQUEST_CANCELLED);
        }
    });
    Ok(())
}

/// The stream error an HTTP/0.9 server resets with for a missing file.
const HQ_NOT_FOUND: u64 = 0x10c;

/// HTTP/0.9: `GET /path`, the body until the stream ends; a reset stream is an error (the
/// interop runner's 404).
async fn send_hq(q: &QuicConn, req: Request<RequestBody>) -> Result<Response<Body>, Error> {
    if req.method() != http::Method::GET {
        return Err(Error::InvalidUrl {
            url: req.uri().to_string(),
            reason: "HTTP/0.9 has only GET",
        });
    }
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    for attempt in 0..2 {
        let (mut send, mut recv) = q.quic.open_bi().await.map_err(Error::Quic)?;
        let line = format!("GET {path}\r\n");
        let sent = async {
            send.write_all(line.as_bytes()).await?;
            send.finish()
        }
        .await;
        if sent.is_err() && attempt == 0 && q.early {
            q.handshake_done().await;
            continue;
        }
        sent.map_err(|e| Error::Io(std::io::Error::other(e)))?;
        // The first bytes tell whether the server took it (a 0-RTT refusal comes first).
        match recv.read_chunk(usize::MAX).await {
            Err(kuai::ReadError::ZeroRttRejected) if attempt == 0 => {
                q.handshake_done().await;
                continue;
            }
            // The interop runner's convention for "not found": a 404 here.
            Err(kuai::ReadError::Reset(HQ_NOT_FOUND)) => {
                let mut resp = Response::new(Body::empty());
                *resp.status_mut() = http::StatusCode::NOT_FOUND;
                *resp.version_mut() = Version::HTTP_09;
                return Ok(resp);
            }
            Err(e) => return Err(Error::Read(e)),
            Ok(first) => {
                let body = Body::quic_with_first(first, recv);
                let mut resp = Response::new(body);
                *resp.version_mut() = Version::HTTP_09;
                return Ok(resp);
            }
        }
    }
    Err(Error::Read(kuai::ReadError::ZeroRttRejected))
}

/// Connects TCP and TLS to `addr` for `host`, offering `alpn`; the stream, the protocol the
/// server chose and the TLS facts.
pub(crate) async fn connect_tls(
    addr: SocketAddr,
    host: &str,
    connector: &tokio_rustls::TlsConnector,
) -> Result<(tokio_rustls::client::TlsStream<TcpStream>, Vec<u8>, TlsInfo), Error> {
    let sock = TcpStream::connect(addr).await?;
    let _ = sock.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|_| {
        Error::InvalidUrl {
            url: host.to_string(),
            reason: "not a valid server name",
        }
    })?;
    let tls = connector.connect(name, sock).await?;
    let c = tls.get_ref().1;
    let alpn = c.alpn_protocol().unwrap_or(ALPN_H1).to_vec();
    let info = TlsInfo {
        cipher_suite: c
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite())),
        resumed: c.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
    };
    Ok((tls, alpn, info))
}

/// An HTTP/2 or HTTP/1.1 connection over TLS, whichever the server picks of `alpn`.
pub(crate) async fn connect_tcp(
    addr: SocketAddr,
    host: &str,
    tls: &Arc<rustls::ClientConfig>,
    alpn: &[&[u8]],
    h1_max: usize,
    connect_timeout: std::time::Duration,
    h2_keep_alive: Option<(std::time::Duration, std::time::Duration)>,
) -> Result<Conn, Error> {
    let mut cfg = (**tls).clone();
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let (stream, chosen, info) = connect_tls(addr, host, &connector).await?;
    if chosen == ALPN_H2 {
        let mut h2 = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        h2.initial_stream_window_size(4 << 20)
            .initial_connection_window_size(16 << 20);
        if let Some((interval, timeout)) = h2_keep_alive {
            h2.timer(hyper_util::rt::TokioTimer::new())
                .keep_alive_interval(interval)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true);
        }
        let (send, conn) = h2.handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        return Ok(Conn::H2 {
            send,
            info,
            remote: addr,
        });
    }
    // Later HTTP/1.1 connections ask for HTTP/1.1 only.
    let mut cfg = (**tls).clone();
    cfg.alpn_protocols = vec![ALPN_H1.to_vec()];
    let pool = H1Pool {
        remote: addr,
        host: host.to_string(),
        connector: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        idle: Arc::new(Mutex::new(vec![h1_handshake(stream).await?])),
        slots: Arc::new(Semaphore::new(h1_max.max(1))),
        info,
        connect_timeout,
        broken: std::sync::atomic::AtomicBool::new(false),
    };
    Ok(Conn::H1(pool))
}

async fn h1_handshake(
    stream: tokio_rustls::client::TlsStream<TcpStream>,
) -> Result<hyper::client::conn::http1::SendRequest<RequestBody>, Error> {
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

impl H1Pool {
    /// A new connection to the pool's address, within the connect timeout; a failure marks
    /// the pool broken (see [`H1Pool::broken`]).
    async fn connect(&self) -> Result<hyper::client::conn::http1::SendRequest<RequestBody>, Error> {
        let made = tokio::time::timeout(self.connect_timeout, async {
            let (stream, _, _) = connect_tls(self.remote, &self.host, &self.connector).await?;
            h1_handshake(stream).await
        })
        .await
        .unwrap_or(Err(Error::Timeout {
            what: "connecting",
            after: self.connect_timeout,
        }));
        // Never sent, so the request may go again on a new connection (`is_unprocessed`).
        made.map_err(|e| {
            self.broken
                .store(true, std::sync::atomic::Ordering::Relaxed);
            Error::Connect(Box::new(crate::error::ConnectError {
                addr: self.remote,
                http3: None,
                tcp: Some(e),
            }))
        })
    }

    async fn send(&self, req: Request<RequestBody>) -> Result<Response<Body>, Error> {
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::Io(std::io::ErrorKind::BrokenPipe.into()))?;
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let (mut send, fresh) = match pooled {
            Some(s) if !s.is_closed() => (s, false),
            _ => (self.connect().await?, true),
        };
        // HTTP/1.1 wants the path in the request line and the authority in Host.
        let (mut parts, body) = req.into_parts();
        if let Some(a) = parts.uri.authority().cloned()
            && !parts.headers.contains_key(http::header::HOST)
            && let Ok(v) = http::HeaderValue::from_str(a.as_str())
        {
            parts.headers.insert(http::header::HOST, v);
        }
        let pq = parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        parts.uri = pq.parse().map_err(|_| Error::InvalidUrl {
            url: pq.clone(),
            reason: "not a path",
        })?;
        let req = Request::from_parts(parts, body);
        let resp = match send.ready().await {
            Ok(()) => send.try_send_request(req).await,
            Err(e) if fresh => return Err(e.into()),
            // The pooled connection closed while idle: a new one.
            Err(_) => {
                send = self.connect().await?;
                send.ready().await?;
                send.try_send_request(req).await
            }
        };
        let resp = match resp {
            Ok(r) => r,
            // Closed by the server before any of the request went out (a keep-alive
            // connection it had just given up): sent again on a new connection, whatever the
            // method, since the server never saw it (RFC 9112 §9.3.1).
            Err(mut e) if !fresh && e.message().is_some() => {
                let req = e.take_message().expect("checked");
                send = self.connect().await?;
                send.ready().await?;
                send.send_request(req).await?
            }
            // Sent, and the kept-alive connection closed before any response: the server
            // gave it up as the request went out (its idle close crossing the request).
            // The caller sends an idempotent request again on a new one (RFC 9112 §9.3.1).
            Err(e) if !fresh && e.error().is_incomplete_message() => {
                return Err(Error::Stale(e.into_error()));
            }
            Err(e) => return Err(e.into_error().into()),
        };
        let idle = self.idle.clone();
        // The connection goes back to the pool once its response was read to the end (the
        // permit with it); dropped half-read, it is closed.
        let back = move || {
            idle.lock().unwrap_or_else(|e| e.into_inner()).push(send);
            drop(permit);
        };
        Ok(resp.map(|b| Body::hyper(b, None).on_end(Box::new(back))))
    }
}
