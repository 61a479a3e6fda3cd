//! The QPACK offline interop formats (quicwg/base-drafts wiki, "QPACK Offline Interop").
//!
//! * QIF, the input: field sections as text, one `name<TAB>value` line per field line, sections
//!   separated by blank lines, `#` starting a comment line.
//! * The encoded file: a sequence of blocks, each an 8-byte stream ID and a 4-byte length (both
//!   big-endian) followed by that many bytes. Stream ID 0 carries encoder stream instructions;
//!   any other stream ID carries one encoded field section (the n-th section of the QIF file on
//!   stream n).

use bytes::Bytes;

use super::instructions::DecoderInstruction;
use super::{Decoded, Decoder, Encoder, QPACK_DECOMPRESSION_FAILED, QpackError};

/// A field section: its field lines in order.
pub type Section = Vec<(Bytes, Bytes)>;

/// Appends one block of the encoded file format.
///
/// # Panics
///
/// If `data` is 4 GiB or longer (the length field has 32 bits).
pub fn write_block(out: &mut Vec<u8>, stream_id: u64, data: &[u8]) {
    let len = u32::try_from(data.len()).expect("a block is shorter than 4 GiB");
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
}

/// Splits an encoded file into its blocks: `(stream ID, data)`.
pub fn read_blocks(mut data: &[u8]) -> Result<Vec<(u64, &[u8])>, &'static str> {
    let mut blocks = Vec::new();
    while !data.is_empty() {
        if data.len() < 12 {
            return Err("truncated block header");
        }
        let stream_id = u64::from_be_bytes(data[..8].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(data[8..12].try_into().expect("4 bytes")) as usize;
        let rest = &data[12..];
        if rest.len() < len {
            return Err("truncated block");
        }
        blocks.push((stream_id, &rest[..len]));
        data = &rest[len..];
    }
    Ok(blocks)
}

/// Encodes sections into the encoded file format, section `i` on stream `i + 1`. With
/// `immediate_ack` the decoder is assumed to acknowledge every section and insert as soon as it
/// is written (the interop "a" option), otherwise the encoder never hears from it.
pub fn encode_file(
    sections: &[Section],
    max_table_capacity: u64,
    max_blocked_streams: u64,
    immediate_ack: bool,
    huffman: bool,
) -> Result<Vec<u8>, QpackError> {
    let mut encoder = Encoder::new(max_table_capacity, max_blocked_streams);
    encoder.set_huffman(huffman);
    let mut out = Vec::new();
    let (mut block, mut enc) = (Vec::new(), Vec::new());
    for (i, fields) in sections.iter().enumerate() {
        let stream_id = i as u64 + 1;
        block.clear();
        enc.clear();
        encoder.encode(stream_id, fields, &mut block, &mut enc)?;
        if !enc.is_empty() {
            write_block(&mut out, 0, &enc);
        }
        write_block(&mut out, stream_id, &block);
        if immediate_ack {
            let mut acks = Vec::new();
            if block.first() != Some(&0) {
                DecoderInstruction::SectionAck(stream_id).encode(&mut acks);
            }
            encoder.on_decoder_stream(&acks)?;
            let unacked = encoder.insert_count() - encoder.known_received_count();
            if unacked > 0 {
                acks.clear();
                DecoderInstruction::InsertCountIncrement(unacked).encode(&mut acks);
                encoder.on_decoder_stream(&acks)?;
            }
        }
    }
    Ok(out)
}

/// Decodes an encoded file: the sections in stream ID order. Sections blocked on encoder
/// instructions later in the file are decoded when those arrive.
pub fn decode_file(
    data: &[u8],
    max_table_capacity: u64,
    max_blocked_streams: u64,
) -> Result<Vec<(u64, Section)>, QpackError> {
    let malformed = |reason| QpackError {
        code: QPACK_DECOMPRESSION_FAILED,
        reason,
    };
    let blocks = read_blocks(data).map_err(malformed)?;
    let mut decoder = Decoder::new(max_table_capacity, max_blocked_streams, u64::MAX);
    let mut decoder_stream = Vec::new();
    let mut pending: Vec<(u64, &[u8])> = Vec::new();
    let mut sections = Vec::new();
    for (stream_id, data) in blocks {
        if stream_id == 0 {
            decoder.on_encoder_stream(data, &mut decoder_stream)?;
            for s in decoder.unblocked() {
                let Some(i) = pending.iter().position(|&(p, _)| p == s) else {
                    continue;
                };
                let (s, block) = pending.remove(i);
                match decoder.decode(s, block, &mut decoder_stream)? {
                    Decoded::Fields(f) => sections.push((s, f)),
                    Decoded::Blocked => pending.push((s, block)),
                }
            }
        } else {
            match decoder.decode(stream_id, data, &mut decoder_stream)? {
                Decoded::Fields(f) => sections.push((stream_id, f)),
                Decoded::Blocked => pending.push((stream_id, data)),
            }
        }
    }
    if !pending.is_empty() {
        return Err(malformed("sections still blocked at the end of the file"));
    }
    sections.sort_by_key(|&(s, _)| s);
    Ok(sections)
}

/// Parses QIF text into sections.
pub fn parse_qif(text: &str) -> Vec<Section> {
    let mut sections = Vec::new();
    let mut current = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            if !current.is_empty() {
                sections.push(std::mem::take(&mut current));
            }
            continue;
        }
        let (name, value) = line.split_once('\t').unwrap_or((line, ""));
        current.push((
            Bytes::copy_from_slice(name.as_bytes()),
            Bytes::copy_from_slice(value.as_bytes()),
        ));
    }
    if !current.is_empty() {
        sections.push(current);
    }
    sections
}

/// Writes sections as QIF text (names and values must not contain tabs or line breaks).
pub fn write_qif(sections: &[Section]) -> String {
    let mut out = String::new();
    for fields in sections {
        for (name, value) in fields {
            out.push_str(&String::from_utf8_lossy(name));
            out.push('\t');
            out.push_str(&String::from_utf8_lossy(value));
            out.push('\n');
        }
        out.push('\n');
    }
    out
}
