//! Micro-benchmarks of the per-packet work: sealing and opening packets for each cipher suite,
//! frame decoding, ACK encoding and processing, and a whole connection moving data through the
//! sans-IO core (no sockets), which measures protocol processing per byte.
//!
//!     cargo bench -p kuai-proto --bench packets

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kuai_proto::cid::ConnectionId;
use kuai_proto::config::{ClientConfig, EndpointConfig, ServerConfig, TransportConfig};
use kuai_proto::crypto::{CapturedSecrets, OneRttKeys, SuiteAlgs};
use kuai_proto::frame::{Ack, Frame, FrameIter, StreamFrame};
use kuai_proto::packet::{self, PartialDecode};
use kuai_proto::range_set::RangeSet;
use kuai_proto::{Dir, Endpoint, Event, StreamEvent, StreamId, Version};

fn one_rtt_keys(suite: rustls::CipherSuite) -> (Box<OneRttKeys>, Box<OneRttKeys>) {
    let algs = SuiteAlgs::of(suite).unwrap();
    let len = if suite == rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 {
        48
    } else {
        32
    };
    let s = CapturedSecrets {
        client_handshake: vec![1; len],
        server_handshake: vec![2; len],
        client_traffic: vec![3; len],
        server_traffic: vec![4; len],
    };
    // The same secrets seen from the other side: swap the directions.
    let peer = CapturedSecrets {
        client_traffic: s.server_traffic.clone(),
        server_traffic: s.client_traffic.clone(),
        ..s.clone()
    };
    (
        Box::new(OneRttKeys::derived(algs, Version::V1, &s).unwrap()),
        Box::new(OneRttKeys::derived(algs, Version::V1, &peer).unwrap()),
    )
}

fn seal(keys: &OneRttKeys, dcid: &ConnectionId, pn: u64, payload: &[u8], buf: &mut Vec<u8>) {
    buf.clear();
    let pos = packet::write_short_header(buf, dcid, false, false, pn, 2);
    buf.extend_from_slice(payload);
    packet::seal_packet(
        buf,
        &pos,
        pn,
        keys.header.local.as_ref(),
        keys.current.local.as_ref(),
    )
    .unwrap();
}

fn bench_aead(c: &mut Criterion) {
    let mut g = c.benchmark_group("packet_1200");
    g.throughput(Throughput::Bytes(1200));
    let dcid = ConnectionId::new(&[7; 8]);
    let payload = vec![0x42u8; 1200 - 1 - 8 - 2 - 16];
    for (name, suite) in [
        ("aes128gcm", rustls::CipherSuite::TLS13_AES_128_GCM_SHA256),
        ("aes256gcm", rustls::CipherSuite::TLS13_AES_256_GCM_SHA384),
        (
            "chacha20",
            rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
        ),
    ] {
        let (ours, theirs) = one_rtt_keys(suite);
        let mut buf = Vec::with_capacity(1500);
        let mut pn = 0u64;
        g.bench_function(BenchmarkId::new("seal", name), |b| {
            b.iter(|| {
                pn += 1;
                seal(&ours, &dcid, pn, &payload, &mut buf);
            })
        });
        seal(&ours, &dcid, 1000, &payload, &mut buf);
        let sealed = buf.clone();
        g.bench_function(BenchmarkId::new("open", name), |b| {
            b.iter(|| {
                let (pd, _) = PartialDecode::new(BytesMut::from(&sealed[..]), 8).unwrap();
                let up = pd
                    .unprotect(theirs.header.remote.as_ref(), Some(999))
                    .unwrap();
                up.decrypt(theirs.current.remote.as_ref()).unwrap()
            })
        });
    }
    g.finish();
}

fn bench_frames(c: &mut Criterion) {
    let mut payload = Vec::new();
    for i in 0..10u64 {
        Frame::Stream(StreamFrame {
            id: StreamId(4 * i),
            offset: 1 << 20,
            fin: false,
            data: Bytes::from(vec![0u8; 100]),
        })
        .encode(&mut payload);
    }
    let payload = Bytes::from(payload);
    let mut g = c.benchmark_group("frames");
    g.throughput(Throughput::Elements(10));
    g.bench_function("decode_10_stream_frames", |b| {
        b.iter(|| {
            FrameIter::new(payload.clone())
                .filter(|f| f.is_ok())
                .count()
        })
    });
    let mut ranges = RangeSet::new();
    for i in 0..32u64 {
        ranges.insert(i * 10..i * 10 + 7);
    }
    let mut buf = Vec::with_capacity(512);
    g.bench_function("ack_encode_32_ranges", |b| {
        b.iter(|| {
            buf.clear();
            Ack::encode(100, &ranges, None, 64, &mut buf);
        })
    });
    Ack::encode(100, &ranges, None, 64, &mut buf);
    let ack = Bytes::from(buf.clone());
    g.bench_function("ack_decode_iterate_32_ranges", |b| {
        b.iter(|| match FrameIter::new(ack.clone()).next() {
            Some(Ok(Frame::Ack(a))) => a.iter().count(),
            _ => 0,
        })
    });
    g.finish();
}

fn tls_pair() -> (ServerConfig, ClientConfig) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut s = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    s.alpn_protocols = vec![b"bench".to_vec()];
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"bench".to_vec()];
    let t = Arc::new(TransportConfig {
        ecn: false,
        ..TransportConfig::default()
    });
    let mut sc = ServerConfig::new(Arc::new(s));
    sc.transport = t.clone();
    let mut cc = ClientConfig::new(Arc::new(c));
    cc.transport = t;
    (sc, cc)
}

/// Moves `bytes` from server to client through both sans-IO endpoints, delivering every
/// datagram at once (no loss, no delay): the CPU cost of the protocol itself.
fn transfer(bytes: u64, sc: &ServerConfig, cc: &ClientConfig) {
    let base = Instant::now();
    let saddr: SocketAddr = "10.0.0.1:443".parse().unwrap();
    let caddr: SocketAddr = "10.0.0.2:5000".parse().unwrap();
    let mut server = Endpoint::new(
        Arc::new(EndpointConfig::default()),
        Some(Arc::new(sc.clone())),
        base,
        0,
        Some(1),
    );
    let mut client = Endpoint::new(Arc::new(EndpointConfig::default()), None, base, 0, Some(2));
    let ch = client.connect(base, cc, saddr, "localhost").unwrap();
    let mut now = base;
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut received = 0u64;
    let mut sh = None;
    let mut sid = None;
    let mut left = bytes;
    let chunk = Bytes::from(vec![0x5a; 256 * 1024]);
    for _ in 0..10_000_000 {
        let mut moved = false;
        while let Some(t) = client.poll_transmit(now, 10, &mut buf) {
            for d in buf[..t.size].chunks(t.segment_size.unwrap_or(t.size)) {
                server.handle_datagram(now, caddr, None, None, BytesMut::from(d));
            }
            moved = true;
        }
        while let Some(h) = server.accept() {
            sh = Some(h);
        }
        if let Some(h) = sh {
            let c = server.connection_mut(h).unwrap();
            if sid.is_none() && c.is_established() {
                sid = c.open_stream(Dir::Uni).ok();
            }
            if let Some(id) = sid {
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    match c.write(id, chunk.slice(..n)) {
                        Ok(0) | Err(_) => break,
                        Ok(w) => left -= w as u64,
                    }
                }
                if left == 0 {
                    let _ = c.finish(id);
                }
            }
        }
        while let Some(t) = server.poll_transmit(now, 10, &mut buf) {
            for d in buf[..t.size].chunks(t.segment_size.unwrap_or(t.size)) {
                client.handle_datagram(now, saddr, None, None, BytesMut::from(d));
            }
            moved = true;
        }
        while let Some((_, ev)) = client.poll_event() {
            if let Event::Stream(StreamEvent::Readable(id)) = ev {
                let c = client.connection_mut(ch).unwrap();
                while let Ok(Some(d)) = c.read(id, usize::MAX) {
                    received += d.len() as u64;
                }
            }
        }
        while server.poll_event().is_some() {}
        if received >= bytes {
            return;
        }
        if !moved {
            now = client
                .poll_timeout()
                .into_iter()
                .chain(server.poll_timeout())
                .min()
                .unwrap_or(now + Duration::from_millis(1))
                .max(now + Duration::from_micros(10));
            client.handle_timeout(now);
            server.handle_timeout(now);
        } else {
            now += Duration::from_micros(5);
        }
    }
    panic!("transfer stalled at {received} of {bytes}");
}

fn bench_connection(c: &mut Criterion) {
    let (sc, cc) = tls_pair();
    let mut g = c.benchmark_group("connection");
    g.sample_size(10);
    let bytes = 64 << 20;
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("transfer_64MiB_sans_io", |b| {
        b.iter(|| transfer(bytes, &sc, &cc))
    });
    g.finish();
}

criterion_group!(benches, bench_aead, bench_frames, bench_connection);
criterion_main!(benches);
