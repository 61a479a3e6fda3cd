//! Mahimahi packet-delivery traces.
//!
//! A trace file has one line per delivery opportunity: a timestamp in milliseconds from the
//! start of the trace (non-decreasing; equal timestamps are several opportunities in the same
//! millisecond). Each opportunity can carry [`OPPORTUNITY_BYTES`] bytes, one MTU-sized packet;
//! smaller packets share an opportunity and a larger remainder spills into the next one, as in
//! Mahimahi's link queue. Unused opportunities are lost. The trace loops: after the last line
//! it starts again, shifted by the last timestamp (so the last timestamp is the period).

use std::path::Path;
use std::time::Duration;

/// The bytes one delivery opportunity carries: one packet of the link's MTU.
pub const OPPORTUNITY_BYTES: usize = 1500;

/// The longest trace period accepted, in milliseconds: a day. Longer ones are surely a
/// mistake, and the times of later loops (`loop x period + timestamp`) stay far from overflow.
pub const MAX_PERIOD_MS: u64 = 24 * 3600 * 1000;

/// A parsed trace: the opportunities of one period, in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    ms: Vec<u64>,
}

impl Trace {
    /// Parses the text of a trace file. Blank lines and lines starting with `#` are skipped.
    pub fn parse(text: &str) -> Result<Trace, String> {
        let mut ms = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let v: u64 = line
                .parse()
                .map_err(|_| format!("line {}: `{line}` is not a millisecond count", i + 1))?;
            if v > MAX_PERIOD_MS {
                return Err(format!(
                    "line {}: {v} ms is beyond a day ({MAX_PERIOD_MS} ms), the longest trace",
                    i + 1
                ));
            }
            if let Some(&last) = ms.last()
                && v < last
            {
                return Err(format!(
                    "line {}: timestamps must not decrease ({v} after {last})",
                    i + 1
                ));
            }
            ms.push(v);
        }
        Trace::new(ms)
    }

    /// Reads and parses a trace file.
    pub fn load(path: &Path) -> Result<Trace, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
        Trace::parse(&text).map_err(|e| format!("trace {}: {e}", path.display()))
    }

    /// A trace from opportunity timestamps (milliseconds, non-decreasing, last one above 0
    /// and at most [`MAX_PERIOD_MS`]).
    pub fn new(ms: Vec<u64>) -> Result<Trace, String> {
        if ms.windows(2).any(|w| w[1] < w[0]) {
            return Err("timestamps must not decrease".into());
        }
        match ms.last() {
            None => Err("the trace has no delivery opportunity".into()),
            Some(0) => Err("the trace must last longer than 0 ms".into()),
            Some(&p) if p > MAX_PERIOD_MS => Err(format!(
                "the trace lasts {p} ms, beyond a day ({MAX_PERIOD_MS} ms)"
            )),
            Some(_) => Ok(Trace { ms }),
        }
    }

    /// A constant-rate trace: `per_ms` opportunities every millisecond for `period_ms`.
    pub fn constant(per_ms: usize, period_ms: u64) -> Trace {
        let mut ms = Vec::new();
        for t in 1..=period_ms.max(1) {
            ms.extend(std::iter::repeat_n(t, per_ms.max(1)));
        }
        Trace { ms }
    }

    /// The period after which the trace repeats.
    pub fn period(&self) -> Duration {
        Duration::from_millis(self.period_ms())
    }

    fn period_ms(&self) -> u64 {
        *self.ms.last().expect("a trace is never empty")
    }

    /// Opportunities per period.
    pub fn len(&self) -> usize {
        self.ms.len()
    }

    /// Never true: a trace has at least one opportunity.
    pub fn is_empty(&self) -> bool {
        self.ms.is_empty()
    }

    /// The mean capacity of the trace in bits per second.
    pub fn mean_rate_bps(&self) -> f64 {
        (self.ms.len() * OPPORTUNITY_BYTES * 8) as f64 / (self.period_ms() as f64 / 1000.0)
    }

    /// The time (from the start) of opportunity `index` of loop `cycle`.
    fn at(&self, cycle: u64, index: usize) -> Duration {
        Duration::from_millis(cycle * self.period_ms() + self.ms[index])
    }
}

/// Where a queue stands on a trace: the opportunity in use and the bytes it has left.
#[derive(Debug, Clone)]
pub(crate) struct TraceCursor {
    cycle: u64,
    index: usize,
    credit: usize,
}

impl TraceCursor {
    pub(crate) fn new() -> TraceCursor {
        TraceCursor {
            cycle: 0,
            index: 0,
            credit: OPPORTUNITY_BYTES,
        }
    }

    fn step(&mut self, trace: &Trace) {
        self.index += 1;
        if self.index == trace.ms.len() {
            self.index = 0;
            self.cycle += 1;
        }
        self.credit = OPPORTUNITY_BYTES;
    }

    /// Moves to the first opportunity at or after `t` (time since the start), unless the
    /// next one with bytes left is already there.
    fn catch_up(&mut self, trace: &Trace, t: Duration) {
        if trace.at(self.cycle, self.index) >= t {
            return;
        }
        let period = u128::from(trace.period_ms()) * 1_000_000;
        let t_ns = t.as_nanos();
        let mut cycle = (t_ns / period) as u64;
        let within = Duration::from_nanos((t_ns % period) as u64);
        let mut index = trace
            .ms
            .partition_point(|&ms| Duration::from_millis(ms) < within);
        if index == trace.ms.len() {
            index = 0;
            cycle += 1;
        }
        self.cycle = cycle;
        self.index = index;
        self.credit = OPPORTUNITY_BYTES;
    }

    /// Sends a packet of `len` bytes that reaches the head of the queue at `t` (time since the
    /// start, not before the previous packet left); returns when its last byte leaves.
    pub(crate) fn send(&mut self, trace: &Trace, t: Duration, len: usize) -> Duration {
        self.catch_up(trace, t);
        let mut left = len.max(1);
        loop {
            let take = left.min(self.credit);
            self.credit -= take;
            left -= take;
            let at = trace.at(self.cycle, self.index);
            if self.credit == 0 {
                self.step(trace);
            }
            if left == 0 {
                return at;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn parse_and_reject() {
        let t = Trace::parse("# a trace\n1\n1\n5\n\n10\n").unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t.period(), ms(10));
        assert!(Trace::parse("").is_err());
        assert!(Trace::parse("0\n0\n").is_err());
        assert!(Trace::parse("5\n3\n").is_err());
        assert!(Trace::parse("5\nabc\n").is_err());
    }

    #[test]
    fn one_packet_per_opportunity() {
        let t = Trace::parse("2\n4\n4\n10\n").unwrap();
        let mut c = TraceCursor::new();
        // Four full packets at time 0 take the four opportunities of the first period.
        let times: Vec<_> = (0..6).map(|_| c.send(&t, ms(0), 1500)).collect();
        assert_eq!(times, [ms(2), ms(4), ms(4), ms(10), ms(12), ms(14)]);
    }

    #[test]
    fn small_packets_share_and_large_spill() {
        let t = Trace::parse("1\n2\n3\n4\n").unwrap();
        let mut c = TraceCursor::new();
        assert_eq!(c.send(&t, ms(0), 500), ms(1));
        assert_eq!(c.send(&t, ms(0), 500), ms(1));
        assert_eq!(c.send(&t, ms(0), 500), ms(1));
        // 1500 bytes: nothing left at 1 ms, so it takes the 2 ms opportunity.
        assert_eq!(c.send(&t, ms(0), 1500), ms(2));
        // 1000 + 1000: the second spills from 3 ms into 4 ms.
        assert_eq!(c.send(&t, ms(0), 1000), ms(3));
        assert_eq!(c.send(&t, ms(0), 1000), ms(4));
    }

    #[test]
    fn idle_opportunities_are_lost_and_the_trace_loops() {
        let t = Trace::parse("10\n20\n30\n").unwrap();
        let mut c = TraceCursor::new();
        assert_eq!(c.send(&t, ms(15), 1500), ms(20));
        // Idle until 95 ms: the next opportunity is 10 ms into the fourth period (90 + 10).
        assert_eq!(c.send(&t, ms(95), 1500), ms(100));
        // Exactly at an opportunity: it is used.
        assert_eq!(c.send(&t, ms(110), 1500), ms(110));
        assert_eq!(c.send(&t, ms(110), 1500), ms(120));
        // A partly used opportunity in the future keeps its credit.
        assert_eq!(c.send(&t, ms(121), 100), ms(130));
        assert_eq!(c.send(&t, ms(122), 100), ms(130));
    }

    #[test]
    fn periods_are_bounded() {
        // Found by the netsim_trace fuzz target: a trace whose last timestamp is u64::MAX ms
        // parsed, and its second loop overflowed `cycle * period + ms` (a panic in debug
        // builds, wrong times in release).
        assert!(Trace::parse("4\n18446744073709551615\n").is_err());
        assert!(Trace::parse("86400001\n").is_err());
        // The longest period allowed (a day) loops without overflow.
        let t = Trace::parse("1\n86400000\n").unwrap();
        let mut c = TraceCursor::new();
        let times: Vec<_> = (0..5).map(|_| c.send(&t, ms(0), 1500)).collect();
        assert_eq!(
            times,
            [
                ms(1),
                ms(86_400_000),
                ms(86_400_001),
                ms(172_800_000),
                ms(172_800_001)
            ]
        );
    }

    #[test]
    fn mean_rate() {
        // 1 opportunity per ms: 1500 bytes/ms = 12 Mbit/s.
        let t = Trace::constant(1, 100);
        assert!((t.mean_rate_bps() - 12e6).abs() < 1.0);
    }
}
