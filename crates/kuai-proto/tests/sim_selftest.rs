//! Self-tests of the in-memory network simulator (`tests/common/sim.rs`) using toy nodes.

mod common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::sim::*;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A datagram as seen by a receiving toy node.
#[derive(Clone, Debug, PartialEq)]
struct Rx {
    at: Instant,
    remote: SocketAddr,
    local: SocketAddr,
    ecn: Option<u8>,
    data: Vec<u8>,
}

impl Rx {
    fn seq(&self) -> u32 {
        seq_of(&self.data)
    }
}

fn seq_of(data: &[u8]) -> u32 {
    u32::from_be_bytes(data[..4].try_into().unwrap())
}

/// Deterministic payload: 4-byte big-endian sequence number followed by a pattern.
fn payload(seq: u32, size: usize) -> Vec<u8> {
    let size = size.max(4);
    let mut v = Vec::with_capacity(size);
    v.extend_from_slice(&seq.to_be_bytes());
    v.extend((4..size).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seq) as u8));
    v
}

/// Sends `total` numbered datagrams to `dest`: `burst` of them immediately and then `burst`
/// more every `interval` (all at once if `interval` is None). Records everything it receives.
struct Sender {
    dest: SocketAddr,
    size: usize,
    ecn: Option<u8>,
    total: u32,
    sent: u32,
    burst: u32,
    pending: u32,
    interval: Option<Duration>,
    next: Option<Instant>,
    rx: Vec<Rx>,
}

impl Sender {
    fn new(dest: SocketAddr, total: u32, size: usize) -> Self {
        Self {
            dest,
            size,
            ecn: None,
            total,
            sent: 0,
            burst: total,
            pending: total,
            interval: None,
            next: None,
            rx: Vec::new(),
        }
    }

    fn paced(
        dest: SocketAddr,
        total: u32,
        size: usize,
        burst: u32,
        interval: Duration,
        start: Instant,
    ) -> Self {
        Self {
            burst,
            pending: burst.min(total),
            interval: Some(interval),
            next: Some(start + interval),
            ..Self::new(dest, total, size)
        }
    }
}

impl Node for Sender {
    fn receive(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local: SocketAddr,
        ecn: Option<u8>,
        data: &[u8],
    ) {
        self.rx.push(Rx {
            at: now,
            remote,
            local,
            ecn,
            data: data.to_vec(),
        });
    }

    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        if self.pending == 0 || self.sent >= self.total {
            return None;
        }
        self.pending -= 1;
        let p = payload(self.sent, self.size);
        self.sent += 1;
        Some((self.dest, self.ecn, p))
    }

    fn next_timeout(&self) -> Option<Instant> {
        if self.sent >= self.total {
            None
        } else {
            self.next
        }
    }

    fn timeout(&mut self, now: Instant) {
        self.pending += self.burst;
        self.next = Some(now + self.interval.unwrap());
    }
}

/// Records everything; optionally echoes each datagram back to its sender.
#[derive(Default)]
struct Sink {
    echo: bool,
    rx: Vec<Rx>,
    out: VecDeque<(SocketAddr, Option<u8>, Vec<u8>)>,
}

impl Sink {
    fn echo() -> Self {
        Self {
            echo: true,
            ..Self::default()
        }
    }
    fn seqs(&self) -> Vec<u32> {
        self.rx.iter().map(Rx::seq).collect()
    }
}

impl Node for Sink {
    fn receive(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local: SocketAddr,
        ecn: Option<u8>,
        data: &[u8],
    ) {
        self.rx.push(Rx {
            at: now,
            remote,
            local,
            ecn,
            data: data.to_vec(),
        });
        if self.echo {
            self.out.push_back((remote, ecn, data.to_vec()));
        }
    }
    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        self.out.pop_front()
    }
    fn next_timeout(&self) -> Option<Instant> {
        None
    }
    fn timeout(&mut self, _now: Instant) {}
}

/// Fires at a fixed list of deadlines, then optionally once more `follow_up` after the last.
struct TimerNode {
    deadlines: Vec<Instant>,
    follow_up: Option<Duration>,
    fired: Vec<Instant>,
}

impl Node for TimerNode {
    fn receive(&mut self, _: Instant, _: SocketAddr, _: SocketAddr, _: Option<u8>, _: &[u8]) {}
    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        None
    }
    fn next_timeout(&self) -> Option<Instant> {
        self.deadlines.iter().min().copied()
    }
    fn timeout(&mut self, now: Instant) {
        self.fired.push(now);
        self.deadlines.retain(|d| *d > now);
        // Once all deadlines are done, schedule one follow-up.
        if self.deadlines.is_empty()
            && let Some(f) = self.follow_up.take()
        {
            self.deadlines.push(now + f);
        }
    }
}

/// Never clears its (past) timer: a classic livelock.
struct StuckTimer(Instant);

impl Node for StuckTimer {
    fn receive(&mut self, _: Instant, _: SocketAddr, _: SocketAddr, _: Option<u8>, _: &[u8]) {}
    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        None
    }
    fn next_timeout(&self) -> Option<Instant> {
        Some(self.0)
    }
    fn timeout(&mut self, _now: Instant) {}
}

/// Always has something to send.
struct Firehose(SocketAddr);

impl Node for Firehose {
    fn receive(&mut self, _: Instant, _: SocketAddr, _: SocketAddr, _: Option<u8>, _: &[u8]) {}
    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        Some((self.0, None, vec![0; 10]))
    }
    fn next_timeout(&self) -> Option<Instant> {
        None
    }
    fn timeout(&mut self, _now: Instant) {}
}

const A: &str = "10.0.0.1:1000";
const B: &str = "10.0.0.2:2000";

/// Sender at A → Sink at B with the given default link.
fn pair(
    seed: u64,
    cfg: LinkConfig,
    sender: impl FnOnce(Instant) -> Sender,
    echo: bool,
) -> (Network, NodeId, NodeId) {
    let mut net = Network::new(seed);
    net.set_default_link(cfg);
    let s = net.add_node(addr(A), sender(net.now()));
    let r = net.add_node(addr(B), if echo { Sink::echo() } else { Sink::default() });
    (net, s, r)
}

#[test]
fn delay_is_exact_without_jitter() {
    let (mut net, s, r) = pair(
        1,
        LinkConfig::with_delay(ms(10)),
        |_| Sender::new(addr(B), 5, 100),
        true,
    );
    net.set_link(r, s, LinkConfig::with_delay(ms(25)));
    let t0 = net.now();
    assert!(net.run_until_idle(Duration::from_secs(1)));
    let sink = net.node::<Sink>(r);
    assert_eq!(sink.seqs(), vec![0, 1, 2, 3, 4]);
    for rx in &sink.rx {
        assert_eq!(rx.at, t0 + ms(10));
        assert_eq!(rx.remote, addr(A));
        assert_eq!(rx.local, addr(B));
    }
    let sender = net.node::<Sender>(s);
    assert_eq!(sender.rx.len(), 5);
    for rx in &sender.rx {
        assert_eq!(rx.at, t0 + ms(35), "asymmetric per-pair delay");
        assert_eq!(rx.remote, addr(B));
    }
    assert_eq!(net.now(), t0 + ms(35));
    let st = net.stats(s, r);
    assert_eq!(
        st.offered,
        Count {
            datagrams: 5,
            bytes: 500
        }
    );
    assert_eq!(st.delivered, st.offered);
    assert_eq!(st.dropped().datagrams, 0);
    assert_eq!(net.stats(r, s).delivered.datagrams, 5);
    assert_eq!(net.node_stats(s).sent.datagrams, 5);
    assert_eq!(net.node_stats(s).received.datagrams, 5);
}

#[test]
fn jitter_stays_within_bounds_and_varies() {
    let cfg = LinkConfig {
        delay: ms(20),
        jitter: ms(5),
        ..LinkConfig::default()
    };
    let (mut net, _s, r) = pair(2, cfg, |_| Sender::new(addr(B), 1000, 50), false);
    let t0 = net.now();
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    assert_eq!(sink.rx.len(), 1000);
    let delays: Vec<Duration> = sink.rx.iter().map(|rx| rx.at - t0).collect();
    assert!(delays.iter().all(|d| *d >= ms(15) && *d <= ms(25)));
    let min = *delays.iter().min().unwrap();
    let max = *delays.iter().max().unwrap();
    assert!(min < ms(16) && max > ms(24), "min {min:?} max {max:?}");
    // Jitter larger than the delay is clamped at zero.
    let cfg = LinkConfig {
        delay: ms(1),
        jitter: ms(10),
        ..LinkConfig::default()
    };
    let (mut net, _s, r) = pair(3, cfg, |_| Sender::new(addr(B), 200, 50), false);
    let t0 = net.now();
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    assert_eq!(sink.rx.len(), 200);
    assert!(sink.rx.iter().any(|rx| rx.at == t0));
    assert!(sink.rx.iter().all(|rx| rx.at <= t0 + ms(11)));
}

#[test]
fn loss_rate_within_tolerance() {
    let cfg = LinkConfig {
        loss: 0.1,
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(4, cfg, |_| Sender::new(addr(B), 10_000, 20), false);
    net.run_until_idle(Duration::from_secs(1));
    let st = net.stats(s, r);
    assert_eq!(st.offered.datagrams, 10_000);
    assert_eq!(st.delivered.datagrams + st.dropped_loss.datagrams, 10_000);
    assert_eq!(st.dropped().datagrams, st.dropped_loss.datagrams);
    let rate = st.dropped_loss.datagrams as f64 / 10_000.0;
    // σ = 0.003; allow 5σ.
    assert!((rate - 0.1).abs() < 0.015, "loss rate {rate}");
    assert_eq!(net.node::<Sink>(r).rx.len() as u64, st.delivered.datagrams);
}

#[test]
fn reordering_only_with_reorder_probability() {
    let in_order = |seqs: &[u32]| seqs.windows(2).all(|w| w[0] < w[1]);
    // No reordering configured: arrival order equals send order, even across many datagrams.
    let (mut net, _s, r) = pair(
        5,
        LinkConfig::default(),
        |t| Sender::paced(addr(B), 500, 100, 3, MS, t),
        false,
    );
    net.run_until_idle(Duration::from_secs(5));
    let seqs = net.node::<Sink>(r).seqs();
    assert_eq!(seqs.len(), 500);
    assert!(in_order(&seqs));

    let cfg = LinkConfig {
        reorder: 0.1,
        reorder_delay: ms(7),
        ..LinkConfig::default()
    };
    let (mut net, _s, r) = pair(
        5,
        cfg,
        |t| Sender::paced(addr(B), 500, 100, 3, MS, t),
        false,
    );
    let t0 = net.now();
    net.run_until_idle(Duration::from_secs(5));
    let sink = net.node::<Sink>(r);
    let seqs = sink.seqs();
    assert_eq!(seqs.len(), 500, "reordering does not lose anything");
    assert!(!in_order(&seqs));
    // Reordered datagrams arrive exactly reorder_delay late.
    let late = sink
        .rx
        .iter()
        .filter(|rx| {
            let sent = t0 + MS * (rx.seq() / 3);
            let d = rx.at - sent;
            assert!(d == ms(10) || d == ms(17), "delay {d:?}");
            d == ms(17)
        })
        .count();
    assert!((20..=80).contains(&late), "{late} reordered of 500");
}

#[test]
fn rate_limit_throughput_and_queue_drops() {
    // 10 Mbit/s bottleneck, 1250-byte datagrams = 1 ms serialization each. The sender offers
    // 2 datagrams per ms (20 Mbit/s) for one second.
    let run = |queue_bytes: usize| {
        let cfg = LinkConfig {
            delay: ms(10),
            rate_bps: Some(10_000_000),
            queue_bytes,
            ..LinkConfig::default()
        };
        let (mut net, s, r) = pair(
            6,
            cfg,
            |t| Sender::paced(addr(B), 2000, 1250, 2, MS, t),
            false,
        );
        let t0 = net.now();
        net.run_until_idle(Duration::from_secs(10));
        let st = net.stats(s, r);
        let sink = net.node::<Sink>(r);
        // Bytes that arrived during the first second of arrivals (after the first one).
        let first = sink.rx[0].at;
        assert_eq!(first, t0 + ms(11), "serialization + propagation");
        let bytes: usize = sink
            .rx
            .iter()
            .filter(|rx| rx.at > first && rx.at <= first + Duration::from_secs(1))
            .map(|rx| rx.data.len())
            .sum();
        let bps = bytes as f64 * 8.0;
        // Back-to-back arrivals are spaced exactly by the serialization time.
        let spacing_ok = sink
            .rx
            .windows(2)
            .take(500)
            .all(|w| w[1].at - w[0].at == MS);
        (st, bps, spacing_ok, sink.rx.len())
    };

    // Big queue: nothing dropped, link saturated.
    let (st, bps, spacing_ok, n) = run(10_000_000);
    assert_eq!(st.dropped_queue.datagrams, 0);
    assert_eq!(n, 2000);
    assert!((bps - 10e6).abs() / 10e6 < 0.02, "throughput {bps}");
    assert!(spacing_ok);

    // Small queue (4 datagrams): about half is dropped, throughput still matches the rate.
    let (st, bps, spacing_ok, n) = run(5000);
    assert!(st.dropped_queue.datagrams > 900, "{st:?}");
    assert_eq!(st.delivered.datagrams + st.dropped_queue.datagrams, 2000);
    assert_eq!(n as u64, st.delivered.datagrams);
    assert!((bps - 10e6).abs() / 10e6 < 0.02, "throughput {bps}");
    assert!(spacing_ok);
    assert_eq!(ser_time(1250, 10_000_000), MS);
}

#[test]
fn corruption_flips_exactly_one_bit() {
    let cfg = LinkConfig {
        corrupt: 1.0,
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(7, cfg, |_| Sender::new(addr(B), 300, 64), false);
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    assert_eq!(sink.rx.len(), 300);
    let mut positions = std::collections::HashSet::new();
    for (i, rx) in sink.rx.iter().enumerate() {
        let orig = payload(i as u32, 64);
        assert_eq!(rx.data.len(), orig.len());
        let flipped: u32 = rx
            .data
            .iter()
            .zip(&orig)
            .map(|(a, b)| (a ^ b).count_ones())
            .sum();
        assert_eq!(flipped, 1, "datagram {i}");
        let pos = rx.data.iter().zip(&orig).position(|(a, b)| a != b).unwrap();
        positions.insert(pos);
    }
    assert!(positions.len() > 30, "flips spread over the datagram");
    assert_eq!(net.stats(s, r).corrupted.datagrams, 300);

    // Partial corruption: the counter matches what the receiver sees.
    let cfg = LinkConfig {
        corrupt: 0.25,
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(8, cfg, |_| Sender::new(addr(B), 2000, 64), false);
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    let bad = sink
        .rx
        .iter()
        .enumerate()
        .filter(|(i, rx)| rx.data != payload(*i as u32, 64))
        .count() as u64;
    assert_eq!(bad, net.stats(s, r).corrupted.datagrams);
    assert!((400..=600).contains(&bad), "{bad}");
}

#[test]
fn duplication() {
    let cfg = LinkConfig {
        duplicate: 1.0,
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(9, cfg, |_| Sender::new(addr(B), 100, 30), false);
    net.run_until_idle(Duration::from_secs(1));
    let mut seqs = net.node::<Sink>(r).seqs();
    assert_eq!(seqs.len(), 200);
    seqs.sort();
    assert!(
        seqs.chunks(2)
            .enumerate()
            .all(|(i, c)| c == [i as u32, i as u32])
    );
    let st = net.stats(s, r);
    assert_eq!(st.duplicated.datagrams, 100);
    assert_eq!(st.delivered.datagrams, 200);
    assert_eq!(st.offered.datagrams, 100);

    let cfg = LinkConfig {
        duplicate: 0.2,
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(10, cfg, |_| Sender::new(addr(B), 5000, 30), false);
    net.run_until_idle(Duration::from_secs(1));
    let st = net.stats(s, r);
    assert_eq!(st.delivered.datagrams, 5000 + st.duplicated.datagrams);
    assert!((850..=1150).contains(&st.duplicated.datagrams), "{st:?}");
    assert_eq!(net.node::<Sink>(r).rx.len() as u64, st.delivered.datagrams);
}

/// Sends one datagram of each given size.
struct SizedSender {
    dest: SocketAddr,
    sizes: VecDeque<usize>,
}

impl Node for SizedSender {
    fn receive(&mut self, _: Instant, _: SocketAddr, _: SocketAddr, _: Option<u8>, _: &[u8]) {}
    fn transmit(&mut self, _now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        let n = self.sizes.pop_front()?;
        Some((self.dest, None, vec![0xab; n]))
    }
    fn next_timeout(&self) -> Option<Instant> {
        None
    }
    fn timeout(&mut self, _now: Instant) {}
}

#[test]
fn mtu_drop() {
    let mut net = Network::new(11);
    net.default_link_mut().mtu = 1200;
    let s = net.add_node(
        addr(A),
        SizedSender {
            dest: addr(B),
            sizes: [1100, 1200, 1201, 1500, 1199].into(),
        },
    );
    let r = net.add_node(addr(B), Sink::default());
    net.run_until_idle(Duration::from_secs(1));
    let lens: Vec<usize> = net
        .node::<Sink>(r)
        .rx
        .iter()
        .map(|rx| rx.data.len())
        .collect();
    assert_eq!(lens, vec![1100, 1200, 1199]);
    let st = net.stats(s, r);
    assert_eq!(
        st.dropped_mtu,
        Count {
            datagrams: 2,
            bytes: 2701
        }
    );
    assert_eq!(st.dropped_by(DropReason::Mtu).datagrams, 2);
}

#[test]
fn blackhole_on_and_off() {
    // One datagram every 10 ms, delay 10 ms. Blackhole during [100 ms, 200 ms).
    let (mut net, s, r) = pair(
        12,
        LinkConfig::default(),
        |t| Sender::paced(addr(B), 40, 10, 1, ms(10), t),
        false,
    );
    let t0 = net.now();
    net.record(true);
    net.run_until(t0 + ms(100));
    net.link_mut(s, r).blackhole = true;
    net.run_until(t0 + ms(200));
    assert_eq!(net.now(), t0 + ms(200));
    net.link_mut(s, r).blackhole = false;
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    assert!(
        sink.rx
            .iter()
            .all(|rx| rx.at <= t0 + ms(100) || rx.at > t0 + ms(200))
    );
    let seqs = sink.seqs();
    // Sent at 0..=90 ms arrive by 100 ms; sent at 100..=190 ms (in flight or sent during the
    // blackhole) are lost; sent at 200 ms (while still blackholed) is lost too.
    let expected: Vec<u32> = (0..10).chain(21..40).collect();
    assert_eq!(seqs, expected);
    let st = net.stats(s, r);
    assert_eq!(st.dropped_blackhole.datagrams, 11);
    assert_eq!(st.delivered.datagrams, 29);
    // The log agrees.
    let dropped: Vec<u32> = net
        .log()
        .iter()
        .enumerate()
        .filter(|(_, e)| e.drop == Some(DropReason::Blackhole))
        .map(|(i, _)| i as u32)
        .collect();
    assert_eq!(dropped, (10..21).collect::<Vec<_>>());
    // The reverse direction is unaffected by the override.
    assert!(!net.link(r, s).blackhole);
}

#[test]
fn address_change_redirects() {
    let a2 = addr("10.0.0.9:4444");
    // Client sends one datagram every 10 ms to an echo server; 10 ms one-way delay.
    let run = |keep_old: bool| {
        let (mut net, c, srv) = pair(
            13,
            LinkConfig::default(),
            |t| Sender::paced(addr(B), 10, 10, 1, ms(10), t),
            true,
        );
        let t0 = net.now();
        net.run_until(t0 + ms(55));
        if keep_old {
            net.set_address_keep_old(c, a2);
        } else {
            net.set_address(c, a2);
        }
        assert_eq!(net.addr(c), a2);
        assert_eq!(net.node_at(a2), Some(c));
        assert_eq!(net.node_at(addr(A)), if keep_old { Some(c) } else { None });
        net.run_until_idle(Duration::from_secs(1));
        (net, c, srv, t0)
    };

    let (net, c, srv, _) = run(false);
    let server = net.node::<Sink>(srv);
    // Sent at 0..=50 ms from A, 60..=90 ms from a2.
    let remotes: Vec<SocketAddr> = server.rx.iter().map(|rx| rx.remote).collect();
    assert_eq!(remotes.len(), 10);
    assert!(remotes[..6].iter().all(|r| *r == addr(A)));
    assert!(remotes[6..].iter().all(|r| *r == a2));
    // Echoes to A: of seq 0..=5, those echoed at 10..=40 ms arrive by 50 ms; the echo of seq 4
    // (sent 50 ms, arrives 60 ms) and seq 5 (sent at 60 ms to A) are dropped.
    let client = net.node::<Sender>(c);
    let got: Vec<u32> = client.rx.iter().map(Rx::seq).collect();
    assert_eq!(got, vec![0, 1, 2, 3, 6, 7, 8, 9]);
    assert!(client.rx[..4].iter().all(|rx| rx.local == addr(A)));
    assert!(client.rx[4..].iter().all(|rx| rx.local == a2));
    let st = net.stats(srv, c);
    assert_eq!(st.dropped_unknown.datagrams, 1, "in flight at the change");
    assert_eq!(
        net.node_stats(srv).unroutable.datagrams,
        1,
        "sent after the change"
    );

    // Keeping the old address: everything arrives, on the address it was sent to.
    let (net, c, _srv, _) = run(true);
    let client = net.node::<Sender>(c);
    let got: Vec<(u32, SocketAddr)> = client.rx.iter().map(|rx| (rx.seq(), rx.local)).collect();
    assert_eq!(got.len(), 10);
    assert!(
        got.iter()
            .all(|(s, l)| *l == if *s <= 5 { addr(A) } else { a2 })
    );
}

/// Scenario with every random impairment enabled; returns the log with times as offsets.
fn random_scenario(
    seed: u64,
) -> Vec<(
    Duration,
    SocketAddr,
    SocketAddr,
    usize,
    bool,
    Option<Duration>,
)> {
    let cfg = LinkConfig {
        delay: ms(15),
        jitter: ms(4),
        loss: 0.05,
        reorder: 0.05,
        corrupt: 0.05,
        duplicate: 0.05,
        rate_bps: Some(50_000_000),
        queue_bytes: 20_000,
        ..LinkConfig::default()
    };
    let (mut net, _, _) = pair(
        seed,
        cfg,
        |t| Sender::paced(addr(B), 3000, 1000, 10, MS, t),
        true,
    );
    net.record(true);
    net.run_until_idle(Duration::from_secs(10));
    let base = net.base();
    net.log()
        .iter()
        .map(|e| {
            (
                e.time - base,
                e.from_addr,
                e.to_addr,
                e.len,
                e.delivered,
                e.arrival.map(|a| a - base),
            )
        })
        .collect()
}

#[test]
fn determinism() {
    let a = random_scenario(42);
    let b = random_scenario(42);
    let c = random_scenario(43);
    assert!(a.len() > 5000);
    assert!(a.iter().any(|e| !e.4));
    assert_eq!(a, b, "same seed, same log");
    assert_ne!(a, c, "different seed, different log");
}

#[test]
fn timer_node_fires_at_virtual_deadlines() {
    let mut net = Network::new(14);
    let t0 = net.now();
    let n = net.add_node(
        addr(A),
        TimerNode {
            deadlines: vec![
                t0 + ms(5),
                t0 + ms(17),
                t0 + ms(17),
                t0 + Duration::from_micros(17_001),
            ],
            follow_up: Some(ms(100)),
            fired: Vec::new(),
        },
    );
    // A timer in the past fires "now".
    let m = net.add_node(
        addr(B),
        TimerNode {
            deadlines: vec![t0],
            follow_up: None,
            fired: Vec::new(),
        },
    );
    assert_eq!(net.step(), StepResult::Timeout(m));
    assert_eq!(net.now(), t0);
    assert_eq!(net.next_event_time(), Some(t0 + ms(5)));
    assert_eq!(net.step(), StepResult::Timeout(n));
    assert_eq!(net.now(), t0 + ms(5));
    net.run_until(t0 + ms(50));
    assert_eq!(net.now(), t0 + ms(50));
    assert_eq!(
        net.node::<TimerNode>(n).fired,
        vec![t0 + ms(5), t0 + ms(17), t0 + Duration::from_micros(17_001)]
    );
    assert!(net.run_until_idle(Duration::from_secs(10)));
    assert_eq!(
        net.node::<TimerNode>(n).fired,
        vec![
            t0 + ms(5),
            t0 + ms(17),
            t0 + Duration::from_micros(17_001),
            t0 + Duration::from_micros(117_001)
        ]
    );
    assert_eq!(net.node::<TimerNode>(m).fired, vec![t0]);
    // Idle: the clock stays at the last event.
    assert_eq!(net.now(), t0 + Duration::from_micros(117_001));
    assert_eq!(net.step(), StepResult::Idle);
    assert!(net.try_node::<Sink>(n).is_none());
}

#[test]
fn run_while_stops_on_condition_or_limit() {
    let (mut net, _s, r) = pair(
        15,
        LinkConfig::default(),
        |t| Sender::paced(addr(B), 100, 10, 1, ms(10), t),
        false,
    );
    let t0 = net.now();
    assert!(net.run_while(
        |net| net.node::<Sink>(r).rx.len() < 5,
        Duration::from_secs(10)
    ));
    assert_eq!(net.node::<Sink>(r).rx.len(), 5);
    assert_eq!(net.now(), t0 + ms(50));
    // Limit reached with the condition still true.
    assert!(!net.run_while(|_| true, ms(33)));
    assert_eq!(net.now(), t0 + ms(83));
    assert_eq!(net.node::<Sink>(r).rx.len(), 8);
    net.run_for(ms(17));
    assert_eq!(net.now(), t0 + ms(100));
    assert_eq!(net.node::<Sink>(r).rx.len(), 10);
}

#[test]
fn filter_inject_and_ecn() {
    let (mut net, s, r) = pair(
        16,
        LinkConfig::default(),
        |_| Sender::new(addr(B), 10, 20),
        false,
    );
    net.node_mut::<Sender>(s).ecn = Some(ecn::ECT0);
    net.link_mut(s, r).ce_mark = 0.5;
    net.set_filter(|ctx| {
        if seq_of(ctx.data) == 3 {
            return Verdict::Drop;
        }
        if seq_of(ctx.data) == 4 {
            ctx.data.truncate(4);
        }
        Verdict::Pass
    });
    net.inject(addr("192.0.2.1:9"), addr(B), None, payload(99, 8), ms(1));
    let t0 = net.now();
    net.run_until_idle(Duration::from_secs(1));
    let sink = net.node::<Sink>(r);
    assert_eq!(sink.seqs(), vec![99, 0, 1, 2, 4, 5, 6, 7, 8, 9]);
    assert_eq!(sink.rx[0].at, t0 + ms(1));
    assert_eq!(sink.rx[0].remote, addr("192.0.2.1:9"));
    assert_eq!(sink.rx[4].data.len(), 4);
    let st = net.stats(s, r);
    assert_eq!(st.dropped_filter.datagrams, 1);
    let ce = sink.rx.iter().filter(|rx| rx.ecn == Some(ecn::CE)).count() as u64;
    assert_eq!(ce, st.ce_marked.datagrams);
    assert!(ce > 0 && ce < 9);
    assert!(
        sink.rx[1..]
            .iter()
            .all(|rx| rx.ecn == Some(ecn::CE) || rx.ecn == Some(ecn::ECT0))
    );
    assert_eq!(net.node_stats(r).received.datagrams, 10);

    // Queue-threshold CE marking and bleaching.
    let cfg = LinkConfig {
        rate_bps: Some(8_000_000),
        queue_bytes: 1_000_000,
        ce_threshold_bytes: Some(5000),
        ..LinkConfig::default()
    };
    let (mut net, s, r) = pair(17, cfg, |_| Sender::new(addr(B), 20, 1000), false);
    net.node_mut::<Sender>(s).ecn = Some(ecn::ECT1);
    net.run_until_idle(Duration::from_secs(1));
    let e: Vec<Option<u8>> = net.node::<Sink>(r).rx.iter().map(|rx| rx.ecn).collect();
    // Datagrams 0..=5 find ≤ 5000 bytes ahead; the rest are marked.
    assert!(e[..6].iter().all(|x| *x == Some(ecn::ECT1)));
    assert!(e[6..].iter().all(|x| *x == Some(ecn::CE)));
    let (mut net, s, r) = pair(
        18,
        LinkConfig {
            ecn_bleach: true,
            ..LinkConfig::default()
        },
        |_| Sender::new(addr(B), 3, 10),
        false,
    );
    net.node_mut::<Sender>(s).ecn = Some(ecn::ECT0);
    net.run_until_idle(Duration::from_secs(1));
    assert!(
        net.node::<Sink>(r)
            .rx
            .iter()
            .all(|rx| rx.ecn == Some(ecn::NOT_ECT))
    );
}

#[test]
fn unknown_address_is_counted() {
    let mut net = Network::new(19);
    net.record(true);
    let s = net.add_node(addr(A), Sender::new(addr("10.9.9.9:1"), 3, 10));
    net.run_until_idle(Duration::from_secs(1));
    assert_eq!(
        net.node_stats(s).unroutable,
        Count {
            datagrams: 3,
            bytes: 30
        }
    );
    assert_eq!(net.total_stats(), PairStats::default());
    assert!(
        net.log()
            .iter()
            .all(|e| !e.delivered && e.drop == Some(DropReason::UnknownAddress))
    );
}

#[test]
#[should_panic(expected = "without virtual time advancing")]
fn livelock_same_instant_panics() {
    let mut net = Network::new(20);
    let t = net.now();
    net.add_node(addr(A), StuckTimer(t));
    net.run_for(Duration::from_secs(1));
}

#[test]
#[should_panic(expected = "more than 1000 events in one run")]
fn livelock_event_cap_panics() {
    // Two echo nodes ping-pong forever; time advances, but the run never ends.
    let mut net = Network::new(21);
    let a = net.add_node(addr(A), Sink::echo());
    net.add_node(addr(B), Sink::echo());
    net.set_max_events(1000);
    net.inject(net.addr(a), addr(B), None, vec![1, 2, 3, 4], Duration::ZERO);
    net.run_for(Duration::from_secs(3600));
}

#[test]
#[should_panic(expected = "emitted more than")]
fn livelock_burst_cap_panics() {
    let mut net = Network::new(22);
    net.set_max_burst(10_000);
    net.add_node(addr(A), Firehose(addr(B)));
    net.add_node(addr(B), Sink::default());
    net.step();
}
