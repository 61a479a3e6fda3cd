//! The impairment model of one direction of the link: pure and deterministic.
//!
//! [`Impairment::offer`] takes a packet's arrival time and size and says when the packet
//! leaves the link, or why it is dropped; [`Pipe`] wraps it with the packets themselves and
//! hands them back in release order. Nothing here reads a clock or touches a device: time is
//! an input, and every random choice comes from generators seeded by the caller, so the same
//! seed, configuration and arrivals always give the same output.
//!
//! A packet goes through the stages of a real bottleneck link, in this order:
//!
//! 1. the **bottleneck** (a rate limit in bit/s, or a Mahimahi delivery trace) with a finite
//!    drop-tail queue: a packet that finds the queue full is dropped; otherwise it leaves the
//!    bottleneck once the packets ahead of it and its own bytes are through;
//! 2. the **blackhole** schedule: a packet that leaves the bottleneck while the link is down is
//!    lost (the queue still drains, into the void);
//! 3. **random loss** and **Gilbert-Elliott burst loss**, independent of each other;
//! 4. **delay** plus **jitter** (uniform within ±jitter, never below zero extra delay); a
//!    packet is never released before the one in front of it, so jitter does not reorder
//!    (which also means that packets closer together than the jitter's span are released
//!    close to `delay + jitter`, the latest of their draws: the spread shows between
//!    sparse packets, bunched ones share the largest delay, as behind a FIFO that a netem
//!    with a rate gives);
//! 5. **reordering**: a share of packets is held back an extra delay and does not hold up the
//!    packets behind it, which overtake it.
//!
//! With [`LinkConfig::netem`] stages 4 and 5 follow Linux netem without a rate instead
//! (`delay D J reorder P`): each packet gets its own `delay ± jitter` and leaves at that
//! time whatever the packets around it do (jitter reorders), and the reordered share is
//! sent without the delay at all, ahead of the packets before it (tc's `gap` of 1).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::stats::{DirectionStats, DropReason, Short};
use crate::trace::{Trace, TraceCursor};

/// Gilbert-Elliott burst loss: a two-state Markov chain advanced once per packet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GilbertElliott {
    /// Probability of moving from the good to the bad state.
    pub p: f64,
    /// Probability of moving from the bad to the good state (the mean bad run is `1/r`).
    pub r: f64,
    /// Loss probability in the bad state (`1 - h`).
    pub loss_bad: f64,
    /// Loss probability in the good state (`1 - k`).
    pub loss_good: f64,
}

impl GilbertElliott {
    /// The long-run loss rate.
    pub fn mean_loss(&self) -> f64 {
        let bad = if self.p + self.r > 0.0 {
            self.p / (self.p + self.r)
        } else {
            0.0
        };
        bad * self.loss_bad + (1.0 - bad) * self.loss_good
    }
}

/// The size of the bottleneck's drop-tail queue, counting the packets waiting and the one
/// being sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// At most this many packets.
    Packets(usize),
    /// At most this many bytes.
    Bytes(usize),
}

/// An on/off schedule from the start of the link: up for `up`, then down (every packet
/// dropped) for `down`, and again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blackhole {
    /// How long the link works in each cycle.
    pub up: Duration,
    /// How long it drops everything in each cycle.
    pub down: Duration,
}

impl Blackhole {
    /// Whether the link is down `since_start` after the start.
    pub fn is_down(&self, since_start: Duration) -> bool {
        let period = (self.up + self.down).as_nanos();
        since_start.as_nanos() % period >= self.up.as_nanos()
    }
}

/// The impairments of one direction.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// One-way propagation delay.
    pub delay: Duration,
    /// Uniform jitter around the delay: each packet gets `delay ± jitter` (at least zero).
    pub jitter: Duration,
    /// Random loss probability.
    pub loss: f64,
    /// Burst loss, on top of (and independent of) `loss`.
    pub gilbert: Option<GilbertElliott>,
    /// Share of packets held back by `reorder_delay` so that later packets overtake them.
    pub reorder: f64,
    /// The extra delay of a reordered packet.
    pub reorder_delay: Duration,
    /// Bottleneck rate in bits per second (IP packet bytes; no link-layer overhead).
    pub rate: Option<u64>,
    /// A delivery trace as the bottleneck instead of a fixed rate.
    pub trace: Option<Arc<Trace>>,
    /// The bottleneck's queue; only used with `rate` or `trace`.
    pub queue: QueueLimit,
    /// The outage schedule.
    pub blackhole: Option<Blackhole>,
    /// Drop every UDP packet (IPv4 or IPv6), like a network that blocks UDP; TCP and
    /// everything else pass. Applied by the forwarder before the model sees the packet.
    pub block_udp: bool,
    /// Jitter and reordering as Linux netem without a rate (see the [module](self) docs):
    /// jitter reorders, and a reordered packet skips the delay (`reorder_delay` unused).
    pub netem: bool,
}

/// The reorder hold-back when none is given.
pub const DEFAULT_REORDER_DELAY: Duration = Duration::from_millis(10);
/// The queue when none is given (netem's default limit).
pub const DEFAULT_QUEUE: QueueLimit = QueueLimit::Packets(1000);

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            gilbert: None,
            reorder: 0.0,
            reorder_delay: DEFAULT_REORDER_DELAY,
            rate: None,
            trace: None,
            queue: DEFAULT_QUEUE,
            blackhole: None,
            block_udp: false,
            netem: false,
        }
    }
}

/// Whether an IP packet (as read from a TUN device) carries UDP.
pub fn is_udp(packet: &[u8]) -> bool {
    match packet.first().map(|b| b >> 4) {
        Some(4) => packet.get(9) == Some(&17),
        // The first next-header only: extension headers before UDP are rare enough here.
        Some(6) => packet.get(6) == Some(&17),
        _ => false,
    }
}

impl LinkConfig {
    /// Checks the configuration for contradictions and out-of-range values.
    pub fn validate(&self) -> Result<(), String> {
        let share = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("{name} must be within 0 and 1, not {v}"))
            }
        };
        share("loss", self.loss)?;
        share("reorder", self.reorder)?;
        if let Some(g) = &self.gilbert {
            share("Gilbert-Elliott p", g.p)?;
            share("Gilbert-Elliott r", g.r)?;
            share("Gilbert-Elliott loss_bad", g.loss_bad)?;
            share("Gilbert-Elliott loss_good", g.loss_good)?;
            if g.r == 0.0 {
                return Err("Gilbert-Elliott r must be above 0".into());
            }
        }
        if self.rate.is_some() && self.trace.is_some() {
            return Err("a direction takes a rate or a trace, not both".into());
        }
        if self.rate == Some(0) {
            return Err("the rate must be above 0".into());
        }
        if let Some(b) = &self.blackhole
            && (b.up.is_zero() || b.down.is_zero())
        {
            return Err("blackhole periods must be above zero".into());
        }
        Ok(())
    }

    /// Whether packets go through untouched.
    pub fn is_transparent(&self) -> bool {
        self.delay.is_zero()
            && self.jitter.is_zero()
            && self.loss == 0.0
            && self.gilbert.is_none()
            && self.reorder == 0.0
            && self.rate.is_none()
            && self.trace.is_none()
            && self.blackhole.is_none()
            && !self.block_udp
    }
}

fn pct(v: f64) -> String {
    let s = format!("{:.3}", v * 100.0);
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}%")
}

/// A one-line summary, such as `delay 20.0ms ±5.00ms, loss 5%, rate 10 Mbit/s, queue 25 packets`.
impl fmt::Display for LinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_transparent() {
            return write!(f, "no impairment");
        }
        let mut parts = Vec::new();
        if !self.delay.is_zero() || !self.jitter.is_zero() {
            let mut s = format!("delay {}", Short(self.delay));
            if !self.jitter.is_zero() {
                s += &format!(" ±{}", Short(self.jitter));
            }
            parts.push(s);
        }
        if self.loss > 0.0 {
            parts.push(format!("loss {}", pct(self.loss)));
        }
        if let Some(g) = &self.gilbert {
            parts.push(format!(
                "burst loss (p {}, r {}, bad {}, good {}: mean {}, bursts of {:.1})",
                pct(g.p),
                pct(g.r),
                pct(g.loss_bad),
                pct(g.loss_good),
                pct(g.mean_loss()),
                1.0 / g.r
            ));
        }
        if self.reorder > 0.0 && self.netem {
            parts.push(format!("reorder {} sent at once", pct(self.reorder)));
        } else if self.reorder > 0.0 {
            parts.push(format!(
                "reorder {} held {}",
                pct(self.reorder),
                Short(self.reorder_delay)
            ));
        }
        if self.netem && !self.jitter.is_zero() {
            parts.push("jitter reorders (netem)".into());
        }
        if let Some(rate) = self.rate {
            parts.push(format!("rate {}", Rate(rate as f64)));
        }
        if let Some(t) = &self.trace {
            parts.push(format!(
                "trace of {} opportunities per {} (mean {})",
                t.len(),
                Short(t.period()),
                Rate(t.mean_rate_bps())
            ));
        }
        if self.rate.is_some() || self.trace.is_some() {
            parts.push(match self.queue {
                QueueLimit::Packets(n) => format!("queue {n} packets"),
                QueueLimit::Bytes(n) => format!("queue {n} bytes"),
            });
        }
        if let Some(b) = &self.blackhole {
            parts.push(format!(
                "blackhole: up {} / down {}",
                Short(b.up),
                Short(b.down)
            ));
        }
        write!(f, "{}", parts.join(", "))
    }
}

/// A rate printed in kbit/s, Mbit/s or Gbit/s.
pub struct Rate(pub f64);

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        if v >= 1e9 {
            write!(f, "{:.3} Gbit/s", v / 1e9)
        } else if v >= 1e6 {
            write!(f, "{:.3} Mbit/s", v / 1e6)
        } else {
            write!(f, "{:.1} kbit/s", v / 1e3)
        }
    }
}

/// What the model decided for a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The packet leaves the link at `at`; `reordered` if it was held back to be overtaken.
    Deliver {
        /// When the packet comes out of the link.
        at: Instant,
        /// Whether the packet was chosen for reordering.
        reordered: bool,
    },
    /// The packet is dropped.
    Drop(DropReason),
}

/// A seed for one independent stream, derived from the user's seed (SplitMix64).
pub fn sub_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The model of one direction.
#[derive(Debug)]
pub struct Impairment {
    cfg: LinkConfig,
    start: Instant,
    // One generator per random process, so that turning one impairment on or off does not
    // change the choices of another.
    loss_rng: StdRng,
    burst_rng: StdRng,
    jitter_rng: StdRng,
    reorder_rng: StdRng,
    bad: bool,
    /// Departure times and sizes of the packets in the bottleneck.
    queue: VecDeque<(Instant, usize)>,
    queued_bytes: usize,
    busy_until: Instant,
    cursor: TraceCursor,
    last_release: Instant,
    stats: DirectionStats,
}

impl Impairment {
    /// A model starting at `start` (the origin of the blackhole schedule and of the trace).
    /// The configuration must be valid ([`LinkConfig::validate`]).
    pub fn new(cfg: LinkConfig, seed: u64, start: Instant) -> Impairment {
        debug_assert!(cfg.validate().is_ok(), "{:?}", cfg.validate());
        let rng = |stream| StdRng::seed_from_u64(sub_seed(seed, stream));
        Impairment {
            cfg,
            start,
            loss_rng: rng(1),
            burst_rng: rng(2),
            jitter_rng: rng(3),
            reorder_rng: rng(4),
            bad: false,
            queue: VecDeque::new(),
            queued_bytes: 0,
            busy_until: start,
            cursor: TraceCursor::new(),
            last_release: start,
            stats: DirectionStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    /// What happened so far.
    pub fn stats(&self) -> &DirectionStats {
        &self.stats
    }

    /// Decides the fate of a packet of `len` bytes arriving at `now`. Arrivals must come in
    /// time order (an earlier `now` than the previous one is treated as equal to it).
    pub fn offer(&mut self, now: Instant, len: usize) -> Verdict {
        self.stats.packets_in += 1;
        self.stats.bytes_in += len as u64;
        let now = now.max(self.start);
        match self.decide(now, len) {
            Ok((at, reordered)) => {
                self.stats.delivered += 1;
                self.stats.bytes_delivered += len as u64;
                self.stats.reordered += u64::from(reordered);
                self.stats.delay.record(at - now);
                Verdict::Deliver { at, reordered }
            }
            Err(reason) => {
                self.stats.count_drop(reason);
                Verdict::Drop(reason)
            }
        }
    }

    fn decide(&mut self, now: Instant, len: usize) -> Result<(Instant, bool), DropReason> {
        // 1. The bottleneck and its queue.
        let departure = if self.cfg.rate.is_some() || self.cfg.trace.is_some() {
            while let Some(&(left, size)) = self.queue.front() {
                if left > now {
                    break;
                }
                self.queue.pop_front();
                self.queued_bytes -= size;
            }
            let full = match self.cfg.queue {
                QueueLimit::Packets(n) => self.queue.len() >= n,
                QueueLimit::Bytes(n) => self.queued_bytes + len > n,
            };
            if full {
                return Err(DropReason::Queue);
            }
            let head = now.max(self.busy_until);
            let departure = match (&self.cfg.rate, &self.cfg.trace) {
                (Some(rate), _) => {
                    let ns = (len as u128 * 8 * 1_000_000_000) / u128::from(*rate);
                    head + Duration::from_nanos(ns as u64)
                }
                (None, Some(trace)) => self.start + self.cursor.send(trace, head - self.start, len),
                (None, None) => unreachable!(),
            };
            self.busy_until = departure;
            self.queue.push_back((departure, len));
            self.queued_bytes += len;
            departure
        } else {
            now
        };

        // 2. Outages.
        if let Some(b) = &self.cfg.blackhole
            && b.is_down(departure - self.start)
        {
            return Err(DropReason::Blackhole);
        }

        // 3. Losses: both processes advance on every packet that reaches them.
        let lost = self.cfg.loss > 0.0 && self.loss_rng.random::<f64>() < self.cfg.loss;
        let burst_lost = match &self.cfg.gilbert {
            Some(g) => {
                let p = if self.bad { g.loss_bad } else { g.loss_good };
                let lost = p > 0.0 && self.burst_rng.random::<f64>() < p;
                let flip = if self.bad { g.r } else { g.p };
                if flip > 0.0 && self.burst_rng.random::<f64>() < flip {
                    self.bad = !self.bad;
                }
                lost
            }
            None => false,
        };
        if lost {
            return Err(DropReason::Loss);
        }
        if burst_lost {
            return Err(DropReason::BurstLoss);
        }

        // 4. Delay and jitter (netem: a reordered packet skips both; tc sets gap 1 when a
        // reorder share is given, so each packet is reordered with that probability).
        if self.cfg.netem
            && self.cfg.reorder > 0.0
            && self.reorder_rng.random::<f64>() < self.cfg.reorder
        {
            return Ok((departure, true));
        }
        let mut at = departure + self.cfg.delay;
        if !self.cfg.jitter.is_zero() {
            let j = self.cfg.jitter.as_nanos().min(i64::MAX as u128) as i64;
            let offset = self.jitter_rng.random_range(-j..=j);
            let magnitude = Duration::from_nanos(offset.unsigned_abs());
            at = if offset >= 0 {
                at + magnitude
            } else {
                at.checked_sub(magnitude)
                    .unwrap_or(departure)
                    .max(departure)
            };
        }

        // 5. Reordering, or first-in first-out (netem: neither, each packet leaves at its
        // own time).
        if self.cfg.netem {
            return Ok((at, false));
        }
        let reordered =
            self.cfg.reorder > 0.0 && self.reorder_rng.random::<f64>() < self.cfg.reorder;
        if reordered {
            at += self.cfg.reorder_delay;
        } else {
            at = at.max(self.last_release);
            self.last_release = at;
        }
        Ok((at, reordered))
    }

    fn note_overflow(&mut self, len: usize) {
        self.stats.packets_in += 1;
        self.stats.bytes_in += len as u64;
        self.stats.count_drop(DropReason::Overflow);
    }
}

struct Held<P> {
    at: Instant,
    seq: u64,
    packet: P,
}

impl<P> PartialEq for Held<P> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<P> Eq for Held<P> {}
impl<P> PartialOrd for Held<P> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<P> Ord for Held<P> {
    // Reversed: the heap's top is the earliest release, ties in arrival order.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// A direction of the link with its packets: packets in with their arrival time, packets out
/// at their release time.
pub struct Pipe<P> {
    model: Impairment,
    held: BinaryHeap<Held<P>>,
    seq: u64,
    limit: usize,
}

/// How many packets a [`Pipe`] holds at most by default (a safety limit on memory: 200k
/// packets of 1500 bytes are 300 MB).
pub const DEFAULT_PIPE_LIMIT: usize = 200_000;

impl<P> Pipe<P> {
    /// A pipe over `model` holding at most `limit` packets in flight.
    pub fn new(model: Impairment, limit: usize) -> Pipe<P> {
        Pipe {
            model,
            held: BinaryHeap::new(),
            seq: 0,
            limit: limit.max(1),
        }
    }

    /// Offers a packet of `len` bytes arriving at `now`. On a drop the packet comes back with
    /// the reason, so its buffer can be reused.
    pub fn push(
        &mut self,
        now: Instant,
        len: usize,
        packet: P,
    ) -> Result<Instant, (DropReason, P)> {
        if self.held.len() >= self.limit {
            self.model.note_overflow(len);
            return Err((DropReason::Overflow, packet));
        }
        match self.model.offer(now, len) {
            Verdict::Deliver { at, .. } => {
                self.seq += 1;
                self.held.push(Held {
                    at,
                    seq: self.seq,
                    packet,
                });
                Ok(at)
            }
            Verdict::Drop(reason) => Err((reason, packet)),
        }
    }

    /// When the next packet is due, if any is held.
    pub fn next_release(&self) -> Option<Instant> {
        self.held.peek().map(|h| h.at)
    }

    /// The next packet due at or before `now`, with its scheduled release time.
    pub fn pop_due(&mut self, now: Instant) -> Option<(P, Instant)> {
        if self.held.peek()?.at > now {
            return None;
        }
        self.held.pop().map(|h| (h.packet, h.at))
    }

    /// Packets held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no packet is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The model's statistics.
    pub fn stats(&self) -> &DirectionStats {
        self.model.stats()
    }

    /// The model.
    pub fn model(&self) -> &Impairment {
        &self.model
    }
}

#[cfg(test)]
mod udp_tests {
    use super::is_udp;

    #[test]
    fn tells_udp_from_tcp_in_both_ip_versions() {
        let mut v4 = [0u8; 28];
        v4[0] = 0x45;
        v4[9] = 17;
        assert!(is_udp(&v4));
        v4[9] = 6;
        assert!(!is_udp(&v4));
        let mut v6 = [0u8; 48];
        v6[0] = 0x60;
        v6[6] = 17;
        assert!(is_udp(&v6));
        v6[6] = 6;
        assert!(!is_udp(&v6));
        assert!(!is_udp(&[]));
        assert!(!is_udp(&[0x45]));
    }
}
