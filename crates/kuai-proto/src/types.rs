//! Small shared types: endpoint side, stream IDs, packet-number spaces, versions.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

use crate::varint::VarInt;

/// Which end of the connection we are.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub enum Side {
    /// The client.
    Client = 0,
    /// The server.
    Server = 1,
}

impl Side {
    /// Whether this is the client.
    pub fn is_client(self) -> bool {
        self == Side::Client
    }

    /// Whether this is the server.
    pub fn is_server(self) -> bool {
        self == Side::Server
    }

    /// The other side.
    pub fn peer(self) -> Side {
        match self {
            Side::Client => Side::Server,
            Side::Server => Side::Client,
        }
    }
}

/// A hash for the integer IDs a connection keeps maps of (stream IDs, connection handles):
/// a multiply and a rotate per word instead of SipHash, and no per-map random state. The
/// keys are not the peer's to choose freely: stream IDs are consecutive within the limits
/// we grant, handles are ours.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        // The product's high bits depend on every bit of the key, its low bits only on the
        // key's low bits (a stream ID's type bits): bring the high ones down, where the
        // table picks its bucket.
        self.0.rotate_left(26)
    }
}

/// A map keyed by stream IDs or connection handles.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Stream directionality.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub enum Dir {
    /// Bidirectional.
    Bi = 0,
    /// Unidirectional.
    Uni = 1,
}

/// A stream ID (RFC 9000 §2.1): the low bit is the initiator, the next bit the directionality.
#[derive(Copy, Clone, Eq, PartialEq, Ord, PartialOrd, Hash)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The `index`-th stream of kind `dir` opened by `initiator`.
    pub fn new(initiator: Side, dir: Dir, index: u64) -> Self {
        Self((index << 2) | ((dir as u64) << 1) | initiator as u64)
    }

    /// Who opened the stream (RFC 9000 §2.1).
    pub fn initiator(self) -> Side {
        if self.0 & 1 == 0 {
            Side::Client
        } else {
            Side::Server
        }
    }

    /// Whether the stream is bidirectional or unidirectional.
    pub fn dir(self) -> Dir {
        if self.0 & 2 == 0 { Dir::Bi } else { Dir::Uni }
    }

    /// Position among streams of the same initiator and directionality.
    pub fn index(self) -> u64 {
        self.0 >> 2
    }

    /// The stream ID as a number.
    pub fn into_inner(self) -> u64 {
        self.0
    }
}

impl From<StreamId> for VarInt {
    fn from(s: StreamId) -> VarInt {
        VarInt::saturating(s.0)
    }
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match self.initiator() {
            Side::Client => "c",
            Side::Server => "s",
        };
        let dir = match self.dir() {
            Dir::Bi => "bi",
            Dir::Uni => "uni",
        };
        write!(f, "{}({who}-{dir})", self.0)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A packet-number space (RFC 9000 §12.3). 0-RTT and 1-RTT packets share `Data`.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Ord, PartialOrd, Hash)]
pub enum SpaceId {
    /// Initial packets.
    Initial = 0,
    /// Handshake packets.
    Handshake = 1,
    /// 0-RTT and 1-RTT packets (the application data space).
    Data = 2,
}

impl SpaceId {
    /// The three spaces, in order.
    pub const ALL: [SpaceId; 3] = [SpaceId::Initial, SpaceId::Handshake, SpaceId::Data];

    /// Its index in [`SpaceId::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The QUIC versions kuai speaks.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub enum Version {
    /// RFC 9000.
    V1,
    /// RFC 9369.
    V2,
}

impl Version {
    /// QUIC version 1 on the wire (RFC 9000).
    pub const V1_WIRE: u32 = 0x0000_0001;
    /// QUIC version 2 on the wire (RFC 9369).
    pub const V2_WIRE: u32 = 0x6b33_43cf;

    /// Its number on the wire.
    pub fn wire(self) -> u32 {
        match self {
            Version::V1 => Self::V1_WIRE,
            Version::V2 => Self::V2_WIRE,
        }
    }

    /// The version `v` names, if kuai speaks it.
    pub fn from_wire(v: u32) -> Option<Self> {
        match v {
            Self::V1_WIRE => Some(Version::V1),
            Self::V2_WIRE => Some(Version::V2),
            _ => None,
        }
    }

    pub(crate) fn rustls(self) -> rustls::quic::Version {
        match self {
            Version::V1 => rustls::quic::Version::V1,
            Version::V2 => rustls::quic::Version::V2,
        }
    }
}

/// Whether a version number is reserved for greasing version negotiation (RFC 9000 §15).
pub fn is_grease_version(v: u32) -> bool {
    v & 0x0f0f_0f0f == 0x0a0a_0a0a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids() {
        let s = StreamId::new(Side::Server, Dir::Uni, 5);
        assert_eq!(s.0, 23);
        assert_eq!(s.initiator(), Side::Server);
        assert_eq!(s.dir(), Dir::Uni);
        assert_eq!(s.index(), 5);
        assert_eq!(StreamId(0).initiator(), Side::Client);
        assert_eq!(StreamId(0).dir(), Dir::Bi);
    }
}
