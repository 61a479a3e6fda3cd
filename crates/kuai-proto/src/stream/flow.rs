//! Receive-window management with auto-tuning (RFC 9000 §4.2).

use std::time::{Duration, Instant};

/// A receive window: the limit advertised to the peer and how it moves as the application
/// consumes data.
///
/// The window starts at the configured initial size. Each time an update is sent, if the
/// previous update went out less than two round trips ago, the application is reading faster
/// than one window per RTT allows, so the window doubles (up to `cap`). This is the same
/// feedback loop TCP receive-buffer auto-tuning uses.
#[derive(Debug, Clone)]
pub struct RecvWindow {
    /// Limit advertised to the peer (absolute offset).
    max: u64,
    /// Current window size.
    window: u64,
    /// Largest window auto-tuning may reach.
    cap: u64,
    last_update: Option<Instant>,
}

impl RecvWindow {
    pub fn new(initial: u64, cap: u64) -> Self {
        Self {
            max: initial,
            window: initial,
            cap: cap.max(initial),
            last_update: None,
        }
    }

    /// The limit currently advertised.
    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn window(&self) -> u64 {
        self.window
    }

    /// Whether an update should be sent now that the application consumed up to `consumed`:
    /// when less than half the window is left.
    pub fn wants_update(&self, consumed: u64) -> bool {
        self.max.saturating_sub(consumed) < self.window / 2 && consumed + self.window > self.max
    }

    /// Moves the limit to `consumed + window`, auto-tuning first unless `grow` is false;
    /// returns the new limit.
    pub fn update(&mut self, consumed: u64, now: Instant, rtt: Duration, grow: bool) -> u64 {
        // Only an update the reader's own progress called for (half the window consumed)
        // grows the window: one the peer asked for (DATA_BLOCKED, STREAM_DATA_BLOCKED) or a
        // lost update sent again says nothing about how fast the application reads, and a
        // peer repeating DATA_BLOCKED would otherwise double the window up to the cap while
        // nothing is read (memory the peer fills on its own say-so).
        if grow
            && self.wants_update(consumed)
            && let Some(last) = self.last_update
            && now.saturating_duration_since(last) < rtt * 2
            && self.window < self.cap
        {
            self.window = (self.window * 2).min(self.cap);
        }
        self.last_update = Some(now);
        self.max = self.max.max(consumed + self.window);
        self.max
    }

    /// Shrinks the window (memory pressure); the advertised limit never goes back.
    pub fn set_window(&mut self, window: u64) {
        self.window = window.min(self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_when_read_fast() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(50);
        let mut w = RecvWindow::new(1000, 8000);
        assert!(!w.wants_update(400));
        assert!(w.wants_update(600));
        assert_eq!(w.update(600, t0, rtt, true), 1600);
        // Next update within 2 RTT: window doubles.
        assert_eq!(
            w.update(1200, t0 + Duration::from_millis(60), rtt, true),
            3200
        );
        assert_eq!(w.window(), 2000);
        // Slow reader: no growth.
        assert_eq!(w.update(2000, t0 + Duration::from_secs(5), rtt, true), 4000);
        assert_eq!(w.window(), 2000);
        // Updates the peer asks for (it says it is blocked), however often, while the
        // application reads nothing: no growth.
        for i in 0..10 {
            w.update(
                2000,
                t0 + Duration::from_secs(5) + Duration::from_millis(i),
                rtt,
                true,
            );
        }
        assert_eq!(w.window(), 2000);
        assert_eq!(w.max(), 4000);
        // Half a window read within two round trips each time: it doubles up to the cap.
        let mut consumed = 2000;
        for i in 1..=4 {
            consumed = w.max() - w.window() / 2 + 1;
            assert!(w.wants_update(consumed));
            w.update(
                consumed,
                t0 + Duration::from_secs(5) + Duration::from_millis(10 + i),
                rtt,
                true,
            );
        }
        assert_eq!(w.window(), 8000);
        assert_eq!(w.max(), consumed + 8000);
        // Under memory pressure: shrunk, and no growth however fast the reads.
        w.set_window(1000);
        let t1 = t0 + Duration::from_secs(6);
        let granted = w.max();
        assert_eq!(w.update(consumed + 10, t1, rtt, false), granted, "granted credit stays");
        assert_eq!(w.update(granted, t1, rtt, false), granted + 1000);
        assert_eq!(
            w.update(granted + 600, t1 + Duration::from_millis(1), rtt, false),
            granted + 1600
        );
        assert_eq!(w.window(), 1000);
    }
}
