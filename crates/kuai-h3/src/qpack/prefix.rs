//! The primitives of RFC 9204 §4.1: prefixed integers (RFC 7541 §5.1) and string literals
//! (RFC 7541 §5.2) with an N-bit prefix.
//!
//! Decoding distinguishes input that is merely short ([`Error::Incomplete`], which the stream
//! parsers wait out) from input that can never be valid ([`Error::Invalid`]).

use super::huffman;

/// The largest integer QPACK has to handle (RFC 9204 §4.1.1: 62 bits); larger ones are refused.
pub const MAX_INT: u64 = (1 << 62) - 1;

/// A decoding failure of a primitive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// More input is needed. `Some(n)` when the total length of the item, counted from where
    /// the parse started, is known to be at least `n` bytes.
    Incomplete(Option<usize>),
    /// The input is malformed.
    Invalid(&'static str),
}

/// Appends `value` as an integer with an `prefix_bits`-bit prefix (1..=8). `first` holds the
/// bits above the prefix in the first octet (they must be zero within the prefix).
#[inline]
pub fn encode_int(out: &mut Vec<u8>, first: u8, prefix_bits: u8, value: u64) {
    debug_assert!((1..=8).contains(&prefix_bits));
    let max = ((1u16 << prefix_bits) - 1) as u64;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    encode_long_int(out, first, max, value);
}

/// [`encode_int`] for a value that does not fit in the prefix (`max`, all ones).
#[inline(never)]
fn encode_long_int(out: &mut Vec<u8>, first: u8, max: u64, value: u64) {
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 0x80 {
        out.push(0x80 | (rest & 0x7f) as u8);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// The encoded length of `value` with a `prefix_bits`-bit prefix.
pub fn int_len(prefix_bits: u8, value: u64) -> usize {
    let max = ((1u16 << prefix_bits) - 1) as u64;
    if value < max {
        return 1;
    }
    let mut rest = value - max;
    let mut n = 2;
    while rest >= 0x80 {
        rest >>= 7;
        n += 1;
    }
    n
}

/// Decodes an integer with a `prefix_bits`-bit prefix from `buf[*pos..]`, advancing `pos`.
/// Values above [`MAX_INT`] (or encodings longer than such a value needs) are invalid.
pub fn decode_int(buf: &[u8], pos: &mut usize, prefix_bits: u8) -> Result<u64, Error> {
    let start = *pos;
    let Some(&first) = buf.get(start) else {
        return Err(Error::Incomplete(None));
    };
    let max = ((1u16 << prefix_bits) - 1) as u64;
    let mut value = first as u64 & max;
    let mut i = start + 1;
    if value == max {
        let mut shift = 0u32;
        loop {
            let Some(&b) = buf.get(i) else {
                return Err(Error::Incomplete(None));
            };
            i += 1;
            // 62 bits need at most 9 continuation octets (7 bits each, 63 bits).
            if shift > 56 {
                return Err(Error::Invalid("integer too long"));
            }
            value += ((b & 0x7f) as u64) << shift;
            if value > MAX_INT {
                return Err(Error::Invalid("integer above 2^62 - 1"));
            }
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
    }
    *pos = i;
    Ok(value)
}

/// Appends a string literal with a `prefix_bits`-bit prefix (2..=8, the H bit included).
/// `first` holds the bits above the prefix. With `huffman` the Huffman code is used when it is
/// shorter than the raw octets.
pub fn encode_string(out: &mut Vec<u8>, first: u8, prefix_bits: u8, s: &[u8], huffman: bool) {
    let h_bit = 1u8 << (prefix_bits - 1);
    if huffman && s.len() > 1 {
        let hlen = huffman::encoded_len(s);
        if hlen < s.len() {
            encode_int(out, first | h_bit, prefix_bits - 1, hlen as u64);
            huffman::encode_with_len(s, hlen, out);
            return;
        }
    }
    encode_int(out, first, prefix_bits - 1, s.len() as u64);
    out.extend_from_slice(s);
}

/// The encoded length of a string literal as [`encode_string`] writes it.
pub fn string_len(prefix_bits: u8, s: &[u8], huffman: bool) -> usize {
    let mut len = s.len();
    if huffman && s.len() > 1 {
        len = len.min(huffman::encoded_len(s));
    }
    int_len(prefix_bits - 1, len as u64) + len
}

/// Decodes a string literal with a `prefix_bits`-bit prefix from `buf[*pos..]`, advancing
/// `pos`. The decoded string must not exceed `max_len` octets (`Invalid("string too long")`
/// otherwise); its declared length is checked against the input before anything is allocated.
pub fn decode_string(
    buf: &[u8],
    pos: &mut usize,
    prefix_bits: u8,
    max_len: usize,
) -> Result<Vec<u8>, Error> {
    let (data, is_huffman, end) = string_span(buf, *pos, prefix_bits, max_len)?;
    let out = if is_huffman {
        let mut out = Vec::new();
        huffman::decode(data, &mut out).map_err(huffman_error)?;
        if out.len() > max_len {
            return Err(Error::Invalid("string too long"));
        }
        // Exactly sized, the vector becomes `Bytes` without a second allocation.
        out.shrink_to_fit();
        out
    } else {
        data.to_vec()
    };
    *pos = end;
    Ok(out)
}

/// As [`decode_string`], the string written at the end of `arena` and split off it: the
/// strings of one field section share the arena's allocation, so none costs one of its own,
/// and each is a slice of shared bytes that clones without copying. An arena without room
/// for the string gets room for the rest of the section.
pub fn decode_string_in(
    buf: &[u8],
    pos: &mut usize,
    prefix_bits: u8,
    max_len: usize,
    arena: &mut bytes::BytesMut,
) -> Result<bytes::Bytes, Error> {
    let (data, is_huffman, end) = string_span(buf, *pos, prefix_bits, max_len)?;
    arena.clear();
    let need = if is_huffman {
        huffman::decoded_bound(data.len())
    } else {
        data.len()
    };
    if arena.capacity() < need {
        // Room for the rest of the section at once (what is left of `buf` from here).
        arena.reserve(huffman::decoded_bound(buf.len() - *pos).max(need));
    }
    if is_huffman {
        huffman::decode_bytes(data, arena).map_err(huffman_error)?;
        if arena.len() > max_len {
            return Err(Error::Invalid("string too long"));
        }
    } else {
        arena.extend_from_slice(data);
    }
    *pos = end;
    Ok(arena.split().freeze())
}

fn huffman_error(e: huffman::HuffmanError) -> Error {
    match e {
        huffman::HuffmanError::Eos => Error::Invalid("EOS in Huffman string"),
        huffman::HuffmanError::Padding => Error::Invalid("invalid Huffman padding"),
    }
}

/// A string literal's encoded bytes in `buf` from `start`, whether they are Huffman-coded,
/// and where the literal ends; checked against `max_len` and the input before anything is
/// read or allocated.
fn string_span(
    buf: &[u8],
    start: usize,
    prefix_bits: u8,
    max_len: usize,
) -> Result<(&[u8], bool, usize), Error> {
    let Some(&first) = buf.get(start) else {
        return Err(Error::Incomplete(None));
    };
    let is_huffman = first & (1 << (prefix_bits - 1)) != 0;
    let mut i = start;
    let len = decode_int(buf, &mut i, prefix_bits - 1)?;
    // A raw string is exactly `len` octets; a Huffman one at least `len * 8 / 30` (the longest
    // code has 30 bits). Either way refuse it before reading or allocating anything.
    let min_decoded = if is_huffman {
        len.saturating_mul(8) / 30
    } else {
        len
    };
    if min_decoded > max_len as u64 {
        return Err(Error::Invalid("string too long"));
    }
    let Ok(len) = usize::try_from(len) else {
        return Err(Error::Invalid("string too long"));
    };
    let available = buf.len() - i;
    if len > available {
        return Err(Error::Incomplete(Some((i - start).saturating_add(len))));
    }
    Ok((&buf[i..i + len], is_huffman, i + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc7541_integer_examples() {
        // C.1.1: 10 with a 5-bit prefix.
        let mut out = Vec::new();
        encode_int(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        // C.1.2: 1337 with a 5-bit prefix.
        out.clear();
        encode_int(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
        // C.1.3: 42 with an 8-bit prefix.
        out.clear();
        encode_int(&mut out, 0, 8, 42);
        assert_eq!(out, [0x2a]);
        let mut pos = 0;
        assert_eq!(decode_int(&[0x1f, 0x9a, 0x0a], &mut pos, 5), Ok(1337));
        assert_eq!(pos, 3);
    }

    #[test]
    fn integer_round_trip_and_limits() {
        for prefix in 1..=8u8 {
            for v in [0, 1, 30, 31, 126, 127, 128, 255, 16383, 1 << 40, MAX_INT] {
                let mut out = vec![];
                encode_int(&mut out, 0, prefix, v);
                assert_eq!(out.len(), int_len(prefix, v));
                let mut pos = 0;
                assert_eq!(decode_int(&out, &mut pos, prefix), Ok(v), "{prefix} {v}");
                assert_eq!(pos, out.len());
                for cut in 0..out.len() {
                    let mut pos = 0;
                    assert!(matches!(
                        decode_int(&out[..cut], &mut pos, prefix),
                        Err(Error::Incomplete(_))
                    ));
                }
            }
            let mut out = vec![];
            encode_int(&mut out, 0, prefix, MAX_INT + 1);
            assert!(matches!(
                decode_int(&out, &mut 0, prefix),
                Err(Error::Invalid(_))
            ));
        }
        // Endless continuation octets are refused, not looped over.
        let mut long = vec![0xff];
        long.extend([0x80; 20]);
        assert!(matches!(
            decode_int(&long, &mut 0, 8),
            Err(Error::Invalid(_))
        ));
        // Zero continuation octets (non-minimal but within bounds) are fine.
        assert_eq!(decode_int(&[0x1f, 0x80, 0x80, 0x00], &mut 0, 5), Ok(31));
    }

    #[test]
    fn string_limits() {
        let mut out = vec![];
        encode_string(&mut out, 0, 8, b"custom-key", false);
        assert_eq!(
            decode_string(&out, &mut 0, 8, 10),
            Ok(b"custom-key".to_vec())
        );
        assert_eq!(
            decode_string(&out, &mut 0, 8, 9),
            Err(Error::Invalid("string too long"))
        );
        assert_eq!(
            decode_string(&out[..5], &mut 0, 8, 100),
            Err(Error::Incomplete(Some(11)))
        );
        // A huge declared length is refused before allocation.
        let mut big = vec![];
        encode_int(&mut big, 0, 7, 1 << 40);
        assert_eq!(
            decode_string(&big, &mut 0, 8, 1 << 20),
            Err(Error::Invalid("string too long"))
        );
        out.clear();
        encode_string(&mut out, 0x40, 6, b"www.example.com", true);
        assert_eq!(out[0] & 0x20, 0x20);
        assert_eq!(out.len(), string_len(6, b"www.example.com", true));
        assert_eq!(
            decode_string(&out, &mut 0, 6, 100),
            Ok(b"www.example.com".to_vec())
        );
    }
}
