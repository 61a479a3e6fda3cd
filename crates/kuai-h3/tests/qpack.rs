//! QPACK (RFC 9204) tests: the RFC 9204 Appendix B examples byte for byte, the RFC 7541
//! Huffman examples, the fast Huffman decoder against the reference one, encoder → decoder
//! round trips with reordered delivery, the offline interop format, every error class, random
//! input, and the compression ratios quoted in the module docs.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use kuai_h3::qpack::instructions::{
    DecoderInstruction, EncoderInstruction, FieldLine, write_section_prefix,
};
use kuai_h3::qpack::interop::{self, Section};
use kuai_h3::qpack::{
    Decoded, Decoder, Encoder, EncoderStats, H3_MESSAGE_ERROR, QPACK_DECODER_STREAM_ERROR,
    QPACK_DECOMPRESSION_FAILED, QPACK_ENCODER_STREAM_ERROR, corpus, huffman,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| b.is_ascii_hexdigit()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn f(name: &str, value: &str) -> (Bytes, Bytes) {
    (
        Bytes::copy_from_slice(name.as_bytes()),
        Bytes::copy_from_slice(value.as_bytes()),
    )
}

fn fields(d: Decoded) -> Vec<(Bytes, Bytes)> {
    match d {
        Decoded::Fields(f) => f,
        Decoded::Blocked => panic!("unexpectedly blocked"),
    }
}

// ---------------------------------------------------------------------------------------------
// RFC 9204 Appendix B.

#[test]
fn rfc9204_b1_literal_field_line_with_name_reference() {
    let block = hex("0000 510b 2f69 6e64 6578 2e68 746d 6c");
    let mut dec = Decoder::new(0, 0, 1 << 16);
    let mut ds = Vec::new();
    assert_eq!(
        fields(dec.decode(0, &block, &mut ds).unwrap()),
        vec![f(":path", "/index.html")]
    );
    assert!(
        ds.is_empty(),
        "no acknowledgment for a section without dynamic references"
    );

    // The encoder makes the same choice (literal with static name reference, no insert).
    let mut enc = Encoder::new(0, 0);
    enc.set_huffman(false);
    let (mut out, mut es) = (Vec::new(), Vec::new());
    enc.encode(0, &[f(":path", "/index.html")], &mut out, &mut es)
        .unwrap();
    assert_eq!(out, block);
    assert!(es.is_empty());
    // Even with a dynamic table, :path is never inserted.
    let mut enc = Encoder::new(220, 1);
    enc.set_huffman(false);
    out.clear();
    enc.encode(0, &[f(":path", "/index.html")], &mut out, &mut es)
        .unwrap();
    assert_eq!(out, block);
    assert!(es.is_empty());
}

const B2_ENCODER: &str =
    "3fbd01 c00f 7777 772e 6578 616d 706c 652e 636f 6d c10c 2f73 616d 706c 652f 7061 7468";
const B3_ENCODER: &str = "4a63 7573 746f 6d2d 6b65 790c 6375 7374 6f6d 2d76 616c 7565";
const B4_ENCODER: &str = "02";
const B4_SECTION: &str = "0500 80 c1 81";
const B5_ENCODER: &str = "810d 6375 7374 6f6d 2d76 616c 7565 32";

#[test]
fn rfc9204_b2_dynamic_table() {
    // The encoder instructions and representations, encoded from their typed form.
    let mut es = Vec::new();
    EncoderInstruction::SetCapacity(220).encode(&mut es, false);
    EncoderInstruction::InsertWithNameRef {
        is_static: true,
        index: 0,
        value: "www.example.com".into(),
    }
    .encode(&mut es, false);
    EncoderInstruction::InsertWithNameRef {
        is_static: true,
        index: 1,
        value: "/sample/path".into(),
    }
    .encode(&mut es, false);
    assert_eq!(es, hex(B2_ENCODER));
    let mut block = Vec::new();
    write_section_prefix(&mut block, 2, 0, 220 / 32);
    FieldLine::IndexedPostBase(0).encode(&mut block, false);
    FieldLine::IndexedPostBase(1).encode(&mut block, false);
    assert_eq!(block, hex("0381 10 11"));
    let mut ack = Vec::new();
    DecoderInstruction::SectionAck(4).encode(&mut ack);
    assert_eq!(ack, [0x84]);

    // The decoder.
    let mut dec = Decoder::new(220, 1, 1 << 16);
    let mut ds = Vec::new();
    dec.on_encoder_stream(&hex(B2_ENCODER), &mut ds).unwrap();
    assert_eq!(dec.table_size(), 106);
    assert_eq!(dec.insert_count(), 2);
    // This decoder acknowledges inserts at once (Insert Count Increment 2); the RFC's decoder
    // leaves that to the Section Acknowledgment.
    assert_eq!(ds, [0x02]);
    ds.clear();
    let got = fields(dec.decode(4, &hex("0381 10 11"), &mut ds).unwrap());
    assert_eq!(
        got,
        vec![
            f(":authority", "www.example.com"),
            f(":path", "/sample/path")
        ]
    );
    assert_eq!(ds, [0x84]);

    // Our encoder with the same settings: the same Set Dynamic Table Capacity and insert of
    // :authority, referenced post-Base; :path stays a literal.
    let mut enc = Encoder::new(220, 1);
    enc.set_huffman(false);
    let (mut block, mut es) = (Vec::new(), Vec::new());
    enc.encode(
        4,
        &[f(":authority", "www.example.com")],
        &mut block,
        &mut es,
    )
    .unwrap();
    assert_eq!(es, hex("3fbd01 c00f 7777 772e 6578 616d 706c 652e 636f 6d"));
    assert_eq!(block, hex("0280 10"));
    assert_eq!(enc.stats().blocking_sections, 1);
    enc.on_decoder_stream(&[0x84]).unwrap();
    assert_eq!(enc.known_received_count(), 1);
    assert_eq!(enc.unacknowledged_sections(), 0);
}

/// A decoder after B.1–B.3.
fn decoder_after_b3() -> Decoder {
    let mut dec = Decoder::new(220, 1, 1 << 16);
    let mut ds = Vec::new();
    dec.on_encoder_stream(&hex(B2_ENCODER), &mut ds).unwrap();
    dec.decode(4, &hex("0381 10 11"), &mut ds).unwrap();
    ds.clear();
    dec.on_encoder_stream(&hex(B3_ENCODER), &mut ds).unwrap();
    assert_eq!(ds, [0x01], "Insert Count Increment (1)");
    assert_eq!(dec.table_size(), 160);
    dec
}

#[test]
fn rfc9204_b3_speculative_insert() {
    let mut es = Vec::new();
    EncoderInstruction::InsertWithLiteralName {
        name: "custom-key".into(),
        value: "custom-value".into(),
    }
    .encode(&mut es, false);
    assert_eq!(es, hex(B3_ENCODER));
    let mut ici = Vec::new();
    DecoderInstruction::InsertCountIncrement(1).encode(&mut ici);
    assert_eq!(ici, [0x01]);
    decoder_after_b3();
}

#[test]
fn rfc9204_b4_duplicate_and_stream_cancellation() {
    let mut es = Vec::new();
    EncoderInstruction::Duplicate(2).encode(&mut es, false);
    assert_eq!(es, hex(B4_ENCODER));
    let mut block = Vec::new();
    write_section_prefix(&mut block, 4, 4, 220 / 32);
    FieldLine::IndexedDynamic(0).encode(&mut block, false);
    FieldLine::IndexedStatic(1).encode(&mut block, false);
    FieldLine::IndexedDynamic(1).encode(&mut block, false);
    assert_eq!(block, hex(B4_SECTION));

    // As in the RFC: the section arrives before the Duplicate, and the stream is cancelled.
    let mut dec = decoder_after_b3();
    let mut ds = Vec::new();
    assert_eq!(
        dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap(),
        Decoded::Blocked
    );
    assert_eq!(dec.blocked_streams(), 1);
    dec.cancel_stream(8, &mut ds);
    assert_eq!(ds, [0x48], "Stream Cancellation (Stream=8)");
    assert_eq!(dec.blocked_streams(), 0);
    dec.on_encoder_stream(&hex(B4_ENCODER), &mut ds).unwrap();
    assert!(dec.unblocked().is_empty());
    assert_eq!(dec.table_size(), 217);

    // Had the Duplicate arrived, the stream would have unblocked.
    let mut dec = decoder_after_b3();
    let mut ds = Vec::new();
    assert_eq!(
        dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap(),
        Decoded::Blocked
    );
    dec.on_encoder_stream(&hex(B4_ENCODER), &mut ds).unwrap();
    assert_eq!(dec.unblocked(), vec![8]);
    let got = fields(dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap());
    assert_eq!(
        got,
        vec![
            f(":authority", "www.example.com"),
            f(":path", "/"),
            f("custom-key", "custom-value")
        ]
    );
    assert_eq!(
        ds,
        [0x01, 0x88],
        "Insert Count Increment (1), Section Acknowledgment (8)"
    );
}

#[test]
fn rfc9204_b5_dynamic_table_insert_eviction() {
    let mut es = Vec::new();
    EncoderInstruction::InsertWithNameRef {
        is_static: false,
        index: 1,
        value: "custom-value2".into(),
    }
    .encode(&mut es, false);
    assert_eq!(es, hex(B5_ENCODER));

    let mut dec = decoder_after_b3();
    let mut ds = Vec::new();
    dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap();
    dec.cancel_stream(8, &mut ds);
    dec.on_encoder_stream(&hex(B4_ENCODER), &mut ds).unwrap();
    dec.on_encoder_stream(&hex(B5_ENCODER), &mut ds).unwrap();
    assert_eq!(dec.table_size(), 215);
    assert_eq!(dec.insert_count(), 5);
    // Absolute index 0 is evicted: referencing it is an error.
    let mut block = Vec::new();
    write_section_prefix(&mut block, 1, 1, 220 / 32);
    FieldLine::IndexedDynamic(0).encode(&mut block, false);
    let e = dec.decode(12, &block, &mut ds).unwrap_err();
    assert_eq!(e.code, QPACK_DECOMPRESSION_FAILED);
    // Absolute index 4 is the new entry.
    let mut block = Vec::new();
    write_section_prefix(&mut block, 5, 5, 220 / 32);
    FieldLine::IndexedDynamic(0).encode(&mut block, false);
    FieldLine::IndexedDynamic(3).encode(&mut block, false);
    let got = fields(dec.decode(16, &block, &mut ds).unwrap());
    assert_eq!(
        got,
        vec![f("custom-key", "custom-value2"), f(":path", "/sample/path")]
    );
}

// ---------------------------------------------------------------------------------------------
// Huffman.

const RFC7541_HUFFMAN: &[(&str, &str)] = &[
    ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
    ("a8eb 1064 9cbf", "no-cache"),
    ("25a8 49e9 5ba9 7d7f", "custom-key"),
    ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
    ("6402", "302"),
    ("aec3 771a 4b", "private"),
    (
        "d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff",
        "Mon, 21 Oct 2013 20:13:21 GMT",
    ),
    (
        "9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3",
        "https://www.example.com",
    ),
    ("640e ff", "307"),
    (
        "d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff",
        "Mon, 21 Oct 2013 20:13:22 GMT",
    ),
    ("9bd9 ab", "gzip"),
    (
        "94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
        "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
    ),
];

#[test]
fn rfc7541_appendix_c_huffman_examples() {
    for &(code, text) in RFC7541_HUFFMAN {
        let code = hex(code);
        let mut enc = Vec::new();
        huffman::encode(text.as_bytes(), &mut enc);
        assert_eq!(enc, code, "{text}");
        assert_eq!(huffman::encoded_len(text.as_bytes()), code.len());
        for decode in [huffman::decode, huffman::decode_reference] {
            let mut dec = Vec::new();
            decode(&code, &mut dec).unwrap();
            assert_eq!(dec, text.as_bytes());
        }
    }
}

#[test]
fn huffman_round_trip_random() {
    let mut rng = StdRng::seed_from_u64(1);
    for i in 0..5000 {
        let len = rng.random_range(0..200);
        let s: Vec<u8> = if i % 2 == 0 {
            (0..len).map(|_| rng.random()).collect()
        } else {
            // Mostly header-like text.
            let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789-_./:;=?&%, ABCXYZ\"'<>{}~^\\";
            (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect()
        };
        let mut enc = Vec::new();
        huffman::encode(&s, &mut enc);
        assert_eq!(enc.len(), huffman::encoded_len(&s));
        let mut dec = Vec::new();
        huffman::decode(&enc, &mut dec).unwrap();
        assert_eq!(dec, s);
    }
}

fn same_decoding(input: &[u8]) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let ra = huffman::decode(input, &mut a);
    let rb = huffman::decode_reference(input, &mut b);
    assert_eq!(ra, rb, "input {input:02x?}");
    if ra.is_ok() {
        assert_eq!(a, b, "input {input:02x?}");
    }
}

#[test]
fn huffman_fast_decoder_matches_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    // Every input of up to two bytes.
    same_decoding(&[]);
    for a in 0..=255u8 {
        same_decoding(&[a]);
        for b in 0..=255u8 {
            same_decoding(&[a, b]);
        }
    }
    let mut valid = 0;
    for i in 0..20_000 {
        let input: Vec<u8> = match i % 4 {
            // Random bytes: mostly invalid.
            0 => (0..rng.random_range(0..40)).map(|_| rng.random()).collect(),
            // Random bytes biased to ones (long codes, EOS, padding).
            1 => (0..rng.random_range(0..40))
                .map(|_| rng.random::<u8>() | rng.random::<u8>())
                .collect(),
            // Valid encodings, possibly truncated or with a flipped bit.
            _ => {
                let s: Vec<u8> = (0..rng.random_range(0..60)).map(|_| rng.random()).collect();
                let mut enc = Vec::new();
                huffman::encode(&s, &mut enc);
                if i % 4 == 3 && !enc.is_empty() {
                    let bit = rng.random_range(0..enc.len() * 8);
                    enc[bit / 8] ^= 0x80 >> (bit % 8);
                    if rng.random_bool(0.3) {
                        enc.truncate(rng.random_range(0..enc.len()));
                    }
                } else {
                    valid += 1;
                }
                enc
            }
        };
        same_decoding(&input);
    }
    assert!(valid > 1000);
}

#[test]
fn huffman_rejects_bad_padding_and_eos() {
    let mut out = Vec::new();
    // "a" is 00011: padding 111 is fine, 110 is not.
    assert!(huffman::decode(&[0b0001_1111], &mut out).is_ok());
    assert_eq!(
        huffman::decode(&[0b0001_1110], &mut out),
        Err(huffman::HuffmanError::Padding)
    );
    // A whole octet of padding.
    assert_eq!(
        huffman::decode(&[0b0001_1111, 0xff], &mut out),
        Err(huffman::HuffmanError::Padding)
    );
    // EOS inside the string.
    assert_eq!(
        huffman::decode(&[0xff, 0xff, 0xff, 0xfc], &mut out),
        Err(huffman::HuffmanError::Eos)
    );
}

// ---------------------------------------------------------------------------------------------
// Round trips with reordered delivery.

/// Sections of random field lines: repeated names and values, unique values, large values,
/// binary values.
fn random_sections(rng: &mut StdRng, count: usize) -> Vec<Section> {
    let names = [
        ":authority",
        "user-agent",
        "cookie",
        ":path",
        "content-type",
        "x-custom-a",
        "x-custom-b",
        "x-trace",
        "accept",
        "referer",
        ":method",
        "x-big",
    ];
    (0..count)
        .map(|_| {
            let n = rng.random_range(0..16);
            (0..n)
                .map(|_| {
                    let name = names[rng.random_range(0..names.len())];
                    let value: Vec<u8> = match rng.random_range(0..10) {
                        0 => Vec::new(),
                        1 => (0..rng.random_range(1..40)).map(|_| rng.random()).collect(),
                        2 => vec![b'x'; rng.random_range(100..6000)],
                        3 => format!("unique-{}", rng.random::<u64>()).into_bytes(),
                        _ => format!("value-{}", rng.random_range(0..6)).into_bytes(),
                    };
                    let name = if rng.random_bool(0.05) {
                        Bytes::from(format!("x-rand-{}", rng.random_range(0..1000)))
                    } else {
                        Bytes::from_static(name.as_bytes())
                    };
                    (name, Bytes::from(value))
                })
                .collect()
        })
        .collect()
}

/// An encoder and a decoder connected by a simulated network that delivers the encoder
/// stream, the request streams and the decoder stream in random chunks and random order,
/// and sometimes cancels streams.
struct Session {
    rng: StdRng,
    enc: Encoder,
    dec: Decoder,
    enc_wire: VecDeque<u8>,
    dec_wire: VecDeque<u8>,
    in_flight: Vec<(u64, Vec<u8>)>,
    blocked: HashMap<u64, Vec<u8>>,
    expected: HashMap<u64, Section>,
    decoded: usize,
    cancelled: usize,
    max_blocked_seen: usize,
}

impl Session {
    fn new(capacity: u64, blocked: u64, seed: u64) -> Self {
        Session {
            rng: StdRng::seed_from_u64(seed),
            enc: Encoder::new(capacity, blocked),
            dec: Decoder::new(capacity, blocked, u64::MAX),
            enc_wire: VecDeque::new(),
            dec_wire: VecDeque::new(),
            in_flight: Vec::new(),
            blocked: HashMap::new(),
            expected: HashMap::new(),
            decoded: 0,
            cancelled: 0,
            max_blocked_seen: 0,
        }
    }

    fn send(&mut self, stream: u64, section: &Section) {
        let (mut block, mut es) = (Vec::new(), Vec::new());
        self.enc
            .encode(stream, section, &mut block, &mut es)
            .unwrap();
        self.enc_wire.extend(es);
        self.in_flight.push((stream, block));
        self.expected.insert(stream, section.clone());
    }

    fn chunk(&mut self, available: usize) -> usize {
        if self.rng.random_bool(0.5) {
            available.min(self.rng.random_range(1..8))
        } else {
            available
        }
    }

    fn deliver_encoder_stream(&mut self, all: bool) {
        let n = if all {
            self.enc_wire.len()
        } else {
            self.chunk(self.enc_wire.len())
        };
        let data: Vec<u8> = self.enc_wire.drain(..n).collect();
        let mut ds = Vec::new();
        self.dec.on_encoder_stream(&data, &mut ds).unwrap();
        for stream in self.dec.unblocked() {
            let block = self
                .blocked
                .remove(&stream)
                .expect("unblocked stream was blocked");
            self.decode(stream, block, &mut ds);
        }
        self.dec_wire.extend(ds);
    }

    fn decode(&mut self, stream: u64, block: Vec<u8>, ds: &mut Vec<u8>) {
        match self.dec.decode(stream, &block, ds).unwrap() {
            Decoded::Fields(got) => {
                assert_eq!(
                    got,
                    self.expected.remove(&stream).unwrap(),
                    "stream {stream}"
                );
                self.decoded += 1;
            }
            Decoded::Blocked => {
                self.blocked.insert(stream, block);
                self.max_blocked_seen = self.max_blocked_seen.max(self.dec.blocked_streams());
            }
        }
    }

    fn deliver_block(&mut self) {
        let i = self.rng.random_range(0..self.in_flight.len());
        let (stream, block) = self.in_flight.swap_remove(i);
        let mut ds = Vec::new();
        self.decode(stream, block, &mut ds);
        self.dec_wire.extend(ds);
    }

    fn deliver_decoder_stream(&mut self, all: bool) {
        let n = if all {
            self.dec_wire.len()
        } else {
            self.chunk(self.dec_wire.len())
        };
        let data: Vec<u8> = self.dec_wire.drain(..n).collect();
        self.enc.on_decoder_stream(&data).unwrap();
    }

    fn cancel_one(&mut self) {
        let stream = if !self.in_flight.is_empty() && self.rng.random_bool(0.5) {
            let i = self.rng.random_range(0..self.in_flight.len());
            self.in_flight.swap_remove(i).0
        } else if let Some(&s) = self.blocked.keys().next() {
            self.blocked.remove(&s);
            s
        } else {
            return;
        };
        self.expected.remove(&stream);
        let mut ds = Vec::new();
        self.dec.cancel_stream(stream, &mut ds);
        self.dec_wire.extend(ds);
        self.cancelled += 1;
    }

    /// Runs the sections through, in random interleavings, then drains everything.
    fn run(&mut self, sections: &[Section], cancel: bool) {
        let mut next = 0;
        while next < sections.len() || !self.in_flight.is_empty() || !self.enc_wire.is_empty() {
            match self.rng.random_range(0..100) {
                0..30 if next < sections.len() => {
                    self.send(next as u64 * 4, &sections[next]);
                    next += 1;
                }
                30..55 if !self.enc_wire.is_empty() => self.deliver_encoder_stream(false),
                55..80 if !self.in_flight.is_empty() => self.deliver_block(),
                80..98 if !self.dec_wire.is_empty() => self.deliver_decoder_stream(false),
                98..100 if cancel => self.cancel_one(),
                _ => {}
            }
        }
        self.finish();
    }

    fn finish(&mut self) {
        while !self.in_flight.is_empty() {
            self.deliver_block();
        }
        self.deliver_encoder_stream(true);
        self.deliver_decoder_stream(true);
        assert!(self.blocked.is_empty(), "sections left blocked");
        assert!(self.expected.is_empty(), "sections not decoded");
        assert_eq!(self.enc.unacknowledged_sections(), 0);
        assert!(!self.enc.has_referenced_entries());
        assert_eq!(self.enc.known_received_count(), self.enc.insert_count());
        assert_eq!(self.dec.insert_count(), self.enc.insert_count());
        assert_eq!(self.dec.table_size(), self.enc.table_size());
        assert_eq!(self.dec.buffered(), 0);
    }
}

#[test]
fn round_trip_with_reordering() {
    let corpus: Vec<Section> = corpus::page_load_requests()
        .into_iter()
        .chain(corpus::page_load_responses())
        .collect();
    for capacity in [0, 256, 4096, 16384] {
        for blocked in [0, 100] {
            for seed in 0..3 {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut sections = random_sections(&mut rng, 150);
                sections.extend(corpus.iter().cloned());
                let mut s = Session::new(capacity, blocked, seed * 31 + capacity + blocked);
                s.run(&sections, seed == 2);
                assert!(s.max_blocked_seen as u64 <= blocked);
                let stats = s.enc.stats();
                if capacity >= 4096 {
                    assert!(
                        stats.dynamic_refs > 0,
                        "{capacity}/{blocked}: the dynamic table is used"
                    );
                }
                if blocked == 0 {
                    assert_eq!(stats.blocking_sections, 0);
                    assert_eq!(s.max_blocked_seen, 0);
                }
                if capacity == 0 {
                    assert_eq!(stats.encoder_stream_bytes, 0);
                }
            }
        }
    }
}

#[test]
fn blocked_streams_limit_is_respected_without_feedback() {
    // No decoder stream at all: the encoder may only let `limit` streams risk blocking.
    for limit in [1u64, 2, 5] {
        let mut enc = Encoder::new(4096, limit);
        let mut dec = Decoder::new(4096, limit, u64::MAX);
        let mut blocks = Vec::new();
        let mut es = Vec::new();
        for i in 0..20u64 {
            let section = vec![
                f("x-custom", &format!("value-{i}")),
                f("x-custom", &format!("value-{i}")),
            ];
            let mut block = Vec::new();
            enc.encode(i * 4, &section, &mut block, &mut es).unwrap();
            blocks.push((i * 4, block, section));
            assert!(enc.blocking_streams() <= limit);
        }
        assert_eq!(enc.stats().blocking_sections, limit);
        // Every section reaches the decoder before any encoder instruction: exactly `limit`
        // block, none over the limit.
        let mut ds = Vec::new();
        let mut blocked = Vec::new();
        for (stream, block, section) in &blocks {
            match dec.decode(*stream, block, &mut ds).unwrap() {
                Decoded::Fields(got) => assert_eq!(&got, section),
                Decoded::Blocked => blocked.push(*stream),
            }
        }
        assert_eq!(blocked.len() as u64, limit);
        dec.on_encoder_stream(&es, &mut ds).unwrap();
        let mut unblocked = dec.unblocked();
        unblocked.sort();
        assert_eq!(unblocked, blocked);
    }
}

#[test]
fn repeated_fields_use_the_dynamic_table_and_paths_do_not() {
    let mut enc = Encoder::new(4096, 0);
    let mut dec = Decoder::new(4096, 0, u64::MAX);
    let mut sizes = Vec::new();
    for i in 0..5 {
        let section = vec![
            f(":authority", "www.example.com"),
            f(
                "user-agent",
                "kuai-test/1.0 (a user agent long enough to matter)",
            ),
            f(":path", &format!("/item/{i}")),
            f("x-custom", "same"),
        ];
        let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        enc.encode(i * 4, &section, &mut block, &mut es).unwrap();
        dec.on_encoder_stream(&es, &mut ds).unwrap();
        assert_eq!(fields(dec.decode(i * 4, &block, &mut ds).unwrap()), section);
        enc.on_decoder_stream(&ds).unwrap();
        sizes.push(block.len());
    }
    let st = enc.stats();
    assert_eq!(
        st.inserts, 3,
        ":authority, user-agent, x-custom; never :path"
    );
    // From the second section on (after the Insert Count Increment) all three are references.
    assert_eq!(st.dynamic_refs, 3 * 4);
    assert!(sizes[1] < sizes[0] / 3, "{sizes:?}");
    assert_eq!(sizes[1], sizes[4]);
}

#[test]
fn repeated_literals_encode_the_same_and_changed_ones_anew() {
    // `date`, `etag`, `content-length` are never inserted: literals with a static name
    // reference, which the encoder keeps encoded for the next identical line.
    let mut enc = Encoder::new(4096, 0);
    let mut dec = Decoder::new(4096, 0, u64::MAX);
    let date = |s: u32| format!("Sat, 28 Nov 2026 04:30:{s:02} GMT");
    let mut blocks = Vec::new();
    for (i, (d, tag)) in [
        (1, "\"a1\""),
        (1, "\"a1\""),
        (2, "\"a1\""),
        (2, "\"b2\""),
        (1, "\"a1\""),
    ]
    .into_iter()
    .enumerate()
    {
        let long = "v".repeat(100); // too long to keep
        let section = vec![
            f(":status", "200"),
            f("date", &date(d)),
            f("etag", tag),
            f("content-length", "1024"),
            f("location", &long),
        ];
        let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        enc.encode(i as u64 * 4, &section, &mut block, &mut es)
            .unwrap();
        dec.on_encoder_stream(&es, &mut ds).unwrap();
        assert_eq!(
            fields(dec.decode(i as u64 * 4, &block, &mut ds).unwrap()),
            section
        );
        enc.on_decoder_stream(&ds).unwrap();
        blocks.push(block);
    }
    assert_eq!(enc.stats().inserts, 0);
    assert_eq!(blocks[0], blocks[1]);
    assert_ne!(blocks[1], blocks[2]);
    assert_ne!(blocks[2], blocks[3]);
    assert_eq!(blocks[0], blocks[4]);
}

#[test]
fn draining_entries_are_duplicated() {
    // A small table filled with new entries while one field repeats in every section: the
    // repeated entry reaches the draining zone and is refreshed with Duplicate.
    let mut s = Session::new(400, 10, 7);
    let sections: Vec<Section> = (0..60)
        .map(|i| {
            vec![
                f("x-keep", "this value repeats in every section"),
                f(&format!("x-new-{i}"), "new value"),
            ]
        })
        .collect();
    for (i, section) in sections.iter().enumerate() {
        s.send(i as u64 * 4, section);
        s.deliver_encoder_stream(true);
        s.deliver_block();
        s.deliver_decoder_stream(true);
    }
    s.finish();
    let st = s.enc.stats();
    assert!(st.duplicates > 0, "{st:?}");
    assert!(st.evictions > 0, "{st:?}");
    assert!(st.dynamic_refs >= 100, "{st:?}");
}

#[test]
fn referenced_entries_are_not_evicted() {
    // A 200-octet table holds two 90-octet entries; a third may only evict an entry once the
    // section referencing it is acknowledged.
    let value = |c: char| c.to_string().repeat(55);
    let mut enc = Encoder::new(200, 10);
    let mut dec = Decoder::new(200, 10, u64::MAX);
    let mut sent = Vec::new();
    let mut es = Vec::new();
    for (i, name) in ["x-a", "x-b", "x-c"].iter().enumerate() {
        let section = vec![f(name, &value('v'))];
        let mut block = Vec::new();
        enc.encode(i as u64 * 4, &section, &mut block, &mut es)
            .unwrap();
        sent.push((i as u64 * 4, block, section));
    }
    assert_eq!(
        enc.stats().inserts,
        2,
        "x-c does not fit without evicting x-a, still referenced"
    );
    assert_eq!(enc.stats().evictions, 0);
    let mut ds = Vec::new();
    dec.on_encoder_stream(&es, &mut ds).unwrap();
    for (stream, block, section) in &sent {
        assert_eq!(
            &fields(dec.decode(*stream, block, &mut ds).unwrap()),
            section
        );
    }
    enc.on_decoder_stream(&ds).unwrap();
    assert_eq!(enc.blocking_streams(), 0);
    // Acknowledged and unreferenced now: x-a makes room for x-c.
    let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
    let section = vec![f("x-c", &value('v'))];
    enc.encode(12, &section, &mut block, &mut es).unwrap();
    assert_eq!(enc.stats().inserts, 3);
    assert_eq!(enc.stats().evictions, 1);
    dec.on_encoder_stream(&es, &mut ds).unwrap();
    assert_eq!(fields(dec.decode(12, &block, &mut ds).unwrap()), section);
    assert_eq!(dec.table_size(), enc.table_size());
}

#[test]
fn sensitive_fields_are_never_indexed() {
    let mut enc = Encoder::new(4096, 100);
    let (mut block, mut es) = (Vec::new(), Vec::new());
    let section = vec![f("authorization", "Bearer abcdef"), f("cookie", "short=1")];
    enc.encode(0, &section, &mut block, &mut es).unwrap();
    enc.encode(4, &section, &mut block, &mut es).unwrap();
    assert!(es.is_empty());
    assert_eq!(enc.stats().inserts, 0);
    // The N bit is set on both literals (0x5x with N = 0x20).
    let mut dec = Decoder::new(4096, 100, u64::MAX);
    let mut one = Vec::new();
    enc.encode(8, &section, &mut one, &mut es).unwrap();
    assert_eq!(
        one[2] & 0xf0,
        0x70,
        "literal with static name reference and N"
    );
    assert_eq!(
        fields(dec.decode(8, &one, &mut Vec::new()).unwrap()),
        section
    );
}

// ---------------------------------------------------------------------------------------------
// The offline interop format.

#[test]
fn offline_interop_round_trip() {
    let mut sections = corpus::page_load_requests();
    sections.extend(corpus::page_load_responses());
    // QIF text.
    let qif = interop::write_qif(&sections);
    assert_eq!(interop::parse_qif(&qif), sections);
    assert_eq!(
        interop::parse_qif("# comment\na\tb\n\n\nc\td\te\n"),
        vec![vec![f("a", "b")], vec![f("c", "d\te")]]
    );

    for (capacity, blocked) in [(0, 0), (256, 0), (4096, 0), (4096, 100), (16384, 100)] {
        for immediate_ack in [false, true] {
            let file =
                interop::encode_file(&sections, capacity, blocked, immediate_ack, true).unwrap();
            let blocks = interop::read_blocks(&file).unwrap();
            assert_eq!(blocks.iter().filter(|b| b.0 != 0).count(), sections.len());
            let decoded = interop::decode_file(&file, capacity, blocked).unwrap();
            let decoded: Vec<Section> = decoded.into_iter().map(|(_, s)| s).collect();
            assert_eq!(decoded, sections, "{capacity} {blocked} {immediate_ack}");

            // The same file with every encoder block moved after the section that follows it:
            // sections block and unblock.
            if blocked > 0 {
                let mut reordered = Vec::new();
                let mut held: Option<&[u8]> = None;
                for (stream, data) in &blocks {
                    if *stream == 0 {
                        held = Some(data);
                    } else {
                        interop::write_block(&mut reordered, *stream, data);
                        if let Some(h) = held.take() {
                            interop::write_block(&mut reordered, 0, h);
                        }
                    }
                }
                let decoded = interop::decode_file(&reordered, capacity, blocked).unwrap();
                assert_eq!(decoded.len(), sections.len());
                assert!(
                    decoded
                        .into_iter()
                        .map(|(_, s)| s)
                        .eq(sections.iter().cloned())
                );
            }
        }
    }
    assert!(interop::read_blocks(&[0; 11]).is_err());
    assert!(interop::read_blocks(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, 1]).is_err());
}

// ---------------------------------------------------------------------------------------------
// Errors.

fn decode_err(dec: &mut Decoder, block: &[u8]) -> u64 {
    dec.decode(100, block, &mut Vec::new()).unwrap_err().code
}

fn encoder_stream_err(max_capacity: u64, data: &[u8]) -> u64 {
    Decoder::new(max_capacity, 0, u64::MAX)
        .on_encoder_stream(data, &mut Vec::new())
        .unwrap_err()
        .code
}

#[test]
fn field_section_errors() {
    let mut dec = decoder_after_b3(); // 3 entries, MaxEntries 6
    // Encoded Required Insert Count above 2 × MaxEntries.
    assert_eq!(
        decode_err(&mut dec, &hex("0d00")),
        QPACK_DECOMPRESSION_FAILED
    );
    // A Required Insert Count with no dynamic table.
    assert_eq!(
        decode_err(&mut Decoder::new(0, 0, 1000), &hex("0200 80")),
        QPACK_DECOMPRESSION_FAILED
    );
    // Negative Base: RIC 1, S = 1, Delta Base 1.
    assert_eq!(
        decode_err(&mut dec, &hex("0281 80")),
        QPACK_DECOMPRESSION_FAILED
    );
    // A reference at or above the Required Insert Count (post-Base index 1 with RIC 1).
    assert_eq!(
        decode_err(&mut dec, &hex("0280 11")),
        QPACK_DECOMPRESSION_FAILED
    );
    // A Required Insert Count larger than the references need (RIC 2, only entry 0 used).
    assert_eq!(
        decode_err(&mut dec, &hex("0300 81")),
        QPACK_DECOMPRESSION_FAILED
    );
    // A Required Insert Count of 0 with a dynamic reference.
    assert_eq!(
        decode_err(&mut dec, &hex("0000 80")),
        QPACK_DECOMPRESSION_FAILED
    );
    // An invalid static index.
    assert_eq!(
        decode_err(&mut dec, &hex("0000 ff24")),
        QPACK_DECOMPRESSION_FAILED
    );
    // Invalid Huffman: a literal value of one octet 0x00 (bad padding).
    assert_eq!(
        decode_err(&mut dec, &hex("0000 5181 00")),
        QPACK_DECOMPRESSION_FAILED
    );
    // Truncated: a prefix only half there, a literal longer than the block.
    assert_eq!(decode_err(&mut dec, &hex("00")), QPACK_DECOMPRESSION_FAILED);
    assert_eq!(
        decode_err(&mut dec, &hex("0000 5105 6162")),
        QPACK_DECOMPRESSION_FAILED
    );
    // A literal length of 2^40: refused without allocating.
    let mut block = hex("0000 517f");
    block.extend([0x80, 0x80, 0x80, 0x80, 0x80, 0x20]);
    assert_eq!(
        decode_err(&mut Decoder::new(0, 0, u64::MAX), &block),
        QPACK_DECOMPRESSION_FAILED
    );
    // An integer above 2^62.
    let mut block = hex("0000 ff");
    block.extend([0xff; 9]);
    block.push(0x01);
    assert_eq!(decode_err(&mut dec, &block), QPACK_DECOMPRESSION_FAILED);
    // The decoder state is unharmed by these: the B.4 section still decodes once unblocked.
    let mut ds = Vec::new();
    assert_eq!(
        dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap(),
        Decoded::Blocked
    );
}

#[test]
fn too_many_blocked_streams() {
    let mut dec = decoder_after_b3(); // allows 1 blocked stream
    let mut ds = Vec::new();
    assert_eq!(
        dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap(),
        Decoded::Blocked
    );
    // Retrying the same stream does not count twice.
    assert_eq!(
        dec.decode(8, &hex(B4_SECTION), &mut ds).unwrap(),
        Decoded::Blocked
    );
    assert_eq!(
        dec.decode(12, &hex(B4_SECTION), &mut ds).unwrap_err().code,
        QPACK_DECOMPRESSION_FAILED
    );
    // With a limit of 0, any blocked section is an error.
    let mut dec = Decoder::new(220, 0, u64::MAX);
    assert_eq!(
        dec.decode(0, &hex("0200 80"), &mut ds).unwrap_err().code,
        QPACK_DECOMPRESSION_FAILED
    );
}

#[test]
fn field_section_size_limit() {
    // RFC 9114 §4.2.2: name + value + 32 per field line.
    let section = vec![f("x-a", "1234567"), f("x-b", "1234567")]; // 42 each
    let mut enc = Encoder::new(0, 0);
    let (mut block, mut es) = (Vec::new(), Vec::new());
    enc.encode(0, &section, &mut block, &mut es).unwrap();
    assert_eq!(
        fields(
            Decoder::new(0, 0, 84)
                .decode(0, &block, &mut Vec::new())
                .unwrap()
        ),
        section
    );
    let e = Decoder::new(0, 0, 83)
        .decode(0, &block, &mut Vec::new())
        .unwrap_err();
    assert_eq!(e.code, H3_MESSAGE_ERROR);
    // A literal longer than the limit is refused from its length alone.
    let mut big = Vec::new();
    Encoder::new(0, 0)
        .encode(0, &[f("x-a", &"v".repeat(5000))], &mut big, &mut es)
        .unwrap();
    assert_eq!(
        Decoder::new(0, 0, 1000)
            .decode(0, &big, &mut Vec::new())
            .unwrap_err()
            .code,
        H3_MESSAGE_ERROR
    );
    // Indexed references count too: a section referencing a big entry many times.
    let mut dec = Decoder::new(4096, 0, 3000);
    let mut ds = Vec::new();
    let mut es = Vec::new();
    EncoderInstruction::SetCapacity(4096).encode(&mut es, false);
    EncoderInstruction::InsertWithLiteralName {
        name: "x".into(),
        value: Bytes::from(vec![b'v'; 1000]),
    }
    .encode(&mut es, false);
    dec.on_encoder_stream(&es, &mut ds).unwrap();
    let mut block = Vec::new();
    write_section_prefix(&mut block, 1, 1, 4096 / 32);
    for _ in 0..3 {
        FieldLine::IndexedDynamic(0).encode(&mut block, false);
    }
    ds.clear();
    assert_eq!(
        dec.decode(0, &block, &mut ds).unwrap_err().code,
        H3_MESSAGE_ERROR
    );
    // The section was acknowledged, keeping the encoder's state in step.
    assert_eq!(ds, [0x80]);
}

#[test]
fn encoder_stream_errors() {
    // Capacity above our SETTINGS value.
    assert_eq!(
        encoder_stream_err(100, &hex("3f46")),
        QPACK_ENCODER_STREAM_ERROR
    ); // 101
    // Insert into a table of capacity 0 (never set).
    assert_eq!(
        encoder_stream_err(100, &hex("c0 01 61")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // Invalid static index 99 in Insert With Name Reference.
    assert_eq!(
        encoder_stream_err(100, &hex("3f45 ff24 0161")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // Dynamic name reference to an entry not inserted.
    assert_eq!(
        encoder_stream_err(100, &hex("3f45 80 0161")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // Duplicate of an entry not inserted.
    assert_eq!(
        encoder_stream_err(100, &hex("3f45 00")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // An entry larger than the capacity: 32 + 1 + 1 > 33.
    assert_eq!(
        encoder_stream_err(100, &hex("3f02 c0 0161")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // Invalid Huffman in a value.
    assert_eq!(
        encoder_stream_err(100, &hex("3f45 c0 8100")),
        QPACK_ENCODER_STREAM_ERROR
    );
    // A huge declared length: refused at once, nothing buffered.
    let mut dec = Decoder::new(4096, 0, u64::MAX);
    let mut data = hex("3fe11f 5f");
    data.extend([0x80, 0x80, 0x80, 0x80, 0x10]);
    assert_eq!(
        dec.on_encoder_stream(&data, &mut Vec::new())
            .unwrap_err()
            .code,
        QPACK_ENCODER_STREAM_ERROR
    );
    // Errors stick.
    assert_eq!(
        dec.on_encoder_stream(&[], &mut Vec::new())
            .unwrap_err()
            .code,
        QPACK_ENCODER_STREAM_ERROR
    );
    assert_eq!(
        dec.decode(0, &[0, 0], &mut Vec::new()).unwrap_err().code,
        QPACK_ENCODER_STREAM_ERROR
    );
    // Duplicate of an evicted entry: capacity 40 holds one 33-byte entry.
    let mut data = hex("3f09 4161 00 4162 00");
    assert!(
        Decoder::new(100, 0, 9)
            .on_encoder_stream(&data, &mut Vec::new())
            .is_ok()
    );
    data.extend(hex("01"));
    assert_eq!(encoder_stream_err(100, &data), QPACK_ENCODER_STREAM_ERROR);
}

#[test]
fn encoder_stream_buffering_is_bounded() {
    let mut dec = Decoder::new(4096, 0, u64::MAX);
    let mut ds = Vec::new();
    let mut data = Vec::new();
    EncoderInstruction::SetCapacity(4096).encode(&mut data, false);
    EncoderInstruction::InsertWithLiteralName {
        name: "x-big".into(),
        value: Bytes::from(vec![b'a'; 4000]),
    }
    .encode(&mut data, false);
    let mut max = 0;
    for b in &data {
        dec.on_encoder_stream(std::slice::from_ref(b), &mut ds)
            .unwrap();
        max = max.max(dec.buffered());
    }
    assert!(max < data.len(), "{max}");
    assert_eq!(dec.buffered(), 0);
    assert_eq!(dec.insert_count(), 1);
    // One byte too many for the table: refused as soon as the length is read.
    let mut dec = Decoder::new(4096, 0, u64::MAX);
    let mut data = Vec::new();
    EncoderInstruction::SetCapacity(4096).encode(&mut data, false);
    EncoderInstruction::InsertWithLiteralName {
        name: "".into(),
        value: Bytes::from(vec![b'a'; 4096 - 31]),
    }
    .encode(&mut data, false);
    let e = dec.on_encoder_stream(&data[..10], &mut ds).unwrap_err();
    assert_eq!(e.code, QPACK_ENCODER_STREAM_ERROR);
}

#[test]
fn decoder_stream_errors() {
    let setup = || {
        let mut enc = Encoder::new(4096, 10);
        let (mut block, mut es) = (Vec::new(), Vec::new());
        enc.encode(4, &[f("x-a", "b")], &mut block, &mut es)
            .unwrap();
        assert_eq!(enc.insert_count(), 1);
        enc
    };
    // Acknowledgment of a stream without unacknowledged sections.
    assert_eq!(
        setup().on_decoder_stream(&[0x88]).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    let mut enc = setup();
    enc.on_decoder_stream(&[0x84]).unwrap();
    assert_eq!(
        enc.on_decoder_stream(&[0x84]).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    // Insert Count Increment of zero, and beyond the inserts sent.
    assert_eq!(
        setup().on_decoder_stream(&[0x00]).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    assert_eq!(
        setup().on_decoder_stream(&[0x02]).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    let mut enc = setup();
    enc.on_decoder_stream(&[0x01]).unwrap();
    assert_eq!(
        enc.on_decoder_stream(&[0x01]).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    // An integer above 2^62.
    let mut data = vec![0xff];
    data.extend([0xff; 9]);
    data.push(1);
    assert_eq!(
        setup().on_decoder_stream(&data).unwrap_err().code,
        QPACK_DECODER_STREAM_ERROR
    );
    // Stream Cancellation of an unknown stream is fine; instructions may arrive split.
    let mut enc = setup();
    enc.on_decoder_stream(&[0x7f]).unwrap();
    enc.on_decoder_stream(&[0x80]).unwrap();
    enc.on_decoder_stream(&[0x01, 0x44]).unwrap();
    assert_eq!(enc.unacknowledged_sections(), 0);
    // Errors stick, and the encoder refuses to go on.
    let mut enc = setup();
    assert!(enc.on_decoder_stream(&[0x00]).is_err());
    assert!(
        enc.encode(8, &[], &mut Vec::new(), &mut Vec::new())
            .is_err()
    );
}

// ---------------------------------------------------------------------------------------------
// Random input.

#[test]
fn random_input_never_panics() {
    let allowed = [
        QPACK_DECOMPRESSION_FAILED,
        QPACK_ENCODER_STREAM_ERROR,
        H3_MESSAGE_ERROR,
    ];
    let mut rng = StdRng::seed_from_u64(3);
    // Valid material to mutate.
    let mut valid_es = Vec::new();
    let mut valid_blocks = Vec::new();
    {
        let mut enc = Encoder::new(4096, 100);
        for (i, s) in corpus::page_load_requests().iter().take(10).enumerate() {
            let mut block = Vec::new();
            enc.encode(i as u64 * 4, s, &mut block, &mut valid_es)
                .unwrap();
            valid_blocks.push(block);
        }
    }
    for case in 0..4000 {
        let capacity = [0, 64, 220, 4096][case % 4];
        let mut dec = Decoder::new(capacity, rng.random_range(0..4), rng.random_range(0..5000));
        let mut ds = Vec::new();
        for step in 0..rng.random_range(1..12) {
            let mutate = |rng: &mut StdRng, v: &[u8]| {
                let mut v = v.to_vec();
                for _ in 0..rng.random_range(0..4) {
                    if !v.is_empty() {
                        let i = rng.random_range(0..v.len());
                        v[i] ^= 1 << rng.random_range(0..8);
                    }
                }
                if rng.random_bool(0.2) && !v.is_empty() {
                    v.truncate(rng.random_range(0..v.len()));
                }
                v
            };
            let data: Vec<u8> = match rng.random_range(0..3) {
                0 => (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
                1 if case % 2 == 0 => mutate(&mut rng, &valid_es),
                _ => mutate(&mut rng, &valid_blocks[step % valid_blocks.len()]),
            };
            let result = if rng.random_bool(0.5) {
                dec.on_encoder_stream(&data, &mut ds).map(|_| ())
            } else {
                dec.decode(rng.random_range(0..8) * 4, &data, &mut ds)
                    .map(|_| ())
            };
            if let Err(e) = result {
                assert!(allowed.contains(&e.code), "{e}");
            }
            if rng.random_bool(0.1) {
                dec.cancel_stream(rng.random_range(0..8) * 4, &mut ds);
            }
            let _ = dec.unblocked();
        }
    }
    // The encoder's decoder stream parser.
    for _ in 0..2000 {
        let mut enc = Encoder::new(4096, 3);
        let (mut block, mut es) = (Vec::new(), Vec::new());
        for (i, s) in corpus::page_load_requests().iter().take(4).enumerate() {
            enc.encode(i as u64 * 4, s, &mut block, &mut es).unwrap();
        }
        let data: Vec<u8> = (0..rng.random_range(0..16))
            .map(|_| rng.random::<u8>() & 0xcf)
            .collect();
        if let Err(e) = enc.on_decoder_stream(&data) {
            assert_eq!(e.code, QPACK_DECODER_STREAM_ERROR);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Compression ratios (quoted in the module docs).

/// Encodes the sections on one connection direction, the decoder acknowledging each section
/// as it decodes it.
fn measure(sections: &[Section], capacity: u64, blocked: u64) -> EncoderStats {
    let mut enc = Encoder::new(capacity, blocked);
    let mut dec = Decoder::new(capacity, blocked, u64::MAX);
    for (i, s) in sections.iter().enumerate() {
        let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        enc.encode(i as u64 * 4, s, &mut block, &mut es).unwrap();
        dec.on_encoder_stream(&es, &mut ds).unwrap();
        assert_eq!(
            &fields(dec.decode(i as u64 * 4, &block, &mut ds).unwrap()),
            s
        );
        enc.on_decoder_stream(&ds).unwrap();
    }
    enc.stats()
}

#[test]
fn compression_ratio() {
    let requests = corpus::page_load_requests();
    let responses = corpus::page_load_responses();
    let raw = |s: &[Section]| {
        s.iter()
            .flatten()
            .map(|(n, v)| n.len() + v.len())
            .sum::<usize>()
    };
    println!(
        "corpus: {} requests, {} raw octets; {} responses, {} raw octets",
        requests.len(),
        raw(&requests),
        responses.len(),
        raw(&responses)
    );
    println!("| table capacity / blocked streams | requests | responses |");
    println!("|---|---|---|");
    let mut results = Vec::new();
    for (capacity, blocked) in [(0, 0), (256, 100), (4096, 0), (4096, 100), (16384, 100)] {
        let rq = measure(&requests, capacity, blocked);
        let rs = measure(&responses, capacity, blocked);
        let cell = |s: &EncoderStats| {
            format!(
                "{:.1}% ({} + {} octets)",
                100.0 * s.ratio(),
                s.block_bytes,
                s.encoder_stream_bytes
            )
        };
        println!("| {capacity} / {blocked} | {} | {} |", cell(&rq), cell(&rs));
        println!("    requests:  {rq:?}\n    responses: {rs:?}");
        results.push((capacity, rq.ratio(), rs.ratio()));
    }
    // Static table and Huffman alone save something; the dynamic table much more.
    let (_, rq0, rs0) = results[0];
    assert!(rq0 < 0.8 && rs0 < 0.8, "{results:?}");
    for &(capacity, rq, rs) in &results[1..] {
        assert!(rq < rq0 && rs < rs0, "{results:?}");
        if capacity >= 4096 {
            assert!(rq < rq0 / 5.0, "{results:?}");
        }
    }
}

/// RFC 9204 §7.4: the encoder keeps every section that references the dynamic table until
/// the decoder acknowledges it. A decoder that acknowledges inserts (Insert Count Increment)
/// but never a section would make that list grow with every response; past
/// `MAX_UNACKNOWLEDGED_SECTIONS` the encoder uses the static table and literals only, and
/// goes back to the dynamic table once acknowledgments come.
#[test]
fn unacknowledged_sections_are_bounded() {
    use kuai_h3::qpack::MAX_UNACKNOWLEDGED_SECTIONS;
    let mut enc = Encoder::new(4096, 0);
    let fields = [f("server", "kuai"), f("x-custom", "a value that repeats")];
    let (mut block, mut es) = (Vec::new(), Vec::new());
    enc.encode(0, &fields, &mut block, &mut es).unwrap();
    // The decoder received the inserts: an Insert Count Increment, never a Section Ack.
    let inserts = enc.insert_count();
    assert!(inserts > 0);
    let mut ici = Vec::new();
    DecoderInstruction::InsertCountIncrement(inserts).encode(&mut ici);
    enc.on_decoder_stream(&ici).unwrap();
    for n in 1..5000u64 {
        block.clear();
        es.clear();
        enc.encode(4 * n, &fields, &mut block, &mut es).unwrap();
    }
    assert!(
        enc.unacknowledged_sections() <= MAX_UNACKNOWLEDGED_SECTIONS,
        "{} sections held",
        enc.unacknowledged_sections()
    );
    // The last section is self-contained: Required Insert Count 0.
    assert_eq!(block[0], 0, "no dynamic reference past the cap");
    // Acknowledging the oldest section (stream 4's: stream 0's referenced nothing, its
    // inserts were not acknowledged yet) makes room again.
    let mut ack = Vec::new();
    DecoderInstruction::SectionAck(4).encode(&mut ack);
    enc.on_decoder_stream(&ack).unwrap();
    block.clear();
    es.clear();
    enc.encode(4 * 5000, &fields, &mut block, &mut es).unwrap();
    assert_ne!(block[0], 0, "dynamic references again");
}

/// An encoder using less of the table than the decoder allows (a gateway capping what it
/// keeps per connection) encodes the Required Insert Count modulo the decoder's MaxEntries
/// (RFC 9204 §4.5.1.1), not one of its own: past twice its own, the decoder would read
/// another count and fail.
#[test]
fn a_capped_encoder_counts_inserts_by_the_decoders_max_entries() {
    let mut enc = Encoder::new(65536, 0).limit_capacity(4096);
    assert_eq!(enc.table_capacity(), 4096);
    let mut dec = Decoder::new(65536, 0, u64::MAX);
    // Each value three times, so that the encoder keeps inserting (a hit per insert).
    for i in 0..1200u64 {
        let section = vec![f("x-session", &format!("s-{:06}", i / 3))];
        let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        enc.encode(i * 4, &section, &mut block, &mut es).unwrap();
        dec.on_encoder_stream(&es, &mut ds).unwrap();
        enc.on_decoder_stream(&ds).unwrap();
        ds.clear();
        let got = dec.decode(i * 4, &block, &mut ds);
        assert_eq!(
            fields(got.unwrap_or_else(|e| panic!("section {i}: {e:?}"))),
            section,
            "section {i}"
        );
        enc.on_decoder_stream(&ds).unwrap();
    }
    assert!(enc.stats().inserts > 300, "{:?}", enc.stats());
}

/// The peer's decoder stream can bring part of an instruction before its SETTINGS are read
/// (the two come on different streams): taking the SETTINGS keeps that part, so the rest
/// completes it. Here a Stream Cancellation for stream 100 (0x7f, then 100 − 63) is cut
/// after its first byte; read alone, the second byte would be an Insert Count Increment of
/// 37 and fail the connection.
#[test]
fn a_decoder_instruction_cut_around_settings_is_read_whole() {
    let mut enc = Encoder::new(0, 0);
    enc.on_decoder_stream(&[0x7f]).unwrap();
    enc.set_peer_settings(4096, 16, 4096);
    enc.on_decoder_stream(&[37]).unwrap();
    // The dynamic table is in use after the SETTINGS.
    let mut dec = Decoder::new(4096, 16, 1 << 16);
    let (mut block, mut enc_stream, mut dec_stream) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2 {
        block.clear();
        let fields = [(
            Bytes::from_static(b"x-name"),
            Bytes::from_static(b"a value"),
        )];
        enc.encode(0, &fields, &mut block, &mut enc_stream).unwrap();
    }
    assert!(enc.insert_count() > 0, "the table was used");
    dec.on_encoder_stream(&enc_stream, &mut dec_stream).unwrap();
    assert!(matches!(
        dec.decode(0, &block, &mut dec_stream).unwrap(),
        Decoded::Fields(_)
    ));
}
