//! The endpoint: routes datagrams to connections by destination CID, accepts new server
//! connections from valid Initials, and answers what no connection owns with Version
//! Negotiation, Retry, CONNECTION_CLOSE or a stateless reset. Sans-IO like the rest.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::trace::{ConnectionMeta, EndpointDropReason, EndpointTraceEvent};
use crate::cid::{ConnectionId, ConnectionIdGenerator, MAX_CID_SIZE};
use crate::config::{ClientConfig, EndpointConfig, RetryPolicy, ServerConfig};
use crate::connection::{
    ConnectError, Connection, EcnCodepoint, EndpointEvent, Event, PathHint, ServerConnectionParams,
    Transmit,
};
use crate::error::TransportErrorCode;
use crate::frame::{Close, Frame};
use crate::packet::{self, LongType};
use crate::token::{self, TokenError, ValidToken};
use crate::types::{Side, Version, is_grease_version};

/// Identifies a connection within its endpoint. Never reused: a handle of a connection that
/// is gone stays invalid even when its slot serves a new connection.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash, Ord, PartialOrd)]
pub struct ConnectionHandle {
    idx: u32,
    generation: u32,
}

impl ConnectionHandle {
    fn idx(self) -> usize {
        self.idx as usize
    }
}

/// A slot of the connection table.
#[derive(Default)]
struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

struct Entry {
    conn: Connection,
    /// Server connection still in its handshake (counts toward `max_handshakes`).
    handshaking: bool,
    /// Its path hint was kept when it closed.
    hinted: bool,
    /// Client's initial DCID registered for routing (server side), with its address.
    initial_key: Option<(SocketAddr, ConnectionId)>,
    /// Our CIDs routed to this connection, the first `retired` of them ones the peer
    /// retired: they stay routed a while because a packet sent before the retirement may
    /// arrive after it (reordered, or on the path being left), and answering it with a
    /// stateless reset would end the connection.
    cids: Vec<ConnectionId>,
    retired: u8,
    /// The peer's reset token registered for this connection.
    reset_token: Option<[u8; 16]>,
    /// `Endpoint::timeout_epoch` of the last `handle_timeout` that ran this connection.
    timeout_epoch: u64,
    /// The deadline this connection has in the timer heap.
    scheduled: Option<Instant>,
    /// Bytes the connection held when last counted against the memory budget.
    memory: u64,
    /// The received part of `memory`, counted against the budget's hard limit.
    received: u64,
    /// A handshake begun with a validated address, counted for that client (see
    /// `ServerConfig::max_validated_handshakes_per_ip`; its [`Endpoint::client_key`]) until
    /// it completes or goes.
    validated_ip: Option<SocketAddr>,
    /// A server's connection, counted for its client (`Endpoint::client_key`) until it goes
    /// (see `ServerConfig::max_connections_per_ip`).
    client_ip: Option<SocketAddr>,
}

/// The key per-address limits count a client by: its IPv4 address, or the /64 its IPv6
/// address is in (one host commonly holds a whole /64, RFC 7421, and could otherwise take a
/// fresh address per connection); an IPv4-mapped address counts as IPv4.
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                v6.to_bits() & !u128::from(u64::MAX),
            )),
        },
    }
}

/// What `conn` learnt about its path, with its peer's address and its side: `None` before an
/// RTT sample, and for a server connection whose handshake did not complete (its address
/// may not have been real).
fn hint_of(conn: &Connection) -> Option<(SocketAddr, Side, PathHint)> {
    let hint = conn.path_hint()?;
    let side = conn.side();
    (side.is_client() || conn.is_established()).then(|| (conn.remote_address(), side, hint))
}

/// Retired CIDs each connection keeps routed (see `Entry::retired`).
const RETIRED_KEPT: usize = 2;

/// Statistics of an endpoint.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connection attempts refused (CONNECTION_REFUSED).
    pub refused: u64,
    /// Retry packets sent.
    pub retries_sent: u64,
    /// Version Negotiation packets sent.
    pub version_negotiations_sent: u64,
    /// Stateless resets sent.
    pub stateless_resets_sent: u64,
    /// Address-validation tokens that did not check out.
    pub invalid_tokens: u64,
    /// Datagrams dropped before reaching a connection.
    pub dropped: u64,
    /// Connections closed past the memory budget's hard limit (see
    /// [`crate::config::MemoryBudget`]).
    pub closed_over_budget: u64,
}

impl std::ops::AddAssign<&EndpointStats> for EndpointStats {
    /// Sums the counters of several endpoints (the workers of one port).
    fn add_assign(&mut self, o: &EndpointStats) {
        self.accepted += o.accepted;
        self.refused += o.refused;
        self.retries_sent += o.retries_sent;
        self.version_negotiations_sent += o.version_negotiations_sent;
        self.stateless_resets_sent += o.stateless_resets_sent;
        self.invalid_tokens += o.invalid_tokens;
        self.dropped += o.dropped;
        self.closed_over_budget += o.closed_over_budget;
    }
}

/// Stateless resets answer only datagrams longer than this, and are 41 bytes up to this long
/// themselves, so a reset never answers one of kuai's (RFC 9000 §10.3.3; see
/// `maybe_stateless_reset`). A peer whose packets are all this short learns of a lost
/// connection from its timers instead, as §10.3.3 allows.
pub(crate) const RESET_ANSWERS_ABOVE: usize = 43;

/// Stateless responses queued at most (see `Endpoint::queue_response`).
const MAX_RESPONSES: usize = 1024;

/// Extra age a Retry token from a Retry offload may have here: the offload took it a
/// moment before, by its own clock.
const RETRY_OFFLOAD_GRACE: Duration = Duration::from_secs(5);

/// A QUIC endpoint (client, server, or both): the connections behind one UDP socket, routed
/// by connection ID, and the stateless answers (Version Negotiation, Retry, stateless reset).
///
/// The endpoint does no I/O and reads no clock; whoever drives it owns the socket and the
/// timer, and follows this contract (the `kuai` crate's driver task does):
///
/// 1. **Input.** Every UDP datagram received goes to [`handle_datagram`](Self::handle_datagram)
///    with the time it arrived, where it came from, the local IP it was sent to (needed when
///    the socket is bound to a wildcard address) and its ECN codepoint. Calls the application
///    makes on a connection ([`connection_mut`](Self::connection_mut): open a stream, write,
///    close) are input too.
/// 2. **Output, after any input.** Call [`poll_transmit`](Self::poll_transmit) until it
///    returns `None`, sending each [`Transmit`] (one datagram, or a GSO
///    batch of `segment_size` pieces) as it comes; then take [`poll_event`](Self::poll_event)
///    until `None` (handshake done, streams readable or writable, connection lost), new
///    connections from [`accept`](Self::accept), and handles of connections that are gone from
///    [`poll_removed`](Self::poll_removed). Skipping the transmit loop stalls the connections:
///    acknowledgments, retransmissions and flow-control credit leave only through it.
/// 3. **Timers.** Only after `poll_transmit` has returned `None`, ask
///    [`poll_timeout`](Self::poll_timeout) for the earliest deadline; when it passes, call
///    [`handle_timeout`](Self::handle_timeout) with the current time, then do step 2 again.
///    An input that arrives first resets nothing: ask again after it.
///
/// The `now` given to every call must never go backwards. Each call takes `&mut self` and does
/// bounded work, so one task (or one thread) per endpoint drives it with no locking inside.
///
/// ```
/// use std::time::Instant;
/// use kuai_proto::Endpoint;
///
/// /// One turn of a driver: a datagram (or none), then everything it caused.
/// fn turn(ep: &mut Endpoint, input: Option<(std::net::SocketAddr, bytes::BytesMut)>) {
///     let now = Instant::now();
///     if let Some((from, data)) = input {
///         ep.handle_datagram(now, from, None, None, data);
///     }
///     let mut buf = Vec::new();
///     while let Some(t) = ep.poll_transmit(now, 1, &mut buf) {
///         // socket.send_to(&buf[..t.size], t.destination)
///         let _ = t;
///     }
///     while let Some((_handle, _event)) = ep.poll_event() {
///         // hand the event to whoever waits on that connection
///     }
///     if let Some(deadline) = ep.poll_timeout() {
///         // sleep until `deadline` (or the next datagram), then ep.handle_timeout(Instant::now())
///         let _ = deadline;
///     }
/// }
/// ```
pub struct Endpoint {
    config: Arc<EndpointConfig>,
    server: Option<Arc<ServerConfig>>,
    cid_gen: Box<dyn ConnectionIdGenerator>,
    conns: Vec<Slot>,
    free: Vec<usize>,
    /// Connections forgotten since the application last asked ([`Endpoint::poll_removed`]).
    removed: Vec<ConnectionHandle>,
    by_cid: HashMap<ConnectionId, ConnectionHandle>,
    by_initial: HashMap<(SocketAddr, ConnectionId), ConnectionHandle>,
    /// Peers' stateless reset tokens, to find the connection a reset is meant for.
    by_reset_token: HashMap<[u8; 16], ConnectionHandle>,
    /// Slots to poll for sending (by index: whichever connection holds the slot now).
    ready: VecDeque<usize>,
    in_ready: Vec<bool>,
    /// Connection deadlines by slot index; stale entries are skipped when popped.
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
    responses: VecDeque<(SocketAddr, Option<IpAddr>, Vec<u8>)>,
    events: VecDeque<(ConnectionHandle, Event)>,
    incoming: VecDeque<ConnectionHandle>,
    handshakes: usize,
    /// Handshakes in flight begun with a validated address, per client
    /// ([`Endpoint::client_key`]).
    validated_by_ip: HashMap<SocketAddr, u32>,
    /// A server's connections per client ([`Endpoint::client_key`]).
    conns_by_ip: HashMap<SocketAddr, u32>,
    timeout_epoch: u64,
    rng: StdRng,
    anchor: (Instant, u64),
    stats: EndpointStats,
    /// The time of the datagram or call being handled, for subscribers' events.
    now: Instant,
    /// What client connections learnt about their servers' paths, for the next connection
    /// to the same address.
    path_hints: Hints<SocketAddr>,
    /// What established server connections learnt about their clients' paths, by client
    /// ([`Endpoint::client_key`]: its IP, as a NAT gives a returning client another port).
    client_hints: Hints<SocketAddr>,
}

/// Peers an endpoint remembers a path hint for, each way.
const PATH_HINTS: usize = 1024;

/// Path hints by peer, at most [`PATH_HINTS`], the oldest entry out first.
struct Hints<K> {
    by_peer: HashMap<K, PathHint>,
    order: VecDeque<K>,
}

impl<K: std::hash::Hash + Eq + Copy> Hints<K> {
    fn new() -> Self {
        Self {
            by_peer: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn get(&self, k: &K) -> Option<PathHint> {
        self.by_peer.get(k).copied()
    }

    fn insert(&mut self, k: K, hint: PathHint) {
        if self.by_peer.insert(k, hint).is_none() {
            self.order.push_back(k);
            if self.order.len() > PATH_HINTS
                && let Some(old) = self.order.pop_front()
            {
                self.by_peer.remove(&old);
            }
        }
    }
}

/// A dropped endpoint gives back what its connections held of a budget other endpoints may
/// share.
impl Drop for Endpoint {
    fn drop(&mut self) {
        let budget = &self.config.memory_budget;
        for e in self.conns.iter().filter_map(|s| s.entry.as_ref()) {
            budget.update(e.memory, 0);
            budget.update_received(e.received, 0);
            budget.count(false);
        }
    }
}

impl Endpoint {
    /// Creates an endpoint. `unix_ms` is the wall-clock time at `now` (used only inside
    /// address-validation tokens); `seed` makes all randomness reproducible when given.
    pub fn new(
        config: Arc<EndpointConfig>,
        server: Option<Arc<ServerConfig>>,
        now: Instant,
        unix_ms: u64,
        seed: Option<u64>,
    ) -> Self {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Self {
            cid_gen: (config.cid_generator)(),
            config,
            server,
            conns: Vec::new(),
            free: Vec::new(),
            removed: Vec::new(),
            by_cid: HashMap::new(),
            by_initial: HashMap::new(),
            by_reset_token: HashMap::new(),
            ready: VecDeque::new(),
            in_ready: Vec::new(),
            timers: BinaryHeap::new(),
            responses: VecDeque::new(),
            events: VecDeque::new(),
            incoming: VecDeque::new(),
            handshakes: 0,
            validated_by_ip: HashMap::new(),
            conns_by_ip: HashMap::new(),
            timeout_epoch: 0,
            rng,
            anchor: (now, unix_ms),
            stats: EndpointStats::default(),
            now,
            path_hints: Hints::new(),
            client_hints: Hints::new(),
        }
    }

    /// Lets this endpoint accept connections (or stop, with `None`).
    pub fn set_server_config(&mut self, server: Option<Arc<ServerConfig>>) {
        self.server = server;
    }

    /// Derives stateless reset tokens (RFC 9000 §10.3.2) from `key` from now on: for the
    /// connection IDs issued next, and for the resets sent for IDs the endpoint does not
    /// know. IDs already issued keep the tokens their peers hold. A fleet server that
    /// started without the fleet's key (its store unreachable) takes it up this way, so
    /// the other servers can reset its later connections.
    pub fn set_reset_key(&mut self, key: [u8; 32]) {
        Arc::make_mut(&mut self.config).reset_key = key;
    }

    /// Statistics so far.
    pub fn stats(&self) -> &EndpointStats {
        &self.stats
    }

    /// Connections held.
    pub fn connection_count(&self) -> usize {
        self.conns.len() - self.free.len()
    }

    fn slot(&self, h: ConnectionHandle) -> Option<&Entry> {
        let slot = self.conns.get(h.idx())?;
        if slot.generation != h.generation {
            return None;
        }
        slot.entry.as_ref()
    }

    fn slot_mut(&mut self, h: ConnectionHandle) -> Option<&mut Entry> {
        let slot = self.conns.get_mut(h.idx())?;
        if slot.generation != h.generation {
            return None;
        }
        slot.entry.as_mut()
    }

    /// The handle of whatever connection holds slot `idx` now.
    fn handle_at(&self, idx: usize) -> Option<ConnectionHandle> {
        let slot = self.conns.get(idx)?;
        slot.entry.as_ref()?;
        Some(ConnectionHandle {
            idx: idx as u32,
            generation: slot.generation,
        })
    }

    /// The connection behind `h`, while it exists.
    pub fn connection(&self, h: ConnectionHandle) -> Option<&Connection> {
        self.slot(h).map(|e| &e.conn)
    }

    /// Mutable access for the application; the endpoint re-polls the connection afterwards.
    pub fn connection_mut(&mut self, h: ConnectionHandle) -> Option<&mut Connection> {
        if self.slot(h).is_some() {
            self.mark_ready(h);
        }
        self.slot_mut(h).map(|e| &mut e.conn)
    }

    /// Handles of all live connections.
    pub fn handles(&self) -> impl Iterator<Item = ConnectionHandle> + '_ {
        self.conns
            .iter()
            .enumerate()
            .filter(|(_, s)| s.entry.is_some())
            .map(|(i, s)| ConnectionHandle {
                idx: i as u32,
                generation: s.generation,
            })
    }

    fn unix_ms(&self, now: Instant) -> u64 {
        self.anchor.1 + now.saturating_duration_since(self.anchor.0).as_millis() as u64
    }

    fn new_cid(&mut self) -> ConnectionId {
        loop {
            let cid = self.cid_gen.generate();
            if cid.is_empty() || !self.by_cid.contains_key(&cid) {
                return cid;
            }
        }
    }

    fn insert(&mut self, entry: Entry) -> ConnectionHandle {
        self.config.memory_budget.count(true);
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(Slot::default());
                self.in_ready.push(false);
                self.conns.len() - 1
            }
        };
        let slot = &mut self.conns[i];
        slot.generation = slot.generation.wrapping_add(1);
        slot.entry = Some(entry);
        ConnectionHandle {
            idx: i as u32,
            generation: slot.generation,
        }
    }

    fn route_cid(&mut self, cid: ConnectionId, h: ConnectionHandle) {
        self.by_cid.insert(cid, h);
        if let Some(e) = self.slot_mut(h) {
            e.cids.push(cid);
        }
    }

    fn mark_ready(&mut self, h: ConnectionHandle) {
        let i = h.idx();
        if !self.in_ready[i] {
            self.in_ready[i] = true;
            self.ready.push_back(i);
        }
    }

    /// Starts a client connection.
    pub fn connect(
        &mut self,
        now: Instant,
        config: &ClientConfig,
        remote: SocketAddr,
        server_name: &str,
    ) -> Result<ConnectionHandle, ConnectError> {
        self.connect_with_token(now, config, remote, server_name, Bytes::new())
    }

    /// Starts a client connection presenting a NEW_TOKEN token from an earlier connection.
    pub fn connect_with_token(
        &mut self,
        now: Instant,
        config: &ClientConfig,
        remote: SocketAddr,
        server_name: &str,
        token: Bytes,
    ) -> Result<ConnectionHandle, ConnectError> {
        let cid = self.new_cid();
        let seed = self.rng.random();
        let hint = self.path_hints.get(&remote);
        self.now = now;
        let mut conn = Connection::new_client(
            config,
            server_name,
            remote,
            cid,
            token,
            now,
            seed,
            hint,
            self.config.max_udp_payload_size,
        )?;
        self.attach_tracer(&mut conn, Side::Client, remote, now);
        let h = self.insert(Entry {
            conn,
            handshaking: false,
            hinted: false,
            initial_key: None,
            cids: Vec::new(),
            retired: 0,
            reset_token: None,
            timeout_epoch: 0,
            scheduled: None,
            memory: 0,
            received: 0,
            validated_ip: None,
            client_ip: None,
        });
        if !cid.is_empty() {
            self.route_cid(cid, h);
        }
        self.after_conn_op(h, now);
        Ok(h)
    }

    /// What the last client connection to `server` learnt about the path (its smoothed RTT
    /// and loss rate), which the next [`Endpoint::connect`] to that address starts from.
    pub fn path_hint(&self, server: SocketAddr) -> Option<PathHint> {
        self.path_hints.get(&server)
    }

    /// Records a path hint for `server`, as a client connection does when it ends; an
    /// application that keeps hints across processes gives them back here.
    pub fn remember_path(&mut self, server: SocketAddr, hint: PathHint) {
        self.path_hints.insert(server, hint);
    }

    /// Server: what the last established connection from `client` learnt about its path,
    /// which the next connection from that host starts from (an IPv4 address or an IPv6
    /// /64, [`address_key`]: a client's temporary IPv6 addresses share its path).
    pub fn client_path_hint(&self, client: IpAddr) -> Option<PathHint> {
        self.client_hints.get(&SocketAddr::new(address_key(client), 0))
    }

    /// Who a client is for the per-client limits and path hints: its IPv4 address or IPv6
    /// /64 ([`address_key`]; port 0), or, when it arrives from one of the server's
    /// `proxies`, that proxy's address and port (the proxy gives each client a port of its
    /// own, and its address is everyone's).
    fn client_key(&self, remote: SocketAddr) -> SocketAddr {
        let ip = remote.ip().to_canonical();
        if self.proxied(remote) {
            SocketAddr::new(ip, remote.port())
        } else {
            SocketAddr::new(address_key(ip), 0)
        }
    }

    /// Whether `remote` is one of the server's `proxies`.
    fn proxied(&self, remote: SocketAddr) -> bool {
        let ip = remote.ip().to_canonical();
        self.server
            .as_ref()
            .is_some_and(|s| s.proxies.iter().any(|p| p.to_canonical() == ip))
    }

    /// Takes the next connection a client opened to us.
    pub fn accept(&mut self) -> Option<ConnectionHandle> {
        self.incoming.pop_front()
    }

    /// Takes the next connection the endpoint forgot (drained, or dropped by
    /// [`Endpoint::forget_all_connections`]), so the application can release what it keeps
    /// per connection without scanning them all.
    pub fn poll_removed(&mut self) -> Option<ConnectionHandle> {
        self.removed.pop()
    }

    /// Takes the next connection event.
    pub fn poll_event(&mut self) -> Option<(ConnectionHandle, Event)> {
        self.events.pop_front()
    }

    /// The length of the connection IDs this endpoint issues (every short-header packet for
    /// it carries one).
    pub fn cid_len(&self) -> usize {
        self.cid_gen.cid_len()
    }

    /// Whether `datagram` would reach one of this endpoint's connections: a long-header packet
    /// always counts (it may start a connection); a short-header one when its destination CID
    /// is ours, or when it ends in the stateless reset token of one of our peers.
    pub fn routes(&self, datagram: &[u8]) -> bool {
        match datagram.first() {
            Some(b) if b & 0x80 == 0 => {
                datagram
                    .get(1..1 + self.cid_len())
                    .and_then(ConnectionId::try_from_slice)
                    .is_some_and(|dcid| self.by_cid.contains_key(&dcid))
                    || packet::reset_token_of(datagram)
                        .is_some_and(|t| self.by_reset_token.contains_key(t))
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Gives a new connection its subscribers' tracer, if the endpoint has subscribers.
    fn attach_tracer(&self, conn: &mut Connection, side: Side, remote: SocketAddr, now: Instant) {
        let subs = &self.config.subscribers;
        if subs.is_empty() {
            return;
        }
        let meta = ConnectionMeta {
            side,
            remote,
            original_dcid: conn.original_dcid(),
        };
        if let Some(t) = subs.connection_tracer(&meta, now) {
            conn.set_tracer(t);
        }
    }

    /// Counts a datagram dropped before any connection saw it, and tells the subscribers.
    fn drop_datagram(&mut self, remote: SocketAddr, size: usize, reason: EndpointDropReason) {
        self.stats.dropped += 1;
        self.notify(EndpointTraceEvent::DatagramDropped {
            remote,
            size,
            reason,
        });
    }

    /// Hands `event` to the subscribers (built only when there are some: callers pass a
    /// cheap value).
    /// Refuses connection `h` because its 0-RTT flight is a replay (see
    /// [`Connection::accepted_0rtt_ticket`]): CONNECTION_REFUSED, and subscribers hear of
    /// it.
    pub fn refuse_replay(&mut self, h: ConnectionHandle, now: Instant) {
        let Some(c) = self.connection_mut(h) else {
            return;
        };
        let remote = c.remote_address();
        c.refuse(now, "0-RTT replay: this session ticket was used before");
        self.now = now;
        self.notify(EndpointTraceEvent::ZeroRttReplayRefused { remote });
    }

    fn notify(&self, event: EndpointTraceEvent) {
        if !self.config.subscribers.is_empty() {
            self.config.subscribers.endpoint_event(self.now, &event);
        }
    }

    /// Processes a received UDP datagram.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
    ) {
        self.now = now;
        let Some(first) = data.first().copied() else {
            return;
        };
        let cid_len = self.cid_gen.cid_len();
        if first & 0x80 == 0 {
            // Short header: the DCID has our fixed length.
            let Some(dcid) = data
                .get(1..1 + cid_len)
                .and_then(ConnectionId::try_from_slice)
            else {
                self.drop_datagram(remote, data.len(), EndpointDropReason::Malformed);
                return;
            };
            if let Some(&h) = self.by_cid.get(&dcid) {
                self.deliver(h, now, remote, local_ip, ecn, data);
            } else if let Some(&h) =
                packet::reset_token_of(&data).and_then(|t| self.by_reset_token.get(t))
            {
                // Unroutable but ending in a peer's reset token: let the connection check it.
                self.deliver(h, now, remote, local_ip, ecn, data);
            } else {
                self.maybe_stateless_reset(remote, local_ip, &dcid, data.len());
            }
            return;
        }
        // Long header invariants (RFC 8999 §5.1).
        let Some(info) = long_header_ids(&data) else {
            self.drop_datagram(remote, data.len(), EndpointDropReason::Malformed);
            return;
        };
        let version = info.version;
        if version != 0 && Version::from_wire(version).is_none() {
            self.send_version_negotiation(remote, local_ip, &info, data.len());
            return;
        }
        if let Some(dcid) = ConnectionId::try_from_slice(info.dcid(&data))
            && let Some(&h) = self
                .by_cid
                .get(&dcid)
                .or_else(|| self.by_initial.get(&(remote, dcid)))
        {
            self.deliver(h, now, remote, local_ip, ecn, data);
            return;
        }
        if version == 0 {
            self.drop_datagram(remote, data.len(), EndpointDropReason::UnsupportedVersion);
            return;
        }
        let v = Version::from_wire(version).expect("checked above");
        let ty = LongType::from_bits((first >> 4) & 0x03, v);
        if ty != LongType::Initial || self.server.is_none() {
            self.drop_datagram(remote, data.len(), EndpointDropReason::Unexpected);
            return;
        }
        self.accept_initial(now, remote, local_ip, ecn, data, v);
    }

    fn deliver(
        &mut self,
        h: ConnectionHandle,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
    ) {
        let Some(e) = self.slot_mut(h) else {
            return;
        };
        e.conn.handle_datagram(now, remote, local_ip, ecn, data);
        if e.handshaking || e.conn.has_pending_events() || e.conn.is_closed() {
            self.after_conn_op(h, now);
        } else {
            // Nothing to route or report: the next `poll_transmit` visits the connection and
            // reschedules its timer, once for a batch of datagrams rather than after each.
            self.mark_ready(h);
        }
    }

    fn accept_initial(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
        version: Version,
    ) {
        let server = self.server.clone().expect("checked by caller");
        // RFC 9000 §14.1: Initial datagrams are at least 1200 bytes.
        if data.len() < 1200 {
            self.drop_datagram(remote, data.len(), EndpointDropReason::InitialTooSmall);
            return;
        }
        let Ok((pd, _)) = packet::PartialDecode::new(data.clone(), self.cid_gen.cid_len()) else {
            self.drop_datagram(remote, data.len(), EndpointDropReason::Malformed);
            return;
        };
        let dcid = pd.dst_cid();
        let Some(scid) = pd.src_cid() else { return };
        // RFC 9000 §7.2: the client's first DCID is at least 8 bytes. After a Retry it is the
        // Retry's source ID, which may be shorter (a QUIC-LB ID of 6 or 7): with a token
        // (checked below: only a valid Retry token for that very ID lets it through).
        if dcid.len() < 8 && pd.token().is_empty() {
            self.drop_datagram(remote, data.len(), EndpointDropReason::InitialCidTooShort);
            return;
        }
        if !server.versions.contains(&version) {
            let info = long_header_ids(&data).expect("parsed above");
            self.send_version_negotiation(remote, local_ip, &info, data.len());
            return;
        }
        let unix_ms = self.unix_ms(now);
        let mut original_dcid = dcid;
        let mut retry_scid = None;
        let mut validated = false;
        // Behind a Retry offload its tokens bind the client's address, which only the
        // offload saw: taken without the address check from the offload's proxies (from
        // anywhere when none is named), never from a client reaching this server directly.
        let proxied = self.proxied(remote);
        let offloaded = server.retry_offload && (proxied || server.proxies.is_empty());
        let mut bad_retry_token = false;
        if !pd.token().is_empty() {
            match token::validate(
                &server.token_key,
                pd.token(),
                remote,
                !offloaded,
                unix_ms,
                // The offload judged the token's age a moment ago, perhaps on a clock a
                // little behind ours: what it let through is not refused here for that.
                if offloaded {
                    server.retry_token_lifetime + RETRY_OFFLOAD_GRACE
                } else {
                    server.retry_token_lifetime
                },
                server.new_token_lifetime,
            ) {
                // RFC 9000 §17.2.5.2: after a Retry the client sends to the Retry's source
                // ID. A token presented with any other ID is a copy reused for another
                // connection: one Retry validates one handshake.
                Ok(ValidToken::Retry { retry_scid, .. }) if retry_scid != dcid => {
                    self.stats.invalid_tokens += 1;
                    self.notify(EndpointTraceEvent::InvalidToken { remote });
                    bad_retry_token = true;
                }
                Ok(ValidToken::Retry { odcid, .. }) => {
                    original_dcid = odcid;
                    retry_scid = Some(dcid);
                    validated = true;
                    // The client took our Retry (RFC 9000 §17.2.5.2): a copy of its first
                    // Initial that arrived after the Retry was sent, and was accepted, is a
                    // handshake nobody will finish.
                    if let Some(&orphan) = self.by_initial.get(&(remote, odcid)) {
                        if let Some(e) = self.slot_mut(orphan).filter(|e| e.handshaking) {
                            e.conn.abandon();
                        }
                        self.after_conn_op(orphan, now);
                    }
                }
                Ok(ValidToken::NewToken { issued_ms, id }) => {
                    // Each token validates once (RFC 9000 §8.1.4); a replayed one leaves the
                    // client unvalidated, as if it had none. Not taken at all when this
                    // server takes none (behind a proxy, see `ServerConfig::new_tokens`).
                    // From a proxy the token's address is the proxy's, every client's.
                    if server.new_tokens
                        && !proxied
                        && server.token_log.first_use(
                        &id,
                        issued_ms,
                        unix_ms,
                        server.new_token_lifetime,
                    ) {
                        validated = true;
                    } else {
                        self.stats.invalid_tokens += 1;
                        self.notify(EndpointTraceEvent::InvalidToken { remote });
                    }
                }
                Err(TokenError::Stale) => {
                    // A NEW_TOKEN token that no longer checks out is simply ignored; a Retry
                    // token that does not is answered below.
                    self.stats.invalid_tokens += 1;
                    self.notify(EndpointTraceEvent::InvalidToken { remote });
                    bad_retry_token = token::is_retry_token(&server.token_key, pd.token());
                }
                Err(TokenError::Invalid) => {
                    self.stats.invalid_tokens += 1;
                    self.notify(EndpointTraceEvent::InvalidToken { remote });
                }
            }
        }
        // RFC 9000 §8.1.3: a client that brings a Retry token took a Retry and takes no
        // other (§17.2.5.2), and would close a connection accepted without it on the
        // missing retry_source_connection_id (§7.3): tell it at once with INVALID_TOKEN
        // rather than let it time out (or accept a handshake it must abort).
        if bad_retry_token {
            self.refuse(
                remote,
                local_ip,
                version,
                &dcid,
                &scid,
                TransportErrorCode::INVALID_TOKEN,
            );
            return;
        }
        if dcid.len() < 8 && retry_scid.is_none() {
            self.drop_datagram(remote, data.len(), EndpointDropReason::InitialCidTooShort);
            return;
        }
        // One host (an IPv4 address, an IPv6 /64) holds a share of the table at most, so it
        // cannot push every other client out by opening connections it keeps idle.
        let busy = self.connection_count() >= server.max_connections
            || self
                .conns_by_ip
                .get(&self.client_key(remote))
                .is_some_and(|&n| n >= server.max_connections_per_ip);
        if busy {
            self.refuse(
                remote,
                local_ip,
                version,
                &dcid,
                &scid,
                TransportErrorCode::CONNECTION_REFUSED,
            );
            return;
        }
        // Behind a Retry offload the offload sends the Retries: one of ours would seal the
        // proxy's address, which the offload would refuse when the client brings it back.
        let want_retry = !server.retry_offload
            && match server.retry {
                RetryPolicy::Never => false,
                RetryPolicy::Always => true,
                RetryPolicy::AboveHandshakes(n) => self.handshakes >= n,
            };
        if !validated && (want_retry || self.handshakes >= server.max_handshakes) {
            if want_retry
                || (!server.retry_offload && matches!(server.retry, RetryPolicy::AboveHandshakes(_)))
            {
                self.send_retry(remote, local_ip, version, &dcid, &scid, unix_ms);
            } else {
                self.refuse(
                    remote,
                    local_ip,
                    version,
                    &dcid,
                    &scid,
                    TransportErrorCode::CONNECTION_REFUSED,
                );
            }
            return;
        }
        let ip_handshakes = if validated {
            self.validated_by_ip
                .get(&self.client_key(remote))
                .copied()
                .unwrap_or(0)
        } else {
            0
        };
        if validated
            && (self.handshakes >= server.max_handshakes.saturating_mul(2)
                || ip_handshakes >= server.max_validated_handshakes_per_ip)
        {
            self.refuse(
                remote,
                local_ip,
                version,
                &dcid,
                &scid,
                TransportErrorCode::CONNECTION_REFUSED,
            );
            return;
        }
        let local_cid = self.new_cid();
        let reset_token = token::reset_token(&self.config.reset_key, &local_cid);
        let preferred_cid = (server.preferred_address.is_some() && !local_cid.is_empty())
            .then(|| self.new_cid())
            .filter(|c| *c != local_cid);
        let seed = self.rng.random();
        let conn = Connection::new_server(
            ServerConnectionParams {
                config: server,
                version,
                original_dcid,
                initial_dcid: dcid,
                client_cid: scid,
                local_cid,
                reset_token,
                preferred_cid,
                retry_scid,
                remote,
                local_ip,
                address_validated: validated,
                reset_key: self.config.reset_key,
                unix_ms,
                seed,
                memory_pressure: self.config.memory_budget.under_pressure(),
                // Not for a client behind a proxy: its next connection comes on another of
                // the proxy's ports, and another client may get this one's.
                hint: (!self.proxied(remote))
                    .then(|| self.client_hints.get(&self.client_key(remote)))
                    .flatten(),
                max_udp_payload_size: self.config.max_udp_payload_size,
            },
            now,
        );
        let mut conn = conn;
        self.attach_tracer(&mut conn, Side::Server, remote, now);
        let client = self.client_key(remote);
        let h = self.insert(Entry {
            conn,
            handshaking: true,
            hinted: false,
            initial_key: Some((remote, dcid)),
            cids: Vec::new(),
            retired: 0,
            reset_token: None,
            timeout_epoch: 0,
            scheduled: None,
            memory: 0,
            received: 0,
            validated_ip: validated.then_some(client),
            client_ip: Some(client),
        });
        *self
            .conns_by_ip
            .entry(client)
            .or_insert(0) += 1;
        self.handshakes += 1;
        if validated {
            *self
                .validated_by_ip
                .entry(client)
                .or_insert(0) += 1;
        }
        self.stats.accepted += 1;
        self.route_cid(local_cid, h);
        self.by_initial.insert((remote, dcid), h);
        // The preferred-address CID routes here too.
        let extra: Vec<ConnectionId> = self
            .slot(h)
            .map(|e| e.conn.local_cids().filter(|c| *c != local_cid).collect())
            .unwrap_or_default();
        for c in extra {
            self.route_cid(c, h);
        }
        let size = data.len();
        self.deliver(h, now, remote, local_ip, ecn, data);
        // RFC 9001 §5.2: an Initial that fails authentication is discarded, and it leaves
        // nothing behind: a connection whose first datagram held no packet it could open is
        // gone at once (it was never announced), so junk Initials cost no state.
        if self
            .slot(h)
            .is_some_and(|e| e.conn.packets_received() == 0 && !e.conn.is_closed())
        {
            self.remove(h);
            self.removed.retain(|&r| r != h);
            self.events.retain(|(x, _)| *x != h);
            self.drop_datagram(remote, size, EndpointDropReason::InitialUndecryptable);
            return;
        }
        self.incoming.push_back(h);
    }

    fn send_retry(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        version: Version,
        dcid: &ConnectionId,
        scid: &ConnectionId,
        unix_ms: u64,
    ) {
        let server = self.server.as_ref().expect("server");
        let new_scid = self.cid_gen.generate();
        let tok = token::retry_token(&server.token_key, remote, dcid, &new_scid, unix_ms);
        let pkt = packet::build_retry(version, scid, &new_scid, dcid, &tok);
        self.stats.retries_sent += 1;
        self.notify(EndpointTraceEvent::RetrySent { remote });
        self.queue_response(remote, local_ip, pkt);
    }

    /// Closes a connection attempt statelessly with CONNECTION_CLOSE in an Initial packet.
    fn refuse(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        version: Version,
        dcid: &ConnectionId,
        scid: &ConnectionId,
        code: TransportErrorCode,
    ) {
        self.stats.refused += 1;
        self.notify(EndpointTraceEvent::ConnectionRefused { remote });
        let local = self.cid_gen.generate();
        if let Some(pkt) = initial_close(version, dcid, scid, &local, code, b"server busy") {
            self.queue_response(remote, local_ip, pkt);
        }
    }

    fn send_version_negotiation(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        info: &LongIds,
        datagram_len: usize,
    ) {
        // RFC 9000 §6.1 / §14.1: only for datagrams big enough to be a client's Initial, and
        // never in answer to a Version Negotiation packet.
        if self.server.is_none() || datagram_len < 1200 || info.version == 0 {
            self.drop_datagram(remote, datagram_len, EndpointDropReason::UnsupportedVersion);
            return;
        }
        let versions: Vec<u32> = self
            .server
            .as_ref()
            .map(|s| s.versions.iter().map(|v| v.wire()).collect())
            .unwrap_or_default();
        let pkt = packet::build_version_negotiation(&info.scid, &info.dcid_bytes, &versions);
        self.stats.version_negotiations_sent += 1;
        self.notify(EndpointTraceEvent::VersionNegotiationSent { remote });
        self.queue_response(remote, local_ip, pkt);
    }

    /// Queues a stateless packet (Retry, Version Negotiation, refusal, stateless reset). They
    /// are sent before any connection's packets; past [`MAX_RESPONSES`] waiting, more are
    /// dropped (each answers a datagram that may be spoofed, so none is owed).
    fn queue_response(&mut self, remote: SocketAddr, local_ip: Option<IpAddr>, pkt: Vec<u8>) {
        if self.responses.len() >= MAX_RESPONSES {
            self.drop_datagram(remote, pkt.len(), EndpointDropReason::ResponsesQueueFull);
            return;
        }
        self.responses.push_back((remote, local_ip, pkt));
    }

    fn maybe_stateless_reset(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        dcid: &ConnectionId,
        received: usize,
    ) {
        // RFC 9000 §10.3.3: a reset smaller than the packet that triggered it, so that two
        // endpoints that answer each other's resets shrink them until they stop. Shrinking
        // by a byte a time (as §10.3 asks of an answer to a packet of 43 bytes or fewer) left
        // two kuai endpoints that had both lost a connection trading up to 37 resets for
        // each stray packet (a fuzzed handshake found it): 44 bytes spoofed from one to the
        // other drew 23 resets, 736 bytes. So a reset answers only a datagram longer
        // than `RESET_ANSWERS_ABOVE` and is no longer than that itself: one of ours never
        // draws another, and whatever a peer answers it with (shorter still) draws none.
        if !self.config.stateless_reset
            || received <= RESET_ANSWERS_ABOVE
            || dcid.is_empty()
            || self.cid_gen.issued_here(dcid) == Some(false)
        {
            self.drop_datagram(remote, received, EndpointDropReason::UnknownConnection);
            return;
        }
        let token = token::reset_token(&self.config.reset_key, dcid);
        // 41 bytes or more: a shorter reset may be told apart from a packet (§10.3.3).
        let len = RESET_ANSWERS_ABOVE - self.rng.random_range(0..=2);
        let pkt = packet::build_stateless_reset(&token, len);
        self.stats.stateless_resets_sent += 1;
        self.notify(EndpointTraceEvent::StatelessResetSent { remote });
        self.queue_response(remote, local_ip, pkt);
    }

    /// After any operation on a connection: route its endpoint events, collect its events,
    /// reschedule its timer and queue it for sending.
    fn after_conn_op(&mut self, h: ConnectionHandle, now: Instant) {
        self.process_conn(h, true, now);
    }

    /// Routes a connection's endpoint events, collects its application events and reschedules
    /// its timer; `requeue` puts it in the send rotation.
    fn process_conn(&mut self, h: ConnectionHandle, mut requeue: bool, now: Instant) {
        let Some(entry) = self
            .conns
            .get_mut(h.idx())
            .filter(|s| s.generation == h.generation)
            .and_then(|s| s.entry.as_mut())
        else {
            return;
        };
        let mut drained = false;
        let mut need = 0;
        let mut retire = Vec::new();
        while let Some(ev) = entry.conn.poll_endpoint_event() {
            match ev {
                // Each says how many short the connection was when it was made: two in one
                // batch (two retirements in one packet) overlap, so the largest is the need.
                // Adding them issued more than the peer's active_connection_id_limit.
                EndpointEvent::NeedCids(n) => need = need.max(n),
                EndpointEvent::RetireCid(cid) => retire.push(cid),
                EndpointEvent::ResetToken(t) => {
                    if let Some(old) = entry.reset_token.replace(t) {
                        self.by_reset_token.remove(&old);
                    }
                    self.by_reset_token.insert(t, h);
                }
                EndpointEvent::Drained => drained = true,
            }
        }
        // What it holds counts against the endpoint's memory budget, and the budget's state
        // sets its windows. Past the hard limit, a connection holding more received data than
        // its share goes (credit granted earlier cannot be taken back otherwise).
        let budget = &self.config.memory_budget;
        let m = entry.conn.memory();
        budget.update(entry.memory, m.send + m.receive);
        budget.update_received(entry.received, m.receive);
        entry.memory = m.send + m.receive;
        entry.received = m.receive;
        if budget.received() > budget.hard_limit()
            && m.receive > budget.share()
            && !entry.conn.is_closed()
        {
            tracing::debug!(remote = %entry.conn.remote_address(), held = m.receive,
                share = budget.share(), "memory budget exhausted: connection closed");
            entry.conn.close_over_budget(now);
            self.stats.closed_over_budget += 1;
            let remote = entry.conn.remote_address();
            let m = entry.conn.memory();
            budget.update(entry.memory, m.send + m.receive);
            budget.update_received(entry.received, m.receive);
            entry.memory = m.send + m.receive;
            entry.received = m.receive;
            // Its CONNECTION_CLOSE goes out.
            requeue = true;
            self.notify(EndpointTraceEvent::ClosedOverBudget {
                remote,
                held: m.receive,
            });
        }
        let Some(entry) = self
            .conns
            .get_mut(h.idx())
            .and_then(|s| s.entry.as_mut())
        else {
            return;
        };
        entry.conn.set_memory_pressure(self.config.memory_budget.under_pressure());
        while let Some(ev) = entry.conn.poll_event() {
            self.events.push_back((h, ev));
        }
        if entry.handshaking && (entry.conn.is_established() || entry.conn.is_closed()) {
            entry.handshaking = false;
            self.handshakes -= 1;
            if let Some(ip) = entry.validated_ip.take() {
                uncount_ip(&mut self.validated_by_ip, ip);
            }
            // The client's initial DCID stays routed here until the connection goes: a late
            // or duplicated Initial of the client (an ACK of ours, a retransmission) is then
            // dropped by this connection (its Initial keys are gone) instead of starting a
            // second connection that would answer it.
        }
        for cid in &retire {
            let Some(e) = self.slot_mut(h) else { break };
            let first = e.retired as usize;
            let Some(at) = e.cids[first..].iter().position(|c| c == cid) else {
                continue;
            };
            // To the end of the retired block; the oldest retired one goes when it is full.
            e.cids[first..=first + at].rotate_right(1);
            e.retired += 1;
            if first + 1 > RETIRED_KEPT {
                let gone = e.cids.remove(0);
                e.retired -= 1;
                self.by_cid.remove(&gone);
            }
        }
        if need > 0 && self.cid_gen.cid_len() > 0 {
            let mut new = Vec::with_capacity(need);
            for _ in 0..need.min(8) {
                let cid = self.new_cid();
                let token = token::reset_token(&self.config.reset_key, &cid);
                self.route_cid(cid, h);
                new.push((cid, token));
            }
            if let Some(e) = self.slot_mut(h) {
                e.conn.issue_cids(new);
            }
        }
        if drained {
            self.remove(h);
            return;
        }
        // What a connection learnt is kept as soon as it closes, not when it drains three
        // probe timeouts later (RFC 9000 §10.2): the next connection from the same peer
        // often starts in between (a client fetching one URL after another).
        if let Some(e) = self.slot_mut(h)
            && !e.hinted
            && e.conn.is_closed()
        {
            e.hinted = true;
            let hint = hint_of(&e.conn);
            self.keep_hint(hint);
        }
        self.schedule_timer(h.idx());
        if requeue {
            self.mark_ready(h);
        }
    }

    /// Keeps what a connection learnt about its path (see [`hint_of`]) for the next
    /// connection to the same peer.
    fn keep_hint(&mut self, hint: Option<(SocketAddr, Side, PathHint)>) {
        match hint {
            Some((server, Side::Client, hint)) => self.path_hints.insert(server, hint),
            Some((client, Side::Server, hint)) if !self.proxied(client) => {
                let key = self.client_key(client);
                self.client_hints.insert(key, hint)
            }
            Some((_, Side::Server, _)) => {}
            None => {}
        }
    }

    fn remove(&mut self, h: ConnectionHandle) {
        let Some(entry) = self
            .conns
            .get_mut(h.idx())
            .filter(|s| s.generation == h.generation)
            .and_then(|s| s.entry.take())
        else {
            return;
        };
        if entry.handshaking {
            self.handshakes -= 1;
            if let Some(ip) = entry.validated_ip {
                uncount_ip(&mut self.validated_by_ip, ip);
            }
        }
        if let Some(ip) = entry.client_ip {
            uncount_ip(&mut self.conns_by_ip, ip);
        }
        self.config.memory_budget.update(entry.memory, 0);
        self.config.memory_budget.update_received(entry.received, 0);
        self.config.memory_budget.count(false);
        if !entry.hinted {
            self.keep_hint(hint_of(&entry.conn));
        }
        if let Some(k) = entry.initial_key {
            self.by_initial.remove(&k);
        }
        for c in &entry.cids {
            self.by_cid.remove(c);
        }
        if let Some(t) = entry.reset_token {
            self.by_reset_token.remove(&t);
        }
        self.free.push(h.idx());
        self.removed.push(h);
    }

    /// Drops every connection without a trace, as if the process had restarted (the
    /// endpoint configuration, and so the stateless reset key, stays). For tests and for
    /// operators who need to shed state at once.
    pub fn forget_all_connections(&mut self) {
        let all: Vec<ConnectionHandle> = self.handles().collect();
        for h in all {
            self.remove(h);
        }
    }

    /// Writes the next datagram(s) to send into `buf`.
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        max_datagrams: usize,
        buf: &mut Vec<u8>,
    ) -> Option<Transmit> {
        if let Some((dst, src_ip, pkt)) = self.responses.pop_front() {
            buf.clear();
            buf.extend_from_slice(&pkt);
            return Some(Transmit {
                destination: dst,
                ecn: None,
                size: pkt.len(),
                segment_size: None,
                src_ip,
            });
        }
        while let Some(i) = self.ready.pop_front() {
            self.in_ready[i] = false;
            let Some(h) = self.handle_at(i) else {
                continue;
            };
            let Some(e) = self.slot_mut(h) else {
                continue;
            };
            if let Some(t) = e.conn.poll_transmit(now, max_datagrams, buf) {
                // It may have more: keep it in the rotation.
                self.after_conn_op(h, now);
                return Some(t);
            }
            // Nothing to send: its timer (pacing, ACK delay, ...) will bring it back.
            self.process_conn(h, false, now);
        }
        None
    }

    /// Puts slot `i`'s current deadline in the heap unless it is there already; the heap
    /// then holds about one entry per connection instead of one per operation.
    fn schedule_timer(&mut self, i: usize) {
        let Some(e) = self.conns.get_mut(i).and_then(|s| s.entry.as_mut()) else {
            return;
        };
        if let Some(t) = e.conn.poll_timeout()
            && e.scheduled != Some(t)
        {
            e.scheduled = Some(t);
            self.timers.push(Reverse((t, i)));
        }
    }

    /// Pops the earliest heap entry, noting that its slot no longer has it scheduled.
    fn pop_timer(&mut self) -> Option<(Instant, usize)> {
        let Reverse((t, i)) = self.timers.pop()?;
        if let Some(e) = self.conns.get_mut(i).and_then(|s| s.entry.as_mut())
            && e.scheduled == Some(t)
        {
            e.scheduled = None;
        }
        Some((t, i))
    }

    /// The earliest time [`handle_timeout`](Self::handle_timeout) should run. Ask after
    /// [`poll_transmit`](Self::poll_transmit) has returned `None`: a connection that only
    /// received datagrams is rescheduled when `poll_transmit` visits it.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some(Reverse((t, i))) = self.timers.peek().copied() {
            let current = self
                .handle_at(i)
                .and_then(|h| self.slot_mut(h))
                .and_then(|e| e.conn.poll_timeout());
            if current == Some(t) {
                return Some(t);
            }
            // Stale entry: the connection's deadline moved or it left.
            self.pop_timer();
            self.schedule_timer(i);
        }
        None
    }

    /// Runs the timers that expired.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Each connection runs its timers at most once per call, so a deadline a connection
        // leaves in the past cannot spin this loop.
        self.timeout_epoch = self.timeout_epoch.wrapping_add(1);
        let epoch = self.timeout_epoch;
        let mut deferred = Vec::new();
        while let Some(Reverse((t, i))) = self.timers.peek().copied() {
            if t > now {
                break;
            }
            self.pop_timer();
            let Some(h) = self.handle_at(i) else {
                continue;
            };
            let Some(e) = self.slot_mut(h) else {
                continue;
            };
            if e.timeout_epoch == epoch {
                // Already ran in this call: look again next time.
                deferred.push(i);
                continue;
            }
            match e.conn.poll_timeout() {
                Some(d) if d <= now => {
                    e.conn.handle_timeout(now);
                    e.timeout_epoch = epoch;
                    self.after_conn_op(h, now);
                }
                Some(_) => self.schedule_timer(i),
                None => {}
            }
        }
        for i in deferred {
            self.schedule_timer(i);
        }
    }
}

/// The invariant fields of a long header (RFC 8999 §5.1).
struct LongIds {
    version: u32,
    dcid_range: std::ops::Range<usize>,
    dcid_bytes: Vec<u8>,
    scid: Vec<u8>,
}

impl LongIds {
    fn dcid<'a>(&self, data: &'a [u8]) -> &'a [u8] {
        &data[self.dcid_range.clone()]
    }
}

fn long_header_ids(data: &[u8]) -> Option<LongIds> {
    let version = u32::from_be_bytes(data.get(1..5)?.try_into().ok()?);
    let dlen = usize::from(*data.get(5)?);
    let dcid_range = 6..6 + dlen;
    let dcid_bytes = data.get(dcid_range.clone())?.to_vec();
    let slen = usize::from(*data.get(6 + dlen)?);
    let scid = data.get(7 + dlen..7 + dlen + slen)?.to_vec();
    // CIDs above 20 bytes are only legal in versions we do not know.
    if Version::from_wire(version).is_some() && (dlen > MAX_CID_SIZE || slen > MAX_CID_SIZE) {
        return None;
    }
    if is_grease_version(version) {
        // Greased versions get Version Negotiation like any unknown version.
    }
    Some(LongIds {
        version,
        dcid_range,
        dcid_bytes,
        scid,
    })
}

/// A server's Initial packet closing a connection attempt statelessly with CONNECTION_CLOSE
/// (`code`, `reason`): sealed with the Initial keys of the client's `dcid`, sent to its
/// `scid` from `local`. Not ack-eliciting, so not padded (RFC 9000 §14.1).
pub(crate) fn initial_close(
    version: Version,
    dcid: &ConnectionId,
    scid: &ConnectionId,
    local: &ConnectionId,
    code: TransportErrorCode,
    reason: &'static [u8],
) -> Option<Vec<u8>> {
    let keys = crate::crypto::initial_keys(version, dcid, Side::Server);
    let mut buf = Vec::with_capacity(128);
    let pos = packet::write_long_header(&mut buf, version, LongType::Initial, scid, local, &[], 0, 1);
    Frame::Close(Close {
        error_code: code.0,
        frame_type: Some(0),
        reason: Bytes::from_static(reason),
    })
    .encode(&mut buf);
    packet::seal_packet(
        &mut buf,
        &pos,
        0,
        keys.local.header.as_ref(),
        keys.local.packet.as_ref(),
    )
    .ok()?;
    Some(buf)
}

/// One handshake fewer for `ip` (the entry goes with the last).
fn uncount_ip(counts: &mut HashMap<SocketAddr, u32>, ip: SocketAddr) {
    if let std::collections::hash_map::Entry::Occupied(mut e) = counts.entry(ip) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn addresses_are_counted_by_ipv4_address_or_ipv6_slash_64() {
        let key = |s: &str| address_key(s.parse().unwrap());
        assert_eq!(key("192.0.2.7"), key("192.0.2.7"));
        assert_ne!(key("192.0.2.7"), key("192.0.2.8"));
        assert_eq!(key("2001:db8:1:2:aaaa::1"), key("2001:db8:1:2:bbbb::2"));
        assert_eq!(key("2001:db8:1:2:aaaa::1"), key("2001:db8:1:2::"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:192.0.2.7"), key("192.0.2.7"));
    }

    use super::*;
    use std::time::Duration;

    /// Two endpoints that both lost a connection, a stray packet between them: one reset
    /// answers it and nothing answers the reset (RFC 9000 §10.3.3).
    #[test]
    fn a_stateless_reset_draws_no_other() {
        let now = Instant::now();
        let ep = |seed| Endpoint::new(Arc::new(EndpointConfig::default()), None, now, 0, Some(seed));
        let (mut a, mut b) = (ep(1), ep(2));
        let (a_addr, b_addr): (SocketAddr, SocketAddr) =
            ("10.0.0.1:443".parse().unwrap(), "10.0.0.2:5000".parse().unwrap());
        let stray = |len: usize| {
            let mut d = BytesMut::from(&vec![0x5au8; len][..]);
            d[0] = 0x41;
            d
        };
        let mut buf = Vec::new();
        let mut sent = |e: &mut Endpoint| {
            let mut out = vec![];
            while let Some(t) = e.poll_transmit(now, 1, &mut buf) {
                out.push((t.destination, BytesMut::from(&buf[..])));
            }
            out
        };
        for len in [44, 60, 1200] {
            a.handle_datagram(now, b_addr, None, None, stray(len));
            let resets = sent(&mut a);
            assert_eq!(resets.len(), 1, "a {len}-byte packet draws one reset");
            let (to, reset) = resets.into_iter().next().unwrap();
            assert_eq!(to, b_addr);
            assert!((41..=RESET_ANSWERS_ABOVE).contains(&reset.len()), "{}", reset.len());
            b.handle_datagram(now, a_addr, None, None, reset);
            assert!(sent(&mut b).is_empty(), "a reset drew another");
        }
        // Short packets draw none: a reset answering them could be answered in turn.
        a.handle_datagram(now, b_addr, None, None, stray(RESET_ANSWERS_ABOVE));
        assert!(sent(&mut a).is_empty());
        assert_eq!(a.stats().stateless_resets_sent, 3);
        assert_eq!(b.stats().stateless_resets_sent, 0);
    }

    #[test]
    fn path_hints_keep_the_newest_thousand() {
        let mut h = Hints::new();
        let hint = |ms| PathHint {
            rtt: Duration::from_millis(ms),
            loss_permille: 0,
            ..Default::default()
        };
        for i in 0..(PATH_HINTS as u64 + 10) {
            h.insert(i, hint(i));
        }
        assert_eq!(h.by_peer.len(), PATH_HINTS);
        assert_eq!(h.order.len(), PATH_HINTS);
        assert_eq!(h.get(&9), None);
        assert_eq!(h.get(&10), Some(hint(10)));
        // A peer seen again keeps its place and takes the newer hint.
        h.insert(10, hint(1));
        assert_eq!(h.get(&10), Some(hint(1)));
        assert_eq!(h.order.len(), PATH_HINTS);
    }
}
