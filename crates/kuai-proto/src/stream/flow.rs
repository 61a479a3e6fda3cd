//! Receive-window management with auto-tuning (RFC 9000 §4.2).

use std::time::{Duration, Instant};

/// A receive window: the limit advertised to the peer and how it moves as the application
/// consumes data.
///
/// The window starts at the configured initial size. Each time the application has read
/// half a window, if it took less than two round trips to do so, it reads faster than one
/// window per round trip allows, so the window doubles (up to `cap`): the feedback loop TCP
/// receive-buffer auto-tuning uses. Only the application's reads count: credit the peer
/// gives back itself (a reset stream's final size, data on a stopped stream) and updates it
/// asks for (DATA_BLOCKED, STREAM_DATA_BLOCKED) or that were lost and sent again say nothing
/// about the reader, and a sender could otherwise grow the window to the cap with nothing
/// read (memory it then fills on its own say-so).
#[derive(Debug, Clone)]
pub struct RecvWindow {
    /// Limit advertised to the peer (absolute offset).
    max: u64,
    /// Current window size.
    window: u64,
    /// Largest window auto-tuning may reach.
    cap: u64,
    /// When the application last completed half a window of reading, and how much it had
    /// read then.
    mark: Option<(Instant, u64)>,
}

/// The longest round trip the growth test counts: a peer that holds its acknowledgments
/// back inflates the estimate, and would make a slow reader look fast.
const MAX_GROWTH_RTT: Duration = Duration::from_secs(1);

impl RecvWindow {
    pub fn new(initial: u64, cap: u64) -> Self {
        Self {
            max: initial,
            window: initial,
            cap: cap.max(initial),
            mark: None,
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

    /// Moves the limit to `consumed + window` (`consumed`: all credit given back, reads and
    /// what resets and stops released), auto-tuning first by what the application itself
    /// has `read` (unless `grow` is false); returns the new limit.
    pub fn update(
        &mut self,
        consumed: u64,
        read: u64,
        now: Instant,
        rtt: Duration,
        grow: bool,
    ) -> u64 {
        match self.mark {
            None => self.mark = Some((now, read)),
            Some((at, from)) if read.saturating_sub(from) >= self.window / 2 => {
                if grow
                    && now.saturating_duration_since(at) < rtt.min(MAX_GROWTH_RTT) * 2
                    && self.window < self.cap
                {
                    self.window = (self.window * 2).min(self.cap);
                }
                self.mark = Some((now, read));
            }
            Some(_) => {}
        }
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
        let ms = |n| t0 + Duration::from_millis(n);
        let rtt = Duration::from_millis(50);
        let mut w = RecvWindow::new(1000, 8000);
        assert!(!w.wants_update(400));
        assert!(w.wants_update(600));
        assert_eq!(w.update(600, 600, t0, rtt, true), 1600);
        // The next half window read within 2 RTT: the window doubles.
        assert_eq!(w.update(1200, 1200, ms(60), rtt, true), 3200);
        assert_eq!(w.window(), 2000);
        // A slow reader: no growth.
        assert_eq!(w.update(2200, 2200, ms(5000), rtt, true), 4200);
        assert_eq!(w.window(), 2000);
        // Updates the peer asks for (it says it is blocked), however often, while the
        // application reads nothing: no growth.
        for i in 0..10 {
            w.update(2200, 2200, ms(5001 + i), rtt, true);
        }
        assert_eq!((w.window(), w.max()), (2000, 4200));
        // Credit the peer gives back itself (a reset stream's final size) is not reading:
        // the limit moves, the window does not grow.
        w.update(3300, 2200, ms(5020), rtt, true);
        w.update(4400, 2200, ms(5030), rtt, true);
        assert_eq!((w.window(), w.max()), (2000, 6400));
        // Nor does a slow reader whose last half window came just after an update the peer
        // asked for: the time counts from the reader's last half window.
        w.update(4400, 3200, ms(9000), rtt, true);
        w.update(4400, 3200, ms(9950), rtt, true);
        w.update(4400, 4200, ms(10_000), rtt, true);
        assert_eq!(w.window(), 2000);
        // Half a window read within two round trips each time: it doubles up to the cap.
        let mut read = 4200;
        for i in 1..=4 {
            read += w.window() / 2;
            w.update(read, read, ms(10_000 + 10 * i), rtt, true);
        }
        assert_eq!(w.window(), 8000);
        assert_eq!(w.max(), read + 8000);
        // Under memory pressure: shrunk, and no growth however fast the reads.
        w.set_window(1000);
        let granted = w.max();
        let t1 = ms(20_000);
        assert_eq!(w.update(read + 10, read + 10, t1, rtt, false), granted, "granted credit stays");
        assert_eq!(w.update(granted, granted, t1, rtt, false), granted + 1000);
        assert_eq!(
            w.update(granted + 600, granted + 600, ms(20_001), rtt, false),
            granted + 1600
        );
        assert_eq!(w.window(), 1000);
        // A round trip the peer inflated (its acknowledgments held back) counts 1 s at most.
        let mut w = RecvWindow::new(1000, 8000);
        w.update(600, 600, t0, Duration::from_secs(30), true);
        w.update(1200, 1200, ms(2500), Duration::from_secs(30), true);
        assert_eq!(w.window(), 1000);
    }
}
