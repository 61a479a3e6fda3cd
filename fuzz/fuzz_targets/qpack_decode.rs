//! QPACK decoding (`kuai_h3::qpack`): a [`Decoder`] fed encoder stream data and header blocks
//! in any order, and an [`Encoder`] fed decoder stream data.
//!
//! Input: one settings octet (table capacity, blocked streams, field section limit), then
//! records of `tag, length, data`. The tag's low two bits pick the action: encoder stream data
//! for the decoder, a header block on stream `(tag >> 2) % 8 * 4` (kept and retried when the
//! decoder reports it blocked and later unblocked), a stream cancellation, or decoder stream
//! data for an encoder that has encoded a few sections.
//!
//! Nothing may panic, and: errors carry a QPACK error code or H3_MESSAGE_ERROR (for the field
//! section limit); the dynamic table never exceeds its capacity, nor the capacity our SETTINGS;
//! blocked streams never exceed our SETTINGS; buffered encoder stream data stays bounded; a
//! decoded field section respects the size limit and survives re-encoding unchanged.

#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use bytes::Bytes;
use kuai_h3::qpack::{
    Decoded, Decoder, Encoder, H3_MESSAGE_ERROR, QPACK_DECODER_STREAM_ERROR,
    QPACK_DECOMPRESSION_FAILED, QPACK_ENCODER_STREAM_ERROR, corpus,
};
use libfuzzer_sys::fuzz_target;

const CAPACITIES: [u64; 8] = [0, 32, 64, 220, 256, 1024, 4096, 16384];
const BLOCKED: [u64; 4] = [0, 1, 2, 100];
const FIELD_SECTION_LIMITS: [u64; 4] = [u64::MAX, 100, 1000, 16384];

fuzz_target!(|data: &[u8]| {
    let Some((&settings, mut rest)) = data.split_first() else {
        return;
    };
    let capacity = CAPACITIES[(settings & 7) as usize];
    let max_blocked = BLOCKED[((settings >> 3) & 3) as usize];
    let limit = FIELD_SECTION_LIMITS[((settings >> 5) & 3) as usize];
    let mut decoder = Decoder::new(capacity, max_blocked, limit);
    let mut decoder_stream = Vec::new();
    let mut blocked: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut encoder: Option<Encoder> = None;

    while rest.len() >= 2 {
        let (tag, len) = (rest[0], rest[1] as usize);
        let chunk = &rest[2..(2 + len).min(rest.len())];
        rest = &rest[2 + chunk.len()..];
        let stream = ((tag >> 2) % 8) as u64 * 4;
        match tag & 3 {
            0 => {
                if let Err(e) = decoder.on_encoder_stream(chunk, &mut decoder_stream) {
                    assert_eq!(e.code, QPACK_ENCODER_STREAM_ERROR, "{e}");
                }
                for s in decoder.unblocked() {
                    if let Some(block) = blocked.remove(&s) {
                        decode(
                            &mut decoder,
                            s,
                            block,
                            &mut blocked,
                            &mut decoder_stream,
                            limit,
                        );
                    }
                }
            }
            1 => decode(
                &mut decoder,
                stream,
                chunk.to_vec(),
                &mut blocked,
                &mut decoder_stream,
                limit,
            ),
            2 => {
                blocked.remove(&stream);
                decoder.cancel_stream(stream, &mut decoder_stream);
            }
            _ => {
                let encoder = encoder.get_or_insert_with(|| {
                    let mut enc = Encoder::new(4096, 2);
                    let (mut block, mut es) = (Vec::new(), Vec::new());
                    for (i, section) in sections().iter().enumerate() {
                        enc.encode(i as u64 * 4, section, &mut block, &mut es)
                            .unwrap();
                    }
                    enc
                });
                if let Err(e) = encoder.on_decoder_stream(chunk) {
                    assert_eq!(e.code, QPACK_DECODER_STREAM_ERROR, "{e}");
                }
                assert!(encoder.known_received_count() <= encoder.insert_count());
                assert!(encoder.table_size() <= encoder.table_capacity());
            }
        }
        assert!(decoder.table_size() <= decoder.table_capacity());
        assert!(decoder.table_capacity() <= capacity);
        assert!(decoder.blocked_streams() as u64 <= max_blocked);
        assert!(decoder.buffered() as u64 <= capacity * 8 + 64);
    }
});

/// The sections the encoder has sent before the decoder stream data arrives.
fn sections() -> &'static [Vec<(Bytes, Bytes)>] {
    static SECTIONS: OnceLock<Vec<Vec<(Bytes, Bytes)>>> = OnceLock::new();
    SECTIONS.get_or_init(|| corpus::page_load_requests().into_iter().take(3).collect())
}

fn decode(
    decoder: &mut Decoder,
    stream: u64,
    block: Vec<u8>,
    blocked: &mut HashMap<u64, Vec<u8>>,
    decoder_stream: &mut Vec<u8>,
    limit: u64,
) {
    match decoder.decode(stream, &block, decoder_stream) {
        Ok(Decoded::Fields(fields)) => {
            blocked.remove(&stream);
            let size: u64 = fields
                .iter()
                .map(|(n, v)| n.len() as u64 + v.len() as u64 + 32)
                .sum();
            assert!(size <= limit);
            check_reencoding(&fields);
        }
        Ok(Decoded::Blocked) => {
            blocked.insert(stream, block);
        }
        Err(e) => {
            assert!(
                matches!(
                    e.code,
                    QPACK_DECOMPRESSION_FAILED | QPACK_ENCODER_STREAM_ERROR | H3_MESSAGE_ERROR
                ),
                "{e}"
            );
        }
    }
}

/// Whatever decodes must encode and decode back to the same field lines.
fn check_reencoding(fields: &[(Bytes, Bytes)]) {
    let mut encoder = Encoder::new(256, 1);
    let mut decoder = Decoder::new(256, 1, u64::MAX);
    let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
    encoder.encode(0, fields, &mut block, &mut es).unwrap();
    decoder.on_encoder_stream(&es, &mut ds).unwrap();
    match decoder.decode(0, &block, &mut ds).unwrap() {
        Decoded::Fields(again) => assert_eq!(again, fields),
        Decoded::Blocked => panic!("blocked after its encoder stream data"),
    }
    encoder.on_decoder_stream(&ds).unwrap();
}
