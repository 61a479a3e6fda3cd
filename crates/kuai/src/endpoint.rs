//! The async endpoint: one UDP socket, one driver task, many connections.

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use kuai_proto::connection::EcnCodepoint;
use kuai_proto::{ConnectionError, ConnectionHandle, Dir, Event, StreamEvent, StreamId};
use quinn_udp::RecvMeta;
use tokio::sync::Notify;

use crate::connection::{Connecting, ConnectionInner};
use crate::udp::{SocketOptions, UdpSocket, UdpStats, UdpStatsSnapshot};
use crate::{ClientConfig, EndpointConfig, ServerConfig};

/// Largest UDP payload (a GRO batch) one receive buffer takes.
const RECV_BUF: usize = 64 * 1024;
/// Datagrams per receive call.
const RECV_BATCH: usize = 32;
/// Size of the buffers received datagrams are copied into.
const POOL_BUF: usize = 256 * 1024;
/// Largest batch handed to one GSO send.
const MAX_GSO: usize = 32;

/// What the endpoint keeps for one stream: the tasks waiting on it, and, while a `SendStream`
/// handle lives, how its sending ended. An entry goes when none of that is left.
#[derive(Default)]
pub(crate) struct StreamWaiters {
    pub read: Option<Waker>,
    pub write: Option<Waker>,
    pub finished: Option<Waker>,
    pub send_handle: bool,
    /// All sent data was acknowledged (kept only for a live handle).
    pub all_acked: bool,
    /// The peer sent STOP_SENDING with this code (kept only for a live handle).
    pub stopped: Option<u64>,
}

impl StreamWaiters {
    fn is_empty(&self) -> bool {
        self.read.is_none() && self.write.is_none() && self.finished.is_none() && !self.send_handle
    }
}

/// Wakers and status of one connection, kept by the endpoint.
#[derive(Default)]
pub(crate) struct ConnState {
    pub connected: bool,
    pub error: Option<ConnectionError>,
    pub handshake: Vec<Waker>,
    /// Per stream; a connection with nothing waiting and no send handles has none.
    pub streams: HashMap<StreamId, StreamWaiters>,
    pub accept: [Vec<Waker>; 2],
    pub open: [Vec<Waker>; 2],
    pub datagram: Vec<Waker>,
    pub closed: Vec<Waker>,
    pub zero_rtt_rejected: bool,
    pub server_name: Option<String>,
    /// The transport forgot the connection; only the error remains.
    pub drained: bool,
}

impl ConnState {
    /// The entry of stream `id`, made if needed.
    pub fn stream(&mut self, id: StreamId) -> &mut StreamWaiters {
        self.streams.entry(id).or_default()
    }

    /// Wakes the waker `which` picks from stream `id`'s entry, dropping the entry if that
    /// leaves it empty.
    fn wake_stream(&mut self, id: StreamId, which: impl Fn(&mut StreamWaiters) -> Option<Waker>) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        if let Some(w) = which(s) {
            w.wake();
        }
        if s.is_empty() {
            self.streams.remove(&id);
        }
    }

    /// The STOP_SENDING code of a stream with a live send handle.
    pub fn stopped(&self, id: StreamId) -> Option<u64> {
        self.streams.get(&id).and_then(|s| s.stopped)
    }

    /// Whether a stream with a live send handle had all its data acknowledged.
    pub fn all_acked(&self, id: StreamId) -> bool {
        self.streams.get(&id).is_some_and(|s| s.all_acked)
    }

    /// A `SendStream` handle went away: forget how its sending ended.
    pub fn drop_send_handle(&mut self, id: StreamId) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.send_handle = false;
            s.all_acked = false;
            s.stopped = None;
            if s.is_empty() {
                self.streams.remove(&id);
            }
        }
    }

    fn wake_all(&mut self) {
        for w in self.handshake.drain(..) {
            w.wake();
        }
        for s in self.streams.values_mut() {
            for w in [s.read.take(), s.write.take(), s.finished.take()]
                .into_iter()
                .flatten()
            {
                w.wake();
            }
        }
        self.streams.retain(|_, s| s.send_handle);
        for v in self.accept.iter_mut().chain(self.open.iter_mut()) {
            for w in v.drain(..) {
                w.wake();
            }
        }
        for w in self.datagram.drain(..).chain(self.closed.drain(..)) {
            w.wake();
        }
    }
}

pub(crate) struct State {
    pub ep: kuai_proto::Endpoint,
    pub socket: Arc<UdpSocket>,
    /// Server: a second socket on the preferred address (RFC 9000 §9.6), on an IP of its
    /// own, so a datagram's local IP tells which address a client used.
    preferred: Option<Arc<UdpSocket>>,
    /// Boxed: the map grows by doubling, and a slot the size of a `ConnState` in each of its
    /// spare buckets cost about a kilobyte per connection.
    pub conns: HashMap<ConnectionHandle, Box<ConnState>>,
    incoming: VecDeque<ConnectionHandle>,
    accept_wakers: Vec<Waker>,
    client_config: Option<ClientConfig>,
    /// NEW_TOKEN tokens by server name, for the next connection's Initial.
    tokens: HashMap<String, Bytes>,
    closed: bool,
    max_segments: usize,
    idle_wakers: Vec<Waker>,
    qlog_dir: Option<std::path::PathBuf>,
}

pub(crate) struct Shared {
    pub state: Mutex<State>,
    pub notify: Notify,
    pub udp: UdpStats,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the driver to send what the application queued.
    pub fn kick(&self) {
        self.notify.notify_one();
    }
}

/// Options for binding an [`Endpoint`] (see [`EndpointBuilder::bind`]).
#[derive(Clone, Default)]
pub struct EndpointBuilder {
    config: Option<EndpointConfig>,
    server: Option<ServerConfig>,
    client: Option<ClientConfig>,
    socket: SocketOptions,
    max_segments: Option<usize>,
    qlog_dir: Option<std::path::PathBuf>,
    preferred_address: Option<SocketAddr>,
}

impl EndpointBuilder {
    /// Connection-ID generator and stateless reset key.
    pub fn endpoint_config(mut self, c: EndpointConfig) -> Self {
        self.config = Some(c);
        self
    }

    /// Accept connections with this configuration.
    pub fn server(mut self, c: ServerConfig) -> Self {
        self.server = Some(c);
        self
    }

    /// The configuration [`Endpoint::connect`] uses.
    pub fn client(mut self, c: ClientConfig) -> Self {
        self.client = Some(c);
        self
    }

    /// Share the port with other sockets (SO_REUSEPORT), for several workers.
    pub fn reuse_port(mut self, on: bool) -> Self {
        self.socket.reuse_port = on;
        self
    }

    /// Turn UDP GSO off (on by default where the kernel supports it).
    pub fn gso(mut self, on: bool) -> Self {
        self.socket.gso = on;
        self
    }

    /// Turn UDP GRO off.
    pub fn gro(mut self, on: bool) -> Self {
        self.socket.gro = on;
        self
    }

    /// At most this many datagrams per send call (1: every QUIC datagram in its own UDP
    /// send, as packet captures on loopback need).
    pub fn max_segments(mut self, n: usize) -> Self {
        self.max_segments = Some(n.max(1));
        self
    }

    /// Write a qlog trace of every connection into this directory
    /// (`<original DCID>_<client|server>.sqlog`).
    pub fn qlog_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.qlog_dir = Some(dir.into());
        self
    }

    /// Server: also listen on `addr` and offer it to clients as the preferred address
    /// (RFC 9000 §9.6): they move there once the handshake is confirmed. Its IP must differ
    /// from the main socket's (port 0 picks a free port).
    pub fn preferred_address(mut self, addr: SocketAddr) -> Self {
        self.preferred_address = Some(addr);
        self
    }

    /// Binds the socket and starts the endpoint's driver on the current tokio runtime.
    pub fn bind(self, addr: SocketAddr) -> io::Result<Endpoint> {
        let socket = UdpSocket::bind(addr, self.socket)?;
        Endpoint::from_socket(socket, self)
    }
}

/// A QUIC endpoint on a UDP socket. Cheap to clone; all clones share the socket.
#[derive(Clone)]
pub struct Endpoint {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("local_addr", &self.local_addr().ok())
            .finish()
    }
}

impl Endpoint {
    /// Options for binding an endpoint.
    pub fn builder() -> EndpointBuilder {
        EndpointBuilder::default()
    }

    /// A server endpoint on `addr`.
    pub fn server(config: ServerConfig, addr: SocketAddr) -> io::Result<Self> {
        Self::builder().server(config).bind(addr)
    }

    /// A client endpoint on `addr` (use port 0 for an ephemeral port).
    pub fn client(addr: SocketAddr) -> io::Result<Self> {
        Self::builder().bind(addr)
    }

    fn from_socket(socket: UdpSocket, mut b: EndpointBuilder) -> io::Result<Self> {
        let now = Instant::now();
        let preferred = match b.preferred_address {
            Some(addr) => {
                let main = socket.local_addr();
                if addr.ip() == main.ip() || addr.ip().is_unspecified() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "the preferred address {addr} needs an IP address of its own \
                             (the endpoint listens on {main})"
                        ),
                    ));
                }
                let s = UdpSocket::bind(addr, b.socket).map_err(|e| {
                    io::Error::new(e.kind(), format!("preferred address {addr}: {e}"))
                })?;
                if let Some(server) = b.server.as_mut() {
                    server.proto.preferred_address = Some(preferred_config(s.local_addr()));
                }
                Some(Arc::new(s))
            }
            None => None,
        };
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let config = b.config.unwrap_or_default();
        let ep = kuai_proto::Endpoint::new(
            Arc::new(config.proto),
            b.server.map(|s| Arc::new(s.proto)),
            now,
            unix_ms,
            None,
        );
        let max_segments = b
            .max_segments
            .unwrap_or(MAX_GSO)
            .min(socket.max_segments())
            .max(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                ep,
                socket: Arc::new(socket),
                preferred,
                conns: HashMap::new(),
                incoming: VecDeque::new(),
                accept_wakers: Vec::new(),
                client_config: b.client,
                tokens: HashMap::new(),
                closed: false,
                max_segments,
                idle_wakers: Vec::new(),
                qlog_dir: b.qlog_dir,
            }),
            notify: Notify::new(),
            udp: UdpStats::default(),
        });
        let driver = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = drive(driver).await {
                tracing::error!(error = %e, "endpoint driver stopped");
            }
        });
        Ok(Self { shared })
    }

    /// The local socket address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.shared.lock().socket.local_addr())
    }

    /// Sets the configuration [`connect`](Self::connect) uses.
    pub fn set_default_client_config(&self, c: ClientConfig) {
        self.shared.lock().client_config = Some(c);
    }

    /// Starts accepting connections with `c` (or stops, with `None`).
    pub fn set_server_config(&self, c: Option<ServerConfig>) {
        let mut s = self.shared.lock();
        let preferred = s
            .preferred
            .as_ref()
            .map(|p| preferred_config(p.local_addr()));
        s.ep.set_server_config(c.map(|mut c| {
            if preferred.is_some() {
                c.proto.preferred_address = preferred;
            }
            Arc::new(c.proto)
        }));
    }

    /// The preferred address clients are offered, if the endpoint has one.
    pub fn preferred_address(&self) -> Option<SocketAddr> {
        self.shared
            .lock()
            .preferred
            .as_ref()
            .map(|p| p.local_addr())
    }

    /// Connects to `addr`, presenting `server_name` for SNI and certificate checks.
    pub fn connect(&self, addr: SocketAddr, server_name: &str) -> Result<Connecting, ConnectError> {
        let cfg = self
            .shared
            .lock()
            .client_config
            .clone()
            .ok_or(ConnectError::NoClientConfig)?;
        self.connect_with(cfg, addr, server_name)
    }

    /// Connects with an explicit client configuration.
    pub fn connect_with(
        &self,
        config: ClientConfig,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Connecting, ConnectError> {
        let mut s = self.shared.lock();
        if s.closed {
            return Err(ConnectError::EndpointClosed);
        }
        let local = s.socket.local_addr();
        // An IPv4 socket cannot reach an IPv6 peer; a dual-stack one maps IPv4 addresses.
        let addr = match (local, addr) {
            (SocketAddr::V4(_), SocketAddr::V6(_)) => return Err(ConnectError::AddressFamily),
            (SocketAddr::V6(_), SocketAddr::V4(a)) => {
                SocketAddr::new(a.ip().to_ipv6_mapped().into(), a.port())
            }
            _ => addr,
        };
        let token = s.tokens.get(server_name).cloned().unwrap_or_default();
        let now = Instant::now();
        let h =
            s.ep.connect_with_token(now, &config.proto, addr, server_name, token)
                .map_err(|e| ConnectError::Proto(e.to_string()))?;
        let st = ConnState {
            server_name: Some(server_name.to_owned()),
            ..ConnState::default()
        };
        s.conns.insert(h, Box::new(st));
        attach_qlog(&mut s, h, now);
        drop(s);
        self.shared.kick();
        Ok(Connecting::new(ConnectionInner::new(
            self.shared.clone(),
            h,
        )))
    }

    /// Waits for the next incoming connection; `None` once the endpoint is closed.
    pub async fn accept(&self) -> Option<Connecting> {
        poll_fn(|cx| {
            let mut s = self.shared.lock();
            if let Some(h) = s.incoming.pop_front() {
                return Poll::Ready(Some(h));
            }
            if s.closed {
                return Poll::Ready(None);
            }
            s.accept_wakers.push(cx.waker().clone());
            Poll::Pending
        })
        .await
        .map(|h| Connecting::new(ConnectionInner::new(self.shared.clone(), h)))
    }

    /// Closes every connection with `code` and stops accepting.
    pub fn close(&self, code: u64, reason: &[u8]) {
        let mut s = self.shared.lock();
        s.closed = true;
        let now = Instant::now();
        let handles: Vec<_> = s.ep.handles().collect();
        for h in handles {
            if let Some(c) = s.ep.connection_mut(h) {
                c.close(now, code, reason);
            }
        }
        for w in s.accept_wakers.drain(..) {
            w.wake();
        }
        drop(s);
        self.shared.kick();
    }

    /// Waits until every connection has finished closing.
    pub async fn wait_idle(&self) {
        poll_fn(|cx| {
            let mut s = self.shared.lock();
            if s.ep.connection_count() == 0 {
                return Poll::Ready(());
            }
            s.idle_wakers.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Moves the endpoint to a new socket bound to `addr` (client migration, RFC 9000 §9):
    /// every established client connection switches to a fresh connection ID and validates
    /// the new path.
    pub fn rebind(&self, addr: SocketAddr) -> io::Result<()> {
        let socket = UdpSocket::bind(addr, SocketOptions::default())?;
        let mut s = self.shared.lock();
        let local_ip = Some(socket.local_addr().ip()).filter(|ip| !ip.is_unspecified());
        s.socket = Arc::new(socket);
        let now = Instant::now();
        let handles: Vec<_> = s.ep.handles().collect();
        for h in handles {
            if let Some(c) = s.ep.connection_mut(h)
                && c.side().is_client()
                && c.is_handshake_confirmed()
                && let Err(e) = c.migrate(now, local_ip)
            {
                tracing::warn!(error = %e, "connection could not migrate");
            }
        }
        drop(s);
        self.shared.kick();
        Ok(())
    }

    /// Counters of the UDP layer (datagrams per send and receive call show GSO/GRO at work).
    pub fn udp_stats(&self) -> UdpStatsSnapshot {
        self.shared.udp.snapshot()
    }

    /// Datagrams one send call may carry on this socket (1 without GSO).
    pub fn max_gso_segments(&self) -> usize {
        self.shared.lock().max_segments
    }

    /// Counters of the endpoint: accepted, refused, Retry and reset packets sent, ...
    pub fn stats(&self) -> kuai_proto::endpoint::EndpointStats {
        self.shared.lock().ep.stats().clone()
    }

    /// Live connections, closing ones included.
    pub fn connection_count(&self) -> usize {
        self.shared.lock().ep.connection_count()
    }
}

/// Why a connection could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectError {
    /// `connect` needs a default client configuration; use `connect_with`.
    NoClientConfig,
    /// The endpoint was closed.
    EndpointClosed,
    /// An IPv4-only socket cannot reach an IPv6 address.
    AddressFamily,
    /// Rejected by the transport (bad server name, TLS configuration).
    Proto(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::NoClientConfig => f.write_str("no client configuration set"),
            ConnectError::EndpointClosed => f.write_str("endpoint closed"),
            ConnectError::AddressFamily => {
                f.write_str("cannot reach an IPv6 address from an IPv4 socket")
            }
            ConnectError::Proto(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for ConnectError {}

/// The driver: receives, runs timers, sends, and wakes application tasks.
async fn drive(shared: Arc<Shared>) -> io::Result<()> {
    let gro = shared.lock().socket.gro_segments() > 1;
    // A GRO buffer holds up to 64 KiB of coalesced datagrams; without GRO one datagram.
    let slot = if gro { RECV_BUF } else { 2048 };
    let mut rx = vec![0u8; slot * RECV_BATCH];
    let mut pool = BytesMut::with_capacity(POOL_BUF);
    let mut metas = [RecvMeta::default(); RECV_BATCH];
    let mut tx = Vec::with_capacity(MAX_GSO * 1500);
    // A transmit the socket could not take yet (send buffer full).
    let mut blocked: Option<(Arc<UdpSocket>, kuai_proto::Transmit, Vec<u8>)> = None;
    loop {
        let (socket, preferred, deadline, finished) = {
            let s = shared.lock();
            let finished = s.closed && s.ep.connection_count() == 0;
            (
                s.socket.clone(),
                s.preferred.clone(),
                {
                    let mut s = s;
                    s.ep.poll_timeout()
                },
                finished,
            )
        };
        if finished {
            return Ok(());
        }
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
                None => std::future::pending().await,
            }
        };
        let writable = async {
            match &blocked {
                Some((sock, ..)) => sock.writable().await,
                None => std::future::pending().await,
            }
        };
        let preferred_readable = async {
            match &preferred {
                Some(p) => p.readable().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = socket.readable() => r?,
            r = preferred_readable => r?,
            _ = sleep => {}
            _ = shared.notify.notified() => {}
            r = writable => r?,
        }
        let now = Instant::now();
        let mut s = shared.lock();
        // One receive batch per socket, then send. Draining the whole queue first held every
        // answer back until the last datagram was handled: with many handshakes queued the
        // peer sat idle while this side did all their crypto. A socket with more waiting stays
        // readable, so the next turn comes at once.
        //
        // Each datagram is copied once out of the reusable receive area into a shared pool
        // buffer: one allocation per 256 KiB rather than per datagram, and unread stream data
        // never pins a large receive area.
        for sock in std::iter::once(&socket).chain(preferred.as_ref()) {
            let n = {
                let mut slices: Vec<IoSliceMut<'_>> = rx
                    .chunks_mut(slot)
                    .take(RECV_BATCH)
                    .map(IoSliceMut::new)
                    .collect();
                match sock.try_recv(&shared.udp, &mut slices, &mut metas) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => {
                        // ICMP errors surface here on some kernels; the transport copes.
                        tracing::debug!(error = %e, "UDP receive error");
                        continue;
                    }
                }
            };
            // The local IP tells the transport which of our addresses the peer used.
            let local = sock.local_addr().ip();
            for (i, m) in metas[..n].iter().enumerate() {
                let data = &rx[i * slot..i * slot + m.len];
                let stride = m.stride.max(1);
                let ecn = m.ecn.and_then(|e| EcnCodepoint::from_bits(e as u8));
                let dst_ip = m.dst_ip.or(Some(local).filter(|ip| !ip.is_unspecified()));
                for seg in data.chunks(stride) {
                    if pool.capacity() - pool.len() < seg.len() {
                        pool = BytesMut::with_capacity(POOL_BUF.max(seg.len()));
                    }
                    pool.extend_from_slice(seg);
                    s.ep.handle_datagram(now, m.addr, dst_ip, ecn, pool.split());
                }
            }
        }
        s.ep.handle_timeout(now);
        // Send.
        if let Some((sock, t, buf)) = blocked.take() {
            match sock.try_send(
                &shared.udp,
                t.destination,
                t.ecn.map(|e| e as u8),
                t.src_ip,
                &buf[..t.size],
                t.segment_size,
            ) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => blocked = Some((sock, t, buf)),
                Ok(n) if n < t.size => {
                    let (t, rest) = remainder(t, &buf, n);
                    blocked = Some((sock, t, rest));
                }
                _ => {}
            }
        }
        while blocked.is_none() {
            let max = s.max_segments;
            let Some(t) = s.ep.poll_transmit(now, max, &mut tx) else {
                break;
            };
            // From the preferred address when the path is on it.
            let sock = match (&preferred, t.src_ip) {
                (Some(p), Some(ip)) if p.local_addr().ip() == ip => p,
                _ => &socket,
            };
            match sock.try_send(
                &shared.udp,
                t.destination,
                t.ecn.map(|e| e as u8),
                t.src_ip,
                &tx[..t.size],
                t.segment_size,
            ) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    blocked = Some((sock.clone(), t, tx[..t.size].to_vec()));
                }
                Ok(n) if n < t.size => {
                    let (t, rest) = remainder(t, &tx, n);
                    blocked = Some((sock.clone(), t, rest));
                }
                _ => {}
            }
        }
        dispatch(&mut s);
    }
}

/// What is left of a batch of datagrams after the socket took the first `sent` bytes.
fn remainder(t: kuai_proto::Transmit, buf: &[u8], sent: usize) -> (kuai_proto::Transmit, Vec<u8>) {
    let rest = buf[sent..t.size].to_vec();
    (
        kuai_proto::Transmit {
            size: t.size - sent,
            ..t
        },
        rest,
    )
}

fn preferred_config(addr: SocketAddr) -> kuai_proto::config::PreferredAddressConfig {
    match addr {
        SocketAddr::V4(a) => kuai_proto::config::PreferredAddressConfig {
            v4: Some(a),
            v6: None,
        },
        SocketAddr::V6(a) => kuai_proto::config::PreferredAddressConfig {
            v4: None,
            v6: Some(a),
        },
    }
}

/// Hands endpoint events to the application's wakers.
fn dispatch(s: &mut State) {
    while let Some(h) = s.ep.accept() {
        s.conns.entry(h).or_default();
        attach_qlog(s, h, Instant::now());
        s.incoming.push_back(h);
        for w in s.accept_wakers.drain(..) {
            w.wake();
        }
    }
    while let Some((h, ev)) = s.ep.poll_event() {
        let st = s.conns.entry(h).or_default();
        match ev {
            Event::Connected => {
                st.connected = true;
                // Taken, not drained: an established connection keeps no waker list for it.
                for w in std::mem::take(&mut st.handshake) {
                    w.wake();
                }
                for v in st.open.iter_mut() {
                    for w in v.drain(..) {
                        w.wake();
                    }
                }
            }
            Event::ZeroRttRejected => {
                st.zero_rtt_rejected = true;
                // Every stream so far was voided; their IDs start over.
                st.wake_all();
                st.streams.clear();
            }
            Event::Stream(se) => match se {
                StreamEvent::Readable(id) => st.wake_stream(id, |s| s.read.take()),
                StreamEvent::Writable(id) => st.wake_stream(id, |s| s.write.take()),
                StreamEvent::Finished(id) => {
                    if let Some(s) = st.streams.get_mut(&id)
                        && s.send_handle
                    {
                        s.all_acked = true;
                    }
                    st.wake_stream(id, |s| s.finished.take());
                }
                StreamEvent::Stopped(id, code) => {
                    if let Some(s) = st.streams.get_mut(&id)
                        && s.send_handle
                    {
                        s.stopped = Some(code);
                    }
                    st.wake_stream(id, |s| s.write.take());
                    st.wake_stream(id, |s| s.finished.take());
                }
                StreamEvent::Opened(d) => {
                    for w in st.accept[d as usize].drain(..) {
                        w.wake();
                    }
                }
                StreamEvent::Available(d) => {
                    for w in st.open[d as usize].drain(..) {
                        w.wake();
                    }
                }
            },
            Event::DatagramReceived => {
                for w in st.datagram.drain(..) {
                    w.wake();
                }
            }
            Event::NewToken(t) => {
                if let Some(name) = st.server_name.clone() {
                    s.tokens.insert(name, t);
                }
            }
            Event::ConnectionLost(e) => {
                st.error = Some(e);
                st.wake_all();
            }
            Event::HandshakeConfirmed
            | Event::PathMigrated { .. }
            | Event::PathValidated(_)
            | Event::PathValidationFailed(_)
            | Event::KeyUpdated { .. } => {}
        }
    }
    // Connections that drained: wake anyone still waiting. Their state stays until the last
    // application handle goes (ConnectionInner::drop), so late callers still learn why.
    while let Some(h) = s.ep.poll_removed() {
        if let Some(st) = s.conns.get_mut(&h)
            && !st.drained
        {
            st.drained = true;
            if st.error.is_none() {
                st.error = Some(ConnectionError::LocallyClosed);
            }
            st.wake_all();
        }
    }
    if s.ep.connection_count() == 0 {
        for w in s.idle_wakers.drain(..) {
            w.wake();
        }
    }
}

/// Starts a qlog trace for a new connection when the endpoint has a qlog directory.
fn attach_qlog(s: &mut State, h: ConnectionHandle, now: Instant) {
    let Some(dir) = s.qlog_dir.clone() else {
        return;
    };
    let Some(c) = s.ep.connection_mut(h) else {
        return;
    };
    match crate::qlog::QlogWriter::create(&dir, &c.original_dcid(), c.side(), now) {
        Ok(w) => c.set_tracer(Box::new(w)),
        Err(e) => tracing::warn!(error = %e, dir = %dir.display(), "cannot write qlog"),
    }
}

/// Registers `cx`'s waker in a slot, replacing an older one from the same task.
pub(crate) fn register(slot: &mut Vec<Waker>, cx: &Context<'_>) {
    if !slot.iter().any(|w| w.will_wake(cx.waker())) {
        slot.push(cx.waker().clone());
    }
}

pub(crate) fn dir_index(d: Dir) -> usize {
    d as usize
}
