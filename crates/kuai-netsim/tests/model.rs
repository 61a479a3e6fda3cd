//! Unit and property tests of the impairment model: no clock, no devices, no root.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kuai_netsim::{
    Blackhole, DropReason, GilbertElliott, Impairment, LinkConfig, Pipe, QueueLimit, Trace, Verdict,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn us(v: u64) -> Duration {
    Duration::from_micros(v)
}

/// Offers `n` packets of `len` bytes, one every `gap`, and returns the verdicts with their
/// arrival times.
fn run(
    cfg: LinkConfig,
    seed: u64,
    n: usize,
    gap: Duration,
    len: usize,
) -> (Instant, Vec<(Instant, Verdict)>, Impairment) {
    let t0 = Instant::now();
    let mut m = Impairment::new(cfg, seed, t0);
    let out = (0..n)
        .map(|i| {
            let t = t0 + gap * i as u32;
            (t, m.offer(t, len))
        })
        .collect();
    (t0, out, m)
}

fn delivered(v: &[(Instant, Verdict)]) -> Vec<(Instant, Instant, bool)> {
    v.iter()
        .filter_map(|&(t, v)| match v {
            Verdict::Deliver { at, reordered } => Some((t, at, reordered)),
            Verdict::Drop(_) => None,
        })
        .collect()
}

fn drops(v: &[(Instant, Verdict)], reason: DropReason) -> usize {
    v.iter()
        .filter(|(_, v)| *v == Verdict::Drop(reason))
        .count()
}

#[test]
fn no_impairment_is_transparent() {
    let (_, out, m) = run(LinkConfig::default(), 1, 1000, us(10), 1200);
    for (t, at, reordered) in delivered(&out) {
        assert_eq!(t, at);
        assert!(!reordered);
    }
    assert_eq!(m.stats().delivered, 1000);
    assert_eq!(m.stats().dropped(), 0);
}

#[test]
fn fixed_delay() {
    let cfg = LinkConfig {
        delay: ms(20),
        ..Default::default()
    };
    let (_, out, _) = run(cfg, 1, 1000, us(100), 100);
    for (t, at, _) in delivered(&out) {
        assert_eq!(at - t, ms(20));
    }
}

#[test]
fn random_loss_rate_within_tolerance() {
    for (seed, loss) in [(1, 0.05), (2, 0.15), (3, 0.30), (4, 0.01)] {
        let cfg = LinkConfig {
            loss,
            ..Default::default()
        };
        let n = 100_000;
        let (_, out, m) = run(cfg, seed, n, us(50), 1200);
        let observed = drops(&out, DropReason::Loss) as f64 / n as f64;
        let sigma = (loss * (1.0 - loss) / n as f64).sqrt();
        assert!(
            (observed - loss).abs() < 5.0 * sigma,
            "loss {loss}: observed {observed}"
        );
        assert_eq!(
            m.stats().dropped_loss as usize,
            drops(&out, DropReason::Loss)
        );
    }
}

/// Property: for any seed and loss share, the loss rate is within 5 sigma, and drops and
/// deliveries add up.
#[test]
fn property_loss_and_accounting() {
    let mut rng = StdRng::seed_from_u64(99);
    for _ in 0..40 {
        let loss = rng.random_range(0.0..0.6);
        let seed = rng.random();
        let n = 20_000;
        let cfg = LinkConfig {
            loss,
            delay: ms(rng.random_range(0..50)),
            ..Default::default()
        };
        let (_, out, m) = run(cfg, seed, n, us(100), 1000);
        let lost = drops(&out, DropReason::Loss);
        let sigma = (loss * (1.0 - loss) / n as f64).sqrt().max(1e-4);
        assert!(
            (lost as f64 / n as f64 - loss).abs() < 5.0 * sigma,
            "seed {seed} loss {loss}: {lost}"
        );
        let s = m.stats();
        assert_eq!(s.packets_in, n as u64);
        assert_eq!(s.delivered + s.dropped(), s.packets_in);
        assert_eq!(s.delay.count(), s.delivered);
    }
}

#[test]
fn gilbert_elliott_burst_length_and_rate() {
    // Good to bad 1 %, bad to good 25 %: bursts of 4 on average, 1/26 of packets lost.
    let g = GilbertElliott {
        p: 0.01,
        r: 0.25,
        loss_bad: 1.0,
        loss_good: 0.0,
    };
    let cfg = LinkConfig {
        gilbert: Some(g),
        ..Default::default()
    };
    let n = 400_000;
    let (_, out, _) = run(cfg, 7, n, us(10), 1200);
    let lost: Vec<bool> = out
        .iter()
        .map(|(_, v)| *v == Verdict::Drop(DropReason::BurstLoss))
        .collect();
    let total = lost.iter().filter(|&&l| l).count();
    let mut bursts = 0;
    let mut prev = false;
    for &l in &lost {
        if l && !prev {
            bursts += 1;
        }
        prev = l;
    }
    let mean_burst = total as f64 / bursts as f64;
    assert!((mean_burst - 4.0).abs() < 0.25, "mean burst {mean_burst}");
    let rate = total as f64 / n as f64;
    assert!(
        (rate - g.mean_loss()).abs() < 0.004,
        "rate {rate} vs {}",
        g.mean_loss()
    );
    assert!((g.mean_loss() - 1.0 / 26.0).abs() < 1e-12);
}

#[test]
fn gilbert_elliott_partial_loss_in_states() {
    let g = GilbertElliott {
        p: 0.05,
        r: 0.5,
        loss_bad: 0.5,
        loss_good: 0.01,
    };
    let cfg = LinkConfig {
        gilbert: Some(g),
        ..Default::default()
    };
    let n = 200_000;
    let (_, out, _) = run(cfg, 8, n, us(10), 1200);
    let rate = drops(&out, DropReason::BurstLoss) as f64 / n as f64;
    assert!(
        (rate - g.mean_loss()).abs() < 0.005,
        "{rate} vs {}",
        g.mean_loss()
    );
}

#[test]
fn rate_limiter_throughput_and_queue_drops() {
    // 10 Mbit/s: a 1500-byte packet takes 1.2 ms. Offer twice that (one every 0.6 ms) for 6 s.
    let cfg = LinkConfig {
        rate: Some(10_000_000),
        queue: QueueLimit::Packets(25),
        ..Default::default()
    };
    let n = 10_000;
    let (t0, out, m) = run(cfg, 1, n, us(600), 1500);
    let d = delivered(&out);
    let first = d.first().unwrap().1;
    let last = d.last().unwrap().1;
    let bits = (d.len() - 1) as f64 * 1500.0 * 8.0;
    let rate = bits / (last - first).as_secs_f64();
    assert!((rate - 10e6).abs() / 10e6 < 0.001, "rate {rate}");
    // Half the packets cannot fit.
    let q = drops(&out, DropReason::Queue) as f64 / n as f64;
    assert!((q - 0.5).abs() < 0.01, "queue drops {q}");
    // Departures are spaced by the serialization time, and no packet waits longer than a
    // full queue takes to drain.
    for w in d.windows(2) {
        assert!(w[1].1 - w[0].1 >= us(1200));
    }
    for (t, at, _) in &d {
        assert!(*at - *t <= us(1200) * 25, "{:?}", *at - *t);
    }
    assert!(m.stats().delay.max() > ms(25));
    let _ = t0;
}

#[test]
fn rate_limiter_below_capacity_never_drops() {
    let cfg = LinkConfig {
        rate: Some(10_000_000),
        queue: QueueLimit::Packets(5),
        delay: ms(10),
        ..Default::default()
    };
    // 1000-byte packets every 1 ms: 8 Mbit/s.
    let (_, out, _) = run(cfg, 1, 5000, ms(1), 1000);
    assert_eq!(delivered(&out).len(), 5000);
    for (t, at, _) in delivered(&out) {
        assert_eq!(at - t, ms(10) + us(800));
    }
}

#[test]
fn byte_queue_limit() {
    let cfg = LinkConfig {
        rate: Some(1_000_000),
        queue: QueueLimit::Bytes(10_000),
        ..Default::default()
    };
    // A burst of 20 packets of 1000 bytes at once: 10 fit.
    let t0 = Instant::now();
    let mut m = Impairment::new(cfg, 1, t0);
    let verdicts: Vec<_> = (0..20).map(|_| m.offer(t0, 1000)).collect();
    let ok = verdicts
        .iter()
        .filter(|v| matches!(v, Verdict::Deliver { .. }))
        .count();
    assert_eq!(ok, 10);
    assert!(
        verdicts[10..]
            .iter()
            .all(|v| *v == Verdict::Drop(DropReason::Queue))
    );
    // 8 ms later (1 Mbit/s: 8 ms per packet) one has left, so one more fits.
    assert!(matches!(m.offer(t0 + ms(8), 1000), Verdict::Deliver { .. }));
    assert_eq!(m.offer(t0 + ms(8), 1000), Verdict::Drop(DropReason::Queue));
}

#[test]
fn jitter_bounds_and_spread() {
    let cfg = LinkConfig {
        delay: ms(20),
        jitter: ms(5),
        ..Default::default()
    };
    // Sparse packets (30 ms apart): jitter is free to act on each.
    let (_, out, m) = run(cfg.clone(), 3, 20_000, ms(30), 500);
    let delays: Vec<Duration> = delivered(&out).iter().map(|(t, at, _)| *at - *t).collect();
    assert!(delays.iter().all(|d| *d >= ms(15) && *d <= ms(25)));
    let mean = delays.iter().map(|d| d.as_secs_f64()).sum::<f64>() / delays.len() as f64;
    assert!((mean - 0.020).abs() < 0.0002, "mean {mean}");
    let h = &m.stats().delay;
    assert!((h.quantile(0.1).as_secs_f64() - 0.016).abs() < 0.0005);
    assert!((h.quantile(0.9).as_secs_f64() - 0.024).abs() < 0.0005);

    // Dense packets (50 us apart): still within the bounds, and never reordered.
    let (_, out, _) = run(cfg, 4, 20_000, us(50), 500);
    let d = delivered(&out);
    assert!(
        d.iter()
            .all(|(t, at, _)| *at - *t >= ms(15) && *at - *t <= ms(25))
    );
    assert!(d.windows(2).all(|w| w[1].1 >= w[0].1));
    // But bunched: each leaves with the latest delay of the packets ahead of it, so the
    // mean sits near delay + jitter (the module docs say so; --netem does not bunch).
    let mean = d
        .iter()
        .map(|(t, at, _)| (*at - *t).as_secs_f64())
        .sum::<f64>()
        / d.len() as f64;
    assert!(mean > 0.024, "mean {mean}");
}

/// `netem`: as Linux netem without a rate, each packet keeps its own delay +- jitter, dense
/// or not (jitter reorders), and the reordered share leaves at once, without the delay.
#[test]
fn netem_jitter_reorders_and_reordered_packets_skip_the_delay() {
    let cfg = LinkConfig {
        delay: ms(20),
        jitter: ms(5),
        reorder: 0.10,
        netem: true,
        ..Default::default()
    };
    let n = 50_000;
    let (_, out, m) = run(cfg, 7, n, us(50), 500);
    let d = delivered(&out);
    let (at_once, delayed): (Vec<_>, Vec<_>) = d.iter().partition(|(_, _, r)| *r);
    let share = at_once.len() as f64 / n as f64;
    assert!((share - 0.10).abs() < 0.006, "share {share}");
    assert_eq!(m.stats().reordered as usize, at_once.len());
    assert!(at_once.iter().all(|(t, at, _)| at == t));
    let delays: Vec<f64> = delayed
        .iter()
        .map(|(t, at, _)| (*at - *t).as_secs_f64())
        .collect();
    assert!(delays.iter().all(|d| (0.015..=0.025).contains(d)));
    let mean = delays.iter().sum::<f64>() / delays.len() as f64;
    assert!((mean - 0.020).abs() < 0.0002, "mean {mean}");
    // Jitter alone reorders: packets 50 us apart with +-5 ms each overtake one another.
    let overtaken = delayed.windows(2).filter(|w| w[1].1 < w[0].1).count();
    assert!(overtaken > delayed.len() / 4, "{overtaken} overtaken");
}

#[test]
fn jitter_never_goes_below_zero_delay() {
    let cfg = LinkConfig {
        delay: ms(1),
        jitter: ms(5),
        ..Default::default()
    };
    let (_, out, _) = run(cfg, 5, 5000, ms(10), 500);
    assert!(delivered(&out).iter().all(|(t, at, _)| at >= t));
}

#[test]
fn reordering_share_and_overtaking() {
    let cfg = LinkConfig {
        delay: ms(20),
        reorder: 0.10,
        reorder_delay: ms(10),
        ..Default::default()
    };
    let n = 50_000;
    let (_, out, m) = run(cfg, 6, n, ms(1), 1200);
    let d = delivered(&out);
    let share = m.stats().reordered as f64 / n as f64;
    assert!((share - 0.10).abs() < 0.006, "share {share}");
    // Every held-back packet is overtaken by the next packet (1 ms behind it, not held).
    for w in d.windows(2) {
        let ((_, a, ra), (_, b, rb)) = (w[0], w[1]);
        if ra && !rb {
            assert!(b < a);
        }
    }
    // The packets that were not held stay in order.
    let kept: Vec<Instant> = d.iter().filter(|x| !x.2).map(|x| x.1).collect();
    assert!(kept.windows(2).all(|w| w[1] >= w[0]));
    // Released in time order, the sequence really is out of order about 10 % of the time.
    let mut order: Vec<(Instant, usize)> = d.iter().enumerate().map(|(i, x)| (x.1, i)).collect();
    order.sort();
    let inversions = order.windows(2).filter(|w| w[1].1 < w[0].1).count();
    assert!(inversions as f64 / n as f64 > 0.08);
}

#[test]
fn trace_replay() {
    // Two opportunities at 1 ms, none at 2 ms, one at 3 ms; loops every 3 ms: 1 packet/ms.
    let trace = Arc::new(Trace::parse("1\n1\n3\n").unwrap());
    let cfg = LinkConfig {
        trace: Some(trace.clone()),
        queue: QueueLimit::Packets(100),
        ..Default::default()
    };
    // 30 full packets at once: they go out 2 at 1 ms, 1 at 3 ms, 2 at 4 ms, 1 at 6 ms, ...
    let t0 = Instant::now();
    let mut m = Impairment::new(cfg.clone(), 1, t0);
    let times: Vec<Duration> = (0..30)
        .map(|_| match m.offer(t0, 1500) {
            Verdict::Deliver { at, .. } => at - t0,
            v => panic!("{v:?}"),
        })
        .collect();
    assert_eq!(&times[..6], &[ms(1), ms(1), ms(3), ms(4), ms(4), ms(6)]);
    assert_eq!(times[29], ms(30));

    // Throughput under overload follows the trace's mean rate (12 Mbit/s here).
    let (_, out, _) = run(cfg, 1, 20_000, us(500), 1500);
    let d = delivered(&out);
    let secs = (d.last().unwrap().1 - d.first().unwrap().1).as_secs_f64();
    let rate = (d.len() - 1) as f64 * 1500.0 * 8.0 / secs;
    assert!(
        (rate - trace.mean_rate_bps()).abs() / rate < 0.01,
        "rate {rate}"
    );
    // Every delivery happens on a whole millisecond of the trace.
    let t0 = out[0].0;
    for (_, at, _) in d {
        assert_eq!((at - t0).as_nanos() % 1_000_000, 0);
    }
}

#[test]
fn blackhole_schedule() {
    let cfg = LinkConfig {
        blackhole: Some(Blackhole {
            up: Duration::from_secs(5),
            down: Duration::from_secs(2),
        }),
        ..Default::default()
    };
    // One packet per ms for 14 s: [5, 7) and [12, 14) are outages.
    let (t0, out, m) = run(cfg, 1, 14_000, ms(1), 100);
    for (t, v) in &out {
        let s = (*t - t0).as_secs_f64();
        let down = (5.0..7.0).contains(&s) || (12.0..14.0).contains(&s);
        assert_eq!(*v == Verdict::Drop(DropReason::Blackhole), down, "at {s}");
    }
    assert_eq!(m.stats().dropped_blackhole, 4000);
}

#[test]
fn blackhole_drops_what_leaves_the_bottleneck_during_an_outage() {
    // A queue that fills before the outage drains into it.
    let cfg = LinkConfig {
        rate: Some(1_200_000), // 10 ms per 1500-byte packet
        queue: QueueLimit::Packets(100),
        blackhole: Some(Blackhole {
            up: ms(50),
            down: ms(1000),
        }),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut m = Impairment::new(cfg, 1, t0);
    let v: Vec<_> = (0..10).map(|_| m.offer(t0, 1500)).collect();
    // Departures at 10, 20, 30, 40 ms pass; 50 ms and later fall into the outage.
    assert!(v[..4].iter().all(|v| matches!(v, Verdict::Deliver { .. })));
    assert!(
        v[4..]
            .iter()
            .all(|v| *v == Verdict::Drop(DropReason::Blackhole))
    );
}

#[test]
fn determinism_from_the_seed() {
    let cfg = LinkConfig {
        delay: ms(20),
        jitter: ms(5),
        loss: 0.05,
        gilbert: Some(GilbertElliott {
            p: 0.01,
            r: 0.3,
            loss_bad: 0.8,
            loss_good: 0.0,
        }),
        reorder: 0.1,
        rate: Some(20_000_000),
        queue: QueueLimit::Packets(30),
        ..Default::default()
    };
    let t0 = Instant::now();
    let verdicts = |seed: u64| {
        let mut m = Impairment::new(cfg.clone(), seed, t0);
        (0..20_000u32)
            .map(|i| {
                let v = m.offer(t0 + us(400) * i, 300 + (i as usize * 7) % 1200);
                match v {
                    Verdict::Deliver { at, reordered } => (Some(at - t0), reordered, None),
                    Verdict::Drop(r) => (None, false, Some(r)),
                }
            })
            .collect::<Vec<_>>()
    };
    let a = verdicts(42);
    assert_eq!(a, verdicts(42));
    assert_ne!(a, verdicts(43));

    // One impairment does not disturb another's random choices: the loss pattern is the same
    // with and without jitter.
    let losses = |jitter| {
        let cfg = LinkConfig {
            loss: 0.1,
            jitter,
            delay: ms(10),
            ..Default::default()
        };
        let (_, out, _) = run(cfg, 9, 5000, ms(1), 100);
        out.iter()
            .map(|(_, v)| matches!(v, Verdict::Drop(_)))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(Duration::ZERO), losses(ms(3)));
}

#[test]
fn pipe_releases_in_time_order() {
    let cfg = LinkConfig {
        delay: ms(10),
        jitter: ms(2),
        reorder: 0.2,
        reorder_delay: ms(5),
        loss: 0.1,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut pipe: Pipe<u32> = Pipe::new(Impairment::new(cfg, 11, t0), 1_000_000);
    let mut out = Vec::new();
    let mut returned = 0;
    for i in 0..5000u32 {
        let now = t0 + us(200) * i;
        while let Some((p, at)) = pipe.pop_due(now) {
            assert!(at <= now);
            out.push((at, p));
        }
        if let Err((_, p)) = pipe.push(now, 100, i) {
            assert_eq!(p, i);
            returned += 1;
        }
    }
    assert!(pipe.next_release().is_some());
    let end = t0 + Duration::from_secs(10);
    while let Some((p, at)) = pipe.pop_due(end) {
        out.push((at, p));
    }
    assert!(pipe.is_empty());
    assert_eq!(out.len() + returned, 5000);
    assert!(out.windows(2).all(|w| w[1].0 >= w[0].0));
    // Some packets come out of order.
    assert!(out.windows(2).any(|w| w[1].1 < w[0].1));
    assert_eq!(pipe.stats().delivered as usize, out.len());
}

#[test]
fn pipe_overflow_limit() {
    let cfg = LinkConfig {
        delay: Duration::from_secs(1),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut pipe: Pipe<()> = Pipe::new(Impairment::new(cfg, 1, t0), 10);
    for i in 0..15 {
        let r = pipe.push(t0 + us(i), 100, ());
        assert_eq!(r.is_ok(), i < 10);
    }
    assert_eq!(pipe.len(), 10);
    assert_eq!(pipe.stats().dropped_overflow, 5);
    assert_eq!(pipe.stats().packets_in, 15);
}

#[test]
fn config_validation_and_summary() {
    let mut c = LinkConfig {
        rate: Some(1_000_000),
        trace: Some(Arc::new(Trace::constant(1, 10))),
        ..Default::default()
    };
    assert!(c.validate().is_err());
    c.trace = None;
    assert!(c.validate().is_ok());
    c.loss = 1.5;
    assert!(c.validate().is_err());
    assert_eq!(LinkConfig::default().to_string(), "no impairment");
    let c = LinkConfig {
        delay: ms(20),
        jitter: ms(5),
        loss: 0.05,
        rate: Some(10_000_000),
        queue: QueueLimit::Packets(25),
        ..Default::default()
    };
    assert_eq!(
        c.to_string(),
        "delay 20.0ms ±5.00ms, loss 5%, rate 10.000 Mbit/s, queue 25 packets"
    );
}
