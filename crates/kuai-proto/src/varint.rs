//! Variable-length integers (RFC 9000 §16).

use bytes::{Buf, BufMut};

use crate::coding::UnexpectedEnd;

/// An integer in `0..2^62`, encoded on the wire in 1, 2, 4 or 8 bytes.
#[derive(Default, Copy, Clone, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub struct VarInt(u64);

/// The value does not fit in 62 bits.
#[derive(Debug, Copy, Clone, Eq, PartialEq)]
pub struct VarIntBoundsExceeded;

impl std::fmt::Display for VarIntBoundsExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("value too large for a QUIC varint")
    }
}

impl std::error::Error for VarIntBoundsExceeded {}

impl VarInt {
    /// The largest representable value, 2^62 - 1.
    pub const MAX: Self = Self((1 << 62) - 1);
    /// Zero.
    pub const ZERO: Self = Self(0);
    /// The largest encoded size in bytes.
    pub const MAX_SIZE: usize = 8;

    /// Any `u32` fits.
    pub const fn from_u32(v: u32) -> Self {
        Self(v as u64)
    }

    /// `v`, if it is below 2^62.
    pub const fn from_u64(v: u64) -> Result<Self, VarIntBoundsExceeded> {
        if v <= Self::MAX.0 {
            Ok(Self(v))
        } else {
            Err(VarIntBoundsExceeded)
        }
    }

    /// Clamps `v` to [`VarInt::MAX`].
    pub const fn saturating(v: u64) -> Self {
        if v <= Self::MAX.0 { Self(v) } else { Self::MAX }
    }

    /// The value.
    pub const fn into_inner(self) -> u64 {
        self.0
    }

    /// Encoded size in bytes of `v` (which must be at most [`VarInt::MAX`]).
    pub const fn size_of(v: u64) -> usize {
        if v < 1 << 6 {
            1
        } else if v < 1 << 14 {
            2
        } else if v < 1 << 30 {
            4
        } else {
            8
        }
    }

    /// Encoded size in bytes.
    pub const fn size(self) -> usize {
        Self::size_of(self.0)
    }

    /// Writes it in the shortest encoding (RFC 9000 §16).
    pub fn encode<B: BufMut + ?Sized>(self, buf: &mut B) {
        let v = self.0;
        match self.size() {
            1 => buf.put_u8(v as u8),
            2 => buf.put_u16(0x4000 | v as u16),
            4 => buf.put_u32(0x8000_0000 | v as u32),
            _ => buf.put_u64(0xc000_0000_0000_0000 | v),
        }
    }

    /// Reads one from `buf`.
    pub fn decode<B: Buf + ?Sized>(buf: &mut B) -> Result<Self, UnexpectedEnd> {
        if !buf.has_remaining() {
            return Err(UnexpectedEnd);
        }
        let first = buf.chunk()[0];
        let len = 1usize << (first >> 6);
        if buf.remaining() < len {
            return Err(UnexpectedEnd);
        }
        let v = match len {
            1 => u64::from(buf.get_u8()),
            2 => u64::from(buf.get_u16() & 0x3fff),
            4 => u64::from(buf.get_u32() & 0x3fff_ffff),
            _ => buf.get_u64() & 0x3fff_ffff_ffff_ffff,
        };
        Ok(Self(v))
    }
}

impl From<u8> for VarInt {
    fn from(v: u8) -> Self {
        Self(v.into())
    }
}

impl From<u16> for VarInt {
    fn from(v: u16) -> Self {
        Self(v.into())
    }
}

impl From<u32> for VarInt {
    fn from(v: u32) -> Self {
        Self(v.into())
    }
}

impl TryFrom<u64> for VarInt {
    type Error = VarIntBoundsExceeded;
    fn try_from(v: u64) -> Result<Self, Self::Error> {
        Self::from_u64(v)
    }
}

impl TryFrom<usize> for VarInt {
    type Error = VarIntBoundsExceeded;
    fn try_from(v: usize) -> Result<Self, Self::Error> {
        Self::from_u64(v as u64)
    }
}

impl From<VarInt> for u64 {
    fn from(v: VarInt) -> Self {
        v.0
    }
}

impl std::fmt::Debug for VarInt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for VarInt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(v: u64, expected: &[u8]) {
        let mut out = Vec::new();
        VarInt::from_u64(v).unwrap().encode(&mut out);
        assert_eq!(out, expected, "encoding {v}");
        let mut slice = expected;
        assert_eq!(VarInt::decode(&mut slice).unwrap().into_inner(), v);
        assert!(slice.is_empty());
    }

    // RFC 9000 Appendix A.1 sample encodings.
    #[test]
    fn rfc_examples() {
        roundtrip(
            151_288_809_941_952_652,
            &[0xc2, 0x19, 0x7c, 0x5e, 0xff, 0x14, 0xe8, 0x8c],
        );
        roundtrip(494_878_333, &[0x9d, 0x7f, 0x3e, 0x7d]);
        roundtrip(15_293, &[0x7b, 0xbd]);
        roundtrip(37, &[0x25]);
        let mut non_minimal: &[u8] = &[0x40, 0x25];
        assert_eq!(VarInt::decode(&mut non_minimal).unwrap().into_inner(), 37);
    }

    #[test]
    fn bounds() {
        assert!(VarInt::from_u64(1 << 62).is_err());
        assert_eq!(VarInt::saturating(u64::MAX), VarInt::MAX);
        for v in [
            0,
            63,
            64,
            16383,
            16384,
            (1 << 30) - 1,
            1 << 30,
            VarInt::MAX.0,
        ] {
            let mut out = Vec::new();
            VarInt(v).encode(&mut out);
            assert_eq!(out.len(), VarInt(v).size());
            let mut s = &out[..];
            assert_eq!(VarInt::decode(&mut s).unwrap().0, v);
        }
    }

    #[test]
    fn truncated() {
        let mut s: &[u8] = &[0xc0, 0, 0];
        assert_eq!(VarInt::decode(&mut s), Err(UnexpectedEnd));
        let mut s: &[u8] = &[];
        assert_eq!(VarInt::decode(&mut s), Err(UnexpectedEnd));
    }
}
