//! BBR version 3 (draft-ietf-ccwg-bbr): a model of the path — its bottleneck bandwidth and
//! round-trip propagation delay — sets the pacing rate and the window, instead of the window
//! halving on each loss.
//!
//! Random loss below the draft's 2 % per round leaves the model alone; above it, BBRv3 bounds
//! its inflight (`inflight_hi` while probing, `inflight_lo`/`bw_lo` shrunk by β = 0.7 per lossy
//! round otherwise), and the lower bounds are reset each time it probes for bandwidth again.
//!
//! Simplifications against the draft, each on a path the draft marks optional or where kuai's
//! recovery layer lacks the input: no packet conservation during fast recovery (§4.6.4.4),
//! no undo of a spurious loss response, and the "inflight too high" test uses the bytes lost
//! and delivered in the current round instead of each packet's `tx_in_flight`.

use std::time::{Duration, Instant};

use super::{AckEvent, CongestionController, LossEvent, RateSample, initial_window};

// draft-ietf-ccwg-bbr §2.9 and §5: the gains and thresholds, as (numerator, denominator)
// over 1000 to stay in integers.
const STARTUP_PACING_GAIN: u64 = 2770; // 4 * ln(2)
const STARTUP_CWND_GAIN: u64 = 2000;
const DRAIN_PACING_GAIN: u64 = 350; // 1 / 2.885
const DEFAULT_CWND_GAIN: u64 = 2000;
const PROBE_UP_CWND_GAIN: u64 = 2250;
const PROBE_DOWN_PACING_GAIN: u64 = 900;
const PROBE_UP_PACING_GAIN: u64 = 1250;
const PACING_MARGIN_PERMILLE: u64 = 10; // pace 1 % below the estimate
/// BBRLossThresh: a round losing more than 2 % of its data means inflight is too high.
const LOSS_THRESH_PERMILLE: u64 = 20;
/// BBRBeta: multiplicative decrease of the lower bounds on a lossy round.
const BETA_PERMILLE: u64 = 700;
/// BBRHeadroom: share of inflight_hi left free for other flows while cruising.
const HEADROOM_PERMILLE: u64 = 150;
/// Delivery samples whose RTTs, with the newest, must all show a queue for a loss to count
/// as congestion under the adaptive loss response (see `Bbr::queue_standing`).
const RECENT_RTTS: usize = 4;

/// Startup ends on loss only after this many loss events in one round.
const STARTUP_FULL_LOSS_COUNT: u32 = 6;
/// Startup ends when the bandwidth grew less than 25 % in three rounds.
const FULL_BW_GROWTH_PERMILLE: u64 = 1250;
const FULL_BW_ROUNDS: u32 = 3;
const MIN_PIPE_CWND_PACKETS: u64 = 4;
const PROBE_RTT_INTERVAL: Duration = Duration::from_secs(5);
const PROBE_RTT_DURATION: Duration = Duration::from_millis(200);
const MIN_RTT_WINDOW: Duration = Duration::from_secs(10);
/// Rounds over which the extra-acked (ACK aggregation) maximum is kept.
const EXTRA_ACKED_ROUNDS: u64 = 10;

fn gain(x: u64, permille: u64) -> u64 {
    (u128::from(x) * u128::from(permille) / 1000).min(u128::from(u64::MAX)) as u64
}

/// Careful Resume (RFC 9959) from an earlier connection's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Resume {
    /// The earlier connection's window (`saved_cwnd`) and the RTT it had.
    window: u64,
    rtt: Duration,
    phase: ResumePhase,
    /// Bytes acknowledged and lost in this phase (since the jump once jumped).
    acked: u64,
    lost: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResumePhase {
    /// Waiting for an RTT sample that confirms the path (§4.3.1).
    Reconnaissance,
    /// Jumped; the packets sent since (after `delivered` reached `from`) are not yet
    /// acknowledged (§4.3.2).
    Unvalidated { from: u64 },
    /// The jump's first packets were acknowledged; what was sent until `delivered` reached
    /// `until` is still to be (§4.3.3).
    Validating { until: u64 },
}

/// The largest window Careful Resume jumps to (half of what it saved): 32 MB.
const MAX_RESUME_JUMP: u64 = 32 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Startup,
    Drain,
    ProbeBwDown,
    ProbeBwCruise,
    ProbeBwRefill,
    ProbeBwUp,
    ProbeRtt,
}

/// Where the ACKs being received stand relative to a bandwidth probe (§4.3.3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckPhase {
    Init,
    ProbeStopping,
    Refilling,
    ProbeStarting,
    ProbeFeedback,
}

/// How BBR answers packet loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LossResponse {
    /// BBRv3 as drafted: a round losing more than 2 % bounds inflight (`inflight_hi` while
    /// probing, `inflight_lo`/`bw_lo` shrunk by β = 0.7 otherwise), and Startup may end on
    /// loss.
    #[default]
    Always,
    /// Leave the model alone on loss: no `inflight_hi`, `inflight_lo` or `bw_lo` bounds,
    /// and Startup does not end on loss. For links with random (non-congestive) loss, such
    /// as lossy wireless hops, where BBRv3's loss response would shrink the window of a
    /// request-response flow to a few packets. Chromium's BBRv2 has the same switch for the
    /// same reason. Queue overflow is still bounded by the model's 2 x BDP window.
    Never,
    /// The default. Startup ends on loss as in BBRv3, but only on losses that come with a
    /// queue: the newest RTT sample above min_rtt by clamp(min_rtt / 8, 4 ms, 16 ms),
    /// HyStart++'s threshold (RFC 9406 §4.2). So a flow stops doubling into a buffer it
    /// overflows, and random loss on an empty queue does not end Startup at a fraction of
    /// the path's rate. After Startup, loss leaves the model alone, as with `Never`: the
    /// measured delivery rate and min_rtt bound the flow (2 x BDP in flight). In a drop-tail
    /// queue kept full by a Linux TCP flow, BBRv3's per-round cuts left kuai 0.70 of CUBIC's
    /// rate and 0.25 of BBR's; this response shares about evenly (LAB.md, experiment 7).
    /// ECN-CE always counts as congestion.
    Adaptive,
}

/// Options of [`Bbr`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BbrOptions {
    /// How the controller answers loss (see [`LossResponse`]).
    pub loss_response: LossResponse,
}

#[derive(Debug, Clone)]
/// BBRv3 (draft-ietf-ccwg-bbr) with kuai's choice of loss response.
pub struct Bbr {
    opts: BbrOptions,
    mds: u64,
    /// The window before the first RTT sample (RFC 9002 §7.2 unless configured).
    initial_cwnd: u64,
    state: State,
    cwnd: u64,
    pacing_rate: u64,

    // Round counting (§4.5.1).
    delivered: u64,
    next_round_delivered: u64,
    round_count: u64,
    round_start: bool,

    // The model.
    /// Two-slot windowed maximum of the delivery rate over the last two ProbeBW cycles.
    bw_hi: [u64; 2],
    max_bw: u64,
    bw_lo: u64,
    /// The bandwidth the model uses: min(max_bw, bw_lo).
    bw: u64,
    min_rtt: Option<Duration>,
    min_rtt_stamp: Option<Instant>,
    probe_rtt_min: Option<Duration>,
    probe_rtt_min_stamp: Option<Instant>,
    /// When an RTT sample last came within 12.5 % of min_rtt.
    near_min_rtt_at: Option<Instant>,
    inflight_hi: u64,
    inflight_lo: u64,
    /// The last probe for bandwidth (or Startup) ended losing too much: the next probe up
    /// stops once in flight reaches `inflight_hi` again, where the loss was. Otherwise a
    /// window held at `inflight_hi` keeps probing and raises it (Linux's BBRv3 keeps the
    /// same flag).
    prev_probe_too_high: bool,

    /// The RTTs of the last [`RECENT_RTTS`] delivery samples (see `queue_standing`).
    recent_rtts: [Duration; RECENT_RTTS],
    recent_rtt_next: usize,

    // Signals of the latest round.
    bw_latest: u64,
    inflight_latest: u64,
    loss_in_round: bool,
    loss_events_in_round: u32,
    lost_in_round: u64,
    delivered_in_round: u64,
    /// Bytes lost this round with no queue in the RTT samples (the loss-tolerant
    /// responses only): random loss, which the model does not answer.
    random_lost_in_round: u64,
    /// Smoothed share of random loss per round, per mille: the delivery-rate samples are
    /// scaled up by it (see [`Bbr::update_max_bw`]).
    random_loss_permille: u64,

    // Startup exit.
    full_bw: u64,
    full_bw_count: u32,
    full_bw_reached: bool,

    // ProbeBW cycle.
    cycle_stamp: Option<Instant>,
    ack_phase: AckPhase,
    bw_probe_wait: Duration,
    rounds_since_bw_probe: u64,
    bw_probe_up_cnt: u64,
    bw_probe_up_acks: u64,
    bw_probe_up_rounds: u32,
    rng: u64,

    // ProbeRTT.
    probe_rtt_done_stamp: Option<Instant>,
    probe_rtt_round_done: bool,
    prior_cwnd: u64,
    idle_restart: bool,
    /// `delivered` when persistent congestion cut the window: an ACK for a packet sent
    /// after it ends the recovery and restores `prior_cwnd`.
    restore_after: Option<u64>,

    // ACK aggregation (§4.5.5).
    extra_acked: [u64; 2],
    extra_acked_slot: usize,
    extra_acked_slot_rounds: u64,
    ack_epoch_start: Option<Instant>,
    ack_epoch_acked: u64,

    app_limited: bool,
    in_flight: u64,
    /// Whether an RTT sample has set the pacing rate yet.
    seen_rtt: bool,
    resume: Option<Resume>,
    /// The loss rate an earlier connection on this path saw (0 when unknown).
    usual_loss_permille: u32,
}

impl Bbr {
    /// A controller for datagrams of `max_datagram_size` bytes.
    pub fn new(max_datagram_size: u64, opts: BbrOptions) -> Self {
        let cwnd = initial_window(max_datagram_size);
        let mut b = Self {
            opts,
            mds: max_datagram_size,
            initial_cwnd: cwnd,
            state: State::Startup,
            cwnd,
            pacing_rate: 0,
            delivered: 0,
            next_round_delivered: 0,
            round_count: 0,
            round_start: false,
            bw_hi: [0; 2],
            max_bw: 0,
            bw_lo: u64::MAX,
            bw: 0,
            min_rtt: None,
            min_rtt_stamp: None,
            probe_rtt_min: None,
            probe_rtt_min_stamp: None,
            near_min_rtt_at: None,
            inflight_hi: u64::MAX,
            prev_probe_too_high: false,
            inflight_lo: u64::MAX,
            recent_rtts: [Duration::MAX; RECENT_RTTS],
            recent_rtt_next: 0,
            bw_latest: 0,
            inflight_latest: 0,
            loss_in_round: false,
            loss_events_in_round: 0,
            lost_in_round: 0,
            random_lost_in_round: 0,
            random_loss_permille: 0,
            delivered_in_round: 0,
            full_bw: 0,
            full_bw_count: 0,
            full_bw_reached: false,
            cycle_stamp: None,
            ack_phase: AckPhase::Init,
            bw_probe_wait: Duration::from_secs(2),
            rounds_since_bw_probe: 0,
            bw_probe_up_cnt: u64::MAX,
            bw_probe_up_acks: 0,
            bw_probe_up_rounds: 0,
            rng: 0x9e37_79b9_7f4a_7c15,
            probe_rtt_done_stamp: None,
            probe_rtt_round_done: false,
            prior_cwnd: cwnd,
            idle_restart: false,
            restore_after: None,
            extra_acked: [0; 2],
            extra_acked_slot: 0,
            extra_acked_slot_rounds: 0,
            ack_epoch_start: None,
            ack_epoch_acked: 0,
            app_limited: false,
            in_flight: 0,
            seen_rtt: false,
            resume: None,
            usual_loss_permille: 0,
        };
        b.pacing_rate = b.initial_pacing_rate(None);
        b
    }

    /// Starts from `bytes` instead of RFC 9002's initial window (at least 4 datagrams).
    pub fn with_initial_window(mut self, bytes: u64) -> Self {
        self.cwnd = bytes.max(self.min_cwnd());
        self.initial_cwnd = self.cwnd;
        self.prior_cwnd = self.cwnd;
        self.pacing_rate = self.initial_pacing_rate(None);
        self
    }

    /// §4.6.2: startup gain times the initial window over the first RTT (1 ms before any).
    fn initial_pacing_rate(&self, srtt: Option<Duration>) -> u64 {
        let us = srtt.map_or(1000, |d| d.as_micros().max(1));
        let r = u128::from(gain(self.cwnd, STARTUP_PACING_GAIN)) * 1_000_000 / us;
        r.min(u128::from(u64::MAX)) as u64
    }

    fn min_cwnd(&self) -> u64 {
        MIN_PIPE_CWND_PACKETS * self.mds
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: deterministic, which keeps the sans-IO core reproducible.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    /// Bandwidth-delay product at `gain_permille`, or the initial window before an RTT sample.
    fn bdp(&self, bw: u64, gain_permille: u64) -> u64 {
        let Some(rtt) = self.min_rtt else {
            return self.initial_cwnd;
        };
        let b = u128::from(bw) * rtt.as_micros() / 1_000_000;
        gain(b.min(u128::from(u64::MAX)) as u64, gain_permille)
    }

    fn is_probing_bw(&self) -> bool {
        matches!(
            self.state,
            State::Startup | State::ProbeBwRefill | State::ProbeBwUp
        )
    }

    fn in_probe_bw(&self) -> bool {
        matches!(
            self.state,
            State::ProbeBwDown | State::ProbeBwCruise | State::ProbeBwRefill | State::ProbeBwUp
        )
    }

    fn pacing_gain(&self) -> u64 {
        match self.state {
            State::Startup => STARTUP_PACING_GAIN,
            State::Drain => DRAIN_PACING_GAIN,
            State::ProbeBwDown => PROBE_DOWN_PACING_GAIN,
            State::ProbeBwUp => PROBE_UP_PACING_GAIN,
            _ => 1000,
        }
    }

    fn cwnd_gain(&self) -> u64 {
        match self.state {
            State::Startup => STARTUP_CWND_GAIN,
            State::ProbeBwUp => PROBE_UP_CWND_GAIN,
            _ => DEFAULT_CWND_GAIN,
        }
    }

    // --- Round counting and the delivery signals (§4.5.1, §4.5.10) ---

    fn update_round(&mut self, rs: &RateSample) {
        if rs.prior_delivered >= self.next_round_delivered {
            self.next_round_delivered = self.delivered;
            self.round_count += 1;
            self.rounds_since_bw_probe += 1;
            self.round_start = true;
        } else {
            self.round_start = false;
        }
    }

    fn update_max_bw(&mut self, rs: &RateSample) {
        let Some(mut rate) = rs.rate() else { return };
        // A delivery-rate sample counts what arrived. Under random loss p (a lossy radio
        // hop, no queue), a flow sending at rate r measures (1 - p) r: ProbeBW_UP's 1.25 x
        // then measures less than the estimate once p passes 20 %, and the estimate decays
        // every cycle (at 30 % loss a 6.3 Mbit/s link fell to 1.5 Mbit/s in 30 s, the
        // window to a sixth of the path's). Counted back, the sample is the rate the path
        // carried: the sender's, never more. Congestion loss (a queue in the RTT) is not
        // counted back, and half the packets at most.
        if self.random_loss_permille > 0 {
            let kept = 1000 - self.random_loss_permille.min(500);
            rate = rate.saturating_mul(1000) / kept;
        }
        self.bw_latest = self.bw_latest.max(rate);
        self.inflight_latest = self.inflight_latest.max(rs.delivered);
        // An application-limited sample only counts when it beats the estimate.
        if rate >= self.max_bw || !rs.is_app_limited {
            self.bw_hi[1] = self.bw_hi[1].max(rate);
            self.max_bw = self.bw_hi[0].max(self.bw_hi[1]);
        }
    }

    fn advance_max_bw_filter(&mut self) {
        if self.bw_hi[1] == 0 {
            return; // nothing measured in this cycle; keep the older slot
        }
        self.bw_hi[0] = self.bw_hi[1];
        self.bw_hi[1] = 0;
    }

    fn inflight_too_high(&self) -> bool {
        let total = self.lost_in_round + self.delivered_in_round;
        total > 0 && self.lost_in_round * 1000 > total * LOSS_THRESH_PERMILLE
    }

    // --- Lower bounds from loss (§4.5.10.3) ---

    fn adapt_lower_bounds(&mut self) {
        if self.is_probing_bw() || !self.loss_in_round {
            return;
        }
        if self.bw_lo == u64::MAX {
            self.bw_lo = self.max_bw;
        }
        if self.inflight_lo == u64::MAX {
            self.inflight_lo = self.cwnd;
        }
        self.bw_lo = self.bw_latest.max(gain(self.bw_lo, BETA_PERMILLE));
        self.inflight_lo = self
            .inflight_latest
            .max(gain(self.inflight_lo, BETA_PERMILLE));
    }

    /// Whether the RTT at a loss shows a queue at the bottleneck: the newest sample, and
    /// the last [`RECENT_RTTS`] delivery samples before it, all above min_rtt by
    /// clamp(min_rtt / 8, 4 ms, 16 ms) (HyStart++'s threshold, RFC 9406 §4.2). A queue
    /// that overflows is full, so the packets acknowledged around the lost one all waited
    /// in it; random loss on an empty queue leaves them at the minimum, and jitter lifts
    /// some of them, seldom all (with ±5 ms of jitter on a 40 ms path, one sample in two
    /// is over the threshold, four in a row one time in sixteen). Without samples, assume
    /// a queue. (A round's smallest sample, as HyStart++ takes, filters jitter too but
    /// misses a shallow queue that Startup's bursts overflow: the first packets of each
    /// round find it drained.)
    fn queue_standing(&self, latest_rtt: Option<Duration>) -> bool {
        const MIN_THRESH: Duration = Duration::from_millis(4);
        const MAX_THRESH: Duration = Duration::from_millis(16);
        let (Some(min), Some(latest)) = (self.min_rtt, latest_rtt) else {
            return true;
        };
        let floor = self
            .recent_rtts
            .iter()
            .copied()
            .filter(|&r| r != Duration::MAX)
            .fold(latest, Duration::min);
        floor >= min + (min / 8).clamp(MIN_THRESH, MAX_THRESH)
    }

    /// With the adaptive response, whether `lost` of `lost + delivered` is more than the
    /// path's usual random loss explains: above twice the loss rate an earlier connection
    /// saw ([`CongestionController::resume_from`]) and 2 % over it. On a path known to lose
    /// 5 % (lab experiment 4), a 6 % round with jitter in its RTT samples is that path, not
    /// a queue overflowing; without a hint, any loss counts.
    fn above_usual_loss(&self, lost: u64, delivered: u64) -> bool {
        self.opts.loss_response != LossResponse::Adaptive
            || self.exceeds_usual_loss(lost, delivered)
    }

    fn exceeds_usual_loss(&self, lost: u64, delivered: u64) -> bool {
        if self.usual_loss_permille == 0 {
            return true;
        }
        let usual = u64::from(self.usual_loss_permille.min(1000));
        let limit = (usual * 2).max(usual + LOSS_THRESH_PERMILLE);
        lost * 1000 > (lost + delivered) * limit
    }

    fn reset_lower_bounds(&mut self) {
        self.bw_lo = u64::MAX;
        self.inflight_lo = u64::MAX;
    }

    /// Folds the round that just ended into the smoothed random-loss share (a quarter
    /// weight per round with at least ten packets' worth delivered or lost).
    fn update_random_loss(&mut self) {
        let total = self.random_lost_in_round + self.delivered_in_round;
        if total >= 10 * self.mds {
            let p = self.random_lost_in_round * 1000 / total;
            self.random_loss_permille = (3 * self.random_loss_permille + p) / 4;
        }
        self.random_lost_in_round = 0;
    }

    fn start_new_round_signals(&mut self) {
        self.loss_in_round = false;
        self.loss_events_in_round = 0;
        self.lost_in_round = 0;
        self.delivered_in_round = 0;
        self.bw_latest = 0;
        self.inflight_latest = 0;
    }

    // --- Startup and Drain (§4.3.1, §4.3.2) ---

    fn check_full_bw_reached(&mut self, rs: &RateSample) {
        if self.full_bw_reached || !self.round_start || rs.is_app_limited {
            return;
        }
        if self.max_bw >= gain(self.full_bw, FULL_BW_GROWTH_PERMILLE) {
            self.full_bw = self.max_bw;
            self.full_bw_count = 0;
            return;
        }
        self.full_bw_count += 1;
        if self.full_bw_count >= FULL_BW_ROUNDS {
            self.full_bw_reached = true;
        }
    }

    /// §4.3.1.3: Startup also ends after a round with many losses above the threshold.
    fn check_startup_high_loss(&mut self) {
        if self.full_bw_reached
            || self.loss_events_in_round < STARTUP_FULL_LOSS_COUNT
            || !self.inflight_too_high()
            || !self.above_usual_loss(self.lost_in_round, self.delivered_in_round)
        {
            return;
        }
        if self
            .resume
            .is_some_and(|r| r.phase != ResumePhase::Reconnaissance)
        {
            // The jump's round lost too much: retreat, and let Startup measure the path
            // again from there. Its bandwidth samples so far come from a round that lost
            // most of its packets, too low to leave Startup with.
            self.safe_retreat();
            return;
        }
        self.full_bw_reached = true;
        self.inflight_hi = self.bdp(self.max_bw, 1000).max(self.inflight_latest);
        self.prev_probe_too_high = true;
    }

    fn check_startup_done(&mut self, now: Instant) {
        if self.state == State::Startup && self.full_bw_reached {
            self.state = State::Drain;
        }
        if self.state == State::Drain && self.in_flight <= self.bdp(self.bw, 1000) {
            self.start_probe_bw_down(now);
        }
    }

    // --- ProbeBW (§4.3.3) ---

    fn start_probe_bw_down(&mut self, now: Instant) {
        self.bw_probe_up_cnt = u64::MAX;
        // BBRPickProbeWait: 0 or 1 round, and 2 to 3 seconds.
        self.rounds_since_bw_probe = self.next_random() % 2;
        self.bw_probe_wait = Duration::from_millis(2000 + self.next_random() % 1001);
        self.cycle_stamp = Some(now);
        self.ack_phase = AckPhase::ProbeStopping;
        self.next_round_delivered = self.delivered;
        self.state = State::ProbeBwDown;
    }

    fn start_probe_bw_cruise(&mut self) {
        self.state = State::ProbeBwCruise;
    }

    fn start_probe_bw_refill(&mut self) {
        self.reset_lower_bounds();
        self.bw_probe_up_rounds = 0;
        self.bw_probe_up_acks = 0;
        self.ack_phase = AckPhase::Refilling;
        self.next_round_delivered = self.delivered;
        self.state = State::ProbeBwRefill;
    }

    fn start_probe_bw_up(&mut self, now: Instant) {
        self.ack_phase = AckPhase::ProbeStarting;
        self.next_round_delivered = self.delivered;
        self.cycle_stamp = Some(now);
        self.state = State::ProbeBwUp;
        self.raise_inflight_hi_slope();
    }

    /// §4.3.3.5: how fast inflight_hi grows while probing up: 1, 2, 4, ... packets per round.
    fn raise_inflight_hi_slope(&mut self) {
        let growth = 1u64 << self.bw_probe_up_rounds.min(30);
        self.bw_probe_up_rounds = (self.bw_probe_up_rounds + 1).min(30);
        self.bw_probe_up_cnt = (self.cwnd / growth.max(1)).max(1);
    }

    fn probe_inflight_hi_upward(&mut self, rs_acked: u64, cwnd_limited: bool) {
        if !cwnd_limited || self.cwnd < self.inflight_hi {
            return;
        }
        self.bw_probe_up_acks += rs_acked;
        if self.bw_probe_up_acks >= self.bw_probe_up_cnt {
            let delta = self.bw_probe_up_acks / self.bw_probe_up_cnt;
            self.bw_probe_up_acks -= delta * self.bw_probe_up_cnt;
            self.inflight_hi = self.inflight_hi.saturating_add(delta * self.mds);
        }
        if self.round_start {
            self.raise_inflight_hi_slope();
        }
    }

    fn has_elapsed_in_phase(&self, now: Instant, d: Duration) -> bool {
        self.cycle_stamp
            .is_some_and(|s| now.saturating_duration_since(s) > d)
    }

    fn inflight_with_headroom(&self) -> u64 {
        if self.inflight_hi == u64::MAX {
            return u64::MAX;
        }
        let headroom = gain(self.inflight_hi, HEADROOM_PERMILLE).max(self.mds);
        self.inflight_hi
            .saturating_sub(headroom)
            .max(self.min_cwnd())
    }

    /// §4.3.3.6: time to probe when the wall-clock wait passed, or after as many rounds as a
    /// Reno flow with this BDP would take to grow its window (at most 63).
    fn is_time_to_probe_bw(&mut self, now: Instant) -> bool {
        let reno_rounds = (self.bdp(self.bw, 1000) / self.mds).min(63);
        if self.has_elapsed_in_phase(now, self.bw_probe_wait)
            || self.rounds_since_bw_probe >= reno_rounds
        {
            self.start_probe_bw_refill();
            return true;
        }
        false
    }

    fn update_probe_bw_cycle(&mut self, now: Instant, acked: u64, cwnd_limited: bool) {
        if !self.full_bw_reached {
            return;
        }
        // BBRAdaptUpperBounds: the ACK phase follows the rounds.
        if self.ack_phase == AckPhase::ProbeStarting && self.round_start {
            self.ack_phase = AckPhase::ProbeFeedback;
        }
        if self.ack_phase == AckPhase::ProbeStopping && self.round_start {
            if self.in_probe_bw() {
                self.advance_max_bw_filter();
            }
            self.ack_phase = AckPhase::Init;
        }
        if self.state == State::ProbeBwUp {
            self.probe_inflight_hi_upward(acked, cwnd_limited);
        }
        match self.state {
            State::ProbeBwDown => {
                if self.is_time_to_probe_bw(now) {
                    return;
                }
                let bdp = self.bdp(self.max_bw, 1000);
                if self.in_flight <= self.inflight_with_headroom() && self.in_flight <= bdp {
                    self.start_probe_bw_cruise();
                }
            }
            State::ProbeBwCruise => {
                self.is_time_to_probe_bw(now);
            }
            State::ProbeBwRefill if self.round_start => self.start_probe_bw_up(now),
            State::ProbeBwUp => {
                // Done probing once a round in flight exceeds 1.25 BDP, or, when the last
                // probe lost too much, once in flight is back where it did. A window held
                // at inflight_hi otherwise goes on probing (`probe_inflight_hi_upward`
                // raises it): stopping there, as this did whenever the window was the limit,
                // ended every probe after one ACK once Startup had set inflight_hi (the
                // window climbs to it during Refill), and inflight_hi never grew again.
                let target = self.bdp(self.max_bw, PROBE_UP_PACING_GAIN);
                if self.has_elapsed_in_phase(now, self.min_rtt.unwrap_or_default())
                    && self.in_flight > target
                    || (self.prev_probe_too_high && self.in_flight >= self.inflight_hi)
                {
                    self.prev_probe_too_high = false;
                    self.start_probe_bw_down(now);
                }
            }
            _ => {}
        }
    }

    // --- ProbeRTT (§4.3.4) ---

    fn update_min_rtt(&mut self, now: Instant, rs: &RateSample) {
        let mut expired = self
            .probe_rtt_min_stamp
            .is_some_and(|s| now.saturating_duration_since(s) > PROBE_RTT_INTERVAL);
        if self.min_rtt.is_some_and(|m| rs.rtt <= m + m / 8) {
            self.near_min_rtt_at = Some(now);
        }
        // ProbeRTT is skipped when an RTT within 12.5 % of min_rtt was measured in the last
        // interval: the queue was empty then, so the estimate still holds (Chromium's BBRv2
        // has the same option). Draining to half a BDP for 200 ms would only cost goodput,
        // and after an outage, which leaves the queue empty and the timer expired, it
        // would delay the restart.
        if expired
            && self
                .near_min_rtt_at
                .is_some_and(|t| now.saturating_duration_since(t) <= PROBE_RTT_INTERVAL)
        {
            self.probe_rtt_min_stamp = Some(now);
            self.min_rtt_stamp = Some(now);
            expired = false;
        }
        if self.probe_rtt_min.is_none_or(|m| rs.rtt < m) || expired {
            self.probe_rtt_min = Some(rs.rtt);
            self.probe_rtt_min_stamp = Some(now);
        }
        let min_expired = self
            .min_rtt_stamp
            .is_none_or(|s| now.saturating_duration_since(s) > MIN_RTT_WINDOW);
        if self.probe_rtt_min < self.min_rtt || self.min_rtt.is_none() || min_expired {
            self.min_rtt = self.probe_rtt_min;
            self.min_rtt_stamp = self.probe_rtt_min_stamp;
        }
        if expired && !self.idle_restart && self.state != State::ProbeRtt {
            self.prior_cwnd = if self.state == State::ProbeBwDown || !self.in_probe_bw() {
                self.cwnd.max(self.prior_cwnd)
            } else {
                self.cwnd
            };
            self.state = State::ProbeRtt;
            self.probe_rtt_done_stamp = None;
            self.probe_rtt_round_done = false;
        }
        if self.state == State::ProbeRtt {
            self.handle_probe_rtt(now);
        }
        self.idle_restart = false;
    }

    fn probe_rtt_cwnd(&self) -> u64 {
        self.bdp(self.bw, 500).max(self.min_cwnd())
    }

    fn handle_probe_rtt(&mut self, now: Instant) {
        match self.probe_rtt_done_stamp {
            None => {
                if self.in_flight <= self.probe_rtt_cwnd() {
                    self.probe_rtt_done_stamp = Some(now + PROBE_RTT_DURATION);
                    self.probe_rtt_round_done = false;
                    self.next_round_delivered = self.delivered;
                }
            }
            Some(done) => {
                if self.round_start {
                    self.probe_rtt_round_done = true;
                }
                if self.probe_rtt_round_done && now >= done {
                    self.probe_rtt_min_stamp = Some(now);
                    self.cwnd = self.cwnd.max(self.prior_cwnd);
                    if self.full_bw_reached {
                        self.start_probe_bw_down(now);
                        self.start_probe_bw_cruise();
                    } else {
                        self.state = State::Startup;
                    }
                }
            }
        }
    }

    // --- ACK aggregation (§4.5.5) ---

    fn update_ack_aggregation(&mut self, now: Instant, acked: u64) {
        let Some(start) = self.ack_epoch_start else {
            self.ack_epoch_start = Some(now);
            self.ack_epoch_acked = acked;
            return;
        };
        let interval = now.saturating_duration_since(start);
        let expected = (u128::from(self.bw) * interval.as_micros() / 1_000_000)
            .min(u128::from(u64::MAX)) as u64;
        if self.ack_epoch_acked <= expected {
            self.ack_epoch_start = Some(now);
            self.ack_epoch_acked = 0;
        }
        self.ack_epoch_acked += acked;
        let extra = self.ack_epoch_acked.saturating_sub(expected).min(self.cwnd);
        if self.round_start {
            self.extra_acked_slot_rounds += 1;
            if self.extra_acked_slot_rounds >= EXTRA_ACKED_ROUNDS {
                self.extra_acked_slot ^= 1;
                self.extra_acked[self.extra_acked_slot] = 0;
                self.extra_acked_slot_rounds = 0;
            }
        }
        let s = &mut self.extra_acked[self.extra_acked_slot];
        *s = (*s).max(extra);
    }

    // --- Careful Resume (RFC 9959) ---

    /// Called on each ACK with a rate sample, before the model is updated.
    fn careful_resume(&mut self, rs: &RateSample, acked: u64, app_limited: bool) {
        let Some(mut r) = self.resume else { return };
        r.acked += acked;
        match r.phase {
            ResumePhase::Reconnaissance => {
                // §4.3.1: the path is taken to be the same when the RTT is within half and
                // ten times the saved one; otherwise the saved window is forgotten.
                if rs.rtt < r.rtt / 2 || rs.rtt > r.rtt * 10 || self.state != State::Startup {
                    self.resume = None;
                    return;
                }
                let jump = (r.window / 2).min(MAX_RESUME_JUMP);
                // Only when there is more to send than the window allows, and the jump adds
                // to it (§4.3.1: the sender is limited by cwnd).
                if !app_limited && jump > self.cwnd {
                    self.cwnd = jump;
                    // Paced over one RTT (§4.3.2).
                    let us = rs.rtt.as_micros().max(1);
                    let rate = (u128::from(jump) * 1_000_000 / us).min(u128::from(u64::MAX));
                    self.pacing_rate = self.pacing_rate.max(rate as u64);
                    r.phase = ResumePhase::Unvalidated {
                        from: self.delivered,
                    };
                    (r.acked, r.lost) = (0, 0);
                }
            }
            ResumePhase::Unvalidated { from } => {
                if rs.prior_delivered >= from {
                    r.phase = ResumePhase::Validating {
                        until: self.delivered,
                    };
                }
            }
            ResumePhase::Validating { until } => {
                if rs.prior_delivered >= until {
                    self.resume = None; // §4.3.5: Normal
                    return;
                }
            }
        }
        self.resume = Some(r);
    }

    /// Congestion before the jump forgets the saved window (§4.3.1). A path with known random
    /// loss loses at its usual rate: only loss above 2 % and well above the usual
    /// ([`Self::exceeds_usual_loss`]), with a standing queue, counts (a loss before any RTT
    /// sample, a handshake packet, does not). After the jump, ECN-CE retreats at once; loss
    /// retreats when it ends Startup ([`Self::check_startup_high_loss`]), judged on a whole
    /// round: the first few acknowledgments of a jump are too few to tell random loss, or
    /// packets reordered past the threshold, from an overflowing queue.
    fn careful_resume_loss(&mut self, loss: &LossEvent) {
        let Some(mut r) = self.resume else { return };
        r.lost += loss.lost_bytes;
        self.resume = Some(r);
        if r.phase != ResumePhase::Reconnaissance {
            if loss.ecn_ce {
                self.safe_retreat();
            }
            return;
        }
        if loss.ecn_ce
            || (self.min_rtt.is_some()
                && r.lost * 1000 > (r.acked + r.lost) * LOSS_THRESH_PERMILLE
                && self.exceeds_usual_loss(r.lost, r.acked)
                && self.queue_standing(loss.latest_rtt))
        {
            self.resume = None;
        }
    }

    /// §4.3.4 Safe Retreat: the jump met congestion. The window falls to half of what was
    /// delivered since the jump (at least the initial window), paced at Startup's gain over
    /// the RTT, and Startup goes on from there: BBR has no congestion avoidance to fall back
    /// to, and leaving Startup would freeze the bandwidth the lossy jump round measured.
    /// Startup's own exits judge the rounds that follow.
    fn safe_retreat(&mut self) {
        let Some(r) = self.resume.take() else { return };
        if r.phase == ResumePhase::Reconnaissance {
            return;
        }
        self.cwnd = (r.acked / 2).max(self.initial_cwnd);
        let rtt = self.min_rtt.unwrap_or(r.rtt).as_micros().max(1);
        let rate = u128::from(gain(self.cwnd, STARTUP_PACING_GAIN)) * 1_000_000 / rtt;
        self.pacing_rate = rate.min(u128::from(u64::MAX)) as u64;
        self.max_bw = 0;
        self.bw_hi = [0; 2];
        self.full_bw = 0;
        self.full_bw_count = 0;
    }

    // --- Output: pacing rate and window (§4.6) ---

    fn set_pacing_rate(&mut self) {
        if self.bw == 0 {
            return;
        }
        let r = gain(
            gain(self.bw, self.pacing_gain()),
            1000 - PACING_MARGIN_PERMILLE,
        );
        if self.full_bw_reached || r > self.pacing_rate {
            self.pacing_rate = r;
        }
    }

    fn set_cwnd(&mut self, acked: u64) {
        let extra = self.extra_acked[0].max(self.extra_acked[1]);
        let mut max_inflight = self.bdp(self.bw, self.cwnd_gain()).saturating_add(extra);
        // Quantization budget: room for the pacer's bursts, more while probing up.
        max_inflight = max_inflight.saturating_add(3 * 2 * self.mds);
        if self.state == State::ProbeBwUp {
            max_inflight = max_inflight.saturating_add(2 * self.mds);
        }
        if self.full_bw_reached {
            self.cwnd = self.cwnd.saturating_add(acked).min(max_inflight);
        } else if self.cwnd < max_inflight || self.delivered < self.initial_cwnd {
            self.cwnd = self.cwnd.saturating_add(acked);
        }
        self.cwnd = self.cwnd.max(self.min_cwnd());
        if self.state == State::ProbeRtt {
            self.cwnd = self.cwnd.min(self.probe_rtt_cwnd());
        }
        // BBRBoundCwndForModel.
        let mut cap = u64::MAX;
        if self.in_probe_bw() && self.state != State::ProbeBwCruise {
            cap = self.inflight_hi;
        } else if matches!(self.state, State::ProbeRtt | State::ProbeBwCruise) {
            cap = self.inflight_with_headroom();
        }
        cap = cap.min(self.inflight_lo).max(self.min_cwnd());
        self.cwnd = self.cwnd.min(cap);
    }
}

impl CongestionController for Bbr {
    fn on_packet_sent(&mut self, _now: Instant, bytes: u64, bytes_in_flight: u64) {
        // `bytes_in_flight` already counts this packet.
        if bytes_in_flight <= bytes && self.app_limited {
            // §4.4.3: restarting from idle; do not let a stale ProbeRTT timer fire.
            self.idle_restart = true;
            self.ack_epoch_start = None;
        }
        self.in_flight = bytes_in_flight;
    }

    fn on_ack(&mut self, now: Instant, ack: &AckEvent<'_>) {
        self.app_limited = ack.app_limited;
        self.in_flight = ack.bytes_in_flight;
        let Some(rs) = ack.rate else {
            return;
        };
        self.recent_rtts[self.recent_rtt_next] = rs.rtt;
        self.recent_rtt_next = (self.recent_rtt_next + 1) % RECENT_RTTS;
        self.delivered = rs.prior_delivered + rs.delivered;
        self.delivered_in_round += ack.acked_bytes;
        if self.resume.is_some() {
            self.careful_resume(&rs, ack.acked_bytes, ack.app_limited);
        }
        if self.restore_after.is_some_and(|d| rs.prior_delivered >= d) {
            self.restore_after = None;
            self.cwnd = self.cwnd.max(self.prior_cwnd);
        }
        self.update_round(&rs);
        if self.round_start {
            // The round that just ended: its loss sets the lower bounds (BBRv3).
            if self.state == State::Startup {
                self.check_startup_high_loss();
            }
            self.adapt_lower_bounds();
            self.update_random_loss();
            self.start_new_round_signals();
            self.delivered_in_round = ack.acked_bytes;
        }
        self.update_max_bw(&rs);
        self.bw = self.max_bw.min(self.bw_lo);
        self.update_ack_aggregation(now, ack.acked_bytes);
        self.check_full_bw_reached(&rs);
        self.check_startup_done(now);
        let cwnd_limited = !ack.app_limited;
        self.update_probe_bw_cycle(now, ack.acked_bytes, cwnd_limited);
        self.update_min_rtt(now, &rs);
        self.bw = self.max_bw.min(self.bw_lo);
        if !self.seen_rtt {
            // §4.6.2 sets the first pacing rate from the initial window over SRTT, or over
            // 1 ms before any RTT sample, which is no pacing at all. Set it again from the
            // first sample (as Linux's BBR does): Startup then paces at 2.77 x what the
            // window delivers per RTT until the measured rate takes over, instead of sending
            // each doubled window in one burst.
            self.seen_rtt = true;
            if !self.full_bw_reached
                && self
                    .resume
                    .is_none_or(|r| r.phase == ResumePhase::Reconnaissance)
            {
                self.pacing_rate = self.initial_pacing_rate(Some(ack.rtt.smoothed()));
            }
        }
        self.set_pacing_rate();
        self.set_cwnd(ack.acked_bytes);
    }

    fn on_congestion_event(&mut self, now: Instant, loss: &LossEvent) {
        if self.resume.is_some() {
            self.careful_resume_loss(loss);
        }
        if !loss.ecn_ce {
            match self.opts.loss_response {
                LossResponse::Always => {}
                LossResponse::Never => {
                    if !self.queue_standing(loss.latest_rtt) {
                        self.random_lost_in_round += loss.lost_bytes;
                    }
                    return;
                }
                LossResponse::Adaptive => {
                    let queue = self.queue_standing(loss.latest_rtt);
                    if !queue {
                        self.random_lost_in_round += loss.lost_bytes;
                    }
                    if self.state != State::Startup || !queue {
                        return;
                    }
                }
            }
        }
        if loss.ecn_ce {
            // BBRv3 reacts to ECN only with L4S-style marking; classic CE is treated as loss
            // of one datagram so that a marking bottleneck is not ignored.
            self.lost_in_round += self.mds;
        } else {
            self.lost_in_round += loss.lost_bytes;
        }
        self.loss_in_round = true;
        self.loss_events_in_round += 1;
        self.in_flight = loss.bytes_in_flight;
        // §4.5.10.2: while probing up, a round losing too much sets inflight_hi and ends
        // the probe.
        if self.inflight_too_high() && matches!(self.state, State::ProbeBwUp) {
            self.inflight_hi = (loss.bytes_in_flight + loss.lost_bytes)
                .max(gain(self.bdp(self.bw, 1000), BETA_PERMILLE))
                .max(self.min_cwnd());
            self.prev_probe_too_high = true;
            self.start_probe_bw_down(now);
            self.set_cwnd(0);
        }
    }

    fn on_persistent_congestion(&mut self, _now: Instant) {
        // RFC 9002 §7.6.2. The model is kept, and the window saved (BBRSaveCwnd) comes back
        // once a packet sent after the cut is acknowledged, as on leaving loss recovery
        // (draft-ietf-ccwg-bbr §4.6.4.4, BBRRestoreCwnd; Linux's BBR does the same after a
        // retransmission timeout). After an outage of a few seconds the path is what it
        // was, and regrowing from four packets would cost several round trips.
        self.prior_cwnd = if self.state == State::ProbeRtt || self.restore_after.is_some() {
            self.cwnd.max(self.prior_cwnd)
        } else {
            self.cwnd
        };
        self.cwnd = self.min_cwnd();
        self.restore_after = Some(self.delivered);
    }

    fn on_mtu_update(&mut self, max_datagram_size: u64) {
        self.mds = max_datagram_size;
        self.cwnd = self.cwnd.max(self.min_cwnd());
    }

    fn window(&self) -> u64 {
        self.cwnd
    }

    fn pacing_rate(&self) -> Option<u64> {
        Some(self.pacing_rate.max(1))
    }

    fn in_slow_start(&self) -> bool {
        self.state == State::Startup
    }

    /// Two BDPs of the bandwidth and min_rtt measured (the window BBR keeps while probing),
    /// at min_rtt.
    fn resume_window(&self) -> Option<(u64, Duration)> {
        let rtt = self.min_rtt?;
        (self.max_bw > 0).then(|| (self.bdp(self.max_bw, 2000), rtt))
    }

    fn resume_from(&mut self, window: u64, rtt: Duration, loss_permille: u32) {
        self.usual_loss_permille = loss_permille;
        self.resume = (window > self.initial_cwnd && !rtt.is_zero()).then_some(Resume {
            window,
            rtt,
            phase: ResumePhase::Reconnaissance,
            acked: 0,
            lost: 0,
        });
    }

    fn name(&self) -> &'static str {
        match self.opts.loss_response {
            LossResponse::Always => "bbr",
            LossResponse::Never => "bbr-loss-tolerant",
            LossResponse::Adaptive => "bbr-adaptive",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recovery::RttEstimator;

    const MDS: u64 = 1200;

    /// Feeds `rounds` round trips of a sender that keeps `cwnd` in flight on a path of
    /// `rate` bytes/s and `rtt`, acknowledging each round at once; returns the time reached.
    fn drive(b: &mut Bbr, mut now: Instant, rounds: u32, rate: u64, rtt: Duration) -> Instant {
        let mut est = RttEstimator::new(rtt);
        est.update(Duration::ZERO, rtt);
        for _ in 0..rounds {
            let flight = b
                .window()
                .min(rate * rtt.as_micros() as u64 / 1_000_000 * 2);
            b.on_packet_sent(now, flight, flight);
            now += rtt;
            let delivered = flight.min(rate * rtt.as_micros() as u64 / 1_000_000);
            let ack = AckEvent {
                acked_bytes: delivered,
                largest_acked_sent_time: now - rtt,
                rtt: &est,
                rate: Some(RateSample {
                    delivered,
                    interval: rtt,
                    prior_delivered: b.delivered,
                    is_app_limited: false,
                    rtt,
                }),
                prior_in_flight: flight,
                bytes_in_flight: 0,
                app_limited: false,
            };
            b.on_ack(now, &ack);
        }
        now
    }

    #[test]
    fn startup_finds_the_bandwidth_then_paces_near_it() {
        let t0 = Instant::now();
        let mut b = Bbr::new(MDS, BbrOptions::default());
        assert_eq!(b.window(), initial_window(MDS));
        let rate = 1_250_000; // 10 Mbit/s
        let rtt = Duration::from_millis(40);
        drive(&mut b, t0, 30, rate, rtt);
        assert!(b.full_bw_reached, "startup must end on a plateau");
        assert!(b.in_probe_bw(), "state {:?}", b.state);
        assert_eq!(b.max_bw, rate);
        let pacing = b.pacing_rate().unwrap();
        assert!(
            pacing > rate * 8 / 10 && pacing < rate * 13 / 10,
            "pacing {pacing}"
        );
        // About two BDPs (50 KB) plus the allowance for bursts.
        let bdp = rate * 40 / 1000;
        assert!(
            b.window() >= 2 * bdp && b.window() < 3 * bdp,
            "cwnd {}",
            b.window()
        );
    }

    #[test]
    fn probe_rtt_is_skipped_while_the_minimum_rtt_shows_up() {
        let t0 = Instant::now();
        let rate = 1_250_000;
        let rtt = Duration::from_millis(40);
        let mut b = Bbr::new(MDS, BbrOptions::default());
        let mut now = drive(&mut b, t0, 30, rate, rtt);
        // 12 s of samples at the minimum: the queue is empty, nothing to drain for.
        for _ in 0..300 {
            now = drive(&mut b, now, 1, rate, rtt);
            assert_ne!(b.state, State::ProbeRtt, "at {:?}", now - t0);
        }
        // A standing queue (every sample 50 % above the minimum): ProbeRTT within 5 s.
        let queued = rtt * 3 / 2;
        let mut probed = false;
        for _ in 0..150 {
            now = drive(&mut b, now, 1, rate, queued);
            probed |= b.state == State::ProbeRtt;
        }
        assert!(
            probed,
            "a standing queue must still be drained to find min_rtt"
        );
    }

    #[test]
    fn the_window_comes_back_after_persistent_congestion() {
        let t0 = Instant::now();
        let rate = 1_250_000;
        let rtt = Duration::from_millis(40);
        let mut b = Bbr::new(MDS, BbrOptions::default());
        let now = drive(&mut b, t0, 30, rate, rtt);
        let before = b.window();
        b.on_persistent_congestion(now);
        assert_eq!(b.window(), b.min_cwnd());
        // The first round trip after the outage: its ACK is for a packet sent after the cut.
        drive(&mut b, now, 1, rate, rtt);
        assert!(
            b.window() >= before,
            "window {} restored to {before}",
            b.window()
        );
    }

    #[test]
    fn careful_resume_jumps_once_the_rtt_is_confirmed() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(40);
        let rate = 12_500_000; // 100 Mbit/s: a 500 KB BDP
        // An RTT far from the saved one: the path changed, the window is forgotten.
        for far in [rtt * 3, rtt / 11] {
            let mut b = Bbr::new(MDS, BbrOptions::default());
            b.resume_from(1_000_000, far, 0);
            drive(&mut b, t0, 1, rate, rtt);
            assert!(b.resume.is_none() && b.window() < 100_000, "{far:?}");
        }
        let mut b = Bbr::new(MDS, BbrOptions::default());
        b.resume_from(1_000_000, rtt, 0);
        drive(&mut b, t0, 1, rate, rtt);
        assert_eq!(b.window(), 500_000, "half the saved window");
        assert!(matches!(
            b.resume.map(|r| r.phase),
            Some(ResumePhase::Unvalidated { .. })
        ));
        // Paced over one RTT: 500 KB in 40 ms.
        assert!(b.pacing_rate().unwrap() >= 12_000_000);
        // The jump's packets are acknowledged, then those sent after them: Normal again.
        drive(&mut b, t0 + rtt, 3, rate, rtt);
        assert!(b.resume.is_none());
        assert!(b.window() >= 500_000, "cwnd {}", b.window());
    }

    #[test]
    fn careful_resume_retreats_from_congestion_but_not_from_the_usual_loss() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(40);
        let rate = 12_500_000;
        let adaptive = BbrOptions {
            loss_response: LossResponse::Adaptive,
        };
        // The jump's round loses about 9 % of what it delivers, with a queue in the RTT.
        for (usual, retreats) in [(0, true), (20, true), (50, false)] {
            let mut b = Bbr::new(MDS, adaptive);
            b.resume_from(1_000_000, rtt, usual);
            let now = drive(&mut b, t0, 1, rate, rtt);
            assert_eq!(b.window(), 500_000);
            // The samples before the losses waited in the queue too.
            b.recent_rtts = [rtt * 2; RECENT_RTTS];
            for _ in 0..STARTUP_FULL_LOSS_COUNT {
                let mut ev = loss(now, 500_000 / 60, 400_000);
                ev.latest_rtt = Some(rtt * 2);
                b.on_congestion_event(now, &ev);
            }
            drive(&mut b, now, 1, rate, rtt);
            if retreats {
                // Half of what the jump delivered, and Startup measures the path again.
                assert!(b.resume.is_none(), "usual {usual}");
                assert_eq!(b.state, State::Startup, "usual {usual}");
                assert!(b.window() <= 750_000, "usual {usual}: cwnd {}", b.window());
            } else {
                assert!(b.resume.is_some(), "usual {usual}");
                assert_eq!(b.state, State::Startup, "usual {usual}");
                assert!(
                    b.window() >= 1_000_000,
                    "usual {usual}: cwnd {}",
                    b.window()
                );
            }
        }
        // ECN-CE during the jump is congestion at once, whatever the usual loss.
        let mut b = Bbr::new(MDS, adaptive);
        b.resume_from(1_000_000, rtt, 50);
        let now = drive(&mut b, t0, 1, rate, rtt);
        let mut ce = loss(now, 0, 400_000);
        ce.ecn_ce = true;
        b.on_congestion_event(now, &ce);
        assert!(b.resume.is_none());
        assert!(b.window() < 500_000);
    }

    fn loss(now: Instant, lost: u64, in_flight: u64) -> LossEvent {
        LossEvent {
            largest_sent_time: now,
            lost_bytes: lost,
            ecn_ce: false,
            bytes_in_flight: in_flight,
            latest_rtt: None,
        }
    }

    /// inflight_hi, once set (by a lossy Startup, say), is no ceiling for good: when the
    /// path has room for twice as much, the probes for bandwidth raise it and find the
    /// rate. Every probe stopped after one ACK before (the window, at inflight_hi, was the
    /// limit), and the flow stayed at the old rate for the connection's life.
    #[test]
    fn inflight_hi_grows_when_the_path_has_more_room() {
        let t0 = Instant::now();
        let rate = 1_250_000;
        let rtt = Duration::from_millis(40);
        let mut b = Bbr::new(MDS, BbrOptions::default());
        let now = drive(&mut b, t0, 30, rate, rtt);
        assert!(b.in_probe_bw(), "state {:?}", b.state);
        let bdp = rate * 40 / 1000;
        b.inflight_hi = bdp;
        b.prev_probe_too_high = false;
        // 12 s at twice the rate: several probes (one every 2 to 3 s at most), each round
        // acknowledged two packets at a time, as a receiver does.
        let mut est = RttEstimator::new(rtt);
        est.update(Duration::ZERO, rtt);
        let mut now = now;
        let path_bdp = 2 * bdp;
        for _ in 0..300 {
            let flight = b.window().min(2 * path_bdp);
            b.on_packet_sent(now, flight, flight);
            let delivered = flight.min(path_bdp);
            let start = now;
            let mut acked = 0;
            while acked < delivered {
                let n = (2 * MDS).min(delivered - acked);
                acked += n;
                let at = start + rtt.mul_f64(acked as f64 / delivered as f64);
                let ack = AckEvent {
                    acked_bytes: n,
                    largest_acked_sent_time: start,
                    rtt: &est,
                    rate: Some(RateSample {
                        delivered,
                        interval: rtt,
                        prior_delivered: b.delivered,
                        is_app_limited: false,
                        rtt,
                    }),
                    prior_in_flight: flight - acked + n,
                    bytes_in_flight: flight - acked,
                    app_limited: false,
                };
                b.on_ack(at, &ack);
            }
            now = start + rtt;
        }
        assert!(
            b.inflight_hi > 3 * bdp / 2,
            "inflight_hi {} against {bdp}",
            b.inflight_hi
        );
        assert!(b.max_bw > rate * 3 / 2, "max_bw {}", b.max_bw);
    }

    #[test]
    fn lossy_rounds_lower_the_bounds_unless_loss_tolerant() {
        let t0 = Instant::now();
        let rate = 1_250_000;
        let rtt = Duration::from_millis(40);
        for tolerant in [false, true] {
            let loss_response = if tolerant {
                LossResponse::Never
            } else {
                LossResponse::Always
            };
            let mut b = Bbr::new(MDS, BbrOptions { loss_response });
            let mut now = drive(&mut b, t0, 30, rate, rtt);
            let before = b.window();
            // Five rounds, each losing a tenth of what it sent.
            for _ in 0..5 {
                b.on_congestion_event(now, &loss(now, before / 10, before / 2));
                now = drive(&mut b, now, 1, rate, rtt);
            }
            if tolerant {
                assert_eq!(b.inflight_lo, u64::MAX);
                assert!(b.window() >= before * 9 / 10);
            } else {
                assert!(b.inflight_lo < u64::MAX, "a lossy round sets inflight_lo");
                assert!(
                    b.window() <= b.inflight_lo.max(b.min_cwnd()),
                    "cwnd {} bounded by inflight_lo {}",
                    b.window(),
                    b.inflight_lo
                );
            }
        }
    }

    #[test]
    fn adaptive_startup_ends_on_loss_only_with_a_queue() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(40);
        let adaptive = BbrOptions {
            loss_response: LossResponse::Adaptive,
        };
        // Startup on a fast path: rounds of growing deliveries, each with heavy loss (six
        // loss events, 10 % of what was sent) seen at `extra` above the minimum RTT, the
        // delivery samples just before them at `before` above it, on a path an earlier
        // connection saw lose `usual` per mille.
        let startup_with = |extra: u64, before: u64, usual: u32| {
            let mut b = Bbr::new(MDS, adaptive);
            b.resume_from(0, Duration::ZERO, usual);
            let mut now = drive(&mut b, t0, 2, 100_000_000, rtt);
            for _ in 0..3 {
                let w = b.window();
                b.recent_rtts = [rtt + Duration::from_millis(before); RECENT_RTTS];
                for _ in 0..STARTUP_FULL_LOSS_COUNT {
                    let mut ev = loss(now, w / 60, w / 2);
                    ev.latest_rtt = Some(rtt + Duration::from_millis(extra));
                    b.on_congestion_event(now, &ev);
                }
                now = drive(&mut b, now, 1, 100_000_000, rtt);
            }
            b
        };
        let startup = |extra: u64, usual: u32| startup_with(extra, extra, usual);
        // 4 ms above a 40 ms minimum is below the threshold (5 ms): random loss, Startup
        // goes on. 6 ms is a queue: Startup ends and inflight_hi is set, as in BBRv3.
        let random = startup(4, 0);
        assert_eq!(random.state, State::Startup);
        assert_eq!(random.inflight_hi, u64::MAX);
        let queue = startup(6, 0);
        assert_ne!(queue.state, State::Startup);
        assert!(queue.inflight_hi < u64::MAX);
        // The newest sample 6 ms up but the ones before it at the minimum: jitter, not a
        // full queue.
        assert_eq!(startup_with(6, 0, 0).state, State::Startup);
        // On a path known to lose 6 %, rounds losing 10 % are its usual loss (jitter can
        // look like a queue); on one known to lose 3 %, they are more than that.
        assert_eq!(startup(6, 60).state, State::Startup);
        assert_ne!(startup(6, 30).state, State::Startup);

        // After Startup, lossy rounds leave the model alone even with a queue.
        let rate = 1_250_000;
        let mut b = Bbr::new(MDS, adaptive);
        let mut now = drive(&mut b, t0, 30, rate, rtt);
        let before = b.window();
        for _ in 0..5 {
            let mut ev = loss(now, before / 10, before / 2);
            ev.latest_rtt = Some(rtt * 2);
            b.on_congestion_event(now, &ev);
            now = drive(&mut b, now, 1, rate, rtt);
        }
        assert_eq!(b.inflight_lo, u64::MAX);
        assert!(b.window() >= before * 9 / 10);
        // ECN-CE is congestion whatever the delay.
        for _ in 0..5 {
            for _ in 0..(before / 10 / MDS) {
                let mut ce = loss(now, 0, before / 2);
                ce.ecn_ce = true;
                ce.latest_rtt = Some(rtt);
                b.on_congestion_event(now, &ce);
            }
            now = drive(&mut b, now, 1, rate, rtt);
        }
        assert!(b.inflight_lo < u64::MAX, "CE marks set inflight_lo");
    }

    /// Before an RTT sample the pacing rate is the initial window over 1 ms, no pacing at
    /// all; the first sample sets it from the window over SRTT, as Linux's BBR does, so
    /// Startup does not send each doubled window in one burst.
    #[test]
    fn the_first_rtt_sample_sets_the_startup_pacing_rate() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(40);
        let mut b = Bbr::new(MDS, BbrOptions::default());
        let before = b.pacing_rate().unwrap();
        // One round of a slow path: 100 kB/s delivers 4 kB per 40 ms round, far less than
        // 2.77 x the initial window per RTT, which then sets the rate.
        drive(&mut b, t0, 1, 100_000, rtt);
        let after = b.pacing_rate().unwrap();
        let from_window = gain(initial_window(MDS), STARTUP_PACING_GAIN) * 1000 / 40;
        assert!(before >= 20 * after, "{before} then {after}");
        assert!(
            after >= from_window * 9 / 10 && after <= from_window * 11 / 10,
            "{after} against {from_window}"
        );
    }

    #[test]
    fn window_never_drops_below_four_packets() {
        let t0 = Instant::now();
        let mut b = Bbr::new(MDS, BbrOptions::default());
        drive(&mut b, t0, 10, 50_000, Duration::from_millis(100));
        b.on_persistent_congestion(t0);
        assert_eq!(b.window(), 4 * MDS);
        for i in 0..20 {
            let now = t0 + Duration::from_millis(100 * i);
            b.on_congestion_event(now, &loss(now, 10 * MDS, 0));
        }
        assert!(b.window() >= 4 * MDS);
    }
}
