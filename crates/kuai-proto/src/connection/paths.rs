//! Per-path state (RFC 9000 §8.2, §9; RFC 9002 §9): RTT, congestion control, pacing, MTU,
//! ECN and validation, keyed by [`PathId`] so several paths can coexist.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::cc::{Congestion, CongestionAlgorithm, CongestionController};
use crate::recovery::{DeliveryRate, Pacer, PathId, RttEstimator};

/// ECN codepoints (RFC 3168).
#[derive(Debug, Copy, Clone, Eq, PartialEq)]
pub enum EcnCodepoint {
    /// ECT(0).
    Ect0 = 0b10,
    /// ECT(1).
    Ect1 = 0b01,
    /// Congestion Experienced.
    Ce = 0b11,
}

impl EcnCodepoint {
    /// From the two ECN bits of the IP header; `None` for Not-ECT.
    pub fn from_bits(bits: u8) -> Option<Self> {
        match bits & 0b11 {
            0b10 => Some(Self::Ect0),
            0b01 => Some(Self::Ect1),
            0b11 => Some(Self::Ce),
            _ => None,
        }
    }
}

/// ECN validation state of a path (RFC 9000 §13.4.2).
#[derive(Debug, Copy, Clone, Eq, PartialEq)]
pub enum EcnState {
    /// Marking the first packets and waiting for the peer to report them.
    Testing {
        /// Packets marked so far.
        marked: u64,
    },
    /// The peer's counts prove the path passes ECN.
    Capable,
    /// The path or the peer mangles or ignores ECN; no more marking.
    Failed,
    /// Disabled by configuration.
    Off,
}

/// Packets marked during the ECN testing period (RFC 9000 §13.4.2.1 suggests 10).
const ECN_TESTING_PACKETS: u64 = 10;

/// The losses behind the last window reduction, and how many of them later ACKs showed
/// were not lost (reordering). The reduction is undone only when all were: one spurious loss
/// among real ones proves nothing (Linux undoes a recovery likewise only when no
/// retransmission was needed). `lost == 0`: nothing to undo (none yet, done, or the
/// reduction came from ECN-CE or persistent congestion, which are not undone).
#[derive(Debug, Clone, Copy, Default)]
pub struct UndoWatch {
    /// Lost packets counted toward the reduction.
    pub lost: u32,
    /// Of them, found acknowledged.
    pub spurious: u32,
    /// Lowest packet number lost in the reduction's losses: records below it belong to an
    /// earlier one.
    pub floor: u64,
    /// Reductions undone so far (statistics).
    pub undone: u32,
}

impl EcnState {
    /// Whether packets go out marked ECT(0).
    pub fn should_mark(&self) -> bool {
        match *self {
            EcnState::Testing { marked } => marked < ECN_TESTING_PACKETS,
            EcnState::Capable => true,
            _ => false,
        }
    }
}

/// DPLPMTUD (RFC 8899, RFC 9000 §14.3) search state.
#[derive(Debug, Clone)]
pub struct Mtud {
    /// Size every packet is built to.
    pub current: u16,
    /// Largest size that may still work.
    upper: u16,
    /// Probe in flight: its size and packet number.
    pub in_flight: Option<(u16, u64)>,
    /// Consecutive losses of probes of `in_flight`'s size.
    failures: u8,
    /// Next time a probe may be sent.
    pub next_probe: Option<Instant>,
    /// Base size that never needs probing.
    base: u16,
    /// Full-size packets lost since the last acknowledgement of a full-size packet; a burst of
    /// these triggers a confirmation probe, never a direct reduction.
    full_size_losses: u32,
    /// Whether the current size must be re-confirmed by a probe (suspected black hole).
    pub confirm: bool,
    /// The configured maximum was probed once already.
    tried_top: bool,
    /// Size of the latest probe.
    last_probe: u16,
}

/// Probes lost in a row before a size is taken as too large (RFC 8899 MAX_PROBES).
const MAX_PROBES: u8 = 3;
/// Re-search for a larger MTU this often after the search ended (RFC 8899 §5.3.3).
const RAISE_TIMER: Duration = Duration::from_secs(600);

impl Mtud {
    pub fn new(base: u16, max: u16, now: Instant) -> Self {
        Self {
            current: base,
            upper: max.max(base),
            in_flight: None,
            failures: 0,
            next_probe: (max > base).then_some(now),
            base,
            full_size_losses: 0,
            confirm: false,
            tried_top: false,
            last_probe: base,
        }
    }

    /// The size to probe next, if a probe is due.
    pub fn probe_size(&self, now: Instant) -> Option<u16> {
        if self.in_flight.is_some() || self.next_probe.is_none_or(|t| t > now) {
            return None;
        }
        if self.confirm {
            return Some(self.current);
        }
        if self.upper <= self.current {
            return None;
        }
        // Binary search, rounded to 4 bytes; jump straight to the top first, since the
        // common case is that the whole range works.
        let size = if self.failures > 0 {
            // Retry the size that was lost, up to MAX_PROBES times.
            self.last_probe
        } else if !self.tried_top {
            self.upper
        } else {
            (self.current + (self.upper - self.current).div_ceil(2)).min(self.upper)
        };
        Some(size)
    }

    /// The peer takes datagrams of `max` bytes at most (its max_udp_payload_size): the
    /// search stops there instead of at the configured maximum.
    pub fn cap(&mut self, max: u16) {
        self.upper = self.upper.min(max).max(self.base);
    }

    pub fn on_probe_sent(&mut self, size: u16, pn: u64) {
        self.in_flight = Some((size, pn));
        self.last_probe = size;
        self.tried_top = true;
    }

    /// A probe was acknowledged: the size works. Returns the new MTU if it grew.
    pub fn on_probe_acked(&mut self, pn: u64, now: Instant) -> Option<u16> {
        let (size, probe_pn) = self.in_flight?;
        if probe_pn != pn {
            return None;
        }
        self.in_flight = None;
        self.failures = 0;
        self.confirm = false;
        self.full_size_losses = 0;
        let grew = size > self.current;
        self.current = self.current.max(size);
        self.next_probe = if self.upper > self.current {
            Some(now)
        } else {
            Some(now + RAISE_TIMER)
        };
        grew.then_some(self.current)
    }

    /// A probe was declared lost. Returns the new (lower) MTU if the path turned out not to
    /// carry the current size.
    pub fn on_probe_lost(&mut self, pn: u64, now: Instant, pto: Duration) -> Option<u16> {
        let (size, probe_pn) = self.in_flight?;
        if probe_pn != pn {
            return None;
        }
        self.in_flight = None;
        self.failures += 1;
        self.next_probe = Some(now + pto.min(Duration::from_secs(1)));
        if self.failures < MAX_PROBES {
            return None;
        }
        self.failures = 0;
        if self.confirm && size == self.current {
            // A black hole: the current size stopped working. Fall back to the base and
            // search again.
            self.confirm = false;
            self.upper = self.current.saturating_sub(1).max(self.base);
            self.current = self.base;
            return Some(self.current);
        }
        self.upper = size.saturating_sub(1).max(self.current);
        None
    }

    /// A full-size (above base) packet was lost. Ordinary loss never lowers the MTU: a burst
    /// of such losses only schedules a confirmation probe of the current size.
    pub fn on_full_size_lost(&mut self, now: Instant) {
        if self.current <= self.base {
            return;
        }
        self.full_size_losses += 1;
        if self.full_size_losses >= 5 && !self.confirm {
            self.confirm = true;
            if self.in_flight.is_none() {
                self.next_probe = Some(now);
            }
        }
    }

    /// Probe timeouts with full-size packets in flight: confirm the current size.
    pub fn suspect_black_hole(&mut self, now: Instant) {
        if self.current > self.base && !self.confirm {
            self.confirm = true;
            if self.in_flight.is_none() {
                self.next_probe = Some(now);
            }
        }
    }

    pub fn on_full_size_acked(&mut self) {
        self.full_size_losses = 0;
    }
}

/// An in-progress path validation (RFC 9000 §8.2).
#[derive(Debug, Clone)]
pub struct Challenge {
    pub data: [u8; 8],
    /// When to send (or resend) PATH_CHALLENGE.
    pub resend_at: Instant,
    /// When to give up.
    pub deadline: Instant,
    pub sent: bool,
    /// A send went in a datagram under 1200 bytes (the amplification budget allowed no
    /// more): an answer validates the address, not that the path carries QUIC's minimum.
    pub small: bool,
}

/// A peer address other than the active path's that sent a PATH_CHALLENGE: a peer probing a
/// new path, or anyone who spoofed that source address. Until the address is validated it
/// may be sent at most three times what came from it (RFC 9000 §8.2.2, §9.3).
#[derive(Debug, Clone)]
pub struct OffPath {
    pub remote: SocketAddr,
    pub local_ip: Option<IpAddr>,
    /// The latest challenge from there not answered yet (older ones need no answer).
    pub challenge: Option<[u8; 8]>,
    pub amp_received: u64,
    pub amp_sent: u64,
}

/// Addresses probing at once that are tracked; a new one replaces the oldest.
pub const MAX_OFF_PATHS: usize = 4;

impl OffPath {
    pub fn new(remote: SocketAddr, local_ip: Option<IpAddr>) -> Self {
        Self {
            remote,
            local_ip,
            challenge: None,
            amp_received: 0,
            amp_sent: 0,
        }
    }

    /// Bytes that may still be sent there (RFC 9000 §8.1).
    pub fn amplification_budget(&self) -> u64 {
        (self.amp_received * 3).saturating_sub(self.amp_sent)
    }

    /// Whether a datagram from `remote` to our `local_ip` is from this address (an unknown
    /// local IP matches any, as for the active path).
    pub fn matches(&self, remote: SocketAddr, local_ip: Option<IpAddr>) -> bool {
        remote == self.remote
            && (local_ip.is_none() || self.local_ip.is_none() || local_ip == self.local_ip)
    }
}

/// Client: a probe of the server's preferred address (RFC 9000 §9.6.1).
#[derive(Debug)]
pub struct PreferredProbe {
    pub remote: SocketAddr,
    /// The peer's connection ID for the new path (sequence 1, from the transport parameter).
    pub cid_seq: u64,
    /// Set once the handshake is confirmed.
    pub challenge: Option<Challenge>,
}

/// One network path.
#[derive(Debug)]
pub struct Path {
    pub id: PathId,
    pub remote: SocketAddr,
    pub local_ip: Option<IpAddr>,
    pub rtt: RttEstimator,
    /// When the path's first RTT sample was taken: persistent congestion counts only
    /// packets sent after it (RFC 9002 §7.6.2).
    pub first_rtt_sample: Option<Instant>,
    pub cc: Congestion,
    pub pacer: Pacer,
    pub delivery: DeliveryRate,
    pub mtud: Mtud,
    pub ecn: EcnState,
    pub bytes_in_flight: u64,
    /// Address validated (RFC 9000 §8): no anti-amplification limit.
    pub validated: bool,
    /// Bytes received from and sent to this address while unvalidated (RFC 9000 §8.1).
    pub amp_received: u64,
    pub amp_sent: u64,
    pub challenge: Option<Challenge>,
    /// Whether the last send found the congestion window full (for RFC 9002 §7.8).
    pub cwnd_limited: bool,
    /// Packet reordering threshold (RFC 9002 §6.1.1 kPacketThreshold, raised when losses turn
    /// out to be spurious).
    pub reorder_threshold: u64,
    /// Time threshold in eighths of an RTT (RFC 9002 §6.1.2: 9/8, raised likewise).
    pub time_threshold_eighths: u32,
    /// Congestion events that reduced the window.
    pub congestion_events: u64,
    /// The window reduction the controller may still undo, if every loss behind it proves
    /// spurious.
    pub undo: UndoWatch,
    /// Recent ack-eliciting packets sent and declared lost, halved together as they grow:
    /// a decaying loss-rate estimate for [`crate::config::Redundancy`].
    pub recent_sent: u32,
    pub recent_lost: u32,
    /// The peer's packets this side has seen the packet numbers of, and of those the ones
    /// that never arrived (gaps below the largest), halved together like `recent_sent`. A
    /// client that downloads sends a handful of packets per connection, so its own loss
    /// count says little about the path; the gaps in what it receives say more.
    pub rx_numbered: u32,
    pub rx_missing: u32,
}

/// The largest UDP payload DPLPMTUD may probe for on a path to `remote`: the configured
/// maximum is for IPv4, and IPv6's header is 20 bytes longer (40 against 20), so both fill the
/// same link MTU (1500 bytes: 1472 and 1452). Never below the initial size.
fn mtu_ceiling(remote: SocketAddr, (initial, max): (u16, u16)) -> u16 {
    let v6 = match remote.ip() {
        IpAddr::V4(_) => false,
        IpAddr::V6(a) => a.to_ipv4_mapped().is_none(),
    };
    if v6 {
        max.saturating_sub(20).max(initial)
    } else {
        max
    }
}

impl Path {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: PathId,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        now: Instant,
        initial_rtt: Duration,
        cc: &CongestionAlgorithm,
        initial_window: u64,
        mtu: (u16, u16),
        ecn: bool,
        validated: bool,
    ) -> Self {
        Self {
            id,
            remote,
            local_ip,
            rtt: RttEstimator::new(initial_rtt),
            first_rtt_sample: None,
            cc: cc.build_with_window(now, u64::from(mtu.0), initial_window),
            pacer: Pacer::new(now, u64::from(mtu.0)),
            delivery: DeliveryRate::new(now),
            mtud: Mtud::new(mtu.0, mtu_ceiling(remote, mtu), now),
            ecn: if ecn {
                EcnState::Testing { marked: 0 }
            } else {
                EcnState::Off
            },
            bytes_in_flight: 0,
            validated,
            amp_received: 0,
            amp_sent: 0,
            challenge: None,
            cwnd_limited: false,
            reorder_threshold: crate::recovery::PACKET_THRESHOLD,
            time_threshold_eighths: 9,
            congestion_events: 0,
            undo: UndoWatch::default(),
            recent_sent: 0,
            recent_lost: 0,
            rx_numbered: 0,
            rx_missing: 0,
        }
    }

    /// Recent loss rate in per mille of ack-eliciting packets; 0 before 32 were sent.
    pub fn recent_loss_permille(&self) -> u32 {
        if self.recent_sent < 32 {
            return 0;
        }
        (u64::from(self.recent_lost) * 1000 / u64::from(self.recent_sent)) as u32
    }

    /// Starts from what an earlier connection learnt: its loss rate, and for the congestion
    /// controller the window it carried (Careful Resume; the RTT is already the hint's).
    pub fn assume_hint(&mut self, h: &super::PathHint) {
        self.assume_loss_rate(h.loss_permille);
        self.cc.resume_from(h.window, h.window_rtt, h.loss_permille);
    }

    /// Starts the loss-rate estimate from an earlier connection's rate (per mille): as if
    /// 200 packets had been sent at that rate, so real ones take over within a few hundred.
    pub fn assume_loss_rate(&mut self, permille: u32) {
        self.recent_sent = 200;
        self.recent_lost = permille.min(1000) / 5;
        // The receive side's prior weighs less, so that a path whose loss changed shows it
        // in the next connection's hint within a few short connections.
        self.rx_numbered = 100;
        self.rx_missing = permille.min(1000) / 10;
    }

    /// A packet numbered `pn` arrived in a space whose largest number so far was
    /// `prev_largest`: numbers skipped over are counted missing until they arrive late.
    /// A peer may skip a number on purpose (RFC 9000 §21.4; kuai skips one among its first
    /// 16–256 packets, then one per 1,024–32,768), which counts as one loss: about 1 % on a
    /// 100 KB connection, under the 2 % that makes a path lossy.
    pub fn count_received_for_loss_rate(&mut self, pn: u64, prev_largest: Option<u64>) {
        let (numbered, missing) = match prev_largest {
            None => (pn.saturating_add(1), pn),
            Some(l) if pn > l => (pn - l, pn - l - 1),
            Some(_) => {
                self.rx_missing = self.rx_missing.saturating_sub(1);
                return;
            }
        };
        // A jump of more than a few hundred is not loss (or is too much to weigh).
        let numbered = numbered.min(256) as u32;
        let missing = (missing.min(255) as u32).min(numbered - 1);
        self.rx_numbered += numbered;
        self.rx_missing += missing;
        while self.rx_numbered >= 1024 {
            self.rx_numbered /= 2;
            self.rx_missing /= 2;
        }
    }

    /// The loss rate to remember for the next connection on this path (per mille): the
    /// packets this side lost and the peer's packets that never arrived, together, once at
    /// least 16 were counted (0 before).
    pub fn hint_loss_permille(&self) -> u32 {
        let total = u64::from(self.recent_sent) + u64::from(self.rx_numbered);
        if total < 16 {
            return 0;
        }
        let lost = u64::from(self.recent_lost) + u64::from(self.rx_missing);
        (lost * 1000 / total).min(1000) as u32
    }

    pub fn count_sent_for_loss_rate(&mut self) {
        self.recent_sent += 1;
        if self.recent_sent >= 1024 {
            self.recent_sent /= 2;
            self.recent_lost /= 2;
        }
    }

    pub fn mtu(&self) -> u16 {
        self.mtud.current
    }

    /// Bytes we may still send before the 3x limit (RFC 9000 §8.1); `u64::MAX` once validated.
    pub fn amplification_budget(&self) -> u64 {
        if self.validated {
            u64::MAX
        } else {
            (self.amp_received * 3).saturating_sub(self.amp_sent)
        }
    }

    pub fn window_room(&self) -> u64 {
        self.cc.window().saturating_sub(self.bytes_in_flight)
    }

    pub fn pacing_rate(&self) -> u64 {
        Pacer::rate(self.cc.pacing_rate(), self.cc.window(), self.rtt.smoothed())
    }

    pub fn set_mtu(&mut self, mtu: u16) {
        self.cc.on_mtu_update(u64::from(mtu));
        self.pacer.on_mtu_update(u64::from(mtu));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_path() -> Path {
        let addr: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        let cc = CongestionAlgorithm::default();
        Path::new(
            PathId(0),
            addr,
            None,
            Instant::now(),
            Duration::from_millis(40),
            &cc,
            12_000,
            (1200, 1452),
            false,
            true,
        )
    }

    #[test]
    fn the_mtu_ceiling_follows_the_address_family() {
        let v4: SocketAddr = "192.0.2.1:443".parse().unwrap();
        let v6: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:443".parse().unwrap();
        assert_eq!(mtu_ceiling(v4, (1200, 1472)), 1472);
        assert_eq!(mtu_ceiling(v6, (1200, 1472)), 1452);
        assert_eq!(mtu_ceiling(mapped, (1200, 1472)), 1472);
        // Probing stays off when it was off, and never goes below the initial size.
        assert_eq!(mtu_ceiling(v6, (1200, 1200)), 1200);
        assert_eq!(mtu_ceiling(v6, (1200, 1210)), 1200);
    }

    #[test]
    fn the_hint_counts_gaps_in_what_arrives_and_forgives_late_packets() {
        let mut p = test_path();
        // 0..=19 with 3, 7 and 11 missing, then 7 arrives late: 2 of 20 lost.
        let mut largest = None;
        for pn in (0..20u64).filter(|n| ![3, 7, 11].contains(n)).chain([7]) {
            p.count_received_for_loss_rate(pn, largest);
            largest = largest.max(Some(pn));
        }
        assert_eq!((p.rx_numbered, p.rx_missing), (20, 2));
        assert_eq!(p.hint_loss_permille(), 100);
        // Fewer than 16 counted: no estimate.
        let mut q = test_path();
        q.count_received_for_loss_rate(9, None);
        assert_eq!(q.hint_loss_permille(), 0);
        // A hint's prior weighs in, and a huge jump counts as at most 256 numbers.
        q.assume_loss_rate(200);
        q.count_received_for_loss_rate(1_000_000, Some(9));
        assert!(q.rx_numbered < 1024 && q.rx_missing < q.rx_numbered);
    }

    #[test]
    fn mtud_searches_and_survives_ordinary_loss() {
        let t = Instant::now();
        let mut m = Mtud::new(1200, 1452, t);
        assert_eq!(m.probe_size(t), Some(1452));
        m.on_probe_sent(1452, 10);
        assert_eq!(m.on_probe_acked(10, t), Some(1452));
        assert_eq!(m.probe_size(t), None);
        // Ordinary losses do not lower the MTU; a burst asks for confirmation.
        for _ in 0..5 {
            m.on_full_size_lost(t);
        }
        assert_eq!(m.current, 1452);
        assert_eq!(m.probe_size(t), Some(1452));
        m.on_probe_sent(1452, 20);
        assert_eq!(m.on_probe_acked(20, t), None);
        assert_eq!(m.current, 1452);
    }

    #[test]
    fn mtud_black_hole_needs_repeated_probe_loss() {
        let t = Instant::now();
        let pto = Duration::from_millis(100);
        let mut m = Mtud::new(1200, 1452, t);
        m.on_probe_sent(1452, 1);
        m.on_probe_acked(1, t);
        for _ in 0..5 {
            m.on_full_size_lost(t);
        }
        let mut now = t;
        for i in 0..2 {
            let s = m.probe_size(now).unwrap();
            m.on_probe_sent(s, 100 + i);
            assert_eq!(m.on_probe_lost(100 + i, now, pto), None);
            now += Duration::from_secs(1);
        }
        let s = m.probe_size(now).unwrap();
        m.on_probe_sent(s, 200);
        assert_eq!(m.on_probe_lost(200, now, pto), Some(1200));
    }

    #[test]
    fn mtud_binary_search_after_failure() {
        let t = Instant::now();
        let pto = Duration::from_millis(100);
        let mut m = Mtud::new(1200, 1500, t);
        let mut now = t;
        for i in 0..3 {
            let s = m.probe_size(now).unwrap();
            assert_eq!(s, 1500);
            m.on_probe_sent(s, i);
            m.on_probe_lost(i, now, pto);
            now += Duration::from_secs(1);
        }
        let s = m.probe_size(now).unwrap();
        assert!(s > 1200 && s < 1500, "{s}");
    }
}
