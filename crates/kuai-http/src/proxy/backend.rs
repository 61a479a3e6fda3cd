//! One backend: its pooled connections (HTTP/1.1 keep-alive or one shared cleartext HTTP/2
//! connection), the requests outstanding on it, and whether it looks healthy.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::h1;
use super::{Options, Upstream, UpstreamProtocol, body::UpBody};

/// A backend's response body: from an HTTP/1.1 connection of the proxy's own, or from
/// hyper (the HTTP/2 client, and the HTTP/1.1 one of WebSocket upgrades).
// The HTTP/1.1 body is the common case and lives as long as its response: boxing it would
// cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Received {
    H1(h1::Body),
    Hyper(Incoming),
    /// From an HTTP/2 connection, holding its place there until dropped.
    H2(
        Incoming,
        #[allow(dead_code, reason = "held for its drop")] StreamSlot,
    ),
}

/// A request's place on one of a backend's HTTP/2 connections, given up when its response
/// is dropped.
pub(crate) struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// The connections a backend has open (HTTP/1.1 ones, idle or busy, and HTTP/2 ones; not
/// WebSocket tunnels), and a wake-up for requests waiting for room under the cap.
pub(crate) struct ConnCount {
    open: AtomicUsize,
    freed: tokio::sync::Notify,
}

/// One of a backend's connections, counted until dropped.
pub(crate) struct ConnSlot(Arc<ConnCount>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
        self.0.freed.notify_one();
    }
}

/// An HTTP/2 connection to a backend and the requests on it.
struct H2Conn {
    sender: http2::SendRequest<UpBody>,
    streams: Arc<AtomicUsize>,
}

/// Why an exchange with a backend failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Nothing of the request left: it comes back, to go elsewhere.
    NotSent(Box<Request<UpBody>>, Reason),
    /// The request (some of it) went out; no response head came.
    Sent(Reason),
    /// The client's request body failed (or broke its declared length): not the backend's
    /// fault, and not worth another backend.
    Client(Reason),
}

/// What went wrong, for the log and the status.
#[derive(Debug)]
pub(crate) enum Reason {
    Connect(std::io::Error),
    ConnectTimeout(Duration),
    Handshake(hyper::Error),
    Exchange(hyper::Error),
    H1(h1::Error),
    ResponseTimeout(Duration),
    /// The client sent nothing more of its request body for this long.
    ClientBodyTimeout(Duration),
    /// The backend had its most connections open, none came free within the connect
    /// timeout: not the backend's failure.
    Saturated(usize),
}

impl Reason {
    /// For the statistics: `timeout`, `connect` or `exchange`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Reason::ConnectTimeout(_)
            | Reason::ResponseTimeout(_)
            | Reason::ClientBodyTimeout(_) => "timeout",
            Reason::Connect(_) | Reason::Handshake(_) | Reason::Saturated(_) => "connect",
            Reason::Exchange(_) | Reason::H1(_) => "exchange",
        }
    }

    /// Nothing of a request went out: the connection was never made.
    pub(crate) fn is_unsent(&self) -> bool {
        matches!(
            self,
            Reason::Connect(_)
                | Reason::ConnectTimeout(_)
                | Reason::Handshake(_)
                | Reason::Saturated(_)
        )
    }

    /// The backend is busy, not failing.
    pub(crate) fn is_saturation(&self) -> bool {
        matches!(self, Reason::Saturated(_))
    }

    /// A timeout (504) rather than a failure (502).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, Reason::ConnectTimeout(_) | Reason::ResponseTimeout(_))
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Connect(e) => write!(f, "connect: {e}"),
            Reason::ConnectTimeout(d) => write!(f, "connect: timed out after {d:?}"),
            Reason::Handshake(e) => write!(f, "connection setup: {e}"),
            Reason::Exchange(e) => write!(f, "{e}"),
            Reason::H1(e) => write!(f, "{e}"),
            Reason::ResponseTimeout(d) => write!(f, "no response head within {d:?}"),
            Reason::ClientBodyTimeout(d) => {
                write!(f, "the client sent nothing of its body for {d:?}")
            }
            Reason::Saturated(n) => {
                write!(f, "all {n} connections busy for the connect timeout")
            }
        }
    }
}

/// An idle HTTP/1.1 connection and since when it has been idle.
struct Idle {
    conn: h1::Conn,
    since: Instant,
}

pub(crate) struct Backend {
    pub(crate) upstream: Upstream,
    /// `host:port` as given, for the log and the statistics.
    pub(crate) name: Arc<str>,
    idle: Mutex<Vec<Idle>>,
    /// HTTP/2 connections, oldest first; one more is made when each carries
    /// [`H2_STREAMS_PER_CONNECTION`](super::H2_STREAMS_PER_CONNECTION) requests.
    h2: tokio::sync::Mutex<Vec<H2Conn>>,
    /// When the last new HTTP/2 connection failed, and whether by timing out (taken under
    /// `h2`'s lock): requests that waited for the lock while it was tried fail with it.
    h2_failed: std::sync::Mutex<Option<(std::time::Instant, Option<Duration>)>>,
    /// Requests sent and not yet answered to their last byte.
    pub(crate) outstanding: AtomicUsize,
    /// Failures in a row (passive health).
    fails: AtomicU32,
    /// Until when (ms since `epoch`) the backend is left alone after failures; 0: not.
    down_until: AtomicU64,
    /// The last active health check failed.
    check_failed: AtomicBool,
    /// The connections open to it.
    conns: Arc<ConnCount>,
    epoch: Instant,
    /// Response times and errors, when the proxy keeps statistics.
    pub(crate) metrics: Option<Arc<crate::metrics::Upstream>>,
}

impl Backend {
    pub(crate) fn new(upstream: Upstream, epoch: Instant) -> Self {
        Self {
            name: upstream.authority().into(),
            upstream,
            idle: Mutex::new(Vec::new()),
            h2: tokio::sync::Mutex::new(Vec::new()),
            h2_failed: std::sync::Mutex::new(None),
            outstanding: AtomicUsize::new(0),
            fails: AtomicU32::new(0),
            down_until: AtomicU64::new(0),
            check_failed: AtomicBool::new(false),
            conns: Arc::new(ConnCount {
                open: AtomicUsize::new(0),
                freed: tokio::sync::Notify::new(),
            }),
            epoch,
            metrics: None,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether requests should go here: no failed health check and not resting after
    /// failures.
    pub(crate) fn is_available(&self) -> bool {
        !self.check_failed.load(Relaxed) && self.down_until.load(Relaxed) <= self.now_ms()
    }

    /// A request failed here: `max_fails` in a row rest the backend for `fail_timeout`
    /// (nginx's passive health checks).
    pub(crate) fn on_failure(&self, o: &Options) {
        let n = self.fails.fetch_add(1, Relaxed) + 1;
        if n >= o.max_fails.max(1) {
            self.fails.store(0, Relaxed);
            let until = self.now_ms() + o.fail_timeout.as_millis() as u64;
            self.down_until.store(until, Relaxed);
            tracing::warn!(
                target: "kuai_http::proxy", backend = %self.name, failures = n,
                rest_s = o.fail_timeout.as_secs_f64(), "backend marked down"
            );
        }
    }

    pub(crate) fn on_success(&self) {
        if self.fails.load(Relaxed) != 0 {
            self.fails.store(0, Relaxed);
        }
    }

    /// The result of an active health check.
    pub(crate) fn set_check(&self, ok: bool) {
        let was = self.check_failed.swap(!ok, Relaxed);
        if was == ok {
            if ok {
                tracing::info!(target: "kuai_http::proxy", backend = %self.name, "backend healthy again");
            } else {
                tracing::warn!(target: "kuai_http::proxy", backend = %self.name, "backend failed its health check");
            }
        }
        if ok {
            self.down_until.store(0, Relaxed);
        }
    }

    /// Sends `req` and waits for the response head (within `o.response_timeout`). An
    /// HTTP/1.1 connection goes back to the pool by itself once the response body has been
    /// read to its end.
    pub(crate) async fn send(
        self: &Arc<Self>,
        req: Request<UpBody>,
        o: &Options,
    ) -> Result<Response<Received>, Failure> {
        match self.upstream.protocol() {
            UpstreamProtocol::Http1 => self.send_h1(req, o).await.map(|r| r.map(Received::H1)),
            UpstreamProtocol::H2c => self.send_h2(req, o).await,
        }
    }

    async fn send_h1(
        self: &Arc<Self>,
        mut req: Request<UpBody>,
        o: &Options,
    ) -> Result<Response<h1::Body>, Failure> {
        // What of the body is here already decides its framing; a GET's end is awaited
        // (within the response timeout) before a connection is taken for it.
        let wait = h1::wait_for_body_end(&req);
        let _ = tokio::time::timeout(o.response_timeout, req.body_mut().read_ahead(wait)).await;
        loop {
            let (conn, pooled) = match self.h1_conn(o).await {
                Ok(c) => c,
                Err(r) => return Err(Failure::NotSent(Box::new(req), r)),
            };
            let home = h1::Home {
                backend: self.clone(),
                max_idle: o.max_idle,
            };
            let watch = req.body().watch();
            let sent = head_within(o.response_timeout, &watch, h1::exchange(conn, req, home));
            let failed = match sent.await {
                Ok(Ok(resp)) => return Ok(resp),
                Ok(Err(f)) => f,
                Err(failure) => return Err(failure),
            };
            let h1::Failed {
                error,
                request,
                sent,
                answered,
            } = *failed;
            // A pooled connection the backend closed as this request went out (RFC 9112
            // §9.3.1): a request that did not leave goes on the next connection, and so does
            // an idempotent one that no answer began for and whose body was not read.
            let again = pooled
                && !answered
                && (!sent || (request.method().is_idempotent() && !request.body().data_taken()));
            if matches!(error, h1::Error::ClientBody(_) | h1::Error::BodyLength) {
                return Err(Failure::Client(Reason::H1(error)));
            }
            if again {
                req = request;
                continue;
            }
            return Err(if sent {
                Failure::Sent(Reason::H1(error))
            } else {
                Failure::NotSent(Box::new(request), Reason::H1(error))
            });
        }
    }

    async fn send_h2(
        &self,
        mut req: Request<UpBody>,
        o: &Options,
    ) -> Result<Response<Received>, Failure> {
        // A connection found closed is replaced once.
        for attempt in 0..2 {
            let (mut sender, slot) = match self.h2_sender(o).await {
                Ok(s) => s,
                Err(r) => return Err(Failure::NotSent(Box::new(req), r)),
            };
            let watch = req.body().watch();
            let sent = head_within(o.response_timeout, &watch, async {
                // Waits for a stream the backend allows (its concurrency limit).
                match sender.ready().await {
                    Err(e) => Err((Some(req), e)),
                    Ok(()) => sender
                        .try_send_request(req)
                        .await
                        .map_err(|mut e| (e.take_message(), e.into_error())),
                }
            })
            .await;
            match sent {
                Ok(Ok(resp)) => return Ok(resp.map(|b| Received::H2(b, slot))),
                Ok(Err((back, e))) => match back {
                    Some(back) if attempt == 0 => req = back,
                    Some(back) => {
                        return Err(Failure::NotSent(Box::new(back), Reason::Exchange(e)));
                    }
                    // The client's body broke off (the stream was reset for it): not the
                    // backend's fault.
                    None if watch.client_failed() => {
                        return Err(Failure::Client(Reason::Exchange(e)));
                    }
                    None => return Err(Failure::Sent(Reason::Exchange(e))),
                },
                Err(failure) => return Err(failure),
            }
        }
        unreachable!("the second attempt returns")
    }

    /// A place for one more connection, if the backend has fewer than its most open.
    fn try_slot(&self, o: &Options) -> Option<ConnSlot> {
        self.conns
            .open
            .fetch_update(Relaxed, Relaxed, |n| (n < o.max_conns).then_some(n + 1))
            .ok()
            .map(|_| ConnSlot(self.conns.clone()))
    }

    /// An HTTP/1.1 connection for a request, and whether it was pooled: an idle one, or a
    /// new one while the backend has room; at its most connections, the first to come free
    /// within the connect timeout.
    async fn h1_conn(&self, o: &Options) -> Result<(h1::Conn, bool), Reason> {
        let deadline = tokio::time::Instant::now() + o.connect_timeout;
        loop {
            // Registered before looking, so a connection freed in between wakes it.
            let freed = self.conns.freed.notified();
            if let Some(c) = self.take_idle(o) {
                return Ok((c, true));
            }
            if let Some(slot) = self.try_slot(o) {
                let s = self.connect_raw(o).await?;
                return Ok((h1::Conn::new(s, slot), false));
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(Reason::Saturated(o.max_conns));
            }
        }
    }

    /// An HTTP/2 connection with room for one more request, and the request's place on
    /// it: the oldest open one with room, else a new one. Connections left without requests
    /// go while another is kept.
    async fn h2_sender(
        &self,
        o: &Options,
    ) -> Result<(http2::SendRequest<UpBody>, StreamSlot), Reason> {
        let asked = std::time::Instant::now();
        let mut conns = self.h2.lock().await;
        conns.retain(|c| !c.sender.is_closed());
        while conns.len() > 1 && conns.last().is_some_and(|c| c.streams.load(Relaxed) == 0) {
            conns.pop();
        }
        let room = conns
            .iter()
            .find(|c| c.streams.load(Relaxed) < super::H2_STREAMS_PER_CONNECTION);
        if let Some(c) = room {
            c.streams.fetch_add(1, Relaxed);
            return Ok((c.sender.clone(), StreamSlot(c.streams.clone())));
        }
        // A new connection was tried while this request waited for the lock, and failed:
        // this one fails with it rather than trying again in turn (behind a backend that
        // drops SYNs, the k-th of the requests queued here would wait k connect timeouts).
        let failed = *self.h2_failed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, timeout)) = failed
            && at >= asked
        {
            return Err(match timeout {
                Some(d) => Reason::ConnectTimeout(d),
                None => {
                    Reason::Connect(std::io::Error::other("a connection tried meanwhile failed"))
                }
            });
        }
        let Some(conn_slot) = self.try_slot(o) else {
            // At the most connections: the least busy one takes more than its share.
            let c = conns
                .iter()
                .min_by_key(|c| c.streams.load(Relaxed))
                .ok_or(Reason::Saturated(o.max_conns))?;
            c.streams.fetch_add(1, Relaxed);
            return Ok((c.sender.clone(), StreamSlot(c.streams.clone())));
        };
        let opened = self.h2_connect(o).await;
        if let Err(e) = &opened {
            let timeout = match e {
                Reason::ConnectTimeout(d) => Some(*d),
                _ => None,
            };
            *self.h2_failed.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((std::time::Instant::now(), timeout));
        }
        let (sender, conn) = opened?;
        let name = self.name.clone();
        tokio::spawn(async move {
            // Counted while the connection lives.
            let _slot = conn_slot;
            if let Err(e) = conn.await {
                tracing::debug!(target: "kuai_http::proxy", backend = %name, error = %e, "upstream connection ended");
            }
        });
        let streams = Arc::new(AtomicUsize::new(1));
        conns.push(H2Conn {
            sender: sender.clone(),
            streams: streams.clone(),
        });
        Ok((sender, StreamSlot(streams)))
    }

    /// A new HTTP/2 connection to the backend, its handshake done.
    async fn h2_connect(
        &self,
        o: &Options,
    ) -> Result<
        (
            http2::SendRequest<UpBody>,
            http2::Connection<TokioIo<tokio::net::TcpStream>, UpBody, TokioExecutor>,
        ),
        Reason,
    > {
        let io = self.connect_tcp(o).await?;
        http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(super::H2_STREAM_WINDOW)
            .initial_connection_window_size(super::H2_CONNECTION_WINDOW)
            // A backend host that went away is found by an unanswered PING, not by the
            // next requests' timeouts.
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true)
            .handshake(io)
            .await
            .map_err(Reason::Handshake)
    }

    pub(super) async fn connect_tcp(
        &self,
        o: &Options,
    ) -> Result<TokioIo<tokio::net::TcpStream>, Reason> {
        self.connect_raw(o).await.map(TokioIo::new)
    }

    async fn connect_raw(&self, o: &Options) -> Result<tokio::net::TcpStream, Reason> {
        let connect = tokio::net::TcpStream::connect(self.upstream.authority());
        let tcp = tokio::time::timeout(o.connect_timeout, connect)
            .await
            .map_err(|_| Reason::ConnectTimeout(o.connect_timeout))?
            .map_err(Reason::Connect)?;
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }

    /// The most recently used idle connection still open and not idle too long.
    fn take_idle(&self, o: &Options) -> Option<h1::Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(i) = idle.pop() {
            if i.since.elapsed() < o.idle_timeout && i.conn.is_open() {
                return Some(i.conn);
            }
        }
        None
    }

    /// Puts a connection whose response was read to its end back in the pool (`max` idle
    /// ones at most: the oldest goes).
    pub(crate) fn put_idle(&self, conn: h1::Conn, max: usize) {
        if max == 0 {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() >= max {
            idle.remove(0);
        }
        idle.push(Idle {
            conn,
            since: Instant::now(),
        });
        drop(idle);
        // A request waiting for room may take it.
        self.conns.freed.notify_one();
    }
}

/// Runs `exchange` (a request until its response head) within `limit` of the request body's
/// last progress: a long upload that keeps moving is not cut off, and the time to the head
/// counts from the body's end. When the time runs out while the body waits for the client,
/// the client is at fault (not the backend); otherwise the backend did not answer in time.
async fn head_within<T>(
    limit: Duration,
    body: &super::body::BodyWatch,
    exchange: impl std::future::Future<Output = T>,
) -> Result<T, Failure> {
    let mut exchange = std::pin::pin!(exchange);
    let mut deadline = tokio::time::Instant::now() + limit;
    loop {
        tokio::select! {
            r = &mut exchange => return Ok(r),
            () = tokio::time::sleep_until(deadline) => {
                let next = body.last_progress() + limit;
                if next > tokio::time::Instant::now() {
                    deadline = next;
                } else if body.waiting_for_client() {
                    return Err(Failure::Client(Reason::ClientBodyTimeout(limit)));
                } else {
                    return Err(Failure::Sent(Reason::ResponseTimeout(limit)));
                }
            }
        }
    }
}
