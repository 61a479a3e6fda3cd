//! Checked reading and writing of QUIC's wire primitives.
//!
//! Every read is bounds-checked and returns [`UnexpectedEnd`] instead of panicking, so parsers
//! built on these helpers are safe against hostile input by construction.

use bytes::{Buf, BufMut};

use crate::varint::VarInt;

/// The input ended before a complete field could be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnexpectedEnd;

impl std::fmt::Display for UnexpectedEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("unexpected end of input")
    }
}

impl std::error::Error for UnexpectedEnd {}

/// Result of a checked read.
pub type Result<T> = std::result::Result<T, UnexpectedEnd>;

/// Checked reads on any [`Buf`].
pub trait BufExt: Buf {
    /// A byte, or an error at the end of the buffer.
    fn get_u8_checked(&mut self) -> Result<u8> {
        if self.remaining() < 1 {
            return Err(UnexpectedEnd);
        }
        Ok(self.get_u8())
    }

    /// A big-endian `u16`, or an error if fewer bytes remain.
    fn get_u16_checked(&mut self) -> Result<u16> {
        if self.remaining() < 2 {
            return Err(UnexpectedEnd);
        }
        Ok(self.get_u16())
    }

    /// A big-endian `u32`, or an error if fewer bytes remain.
    fn get_u32_checked(&mut self) -> Result<u32> {
        if self.remaining() < 4 {
            return Err(UnexpectedEnd);
        }
        Ok(self.get_u32())
    }

    /// A big-endian `u64`, or an error if fewer bytes remain.
    fn get_u64_checked(&mut self) -> Result<u64> {
        if self.remaining() < 8 {
            return Err(UnexpectedEnd);
        }
        Ok(self.get_u64())
    }

    /// Reads a variable-length integer (RFC 9000 §16).
    fn get_var(&mut self) -> Result<u64> {
        VarInt::decode(self).map(VarInt::into_inner)
    }

    /// Reads exactly `out.len()` bytes.
    fn copy_to_checked(&mut self, out: &mut [u8]) -> Result<()> {
        if self.remaining() < out.len() {
            return Err(UnexpectedEnd);
        }
        self.copy_to_slice(out);
        Ok(())
    }

    /// Skips `n` bytes.
    fn skip(&mut self, n: usize) -> Result<()> {
        if self.remaining() < n {
            return Err(UnexpectedEnd);
        }
        self.advance(n);
        Ok(())
    }
}

impl<T: Buf + ?Sized> BufExt for T {}

/// Writes of QUIC primitives on any [`BufMut`].
pub trait BufMutExt: BufMut {
    /// Writes a variable-length integer.
    ///
    /// # Panics
    /// If `v` exceeds 2^62 - 1; values that come from the peer are always in range because they
    /// were decoded as varints, and local values are bounded by construction.
    fn put_var(&mut self, v: u64) {
        VarInt::from_u64(v)
            .expect("varint out of range")
            .encode(self);
    }
}

impl<T: BufMut + ?Sized> BufMutExt for T {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_reads_stop_at_end() {
        let mut b: &[u8] = &[1, 2, 3];
        assert_eq!(b.get_u16_checked(), Ok(0x0102));
        assert_eq!(b.get_u16_checked(), Err(UnexpectedEnd));
        assert_eq!(b.get_u8_checked(), Ok(3));
        assert_eq!(b.get_u8_checked(), Err(UnexpectedEnd));
        let mut b: &[u8] = &[1, 2];
        assert_eq!(b.skip(3), Err(UnexpectedEnd));
        assert_eq!(b.skip(2), Ok(()));
    }
}
