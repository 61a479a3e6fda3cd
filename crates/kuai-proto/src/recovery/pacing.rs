//! Pacing (RFC 9002 §7.7): a token bucket refilled at the path's pacing rate.

use std::time::{Duration, Instant};

/// Smallest burst the pacer lets out at once, in datagrams: enough to fill a GSO batch while
/// staying far below a typical bottleneck queue.
const MIN_BURST_PACKETS: u64 = 10;
/// At high rates a burst may cover this much sending time. Ten datagrams last a few
/// microseconds at gigabits per second, and the pacer's timer, not the path, would set the
/// pace; Linux sizes TSO bursts to about a millisecond of data for the same reason.
const BURST_INTERVAL: Duration = Duration::from_millis(1);
/// Largest burst, in datagrams, whatever the rate.
const MAX_BURST_PACKETS: u64 = 128;
/// RFC 9002 §7.7: pace at N = 1.25 times cwnd / smoothed_rtt, so that pacing itself does
/// not limit a window-limited sender.
const PACING_GAIN_NUM: u64 = 5;
const PACING_GAIN_DEN: u64 = 4;

#[derive(Debug, Clone)]
pub struct Pacer {
    tokens: u64,
    last_refill: Instant,
    max_datagram_size: u64,
}

impl Pacer {
    pub fn new(now: Instant, max_datagram_size: u64) -> Self {
        Self {
            tokens: MIN_BURST_PACKETS * max_datagram_size,
            last_refill: now,
            max_datagram_size,
        }
    }

    pub fn on_mtu_update(&mut self, max_datagram_size: u64) {
        self.max_datagram_size = max_datagram_size;
    }

    /// Pacing rate in bytes per second given the controller's rate or its window.
    pub fn rate(cc_rate: Option<u64>, window: u64, srtt: Duration) -> u64 {
        if let Some(r) = cc_rate {
            return r.max(1);
        }
        let us = srtt.as_micros().max(1);
        let r = u128::from(window) * u128::from(PACING_GAIN_NUM) * 1_000_000
            / (u128::from(PACING_GAIN_DEN) * us);
        r.clamp(1, u128::from(u64::MAX)) as u64
    }

    /// Bytes one burst may hold at `rate`: `BURST_INTERVAL` worth, within the packet bounds.
    fn capacity(&self, rate: u64) -> u64 {
        let by_rate = u128::from(rate) * BURST_INTERVAL.as_nanos() / 1_000_000_000;
        let min = MIN_BURST_PACKETS * self.max_datagram_size;
        let max = MAX_BURST_PACKETS * self.max_datagram_size;
        (by_rate.min(u128::from(max)) as u64).max(min)
    }

    fn refill(&mut self, now: Instant, rate: u64) -> u64 {
        let capacity = self.capacity(rate);
        let elapsed = now.saturating_duration_since(self.last_refill);
        let add = u128::from(rate) * elapsed.as_nanos() / 1_000_000_000;
        if add > 0 {
            self.tokens = (u128::from(self.tokens) + add).min(u128::from(capacity)) as u64;
            self.last_refill = now;
        }
        capacity
    }

    /// When a packet of `bytes` may leave; `None` means now.
    pub fn delay(&mut self, now: Instant, bytes: u64, rate: u64) -> Option<Instant> {
        let capacity = self.refill(now, rate);
        let need = bytes.min(capacity);
        if self.tokens >= need {
            return None;
        }
        let missing = need - self.tokens;
        let nanos = (u128::from(missing) * 1_000_000_000).div_ceil(u128::from(rate.max(1)));
        let wait = Duration::from_nanos(nanos.min(u128::from(u64::MAX)) as u64);
        Some(self.last_refill + wait.max(Duration::from_micros(100)))
    }

    pub fn on_sent(&mut self, bytes: u64) {
        self.tokens = self.tokens.saturating_sub(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_paces() {
        let t0 = Instant::now();
        let mut p = Pacer::new(t0, 1200);
        let rate = Pacer::rate(None, 120_000, Duration::from_millis(100));
        assert_eq!(rate, 1_500_000);
        for _ in 0..10 {
            assert!(p.delay(t0, 1200, rate).is_none());
            p.on_sent(1200);
        }
        let next = p.delay(t0, 1200, rate).expect("burst exhausted");
        assert_eq!(next - t0, Duration::from_micros(800));
        assert!(p.delay(next, 1200, rate).is_none());
    }

    #[test]
    fn bursts_grow_with_the_rate() {
        let t0 = Instant::now();
        // 10 Gbit/s: a millisecond is 1.25 MB, above the 128-datagram cap.
        let mut p = Pacer::new(t0, 1200);
        let rate = 1_250_000_000;
        let t1 = t0 + Duration::from_millis(5);
        let mut sent = 0;
        while p.delay(t1, 1200, rate).is_none() {
            p.on_sent(1200);
            sent += 1;
        }
        assert_eq!(sent, 128);
        // 12 Mbit/s: a millisecond is 1,500 bytes, so the 10-datagram floor applies.
        let mut p = Pacer::new(t0, 1200);
        let rate = 1_500_000;
        let mut sent = 0;
        while p.delay(t1, 1200, rate).is_none() {
            p.on_sent(1200);
            sent += 1;
        }
        assert_eq!(sent, 10);
    }
}
