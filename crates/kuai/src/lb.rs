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
//! - Each (client address, backend) pair is a flow with a UDP socket of its own toward the
//!   backend, closed after [`LbConfig::flow_idle`] without traffic, [`LbConfig::max_flows`] at
//!   most (source addresses can be spoofed). Datagrams move in batches:
//!   `recvmmsg`/GRO in, GSO or `sendmmsg` out, one copy each way.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kuai_proto::quic_lb::QuicLbDecoder;
use quinn_udp::RecvMeta;

use crate::udp::{SocketOptions, UdpSocket, UdpStats};

/// Datagram batches read per call.
const BATCH: usize = 32;
/// One receive buffer: a GRO batch of full-size datagrams.
const BUF: usize = 64 * 1024;

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
    /// Most flows (each a socket) at once: datagrams that would open another are dropped.
    /// Source addresses can be spoofed, so this bounds what a flood of them costs.
    pub max_flows: usize,
    /// How often each backend is probed (`None`: never; every backend counts as up).
    pub health_interval: Option<Duration>,
    /// Probes missed in a row that take a backend out of new connections.
    pub health_failures: u32,
}

impl LbConfig {
    /// `decoder`'s configurations for IDs of `cid_len` bytes; flows idle out after 60 s,
    /// 65,536 at most.
    pub fn new(decoder: QuicLbDecoder, cid_len: usize) -> Self {
        Self {
            decoder,
            cid_len,
            flow_idle: Duration::from_secs(60),
            max_flows: 65_536,
            health_interval: Some(Duration::from_secs(1)),
            health_failures: 3,
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
    /// Milliseconds since the balancer started, at the last datagram either way.
    last: AtomicU64,
}

struct State {
    backends: Vec<BackendInfo>,
    flows: HashMap<(SocketAddr, SocketAddr), Arc<Flow>>,
}

struct Shared {
    sock: UdpSocket,
    stats: UdpStats,
    config: LbConfig,
    state: Mutex<State>,
    start: Instant,
    forwarded: AtomicU64,
    unroutable: AtomicU64,
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
    /// Adds a backend (or puts a drained one back in service).
    pub fn add(&self, server_id: &[u8], addr: SocketAddr) {
        let mut s = lock(&self.0.state);
        s.backends.retain(|b| b.server_id != server_id);
        s.backends.push(BackendInfo {
            server_id: server_id.to_vec(),
            addr,
            draining: false,
            up: true,
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

    /// Datagrams forwarded to backends, and those no backend could take.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.0.forwarded.load(Relaxed),
            self.0.unroutable.load(Relaxed),
        )
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
        let shared = Arc::new(Shared {
            sock,
            stats: UdpStats::default(),
            config,
            state: Mutex::new(State {
                backends: backends
                    .into_iter()
                    .map(|(server_id, addr)| BackendInfo {
                        server_id,
                        addr,
                        draining: false,
                        up: true,
                    })
                    .collect(),
                flows: HashMap::new(),
            }),
            start: Instant::now(),
            forwarded: AtomicU64::new(0),
            unroutable: AtomicU64::new(0),
        });
        Ok((Self(shared.clone()), LbHandle(shared)))
    }

    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.0.sock.local_addr()
    }

    /// Forwards (and checks the backends) until the task is dropped.
    pub async fn run(self) -> io::Result<()> {
        match self.0.config.health_interval {
            Some(every) => {
                tokio::select! {
                    r = self.forward() => r,
                    r = health_checks(self.0.clone(), every) => r,
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
            loop {
                let n = {
                    let mut iov: Vec<IoSliceMut<'_>> =
                        bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                    match s.sock.try_recv(&s.stats, &mut iov, &mut meta) {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
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
        let stride = m.stride.max(1);
        let ecn = m.ecn.map(|e| e as u8);
        let mut start = 0;
        let mut run: Option<Arc<Flow>> = None;
        let mut i = 0;
        while i < data.len() {
            let end = (i + stride).min(data.len());
            let flow = self.flow_for(m.addr, &data[i..end]);
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
                    s.unroutable.fetch_add(1, Relaxed);
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
        f.last.store(s.start.elapsed().as_millis() as u64, Relaxed);
        send(&f.sock, &s.stats, f.backend, ecn, data, stride).await;
    }

    /// The flow for a datagram from `client`, made when new.
    fn flow_for(&self, client: SocketAddr, datagram: &[u8]) -> Option<Arc<Flow>> {
        let s = &self.0;
        // One lock per datagram: the route and the flow under it.
        let mut st = lock(&s.state);
        let backend = route(&s.config, &st.backends, datagram)?;
        if let Some(f) = st.flows.get(&(client, backend)) {
            return Some(f.clone());
        }
        if st.flows.len() >= s.config.max_flows {
            return None;
        }
        let local: SocketAddr = if backend.is_ipv4() {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let sock = match UdpSocket::bind(local, SocketOptions::default()) {
            Ok(sock) => Arc::new(sock),
            Err(e) => {
                tracing::warn!(%client, %backend, error = %e, "cannot open a flow socket");
                return None;
            }
        };
        let flow = Arc::new(Flow {
            sock,
            backend,
            last: AtomicU64::new(s.start.elapsed().as_millis() as u64),
        });
        st.flows.insert((client, backend), flow.clone());
        tokio::spawn(back_to_client(s.clone(), flow.clone(), client));
        Some(flow)
    }
}

/// The backend for a datagram: by the server ID in its destination connection ID, else by a
/// rendezvous hash of that ID over the backends taking connections.
fn route(config: &LbConfig, backends: &[BackendInfo], d: &[u8]) -> Option<SocketAddr> {
    let first = *d.first()?;
    let dcid = if first & 0x80 != 0 {
        // Long header (RFC 8999 §5.1): version (4), DCID length (1), DCID.
        let len = usize::from(*d.get(5)?);
        d.get(6..6 + len)?
    } else {
        d.get(1..1 + config.cid_len)?
    };
    if let Some(sid) = config.decoder.server_id(dcid)
        && let Some(b) = backends.iter().find(|b| b.server_id == sid)
    {
        return Some(b.addr);
    }
    // New connections go to backends that answer their probes; if none does, to any (the
    // probes may be what is lost).
    let any_up = backends.iter().any(|b| b.up && !b.draining);
    backends
        .iter()
        .filter(|b| !b.draining && (b.up || !any_up))
        .max_by_key(|b| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            dcid.hash(&mut h);
            b.server_id.hash(&mut h);
            h.finish()
        })
        .map(|b| b.addr)
}

/// The reserved version the health probes use (of the 0x?a?a?a?a form, RFC 9000 §15).
const PROBE_VERSION: u32 = 0x6a7a_8a9a;

/// Probes every backend each `every`; see the [module](self) docs.
async fn health_checks(s: Arc<Shared>, every: Duration) -> io::Result<()> {
    let local: SocketAddr = if s.sock.local_addr().is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(local).await?;
    // Per backend address: the probe ID in flight, and probes missed in a row.
    let mut pending: HashMap<SocketAddr, ([u8; 8], u32)> = HashMap::new();
    let mut probe = vec![0u8; 1200];
    let mut buf = vec![0u8; 2048];
    let mut round = 0u64;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
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
                        entry.1 += 1;
                        if entry.1 == s.config.health_failures {
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
                    let _ = sock.send_to(&probe, addr).await;
                }
            }
            r = sock.recv_from(&mut buf) => {
                let Ok((n, from)) = r else { continue };
                // Version Negotiation (RFC 9000 §17.2.1): version 0, our DCID as its SCID.
                let d = &buf[..n];
                let answered = d.len() >= 7
                    && d[0] & 0x80 != 0
                    && d[1..5] == [0; 4]
                    && {
                        let dlen = usize::from(d[5]);
                        let scid = d.get(6 + dlen + 1..).and_then(|rest| {
                            let slen = usize::from(*d.get(6 + dlen)?);
                            rest.get(..slen)
                        });
                        pending.get(&from).is_some_and(|(id, _)| scid == Some(&id[..]))
                    };
                if answered && let Some(p) = pending.get_mut(&from) {
                    let was_down = p.1 >= s.config.health_failures;
                    *p = ([0; 8], 0);
                    if was_down {
                        set_up(&s, from, true);
                    }
                }
            }
        }
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
    let mut bufs = vec![vec![0u8; BUF]; 8];
    let mut meta = vec![RecvMeta::default(); 8];
    let idle = s.config.flow_idle;
    loop {
        let since = (s.start.elapsed().as_millis() as u64).saturating_sub(flow.last.load(Relaxed));
        let left = idle.saturating_sub(Duration::from_millis(since));
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, flow.sock.readable()).await {
            Err(_) => continue, // re-check: the client may have sent meanwhile
            Ok(Err(_)) => break,
            Ok(Ok(())) => {}
        }
        loop {
            let n = {
                let mut iov: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                match flow.sock.try_recv(&s.stats, &mut iov, &mut meta) {
                    Ok(n) => n,
                    Err(_) => break,
                }
            };
            flow.last
                .store(s.start.elapsed().as_millis() as u64, Relaxed);
            for (m, buf) in meta[..n].iter().zip(&bufs) {
                // Only the backend's answers.
                if m.addr != flow.backend {
                    continue;
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
    }
    let mut st = lock(&s.state);
    if st
        .flows
        .get(&(client, flow.backend))
        .is_some_and(|f| Arc::ptr_eq(f, &flow))
    {
        st.flows.remove(&(client, flow.backend));
    }
}
