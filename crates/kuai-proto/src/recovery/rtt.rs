//! RTT estimation (RFC 9002 §5).

use std::time::Duration;

/// Timer granularity (RFC 9002 §6.1.2, kGranularity).
pub const GRANULARITY: Duration = Duration::from_millis(1);

/// Round-trip time estimate of one path.
#[derive(Debug, Clone)]
pub struct RttEstimator {
    latest: Duration,
    smoothed: Duration,
    var: Duration,
    min: Duration,
    has_sample: bool,
    initial: Duration,
}

impl RttEstimator {
    /// `initial` is kInitialRtt (RFC 9002 §6.2.2: 333 ms unless configured).
    pub fn new(initial: Duration) -> Self {
        Self {
            latest: initial,
            smoothed: initial,
            var: initial / 2,
            min: initial,
            has_sample: false,
            initial,
        }
    }

    pub fn latest(&self) -> Duration {
        self.latest
    }

    pub fn smoothed(&self) -> Duration {
        self.smoothed
    }

    pub fn var(&self) -> Duration {
        self.var
    }

    /// Smallest RTT seen; the initial value until the first sample.
    pub fn min(&self) -> Duration {
        self.min
    }

    pub fn has_sample(&self) -> bool {
        self.has_sample
    }

    /// Adds an RTT sample (RFC 9002 §5.3). `ack_delay` must already be limited to the peer's
    /// max_ack_delay once the handshake is confirmed, and zero for Initial packets.
    pub fn update(&mut self, ack_delay: Duration, sample: Duration) {
        self.latest = sample;
        if !self.has_sample {
            self.has_sample = true;
            self.min = sample;
            self.smoothed = sample;
            self.var = sample / 2;
            return;
        }
        self.min = self.min.min(sample);
        // Subtract the ack delay only if the result is not below min_rtt (§5.3).
        let adjusted = if sample >= self.min + ack_delay {
            sample - ack_delay
        } else {
            sample
        };
        let diff = self.smoothed.abs_diff(adjusted);
        self.var = (self.var * 3 + diff) / 4;
        self.smoothed = (self.smoothed * 7 + adjusted) / 8;
    }

    /// The probe timeout base (RFC 9002 §6.2.1), without max_ack_delay.
    pub fn pto_base(&self) -> Duration {
        self.smoothed + (self.var * 4).max(GRANULARITY)
    }

    /// Loss delay for time-threshold detection (RFC 9002 §6.1.2): `eighths`/8 of
    /// max(srtt, latest); RFC 9002 uses 9/8.
    pub fn loss_delay(&self, eighths: u32) -> Duration {
        (self.smoothed.max(self.latest) * eighths / 8).max(GRANULARITY)
    }

    /// RFC 9002 §5.2: after persistent congestion, min_rtt restarts from the latest sample.
    pub fn on_persistent_congestion(&mut self) {
        self.min = self.latest;
    }

    /// Forgets samples, e.g. after migrating to a new path (RFC 9000 §9.4).
    pub fn reset(&mut self) {
        *self = Self::new(self.initial);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_sample_and_smoothing() {
        let mut r = RttEstimator::new(Duration::from_millis(333));
        assert!(!r.has_sample());
        r.update(Duration::ZERO, Duration::from_millis(100));
        assert_eq!(r.smoothed(), Duration::from_millis(100));
        assert_eq!(r.var(), Duration::from_millis(50));
        r.update(Duration::from_millis(10), Duration::from_millis(120));
        // adjusted = 110; srtt = (700 + 110) / 8 = 101.25
        assert_eq!(r.smoothed(), Duration::from_micros(101_250));
        assert_eq!(r.min(), Duration::from_millis(100));
        // An ack delay that would push the sample below min_rtt is ignored.
        r.update(Duration::from_millis(50), Duration::from_millis(120));
        assert_eq!(r.latest(), Duration::from_millis(120));
    }
}
