//! Connections and streams as async handles.

use std::future::{Future, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use kuai_proto::DatagramError;
use kuai_proto::StreamError;
use kuai_proto::trace::ConnectionStats;
use kuai_proto::{ConnectionError, ConnectionHandle, Dir, Priority, StreamId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::endpoint::{ConnState, Shared, State, dir_index, register};

/// Keeps a connection alive while any handle to it exists; closes it when the last goes.
pub(crate) struct ConnectionInner {
    pub shared: Arc<Shared>,
    pub handle: ConnectionHandle,
}

impl ConnectionInner {
    pub fn new(shared: Arc<Shared>, handle: ConnectionHandle) -> Arc<Self> {
        Arc::new(Self { shared, handle })
    }

    /// Runs `f` on the connection and its wake state under the endpoint lock.
    fn with<R>(&self, f: impl FnOnce(&mut State, ConnectionHandle) -> R) -> R {
        let mut s = self.shared.lock();
        f(&mut s, self.handle)
    }
}

impl Drop for ConnectionInner {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        let held = match s.ep.connection_mut(self.handle) {
            Some(c) => {
                if !c.is_closed() {
                    c.close(Instant::now(), 0, b"");
                }
                true
            }
            None => false,
        };
        if held {
            // Its wake state goes when the transport forgets the connection.
            if let Some(st) = s.conns.get_mut(&self.handle) {
                st.released = true;
            }
        } else {
            // Already gone from the transport: forget the wake state too.
            s.conns.remove(&self.handle);
        }
        drop(s);
        self.shared.kick();
    }
}

fn conn_error(st: Option<&ConnState>) -> ConnectionError {
    st.and_then(|c| c.error.clone())
        .unwrap_or(ConnectionError::LocallyClosed)
}

/// A connection whose handshake is under way.
pub struct Connecting {
    inner: Option<Arc<ConnectionInner>>,
}

impl Connecting {
    pub(crate) fn new(inner: Arc<ConnectionInner>) -> Self {
        Self { inner: Some(inner) }
    }

    /// Use the connection before the handshake completes. Client: send in 0-RTT when a
    /// resumed session allows it; the returned [`ZeroRttAccepted`] resolves to whether the
    /// server accepted the early data (if not, streams opened before were reset and their data
    /// must be sent again). Server: read 0-RTT requests and answer in 0.5-RTT, a round trip
    /// before the client's Finished arrives (RFC 9001 §4.1.1); [`ZeroRttAccepted`] resolves
    /// to `true` once the handshake completes. The client's address is not validated yet, so
    /// until then the anti-amplification limit applies. `Err(self)` when not possible yet.
    pub fn into_0rtt(mut self) -> Result<(Connection, ZeroRttAccepted), Self> {
        let inner = self.inner.take().expect("not consumed");
        let ok = inner.with(|s, h| {
            s.ep.connection(h)
                .is_some_and(|c| c.is_0rtt_available() || c.is_half_rtt_available())
        });
        if !ok {
            return Err(Self { inner: Some(inner) });
        }
        let conn = Connection {
            inner: inner.clone(),
        };
        Ok((conn, ZeroRttAccepted { inner }))
    }

    /// Transport statistics so far: whether any datagram came back
    /// ([`udp_rx_datagrams`](ConnectionStats::udp_rx_datagrams)), how many Initials went
    /// out, ...
    pub fn stats(&self) -> ConnectionStats {
        // After the handshake completed (polled through `&mut`) the connection went on.
        self.inner
            .as_ref()
            .map_or_else(ConnectionStats::default, |inner| {
                inner.with(|s, h| s.ep.connection(h).map(|c| c.stats()).unwrap_or_default())
            })
    }

    /// The server address the handshake goes to.
    pub fn remote_address(&self) -> SocketAddr {
        let inner = self.inner.as_ref().expect("not consumed");
        inner
            .with(|s, h| s.ep.connection(h).map(|c| c.remote_address()))
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

impl Future for Connecting {
    type Output = Result<Connection, ConnectionError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.inner.as_ref().expect("polled after completion");
        let ready = inner.with(|s, h| {
            let st = s.conns.get_mut(&h);
            match st {
                Some(st) if st.connected => Some(Ok(())),
                Some(st) if st.error.is_some() => Some(Err(st.error.clone().expect("checked"))),
                Some(st) => {
                    register(&mut st.handshake, cx);
                    None
                }
                None => Some(Err(ConnectionError::LocallyClosed)),
            }
        });
        match ready {
            None => Poll::Pending,
            Some(Ok(())) => Poll::Ready(Ok(Connection {
                inner: self.inner.take().expect("set"),
            })),
            Some(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

/// Resolves once the handshake finished: `true` if the server accepted 0-RTT data.
pub struct ZeroRttAccepted {
    inner: Arc<ConnectionInner>,
}

impl Future for ZeroRttAccepted {
    type Output = bool;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        self.inner.with(|s, h| {
            let server = s.ep.connection(h).is_some_and(|c| c.side().is_server());
            let accepted = s.ep.connection(h).and_then(|c| c.zero_rtt_accepted());
            match (accepted, s.conns.get_mut(&h)) {
                // Server: the handshake completed (the client's address and Finished check out).
                (_, Some(st)) if server && st.connected => Poll::Ready(true),
                (_, Some(st)) if server && st.error.is_none() => {
                    register(&mut st.handshake, cx);
                    Poll::Pending
                }
                (Some(a), _) => Poll::Ready(a),
                (None, Some(st)) if st.error.is_none() => {
                    register(&mut st.handshake, cx);
                    Poll::Pending
                }
                _ => Poll::Ready(false),
            }
        })
    }
}

/// An established QUIC connection. Cheap to clone; closed when the last handle (including
/// its streams) is dropped.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<ConnectionInner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("remote", &self.remote_address())
            .finish()
    }
}

impl Connection {
    /// Opens a stream; also says whether it is a client's 0-RTT stream (void if the server
    /// rejects the early data).
    async fn open(&self, dir: Dir) -> Result<(StreamId, bool), ConnectionError> {
        poll_fn(|cx| {
            self.inner.with(|s, h| {
                let Some(c) = s.ep.connection_mut(h) else {
                    return Poll::Ready(Err(conn_error(s.conns.get(&h).map(Box::as_ref))));
                };
                // Opened in 0-RTT, and so voided should the server reject it. The client
                // learns the outcome when the handshake completes, so a stream opened
                // before that is early, however soon the rejection follows.
                let early = c.side().is_client() && !c.is_established();
                match c.open_stream(dir) {
                    Ok(id) => Poll::Ready(Ok((id, early))),
                    Err(StreamError::Blocked) => {
                        if let Some(st) = s.conns.get_mut(&h) {
                            if let Some(e) = st.error.clone() {
                                return Poll::Ready(Err(e));
                            }
                            register(&mut st.open[dir_index(dir)], cx);
                        }
                        Poll::Pending
                    }
                    Err(_) => Poll::Ready(Err(conn_error(s.conns.get(&h).map(Box::as_ref)))),
                }
            })
        })
        .await
    }

    /// Opens a bidirectional stream, waiting while the peer's stream limit is reached.
    pub async fn open_bi(&self) -> Result<(SendStream, RecvStream), ConnectionError> {
        let (id, early) = self.open(Dir::Bi).await?;
        Ok((
            SendStream::new(self.inner.clone(), id).early(early),
            RecvStream::new(self.inner.clone(), id).early(early),
        ))
    }

    /// Opens a unidirectional stream.
    pub async fn open_uni(&self) -> Result<SendStream, ConnectionError> {
        let (id, early) = self.open(Dir::Uni).await?;
        Ok(SendStream::new(self.inner.clone(), id).early(early))
    }

    /// Resolves once the handshake finished: `true` unless the server rejected the 0-RTT
    /// data this client sent (then streams opened before are void: reopen and send again).
    /// Never resolves on a server or a client that did not try 0-RTT.
    pub fn early_data_outcome(&self) -> ZeroRttAccepted {
        ZeroRttAccepted {
            inner: self.inner.clone(),
        }
    }

    async fn accept(&self, dir: Dir) -> Result<StreamId, ConnectionError> {
        poll_fn(|cx| {
            self.inner.with(|s, h| {
                let Some(c) = s.ep.connection_mut(h) else {
                    return Poll::Ready(Err(conn_error(s.conns.get(&h).map(Box::as_ref))));
                };
                if let Some(id) = c.accept_stream(dir) {
                    return Poll::Ready(Ok(id));
                }
                let Some(st) = s.conns.get_mut(&h) else {
                    return Poll::Ready(Err(ConnectionError::LocallyClosed));
                };
                if let Some(e) = st.error.clone() {
                    return Poll::Ready(Err(e));
                }
                register(&mut st.accept[dir_index(dir)], cx);
                Poll::Pending
            })
        })
        .await
    }

    /// Waits for the peer to open a bidirectional stream.
    pub async fn accept_bi(&self) -> Result<(SendStream, RecvStream), ConnectionError> {
        let id = self.accept(Dir::Bi).await?;
        Ok((
            SendStream::new(self.inner.clone(), id),
            RecvStream::new(self.inner.clone(), id),
        ))
    }

    /// Waits for the peer to open a unidirectional stream.
    pub async fn accept_uni(&self) -> Result<RecvStream, ConnectionError> {
        let id = self.accept(Dir::Uni).await?;
        Ok(RecvStream::new(self.inner.clone(), id))
    }

    /// Sends an unreliable datagram (RFC 9221).
    pub fn send_datagram(&self, data: Bytes) -> Result<(), DatagramError> {
        let r = self.inner.with(|s, h| match s.ep.connection_mut(h) {
            Some(c) => c.send_datagram(data),
            None => Err(DatagramError::Unsupported),
        });
        self.inner.shared.kick();
        r
    }

    /// Receives the next datagram.
    pub async fn read_datagram(&self) -> Result<Bytes, ConnectionError> {
        poll_fn(|cx| {
            self.inner.with(|s, h| {
                if let Some(d) = s.ep.connection_mut(h).and_then(|c| c.recv_datagram()) {
                    return Poll::Ready(Ok(d));
                }
                let Some(st) = s.conns.get_mut(&h) else {
                    return Poll::Ready(Err(ConnectionError::LocallyClosed));
                };
                if let Some(e) = st.error.clone() {
                    return Poll::Ready(Err(e));
                }
                register(&mut st.datagram, cx);
                Poll::Pending
            })
        })
        .await
    }

    /// Largest datagram payload that can be sent now.
    pub fn max_datagram_size(&self) -> Option<usize> {
        self.inner
            .with(|s, h| s.ep.connection(h).and_then(|c| c.max_datagram_size()))
    }

    /// Closes the connection with an application error code.
    pub fn close(&self, code: u64, reason: &[u8]) {
        self.inner.with(|s, h| {
            if let Some(c) = s.ep.connection_mut(h) {
                c.close(Instant::now(), code, reason);
            }
        });
        self.inner.shared.kick();
    }

    /// Client: waits until the server has sent a session ticket on this connection (one that
    /// arrived earlier counts), so that a later connection can resume it and send 0-RTT data.
    /// Servers send their tickets after the handshake: closing at once after a short exchange
    /// may lose them. Returns false if the connection ended first. Bound it with a timeout.
    pub async fn session_ticket(&self) -> bool {
        poll_fn(|cx| {
            self.inner.with(|s, h| match s.conns.get_mut(&h) {
                Some(st) if st.session_tickets > 0 => Poll::Ready(true),
                Some(st) if st.error.is_none() => {
                    register(&mut st.ticket, cx);
                    Poll::Pending
                }
                _ => Poll::Ready(false),
            })
        })
        .await
    }

    /// Waits until the connection is closed, and says why.
    pub async fn closed(&self) -> ConnectionError {
        let state = |s: &mut crate::endpoint::State, h| match s.conns.get(&h) {
            Some(st) => match &st.error {
                Some(e) => Err(e.clone()),
                None => Ok(st.closed.clone()),
            },
            None => Err(ConnectionError::LocallyClosed),
        };
        loop {
            let notify = match self.inner.with(state) {
                Ok(n) => n,
                Err(e) => return e,
            };
            let notified = notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Waiting from here on; then looked at again, so a close in between is seen.
            notified.as_mut().enable();
            if let Err(e) = self.inner.with(state) {
                return e;
            }
            notified.await;
        }
    }

    /// Why the connection closed, if it has.
    pub fn close_reason(&self) -> Option<ConnectionError> {
        self.inner
            .with(|s, h| s.conns.get(&h).and_then(|c| c.error.clone()))
    }

    /// The peer's address (it changes when the peer migrates).
    pub fn remote_address(&self) -> SocketAddr {
        self.inner
            .with(|s, h| s.ep.connection(h).map(|c| c.remote_address()))
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// Transport statistics: RTT, congestion window, packets sent and lost, ...
    pub fn stats(&self) -> ConnectionStats {
        self.inner
            .with(|s, h| s.ep.connection(h).map(|c| c.stats()).unwrap_or_default())
    }

    /// Negotiated ALPN protocol.
    pub fn alpn(&self) -> Option<Vec<u8>> {
        self.inner.with(|s, h| {
            s.ep.connection(h)
                .and_then(|c| c.alpn().map(<[u8]>::to_vec))
        })
    }

    /// Server: the SNI the client sent.
    pub fn server_name(&self) -> Option<String> {
        self.inner.with(|s, h| {
            s.ep.connection(h)
                .and_then(|c| c.server_name().map(str::to_owned))
        })
    }

    /// Whether the server accepted 0-RTT (client; `None` if not attempted or unknown yet).
    pub fn zero_rtt_accepted(&self) -> Option<bool> {
        self.inner
            .with(|s, h| s.ep.connection(h).and_then(|c| c.zero_rtt_accepted()))
    }

    /// Starts a 1-RTT key update; false if one is already in progress.
    pub fn force_key_update(&self) -> bool {
        let r = self.inner.with(|s, h| {
            s.ep.connection_mut(h)
                .is_some_and(|c| c.initiate_key_update())
        });
        self.inner.shared.kick();
        r
    }

    /// The negotiated QUIC version.
    pub fn version(&self) -> Option<kuai_proto::Version> {
        self.inner
            .with(|s, h| s.ep.connection(h).map(|c| c.version()))
    }

    /// Sets a qlog-shaped event callback for this connection.
    pub fn set_tracer(&self, tracer: Box<dyn kuai_proto::trace::Tracer>) {
        self.inner.with(|s, h| {
            if let Some(c) = s.ep.connection_mut(h) {
                c.set_tracer(tracer);
            }
        });
    }
}

fn stream_io_error(e: StreamError) -> io::Error {
    let kind = match e {
        StreamError::Reset(_) | StreamError::Stopped(_) => io::ErrorKind::ConnectionReset,
        StreamError::UnknownStream | StreamError::ClosedStream => io::ErrorKind::NotConnected,
        StreamError::Blocked | StreamError::WouldBlock => io::ErrorKind::WouldBlock,
    };
    io::Error::new(kind, e)
}

fn connection_io_error(e: ConnectionError) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, e)
}

/// Why a write failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteError {
    /// The peer asked us to stop with this code.
    Stopped(u64),
    /// The connection closed.
    ConnectionLost(ConnectionError),
    /// The stream was finished or reset already.
    ClosedStream,
    /// The stream was opened in 0-RTT and the server rejected the early data: it never
    /// existed for the server. Open a new stream and send again (RFC 9001 §4.6.2).
    ZeroRttRejected,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Stopped(c) => write!(f, "peer stopped the stream with code {c}"),
            WriteError::ConnectionLost(e) => write!(f, "connection lost: {e}"),
            WriteError::ClosedStream => f.write_str("stream already finished or reset"),
            WriteError::ZeroRttRejected => f.write_str(REJECTED),
        }
    }
}

impl std::error::Error for WriteError {}

impl From<WriteError> for io::Error {
    fn from(e: WriteError) -> Self {
        let kind = match e {
            WriteError::Stopped(_) => io::ErrorKind::ConnectionReset,
            WriteError::ConnectionLost(_) => io::ErrorKind::ConnectionAborted,
            WriteError::ClosedStream => io::ErrorKind::NotConnected,
            WriteError::ZeroRttRejected => io::ErrorKind::ConnectionReset,
        };
        io::Error::new(kind, e)
    }
}

/// Why a read failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadError {
    /// The peer reset the stream with this code.
    Reset(u64),
    /// The connection closed.
    ConnectionLost(ConnectionError),
    /// `read_to_end` hit its size limit.
    TooLong,
    /// The stream was stopped or finished already.
    ClosedStream,
    /// The stream was opened in 0-RTT and the server rejected the early data (see
    /// [`WriteError::ZeroRttRejected`]).
    ZeroRttRejected,
}

const REJECTED: &str = "the server rejected 0-RTT; the stream must be opened again";

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Reset(c) => write!(f, "peer reset the stream with code {c}"),
            ReadError::ConnectionLost(e) => write!(f, "connection lost: {e}"),
            ReadError::TooLong => f.write_str("stream longer than the limit"),
            ReadError::ClosedStream => f.write_str("stream already closed"),
            ReadError::ZeroRttRejected => f.write_str(REJECTED),
        }
    }
}

impl std::error::Error for ReadError {}

impl From<ReadError> for io::Error {
    fn from(e: ReadError) -> Self {
        let kind = match e {
            ReadError::Reset(_) => io::ErrorKind::ConnectionReset,
            ReadError::ConnectionLost(_) => io::ErrorKind::ConnectionAborted,
            ReadError::TooLong => io::ErrorKind::InvalidData,
            ReadError::ClosedStream => io::ErrorKind::NotConnected,
            ReadError::ZeroRttRejected => io::ErrorKind::ConnectionReset,
        };
        io::Error::new(kind, e)
    }
}

/// The sending half of a stream. Dropping it without [`finish`](Self::finish) or
/// [`reset`](Self::reset) finishes it.
pub struct SendStream {
    inner: Arc<ConnectionInner>,
    id: StreamId,
    done: bool,
    /// Opened by a client in 0-RTT.
    early: bool,
}

/// Whether a stream opened in 0-RTT was voided by the server's rejection of the early data:
/// the transport started its streams over, so the ID may now name a new stream.
fn voided(
    early: bool,
    conns: &kuai_proto::IdMap<ConnectionHandle, Box<ConnState>>,
    h: ConnectionHandle,
) -> bool {
    early && conns.get(&h).is_some_and(|st| st.zero_rtt_rejected)
}

impl SendStream {
    fn new(inner: Arc<ConnectionInner>, id: StreamId) -> Self {
        inner.with(|s, h| {
            if let Some(st) = s.conns.get_mut(&h) {
                st.stream(id).send_handle = true;
            }
        });
        Self {
            inner,
            id,
            done: false,
            early: false,
        }
    }

    fn early(mut self, early: bool) -> Self {
        self.early = early;
        self
    }

    /// Whether this stream went out in 0-RTT that the server rejected; every operation on
    /// it then fails with [`WriteError::ZeroRttRejected`].
    pub fn is_0rtt_rejected(&self) -> bool {
        self.early && self.inner.with(|s, h| voided(true, &s.conns, h))
    }

    /// The stream's ID.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// Queues as much of `data` as the send buffer takes, waiting for room if none.
    pub fn poll_write_chunk(
        &mut self,
        cx: &mut Context<'_>,
        data: &Bytes,
    ) -> Poll<Result<usize, WriteError>> {
        let id = self.id;
        let early = self.early;
        let mut send = false;
        let r = self.inner.with(|s, h| {
            if voided(early, &s.conns, h) {
                return Poll::Ready(Err(WriteError::ZeroRttRejected));
            }
            let Some(c) = s.ep.connection_mut(h) else {
                return Poll::Ready(Err(WriteError::ConnectionLost(conn_error(
                    s.conns.get(&h).map(Box::as_ref),
                ))));
            };
            let written = c.write(id, data.clone());
            send = c.take_send_hint();
            match written {
                // Nothing to write is written at once (no room will be announced for it).
                Ok(0) if data.is_empty() => Poll::Ready(Ok(0)),
                Ok(0) => {
                    if let Some(st) = s.conns.get_mut(&h) {
                        if let Some(e) = st.error.clone() {
                            return Poll::Ready(Err(WriteError::ConnectionLost(e)));
                        }
                        st.stream(id).write = Some(cx.waker().clone());
                    }
                    Poll::Pending
                }
                Ok(n) => Poll::Ready(Ok(n)),
                Err(StreamError::Stopped(code)) => Poll::Ready(Err(WriteError::Stopped(code))),
                Err(_) => Poll::Ready(Err(closed_or_stopped(s.conns.get(&h).map(Box::as_ref), id))),
            }
        });
        // Bytes behind others not yet sent go when those do: no need to wake the driver.
        if send {
            self.inner.shared.kick();
        }
        r
    }

    /// Writes all of `data` without copying it.
    pub async fn write_chunk(&mut self, mut data: Bytes) -> Result<(), WriteError> {
        while !data.is_empty() {
            let n = poll_fn(|cx| self.poll_write_chunk(cx, &data)).await?;
            let _ = data.split_to(n);
        }
        Ok(())
    }

    /// Writes all of `buf`.
    pub async fn write_all(&mut self, buf: &[u8]) -> Result<(), WriteError> {
        self.write_chunk(Bytes::copy_from_slice(buf)).await
    }

    /// Ends the stream: the peer reads to the end, then sees EOF.
    pub fn finish(&mut self) -> Result<(), WriteError> {
        if self.done {
            return Ok(());
        }
        let id = self.id;
        let early = self.early;
        let mut send = false;
        let r = self.inner.with(|s, h| match s.ep.connection_mut(h) {
            _ if voided(early, &s.conns, h) => Err(WriteError::ZeroRttRejected),
            Some(c) => {
                let r = c.finish(id);
                send = c.take_send_hint();
                r.map_err(|e| match e {
                    StreamError::Stopped(code) => WriteError::Stopped(code),
                    _ => closed_or_stopped(s.conns.get(&h).map(Box::as_ref), id),
                })
            }
            None => Err(WriteError::ConnectionLost(conn_error(
                s.conns.get(&h).map(Box::as_ref),
            ))),
        });
        self.done = true;
        // A FIN behind unsent bytes goes with the last of them.
        if send {
            self.inner.shared.kick();
        }
        r
    }

    /// Abandons the stream with an application error code (RESET_STREAM).
    pub fn reset(&mut self, code: u64) -> Result<(), WriteError> {
        let id = self.id;
        let early = self.early;
        self.done = true;
        let r = self.inner.with(|s, h| match s.ep.connection_mut(h) {
            _ if voided(early, &s.conns, h) => Err(WriteError::ZeroRttRejected),
            Some(c) => c
                .reset_stream(id, code)
                .map_err(|_| WriteError::ClosedStream),
            None => Err(WriteError::ConnectionLost(conn_error(
                s.conns.get(&h).map(Box::as_ref),
            ))),
        });
        self.inner.shared.kick();
        r
    }

    /// Takes at most `max` bytes ahead of what has been sent (`None`: up to the send buffer).
    /// For data read into fresh memory just for this stream (a file): the next piece is read
    /// when the last is nearly sent, and is still in the CPU's cache when it is copied into
    /// packets.
    pub fn set_max_unsent(&self, max: Option<u64>) {
        self.with_conn(|c, id| {
            let _ = c.set_max_unsent(id, max);
        });
    }

    /// Resets the stream with application error `code` unless everything written on it, its
    /// end included, is acknowledged within `timeout` from now: for a response the peer may
    /// stop taking (its flow-control credit never comes). The transport keeps the deadline,
    /// so the stream's handle may be dropped after [`finish`](Self::finish) and no task has
    /// to wait for the delivery. At the deadline, [`stopped`](Self::stopped) and
    /// [`cancelled`](Self::cancelled) report `Stopped(code)`, and writes fail with it.
    pub fn set_delivery_timeout(&self, timeout: std::time::Duration, code: u64) {
        let Some(at) = Instant::now().checked_add(timeout) else {
            return;
        };
        // The driver schedules the connection's new deadline when it next takes the
        // connection's transmits: the write or finish that goes with this brings that turn.
        self.with_conn(|c, id| {
            let _ = c.set_delivery_deadline(id, at, code);
        });
    }

    /// Sets the stream's priority (RFC 9218 urgency 0–7 and incremental).
    pub fn set_priority(&self, p: Priority) {
        self.with_conn(|c, id| {
            let _ = c.set_priority(id, p);
        });
    }

    /// Runs `f` on the stream's connection, unless it is gone or the stream was voided by a
    /// refused 0-RTT.
    fn with_conn(&self, f: impl FnOnce(&mut kuai_proto::Connection, StreamId)) {
        let id = self.id;
        let early = self.early;
        self.inner.with(|s, h| {
            if voided(early, &s.conns, h) {
                return;
            }
            if let Some(c) = s.ep.connection_mut(h) {
                f(c, id);
            }
        });
    }

    /// Waits until everything sent was acknowledged (`Ok`) or the peer stopped the stream
    /// (`Err(Stopped)`).
    pub async fn stopped(&mut self) -> Result<(), WriteError> {
        let id = self.id;
        let early = self.early;
        poll_fn(|cx| {
            self.inner.with(|s, h| {
                if voided(early, &s.conns, h) {
                    return Poll::Ready(Err(WriteError::ZeroRttRejected));
                }
                let Some(st) = s.conns.get_mut(&h) else {
                    return Poll::Ready(Err(WriteError::ConnectionLost(
                        ConnectionError::LocallyClosed,
                    )));
                };
                if let Some(code) = st.stopped(id) {
                    return Poll::Ready(Err(WriteError::Stopped(code)));
                }
                if st.all_acked(id) {
                    return Poll::Ready(Ok(()));
                }
                if let Some(e) = st.error.clone() {
                    return Poll::Ready(Err(WriteError::ConnectionLost(e)));
                }
                st.stream(id).finished = Some(cx.waker().clone());
                Poll::Pending
            })
        })
        .await
    }
}

impl SendStream {
    /// Resolves when nothing more sent on this stream can reach the peer's application: the
    /// peer stopped it (STOP_SENDING, `Stopped`), the connection was lost, or the 0-RTT it
    /// went out in was rejected. It never resolves while the stream can still deliver, so a
    /// server can race it against the work that makes a response, to drop that work when
    /// the client cancels (RFC 9114 §4.1.1).
    pub async fn cancelled(&mut self) -> WriteError {
        let id = self.id;
        let early = self.early;
        poll_fn(|cx| {
            self.inner.with(|s, h| {
                if voided(early, &s.conns, h) {
                    return Poll::Ready(WriteError::ZeroRttRejected);
                }
                let Some(st) = s.conns.get_mut(&h) else {
                    return Poll::Ready(WriteError::ConnectionLost(ConnectionError::LocallyClosed));
                };
                if let Some(code) = st.stopped(id) {
                    return Poll::Ready(WriteError::Stopped(code));
                }
                if let Some(e) = st.error.clone() {
                    return Poll::Ready(WriteError::ConnectionLost(e));
                }
                st.stream(id).finished = Some(cx.waker().clone());
                Poll::Pending
            })
        })
        .await
    }
}

impl Drop for SendStream {
    fn drop(&mut self) {
        let (id, early, finish) = (self.id, self.early, !self.done);
        self.inner.with(|s, h| {
            // A voided stream's ID may name a new stream now, whose state this is.
            if voided(early, &s.conns, h) {
                return;
            }
            if finish && let Some(c) = s.ep.connection_mut(h) {
                let _ = c.finish(id);
            }
            if let Some(st) = s.conns.get_mut(&h) {
                st.drop_send_handle(id);
            }
        });
        if finish {
            self.inner.shared.kick();
        }
    }
}

/// A write on a stream the transport no longer knows: if the peer had stopped it
/// (STOP_SENDING), the stream was reset and then forgotten, and that is what to report.
fn closed_or_stopped(st: Option<&ConnState>, id: StreamId) -> WriteError {
    let Some(st) = st else {
        return WriteError::ClosedStream;
    };
    if let Some(e) = &st.error {
        return WriteError::ConnectionLost(e.clone());
    }
    match st.stopped(id) {
        Some(code) => WriteError::Stopped(code),
        None => WriteError::ClosedStream,
    }
}

impl AsyncWrite for SendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let data = Bytes::copy_from_slice(buf);
        this.poll_write_chunk(cx, &data).map_err(io::Error::from)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().finish().map_err(io::Error::from))
    }
}

/// The receiving half of a stream. Dropping it before the end asks the peer to stop.
pub struct RecvStream {
    inner: Arc<ConnectionInner>,
    id: StreamId,
    done: bool,
    /// Opened by a client in 0-RTT.
    early: bool,
}

impl RecvStream {
    fn new(inner: Arc<ConnectionInner>, id: StreamId) -> Self {
        Self {
            inner,
            id,
            done: false,
            early: false,
        }
    }

    fn early(mut self, early: bool) -> Self {
        self.early = early;
        self
    }

    /// Whether this stream went out in 0-RTT that the server rejected; every operation on
    /// it then fails with [`ReadError::ZeroRttRejected`], and its ID may already name a new
    /// stream.
    pub fn is_0rtt_rejected(&self) -> bool {
        self.early && self.inner.with(|s, h| voided(true, &s.conns, h))
    }

    /// The stream's ID.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// Server: whether some of this stream's data arrived in 0-RTT, which an attacker can
    /// replay (RFC 9001 §9.2). A request that did should only do what a safe, idempotent
    /// method may; RFC 8470 has the server answer others with 425 Too Early.
    pub fn received_in_0rtt(&self) -> bool {
        let id = self.id;
        self.inner
            .with(|s, h| s.ep.connection(h).is_some_and(|c| c.received_in_0rtt(id)))
    }

    /// The next chunk of at most `max` bytes, without copying; `None` at the end.
    pub fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Result<Option<Bytes>, ReadError>> {
        let id = self.id;
        let early = self.early;
        let mut send = false;
        let r = self.inner.with(|s, h| {
            if voided(early, &s.conns, h) {
                return Poll::Ready(Err(ReadError::ZeroRttRejected));
            }
            let Some(c) = s.ep.connection_mut(h) else {
                return Poll::Ready(Err(ReadError::ConnectionLost(conn_error(
                    s.conns.get(&h).map(Box::as_ref),
                ))));
            };
            let read = c.read(id, max);
            send = c.take_send_hint();
            match read {
                Ok(x) => Poll::Ready(Ok(x)),
                Err(StreamError::WouldBlock) => {
                    if let Some(st) = s.conns.get_mut(&h) {
                        if let Some(e) = st.error.clone() {
                            return Poll::Ready(Err(ReadError::ConnectionLost(e)));
                        }
                        st.stream(id).read = Some(cx.waker().clone());
                    }
                    Poll::Pending
                }
                Err(StreamError::Reset(code)) => Poll::Ready(Err(ReadError::Reset(code))),
                Err(_) => match s.conns.get(&h).and_then(|c| c.error.clone()) {
                    Some(e) => Poll::Ready(Err(ReadError::ConnectionLost(e))),
                    None => Poll::Ready(Err(ReadError::ClosedStream)),
                },
            }
        });
        if matches!(r, Poll::Ready(Ok(None)) | Poll::Ready(Err(_))) {
            self.done = true;
        }
        // Reading may open flow-control credit, or room for another stream, to announce.
        if send {
            self.inner.shared.kick();
        }
        r
    }

    /// Resolves with the peer's RESET_STREAM code once it resets the stream, without
    /// reading any of its data (a later read still reports the reset); an error when the
    /// connection is lost or the stream is over. Uses the same wake-up as reads: not to be
    /// polled beside them.
    pub fn poll_reset(&mut self, cx: &mut Context<'_>) -> Poll<Result<u64, ReadError>> {
        let id = self.id;
        let early = self.early;
        self.inner.with(|s, h| {
            if voided(early, &s.conns, h) {
                return Poll::Ready(Err(ReadError::ZeroRttRejected));
            }
            let Some(c) = s.ep.connection(h) else {
                return Poll::Ready(Err(ReadError::ConnectionLost(conn_error(
                    s.conns.get(&h).map(Box::as_ref),
                ))));
            };
            match c.stream_reset_received(id) {
                Ok(Some(code)) => return Poll::Ready(Ok(code)),
                Ok(None) => {}
                // Its receiving side is over (read to its end): no reset will come.
                Err(_) => return Poll::Ready(Err(ReadError::ClosedStream)),
            }
            match s.conns.get_mut(&h) {
                Some(st) => {
                    if let Some(e) = st.error.clone() {
                        return Poll::Ready(Err(ReadError::ConnectionLost(e)));
                    }
                    st.stream(id).read = Some(cx.waker().clone());
                    Poll::Pending
                }
                None => Poll::Ready(Err(ReadError::ClosedStream)),
            }
        })
    }

    /// See [`poll_reset`](Self::poll_reset).
    pub async fn reset_received(&mut self) -> Result<u64, ReadError> {
        poll_fn(|cx| self.poll_reset(cx)).await
    }

    /// The next chunk, without copying; `None` at the end of the stream.
    pub async fn read_chunk(&mut self, max: usize) -> Result<Option<Bytes>, ReadError> {
        poll_fn(|cx| self.poll_read_chunk(cx, max)).await
    }

    /// Reads the whole stream, failing with [`ReadError::TooLong`] beyond `limit` bytes.
    pub async fn read_to_end(&mut self, limit: usize) -> Result<Vec<u8>, ReadError> {
        let mut out = Vec::new();
        while let Some(chunk) = self.read_chunk(usize::MAX).await? {
            if out.len() + chunk.len() > limit {
                let _ = self.stop(0);
                return Err(ReadError::TooLong);
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// Asks the peer to stop sending (STOP_SENDING) with an application error code. True if
    /// more than the stream's end was left: data unread, the end not received yet, or a reset
    /// not read (what a protocol on top abandons, e.g. a QPACK section it must cancel).
    pub fn stop(&mut self, code: u64) -> Result<bool, ReadError> {
        self.stop_with(code, false)
    }

    /// Stops reading; the STOP_SENDING goes out only if more than the stream's FIN is still
    /// to come (see [`kuai_proto::Connection::stop_stream_unless_ending`]). For a server that
    /// has answered a request its client may still be finishing. True as for
    /// [`stop`](Self::stop).
    pub fn stop_unless_ending(&mut self, code: u64) -> Result<bool, ReadError> {
        self.stop_with(code, true)
    }

    fn stop_with(&mut self, code: u64, unless_ending: bool) -> Result<bool, ReadError> {
        let id = self.id;
        let early = self.early;
        self.done = true;
        let r = self.inner.with(|s, h| match s.ep.connection_mut(h) {
            _ if voided(early, &s.conns, h) => Err(ReadError::ZeroRttRejected),
            Some(c) if unless_ending => c
                .stop_stream_unless_ending(id, code)
                .map_err(|_| ReadError::ClosedStream),
            Some(c) => c.stop_stream(id, code).map_err(|_| ReadError::ClosedStream),
            None => Err(ReadError::ConnectionLost(conn_error(
                s.conns.get(&h).map(Box::as_ref),
            ))),
        });
        self.inner.shared.kick();
        r
    }
}

impl Drop for RecvStream {
    fn drop(&mut self) {
        // A stream read to its end left no waker (the read that saw the end returned
        // ready): nothing to do, and no lock taken, for the ordinary request.
        if self.done {
            return;
        }
        let _ = self.stop(0);
        // A read abandoned before the drop left its waker (and with it the task's memory):
        // after a stop no event comes to take it.
        let (id, early) = (self.id, self.early);
        self.inner.with(|s, h| {
            if voided(early, &s.conns, h) {
                return;
            }
            if let Some(st) = s.conns.get_mut(&h) {
                st.drop_recv_handle(id);
            }
        });
    }
}

impl AsyncRead for RecvStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.poll_read_chunk(cx, buf.remaining()) {
            Poll::Ready(Ok(Some(chunk))) => {
                buf.put_slice(&chunk);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(None)) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[allow(dead_code)]
fn _assert_send() {
    fn is_send<T: Send>() {}
    is_send::<Connection>();
    is_send::<SendStream>();
    is_send::<RecvStream>();
    let _ = stream_io_error;
    let _ = connection_io_error;
}
