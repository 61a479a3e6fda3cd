//! QPACK benchmarks: the fast Huffman decoder against the bit-by-bit reference decoder, the
//! Huffman encoder, and encoding / decoding the page-load corpus.
//!
//!     cargo bench -p kuai-h3 --bench qpack

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kuai_h3::qpack::{Decoded, Decoder, Encoder, corpus, huffman};

/// Every distinct name and value of the corpus (header text as it appears on the wire).
fn strings() -> Vec<Bytes> {
    let mut all: Vec<Bytes> = corpus::page_load_requests()
        .into_iter()
        .chain(corpus::page_load_responses())
        .flatten()
        .flat_map(|(n, v)| [n, v])
        .filter(|s| s.len() > 1)
        .collect();
    all.sort();
    all.dedup();
    all
}

fn huffman_benches(c: &mut Criterion) {
    let strings = strings();
    let encoded: Vec<Vec<u8>> = strings
        .iter()
        .map(|s| {
            let mut out = Vec::new();
            huffman::encode(s, &mut out);
            out
        })
        .collect();
    let decoded_len: usize = strings.iter().map(|s| s.len()).sum();

    // The corpus strings one by one (header-sized: 20 octets on average), and all of them
    // concatenated into one long string (per-call costs out of the picture).
    let long: Vec<u8> = strings.concat();
    let mut long_encoded = Vec::new();
    huffman::encode(&long, &mut long_encoded);
    type Decode = fn(&[u8], &mut Vec<u8>) -> Result<(), huffman::HuffmanError>;
    let decoders = [
        ("fast", huffman::decode as Decode),
        ("reference", huffman::decode_reference),
    ];
    let mut group = c.benchmark_group("huffman_decode");
    group.throughput(Throughput::Bytes(decoded_len as u64));
    for (name, decode) in decoders {
        group.bench_function(format!("{name}/headers"), |b| {
            let mut out = Vec::with_capacity(4096);
            b.iter(|| {
                for e in &encoded {
                    out.clear();
                    decode(black_box(e), &mut out).unwrap();
                }
                black_box(out.len())
            })
        });
        group.bench_function(format!("{name}/long"), |b| {
            let mut out = Vec::with_capacity(long.len() * 2);
            b.iter(|| {
                out.clear();
                decode(black_box(&long_encoded), &mut out).unwrap();
                black_box(out.len())
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("huffman_encode");
    group.throughput(Throughput::Bytes(decoded_len as u64));
    group.bench_function("encode", |b| {
        let mut out = Vec::with_capacity(4096);
        b.iter(|| {
            for s in &strings {
                out.clear();
                huffman::encode(black_box(s), &mut out);
            }
            black_box(out.len())
        })
    });
    group.finish();
}

fn qpack_benches(c: &mut Criterion) {
    let requests = corpus::page_load_requests();
    let raw: usize = requests
        .iter()
        .flatten()
        .map(|(n, v)| n.len() + v.len())
        .sum();

    // Encoded once, to time the decoder alone.
    let mut enc = Encoder::new(4096, 100);
    let mut encoded = Vec::new();
    let mut acks = Vec::new();
    {
        let mut dec = Decoder::new(4096, 100, u64::MAX);
        for (i, s) in requests.iter().enumerate() {
            let (mut block, mut es, mut ds) = (Vec::new(), Vec::new(), Vec::new());
            enc.encode(i as u64 * 4, s, &mut block, &mut es).unwrap();
            dec.on_encoder_stream(&es, &mut ds).unwrap();
            dec.decode(i as u64 * 4, &block, &mut ds).unwrap();
            enc.on_decoder_stream(&ds).unwrap();
            acks.push(ds);
            encoded.push((es, block));
        }
    }

    let mut group = c.benchmark_group("qpack_100_requests");
    group.throughput(Throughput::Bytes(raw as u64));
    group.bench_function("encode", |b| {
        b.iter(|| {
            let mut enc = Encoder::new(4096, 100);
            let (mut block, mut es) = (Vec::new(), Vec::new());
            for (i, s) in requests.iter().enumerate() {
                block.clear();
                es.clear();
                enc.encode(i as u64 * 4, s, &mut block, &mut es).unwrap();
                enc.on_decoder_stream(&acks[i]).unwrap();
            }
            black_box(block.len())
        })
    });
    group.bench_function("decode", |b| {
        b.iter(|| {
            let mut dec = Decoder::new(4096, 100, u64::MAX);
            let mut ds = Vec::new();
            let mut n = 0;
            for (i, (es, block)) in encoded.iter().enumerate() {
                ds.clear();
                dec.on_encoder_stream(es, &mut ds).unwrap();
                if let Decoded::Fields(f) = dec.decode(i as u64 * 4, block, &mut ds).unwrap() {
                    n += f.len();
                }
            }
            black_box(n)
        })
    });
    group.finish();
}

fn config() -> Criterion {
    // Short runs: the numbers are stable enough, and the machine is shared.
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! { name = benches; config = config(); targets = huffman_benches, qpack_benches }
criterion_main!(benches);
