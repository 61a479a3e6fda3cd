//! The async endpoint: one UDP socket per worker, one driver task per worker, many
//! connections. Each connection lives on one worker; the connection IDs a worker issues name
//! it, and the kernel steers every datagram to the worker its destination CID names.

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use kuai_proto::EcnCodepoint;
use kuai_proto::{ConnectionError, ConnectionHandle, Dir, Event, IdMap, StreamEvent, StreamId};
use quinn_udp::RecvMeta;
use tokio::sync::Notify;

use crate::connection::{Connecting, ConnectionInner};
use crate::replay::{AntiReplay, Held, Verdict};
use crate::udp::{RecvPool, SocketOptions, UdpSocket, UdpStats, UdpStatsSnapshot, worker_of};
use crate::{ClientConfig, EndpointConfig, ServerConfig};

/// Largest UDP payload (a GRO batch) one receive buffer takes.
const RECV_BUF: usize = 64 * 1024;
/// A receive slot without GRO: one datagram of up to the 1500-byte Ethernet MTU and then
/// some. Advertised to peers as our max_udp_payload_size (see [`recv_slot`]).
const RECV_SLOT: usize = 2048;

/// The largest datagram a worker's receive slot takes whole. A GRO buffer holds up to 64 KiB
/// of coalesced datagrams (any single datagram fits); without GRO a slot is one datagram.
fn recv_slot(socket: &UdpSocket) -> usize {
    if socket.gro_segments() > 1 {
        65_527
    } else {
        RECV_SLOT
    }
}
/// Datagrams per receive call.
const RECV_BATCH: usize = 32;
/// Bytes a driver receives, after waking tasks, before it lets them run.
const YIELD_AFTER_BYTES: usize = 512 * 1024;
/// Datagrams a worker's inbox holds at most; more are dropped, as a full socket buffer
/// would (a worker that cannot keep up must not queue without bound).
const INBOX_MAX: usize = 4096;
/// Largest batch handed to one GSO send.
const MAX_GSO: usize = 32;

/// Length of the connection IDs of an endpoint that only connects out.
const CLIENT_CID_LEN: usize = 4;

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
        self.read.is_none()
            && self.write.is_none()
            && self.finished.is_none()
            && !self.send_handle
            && self.stopped.is_none()
    }
}

/// Wakers and status of one connection, kept by the endpoint.
#[derive(Default)]
pub(crate) struct ConnState {
    pub connected: bool,
    pub error: Option<ConnectionError>,
    pub handshake: Vec<Waker>,
    /// Per stream; a connection with nothing waiting and no send handles has none.
    pub streams: IdMap<StreamId, StreamWaiters>,
    pub accept: [Vec<Waker>; 2],
    pub open: [Vec<Waker>; 2],
    pub datagram: Vec<Waker>,
    /// Those waiting in `Connection::closed`: a `Notify`, whose waiters leave when their
    /// future is dropped (a waker list kept one for every task that ever asked, which
    /// per-request code does, until the connection ended).
    pub closed: Arc<tokio::sync::Notify>,
    /// Client: session tickets received, and the tasks waiting for one.
    pub session_tickets: u32,
    pub ticket: Vec<Waker>,
    pub zero_rtt_rejected: bool,
    pub server_name: Option<String>,
    /// The transport forgot the connection; only the error remains.
    pub drained: bool,
    /// The application dropped its last handle while the transport still held the
    /// connection: the entry goes when the transport forgets it.
    pub released: bool,
}

impl ConnState {
    /// The entry of stream `id`, made if needed.
    pub fn stream(&mut self, id: StreamId) -> &mut StreamWaiters {
        self.streams.entry(id).or_default()
    }

    /// Queues the waker `which` picks from stream `id`'s entry, dropping the entry if that
    /// leaves it empty.
    fn wake_stream(
        &mut self,
        id: StreamId,
        which: impl Fn(&mut StreamWaiters) -> Option<Waker>,
        woken: &mut Vec<Waker>,
    ) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        if let Some(w) = which(s) {
            woken.push(w);
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

    /// A `SendStream` handle went away: forget how its sending ended, and the wakers of
    /// waits it abandoned.
    pub fn drop_send_handle(&mut self, id: StreamId) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.send_handle = false;
            s.all_acked = false;
            s.stopped = None;
            s.write = None;
            s.finished = None;
            if s.is_empty() {
                self.streams.remove(&id);
            }
        }
    }

    /// A `RecvStream` handle went away: the waker of a read it abandoned goes.
    pub fn drop_recv_handle(&mut self, id: StreamId) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.read = None;
            if s.is_empty() {
                self.streams.remove(&id);
            }
        }
    }

    fn wake_all(&mut self, woken: &mut Vec<Waker>) {
        for w in self.handshake.drain(..) {
            woken.push(w);
        }
        for s in self.streams.values_mut() {
            for w in [s.read.take(), s.write.take(), s.finished.take()]
                .into_iter()
                .flatten()
            {
                woken.push(w);
            }
        }
        self.streams.retain(|_, s| s.send_handle);
        for v in self.accept.iter_mut().chain(self.open.iter_mut()) {
            for w in v.drain(..) {
                woken.push(w);
            }
        }
        for w in self.datagram.drain(..) {
            woken.push(w);
        }
        self.closed.notify_waiters();
        woken.append(&mut self.ticket);
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
    pub conns: IdMap<ConnectionHandle, Box<ConnState>>,
    incoming: VecDeque<ConnectionHandle>,
    accept_wakers: Vec<Waker>,
    client_config: Option<ClientConfig>,
    /// NEW_TOKEN tokens by server name, for the next connection's Initial (one map for all
    /// workers: the next connection to a server may start on another).
    tokens: Arc<Mutex<HashMap<String, Bytes>>>,
    closed: bool,
    /// Every `Endpoint` handle is gone: the driver stops once no connection is left.
    abandoned: bool,
    max_segments: usize,
    idle_wakers: Vec<Waker>,
    /// Server: the guard that must see each accepted 0-RTT ticket before the application
    /// sees its connection (see [`crate::replay`]).
    anti_replay: Option<Arc<dyn AntiReplay>>,
    /// Connections held back from `accept` until the guard answers.
    held: Vec<Held>,
    held_seq: u64,
    /// The guard's answers: handle, the `Held::seq` asked, first use.
    pub(crate) verdicts: Vec<(ConnectionHandle, u64, bool)>,
    /// Held connections the application never got, closing: their entries in `conns` go
    /// when the transport forgets them.
    orphans: Vec<ConnectionHandle>,
    /// Client connections moved to new sockets before their handshake was confirmed, with
    /// the new local IP: they migrate (a fresh connection ID, path validation) once it is,
    /// since none may before (RFC 9000 §9).
    migrate_when_confirmed: Vec<(ConnectionHandle, Option<IpAddr>)>,
}

/// One worker: its socket, transport endpoint and connections, and what wakes its driver.
pub(crate) struct Shared {
    pub state: Mutex<State>,
    pub notify: Notify,
    pub udp: UdpStats,
    /// Datagrams another worker received for this one's connections.
    inbox: Mutex<Vec<Received>>,
    /// Driver turns started, and the last one finished (its transmits handed to the socket).
    turns_started: AtomicU64,
    turns_done: AtomicU64,
    /// Tasks waiting in [`Endpoint::flush`] for a turn to finish.
    turn_waiters: Mutex<Vec<Waker>>,
    has_turn_waiters: AtomicBool,
}

/// A datagram handed from one worker to another.
struct Received {
    remote: SocketAddr,
    local_ip: Option<IpAddr>,
    ecn: Option<EcnCodepoint>,
    data: BytesMut,
    /// Its owner is settled: handle it here whatever the checks say.
    settled: bool,
}

/// The workers of one endpoint (one, unless [`EndpointBuilder::workers`] asks for more).
pub(crate) struct Workers {
    all: Box<[Arc<Shared>]>,
    /// Round-robin choice of the worker a new client connection starts on.
    next_connect: AtomicUsize,
    /// Where `accept` looks first, so no worker's connections wait behind another's.
    next_accept: AtomicUsize,
    /// How a datagram finds the worker its connection ID names.
    steering: Steering,
    /// The sockets' options, for a rebind to keep them (GSO or GRO turned off, say).
    socket_options: SocketOptions,
}

/// How the workers of one endpoint tell whose a connection ID is.
#[derive(Clone)]
enum Steering {
    /// kuai puts the worker in the ID's last byte (modulo the workers), and a kernel
    /// program steers by it ([`worker_of`]).
    LastByte,
    /// QUIC-LB IDs: worker `i`'s server ID is `base` with `i` added to its last byte
    /// (see [`EndpointBuilder::quic_lb`]).
    QuicLb {
        config: kuai_proto::quic_lb::QuicLbConfig,
        base: Vec<u8>,
    },
}

impl Steering {
    fn quic_lb(
        config: kuai_proto::quic_lb::QuicLbConfig,
        base: Vec<u8>,
        workers: usize,
    ) -> io::Result<Self> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if base.len() != config.server_id_len() {
            return Err(invalid(format!(
                "the server ID has {} bytes, the QUIC-LB configuration {}",
                base.len(),
                config.server_id_len()
            )));
        }
        let last = usize::from(*base.last().expect("server IDs have a byte at least"));
        if last + workers - 1 > usize::from(u8::MAX) {
            return Err(invalid(format!(
                "{workers} workers need server IDs whose last byte goes up to {}",
                last + workers - 1
            )));
        }
        Ok(Self::QuicLb { config, base })
    }

    /// Whether the kernel can steer by the ID (not when it is encrypted).
    fn kernel_steers(&self) -> bool {
        matches!(self, Self::LastByte)
    }

    /// Worker `i`'s QUIC-LB server ID.
    fn server_id(base: &[u8], i: usize) -> Vec<u8> {
        let mut sid = base.to_vec();
        if let Some(l) = sid.last_mut() {
            *l += i as u8;
        }
        sid
    }

    /// The worker whose ID a datagram's destination CID is; `None` if it names none (a
    /// client's own Initial ID, junk): it stays where it landed.
    fn owner(&self, datagram: &[u8], workers: usize, cid_len: usize) -> Option<usize> {
        match self {
            Self::LastByte => Some(worker_of(datagram, workers, cid_len)),
            Self::QuicLb { config, base } => {
                let dcid = match *datagram.first()? {
                    // Long header (RFC 8999 §5.1): the DCID length is byte 5.
                    b if b & 0x80 != 0 => {
                        let len = usize::from(*datagram.get(5)?);
                        datagram.get(6..6 + len)?
                    }
                    _ => datagram.get(1..1 + cid_len)?,
                };
                let mut body = [0u8; 19];
                let sid = &config.decode_into(dcid, &mut body)?[..base.len()];
                let n = base.len();
                if sid[..n - 1] != base[..n - 1] {
                    return None;
                }
                let i = usize::from(sid[n - 1].checked_sub(base[n - 1])?);
                (i < workers).then_some(i)
            }
        }
    }
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the driver to send what the application queued.
    pub fn kick(&self) {
        self.notify.notify_one();
    }

    /// Records that driver turn `turn` has handed its transmits to the socket.
    fn finish_turn(&self, turn: u64) {
        self.turns_done.store(turn, Ordering::SeqCst);
        if self.has_turn_waiters.swap(false, Ordering::SeqCst) {
            for w in lock(&self.turn_waiters).drain(..) {
                w.wake();
            }
        }
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
    subscribers: kuai_proto::trace::Subscribers,
    preferred_address: Option<SocketAddr>,
    workers: usize,
    quic_lb: Option<(kuai_proto::quic_lb::QuicLbConfig, Vec<u8>)>,
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
    /// (`<original DCID>_<client|server>.sqlog`): the [`QlogDir`](crate::qlog::QlogDir)
    /// subscriber.
    pub fn qlog_dir(self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.subscriber(crate::qlog::QlogDir::new(dir))
    }

    /// Adds a subscriber: it gets a context of its own for each connection from its first
    /// packet, the connection's events, and the endpoint's (Retry, Version Negotiation,
    /// stateless resets, dropped datagrams). See [`kuai_proto::trace::Subscriber`]. Several
    /// may be added; with none, no event is built.
    pub fn subscriber<S: kuai_proto::trace::Subscriber>(mut self, s: S) -> Self {
        self.subscribers.push(s);
        self
    }

    /// Adds a subscriber the application keeps a handle to (to read what it gathers).
    pub fn subscriber_shared<S: kuai_proto::trace::Subscriber>(mut self, s: Arc<S>) -> Self {
        self.subscribers.push_shared(s);
        self
    }

    /// Server: also listen on `addr` and offer it to clients as the preferred address
    /// (RFC 9000 §9.6): they move there once the handshake is confirmed. Its IP must differ
    /// from the main socket's (port 0 picks a free port).
    pub fn preferred_address(mut self, addr: SocketAddr) -> Self {
        self.preferred_address = Some(addr);
        self
    }

    /// Spreads the endpoint over `n` workers, each with its own socket on the same port
    /// (SO_REUSEPORT), driver task and share of the connections, so handshakes and
    /// connections use several cores (default 1). A connection stays on the worker it
    /// started on: the last byte of every connection ID a worker issues names it, and a
    /// kernel program steers each datagram to the worker its destination CID names, so
    /// migrated and NAT-rebound connections still find theirs. The server's connection and
    /// handshake limits are shared out among the workers. Linux only.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Connection IDs in the QUIC-LB format (draft-ietf-quic-load-balancers-21) of `config`,
    /// naming `server_id`, so that a QUIC-LB balancer (`kuai lb`) routes every packet of a
    /// connection here whatever the client's address. Replaces the endpoint configuration's
    /// ID generator. With several [`workers`](Self::workers), the worker bits are in the
    /// server ID: worker `i`'s is `server_id` with `i` added to its last byte (list each at
    /// the balancer, all at this address). The kernel cannot read an encrypted ID, so a
    /// datagram lands on a worker by its addresses and ports, and a worker hands on to its
    /// owner what another worker's ID names (after a migration or NAT rebinding).
    pub fn quic_lb(mut self, config: kuai_proto::quic_lb::QuicLbConfig, server_id: &[u8]) -> Self {
        self.quic_lb = Some((config, server_id.to_vec()));
        self
    }

    /// Binds the sockets and starts the endpoint's drivers on the current tokio runtime.
    pub fn bind(self, addr: SocketAddr) -> io::Result<Endpoint> {
        Endpoint::bind_with(addr, self)
    }
}

/// A QUIC endpoint on a UDP port. Cheap to clone; all clones share the sockets. Once every
/// clone is dropped (without [`close`](Endpoint::close)), the endpoint takes no new
/// connection, and its drivers, sockets and buffers go when its last connection has.
#[derive(Clone)]
pub struct Endpoint {
    workers: Arc<Workers>,
    _handles: Arc<Handles>,
}

/// Alive while an [`Endpoint`] handle is: the drivers hold the workers themselves, so
/// without this they ran, with their sockets and buffers, for the process's life.
struct Handles(Arc<Workers>);

impl Drop for Handles {
    fn drop(&mut self) {
        for w in self.0.all.iter() {
            let mut s = w.lock();
            s.abandoned = true;
            // Nobody can accept any more: new connections are not taken, and those queued
            // for `accept` are closed.
            s.ep.set_server_config(None);
            let now = Instant::now();
            // Those held for an anti-replay verdict too: released later into `incoming`,
            // nobody would take or close them.
            let held: Vec<_> = s.held.drain(..).map(|hd| hd.handle).collect();
            let queued: Vec<_> = s.incoming.drain(..).chain(held).collect();
            for h in queued {
                if let Some(c) = s.ep.connection_mut(h) {
                    c.close(now, 0, b"");
                }
                // No handle will ask about it: its state goes when it drains.
                if let Some(st) = s.conns.get_mut(&h) {
                    st.released = true;
                }
            }
            drop(s);
            w.kick();
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("local_addr", &self.local_addr().ok())
            .field("workers", &self.workers.all.len())
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

    fn bind_with(addr: SocketAddr, b: EndpointBuilder) -> io::Result<Self> {
        let now = Instant::now();
        let n = b.workers.max(1);
        let client_only = b.config.is_none() && b.server.is_none() && b.quic_lb.is_none();
        let mut config = b.config.unwrap_or_default().proto;
        if client_only {
            // Nothing routes a client's connection IDs but this endpoint, which draws them
            // until one is unused: 4 random bytes do (as quic-go's client), and every
            // packet a server sends carries 4 bytes more of data than with 8 (0.3 % of a
            // full packet; a bulk download over HTTP/3 otherwise carried less per byte on
            // the wire than TCP + TLS).
            config.cid_generator =
                Arc::new(|| Box::new(kuai_proto::cid::RandomCidGenerator::new(CLIENT_CID_LEN)));
        }
        config.subscribers.extend(b.subscribers);
        let steering = match b.quic_lb {
            Some((c, sid)) => Steering::quic_lb(c, sid, n)?,
            None => Steering::LastByte,
        };
        let cid_len = match &steering {
            Steering::QuicLb { config, .. } => config.cid_len(),
            Steering::LastByte => (config.cid_generator)().cid_len(),
        };
        let steer = steering.kernel_steers().then_some(cid_len);
        let sockets = UdpSocket::bind_workers(addr, b.socket, n, steer)?;
        let main = sockets[0].local_addr();
        let mut preferred: Vec<Option<Arc<UdpSocket>>> = vec![None; n];
        if let Some(addr) = b.preferred_address {
            if addr.ip() == main.ip() || addr.ip().is_unspecified() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "the preferred address {addr} needs an IP address of its own \
                         (the endpoint listens on {main})"
                    ),
                ));
            }
            let group = UdpSocket::bind_workers(addr, b.socket, n, steer)
                .map_err(|e| io::Error::new(e.kind(), format!("preferred address {addr}: {e}")))?;
            for (slot, s) in preferred.iter_mut().zip(group) {
                *slot = Some(Arc::new(s));
            }
        }
        let mut server = b.server;
        if let (Some(s), Some(p)) = (server.as_mut(), &preferred[0]) {
            s.proto.preferred_address = Some(preferred_config(p.local_addr()));
        }
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let tokens = Arc::new(Mutex::new(HashMap::new()));
        let mut all = Vec::with_capacity(n);
        for (i, (socket, preferred)) in sockets.into_iter().zip(preferred).enumerate() {
            let mut wc = worker_config(&config, i, n, &steering);
            // Peers may send datagrams up to this size: no larger than a receive slot.
            wc.max_udp_payload_size = wc.max_udp_payload_size.min(recv_slot(&socket) as u16);
            let ep = kuai_proto::Endpoint::new(
                Arc::new(wc),
                server
                    .as_ref()
                    .map(|s| Arc::new(worker_server_config(&s.proto, n))),
                now,
                unix_ms,
                None,
            );
            let max_segments = b
                .max_segments
                .unwrap_or(MAX_GSO)
                .min(socket.max_segments())
                .max(1);
            all.push(Arc::new(Shared {
                state: Mutex::new(State {
                    ep,
                    socket: Arc::new(socket),
                    preferred,
                    conns: IdMap::default(),
                    incoming: VecDeque::new(),
                    accept_wakers: Vec::new(),
                    client_config: b.client.clone(),
                    tokens: tokens.clone(),
                    closed: false,
                    abandoned: false,
                    max_segments,
                    idle_wakers: Vec::new(),
                    anti_replay: server.as_ref().and_then(|s| s.anti_replay.clone()),
                    held: Vec::new(),
                    held_seq: 0,
                    verdicts: Vec::new(),
                    orphans: Vec::new(),
                    migrate_when_confirmed: Vec::new(),
                }),
                notify: Notify::new(),
                udp: UdpStats::default(),
                inbox: Mutex::new(Vec::new()),
                turns_started: AtomicU64::new(0),
                turns_done: AtomicU64::new(0),
                turn_waiters: Mutex::new(Vec::new()),
                has_turn_waiters: AtomicBool::new(false),
            }));
        }
        let workers = Arc::new(Workers {
            all: all.into(),
            next_connect: AtomicUsize::new(0),
            next_accept: AtomicUsize::new(0),
            steering,
            socket_options: b.socket,
        });
        for i in 0..n {
            let w = workers.clone();
            tokio::spawn(async move {
                if let Err(e) = drive(w, i).await {
                    tracing::error!(error = %e, worker = i, "endpoint driver stopped");
                }
            });
        }
        let handles = Arc::new(Handles(workers.clone()));
        Ok(Self {
            workers,
            _handles: handles,
        })
    }

    fn first(&self) -> &Shared {
        &self.workers.all[0]
    }

    /// The local socket address (every worker's socket has it).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.first().lock().socket.local_addr())
    }

    /// How many workers share the endpoint's port.
    pub fn workers(&self) -> usize {
        self.workers.all.len()
    }

    /// Sets the configuration [`connect`](Self::connect) uses.
    pub fn set_default_client_config(&self, c: ClientConfig) {
        for w in self.workers.all.iter() {
            w.lock().client_config = Some(c.clone());
        }
    }

    /// Starts accepting connections with `c` (or stops, with `None`).
    pub fn set_server_config(&self, c: Option<ServerConfig>) {
        let n = self.workers.all.len();
        for w in self.workers.all.iter() {
            let mut s = w.lock();
            let preferred = s
                .preferred
                .as_ref()
                .map(|p| preferred_config(p.local_addr()));
            s.anti_replay = c.as_ref().and_then(|c| c.anti_replay.clone());
            s.ep.set_server_config(c.as_ref().map(|c| {
                let mut proto = worker_server_config(&c.proto, n);
                if preferred.is_some() {
                    proto.preferred_address = preferred;
                }
                Arc::new(proto)
            }));
        }
    }

    /// Derives stateless reset tokens from `key` from now on, in every worker (see
    /// [`kuai_proto::Endpoint::set_reset_key`]).
    pub fn set_reset_key(&self, key: [u8; 32]) {
        for w in self.workers.all.iter() {
            w.lock().ep.set_reset_key(key);
        }
    }

    /// The preferred address clients are offered, if the endpoint has one.
    pub fn preferred_address(&self) -> Option<SocketAddr> {
        self.first()
            .lock()
            .preferred
            .as_ref()
            .map(|p| p.local_addr())
    }

    /// Connects to `addr`, presenting `server_name` for SNI and certificate checks.
    pub fn connect(&self, addr: SocketAddr, server_name: &str) -> Result<Connecting, ConnectError> {
        let cfg = self
            .first()
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
        let all = &self.workers.all;
        let worker = &all[self.workers.next_connect.fetch_add(1, Ordering::Relaxed) % all.len()];
        let mut s = worker.lock();
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
        // Each token goes into one connection attempt (RFC 9000 §8.1.3: reuse would link
        // the connections, and kuai's server accepts a token once); the new connection's
        // NEW_TOKEN replaces it.
        let token = lock(&s.tokens).remove(server_name).unwrap_or_default();
        let now = Instant::now();
        let h =
            s.ep.connect_with_token(now, &config.proto, addr, server_name, token)
                .map_err(|e| ConnectError::Proto(e.to_string()))?;
        let st = ConnState {
            server_name: Some(server_name.to_owned()),
            ..ConnState::default()
        };
        s.conns.insert(h, Box::new(st));
        drop(s);
        worker.kick();
        Ok(Connecting::new(ConnectionInner::new(worker.clone(), h)))
    }

    /// Waits for the next incoming connection; `None` once the endpoint is closed.
    pub async fn accept(&self) -> Option<Connecting> {
        let all = &self.workers.all;
        poll_fn(|cx| {
            let start = self.workers.next_accept.fetch_add(1, Ordering::Relaxed);
            let mut closed = true;
            for k in 0..all.len() {
                let w = &all[(start + k) % all.len()];
                let mut s = w.lock();
                // A closed endpoint hands out nothing more (what was queued is closing).
                if !s.closed
                    && let Some(h) = s.incoming.pop_front()
                {
                    return Poll::Ready(Some((w.clone(), h)));
                }
                closed &= s.closed;
                register(&mut s.accept_wakers, cx);
            }
            if closed {
                Poll::Ready(None)
            } else {
                Poll::Pending
            }
        })
        .await
        .map(|(w, h)| Connecting::new(ConnectionInner::new(w, h)))
    }

    /// Closes every connection with `code` and stops accepting: new connections are
    /// refused and [`accept`](Self::accept) returns `None`.
    pub fn close(&self, code: u64, reason: &[u8]) {
        for w in self.workers.all.iter() {
            let mut s = w.lock();
            s.closed = true;
            s.ep.set_server_config(None);
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
            w.kick();
        }
    }

    /// Waits until each worker's driver has run a whole turn that started after this call:
    /// what the application queued before it (a `close`, stream data) has been handed to the
    /// socket, as far as flow control, congestion control and pacing allow. A client that
    /// exits right after closing calls this instead of [`wait_idle`](Self::wait_idle), which
    /// also waits out the closing period (three PTOs, RFC 9000 §10.2) to answer late packets.
    pub async fn flush(&self) {
        for w in self.workers.all.iter() {
            // SeqCst with the driver's count: a turn numbered above `started` began after
            // this point, so under the lock it sees whatever was queued before the call.
            let target = w.turns_started.load(Ordering::SeqCst) + 1;
            w.kick();
            poll_fn(|cx| {
                if w.turns_done.load(Ordering::SeqCst) >= target {
                    return Poll::Ready(());
                }
                lock(&w.turn_waiters).push(cx.waker().clone());
                w.has_turn_waiters.store(true, Ordering::SeqCst);
                // Checked again: the turn may have ended before the flag was up.
                if w.turns_done.load(Ordering::SeqCst) >= target {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
        }
    }

    /// Waits until every connection has finished closing.
    pub async fn wait_idle(&self) {
        poll_fn(|cx| {
            let mut idle = true;
            for w in self.workers.all.iter() {
                let mut s = w.lock();
                if s.ep.connection_count() > 0 {
                    idle = false;
                    register(&mut s.idle_wakers, cx);
                }
            }
            if idle { Poll::Ready(()) } else { Poll::Pending }
        })
        .await
    }

    /// Moves the endpoint to new sockets bound to `addr` (client migration, RFC 9000 §9):
    /// every established client connection switches to a fresh connection ID and validates
    /// the new path (one still waiting for its handshake to be confirmed does when it is;
    /// its packets leave from the new sockets meanwhile, which the server sees as a NAT
    /// rebinding).
    pub fn rebind(&self, addr: SocketAddr) -> io::Result<()> {
        let all = &self.workers.all;
        let cid_len = self.first().lock().ep.cid_len();
        let steer = self.workers.steering.kernel_steers().then_some(cid_len);
        let sockets = UdpSocket::bind_workers(addr, self.workers.socket_options, all.len(), steer)?;
        for (w, socket) in all.iter().zip(sockets) {
            let mut s = w.lock();
            let local_ip = Some(socket.local_addr().ip()).filter(|ip| !ip.is_unspecified());
            s.socket = Arc::new(socket);
            let now = Instant::now();
            let handles: Vec<_> = s.ep.handles().collect();
            s.migrate_when_confirmed.clear();
            for h in handles {
                let Some(c) = s.ep.connection_mut(h).filter(|c| c.side().is_client()) else {
                    continue;
                };
                if !c.is_handshake_confirmed() {
                    s.migrate_when_confirmed.push((h, local_ip));
                } else if let Err(e) = c.migrate(now, local_ip) {
                    tracing::warn!(error = %e, "connection could not migrate");
                }
            }
            drop(s);
            w.kick();
        }
        Ok(())
    }

    /// Counters of the UDP layer (datagrams per send and receive call show GSO/GRO at work),
    /// summed over the workers.
    pub fn udp_stats(&self) -> UdpStatsSnapshot {
        let mut sum = UdpStatsSnapshot::default();
        for w in self.workers.all.iter() {
            sum += w.udp.snapshot();
        }
        sum
    }

    /// Datagrams one send call may carry on this socket (1 without GSO).
    pub fn max_gso_segments(&self) -> usize {
        self.first().lock().max_segments
    }

    /// What this endpoint remembers of the path to `server` from its last connection there
    /// (smoothed RTT, loss rate both ways), which the next connection starts from. An
    /// application that outlives the process saves it and gives it back with
    /// [`Endpoint::remember_path`].
    pub fn path_hint(&self, server: SocketAddr) -> Option<kuai_proto::PathHint> {
        let server = self.peer_form(server);
        self.workers
            .all
            .iter()
            .find_map(|w| w.lock().ep.path_hint(server))
    }

    /// `addr` as this endpoint's connections know their peer: an IPv4 address IPv4-mapped
    /// on a dual-stack (IPv6) socket, as [`connect_with`](Self::connect_with) makes it.
    fn peer_form(&self, addr: SocketAddr) -> SocketAddr {
        match (self.first().lock().socket.local_addr(), addr) {
            (SocketAddr::V6(_), SocketAddr::V4(a)) => {
                SocketAddr::new(a.ip().to_ipv6_mapped().into(), a.port())
            }
            _ => addr,
        }
    }

    /// Gives the endpoint a path hint for `server`, as one of its own connections would when
    /// it ends (every worker gets it).
    pub fn remember_path(&self, server: SocketAddr, hint: kuai_proto::PathHint) {
        let server = self.peer_form(server);
        for w in self.workers.all.iter() {
            w.lock().ep.remember_path(server, hint);
        }
    }

    /// Counters of the endpoint: accepted, refused, Retry and reset packets sent, ...
    pub fn stats(&self) -> kuai_proto::EndpointStats {
        let mut sum = kuai_proto::EndpointStats::default();
        for w in self.workers.all.iter() {
            sum += w.lock().ep.stats();
        }
        sum
    }

    /// Live connections on each worker, closing ones included.
    pub fn worker_connection_counts(&self) -> Vec<usize> {
        self.workers
            .all
            .iter()
            .map(|w| w.lock().ep.connection_count())
            .collect()
    }

    /// Connections whose wake state this endpoint still keeps (live ones, and closed ones
    /// an application handle may still ask about): for tests that check nothing leaks.
    #[doc(hidden)]
    pub fn tracked_connections(&self) -> usize {
        self.workers.all.iter().map(|w| w.lock().conns.len()).sum()
    }

    /// Live connections, closing ones included.
    pub fn connection_count(&self) -> usize {
        self.workers
            .all
            .iter()
            .map(|w| w.lock().ep.connection_count())
            .sum()
    }
}

/// Locks a mutex, ignoring poisoning (the data stays consistent: no panics mid-update).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Worker `i` of `n`'s endpoint settings: its connection IDs name it (see [`Steering`]).
fn worker_config(
    config: &kuai_proto::EndpointConfig,
    i: usize,
    n: usize,
    steering: &Steering,
) -> kuai_proto::EndpointConfig {
    let mut c = config.clone();
    match steering {
        Steering::QuicLb { config: lb, base } => {
            let (lb, sid) = (lb.clone(), Steering::server_id(base, i));
            c.cid_generator = Arc::new(move || {
                Box::new(
                    kuai_proto::quic_lb::QuicLbCids::new(lb.clone(), &sid)
                        .expect("server ID length checked at bind"),
                )
            });
        }
        Steering::LastByte if n > 1 => {
            let inner = config.cid_generator.clone();
            c.cid_generator = Arc::new(move || {
                Box::new(WorkerCids {
                    inner: inner(),
                    worker: i as u8,
                    workers: n as u8,
                })
            });
        }
        Steering::LastByte => {}
    }
    c
}

/// A server configuration's limits shared out among `n` workers.
fn worker_server_config(c: &kuai_proto::ServerConfig, n: usize) -> kuai_proto::ServerConfig {
    let mut c = c.clone();
    if n > 1 {
        c.max_connections = c.max_connections.div_ceil(n);
        c.max_handshakes = c.max_handshakes.div_ceil(n);
        c.max_validated_handshakes_per_ip = c.max_validated_handshakes_per_ip.div_ceil(n as u32);
        c.max_connections_per_ip = c.max_connections_per_ip.div_ceil(n as u32);
        if let kuai_proto::RetryPolicy::AboveHandshakes(k) = c.retry {
            c.retry = kuai_proto::RetryPolicy::AboveHandshakes(k.div_ceil(n));
        }
    }
    c
}

/// Connection IDs of one worker: the application's generator's, drawn until one's last byte
/// names the worker modulo the number of workers (so the IDs stay the generator's own and
/// pass its `validate`); a generator that keeps making IDs for other workers gets its last
/// byte set.
struct WorkerCids {
    inner: Box<dyn kuai_proto::ConnectionIdGenerator>,
    worker: u8,
    workers: u8,
}

impl kuai_proto::ConnectionIdGenerator for WorkerCids {
    fn generate(&mut self) -> kuai_proto::ConnectionId {
        // Each draw names this worker with probability 1/workers: 64 draws a worker miss
        // with a random generator less than once in 2^9 (2 workers) ... 2^-0.4·64 (255).
        for _ in 0..64 * usize::from(self.workers) {
            let cid = self.inner.generate();
            if cid.last().is_some_and(|&b| b % self.workers == self.worker) {
                return cid;
            }
        }
        let cid = self.inner.generate();
        let mut bytes = [0u8; kuai_proto::cid::MAX_CID_SIZE];
        let bytes = &mut bytes[..cid.len()];
        bytes.copy_from_slice(&cid);
        if let Some(last) = bytes.last_mut() {
            // Keep the high part random; the largest multiple of `workers` that fits.
            let base = *last - *last % self.workers;
            *last = match base.checked_add(self.worker) {
                Some(b) => b,
                None => base - self.workers + self.worker,
            };
        }
        kuai_proto::ConnectionId::new(bytes)
    }

    fn cid_len(&self) -> usize {
        self.inner.cid_len()
    }

    fn cid_lifetime(&self) -> Option<std::time::Duration> {
        self.inner.cid_lifetime()
    }

    fn validate(&self, cid: &kuai_proto::ConnectionId) -> bool {
        self.inner.validate(cid)
    }
}

/// Why a connection could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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

/// The driver of worker `me`: receives, runs timers, sends, and wakes application tasks.
///
/// The worker's state is locked only while the transport works: datagrams are received
/// before and sent after, so an application task never waits on the lock through a system
/// call. A turn takes one receive batch per socket and makes at most [`OUTBOX`] transmits;
/// more waiting on either side brings the next turn at once.
async fn drive(workers: Arc<Workers>, me: usize) -> io::Result<()> {
    let shared = workers.all[me].clone();
    let (gro, cid_len, mut view) = {
        let mut s = shared.lock();
        (
            s.socket.gro_segments() > 1,
            s.ep.cid_len(),
            View::of(&mut s),
        )
    };
    let mut route = Route {
        me,
        workers: workers.all.len(),
        cid_len,
        steering: workers.steering.clone(),
        asks: AskBudget::new(Instant::now()),
    };
    // Datagrams to hand to other workers, by worker; at `me`, those no connection here knows.
    let mut away: Vec<Vec<Received>> = (0..route.workers).map(|_| Vec::new()).collect();
    let mut inbox = Vec::new();
    let mut received = Vec::new();
    let slot = if gro { RECV_BUF } else { RECV_SLOT };
    // The first message of each batch goes to the pool (below), the others here.
    let mut rx = vec![0u8; slot * (RECV_BATCH - 1)];
    let mut pool = RecvPool::new();
    let mut metas = [RecvMeta::default(); RECV_BATCH];
    let mut outbox = Outbox::new();
    let mut woken = Vec::new();
    let mut checks: Vec<Check> = Vec::new();
    // Tasks woken by the last turn that woke any.
    let mut last_woken = 0;
    // The last turn had more to send than one outbox: go on without waiting.
    let mut again = false;
    // Woke tasks, and bytes received, since the driver last let other tasks run.
    let mut woke_since_yield = false;
    let mut received_since_yield = 0usize;
    loop {
        if view.finished {
            outbox.flush(&view, &shared.udp);
            shared.finish_turn(u64::MAX);
            return Ok(());
        }
        if !again {
            let sleep = async {
                match view.deadline {
                    Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
                    None => std::future::pending().await,
                }
            };
            let writable = async {
                match outbox.blocked_on(&view) {
                    Some(sock) => sock.writable().await,
                    None => std::future::pending().await,
                }
            };
            let preferred_readable = async {
                match &view.preferred {
                    Some(p) => p.readable().await,
                    None => std::future::pending().await,
                }
            };
            let kicked = tokio::select! {
                r = view.socket.readable() => { r?; false }
                r = preferred_readable => { r?; false }
                _ = sleep => false,
                _ = shared.notify.notified() => true,
                r = writable => { r?; false }
            };
            // A task queued something to send. When the last events woke several tasks, the
            // others are likely queued behind this wake-up: let them run first, and one turn
            // sends what they all wrote, where running at once would send the first task's
            // alone. After a single wake-up (one stream's bulk writer) it would only cost.
            if kicked && last_woken > 1 {
                tokio::task::yield_now().await;
            }
        }
        let turn = shared.turns_started.fetch_add(1, Ordering::SeqCst) + 1;
        // What the socket would not take last turn goes first.
        let backlog_sent = outbox.flush(&view, &shared.udp);
        // One receive batch per socket, and none while the answers to the last are still
        // going out. Draining the whole queue first held every answer back until the last
        // datagram was handled: with many handshakes queued the peer sat idle while this side
        // did all their crypto. A socket with more waiting stays readable, so the next turn
        // comes at once.
        //
        // The first message of a batch (usually the only one: a GRO batch of up to 64 KiB)
        // lands straight in a pool buffer and its datagrams are cut from it without a copy.
        // The others go to the reusable receive area and each datagram is copied once into
        // the pool: one allocation per 256 KiB rather than per datagram, and unread stream
        // data never pins the large receive area.
        let sockets = std::iter::once(&view.socket).chain(view.preferred.as_ref());
        for sock in sockets.take(if again { 0 } else { 2 }) {
            let n = {
                let mut slices: Vec<IoSliceMut<'_>> = std::iter::once(pool.recv_area(slot))
                    .chain(rx.chunks_mut(slot).take(RECV_BATCH - 1))
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
                received_since_yield += m.len;
                let stride = m.stride.max(1);
                let ecn = m.ecn.and_then(|e| EcnCodepoint::from_bits(e as u8));
                let dst_ip = m.dst_ip.or(Some(local).filter(|ip| !ip.is_unspecified()));
                let mut push = |data: BytesMut| {
                    received.push(Received {
                        remote: m.addr,
                        local_ip: dst_ip,
                        ecn,
                        data,
                        settled: false,
                    })
                };
                if i == 0 {
                    pool.commit(m.len, stride, &mut push);
                } else {
                    let data = &rx[(i - 1) * slot..(i - 1) * slot + m.len];
                    for seg in data.chunks(stride) {
                        push(pool.copy(seg));
                    }
                }
            }
        }
        if route.workers > 1 && !again {
            std::mem::swap(&mut inbox, &mut *lock(&shared.inbox));
        }
        let now = Instant::now();
        let (woke, full);
        {
            let mut s = shared.lock();
            for r in inbox.drain(..).chain(received.drain(..)) {
                route.deliver(&mut s, now, r, &mut away);
            }
            if !s.migrate_when_confirmed.is_empty() {
                migrate_when_confirmed(&mut s, now);
            }
            s.ep.handle_timeout(now);
            full = backlog_sent && outbox.fill(&mut s, now);
            dispatch(&mut s, &mut woken);
            if !s.held.is_empty() {
                release_held(&mut s, &shared, &mut woken, &mut checks);
            }
            woke = !woken.is_empty();
            if woke {
                last_woken = woken.len();
            }
            for w in woken.drain(..) {
                w.wake();
            }
            view = View::of(&mut s);
        }
        // Outside the lock: a guard may answer at once, and its answer takes the lock.
        for (guard, ticket, verdict) in checks.drain(..) {
            match verdict {
                Some(v) => guard.check(&ticket, v),
                None => guard.record(&ticket),
            }
        }
        if route.workers > 1 {
            route.hand_on(&workers, &mut away);
        }
        again = outbox.flush(&view, &shared.udp) && full;
        shared.finish_turn(turn);
        // While datagrams keep coming the socket stays ready and this task never waits:
        // tokio lets it run 128 turns before others get the thread, and the readers it woke
        // fell tens of megabytes behind (each holding pool buffers, faulting in new ones).
        woke_since_yield |= woke;
        if woke_since_yield && !again && received_since_yield >= YIELD_AFTER_BYTES {
            woke_since_yield = false;
            received_since_yield = 0;
            tokio::task::yield_now().await;
        }
    }
}

/// What a driver's turn reads from the worker's state for the wait that follows it.
struct View {
    socket: Arc<UdpSocket>,
    preferred: Option<Arc<UdpSocket>>,
    deadline: Option<Instant>,
    finished: bool,
}

impl View {
    fn of(s: &mut State) -> Self {
        Self {
            socket: s.socket.clone(),
            preferred: s.preferred.clone(),
            deadline: s.ep.poll_timeout(),
            finished: (s.closed || s.abandoned) && s.ep.connection_count() == 0,
        }
    }

    /// The socket a transmit from `src_ip` goes out on: the preferred address's when the
    /// path is on it.
    fn socket_for(&self, src_ip: Option<IpAddr>) -> &Arc<UdpSocket> {
        match (&self.preferred, src_ip) {
            (Some(p), Some(ip)) if p.local_addr().ip() == ip => p,
            _ => &self.socket,
        }
    }
}

/// Transmits per driver turn.
const OUTBOX: usize = 8;

/// Servers whose NEW_TOKEN tokens a client endpoint keeps (RFC 9000 §8.1.3).
const MAX_TOKENS: usize = 4096;

/// Transmits made under the worker's lock and sent after it is released.
struct Outbox {
    /// One buffer per transmit, kept from turn to turn.
    slots: Vec<(Option<kuai_proto::Transmit>, Vec<u8>)>,
    /// Slots filled, and of those the first not yet sent.
    filled: usize,
    head: usize,
    /// Bytes of the head slot already sent (whole datagrams).
    sent: usize,
}

impl Outbox {
    fn new() -> Self {
        Self {
            slots: (0..OUTBOX)
                .map(|_| (None, Vec::with_capacity(MAX_GSO * 1500)))
                .collect(),
            filled: 0,
            head: 0,
            sent: 0,
        }
    }

    /// Polls the transport for transmits while there is room; true if it filled every slot
    /// (the transport may have more).
    fn fill(&mut self, s: &mut State, now: Instant) -> bool {
        while self.filled < self.slots.len() {
            let max = s.max_segments;
            let (t, buf) = &mut self.slots[self.filled];
            let Some(next) = s.ep.poll_transmit(now, max, buf) else {
                return false;
            };
            *t = Some(next);
            self.filled += 1;
        }
        true
    }

    /// The socket a transmit waits on, if the last flush could not send it.
    fn blocked_on<'a>(&self, view: &'a View) -> Option<&'a Arc<UdpSocket>> {
        let (t, _) = self
            .slots
            .get(self.head)
            .filter(|_| self.head < self.filled)?;
        Some(view.socket_for(t.as_ref()?.src_ip))
    }

    /// Sends what is queued; false if a socket would not take it all (the rest stays, to go
    /// when the socket is writable).
    fn flush(&mut self, view: &View, udp: &UdpStats) -> bool {
        while self.head < self.filled {
            let (t, buf) = &self.slots[self.head];
            if let Some(t) = t {
                let sock = view.socket_for(t.src_ip);
                match sock.try_send(
                    udp,
                    t.destination,
                    t.ecn.map(|e| e as u8),
                    t.src_ip,
                    &buf[self.sent..t.size],
                    t.segment_size,
                ) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                    // Whole datagrams went out; the rest waits for room in the socket.
                    Ok(n) if self.sent + n < t.size => {
                        self.sent += n;
                        return false;
                    }
                    // Sent, or failed for good (counted; the transport retransmits).
                    _ => {}
                }
            }
            self.head += 1;
            self.sent = 0;
        }
        self.filled = 0;
        self.head = 0;
        true
    }
}

/// Where a worker's datagrams go.
struct Route {
    me: usize,
    workers: usize,
    cid_len: usize,
    steering: Steering,
    /// How many unknown datagrams this worker may still ask the others about.
    asks: AskBudget,
}

/// A token bucket for asking the other workers whether an unknown short-header datagram is
/// a stateless reset for one of their connections: each ask takes their locks, so junk
/// datagrams must not be able to make every worker wait on every other. Resets are rare;
/// past the budget an unknown datagram is handled where it landed.
struct AskBudget {
    tokens: f64,
    at: Instant,
}

/// Asks per second, and the burst allowed.
const ASKS_PER_SECOND: f64 = 256.0;

impl AskBudget {
    fn new(now: Instant) -> Self {
        Self {
            tokens: ASKS_PER_SECOND,
            at: now,
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * ASKS_PER_SECOND;
        self.tokens = (self.tokens + refill).min(ASKS_PER_SECOND);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Route {
    /// Handles `r` here, or sets it aside in `away` for the worker it belongs to.
    fn deliver(&self, s: &mut State, now: Instant, r: Received, away: &mut [Vec<Received>]) {
        if self.workers > 1 && !r.settled {
            let owner = self
                .steering
                .owner(&r.data, self.workers, self.cid_len)
                .unwrap_or(self.me);
            // The kernel steers by the same rule, but GRO may merge datagrams of two
            // connections that share a client address.
            if owner != self.me || !s.ep.routes(&r.data) {
                // A short-header datagram no connection here knows may be a peer's stateless
                // reset: random bytes where the CID would be, so it was steered anywhere.
                // The other workers are asked first (`hand_on`).
                away[owner].push(r);
                return;
            }
        }
        s.ep.handle_datagram(now, r.remote, r.local_ip, r.ecn, r.data);
    }

    /// Hands the datagrams set aside to their workers, with this worker's state unlocked.
    fn hand_on(&mut self, workers: &Workers, away: &mut [Vec<Received>]) {
        for (i, batch) in away.iter_mut().enumerate() {
            if i != self.me && !batch.is_empty() {
                let mut inbox = lock(&workers.all[i].inbox);
                // What does not fit is dropped with the rest of the drain.
                let room = INBOX_MAX.saturating_sub(inbox.len());
                inbox.extend(batch.drain(..).take(room));
                drop(inbox);
                workers.all[i].kick();
            }
        }
        // Unknown here: to the worker whose connection knows it (a reset token), or back
        // here to be answered (a stateless reset of our own, or dropped).
        let now = Instant::now();
        for mut r in away[self.me].drain(..) {
            let owner = if self.asks.take(now) {
                (0..self.workers)
                    .filter(|&i| i != self.me)
                    .find(|&i| workers.all[i].lock().ep.routes(&r.data))
                    .unwrap_or(self.me)
            } else {
                self.me
            };
            r.settled = true;
            let mut inbox = lock(&workers.all[owner].inbox);
            if inbox.len() < INBOX_MAX {
                inbox.push(r);
            }
            drop(inbox);
            workers.all[owner].kick();
        }
    }
}

fn preferred_config(addr: SocketAddr) -> kuai_proto::PreferredAddressConfig {
    match addr {
        SocketAddr::V4(a) => kuai_proto::PreferredAddressConfig {
            v4: Some(a),
            v6: None,
        },
        SocketAddr::V6(a) => kuai_proto::PreferredAddressConfig {
            v4: None,
            v6: Some(a),
        },
    }
}

/// Migrates the client connections rebound during their handshake whose handshake is now
/// confirmed (see `State::migrate_when_confirmed`); forgets those that went.
fn migrate_when_confirmed(s: &mut State, now: Instant) {
    let State {
        ep,
        migrate_when_confirmed: pending,
        ..
    } = s;
    pending.retain(|&(h, local_ip)| {
        let Some(c) = ep.connection_mut(h).filter(|c| c.side().is_client()) else {
            return false;
        };
        if !c.is_handshake_confirmed() {
            return true;
        }
        if let Err(e) = c.migrate(now, local_ip) {
            tracing::warn!(error = %e, "connection could not migrate");
        }
        false
    });
}

/// Hands endpoint events to the application: the wakers to wake go to `woken`.
fn dispatch(s: &mut State, woken: &mut Vec<Waker>) {
    while let Some(h) = s.ep.accept() {
        s.conns.entry(h).or_default();
        if s.anti_replay.is_some() {
            s.held_seq += 1;
            s.held.push(Held {
                handle: h,
                seq: s.held_seq,
                asked: false,
            });
            continue;
        }
        s.incoming.push_back(h);
        for w in s.accept_wakers.drain(..) {
            woken.push(w);
        }
    }
    while let Some((h, ev)) = s.ep.poll_event() {
        let st = s.conns.entry(h).or_default();
        match ev {
            Event::Connected => {
                st.connected = true;
                // Taken, not drained: an established connection keeps no waker list for it.
                woken.append(&mut std::mem::take(&mut st.handshake));
                for v in st.open.iter_mut() {
                    for w in v.drain(..) {
                        woken.push(w);
                    }
                }
            }
            Event::ZeroRttRejected => {
                st.zero_rtt_rejected = true;
                // Every stream so far was voided; their IDs start over.
                st.wake_all(woken);
                st.streams.clear();
            }
            Event::Stream(se) => match se {
                StreamEvent::Readable(id) => st.wake_stream(id, |s| s.read.take(), woken),
                StreamEvent::Writable(id) => st.wake_stream(id, |s| s.write.take(), woken),
                StreamEvent::Finished(id) => {
                    if let Some(s) = st.streams.get_mut(&id)
                        && s.send_handle
                    {
                        s.all_acked = true;
                    }
                    st.wake_stream(id, |s| s.finished.take(), woken);
                }
                // Reset at its delivery deadline: for its writer, as good as stopped (nothing
                // more it sends can arrive).
                StreamEvent::Stopped(id, code) | StreamEvent::Expired(id, code) => {
                    if let Some(s) = st.streams.get_mut(&id)
                        && s.send_handle
                    {
                        s.stopped = Some(code);
                    } else if s
                        .ep
                        .connection(h)
                        .is_some_and(|c| c.is_stream_unaccepted(id))
                    {
                        // Stopped before the application accepted it: kept for the handle
                        // `accept_bi` makes (the transport forgets the stream once its reset
                        // is acknowledged, which may come first).
                        st.stream(id).stopped = Some(code);
                    }
                    st.wake_stream(id, |s| s.write.take(), woken);
                    st.wake_stream(id, |s| s.finished.take(), woken);
                }
                StreamEvent::Opened(d) => {
                    for w in st.accept[d as usize].drain(..) {
                        woken.push(w);
                    }
                }
                StreamEvent::Available(d) => {
                    for w in st.open[d as usize].drain(..) {
                        woken.push(w);
                    }
                }
            },
            Event::DatagramReceived => {
                for w in st.datagram.drain(..) {
                    woken.push(w);
                }
            }
            Event::NewToken(t) => {
                if let Some(name) = st.server_name.clone() {
                    let mut tokens = lock(&s.tokens);
                    // A client of many servers keeps tokens for the last few thousand: one
                    // goes (any: they are all single-use hints) to make room.
                    if tokens.len() >= MAX_TOKENS
                        && !tokens.contains_key(&name)
                        && let Some(k) = tokens.keys().next().cloned()
                    {
                        tokens.remove(&k);
                    }
                    tokens.insert(name, t);
                }
            }
            Event::ConnectionLost(e) => {
                st.error = Some(e);
                st.wake_all(woken);
            }
            Event::SessionTicket => {
                st.session_tickets += 1;
                woken.append(&mut st.ticket);
            }
            Event::HandshakeConfirmed
            | Event::PathMigrated { .. }
            | Event::PathValidated(_)
            | Event::PathValidationFailed(_)
            | Event::KeyUpdated { .. } => {}
            // kuai-proto's events may grow; what this driver does not know it need not wake.
            _ => {}
        }
    }
    // Connections that drained: wake anyone still waiting. Their state stays until the last
    // application handle goes (ConnectionInner::drop), so late callers still learn why.
    while let Some(h) = s.ep.poll_removed() {
        if let Some(k) = s.orphans.iter().position(|&o| o == h) {
            s.orphans.swap_remove(k);
            s.conns.remove(&h);
            continue;
        }
        // No handle is left to learn why: nothing to keep (it stayed for good before).
        if s.conns.get(&h).is_some_and(|st| st.released) {
            s.conns.remove(&h);
            continue;
        }
        if let Some(st) = s.conns.get_mut(&h)
            && !st.drained
        {
            st.drained = true;
            if st.error.is_none() {
                st.error = Some(ConnectionError::LocallyClosed);
            }
            st.wake_all(woken);
        }
    }
    if s.ep.connection_count() == 0 {
        for w in s.idle_wakers.drain(..) {
            woken.push(w);
        }
    }
}

/// A ticket for the anti-replay guard to check, asked once the worker's lock is released.
/// A ticket to check (with the verdict to give), or only to record as used (`None`).
type Check = (Arc<dyn AntiReplay>, Box<[u8]>, Option<Verdict>);

/// Moves held connections (see [`crate::replay`]) on: to the guard once their ClientHello is
/// read and they accepted 0-RTT, to `accept` once it answered first use (or at once without
/// 0-RTT); a replay is refused first. Handshake completion does not release one: the
/// replay's twin may be the one another server accepted.
fn release_held(
    s: &mut State,
    shared: &Arc<Shared>,
    woken: &mut Vec<Waker>,
    checks: &mut Vec<Check>,
) {
    let verdicts = std::mem::take(&mut s.verdicts);
    let now = Instant::now();
    let mut released = false;
    let mut i = 0;
    while i < s.held.len() {
        let hd = &mut s.held[i];
        let verdict = verdicts
            .iter()
            .find(|v| v.0 == hd.handle && v.1 == hd.seq)
            .map(|v| v.2);
        // Released to `accept`: Some(true); dropped unseen (its early data never reaches the
        // application): Some(false).
        let release = match s.ep.connection(hd.handle) {
            None => Some(false),
            Some(_) if verdict == Some(true) => Some(true),
            Some(c) if c.is_closed() => Some(false),
            Some(_) if verdict == Some(false) => {
                s.ep.refuse_replay(hd.handle, now);
                tracing::info!(target: "kuai::replay", "refused a replayed 0-RTT flight");
                Some(false)
            }
            Some(c) if !c.client_hello_read() => None,
            Some(c) => match c.accepted_0rtt_ticket() {
                None => {
                    // 0-RTT offered and not taken here: used all the same (see
                    // `AntiReplay::record`).
                    if let (Some(g), Some(t)) = (&s.anti_replay, c.offered_0rtt_ticket()) {
                        checks.push((g.clone(), Box::from(t), None));
                    }
                    Some(true)
                }
                Some(_) if hd.asked => None,
                Some(t) => {
                    hd.asked = true;
                    if let Some(g) = &s.anti_replay {
                        let v = Verdict::new(shared, hd.handle, hd.seq);
                        checks.push((g.clone(), Box::from(t), Some(v)));
                    }
                    None
                }
            },
        };
        match release {
            None => i += 1,
            Some(to_app) => {
                let h = s.held.swap_remove(i).handle;
                if to_app {
                    s.incoming.push_back(h);
                    released = true;
                } else if s.ep.connection(h).is_some() {
                    s.orphans.push(h);
                } else {
                    s.conns.remove(&h);
                }
            }
        }
    }
    if released {
        woken.append(&mut s.accept_wakers);
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

#[cfg(test)]
mod tests {
    use super::*;
    use kuai_proto::ConnectionIdGenerator;

    /// An endpoint that only connects out issues 4-byte connection IDs; one that also
    /// accepts, or was given its own configuration, keeps the generator's 8.
    #[tokio::test]
    async fn client_endpoints_use_short_connection_ids() {
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let len = |e: &Endpoint| e.first().lock().ep.cid_len();
        assert_eq!(len(&Endpoint::client(any).unwrap()), CLIENT_CID_LEN);
        let configured = Endpoint::builder()
            .endpoint_config(EndpointConfig::default())
            .bind(any)
            .unwrap();
        assert_eq!(len(&configured), 8);
        let (scfg, _) = crate::ServerConfig::self_signed(&["localhost"], &[b"x"]).unwrap();
        assert_eq!(len(&Endpoint::server(scfg, any).unwrap()), 8);
    }

    /// Junk short-header datagrams (unknown connection IDs) at any rate make a worker ask the
    /// others, taking their locks, at most ASKS_PER_SECOND times a second after a burst of as
    /// many.
    #[test]
    fn unknown_datagrams_ask_other_workers_a_bounded_number_of_times() {
        let t0 = Instant::now();
        let mut b = AskBudget::new(t0);
        let mut asked = 0;
        // A million junk datagrams over two seconds.
        for i in 0..1_000_000u32 {
            let now = t0 + std::time::Duration::from_micros(u64::from(i) * 2);
            asked += u32::from(b.take(now));
        }
        assert!(asked <= 3 * ASKS_PER_SECOND as u32 + 1, "{asked} asks");
        assert!(asked >= 2 * ASKS_PER_SECOND as u32, "{asked} asks");
    }

    /// Always the same ID, to pin the last byte.
    struct Fixed(u8);

    impl ConnectionIdGenerator for Fixed {
        fn generate(&mut self) -> kuai_proto::ConnectionId {
            kuai_proto::ConnectionId::new(&[9, 9, 9, self.0])
        }
        fn cid_len(&self) -> usize {
            4
        }
    }

    /// QUIC-LB steering: a datagram goes to the worker whose server ID its destination CID
    /// carries (encrypted), short or long header; other IDs stay where they landed.
    #[test]
    fn quic_lb_ids_name_their_worker() {
        use kuai_proto::quic_lb::{QuicLbCids, QuicLbConfig};
        let config = QuicLbConfig::new(1, 2, 6, Some([3; 16])).unwrap();
        let steering = Steering::quic_lb(config.clone(), vec![7, 10], 3).unwrap();
        let cid_len = config.cid_len();
        for (sid, want) in [
            ([7, 10], Some(0)),
            ([7, 12], Some(2)),
            ([7, 13], None),
            ([8, 10], None),
        ] {
            let cid = QuicLbCids::new(config.clone(), &sid).unwrap().generate();
            let mut short = vec![0x40];
            short.extend_from_slice(&cid);
            short.extend_from_slice(&[0; 20]);
            assert_eq!(steering.owner(&short, 3, cid_len), want, "{sid:?}");
            let mut long = vec![0xc0, 0, 0, 0, 1, cid.len() as u8];
            long.extend_from_slice(&cid);
            long.push(0);
            assert_eq!(steering.owner(&long, 3, cid_len), want, "{sid:?} long");
        }
        assert_eq!(steering.owner(&[0x40, 1, 2], 3, cid_len), None);
        assert_eq!(steering.owner(&[], 3, cid_len), None);
        assert!(Steering::quic_lb(config.clone(), vec![7, 254], 3).is_err());
        assert!(Steering::quic_lb(config, vec![7], 1).is_err());
        // Worker 2's server ID.
        assert_eq!(Steering::server_id(&[7, 10], 2), [7, 12]);
    }

    /// IDs with a structure of their own (here a tag byte, a random tail and a checksum as
    /// last byte): the worker's IDs are the generator's, unchanged, so they pass its
    /// `validate`.
    #[test]
    fn worker_cids_keep_the_generators_ids() {
        struct Checked;
        impl ConnectionIdGenerator for Checked {
            fn generate(&mut self) -> kuai_proto::ConnectionId {
                let mut b = [0xab, 0, 0, 0, 0, 0, 0, 0];
                rand::RngCore::fill_bytes(&mut rand::rng(), &mut b[1..7]);
                b[7] = b[..7].iter().fold(0u8, |a, x| a.wrapping_add(*x));
                kuai_proto::ConnectionId::new(&b)
            }
            fn cid_len(&self) -> usize {
                8
            }
            fn validate(&self, cid: &kuai_proto::ConnectionId) -> bool {
                cid.len() == 8 && cid[..7].iter().fold(0u8, |a, x| a.wrapping_add(*x)) == cid[7]
            }
        }
        for (worker, workers) in [(0u8, 2u8), (1, 2), (4, 7)] {
            let mut g = WorkerCids {
                inner: Box::new(Checked),
                worker,
                workers,
            };
            for _ in 0..200 {
                let cid = g.generate();
                assert!(g.validate(&cid), "{cid:?}");
                assert_eq!(cid[7] % workers, worker);
            }
        }
    }

    #[test]
    fn worker_cids_name_their_worker() {
        for workers in [2u8, 3, 7] {
            for worker in 0..workers {
                for last in [0u8, 1, 100, 250, 254, 255] {
                    let mut g = WorkerCids {
                        inner: Box::new(Fixed(last)),
                        worker,
                        workers,
                    };
                    let cid = g.generate();
                    assert_eq!(cid.len(), 4);
                    assert_eq!(&cid[..3], &[9, 9, 9]);
                    let mut short = vec![0x40];
                    short.extend_from_slice(&cid);
                    assert_eq!(
                        worker_of(&short, workers as usize, 4),
                        worker as usize,
                        "last byte {last}, worker {worker} of {workers}"
                    );
                }
            }
        }
    }
}
