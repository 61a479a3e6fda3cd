//! NewReno (RFC 9002 §7 and Appendix B).

use std::time::Instant;

use super::{AckEvent, CongestionController, LossEvent, initial_window, minimum_window};

/// RFC 9002 §7.3.2: kLossReductionFactor = 0.5.
const LOSS_REDUCTION_NUM: u64 = 1;
const LOSS_REDUCTION_DEN: u64 = 2;

#[derive(Debug, Clone)]
/// NewReno as RFC 9002 §7 describes it.
pub struct NewReno {
    max_datagram_size: u64,
    window: u64,
    ssthresh: u64,
    recovery_start: Option<Instant>,
    /// Bytes acknowledged in congestion avoidance not yet turned into window growth.
    bytes_acked: u64,
    /// Window before the last reduction, restored on a spurious congestion event.
    prior_window: u64,
    prior_ssthresh: u64,
}

impl NewReno {
    /// A controller for datagrams of `max_datagram_size` bytes.
    pub fn new(max_datagram_size: u64) -> Self {
        let window = initial_window(max_datagram_size);
        Self {
            max_datagram_size,
            window,
            ssthresh: u64::MAX,
            recovery_start: None,
            bytes_acked: 0,
            prior_window: window,
            prior_ssthresh: u64::MAX,
        }
    }

    /// Starts from `bytes` instead of RFC 9002's initial window (at least 2 datagrams).
    pub fn with_initial_window(mut self, bytes: u64) -> Self {
        self.window = bytes.max(2 * self.max_datagram_size);
        self.prior_window = self.window;
        self
    }

    fn in_recovery(&self, sent_time: Instant) -> bool {
        self.recovery_start.is_some_and(|start| sent_time <= start)
    }
}

impl CongestionController for NewReno {
    fn on_packet_sent(&mut self, _now: Instant, _bytes: u64, _bytes_in_flight: u64) {}

    fn on_ack(&mut self, _now: Instant, ack: &AckEvent<'_>) {
        // RFC 9002 §7.3.2: acknowledging a packet sent after recovery began ends recovery.
        if self.in_recovery(ack.largest_acked_sent_time) {
            return;
        }
        self.recovery_start = None;
        // RFC 9002 §7.8: do not grow the window when not limited by it.
        if ack.app_limited {
            return;
        }
        if self.window < self.ssthresh {
            self.window += ack.acked_bytes;
        } else {
            // Congestion avoidance: one datagram per window of acknowledged bytes.
            self.bytes_acked += ack.acked_bytes;
            if self.bytes_acked >= self.window {
                self.bytes_acked -= self.window;
                self.window += self.max_datagram_size;
            }
        }
    }

    fn on_congestion_event(&mut self, now: Instant, loss: &LossEvent) {
        if self.in_recovery(loss.largest_sent_time) {
            return;
        }
        self.recovery_start = Some(now);
        self.prior_window = self.window;
        self.prior_ssthresh = self.ssthresh;
        self.ssthresh = (self.window * LOSS_REDUCTION_NUM / LOSS_REDUCTION_DEN)
            .max(minimum_window(self.max_datagram_size));
        self.window = self.ssthresh;
        self.bytes_acked = 0;
    }

    fn on_persistent_congestion(&mut self, _now: Instant) {
        self.window = minimum_window(self.max_datagram_size);
        self.recovery_start = None;
        self.bytes_acked = 0;
    }

    fn on_spurious_congestion_event(&mut self) {
        if self.prior_window > self.window {
            self.window = self.prior_window;
            self.ssthresh = self.prior_ssthresh;
            self.recovery_start = None;
        }
    }

    fn on_mtu_update(&mut self, max_datagram_size: u64) {
        self.max_datagram_size = max_datagram_size;
        self.window = self.window.max(minimum_window(max_datagram_size));
    }

    fn window(&self) -> u64 {
        self.window
    }

    fn ssthresh(&self) -> Option<u64> {
        (self.ssthresh != u64::MAX).then_some(self.ssthresh)
    }

    fn in_slow_start(&self) -> bool {
        self.window < self.ssthresh
    }

    fn name(&self) -> &'static str {
        "newreno"
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::recovery::RttEstimator;

    fn ack(bytes: u64, sent: Instant, rtt: &RttEstimator) -> AckEvent<'_> {
        AckEvent {
            acked_bytes: bytes,
            largest_acked_sent_time: sent,
            rtt,
            rate: None,
            prior_in_flight: 0,
            bytes_in_flight: 0,
            app_limited: false,
        }
    }

    #[test]
    fn slow_start_then_halving_then_avoidance() {
        let t0 = Instant::now();
        let rtt = RttEstimator::new(Duration::from_millis(100));
        let mut cc = NewReno::new(1200);
        assert_eq!(cc.window(), 12_000);
        cc.on_ack(t0, &ack(12_000, t0, &rtt));
        assert_eq!(cc.window(), 24_000);
        let t1 = t0 + Duration::from_millis(100);
        let loss = LossEvent {
            largest_sent_time: t0,
            lost_bytes: 1200,
            ecn_ce: false,
            bytes_in_flight: 0,
            latest_rtt: None,
        };
        cc.on_congestion_event(t1, &loss);
        assert_eq!(cc.window(), 12_000);
        // A second loss of a packet sent before recovery started is ignored.
        cc.on_congestion_event(t1, &loss);
        assert_eq!(cc.window(), 12_000);
        // ACK of a packet sent before recovery: still in recovery, no growth.
        cc.on_ack(t1, &ack(1200, t0, &rtt));
        assert_eq!(cc.window(), 12_000);
        // A full window acknowledged after recovery: +1 datagram.
        let t2 = t1 + Duration::from_millis(10);
        cc.on_ack(t2, &ack(12_000, t2, &rtt));
        assert_eq!(cc.window(), 13_200);
        cc.on_persistent_congestion(t2);
        assert_eq!(cc.window(), 2400);
    }
}
