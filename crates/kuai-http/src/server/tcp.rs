//! HTTP/2 and HTTP/1.1 over TLS 1.3 on TCP (hyper and rustls) in front of the service, with
//! the limits that keep idle, slow and stalled clients from holding the server's sockets and
//! memory.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::{ALPN_H2, AccessLog, ConnInfo, Limits, Protocol, ReplyBody, Shared, TaskGuard};
use crate::{Body, BoxError};
use kuai::kuai_proto::address_key;

/// HTTP/2 receive windows: what a client may send on a stream (and on the connection) that
/// the service has not read yet. 256 KiB per stream carries an upload at 20 Mbit/s over a
/// 100 ms path; the connection's 1 MiB bounds what one client parks in the server.
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONNECTION_WINDOW: u32 = 1 << 20;
/// Response bytes a connection may hold made but not yet written to its socket (in hyper's
/// and h2's buffers); past it its responses wait for the client to read.
const RESPONSE_BUFFER: u64 = 256 * 1024;
/// What a connection gets past [`Limits::tcp_memory_budget`]: HTTP/2's default windows
/// (RFC 9113 §6.9.2) and a quarter of the response buffer.
const SMALL_H2_WINDOW: u32 = 65_535;
const SMALL_RESPONSE_BUFFER: u64 = 64 * 1024;

/// The memory a connection is granted once its protocol is known: HTTP/2 receive windows
/// (request data the client may send before the service reads it) and the response buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Grant {
    stream_window: u32,
    connection_window: u32,
    response_buffer: u64,
}

impl Grant {
    fn full(h2: bool) -> Self {
        Self {
            stream_window: if h2 { H2_STREAM_WINDOW } else { 0 },
            connection_window: if h2 { H2_CONNECTION_WINDOW } else { 0 },
            response_buffer: RESPONSE_BUFFER,
        }
    }

    fn small(h2: bool) -> Self {
        Self {
            stream_window: if h2 { SMALL_H2_WINDOW } else { 0 },
            connection_window: if h2 { SMALL_H2_WINDOW } else { 0 },
            response_buffer: SMALL_RESPONSE_BUFFER,
        }
    }

    /// What the grant lets a connection hold at most: the connection window bounds every
    /// stream's request data together.
    fn bytes(self) -> u64 {
        u64::from(self.connection_window) + self.response_buffer
    }
}

/// How long an HTTP/2 connection closed for idleness has to finish after its GOAWAY.
const H2_GOAWAY_GRACE: Duration = Duration::from_secs(5);

/// Milliseconds since the server started: connection timestamps fit in atomics.
#[derive(Clone, Copy)]
struct Clock(tokio::time::Instant);

impl Clock {
    fn now(self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }

    fn instant(self, ms: u64) -> tokio::time::Instant {
        self.0 + Duration::from_millis(ms)
    }
}

const NEVER: u64 = u64::MAX;

/// What the watchdog of one connection needs to know, updated by its requests and reads.
struct ConnState {
    clock: Clock,
    /// The client's address as the per-address cap counts it ([`address_key`]: an IPv4
    /// address or an IPv6 /64).
    ip: IpAddr,
    /// Requests whose response is not finished.
    active: AtomicUsize,
    /// Requests begun so far.
    requests: AtomicU64,
    /// When the TLS handshake ended or, after that, the last response finished.
    idle_since: AtomicU64,
    /// When the first byte after `idle_since` was read (the next HTTP/1.1 head began).
    head_started: AtomicU64,
    /// When the connection last moved while a request is in flight: a response body gave
    /// data, bytes went out or came in.
    progress: AtomicU64,
    /// Request bodies a service is reading and waiting for more of (see
    /// [`Body::watched`]).
    body_waits: Arc<AtomicUsize>,
    /// Response body bytes handed to hyper, and those hyper wrote to the TLS stream (HTTP/2:
    /// DATA payload only; HTTP/1.1: every byte, never counted past `produced`, so heads and
    /// chunk framing do not make room): the difference is what waits in hyper's and h2's
    /// buffers.
    produced: AtomicU64,
    written: AtomicU64,
    /// The response buffer granted (see [`Grant`]); past it responses wait.
    response_buffer: AtomicU64,
    /// Response bodies waiting for `buffered()` to fall under the response buffer.
    drained: Mutex<Vec<std::task::Waker>>,
    /// A request began or ended, or a head began: the deadline moved.
    changed: Notify,
    /// Closed to make room for a new connection.
    evict: Notify,
    /// HTTP/2: bytes either way are not a response's progress (the server's keep-alive
    /// PINGs and the client's answers pass while a client lets no response through).
    h2: AtomicBool,
    /// Response bodies whose last poll gave data and that have not been polled since:
    /// hyper's HTTP/2 polls a body only when its stream's window has room, so a body that
    /// stays here waits on the client's WINDOW_UPDATE.
    awaiting_window: AtomicUsize,
    /// HTTP/1.1 upgraded (a 101 went out): the socket is the service's now, busy for as long
    /// as it keeps it, and still counted against the caps until it closes.
    upgraded: AtomicBool,
}

/// Why the watchdog closes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expiry {
    /// No complete first request within the header timeout of the handshake.
    FirstRequest,
    /// A later HTTP/1.1 head not complete within the header timeout of its first byte.
    Header,
    /// No request for the idle timeout after the last response.
    Idle,
    /// A response made no progress for the send timeout.
    Send,
}

impl ConnState {
    fn new(clock: Clock, ip: IpAddr) -> Self {
        let now = clock.now();
        Self {
            clock,
            ip,
            active: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            idle_since: AtomicU64::new(now),
            head_started: AtomicU64::new(NEVER),
            progress: AtomicU64::new(now),
            body_waits: Arc::new(AtomicUsize::new(0)),
            produced: AtomicU64::new(0),
            written: AtomicU64::new(0),
            response_buffer: AtomicU64::new(RESPONSE_BUFFER),
            drained: Mutex::new(Vec::new()),
            changed: Notify::new(),
            evict: Notify::new(),
            h2: AtomicBool::new(false),
            awaiting_window: AtomicUsize::new(0),
            upgraded: AtomicBool::new(false),
        }
    }

    /// The time (clock milliseconds) the connection is closed at unless something happens
    /// first, and why.
    fn deadline(&self, l: &Limits, h2: bool) -> (u64, Expiry) {
        let ms = |d: Duration| d.as_millis() as u64;
        if self.active.load(Relaxed) > 0 {
            return (
                self.progress
                    .load(Relaxed)
                    .saturating_add(ms(l.send_timeout)),
                Expiry::Send,
            );
        }
        let idle_since = self.idle_since.load(Relaxed);
        if self.requests.load(Relaxed) == 0 {
            return (
                idle_since.saturating_add(ms(l.header_timeout)),
                Expiry::FirstRequest,
            );
        }
        let head = self.head_started.load(Relaxed);
        if !h2 && head != NEVER {
            return (head.saturating_add(ms(l.header_timeout)), Expiry::Header);
        }
        (idle_since.saturating_add(ms(l.idle_timeout)), Expiry::Idle)
    }

    /// Whether the connection waits on the client: response bytes it has not taken, or a
    /// request body a service reads that does not come. Only then does the send timeout
    /// close it; a service taking its time to answer, or a stream with nothing to send
    /// (a long poll, a quiet event stream), is not the client's stall.
    fn waits_on_client(&self) -> bool {
        self.buffered() > 0
            || self.body_waits.load(Relaxed) > 0
            || self.awaiting_window.load(Relaxed) > 0
    }

    /// Response bytes produced and not yet written out.
    fn buffered(&self) -> u64 {
        self.produced
            .load(Relaxed)
            .saturating_sub(self.written.load(Relaxed))
    }

    /// `n` bytes of responses went to the TLS stream (HTTP/2: of DATA payload): wakes the
    /// bodies waiting for room.
    fn on_written(&self, n: u64) {
        if self.active.load(Relaxed) > 0 && !self.h2.load(Relaxed) {
            self.progress.store(self.clock.now(), Relaxed);
        }
        let produced = self.produced.load(Relaxed);
        let _ = self.written.fetch_update(Relaxed, Relaxed, |w| {
            Some(w.saturating_add(n).min(produced.max(w)))
        });
        if self.buffered() < self.response_buffer.load(Relaxed) {
            let waiting =
                std::mem::take(&mut *self.drained.lock().unwrap_or_else(|e| e.into_inner()));
            for w in waiting {
                w.wake();
            }
        }
    }

    /// Whether a response body may make more data now; if not, `cx` is woken when it may.
    fn room(&self, cx: &Context<'_>) -> bool {
        let limit = self.response_buffer.load(Relaxed);
        if self.buffered() < limit {
            return true;
        }
        let mut waiting = self.drained.lock().unwrap_or_else(|e| e.into_inner());
        if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
            waiting.push(cx.waker().clone());
        }
        // Written out meanwhile: no wake-up would come.
        self.buffered() < limit
    }

    /// Bytes arrived from the client.
    fn on_read(&self) {
        if self.active.load(Relaxed) > 0 {
            if !self.h2.load(Relaxed) {
                self.progress.store(self.clock.now(), Relaxed);
            }
        } else if self.head_started.load(Relaxed) == NEVER {
            self.head_started.store(self.clock.now(), Relaxed);
            self.changed.notify_one();
        }
    }
}

/// Marks a request in flight from its head to the end of its response (dropped with the
/// response body).
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn new(state: &Arc<ConnState>) -> Self {
        let now = state.clock.now();
        state.progress.store(now, Relaxed);
        state.head_started.store(NEVER, Relaxed);
        state.requests.fetch_add(1, Relaxed);
        state.active.fetch_add(1, Relaxed);
        state.changed.notify_one();
        Self(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let s = &self.0;
        s.idle_since.store(s.clock.now(), Relaxed);
        s.head_started.store(NEVER, Relaxed);
        s.active.fetch_sub(1, Relaxed);
        s.changed.notify_one();
    }
}

/// A response body that tells the watchdog when the client takes data, and writes the
/// request's access-log line when it is dropped (sent, or abandoned).
struct Tracked {
    body: ReplyBody,
    request: InFlight,
    log: AccessLog,
    /// Counted in [`ConnState::awaiting_window`]: its last poll gave data.
    gave: bool,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.gave {
            self.request.0.awaiting_window.fetch_sub(1, Relaxed);
        }
        self.log.write();
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let s = &this.request.0;
        if std::mem::take(&mut this.gave) {
            s.awaiting_window.fetch_sub(1, Relaxed);
        }
        // Past its response buffer the connection's responses wait for the client to read (and
        // make no progress, for the send timeout).
        if !s.room(cx) {
            return Poll::Pending;
        }
        let r = Pin::new(&mut this.body).poll_frame(cx);
        // Progress when the body gives something: a poll that finds nothing (every wake of
        // the connection's task polls it again) is none.
        if r.is_ready() {
            s.progress.store(s.clock.now(), Relaxed);
        }
        if let Poll::Ready(Some(Ok(frame))) = &r
            && let Some(data) = frame.data_ref()
        {
            s.produced.fetch_add(data.len() as u64, Relaxed);
            this.log.bytes += data.len() as u64;
            if !data.is_empty() {
                this.gave = true;
                s.awaiting_window.fetch_add(1, Relaxed);
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The TLS stream of a connection, telling the watchdog when bytes arrive.
struct Watched {
    io: tokio_rustls::server::TlsStream<TcpStream>,
    state: Arc<ConnState>,
    /// The connection's place among the connections and its memory grant, given back when
    /// the socket goes: with the connection's task, or, once upgraded (a WebSocket), with
    /// the service's handle on it.
    _held: (Admitted, Granted),
    /// HTTP/2: the frames written, read to count only DATA payload as a response's bytes
    /// written (PING and SETTINGS acknowledgments, headers and frame headers went out while
    /// DATA waited for the client's window, and counted as though the stuck data had gone,
    /// making room for more).
    h2_frames: Option<H2Frames>,
}

/// Follows the HTTP/2 frames (RFC 9113 §4.1) in what the server writes.
#[derive(Default)]
struct H2Frames {
    /// A frame header being read, and how much of it has come.
    header: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to come, and whether it is DATA.
    left: usize,
    data: bool,
}

impl H2Frames {
    /// The DATA payload bytes among `bytes`, the next bytes written.
    fn data_in(&mut self, mut bytes: &[u8]) -> u64 {
        let mut n = 0;
        while !bytes.is_empty() {
            if self.left == 0 {
                let take = (9 - self.have).min(bytes.len());
                self.header[self.have..self.have + take].copy_from_slice(&bytes[..take]);
                self.have += take;
                bytes = &bytes[take..];
                if self.have == 9 {
                    let h = self.header;
                    self.left = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                    self.data = h[3] == 0;
                    self.have = 0;
                }
                continue;
            }
            let take = self.left.min(bytes.len());
            if self.data {
                n += take as u64;
            }
            self.left -= take;
            bytes = &bytes[take..];
        }
        n
    }

    /// The DATA payload bytes among the first `n` bytes of `bufs`.
    fn data_in_slices(&mut self, bufs: &[io::IoSlice<'_>], mut n: usize) -> u64 {
        let mut data = 0;
        for b in bufs {
            if n == 0 {
                break;
            }
            let take = n.min(b.len());
            data += self.data_in(&b[..take]);
            n -= take;
        }
        data
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.state.on_read();
        }
        r
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            let n = match &mut this.h2_frames {
                Some(f) => f.data_in(&buf[..n]),
                None => n as u64,
            };
            this.state.on_written(n);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            let n = match &mut this.h2_frames {
                Some(f) => f.data_in_slices(bufs, n),
                None => n as u64,
            };
            this.state.on_written(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The connections the server holds, oldest first, for the caps.
struct Conns {
    held: Mutex<Held>,
    next: AtomicU64,
    clock: Clock,
    /// Bytes granted to the connections ([`Grant::bytes`]), against
    /// [`Limits::tcp_memory_budget`].
    granted: AtomicU64,
}

#[derive(Default)]
struct Held {
    by_age: BTreeMap<u64, Arc<ConnState>>,
    /// Connections held per client address ([`address_key`]).
    per_address: HashMap<IpAddr, usize>,
}

impl Held {
    fn take(&mut self, id: u64) -> Option<Arc<ConnState>> {
        let c = self.by_age.remove(&id)?;
        if let Some(n) = self.per_address.get_mut(&c.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&c.ip);
            }
        }
        Some(c)
    }

    /// Closes the oldest connection with no request in flight (from `ip` only, if given);
    /// false when there is none.
    fn evict_oldest_idle(&mut self, ip: Option<IpAddr>) -> bool {
        let Some(id) = self
            .by_age
            .iter()
            .find(|(_, c)| {
                ip.is_none_or(|ip| c.ip == ip)
                    && c.active.load(Relaxed) == 0
                    && !c.upgraded.load(Relaxed)
            })
            .map(|(&id, _)| id)
        else {
            return false;
        };
        if let Some(c) = self.take(id) {
            c.evict.notify_one();
        }
        true
    }
}

impl Conns {
    fn new() -> Self {
        Self {
            held: Mutex::new(Held::default()),
            next: AtomicU64::new(0),
            clock: Clock(tokio::time::Instant::now()),
            granted: AtomicU64::new(0),
        }
    }

    /// The full grant for a connection while the connections' grants stay within `budget`,
    /// the small one past it; counted until the returned guard drops. Connections already
    /// open keep what they were granted (HTTP/2 credit is never taken back, RFC 9113 §6.9).
    fn grant(self: &Arc<Self>, budget: u64, h2: bool) -> (Grant, Granted) {
        let full = Grant::full(h2);
        let g = match self.granted.fetch_update(Relaxed, Relaxed, |used| {
            let after = used.saturating_add(full.bytes());
            (after <= budget).then_some(after)
        }) {
            Ok(_) => full,
            Err(_) => {
                let small = Grant::small(h2);
                self.granted.fetch_add(small.bytes(), Relaxed);
                small
            }
        };
        (g, Granted(self.clone(), g.bytes()))
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a new connection from `remote` in: its id and state, or `None` when it must be
    /// refused. A client address at its cap makes room among its own connections, so one
    /// address cannot push everyone else's out.
    fn admit(&self, l: &Limits, remote: IpAddr) -> Option<(u64, Arc<ConnState>)> {
        let ip = address_key(remote);
        let mut h = self.held();
        let mine = h.per_address.get(&ip).copied().unwrap_or(0);
        if mine >= l.max_connections_per_address.max(1) {
            if !h.evict_oldest_idle(Some(ip)) {
                return None;
            }
        } else if h.by_age.len() >= l.max_connections.max(1) && !h.evict_oldest_idle(None) {
            return None;
        }
        let id = self.next.fetch_add(1, Relaxed);
        let state = Arc::new(ConnState::new(self.clock, ip));
        h.by_age.insert(id, state.clone());
        *h.per_address.entry(ip).or_insert(0) += 1;
        Some((id, state))
    }

    fn remove(&self, id: u64) {
        self.held().take(id);
    }
}

/// Takes a connection out of [`Conns`] when it ends.
struct Admitted(Arc<Conns>, u64);

/// Gives a connection's [`Grant`] back when it ends.
struct Granted(Arc<Conns>, u64);

impl Drop for Granted {
    fn drop(&mut self) {
        self.0.granted.fetch_sub(self.1, Relaxed);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.remove(self.1);
    }
}

/// Accepts TCP connections and serves HTTP/1.1 or HTTP/2 (by ALPN) within the limits,
/// until a shutdown begins.
pub(super) async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
    _guard: TaskGuard,
) {
    serve_with(listener, tls, shared, Arc::new(Conns::new())).await
}

async fn serve_with(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
    conns: Arc<Conns>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let (sock, remote) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::warn!(error = %e, "TCP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shared.shutting_down() => return,
        };
        let Some((id, state)) = conns.admit(&shared.limits, remote.ip()) else {
            // Every connection it could replace has a request in flight: this one is closed
            // at once, so the client can go elsewhere or retry, rather than wait unanswered.
            tracing::debug!(%remote, "at a connection cap with no idle connection: refused");
            continue;
        };
        let _ = sock.set_nodelay(true);
        let acceptor = acceptor.clone();
        let shared = shared.clone();
        let conns = conns.clone();
        let guard = shared.tasks.guard();
        tokio::spawn(async move {
            let _guard = guard;
            let admitted = Admitted(conns.clone(), id);
            serve_connection(sock, remote, acceptor, &shared, &conns, state, admitted).await;
        });
    }
}

/// How long a new connection's output is corked after its TLS handshake.
const FIRST_BURST: Duration = Duration::from_millis(2);

/// The first burst of an HTTP/2 connection after the handshake (its SETTINGS, the
/// acknowledgment of the client's, then the first response's HEADERS and DATA) is written in
/// several small pieces. With TCP_NODELAY each leaves as its own segment, and Linux's initial
/// window counts segments (10): a 10 KB response behind them waited a round trip for
/// acknowledgments, so an HTTP/2 fetch on a new connection took 4 round trips where
/// HTTP/1.1 took 3. Corking the socket for [`FIRST_BURST`] sends that burst in full
/// segments; afterwards TCP_NODELAY alone applies. (Linux holds corked data 200 ms at most.)
#[cfg(target_os = "linux")]
fn cork_first_burst(sock: &TcpStream) {
    let Ok(fd) = std::os::fd::AsFd::as_fd(sock).try_clone_to_owned() else {
        return;
    };
    let s = socket2::Socket::from(fd);
    if s.set_tcp_cork(true).is_err() {
        return;
    }
    tokio::spawn(async move {
        tokio::time::sleep(FIRST_BURST).await;
        let _ = s.set_tcp_cork(false);
    });
}

#[cfg(not(target_os = "linux"))]
fn cork_first_burst(_: &TcpStream) {}

async fn serve_connection(
    sock: TcpStream,
    remote: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: &Arc<Shared>,
    conns: &Arc<Conns>,
    state: Arc<ConnState>,
    admitted: Admitted,
) {
    let limits = &shared.limits;
    let handshake = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(sock));
    let tls = tokio::select! {
        r = handshake => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(%remote, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%remote, "TLS handshake timed out");
                return;
            }
        },
        _ = state.evict.notified() => {
            tracing::debug!(%remote, "closed in its TLS handshake to make room");
            return;
        }
    };
    state.idle_since.store(state.clock.now(), Relaxed);
    let h2 = tls.get_ref().1.alpn_protocol() == Some(ALPN_H2);
    state.h2.store(h2, Relaxed);
    let (grant, granted) = conns.grant(limits.tcp_memory_budget, h2);
    state.response_buffer.store(grant.response_buffer, Relaxed);
    if h2 {
        // HTTP/1.1 writes a response in one piece already.
        cork_first_burst(tls.get_ref().0);
    }
    let info = ConnInfo {
        remote,
        protocol: if h2 {
            Protocol::Http2
        } else {
            Protocol::Http11
        },
    };
    let st = state.clone();
    let sh = shared.clone();
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        if h2 {
            join_cookies(req.headers_mut());
        }
        let shared = sh.clone();
        let request = InFlight::new(&st);
        if h2 && req.method() == http::Method::CONNECT {
            // The tunnel keeps the connection busy after its response (see `Busy`).
            req.extensions_mut()
                .insert(super::Busy(Arc::new(InFlight::new(&st))));
        }
        let waits = st.body_waits.clone();
        let conn_state = st.clone();
        async move {
            let mut log = AccessLog::new(&shared, info, req.method().clone(), req.uri(), false);
            let limit = shared.limits.max_request_body;
            // A tunnel (extended CONNECT, RFC 8441) may be quiet both ways for as long as
            // its ends like: its request body is not one the client owes.
            let tunnel = req.method() == http::Method::CONNECT;
            // HTTP/2: a stalled body ends its own request (the connection's other
            // streams go on); HTTP/1.1: the connection waits on the client, and its
            // watchdog closes it.
            let stall = shared.limits.send_timeout;
            let resp = shared
                .respond(
                    req.map(|b| {
                        let b = Body::hyper(b, limit);
                        match (tunnel, h2) {
                            (true, _) => b,
                            (false, true) => b.stall_limit(stall),
                            (false, false) => b.watched(waits),
                        }
                    }),
                    info,
                )
                .await;
            log.response(&resp);
            if !h2 && resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                // Not idle from now on: never closed to make room for another.
                conn_state.upgraded.store(true, Relaxed);
            }
            Ok::<_, Infallible>(resp.map(|body| Tracked {
                body,
                request,
                log,
                gave: false,
            }))
        }
    });
    let io = TokioIo::new(Watched {
        io: tls,
        state: state.clone(),
        _held: (admitted, granted),
        h2_frames: h2.then(H2Frames::default),
    });
    if h2 {
        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.h2_max_concurrent_streams)
            .keep_alive_interval(limits.h2_keepalive_interval)
            .keep_alive_timeout(limits.h2_keepalive_timeout)
            .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX))
            .initial_stream_window_size(grant.stream_window)
            .initial_connection_window_size(grant.connection_window)
            // Extended CONNECT (RFC 8441): WebSockets over HTTP/2.
            .enable_connect_protocol()
            .serve_connection(io, svc);
        watch(
            conn,
            |c| c.graceful_shutdown(),
            &state,
            shared,
            true,
            remote,
        )
        .await;
    } else {
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            // hyper's own header timer starts when it begins waiting for a head, which on a
            // kept-alive connection includes the idle time: the watchdog times the two apart.
            .header_read_timeout(None)
            .max_headers(limits.max_headers)
            .max_header_size(limits.max_header_size)
            .serve_connection(io, svc)
            // `Upgrade: websocket` (RFC 6455 §4) for services that take it.
            .with_upgrades();
        watch(
            conn,
            |c| c.graceful_shutdown(),
            &state,
            shared,
            false,
            remote,
        )
        .await;
    }
}

/// Drives a connection until it ends, closing it when its deadline passes (see
/// [`ConnState::deadline`]) or it is evicted. Idle connections are shut down gracefully
/// (HTTP/2 GOAWAY, then `H2_GOAWAY_GRACE` to finish); the others are dropped. When the server
/// shuts down, every connection is shut down gracefully and gets the drain timeout.
async fn watch<C>(
    conn: C,
    shutdown: impl Fn(Pin<&mut C>),
    state: &ConnState,
    shared: &Shared,
    h2: bool,
    remote: SocketAddr,
) where
    C: std::future::Future<Output = Result<(), hyper::Error>>,
{
    let limits = &shared.limits;
    let proto = if h2 { "h2" } else { "http/1.1" };
    tokio::pin!(conn);
    let mut grace: Option<tokio::time::Instant> = None;
    loop {
        let wake = grace.unwrap_or_else(|| state.clock.instant(state.deadline(limits, h2).0));
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%remote, error = %e, "{proto} connection ended");
                }
                return;
            }
            _ = tokio::time::sleep_until(wake) => {
                if grace.is_some() {
                    tracing::debug!(%remote, "{proto} connection did not finish after GOAWAY");
                    return;
                }
                // The deadline may have moved while asleep.
                let (at, why) = state.deadline(limits, h2);
                let now = state.clock.now();
                if at > now {
                    continue;
                }
                // Not waiting on the client: the service's time is not the client's stall.
                // Looked at again a send timeout from now; a response that then sits
                // unread counts from when it was produced.
                if why == Expiry::Send && !state.waits_on_client() {
                    state.progress.store(now, Relaxed);
                    continue;
                }
                tracing::debug!(%remote, ?why, "{proto} connection timed out");
                if why != Expiry::Idle {
                    return;
                }
                shutdown(conn.as_mut());
                grace = Some(tokio::time::Instant::now() + H2_GOAWAY_GRACE);
            }
            // A request began or ended: compute the deadline again.
            _ = state.changed.notified(), if grace.is_none() => {}
            _ = state.evict.notified() => {
                tracing::debug!(%remote, "{proto} connection closed to make room");
                return;
            }
            _ = shared.shutting_down(), if grace.is_none() => {
                shutdown(conn.as_mut());
                grace = Some(tokio::time::Instant::now() + limits.drain_timeout);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The TCP server's limits on real loopback sockets, with its timeouts made short
    //! through the same settings `kuai server` takes from its flags.

    use super::*;
    use crate::server::tests::{
        Sender, Stalled, TestBody, TestSite, Tls, empty, identity, request, tls_to,
    };
    use crate::server::{ALPN_H1, Server};
    use http_body_util::BodyExt;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Srv {
        addr: SocketAddr,
        cert: rustls::pki_types::CertificateDer<'static>,
        conns: Arc<Conns>,
    }

    /// The two TCP protocols.
    #[derive(Clone, Copy, Debug)]
    enum Proto {
        H1,
        H2,
    }

    fn short_limits() -> Limits {
        Limits {
            max_connections: 1000,
            handshake_timeout: Duration::from_millis(400),
            header_timeout: Duration::from_millis(400),
            idle_timeout: Duration::from_millis(1000),
            send_timeout: Duration::from_millis(600),
            h2_max_concurrent_streams: 7,
            h2_keepalive_interval: None,
            h2_keepalive_timeout: Duration::from_secs(20),
            max_header_size: 8 * 1024,
            max_headers: 20,
            ..Limits::default()
        }
    }

    async fn start(limits: Limits) -> Srv {
        let (cert, mut tls) = identity();
        tls.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_H1.to_vec()];
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(Conns::new());
        let shared = Server::new(TestSite { dir: None })
            .limits(limits)
            .into_shared(addr.port());
        tokio::spawn(serve_with(listener, Arc::new(tls), shared, conns.clone()));
        Srv { addr, cert, conns }
    }

    impl Srv {
        async fn tls(&self, alpn: &[u8]) -> Tls {
            tls_to(self.addr, &self.cert, alpn).await
        }

        /// One GET /hello.txt; the body.
        async fn fetch(&self, proto: Proto) -> Result<Vec<u8>, String> {
            let alpn = match proto {
                Proto::H1 => ALPN_H1,
                Proto::H2 => ALPN_H2,
            };
            let mut c = Sender::connect(self.addr, &self.cert, alpn).await;
            let req = request(alpn, self.addr.port(), "/hello.txt")
                .body(empty())
                .unwrap();
            let resp = c.try_send(req).await.map_err(|e| e.to_string())?;
            if resp.status() != http::StatusCode::OK {
                return Err(format!("status {}", resp.status()));
            }
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            Ok(body.to_bytes().to_vec())
        }
    }

    /// Waits up to `limit` for the peer to close `s` (EOF or an error on read); the time it
    /// took, or `None` if it stayed open. Whatever arrives before is discarded.
    async fn closed_within<S: AsyncRead + Unpin>(s: &mut S, limit: Duration) -> Option<Duration> {
        let t = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let left = limit.checked_sub(t.elapsed())?;
            match tokio::time::timeout(left, s.read(&mut buf)).await {
                Err(_) => return None,
                Ok(Ok(0)) | Ok(Err(_)) => return Some(t.elapsed()),
                Ok(Ok(_)) => {}
            }
        }
    }

    /// A TCP connection that never starts TLS is closed after the handshake timeout.
    #[tokio::test]
    async fn a_connection_that_never_starts_tls_is_closed() {
        let srv = start(short_limits()).await;
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        let t = closed_within(&mut s, Duration::from_secs(5)).await;
        let t = t.expect("still open after 5 s");
        eprintln!("closed after {t:?}");
        assert!(t >= Duration::from_millis(300), "closed after {t:?}");
        assert!(t < Duration::from_millis(1500), "closed after {t:?}");
    }

    /// A TLS connection that sends no request is closed after the header timeout.
    #[tokio::test]
    async fn an_idle_tls_connection_is_closed() {
        let srv = start(short_limits()).await;
        for alpn in [ALPN_H1, ALPN_H2] {
            let mut s = srv.tls(alpn).await;
            if alpn == ALPN_H2 {
                // The client preface and SETTINGS, then nothing.
                s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
                    .await
                    .unwrap();
            }
            let t = closed_within(&mut s, Duration::from_secs(5)).await;
            let t = t.unwrap_or_else(|| panic!("{alpn:?}: still open after 5 s"));
            eprintln!("{}: closed after {t:?}", String::from_utf8_lossy(alpn));
            assert!(
                t >= Duration::from_millis(300),
                "{alpn:?}: closed after {t:?}"
            );
            assert!(
                t < Duration::from_millis(1500),
                "{alpn:?}: closed after {t:?}"
            );
        }
    }

    /// Slowloris: a request head sent a byte every 50 ms is cut off at the header timeout
    /// (400 ms), however long it goes on.
    #[tokio::test]
    async fn a_header_sent_a_byte_at_a_time_is_cut_off() {
        let srv = start(short_limits()).await;
        let mut s = srv.tls(ALPN_H1).await;
        let head = b"GET /hello.txt HTTP/1.1\r\nhost: localhost\r\nx-slow: ";
        let t = Instant::now();
        let mut buf = [0u8; 1024];
        let mut closed = None;
        for i in 0..100usize {
            let byte = head.get(i).copied().unwrap_or(b'a');
            if s.write_all(&[byte]).await.is_err() {
                closed = Some(t.elapsed());
                break;
            }
            match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = Some(t.elapsed());
                    break;
                }
                Ok(Ok(_)) | Err(_) => {}
            }
        }
        let t = closed.expect("still open after 100 bytes at one per 50 ms");
        eprintln!("closed after {t:?}");
        assert!(t >= Duration::from_millis(300), "closed after {t:?}");
        assert!(t < Duration::from_millis(1500), "closed after {t:?}");
    }

    /// HTTP/1.1 keep-alive: after a response, the connection may wait for the next request
    /// for the idle timeout (1 s, longer than the header timeout), then it is closed.
    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed() {
        let srv = start(short_limits()).await;
        let mut s = srv.tls(ALPN_H1).await;
        s.write_all(b"GET /hello.txt HTTP/1.1\r\nhost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"over QUIC\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed before the response: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        let t = closed_within(&mut s, Duration::from_secs(5)).await;
        let t = t.expect("still open after 5 s");
        eprintln!("closed after {t:?}");
        assert!(t >= Duration::from_millis(800), "closed after {t:?}");
        assert!(t < Duration::from_millis(2500), "closed after {t:?}");
    }

    /// A client that stops reading a response: no progress for the send timeout, and the
    /// connection is closed.
    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off() {
        let srv = start(short_limits()).await;
        let mut s = srv.tls(ALPN_H1).await;
        s.write_all(b"GET /bytes/10000000000 HTTP/1.1\r\nhost: localhost\r\n\r\n")
            .await
            .unwrap();
        // Read a little, then nothing while the socket buffers fill.
        let mut buf = vec![0u8; 16 * 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        // Now read on: the stream ends (after what was buffered) instead of going on to
        // 10 GB.
        let mut total = 0u64;
        let t = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => total += n as u64,
                Err(_) => panic!("stalled"),
            }
            assert!(total < 1 << 30, "the response went on after the stall");
            assert!(t.elapsed() < Duration::from_secs(20));
        }
        eprintln!("{total} bytes after the stall, then the end");
    }

    /// HTTP/2: a client that stops reading (no WINDOW_UPDATE) but answers the server's
    /// keep-alive PINGs, as every HTTP/2 stack does, is cut off after the send timeout:
    /// control frames either way are not a response's progress. (Counted as progress, the
    /// PINGs every 200 ms here kept it open for good.)
    #[tokio::test]
    async fn an_h2_client_that_stops_reading_but_answers_pings_is_cut_off() {
        let srv = start(Limits {
            h2_keepalive_interval: Some(Duration::from_millis(200)),
            ..short_limits()
        })
        .await;
        let io = hyper_util::rt::TokioIo::new(tls_to(srv.addr, &srv.cert, ALPN_H2).await);
        let (mut send, conn) = hyper::client::conn::http2::handshake::<_, _, TestBody>(
            hyper_util::rt::TokioExecutor::new(),
            io,
        )
        .await
        .unwrap();
        let conn = tokio::spawn(conn);
        let req = request(ALPN_H2, srv.addr.port(), "/bytes/10000000000")
            .body(empty())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), http::StatusCode::OK);
        // The body is never read: its window stays shut.
        let t = Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
        assert!(ended.is_ok(), "still open after 5 s");
        eprintln!("closed after {:?}", t.elapsed());
        assert!(
            t.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        drop(resp);
    }

    /// The send timeout (600 ms here) counts only while the connection waits on its
    /// client: a service that takes longer to answer, and a response quiet for longer
    /// between two chunks, are not cut off, over HTTP/1.1 or HTTP/2; a request body that
    /// stops coming while the service reads it is.
    #[tokio::test]
    async fn the_send_timeout_counts_only_while_the_client_is_waited_on() {
        let srv = start(short_limits()).await;
        for proto in [Proto::H1, Proto::H2] {
            let alpn = match proto {
                Proto::H1 => ALPN_H1,
                Proto::H2 => ALPN_H2,
            };
            for (path, len) in [("/wait/1500", 7), ("/quiet/1500", 2 * 65536)] {
                let mut c = Sender::connect(srv.addr, &srv.cert, alpn).await;
                let req = request(alpn, srv.addr.port(), path).body(empty()).unwrap();
                let resp = c.try_send(req).await.unwrap();
                assert_eq!(resp.status(), http::StatusCode::OK, "{proto:?} {path}");
                let body = resp.into_body().collect().await;
                let body = body.unwrap_or_else(|e| panic!("{proto:?} {path}: {e}"));
                assert_eq!(body.to_bytes().len(), len, "{proto:?} {path}");
            }
        }
        // An upload that stops: closed after about the send timeout.
        let mut s = srv.tls(ALPN_H1).await;
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-length: 1000\r\n\r\nsome")
            .await
            .unwrap();
        let t = closed_within(&mut s, Duration::from_secs(5)).await;
        let t = t.expect("a stalled upload still open after 5 s");
        eprintln!("stalled upload closed after {t:?}");
        assert!(t >= Duration::from_millis(500), "closed after {t:?}");
        assert!(t < Duration::from_millis(2500), "closed after {t:?}");
    }

    /// HTTP/2: a request body that stops coming ends its own request after the send
    /// timeout (600 ms here), not the connection: a request on another stream that takes
    /// 1.5 s is answered.
    #[tokio::test]
    async fn an_h2_upload_that_stops_ends_only_its_stream() {
        let srv = start(short_limits()).await;
        let io = hyper_util::rt::TokioIo::new(tls_to(srv.addr, &srv.cert, ALPN_H2).await);
        let (send, conn) = hyper::client::conn::http2::handshake::<_, _, TestBody>(
            hyper_util::rt::TokioExecutor::new(),
            io,
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let port = srv.addr.port();
        let slow = {
            let mut send = send.clone();
            tokio::spawn(async move {
                let req = request(ALPN_H2, port, "/wait/1500").body(empty()).unwrap();
                let resp = send.send_request(req).await.unwrap();
                resp.into_body().collect().await.map(|b| b.to_bytes().len())
            })
        };
        let mut send = send;
        let stalled = Stalled(Some(Bytes::from_static(b"some"))).boxed_unsync();
        let req = request(ALPN_H2, port, "/echo")
            .method(http::Method::POST)
            .header("content-length", "1000")
            .body(stalled)
            .unwrap();
        let t = Instant::now();
        let resp = send.send_request(req).await.unwrap();
        let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
            .await
            .expect("the stalled upload's stream still open after 5 s");
        assert!(body.is_err(), "the echo ended normally");
        assert!(
            t.elapsed() < Duration::from_millis(1400),
            "{:?}",
            t.elapsed()
        );
        let n = slow.await.unwrap().expect("the other stream was cut");
        assert_eq!(n, 7);
    }

    /// Header size and count limits: HTTP/1.1 answers 431 past them; HTTP/2 advertises
    /// SETTINGS_MAX_HEADER_LIST_SIZE and SETTINGS_MAX_CONCURRENT_STREAMS.
    #[tokio::test]
    async fn header_limits_and_h2_settings() {
        let srv = start(short_limits()).await;
        let status_of = |req: Vec<u8>| {
            let srv = &srv;
            async move {
                let mut s = srv.tls(ALPN_H1).await;
                s.write_all(&req).await.unwrap();
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                String::from_utf8_lossy(&buf[..n.min(12)]).into_owned()
            }
        };
        let mut many = b"GET /hello.txt HTTP/1.1\r\nhost: localhost\r\n".to_vec();
        for i in 0..30 {
            many.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(status_of(many).await, "HTTP/1.1 431");
        let mut big = b"GET /hello.txt HTTP/1.1\r\nhost: localhost\r\nx-big: ".to_vec();
        big.extend_from_slice(&[b'a'; 10 * 1024]);
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(status_of(big).await, "HTTP/1.1 431");
        let ok = b"GET /hello.txt HTTP/1.1\r\nhost: localhost\r\n\r\n".to_vec();
        assert_eq!(status_of(ok).await, "HTTP/1.1 200");
        // HTTP/2: the server's SETTINGS frame.
        let mut s = srv.tls(ALPN_H2).await;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let mut hdr = [0u8; 9];
        s.read_exact(&mut hdr).await.unwrap();
        assert_eq!(hdr[3], 0x04, "SETTINGS first");
        let len = u32::from_be_bytes([0, hdr[0], hdr[1], hdr[2]]) as usize;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.unwrap();
        let settings: Vec<(u16, u32)> = payload
            .chunks(6)
            .map(|c| {
                (
                    u16::from_be_bytes([c[0], c[1]]),
                    u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                )
            })
            .collect();
        assert!(settings.contains(&(0x3, 7)), "{settings:?}");
        assert!(settings.contains(&(0x6, 8 * 1024)), "{settings:?}");
    }

    /// HTTP/2 keep-alive: a peer that answers nothing (here, not even PINGs) is closed after
    /// the ping interval and timeout, well before the other timeouts.
    #[tokio::test]
    async fn an_h2_peer_that_does_not_answer_pings_is_closed() {
        let srv = start(Limits {
            header_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            h2_keepalive_interval: Some(Duration::from_millis(200)),
            h2_keepalive_timeout: Duration::from_millis(300),
            ..short_limits()
        })
        .await;
        let mut s = srv.tls(ALPN_H2).await;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let t = Instant::now();
        let mut frames = Vec::new();
        loop {
            let mut hdr = [0u8; 9];
            let r = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hdr)).await;
            match r {
                Err(_) => panic!("still open after 5 s; frames {frames:?}"),
                Ok(Err(_)) => break,
                Ok(Ok(_)) => {}
            }
            let len = u32::from_be_bytes([0, hdr[0], hdr[1], hdr[2]]) as usize;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                break;
            }
            frames.push(hdr[3]);
        }
        eprintln!("frames {frames:?}, closed after {:?}", t.elapsed());
        assert!(frames.contains(&0x6), "a PING was sent: {frames:?}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    /// An HTTP/2 connection with no request in flight is closed (GOAWAY) after the idle
    /// timeout; one in use stays.
    #[tokio::test]
    async fn an_idle_h2_connection_is_closed() {
        let srv = start(short_limits()).await;
        let mut c = Sender::connect(srv.addr, &srv.cert, ALPN_H2).await;
        // Requests every 300 ms for 1.5 s: longer than the idle timeout, never idle that long.
        for _ in 0..5 {
            let req = request(ALPN_H2, srv.addr.port(), "/hello.txt");
            let resp = c.send(req.body(empty()).unwrap()).await;
            resp.into_body().collect().await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let t = Instant::now();
        while !c.is_closed() {
            assert!(t.elapsed() < Duration::from_secs(5), "still open after 5 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!("closed {:?} after the last response", t.elapsed());
        assert!(
            t.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    /// The connection cap: past it, idle connections (here, ones that never start TLS) are
    /// closed to make room, so the server holds at most the cap and a real client is
    /// served at once, over HTTP/1.1 and HTTP/2.
    #[tokio::test]
    async fn connections_beyond_the_cap_do_not_exhaust_the_server() {
        let srv = start(Limits {
            max_connections: 8,
            handshake_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            ..short_limits()
        })
        .await;
        let mut idle = Vec::new();
        for _ in 0..50 {
            idle.push(TcpStream::connect(srv.addr).await.unwrap());
        }
        // Give the server a moment to accept them all.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut open = 0;
        for s in &mut idle {
            if closed_within(s, Duration::from_millis(20)).await.is_none() {
                open += 1;
            }
        }
        eprintln!("{open} of 50 idle connections held");
        assert!(open <= 8, "{open} of 50 idle connections held");
        // Real clients, while the idle ones (re)fill the cap.
        for proto in [Proto::H1, Proto::H2, Proto::H1] {
            for _ in 0..8 {
                idle.push(TcpStream::connect(srv.addr).await.unwrap());
            }
            let t = Instant::now();
            let body = tokio::time::timeout(Duration::from_secs(2), srv.fetch(proto))
                .await
                .unwrap_or_else(|_| panic!("{proto:?}: not served within 2 s"));
            assert_eq!(body.unwrap(), b"hello from kuai over QUIC\n", "{proto:?}");
            eprintln!("{proto:?} served in {:?}", t.elapsed());
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "{proto:?} {:?}",
                t.elapsed()
            );
        }
        // Slowloris clients that completed TLS are made room for in the same way.
        let mut slow = Vec::new();
        for _ in 0..16 {
            let mut s = srv.tls(ALPN_H1).await;
            let _ = s.write_all(b"GET / HTTP/1.1\r\n").await;
            slow.push(s);
        }
        let body = tokio::time::timeout(Duration::from_secs(2), srv.fetch(Proto::H1)).await;
        assert!(body.is_ok_and(|b| b.is_ok()), "served during the slowloris");
    }

    /// The per-address cap: an address at it makes room among its own connections (oldest
    /// idle first), never among another address's, and the other address is still served.
    #[tokio::test]
    async fn one_address_at_its_cap_pushes_out_only_its_own_connections() {
        let srv = start(Limits {
            max_connections: 16,
            max_connections_per_address: 3,
            handshake_timeout: Duration::from_secs(30),
            ..short_limits()
        })
        .await;
        let from = |ip: &'static str| async move {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(format!("{ip}:0").parse().unwrap()).unwrap();
            let c = s.connect(srv.addr).await.unwrap();
            // Let the server accept it before the next one: the order is the age.
            tokio::time::sleep(Duration::from_millis(50)).await;
            c
        };
        let mut other = vec![from("127.0.0.2").await, from("127.0.0.2").await];
        let mut first = Vec::new();
        for _ in 0..3 {
            first.push(from("127.0.0.1").await);
        }
        let mut second = Vec::new();
        for _ in 0..2 {
            second.push(from("127.0.0.1").await);
        }
        // 127.0.0.1's two oldest went, its newest of the first three and the two new stay,
        // and 127.0.0.2 kept both of its own.
        let mut open = Vec::new();
        for s in first.iter_mut().chain(&mut second).chain(&mut other) {
            open.push(closed_within(s, Duration::from_millis(100)).await.is_none());
        }
        assert_eq!(open, [false, false, true, true, true, true, true]);
        {
            let h = srv.conns.held();
            assert_eq!(
                h.per_address.get(&"127.0.0.1".parse::<IpAddr>().unwrap()),
                Some(&3)
            );
            assert_eq!(
                h.per_address.get(&"127.0.0.2".parse::<IpAddr>().unwrap()),
                Some(&2)
            );
        }
        // 127.0.0.1 at its cap still gets served (its oldest idle connection makes room).
        let body = tokio::time::timeout(Duration::from_secs(2), srv.fetch(Proto::H1)).await;
        assert!(body.is_ok_and(|b| b.is_ok()), "served at the cap");
        assert!(
            closed_within(&mut first[2], Duration::from_millis(100))
                .await
                .is_some()
        );
        // Closed connections are counted out.
        drop((first, second, other));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let h = srv.conns.held();
        assert!(
            h.per_address.is_empty() && h.by_age.is_empty(),
            "{:?}",
            h.per_address
        );
    }

    /// An HTTP/2 client that grants huge flow-control windows, asks for 64 large responses
    /// and reads nothing: what the server holds for it in user space (response bytes made
    /// and not yet written to the socket) stays bounded, whatever the streams and windows.
    #[tokio::test]
    async fn an_h2_client_that_reads_nothing_cannot_make_the_server_buffer_much() {
        let srv = start(Limits {
            send_timeout: Duration::from_secs(30),
            h2_max_concurrent_streams: 128,
            ..short_limits()
        })
        .await;
        let mut s = srv.tls(ALPN_H2).await;
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        // SETTINGS: INITIAL_WINDOW_SIZE 2^31-1; then the connection window to 2^31-1.
        out.extend_from_slice(&[0, 0, 6, 0x4, 0, 0, 0, 0, 0, 0, 0x4, 0x7f, 0xff, 0xff, 0xff]);
        let inc: u32 = 0x7fff_ffff - 65_535;
        out.extend_from_slice(&[0, 0, 4, 0x8, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&inc.to_be_bytes());
        // HEADERS (END_STREAM | END_HEADERS): GET https localhost /bytes/1000000000 with
        // HPACK static indexes and literals without indexing (RFC 7541 §6.2.2).
        let mut block = vec![0x82, 0x87, 0x01, 9];
        block.extend_from_slice(b"localhost");
        block.extend_from_slice(&[0x04, 17]);
        block.extend_from_slice(b"/bytes/1000000000");
        for i in 0..64u32 {
            let id = 1 + 2 * i;
            out.extend_from_slice(&[0, 0, block.len() as u8, 0x1, 0x5]);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&block);
        }
        s.write_all(&out).await.unwrap();
        // Read nothing for a while.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (buffered, produced) = {
            let m = srv.conns.held();
            let c = m.by_age.values().next().expect("the connection is held");
            (c.buffered(), c.produced.load(Relaxed))
        };
        eprintln!("{produced} bytes produced, {buffered} of them not yet written");
        assert!(produced > 0, "the responses started");
        assert!(
            buffered <= RESPONSE_BUFFER + 4 * 64 * 1024,
            "{buffered} bytes buffered for a client that reads nothing"
        );
    }

    /// The windows an HTTP/2 server grants in its first frames: SETTINGS_INITIAL_WINDOW_SIZE
    /// (65,535 when not sent) and the connection window (65,535 plus its first
    /// WINDOW_UPDATE on stream 0).
    async fn h2_windows(s: &mut Tls) -> (u32, u32) {
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let (mut stream, mut conn, mut settings) = (None, None, false);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !(settings && conn.is_some()) {
            // Every complete frame in `buf`.
            while buf.len() >= 9 {
                let len =
                    usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                let (ty, flags) = (buf[3], buf[4]);
                let stream0 = buf[5..9] == [0, 0, 0, 0];
                let payload = buf[9..9 + len].to_vec();
                buf.drain(..9 + len);
                if ty == 0x4 && flags & 1 == 0 {
                    settings = true;
                    for p in payload.chunks_exact(6) {
                        if u16::from_be_bytes([p[0], p[1]]) == 0x4 {
                            stream = Some(u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
                        }
                    }
                } else if ty == 0x8 && stream0 {
                    conn = Some(65_535 + u32::from_be_bytes(payload[..4].try_into().unwrap()));
                }
            }
            let mut b = [0u8; 4096];
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left.min(Duration::from_millis(300)), s.read(&mut b)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&b[..n]),
                Ok(_) => panic!("closed"),
                // Nothing more: a server at the default connection window sends no update.
                Err(_) if settings => break,
                Err(_) => assert!(Instant::now() < deadline, "no SETTINGS"),
            }
        }
        (stream.unwrap_or(65_535), conn.unwrap_or(65_535))
    }

    /// Past the TCP memory budget new HTTP/2 connections get the protocol's default windows
    /// and a small response buffer; when a connection with the full grant ends, the next
    /// one gets the full grant again.
    #[tokio::test]
    async fn past_the_tcp_memory_budget_new_connections_get_small_windows() {
        let full = Grant::full(true);
        let srv = start(Limits {
            // Room for a full HTTP/2 grant, a small one and a full HTTP/1.1 one (its
            // response buffer), not for two full HTTP/2 grants.
            tcp_memory_budget: full.bytes() + Grant::small(true).bytes() + RESPONSE_BUFFER,
            ..Limits::default()
        })
        .await;
        let mut first = srv.tls(ALPN_H2).await;
        assert_eq!(
            h2_windows(&mut first).await,
            (H2_STREAM_WINDOW, H2_CONNECTION_WINDOW)
        );
        let mut second = srv.tls(ALPN_H2).await;
        assert_eq!(
            h2_windows(&mut second).await,
            (SMALL_H2_WINDOW, SMALL_H2_WINDOW)
        );
        let response_buffers = || -> Vec<u64> {
            let h = srv.conns.held();
            h.by_age
                .values()
                .map(|c| c.response_buffer.load(Relaxed))
                .collect()
        };
        assert_eq!(response_buffers(), [RESPONSE_BUFFER, SMALL_RESPONSE_BUFFER]);
        // An HTTP/1.1 connection's full grant (its response buffer) still fits.
        let _h1 = srv.tls(ALPN_H1).await;
        let expected = full.bytes() + Grant::small(true).bytes() + RESPONSE_BUFFER;
        let deadline = Instant::now() + Duration::from_secs(5);
        while srv.conns.granted.load(Relaxed) != expected {
            assert!(Instant::now() < deadline, "HTTP/1.1 connection not granted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The first connection ends: its grant is free for the next.
        drop(first);
        let deadline = Instant::now() + Duration::from_secs(5);
        while srv.conns.granted.load(Relaxed) != expected - full.bytes() {
            assert!(Instant::now() < deadline, "grant not given back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut third = srv.tls(ALPN_H2).await;
        assert_eq!(
            h2_windows(&mut third).await,
            (H2_STREAM_WINDOW, H2_CONNECTION_WINDOW)
        );
        // The small connection serves requests as usual.
        assert_eq!(srv.fetch(Proto::H2).await.unwrap().len(), 26);
        drop(second);
    }

    /// HTTP/2: while the client's window holds response DATA back, the frames that do go
    /// out (PING acknowledgments, response headers) make no room for more. A client that
    /// grants no window and sends PINGs made the server produce a chunk more per 256 KiB of
    /// acknowledgments, up to one chunk per stream.
    #[tokio::test]
    async fn h2_data_held_by_the_window_stays_within_the_response_buffer() {
        let srv = start(Limits {
            h2_max_concurrent_streams: 100,
            send_timeout: Duration::from_secs(30),
            ..short_limits()
        })
        .await;
        let t = srv.tls(ALPN_H2).await;
        let (mut rd, mut wr) = tokio::io::split(t);
        let read = tokio::spawn(async move {
            let mut b = vec![0u8; 65536];
            let mut n = 0usize;
            while let Ok(k) = rd.read(&mut b).await {
                if k == 0 {
                    break;
                }
                n += k;
            }
            n
        });
        let frame = |ty: u8, flags: u8, id: u32, payload: &[u8]| {
            let len = payload.len();
            let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, flags];
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(payload);
            f
        };
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        // SETTINGS_INITIAL_WINDOW_SIZE 0: no stream may get DATA.
        out.extend(frame(4, 0, 0, &[0, 4, 0, 0, 0, 0]));
        // 60 GETs of 10 MB (HPACK: :method GET, :scheme https, :path and :authority
        // literals without indexing).
        let path = b"/bytes/10000000";
        let mut block = vec![0x82, 0x87, 0x04, path.len() as u8];
        block.extend_from_slice(path);
        block.extend_from_slice(&[0x01, 9]);
        block.extend_from_slice(b"localhost");
        for i in 0..60u32 {
            out.extend(frame(1, 0x5, 2 * i + 1, &block));
        }
        wr.write_all(&out).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // 1.7 MB of PINGs, whose acknowledgments go out while the DATA cannot.
        let ping = frame(6, 0, 0, &[1; 8]);
        let batch: Vec<u8> = std::iter::repeat_n(ping.as_slice(), 1000)
            .flatten()
            .copied()
            .collect();
        for _ in 0..100 {
            wr.write_all(&batch).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let produced: u64 = srv
            .conns
            .held()
            .by_age
            .values()
            .map(|c| c.produced.load(Relaxed))
            .sum();
        // The buffer, and the one 64 KiB chunk that crossed it.
        assert!(
            produced <= RESPONSE_BUFFER + 64 * 1024,
            "{produced} bytes of responses made for a client that takes none"
        );
        drop(wr);
        read.abort();
    }
}

/// RFC 9113 §8.2.3: an HTTP/2 client may split Cookie into several field lines; they are
/// joined with "; " into one before the application (or an HTTP/1.1 backend, which must get
/// one Cookie field) sees them, as kuai-h3 does for HTTP/3.
fn join_cookies(headers: &mut http::HeaderMap) {
    let mut all = headers.get_all(http::header::COOKIE).iter();
    let (Some(_), Some(_)) = (all.next(), all.next()) else {
        return;
    };
    let mut joined = Vec::new();
    for v in headers.get_all(http::header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(v) = http::HeaderValue::from_bytes(&joined) {
        headers.insert(http::header::COOKIE, v);
    }
}

#[cfg(test)]
mod cookie_tests {
    #[test]
    fn http2_cookie_lines_are_joined() {
        let mut h = http::HeaderMap::new();
        h.append("cookie", "a=1".parse().unwrap());
        h.append("cookie", "b=2".parse().unwrap());
        super::join_cookies(&mut h);
        let all: Vec<_> = h.get_all("cookie").iter().collect();
        assert_eq!(all, ["a=1; b=2"]);
        let mut one = http::HeaderMap::new();
        one.append("cookie", "a=1".parse().unwrap());
        super::join_cookies(&mut one);
        assert_eq!(one["cookie"], "a=1");
    }
}

#[cfg(test)]
mod h2_frames_tests {
    use super::H2Frames;

    /// DATA payload is counted whatever the writes' boundaries; other frames are not.
    #[test]
    fn only_data_payload_counts() {
        let frame = |ty: u8, len: usize| {
            let mut f = vec![
                (len >> 16) as u8,
                (len >> 8) as u8,
                len as u8,
                ty,
                0,
                0,
                0,
                0,
                1,
            ];
            f.extend(std::iter::repeat_n(7u8, len));
            f
        };
        let mut wire = Vec::new();
        for (ty, len) in [
            (4, 0),
            (1, 30),
            (0, 1000),
            (6, 8),
            (0, 0),
            (0, 16384),
            (8, 4),
        ] {
            wire.extend(frame(ty, len));
        }
        for step in [1, 2, 5, 9, 10, 17, 4096, wire.len()] {
            let mut f = H2Frames::default();
            let n: u64 = wire.chunks(step).map(|c| f.data_in(c)).sum();
            assert_eq!(n, 17384, "writes of {step}");
        }
    }
}

#[cfg(test)]
mod upgrade_tests {
    use super::*;
    use crate::server::tests::{TestBody, empty, identity};
    use crate::server::{ALPN_H1, Server};
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn short_limits() -> Limits {
        Limits {
            handshake_timeout: Duration::from_millis(400),
            header_timeout: Duration::from_millis(400),
            ..Limits::default()
        }
    }

    /// Answers every request with 101 and echoes on the upgraded connection.
    #[derive(Clone)]
    struct Upgrader;

    impl tower_service::Service<Request<Body>> for Upgrader {
        type Response = http::Response<TestBody>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, mut req: Request<Body>) -> Self::Future {
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                if let Ok(up) = on.await {
                    let mut io = TokioIo::new(up);
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = io.read(&mut buf).await {
                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            });
            let mut r = http::Response::new(empty());
            *r.status_mut() = http::StatusCode::SWITCHING_PROTOCOLS;
            r.headers_mut()
                .insert("connection", "upgrade".parse().unwrap());
            r.headers_mut().insert("upgrade", "echo".parse().unwrap());
            std::future::ready(Ok(r))
        }
    }

    /// An upgraded HTTP/1.1 connection (a WebSocket) still counts against the caps and the
    /// memory budget for as long as its socket is open, and is never closed as idle to make
    /// room: the connection's slot went with its task, at the 101, and a client could hold
    /// any number of upgraded sockets past the per-address cap.
    #[tokio::test]
    async fn upgraded_connections_stay_counted() {
        let (cert, mut tls) = identity();
        tls.alpn_protocols = vec![ALPN_H1.to_vec()];
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(Conns::new());
        let limits = Limits {
            max_connections_per_address: 2,
            ..short_limits()
        };
        let shared = Server::new(Upgrader)
            .limits(limits)
            .into_shared(addr.port());
        tokio::spawn(serve_with(listener, Arc::new(tls), shared, conns.clone()));
        let mut open = Vec::new();
        for _ in 0..6 {
            let Ok(mut t) = tokio::time::timeout(Duration::from_secs(2), async {
                // (Refused at the cap: the handshake fails, which `tls_to` would not take.)
                let mut cfg = crate::server::tests::client_tls(&cert);
                cfg.alpn_protocols = vec![ALPN_H1.to_vec()];
                let sock = TcpStream::connect(addr).await.ok()?;
                let name = rustls::pki_types::ServerName::try_from("localhost").ok()?;
                let mut t = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                    .connect(name, sock)
                    .await
                    .ok()?;
                t.write_all(b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n")
                    .await
                    .ok()?;
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    let mut b = [0u8; 1];
                    if t.read(&mut b).await.ok()? == 0 {
                        return None;
                    }
                    head.push(b[0]);
                }
                head.starts_with(b"HTTP/1.1 101").then_some(t)
            })
            .await
            .map(|t| t.ok_or(()))
            .unwrap_or(Err(())) else {
                continue;
            };
            // The tunnel works.
            t.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            t.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"ping");
            open.push(t);
        }
        assert_eq!(
            open.len(),
            2,
            "upgraded connections past the per-address cap"
        );
        assert_eq!(conns.held().by_age.len(), 2);
        assert!(
            conns.granted.load(Relaxed) > 0,
            "their memory grants given back"
        );
        drop(open);
        let t = Instant::now();
        while !conns.held().by_age.is_empty() || conns.granted.load(Relaxed) > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "closed tunnels still counted"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
