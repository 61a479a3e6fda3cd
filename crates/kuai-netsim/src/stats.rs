//! Counters and a small log-linear histogram for the per-direction statistics.

use std::fmt;
use std::time::Duration;

const SUB_BITS: u32 = 5;
const SUB: usize = 1 << SUB_BITS;
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// A histogram of durations with about 3 % relative resolution (32 buckets per power of two,
/// in nanoseconds), exact below 32 ns; min, max and mean are exact.
#[derive(Clone)]
pub struct Histogram {
    buckets: Box<[u64]>,
    count: u64,
    sum_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }
}

fn index(v: u64) -> usize {
    if v < SUB as u64 {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BITS;
    let sub = (v >> shift) as usize & (SUB - 1);
    ((shift as usize + 1) << SUB_BITS) + sub
}

/// The smallest value of bucket `i` and the width of the bucket.
fn bucket(i: usize) -> (u64, u64) {
    if i < SUB {
        return (i as u64, 1);
    }
    let shift = (i >> SUB_BITS) - 1;
    let sub = (i & (SUB - 1)) as u64;
    ((SUB as u64 + sub) << shift, 1 << shift)
}

impl Histogram {
    /// Records one value.
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[index(ns)] += 1;
        self.count += 1;
        self.sum_ns += u128::from(ns);
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The smallest value, zero when empty.
    pub fn min(&self) -> Duration {
        Duration::from_nanos(if self.count == 0 { 0 } else { self.min_ns })
    }

    /// The largest value.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// The mean, zero when empty.
    pub fn mean(&self) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos((self.sum_ns / u128::from(self.count)) as u64)
    }

    /// The `q` quantile (0..=1) to the bucket's resolution, clamped to the exact min and max.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (lo, width) = bucket(i);
                let mid = lo + (width - 1) / 2;
                return Duration::from_nanos(mid.clamp(self.min_ns, self.max_ns));
            }
        }
        self.max()
    }
}

impl fmt::Debug for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Histogram({self})")
    }
}

/// `n 120, min 20.0ms, mean 20.3ms, p50 20.1ms, p90 ..., p99 ..., max ...`
impl fmt::Display for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return write!(f, "none");
        }
        write!(
            f,
            "min {} mean {} p50 {} p90 {} p99 {} max {}",
            Short(self.min()),
            Short(self.mean()),
            Short(self.quantile(0.5)),
            Short(self.quantile(0.9)),
            Short(self.quantile(0.99)),
            Short(self.max()),
        )
    }
}

/// A duration printed with three significant digits and a fitting unit.
pub struct Short(pub Duration);

impl fmt::Display for Short {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0.as_nanos() as f64;
        let (v, unit) = if ns >= 1e9 {
            (ns / 1e9, "s")
        } else if ns >= 1e6 {
            (ns / 1e6, "ms")
        } else if ns >= 1e3 {
            (ns / 1e3, "us")
        } else {
            (ns, "ns")
        };
        let digits = if v >= 100.0 {
            0
        } else if v >= 10.0 {
            1
        } else {
            2
        };
        write!(f, "{v:.digits$}{unit}")
    }
}

/// Why the model dropped a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Sent during a blackhole period.
    Blackhole,
    /// Random (Bernoulli) loss.
    Loss,
    /// Gilbert-Elliott burst loss.
    BurstLoss,
    /// The rate limiter's queue was full (drop-tail).
    Queue,
    /// The emulator holds too many packets in flight (a safety limit, not part of the model).
    Overflow,
}

/// What happened to the packets of one direction.
#[derive(Debug, Clone, Default)]
pub struct DirectionStats {
    /// Packets offered to the link.
    pub packets_in: u64,
    /// Bytes offered to the link.
    pub bytes_in: u64,
    /// Packets delivered (or scheduled for delivery).
    pub delivered: u64,
    /// Bytes delivered.
    pub bytes_delivered: u64,
    /// Delivered packets that were held back to be reordered.
    pub reordered: u64,
    /// Drops during blackhole periods.
    pub dropped_blackhole: u64,
    /// Random losses.
    pub dropped_loss: u64,
    /// Gilbert-Elliott losses.
    pub dropped_burst: u64,
    /// Drop-tail queue drops.
    pub dropped_queue: u64,
    /// Drops by the in-flight safety limit.
    pub dropped_overflow: u64,
    /// Time each delivered packet spends in the link (queue, delay, jitter, reordering).
    pub delay: Histogram,
}

impl DirectionStats {
    pub(crate) fn count_drop(&mut self, reason: DropReason) {
        match reason {
            DropReason::Blackhole => self.dropped_blackhole += 1,
            DropReason::Loss => self.dropped_loss += 1,
            DropReason::BurstLoss => self.dropped_burst += 1,
            DropReason::Queue => self.dropped_queue += 1,
            DropReason::Overflow => self.dropped_overflow += 1,
        }
    }

    /// All drops.
    pub fn dropped(&self) -> u64 {
        self.dropped_blackhole
            + self.dropped_loss
            + self.dropped_burst
            + self.dropped_queue
            + self.dropped_overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous() {
        let mut prev_end = 0;
        for i in 0..BUCKETS {
            let (lo, width) = bucket(i);
            assert_eq!(lo, prev_end, "bucket {i}");
            assert_eq!(index(lo), i);
            assert_eq!(index(lo + (width - 1)), i);
            prev_end = lo.wrapping_add(width);
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_within_resolution() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 10_000);
        assert_eq!(h.min(), Duration::from_micros(1));
        assert_eq!(h.max(), Duration::from_micros(10_000));
        let mean = h.mean().as_secs_f64() * 1e6;
        assert!((mean - 5000.5).abs() < 0.01, "{mean}");
        for (q, want) in [(0.5, 5000.0), (0.9, 9000.0), (0.99, 9900.0)] {
            let got = h.quantile(q).as_secs_f64() * 1e6;
            assert!((got - want).abs() / want < 0.035, "q{q}: {got} vs {want}");
        }
        assert!(h.to_string().contains("p99"));
    }

    #[test]
    fn short_durations() {
        assert_eq!(Short(Duration::from_micros(20_100)).to_string(), "20.1ms");
        assert_eq!(Short(Duration::from_nanos(850)).to_string(), "850ns");
        assert_eq!(Short(Duration::from_millis(1500)).to_string(), "1.50s");
        assert_eq!(Short(Duration::from_micros(125)).to_string(), "125us");
    }
}
