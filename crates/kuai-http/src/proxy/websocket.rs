//! WebSockets through the proxy: extended CONNECT from HTTP/3 (RFC 9220) and HTTP/2
//! (RFC 8441) clients, and `Upgrade: websocket` from HTTP/1.1 ones (RFC 6455 §4), forwarded
//! to an HTTP/1.1 backend as an upgrade; then bytes both ways until either side ends or the
//! tunnel is idle for the proxy's response timeout.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::ProxyBody;
use super::backend::Backend;
use super::{Head, Inner, UpstreamProtocol, local};
use crate::server::DrainGuard;
use crate::{Body, Error};

/// RFC 6455 §1.3: appended to the key before hashing for `Sec-WebSocket-Accept`.
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// WebSocket tunnels open through a proxy, in all and per client address
/// ([`address_key`](kuai::kuai_proto::address_key)): each holds a backend connection of its
/// own, which no other limit counts.
#[derive(Default)]
pub(super) struct Tunnels {
    open: std::sync::Mutex<(
        usize,
        std::collections::HashMap<std::net::SocketAddr, usize>,
    )>,
}

impl Tunnels {
    /// A place for a tunnel from `client`, or `None` past a cap.
    fn take(
        self: &Arc<Self>,
        client: Option<std::net::SocketAddr>,
        o: &super::Options,
    ) -> Option<TunnelSlot> {
        // A client's address ([`address_key`](kuai::kuai_proto::address_key), port 0), or
        // from a proxy in front its address and port.
        let mut cap = o.max_tunnels_per_address;
        let key = client.map(|c| {
            let ip = c.ip().to_canonical();
            if o.proxies.iter().any(|p| p.to_canonical() == ip) {
                // One of the proxy's flows: one client connection, so a few tunnels (the
                // proxy's flows per client address bound the rest).
                cap = cap.min(PER_PROXIED_FLOW);
                std::net::SocketAddr::new(ip, c.port())
            } else {
                std::net::SocketAddr::new(kuai::kuai_proto::address_key(ip), 0)
            }
        });
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.0 >= o.max_tunnels {
            return None;
        }
        if let Some(k) = key {
            let mine = open.1.entry(k).or_insert(0);
            if *mine >= cap {
                return None;
            }
            *mine += 1;
        }
        open.0 += 1;
        Some(TunnelSlot {
            tunnels: self.clone(),
            key,
        })
    }
}

/// WebSocket tunnels at once over one flow of a proxy in front (see `ProxyBuilder::proxies`).
const PER_PROXIED_FLOW: usize = 16;

/// A tunnel's place among the open ones; given back when dropped.
pub(super) struct TunnelSlot {
    tunnels: Arc<Tunnels>,
    key: Option<std::net::SocketAddr>,
}

impl Drop for TunnelSlot {
    fn drop(&mut self) {
        let mut open = self.tunnels.open.lock().unwrap_or_else(|e| e.into_inner());
        open.0 -= 1;
        if let Some(k) = self.key
            && let Some(n) = open.1.get_mut(&k)
        {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&k);
            }
        }
    }
}

/// What a tunnel holds while it lasts: its place among the open ones, and (HTTP/2) the
/// request's place in its connection, so that the connection is not taken for idle and
/// closed under a tunnel that is busy.
struct Hold {
    _slot: TunnelSlot,
    _busy: Option<crate::server::Busy>,
}

/// How a client asks for a WebSocket.
pub(super) enum Ask {
    /// HTTP/3 extended CONNECT: the request and response bodies are the tunnel.
    Http3,
    /// HTTP/2 extended CONNECT: hyper hands the stream over after a 2xx.
    Http2(hyper::upgrade::OnUpgrade),
    /// HTTP/1.1 `Upgrade: websocket`: hyper hands the connection over after the 101.
    Http11(hyper::upgrade::OnUpgrade),
}

/// Whether `req` asks for a WebSocket, and how.
pub(super) fn ask(req: &mut Request<Body>) -> Option<Ask> {
    let connect = req.method() == Method::CONNECT;
    if connect
        && req
            .extensions()
            .get::<kuai_h3::Protocol>()
            .is_some_and(|p| p.0.eq_ignore_ascii_case("websocket"))
    {
        return Some(Ask::Http3);
    }
    if connect
        && req
            .extensions()
            .get::<hyper::ext::Protocol>()
            .is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket"))
    {
        return Some(Ask::Http2(hyper::upgrade::on(req)));
    }
    let upgrade = req.method() == Method::GET
        && req.version() == Version::HTTP_11
        && super::headers::has_token(req.headers(), header::CONNECTION, "upgrade")
        && super::headers::has_token(req.headers(), header::UPGRADE, "websocket");
    upgrade.then(|| Ask::Http11(hyper::upgrade::on(req)))
}

/// `Sec-WebSocket-Accept` for `key` (RFC 6455 §4.2.2).
pub(super) fn accept_for(key: &[u8]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key);
    ctx.update(GUID.as_bytes());
    base64(ctx.finish().as_ref())
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

impl Inner {
    /// Forwards a WebSocket request: an upgrade on a new connection to an HTTP/1.1
    /// backend, then the tunnel.
    pub(super) async fn websocket(
        &self,
        mut head: Head,
        body: Body,
        ask: Ask,
        drain: Option<crate::server::Drain>,
        busy: Option<crate::server::Busy>,
        client: Option<std::net::SocketAddr>,
    ) -> Response<ProxyBody> {
        if !self
            .backends
            .iter()
            .any(|b| b.upstream.protocol() == UpstreamProtocol::Http1)
        {
            return local(
                StatusCode::BAD_GATEWAY,
                "WebSockets need an http:// upstream",
            );
        }
        let Some(slot) = self.tunnels.take(client, &self.options) else {
            tracing::debug!(target: "kuai_http::proxy", client = ?client, "WebSocket refused: too many tunnels open");
            return local(StatusCode::SERVICE_UNAVAILABLE, "too many WebSockets open");
        };
        let hold = Hold {
            _slot: slot,
            _busy: busy,
        };
        let h = &mut head.headers;
        // The client's own key when it sent one (HTTP/1.1); otherwise ours (extended
        // CONNECT has none, RFC 8441 §5), checked against the backend's answer.
        let key = match (&ask, h.get(header::SEC_WEBSOCKET_KEY)) {
            (Ask::Http11(_), Some(k)) => k.clone(),
            _ => {
                let mut raw = [0u8; 16];
                if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw)
                    .is_err()
                {
                    return local(StatusCode::INTERNAL_SERVER_ERROR, "no randomness");
                }
                match HeaderValue::from_str(&base64(&raw)) {
                    Ok(v) => v,
                    Err(_) => return local(StatusCode::INTERNAL_SERVER_ERROR, "bad key"),
                }
            }
        };
        h.insert(header::SEC_WEBSOCKET_KEY, key.clone());
        h.entry(header::SEC_WEBSOCKET_VERSION)
            .or_insert(HeaderValue::from_static("13"));
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.remove(header::CONTENT_LENGTH);
        head.method = Method::GET;
        let mut req = head.request(
            super::body::UpBody::new(Body::empty()).0,
            UpstreamProtocol::Http1,
        );
        // Upgrades take a connection for themselves: a new one, never pooled. A backend
        // that cannot be reached (nothing of the request went out) leaves the request to
        // the next one, as other requests do.
        let mut tried: Vec<Arc<Backend>> = Vec::new();
        let (b, resp, start) = loop {
            let Some(b) = self.pick_where(|b| {
                b.upstream.protocol() == UpstreamProtocol::Http1
                    && !tried.iter().any(|t| std::ptr::eq(&**t, b))
            }) else {
                return local(StatusCode::BAD_GATEWAY, "the upstream failed");
            };
            tried.push(b.clone());
            let start = Instant::now();
            match b.upgrade(&mut req, &self.options).await {
                Ok(r) => break (b, r, start),
                Err(why) => {
                    b.on_failure(&self.options);
                    let unsent = why.is_unsent();
                    self.log_failure(&b, &why, &head, unsent);
                    if unsent && tried.len() < super::MAX_ATTEMPTS {
                        continue;
                    }
                    return if why.is_timeout() {
                        local(
                            StatusCode::GATEWAY_TIMEOUT,
                            "the upstream did not answer in time",
                        )
                    } else {
                        local(StatusCode::BAD_GATEWAY, "the upstream failed")
                    };
                }
            }
        };
        b.on_success();
        if let Some(m) = &b.metrics {
            m.answered(start.elapsed());
        }
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            // A 2xx to an extended CONNECT opens the tunnel (RFC 8441 §5, RFC 9220 §3): a
            // backend that answered the upgrade with one did not switch, and the client must
            // not take it for a tunnel.
            if resp.status().is_success() && !matches!(ask, Ask::Http11(_)) {
                tracing::warn!(target: "kuai_http::proxy", backend = %b.name, status = %resp.status(), "WebSocket upgrade answered without switching");
                return local(
                    StatusCode::BAD_GATEWAY,
                    "the upstream did not switch to WebSocket",
                );
            }
            // A refusal (403, 404, 426...) goes back as it is.
            let outstanding = super::body::Outstanding::new(&b);
            return self.downstream(
                resp.map(super::backend::Received::Hyper),
                &b,
                start.elapsed(),
                outstanding,
            );
        }
        let want = accept_for(key.as_bytes());
        // RFC 6455 §4.1: a 101 without `Upgrade: websocket` and `Connection: upgrade`, or
        // with another Accept, is no WebSocket handshake.
        let h = resp.headers();
        if !super::headers::has_token(h, header::UPGRADE, "websocket")
            || !super::headers::has_token(h, header::CONNECTION, "upgrade")
            || h.get(header::SEC_WEBSOCKET_ACCEPT)
                .is_none_or(|a| a.as_bytes() != want.as_bytes())
        {
            tracing::warn!(target: "kuai_http::proxy", backend = %b.name, "WebSocket upgrade answered without its Upgrade, Connection or the right Sec-WebSocket-Accept");
            return local(
                StatusCode::BAD_GATEWAY,
                "the upstream's WebSocket answer is wrong",
            );
        }
        let mut answer = Response::new(ProxyBody::local(Bytes::new()));
        for name in [
            header::SEC_WEBSOCKET_PROTOCOL,
            header::SEC_WEBSOCKET_EXTENSIONS,
        ] {
            if let Some(v) = resp.headers().get(&name) {
                answer.headers_mut().insert(name, v.clone());
            }
        }
        let up = match hyper::upgrade::on(resp).await {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(target: "kuai_http::proxy", backend = %b.name, error = %e, "WebSocket upgrade failed");
                return local(StatusCode::BAD_GATEWAY, "the upstream's upgrade failed");
            }
        };
        // The backend's TCP stream itself (and what hyper read past the 101), so that a
        // tunnel the client aborts is aborted toward the backend too: a TCP RST, not a FIN
        // (RFC 9220 §3: a TCP RST and a stream reset stand for each other).
        let Ok(parts) = up.downcast::<TokioIo<tokio::net::TcpStream>>() else {
            tracing::warn!(target: "kuai_http::proxy", backend = %b.name, "WebSocket upgrade on an unexpected connection type");
            return local(StatusCode::BAD_GATEWAY, "the upstream's upgrade failed");
        };
        let (up, early) = (parts.io.into_inner(), parts.read_buf);
        let idle = self.options.response_timeout;
        let name = b.name.clone();
        // A server shutting down waits for the tunnel, and ends it with its drain timeout.
        let drain = drain.map(|d| d.join());
        match ask {
            Ask::Http3 => {
                // The request body is the client's side of the tunnel, the response body
                // the backend's.
                let (read, write) = up.into_split();
                let activity = Arc::new(Activity::new(hold));
                tokio::spawn(pump_body(body, write, activity.clone(), idle, name, drain));
                *answer.body_mut() = ProxyBody::tunnel(read, early, activity);
                answer
            }
            Ask::Http2(on) => {
                tokio::spawn(splice(on, up, early, idle, name, drain, hold));
                answer
            }
            Ask::Http11(on) => {
                *answer.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
                let h = answer.headers_mut();
                h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
                if let Ok(v) = HeaderValue::from_str(&want) {
                    h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
                }
                tokio::spawn(splice(on, up, early, idle, name, drain, hold));
                answer
            }
        }
    }
}

impl Backend {
    /// Sends an upgrade request on a new connection and waits for the response head.
    pub(super) async fn upgrade(
        &self,
        req: &mut Request<super::body::UpBody>,
        o: &super::Options,
    ) -> Result<Response<hyper::body::Incoming>, super::backend::Reason> {
        use super::backend::Reason;
        let io = self.connect_tcp(o).await?;
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(io)
            .await
            .map_err(Reason::Handshake)?;
        tokio::spawn(conn.with_upgrades());
        // Taken only once connected: a backend that could not be reached leaves it for the
        // next.
        let req = std::mem::replace(req, Request::new(super::body::UpBody::new(Body::empty()).0));
        tokio::time::timeout(o.response_timeout, sender.send_request(req))
            .await
            .map_err(|_| Reason::ResponseTimeout(o.response_timeout))?
            .map_err(Reason::Exchange)
    }
}

/// When a tunnel last moved a byte (milliseconds since its start), and whether it is over.
pub(crate) struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    /// Either side ended the tunnel: an HTTP/3 tunnel's two halves (a task and a response
    /// body) end together.
    over: tokio_util::sync::CancellationToken,
    /// The gateway ended it (idle, the drain over), or the server is shutting down (its
    /// connections close at the drain's end, maybe just before the tunnel's own timer):
    /// no abort toward the backend.
    closing: std::sync::atomic::AtomicBool,
    /// Given back when both halves are gone.
    _hold: Hold,
}

impl Activity {
    fn new(hold: Hold) -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            over: tokio_util::sync::CancellationToken::new(),
            closing: std::sync::atomic::AtomicBool::new(false),
            _hold: hold,
        }
    }

    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Relaxed);
    }

    /// Resolves once nothing moved for `idle`.
    async fn idle(&self, idle: Duration) {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Relaxed));
            let until = last + idle;
            if Instant::now() >= until {
                return;
            }
            tokio::time::sleep_until(until.into()).await;
        }
    }
}

/// The client's bytes (an HTTP/3 request body) to the backend; after the client's end (a
/// half-close, passed on), the backend's side may go on. The tunnel ends when the client's
/// side fails, the backend's side ends (see [`TunnelRead`]), it idles, or the drain ends.
async fn pump_body(
    mut body: Body,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    activity: Arc<Activity>,
    idle: Duration,
    backend: Arc<str>,
    drain: Option<DrainGuard>,
) {
    let copy = async {
        while let Some(frame) = body.frame().await {
            let data = match frame {
                Ok(f) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
                Err(e) => {
                    // The client reset its side: the backend's connection is reset too.
                    abort(to.as_ref());
                    return Err(e.to_string());
                }
            };
            activity.touch();
            to.write_all(&data).await.map_err(|e| e.to_string())?;
        }
        to.shutdown().await.map_err(|e| e.to_string())
    };
    let copy = async {
        if let Err(e) = copy.await {
            tracing::debug!(target: "kuai_http::proxy", %backend, error = e, "WebSocket tunnel ended");
            return;
        }
        std::future::pending().await
    };
    tokio::select! {
        () = copy => {}
        () = activity.over.cancelled() => {}
        _ = activity.idle(idle) => {
            tracing::debug!(target: "kuai_http::proxy", %backend, "WebSocket tunnel idle: closed");
            activity.closing.store(true, Relaxed);
        }
        _ = async {
            if let Some(d) = &drain {
                d.begun().await;
                activity.closing.store(true, Relaxed);
            }
            drain_over(&drain).await
        } => {
            tracing::debug!(target: "kuai_http::proxy", %backend, "WebSocket tunnel closed at the end of the drain");
        }
    }
    // The backend's side (the response body) ends too.
    activity.over.cancel();
    // Dropping a write half would shut it down (a FIN) ahead of an abort's RST: the socket
    // closes with the read half instead.
    to.forget();
}

/// When the server's drain is over (never for a tunnel outside a server's drain).
async fn drain_over(drain: &Option<DrainGuard>) {
    match drain {
        Some(d) => d.over().await,
        None => std::future::pending().await,
    }
}

/// Makes the backend's connection end with a TCP RST when it closes: the tunnel was aborted
/// on the client's side (RFC 9220 §3: a TCP RST and a stream reset stand for each other).
fn abort(tcp: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(tcp).set_linger(Some(Duration::ZERO));
}

/// Bytes both ways between the client's upgraded connection (HTTP/2 stream or HTTP/1.1
/// connection) and the backend's (`early`: what came after its 101), until either ends or
/// the tunnel idles. A failure on either side resets the backend's connection.
#[allow(clippy::too_many_arguments)]
async fn splice(
    client: hyper::upgrade::OnUpgrade,
    mut up: tokio::net::TcpStream,
    early: Bytes,
    idle: Duration,
    backend: Arc<str>,
    drain: Option<DrainGuard>,
    hold: Hold,
) {
    let client = match client.await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(target: "kuai_http::proxy", %backend, error = %e, "client upgrade failed");
            abort(&up);
            return;
        }
    };
    let activity = Arc::new(Activity::new(hold));
    let mut client = Watched {
        io: TokioIo::new(client),
        activity: activity.clone(),
    };
    let tunnel = async {
        if !early.is_empty() {
            client.write_all(&early).await?;
        }
        tokio::io::copy_bidirectional(&mut client, &mut up).await
    };
    tokio::select! {
        r = tunnel => if let Err(e) = r {
            tracing::debug!(target: "kuai_http::proxy", %backend, error = %e, "WebSocket tunnel ended");
            abort(&up);
        },
        _ = activity.idle(idle) => {
            tracing::debug!(target: "kuai_http::proxy", %backend, "WebSocket tunnel idle: closed");
        }
        _ = drain_over(&drain) => {
            tracing::debug!(target: "kuai_http::proxy", %backend, "WebSocket tunnel closed at the end of the drain");
        }
    }
}

/// An I/O object that notes when bytes move through it.
struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = ready!(Pin::new(&mut self.io).poll_read(cx, buf));
        if buf.filled().len() > before {
            self.activity.touch();
        }
        Poll::Ready(r)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = ready!(Pin::new(&mut self.io).poll_write(cx, buf));
        if matches!(r, Ok(n) if n > 0) {
            self.activity.touch();
        }
        Poll::Ready(r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The backend's side of an HTTP/3 tunnel, as a response body: it ends when the backend's
/// side ends, or when the client's side ([`pump_body`]) ends the tunnel.
pub(crate) struct TunnelRead {
    read: tokio::net::tcp::OwnedReadHalf,
    /// What the backend sent right after its 101, read with the head.
    early: Option<Bytes>,
    /// The backend ended its side (a FIN).
    ended: bool,
    activity: Arc<Activity>,
    buf: BytesMut,
    over: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl Drop for TunnelRead {
    fn drop(&mut self) {
        // Dropped before the backend's end, and not by the gateway's own timers: the
        // client abandoned the response (STOP_SENDING, a reset, its connection gone).
        if !self.ended && !self.activity.closing.load(Relaxed) {
            abort(self.read.as_ref());
        }
        self.activity.over.cancel();
    }
}

impl TunnelRead {
    pub(crate) fn new(
        read: tokio::net::tcp::OwnedReadHalf,
        early: Bytes,
        activity: Arc<Activity>,
    ) -> Self {
        let over = Box::pin(activity.over.clone().cancelled_owned());
        Self {
            read,
            early: (!early.is_empty()).then_some(early),
            ended: false,
            activity,
            buf: BytesMut::new(),
            over,
        }
    }

    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if self.over.as_mut().poll(cx).is_ready() {
            // Ended from the client's side: the stream is reset, not finished, since the
            // backend did not end it.
            return Poll::Ready(Some(Err(Error::Io(
                std::io::ErrorKind::ConnectionAborted.into(),
            ))));
        }
        if let Some(early) = self.early.take() {
            self.activity.touch();
            return Poll::Ready(Some(Ok(Frame::data(early))));
        }
        if self.buf.capacity() < 4096 {
            self.buf.reserve(16 * 1024);
        }
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.read),
            cx,
            &mut self.buf
        ));
        Poll::Ready(match n {
            Ok(0) => {
                self.ended = true;
                self.activity.over.cancel();
                None
            }
            Ok(_) => {
                self.activity.touch();
                Some(Ok(Frame::data(self.buf.split().freeze())))
            }
            Err(e) => Some(Err(Error::Io(e))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6455 §1.3's example key and answer; RFC 4648 §10's base64 vectors.
    #[test]
    fn accept_and_base64() {
        assert_eq!(
            accept_for(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(raw.as_bytes()), enc);
        }
    }

    /// One tunnel per client address: an address's ports share its count, an IPv6 /64 too,
    /// but clients from a proxy in front count by address and port.
    #[test]
    fn tunnels_are_counted_per_client_or_per_proxied_flow() {
        let lb: std::net::IpAddr = "10.0.0.10".parse().unwrap();
        let o = super::super::Proxy::builder()
            .max_websockets(100, 1)
            .proxies(vec![lb])
            .options;
        let tunnels = Arc::new(Tunnels::default());
        let at = |s: &str| Some(s.parse::<std::net::SocketAddr>().unwrap());
        let a = tunnels.take(at("192.0.2.1:1000"), &o).expect("first");
        assert!(tunnels.take(at("192.0.2.1:2000"), &o).is_none());
        let v6 = tunnels.take(at("[2001:db8::1]:1000"), &o).expect("v6");
        assert!(tunnels.take(at("[2001:db8::2]:1000"), &o).is_none());
        let p1 = tunnels.take(at("10.0.0.10:40000"), &o).expect("proxied");
        let p2 = tunnels
            .take(at("[::ffff:10.0.0.10]:40001"), &o)
            .expect("another flow");
        assert!(tunnels.take(at("10.0.0.10:40000"), &o).is_none());
        drop((a, v6, p1, p2));
        assert!(tunnels.take(at("192.0.2.1:2000"), &o).is_some());
        // A proxied flow takes a few at most, whatever the per-address cap.
        let o = super::super::Proxy::builder()
            .max_websockets(1000, 512)
            .proxies(vec![lb])
            .options;
        let held: Vec<_> = (0..PER_PROXIED_FLOW)
            .map(|_| {
                tunnels
                    .take(at("10.0.0.10:40002"), &o)
                    .expect("within the cap")
            })
            .collect();
        assert!(tunnels.take(at("10.0.0.10:40002"), &o).is_none());
        drop(held);
    }
}
