//! Deterministic in-memory network simulator for driving sans-IO QUIC endpoints.
//!
//! Everything runs on a virtual clock: a `std::time::Instant` captured once in
//! [`Network::new`] plus a `Duration` offset. The real clock is never read again, so a run is
//! fully determined by the seed, the topology/link configuration and the nodes' behaviour.
//!
//! Model:
//! * Nodes implement [`Node`] and live at one or more `SocketAddr`s (the first is the "current"
//!   address, used as the source of everything the node sends).
//! * Every directed node pair `(from, to)` has a [`LinkConfig`] (a network-wide default, which
//!   can be overridden per pair). A datagram offered to a link goes through, in order:
//!   filter hook → blackhole → MTU → serialization queue (if `rate_bps`) → corruption →
//!   duplication → per copy: loss, delay + jitter (+ reorder delay) → delivery.
//! * Delivery resolves the destination address *at arrival time*: if no node holds it any more
//!   (e.g. after [`Network::set_address`]) the datagram is dropped as `UnknownAddress`.
//! * Events (deliveries and node timeouts) are processed one at a time in virtual-time order;
//!   deliveries at the same instant are processed in insertion order, and deliveries win ties
//!   against node timeouts. After every event every node's `transmit` is polled until `None`.
#![allow(dead_code)]

use std::any::Any;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A participant in the simulated network (typically an adapter around a QUIC endpoint).
pub trait Node {
    /// A datagram arrives at this node's address `local` from `remote`.
    fn receive(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local: SocketAddr,
        ecn: Option<u8>,
        data: &[u8],
    );
    /// The next datagram this node wants to send: (destination, ECN bits to set, payload). The
    /// source address is the node's current address. Called repeatedly until None.
    fn transmit(&mut self, now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)>;
    /// The IP the last datagram from [`Node::transmit`] asked to be sent from, if the node
    /// has several addresses (a server's preferred address); `None` means the current one.
    fn last_source_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
    /// Earliest time the node wants `timeout` called.
    fn next_timeout(&self) -> Option<Instant>;
    fn timeout(&mut self, now: Instant);
}

/// Object-safe `Node + Any`, so tests can downcast back to the concrete node type.
trait SimNode: Node + Any {
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    fn type_name(&self) -> &'static str;
}

impl<T: Node + Any> SimNode for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// Index of a node in a [`Network`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub usize);

/// ECN codepoints (the two low bits of the TOS / traffic class byte).
pub mod ecn {
    pub const NOT_ECT: u8 = 0b00;
    pub const ECT1: u8 = 0b01;
    pub const ECT0: u8 = 0b10;
    pub const CE: u8 = 0b11;
}

/// Behaviour of one direction of the path between two nodes.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Fixed one-way propagation delay.
    pub delay: Duration,
    /// Uniform random ±jitter added to `delay` (result clamped at zero). Jitter can reorder.
    pub jitter: Duration,
    /// Probability (0..=1) that a datagram is lost, i.i.d.
    pub loss: f64,
    /// Probability that a datagram gets an extra `reorder_delay`, so later ones overtake it.
    pub reorder: f64,
    /// Extra delay applied to reordered datagrams.
    pub reorder_delay: Duration,
    /// Bottleneck rate in bits per second; `None` = infinitely fast (no queue).
    pub rate_bps: Option<u64>,
    /// Drop-tail queue capacity in bytes (only with `rate_bps`). A datagram is dropped if the
    /// bytes queued ahead of it (including the one being serialized) plus its own length exceed
    /// this; a datagram arriving at an empty queue is always accepted.
    pub queue_bytes: usize,
    /// With `rate_bps`: ECN-capable datagrams (ECT(0)/ECT(1)) that find more than this many
    /// bytes queued ahead of them are marked CE instead of being dropped by the marker.
    pub ce_threshold_bytes: Option<usize>,
    /// Probability that an ECN-capable datagram is marked CE at random.
    pub ce_mark: f64,
    /// Strip ECN codepoints (deliver `Some(NOT_ECT)` instead of what was sent).
    pub ecn_bleach: bool,
    /// Probability that exactly one random bit of the datagram is flipped.
    pub corrupt: f64,
    /// Probability that the datagram is delivered twice (the copy has independent loss/delay).
    pub duplicate: f64,
    /// Largest UDP payload the link carries; larger datagrams are dropped.
    pub mtu: usize,
    /// Drop everything (checked when a datagram is sent *and* when it would be delivered, so
    /// datagrams in flight when the blackhole is switched on are lost too).
    pub blackhole: bool,
}

impl Default for LinkConfig {
    /// 10 ms delay, no impairments, no rate limit, 65535-byte MTU.
    fn default() -> Self {
        Self {
            delay: Duration::from_millis(10),
            jitter: Duration::ZERO,
            loss: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::from_millis(20),
            rate_bps: None,
            queue_bytes: 64 * 1024,
            ce_threshold_bytes: None,
            ce_mark: 0.0,
            ecn_bleach: false,
            corrupt: 0.0,
            duplicate: 0.0,
            mtu: 65535,
            blackhole: false,
        }
    }
}

impl LinkConfig {
    pub fn with_delay(delay: Duration) -> Self {
        Self {
            delay,
            ..Self::default()
        }
    }
}

/// Why a datagram was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    Loss,
    Queue,
    Mtu,
    Blackhole,
    UnknownAddress,
    /// Dropped by the hook installed with [`Network::set_filter`].
    Filter,
}

/// A datagram / byte counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub datagrams: u64,
    pub bytes: u64,
}

impl Count {
    fn add(&mut self, len: usize) {
        self.datagrams += 1;
        self.bytes += len as u64;
    }
}

impl std::ops::AddAssign for Count {
    fn add_assign(&mut self, o: Self) {
        self.datagrams += o.datagrams;
        self.bytes += o.bytes;
    }
}

/// Statistics for one directed node pair.
///
/// `offered` counts what the sender sent. Duplicated copies are not "offered" but are counted
/// in `duplicated` and, if they make it, in `delivered` (so `delivered` can exceed `offered`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairStats {
    pub offered: Count,
    pub delivered: Count,
    pub dropped_loss: Count,
    pub dropped_queue: Count,
    pub dropped_mtu: Count,
    pub dropped_blackhole: Count,
    /// Destination address no longer held by any node when the datagram arrived.
    pub dropped_unknown: Count,
    pub dropped_filter: Count,
    pub corrupted: Count,
    pub duplicated: Count,
    /// Datagrams marked CE by the link (randomly or by the queue threshold).
    pub ce_marked: Count,
}

impl PairStats {
    pub fn dropped(&self) -> Count {
        let mut c = Count::default();
        for d in [
            self.dropped_loss,
            self.dropped_queue,
            self.dropped_mtu,
            self.dropped_blackhole,
            self.dropped_unknown,
            self.dropped_filter,
        ] {
            c += d;
        }
        c
    }

    pub fn dropped_by(&self, reason: DropReason) -> Count {
        match reason {
            DropReason::Loss => self.dropped_loss,
            DropReason::Queue => self.dropped_queue,
            DropReason::Mtu => self.dropped_mtu,
            DropReason::Blackhole => self.dropped_blackhole,
            DropReason::UnknownAddress => self.dropped_unknown,
            DropReason::Filter => self.dropped_filter,
        }
    }

    fn drop_counter(&mut self, reason: DropReason) -> &mut Count {
        match reason {
            DropReason::Loss => &mut self.dropped_loss,
            DropReason::Queue => &mut self.dropped_queue,
            DropReason::Mtu => &mut self.dropped_mtu,
            DropReason::Blackhole => &mut self.dropped_blackhole,
            DropReason::UnknownAddress => &mut self.dropped_unknown,
            DropReason::Filter => &mut self.dropped_filter,
        }
    }

    fn merge(&mut self, o: &PairStats) {
        self.offered += o.offered;
        self.delivered += o.delivered;
        self.dropped_loss += o.dropped_loss;
        self.dropped_queue += o.dropped_queue;
        self.dropped_mtu += o.dropped_mtu;
        self.dropped_blackhole += o.dropped_blackhole;
        self.dropped_unknown += o.dropped_unknown;
        self.dropped_filter += o.dropped_filter;
        self.corrupted += o.corrupted;
        self.duplicated += o.duplicated;
        self.ce_marked += o.ce_marked;
    }
}

/// Per-node totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Everything the node's `transmit` returned.
    pub sent: Count,
    /// Everything handed to the node's `receive` (including injected datagrams).
    pub received: Count,
    /// Sent to an address no node held at send time (no link, so not in any [`PairStats`]).
    pub unroutable: Count,
}

/// One record of the delivery log (see [`Network::record`]). Each datagram sent, and each
/// duplicate or injected datagram, gets one entry, created when it is sent and updated when
/// it is delivered or dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Virtual time at which the datagram was sent.
    pub time: Instant,
    pub from_addr: SocketAddr,
    pub to_addr: SocketAddr,
    pub len: usize,
    pub delivered: bool,
    /// `None` for injected datagrams.
    pub from_node: Option<NodeId>,
    /// The node it was (or would have been) delivered to, if any.
    pub to_node: Option<NodeId>,
    /// Arrival time, if delivered.
    pub arrival: Option<Instant>,
    /// Why it was dropped, if it was. (`delivered == false && drop == None` → still in flight.)
    pub drop: Option<DropReason>,
    pub duplicate: bool,
    pub injected: bool,
    pub corrupted: bool,
}

/// Verdict of the filter hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    /// Passed, arriving this much later than the link would deliver it.
    Delay(Duration),
}

/// What the filter hook sees for every datagram a node sends (before the link model).
pub struct FilterCtx<'a> {
    pub now: Instant,
    pub from_node: NodeId,
    pub to_node: NodeId,
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub ecn: &'a mut Option<u8>,
    /// May be modified in place.
    pub data: &'a mut Vec<u8>,
}

type Filter = Box<dyn FnMut(FilterCtx<'_>) -> Verdict>;

struct NodeSlot {
    node: Box<dyn SimNode>,
    /// `addrs[0]` is the current (source) address; all of them receive.
    addrs: Vec<SocketAddr>,
    stats: NodeStats,
}

#[derive(Default)]
struct LinkState {
    /// Virtual time (offset) at which the serializer becomes free.
    busy_until: Duration,
    /// (departure time, len) of datagrams queued or being serialized.
    queue: VecDeque<(Duration, usize)>,
    queued_bytes: usize,
}

struct Delivery {
    from_node: Option<NodeId>,
    /// Node the datagram was routed to at send time (the link it travels on).
    via: Option<NodeId>,
    from: SocketAddr,
    to: SocketAddr,
    ecn: Option<u8>,
    data: Vec<u8>,
    log: Option<usize>,
}

struct Event {
    time: Duration,
    seq: u64,
    delivery: Delivery,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.time == o.time && self.seq == o.seq
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Reversed so that `BinaryHeap` (a max-heap) pops the earliest event first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.time, o.seq).cmp(&(self.time, self.seq))
    }
}

/// What [`Network::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepResult {
    /// A datagram was delivered to (or dropped before reaching) this node.
    Delivered(Option<NodeId>),
    /// This node's `timeout` was called.
    Timeout(NodeId),
    /// Nothing pending: no datagram in flight and no node timer.
    Idle,
}

pub struct Network {
    base: Instant,
    now: Duration,
    rng: StdRng,
    nodes: Vec<NodeSlot>,
    addr_map: HashMap<SocketAddr, NodeId>,
    default_link: LinkConfig,
    links: HashMap<(NodeId, NodeId), LinkConfig>,
    link_state: HashMap<(NodeId, NodeId), LinkState>,
    stats: BTreeMap<(NodeId, NodeId), PairStats>,
    events: BinaryHeap<Event>,
    seq: u64,
    recording: bool,
    log: Vec<LogEntry>,
    filter: Option<Filter>,
    /// Events processed since the current `run_*` call started.
    run_events: u64,
    total_events: u64,
    max_events: u64,
    /// Events processed without the virtual clock advancing.
    same_instant_events: u64,
    max_same_instant: u64,
    max_burst: u64,
}

impl fmt::Debug for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Network")
            .field("now", &self.now)
            .field("nodes", &self.nodes.len())
            .field("in_flight", &self.events.len())
            .field("total_events", &self.total_events)
            .finish()
    }
}

impl Network {
    /// A new, empty network. All randomness comes from a `StdRng` seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self::with_base(seed, Instant::now())
    }

    /// Like [`Network::new`] but with an explicit clock base (virtual time zero).
    pub fn with_base(seed: u64, base: Instant) -> Self {
        Self {
            base,
            now: Duration::ZERO,
            rng: StdRng::seed_from_u64(seed),
            nodes: Vec::new(),
            addr_map: HashMap::new(),
            default_link: LinkConfig::default(),
            links: HashMap::new(),
            link_state: HashMap::new(),
            stats: BTreeMap::new(),
            events: BinaryHeap::new(),
            seq: 0,
            recording: false,
            log: Vec::new(),
            filter: None,
            run_events: 0,
            total_events: 0,
            max_events: 5_000_000,
            same_instant_events: 0,
            max_same_instant: 100_000,
            max_burst: 1_000_000,
        }
    }

    // ----- clock -----

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        self.base + self.now
    }

    /// Virtual time zero.
    pub fn base(&self) -> Instant {
        self.base
    }

    /// Virtual time elapsed since the network was created.
    pub fn elapsed(&self) -> Duration {
        self.now
    }

    fn offset(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.base)
    }

    /// The simulator's RNG (e.g. for tests that want reproducible random choices).
    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    // ----- nodes -----

    pub fn add_node<N: Node + 'static>(&mut self, addr: SocketAddr, node: N) -> NodeId {
        let id = NodeId(self.nodes.len());
        if let Some(prev) = self.addr_map.insert(addr, id) {
            panic!("sim: address {addr} already belongs to {prev:?}");
        }
        self.nodes.push(NodeSlot {
            node: Box::new(node),
            addrs: vec![addr],
            stats: NodeStats::default(),
        });
        id
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The node, downcast to its concrete type. Panics if `T` is the wrong type.
    pub fn node<T: Node + 'static>(&self, id: NodeId) -> &T {
        let slot = &self.nodes[id.0];
        let name = slot.node.type_name();
        slot.node.as_any().downcast_ref::<T>().unwrap_or_else(|| {
            panic!(
                "sim: {id:?} is a {name}, not a {}",
                std::any::type_name::<T>()
            )
        })
    }

    /// The node, downcast to its concrete type. Panics if `T` is the wrong type.
    pub fn node_mut<T: Node + 'static>(&mut self, id: NodeId) -> &mut T {
        let slot = &mut self.nodes[id.0];
        let name = slot.node.type_name();
        slot.node
            .as_any_mut()
            .downcast_mut::<T>()
            .unwrap_or_else(|| {
                panic!(
                    "sim: {id:?} is a {name}, not a {}",
                    std::any::type_name::<T>()
                )
            })
    }

    pub fn try_node<T: Node + 'static>(&self, id: NodeId) -> Option<&T> {
        self.nodes.get(id.0)?.node.as_any().downcast_ref::<T>()
    }

    pub fn try_node_mut<T: Node + 'static>(&mut self, id: NodeId) -> Option<&mut T> {
        self.nodes
            .get_mut(id.0)?
            .node
            .as_any_mut()
            .downcast_mut::<T>()
    }

    /// The node's current (source) address.
    pub fn addr(&self, id: NodeId) -> SocketAddr {
        self.nodes[id.0].addrs[0]
    }

    /// All addresses the node receives on (the first is the current one).
    pub fn addrs(&self, id: NodeId) -> &[SocketAddr] {
        &self.nodes[id.0].addrs
    }

    /// The node currently holding `addr`.
    pub fn node_at(&self, addr: SocketAddr) -> Option<NodeId> {
        self.addr_map.get(&addr).copied()
    }

    /// Move the node to `new_addr` (NAT rebinding / migration). From now on it sends from
    /// `new_addr`; datagrams to any of its old addresses (including ones already in flight)
    /// are dropped as `UnknownAddress`.
    pub fn set_address(&mut self, id: NodeId, new_addr: SocketAddr) {
        for a in std::mem::take(&mut self.nodes[id.0].addrs) {
            self.addr_map.remove(&a);
        }
        self.claim(id, new_addr);
        self.nodes[id.0].addrs = vec![new_addr];
    }

    /// Like [`Network::set_address`], but the node keeps receiving on its old address(es).
    pub fn set_address_keep_old(&mut self, id: NodeId, new_addr: SocketAddr) {
        self.nodes[id.0].addrs.retain(|a| *a != new_addr);
        self.claim(id, new_addr);
        self.nodes[id.0].addrs.insert(0, new_addr);
    }

    /// Let the node also receive on `addr` without changing its source address.
    pub fn add_address(&mut self, id: NodeId, addr: SocketAddr) {
        if self.nodes[id.0].addrs.contains(&addr) {
            return;
        }
        self.claim(id, addr);
        self.nodes[id.0].addrs.push(addr);
    }

    /// Stop receiving on `addr` (must not be the node's only address).
    pub fn remove_address(&mut self, id: NodeId, addr: SocketAddr) {
        let addrs = &mut self.nodes[id.0].addrs;
        assert!(
            addrs.len() > 1 || addrs.first() != Some(&addr),
            "sim: cannot remove the only address of {id:?}"
        );
        addrs.retain(|a| *a != addr);
        if self.addr_map.get(&addr) == Some(&id) {
            self.addr_map.remove(&addr);
        }
    }

    fn claim(&mut self, id: NodeId, addr: SocketAddr) {
        if let Some(&prev) = self.addr_map.get(&addr) {
            assert!(
                prev == id,
                "sim: address {addr} already belongs to {prev:?}"
            );
        }
        self.addr_map.insert(addr, id);
    }

    // ----- links -----

    /// Set the configuration used by every pair without an override.
    pub fn set_default_link(&mut self, cfg: LinkConfig) {
        self.default_link = cfg;
    }

    pub fn default_link_mut(&mut self) -> &mut LinkConfig {
        &mut self.default_link
    }

    /// Override the configuration of the directed link `from → to`.
    pub fn set_link(&mut self, from: NodeId, to: NodeId, cfg: LinkConfig) {
        self.links.insert((from, to), cfg);
    }

    /// Override both directions between `a` and `b`.
    pub fn set_link_both(&mut self, a: NodeId, b: NodeId, cfg: LinkConfig) {
        self.links.insert((a, b), cfg.clone());
        self.links.insert((b, a), cfg);
    }

    /// Remove the override for `from → to` (back to the default).
    pub fn clear_link(&mut self, from: NodeId, to: NodeId) {
        self.links.remove(&(from, to));
    }

    /// The effective configuration of `from → to`.
    pub fn link(&self, from: NodeId, to: NodeId) -> &LinkConfig {
        self.links.get(&(from, to)).unwrap_or(&self.default_link)
    }

    /// Mutable access to the override of `from → to`, created from the current default if
    /// there is none (e.g. `net.link_mut(a, b).blackhole = true`).
    pub fn link_mut(&mut self, from: NodeId, to: NodeId) -> &mut LinkConfig {
        let default = &self.default_link;
        self.links
            .entry((from, to))
            .or_insert_with(|| default.clone())
    }

    /// Apply `f` to both directions between `a` and `b` (creating overrides as needed).
    pub fn modify_link_both(&mut self, a: NodeId, b: NodeId, mut f: impl FnMut(&mut LinkConfig)) {
        f(self.link_mut(a, b));
        f(self.link_mut(b, a));
    }

    /// Install a hook that sees (and may modify or drop) every datagram a node sends, before
    /// the link model. Not called for unroutable or injected datagrams.
    pub fn set_filter(&mut self, f: impl FnMut(FilterCtx<'_>) -> Verdict + 'static) {
        self.filter = Some(Box::new(f));
    }

    pub fn clear_filter(&mut self) {
        self.filter = None;
    }

    // ----- statistics & log -----

    /// Statistics of the directed pair `from → to`.
    pub fn stats(&self, from: NodeId, to: NodeId) -> PairStats {
        self.stats.get(&(from, to)).copied().unwrap_or_default()
    }

    /// All pairs with statistics, in (from, to) order.
    pub fn all_stats(&self) -> impl Iterator<Item = ((NodeId, NodeId), &PairStats)> {
        self.stats.iter().map(|(k, v)| (*k, v))
    }

    /// Sum over all pairs.
    pub fn total_stats(&self) -> PairStats {
        let mut t = PairStats::default();
        for s in self.stats.values() {
            t.merge(s);
        }
        t
    }

    pub fn node_stats(&self, id: NodeId) -> NodeStats {
        self.nodes[id.0].stats
    }

    /// Start (true) or stop (false) recording the delivery log. Stopping keeps what was
    /// recorded; use [`Network::clear_log`] to discard it.
    pub fn record(&mut self, on: bool) {
        self.recording = on;
    }

    pub fn log(&self) -> &[LogEntry] {
        &self.log
    }

    pub fn clear_log(&mut self) {
        self.log.clear();
    }

    /// Total number of events (deliveries + timeouts) processed so far.
    pub fn events_processed(&self) -> u64 {
        self.total_events
    }

    /// Datagrams currently in flight.
    pub fn in_flight(&self) -> usize {
        self.events.len()
    }

    /// Maximum events in a single `run_*` call before panicking (livelock guard).
    pub fn set_max_events(&mut self, n: u64) {
        self.max_events = n;
    }

    /// Maximum consecutive events without the virtual clock advancing before panicking.
    pub fn set_max_same_instant(&mut self, n: u64) {
        self.max_same_instant = n;
    }

    /// Maximum datagrams one node may emit in one `transmit` poll loop before panicking.
    pub fn set_max_burst(&mut self, n: u64) {
        self.max_burst = n;
    }

    // ----- sending -----

    /// Inject a raw datagram that bypasses the link model (spoofing, attackers, replays). It
    /// is delivered after `delay` to whichever node holds `to` at that time. Counted in the
    /// receiving node's [`NodeStats::received`] and the log, not in any [`PairStats`].
    pub fn inject(
        &mut self,
        from: SocketAddr,
        to: SocketAddr,
        ecn: Option<u8>,
        data: Vec<u8>,
        delay: Duration,
    ) {
        let log = self.log_push(LogEntry {
            time: self.now(),
            from_addr: from,
            to_addr: to,
            len: data.len(),
            delivered: false,
            from_node: None,
            to_node: self.node_at(to),
            arrival: None,
            drop: None,
            duplicate: false,
            injected: true,
            corrupted: false,
        });
        let time = self.now + delay;
        self.schedule(
            time,
            Delivery {
                from_node: None,
                via: None,
                from,
                to,
                ecn,
                data,
                log,
            },
        );
    }

    fn log_push(&mut self, e: LogEntry) -> Option<usize> {
        if self.recording {
            self.log.push(e);
            Some(self.log.len() - 1)
        } else {
            None
        }
    }

    fn log_drop(&mut self, log: Option<usize>, reason: DropReason) {
        if let Some(i) = log {
            self.log[i].drop = Some(reason);
        }
    }

    fn schedule(&mut self, time: Duration, delivery: Delivery) {
        let seq = self.seq;
        self.seq += 1;
        self.events.push(Event {
            time,
            seq,
            delivery,
        });
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (p >= 1.0 || self.rng.random::<f64>() < p)
    }

    /// Poll every node's `transmit` until `None`, routing each datagram through its link.
    pub fn flush(&mut self) {
        let now = self.now();
        for i in 0..self.nodes.len() {
            let mut burst = 0u64;
            while let Some((to, ecn, data)) = self.nodes[i].node.transmit(now) {
                burst += 1;
                if burst > self.max_burst {
                    panic!(
                        "sim livelock: {:?} ({}) emitted more than {} datagrams in one \
                         transmit loop at t={:?}",
                        NodeId(i),
                        self.nodes[i].node.type_name(),
                        self.max_burst,
                        self.now
                    );
                }
                let src_ip = self.nodes[i].node.last_source_ip();
                self.send(NodeId(i), src_ip, to, ecn, data);
            }
        }
    }

    fn send(
        &mut self,
        from_node: NodeId,
        src_ip: Option<std::net::IpAddr>,
        to: SocketAddr,
        mut ecn: Option<u8>,
        mut data: Vec<u8>,
    ) {
        let from = src_ip
            .and_then(|ip| {
                self.nodes[from_node.0]
                    .addrs
                    .iter()
                    .copied()
                    .find(|a| a.ip() == ip)
            })
            .unwrap_or_else(|| self.addr(from_node));
        let len = data.len();
        self.nodes[from_node.0].stats.sent.add(len);
        let Some(to_node) = self.node_at(to) else {
            self.nodes[from_node.0].stats.unroutable.add(len);
            let log = self.log_entry(from_node, None, from, to, len, false);
            self.log_drop(log, DropReason::UnknownAddress);
            return;
        };
        let pair = (from_node, to_node);
        self.stats.entry(pair).or_default().offered.add(len);

        let mut extra_delay = Duration::ZERO;
        if let Some(filter) = self.filter.as_mut() {
            let verdict = filter(FilterCtx {
                now: self.base + self.now,
                from_node,
                to_node,
                from,
                to,
                ecn: &mut ecn,
                data: &mut data,
            });
            match verdict {
                Verdict::Drop => {
                    self.drop_at_send(pair, from, to, len, DropReason::Filter);
                    return;
                }
                Verdict::Delay(d) => extra_delay = d,
                Verdict::Pass => {}
            }
        }
        let len = data.len();

        let cfg = self.link(from_node, to_node).clone();
        if cfg.blackhole {
            self.drop_at_send(pair, from, to, len, DropReason::Blackhole);
            return;
        }
        if len > cfg.mtu {
            self.drop_at_send(pair, from, to, len, DropReason::Mtu);
            return;
        }

        // Serialization queue.
        let mut depart = self.now;
        if let Some(rate) = cfg.rate_bps {
            let now = self.now;
            let st = self.link_state.entry(pair).or_default();
            while let Some(&(t, l)) = st.queue.front() {
                if t > now {
                    break;
                }
                st.queue.pop_front();
                st.queued_bytes -= l;
            }
            let ahead = st.queued_bytes;
            if ahead > 0 && ahead + len > cfg.queue_bytes {
                self.drop_at_send(pair, from, to, len, DropReason::Queue);
                return;
            }
            let ser = ser_time(len, rate);
            depart = st.busy_until.max(now) + ser;
            st.busy_until = depart;
            st.queue.push_back((depart, len));
            st.queued_bytes += len;
            if let (Some(th), Some(e)) = (cfg.ce_threshold_bytes, ecn)
                && ahead > th
                && (e == ecn::ECT0 || e == ecn::ECT1)
            {
                ecn = Some(ecn::CE);
                self.stats.entry(pair).or_default().ce_marked.add(len);
            }
        }
        if let Some(e) = ecn
            && (e == ecn::ECT0 || e == ecn::ECT1)
            && self.chance(cfg.ce_mark)
        {
            ecn = Some(ecn::CE);
            self.stats.entry(pair).or_default().ce_marked.add(len);
        }
        if cfg.ecn_bleach && ecn.is_some() {
            ecn = Some(ecn::NOT_ECT);
        }

        let mut corrupted = false;
        if len > 0 && self.chance(cfg.corrupt) {
            let byte = self.rng.random_range(0..len);
            let bit = self.rng.random_range(0..8u32);
            data[byte] ^= 1 << bit;
            corrupted = true;
            self.stats.entry(pair).or_default().corrupted.add(len);
        }

        let copies = if self.chance(cfg.duplicate) {
            self.stats.entry(pair).or_default().duplicated.add(len);
            2
        } else {
            1
        };
        let mut data = Some(data);
        for copy in 0..copies {
            let dup = copy > 0;
            let payload = if copy + 1 == copies {
                data.take().unwrap()
            } else {
                data.clone().unwrap()
            };
            let log = self.log_entry(from_node, Some(to_node), from, to, len, dup);
            if let Some(i) = log {
                self.log[i].corrupted = corrupted;
            }
            if self.chance(cfg.loss) {
                self.stats.entry(pair).or_default().dropped_loss.add(len);
                self.log_drop(log, DropReason::Loss);
                continue;
            }
            let mut delay = cfg.delay;
            if !cfg.jitter.is_zero() {
                let j = cfg.jitter.as_nanos().min(i64::MAX as u128) as i64;
                let d = self.rng.random_range(-j..=j);
                delay = if d >= 0 {
                    delay + Duration::from_nanos(d as u64)
                } else {
                    delay.saturating_sub(Duration::from_nanos(d.unsigned_abs()))
                };
            }
            if self.chance(cfg.reorder) {
                delay += cfg.reorder_delay;
            }
            delay += extra_delay;
            self.schedule(
                depart + delay,
                Delivery {
                    from_node: Some(from_node),
                    via: Some(to_node),
                    from,
                    to,
                    ecn,
                    data: payload,
                    log,
                },
            );
        }
    }

    fn log_entry(
        &mut self,
        from_node: NodeId,
        to_node: Option<NodeId>,
        from: SocketAddr,
        to: SocketAddr,
        len: usize,
        duplicate: bool,
    ) -> Option<usize> {
        if !self.recording {
            return None;
        }
        self.log_push(LogEntry {
            time: self.now(),
            from_addr: from,
            to_addr: to,
            len,
            delivered: false,
            from_node: Some(from_node),
            to_node,
            arrival: None,
            drop: None,
            duplicate,
            injected: false,
            corrupted: false,
        })
    }

    fn drop_at_send(
        &mut self,
        pair: (NodeId, NodeId),
        from: SocketAddr,
        to: SocketAddr,
        len: usize,
        reason: DropReason,
    ) {
        self.stats
            .entry(pair)
            .or_default()
            .drop_counter(reason)
            .add(len);
        let log = self.log_entry(pair.0, Some(pair.1), from, to, len, false);
        self.log_drop(log, reason);
    }

    // ----- running -----

    /// Virtual time of the next event (delivery or node timeout), if any.
    pub fn next_event_time(&self) -> Option<Instant> {
        self.next_event().map(|(t, _)| self.base + t)
    }

    /// (time, Some(node) for a timeout / None for a delivery).
    fn next_event(&self) -> Option<(Duration, Option<NodeId>)> {
        let delivery = self.events.peek().map(|e| e.time);
        let mut timer: Option<(Duration, NodeId)> = None;
        for (i, slot) in self.nodes.iter().enumerate() {
            if let Some(t) = slot.node.next_timeout() {
                let t = self.offset(t).max(self.now);
                if timer.is_none_or(|(best, _)| t < best) {
                    timer = Some((t, NodeId(i)));
                }
            }
        }
        match (delivery, timer) {
            (None, None) => None,
            (Some(d), None) => Some((d, None)),
            (None, Some((t, n))) => Some((t, Some(n))),
            (Some(d), Some((t, n))) => {
                if d <= t {
                    Some((d, None))
                } else {
                    Some((t, Some(n)))
                }
            }
        }
    }

    /// Flush pending transmissions, advance the clock to the next event, process it, and
    /// flush again.
    pub fn step(&mut self) -> StepResult {
        self.flush();
        let Some((time, which)) = self.next_event() else {
            return StepResult::Idle;
        };
        let r = self.process(time, which);
        self.flush();
        r
    }

    fn process(&mut self, time: Duration, which: Option<NodeId>) -> StepResult {
        debug_assert!(time >= self.now);
        if time > self.now {
            self.now = time;
            self.same_instant_events = 0;
        }
        self.same_instant_events += 1;
        self.run_events += 1;
        self.total_events += 1;
        if self.same_instant_events > self.max_same_instant {
            panic!(
                "sim livelock: more than {} consecutive events without virtual time advancing \
                 (t={:?}; last event: {})",
                self.max_same_instant,
                self.now,
                match which {
                    Some(n) => format!("timeout of {n:?} ({})", self.nodes[n.0].node.type_name()),
                    None => "delivery".into(),
                }
            );
        }
        if self.run_events > self.max_events {
            panic!(
                "sim livelock: more than {} events in one run (t={:?}); raise the cap with \
                 set_max_events if this is expected",
                self.max_events, self.now
            );
        }
        let now = self.now();
        match which {
            Some(n) => {
                self.nodes[n.0].node.timeout(now);
                StepResult::Timeout(n)
            }
            None => {
                let ev = self.events.pop().expect("delivery event");
                let d = ev.delivery;
                let len = d.data.len();
                let target = self.node_at(d.to);
                let pair = d.from_node.zip(d.via);
                let blackholed = d
                    .from_node
                    .zip(d.via)
                    .is_some_and(|(f, t)| self.link(f, t).blackhole);
                let reason = if blackholed {
                    Some(DropReason::Blackhole)
                } else if target.is_none() {
                    Some(DropReason::UnknownAddress)
                } else {
                    None
                };
                if let Some(reason) = reason {
                    if let Some(pair) = pair {
                        self.stats
                            .entry(pair)
                            .or_default()
                            .drop_counter(reason)
                            .add(len);
                    }
                    self.log_drop(d.log, reason);
                    return StepResult::Delivered(None);
                }
                let target = target.unwrap();
                if let Some(pair) = pair {
                    self.stats.entry(pair).or_default().delivered.add(len);
                }
                if let Some(i) = d.log {
                    let e = &mut self.log[i];
                    e.delivered = true;
                    e.arrival = Some(now);
                    e.to_node = Some(target);
                }
                let slot = &mut self.nodes[target.0];
                slot.stats.received.add(len);
                slot.node.receive(now, d.from, d.to, d.ecn, &d.data);
                StepResult::Delivered(Some(target))
            }
        }
    }

    /// Process every event up to and including `deadline`, then set the clock to `deadline`
    /// (if it is in the future).
    pub fn run_until(&mut self, deadline: Instant) {
        let deadline = self.offset(deadline);
        self.run_events = 0;
        loop {
            self.flush();
            match self.next_event() {
                Some((t, which)) if t <= deadline => {
                    self.process(t, which);
                }
                _ => break,
            }
        }
        if deadline > self.now {
            self.now = deadline;
            self.same_instant_events = 0;
        }
        self.flush();
    }

    /// `run_until(now + d)`.
    pub fn run_for(&mut self, d: Duration) {
        self.run_until(self.now() + d);
    }

    /// Run until nothing is pending (no datagram in flight, no node timer) or `max` virtual
    /// time has passed. Returns true if the network became idle. The clock is left at the
    /// last event when idle, or at `now + max` otherwise.
    pub fn run_until_idle(&mut self, max: Duration) -> bool {
        let deadline = self.now + max;
        self.run_events = 0;
        loop {
            self.flush();
            match self.next_event() {
                None => return true,
                Some((t, which)) if t <= deadline => {
                    self.process(t, which);
                }
                Some(_) => {
                    self.now = deadline;
                    self.same_instant_events = 0;
                    self.flush();
                    return false;
                }
            }
        }
    }

    /// True if no datagram is in flight and no node has a timer.
    pub fn is_idle(&self) -> bool {
        self.next_event().is_none()
    }

    /// Run while `cond` holds, for at most `limit` of virtual time. `cond` is checked before
    /// the first event and after every event. Returns true if `cond` became false, false if
    /// the time limit was reached (clock then at `now + limit`) or the network went idle with
    /// `cond` still true.
    pub fn run_while(
        &mut self,
        mut cond: impl FnMut(&mut Network) -> bool,
        limit: Duration,
    ) -> bool {
        let deadline = self.now + limit;
        self.run_events = 0;
        loop {
            self.flush();
            if !cond(self) {
                return true;
            }
            match self.next_event() {
                Some((t, which)) if t <= deadline => {
                    self.process(t, which);
                }
                None => return false,
                Some(_) => {
                    self.now = deadline;
                    self.same_instant_events = 0;
                    self.flush();
                    return !cond(self);
                }
            }
        }
    }
}

/// Serialization time of `len` bytes at `rate` bits per second (rounded up to the nanosecond).
pub fn ser_time(len: usize, rate_bps: u64) -> Duration {
    assert!(rate_bps > 0, "sim: rate_bps must be > 0");
    let bits = len as u128 * 8;
    let nanos = (bits * 1_000_000_000).div_ceil(rate_bps as u128);
    Duration::from_nanos(nanos.min(u64::MAX as u128) as u64)
}
