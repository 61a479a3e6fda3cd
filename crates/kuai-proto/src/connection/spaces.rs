//! Per packet-number-space state (RFC 9000 §12.3): keys, the CRYPTO stream, sent packets and
//! loss-detection state (RFC 9002 Appendix A.2), and what we owe the peer in ACKs.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::crypto::KeyPair;
use crate::frame::EcnCounts;
use crate::range_set::RangeSet;
use crate::recovery::SentPackets;
use crate::stream::{Assembler, SendBuffer};

/// Most ACK ranges kept and sent (older ones are dropped; the peer has given up on them).
pub const MAX_ACK_RANGES: usize = 64;
/// Largest amount of out-of-order CRYPTO data buffered per space (RFC 9000 §7.5).
pub const MAX_CRYPTO_BUFFER: u64 = 64 * 1024;
/// Memory out-of-order CRYPTO data may hold at a server before the ClientHello is whole.
pub const MAX_CRYPTO_CHARGE_BEFORE_HELLO: u64 = 32 * 1024;

#[derive(Default)]
pub struct PacketSpace {
    /// Initial and Handshake keys; the Data space's keys live in the connection.
    pub keys: Option<Box<KeyPair>>,
    pub crypto_send: SendBuffer,
    pub crypto_recv: Assembler,
    pub next_pn: u64,
    pub sent: SentPackets,
    pub largest_acked: Option<u64>,
    /// Earliest time a packet in flight will be declared lost by time threshold.
    pub loss_time: Option<Instant>,
    pub time_of_last_ack_eliciting: Option<Instant>,
    pub ack: AckState,
    /// Probe packets to send now (after a PTO).
    pub probes: u8,
    /// Keys were discarded; nothing is sent or accepted in this space any more.
    pub discarded: bool,
    /// Peer's ECN counts as last reported, for validation.
    pub peer_ecn: EcnCounts,
    /// ECT(0)-marked packets sent in this space (for ECN validation).
    pub ecn_marked_sent: u64,
    /// Packets declared lost recently, to notice when an ACK shows the loss was spurious.
    pub recently_lost: VecDeque<LostRecord>,
    /// Packets sent without an ack-eliciting frame since the last one with (see
    /// `ACK_ONLY_BEFORE_PING`).
    pub ack_only_sent: u32,
}

/// ACK-only packets sent in a row before one carries a PING, so the peer acknowledges them
/// and their records can go (RFC 9000 §13.2.4).
pub const ACK_ONLY_BEFORE_PING: u32 = 32;

/// Most packet numbers the sent-packet records of a space span, whatever the congestion
/// window (see the limit in `Connection::record_sent`): older records are given up (as lost, if
/// in flight), so a peer that never acknowledges cannot grow them without end.
pub const MAX_SENT_SPAN: usize = 32 * 1024;

/// A packet declared lost: its number and how far the largest acknowledged number was past
/// it at that moment (the reordering it would take to make the loss spurious).
#[derive(Debug, Clone, Copy)]
pub struct LostRecord {
    pub pn: u64,
    pub reorder_distance: u64,
    pub path: crate::recovery::PathId,
}

/// Lost packets remembered for spurious-loss detection.
pub const MAX_RECENTLY_LOST: usize = 256;

/// What we have received and owe acknowledgements for.
#[derive(Default)]
pub struct AckState {
    /// Packet numbers received and still worth acknowledging.
    pub ranges: RangeSet,
    /// Packet numbers below this are treated as duplicates: they were received and their
    /// acknowledgement was acknowledged, or they fell out of the tracked ranges.
    pub floor: u64,
    /// Largest packet number ever received, and when.
    pub largest: Option<(u64, Instant)>,
    /// Ack-eliciting packets received since the last ACK we sent.
    pub eliciting_since_ack: u64,
    /// An ACK should go out at the next opportunity.
    pub immediate: bool,
    /// When a delayed ACK becomes due.
    pub deadline: Option<Instant>,
    /// Whether any packet arrived since the last ACK we sent (an ACK can piggyback).
    pub new_since_ack: bool,
    /// ECN codepoints seen on received packets (RFC 9000 §13.4.1).
    pub ecn: EcnCounts,
    pub ecn_seen: bool,
}

impl AckState {
    /// Records a received packet number. Returns false for a duplicate (or a packet so old
    /// that we stopped tracking its neighbourhood, which we treat the same way).
    pub fn on_packet(&mut self, pn: u64, now: Instant) -> bool {
        if pn < self.floor || self.ranges.contains(pn) {
            return false;
        }
        self.ranges.insert_one(pn);
        if self.ranges.len() > MAX_ACK_RANGES
            && let Some(r) = self.ranges.pop_first()
        {
            self.floor = r.end;
        }
        if self.largest.is_none_or(|(l, _)| pn > l) {
            self.largest = Some((pn, now));
        }
        self.new_since_ack = true;
        true
    }

    /// Whether an ACK is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.new_since_ack && (self.immediate || self.deadline.is_some_and(|d| d <= now))
    }

    /// The ack delay to report: time since the largest packet arrived.
    pub fn delay(&self, now: Instant) -> Duration {
        self.largest
            .map_or(Duration::ZERO, |(_, t)| now.saturating_duration_since(t))
    }

    /// An ACK was just sent.
    pub fn on_ack_sent(&mut self) {
        self.eliciting_since_ack = 0;
        self.immediate = false;
        self.deadline = None;
        self.new_since_ack = false;
    }

    /// The peer acknowledged our ACK that covered up to `largest`: stop acknowledging those
    /// (RFC 9000 §13.2.4).
    pub fn on_ack_acked(&mut self, largest: u64) {
        if largest >= self.floor {
            self.ranges.remove(0..largest + 1);
            self.floor = largest + 1;
        }
    }
}

/// The three packet-number spaces, indexed by [`crate::SpaceId::index`]. The Initial and
/// Handshake spaces live in one allocation that is freed once both are discarded (at
/// handshake confirmation, RFC 9001 §4.9), so an established connection carries only the
/// Data space. Reading a freed space sees an empty, discarded one.
#[derive(Default)]
pub struct Spaces {
    handshake: Option<Box<[PacketSpace; 2]>>,
    data: PacketSpace,
}

impl Spaces {
    /// A fresh set: all three spaces empty, none discarded.
    pub fn new() -> Self {
        Self {
            handshake: Some(Box::default()),
            data: PacketSpace::default(),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &PacketSpace> {
        (0..3).map(move |i| &self[i])
    }

    /// Frees the Initial and Handshake spaces if both are discarded.
    pub fn release_discarded(&mut self) {
        if self
            .handshake
            .as_ref()
            .is_some_and(|h| h.iter().all(|s| s.discarded))
        {
            self.handshake = None;
        }
    }
}

fn discarded_space() -> PacketSpace {
    PacketSpace {
        discarded: true,
        ..Default::default()
    }
}

static DISCARDED: std::sync::LazyLock<PacketSpace> = std::sync::LazyLock::new(discarded_space);

impl std::ops::Index<usize> for Spaces {
    type Output = PacketSpace;

    fn index(&self, i: usize) -> &PacketSpace {
        match (i, &self.handshake) {
            (2, _) => &self.data,
            (_, Some(h)) => &h[i],
            (_, None) => &DISCARDED,
        }
    }
}

impl std::ops::IndexMut<usize> for Spaces {
    /// A write to a freed space brings back an empty, discarded one (nothing on an
    /// established connection's paths writes there; this keeps a stray write harmless).
    fn index_mut(&mut self, i: usize) -> &mut PacketSpace {
        if i == 2 {
            return &mut self.data;
        }
        &mut self
            .handshake
            .get_or_insert_with(|| Box::new([discarded_space(), discarded_space()]))[i]
    }
}
