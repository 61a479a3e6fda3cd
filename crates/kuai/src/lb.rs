//! A QUIC-LB aware UDP load balancer (draft-ietf-quic-load-balancers-21), as a full proxy:
//! clients send to the balancer, which forwards each datagram to the backend its destination
//! connection ID names and sends the backend's answers back from its own address.
//!
//! - A connection ID that decodes to a known server ID (any configuration of the
//!   [`QuicLbDecoder`]) goes to that backend, wherever the client now sends from: a migrated
//!   or NAT-rebound client reaches the server that holds its connection.
//! - Other IDs (a client's first Initial, its 0-RTT packets, unroutable codepoint 7) go by a
//!   rendezvous hash of the ID over the backends that take new connections, so every packet
//!   of one handshake reaches one backend and adding or removing a backend moves only its
//!   share.
//! - Backends are added, drained (no new connections; the connections they hold keep their
//!   packets) and removed while the balancer runs ([`LbHandle`]).
//! - Backends are checked: every [`LbConfig::health_interval`] each gets a probe, a
//!   1200-byte long-header packet of a reserved version (RFC 9000 §15), which any QUIC
//!   server answers with Version Negotiation (§6.1) without keeping state. A backend that
//!   misses [`LbConfig::health_failures`] probes in a row takes no new connections until it
//!   answers again.
//! - Each (client address, backend) pair is a flow with a UDP socket of its own, connected
//!   to the backend, closed after [`LbConfig::flow_idle`] without traffic,
//!   [`LbConfig::max_flows`] at most. Datagrams move in batches: `recvmmsg`/GRO in, GSO or
//!   `sendmmsg` out, one copy each way.
//!
//! Source addresses can be spoofed, so what an unknown address can make the balancer hold is
//! bounded: only a datagram of at least 1200 bytes with a long header (a client's first
//! Initial is padded to that, RFC 9000 §14.1) or one whose connection ID names a backend
//! opens a flow; a flow the backend has not answered closes after
//! [`LbConfig::unanswered_idle`] without traffic; a waiting flow holds a socket and a task
//! but no buffer (buffers are lent while it reads). A flow is confirmed once its client
//! sends to the connection ID the backend chose in its answer, which a spoofed source never
//! learns; a flow opened by a connection ID (a client that moved) is never confirmed (the
//! ID may be forged). When the flows are at their limit (or the local ports run out), a new
//! one takes the place of a flow not confirmed, however often its source sends, or else of
//! the confirmed flow whose client has been quiet longest, so a flood of spoofed sources
//! cannot lock real clients out (a flood that cycles the whole table within a client's
//! handshake can keep it out: see [`LbConfig::retry`]). The limit is at most the system's
//! local port range (each flow's socket takes a port).
//!
//! With [`LbConfig::retry`] the balancer validates client addresses itself
//! (draft-ietf-quic-retry-offload, the shared-state service): while as many flows are open as
//! [`LbRetry::above_flows`] (always, by default), a client's Initial without a token (in a
//! datagram of 1200 bytes) is answered with a Retry from the balancer, whose source
//! connection ID names the backend the hash picks for it, and only an Initial bringing the
//! token back from the same address opens a flow from a long header; other long headers
//! open none (a version the backends do not speak gets Version Negotiation from the
//! balancer). An Initial with a token is checked whether or not its source has a flow. A
//! spoofed source never sees the Retry, so it opens no flow with a long header; a short
//! header naming a backend's connection ID still opens one (a client that moved), never
//! counted as confirmed. The backends share the token key and set
//! `ServerConfig::retry_offload` (they see every client at the balancer's address).

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kuai_proto::quic_lb::{QuicLbConfig, QuicLbDecoder};
use kuai_proto::retry_offload::{self, RetryOffload, Verdict};
use quinn_udp::RecvMeta;

use crate::udp::{SocketOptions, UdpSocket, UdpStats};

/// Datagram batches read per call.
const BATCH: usize = 32;
/// Datagram batches a flow reads per call from its backend.
const FLOW_BATCH: usize = 8;
/// One receive buffer: a GRO batch of full-size datagrams.
const BUF: usize = 64 * 1024;
/// Buffer sets kept for flows between reads (more are made while more flows read at once).
const POOL_KEEP: usize = 16;
/// Buffer sets lent at once (128 MiB): a flow whose send waits (the balancer's socket full,
/// its uplink saturated) keeps its set meanwhile, and tens of thousands of flows each
/// holding one would have taken gigabytes; past this, flows wait before they read.
const MAX_BUF_SETS: usize = 256;
/// The smallest datagram that opens a flow without naming a backend in its connection ID:
/// a client's first datagram carries an Initial, which fills 1200 bytes (RFC 9000 §14.1).
pub const MIN_OPENING_DATAGRAM: usize = 1200;

/// What the balancer needs to know besides its backends.
#[derive(Debug, Clone)]
pub struct LbConfig {
    /// The QUIC-LB configurations in use.
    pub decoder: QuicLbDecoder,
    /// The length of the servers' connection IDs (short headers do not say it).
    pub cid_len: usize,
    /// A flow without traffic this long is closed (its client's next datagram opens a new
    /// one).
    pub flow_idle: Duration,
    /// A flow whose backend has not answered yet is closed after this without traffic from
    /// its client (or after `flow_idle` when shorter): what a spoofed source makes the
    /// balancer hold, it holds briefly. A backend answers a client's Initial at once.
    pub unanswered_idle: Duration,
    /// Most flows (each a socket) at once. Source addresses can be spoofed, so this bounds
    /// what a flood of them costs; at the limit a new flow takes the place of the one whose
    /// client has been quiet longest (found among the oldest 64; when each of those spoke
    /// since, the datagram is dropped).
    pub max_flows: usize,
    /// Most flows from one client address (an IPv4 address, an IPv6 /64) at once: what the
    /// servers' per-address connection limit would be without the balancer (servers behind
    /// it count each flow as a client, `ServerConfig::proxies`). Past it a flow of that
    /// address not confirmed makes room (a spoofer can open flows in an address's name, not
    /// confirm them), else the datagram that would open another is dropped.
    pub max_flows_per_address: usize,
    /// How often each backend is probed (`None`: never; every backend counts as up).
    pub health_interval: Option<Duration>,
    /// Probes missed in a row that take a backend out of new connections.
    pub health_failures: u32,
    /// Validate client addresses with Retry at the balancer (see the [module](self) docs);
    /// `None` (the default): the backends' own Retry policy.
    pub retry: Option<LbRetry>,
}

/// Retry at the balancer (see the [module](self) docs).
#[derive(Debug, Clone)]
pub struct LbRetry {
    /// Seals and checks the tokens: the backends' token key, and a lifetime no longer than
    /// theirs.
    pub offload: RetryOffload,
    /// The QUIC-LB configuration of the connection IDs a Retry sends clients to (the
    /// backends' current one), so the client's next Initial reaches the backend chosen.
    pub config: QuicLbConfig,
    /// Retry only while this many flows or more are open (0, the default: always). A
    /// Retry costs a client a round trip; a flood of spoofed sources fills the table.
    pub above_flows: usize,
}

impl LbRetry {
    /// Retry always, with tokens of `offload`, to IDs of `config`.
    pub fn new(offload: RetryOffload, config: QuicLbConfig) -> Self {
        Self {
            offload,
            config,
            above_flows: 0,
        }
    }
}

impl LbConfig {
    /// `decoder`'s configurations for IDs of `cid_len` bytes; flows idle out after 60 s (5 s
    /// while their backend has not answered), 65,536 at most.
    pub fn new(decoder: QuicLbDecoder, cid_len: usize) -> Self {
        Self {
            decoder,
            cid_len,
            flow_idle: Duration::from_secs(60),
            unanswered_idle: Duration::from_secs(5),
            max_flows: 65_536,
            max_flows_per_address: 4096,
            health_interval: Some(Duration::from_secs(1)),
            health_failures: 3,
            retry: None,
        }
    }
}

/// A backend as the balancer knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// Its QUIC-LB server ID.
    pub server_id: Vec<u8>,
    /// Where its QUIC endpoint listens.
    pub addr: SocketAddr,
    /// It takes no new connections.
    pub draining: bool,
    /// It answered the last health probes (see the [module](self) docs).
    pub up: bool,
}

struct Flow {
    sock: Arc<UdpSocket>,
    backend: SocketAddr,
    /// Milliseconds since the balancer started, at the last datagram either way. Written
    /// under the state lock, so a flow is never torn down between its lookup and its use.
    last: AtomicU64,
    /// The backend has sent something back.
    answered: AtomicBool,
    /// Milliseconds since the balancer started, at the client's last datagram.
    client_last: AtomicU64,
    /// The connection ID the backend chose in its first long-header answer (its Initial's
    /// or Retry's source ID): a client that sends to it has heard the answer.
    backend_cid: std::sync::OnceLock<Box<[u8]>>,
    /// The client sent to the ID the backend chose: it receives at its address, which a
    /// spoofer does not (it never learns the ID). Flows not confirmed make room first.
    confirmed: AtomicBool,
    /// Which flow of its key this is (see [`State::order`]).
    id: u64,
    /// Ended to make room for another: its task stops at once.
    evicted: tokio::sync::Notify,
}

impl Flow {
    /// How long the flow may go without traffic.
    fn idle(&self, config: &LbConfig) -> Duration {
        if self.answered.load(Relaxed) {
            config.flow_idle
        } else {
            config.flow_idle.min(config.unanswered_idle)
        }
    }
}

type FlowKey = (SocketAddr, SocketAddr);

struct State {
    backends: Vec<BackendInfo>,
    flows: HashMap<FlowKey, Arc<Flow>>,
    /// The flows, roughly by their client's last datagram, oldest first: each with its id
    /// and the time it was queued at. A flow whose client spoke since goes to the back
    /// when it reaches the front (a second chance, as the clock algorithm gives); entries of
    /// flows gone are dropped there.
    order: VecDeque<(FlowKey, u64, u64)>,
    /// The next flow's id.
    next_id: u64,
    /// Flows per client address ([`kuai_proto::address_key`]).
    per_address: HashMap<std::net::IpAddr, AddressFlows>,
}

/// The flows of one client address ([`kuai_proto::address_key`]).
#[derive(Default)]
struct AddressFlows {
    count: usize,
    /// Its flows, oldest first (entries of flows gone are dropped as they are met).
    order: VecDeque<(FlowKey, u64)>,
}

/// Flows looked at, at most, to find one to end for a new one.
const EVICT_SCAN: usize = 64;

impl State {
    /// Ends the flow whose client has been quiet longest (approximately) to make room;
    /// `false` if every flow looked at was active since it was queued.
    fn evict_one(&mut self) -> bool {
        for _ in 0..EVICT_SCAN {
            let Some((key, id, queued)) = self.order.pop_front() else {
                return false;
            };
            let Some(f) = self.flows.get(&key).filter(|f| f.id == id) else {
                continue; // gone already
            };
            // A client that spoke since gets a second chance, if it has shown it hears the
            // backend at its address: a spoofer can keep sending, but not to the ID the
            // backend chose.
            let spoke = f.client_last.load(Relaxed);
            if spoke > queued && f.confirmed.load(Relaxed) {
                self.order.push_back((key, id, spoke));
                continue;
            }
            if let Some(f) = self.forget(&key) {
                f.evicted.notify_one();
            }
            return true;
        }
        false
    }

    /// Removes a flow from the table.
    fn forget(&mut self, key: &FlowKey) -> Option<Arc<Flow>> {
        let f = self.flows.remove(key)?;
        let a = kuai_proto::address_key(key.0.ip());
        if let std::collections::hash_map::Entry::Occupied(mut e) = self.per_address.entry(a) {
            let af = e.get_mut();
            af.count -= 1;
            if af.count == 0 {
                e.remove();
            } else if af.order.len() > 2 * af.count + 16 {
                let flows = &self.flows;
                af.order
                    .retain(|(key, id)| flows.get(key).is_some_and(|f| f.id == *id));
            }
        }
        Some(f)
    }

    /// Ends a flow of `address` not confirmed (the oldest of the first 64 looked at) to make
    /// room for another of its flows; `false` if none was found. Spoofed sources can open
    /// flows in a victim's name, never confirm them, and so never take its confirmed ones'
    /// places.
    fn evict_one_of(&mut self, address: std::net::IpAddr) -> bool {
        for _ in 0..EVICT_SCAN {
            let Some(af) = self.per_address.get_mut(&address) else {
                return false;
            };
            let Some((key, id)) = af.order.pop_front() else {
                return false;
            };
            match self.flows.get(&key).filter(|f| f.id == id) {
                None => continue, // gone already
                Some(f) if f.confirmed.load(Relaxed) => af.order.push_back((key, id)),
                Some(_) => {
                    if let Some(f) = self.forget(&key) {
                        f.evicted.notify_one();
                    }
                    return true;
                }
            }
        }
        false
    }

    /// Drops the entries of flows gone when they outnumber the live ones.
    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.flows.len() + 1024 {
            let flows = &self.flows;
            self.order
                .retain(|(key, id, _)| flows.get(key).is_some_and(|f| f.id == *id));
        }
    }
}

struct Shared {
    sock: UdpSocket,
    stats: UdpStats,
    config: LbConfig,
    /// `config.max_flows`, or fewer when the system has fewer local ports for the flows'
    /// sockets (see [`local_ports`]).
    max_flows: usize,
    state: Mutex<State>,
    start: Instant,
    forwarded: AtomicU64,
    unroutable: AtomicU64,
    retries: AtomicU64,
    /// Receive buffers lent to flows while they read.
    pool: Mutex<Vec<Vec<Vec<u8>>>>,
    /// Buffer sets that may be lent at once ([`MAX_BUF_SETS`]).
    sets: tokio::sync::Semaphore,
    /// The key of the rendezvous hash that places new connections: random, so that no one
    /// can pick connection IDs that all land on one backend.
    hash_key: std::collections::hash_map::RandomState,
    /// When a warning was last logged (milliseconds since start, plus one), so a flood of
    /// failures logs one line a second.
    warned: AtomicU64,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Whether a warning may be logged now (one a second).
    fn may_warn(&self) -> bool {
        let now = self.now_ms() + 1;
        let last = self.warned.load(Relaxed);
        (last == 0 || now >= last + 1000)
            && self
                .warned
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }

    fn take_bufs(&self) -> Vec<Vec<u8>> {
        lock(&self.pool)
            .pop()
            .unwrap_or_else(|| vec![vec![0u8; BUF]; FLOW_BATCH])
    }

    fn give_bufs(&self, bufs: Vec<Vec<u8>>) {
        let mut pool = lock(&self.pool);
        if pool.len() < POOL_KEEP {
            pool.push(bufs);
        }
    }
}

/// Whether a socket could not be opened for want of local ports or descriptors.
fn out_of_sockets(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable
    ) || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Whether a datagram's source can be a client at all.
fn plausible_client(a: SocketAddr) -> bool {
    use std::net::IpAddr;
    a.port() != 0
        && !a.ip().is_unspecified()
        && !a.ip().is_multicast()
        && match a.ip() {
            IpAddr::V4(v4) => !v4.is_broadcast(),
            IpAddr::V6(_) => true,
        }
}

/// `a` with an IPv4-mapped IPv6 address written as IPv4, as a dual-stack socket reports
/// IPv4 peers.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Changes a running balancer's backends.
#[derive(Clone)]
pub struct LbHandle(Arc<Shared>);

impl std::fmt::Debug for LbHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LbHandle")
            .field("backends", &self.backends())
            .finish()
    }
}

impl LbHandle {
    /// Adds a backend (or puts a drained one back in service). At an address the health
    /// probes already know, it keeps that address's state: re-adding a backend that does
    /// not answer does not make it take new connections.
    pub fn add(&self, server_id: &[u8], addr: SocketAddr) {
        let addr = canonical(addr);
        let mut s = lock(&self.0.state);
        let up = s
            .backends
            .iter()
            .find(|b| b.addr == addr)
            .is_none_or(|b| b.up);
        s.backends.retain(|b| b.server_id != server_id);
        s.backends.push(BackendInfo {
            server_id: server_id.to_vec(),
            addr,
            draining: false,
            up,
        });
    }

    /// Sends no new connection to the backend; the ones it holds keep reaching it.
    pub fn drain(&self, server_id: &[u8]) -> bool {
        let mut s = lock(&self.0.state);
        match s.backends.iter_mut().find(|b| b.server_id == server_id) {
            Some(b) => {
                b.draining = true;
                true
            }
            None => false,
        }
    }

    /// Forgets the backend: its connections' packets are then routed as unknown ones.
    pub fn remove(&self, server_id: &[u8]) -> bool {
        let mut s = lock(&self.0.state);
        let before = s.backends.len();
        s.backends.retain(|b| b.server_id != server_id);
        s.backends.len() != before
    }

    /// The backends now.
    pub fn backends(&self) -> Vec<BackendInfo> {
        lock(&self.0.state).backends.clone()
    }

    /// Datagrams forwarded to backends, and those dropped: no backend could take them, or
    /// they would have opened a flow they may not open (see the [module](self) docs).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.0.forwarded.load(Relaxed),
            self.0.unroutable.load(Relaxed),
        )
    }

    /// Retry packets the balancer sent (see [`LbConfig::retry`]).
    pub fn retries(&self) -> u64 {
        self.0.retries.load(Relaxed)
    }

    /// Flows open now.
    pub fn flows(&self) -> usize {
        lock(&self.0.state).flows.len()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The balancer; see the [module](self) docs.
pub struct LoadBalancer(Arc<Shared>);

impl LoadBalancer {
    /// A balancer on `listen` in front of `backends` (server ID, address).
    pub fn bind(
        listen: SocketAddr,
        backends: Vec<(Vec<u8>, SocketAddr)>,
        config: LbConfig,
    ) -> io::Result<(Self, LbHandle)> {
        let sock = UdpSocket::bind(listen, SocketOptions::default())?;
        let ports = local_ports();
        let max_flows = config.max_flows.min(ports.unwrap_or(usize::MAX));
        if max_flows < config.max_flows {
            tracing::info!(target: "kuai::lb", flows = max_flows,
                "flows capped by the local port range (net.ipv4.ip_local_port_range)");
        }
        let shared = Arc::new(Shared {
            sock,
            stats: UdpStats::default(),
            max_flows,
            config,
            state: Mutex::new(State {
                backends: backends
                    .into_iter()
                    .map(|(server_id, addr)| BackendInfo {
                        server_id,
                        addr: canonical(addr),
                        draining: false,
                        up: true,
                    })
                    .collect(),
                flows: HashMap::new(),
                order: VecDeque::new(),
                next_id: 0,
                per_address: HashMap::new(),
            }),
            start: Instant::now(),
            forwarded: AtomicU64::new(0),
            unroutable: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            sets: tokio::sync::Semaphore::new(MAX_BUF_SETS),
            hash_key: std::collections::hash_map::RandomState::new(),
            warned: AtomicU64::new(0),
        });
        Ok((Self(shared.clone()), LbHandle(shared)))
    }

    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.0.sock.local_addr()
    }

    /// Forwards (and checks the backends) until the task is dropped.
    pub async fn run(self) -> io::Result<()> {
        // The checks on a task of their own: a flood that keeps the forwarding loop busy
        // must not stop them (a backend dying under it kept getting new connections).
        let checks = self
            .0
            .config
            .health_interval
            .map(|every| AbortOnDrop(tokio::spawn(health_checks(self.0.clone(), every))));
        match checks {
            Some(mut c) => {
                tokio::select! {
                    r = self.forward() => r,
                    r = &mut c.0 => r.unwrap_or_else(|e| Err(io::Error::other(e))),
                }
            }
            None => self.forward().await,
        }
    }

    async fn forward(&self) -> io::Result<()> {
        let s = &self.0;
        let mut bufs = vec![vec![0u8; BUF]; BATCH];
        let mut meta = vec![RecvMeta::default(); BATCH];
        loop {
            s.sock.readable().await?;
            let mut batches = 0u32;
            loop {
                // Non-blocking receives do not count against tokio's budget: let the other
                // tasks on this thread (flows, the CLI's signals) run now and then.
                batches += 1;
                if batches.is_multiple_of(64) {
                    tokio::task::yield_now().await;
                }
                let n = {
                    let mut iov: Vec<IoSliceMut<'_>> =
                        bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                    match s.sock.try_recv(&s.stats, &mut iov, &mut meta) {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // An error the socket reports once (an ICMP error queued for it,
                        // say): the balancer goes on.
                        Err(e) => {
                            if s.may_warn() {
                                tracing::warn!(target: "kuai::lb", error = %e, "receive failed");
                            }
                            break;
                        }
                    }
                };
                for (m, buf) in meta[..n].iter().zip(&bufs) {
                    self.forward_client(m, &buf[..m.len]).await;
                }
            }
        }
    }

    /// Forwards what a client sent (one datagram or a GRO batch of them), run by run of
    /// datagrams going to one backend.
    async fn forward_client(&self, m: &RecvMeta, data: &[u8]) {
        let s = &self.0;
        // No client sends from port 0, a multicast, broadcast or unspecified address (nor
        // from a backend's address or the balancer's own: see `flow_for`).
        // Nor from the address it was sent to: a spoof of the balancer's own, which
        // `flow_for`'s check of the listening address misses when that is a wildcard (the
        // backend's answers would come back here as a client's datagrams).
        let from = canonical(m.addr);
        if !plausible_client(from)
            || m.dst_ip.is_some_and(|ip| {
                canonical(SocketAddr::new(ip, s.sock.local_addr().port())) == from
            })
        {
            s.unroutable.fetch_add(1, Relaxed);
            return;
        }
        let stride = m.stride.max(1);
        let ecn = m.ecn.map(|e| e as u8);
        let mut start = 0;
        let mut run: Option<Arc<Flow>> = None;
        let mut i = 0;
        while i < data.len() {
            let end = (i + stride).min(data.len());
            let mut retried = false;
            let flow = match self.flow_for(m.addr, &data[i..end]) {
                Opened::Flow(f) => Some(f),
                Opened::No => None,
                Opened::Retry(pkt) => {
                    s.retries.fetch_add(1, Relaxed);
                    send(&s.sock, &s.stats, m.addr, None, &pkt, pkt.len()).await;
                    retried = true;
                    None
                }
                Opened::Answer(pkt) => {
                    send(&s.sock, &s.stats, m.addr, None, &pkt, pkt.len()).await;
                    None
                }
            };
            let same = match (&run, &flow) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if !same {
                if let Some(f) = run.take() {
                    self.to_backend(&f, ecn, &data[start..i], stride).await;
                }
                start = i;
                run = flow;
                if run.is_none() {
                    if !retried {
                        s.unroutable.fetch_add(1, Relaxed);
                    }
                    start = end;
                }
            }
            if run.is_some() {
                s.forwarded.fetch_add(1, Relaxed);
            }
            i = end;
        }
        if let Some(f) = run {
            self.to_backend(&f, ecn, &data[start..], stride).await;
        }
    }

    async fn to_backend(&self, f: &Flow, ecn: Option<u8>, data: &[u8], stride: usize) {
        let s = &self.0;
        send(&f.sock, &s.stats, f.backend, ecn, data, stride).await;
    }

    /// The flow for a datagram from `client`, made when new and the datagram may open one;
    /// or the Retry that answers it.
    fn flow_for(&self, client: SocketAddr, datagram: &[u8]) -> Opened {
        let s = &self.0;
        // Retry at the balancer: a long-header datagram is judged first (outside the lock).
        // A token in an Initial must be one of the balancer's, valid for this address,
        // whether or not the source has a flow: the backends take such tokens without
        // checking the address (it is the balancer's there).
        let mut verdict = None;
        if let Some(r) = &s.config.retry
            && datagram[0] & 0x80 != 0
        {
            match r.offload.check(datagram, client, unix_ms()) {
                Verdict::Drop => return Opened::No,
                Verdict::InvalidToken(close) => return Opened::Answer(close),
                v => verdict = Some(v),
            }
        }
        // One lock per datagram: the route and the flow under it.
        let mut st = lock(&s.state);
        let Some((chosen, by_id)) = route_to(&s.config, &s.hash_key, &st.backends, datagram) else {
            return Opened::No;
        };
        let backend = st.backends[chosen].addr;
        if let Some(f) = st.flows.get(&(client, backend)) {
            let now = s.now_ms();
            f.last.store(now, Relaxed);
            f.client_last.store(now, Relaxed);
            if !f.confirmed.load(Relaxed)
                && let Some(cid) = f.backend_cid.get()
                && dcid_is(datagram, cid)
            {
                f.confirmed.store(true, Relaxed);
            }
            return Opened::Flow(f.clone());
        }
        // Retry at the balancer: while it retries, only an Initial whose token proves its
        // address opens a flow from a long header.
        let validated = verdict == Some(Verdict::Validated);
        if let (Some(r), Some(v)) = (&s.config.retry, verdict)
            && st.flows.len() >= r.above_flows
        {
            match v {
                Verdict::Unvalidated(ids) => {
                    // The Retry's ID names the backend the client's ID hashes to, so its
                    // next Initial goes there by ID (that backend's ID, not the first at
                    // its address: a server's workers share one).
                    let mut nonce = vec![0u8; r.config.nonce_len()];
                    rand::RngCore::fill_bytes(&mut rand::rng(), &mut nonce);
                    return match r.config.encode(&st.backends[chosen].server_id, &nonce) {
                        Some(cid) => Opened::Retry(r.offload.retry(&ids, client, unix_ms(), &cid)),
                        None => Opened::No,
                    };
                }
                // Another long header (0-RTT, Handshake) opens nothing; a version the
                // backends do not speak gets Version Negotiation from here (RFC 9000 §6.1),
                // as a backend would have sent. Short headers go on below (a migrated
                // client's, by ID).
                Verdict::NotInitial => {
                    return retry_offload::version_negotiation(datagram)
                        .map_or(Opened::No, Opened::Answer);
                }
                _ => {}
            }
        }
        // A new flow: for a connection ID a backend issued (a migrated or rebound client),
        // or what can be a client's first datagram.
        // By ID: no shorter than a packet with that ID can be (a header-protection sample
        // after a 4-byte packet number field: 1 + ID + 4 + 16 bytes, RFC 9001 §5.4.2).
        let by_id = by_id && datagram.len() > s.config.cid_len + 20;
        let opens = by_id
            || validated
            || (datagram[0] & 0x80 != 0 && datagram.len() >= MIN_OPENING_DATAGRAM);
        // Nor does a client send from a backend's address or the balancer's own: such a
        // source (spoofed) would have the backend's answers sent to a backend or back here.
        let from = canonical(client);
        if !opens
            || from == canonical(s.sock.local_addr())
            || st.backends.iter().any(|b| b.addr == from)
        {
            return Opened::No;
        }
        // One client address opens this many flows at most: behind the balancer every
        // client shares its address, so the servers' per-address limits cannot tell them
        // apart (they count by flow, `ServerConfig::proxies`), and the cap is here.
        // At the cap a flow of that address not confirmed makes room (see `evict_one_of`).
        let address = kuai_proto::address_key(client.ip());
        if st.per_address.get(&address).map_or(0, |a| a.count) >= s.config.max_flows_per_address
            && !st.evict_one_of(address)
        {
            return Opened::No;
        }
        if st.flows.len() >= s.max_flows && !st.evict_one() {
            return Opened::No;
        }
        let sock = match flow_socket(backend) {
            Ok(sock) => Arc::new(sock),
            // Out of local ports (or descriptors) below the flow cap: the table is as full
            // as it gets, so a flow makes room as at the cap (its socket closes once its
            // task sees it go) for the client's next datagram; this one is dropped.
            Err(e) if out_of_sockets(&e) => {
                st.evict_one();
                if s.may_warn() {
                    tracing::warn!(target: "kuai::lb", %client, %backend, error = %e,
                        "out of flow sockets below the flow cap: a flow made room");
                }
                return Opened::No;
            }
            Err(e) => {
                if s.may_warn() {
                    tracing::warn!(target: "kuai::lb", %client, %backend, error = %e,
                        "cannot open a flow socket");
                }
                return Opened::No;
            }
        };
        let now = s.now_ms();
        let id = st.next_id;
        st.next_id += 1;
        let flow = Arc::new(Flow {
            sock,
            backend,
            last: AtomicU64::new(now),
            answered: AtomicBool::new(false),
            client_last: AtomicU64::new(now),
            backend_cid: std::sync::OnceLock::new(),
            // A flow opened by a connection ID (a client that moved, or whose flow idled
            // out) never sees a long-header answer to confirm it by, and nothing tells a
            // real client from a forged ID there (any ID of the right length decodes to
            // some server ID, and an attacker can send its own connection's ID from many
            // addresses): it starts, and stays, unconfirmed. Under a flood its flow may be
            // ended for a new one, and its next datagram opens another; had it started
            // confirmed, a table of such flows kept busy would lock every new client out.
            confirmed: AtomicBool::new(false),
            id,
            evicted: tokio::sync::Notify::new(),
        });
        st.flows.insert((client, backend), flow.clone());
        let af = st.per_address.entry(address).or_default();
        af.count += 1;
        af.order.push_back(((client, backend), id));
        st.order.push_back(((client, backend), id, now));
        st.compact_order();
        tokio::spawn(back_to_client(s.clone(), flow.clone(), client));
        Opened::Flow(flow)
    }
}

/// What a client's datagram gets (see [`LoadBalancer::flow_for`]).
enum Opened {
    /// The flow it goes through.
    Flow(Arc<Flow>),
    /// Nothing: dropped.
    No,
    /// This Retry packet, sent back to the client.
    Retry(Vec<u8>),
    /// This other stateless answer (Version Negotiation, a close for an invalid token),
    /// sent back to the client.
    Answer(Vec<u8>),
}

/// The wall-clock time in milliseconds (for tokens).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How many local ports the system hands out to sockets bound to port 0 (each flow takes
/// one), less a reserve for everything else; `None` where unknown.
fn local_ports() -> Option<usize> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = range.split_whitespace().map(|p| p.parse::<usize>().ok());
    let (low, high) = (it.next()??, it.next()??);
    Some(high.saturating_sub(low).saturating_sub(1024).max(1024))
}

/// The source connection ID of a long-header packet (RFC 8999 §5.1) other than Version
/// Negotiation (which only echoes the client's).
fn long_header_scid(d: &[u8]) -> Option<&[u8]> {
    if d.first()? & 0x80 == 0 || d.get(1..5)? == [0, 0, 0, 0] {
        return None;
    }
    let dcid_len = usize::from(*d.get(5)?);
    let at = 6 + dcid_len;
    let scid_len = usize::from(*d.get(at)?);
    d.get(at + 1..at + 1 + scid_len).filter(|c| !c.is_empty())
}

/// Whether a client's datagram is sent to `cid` (its destination connection ID, long or
/// short header).
fn dcid_is(d: &[u8], cid: &[u8]) -> bool {
    let Some(&first) = d.first() else {
        return false;
    };
    if first & 0x80 != 0 {
        d.get(5).is_some_and(|&l| usize::from(l) == cid.len())
            && d.get(6..6 + cid.len()) == Some(cid)
    } else {
        d.get(1..1 + cid.len()) == Some(cid)
    }
}

/// A flow's socket toward `backend`: connected, so the kernel hands it only the backend's
/// datagrams.
fn flow_socket(backend: SocketAddr) -> io::Result<UdpSocket> {
    let local: SocketAddr = if backend.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = std::net::UdpSocket::bind(local)?;
    sock.connect(backend)?;
    UdpSocket::from_std(sock, SocketOptions::default())
}

/// [`route_to`]'s backend address.
#[cfg(test)]
fn route(
    config: &LbConfig,
    key: &std::collections::hash_map::RandomState,
    backends: &[BackendInfo],
    d: &[u8],
) -> Option<(SocketAddr, bool)> {
    route_to(config, key, backends, d).map(|(i, by_id)| (backends[i].addr, by_id))
}

/// The backend for a datagram (its index: a server's workers share an address, each with
/// its server ID), and whether its destination connection ID named it: by the server ID in
/// that ID, else by a rendezvous hash of the ID over the backends taking connections.
fn route_to(
    config: &LbConfig,
    key: &std::collections::hash_map::RandomState,
    backends: &[BackendInfo],
    d: &[u8],
) -> Option<(usize, bool)> {
    use std::hash::BuildHasher;
    let first = *d.first()?;
    // A client's Initial or 0-RTT packet carries an ID of its own choosing (random), which
    // may decode to a server ID by chance: followed to a backend that is down, it would
    // miss the health checks (a Retry's ID is the backend's, which is up). (Draining
    // backends too made `backends_drain_and_go_without_dropping_the_others` count one
    // connection too many in 5 runs of 8, cause not found: left out.)
    let new_connection = first & 0x80 != 0
        && match d
            .get(1..5)
            .map(|v| u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
        {
            Some(0x0000_0001) => matches!((first >> 4) & 3, 0 | 1),
            Some(0x6b33_43cf) => matches!((first >> 4) & 3, 1 | 2),
            _ => false,
        };
    let dcid = if first & 0x80 != 0 {
        // Long header (RFC 8999 §5.1): version (4), DCID length (1), DCID.
        let len = usize::from(*d.get(5)?);
        d.get(6..6 + len)?
    } else {
        // A short header does not carry the ID's length: its configuration (by the
        // codepoint in the ID's first octet) does, so IDs of an old and a new configuration
        // of another length are both read right while the configuration rotates
        // (draft-ietf-quic-load-balancers-21 §3.1).
        let len = d
            .get(1)
            .and_then(|&o| config.decoder.cid_len(o))
            .unwrap_or(config.cid_len);
        d.get(1..1 + len)?
    };
    if let Some(sid) = config.decoder.server_id(dcid)
        && let Some(i) = backends
            .iter()
            .position(|b| b.server_id == sid && (b.up || !new_connection))
    {
        return Some((i, true));
    }
    // New connections go to backends that answer their probes; if none does, to any (the
    // probes may be what is lost).
    let any_up = backends.iter().any(|b| b.up && !b.draining);
    backends
        .iter()
        .enumerate()
        .filter(|(_, b)| !b.draining && (b.up || !any_up))
        .max_by_key(|(_, b)| {
            let mut h = key.build_hasher();
            dcid.hash(&mut h);
            b.server_id.hash(&mut h);
            h.finish()
        })
        .map(|(i, _)| (i, false))
}

/// The reserved version the health probes use (of the 0x?a?a?a?a form, RFC 9000 §15).
const PROBE_VERSION: u32 = 0x6a7a_8a9a;

/// Probes every backend each `every`; see the [module](self) docs.
async fn health_checks(s: Arc<Shared>, every: Duration) -> io::Result<()> {
    // One probe socket per family: an IPv4 backend answers an IPv4 socket with its own
    // address, which is what the probe was sent to.
    let v4 = tokio::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))
        .await
        .ok();
    let v6 = tokio::net::UdpSocket::bind((std::net::Ipv6Addr::UNSPECIFIED, 0))
        .await
        .ok();
    if v4.is_none() && v6.is_none() {
        return Err(io::Error::other("no socket for health probes"));
    }
    // Per backend address: the probe ID in flight, and probes missed in a row.
    let mut pending: HashMap<SocketAddr, ([u8; 8], u32)> = HashMap::new();
    let mut probe = vec![0u8; 1200];
    let (mut buf4, mut buf6) = (vec![0u8; 2048], vec![0u8; 2048]);
    let mut round = 0u64;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let answer = tokio::select! {
            _ = tick.tick() => {
                round += 1;
                // One probe per address (a server's workers share one, each with its ID).
                let mut addrs: Vec<SocketAddr> =
                    lock(&s.state).backends.iter().map(|b| b.addr).collect();
                addrs.sort();
                addrs.dedup();
                pending.retain(|a, _| addrs.contains(a));
                for (i, &addr) in addrs.iter().enumerate() {
                    let entry = pending.entry(addr).or_insert(([0; 8], 0));
                    if entry.0 != [0; 8] {
                        entry.1 = entry.1.saturating_add(1);
                        if entry.1 >= s.config.health_failures {
                            set_up(&s, addr, false);
                        }
                    }
                    // A probe ID unique per round and backend, never all zeros.
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    (s.start, round, i, addr).hash(&mut h);
                    entry.0 = (h.finish() | 1).to_be_bytes();
                    // Long header (RFC 8999 §5.1): the reserved version, this DCID, no SCID.
                    probe[0] = 0xc0;
                    probe[1..5].copy_from_slice(&PROBE_VERSION.to_be_bytes());
                    probe[5] = 8;
                    probe[6..14].copy_from_slice(&entry.0);
                    probe[14] = 0;
                    let sock = if addr.is_ipv4() { &v4 } else { &v6 };
                    if let Some(sock) = sock {
                        let _ = sock.send_to(&probe, addr).await;
                    }
                }
                continue;
            }
            r = recv_on(v4.as_ref(), &mut buf4) => r.map(|(n, from)| (&buf4[..n], from)),
            r = recv_on(v6.as_ref(), &mut buf6) => r.map(|(n, from)| (&buf6[..n], from)),
        };
        let Ok((d, from)) = answer else { continue };
        let from = canonical(from);
        // Version Negotiation (RFC 9000 §17.2.1): version 0, our DCID as its SCID.
        let answered = d.len() >= 7 && d[0] & 0x80 != 0 && d[1..5] == [0; 4] && {
            let dlen = usize::from(d[5]);
            let scid = d.get(6 + dlen + 1..).and_then(|rest| {
                let slen = usize::from(*d.get(6 + dlen)?);
                rest.get(..slen)
            });
            pending
                .get(&from)
                .is_some_and(|(id, _)| scid == Some(&id[..]))
        };
        if answered && let Some(p) = pending.get_mut(&from) {
            *p = ([0; 8], 0);
            set_up(&s, from, true);
        }
    }
}

/// A datagram on `sock`, or never without one.
async fn recv_on(
    sock: Option<&tokio::net::UdpSocket>,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr)> {
    match sock {
        Some(sock) => sock.recv_from(buf).await,
        None => std::future::pending().await,
    }
}

fn set_up(s: &Shared, addr: SocketAddr, up: bool) {
    let mut st = lock(&s.state);
    for b in st.backends.iter_mut().filter(|b| b.addr == addr) {
        if b.up != up {
            b.up = up;
            if up {
                tracing::info!(target: "kuai::lb", backend = %addr, "backend answers again");
            } else {
                tracing::warn!(target: "kuai::lb", backend = %addr,
                    "backend does not answer: no new connections to it");
            }
        }
    }
}

/// Sends `data` (datagrams of `stride` bytes, the last maybe shorter) to `to`; waits once
/// for room when the socket is full, then drops what does not fit (UDP: the transport
/// retransmits).
async fn send(
    sock: &UdpSocket,
    stats: &UdpStats,
    to: SocketAddr,
    ecn: Option<u8>,
    data: &[u8],
    stride: usize,
) {
    if data.is_empty() {
        return;
    }
    let mut off = 0;
    for _ in 0..2 {
        let seg = (data.len() - off > stride).then_some(stride);
        match sock.try_send(stats, to, ecn, None, &data[off..], seg) {
            Ok(n) => {
                off += n;
                if off >= data.len() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if sock.writable().await.is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

/// A flow's way back: the backend's datagrams to the client, from the balancer's address,
/// until the flow idles out.
async fn back_to_client(s: Arc<Shared>, flow: Arc<Flow>, client: SocketAddr) {
    let mut meta = vec![RecvMeta::default(); FLOW_BATCH];
    loop {
        let since = s.now_ms().saturating_sub(flow.last.load(Relaxed));
        let left = flow
            .idle(&s.config)
            .saturating_sub(Duration::from_millis(since));
        if left.is_zero() {
            // Gone only if still idle under the lock a datagram's lookup takes (which
            // refreshes `last`): a datagram that found the flow finds it alive.
            let mut st = lock(&s.state);
            let since = s.now_ms().saturating_sub(flow.last.load(Relaxed));
            if Duration::from_millis(since) >= flow.idle(&s.config) {
                if st
                    .flows
                    .get(&(client, flow.backend))
                    .is_some_and(|f| Arc::ptr_eq(f, &flow))
                {
                    st.forget(&(client, flow.backend));
                }
                return;
            }
            continue;
        }
        tokio::select! {
            r = tokio::time::timeout(left, flow.sock.readable()) => match r {
                Err(_) => continue, // re-check: the client may have sent meanwhile
                Ok(Err(_)) => break,
                Ok(Ok(())) => {}
            },
            // Out of the table already: the socket closes with the task.
            () = flow.evicted.notified() => return,
        }
        // Buffers only while there is something to read.
        let Ok(_set) = s.sets.acquire().await else {
            return;
        };
        let mut bufs = s.take_bufs();
        loop {
            let n = {
                let mut iov: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                match flow.sock.try_recv(&s.stats, &mut iov, &mut meta) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    // The backend's port refused (ICMP), reported once: read on after
                    // the next wake.
                    Err(_) => break,
                }
            };
            for (m, buf) in meta[..n].iter().zip(&bufs) {
                // Only the backend's answers (the socket is connected; this is the check
                // for when it could not be).
                if canonical(m.addr) != flow.backend {
                    continue;
                }
                flow.answered.store(true, Relaxed);
                flow.last.store(s.now_ms(), Relaxed);
                if flow.backend_cid.get().is_none()
                    && let Some(cid) = long_header_scid(&buf[..m.len])
                {
                    let _ = flow.backend_cid.set(cid.into());
                }
                let ecn = m.ecn.map(|e| e as u8);
                send(
                    &s.sock,
                    &s.stats,
                    client,
                    ecn,
                    &buf[..m.len],
                    m.stride.max(1),
                )
                .await;
            }
        }
        s.give_bufs(bufs);
    }
    let mut st = lock(&s.state);
    if st
        .flows
        .get(&(client, flow.backend))
        .is_some_and(|f| Arc::ptr_eq(f, &flow))
    {
        st.forget(&(client, flow.backend));
    }
}

/// A task aborted when its handle goes (with the balancer's `run`).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kuai_proto::quic_lb::QuicLbConfig;

    fn backend(id: u8, port: u16) -> BackendInfo {
        BackendInfo {
            server_id: vec![id],
            addr: ([127, 0, 0, 1], port).into(),
            draining: false,
            up: true,
        }
    }

    /// While the QUIC-LB configuration rotates from codepoint 0 (8-byte IDs) to codepoint 1
    /// (12-byte IDs), short headers with either are routed by their server ID: the length
    /// comes from the ID's codepoint, not from one fixed length.
    #[test]
    fn short_headers_of_two_configurations_route_by_their_own_length() {
        let old = QuicLbConfig::new(0, 1, 6, Some([3; 16])).unwrap();
        let new = QuicLbConfig::new(1, 1, 10, Some([4; 16])).unwrap();
        let mut decoder = QuicLbDecoder::new();
        decoder.add(old.clone()).add(new.clone());
        let config = LbConfig::new(decoder, old.cid_len());
        let backends: Vec<BackendInfo> = (1..=5).map(|i| backend(i, 1000 + u16::from(i))).collect();
        for (cfg, nonce) in [(&old, &[7u8; 6][..]), (&new, &[7u8; 10][..])] {
            for sid in 1..=5u8 {
                let cid = cfg.encode(&[sid], nonce).unwrap();
                let mut d = vec![0x40];
                d.extend_from_slice(&cid);
                d.extend_from_slice(&[0xaa; 30]);
                assert_eq!(
                    route(&config, &Default::default(), &backends, &d),
                    Some((([127, 0, 0, 1], 1000 + u16::from(sid)).into(), true)),
                    "codepoint {} server {sid}",
                    cid[0] >> 5
                );
            }
        }
    }

    #[test]
    fn sources_no_client_sends_from() {
        for bad in [
            "0.0.0.0:443",
            "10.0.0.1:0",
            "255.255.255.255:443",
            "224.0.0.1:443",
            "[::]:443",
            "[ff02::1]:443",
        ] {
            assert!(!plausible_client(bad.parse().unwrap()), "{bad}");
        }
        for good in ["10.0.0.1:50000", "[2001:db8::1]:443", "127.0.0.1:1"] {
            assert!(plausible_client(good.parse().unwrap()), "{good}");
        }
    }

    /// A client's Initial whose random connection ID decodes to the server ID of a backend
    /// that is down goes by the hash to one that is up; a short header (an established
    /// connection) still goes to its server.
    #[test]
    fn an_initial_naming_a_backend_that_is_down_by_chance_goes_elsewhere() {
        let cfg = QuicLbConfig::new(0, 1, 6, None).unwrap();
        let mut decoder = QuicLbDecoder::new();
        decoder.add(cfg.clone());
        let config = LbConfig::new(decoder, cfg.cid_len());
        let mut backends: Vec<BackendInfo> =
            (1..=3).map(|i| backend(i, 1000 + u16::from(i))).collect();
        backends[0].up = false;
        let cid = cfg.encode(&[1], &[9; 6]).unwrap();
        let down: SocketAddr = ([127, 0, 0, 1], 1001).into();
        let mut initial = vec![0xc0, 0, 0, 0, 1, cid.len() as u8];
        initial.extend_from_slice(&cid);
        initial.resize(1200, 0);
        let key = Default::default();
        let (to, by_id) = route(&config, &key, &backends, &initial).unwrap();
        assert!(to != down && !by_id, "{to}");
        let mut short = vec![0x40];
        short.extend_from_slice(&cid);
        short.extend_from_slice(&[0xaa; 30]);
        assert_eq!(route(&config, &key, &backends, &short), Some((down, true)));
    }

    /// A backend re-added at an address whose probes go unanswered stays out of new
    /// connections.
    #[tokio::test]
    async fn a_backend_added_again_keeps_its_health() {
        let (_lb, handle) = LoadBalancer::bind(
            "127.0.0.1:0".parse().unwrap(),
            vec![(vec![1], "127.0.0.1:1001".parse().unwrap())],
            LbConfig::new(QuicLbDecoder::new(), 8),
        )
        .unwrap();
        set_up(&handle.0, "127.0.0.1:1001".parse().unwrap(), false);
        handle.add(&[1], "127.0.0.1:1001".parse().unwrap());
        assert!(!handle.backends()[0].up);
        handle.add(&[2], "[::ffff:127.0.0.1]:1002".parse().unwrap());
        assert_eq!(handle.backends()[1].addr, "127.0.0.1:1002".parse().unwrap());
        assert!(handle.backends()[1].up);
    }
}
