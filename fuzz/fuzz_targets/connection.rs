//! A connection fed random datagrams after a real handshake (`kuai_proto::Endpoint`,
//! `kuai_proto::Connection`).
//!
//! Every input starts from the same place: a client and a server [`Endpoint`] (fixed seeds,
//! deterministic connection IDs, fixed reset and token keys, one Ed25519 certificate made once
//! per process with rcgen from a fixed key) complete a real TLS 1.3 handshake in lock step on a
//! virtual clock that starts at one `Instant` captured once per process, then open streams both
//! ways with some data. `Connection` cannot be cloned, so the handshake is simply run again for
//! every input (about a millisecond, so ~1000 inputs/s without sanitizer; keeping one pair alive
//! across inputs would make crashes depend on earlier inputs). An input never sees state left by
//! another one. What stays random is inside rustls (X25519 shares, nonces) and where kuai-proto
//! draws from the thread RNG (transport-parameter grease, token nonces, stateless reset filler):
//! the bytes on the wire differ between runs, what happens hardly ever does.
//!
//! The client's TLS key log hands the fuzzer the 1-RTT traffic secrets, from which it derives the
//! same packet keys as the connections (`OneRttKeys::derived`, following key updates by the key
//! phase bit). So it can take a datagram the peer really produced, open it, and deliver a packet
//! with the peer's packet number but fuzz-chosen frames: the target's frame processing is reached
//! with valid packets, and the peer's view stays consistent (it sent that packet number).
//!
//! # Input
//!
//! Byte 0: bit 0 picks the target (0 = server, 1 = client; the other endpoint is "the peer"),
//! bits 1-2 the number of datagrams asked of `poll_transmit` at once (1-4, exercising GSO
//! batches). Then up to [`MAX_OPS`] chunks `[op][len][len bytes of body]` (a short last body is
//! taken as it is). `op & 7` is the operation, `op >> 3` five flag bits (`f0`..`f4`):
//!
//! | op | operation | flags |
//! |---|---|---|
//! | 0 | deliver the body to the target as a raw datagram | f0: from the peer's other port; f1: route it (short-header first byte from body\[0], then the DCID the peer uses, then the rest); f2-f3: ECN bits |
//! | 1 | make the peer send a datagram (queueing a DATAGRAM frame if it has nothing to send), flip bytes in it — body is `(pos u16 LE, xor)` triples — and deliver it | f0: other port; f1: deliver the original first |
//! | 2 | take the peer's next datagram as in 1, decrypt it and re-seal it with the same packet number around fuzz frames | f0-f1: 0 body replaces the frames, 1 frames then body, 2 body then frames, 3 the frames with the body's `(pos u16 LE, xor)` triples applied; f2: other port (a migration); f3: flip the key phase, sealing with the next keys (a peer-initiated key update); f4: ECN CE |
//! | 3 | advance the clock by `u16 LE` ms (body, 1 ms if empty) and run timeouts on both sides | f0: drop what is sent meanwhile instead of delivering it; f1: jump straight to the end instead of stepping through every deadline |
//! | 4 | pump: `body[0] % 16 + 1` rounds of timers and traffic both ways | f0: do not advance the clock (1 ms per round otherwise) |
//! | 5 | application action on a connection, `body[0] % 11`: open bidi + write, open uni + write, write, finish, reset, stop, send datagram, key update, close, migrate (client), read everything; `body[1]` picks a stream, the rest is data or the code | f0: on the peer instead of the target |
//! | 6 | a stateless reset for the target: `[0x40 \| body[0] & 0x3f] ++ body[1..]`, padded to 5 bytes, `++` the peer's reset token for the CID the target last sent to | f0: corrupt the token |
//! | 7 | deliver again one of the last 32 datagrams the target received (`body[0]` back from the newest) | f0: other port |
//!
//! After every operation both endpoints are drained: datagrams are delivered to the other side and
//! events handled (streams read, incoming streams accepted), until neither has anything to send.
//! At the end of the input the clock runs on without delivering anything until every connection
//! is gone.
//!
//! # Checks (a panic is a finding)
//!
//! - Nothing in kuai-proto panics.
//! - One exchange between the endpoints quiesces within [`MAX_DATAGRAMS`] datagrams.
//! - No timer livelock: after `handle_timeout(now)` on both endpoints and draining their output,
//!   a deadline at or before `now` (endpoint's or a connection's) may remain only while the
//!   endpoints keep sending; three rounds in a row without a datagram is a livelock.
//! - After every operation, the endpoint's `poll_timeout` is at or before every live
//!   connection's own deadline (no connection's timer is lost), and `connection_count()` agrees
//!   with `handles()`.
//! - A closed connection has a deadline no later than `max(60 s, 4 x PTO)` ahead (its 3 x PTO
//!   drain timer), so it drains once the clock passes it; at the end of the input, with nothing
//!   delivered any more, every connection is gone after `max(60 s, 6 x PTO)` (twice the 30 s
//!   idle timeout or 3 x PTO, as one PTO probe may restart the idle timer).
//!
//! `KUAI_FUZZ_DEBUG=1` in the environment prints every operation, datagram (the first 40 of each
//! exchange) and event, to follow a reproducer.

#![no_main]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kuai_proto::cid::ConnectionIdGenerator;
use kuai_proto::config::{ClientConfig, EndpointConfig, ServerConfig, TransportConfig};
use kuai_proto::connection::EcnCodepoint;
use kuai_proto::crypto::{CapturedSecrets, OneRttKeys, SuiteAlgs};
use kuai_proto::packet::{self, PartialDecode};
use kuai_proto::token::{self, TokenKey};
use kuai_proto::{
    Connection, ConnectionHandle, ConnectionId, Dir, Endpoint, Event, StreamEvent, StreamId,
};
use libfuzzer_sys::fuzz_target;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Operations run per input at most.
const MAX_OPS: usize = 128;
/// Datagrams one exchange may take before it counts as endless.
const MAX_DATAGRAMS: usize = 1000;
/// Rounds of `handle_timeout` at one instant without a datagram sent before it is a livelock.
const MAX_STALLED_ROUNDS: u32 = 3;
/// Deadlines stepped through by one clock operation before jumping to its end.
const MAX_CLOCK_STEPS: usize = 2000;
/// Timer firings in the final run-down before it counts as a timer storm.
const MAX_QUIESCE_STEPS: usize = 10_000;
/// Length of the connection IDs both endpoints issue.
const CID_LEN: usize = 8;
const UNIX_MS: u64 = 1_700_000_000_000;
const ALPN: &[u8] = b"kuai-fuzz";
const SERVER_RESET_KEY: [u8; 32] = [0x5e; 32];
const CLIENT_RESET_KEY: [u8; 32] = [0xc1; 32];
/// PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410): the certificate's key is fixed, so the
/// certificate is the same in every process (Ed25519 signatures are deterministic).
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
const ED25519_SEED: [u8; 32] = *b"kuai fuzz connection target key!";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Server = 0,
    Client = 1,
}

impl Who {
    fn other(self) -> Who {
        match self {
            Who::Server => Who::Client,
            Who::Client => Who::Server,
        }
    }

    fn addr(self) -> SocketAddr {
        match self {
            Who::Server => "10.0.0.1:443".parse().unwrap(),
            Who::Client => "10.0.0.2:50000".parse().unwrap(),
        }
    }

    /// The same host from another port (NAT rebinding, migration).
    fn alt_addr(self) -> SocketAddr {
        let mut a = self.addr();
        a.set_port(a.port() + 1);
        a
    }

    fn reset_key(self) -> &'static [u8; 32] {
        match self {
            Who::Server => &SERVER_RESET_KEY,
            Who::Client => &CLIENT_RESET_KEY,
        }
    }
}

const BOTH: [Who; 2] = [Who::Server, Who::Client];

// ---------------------------------------------------------------------------------------------
// Set up once per process

struct Shared {
    base: Instant,
    server: Arc<ServerConfig>,
    client: ClientConfig,
    server_ep: Arc<EndpointConfig>,
    client_ep: Arc<EndpointConfig>,
}

/// 1-RTT traffic secrets of the latest handshake, from the client's TLS key log.
static SECRETS: Mutex<(Vec<u8>, Vec<u8>)> = Mutex::new((Vec::new(), Vec::new()));

#[derive(Debug)]
struct FuzzKeyLog;

impl rustls::KeyLog for FuzzKeyLog {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        let mut s = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
        match label {
            "CLIENT_TRAFFIC_SECRET_0" => s.0 = secret.to_vec(),
            "SERVER_TRAFFIC_SECRET_0" => s.1 = secret.to_vec(),
            _ => {}
        }
    }

    fn will_log(&self, label: &str) -> bool {
        matches!(label, "CLIENT_TRAFFIC_SECRET_0" | "SERVER_TRAFFIC_SECRET_0")
    }
}

/// Connection IDs from a counter through splitmix64: unique, and the same in every run.
struct DetCids(u64);

impl ConnectionIdGenerator for DetCids {
    fn generate(&mut self) -> ConnectionId {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ConnectionId::new(&z.to_be_bytes()[..CID_LEN])
    }

    fn cid_len(&self) -> usize {
        CID_LEN
    }
}

fn endpoint_config(who: Who) -> Arc<EndpointConfig> {
    let seed = who as u64 * 1000 + 1;
    Arc::new(EndpointConfig {
        cid_generator: Arc::new(move || Box::new(DetCids(seed))),
        reset_key: *who.reset_key(),
        ..EndpointConfig::default()
    })
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let key_der = [&ED25519_PKCS8_PREFIX[..], &ED25519_SEED[..]].concat();
        let key_pair = rcgen::KeyPair::try_from(key_der.as_slice()).expect("Ed25519 key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .expect("certificate parameters")
            .self_signed(&key_pair)
            .expect("self-signed certificate");
        let cert: CertificateDer<'static> = cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_der));

        // One cipher suite, so the fuzzer knows which keys the secrets give.
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
        let provider = Arc::new(provider);

        let mut server_tls = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)
            .expect("server certificate");
        server_tls.alpn_protocols = vec![ALPN.to_vec()];

        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).expect("root certificate");
        let mut client_tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        client_tls.alpn_protocols = vec![ALPN.to_vec()];
        // Every input must start from a full handshake: no tickets carried between inputs.
        client_tls.resumption = rustls::client::Resumption::disabled();
        client_tls.enable_early_data = false;
        client_tls.key_log = Arc::new(FuzzKeyLog);

        let transport = Arc::new(TransportConfig::default());
        let mut server = ServerConfig::new(Arc::new(server_tls));
        server.transport = transport.clone();
        server.token_key = Arc::new(TokenKey::new(&[0x70; 32]));
        let mut client = ClientConfig::new(Arc::new(client_tls));
        client.transport = transport;

        Shared {
            base: Instant::now(),
            server: Arc::new(server),
            client,
            server_ep: endpoint_config(Who::Server),
            client_ep: endpoint_config(Who::Client),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The harness

/// A packet of the peer opened with the mirrored keys.
struct Opened {
    pn: u64,
    pn_len: usize,
    key_phase: bool,
    spin: bool,
    fixed_bit: bool,
    dcid: ConnectionId,
    payload: Bytes,
}

struct Harness {
    now: Instant,
    eps: [Endpoint; 2],
    /// The connection of the handshake, per endpoint.
    main: [Option<ConnectionHandle>; 2],
    target: Who,
    /// Datagrams per `poll_transmit`.
    gso: usize,
    buf: Vec<u8>,
    /// 1-RTT keys like the client's (`local` = client to server), one copy per sender so each
    /// follows that sender's key updates.
    mirrors: Option<[OneRttKeys; 2]>,
    /// Largest packet number opened per sender, to expand truncated ones.
    largest_pn: [Option<u64>; 2],
    /// DCID of the last 1-RTT packet each side sent.
    last_dcid: [Option<ConnectionId>; 2],
    /// Datagrams the target received, newest last.
    history: VecDeque<Vec<u8>>,
    streams: [Vec<StreamId>; 2],
    /// Datagrams sent in the current exchange.
    exchanged: usize,
}

impl Harness {
    fn new(target: Who, gso: usize) -> Self {
        let sh = shared();
        *SECRETS.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
        let now = sh.base;
        let server = Endpoint::new(
            sh.server_ep.clone(),
            Some(sh.server.clone()),
            now,
            UNIX_MS,
            Some(1),
        );
        let mut client = Endpoint::new(sh.client_ep.clone(), None, now, UNIX_MS, Some(2));
        let ch = client
            .connect(now, &sh.client, Who::Server.addr(), "localhost")
            .expect("connect");
        let mut h = Harness {
            now,
            eps: [server, client],
            main: [None, Some(ch)],
            target,
            gso,
            buf: Vec::new(),
            mirrors: None,
            largest_pn: [None; 2],
            last_dcid: [None, None],
            history: VecDeque::new(),
            streams: [Vec::new(), Vec::new()],
            exchanged: 0,
        };

        // Handshake in lock step, 1 ms per idle round.
        let mut done = false;
        for _ in 0..200 {
            let sent = h.exchange(true);
            done = h
                .conn(Who::Client)
                .is_some_and(|c| c.is_handshake_confirmed())
                && h.conn(Who::Server).is_some_and(|c| c.is_established());
            if done {
                break;
            }
            if sent == 0 {
                h.now += Duration::from_millis(1);
                h.fire_timers(true);
            }
        }
        assert!(done, "setup: the handshake did not complete");

        let (client_traffic, server_traffic) =
            SECRETS.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let secrets = CapturedSecrets {
            client_traffic,
            server_traffic,
            ..Default::default()
        };
        let algs = SuiteAlgs::of(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256).unwrap();
        let version = h.conn(Who::Client).unwrap().version();
        // The mirrors keep their next phase's keys at hand (`open` and `seal` use them).
        let derive = || {
            let mut k = OneRttKeys::derived(algs, version, &secrets).expect("1-RTT secrets");
            k.prepare_next();
            k
        };
        h.mirrors = Some([derive(), derive()]);

        // Streams both ways, with data in flight and some already read.
        let mut opened = Vec::new();
        h.with_conn(Who::Client, |c, _| {
            let id = c.open_stream(Dir::Bi).expect("client bidi stream");
            c.write(id, pattern(1500)).unwrap();
            opened.push(id);
            let id = c.open_stream(Dir::Uni).expect("client uni stream");
            c.write(id, pattern(300)).unwrap();
            c.finish(id).unwrap();
            opened.push(id);
        });
        h.streams[Who::Client as usize].append(&mut opened);
        h.settle();
        // Answer on the client's bidi stream, and open one of the server's own.
        let reply = h.streams[Who::Server as usize].first().copied();
        h.with_conn(Who::Server, |c, _| {
            if let Some(id) = reply {
                c.write(id, pattern(2000)).unwrap();
            }
            let id = c.open_stream(Dir::Bi).expect("server bidi stream");
            c.write(id, pattern(700)).unwrap();
            opened.push(id);
        });
        h.streams[Who::Server as usize].append(&mut opened);
        h.settle();
        assert!(
            reply.is_some() && h.streams[Who::Client as usize].len() == 3,
            "setup: streams were not accepted"
        );
        h.history.clear();
        h.check();
        h
    }

    fn ep(&mut self, who: Who) -> &mut Endpoint {
        &mut self.eps[who as usize]
    }

    fn conn(&self, who: Who) -> Option<&Connection> {
        self.eps[who as usize].connection(self.main[who as usize]?)
    }

    fn with_conn(&mut self, who: Who, f: impl FnOnce(&mut Connection, Instant)) {
        let now = self.now;
        let Some(h) = self.main[who as usize] else {
            return;
        };
        if let Some(c) = self.eps[who as usize].connection_mut(h) {
            f(c, now);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Traffic

    /// Hands a datagram to `to`.
    fn deliver(&mut self, to: Who, from: SocketAddr, ecn: Option<EcnCodepoint>, data: &[u8]) {
        if to == self.target {
            if self.history.len() == 32 {
                self.history.pop_front();
            }
            self.history.push_back(data.to_vec());
        }
        let now = self.now;
        self.ep(to)
            .handle_datagram(now, from, None, ecn, BytesMut::from(data));
    }

    /// Sends everything `from` has, delivering it to the other side or dropping it.
    fn transmit_all(&mut self, from: Who, deliver: bool) -> usize {
        let mut n = 0;
        loop {
            let now = self.now;
            let gso = self.gso;
            let mut buf = std::mem::take(&mut self.buf);
            let t = self.eps[from as usize].poll_transmit(now, gso, &mut buf);
            let Some(t) = t else {
                self.buf = buf;
                return n;
            };
            assert!(
                t.size > 0 && t.size <= buf.len(),
                "transmit of {} bytes with {} in the buffer",
                t.size,
                buf.len()
            );
            let seg = t.segment_size.unwrap_or(t.size);
            assert!(seg > 0, "zero segment size");
            assert!(
                t.size.div_ceil(seg) <= gso,
                "{} bytes in segments of {seg} exceed {gso} datagrams",
                t.size
            );
            for d in buf[..t.size].chunks(seg) {
                n += 1;
                self.exchanged += 1;
                assert!(
                    self.exchanged <= MAX_DATAGRAMS,
                    "endless exchange: more than {MAX_DATAGRAMS} datagrams without going quiet \
                     (last from the {from:?}, {} bytes, first byte {:#04x})",
                    d.len(),
                    d[0]
                );
                self.observe(from, d);
                if debug() && self.exchanged <= 40 {
                    eprintln!(
                        "  {from:?} -> {}: {} bytes, first byte {:#04x}{}",
                        t.destination,
                        d.len(),
                        d[0],
                        if deliver { "" } else { " (dropped)" }
                    );
                }
                if deliver {
                    self.deliver(from.other(), from.addr(), t.ecn, d);
                }
            }
            self.buf = buf;
        }
    }

    /// Until neither side has anything to send: events, then traffic both ways.
    fn exchange(&mut self, deliver: bool) -> usize {
        self.exchanged = 0;
        let mut total = 0;
        loop {
            self.handle_events();
            let a = self.transmit_all(self.target, deliver);
            let b = self.transmit_all(self.target.other(), deliver);
            total += a + b;
            if a + b == 0 {
                break;
            }
        }
        self.handle_events();
        total
    }

    fn settle(&mut self) {
        self.exchange(true);
    }

    fn handle_events(&mut self) {
        for who in BOTH {
            let w = who as usize;
            while let Some(h) = self.eps[w].accept() {
                self.main[w].get_or_insert(h);
            }
            let mut n = 0;
            while let Some((h, ev)) = self.eps[w].poll_event() {
                n += 1;
                assert!(n <= 100_000, "endless events on the {who:?}");
                if debug() {
                    eprintln!("  {who:?} {h:?}: {ev:?}");
                }
                let Some(c) = self.eps[w].connection_mut(h) else {
                    continue;
                };
                match ev {
                    Event::Stream(StreamEvent::Readable(id)) => read_all(c, id),
                    Event::Stream(StreamEvent::Opened(dir)) => {
                        while let Some(id) = c.accept_stream(dir) {
                            if self.streams[w].len() < 64 {
                                self.streams[w].push(id);
                            }
                            read_all(c, id);
                        }
                    }
                    Event::DatagramReceived => {
                        let mut k = 0;
                        while c.recv_datagram().is_some() {
                            k += 1;
                            assert!(k <= 100_000, "endless received datagrams");
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Follows the 1-RTT packets each side sends: packet number, DCID, key phase.
    fn observe(&mut self, from: Who, d: &[u8]) {
        if d[0] & 0x80 != 0 || self.mirrors.is_none() {
            return;
        }
        let _ = self.open(from, d);
    }

    /// Opens a 1-RTT packet `from` sent with the mirrored keys, following a key update when the
    /// packet shows the next key phase and opens with the next keys.
    fn open(&mut self, from: Who, d: &[u8]) -> Option<Opened> {
        let f = from as usize;
        let largest = self.largest_pn[f];
        let mirror = &mut self.mirrors.as_mut()?[f];
        let unprotect = |m: &OneRttKeys| {
            let hp = match from {
                Who::Client => m.header.local.as_ref(),
                Who::Server => m.header.remote.as_ref(),
            };
            let (pd, _) = PartialDecode::new(BytesMut::from(d), CID_LEN).ok()?;
            pd.unprotect(hp, largest).ok()
        };
        let up = unprotect(mirror)?;
        let next = up.key_phase() != mirror.phase;
        let keys = if next {
            mirror.next()?
        } else {
            &mirror.current
        };
        let key = match from {
            Who::Client => keys.local.as_ref(),
            Who::Server => keys.remote.as_ref(),
        };
        let fixed_bit = d[0] & 0x40 != 0;
        let (pn, key_phase, spin, dcid) = (up.pn(), up.key_phase(), up.spin(), up.dst_cid());
        let pn_len = up.header_len() - 1 - CID_LEN;
        let p = up.decrypt(key).ok()?;
        if next {
            mirror.update();
            mirror.prepare_next();
        }
        self.largest_pn[f] = Some(largest.map_or(pn, |l| l.max(pn)));
        self.last_dcid[f] = Some(dcid);
        Some(Opened {
            pn,
            pn_len,
            key_phase,
            spin,
            fixed_bit,
            dcid,
            payload: p.payload,
        })
    }

    /// Seals `frames` as a 1-RTT packet of `from` with the header fields of `o`.
    fn seal(&self, from: Who, o: &Opened, frames: &[u8], flip_phase: bool) -> Option<Vec<u8>> {
        let mirror = &self.mirrors.as_ref()?[from as usize];
        let keys = if flip_phase {
            mirror.next()?
        } else {
            &mirror.current
        };
        let (hp, key) = match from {
            Who::Client => (mirror.header.local.as_ref(), keys.local.as_ref()),
            Who::Server => (mirror.header.remote.as_ref(), keys.remote.as_ref()),
        };
        let mut buf = Vec::with_capacity(frames.len() + 64);
        let pos = packet::write_short_header(
            &mut buf,
            &o.dcid,
            o.spin,
            o.key_phase ^ flip_phase,
            o.pn,
            o.pn_len,
        );
        if !o.fixed_bit {
            packet::grease_fixed_bit(&mut buf, &pos);
        }
        buf.extend_from_slice(frames);
        // PADDING frames so there is a header protection sample.
        while buf.len() < pos.payload_offset() + 4 {
            buf.push(0);
        }
        packet::seal_packet(&mut buf, &pos, o.pn, hp, key).ok()?;
        Some(buf)
    }

    /// Makes the peer produce its next datagram (queueing a DATAGRAM frame if it has nothing
    /// else to say) and returns it undelivered.
    fn intercept(&mut self) -> Option<Vec<u8>> {
        let peer = self.target.other();
        self.with_conn(peer, |c, _| {
            let _ = c.send_datagram(Bytes::from_static(b"kuai"));
        });
        let now = self.now;
        let mut buf = std::mem::take(&mut self.buf);
        let t = self.eps[peer as usize].poll_transmit(now, 1, &mut buf);
        let d = t.map(|t| buf[..t.segment_size.unwrap_or(t.size).min(t.size)].to_vec());
        self.buf = buf;
        let d = d?;
        self.observe(peer, &d);
        Some(d)
    }

    // -----------------------------------------------------------------------------------------
    // Time

    /// A deadline at or before now, of either endpoint or any of their connections.
    fn overdue(&mut self) -> Option<(Who, Option<ConnectionHandle>, Instant)> {
        let now = self.now;
        for who in BOTH {
            let ep = &mut self.eps[who as usize];
            if let Some(t) = ep.poll_timeout()
                && t <= now
            {
                return Some((who, None, t));
            }
            for h in ep.handles().collect::<Vec<_>>() {
                if let Some(t) = ep.connection_mut(h).and_then(|c| c.poll_timeout())
                    && t <= now
                {
                    return Some((who, Some(h), t));
                }
            }
        }
        None
    }

    /// Runs the timers due at `now` on both endpoints until none is due, failing on a livelock.
    fn fire_timers(&mut self, deliver: bool) {
        let now = self.now;
        let mut stalled = 0;
        for _ in 0..1000 {
            for who in BOTH {
                self.ep(who).handle_timeout(now);
            }
            let sent = self.exchange(deliver);
            let Some((who, h, t)) = self.overdue() else {
                return;
            };
            if sent > 0 {
                stalled = 0;
                continue;
            }
            stalled += 1;
            if stalled >= MAX_STALLED_ROUNDS {
                let state = h
                    .and_then(|h| self.eps[who as usize].connection(h))
                    .map(|c| format!("{c:?}"))
                    .unwrap_or_default();
                panic!(
                    "timer livelock: the {who:?}'s deadline {:?} (connection {h:?}) stays at or \
                     before now ({:?} after the start) after {stalled} rounds of handle_timeout \
                     without a datagram sent; {state}",
                    t.saturating_duration_since(shared().base),
                    now.saturating_duration_since(shared().base),
                );
            }
        }
        panic!(
            "timers still due after 1000 rounds of handle_timeout at {:?}",
            now.saturating_duration_since(shared().base)
        );
    }

    fn next_deadline(&mut self) -> Option<Instant> {
        BOTH.iter()
            .filter_map(|&w| self.eps[w as usize].poll_timeout())
            .min()
    }

    /// Moves the clock to `until`, running timers at each deadline on the way (or only at the
    /// end with `jump`).
    fn advance(&mut self, until: Instant, deliver: bool, jump: bool) {
        if !jump {
            for _ in 0..MAX_CLOCK_STEPS {
                match self.next_deadline() {
                    Some(t) if t <= until => {
                        self.now = self.now.max(t);
                        self.fire_timers(deliver);
                        self.check();
                    }
                    _ => break,
                }
            }
        }
        self.now = self.now.max(until);
        self.fire_timers(deliver);
    }

    /// End of the input: let the clock run without delivering anything; every connection must
    /// drain within `max(60 s, 6 x PTO)`.
    fn quiesce(&mut self) {
        let start = self.now;
        let mut horizon = Duration::from_secs(60);
        for who in BOTH {
            let ep = &self.eps[who as usize];
            for h in ep.handles() {
                horizon = horizon.max(pto_estimate(ep.connection(h).unwrap()) * 6);
            }
        }
        let deadline = start + horizon + Duration::from_secs(1);
        let mut steps = 0;
        while self.eps.iter().any(|e| e.connection_count() > 0) {
            match self.next_deadline() {
                Some(t) if t <= deadline => {
                    self.now = self.now.max(t);
                    self.fire_timers(false);
                    self.check();
                    steps += 1;
                    assert!(
                        steps <= MAX_QUIESCE_STEPS,
                        "timer storm: {MAX_QUIESCE_STEPS} deadlines within {:?} with nothing \
                         delivered",
                        self.now - start
                    );
                }
                _ => break,
            }
        }
        for who in BOTH {
            let ep = &mut self.eps[who as usize];
            let handles: Vec<ConnectionHandle> = ep.handles().collect();
            let alive: Vec<String> = handles
                .into_iter()
                .map(|h| {
                    let c = ep.connection_mut(h).unwrap();
                    format!(
                        "{h:?}: closed={} deadline={:?} {c:?}",
                        c.is_closed(),
                        c.poll_timeout().map(|t| t.saturating_duration_since(start))
                    )
                })
                .collect();
            assert!(
                alive.is_empty(),
                "the {who:?} still has {} connection(s) {horizon:?} after the last datagram was \
                 delivered (deadlines relative to then): {alive:?}",
                alive.len()
            );
        }
    }

    // -----------------------------------------------------------------------------------------
    // Invariants

    fn check(&mut self) {
        let now = self.now;
        for who in BOTH {
            let ep = &mut self.eps[who as usize];
            let handles: Vec<ConnectionHandle> = ep.handles().collect();
            assert_eq!(
                ep.connection_count(),
                handles.len(),
                "the {who:?}'s connection_count disagrees with its handles"
            );
            let ep_deadline = ep.poll_timeout();
            for h in handles {
                let c = ep.connection_mut(h).unwrap();
                let deadline = c.poll_timeout();
                if let Some(t) = deadline {
                    assert!(
                        ep_deadline.is_some_and(|e| e <= t),
                        "lost timer: the {who:?}'s connection {h:?} has a deadline {:?} from \
                         now but the endpoint's next is {:?}; {c:?}",
                        t.saturating_duration_since(now),
                        ep_deadline.map(|e| e.saturating_duration_since(now))
                    );
                }
                if c.is_closed() {
                    let bound = Duration::from_secs(60).max(pto_estimate(c) * 4);
                    assert!(
                        deadline.is_some_and(|t| t <= now + bound),
                        "closed connection {h:?} of the {who:?} will not drain: deadline {:?} \
                         from now, more than {bound:?}; {c:?}",
                        deadline.map(|t| t.saturating_duration_since(now))
                    );
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Operations

    fn run(&mut self, op: u8, body: &[u8]) {
        if debug() {
            eprintln!(
                "op {} flags {:#07b} at {:?}: {body:02x?}",
                op & 7,
                op >> 3,
                self.now - shared().base
            );
        }
        let flags = op >> 3;
        let f = |i: u8| flags & (1 << i) != 0;
        let peer = self.target.other();
        let from = |alt: bool| if alt { peer.alt_addr() } else { peer.addr() };
        match op & 7 {
            0 => {
                let mut d = body.to_vec();
                if f(1)
                    && let Some(dcid) = self.last_dcid[peer as usize]
                    && !body.is_empty()
                {
                    d = Vec::with_capacity(body.len() + CID_LEN);
                    d.push(body[0] & 0x7f);
                    d.extend_from_slice(&dcid);
                    d.extend_from_slice(&body[1..]);
                }
                let ecn = EcnCodepoint::from_bits(flags >> 2);
                self.deliver(self.target, from(f(0)), ecn, &d);
            }
            1 => {
                let Some(orig) = self.intercept() else { return };
                if f(1) {
                    self.deliver(self.target, from(f(0)), None, &orig);
                }
                let mut d = orig;
                flip(&mut d, body);
                self.deliver(self.target, from(f(0)), None, &d);
            }
            2 => {
                let Some(d) = self.intercept() else { return };
                let sealed = if d[0] & 0x80 == 0 {
                    self.open(peer, &d).and_then(|o| {
                        let frames = match flags & 3 {
                            0 => body.to_vec(),
                            1 => [&o.payload[..], body].concat(),
                            2 => [body, &o.payload[..]].concat(),
                            _ => {
                                let mut p = o.payload.to_vec();
                                flip(&mut p, body);
                                p
                            }
                        };
                        if debug() {
                            eprintln!(
                                "  sealing pn {} ({} bytes) phase {} over {:02x?}",
                                o.pn,
                                o.pn_len,
                                o.key_phase ^ f(3),
                                o.payload
                            );
                        }
                        self.seal(peer, &o, &frames, f(3))
                    })
                } else {
                    None
                };
                let ecn = f(4).then_some(EcnCodepoint::Ce);
                // Not a 1-RTT packet we can open (or not sealable): deliver it as it was.
                let d = sealed.unwrap_or(d);
                self.deliver(self.target, from(f(2)), ecn, &d);
            }
            3 => {
                let ms = match body {
                    [] => 1,
                    [a] => u64::from(*a),
                    [a, b, ..] => u64::from(u16::from_le_bytes([*a, *b])),
                };
                let until = self.now + Duration::from_millis(ms);
                self.advance(until, !f(0), f(1));
            }
            4 => {
                let rounds = body.first().map_or(1, |b| b % 16 + 1);
                for _ in 0..rounds {
                    if !f(0) {
                        self.now += Duration::from_millis(1);
                    }
                    self.fire_timers(true);
                }
            }
            5 => self.app(if f(0) { peer } else { self.target }, body),
            6 => {
                let Some(dcid) = self.last_dcid[self.target as usize] else {
                    return;
                };
                let mut tok = token::reset_token(peer.reset_key(), &dcid);
                if f(0) {
                    tok[15] ^= 1;
                }
                let mut d = vec![0x40 | body.first().map_or(0, |b| b & 0x3f)];
                d.extend_from_slice(body.get(1..).unwrap_or_default());
                // At least 21 bytes, like any stateless reset (RFC 9000 §10.3).
                while d.len() < 5 {
                    d.push(0x5a);
                }
                d.extend_from_slice(&tok);
                self.deliver(self.target, peer.addr(), None, &d);
            }
            _ => {
                let back = body.first().map_or(0, |b| usize::from(*b));
                let n = self.history.len();
                if n == 0 {
                    return;
                }
                let d = self.history[n - 1 - back % n].clone();
                self.deliver(self.target, from(f(0)), None, &d);
            }
        }
    }

    fn app(&mut self, who: Who, body: &[u8]) {
        let action = body.first().map_or(0, |b| b % 11);
        let pick = body.get(1).copied().unwrap_or(0);
        let data = body.get(2..).unwrap_or_default();
        let code = data
            .iter()
            .take(8)
            .fold(0u64, |a, &b| (a << 8) | u64::from(b))
            & ((1 << 62) - 1);
        let streams = self.streams[who as usize].clone();
        let stream = (!streams.is_empty()).then(|| streams[usize::from(pick) % streams.len()]);
        let mut opened = None;
        self.with_conn(who, |c, now| match action {
            0 | 1 => {
                let dir = if action == 0 { Dir::Bi } else { Dir::Uni };
                if let Ok(id) = c.open_stream(dir) {
                    let _ = c.write(id, Bytes::copy_from_slice(data));
                    if pick & 1 != 0 {
                        let _ = c.finish(id);
                    }
                    opened = Some(id);
                }
            }
            2 => {
                if let Some(id) = stream {
                    let _ = c.write(id, Bytes::copy_from_slice(data));
                }
            }
            3 => {
                if let Some(id) = stream {
                    let _ = c.finish(id);
                }
            }
            4 => {
                if let Some(id) = stream {
                    let _ = c.reset_stream(id, code);
                }
            }
            5 => {
                if let Some(id) = stream {
                    let _ = c.stop_stream(id, code);
                }
            }
            6 => {
                let _ = c.send_datagram(Bytes::copy_from_slice(data));
            }
            7 => {
                let _ = c.initiate_key_update();
            }
            8 => c.close(now, code, data),
            9 => {
                let _ = c.migrate(now, None);
            }
            _ => {
                for &id in &streams {
                    read_all(c, id);
                }
                let _ = c.stats();
                let _ = c.flow_control();
                let _ = format!("{c:?}");
            }
        });
        if let Some(id) = opened
            && self.streams[who as usize].len() < 64
        {
            self.streams[who as usize].push(id);
        }
    }
}

fn read_all(c: &mut Connection, id: StreamId) {
    for _ in 0..10_000 {
        match c.read(id, usize::MAX) {
            Ok(Some(b)) => assert!(!b.is_empty(), "read of {id:?} returned no bytes"),
            Ok(None) | Err(_) => return,
        }
    }
    panic!("reading {id:?} never ends");
}

/// XORs the body's `(pos u16 LE, xor)` triples into `d`.
fn flip(d: &mut [u8], body: &[u8]) {
    if d.is_empty() {
        return;
    }
    let len = d.len();
    for t in body.chunks_exact(3) {
        let pos = usize::from(u16::from_le_bytes([t[0], t[1]]));
        d[pos % len] ^= t[2];
    }
}

/// At least the connection's PTO on its active path (RFC 9002 §6.2.1), without backoff.
fn pto_estimate(c: &Connection) -> Duration {
    let s = c.stats();
    let max_ack_delay = c
        .peer_params()
        .map_or(Duration::from_millis(25), |p| p.max_ack_delay_duration());
    s.path.rtt + (s.path.rtt_var * 4).max(Duration::from_millis(1)) + max_ack_delay
}

/// `KUAI_FUZZ_DEBUG=1` prints each operation and every event, to follow a reproducer.
fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("KUAI_FUZZ_DEBUG").is_some())
}

fn pattern(len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
}

fuzz_target!(|data: &[u8]| {
    let Some((&config, mut rest)) = data.split_first() else {
        return;
    };
    let target = if config & 1 == 0 {
        Who::Server
    } else {
        Who::Client
    };
    let gso = 1 + usize::from((config >> 1) & 3);
    let mut h = Harness::new(target, gso);
    for _ in 0..MAX_OPS {
        let [op, len, tail @ ..] = rest else { break };
        let n = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(n);
        rest = next;
        h.run(*op, body);
        h.settle();
        h.check();
        if debug() {
            for who in BOTH {
                if let Some(c) = h.conn(who) {
                    let s = c.stats();
                    eprintln!(
                        "  {who:?}: closed {} ({:?}), {} connection(s), rx {} tx {} dropped {}, \
                         rtt {:?}",
                        c.is_closed(),
                        c.close_reason(),
                        h.eps[who as usize].connection_count(),
                        s.packets_received,
                        s.packets_sent,
                        s.packets_dropped,
                        s.path.rtt
                    );
                }
            }
        }
    }
    h.quiesce();
});
