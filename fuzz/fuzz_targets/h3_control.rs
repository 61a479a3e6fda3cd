//! HTTP/3 control stream and unidirectional stream dispatch (`kuai-h3`'s `conn.rs`), driven
//! the way a peer's bytes reach them: a real `kuai_h3` server or client on one end of a kuai
//! QUIC connection over loopback, and on the other end a raw kuai connection whose
//! unidirectional streams the fuzzer opens and writes: stream types (control, push, QPACK
//! encoder and decoder, reserved, unknown, non-minimal encodings), frames (SETTINGS, GOAWAY,
//! MAX_PUSH_ID, CANCEL_PUSH, DATA, HEADERS, PUSH_PROMISE, the HTTP/2-only types, reserved and
//! unknown ones) in any order, raw bytes, FIN and resets.
//!
//! The endpoints (one client, two servers: one serving HTTP/3 with `kuai_h3::serve`, one
//! handing its connections to the fuzzer) live for the whole process on a current-thread tokio
//! runtime; every input gets a new connection, closed at its end.
//!
//! # Input
//!
//! Byte 0: bit 0 picks the target: 0 the HTTP/3 server (the fuzzer is the client), 1 the
//! HTTP/3 client (the fuzzer is the server). Then up to 64 chunks `[op][len][body]`; `op & 7`
//! is the operation, `op >> 3` picks one of the streams opened so far (modulo their number):
//!
//! | op | operation |
//! |---|---|
//! | 0 | open a unidirectional stream and write the body as its first bytes (the stream type; empty: a control stream); at most 8 |
//! | 1 | write the body on a stream |
//! | 2 | write a frame: type `FRAME_TYPES[body[0] % 16]`, payload `body[1..]`, with the right length |
//! | 3 | write a SETTINGS frame: `body` as `(id selector, value)` pairs, the id from `SETTING_IDS[selector % 12]` |
//! | 4 | write a GOAWAY, MAX_PUSH_ID or CANCEL_PUSH frame (`body[0] % 3`) for the ID `body[1..9]` (little-endian, 62 bits) |
//! | 5 | finish a stream (FIN) |
//! | 6 | reset a stream |
//! | 7 | a request and its response, both ways through the target (synchronises; 4 per input at most) |
//!
//! # Checks
//!
//! A model of RFC 9114 §6.2 and §7 (and RFC 9204 §4.2, RFC 9297 §2.1.1, RFC 8441 §3) says,
//! from the bytes written, which connection errors the target must raise and which it may;
//! after a final request round trip:
//!
//! - if one is required, the target must close the connection (within 5 s) with an
//!   application error code among those allowed;
//! - if none is required, the connection is either open or closed with an allowed code;
//! - nothing panics, and each input finishes within 20 s.
//!
//! Allowed but not required: errors of streams the fuzzer reset (the reset may overtake the
//! stream type), QPACK stream errors for bytes written on QPACK streams (the `qpack_decode`
//! target checks those), `H3_SETTINGS_ERROR` for the reserved setting 0x00, and the ambiguities
//! the RFC leaves (a first frame that is also forbidden may give `H3_MISSING_SETTINGS` or its
//! own error).

#![no_main]

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use kuai::{ClientConfig, Connection, ConnectionError, Endpoint, SendStream, ServerConfig};
use kuai_h3::{Body, Code, Config, RecvHalf};
use libfuzzer_sys::fuzz_target;
use tokio::sync::{Mutex, mpsc};
use tokio::time::timeout;

const MAX_OPS: usize = 64;
/// Round trips an input may ask for (op 7), besides the last one; each may wait 2 s.
const MAX_ROUND_TRIPS: usize = 4;
const MAX_STREAMS: usize = 8;

/// Frame types op 2 writes.
const FRAME_TYPES: [u64; 16] = [
    0x00,   // DATA
    0x01,   // HEADERS
    0x03,   // CANCEL_PUSH
    0x04,   // SETTINGS
    0x05,   // PUSH_PROMISE
    0x07,   // GOAWAY
    0x0d,   // MAX_PUSH_ID
    0x02,   // HTTP/2 PRIORITY
    0x06,   // HTTP/2 PING
    0x08,   // HTTP/2 WINDOW_UPDATE
    0x09,   // HTTP/2 CONTINUATION
    0x21,   // reserved (grease)
    0x40,   // reserved (grease: 0x1f + 0x21)
    0x0f,   // unknown
    0x1234, // unknown
    0x3fff_ffff,
];

/// Setting identifiers op 3 writes.
const SETTING_IDS: [u64; 12] = [
    0x01, // QPACK_MAX_TABLE_CAPACITY
    0x06, // MAX_FIELD_SECTION_SIZE
    0x07, // QPACK_BLOCKED_STREAMS
    0x08, // ENABLE_CONNECT_PROTOCOL
    0x33, // H3_DATAGRAM
    0x00, // reserved
    0x02, // HTTP/2 ENABLE_PUSH
    0x03, // HTTP/2 MAX_CONCURRENT_STREAMS
    0x04, // HTTP/2 INITIAL_WINDOW_SIZE
    0x05, // HTTP/2 MAX_FRAME_SIZE
    0x21, // reserved (grease)
    0x4242,
];

const CONTROL: u64 = 0x00;
const PUSH: u64 = 0x01;
const QPACK_ENCODER: u64 = 0x02;
const QPACK_DECODER: u64 = 0x03;

// ---------------------------------------------------------------------------------------------
// The model

fn put_var(out: &mut Vec<u8>, v: u64) {
    if v < 1 << 6 {
        out.push(v as u8);
    } else if v < 1 << 14 {
        out.extend_from_slice(&(0x4000 | v as u16).to_be_bytes());
    } else if v < 1 << 30 {
        out.extend_from_slice(&(0x8000_0000 | v as u32).to_be_bytes());
    } else {
        out.extend_from_slice(&(0xc000_0000_0000_0000 | v).to_be_bytes());
    }
}

/// A QUIC variable-length integer at the start of `b`, and its length.
fn get_var(b: &[u8]) -> Option<(u64, usize)> {
    let first = *b.first()?;
    let len = 1usize << (first >> 6);
    let bytes = b.get(..len)?;
    let v = bytes[1..]
        .iter()
        .fold(u64::from(first & 0x3f), |v, &x| (v << 8) | u64::from(x));
    Some((v, len))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    Fin,
    Reset,
}

#[derive(Debug)]
struct ModelStream {
    data: Vec<u8>,
    end: End,
}

/// What the target must and may do: `must` non-empty means it has to close the connection
/// with one of `must` or `may`.
#[derive(Debug, Default)]
struct Verdict {
    must: Vec<u64>,
    may: Vec<u64>,
}

impl Verdict {
    fn must(&mut self, c: Code) {
        self.must.push(c.0);
    }
    fn may(&mut self, c: Code) {
        self.may.push(c.0);
    }
    fn allows(&self, code: u64) -> bool {
        self.must.contains(&code) || self.may.contains(&code)
    }
}

/// The errors the frames of a control stream call for (RFC 9114 §6.2.1, §7).
fn control_stream(target_is_client: bool, frames: &[u8], end: End, v: &mut Verdict) {
    if end == End::Reset {
        // The reset may reach the target before any frame (it discards what it overtakes).
        v.may(Code::CLOSED_CRITICAL_STREAM);
    }
    let mut b = frames;
    let mut first = true;
    let mut goaway: Option<u64> = None;
    let mut max_push: Option<u64> = None;
    while let Some((ty, n)) = get_var(b) {
        let Some((len, m)) = get_var(&b[n..]) else {
            break;
        };
        let payload_at = n + m;
        let avail = &b[payload_at..];
        if matches!(ty, 0x02 | 0x06 | 0x08 | 0x09) {
            // RFC 9114 §7.2.8 and §6.2.1 both apply to a first frame.
            v.must(Code::FRAME_UNEXPECTED);
            if first {
                v.may(Code::MISSING_SETTINGS);
            }
            return;
        }
        let known = matches!(ty, 0x00 | 0x01 | 0x03 | 0x04 | 0x05 | 0x07 | 0x0d);
        if !known {
            // Unknown and reserved frames are skipped (§9), but cannot come first (§6.2.1).
            if first {
                v.must(Code::MISSING_SETTINGS);
                return;
            }
            if (avail.len() as u64) < len {
                break;
            }
            b = &avail[len as usize..];
            continue;
        }
        if ty == 0x00 {
            // DATA: the reader may wait for a payload byte before reporting it.
            let c = if first {
                Code::MISSING_SETTINGS
            } else {
                Code::FRAME_UNEXPECTED
            };
            if len == 0 || !avail.is_empty() {
                v.must(c);
            } else {
                v.may(c);
                if end == End::Fin {
                    // A reader still waiting for the payload sees the stream end first.
                    v.must(Code::CLOSED_CRITICAL_STREAM);
                }
            }
            return;
        }
        if matches!(ty, 0x03 | 0x07 | 0x0d) && len > 8 {
            // Longer than any varint: malformed from the header on (§7.1), whatever follows.
            v.must(Code::FRAME_ERROR);
            if first {
                v.may(Code::MISSING_SETTINGS);
            }
            return;
        }
        if len > 64 * 1024 {
            // Larger than the reader accepts (kuai-h3's limit for non-DATA frames).
            v.must(Code::EXCESSIVE_LOAD);
            if first && ty != 0x04 {
                v.may(Code::MISSING_SETTINGS);
            }
            return;
        }
        if (avail.len() as u64) < len {
            break;
        }
        let payload = &avail[..len as usize];
        b = &avail[len as usize..];
        // A frame whose payload must be exactly one varint (§7.2.3, §7.2.6, §7.2.7).
        let one_var = |v: &mut Verdict| -> Option<u64> {
            match get_var(payload) {
                Some((x, n)) if n == payload.len() => Some(x),
                _ => {
                    v.must(Code::FRAME_ERROR);
                    None
                }
            }
        };
        if first && ty != 0x04 {
            v.must(Code::MISSING_SETTINGS);
            if matches!(ty, 0x03 | 0x07 | 0x0d)
                && get_var(payload).map(|x| x.1) != Some(payload.len())
            {
                v.may(Code::FRAME_ERROR);
            }
            return;
        }
        match ty {
            0x04 if first => {
                first = false;
                if settings(payload, v) {
                    return;
                }
            }
            0x04 | 0x01 | 0x05 => {
                v.must(Code::FRAME_UNEXPECTED);
                return;
            }
            0x07 => {
                let Some(id) = one_var(v) else { return };
                // §5.2: a server's GOAWAY names a client-initiated bidirectional stream, and
                // no GOAWAY may name a larger ID than the one before it.
                if (target_is_client && id % 4 != 0) || goaway.is_some_and(|g| id > g) {
                    v.must(Code::ID_ERROR);
                    return;
                }
                goaway = Some(id);
            }
            0x0d => {
                let Some(id) = one_var(v) else { return };
                if target_is_client {
                    // §7.2.7: only clients send MAX_PUSH_ID.
                    v.must(Code::FRAME_UNEXPECTED);
                    return;
                }
                if max_push.is_some_and(|m| id < m) {
                    // §7.2.7: MAX_PUSH_ID cannot go down.
                    v.must(Code::ID_ERROR);
                    return;
                }
                max_push = Some(id);
            }
            0x03 => {
                if one_var(v).is_none() {
                    return;
                }
                // §7.2.3: the target never promised a push (server) nor allowed one (client:
                // it sends no MAX_PUSH_ID), so every push ID is one it cannot accept.
                v.must(Code::ID_ERROR);
                return;
            }
            _ => unreachable!(),
        }
    }
    if end == End::Fin {
        v.must(Code::CLOSED_CRITICAL_STREAM);
    }
}

/// The errors a SETTINGS payload calls for (§7.2.4, §7.2.4.1); true if there is one.
fn settings(mut p: &[u8], v: &mut Verdict) -> bool {
    let mut seen = Vec::new();
    while !p.is_empty() {
        let Some((id, n)) = get_var(p) else {
            v.must(Code::FRAME_ERROR);
            return true;
        };
        let Some((value, m)) = get_var(&p[n..]) else {
            v.must(Code::FRAME_ERROR);
            return true;
        };
        p = &p[n + m..];
        if seen.contains(&id) {
            v.must(Code::SETTINGS_ERROR);
            return true;
        }
        seen.push(id);
        match id {
            0x02..=0x05 => {
                v.must(Code::SETTINGS_ERROR);
                return true;
            }
            0x00 => v.may(Code::SETTINGS_ERROR),
            0x08 | 0x33 if value > 1 => {
                v.must(Code::SETTINGS_ERROR);
                return true;
            }
            _ => {}
        }
    }
    false
}

fn verdict(target_is_client: bool, streams: &[ModelStream]) -> Verdict {
    let mut v = Verdict::default();
    // Critical streams of each type so far: all of them, and those not reset (whose type the
    // target surely reads).
    let mut critical = [0usize; 4];
    let mut critical_sure = [0usize; 4];
    for s in streams {
        let Some((ty, n)) = get_var(&s.data) else {
            continue;
        };
        let rest = &s.data[n..];
        let mut sv = Verdict::default();
        match ty {
            CONTROL | QPACK_ENCODER | QPACK_DECODER => {
                // §6.2.1, RFC 9204 §4.2: one stream of each type. Which one the target sees
                // second depends on timing; one before that was reset may never be seen.
                let t = ty as usize;
                if critical_sure[t] >= 1 {
                    sv.must(Code::STREAM_CREATION_ERROR);
                } else if critical[t] >= 1 {
                    sv.may(Code::STREAM_CREATION_ERROR);
                }
                critical[t] += 1;
                if s.end != End::Reset {
                    critical_sure[t] += 1;
                }
                if ty == CONTROL {
                    control_stream(target_is_client, rest, s.end, &mut sv);
                } else {
                    if !rest.is_empty() {
                        sv.may(Code::QPACK_DECOMPRESSION_FAILED);
                        sv.may(Code::QPACK_ENCODER_STREAM_ERROR);
                        sv.may(Code::QPACK_DECODER_STREAM_ERROR);
                        sv.may(Code::EXCESSIVE_LOAD);
                    }
                    match s.end {
                        End::Fin => sv.must(Code::CLOSED_CRITICAL_STREAM),
                        End::Reset => sv.may(Code::CLOSED_CRITICAL_STREAM),
                        End::Open => {}
                    }
                }
            }
            PUSH if target_is_client => {
                // §4.6: a push stream without MAX_PUSH_ID.
                sv.must(Code::ID_ERROR);
            }
            PUSH => {
                // §6.2.2: only servers push.
                sv.must(Code::STREAM_CREATION_ERROR);
            }
            _ => {} // §6.2.3: unknown and reserved types are ignored.
        }
        if s.end == End::Reset {
            // The reset may overtake the stream type: nothing is required of the target.
            v.may.append(&mut sv.must);
        } else {
            v.must.append(&mut sv.must);
        }
        v.may.append(&mut sv.may);
    }
    v
}

// ---------------------------------------------------------------------------------------------
// The world: endpoints that live as long as the process

struct Net {
    client: Endpoint,
    client_config: ClientConfig,
    h3_server: SocketAddr,
    raw_server: SocketAddr,
    raw_conns: Mutex<mpsc::UnboundedReceiver<Connection>>,
    _servers: [Endpoint; 2],
}

struct World {
    rt: tokio::runtime::Runtime,
    /// Made again every [`ROTATE`] inputs (see there).
    net: std::sync::Mutex<std::sync::Arc<Net>>,
}

/// Inputs between two sets of endpoints. kuai's endpoints keep about 4 KB for every
/// connection whose last handle went before it drained (a leak reported with the campaign);
/// new endpoints every 1000 inputs keep a long campaign's memory flat, and let the target
/// check that nothing else grows.
const ROTATE: usize = 1000;
/// What the heap may hold beyond what it held after the first rotation.
const HEAP_SLACK: usize = 8 << 20;

async fn handler(_req: Request<RecvHalf>) -> Response<Body> {
    Response::new(Body::from("ok"))
}

async fn net() -> Net {
    let alpn: &[&[u8]] = &[kuai_h3::ALPN];
    let (h3_cfg, h3_cert) = ServerConfig::self_signed(&["localhost"], alpn).unwrap();
    let (raw_cfg, raw_cert) = ServerConfig::self_signed(&["localhost"], alpn).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let h3_ep = Endpoint::server(h3_cfg, any).unwrap();
    let raw_ep = Endpoint::server(raw_cfg, any).unwrap();
    let e = h3_ep.clone();
    tokio::spawn(async move {
        while let Some(c) = e.accept().await {
            tokio::spawn(async move {
                if let Ok(conn) = c.await {
                    let _ = kuai_h3::serve(conn, Config::default(), handler).await;
                }
            });
        }
    });
    let (tx, rx) = mpsc::unbounded_channel();
    let e = raw_ep.clone();
    tokio::spawn(async move {
        while let Some(c) = e.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Ok(conn) = c.await {
                    let _ = tx.send(conn);
                }
            });
        }
    });
    let mut roots = kuai::rustls::RootCertStore::empty();
    roots.add(h3_cert).unwrap();
    roots.add(raw_cert).unwrap();
    Net {
        client: Endpoint::client(any).unwrap(),
        client_config: ClientConfig::with_roots(roots, alpn).unwrap(),
        h3_server: h3_ep.local_addr().unwrap(),
        raw_server: raw_ep.local_addr().unwrap(),
        raw_conns: Mutex::new(rx),
        _servers: [h3_ep, raw_ep],
    }
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let net = rt.block_on(net());
        World {
            rt,
            net: std::sync::Mutex::new(std::sync::Arc::new(net)),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// One input

/// The target's end of the connection, kept alive for the input.
enum Target {
    Server,
    Client(kuai_h3::Client),
}

fn headers_frame(fields: &[(&str, &str)]) -> Vec<u8> {
    let fields: Vec<(Bytes, Bytes)> = fields
        .iter()
        .map(|(n, v)| {
            (
                Bytes::copy_from_slice(n.as_bytes()),
                Bytes::copy_from_slice(v.as_bytes()),
            )
        })
        .collect();
    let mut block = Vec::new();
    let mut enc = Vec::new();
    kuai_h3::qpack::Encoder::new(0, 0)
        .encode(0, &fields, &mut block, &mut enc)
        .expect("static-only encoding");
    let mut f = Vec::new();
    put_var(&mut f, 0x01);
    put_var(&mut f, block.len() as u64);
    f.extend_from_slice(&block);
    f
}

/// A request through the target and its response, so that what was written before has been
/// read; errors are fine (the connection may be closing).
async fn round_trip(raw: &Connection, target: &Target) {
    let t = Duration::from_secs(2);
    match target {
        Target::Server => {
            let _ = timeout(t, async {
                let (mut s, mut r) = raw.open_bi().await.ok()?;
                let req = headers_frame(&[
                    (":method", "GET"),
                    (":scheme", "https"),
                    (":authority", "localhost"),
                    (":path", "/"),
                ]);
                s.write_all(&req).await.ok()?;
                s.finish().ok()?;
                r.read_to_end(64 * 1024).await.ok()
            })
            .await;
        }
        Target::Client(c) => {
            // Answers the request; never ends, so the request's end ends the round trip.
            let serve = async {
                let answer = async {
                    let (mut s, mut r) = raw.accept_bi().await.ok()?;
                    r.read_to_end(64 * 1024).await.ok()?;
                    s.write_all(&headers_frame(&[(":status", "200")]))
                        .await
                        .ok()?;
                    s.finish().ok()
                };
                let _ = answer.await;
                std::future::pending::<()>().await;
            };
            let _ = timeout(t, async {
                tokio::select! {
                    _ = c.get("https://localhost/", 1024) => {}
                    _ = serve => {}
                }
            })
            .await;
        }
    }
    // Let the tasks that were woken meanwhile run.
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

struct RawStream {
    send: SendStream,
    model: ModelStream,
    /// A write failed: what the model holds may not have been sent.
    broken: bool,
}

async fn write(s: &mut RawStream, bytes: &[u8]) {
    if s.broken || s.model.end != End::Open {
        return;
    }
    match timeout(Duration::from_secs(2), s.send.write_all(bytes)).await {
        Ok(Ok(())) => s.model.data.extend_from_slice(bytes),
        _ => s.broken = true,
    }
}

async fn run(w: &Net, target_is_client: bool, mut ops: &[u8]) {
    // The target's end, and the fuzzer's raw end of a new connection.
    let (raw, target) = if target_is_client {
        let mut rx = w.raw_conns.lock().await;
        while rx.try_recv().is_ok() {}
        let conn = w
            .client
            .connect_with(w.client_config.clone(), w.raw_server, "localhost")
            .expect("connect")
            .await
            .expect("handshake with the raw server");
        let raw = timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the raw server accepted")
            .expect("raw server channel");
        let client = kuai_h3::Client::new(conn, Config::default())
            .await
            .expect("HTTP/3 client");
        (raw, Target::Client(client))
    } else {
        let raw = w
            .client
            .connect_with(w.client_config.clone(), w.h3_server, "localhost")
            .expect("connect")
            .await
            .expect("handshake with the HTTP/3 server");
        (raw, Target::Server)
    };
    // Read whatever the target sends on its own unidirectional streams.
    let r = raw.clone();
    let drain = tokio::spawn(async move {
        while let Ok(mut s) = r.accept_uni().await {
            tokio::spawn(async move { while let Ok(Some(_)) = s.read_chunk(usize::MAX).await {} });
        }
    });

    let mut streams: Vec<RawStream> = Vec::new();
    let mut round_trips = 0;
    for _ in 0..MAX_OPS {
        let [op, len, tail @ ..] = ops else { break };
        let n = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(n);
        ops = next;
        let pick = usize::from(op >> 3);
        let k = streams.len();
        match op & 7 {
            0 => {
                if k == MAX_STREAMS {
                    continue;
                }
                let Ok(Ok(send)) = timeout(Duration::from_secs(2), raw.open_uni()).await else {
                    continue;
                };
                let mut s = RawStream {
                    send,
                    model: ModelStream {
                        data: Vec::new(),
                        end: End::Open,
                    },
                    broken: false,
                };
                write(&mut s, if body.is_empty() { &[0x00] } else { body }).await;
                streams.push(s);
            }
            1 if k > 0 => write(&mut streams[pick % k], body).await,
            2 if k > 0 => {
                let ty = FRAME_TYPES[usize::from(body.first().copied().unwrap_or(0)) % 16];
                let payload = body.get(1..).unwrap_or_default();
                let mut f = Vec::new();
                put_var(&mut f, ty);
                put_var(&mut f, payload.len() as u64);
                f.extend_from_slice(payload);
                write(&mut streams[pick % k], &f).await;
            }
            3 if k > 0 => {
                let mut p = Vec::new();
                for pair in body.chunks(2) {
                    put_var(&mut p, SETTING_IDS[usize::from(pair[0]) % 12]);
                    put_var(&mut p, u64::from(pair.get(1).copied().unwrap_or(0)));
                }
                let mut f = Vec::new();
                put_var(&mut f, 0x04);
                put_var(&mut f, p.len() as u64);
                f.extend_from_slice(&p);
                write(&mut streams[pick % k], &f).await;
            }
            4 if k > 0 => {
                let ty = [0x07, 0x0d, 0x03][usize::from(body.first().copied().unwrap_or(0)) % 3];
                let mut id = [0u8; 8];
                for (i, b) in body.iter().skip(1).take(8).enumerate() {
                    id[i] = *b;
                }
                let id = u64::from_le_bytes(id) & ((1 << 62) - 1);
                let mut p = Vec::new();
                put_var(&mut p, id);
                let mut f = Vec::new();
                put_var(&mut f, ty);
                put_var(&mut f, p.len() as u64);
                f.extend_from_slice(&p);
                write(&mut streams[pick % k], &f).await;
            }
            5 if k > 0 => {
                let s = &mut streams[pick % k];
                if s.model.end == End::Open && !s.broken && s.send.finish().is_ok() {
                    s.model.end = End::Fin;
                }
            }
            6 if k > 0 => {
                let s = &mut streams[pick % k];
                let code = u64::from(body.first().copied().unwrap_or(0));
                if s.model.end == End::Open && s.send.reset(code).is_ok() {
                    s.model.end = End::Reset;
                }
            }
            7 if round_trips < MAX_ROUND_TRIPS => {
                round_trips += 1;
                round_trip(&raw, &target).await;
            }
            _ => {}
        }
    }
    round_trip(&raw, &target).await;

    // What the model says of the streams that were written as modelled.
    let model: Vec<ModelStream> = streams
        .iter()
        .filter(|s| !s.broken)
        .map(|s| ModelStream {
            data: s.model.data.clone(),
            end: s.model.end,
        })
        .collect();
    let any_broken = streams.iter().any(|s| s.broken);
    let v = verdict(target_is_client, &model);
    let closed = if v.must.is_empty() {
        raw.close_reason()
    } else {
        Some(
            timeout(Duration::from_secs(5), raw.closed())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "the target must close the connection with one of {:x?}; still open \
                         after 5 s (streams: {model:x?})",
                        v.must
                    )
                }),
        )
    };
    match closed {
        None => {}
        Some(ConnectionError::ApplicationClosed { code, reason }) => {
            assert!(
                v.allows(code) || any_broken,
                "the target closed with {:?} ({:?}); the model allows {:x?} / {:x?} (streams: \
                 {model:x?})",
                Code(code),
                String::from_utf8_lossy(&reason),
                v.must,
                v.may
            );
        }
        Some(e) => panic!("the connection ended with {e:?} (streams: {model:x?})"),
    }

    raw.close(0, b"done");
    drop(target);
    drop(streams);
    drain.abort();
    let _ = timeout(Duration::from_secs(1), raw.closed()).await;
}

/// Replaces the endpoints every [`ROTATE`] inputs, and checks that the heap held once the old
/// ones are gone does not grow from one rotation to the next.
fn rotate() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static INPUTS: AtomicUsize = AtomicUsize::new(0);
    static BASE: AtomicUsize = AtomicUsize::new(0);
    let n = INPUTS.fetch_add(1, Ordering::Relaxed) + 1;
    if !n.is_multiple_of(ROTATE) {
        return;
    }
    let w = world();
    let old = std::mem::replace(
        &mut *w.net.lock().unwrap(),
        std::sync::Arc::new(w.rt.block_on(net())),
    );
    let base = BASE.load(Ordering::Relaxed);
    // The old endpoints wind down in their own time (their connections drain, tasks see the
    // close): wait for them, up to 5 s, before judging what stays.
    let live = w.rt.block_on(async {
        old.client.close(0, b"");
        for s in &old._servers {
            s.close(0, b"");
        }
        drop(old);
        let mut live = 0;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            live = kuai_fuzz::alloc::live();
            if base != 0 && live <= base + HEAP_SLACK {
                break;
            }
        }
        live
    });
    if std::env::var_os("KUAI_FUZZ_DEBUG").is_some() {
        eprintln!("{n} inputs: new endpoints; {live} bytes of heap live");
    }
    let base = match base {
        0 => {
            BASE.store(live, Ordering::Relaxed);
            live
        }
        b => b,
    };
    assert!(
        live <= base + HEAP_SLACK,
        "after {n} inputs and new endpoints the heap holds {live} bytes, {} more than after \
         the first {ROTATE}",
        live - base
    );
}

fuzz_target!(|data: &[u8]| {
    kuai_fuzz::alloc::reset_peak();
    let Some((&config, ops)) = data.split_first() else {
        return;
    };
    let w = world();
    let net = w.net.lock().unwrap().clone();
    w.rt.block_on(async {
        timeout(Duration::from_secs(20), run(&net, config & 1 == 1, ops))
            .await
            .expect("an input took more than 20 s");
    });
    drop(net);
    rotate();
});
