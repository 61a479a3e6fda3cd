//! Pacing (RFC 9002 §7.7): a token bucket refilled at the path's pacing rate.

use std::time::{Duration, Instant};

/// Largest burst the pacer lets out at once, in datagrams. Bursts of this size keep GSO
/// batches full while staying far below a typical bottleneck queue.
const MAX_BURST_PACKETS: u64 = 10;
/// RFC 9002 §7.7: pace at N = 1.25 times cwnd / smoothed_rtt, so that pacing itself does
/// not limit a window-limited sender.
const PACING_GAIN_NUM: u64 = 5;
const PACING_GAIN_DEN: u64 = 4;

#[derive(Debug, Clone)]
pub struct Pacer {
    tokens: u64,
    capacity: u64,
    last_refill: Instant,
    max_datagram_size: u64,
}

impl Pacer {
    pub fn new(now: Instant, max_datagram_size: u64) -> Self {
        let capacity = MAX_BURST_PACKETS * max_datagram_size;
        Self {
            tokens: capacity,
            capacity,
            last_refill: now,
            max_datagram_size,
        }
    }

    pub fn on_mtu_update(&mut self, max_datagram_size: u64) {
        self.max_datagram_size = max_datagram_size;
        self.capacity = MAX_BURST_PACKETS * max_datagram_size;
        self.tokens = self.tokens.min(self.capacity);
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

    fn refill(&mut self, now: Instant, rate: u64) {
        let elapsed = now.saturating_duration_since(self.last_refill);
        let add = u128::from(rate) * elapsed.as_nanos() / 1_000_000_000;
        if add > 0 {
            self.tokens = (u128::from(self.tokens) + add).min(u128::from(self.capacity)) as u64;
            self.last_refill = now;
        }
    }

    /// When a packet of `bytes` may leave; `None` means now.
    pub fn delay(&mut self, now: Instant, bytes: u64, rate: u64) -> Option<Instant> {
        self.refill(now, rate);
        let need = bytes.min(self.capacity);
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
}
