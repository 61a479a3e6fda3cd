//! Frames (RFC 9000 §19, RFC 9221 §4, draft-ietf-quic-ack-frequency §4–5).
//!
//! Decoding borrows from the decrypted packet payload: STREAM, CRYPTO and DATAGRAM data are
//! [`Bytes`] slices of it, never copies. Every length is checked against what is left of the
//! payload before anything is sliced or allocated.

use std::fmt;
use std::ops::RangeInclusive;

use bytes::{Buf, BufMut, Bytes};

use crate::cid::{ConnectionId, MAX_CID_SIZE};
use crate::coding::{BufExt, BufMutExt, UnexpectedEnd};
use crate::error::TransportError;
use crate::range_set::RangeSet;
use crate::types::{Dir, StreamId};
use crate::varint::VarInt;

/// A frame type as it appears on the wire.
#[derive(Copy, Clone, Eq, PartialEq, Hash)]
pub struct FrameType(pub u64);

impl FrameType {
    pub const PADDING: Self = Self(0x00);
    pub const PING: Self = Self(0x01);
    pub const ACK: Self = Self(0x02);
    pub const ACK_ECN: Self = Self(0x03);
    pub const RESET_STREAM: Self = Self(0x04);
    pub const STOP_SENDING: Self = Self(0x05);
    pub const CRYPTO: Self = Self(0x06);
    pub const NEW_TOKEN: Self = Self(0x07);
    /// 0x08..=0x0f: OFF (0x04), LEN (0x02) and FIN (0x01) bits.
    pub const STREAM: Self = Self(0x08);
    pub const MAX_DATA: Self = Self(0x10);
    pub const MAX_STREAM_DATA: Self = Self(0x11);
    pub const MAX_STREAMS_BIDI: Self = Self(0x12);
    pub const MAX_STREAMS_UNI: Self = Self(0x13);
    pub const DATA_BLOCKED: Self = Self(0x14);
    pub const STREAM_DATA_BLOCKED: Self = Self(0x15);
    pub const STREAMS_BLOCKED_BIDI: Self = Self(0x16);
    pub const STREAMS_BLOCKED_UNI: Self = Self(0x17);
    pub const NEW_CONNECTION_ID: Self = Self(0x18);
    pub const RETIRE_CONNECTION_ID: Self = Self(0x19);
    pub const PATH_CHALLENGE: Self = Self(0x1a);
    pub const PATH_RESPONSE: Self = Self(0x1b);
    pub const CONNECTION_CLOSE: Self = Self(0x1c);
    pub const APPLICATION_CLOSE: Self = Self(0x1d);
    pub const HANDSHAKE_DONE: Self = Self(0x1e);
    /// draft-ietf-quic-ack-frequency §5
    pub const IMMEDIATE_ACK: Self = Self(0x1f);
    /// RFC 9221 §4: 0x30 without length, 0x31 with.
    pub const DATAGRAM: Self = Self(0x30);
    pub const DATAGRAM_LEN: Self = Self(0x31);
    /// draft-ietf-quic-ack-frequency §4
    pub const ACK_FREQUENCY: Self = Self(0xaf);

    /// The frame type's name as RFC 9000 writes it.
    pub fn name(self) -> &'static str {
        match self.0 {
            0x00 => "PADDING",
            0x01 => "PING",
            0x02 | 0x03 => "ACK",
            0x04 => "RESET_STREAM",
            0x05 => "STOP_SENDING",
            0x06 => "CRYPTO",
            0x07 => "NEW_TOKEN",
            0x08..=0x0f => "STREAM",
            0x10 => "MAX_DATA",
            0x11 => "MAX_STREAM_DATA",
            0x12 | 0x13 => "MAX_STREAMS",
            0x14 => "DATA_BLOCKED",
            0x15 => "STREAM_DATA_BLOCKED",
            0x16 | 0x17 => "STREAMS_BLOCKED",
            0x18 => "NEW_CONNECTION_ID",
            0x19 => "RETIRE_CONNECTION_ID",
            0x1a => "PATH_CHALLENGE",
            0x1b => "PATH_RESPONSE",
            0x1c | 0x1d => "CONNECTION_CLOSE",
            0x1e => "HANDSHAKE_DONE",
            0x1f => "IMMEDIATE_ACK",
            0x30 | 0x31 => "DATAGRAM",
            0xaf => "ACK_FREQUENCY",
            _ => "UNKNOWN",
        }
    }

    /// Whether a packet containing this frame must be acknowledged (RFC 9002 §2).
    pub fn is_ack_eliciting(self) -> bool {
        !matches!(self.0, 0x00 | 0x02 | 0x03 | 0x1c | 0x1d)
    }

    /// Whether the frame may appear in Initial and Handshake packets (RFC 9000 §12.4, Table 3).
    pub fn allowed_in_handshake_spaces(self) -> bool {
        matches!(self.0, 0x00..=0x03 | 0x06 | 0x1c)
    }

    /// Whether the frame may appear in 0-RTT packets (RFC 9000 §12.4, Table 3: not ACK,
    /// CRYPTO, NEW_TOKEN, RETIRE_CONNECTION_ID, PATH_RESPONSE, HANDSHAKE_DONE; ACK_FREQUENCY
    /// and IMMEDIATE_ACK neither, draft-ietf-quic-ack-frequency §3: min_ack_delay is not
    /// remembered for 0-RTT).
    pub fn allowed_in_0rtt(self) -> bool {
        !matches!(
            self.0,
            0x02 | 0x03 | 0x06 | 0x07 | 0x19 | 0x1b | 0x1e | 0x1f | 0xaf
        )
    }

    /// Whether the frame counts toward bytes in flight (everything but ACK, PADDING counts;
    /// RFC 9002 §2 "in flight": ack-eliciting or containing PADDING).
    pub fn counts_in_flight(self) -> bool {
        self.is_ack_eliciting() || self.0 == 0x00
    }
}

impl fmt::Debug for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({:#x})", self.name(), self.0)
    }
}

/// ECN counts carried in ACK_ECN (RFC 9000 §19.3.2).
#[derive(Debug, Copy, Clone, Default, Eq, PartialEq)]
pub struct EcnCounts {
    pub ect0: u64,
    pub ect1: u64,
    pub ce: u64,
}

/// A decoded ACK frame. The gap/range list stays in its wire form and is walked by
/// [`Ack::iter`]; it was validated when the frame was decoded.
#[derive(Clone, PartialEq, Eq)]
pub struct Ack {
    pub largest: u64,
    /// Encoded ack delay; scale it by the peer's `ack_delay_exponent`.
    pub delay: u64,
    first_range: u64,
    range_count: u64,
    ranges: Bytes,
    pub ecn: Option<EcnCounts>,
}

impl Ack {
    /// Acknowledged ranges from the largest down.
    pub fn iter(&self) -> AckIter<'_> {
        AckIter {
            next: Some(self.largest.saturating_sub(self.first_range)..=self.largest),
            data: &self.ranges,
            remaining: self.range_count,
        }
    }

    /// The smallest acknowledged packet number.
    pub fn smallest(&self) -> u64 {
        self.iter().last().map_or(self.largest, |r| *r.start())
    }

    /// Writes an ACK frame for `ranges` (at most `max_ranges` of the highest ones).
    ///
    /// # Panics
    /// If `ranges` is empty.
    pub fn encode<B: BufMut>(
        delay: u64,
        ranges: &RangeSet,
        ecn: Option<&EcnCounts>,
        max_ranges: usize,
        buf: &mut B,
    ) {
        let mut rev = ranges.iter().rev().take(max_ranges.max(1));
        let first = rev.next().expect("ACK of no packets");
        let largest = first.end - 1;
        let count = ranges.len().min(max_ranges.max(1)) - 1;
        buf.put_var(if ecn.is_some() { 0x03 } else { 0x02 });
        buf.put_var(largest);
        buf.put_var(delay);
        buf.put_var(count as u64);
        buf.put_var(largest - first.start);
        let mut prev_smallest = first.start;
        for r in rev {
            // RFC 9000 §19.3.1: Gap = previous smallest - this largest - 2.
            buf.put_var(prev_smallest - r.end - 1);
            buf.put_var(r.end - 1 - r.start);
            prev_smallest = r.start;
        }
        if let Some(ecn) = ecn {
            buf.put_var(ecn.ect0);
            buf.put_var(ecn.ect1);
            buf.put_var(ecn.ce);
        }
    }

    /// The encoded size [`Ack::encode`] would produce.
    pub fn encoded_len(
        delay: u64,
        ranges: &RangeSet,
        ecn: Option<&EcnCounts>,
        max_ranges: usize,
    ) -> usize {
        let mut rev = ranges.iter().rev().take(max_ranges.max(1));
        let Some(first) = rev.next() else { return 0 };
        let largest = first.end - 1;
        let count = ranges.len().min(max_ranges.max(1)) - 1;
        let mut n = 1
            + VarInt::size_of(largest)
            + VarInt::size_of(delay)
            + VarInt::size_of(count as u64)
            + VarInt::size_of(largest - first.start);
        let mut prev_smallest = first.start;
        for r in rev {
            n += VarInt::size_of(prev_smallest - r.end - 1) + VarInt::size_of(r.end - 1 - r.start);
            prev_smallest = r.start;
        }
        if let Some(e) = ecn {
            n += VarInt::size_of(e.ect0) + VarInt::size_of(e.ect1) + VarInt::size_of(e.ce);
        }
        n
    }
}

impl fmt::Debug for Ack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = f.debug_list();
        for r in self.iter() {
            l.entry(&r);
        }
        l.finish()?;
        write!(f, " delay={} ecn={:?}", self.delay, self.ecn)
    }
}

/// Iterator over the ranges of an [`Ack`], largest first.
pub struct AckIter<'a> {
    next: Option<RangeInclusive<u64>>,
    data: &'a [u8],
    remaining: u64,
}

impl Iterator for AckIter<'_> {
    type Item = RangeInclusive<u64>;

    fn next(&mut self) -> Option<Self::Item> {
        let current = self.next.take()?;
        if self.remaining > 0 {
            self.remaining -= 1;
            // Validated at decode time; a failure here just ends the iteration.
            let gap = self.data.get_var().ok()?;
            let len = self.data.get_var().ok()?;
            let largest = current.start().checked_sub(gap + 2)?;
            let smallest = largest.checked_sub(len)?;
            self.next = Some(smallest..=largest);
        }
        Some(current)
    }
}

/// A STREAM frame.
#[derive(Clone, PartialEq, Eq)]
pub struct StreamFrame {
    pub id: StreamId,
    pub offset: u64,
    pub fin: bool,
    pub data: Bytes,
}

impl fmt::Debug for StreamFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "STREAM id={} off={} len={} fin={}",
            self.id.0,
            self.offset,
            self.data.len(),
            self.fin
        )
    }
}

/// Header of a STREAM frame being written; the data follows it.
#[derive(Debug, Copy, Clone)]
pub struct StreamHeader {
    pub id: StreamId,
    pub offset: u64,
    /// `Some(len)` to write an explicit length; `None` when the frame runs to the packet's end.
    pub len: Option<usize>,
    pub fin: bool,
}

impl StreamHeader {
    pub fn encoded_len(&self) -> usize {
        Self::base_len(self.id, self.offset) + self.len.map_or(0, |l| VarInt::size_of(l as u64))
    }

    pub fn encode<B: BufMut>(&self, buf: &mut B) {
        let mut ty = 0x08u8;
        if self.offset > 0 {
            ty |= 0x04;
        }
        if self.len.is_some() {
            ty |= 0x02;
        }
        if self.fin {
            ty |= 0x01;
        }
        buf.put_u8(ty);
        buf.put_var(self.id.0);
        if self.offset > 0 {
            buf.put_var(self.offset);
        }
        if let Some(len) = self.len {
            buf.put_var(len as u64);
        }
    }

    /// The largest amount of data that fits in `space` bytes without a length field (the
    /// frame then ends the packet).
    pub fn max_data_to_end(id: StreamId, offset: u64, space: usize) -> usize {
        space.saturating_sub(Self::base_len(id, offset))
    }

    /// Type, stream ID and offset: the header without its length field.
    fn base_len(id: StreamId, offset: u64) -> usize {
        1 + VarInt::size_of(id.0)
            + if offset > 0 {
                VarInt::size_of(offset)
            } else {
                0
            }
    }

    /// The largest amount of data that fits in `space` bytes with an explicit length field.
    pub fn max_data_with_len(id: StreamId, offset: u64, space: usize) -> usize {
        let base = Self::base_len(id, offset);
        if space <= base + 1 {
            return 0;
        }
        let avail = space - base;
        // A length field of `lsize` bytes can express at most `cap`.
        [
            (1usize, 63usize),
            (2, 16_383),
            (4, (1 << 30) - 1),
            (8, usize::MAX),
        ]
        .iter()
        .filter(|&&(lsize, _)| avail > lsize)
        .map(|&(lsize, cap)| (avail - lsize).min(cap))
        .max()
        .unwrap_or(0)
    }
}

/// Any frame kuai understands.
#[derive(Clone, PartialEq, Eq)]
pub enum Frame {
    /// A run of consecutive PADDING bytes.
    Padding(usize),
    Ping,
    Ack(Ack),
    ResetStream {
        id: StreamId,
        error_code: u64,
        final_size: u64,
    },
    StopSending {
        id: StreamId,
        error_code: u64,
    },
    Crypto {
        offset: u64,
        data: Bytes,
    },
    NewToken {
        token: Bytes,
    },
    Stream(StreamFrame),
    MaxData(u64),
    MaxStreamData {
        id: StreamId,
        max: u64,
    },
    MaxStreams {
        dir: Dir,
        count: u64,
    },
    DataBlocked(u64),
    StreamDataBlocked {
        id: StreamId,
        limit: u64,
    },
    StreamsBlocked {
        dir: Dir,
        limit: u64,
    },
    NewConnectionId(NewConnectionId),
    RetireConnectionId {
        seq: u64,
    },
    PathChallenge([u8; 8]),
    PathResponse([u8; 8]),
    Close(Close),
    HandshakeDone,
    Datagram(Bytes),
    AckFrequency(AckFrequency),
    ImmediateAck,
}

/// NEW_CONNECTION_ID (RFC 9000 §19.15).
#[derive(Debug, Copy, Clone, PartialEq, Eq)]
pub struct NewConnectionId {
    pub seq: u64,
    pub retire_prior_to: u64,
    pub cid: ConnectionId,
    pub reset_token: [u8; 16],
}

/// CONNECTION_CLOSE (RFC 9000 §19.19): transport (0x1c) when `frame_type` is `Some`,
/// application (0x1d) otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close {
    pub error_code: u64,
    /// For a transport close, the frame type that triggered it (0 when unknown).
    pub frame_type: Option<u64>,
    pub reason: Bytes,
}

impl Close {
    pub fn is_application(&self) -> bool {
        self.frame_type.is_none()
    }
}

/// ACK_FREQUENCY (draft-ietf-quic-ack-frequency §4).
#[derive(Debug, Copy, Clone, PartialEq, Eq)]
pub struct AckFrequency {
    pub seq: u64,
    pub ack_eliciting_threshold: u64,
    /// Microseconds.
    pub request_max_ack_delay: u64,
    pub reordering_threshold: u64,
}

/// A malformed frame; the connection closes with FRAME_ENCODING_ERROR (RFC 9000 §12.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    pub ty: FrameType,
    pub reason: &'static str,
}

impl From<FrameError> for TransportError {
    fn from(e: FrameError) -> Self {
        TransportError::FRAME_ENCODING_ERROR(e.reason).with_frame(e.ty)
    }
}

impl Frame {
    pub fn ty(&self) -> FrameType {
        match self {
            Frame::Padding(_) => FrameType::PADDING,
            Frame::Ping => FrameType::PING,
            Frame::Ack(a) => {
                if a.ecn.is_some() {
                    FrameType::ACK_ECN
                } else {
                    FrameType::ACK
                }
            }
            Frame::ResetStream { .. } => FrameType::RESET_STREAM,
            Frame::StopSending { .. } => FrameType::STOP_SENDING,
            Frame::Crypto { .. } => FrameType::CRYPTO,
            Frame::NewToken { .. } => FrameType::NEW_TOKEN,
            Frame::Stream(_) => FrameType::STREAM,
            Frame::MaxData(_) => FrameType::MAX_DATA,
            Frame::MaxStreamData { .. } => FrameType::MAX_STREAM_DATA,
            Frame::MaxStreams { dir: Dir::Bi, .. } => FrameType::MAX_STREAMS_BIDI,
            Frame::MaxStreams { dir: Dir::Uni, .. } => FrameType::MAX_STREAMS_UNI,
            Frame::DataBlocked(_) => FrameType::DATA_BLOCKED,
            Frame::StreamDataBlocked { .. } => FrameType::STREAM_DATA_BLOCKED,
            Frame::StreamsBlocked { dir: Dir::Bi, .. } => FrameType::STREAMS_BLOCKED_BIDI,
            Frame::StreamsBlocked { dir: Dir::Uni, .. } => FrameType::STREAMS_BLOCKED_UNI,
            Frame::NewConnectionId(_) => FrameType::NEW_CONNECTION_ID,
            Frame::RetireConnectionId { .. } => FrameType::RETIRE_CONNECTION_ID,
            Frame::PathChallenge(_) => FrameType::PATH_CHALLENGE,
            Frame::PathResponse(_) => FrameType::PATH_RESPONSE,
            Frame::Close(c) => {
                if c.is_application() {
                    FrameType::APPLICATION_CLOSE
                } else {
                    FrameType::CONNECTION_CLOSE
                }
            }
            Frame::HandshakeDone => FrameType::HANDSHAKE_DONE,
            Frame::Datagram(_) => FrameType::DATAGRAM_LEN,
            Frame::AckFrequency(_) => FrameType::ACK_FREQUENCY,
            Frame::ImmediateAck => FrameType::IMMEDIATE_ACK,
        }
    }

    /// Writes a frame. ACK and STREAM frames are usually written by [`Ack::encode`] and
    /// [`StreamHeader`] directly; here STREAM and DATAGRAM always carry an explicit length.
    pub fn encode<B: BufMut>(&self, buf: &mut B) {
        match self {
            Frame::Padding(n) => buf.put_bytes(0, *n),
            Frame::Ping => buf.put_u8(0x01),
            Frame::Ack(a) => {
                buf.put_var(if a.ecn.is_some() { 0x03 } else { 0x02 });
                buf.put_var(a.largest);
                buf.put_var(a.delay);
                buf.put_var(a.range_count);
                buf.put_var(a.first_range);
                buf.put_slice(&a.ranges);
                if let Some(e) = &a.ecn {
                    buf.put_var(e.ect0);
                    buf.put_var(e.ect1);
                    buf.put_var(e.ce);
                }
            }
            Frame::ResetStream {
                id,
                error_code,
                final_size,
            } => {
                buf.put_u8(0x04);
                buf.put_var(id.0);
                buf.put_var(*error_code);
                buf.put_var(*final_size);
            }
            Frame::StopSending { id, error_code } => {
                buf.put_u8(0x05);
                buf.put_var(id.0);
                buf.put_var(*error_code);
            }
            Frame::Crypto { offset, data } => {
                buf.put_u8(0x06);
                buf.put_var(*offset);
                buf.put_var(data.len() as u64);
                buf.put_slice(data);
            }
            Frame::NewToken { token } => {
                buf.put_u8(0x07);
                buf.put_var(token.len() as u64);
                buf.put_slice(token);
            }
            Frame::Stream(s) => {
                StreamHeader {
                    id: s.id,
                    offset: s.offset,
                    len: Some(s.data.len()),
                    fin: s.fin,
                }
                .encode(buf);
                buf.put_slice(&s.data);
            }
            Frame::MaxData(v) => {
                buf.put_u8(0x10);
                buf.put_var(*v);
            }
            Frame::MaxStreamData { id, max } => {
                buf.put_u8(0x11);
                buf.put_var(id.0);
                buf.put_var(*max);
            }
            Frame::MaxStreams { dir, count } => {
                buf.put_u8(if *dir == Dir::Bi { 0x12 } else { 0x13 });
                buf.put_var(*count);
            }
            Frame::DataBlocked(v) => {
                buf.put_u8(0x14);
                buf.put_var(*v);
            }
            Frame::StreamDataBlocked { id, limit } => {
                buf.put_u8(0x15);
                buf.put_var(id.0);
                buf.put_var(*limit);
            }
            Frame::StreamsBlocked { dir, limit } => {
                buf.put_u8(if *dir == Dir::Bi { 0x16 } else { 0x17 });
                buf.put_var(*limit);
            }
            Frame::NewConnectionId(n) => {
                buf.put_u8(0x18);
                buf.put_var(n.seq);
                buf.put_var(n.retire_prior_to);
                buf.put_u8(n.cid.len() as u8);
                buf.put_slice(&n.cid);
                buf.put_slice(&n.reset_token);
            }
            Frame::RetireConnectionId { seq } => {
                buf.put_u8(0x19);
                buf.put_var(*seq);
            }
            Frame::PathChallenge(d) => {
                buf.put_u8(0x1a);
                buf.put_slice(d);
            }
            Frame::PathResponse(d) => {
                buf.put_u8(0x1b);
                buf.put_slice(d);
            }
            Frame::Close(c) => {
                match c.frame_type {
                    Some(ft) => {
                        buf.put_u8(0x1c);
                        buf.put_var(c.error_code);
                        buf.put_var(ft);
                    }
                    None => {
                        buf.put_u8(0x1d);
                        buf.put_var(c.error_code);
                    }
                }
                buf.put_var(c.reason.len() as u64);
                buf.put_slice(&c.reason);
            }
            Frame::HandshakeDone => buf.put_u8(0x1e),
            Frame::Datagram(d) => {
                buf.put_u8(0x31);
                buf.put_var(d.len() as u64);
                buf.put_slice(d);
            }
            Frame::AckFrequency(a) => {
                buf.put_var(0xaf);
                buf.put_var(a.seq);
                buf.put_var(a.ack_eliciting_threshold);
                buf.put_var(a.request_max_ack_delay);
                buf.put_var(a.reordering_threshold);
            }
            Frame::ImmediateAck => buf.put_u8(0x1f),
        }
    }

    /// Encoded size of the frame as [`Frame::encode`] writes it.
    pub fn encoded_len(&self) -> usize {
        let v = VarInt::size_of;
        match self {
            Frame::Padding(n) => *n,
            Frame::Ping | Frame::HandshakeDone | Frame::ImmediateAck => 1,
            Frame::Ack(a) => {
                1 + v(a.largest)
                    + v(a.delay)
                    + v(a.range_count)
                    + v(a.first_range)
                    + a.ranges.len()
                    + a.ecn.map_or(0, |e| v(e.ect0) + v(e.ect1) + v(e.ce))
            }
            Frame::ResetStream {
                id,
                error_code,
                final_size,
            } => 1 + v(id.0) + v(*error_code) + v(*final_size),
            Frame::StopSending { id, error_code } => 1 + v(id.0) + v(*error_code),
            Frame::Crypto { offset, data } => 1 + v(*offset) + v(data.len() as u64) + data.len(),
            Frame::NewToken { token } => 1 + v(token.len() as u64) + token.len(),
            Frame::Stream(s) => {
                StreamHeader {
                    id: s.id,
                    offset: s.offset,
                    len: Some(s.data.len()),
                    fin: s.fin,
                }
                .encoded_len()
                    + s.data.len()
            }
            Frame::MaxData(x) | Frame::DataBlocked(x) => 1 + v(*x),
            Frame::MaxStreamData { id, max: x } | Frame::StreamDataBlocked { id, limit: x } => {
                1 + v(id.0) + v(*x)
            }
            Frame::MaxStreams { count: x, .. } | Frame::StreamsBlocked { limit: x, .. } => {
                1 + v(*x)
            }
            Frame::NewConnectionId(n) => 1 + v(n.seq) + v(n.retire_prior_to) + 1 + n.cid.len() + 16,
            Frame::RetireConnectionId { seq } => 1 + v(*seq),
            Frame::PathChallenge(_) | Frame::PathResponse(_) => 9,
            Frame::Close(c) => {
                1 + v(c.error_code)
                    + c.frame_type.map_or(0, v)
                    + v(c.reason.len() as u64)
                    + c.reason.len()
            }
            Frame::Datagram(d) => 1 + v(d.len() as u64) + d.len(),
            Frame::AckFrequency(a) => {
                v(0xaf)
                    + v(a.seq)
                    + v(a.ack_eliciting_threshold)
                    + v(a.request_max_ack_delay)
                    + v(a.reordering_threshold)
            }
        }
    }
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frame::Padding(n) => write!(f, "PADDING({n})"),
            Frame::Ping => f.write_str("PING"),
            Frame::Ack(a) => write!(f, "ACK {a:?}"),
            Frame::ResetStream {
                id,
                error_code,
                final_size,
            } => {
                write!(
                    f,
                    "RESET_STREAM id={} code={error_code} final={final_size}",
                    id.0
                )
            }
            Frame::StopSending { id, error_code } => {
                write!(f, "STOP_SENDING id={} code={error_code}", id.0)
            }
            Frame::Crypto { offset, data } => write!(f, "CRYPTO off={offset} len={}", data.len()),
            Frame::NewToken { token } => write!(f, "NEW_TOKEN len={}", token.len()),
            Frame::Stream(s) => s.fmt(f),
            Frame::MaxData(v) => write!(f, "MAX_DATA {v}"),
            Frame::MaxStreamData { id, max } => write!(f, "MAX_STREAM_DATA id={} {max}", id.0),
            Frame::MaxStreams { dir, count } => write!(f, "MAX_STREAMS {dir:?} {count}"),
            Frame::DataBlocked(v) => write!(f, "DATA_BLOCKED {v}"),
            Frame::StreamDataBlocked { id, limit } => {
                write!(f, "STREAM_DATA_BLOCKED id={} {limit}", id.0)
            }
            Frame::StreamsBlocked { dir, limit } => write!(f, "STREAMS_BLOCKED {dir:?} {limit}"),
            Frame::NewConnectionId(n) => write!(
                f,
                "NEW_CONNECTION_ID seq={} retire_prior_to={} cid={}",
                n.seq, n.retire_prior_to, n.cid
            ),
            Frame::RetireConnectionId { seq } => write!(f, "RETIRE_CONNECTION_ID seq={seq}"),
            Frame::PathChallenge(d) => write!(f, "PATH_CHALLENGE {d:02x?}"),
            Frame::PathResponse(d) => write!(f, "PATH_RESPONSE {d:02x?}"),
            Frame::Close(c) => write!(
                f,
                "CONNECTION_CLOSE {} code={:#x} frame={:?} reason={:?}",
                if c.is_application() {
                    "app"
                } else {
                    "transport"
                },
                c.error_code,
                c.frame_type,
                String::from_utf8_lossy(&c.reason)
            ),
            Frame::HandshakeDone => f.write_str("HANDSHAKE_DONE"),
            Frame::Datagram(d) => write!(f, "DATAGRAM len={}", d.len()),
            Frame::AckFrequency(a) => write!(f, "ACK_FREQUENCY {a:?}"),
            Frame::ImmediateAck => f.write_str("IMMEDIATE_ACK"),
        }
    }
}

/// Iterates over the frames of a decrypted packet payload. After an error it yields nothing more.
pub struct FrameIter {
    bytes: Bytes,
    failed: bool,
}

impl FrameIter {
    pub fn new(payload: Bytes) -> Self {
        Self {
            bytes: payload,
            failed: false,
        }
    }

    fn decode(&mut self) -> Result<Frame, FrameError> {
        let start_len = self.bytes.remaining();
        let ty_raw = self.bytes.get_var().map_err(|_| FrameError {
            ty: FrameType::PADDING,
            reason: "truncated frame type",
        })?;
        let ty = FrameType(ty_raw);
        // RFC 9000 §12.4: frame types must use the shortest encoding.
        if start_len - self.bytes.remaining() != VarInt::size_of(ty_raw) {
            return Err(FrameError {
                ty,
                reason: "frame type not minimally encoded",
            });
        }
        let err = |reason| FrameError { ty, reason };
        let trunc = |_: UnexpectedEnd| FrameError {
            ty,
            reason: "frame truncated",
        };
        let b = &mut self.bytes;
        Ok(match ty_raw {
            0x00 => {
                let mut n = 1;
                while b.first() == Some(&0) {
                    b.advance(1);
                    n += 1;
                }
                Frame::Padding(n)
            }
            0x01 => Frame::Ping,
            0x02 | 0x03 => {
                let largest = b.get_var().map_err(trunc)?;
                let delay = b.get_var().map_err(trunc)?;
                let range_count = b.get_var().map_err(trunc)?;
                let first_range = b.get_var().map_err(trunc)?;
                if first_range > largest {
                    return Err(err("ACK range below zero"));
                }
                // Walk the ranges once to validate and find their extent.
                let mut walker: &[u8] = &b[..];
                let before = walker.len();
                let mut smallest = largest - first_range;
                for _ in 0..range_count {
                    let gap = walker.get_var().map_err(trunc)?;
                    let len = walker.get_var().map_err(trunc)?;
                    let next_largest = smallest
                        .checked_sub(gap)
                        .and_then(|x| x.checked_sub(2))
                        .ok_or(err("ACK gap below zero"))?;
                    smallest = next_largest
                        .checked_sub(len)
                        .ok_or(err("ACK range below zero"))?;
                }
                let ranges_len = before - walker.len();
                let ranges = b.split_to(ranges_len);
                let ecn = if ty_raw == 0x03 {
                    Some(EcnCounts {
                        ect0: b.get_var().map_err(trunc)?,
                        ect1: b.get_var().map_err(trunc)?,
                        ce: b.get_var().map_err(trunc)?,
                    })
                } else {
                    None
                };
                Frame::Ack(Ack {
                    largest,
                    delay,
                    first_range,
                    range_count,
                    ranges,
                    ecn,
                })
            }
            0x04 => Frame::ResetStream {
                id: StreamId(b.get_var().map_err(trunc)?),
                error_code: b.get_var().map_err(trunc)?,
                final_size: b.get_var().map_err(trunc)?,
            },
            0x05 => Frame::StopSending {
                id: StreamId(b.get_var().map_err(trunc)?),
                error_code: b.get_var().map_err(trunc)?,
            },
            0x06 => {
                let offset = b.get_var().map_err(trunc)?;
                let len = b.get_var().map_err(trunc)?;
                if offset + len > VarInt::MAX.into_inner() {
                    return Err(err("CRYPTO data beyond 2^62"));
                }
                let data = take(b, len).ok_or(err("CRYPTO data truncated"))?;
                Frame::Crypto { offset, data }
            }
            0x07 => {
                let len = b.get_var().map_err(trunc)?;
                if len == 0 {
                    return Err(err("empty NEW_TOKEN"));
                }
                Frame::NewToken {
                    token: take(b, len).ok_or(err("token truncated"))?,
                }
            }
            0x08..=0x0f => {
                let id = StreamId(b.get_var().map_err(trunc)?);
                let offset = if ty_raw & 0x04 != 0 {
                    b.get_var().map_err(trunc)?
                } else {
                    0
                };
                let data = if ty_raw & 0x02 != 0 {
                    let len = b.get_var().map_err(trunc)?;
                    take(b, len).ok_or(err("STREAM data truncated"))?
                } else {
                    b.split_to(b.len())
                };
                // RFC 9000 §19.8: offset + length must not exceed 2^62 - 1.
                if offset + data.len() as u64 > VarInt::MAX.into_inner() {
                    return Err(err("STREAM data beyond 2^62"));
                }
                Frame::Stream(StreamFrame {
                    id,
                    offset,
                    fin: ty_raw & 0x01 != 0,
                    data,
                })
            }
            0x10 => Frame::MaxData(b.get_var().map_err(trunc)?),
            0x11 => Frame::MaxStreamData {
                id: StreamId(b.get_var().map_err(trunc)?),
                max: b.get_var().map_err(trunc)?,
            },
            0x12 | 0x13 => {
                let count = b.get_var().map_err(trunc)?;
                // RFC 9000 §19.11: a count above 2^60 is a FRAME_ENCODING_ERROR.
                if count > 1 << 60 {
                    return Err(err("MAX_STREAMS above 2^60"));
                }
                Frame::MaxStreams {
                    dir: if ty_raw == 0x12 { Dir::Bi } else { Dir::Uni },
                    count,
                }
            }
            0x14 => Frame::DataBlocked(b.get_var().map_err(trunc)?),
            0x15 => Frame::StreamDataBlocked {
                id: StreamId(b.get_var().map_err(trunc)?),
                limit: b.get_var().map_err(trunc)?,
            },
            0x16 | 0x17 => {
                let limit = b.get_var().map_err(trunc)?;
                if limit > 1 << 60 {
                    return Err(err("STREAMS_BLOCKED above 2^60"));
                }
                Frame::StreamsBlocked {
                    dir: if ty_raw == 0x16 { Dir::Bi } else { Dir::Uni },
                    limit,
                }
            }
            0x18 => {
                let seq = b.get_var().map_err(trunc)?;
                let retire_prior_to = b.get_var().map_err(trunc)?;
                if retire_prior_to > seq {
                    return Err(err("retire_prior_to above sequence number"));
                }
                let len = b.get_u8_checked().map_err(trunc)? as usize;
                if len == 0 || len > MAX_CID_SIZE {
                    return Err(err("connection ID length out of range"));
                }
                if b.remaining() < len + 16 {
                    return Err(err("NEW_CONNECTION_ID truncated"));
                }
                let cid = ConnectionId::new(&b[..len]);
                b.advance(len);
                let mut reset_token = [0; 16];
                b.copy_to_slice(&mut reset_token);
                Frame::NewConnectionId(NewConnectionId {
                    seq,
                    retire_prior_to,
                    cid,
                    reset_token,
                })
            }
            0x19 => Frame::RetireConnectionId {
                seq: b.get_var().map_err(trunc)?,
            },
            0x1a | 0x1b => {
                let mut d = [0; 8];
                b.copy_to_checked(&mut d).map_err(trunc)?;
                if ty_raw == 0x1a {
                    Frame::PathChallenge(d)
                } else {
                    Frame::PathResponse(d)
                }
            }
            0x1c | 0x1d => {
                let error_code = b.get_var().map_err(trunc)?;
                let frame_type = if ty_raw == 0x1c {
                    Some(b.get_var().map_err(trunc)?)
                } else {
                    None
                };
                let len = b.get_var().map_err(trunc)?;
                let reason = take(b, len).ok_or(err("reason phrase truncated"))?;
                Frame::Close(Close {
                    error_code,
                    frame_type,
                    reason,
                })
            }
            0x1e => Frame::HandshakeDone,
            0x1f => Frame::ImmediateAck,
            0x30 => Frame::Datagram(b.split_to(b.len())),
            0x31 => {
                let len = b.get_var().map_err(trunc)?;
                Frame::Datagram(take(b, len).ok_or(err("DATAGRAM truncated"))?)
            }
            0xaf => Frame::AckFrequency(AckFrequency {
                seq: b.get_var().map_err(trunc)?,
                ack_eliciting_threshold: b.get_var().map_err(trunc)?,
                request_max_ack_delay: b.get_var().map_err(trunc)?,
                reordering_threshold: b.get_var().map_err(trunc)?,
            }),
            _ => return Err(err("unknown frame type")),
        })
    }
}

fn take(b: &mut Bytes, len: u64) -> Option<Bytes> {
    if (b.len() as u64) < len {
        return None;
    }
    Some(b.split_to(len as usize))
}

impl Iterator for FrameIter {
    type Item = Result<Frame, FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.bytes.is_empty() {
            return None;
        }
        let r = self.decode();
        if r.is_err() {
            self.failed = true;
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 9000 §12.4, Table 3: the frames a 0-RTT packet may not carry.
    #[test]
    fn frames_refused_in_0rtt() {
        for t in [0x02, 0x03, 0x06, 0x07, 0x19, 0x1b, 0x1e] {
            assert!(!FrameType(t).allowed_in_0rtt(), "{t:#x}");
        }
        for t in [0x00, 0x01, 0x04, 0x05, 0x08, 0x0f, 0x10, 0x18, 0x1a, 0x1c, 0x1d] {
            assert!(FrameType(t).allowed_in_0rtt(), "{t:#x}");
        }
    }

    fn roundtrip(f: Frame) {
        let mut buf = Vec::new();
        f.encode(&mut buf);
        assert_eq!(buf.len(), f.encoded_len(), "{f:?}");
        let mut it = FrameIter::new(Bytes::from(buf));
        let g = it.next().unwrap().unwrap();
        assert_eq!(f, g);
        assert!(it.next().is_none());
    }

    #[test]
    fn every_frame_roundtrips() {
        let mut ranges = RangeSet::new();
        ranges.insert(1..5);
        ranges.insert(10..11);
        ranges.insert(20..100);
        let mut buf = Vec::new();
        Ack::encode(
            25,
            &ranges,
            Some(&EcnCounts {
                ect0: 5,
                ect1: 0,
                ce: 1,
            }),
            64,
            &mut buf,
        );
        assert_eq!(
            buf.len(),
            Ack::encoded_len(
                25,
                &ranges,
                Some(&EcnCounts {
                    ect0: 5,
                    ect1: 0,
                    ce: 1
                }),
                64
            )
        );
        let ack = match FrameIter::new(Bytes::from(buf)).next().unwrap().unwrap() {
            Frame::Ack(a) => a,
            f => panic!("{f:?}"),
        };
        let got: Vec<_> = ack.iter().collect();
        assert_eq!(got, vec![20..=99, 10..=10, 1..=4]);
        assert_eq!(ack.smallest(), 1);

        let frames = vec![
            Frame::Padding(3),
            Frame::Ping,
            Frame::Ack(ack),
            Frame::ResetStream {
                id: StreamId(4),
                error_code: 7,
                final_size: 1 << 40,
            },
            Frame::StopSending {
                id: StreamId(3),
                error_code: 0x100,
            },
            Frame::Crypto {
                offset: 1000,
                data: Bytes::from_static(b"hello"),
            },
            Frame::NewToken {
                token: Bytes::from_static(b"tok"),
            },
            Frame::Stream(StreamFrame {
                id: StreamId(8),
                offset: 0,
                fin: true,
                data: Bytes::from_static(b"x"),
            }),
            Frame::Stream(StreamFrame {
                id: StreamId(8),
                offset: 77777,
                fin: false,
                data: Bytes::from_static(b"abc"),
            }),
            Frame::MaxData(1 << 30),
            Frame::MaxStreamData {
                id: StreamId(2),
                max: 9,
            },
            Frame::MaxStreams {
                dir: Dir::Bi,
                count: 100,
            },
            Frame::MaxStreams {
                dir: Dir::Uni,
                count: 3,
            },
            Frame::DataBlocked(5),
            Frame::StreamDataBlocked {
                id: StreamId(1),
                limit: 2,
            },
            Frame::StreamsBlocked {
                dir: Dir::Uni,
                limit: 8,
            },
            Frame::NewConnectionId(NewConnectionId {
                seq: 3,
                retire_prior_to: 1,
                cid: ConnectionId::new(&[9; 8]),
                reset_token: [7; 16],
            }),
            Frame::RetireConnectionId { seq: 2 },
            Frame::PathChallenge([1, 2, 3, 4, 5, 6, 7, 8]),
            Frame::PathResponse([8; 8]),
            Frame::Close(Close {
                error_code: 0xa,
                frame_type: Some(0x08),
                reason: Bytes::from_static(b"bad"),
            }),
            Frame::Close(Close {
                error_code: 3,
                frame_type: None,
                reason: Bytes::new(),
            }),
            Frame::HandshakeDone,
            Frame::Datagram(Bytes::from_static(b"dgram")),
            Frame::AckFrequency(AckFrequency {
                seq: 1,
                ack_eliciting_threshold: 9,
                request_max_ack_delay: 25_000,
                reordering_threshold: 3,
            }),
            Frame::ImmediateAck,
        ];
        for f in frames {
            roundtrip(f);
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        let cases: &[&[u8]] = &[
            &[0x02, 0x05, 0x00, 0x00, 0x06], // first range larger than largest
            &[0x02, 0x05, 0x00, 0x01, 0x01, 0x05, 0x00], // gap below zero
            &[0x06, 0x00, 0x05, b'a'],       // crypto truncated
            &[0x07, 0x00],                   // empty token
            &[0x0a, 0x00, 0x09, 0x01],       // stream truncated
            &[0x12, 0xd0, 0, 0, 0, 0, 0, 0, 1], // max_streams > 2^60
            &[0x18, 0x01, 0x02, 0x08],       // retire_prior_to > seq
            &[0x18, 0x01, 0x00, 0x15],       // cid too long
            &[0x1a, 0x01, 0x02],             // short challenge
            &[0x40, 0x01],                   // non-minimal frame type
            &[0x21],                         // unknown frame type
            &[
                0x0e, 0xc0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            ],
        ];
        for c in cases {
            let mut it = FrameIter::new(Bytes::copy_from_slice(c));
            assert!(matches!(it.next(), Some(Err(_))), "accepted {c:02x?}");
            assert!(it.next().is_none());
        }
    }

    #[test]
    fn stream_len_fitting() {
        for space in 0..2000 {
            for offset in [0u64, 1, 100, 1 << 20, 1 << 40] {
                let n = StreamHeader::max_data_with_len(StreamId(4), offset, space);
                if n == 0 {
                    continue;
                }
                let h = StreamHeader {
                    id: StreamId(4),
                    offset,
                    len: Some(n),
                    fin: false,
                };
                assert!(
                    h.encoded_len() + n <= space,
                    "space {space} off {offset} n {n}"
                );
                let h2 = StreamHeader {
                    id: StreamId(4),
                    offset,
                    len: Some(n + 1),
                    fin: false,
                };
                assert!(h2.encoded_len() + n + 1 > space);
            }
        }
    }
}
