//! Congestion control behind one trait.
//!
//! Built-in algorithms are dispatched through the [`Congestion`] enum (no virtual call on the hot
//! path); a user's own algorithm plugs in through [`CongestionController`] and
//! [`ControllerFactory`] and lives in the `Custom` variant.

mod bbr;
mod cubic;
mod new_reno;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use bbr::{Bbr, BbrOptions, LossResponse};
pub use cubic::{Cubic, CubicOptions};
pub use new_reno::NewReno;

use crate::recovery::RttEstimator;

/// A delivery-rate sample (draft-cheng-iccrg-delivery-rate-estimation), computed from the
/// newest packet an ACK newly acknowledged.
#[derive(Debug, Clone, Copy)]
pub struct RateSample {
    /// Bytes delivered during `interval`.
    pub delivered: u64,
    /// The elapsed time the sample covers.
    pub interval: Duration,
    /// Total bytes delivered on the path when the sampled packet was sent.
    pub prior_delivered: u64,
    /// Whether the sender was application-limited when the sampled packet was sent; such a
    /// sample underestimates the bottleneck and must not lower a bandwidth estimate.
    pub is_app_limited: bool,
    /// RTT of the sampled packet.
    pub rtt: Duration,
}

impl RateSample {
    /// Bytes per second; `None` for an empty interval.
    pub fn rate(&self) -> Option<u64> {
        let us = self.interval.as_micros();
        if us == 0 {
            return None;
        }
        Some((u128::from(self.delivered) * 1_000_000 / us).min(u128::from(u64::MAX)) as u64)
    }
}

/// What one ACK frame did, from the point of view of one path's controller.
#[derive(Debug, Clone, Copy)]
pub struct AckEvent<'a> {
    /// Bytes of in-flight packets newly acknowledged by this ACK.
    pub acked_bytes: u64,
    /// Send time of the newest packet this ACK newly acknowledged.
    pub largest_acked_sent_time: Instant,
    /// RTT state after this ACK's sample (if any) was taken.
    pub rtt: &'a RttEstimator,
    /// Delivery-rate sample, when the ACK yielded one.
    pub rate: Option<RateSample>,
    /// Bytes in flight before this ACK was processed.
    pub prior_in_flight: u64,
    /// Bytes in flight after it.
    pub bytes_in_flight: u64,
    /// Whether the sender used less than the window since the last ACK (RFC 9002 §7.8): the
    /// window should not grow then.
    pub app_limited: bool,
}

/// Packets declared lost, or an ECN-CE increase.
#[derive(Debug, Clone, Copy)]
pub struct LossEvent {
    /// Send time of the newest packet that triggered the event; a controller reacts at most
    /// once per round trip by comparing it to the start of its recovery period.
    pub largest_sent_time: Instant,
    /// Bytes declared lost (0 for an ECN-CE signal).
    pub lost_bytes: u64,
    /// True when the signal is an ECN-CE increase rather than loss.
    pub ecn_ce: bool,
    /// Bytes in flight after removing the lost packets.
    pub bytes_in_flight: u64,
    /// The path's newest RTT sample (RFC 9002 §5.1 latest_rtt, ack delay included), `None`
    /// before the first. A receiver acknowledges at once when it sees a gap (RFC 9000
    /// §13.2.1), so at a loss this is usually the queue the packets after the lost one met.
    pub latest_rtt: Option<Duration>,
}

/// A congestion controller for one path. Implement this to bring your own algorithm.
///
/// All sizes are bytes; `max_datagram_size` is the path's current UDP payload size.
pub trait CongestionController: Send + fmt::Debug {
    /// A packet counted in flight was sent.
    fn on_packet_sent(&mut self, now: Instant, bytes: u64, bytes_in_flight: u64);

    /// An ACK acknowledged in-flight packets.
    fn on_ack(&mut self, now: Instant, ack: &AckEvent<'_>);

    /// Packets were lost or ECN-CE was reported (RFC 9002 §7.3.2).
    fn on_congestion_event(&mut self, now: Instant, loss: &LossEvent);

    /// Persistent congestion was established (RFC 9002 §7.6); collapse to the minimum window.
    fn on_persistent_congestion(&mut self, now: Instant);

    /// A congestion event turned out to be spurious (the "lost" packets were acknowledged).
    /// Controllers that can undo a reduction do it here; the default ignores it.
    fn on_spurious_congestion_event(&mut self) {}

    /// The path's datagram size changed (DPLPMTUD).
    fn on_mtu_update(&mut self, max_datagram_size: u64);

    /// Congestion window in bytes.
    fn window(&self) -> u64;

    /// Pacing rate in bytes per second, if the algorithm sets one; otherwise the pacer derives
    /// a rate from the window and smoothed RTT (RFC 9002 §7.7).
    fn pacing_rate(&self) -> Option<u64> {
        None
    }

    /// Slow-start threshold, for statistics; `None` while unset.
    fn ssthresh(&self) -> Option<u64> {
        None
    }

    /// Whether the controller is in slow start, for statistics.
    fn in_slow_start(&self) -> bool {
        false
    }

    /// What the path was seen to carry, in bytes, and the RTT it was measured at, for a later
    /// connection between the same peers to resume from
    /// ([`CongestionController::resume_from`]); `None` when nothing worth keeping was
    /// measured. The default keeps nothing.
    fn resume_window(&self) -> Option<(u64, Duration)> {
        None
    }

    /// Careful Resume (RFC 9959): an earlier connection on this path carried `window` bytes
    /// (0: unknown) at an RTT of `rtt`, losing `loss_permille` of its packets. A controller
    /// may jump to half of it once its own first RTT sample confirms the path, and must
    /// retreat if the jump meets congestion; it may also take the loss rate as the path's
    /// usual random loss. Called before the first packet when the connection has a
    /// [`crate::PathHint`]; the default ignores it.
    fn resume_from(&mut self, window: u64, rtt: Duration, loss_permille: u32) {
        let _ = (window, rtt, loss_permille);
    }

    /// Short algorithm name for logs and qlog ("newreno", "cubic", ...).
    fn name(&self) -> &'static str;
}

/// Makes a controller for each new path. Implement it to plug in your own algorithm.
pub trait ControllerFactory: Send + Sync + fmt::Debug {
    /// A controller for a new path whose datagrams are `max_datagram_size` bytes.
    fn build(&self, now: Instant, max_datagram_size: u64) -> Box<dyn CongestionController>;
}

/// Which congestion controller new paths get.
///
/// The default is BBRv3 with the adaptive loss response ([`LossResponse::Adaptive`]): it
/// paces at the measured bottleneck rate; its Startup ends on losses that come with a queue
/// (not on random loss); afterwards the measured rate and minimum RTT bound it, not loss;
/// ECN-CE marks count as congestion.
#[derive(Clone, Debug)]
pub enum CongestionAlgorithm {
    /// NewReno as in RFC 9002 §7.
    NewReno,
    /// CUBIC (RFC 9438) with HyStart++ (RFC 9406) for the first slow start.
    Cubic(CubicOptions),
    /// BBR version 3 (draft-ietf-ccwg-bbr): paces at the measured bottleneck rate and does
    /// not halve its window on random loss.
    Bbr(BbrOptions),
    /// A user-supplied algorithm.
    Custom(Arc<dyn ControllerFactory>),
}

impl Default for CongestionAlgorithm {
    fn default() -> Self {
        Self::Bbr(BbrOptions {
            loss_response: LossResponse::Adaptive,
        })
    }
}

impl std::str::FromStr for CongestionAlgorithm {
    type Err = String;

    /// Parses a built-in algorithm's name: `newreno`, `cubic`, `bbr`, `bbr-loss-tolerant` or
    /// `bbr-adaptive`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "newreno" | "reno" => Ok(Self::NewReno),
            "cubic" => Ok(Self::Cubic(CubicOptions::default())),
            "bbr" | "bbr3" | "bbrv3" => Ok(Self::Bbr(BbrOptions::default())),
            "bbr-loss-tolerant" => Ok(Self::Bbr(BbrOptions {
                loss_response: LossResponse::Never,
            })),
            "bbr-adaptive" => Ok(Self::Bbr(BbrOptions {
                loss_response: LossResponse::Adaptive,
            })),
            _ => Err(format!(
                "unknown congestion control {s:?} (known: newreno, cubic, bbr, bbr-loss-tolerant, bbr-adaptive)"
            )),
        }
    }
}

impl CongestionAlgorithm {
    /// A controller with RFC 9002's initial window.
    pub fn build(&self, now: Instant, max_datagram_size: u64) -> Congestion {
        self.build_with_window(now, max_datagram_size, initial_window(max_datagram_size))
    }

    /// A controller whose first window is `initial_window` bytes (a custom controller picks
    /// its own).
    pub fn build_with_window(
        &self,
        now: Instant,
        max_datagram_size: u64,
        initial_window: u64,
    ) -> Congestion {
        let mds = max_datagram_size;
        match self {
            Self::NewReno => {
                Congestion::NewReno(NewReno::new(mds).with_initial_window(initial_window))
            }
            Self::Cubic(o) => Congestion::Cubic(Box::new(
                Cubic::new(mds, *o).with_initial_window(initial_window),
            )),
            Self::Bbr(o) => Congestion::Bbr(Box::new(
                Bbr::new(mds, *o).with_initial_window(initial_window),
            )),
            Self::Custom(f) => Congestion::Custom(f.build(now, mds)),
        }
    }
}

/// A path's controller: built-ins inline, custom ones boxed.
#[derive(Debug)]
pub enum Congestion {
    /// NewReno (RFC 9002 §7).
    NewReno(NewReno),
    /// Boxed: its state is four times NewReno's, and most connections idle.
    Cubic(Box<Cubic>),
    /// Boxed: its state is several times NewReno's, and most connections idle.
    Bbr(Box<Bbr>),
    /// A controller of the application's own.
    Custom(Box<dyn CongestionController>),
}

macro_rules! dispatch {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            Congestion::NewReno($c) => $e,
            Congestion::Cubic($c) => $e,
            Congestion::Bbr($c) => $e,
            Congestion::Custom($c) => $e,
        }
    };
}

impl CongestionController for Congestion {
    #[inline]
    fn on_packet_sent(&mut self, now: Instant, bytes: u64, bytes_in_flight: u64) {
        dispatch!(self, c => c.on_packet_sent(now, bytes, bytes_in_flight))
    }

    #[inline]
    fn on_ack(&mut self, now: Instant, ack: &AckEvent<'_>) {
        dispatch!(self, c => c.on_ack(now, ack))
    }

    fn on_congestion_event(&mut self, now: Instant, loss: &LossEvent) {
        dispatch!(self, c => c.on_congestion_event(now, loss))
    }

    fn on_persistent_congestion(&mut self, now: Instant) {
        dispatch!(self, c => c.on_persistent_congestion(now))
    }

    fn on_spurious_congestion_event(&mut self) {
        dispatch!(self, c => c.on_spurious_congestion_event())
    }

    fn on_mtu_update(&mut self, max_datagram_size: u64) {
        dispatch!(self, c => c.on_mtu_update(max_datagram_size))
    }

    #[inline]
    fn window(&self) -> u64 {
        dispatch!(self, c => c.window())
    }

    #[inline]
    fn pacing_rate(&self) -> Option<u64> {
        dispatch!(self, c => c.pacing_rate())
    }

    fn ssthresh(&self) -> Option<u64> {
        dispatch!(self, c => c.ssthresh())
    }

    fn in_slow_start(&self) -> bool {
        dispatch!(self, c => c.in_slow_start())
    }

    fn resume_window(&self) -> Option<(u64, Duration)> {
        dispatch!(self, c => c.resume_window())
    }

    fn resume_from(&mut self, window: u64, rtt: Duration, loss_permille: u32) {
        dispatch!(self, c => c.resume_from(window, rtt, loss_permille))
    }

    fn name(&self) -> &'static str {
        dispatch!(self, c => c.name())
    }
}

/// Initial window (RFC 9002 §7.2): min(10 * mds, max(14720, 2 * mds)).
pub fn initial_window(max_datagram_size: u64) -> u64 {
    (10 * max_datagram_size).min(14_720.max(2 * max_datagram_size))
}

/// Minimum window (RFC 9002 §7.2): 2 * max_datagram_size.
pub fn minimum_window(max_datagram_size: u64) -> u64 {
    2 * max_datagram_size
}
