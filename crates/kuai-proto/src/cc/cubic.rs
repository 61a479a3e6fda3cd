//! CUBIC (RFC 9438) with HyStart++ (RFC 9406) for the first slow start.
//!
//! The window is kept in bytes; the cubic function works in segments of the path's datagram
//! size, as the RFC writes it, and its results are turned back into bytes. Growth is counted
//! in acknowledged bytes (the RFC's note on Appropriate Byte Counting, §4.3).

use std::time::{Duration, Instant};

use super::{AckEvent, CongestionController, LossEvent, initial_window, minimum_window};

/// RFC 9438 §5.1: C = 0.4 (segments / second³).
const C: f64 = 0.4;
/// RFC 9438 §4.6: β_cubic = 0.7 (as a fraction for the window cut, exact in integers).
const BETA: f64 = 0.7;
const BETA_NUM: u64 = 7;
const BETA_DEN: u64 = 10;
/// RFC 9438 §4.3: α_cubic = 3 (1 − β) / (1 + β), the Reno-friendly additive increase.
const ALPHA: f64 = 3.0 * (1.0 - BETA) / (1.0 + BETA);

/// RFC 9406 §4.3 constants.
const MIN_RTT_THRESH: Duration = Duration::from_millis(4);
const MAX_RTT_THRESH: Duration = Duration::from_millis(16);
const MIN_RTT_DIVISOR: u32 = 8;
const N_RTT_SAMPLE: u32 = 8;
const CSS_GROWTH_DIVISOR: u64 = 4;
const CSS_ROUNDS: u32 = 5;

/// CUBIC's switches. Both are on by default, as RFC 9438 recommends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CubicOptions {
    /// Fast convergence (RFC 9438 §4.7): after a loss below the previous maximum, plateau
    /// earlier to leave room for a new flow.
    pub fast_convergence: bool,
    /// HyStart++ (RFC 9406) for the first slow start; standard slow start otherwise.
    pub hystart: bool,
}

impl Default for CubicOptions {
    fn default() -> Self {
        Self {
            fast_convergence: true,
            hystart: true,
        }
    }
}

/// Where HyStart++ is in the first slow start (RFC 9406 §4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hystart {
    /// Standard slow start, watching each round's minimum RTT.
    SlowStart,
    /// Conservative Slow Start, entered when the RTT rose; counts its rounds.
    Css { rounds: u32, baseline: Duration },
    /// Done: the first slow start is over (or HyStart++ is off).
    Off,
}

/// The state a spurious congestion event restores (RFC 9438 §4.9.2).
#[derive(Clone, Copy, Debug)]
struct Undo {
    window: u64,
    cwnd_prior: u64,
    ssthresh: u64,
    w_max: f64,
    k: f64,
    epoch: Option<Instant>,
    w_est: f64,
}

#[derive(Debug, Clone)]
/// CUBIC (RFC 9438) with HyStart++ (RFC 9406) in the first slow start.
pub struct Cubic {
    options: CubicOptions,
    max_datagram_size: u64,
    window: u64,
    ssthresh: u64,
    recovery_start: Option<Instant>,

    // RFC 9438 §4.1.2, all in bytes.
    /// cwnd_prior: the window when ssthresh was last set.
    cwnd_prior: u64,
    /// W_max: the window before the last reduction, lowered by fast convergence.
    w_max: f64,
    /// K in seconds.
    k: f64,
    /// t_epoch, when the current congestion-avoidance stage began, moved forward by the time
    /// the flow was application-limited or idle; `None` until the stage's first ACK.
    epoch: Option<Instant>,
    /// W_est, the Reno-friendly estimate.
    w_est: f64,
    /// Growth owed but not yet a whole byte.
    carry: f64,
    /// The first stage after persistent congestion uses K = 0 and W_max = its start
    /// (RFC 9438 §4.8).
    after_timeout: bool,
    /// When t was last brought up to date: an ACK, or the end of an idle period.
    last_time: Option<Instant>,

    undo: Option<Undo>,

    // HyStart++ (RFC 9406 §4.2).
    hystart: Hystart,
    delivered: u64,
    next_round_delivered: u64,
    last_round_min_rtt: Option<Duration>,
    current_round_min_rtt: Option<Duration>,
    rtt_sample_count: u32,
}

impl Cubic {
    /// A controller for datagrams of `max_datagram_size` bytes.
    pub fn new(max_datagram_size: u64, options: CubicOptions) -> Self {
        let window = initial_window(max_datagram_size);
        Self {
            options,
            max_datagram_size,
            window,
            ssthresh: u64::MAX,
            recovery_start: None,
            cwnd_prior: window,
            w_max: 0.0,
            k: 0.0,
            epoch: None,
            w_est: 0.0,
            carry: 0.0,
            after_timeout: false,
            last_time: None,
            undo: None,
            hystart: if options.hystart {
                Hystart::SlowStart
            } else {
                Hystart::Off
            },
            delivered: 0,
            next_round_delivered: 0,
            last_round_min_rtt: None,
            current_round_min_rtt: None,
            rtt_sample_count: 0,
        }
    }

    /// Starts from `bytes` instead of RFC 9002's initial window (at least 2 datagrams).
    pub fn with_initial_window(mut self, bytes: u64) -> Self {
        self.window = bytes.max(2 * self.max_datagram_size);
        self.cwnd_prior = self.window;
        self
    }

    fn in_recovery(&self, sent_time: Instant) -> bool {
        self.recovery_start.is_some_and(|start| sent_time <= start)
    }

    fn mds(&self) -> f64 {
        self.max_datagram_size as f64
    }

    /// W_cubic(t) in bytes (RFC 9438 §4.2, Figure 1): C (t − K)³ + W_max, in segments.
    fn w_cubic(&self, t: f64) -> f64 {
        let d = t - self.k;
        C * d * d * d * self.mds() + self.w_max
    }

    /// Starts a congestion-avoidance stage at `now` from the current window.
    fn start_epoch(&mut self, now: Instant) {
        let cwnd = self.window as f64;
        if self.after_timeout || self.w_max <= cwnd {
            // After a timeout, or leaving slow start without a loss (HyStart++): K = 0 and
            // W_max = the window now (RFC 9438 §4.8, §4.10).
            self.w_max = cwnd;
            self.k = 0.0;
        } else {
            // RFC 9438 §4.2, Figure 2: K = ∛((W_max − cwnd_epoch) / C), in segments.
            self.k = ((self.w_max - cwnd) / self.mds() / C).cbrt();
        }
        self.after_timeout = false;
        self.w_est = cwnd;
        self.carry = 0.0;
        self.epoch = Some(now);
    }

    /// Congestion avoidance for one ACK of `acked` bytes (RFC 9438 §4.2–4.5).
    fn avoid_congestion(&mut self, now: Instant, acked: u64, srtt: Duration) {
        if self.epoch.is_none() {
            self.start_epoch(now);
        }
        let Some(epoch) = self.epoch else { return };
        let cwnd = self.window as f64;
        let t = now.saturating_duration_since(epoch).as_secs_f64();
        // Target after one more round trip, bounded to [cwnd, 1.5 cwnd] (§4.2).
        let target = self.w_cubic(t + srtt.as_secs_f64()).clamp(cwnd, 1.5 * cwnd);
        // Reno-friendly estimate (§4.3, Figure 4); α becomes 1 once W_est reached cwnd_prior.
        let alpha = if self.w_est >= self.cwnd_prior as f64 {
            1.0
        } else {
            ALPHA
        };
        self.w_est += alpha * self.mds() * acked as f64 / cwnd;
        if self.w_cubic(t) < self.w_est {
            // Reno-friendly region: cwnd follows W_est.
            if self.w_est > cwnd {
                self.carry = 0.0;
                self.window = self.w_est as u64;
            }
        } else {
            // Concave and convex regions (§4.4, §4.5): (target − cwnd) / cwnd per segment.
            self.carry += (target - cwnd) * acked as f64 / cwnd;
            if self.carry >= 1.0 {
                let whole = self.carry.floor();
                self.carry -= whole;
                self.window += whole as u64;
            }
        }
    }

    /// Leaves the first slow start with no loss: congestion avoidance from this window.
    fn exit_slow_start(&mut self) {
        self.hystart = Hystart::Off;
        self.ssthresh = self.window;
        self.cwnd_prior = self.window;
        self.epoch = None;
    }

    /// HyStart++'s per-ACK bookkeeping and its delay-increase test (RFC 9406 §4.2).
    fn hystart_on_ack(&mut self, ack: &AckEvent<'_>) {
        let Some(rs) = ack.rate else { return };
        // A round ends when a packet sent after it began is acknowledged.
        if rs.prior_delivered >= self.next_round_delivered {
            self.next_round_delivered = self.delivered;
            self.last_round_min_rtt = self.current_round_min_rtt;
            self.current_round_min_rtt = None;
            self.rtt_sample_count = 0;
            if let Hystart::Css { rounds, baseline } = self.hystart {
                if rounds + 1 >= CSS_ROUNDS {
                    // CSS_ROUNDS rounds of Conservative Slow Start: congestion avoidance.
                    self.exit_slow_start();
                    return;
                }
                self.hystart = Hystart::Css {
                    rounds: rounds + 1,
                    baseline,
                };
            }
        }
        let sample = rs.rtt;
        self.current_round_min_rtt =
            Some(self.current_round_min_rtt.map_or(sample, |m| m.min(sample)));
        self.rtt_sample_count += 1;
        if self.rtt_sample_count < N_RTT_SAMPLE {
            return;
        }
        let Some(current) = self.current_round_min_rtt else {
            return;
        };
        match self.hystart {
            Hystart::SlowStart => {
                let Some(last) = self.last_round_min_rtt else {
                    return;
                };
                let thresh = (last / MIN_RTT_DIVISOR).clamp(MIN_RTT_THRESH, MAX_RTT_THRESH);
                if current >= last + thresh {
                    self.hystart = Hystart::Css {
                        rounds: 0,
                        baseline: current,
                    };
                }
            }
            Hystart::Css { baseline, .. } => {
                if current < baseline {
                    // The RTT came back down: the rise was not the queue filling.
                    self.hystart = Hystart::SlowStart;
                }
            }
            Hystart::Off => {}
        }
    }

    /// Moves t_epoch forward by the time since t was last brought up to date, so that t
    /// leaves out application-limited and idle periods (RFC 9438 §4.2, §5.8).
    fn freeze_epoch(&mut self, now: Instant) {
        if let (Some(epoch), Some(last)) = (self.epoch.as_mut(), self.last_time) {
            *epoch += now.saturating_duration_since(last);
        }
    }

    /// W_max in bytes, for tests.
    #[cfg(test)]
    fn w_max(&self) -> f64 {
        self.w_max
    }
}

impl CongestionController for Cubic {
    fn on_packet_sent(&mut self, now: Instant, bytes: u64, bytes_in_flight: u64) {
        if bytes_in_flight <= bytes {
            // Sending again after the flight had drained: the idle time is not growth time.
            self.freeze_epoch(now);
            self.last_time = Some(now);
        }
    }

    fn on_ack(&mut self, now: Instant, ack: &AckEvent<'_>) {
        self.delivered += ack.acked_bytes;
        let in_slow_start = self.window < self.ssthresh;
        if in_slow_start && self.hystart != Hystart::Off {
            self.hystart_on_ack(ack);
        }
        // RFC 9002 §7.3.2: acknowledging a packet sent after recovery began ends recovery.
        if self.in_recovery(ack.largest_acked_sent_time) {
            self.last_time = Some(now);
            return;
        }
        self.recovery_start = None;
        // RFC 9002 §7.8 and RFC 9438 §5.8: no growth, and no growth time, while the
        // application, not the window, limits the flow.
        if ack.app_limited {
            self.freeze_epoch(now);
            self.last_time = Some(now);
            return;
        }
        self.last_time = Some(now);
        if self.window < self.ssthresh {
            match self.hystart {
                Hystart::Css { .. } => self.window += ack.acked_bytes / CSS_GROWTH_DIVISOR,
                _ => self.window += ack.acked_bytes,
            }
            return;
        }
        self.avoid_congestion(now, ack.acked_bytes, ack.rtt.smoothed());
    }

    fn on_congestion_event(&mut self, now: Instant, loss: &LossEvent) {
        if loss.ecn_ce {
            // A CE mark is no loss that could turn out spurious: what it reduces stays.
            self.undo = None;
        }
        if self.in_recovery(loss.largest_sent_time) {
            return;
        }
        self.recovery_start = Some(now);
        // RFC 9406 §4.2: a loss in slow start or CSS ends HyStart++.
        self.hystart = Hystart::Off;
        self.undo = (!loss.ecn_ce).then_some(Undo {
            window: self.window,
            cwnd_prior: self.cwnd_prior,
            ssthresh: self.ssthresh,
            w_max: self.w_max,
            k: self.k,
            epoch: self.epoch,
            w_est: self.w_est,
        });
        let cwnd = self.window as f64;
        // Fast convergence (RFC 9438 §4.7) sets W_max from the window before the reduction:
        // cwnd (1 + β) / 2 when this loss came below the previous maximum.
        self.w_max = if self.options.fast_convergence && cwnd < self.w_max {
            cwnd * (1.0 + BETA) / 2.0
        } else {
            cwnd
        };
        // Multiplicative decrease (§4.6), from cwnd rather than flight size: the window does
        // not grow while application-limited (RFC 9002 §7.8), as §4.6 requires then.
        self.cwnd_prior = self.window;
        self.ssthresh =
            (self.window * BETA_NUM / BETA_DEN).max(minimum_window(self.max_datagram_size));
        self.window = self.ssthresh;
        self.epoch = None;
        self.carry = 0.0;
    }

    fn on_persistent_congestion(&mut self, _now: Instant) {
        // RFC 9002 §7.6.2 and RFC 9438 §4.8: the minimum window, and the next stage starts
        // with K = 0.
        self.window = minimum_window(self.max_datagram_size);
        self.recovery_start = None;
        self.epoch = None;
        self.after_timeout = true;
        self.carry = 0.0;
        self.undo = None;
    }

    fn on_spurious_congestion_event(&mut self) {
        // RFC 9438 §4.9.2: restore what the event changed, unless the window has already
        // grown back past where it was.
        let Some(u) = self.undo.take() else { return };
        if self.window < self.cwnd_prior {
            self.window = u.window;
            self.cwnd_prior = u.cwnd_prior;
            self.ssthresh = u.ssthresh;
            self.w_max = u.w_max;
            self.k = u.k;
            self.epoch = u.epoch;
            self.w_est = u.w_est;
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
        "cubic"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cc::RateSample;
    use crate::recovery::RttEstimator;

    const MDS: u64 = 1200;

    struct Sim {
        cc: Cubic,
        now: Instant,
        rtt: RttEstimator,
        delivered: u64,
    }

    impl Sim {
        fn new(options: CubicOptions) -> Self {
            let mut rtt = RttEstimator::new(Duration::from_millis(100));
            rtt.update(Duration::ZERO, Duration::from_millis(100));
            Self {
                cc: Cubic::new(MDS, options),
                now: Instant::now(),
                rtt,
                delivered: 0,
            }
        }

        /// One ACK of `bytes`, the newest packet sent `sample` ago at `prior_delivered`.
        fn ack_with(&mut self, bytes: u64, sample: Duration, prior_delivered: u64, limited: bool) {
            self.delivered += bytes;
            let rate = RateSample {
                delivered: bytes,
                interval: sample,
                prior_delivered,
                is_app_limited: limited,
                rtt: sample,
            };
            let ev = AckEvent {
                acked_bytes: bytes,
                largest_acked_sent_time: self.now,
                rtt: &self.rtt,
                rate: Some(rate),
                prior_in_flight: 0,
                bytes_in_flight: 0,
                app_limited: limited,
            };
            self.cc.on_ack(self.now, &ev);
        }

        fn ack(&mut self, bytes: u64) {
            let d = self.delivered;
            self.ack_with(bytes, Duration::from_millis(100), d, false);
        }

        fn loss(&mut self) {
            let ev = LossEvent {
                largest_sent_time: self.now,
                lost_bytes: MDS,
                ecn_ce: false,
                bytes_in_flight: 0,
                latest_rtt: None,
            };
            self.now += Duration::from_millis(1);
            self.cc.on_congestion_event(self.now, &ev);
            self.now += Duration::from_millis(1);
        }

        fn advance(&mut self, d: Duration) {
            self.now += d;
        }

        /// Slow start, one ACK per datagram, up to `segments` datagrams of window.
        fn grow_to(&mut self, segments: u64) {
            while self.cc.window() < segments * MDS {
                self.ack(MDS);
            }
        }

        /// Congestion avoidance, one ACK per datagram every 5 ms, up to `segments`.
        fn avoid_to(&mut self, segments: u64) {
            while self.cc.window() < segments * MDS {
                self.advance(Duration::from_millis(5));
                self.ack(MDS);
            }
        }

        /// One round trip of window-limited ACKs, one per datagram.
        fn round(&mut self) {
            let n = self.cc.window() / MDS;
            let step = Duration::from_millis(100) / n.max(1) as u32;
            for _ in 0..n {
                self.advance(step);
                self.ack(MDS);
            }
        }
    }

    fn no_hystart() -> CubicOptions {
        CubicOptions {
            hystart: false,
            ..CubicOptions::default()
        }
    }

    #[test]
    fn constants_are_the_rfcs() {
        assert!((ALPHA - 0.5294).abs() < 1e-4, "{ALPHA}");
        assert_eq!(BETA, 0.7);
        assert_eq!(C, 0.4);
    }

    #[test]
    fn loss_cuts_to_beta_and_sets_k_from_the_formula() {
        let mut s = Sim::new(no_hystart());
        // Slow start to 100 segments.
        s.grow_to(100);
        assert_eq!(s.cc.window(), 100 * MDS);
        s.loss();
        // β = 0.7 of the window, W_max the window before (no previous maximum).
        assert_eq!(s.cc.window(), 70 * MDS);
        assert_eq!(s.cc.ssthresh(), Some(70 * MDS));
        assert_eq!(s.cc.w_max(), (100 * MDS) as f64);
        // The first ACK after recovery starts the stage: K = ∛((100 − 70) / 0.4) segments.
        s.advance(Duration::from_millis(10));
        s.ack(MDS);
        let k = (30.0f64 / 0.4).cbrt();
        assert!((s.cc.k - k).abs() < 1e-9, "K {} want {k}", s.cc.k);
        assert!((k - 4.217).abs() < 1e-3);
    }

    #[test]
    fn fast_convergence_applies_beta_once() {
        let mut s = Sim::new(no_hystart());
        s.grow_to(100);
        s.loss();
        // Grow a little, to 80 segments, then lose again below the old maximum of 100.
        s.avoid_to(80);
        let before = s.cc.window();
        s.loss();
        // W_max = cwnd (1 + β) / 2 = 85 % of the window before; the window itself is cut to
        // exactly β = 70 % (not 0.7 × 0.85 = 59.5 %).
        assert!((s.cc.w_max() - before as f64 * 0.85).abs() < 1.0);
        assert_eq!(s.cc.window(), before * 7 / 10);

        // Without fast convergence W_max is the window before the loss.
        let mut s = Sim::new(CubicOptions {
            fast_convergence: false,
            hystart: false,
        });
        s.grow_to(100);
        s.loss();
        s.avoid_to(80);
        let before = s.cc.window() as f64;
        s.loss();
        assert_eq!(s.cc.w_max(), before);
    }

    #[test]
    fn window_follows_the_cubic_curve_back_to_w_max_in_k_seconds() {
        // A large window, where the cubic region dominates the Reno-friendly one.
        let mut s = Sim::new(no_hystart());
        s.grow_to(1000);
        s.loss();
        let k = (300.0f64 / 0.4).cbrt(); // 9.09 s
        // ACKs every 10 ms for K seconds; the window is limited to [cwnd, 1.5 cwnd] targets.
        s.advance(Duration::from_millis(10));
        s.ack(MDS);
        let start = s.now;
        let mut at_half = 0;
        // A window's worth of ACKs per 100 ms round trip, every 10 ms.
        while s.now < start + Duration::from_secs_f64(k) {
            s.advance(Duration::from_millis(10));
            let w = s.cc.window();
            s.ack(w / 10);
            if at_half == 0 && s.now >= start + Duration::from_secs_f64(k / 2.0) {
                at_half = s.cc.window();
            }
        }
        let w = s.cc.window() as f64 / MDS as f64;
        // At t = K the curve is at W_max = 1000 segments (targets run one RTT ahead).
        assert!((990.0..=1010.0).contains(&w), "window at K: {w} segments");
        // Concave: at K/2 the curve is C (K/2)³ below W_max = 1000 − 300/8 = 962.5 segments.
        let half = at_half as f64 / MDS as f64;
        let want = 1000.0 - 0.4 * (k / 2.0).powi(3);
        assert!((half - want).abs() < 12.0, "at K/2: {half} want {want}");
    }

    #[test]
    fn reno_friendly_region_grows_like_aimd() {
        // A small window on a short RTT: W_est outgrows the cubic curve.
        let mut s = Sim::new(no_hystart());
        s.rtt = RttEstimator::new(Duration::from_millis(10));
        s.rtt.update(Duration::ZERO, Duration::from_millis(10));
        s.grow_to(20);
        s.loss();
        assert_eq!(s.cc.window(), 14 * MDS);
        // 10 round trips of 10 ms, one ACK per segment. W_est gains α segments per window
        // acknowledged (≈ 0.53 per round trip), the cubic curve only ∛-slowly at first.
        for _ in 0..10 {
            let n = s.cc.window() / MDS;
            for _ in 0..n {
                s.advance(Duration::from_millis(10) / n as u32);
                s.ack(MDS);
            }
        }
        let w = s.cc.window() as f64 / MDS as f64;
        let cubic = s.cc.w_cubic(0.1) / MDS as f64;
        assert!(
            w > cubic,
            "window {w} should exceed the cubic curve {cubic}"
        );
        // 14 + 10 × 0.53 ≈ 19.3 segments, within rounding of whole ACKs.
        assert!((18.5..=20.0).contains(&w), "{w}");
    }

    #[test]
    fn application_limited_time_does_not_count() {
        let mut s = Sim::new(no_hystart());
        s.grow_to(1000);
        s.loss();
        s.advance(Duration::from_millis(10));
        s.ack(MDS);
        let w0 = s.cc.window();
        // 20 s of application-limited ACKs: no growth, and t stays where it was.
        for _ in 0..2000 {
            s.advance(Duration::from_millis(10));
            let d = s.delivered;
            s.ack_with(MDS, Duration::from_millis(100), d, true);
        }
        assert_eq!(s.cc.window(), w0);
        // Then window-limited again: the next ACK's target is near the start of the curve,
        // not 20 s along it (1.5 cwnd, which would add half the acknowledged bytes: 600).
        s.advance(Duration::from_millis(10));
        s.ack(MDS);
        assert!(s.cc.window() - w0 < 100, "{} after {w0}", s.cc.window());
        // Idle time (nothing in flight, then a send) does not count either.
        s.advance(Duration::from_secs(30));
        s.cc.on_packet_sent(s.now, MDS, MDS);
        s.advance(Duration::from_millis(100));
        let before = s.cc.window();
        s.ack(MDS);
        assert!(
            s.cc.window() - before < 100,
            "{} after {before}",
            s.cc.window()
        );
    }

    #[test]
    fn spurious_loss_is_undone() {
        let mut s = Sim::new(no_hystart());
        s.grow_to(100);
        s.loss();
        assert_eq!(s.cc.window(), 70 * MDS);
        s.cc.on_spurious_congestion_event();
        assert_eq!(s.cc.window(), 100 * MDS);
        assert_eq!(s.cc.ssthresh(), None);
        assert_eq!(s.cc.w_max(), 0.0);
        // Only once.
        s.cc.on_spurious_congestion_event();
        assert_eq!(s.cc.window(), 100 * MDS);
    }

    #[test]
    fn an_ecn_reduction_is_not_undone() {
        let mut s = Sim::new(no_hystart());
        s.grow_to(100);
        let ce = LossEvent {
            largest_sent_time: s.now,
            lost_bytes: 0,
            ecn_ce: true,
            bytes_in_flight: 0,
            latest_rtt: None,
        };
        s.now += Duration::from_millis(1);
        s.cc.on_congestion_event(s.now, &ce);
        assert_eq!(s.cc.window(), 70 * MDS);
        s.cc.on_spurious_congestion_event();
        assert_eq!(s.cc.window(), 70 * MDS);
        // A loss reduction followed within its recovery period by CE: not undone either.
        let mut s = Sim::new(no_hystart());
        s.grow_to(100);
        s.loss();
        let ce = LossEvent {
            largest_sent_time: s.now - Duration::from_millis(1),
            ..ce
        };
        s.cc.on_congestion_event(s.now, &ce);
        s.cc.on_spurious_congestion_event();
        assert_eq!(s.cc.window(), 70 * MDS);
    }

    #[test]
    fn persistent_congestion_restarts_with_k_zero() {
        let mut s = Sim::new(no_hystart());
        s.grow_to(100);
        s.loss();
        s.cc.on_persistent_congestion(s.now);
        assert_eq!(s.cc.window(), 2 * MDS);
        // Slow start back to ssthresh, then a stage with W_max = its start and K = 0.
        s.grow_to(70);
        s.ack(MDS);
        assert_eq!(s.cc.k, 0.0);
        assert_eq!(s.cc.w_max(), (70 * MDS) as f64);
    }

    #[test]
    fn hystart_leaves_slow_start_when_the_rtt_rises() {
        let mut s = Sim::new(CubicOptions::default());
        // Rounds of 100 ms samples, then a round whose RTT is 100 + 12.5 = 112.5 ms or more
        // (threshold: min(100 / 8, 16) = 12.5 ms).
        let mut rtt = Duration::from_millis(100);
        for round in 0..6 {
            if round == 4 {
                rtt = Duration::from_millis(113);
            }
            let start = s.delivered;
            let n = s.cc.window() / MDS;
            for _ in 0..n {
                s.advance(Duration::from_millis(1));
                s.ack_with(MDS, rtt, start, false);
            }
            // A packet sent after the round began ends it.
            if round < 3 {
                assert!(matches!(s.cc.hystart, Hystart::SlowStart), "round {round}");
            }
        }
        assert!(
            matches!(s.cc.hystart, Hystart::Css { .. }),
            "{:?}",
            s.cc.hystart
        );
        // In CSS the window grows by a quarter of what is acknowledged.
        let w = s.cc.window();
        let same_round = s.cc.next_round_delivered - 1;
        s.ack_with(4 * MDS, rtt, same_round, false);
        assert_eq!(s.cc.window(), w + MDS);
        // CSS_ROUNDS rounds later: congestion avoidance with ssthresh = cwnd, K = 0.
        for _ in 0..6 {
            let start = s.delivered;
            for _ in 0..8 {
                s.advance(Duration::from_millis(1));
                s.ack_with(MDS, rtt, start, false);
            }
        }
        assert_eq!(s.cc.hystart, Hystart::Off);
        assert!(!s.cc.in_slow_start());
        assert_eq!(s.cc.ssthresh(), Some(s.cc.cwnd_prior));
    }

    #[test]
    fn hystart_resumes_slow_start_when_the_rtt_falls_back() {
        let mut s = Sim::new(CubicOptions::default());
        let rtts = [100, 100, 100, 120, 90];
        for &ms in &rtts {
            let start = s.delivered;
            for _ in 0..10 {
                s.advance(Duration::from_millis(1));
                s.ack_with(MDS, Duration::from_millis(ms), start, false);
            }
        }
        assert_eq!(s.cc.hystart, Hystart::SlowStart);
        assert!(s.cc.in_slow_start());
    }

    #[test]
    fn hystart_needs_eight_samples_a_round() {
        let mut s = Sim::new(CubicOptions::default());
        for &ms in &[100, 100, 150, 150] {
            let start = s.delivered;
            for _ in 0..7 {
                s.advance(Duration::from_millis(1));
                s.ack_with(MDS, Duration::from_millis(ms), start, false);
            }
        }
        assert_eq!(s.cc.hystart, Hystart::SlowStart);
    }

    #[test]
    fn loss_ends_hystart_and_later_slow_starts_are_standard() {
        let mut s = Sim::new(CubicOptions::default());
        s.round();
        s.loss();
        assert_eq!(s.cc.hystart, Hystart::Off);
        s.cc.on_persistent_congestion(s.now);
        let w = s.cc.window();
        s.ack(MDS);
        assert_eq!(s.cc.window(), w + MDS);
    }
}
