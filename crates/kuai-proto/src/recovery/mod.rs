//! Loss detection and recovery bookkeeping (RFC 9002): what was sent, RTT, pacing.

mod pacing;
mod rtt;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use pacing::Pacer;
pub use rtt::{GRANULARITY, RttEstimator};

use crate::types::{Dir, StreamId};

/// RFC 9002 §6.1.1: kPacketThreshold.
pub const PACKET_THRESHOLD: u64 = 3;
/// RFC 9002 §7.6.1: kPersistentCongestionThreshold.
pub const PERSISTENT_CONGESTION_THRESHOLD: u32 = 3;

/// Identifies a network path of a connection (RTT, congestion, pacing, MTU and ECN state).
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash, Ord, PartialOrd, Default)]
pub struct PathId(pub u32);

/// What a sent packet carried that matters if it is acknowledged or lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SentFrame {
    Stream {
        id: StreamId,
        offset: u64,
        len: u32,
        fin: bool,
    },
    Crypto {
        offset: u64,
        len: u32,
    },
    ResetStream(StreamId),
    StopSending(StreamId),
    MaxData,
    MaxStreamData(StreamId),
    MaxStreams(Dir),
    DataBlocked,
    StreamDataBlocked(StreamId),
    StreamsBlocked(Dir),
    NewConnectionId(u64),
    RetireConnectionId(u64),
    HandshakeDone,
    NewToken,
    AckFrequency(u64),
    /// An ACK frame whose largest acknowledged number was this; once acknowledged, ranges at
    /// or below it need not be acknowledged again (RFC 9000 §13.2.4).
    Ack(u64),
    Datagram,
    PathChallenge,
    PathResponse,
}

/// A sent packet awaiting acknowledgement.
#[derive(Debug)]
pub struct SentPacket {
    pub time_sent: Instant,
    /// Bytes on the wire (the packet's share of the UDP payload).
    pub size: u16,
    pub ack_eliciting: bool,
    pub in_flight: bool,
    pub path: PathId,
    /// Whether this packet was a DPLPMTUD probe.
    pub mtu_probe: bool,
    /// Sent with the ECT(0) codepoint.
    pub ecn_marked: bool,
    pub frames: Vec<SentFrame>,
    // Delivery-rate estimation state at send time.
    pub delivered: u64,
    pub delivered_time: Instant,
    pub first_sent_time: Instant,
    pub is_app_limited: bool,
    /// A redundant copy of this packet's frames was queued, or it is itself such a copy.
    pub copied: bool,
}

/// Frame vectors of acknowledged packets kept for reuse.
const SPARE_FRAME_VECS: usize = 1024;

/// Sent packets of one packet-number space, indexed by packet number.
///
/// Packet numbers only grow, so a deque indexed by `pn - base` gives O(1) insertion and lookup;
/// acknowledged or lost entries become `None` and the front is trimmed.
#[derive(Debug, Default)]
pub struct SentPackets {
    packets: VecDeque<Option<SentPacket>>,
    base: u64,
    /// Packets present.
    len: usize,
    /// Ack-eliciting packets present and in flight.
    ack_eliciting_in_flight: usize,
    /// Recycled frame vectors, so steady-state sending does not allocate.
    spare: Vec<Vec<SentFrame>>,
}

impl SentPackets {
    pub fn insert(&mut self, pn: u64, packet: SentPacket) {
        if self.packets.is_empty() {
            self.base = pn;
        }
        debug_assert!(
            pn >= self.base + self.packets.len() as u64,
            "packet numbers must grow"
        );
        while self.base + (self.packets.len() as u64) < pn {
            self.packets.push_back(None);
        }
        if packet.ack_eliciting && packet.in_flight {
            self.ack_eliciting_in_flight += 1;
        }
        self.packets.push_back(Some(packet));
        self.len += 1;
    }

    pub fn get(&self, pn: u64) -> Option<&SentPacket> {
        let i = pn.checked_sub(self.base)?;
        self.packets.get(usize::try_from(i).ok()?)?.as_ref()
    }

    pub fn get_mut(&mut self, pn: u64) -> Option<&mut SentPacket> {
        let i = pn.checked_sub(self.base)?;
        self.packets.get_mut(usize::try_from(i).ok()?)?.as_mut()
    }

    pub fn remove(&mut self, pn: u64) -> Option<SentPacket> {
        let i = usize::try_from(pn.checked_sub(self.base)?).ok()?;
        let p = self.packets.get_mut(i)?.take()?;
        self.len -= 1;
        if p.ack_eliciting && p.in_flight {
            self.ack_eliciting_in_flight -= 1;
        }
        while let Some(None) = self.packets.front() {
            self.packets.pop_front();
            self.base += 1;
        }
        Some(p)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Packet numbers from the oldest record present to the newest.
    pub fn span(&self) -> usize {
        self.packets.len()
    }

    /// Gives back the frame pool and the queue's spare capacity (what is left is typically a
    /// few ACK-only packets that wait for an ACK of an ACK).
    pub fn release_memory(&mut self) {
        self.packets.shrink_to_fit();
        self.spare = Vec::new();
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn has_ack_eliciting_in_flight(&self) -> bool {
        self.ack_eliciting_in_flight > 0
    }

    /// Packet numbers present, ascending, that are below `end`.
    pub fn pns_below(&self, end: u64) -> impl Iterator<Item = u64> + '_ {
        let base = self.base;
        self.packets
            .iter()
            .enumerate()
            .take_while(move |(i, _)| base + (*i as u64) < end)
            .filter(|(_, p)| p.is_some())
            .map(move |(i, _)| base + i as u64)
    }

    /// Packets present, ascending.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (u64, &SentPacket)> + '_ {
        let base = self.base;
        self.packets
            .iter()
            .enumerate()
            .filter_map(move |(i, p)| p.as_ref().map(|p| (base + i as u64, p)))
    }

    /// The newest packet number with a slot (recorded, or a hole below a newer record);
    /// `None` when there is none.
    pub fn last_slot_pn(&self) -> Option<u64> {
        (!self.packets.is_empty()).then(|| self.base + self.packets.len() as u64 - 1)
    }

    /// The smallest packet number present.
    pub fn first_pn(&self) -> Option<u64> {
        self.iter().next().map(|(pn, _)| pn)
    }

    /// Takes all packets (when a space's keys are discarded).
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, SentPacket)> + '_ {
        let base = self.base;
        self.len = 0;
        self.ack_eliciting_in_flight = 0;
        self.packets
            .drain(..)
            .enumerate()
            .filter_map(move |(i, p)| p.map(|p| (base + i as u64, p)))
    }

    /// A cleared frame vector to fill for the next packet.
    pub fn take_frame_vec(&mut self) -> Vec<SentFrame> {
        self.spare.pop().unwrap_or_default()
    }

    /// Returns a packet's frame vector for reuse.
    pub fn recycle(&mut self, mut v: Vec<SentFrame>) {
        // One ACK may free a whole GSO burst's worth of packets: keep enough for the next
        // bursts (a few tens of KB at most; a quiet spell gives it all back).
        if self.spare.len() < SPARE_FRAME_VECS {
            v.clear();
            self.spare.push(v);
        }
    }
}

/// Delivery-rate estimation state of a path (draft-cheng-iccrg-delivery-rate-estimation §3).
#[derive(Debug, Clone)]
pub struct DeliveryRate {
    pub delivered: u64,
    pub delivered_time: Instant,
    pub first_sent_time: Instant,
    /// Nonzero while the flight contains packets sent when application-limited: the
    /// `delivered` value at which that ends.
    pub app_limited_until: u64,
}

impl DeliveryRate {
    pub fn new(now: Instant) -> Self {
        Self {
            delivered: 0,
            delivered_time: now,
            first_sent_time: now,
            app_limited_until: 0,
        }
    }

    /// State to stamp on a packet being sent.
    pub fn on_sent(&mut self, now: Instant, bytes_in_flight: u64) -> (u64, Instant, Instant, bool) {
        if bytes_in_flight == 0 {
            self.first_sent_time = now;
            self.delivered_time = now;
        }
        (
            self.delivered,
            self.delivered_time,
            self.first_sent_time,
            self.app_limited_until > 0,
        )
    }

    /// The sender has nothing to send and the window is not full.
    pub fn on_app_limited(&mut self, bytes_in_flight: u64) {
        self.app_limited_until = (self.delivered + bytes_in_flight).max(1);
    }
}

/// Per-ACK accumulator for the newest acknowledged packet's rate sample.
#[derive(Debug, Default)]
pub struct RateSampler {
    best: Option<(u64, Instant, Instant, bool, Instant)>,
}

impl RateSampler {
    /// Feeds one newly acknowledged packet.
    pub fn on_acked(&mut self, dr: &mut DeliveryRate, now: Instant, p: &SentPacket) {
        dr.delivered += u64::from(p.size);
        dr.delivered_time = now;
        let newer = match self.best {
            None => true,
            Some((prior_delivered, ..)) => p.delivered > prior_delivered,
        };
        if newer {
            self.best = Some((
                p.delivered,
                p.delivered_time,
                p.first_sent_time,
                p.is_app_limited,
                p.time_sent,
            ));
            dr.first_sent_time = p.time_sent;
        }
        if dr.app_limited_until > 0 && dr.delivered > dr.app_limited_until {
            dr.app_limited_until = 0;
        }
    }

    /// The rate sample of this ACK, if any packet was acknowledged.
    pub fn finish(self, dr: &DeliveryRate, now: Instant) -> Option<crate::cc::RateSample> {
        let (prior_delivered, prior_time, first_sent, app_limited, sent) = self.best?;
        let send_elapsed = sent.saturating_duration_since(first_sent);
        let ack_elapsed = dr.delivered_time.saturating_duration_since(prior_time);
        let interval = send_elapsed.max(ack_elapsed);
        Some(crate::cc::RateSample {
            delivered: dr.delivered - prior_delivered,
            interval,
            prior_delivered,
            is_app_limited: app_limited,
            rtt: now.saturating_duration_since(sent),
        })
    }
}

/// Duration of `n` probe timeouts starting from `pto` with exponential backoff, saturating.
pub fn backoff(pto: Duration, count: u32) -> Duration {
    pto.checked_mul(1u32 << count.min(16))
        .unwrap_or(Duration::from_secs(3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkt(t: Instant) -> SentPacket {
        SentPacket {
            time_sent: t,
            size: 1200,
            ack_eliciting: true,
            in_flight: true,
            path: PathId(0),
            mtu_probe: false,
            ecn_marked: false,
            frames: Vec::new(),
            delivered: 0,
            delivered_time: t,
            first_sent_time: t,
            is_app_limited: false,
            copied: false,
        }
    }

    #[test]
    fn sent_packets_index() {
        let t = Instant::now();
        let mut s = SentPackets::default();
        s.insert(5, pkt(t));
        s.insert(6, pkt(t));
        s.insert(9, pkt(t)); // 7 and 8 skipped
        assert_eq!(s.len(), 3);
        assert!(s.get(7).is_none());
        assert!(s.remove(6).is_some());
        assert!(s.remove(6).is_none());
        assert_eq!(s.pns_below(100).collect::<Vec<_>>(), vec![5, 9]);
        assert!(s.remove(5).is_some());
        assert_eq!(s.first_pn(), Some(9));
        assert!(s.has_ack_eliciting_in_flight());
        assert!(s.remove(9).is_some());
        assert!(s.is_empty());
        assert!(!s.has_ack_eliciting_in_flight());
    }
}
