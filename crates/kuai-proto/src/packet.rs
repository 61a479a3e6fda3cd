//! Packet headers, packet protection and the unprotected special packets.
//!
//! * Long and short headers (RFC 9000 §17), including the version 2 type codes (RFC 9369 §3.2).
//! * Header and payload protection (RFC 9001 §5) on top of rustls's QUIC key traits.
//! * Retry with its integrity tag (RFC 9000 §17.2.5, RFC 9001 §5.8, RFC 9369 §3.3.3),
//!   Version Negotiation (RFC 9000 §17.2.1) and stateless resets (RFC 9000 §10.3).
//!
//! # Receiving
//!
//! A datagram goes through three steps, each consuming the previous one:
//!
//! 1. [`PartialDecode::new`] reads the cleartext part of the first packet's header, splits that
//!    packet off the datagram and hands back the rest (coalesced packets, RFC 9000 §12.2). The
//!    endpoint routes on [`PartialDecode::dst_cid`] and picks keys from [`PartialDecode::ty`].
//! 2. [`PartialDecode::unprotect`] removes header protection and recovers the full packet number.
//! 3. [`UnprotectedPacket::decrypt`] opens the payload in place, giving a [`DecryptedPacket`] whose
//!    payload is a [`Bytes`] view into the original datagram buffer (no copy).
//!
//! # Sending
//!
//! The caller writes a header with [`write_long_header`] or [`write_short_header`] into the
//! datagram buffer, appends the plaintext frames right after it, and calls [`seal_packet`], which
//! fills in the Length field, encrypts, appends the AEAD tag and applies header protection. Several
//! packets can be coalesced into one buffer this way, one after the other.

use std::fmt;
use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use rand::RngCore;
use ring::aead;
use rustls::quic::{HeaderProtectionKey, Keys, PacketKey};

use crate::cid::{ConnectionId, MAX_CID_SIZE};
use crate::coding::{BufExt, BufMutExt, UnexpectedEnd};
use crate::types::{Side, SpaceId, Version};

/// The smallest datagram a client may carry an Initial packet in, and the size a server must see
/// before it answers an unknown version (RFC 9000 §14.1, §6.1).
pub const MIN_INITIAL_SIZE: usize = 1200;

/// The longest packet number encoding.
pub const MAX_PN_LEN: usize = 4;

/// The header protection sample is taken this many bytes after the start of the Packet Number
/// field, whatever the packet number's actual length (RFC 9001 §5.4.2).
pub const SAMPLE_OFFSET: usize = 4;

/// Length of the header protection sample for every AEAD QUIC v1 and v2 define.
pub const SAMPLE_LEN: usize = 16;

/// Length of a Retry packet's integrity tag (RFC 9001 §5.8).
pub const RETRY_INTEGRITY_TAG_LEN: usize = 16;

/// Length of a stateless reset token (RFC 9000 §10.3).
pub const RESET_TOKEN_SIZE: usize = 16;

/// The smallest stateless reset, and the smallest datagram whose tail is checked for a reset
/// token: 1 byte of header, 4 bytes standing in for a packet number, and the 16-byte token
/// (RFC 9000 §10.3).
pub const MIN_STATELESS_RESET_SIZE: usize = 21;

/// The largest value the 2-byte Length placeholder of [`write_long_header`] can hold; a long
/// header packet's packet number, payload and tag must fit in it.
pub const MAX_LONG_PACKET_LENGTH: usize = (1 << 14) - 1;

const LONG_HEADER_FORM: u8 = 0x80;
const FIXED_BIT: u8 = 0x40;
const SPIN_BIT: u8 = 0x20;
const KEY_PHASE_BIT: u8 = 0x04;
const LONG_RESERVED_BITS: u8 = 0x0c;
const SHORT_RESERVED_BITS: u8 = 0x18;
const PN_LEN_BITS: u8 = 0x03;

// ---------------------------------------------------------------------------------------------
// Packet types
// ---------------------------------------------------------------------------------------------

/// The long header packet types of QUIC v1 and v2.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub enum LongType {
    Initial,
    ZeroRtt,
    Handshake,
    Retry,
}

impl LongType {
    /// The two-bit Long Packet Type code of this type in `version` (RFC 9000 §17.2,
    /// RFC 9369 §3.2).
    pub fn to_bits(self, version: Version) -> u8 {
        match (version, self) {
            (Version::V1, LongType::Initial) => 0,
            (Version::V1, LongType::ZeroRtt) => 1,
            (Version::V1, LongType::Handshake) => 2,
            (Version::V1, LongType::Retry) => 3,
            (Version::V2, LongType::Retry) => 0,
            (Version::V2, LongType::Initial) => 1,
            (Version::V2, LongType::ZeroRtt) => 2,
            (Version::V2, LongType::Handshake) => 3,
        }
    }

    /// The type a two-bit Long Packet Type code stands for in `version`; only the low two bits of
    /// `bits` are looked at.
    pub fn from_bits(bits: u8, version: Version) -> Self {
        match (version, bits & 0x03) {
            (Version::V1, 0) => LongType::Initial,
            (Version::V1, 1) => LongType::ZeroRtt,
            (Version::V1, 2) => LongType::Handshake,
            (Version::V1, _) => LongType::Retry,
            (Version::V2, 0) => LongType::Retry,
            (Version::V2, 1) => LongType::Initial,
            (Version::V2, 2) => LongType::ZeroRtt,
            (Version::V2, _) => LongType::Handshake,
        }
    }

    /// The packet-number space; `None` for Retry.
    pub fn space(self) -> Option<SpaceId> {
        match self {
            LongType::Initial => Some(SpaceId::Initial),
            LongType::ZeroRtt => Some(SpaceId::Data),
            LongType::Handshake => Some(SpaceId::Handshake),
            LongType::Retry => None,
        }
    }
}

/// What kind of packet a header describes.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub enum PacketType {
    /// A long header packet of a version we speak (v1 or v2).
    Long(LongType),
    /// A short header (1-RTT) packet.
    Short,
    /// A Version Negotiation packet (version 0).
    VersionNegotiation,
    /// A long header packet of a version other than v1 and v2; only the version-independent
    /// fields (RFC 8999) were parsed. A server answers it with Version Negotiation.
    UnsupportedVersion,
}

impl PacketType {
    /// The packet-number space; `None` for packets that have none (Retry, Version Negotiation,
    /// unknown versions). 0-RTT and 1-RTT packets share [`SpaceId::Data`].
    pub fn space(self) -> Option<SpaceId> {
        match self {
            PacketType::Long(t) => t.space(),
            PacketType::Short => Some(SpaceId::Data),
            PacketType::VersionNegotiation | PacketType::UnsupportedVersion => None,
        }
    }

    /// Whether the packet has a long header (everything but [`PacketType::Short`]).
    pub fn is_long(self) -> bool {
        self != PacketType::Short
    }

    /// Whether the packet carries header and payload protection (and a packet number).
    pub fn is_protected(self) -> bool {
        self.space().is_some()
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a received packet could not be decoded. Most of these mean "drop the packet".
#[derive(Clone, PartialEq, Eq)]
pub enum PacketDecodeError {
    /// The header is malformed or the packet is too short; the text says which.
    InvalidHeader(&'static str),
    /// A long header packet of a version we do not speak. It carries what a server needs to
    /// answer with [`build_version_negotiation`]: the packet's connection IDs, which may be up to
    /// 255 bytes long for unknown versions (RFC 8999 §5.1). The answer swaps them: its DCID is
    /// `src_cid`, its SCID is `dst_cid`.
    UnsupportedVersion {
        version: u32,
        dst_cid: Bytes,
        src_cid: Bytes,
    },
    /// The packet type has no header or payload protection (Retry, Version Negotiation).
    NotProtected(PacketType),
    /// The header protection key rejected the sample.
    HeaderProtection,
    /// AEAD authentication of the payload failed.
    DecryptionFailed,
}

impl From<UnexpectedEnd> for PacketDecodeError {
    fn from(_: UnexpectedEnd) -> Self {
        PacketDecodeError::InvalidHeader("header truncated")
    }
}

impl fmt::Debug for PacketDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PacketDecodeError::InvalidHeader(why) => write!(f, "invalid packet header: {why}"),
            PacketDecodeError::UnsupportedVersion {
                version,
                dst_cid,
                src_cid,
            } => write!(
                f,
                "unsupported QUIC version {version:#010x} (dcid {}, scid {})",
                Hex(dst_cid),
                Hex(src_cid)
            ),
            PacketDecodeError::NotProtected(ty) => {
                write!(f, "{ty:?} packets carry no packet protection")
            }
            PacketDecodeError::HeaderProtection => {
                f.write_str("header protection could not be removed")
            }
            PacketDecodeError::DecryptionFailed => f.write_str("packet decryption failed"),
        }
    }
}

impl fmt::Display for PacketDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for PacketDecodeError {}

/// Why [`seal_packet`] refused to protect a packet. All of these are bugs in the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealError {
    /// The [`HeaderPos`] does not describe a header inside the buffer.
    InvalidHeaderPos,
    /// Packet number plus payload is shorter than 4 bytes, so there is nothing to sample for
    /// header protection; add PADDING frames.
    PayloadTooShort,
    /// The packet does not fit the 2-byte Length field ([`MAX_LONG_PACKET_LENGTH`]).
    PayloadTooLong,
    /// The packet or header protection key failed.
    Crypto,
}

impl fmt::Display for SealError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SealError::InvalidHeaderPos => "header position does not match the buffer",
            SealError::PayloadTooShort => "payload too short to sample for header protection",
            SealError::PayloadTooLong => "packet too long for its 2-byte Length field",
            SealError::Crypto => "packet protection failed",
        })
    }
}

impl std::error::Error for SealError {}

struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Receiving: partial decode
// ---------------------------------------------------------------------------------------------

/// A packet whose cleartext header fields have been read but whose header protection is still on.
///
/// Holds exactly the bytes of one packet (for long header packets with a Length field) or the
/// rest of the datagram (short header, Retry, Version Negotiation, unknown versions).
pub struct PartialDecode {
    buf: BytesMut,
    ty: PacketType,
    version: Option<u32>,
    dst_cid: Range<usize>,
    src_cid: Option<Range<usize>>,
    /// Initial: the Token field. Retry: the Retry Token. Empty otherwise.
    token: Range<usize>,
    /// Version Negotiation: the Supported Version list. Empty otherwise.
    versions: Range<usize>,
    /// Protected packets: where the Packet Number field starts. 0 otherwise.
    pn_offset: usize,
}

impl PartialDecode {
    /// Reads the first packet of `datagram`.
    ///
    /// Returns the packet and, if the packet's Length field says it ends before the datagram
    /// does, the remaining bytes (which may hold further coalesced packets, or junk). Short
    /// header packets, Retry, Version Negotiation and packets of unknown versions extend to the end
    /// of the datagram. `local_cid_len` is the length of the connection IDs this endpoint issues,
    /// which is the DCID length of short header packets.
    ///
    /// The fixed bit is not checked (RFC 9287 lets peers grease it); see
    /// [`fixed_bit`](Self::fixed_bit).
    pub fn new(
        mut datagram: BytesMut,
        local_cid_len: usize,
    ) -> Result<(Self, Option<BytesMut>), PacketDecodeError> {
        let total = datagram.len();
        let mut r: &[u8] = &datagram;
        let first = r.get_u8_checked()?;

        if first & LONG_HEADER_FORM == 0 {
            if local_cid_len > MAX_CID_SIZE {
                return Err(PacketDecodeError::InvalidHeader(
                    "local connection ID length above 20",
                ));
            }
            let pn_offset = 1 + local_cid_len;
            if pn_offset + SAMPLE_OFFSET + SAMPLE_LEN > total {
                return Err(PacketDecodeError::InvalidHeader(
                    "short header packet too short",
                ));
            }
            let pd = Self {
                buf: datagram,
                ty: PacketType::Short,
                version: None,
                dst_cid: 1..pn_offset,
                src_cid: None,
                token: 0..0,
                versions: 0..0,
                pn_offset,
            };
            return Ok((pd, None));
        }

        let version = r.get_u32_checked()?;
        let dcid_len = usize::from(r.get_u8_checked()?);
        let dcid_start = total - r.remaining();
        r.skip(dcid_len)?;
        let scid_len = usize::from(r.get_u8_checked()?);
        let scid_start = total - r.remaining();
        r.skip(scid_len)?;
        let after_cids = total - r.remaining();
        let dst_cid = dcid_start..dcid_start + dcid_len;
        let src_cid = Some(scid_start..scid_start + scid_len);

        let mut pd = Self {
            buf: BytesMut::new(),
            ty: PacketType::UnsupportedVersion,
            version: Some(version),
            dst_cid,
            src_cid,
            token: after_cids..after_cids,
            versions: after_cids..after_cids,
            pn_offset: 0,
        };

        if version == 0 {
            if !(total - after_cids).is_multiple_of(4) {
                return Err(PacketDecodeError::InvalidHeader(
                    "version list length not a multiple of 4",
                ));
            }
            pd.ty = PacketType::VersionNegotiation;
            pd.versions = after_cids..total;
            pd.buf = datagram;
            return Ok((pd, None));
        }

        let Some(v) = Version::from_wire(version) else {
            pd.buf = datagram;
            return Ok((pd, None));
        };

        if dcid_len > MAX_CID_SIZE || scid_len > MAX_CID_SIZE {
            return Err(PacketDecodeError::InvalidHeader(
                "connection ID longer than 20 bytes",
            ));
        }
        let ty = LongType::from_bits(first >> 4, v);
        pd.ty = PacketType::Long(ty);

        match ty {
            LongType::Retry => {
                if total - after_cids < RETRY_INTEGRITY_TAG_LEN {
                    return Err(PacketDecodeError::InvalidHeader(
                        "Retry packet shorter than its integrity tag",
                    ));
                }
                pd.token = after_cids..total - RETRY_INTEGRITY_TAG_LEN;
                pd.buf = datagram;
                return Ok((pd, None));
            }
            LongType::Initial => {
                let token_len = r.get_var()?;
                if token_len > r.remaining() as u64 {
                    return Err(PacketDecodeError::InvalidHeader(
                        "token length exceeds datagram",
                    ));
                }
                let token_len = token_len as usize;
                let token_start = total - r.remaining();
                r.advance(token_len);
                pd.token = token_start..token_start + token_len;
            }
            LongType::ZeroRtt | LongType::Handshake => {}
        }

        let length = r.get_var()?;
        let pn_offset = total - r.remaining();
        if length > r.remaining() as u64 {
            return Err(PacketDecodeError::InvalidHeader(
                "Length field exceeds datagram",
            ));
        }
        let end = pn_offset + length as usize;
        if pn_offset + SAMPLE_OFFSET + SAMPLE_LEN > end {
            return Err(PacketDecodeError::InvalidHeader(
                "packet too short to sample for header protection",
            ));
        }
        pd.pn_offset = pn_offset;
        let rest = if end < total {
            Some(datagram.split_off(end))
        } else {
            None
        };
        pd.buf = datagram;
        Ok((pd, rest))
    }

    pub fn ty(&self) -> PacketType {
        self.ty
    }

    /// The Version field; `None` for short headers, `Some(0)` for Version Negotiation.
    pub fn version(&self) -> Option<u32> {
        self.version
    }

    /// The Destination Connection ID.
    ///
    /// Packets of unknown versions and Version Negotiation packets may carry IDs of up to 255
    /// bytes; for those this returns an empty ID and [`dst_cid_bytes`](Self::dst_cid_bytes) has
    /// the real one. Such packets never belong to a connection, so routing is unaffected.
    pub fn dst_cid(&self) -> ConnectionId {
        ConnectionId::try_from_slice(self.dst_cid_bytes()).unwrap_or(ConnectionId::EMPTY)
    }

    /// The Destination Connection ID as it is on the wire (up to 255 bytes for unknown versions).
    pub fn dst_cid_bytes(&self) -> &[u8] {
        self.buf.get(self.dst_cid.clone()).unwrap_or_default()
    }

    /// The Source Connection ID of a long header; `None` for short headers. See
    /// [`dst_cid`](Self::dst_cid) about IDs longer than 20 bytes.
    pub fn src_cid(&self) -> Option<ConnectionId> {
        self.src_cid_bytes()
            .map(|b| ConnectionId::try_from_slice(b).unwrap_or(ConnectionId::EMPTY))
    }

    /// The Source Connection ID as it is on the wire.
    pub fn src_cid_bytes(&self) -> Option<&[u8]> {
        self.src_cid
            .clone()
            .map(|r| self.buf.get(r).unwrap_or_default())
    }

    /// The Token of an Initial packet, or the Retry Token of a Retry packet (the bytes between the
    /// SCID and the integrity tag); empty for every other type.
    pub fn token(&self) -> &[u8] {
        self.buf.get(self.token.clone()).unwrap_or_default()
    }

    /// The versions a Version Negotiation packet lists, in order; empty for other packets.
    pub fn supported_versions(&self) -> impl Iterator<Item = u32> + '_ {
        self.buf
            .get(self.versions.clone())
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
    }

    pub fn space(&self) -> Option<SpaceId> {
        self.ty.space()
    }

    /// Whether this is a long header packet.
    pub fn is_long(&self) -> bool {
        self.ty.is_long()
    }

    /// Whether this is an Initial packet.
    pub fn is_initial(&self) -> bool {
        self.ty == PacketType::Long(LongType::Initial)
    }

    /// The QUIC Bit (RFC 9000 §17.2, §17.3.1). A peer that sent `grease_quic_bit` (RFC 9287) may
    /// clear it; otherwise a packet with a zero fixed bit should be dropped.
    pub fn fixed_bit(&self) -> bool {
        self.buf.first().is_some_and(|b| b & FIXED_BIT != 0)
    }

    /// Length of this packet in bytes (for Retry, VN, short and unknown-version packets: the rest
    /// of the datagram).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always false: a decoded packet has at least a first byte.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The packet's raw (still protected) bytes.
    pub fn data(&self) -> &[u8] {
        &self.buf
    }

    /// Removes header protection (RFC 9001 §5.4) and recovers the full packet number (RFC 9000
    /// Appendix A.3) given `largest_pn`, the largest packet number successfully processed so far
    /// in this packet's space (`None` if none yet).
    ///
    /// Fails with [`PacketDecodeError::UnsupportedVersion`] for unknown versions and with
    /// [`PacketDecodeError::NotProtected`] for Retry and Version Negotiation packets.
    pub fn unprotect(
        self,
        hp: &dyn HeaderProtectionKey,
        largest_pn: Option<u64>,
    ) -> Result<UnprotectedPacket, PacketDecodeError> {
        match self.ty {
            PacketType::Long(LongType::Initial | LongType::ZeroRtt | LongType::Handshake)
            | PacketType::Short => {}
            PacketType::UnsupportedVersion => {
                return Err(PacketDecodeError::UnsupportedVersion {
                    version: self.version.unwrap_or_default(),
                    dst_cid: Bytes::copy_from_slice(self.dst_cid_bytes()),
                    src_cid: Bytes::copy_from_slice(self.src_cid_bytes().unwrap_or_default()),
                });
            }
            ty => return Err(PacketDecodeError::NotProtected(ty)),
        }
        let dst_cid = self.dst_cid();
        let src_cid = self.src_cid();
        let Self {
            mut buf,
            ty,
            version,
            token,
            pn_offset,
            ..
        } = self;

        let sample_start = pn_offset + SAMPLE_OFFSET;
        let sample_end = sample_start + hp.sample_len();
        if pn_offset == 0 || sample_end > buf.len() {
            return Err(PacketDecodeError::InvalidHeader(
                "packet too short to sample for header protection",
            ));
        }
        {
            let (head, tail) = buf.split_at_mut(sample_start);
            let sample = &tail[..sample_end - sample_start];
            let (first, rest) = head
                .split_first_mut()
                .ok_or(PacketDecodeError::HeaderProtection)?;
            let pn_field = &mut rest[pn_offset - 1..];
            hp.decrypt_in_place(sample, first, pn_field)
                .map_err(|_| PacketDecodeError::HeaderProtection)?;
        }

        let first = buf[0];
        let pn_len = usize::from(first & PN_LEN_BITS) + 1;
        let truncated = buf[pn_offset..pn_offset + pn_len]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        let pn = decode_pn(truncated, pn_len, largest_pn);
        let short = ty == PacketType::Short;
        let header = HeaderInfo {
            ty,
            version,
            dst_cid,
            src_cid,
            pn,
            pn_len,
            key_phase: short && first & KEY_PHASE_BIT != 0,
            spin: short && first & SPIN_BIT != 0,
            fixed_bit: first & FIXED_BIT != 0,
            reserved_bits: first
                & if short {
                    SHORT_RESERVED_BITS
                } else {
                    LONG_RESERVED_BITS
                },
            header_len: pn_offset + pn_len,
        };
        Ok(UnprotectedPacket { header, token, buf })
    }
}

impl fmt::Debug for PartialDecode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("PartialDecode");
        s.field("ty", &self.ty);
        if let Some(v) = self.version {
            s.field("version", &format_args!("{v:#010x}"));
        }
        s.field("dst_cid", &format_args!("{}", Hex(self.dst_cid_bytes())));
        if let Some(scid) = self.src_cid_bytes() {
            s.field("src_cid", &format_args!("{}", Hex(scid)));
        }
        s.field("len", &self.buf.len()).finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Receiving: header protection removed, payload decrypted
// ---------------------------------------------------------------------------------------------

/// The header fields of a packet whose header protection has been removed.
#[derive(Debug, Copy, Clone, Eq, PartialEq)]
pub struct HeaderInfo {
    pub ty: PacketType,
    /// `None` for short headers.
    pub version: Option<u32>,
    pub dst_cid: ConnectionId,
    /// `None` for short headers.
    pub src_cid: Option<ConnectionId>,
    /// The full, reconstructed packet number.
    pub pn: u64,
    /// Length in bytes of the Packet Number field on the wire (1..=4).
    pub pn_len: usize,
    /// The Key Phase bit (short headers; false for long headers).
    pub key_phase: bool,
    /// The latency Spin Bit (short headers; false for long headers).
    pub spin: bool,
    /// The QUIC Bit; see [`PartialDecode::fixed_bit`].
    pub fixed_bit: bool,
    /// The Reserved Bits, in place in the first byte (mask 0x0c long, 0x18 short).
    pub reserved_bits: u8,
    /// Length of the header including the Packet Number field; the AAD of the payload.
    pub header_len: usize,
}

impl HeaderInfo {
    /// Whether the Reserved Bits are set. The receiver must close the connection with
    /// PROTOCOL_VIOLATION then, but only once the packet decrypted successfully (RFC 9000
    /// §17.2, §17.3.1).
    pub fn reserved_bits_nonzero(&self) -> bool {
        self.reserved_bits != 0
    }

    pub fn space(&self) -> Option<SpaceId> {
        self.ty.space()
    }

    pub fn is_long(&self) -> bool {
        self.ty.is_long()
    }
}

macro_rules! header_accessors {
    () => {
        pub fn ty(&self) -> PacketType {
            self.header.ty
        }

        /// The Version field; `None` for short headers.
        pub fn version(&self) -> Option<u32> {
            self.header.version
        }

        pub fn dst_cid(&self) -> ConnectionId {
            self.header.dst_cid
        }

        /// `None` for short headers.
        pub fn src_cid(&self) -> Option<ConnectionId> {
            self.header.src_cid
        }

        /// The full packet number.
        pub fn pn(&self) -> u64 {
            self.header.pn
        }

        /// The Key Phase bit; false for long headers.
        pub fn key_phase(&self) -> bool {
            self.header.key_phase
        }

        /// The Spin Bit; false for long headers.
        pub fn spin(&self) -> bool {
            self.header.spin
        }

        /// See [`HeaderInfo::reserved_bits_nonzero`].
        pub fn reserved_bits_nonzero(&self) -> bool {
            self.header.reserved_bits_nonzero()
        }

        /// Length of the header including the Packet Number field.
        pub fn header_len(&self) -> usize {
            self.header.header_len
        }

        pub fn space(&self) -> Option<SpaceId> {
            self.header.space()
        }

        pub fn is_long(&self) -> bool {
            self.header.is_long()
        }
    };
}

/// A packet with header protection removed and its payload still encrypted.
pub struct UnprotectedPacket {
    header: HeaderInfo,
    token: Range<usize>,
    buf: BytesMut,
}

impl UnprotectedPacket {
    header_accessors!();

    pub fn header(&self) -> &HeaderInfo {
        &self.header
    }

    /// The Token of an Initial packet; empty otherwise.
    pub fn token(&self) -> &[u8] {
        self.buf.get(self.token.clone()).unwrap_or_default()
    }

    /// The unprotected header bytes (the AAD).
    pub fn header_bytes(&self) -> &[u8] {
        &self.buf[..self.header.header_len]
    }

    /// Length of the whole packet.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// For short header packets, the last 16 bytes, which would be the token if this is really a
    /// stateless reset (RFC 9000 §10.3.1). Take it before [`decrypt`](Self::decrypt), which
    /// consumes the packet, and compare it if decryption fails.
    pub fn reset_token(&self) -> Option<[u8; RESET_TOKEN_SIZE]> {
        if self.header.ty != PacketType::Short {
            return None;
        }
        reset_token_of(&self.buf).copied()
    }

    /// Opens the payload in place with `key`, authenticating the header as AAD.
    pub fn decrypt(self, key: &dyn PacketKey) -> Result<DecryptedPacket, PacketDecodeError> {
        let Self {
            header,
            token,
            mut buf,
        } = self;
        let header_len = header.header_len;
        if header_len > buf.len() {
            return Err(PacketDecodeError::DecryptionFailed);
        }
        let plain_len = {
            let (aad, payload) = buf.split_at_mut(header_len);
            key.decrypt_in_place(header.pn, aad, payload)
                .map_err(|_| PacketDecodeError::DecryptionFailed)?
                .len()
        };
        let bytes = buf.freeze();
        let payload = bytes.slice(header_len..header_len + plain_len);
        let token = bytes.slice(token);
        Ok(DecryptedPacket {
            header,
            token,
            payload,
        })
    }
}

impl fmt::Debug for UnprotectedPacket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnprotectedPacket")
            .field("header", &self.header)
            .field("len", &self.buf.len())
            .finish()
    }
}

/// A fully decoded packet: header fields and the plaintext payload (the frames).
#[derive(Debug, Clone)]
pub struct DecryptedPacket {
    pub header: HeaderInfo,
    /// The Token of an Initial packet; empty otherwise.
    pub token: Bytes,
    /// The decrypted frames; a view into the original datagram buffer.
    pub payload: Bytes,
}

impl DecryptedPacket {
    header_accessors!();
}

// ---------------------------------------------------------------------------------------------
// Packet numbers
// ---------------------------------------------------------------------------------------------

/// How many bytes to encode `pn` in, given the largest packet number the peer has acknowledged
/// in that space (RFC 9000 §17.1, Appendix A.2): enough to cover twice the range of
/// unacknowledged packet numbers, from 1 to 4.
pub fn pn_len_for(pn: u64, largest_acked: Option<u64>) -> usize {
    let unacked = match largest_acked {
        Some(acked) => pn.saturating_sub(acked),
        None => pn.saturating_add(1),
    };
    // log2(unacked) + 1 bits fit in n bytes exactly when unacked <= 2^(8n - 1).
    (1..MAX_PN_LEN)
        .find(|&n| unacked <= 1u64 << (8 * n - 1))
        .unwrap_or(MAX_PN_LEN)
}

/// Reconstructs a full packet number from its `pn_len`-byte truncation, given the largest packet
/// number received so far in that space (RFC 9000 Appendix A.3). `pn_len` is clamped to 1..=4.
pub fn decode_pn(truncated: u64, pn_len: usize, largest: Option<u64>) -> u64 {
    let bits = 8 * pn_len.clamp(1, MAX_PN_LEN) as u32;
    let win = 1u64 << bits;
    let hwin = win / 2;
    let mask = win - 1;
    let expected = largest.map_or(0, |l| l.saturating_add(1));
    let candidate = (expected & !mask) | (truncated & mask);
    if expected
        .checked_sub(hwin)
        .is_some_and(|low| candidate <= low)
        && candidate < (1 << 62) - win
    {
        candidate + win
    } else if candidate > expected.saturating_add(hwin) && candidate >= win {
        candidate - win
    } else {
        candidate
    }
}

// ---------------------------------------------------------------------------------------------
// Sending
// ---------------------------------------------------------------------------------------------

/// Where [`write_long_header`] or [`write_short_header`] put a header in the buffer; offsets are
/// from the start of the buffer.
#[derive(Debug, Copy, Clone, Eq, PartialEq)]
pub struct HeaderPos {
    /// The first byte of the packet.
    pub start: usize,
    /// The 2-byte Length field of a long header; `None` for short headers.
    pub length_offset: Option<usize>,
    /// The Packet Number field.
    pub pn_offset: usize,
    /// Length of the Packet Number field (1..=4).
    pub pn_len: usize,
}

impl HeaderPos {
    /// Length of the header including the packet number.
    pub fn header_len(&self) -> usize {
        self.pn_offset + self.pn_len - self.start
    }

    /// Where the payload starts: the first byte after the header.
    pub fn payload_offset(&self) -> usize {
        self.pn_offset + self.pn_len
    }

    /// Bytes the packet adds around its frames: header plus AEAD tag.
    pub fn overhead(&self, tag_len: usize) -> usize {
        self.header_len() + tag_len
    }

    /// How many bytes of frames still fit if the packet must end by `max_end` (an offset in the
    /// buffer, e.g. the datagram size limit) given `buf_len`, the buffer's current length.
    pub fn payload_room(&self, buf_len: usize, max_end: usize, tag_len: usize) -> usize {
        let room = max_end.saturating_sub(buf_len.max(self.payload_offset()) + tag_len);
        match self.length_offset {
            Some(_) => {
                let used = buf_len.saturating_sub(self.pn_offset);
                room.min(MAX_LONG_PACKET_LENGTH.saturating_sub(used + tag_len))
            }
            None => room,
        }
    }
}

/// Length of a long header written by [`write_long_header`] (with its 2-byte Length field).
/// `token_len` only counts for Initial packets.
pub fn long_header_len(
    ty: LongType,
    dst_len: usize,
    src_len: usize,
    token_len: usize,
    pn_len: usize,
) -> usize {
    let token = match ty {
        LongType::Initial => crate::VarInt::size_of(token_len as u64) + token_len,
        _ => 0,
    };
    1 + 4 + 1 + dst_len + 1 + src_len + token + 2 + pn_len
}

/// Length of a short header written by [`write_short_header`].
pub fn short_header_len(dst_len: usize, pn_len: usize) -> usize {
    1 + dst_len + pn_len
}

fn put_truncated_pn(buf: &mut Vec<u8>, pn: u64, pn_len: usize) {
    buf.extend_from_slice(&pn.to_be_bytes()[8 - pn_len..]);
}

/// Appends an unprotected long header of type `ty` to `buf`, with a 2-byte Length placeholder
/// (so packets up to [`MAX_LONG_PACKET_LENGTH`] bytes after the Length field) and the low
/// `pn_len` bytes of `pn`. `token` is written only for Initial packets. The fixed bit is set and
/// the reserved bits are zero; see [`grease_fixed_bit`].
///
/// # Panics
/// If `ty` is [`LongType::Retry`] (use [`build_retry`]) or `pn_len` is not in 1..=4.
#[allow(clippy::too_many_arguments)]
pub fn write_long_header(
    buf: &mut Vec<u8>,
    version: Version,
    ty: LongType,
    dst: &ConnectionId,
    src: &ConnectionId,
    token: &[u8],
    pn: u64,
    pn_len: usize,
) -> HeaderPos {
    assert!(
        ty != LongType::Retry,
        "Retry packets are built by build_retry"
    );
    assert!((1..=MAX_PN_LEN).contains(&pn_len), "packet number length");
    let start = buf.len();
    buf.push(LONG_HEADER_FORM | FIXED_BIT | (ty.to_bits(version) << 4) | (pn_len as u8 - 1));
    buf.extend_from_slice(&version.wire().to_be_bytes());
    buf.push(dst.len() as u8);
    buf.extend_from_slice(dst);
    buf.push(src.len() as u8);
    buf.extend_from_slice(src);
    if ty == LongType::Initial {
        buf.put_var(token.len() as u64);
        buf.extend_from_slice(token);
    }
    let length_offset = buf.len();
    buf.extend_from_slice(&[0x40, 0x00]);
    let pn_offset = buf.len();
    put_truncated_pn(buf, pn, pn_len);
    HeaderPos {
        start,
        length_offset: Some(length_offset),
        pn_offset,
        pn_len,
    }
}

/// Appends an unprotected short (1-RTT) header to `buf`. The fixed bit is set and the reserved
/// bits are zero; see [`grease_fixed_bit`].
///
/// # Panics
/// If `pn_len` is not in 1..=4.
pub fn write_short_header(
    buf: &mut Vec<u8>,
    dst: &ConnectionId,
    spin: bool,
    key_phase: bool,
    pn: u64,
    pn_len: usize,
) -> HeaderPos {
    assert!((1..=MAX_PN_LEN).contains(&pn_len), "packet number length");
    let start = buf.len();
    let mut first = FIXED_BIT | (pn_len as u8 - 1);
    if spin {
        first |= SPIN_BIT;
    }
    if key_phase {
        first |= KEY_PHASE_BIT;
    }
    buf.push(first);
    buf.extend_from_slice(dst);
    let pn_offset = buf.len();
    put_truncated_pn(buf, pn, pn_len);
    HeaderPos {
        start,
        length_offset: None,
        pn_offset,
        pn_len,
    }
}

/// Clears the fixed bit of the not yet sealed header at `pos`, for a peer that sent the
/// `grease_quic_bit` transport parameter (RFC 9287 §3). Call it between writing the header and
/// [`seal_packet`]; the caller decides how often (the RFC suggests unpredictably).
pub fn grease_fixed_bit(buf: &mut [u8], pos: &HeaderPos) {
    if let Some(b) = buf.get_mut(pos.start) {
        *b &= !FIXED_BIT;
    }
}

/// Protects the packet whose header is at `pos`: the payload is everything in `buf` after the
/// header. Appends the AEAD tag, patches the Length field (long headers; it covers packet number,
/// payload and tag), encrypts the payload in place with the header as AAD, then applies header
/// protection (RFC 9001 §5.3, §5.4). `pn` must be the packet number the header was written with.
///
/// The caller must make the packet number plus payload at least 4 bytes long (pad with PADDING
/// frames) so there is a header protection sample; otherwise this returns
/// [`SealError::PayloadTooShort`] and leaves `buf` unchanged.
pub fn seal_packet(
    buf: &mut Vec<u8>,
    pos: &HeaderPos,
    pn: u64,
    hp: &dyn HeaderProtectionKey,
    key: &dyn PacketKey,
) -> Result<(), SealError> {
    let header_end = pos.pn_offset + pos.pn_len;
    if !(1..=MAX_PN_LEN).contains(&pos.pn_len)
        || pos.start >= pos.pn_offset
        || header_end > buf.len()
        || pos
            .length_offset
            .is_some_and(|lo| lo <= pos.start || lo + 2 > pos.pn_offset)
    {
        return Err(SealError::InvalidHeaderPos);
    }
    let tag_len = key.tag_len();
    let payload_len = buf.len() - header_end;
    let sample_len = hp.sample_len();
    if pos.pn_len + payload_len < SAMPLE_OFFSET
        || header_end + payload_len + tag_len < pos.pn_offset + SAMPLE_OFFSET + sample_len
    {
        return Err(SealError::PayloadTooShort);
    }
    if let Some(lo) = pos.length_offset {
        let length = pos.pn_len + payload_len + tag_len;
        if length > MAX_LONG_PACKET_LENGTH {
            return Err(SealError::PayloadTooLong);
        }
        buf[lo..lo + 2].copy_from_slice(&(0x4000 | length as u16).to_be_bytes());
    }

    let tag = {
        let (head, payload) = buf.split_at_mut(header_end);
        key.encrypt_in_place(pn, &head[pos.start..], payload)
            .map_err(|_| SealError::Crypto)?
    };
    buf.extend_from_slice(tag.as_ref());

    let sample_start = pos.pn_offset + SAMPLE_OFFSET;
    let (head, tail) = buf.split_at_mut(sample_start);
    let sample = &tail[..sample_len];
    let (before, from_second) = head.split_at_mut(pos.start + 1);
    let first = &mut before[pos.start];
    let pn_at = pos.pn_offset - pos.start - 1;
    let pn_field = &mut from_second[pn_at..pn_at + pos.pn_len];
    hp.encrypt_in_place(sample, first, pn_field)
        .map_err(|_| SealError::Crypto)
}

// ---------------------------------------------------------------------------------------------
// Initial keys
// ---------------------------------------------------------------------------------------------

/// The Initial packet protection keys (RFC 9001 §5.2, RFC 9369 §3.3.1) derived from the
/// Destination Connection ID of the client's first Initial packet. `side` is our side: `local`
/// protects what we send, `remote` opens what we receive.
pub fn initial_keys(version: Version, client_dst_cid: &ConnectionId, side: Side) -> Keys {
    let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
        .tls13()
        .and_then(|s| s.quic_suite())
        .expect("rustls's ring provider supports TLS_AES_128_GCM_SHA256 for QUIC");
    let side = match side {
        Side::Client => rustls::Side::Client,
        Side::Server => rustls::Side::Server,
    };
    suite.keys(client_dst_cid, side, version.rustls())
}

// ---------------------------------------------------------------------------------------------
// Retry
// ---------------------------------------------------------------------------------------------

fn retry_key_nonce(version: Version) -> ([u8; 16], [u8; 12]) {
    match version {
        // RFC 9001 §5.8
        Version::V1 => (
            [
                0xbe, 0x0c, 0x69, 0x0b, 0x9f, 0x66, 0x57, 0x5a, 0x1d, 0x76, 0x6b, 0x54, 0xe3, 0x68,
                0xc8, 0x4e,
            ],
            [
                0x46, 0x15, 0x99, 0xd3, 0x5d, 0x63, 0x2b, 0xf2, 0x23, 0x98, 0x25, 0xbb,
            ],
        ),
        // RFC 9369 §3.3.3
        Version::V2 => (
            [
                0x8f, 0xb4, 0xb0, 0x1b, 0x56, 0xac, 0x48, 0xe2, 0x60, 0xfb, 0xcb, 0xce, 0xad, 0x7c,
                0xcc, 0x92,
            ],
            [
                0xd8, 0x69, 0x69, 0xbc, 0x2d, 0x7c, 0x6d, 0x99, 0x90, 0xef, 0xb0, 0x4a,
            ],
        ),
    }
}

fn retry_key(version: Version) -> Option<(aead::LessSafeKey, aead::Nonce)> {
    let (key, nonce) = retry_key_nonce(version);
    let key = aead::UnboundKey::new(&aead::AES_128_GCM, &key).ok()?;
    Some((
        aead::LessSafeKey::new(key),
        aead::Nonce::assume_unique_for_key(nonce),
    ))
}

/// The Retry Pseudo-Packet (RFC 9001 §5.8): the original DCID, length-prefixed, then the Retry
/// packet without its tag.
fn retry_pseudo_packet(odcid: &ConnectionId, without_tag: &[u8]) -> Vec<u8> {
    let mut pseudo = Vec::with_capacity(1 + odcid.len() + without_tag.len());
    pseudo.push(odcid.len() as u8);
    pseudo.extend_from_slice(odcid);
    pseudo.extend_from_slice(without_tag);
    pseudo
}

fn retry_tag(
    version: Version,
    odcid: &ConnectionId,
    without_tag: &[u8],
) -> Option<[u8; RETRY_INTEGRITY_TAG_LEN]> {
    let (key, nonce) = retry_key(version)?;
    let pseudo = retry_pseudo_packet(odcid, without_tag);
    let tag = key
        .seal_in_place_separate_tag(nonce, aead::Aad::from(&pseudo[..]), &mut [])
        .ok()?;
    tag.as_ref().try_into().ok()
}

/// Builds a Retry packet (RFC 9000 §17.2.5) with its integrity tag. `dst` is the client's SCID,
/// `src` the new connection ID the server picked, `odcid` the DCID of the client's Initial. The
/// four unused bits of the first byte are random.
pub fn build_retry(
    version: Version,
    dst: &ConnectionId,
    src: &ConnectionId,
    odcid: &ConnectionId,
    token: &[u8],
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(7 + dst.len() + src.len() + token.len() + 16);
    let unused = (rand::rng().next_u32() & 0x0f) as u8;
    buf.push(LONG_HEADER_FORM | FIXED_BIT | (LongType::Retry.to_bits(version) << 4) | unused);
    buf.extend_from_slice(&version.wire().to_be_bytes());
    buf.push(dst.len() as u8);
    buf.extend_from_slice(dst);
    buf.push(src.len() as u8);
    buf.extend_from_slice(src);
    buf.extend_from_slice(token);
    // The key and nonce are fixed and valid, so this cannot fail.
    let tag = retry_tag(version, odcid, &buf).unwrap_or_default();
    buf.extend_from_slice(&tag);
    buf
}

/// Checks the Retry Integrity Tag of the whole Retry `packet` (as received, tag included) against
/// the DCID the client put in its first Initial (RFC 9001 §5.8).
pub fn retry_integrity_ok(version: Version, odcid: &ConnectionId, packet: &[u8]) -> bool {
    let Some(split) = packet.len().checked_sub(RETRY_INTEGRITY_TAG_LEN) else {
        return false;
    };
    let (without_tag, tag) = packet.split_at(split);
    let Some((key, nonce)) = retry_key(version) else {
        return false;
    };
    let pseudo = retry_pseudo_packet(odcid, without_tag);
    // Opening an empty ciphertext verifies the tag in constant time.
    let mut in_out = [0u8; RETRY_INTEGRITY_TAG_LEN];
    in_out.copy_from_slice(tag);
    key.open_in_place(nonce, aead::Aad::from(&pseudo[..]), &mut in_out)
        .is_ok()
}

// ---------------------------------------------------------------------------------------------
// Version Negotiation
// ---------------------------------------------------------------------------------------------

/// Builds a Version Negotiation packet (RFC 9000 §17.2.1) listing `supported` plus one greased
/// version (RFC 9000 §15). `dst` must be the SCID of the packet being answered and `src` its DCID;
/// both can be up to 255 bytes (longer ones are cut to 255). The first byte is random with the
/// high bit set and, as RFC 9000 §17.2.1 recommends, the 0x40 bit set too.
pub fn build_version_negotiation(dst: &[u8], src: &[u8], supported: &[u32]) -> Vec<u8> {
    let dst = &dst[..dst.len().min(255)];
    let src = &src[..src.len().min(255)];
    let mut rng = rand::rng();
    let mut buf = Vec::with_capacity(7 + dst.len() + src.len() + 4 * (supported.len() + 1));
    buf.push(LONG_HEADER_FORM | FIXED_BIT | (rng.next_u32() & 0x3f) as u8);
    buf.extend_from_slice(&0u32.to_be_bytes());
    buf.push(dst.len() as u8);
    buf.extend_from_slice(dst);
    buf.push(src.len() as u8);
    buf.extend_from_slice(src);
    for v in supported {
        buf.extend_from_slice(&v.to_be_bytes());
    }
    let grease = (rng.next_u32() & 0xf0f0_f0f0) | 0x0a0a_0a0a;
    buf.extend_from_slice(&grease.to_be_bytes());
    buf
}

// ---------------------------------------------------------------------------------------------
// Stateless reset
// ---------------------------------------------------------------------------------------------

/// Builds a stateless reset (RFC 9000 §10.3) of `len` bytes (at least
/// [`MIN_STATELESS_RESET_SIZE`]): it looks like a short header packet (first byte `0b01xxxxxx`),
/// random throughout, with `token` as its last 16 bytes. The caller picks `len` smaller than the
/// packet that triggered it (to avoid loops) and not much larger than needed.
pub fn build_stateless_reset(token: &[u8; RESET_TOKEN_SIZE], len: usize) -> Vec<u8> {
    let len = len.max(MIN_STATELESS_RESET_SIZE);
    let mut buf = vec![0u8; len];
    rand::rng().fill_bytes(&mut buf[..len - RESET_TOKEN_SIZE]);
    buf[0] = FIXED_BIT | (buf[0] & 0x3f);
    buf[len - RESET_TOKEN_SIZE..].copy_from_slice(token);
    buf
}

/// The would-be stateless reset token of a datagram: its last 16 bytes, if it is at least
/// [`MIN_STATELESS_RESET_SIZE`] bytes long (RFC 9000 §10.3.1).
pub fn reset_token_of(datagram: &[u8]) -> Option<&[u8; RESET_TOKEN_SIZE]> {
    if datagram.len() < MIN_STATELESS_RESET_SIZE {
        return None;
    }
    datagram[datagram.len() - RESET_TOKEN_SIZE..]
        .try_into()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn cid(b: &[u8]) -> ConnectionId {
        ConnectionId::new(b)
    }

    /// Seals one long header packet carrying `payload` onto the end of `buf`.
    #[allow(clippy::too_many_arguments)]
    fn push_long(
        buf: &mut Vec<u8>,
        keys: &Keys,
        version: Version,
        ty: LongType,
        dst: &ConnectionId,
        src: &ConnectionId,
        token: &[u8],
        pn: u64,
        pn_len: usize,
        payload: &[u8],
    ) -> HeaderPos {
        let pos = write_long_header(buf, version, ty, dst, src, token, pn, pn_len);
        buf.extend_from_slice(payload);
        seal_packet(buf, &pos, pn, &*keys.local.header, &*keys.local.packet).unwrap();
        pos
    }

    #[test]
    fn long_type_bits() {
        for v in [Version::V1, Version::V2] {
            for ty in [
                LongType::Initial,
                LongType::ZeroRtt,
                LongType::Handshake,
                LongType::Retry,
            ] {
                assert_eq!(LongType::from_bits(ty.to_bits(v), v), ty);
            }
        }
        assert_eq!(LongType::Initial.to_bits(Version::V2), 1);
        assert_eq!(LongType::Retry.to_bits(Version::V2), 0);
        assert_eq!(LongType::Retry.to_bits(Version::V1), 3);
        assert_eq!(
            PacketType::Long(LongType::ZeroRtt).space(),
            Some(SpaceId::Data)
        );
        assert_eq!(PacketType::Long(LongType::Retry).space(), None);
        assert_eq!(PacketType::Short.space(), Some(SpaceId::Data));
        assert!(!PacketType::Short.is_long());
        assert!(PacketType::VersionNegotiation.is_long());
    }

    #[test]
    fn long_header_roundtrip_coalesced() {
        let dcid = cid(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let scid = cid(&[9, 9, 9]);
        for version in [Version::V1, Version::V2] {
            let client = initial_keys(version, &dcid, Side::Client);
            let server = initial_keys(version, &dcid, Side::Server);
            let mut buf = Vec::new();
            let p1 = vec![0xaa; 30];
            let p2 = vec![0xbb; 3];
            let p3 = vec![0xcc; 100];
            push_long(
                &mut buf,
                &client,
                version,
                LongType::Initial,
                &dcid,
                &scid,
                b"tok",
                7,
                1,
                &p1,
            );
            push_long(
                &mut buf,
                &client,
                version,
                LongType::Handshake,
                &dcid,
                &scid,
                &[],
                0x1234,
                2,
                &p2,
            );
            push_long(
                &mut buf,
                &client,
                version,
                LongType::ZeroRtt,
                &dcid,
                &scid,
                b"ignored",
                0x0012_3456,
                4,
                &p3,
            );
            let expect = [
                (LongType::Initial, &p1, 7u64, &b"tok"[..]),
                (LongType::Handshake, &p2, 0x1234, &[][..]),
                (LongType::ZeroRtt, &p3, 0x0012_3456, &[][..]),
            ];
            let mut rest = Some(BytesMut::from(&buf[..]));
            for (ty, payload, pn, token) in expect {
                let (pd, r) = PartialDecode::new(rest.take().unwrap(), 0).unwrap();
                rest = r;
                assert_eq!(pd.ty(), PacketType::Long(ty));
                assert_eq!(pd.version(), Some(version.wire()));
                assert_eq!(pd.dst_cid(), dcid);
                assert_eq!(pd.src_cid(), Some(scid));
                assert_eq!(pd.token(), token);
                assert!(pd.fixed_bit());
                assert!(pd.is_long());
                let up = pd.unprotect(&*server.remote.header, Some(pn - 1)).unwrap();
                assert_eq!(up.pn(), pn);
                assert_eq!(up.token(), token);
                assert!(!up.reserved_bits_nonzero());
                assert!(!up.key_phase());
                assert_eq!(up.reset_token(), None);
                let dp = up.decrypt(&*server.remote.packet).unwrap();
                assert_eq!(&dp.payload[..], &payload[..]);
                assert_eq!(&dp.token[..], token);
                assert_eq!(dp.pn(), pn);
                assert_eq!(dp.space(), ty.space());
                assert_eq!(dp.src_cid(), Some(scid));
            }
            assert!(rest.is_none());
        }
    }

    #[test]
    fn short_header_roundtrip() {
        let dcid = cid(&[0x42; 8]);
        let keys = initial_keys(Version::V1, &dcid, Side::Server);
        let peer = initial_keys(Version::V1, &dcid, Side::Client);
        for (spin, key_phase, pn_len) in [(false, false, 1), (true, false, 2), (true, true, 3)] {
            let mut buf = Vec::new();
            let pos = write_short_header(&mut buf, &dcid, spin, key_phase, 1000, pn_len);
            assert_eq!(pos.header_len(), short_header_len(8, pn_len));
            buf.extend_from_slice(&[1, 0, 0]);
            seal_packet(
                &mut buf,
                &pos,
                1000,
                &*keys.local.header,
                &*keys.local.packet,
            )
            .unwrap();
            let (pd, rest) = PartialDecode::new(BytesMut::from(&buf[..]), 8).unwrap();
            assert!(rest.is_none());
            assert_eq!(pd.ty(), PacketType::Short);
            assert_eq!(pd.dst_cid(), dcid);
            assert_eq!(pd.src_cid(), None);
            assert_eq!(pd.version(), None);
            let up = pd.unprotect(&*peer.remote.header, Some(990)).unwrap();
            assert_eq!(up.pn(), 1000);
            assert_eq!(up.spin(), spin);
            assert_eq!(up.key_phase(), key_phase);
            assert_eq!(up.header_len(), 1 + 8 + pn_len);
            assert_eq!(up.reset_token().unwrap()[..], buf[buf.len() - 16..]);
            let dp = up.decrypt(&*peer.remote.packet).unwrap();
            assert_eq!(&dp.payload[..], &[1, 0, 0]);
            assert_eq!(dp.space(), Some(SpaceId::Data));
        }
    }

    #[test]
    fn grease_and_reserved_bits() {
        let dcid = cid(&[7; 4]);
        let keys = initial_keys(Version::V2, &dcid, Side::Client);
        let peer = initial_keys(Version::V2, &dcid, Side::Server);
        let mut buf = Vec::new();
        let pos = write_short_header(&mut buf, &dcid, false, false, 5, 1);
        grease_fixed_bit(&mut buf, &pos);
        buf[pos.start] |= 0x18; // reserved bits, authenticated as AAD
        buf.extend_from_slice(&[1; 10]);
        seal_packet(&mut buf, &pos, 5, &*keys.local.header, &*keys.local.packet).unwrap();
        let (pd, _) = PartialDecode::new(BytesMut::from(&buf[..]), 4).unwrap();
        assert!(!pd.fixed_bit());
        let up = pd.unprotect(&*peer.remote.header, None).unwrap();
        assert!(up.reserved_bits_nonzero());
        assert!(!up.header().fixed_bit);
        let dp = up.decrypt(&*peer.remote.packet).unwrap();
        assert!(dp.reserved_bits_nonzero());
        assert_eq!(dp.pn(), 5);
    }

    #[test]
    fn wrong_key_fails_decryption() {
        let dcid = cid(&[7; 4]);
        let keys = initial_keys(Version::V1, &dcid, Side::Client);
        let other = initial_keys(Version::V1, &cid(&[8; 4]), Side::Server);
        let mut buf = Vec::new();
        push_long(
            &mut buf,
            &keys,
            Version::V1,
            LongType::Initial,
            &dcid,
            &dcid,
            &[],
            0,
            1,
            &[0; 20],
        );
        let (pd, _) = PartialDecode::new(BytesMut::from(&buf[..]), 0).unwrap();
        // Header protection with the wrong key "succeeds" with garbage, decryption must not.
        let up = pd.unprotect(&*other.remote.header, None).unwrap();
        let err = up.decrypt(&*other.remote.packet).unwrap_err();
        assert_eq!(err, PacketDecodeError::DecryptionFailed);
        assert_eq!(err.to_string(), "packet decryption failed");
    }

    #[test]
    fn seal_errors() {
        let dcid = cid(&[1; 8]);
        let keys = initial_keys(Version::V1, &dcid, Side::Client);
        let (hp, pk) = (&*keys.local.header, &*keys.local.packet);
        // pn_len 1 + 2 bytes of payload < 4.
        let mut buf = Vec::new();
        let pos = write_short_header(&mut buf, &dcid, false, false, 0, 1);
        buf.extend_from_slice(&[1, 0]);
        let before = buf.clone();
        assert_eq!(
            seal_packet(&mut buf, &pos, 0, hp, pk),
            Err(SealError::PayloadTooShort)
        );
        assert_eq!(buf, before);
        buf.push(0);
        assert_eq!(seal_packet(&mut buf, &pos, 0, hp, pk), Ok(()));
        // Too long for the 2-byte Length.
        let mut buf = Vec::new();
        let pos = write_long_header(
            &mut buf,
            Version::V1,
            LongType::Handshake,
            &dcid,
            &dcid,
            &[],
            0,
            4,
        );
        buf.resize(buf.len() + MAX_LONG_PACKET_LENGTH, 0);
        assert_eq!(
            seal_packet(&mut buf, &pos, 0, hp, pk),
            Err(SealError::PayloadTooLong)
        );
        // Bogus position.
        let bogus = HeaderPos {
            start: 10,
            length_offset: None,
            pn_offset: 5,
            pn_len: 1,
        };
        assert_eq!(
            seal_packet(&mut vec![0; 40], &bogus, 0, hp, pk),
            Err(SealError::InvalidHeaderPos)
        );
    }

    #[test]
    fn header_lengths_and_room() {
        let dcid = cid(&[1; 8]);
        let scid = cid(&[2; 5]);
        let mut buf = vec![0xff; 17]; // something already in the datagram
        let pos = write_long_header(
            &mut buf,
            Version::V1,
            LongType::Initial,
            &dcid,
            &scid,
            &[3; 70],
            9,
            2,
        );
        assert_eq!(pos.start, 17);
        assert_eq!(pos.header_len(), buf.len() - 17);
        assert_eq!(
            pos.header_len(),
            long_header_len(LongType::Initial, 8, 5, 70, 2)
        );
        assert_eq!(pos.overhead(16), pos.header_len() + 16);
        let room = pos.payload_room(buf.len(), MIN_INITIAL_SIZE, 16);
        assert_eq!(buf.len() + room + 16, MIN_INITIAL_SIZE);
        assert_eq!(
            long_header_len(LongType::Handshake, 8, 5, 70, 2),
            1 + 4 + 9 + 6 + 2 + 2
        );
    }

    // RFC 9000 Appendix A.2 and A.3.
    #[test]
    fn packet_number_examples() {
        assert_eq!(pn_len_for(0xac5c02, Some(0xabe8b3)), 2);
        assert_eq!(pn_len_for(0xace8fe, Some(0xabe8b3)), 3);
        assert_eq!(decode_pn(0x9b32, 2, Some(0xa82f30ea)), 0xa82f9b32);
        assert_eq!(pn_len_for(0, None), 1);
        assert_eq!(pn_len_for(127, None), 1);
        assert_eq!(pn_len_for(128, None), 2);
        assert_eq!(pn_len_for(1 << 40, None), 4);
        assert_eq!(decode_pn(0, 1, None), 0);
        assert_eq!(decode_pn(0xff, 1, None), 0xff);
        // Near the top of the packet number space, never go past 2^62.
        let top = (1u64 << 62) - 1;
        assert_eq!(decode_pn(top & 0xff, 1, Some(top - 1)), top);
        // Past the last number the decoding can go: the receiver drops such a packet
        // (connection/recv.rs), as no ACK could name it.
        assert_eq!(decode_pn(0, 1, Some(top)), 1 << 62);
    }

    #[test]
    fn packet_number_roundtrip() {
        let mut rng = StdRng::seed_from_u64(9000);
        for _ in 0..20_000 {
            let acked: Option<u64> = if rng.random_bool(0.1) {
                None
            } else {
                Some(rng.random_range(0..1u64 << 40))
            };
            let base = acked.map_or(0, |a| a + 1);
            let bits = rng.random_range(1..31);
            let pn = base + rng.random_range(0..1u64 << bits);
            let len = pn_len_for(pn, acked);
            let truncated = pn & ((1u64 << (8 * len)) - 1);
            // The receiver has seen at least what the sender knows was acknowledged, and maybe
            // more, up to pn - 1 (or up to 2 ahead from reordering...). Use the acked value and
            // the immediate predecessor, both of which must decode.
            assert_eq!(decode_pn(truncated, len, acked), pn, "acked {acked:?}");
            if pn > 0 {
                assert_eq!(decode_pn(truncated, len, Some(pn - 1)), pn);
            }
        }
    }

    #[test]
    fn retry_roundtrip() {
        for version in [Version::V1, Version::V2] {
            let odcid = cid(&[5; 8]);
            let dst = cid(&[1; 4]);
            let src = cid(&[2; 16]);
            let pkt = build_retry(version, &dst, &src, &odcid, b"a retry token");
            assert!(retry_integrity_ok(version, &odcid, &pkt));
            assert!(!retry_integrity_ok(version, &cid(&[5; 7]), &pkt));
            let other = match version {
                Version::V1 => Version::V2,
                Version::V2 => Version::V1,
            };
            assert!(!retry_integrity_ok(other, &odcid, &pkt));
            assert!(!retry_integrity_ok(version, &odcid, &pkt[..10]));
            let (pd, rest) = PartialDecode::new(BytesMut::from(&pkt[..]), 0).unwrap();
            assert!(rest.is_none());
            assert_eq!(pd.ty(), PacketType::Long(LongType::Retry));
            assert_eq!(pd.token(), b"a retry token");
            assert_eq!(pd.dst_cid(), dst);
            assert_eq!(pd.src_cid(), Some(src));
            assert!(retry_integrity_ok(version, &odcid, pd.data()));
            assert!(matches!(
                pd.unprotect(
                    &*initial_keys(version, &odcid, Side::Client).remote.header,
                    None
                ),
                Err(PacketDecodeError::NotProtected(PacketType::Long(
                    LongType::Retry
                )))
            ));
        }
        // A Retry that's too short for its tag.
        let mut short = build_retry(Version::V1, &cid(&[]), &cid(&[]), &cid(&[]), &[]);
        short.pop();
        assert!(PartialDecode::new(BytesMut::from(&short[..]), 0).is_err());
    }

    #[test]
    fn version_negotiation() {
        let dst = [3u8; 30]; // unknown versions may use long IDs
        let src = [4u8; 5];
        let vn = build_version_negotiation(&dst, &src, &[Version::V1_WIRE, Version::V2_WIRE]);
        assert_eq!(vn[0] & 0xc0, 0xc0);
        let (pd, rest) = PartialDecode::new(BytesMut::from(&vn[..]), 0).unwrap();
        assert!(rest.is_none());
        assert_eq!(pd.ty(), PacketType::VersionNegotiation);
        assert_eq!(pd.version(), Some(0));
        assert_eq!(pd.dst_cid_bytes(), &dst);
        assert_eq!(pd.src_cid(), Some(cid(&src)));
        let versions: Vec<u32> = pd.supported_versions().collect();
        assert_eq!(versions.len(), 3);
        assert_eq!(&versions[..2], &[Version::V1_WIRE, Version::V2_WIRE]);
        assert!(crate::types::is_grease_version(versions[2]));
        assert_eq!(pd.space(), None);
        // A ragged version list is malformed.
        let mut bad = vn.clone();
        bad.push(0);
        assert!(PartialDecode::new(BytesMut::from(&bad[..]), 0).is_err());
    }

    #[test]
    fn unsupported_version() {
        let mut pkt = vec![0xc0, 0x1a, 0x2a, 0x3a, 0x4a, 25];
        pkt.extend_from_slice(&[1; 25]);
        pkt.push(3);
        pkt.extend_from_slice(&[2; 3]);
        pkt.extend_from_slice(&[0; 1200]);
        let (pd, rest) = PartialDecode::new(BytesMut::from(&pkt[..]), 8).unwrap();
        assert!(rest.is_none());
        assert_eq!(pd.ty(), PacketType::UnsupportedVersion);
        assert_eq!(pd.version(), Some(0x1a2a3a4a));
        assert_eq!(pd.len(), pkt.len());
        assert_eq!(pd.dst_cid_bytes(), &[1; 25]);
        assert_eq!(pd.dst_cid(), ConnectionId::EMPTY);
        assert_eq!(pd.src_cid(), Some(cid(&[2; 3])));
        let keys = initial_keys(Version::V1, &cid(&[]), Side::Server);
        let err = pd.unprotect(&*keys.remote.header, None).unwrap_err();
        let PacketDecodeError::UnsupportedVersion {
            version,
            ref dst_cid,
            ref src_cid,
        } = err
        else {
            panic!("{err}");
        };
        assert_eq!(version, 0x1a2a3a4a);
        assert_eq!(&dst_cid[..], &[1; 25]);
        assert_eq!(&src_cid[..], &[2; 3]);
        assert!(err.to_string().contains("0x1a2a3a4a"));
        let vn = build_version_negotiation(src_cid, dst_cid, &[Version::V1_WIRE]);
        let (pd, _) = PartialDecode::new(BytesMut::from(&vn[..]), 0).unwrap();
        assert_eq!(pd.dst_cid_bytes(), &[2; 3]);
        assert_eq!(pd.src_cid_bytes(), Some(&[1; 25][..]));
        // v1 does not allow 25-byte IDs.
        pkt[1..5].copy_from_slice(&Version::V1_WIRE.to_be_bytes());
        assert!(PartialDecode::new(BytesMut::from(&pkt[..]), 8).is_err());
    }

    #[test]
    fn stateless_reset() {
        let token = [0x5a; 16];
        for len in [0, 20, 21, 43, 1200] {
            let r = build_stateless_reset(&token, len);
            assert_eq!(r.len(), len.max(21));
            assert_eq!(r[0] & 0xc0, 0x40);
            assert_eq!(reset_token_of(&r), Some(&token));
        }
        assert_eq!(reset_token_of(&[0; 20]), None);
        // A reset is indistinguishable from a short header packet.
        let r = build_stateless_reset(&token, 21);
        let (pd, _) = PartialDecode::new(BytesMut::from(&r[..]), 0).unwrap();
        assert_eq!(pd.ty(), PacketType::Short);
    }

    /// Feeds `data` through every decoding step with every key we have; must never panic.
    fn decode_all(data: &[u8], keys: &[&Keys]) {
        for cid_len in [0, 8, 20, 21] {
            let mut rest = Some(BytesMut::from(data));
            while let Some(d) = rest.take() {
                let Ok((pd, r)) = PartialDecode::new(d, cid_len) else {
                    break;
                };
                rest = r;
                let _ = (pd.dst_cid(), pd.src_cid(), pd.token(), pd.fixed_bit());
                let _ = pd.supported_versions().count();
                let _ = format!("{pd:?}");
                for k in keys {
                    let pd2 = PartialDecode::new(BytesMut::from(pd.data()), cid_len);
                    let Ok((pd2, _)) = pd2 else { continue };
                    if let Ok(up) = pd2.unprotect(&*k.remote.header, Some(3)) {
                        let _ = (up.reset_token(), up.header_bytes().len(), up.token());
                        let _ = up.decrypt(&*k.remote.packet);
                    }
                }
            }
            let _ = reset_token_of(data);
            let _ = retry_integrity_ok(Version::V1, &ConnectionId::EMPTY, data);
        }
    }

    fn sample_datagrams() -> (Vec<Vec<u8>>, Vec<Keys>) {
        let dcid = cid(&[0x11; 8]);
        let scid = cid(&[0x22; 8]);
        let mut out = Vec::new();
        let mut keys = Vec::new();
        for version in [Version::V1, Version::V2] {
            let c = initial_keys(version, &dcid, Side::Client);
            let mut buf = Vec::new();
            push_long(
                &mut buf,
                &c,
                version,
                LongType::Initial,
                &dcid,
                &scid,
                b"t",
                1,
                1,
                &[6; 40],
            );
            push_long(
                &mut buf,
                &c,
                version,
                LongType::Handshake,
                &dcid,
                &scid,
                &[],
                2,
                2,
                &[6; 20],
            );
            let pos = write_short_header(&mut buf, &dcid, true, true, 3, 4);
            buf.extend_from_slice(&[1; 7]);
            seal_packet(&mut buf, &pos, 3, &*c.local.header, &*c.local.packet).unwrap();
            out.push(buf);
            out.push(build_retry(version, &scid, &dcid, &dcid, b"tok"));
            keys.push(initial_keys(version, &dcid, Side::Server));
        }
        out.push(build_version_negotiation(&dcid, &scid, &[1, 2, 3]));
        out.push(build_stateless_reset(&[9; 16], 30));
        (out, keys)
    }

    #[test]
    fn truncated_inputs_never_panic() {
        let (datagrams, keys) = sample_datagrams();
        let keys: Vec<&Keys> = keys.iter().collect();
        for d in &datagrams {
            for end in 0..=d.len() {
                decode_all(&d[..end], &keys);
            }
        }
    }

    #[test]
    fn garbage_never_panics() {
        let (datagrams, keys) = sample_datagrams();
        let keys: Vec<&Keys> = keys.iter().collect();
        let mut rng = StdRng::seed_from_u64(0x6b75_6169);
        for i in 0..4000 {
            let mut data = if i % 2 == 0 {
                // Mutated valid datagram.
                let mut d = datagrams[i / 2 % datagrams.len()].clone();
                for _ in 0..rng.random_range(1..4) {
                    let at = rng.random_range(0..d.len());
                    d[at] = rng.random();
                }
                d
            } else {
                let len = rng.random_range(0..300);
                (0..len).map(|_| rng.random()).collect()
            };
            // Steer some random inputs onto the v1/v2/VN paths.
            if data.len() > 5 && rng.random_bool(0.5) {
                data[0] |= 0x80;
                let v = [Version::V1_WIRE, Version::V2_WIRE, 0][rng.random_range(0..3)];
                data[1..5].copy_from_slice(&v.to_be_bytes());
                if data.len() > 6 && rng.random_bool(0.7) {
                    data[5] %= 21;
                }
            }
            decode_all(&data, &keys);
        }
    }
}
