//! The wire formats of RFC 9204 §4.3 (encoder instructions), §4.4 (decoder instructions) and
//! §4.5 (the field section prefix and the field line representations), as typed values that
//! encode to and parse from bytes. [`Encoder`](super::Encoder) and [`Decoder`](super::Decoder)
//! are built on these; they are public for tests, tools and other encoders.

use bytes::{Bytes, BytesMut};

use super::prefix::{
    Error, decode_int, decode_string, decode_string_in, encode_int, encode_string,
};

/// An instruction on the encoder stream (RFC 9204 §4.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncoderInstruction {
    /// Set Dynamic Table Capacity (§4.3.1).
    SetCapacity(u64),
    /// Insert with Name Reference (§4.3.2): a static index, or a dynamic index relative to the
    /// insert count.
    InsertWithNameRef {
        /// The T bit.
        is_static: bool,
        /// The static index or the relative dynamic index.
        index: u64,
        /// The value.
        value: Bytes,
    },
    /// Insert with Literal Name (§4.3.3).
    InsertWithLiteralName {
        /// The name.
        name: Bytes,
        /// The value.
        value: Bytes,
    },
    /// Duplicate (§4.3.4) of the entry at this relative index.
    Duplicate(u64),
}

/// Makes an `Incomplete(Some(n))` count from the start of an item that began `offset` bytes
/// earlier.
fn shift(e: Error, offset: usize) -> Error {
    match e {
        Error::Incomplete(Some(n)) => Error::Incomplete(Some(n.saturating_add(offset))),
        e => e,
    }
}

impl EncoderInstruction {
    /// Appends the instruction; strings use the Huffman code when it is shorter and `huffman`
    /// is set.
    pub fn encode(&self, out: &mut Vec<u8>, huffman: bool) {
        match self {
            EncoderInstruction::SetCapacity(c) => write_set_capacity(out, *c),
            EncoderInstruction::InsertWithNameRef {
                is_static,
                index,
                value,
            } => write_insert_with_name_ref(out, *is_static, *index, value, huffman),
            EncoderInstruction::InsertWithLiteralName { name, value } => {
                write_insert_with_literal_name(out, name, value, huffman)
            }
            EncoderInstruction::Duplicate(i) => write_duplicate(out, *i),
        }
    }

    /// Parses one instruction from the start of `buf`: the instruction and its length. Each
    /// string may decode to at most `max_string` octets.
    pub fn parse(buf: &[u8], max_string: usize) -> Result<(Self, usize), Error> {
        let Some(&first) = buf.first() else {
            return Err(Error::Incomplete(None));
        };
        let mut pos = 0;
        let instruction = if first & 0x80 != 0 {
            let is_static = first & 0x40 != 0;
            let index = decode_int(buf, &mut pos, 6)?;
            let value = decode_string(buf, &mut pos, 8, max_string).map_err(|e| shift(e, pos))?;
            EncoderInstruction::InsertWithNameRef {
                is_static,
                index,
                value: value.into(),
            }
        } else if first & 0x40 != 0 {
            let name = decode_string(buf, &mut pos, 6, max_string)?;
            let value = decode_string(buf, &mut pos, 8, max_string).map_err(|e| shift(e, pos))?;
            EncoderInstruction::InsertWithLiteralName {
                name: name.into(),
                value: value.into(),
            }
        } else if first & 0x20 != 0 {
            EncoderInstruction::SetCapacity(decode_int(buf, &mut pos, 5)?)
        } else {
            EncoderInstruction::Duplicate(decode_int(buf, &mut pos, 5)?)
        };
        Ok((instruction, pos))
    }
}

/// Set Dynamic Table Capacity.
pub fn write_set_capacity(out: &mut Vec<u8>, capacity: u64) {
    encode_int(out, 0x20, 5, capacity);
}

/// Insert with Name Reference.
pub fn write_insert_with_name_ref(
    out: &mut Vec<u8>,
    is_static: bool,
    index: u64,
    value: &[u8],
    huffman: bool,
) {
    encode_int(out, if is_static { 0xc0 } else { 0x80 }, 6, index);
    encode_string(out, 0, 8, value, huffman);
}

/// Insert with Literal Name.
pub fn write_insert_with_literal_name(out: &mut Vec<u8>, name: &[u8], value: &[u8], huffman: bool) {
    encode_string(out, 0x40, 6, name, huffman);
    encode_string(out, 0, 8, value, huffman);
}

/// Duplicate.
pub fn write_duplicate(out: &mut Vec<u8>, relative_index: u64) {
    encode_int(out, 0x00, 5, relative_index);
}

/// An instruction on the decoder stream (RFC 9204 §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecoderInstruction {
    /// Section Acknowledgment (§4.4.1) for a stream.
    SectionAck(u64),
    /// Stream Cancellation (§4.4.2).
    StreamCancel(u64),
    /// Insert Count Increment (§4.4.3).
    InsertCountIncrement(u64),
}

impl DecoderInstruction {
    /// Appends the instruction.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            DecoderInstruction::SectionAck(s) => encode_int(out, 0x80, 7, s),
            DecoderInstruction::StreamCancel(s) => encode_int(out, 0x40, 6, s),
            DecoderInstruction::InsertCountIncrement(n) => encode_int(out, 0x00, 6, n),
        }
    }

    /// Parses one instruction from the start of `buf`: the instruction and its length.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), Error> {
        let Some(&first) = buf.first() else {
            return Err(Error::Incomplete(None));
        };
        let mut pos = 0;
        let instruction = if first & 0x80 != 0 {
            DecoderInstruction::SectionAck(decode_int(buf, &mut pos, 7)?)
        } else if first & 0x40 != 0 {
            DecoderInstruction::StreamCancel(decode_int(buf, &mut pos, 6)?)
        } else {
            DecoderInstruction::InsertCountIncrement(decode_int(buf, &mut pos, 6)?)
        };
        Ok((instruction, pos))
    }
}

/// Appends the encoded field section prefix (§4.5.1) for a Required Insert Count and a Base.
/// `max_entries` is `floor(MaxTableCapacity / 32)` of the decoder's SETTINGS value.
pub fn write_section_prefix(
    out: &mut Vec<u8>,
    required_insert_count: u64,
    base: u64,
    max_entries: u64,
) {
    if required_insert_count == 0 {
        out.extend_from_slice(&[0, 0]);
        return;
    }
    debug_assert!(max_entries > 0);
    encode_int(out, 0, 8, required_insert_count % (2 * max_entries) + 1);
    if base >= required_insert_count {
        encode_int(out, 0x00, 7, base - required_insert_count);
    } else {
        encode_int(out, 0x80, 7, required_insert_count - base - 1);
    }
}

/// Reconstructs the Required Insert Count from its encoding (§4.5.1.1). `None` when no
/// conforming encoder could have produced the value.
pub fn decode_required_insert_count(
    encoded: u64,
    max_entries: u64,
    total_inserts: u64,
) -> Option<u64> {
    if encoded == 0 {
        return Some(0);
    }
    let full_range = 2 * max_entries;
    if encoded > full_range {
        return None;
    }
    let max_value = total_inserts + max_entries;
    let max_wrapped = max_value / full_range * full_range;
    let mut ric = max_wrapped + encoded - 1;
    if ric > max_value {
        if ric <= full_range {
            return None;
        }
        ric -= full_range;
    }
    if ric == 0 { None } else { Some(ric) }
}

/// A field line representation (§4.5.2–§4.5.6). Dynamic indices are relative to the Base
/// (`Dynamic`) or post-Base (`PostBase`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldLine {
    /// Indexed Field Line, static table.
    IndexedStatic(u64),
    /// Indexed Field Line, dynamic table (relative index).
    IndexedDynamic(u64),
    /// Indexed Field Line with Post-Base Index.
    IndexedPostBase(u64),
    /// Literal Field Line with Name Reference, static table.
    LiteralStaticName {
        /// Static index of the name.
        index: u64,
        /// The value.
        value: Bytes,
        /// The N bit.
        never_index: bool,
    },
    /// Literal Field Line with Name Reference, dynamic table (relative index).
    LiteralDynamicName {
        /// Relative index of the name.
        index: u64,
        /// The value.
        value: Bytes,
        /// The N bit.
        never_index: bool,
    },
    /// Literal Field Line with Post-Base Name Reference.
    LiteralPostBaseName {
        /// Post-base index of the name.
        index: u64,
        /// The value.
        value: Bytes,
        /// The N bit.
        never_index: bool,
    },
    /// Literal Field Line with Literal Name.
    LiteralName {
        /// The name.
        name: Bytes,
        /// The value.
        value: Bytes,
        /// The N bit.
        never_index: bool,
    },
}

impl FieldLine {
    /// Appends the representation.
    pub fn encode(&self, out: &mut Vec<u8>, huffman: bool) {
        match self {
            FieldLine::IndexedStatic(i) => write_indexed(out, true, *i),
            FieldLine::IndexedDynamic(i) => write_indexed(out, false, *i),
            FieldLine::IndexedPostBase(i) => write_indexed_post_base(out, *i),
            FieldLine::LiteralStaticName {
                index,
                value,
                never_index,
            } => write_literal_name_ref(out, true, *index, value, *never_index, huffman),
            FieldLine::LiteralDynamicName {
                index,
                value,
                never_index,
            } => write_literal_name_ref(out, false, *index, value, *never_index, huffman),
            FieldLine::LiteralPostBaseName {
                index,
                value,
                never_index,
            } => write_literal_post_base_name(out, *index, value, *never_index, huffman),
            FieldLine::LiteralName {
                name,
                value,
                never_index,
            } => write_literal_name(out, name, value, *never_index, huffman),
        }
    }

    /// Parses one representation from `buf[*pos..]`, advancing `pos`. Each string may decode
    /// to at most `max_string` octets. A field section is complete, so running out of input is
    /// reported as `Incomplete` for the caller to turn into an error.
    ///
    /// The strings are split off `arena` (see [`decode_string_in`]).
    pub fn parse(
        buf: &[u8],
        pos: &mut usize,
        max_string: usize,
        arena: &mut BytesMut,
    ) -> Result<Self, Error> {
        let Some(&first) = buf.get(*pos) else {
            return Err(Error::Incomplete(None));
        };
        Ok(if first & 0x80 != 0 {
            let index = decode_int(buf, pos, 6)?;
            if first & 0x40 != 0 {
                FieldLine::IndexedStatic(index)
            } else {
                FieldLine::IndexedDynamic(index)
            }
        } else if first & 0x40 != 0 {
            let never_index = first & 0x20 != 0;
            let is_static = first & 0x10 != 0;
            let index = decode_int(buf, pos, 4)?;
            let value = decode_string_in(buf, pos, 8, max_string, arena)?;
            if is_static {
                FieldLine::LiteralStaticName {
                    index,
                    value,
                    never_index,
                }
            } else {
                FieldLine::LiteralDynamicName {
                    index,
                    value,
                    never_index,
                }
            }
        } else if first & 0x20 != 0 {
            let never_index = first & 0x10 != 0;
            let name = decode_string_in(buf, pos, 4, max_string, arena)?;
            let value = decode_string_in(buf, pos, 8, max_string, arena)?;
            FieldLine::LiteralName {
                name,
                value,
                never_index,
            }
        } else if first & 0x10 != 0 {
            FieldLine::IndexedPostBase(decode_int(buf, pos, 4)?)
        } else {
            let never_index = first & 0x08 != 0;
            let index = decode_int(buf, pos, 3)?;
            let value = decode_string_in(buf, pos, 8, max_string, arena)?;
            FieldLine::LiteralPostBaseName {
                index,
                value,
                never_index,
            }
        })
    }
}

/// Indexed Field Line (static or relative dynamic index).
pub fn write_indexed(out: &mut Vec<u8>, is_static: bool, index: u64) {
    encode_int(out, if is_static { 0xc0 } else { 0x80 }, 6, index);
}

/// Indexed Field Line with Post-Base Index.
pub fn write_indexed_post_base(out: &mut Vec<u8>, index: u64) {
    encode_int(out, 0x10, 4, index);
}

/// Literal Field Line with Name Reference (static or relative dynamic index).
pub fn write_literal_name_ref(
    out: &mut Vec<u8>,
    is_static: bool,
    index: u64,
    value: &[u8],
    never_index: bool,
    huffman: bool,
) {
    let first = 0x40 | if never_index { 0x20 } else { 0 } | if is_static { 0x10 } else { 0 };
    encode_int(out, first, 4, index);
    encode_string(out, 0, 8, value, huffman);
}

/// Literal Field Line with Post-Base Name Reference.
pub fn write_literal_post_base_name(
    out: &mut Vec<u8>,
    index: u64,
    value: &[u8],
    never_index: bool,
    huffman: bool,
) {
    encode_int(out, if never_index { 0x08 } else { 0 }, 3, index);
    encode_string(out, 0, 8, value, huffman);
}

/// Literal Field Line with Literal Name.
pub fn write_literal_name(
    out: &mut Vec<u8>,
    name: &[u8],
    value: &[u8],
    never_index: bool,
    huffman: bool,
) {
    encode_string(
        out,
        0x20 | if never_index { 0x10 } else { 0 },
        4,
        name,
        huffman,
    );
    encode_string(out, 0, 8, value, huffman);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_insert_count_round_trip() {
        // RFC 9204 §4.5.1.1 example: a 100-byte table (MaxEntries 3), 10 inserts received, an
        // encoded value of 4 means a Required Insert Count of 9.
        assert_eq!(decode_required_insert_count(4, 3, 10), Some(9));
        for max_entries in [1u64, 3, 6, 128] {
            for total in 0..(6 * max_entries) {
                // Any RIC the encoder could send: the entry RIC - 1 is still in the decoder's
                // table (so RIC > total - MaxEntries) and at most MaxEntries beyond it.
                let lo = (total + 1).saturating_sub(max_entries).max(1);
                for ric in lo..=total + max_entries {
                    let enc = ric % (2 * max_entries) + 1;
                    assert_eq!(
                        decode_required_insert_count(enc, max_entries, total),
                        Some(ric),
                        "{max_entries} {total} {ric}"
                    );
                }
            }
        }
        assert_eq!(decode_required_insert_count(7, 3, 0), None); // > FullRange
        assert_eq!(decode_required_insert_count(1, 0, 0), None); // no table
    }

    #[test]
    fn field_lines_round_trip() {
        let lines = [
            FieldLine::IndexedStatic(98),
            FieldLine::IndexedDynamic(70),
            FieldLine::IndexedPostBase(16),
            FieldLine::LiteralStaticName {
                index: 1,
                value: "/x".into(),
                never_index: false,
            },
            FieldLine::LiteralDynamicName {
                index: 20,
                value: "v".into(),
                never_index: true,
            },
            FieldLine::LiteralPostBaseName {
                index: 8,
                value: "".into(),
                never_index: true,
            },
            FieldLine::LiteralName {
                name: "x-a".into(),
                value: "b".into(),
                never_index: false,
            },
        ];
        for huffman in [false, true] {
            let mut out = vec![];
            for l in &lines {
                l.encode(&mut out, huffman);
            }
            let mut pos = 0;
            for l in &lines {
                assert_eq!(
                    &FieldLine::parse(&out, &mut pos, 100, &mut BytesMut::new()).unwrap(),
                    l
                );
            }
            assert_eq!(pos, out.len());
        }
    }

    #[test]
    fn instructions_round_trip() {
        let enc = [
            EncoderInstruction::SetCapacity(220),
            EncoderInstruction::InsertWithNameRef {
                is_static: true,
                index: 0,
                value: "a".into(),
            },
            EncoderInstruction::InsertWithNameRef {
                is_static: false,
                index: 70,
                value: "".into(),
            },
            EncoderInstruction::InsertWithLiteralName {
                name: "n".into(),
                value: "v".into(),
            },
            EncoderInstruction::Duplicate(31),
        ];
        let mut out = vec![];
        for i in &enc {
            i.encode(&mut out, true);
        }
        let mut pos = 0;
        for i in &enc {
            let (got, n) = EncoderInstruction::parse(&out[pos..], 100).unwrap();
            assert_eq!(&got, i);
            pos += n;
        }
        let dec = [
            DecoderInstruction::SectionAck(1000),
            DecoderInstruction::StreamCancel(8),
            DecoderInstruction::InsertCountIncrement(63),
        ];
        let mut out = vec![];
        for i in &dec {
            i.encode(&mut out);
        }
        let mut pos = 0;
        for i in &dec {
            let (got, n) = DecoderInstruction::parse(&out[pos..]).unwrap();
            assert_eq!(&got, i);
            pos += n;
        }
    }

    #[test]
    fn incomplete_reports_the_needed_length() {
        let mut out = vec![];
        EncoderInstruction::InsertWithLiteralName {
            name: "name".into(),
            value: "value".into(),
        }
        .encode(&mut out, false);
        // 1 + 4 + 1 + 5 = 11 bytes; cut inside the value.
        assert_eq!(
            EncoderInstruction::parse(&out[..8], 100),
            Err(Error::Incomplete(Some(11)))
        );
        assert_eq!(
            EncoderInstruction::parse(&out[..3], 100),
            Err(Error::Incomplete(Some(5)))
        );
    }
}
