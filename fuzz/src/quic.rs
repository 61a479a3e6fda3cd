//! The harness of the `connection` and `handshake` targets: a client and a server
//! [`Endpoint`] on a virtual clock and a virtual network, the keys to read and forge their
//! packets, and the invariants checked after every operation.
//!
//! # The network
//!
//! The server is at `10.0.0.1:443`, the client at `10.0.0.2:50000` and, from another port,
//! `10.0.0.2:50001` (NAT rebinding, migration). A datagram an endpoint sends to one of the
//! other endpoint's two addresses reaches it (from the sender's main address); a datagram sent
//! anywhere else — the two *victim* addresses `192.0.2.66:7000` and `192.0.2.66:7001`, which
//! the fuzzer uses as spoofed sources — is lost. In the `connection` target datagrams are
//! delivered as soon as they are sent; in the `handshake` target they wait on the wire (one
//! queue per direction) until an operation delivers, drops, duplicates or reorders them.
//!
//! # Keys
//!
//! The fuzzer reads (and seals) every packet the two endpoints exchange: Initial keys come from
//! the client's first Destination Connection ID (RFC 9001 §5.2), or from a Retry's Source
//! Connection ID; Handshake and 1-RTT keys from the client's TLS key log (the client's secrets
//! are both sides' secrets). From the client's Initials the harness gathers its ClientHello,
//! which the `handshake` target replays in pieces from spoofed addresses.
//!
//! # Invariants (a violation panics)
//!
//! Besides those of the `connection` target (see its documentation):
//!
//! - **Amplification** (RFC 9000 §8.1, §8.2.1, §9.3, §10.3, §21.1.1.1): for each endpoint and
//!   each remote address the endpoint has not validated, the bytes of all the datagrams it sent
//!   to that address — from any connection, on or off the active path, and the endpoint's
//!   stateless answers (Version Negotiation, Retry, CONNECTION_CLOSE, stateless reset) — never
//!   exceed three times the bytes of the datagrams it received from that address. Checked at
//!   every datagram sent. The harness decides what is validated on its own, from what it sees
//!   on the wire, never from the endpoint's state: the server's own address for the client
//!   (which chose it); for the server, an address it sent an Initial to and then received a
//!   Handshake packet from that opens with the client's Handshake keys (§8.1), an address an
//!   Initial came from with a token that `token::validate` accepts for it (§8.1.3), and an
//!   address it sent a PATH_CHALLENGE to whose data came back in a PATH_RESPONSE (§8.2.2, on
//!   any path). A victim address is never validated: nothing sent there is delivered.
//! - **Memory**: the heap (counted by [`crate::alloc`]) never grows by more than
//!   [`MEM_BOUND`] during one input, the harness's setup included.
//!
//! `KUAI_FUZZ_SKIP` (comma-separated) turns off checks, so a campaign can go past a finding
//! while its fix lands. Those it names were all found and are all fixed (the fix named after
//! each), so nothing is skipped by default: `path-response` leaves datagrams that carry a
//! PATH_RESPONSE out of the amplification count (issue 17 finding 1; 7d966f9); `ack-loop` cuts an
//! exchange that passes `MAX_DATAGRAMS` with only non-ack-eliciting datagrams for the last 100
//! (the endpoints acknowledging each other's ACK-only Initial or Handshake packets forever, found
//! by this target; 5ff0cda) instead of failing; `stuck-initial` lets a server connection that never
//! processed a packet and has no timer outlive the input (a server connection made for an
//! Initial that fails packet protection is never removed, found by this target; 9e05e1b); `recount`
//! allows 9x instead of 3x (issue 17 finding 7: packets that could not be decrypted count
//! toward the budget again each time they are retried, up to three times; 71b93e8); `memory` turns the
//! memory check off, `amplification` the whole amplification check.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kuai_proto::cid::ConnectionIdGenerator;
use kuai_proto::config::{
    ClientConfig, EndpointConfig, RetryPolicy, ServerConfig, TransportConfig,
};
use kuai_proto::connection::EcnCodepoint;
use kuai_proto::crypto::{self, CapturedSecrets, KeyPair, OneRttKeys, SuiteAlgs};
use kuai_proto::frame::{Frame, FrameIter};
use kuai_proto::packet::{self, DecryptedPacket, LongType, PacketType, PartialDecode};
use kuai_proto::token::{self, TokenKey};
use kuai_proto::{
    Connection, ConnectionHandle, ConnectionId, Endpoint, Event, Side, StreamEvent, StreamId,
    Version,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::quic::{HeaderProtectionKey, PacketKey};

use crate::alloc;

/// Datagrams one exchange may take before it counts as endless.
pub const MAX_DATAGRAMS: usize = 1000;
/// Rounds of `handle_timeout` at one instant without a datagram sent and without the overdue
/// deadline moving forward before it is a livelock.
const MAX_STALLED_ROUNDS: u32 = 3;
/// Rounds of `handle_timeout` at one instant without a datagram sent, the deadline moving or
/// not, before it is a livelock.
const MAX_SILENT_ROUNDS: u32 = 64;
/// Deadlines stepped through by one clock operation before jumping to its end.
const MAX_CLOCK_STEPS: usize = 2000;
/// Timer firings in the final run-down before it counts as a timer storm.
const MAX_QUIESCE_STEPS: usize = 10_000;
/// Length of the connection IDs both endpoints issue.
pub const CID_LEN: usize = 8;
const UNIX_MS: u64 = 1_700_000_000_000;
const ALPN: &[u8] = b"kuai-fuzz";
const SERVER_RESET_KEY: [u8; 32] = [0x5e; 32];
const CLIENT_RESET_KEY: [u8; 32] = [0xc1; 32];
const TOKEN_SECRET: [u8; 32] = [0x70; 32];
/// The most the heap may grow during one input. Honest inputs need about 100 KB in the
/// `connection` target (two endpoints, the handshake, streams) and at most 2.4 MB in the
/// `handshake` target: 127 half-open handshakes from spoofed addresses (about 19 KB each), the
/// most one input can open (`fuzz/seeds/handshake/spoof_flood.bin`).
pub const MEM_BOUND: usize = 4 << 20;
/// PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410): the certificate's key is fixed, so the
/// certificate is the same in every process (Ed25519 signatures are deterministic).
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
const ED25519_SEED: [u8; 32] = *b"kuai fuzz connection target key!";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Who {
    Server = 0,
    Client = 1,
}

impl Who {
    pub fn other(self) -> Who {
        match self {
            Who::Server => Who::Client,
            Who::Client => Who::Server,
        }
    }

    pub fn addr(self) -> SocketAddr {
        match self {
            Who::Server => "10.0.0.1:443".parse().unwrap(),
            Who::Client => "10.0.0.2:50000".parse().unwrap(),
        }
    }

    /// The same host from another port (NAT rebinding, migration).
    pub fn alt_addr(self) -> SocketAddr {
        let mut a = self.addr();
        a.set_port(a.port() + 1);
        a
    }

    /// Whether datagrams sent to `a` reach this endpoint.
    pub fn owns(self, a: SocketAddr) -> bool {
        a == self.addr() || a == self.alt_addr()
    }

    fn reset_key(self) -> &'static [u8; 32] {
        match self {
            Who::Server => &SERVER_RESET_KEY,
            Who::Client => &CLIENT_RESET_KEY,
        }
    }
}

pub const BOTH: [Who; 2] = [Who::Server, Who::Client];

/// Addresses where nobody listens: spoofed sources. What is sent there is lost.
pub fn victim(i: usize) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 66], 7000 + (i % 2) as u16))
}

/// The source of a datagram made by the fuzzer for the target, by `sel & 3`: the peer's
/// address, the peer's other port, or one of the two victims.
pub fn source(peer: Who, sel: u8) -> SocketAddr {
    match sel & 3 {
        0 => peer.addr(),
        1 => peer.alt_addr(),
        n => victim(usize::from(n - 2)),
    }
}

/// Checks turned off by `KUAI_FUZZ_SKIP` while known findings are being fixed.
#[derive(Debug, Default)]
pub struct Skips {
    pub path_response: bool,
    pub memory: bool,
    pub amplification: bool,
    pub ack_loop: bool,
    pub stuck_initial: bool,
    pub recount: bool,
}

pub fn skips() -> &'static Skips {
    static S: OnceLock<Skips> = OnceLock::new();
    S.get_or_init(|| {
        let v = std::env::var("KUAI_FUZZ_SKIP").unwrap_or_default();
        let has = |k: &str| v.split(',').any(|x| x.trim() == k);
        Skips {
            path_response: has("path-response"),
            memory: has("memory"),
            amplification: has("amplification"),
            ack_loop: has("ack-loop"),
            stuck_initial: has("stuck-initial"),
            recount: has("recount"),
        }
    })
}

/// `KUAI_FUZZ_DEBUG=1` prints each operation and every event, to follow a reproducer.
pub fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("KUAI_FUZZ_DEBUG").is_some())
}

// ---------------------------------------------------------------------------------------------
// Set up once per process

/// Server configurations the `handshake` target picks from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerVariant {
    /// kuai's defaults: no Retry, 10,000 handshakes at once.
    Default = 0,
    /// Retry for every Initial without a token.
    RetryAlways = 1,
    /// Retry once one handshake is in flight.
    RetryAboveOne = 2,
    /// One handshake at once, then CONNECTION_REFUSED.
    RefuseAboveOne = 3,
}

impl ServerVariant {
    pub fn from_bits(b: u8) -> Self {
        match b & 3 {
            0 => Self::Default,
            1 => Self::RetryAlways,
            2 => Self::RetryAboveOne,
            _ => Self::RefuseAboveOne,
        }
    }
}

struct Shared {
    base: Instant,
    servers: [Arc<ServerConfig>; 4],
    client: ClientConfig,
    server_ep: Arc<EndpointConfig>,
    client_ep: Arc<EndpointConfig>,
}

/// Secrets of the latest handshake, from the client's TLS key log.
#[derive(Default)]
struct LoggedSecrets {
    client_handshake: Vec<u8>,
    server_handshake: Vec<u8>,
    client_traffic: Vec<u8>,
    server_traffic: Vec<u8>,
}

static SECRETS: Mutex<LoggedSecrets> = Mutex::new(LoggedSecrets {
    client_handshake: Vec::new(),
    server_handshake: Vec::new(),
    client_traffic: Vec::new(),
    server_traffic: Vec::new(),
});

fn secrets() -> std::sync::MutexGuard<'static, LoggedSecrets> {
    SECRETS.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug)]
struct FuzzKeyLog;

impl rustls::KeyLog for FuzzKeyLog {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        let mut s = secrets();
        let slot = match label {
            "CLIENT_HANDSHAKE_TRAFFIC_SECRET" => &mut s.client_handshake,
            "SERVER_HANDSHAKE_TRAFFIC_SECRET" => &mut s.server_handshake,
            "CLIENT_TRAFFIC_SECRET_0" => &mut s.client_traffic,
            "SERVER_TRAFFIC_SECRET_0" => &mut s.server_traffic,
            _ => return,
        };
        *slot = secret.to_vec();
    }

    fn will_log(&self, label: &str) -> bool {
        matches!(
            label,
            "CLIENT_HANDSHAKE_TRAFFIC_SECRET"
                | "SERVER_HANDSHAKE_TRAFFIC_SECRET"
                | "CLIENT_TRAFFIC_SECRET_0"
                | "SERVER_TRAFFIC_SECRET_0"
        )
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
        let server_tls = Arc::new(server_tls);
        let server = |variant: ServerVariant| {
            let mut server = ServerConfig::new(server_tls.clone());
            server.transport = transport.clone();
            server.token_key = Arc::new(TokenKey::new(&TOKEN_SECRET));
            match variant {
                ServerVariant::Default => {}
                ServerVariant::RetryAlways => server.retry = RetryPolicy::Always,
                ServerVariant::RetryAboveOne => server.retry = RetryPolicy::AboveHandshakes(1),
                ServerVariant::RefuseAboveOne => server.max_handshakes = 1,
            }
            Arc::new(server)
        };
        let mut client = ClientConfig::new(Arc::new(client_tls));
        client.transport = transport.clone();

        Shared {
            base: Instant::now(),
            servers: [
                server(ServerVariant::Default),
                server(ServerVariant::RetryAlways),
                server(ServerVariant::RetryAboveOne),
                server(ServerVariant::RefuseAboveOne),
            ],
            client,
            server_ep: endpoint_config(Who::Server),
            client_ep: endpoint_config(Who::Client),
        }
    })
}

/// The instant every input starts at.
pub fn base() -> Instant {
    shared().base
}

// ---------------------------------------------------------------------------------------------
// The harness

/// A 1-RTT packet opened with the mirrored keys.
pub struct Opened {
    pub pn: u64,
    pub pn_len: usize,
    pub key_phase: bool,
    pub spin: bool,
    pub fixed_bit: bool,
    pub dcid: ConnectionId,
    pub payload: Bytes,
}

/// A datagram on the wire (`handshake` target).
#[derive(Clone)]
pub struct Pending {
    pub from: SocketAddr,
    pub ecn: Option<EcnCodepoint>,
    pub data: Vec<u8>,
}

/// Bytes exchanged with one remote address, as one endpoint sees them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Budget {
    pub rx: u64,
    pub tx: u64,
    pub validated: bool,
}

/// A packet space the harness can seal in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Initial = 0,
    Handshake = 1,
}

pub struct Harness {
    pub now: Instant,
    pub eps: [Endpoint; 2],
    /// The connection of the real handshake, per endpoint.
    pub main: [Option<ConnectionHandle>; 2],
    pub target: Who,
    /// Datagrams per `poll_transmit`.
    pub gso: usize,
    buf: Vec<u8>,
    /// 1-RTT keys like the client's (`local` = client to server), one copy per sender so each
    /// follows that sender's key updates.
    pub mirrors: Option<[OneRttKeys; 2]>,
    /// Handshake keys like the client's.
    pub hs_keys: Option<KeyPair>,
    /// Largest 1-RTT packet number opened per sender, to expand truncated ones.
    pub largest_pn: [Option<u64>; 2],
    /// Largest Initial and Handshake packet numbers opened per sender.
    pub long_pn: [[Option<u64>; 2]; 2],
    /// DCID of the last 1-RTT packet each side sent.
    pub last_dcid: [Option<ConnectionId>; 2],
    /// DCID and SCID of the last long-header packet each side sent.
    pub long_cids: [Option<(ConnectionId, ConnectionId)>; 2],
    /// The DCID of the client's first Initial (its Initial keys come from it).
    pub odcid: Option<ConnectionId>,
    /// CIDs Initial keys may be derived from: `odcid`, then Retry SCIDs; the last one that
    /// opened a client Initial is `initial_key_cid`.
    pub initial_cids: Vec<ConnectionId>,
    pub initial_key_cid: Option<ConnectionId>,
    /// The client's ClientHello, as gathered from its Initials' CRYPTO frames from offset 0.
    pub client_hello: Vec<u8>,
    /// Tokens of the Retry packets the server sent.
    pub retry_tokens: Vec<Bytes>,
    /// Datagrams the target received, newest last.
    pub history: VecDeque<Vec<u8>>,
    pub streams: [Vec<StreamId>; 2],
    /// Datagrams sent in the current exchange.
    exchanged: usize,
    /// Datagrams sent in a row that carried no ack-eliciting frame the harness could see.
    non_eliciting_run: usize,
    /// The current exchange was cut (`ack-loop`): what is sent is lost until it ends.
    cut: bool,
    /// Datagrams wait on the wire until an operation delivers them (`handshake` target).
    pub queued: bool,
    /// The wire, per receiving endpoint.
    pub wire: [VecDeque<Pending>; 2],
    /// Per endpoint: bytes exchanged with each remote address.
    pub acct: [HashMap<SocketAddr, Budget>; 2],
    /// Per endpoint: PATH_CHALLENGE data it sent, with the address sent to.
    challenges: [Vec<(SocketAddr, [u8; 8])>; 2],
    /// The largest PTO estimate any connection had at a check: an idle timer armed then may
    /// run 3 x that PTO (RFC 9000 §10.1), even after a path change brought a smaller one.
    max_pto: Duration,
    /// Addresses the server sent an Initial packet to.
    server_initials_to: Vec<SocketAddr>,
    server_variant: ServerVariant,
    /// Heap in use when the input started.
    mem_base: usize,
}

impl Harness {
    /// A client and a server with a finished handshake and streams both ways (`connection`).
    pub fn established(target: Who, gso: usize, mem_base: usize) -> Self {
        let mut h = Self::bare(target, gso, ServerVariant::Default, mem_base);
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
        h.refresh_keys();
        assert!(
            h.mirrors.is_some(),
            "setup: no 1-RTT secrets in the key log"
        );

        // Streams both ways, with data in flight and some already read.
        let mut opened = Vec::new();
        h.with_conn(Who::Client, |c, _| {
            let id = c
                .open_stream(kuai_proto::Dir::Bi)
                .expect("client bidi stream");
            c.write(id, pattern(1500)).unwrap();
            opened.push(id);
            let id = c
                .open_stream(kuai_proto::Dir::Uni)
                .expect("client uni stream");
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
            let id = c
                .open_stream(kuai_proto::Dir::Bi)
                .expect("server bidi stream");
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

    /// A client that has just called `connect`, its first flight on the wire to a server that
    /// has seen nothing yet (`handshake`).
    pub fn handshaking(target: Who, gso: usize, variant: ServerVariant, mem_base: usize) -> Self {
        let mut h = Self::bare(target, gso, variant, mem_base);
        h.queued = true;
        h.flush();
        assert!(
            h.client_hello_complete(),
            "setup: no ClientHello in the client's first flight"
        );
        h.check();
        h
    }

    fn bare(target: Who, gso: usize, variant: ServerVariant, mem_base: usize) -> Self {
        let sh = shared();
        *secrets() = LoggedSecrets::default();
        let now = sh.base;
        let server = Endpoint::new(
            sh.server_ep.clone(),
            Some(sh.servers[variant as usize].clone()),
            now,
            UNIX_MS,
            Some(1),
        );
        let mut client = Endpoint::new(sh.client_ep.clone(), None, now, UNIX_MS, Some(2));
        let ch = client
            .connect(now, &sh.client, Who::Server.addr(), "localhost")
            .expect("connect");
        let mut acct = [HashMap::new(), HashMap::new()];
        // The client chose the server's address.
        acct[Who::Client as usize].insert(
            Who::Server.addr(),
            Budget {
                validated: true,
                ..Budget::default()
            },
        );
        Harness {
            now,
            eps: [server, client],
            main: [None, Some(ch)],
            target,
            gso,
            buf: Vec::new(),
            mirrors: None,
            hs_keys: None,
            largest_pn: [None; 2],
            long_pn: [[None; 2]; 2],
            last_dcid: [None, None],
            long_cids: [None, None],
            odcid: None,
            initial_cids: Vec::new(),
            initial_key_cid: None,
            client_hello: Vec::new(),
            retry_tokens: Vec::new(),
            history: VecDeque::new(),
            streams: [Vec::new(), Vec::new()],
            exchanged: 0,
            non_eliciting_run: 0,
            cut: false,
            queued: false,
            wire: [VecDeque::new(), VecDeque::new()],
            acct,
            challenges: [Vec::new(), Vec::new()],
            max_pto: Duration::ZERO,
            server_initials_to: Vec::new(),
            server_variant: variant,
            mem_base,
        }
    }

    pub fn ep(&mut self, who: Who) -> &mut Endpoint {
        &mut self.eps[who as usize]
    }

    pub fn conn(&self, who: Who) -> Option<&Connection> {
        self.eps[who as usize].connection(self.main[who as usize]?)
    }

    pub fn with_conn(&mut self, who: Who, f: impl FnOnce(&mut Connection, Instant)) {
        let now = self.now;
        let Some(h) = self.main[who as usize] else {
            return;
        };
        if let Some(c) = self.eps[who as usize].connection_mut(h) {
            f(c, now);
        }
    }

    /// Whether the whole ClientHello was seen.
    pub fn client_hello_complete(&self) -> bool {
        let ch = &self.client_hello;
        ch.len() >= 4 && {
            let len = (usize::from(ch[1]) << 16) | (usize::from(ch[2]) << 8) | usize::from(ch[3]);
            ch.len() >= 4 + len
        }
    }

    /// The time the endpoints put into address-validation tokens at `now`.
    fn unix_ms(&self) -> u64 {
        UNIX_MS + self.now.saturating_duration_since(base()).as_millis() as u64
    }

    // -----------------------------------------------------------------------------------------
    // Keys

    /// Derives the Handshake and 1-RTT keys once the client's key log has their secrets.
    pub fn refresh_keys(&mut self) {
        if self.hs_keys.is_some() && self.mirrors.is_some() {
            return;
        }
        let Some(version) = self.conn(Who::Client).map(|c| c.version()) else {
            return;
        };
        let s = secrets();
        let captured = CapturedSecrets {
            client_handshake: s.client_handshake.clone(),
            server_handshake: s.server_handshake.clone(),
            client_traffic: s.client_traffic.clone(),
            server_traffic: s.server_traffic.clone(),
        };
        drop(s);
        let algs = SuiteAlgs::of(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256).unwrap();
        if self.hs_keys.is_none() {
            self.hs_keys = crypto::derived_handshake_keys(algs, version, &captured);
        }
        if self.mirrors.is_none() && !captured.client_traffic.is_empty() {
            // The mirrors keep their next phase's keys at hand (`open` and `seal` use them).
            let derive = || {
                let mut k = OneRttKeys::derived(algs, version, &captured)?;
                k.prepare_next();
                Some(k)
            };
            if let (Some(a), Some(b)) = (derive(), derive()) {
                self.mirrors = Some([a, b]);
            }
        }
    }

    /// Runs `f` with the header and packet keys `sender` uses in `space` (Initial keys from
    /// `cid`, or from the one the client's Initials use).
    fn with_long_keys<R>(
        &self,
        space: Space,
        sender: Who,
        version: Version,
        cid: Option<&ConnectionId>,
        f: impl FnOnce(&dyn HeaderProtectionKey, &dyn PacketKey) -> R,
    ) -> Option<R> {
        match space {
            Space::Initial => {
                let cid = cid.or(self.initial_key_cid.as_ref())?;
                let k = packet::initial_keys(version, cid, Side::Client);
                let d = match sender {
                    Who::Client => &k.local,
                    Who::Server => &k.remote,
                };
                Some(f(d.header.as_ref(), d.packet.as_ref()))
            }
            Space::Handshake => {
                let k = self.hs_keys.as_ref()?;
                let d = match sender {
                    Who::Client => &k.local,
                    Who::Server => &k.remote,
                };
                Some(f(d.header.as_ref(), d.packet.as_ref()))
            }
        }
    }

    /// Opens a long-header packet `sender` sent in `space`, trying every CID Initial keys may
    /// come from. Returns the packet and, for Initials, the CID whose keys opened it.
    fn open_long(
        &self,
        space: Space,
        sender: Who,
        bytes: &[u8],
    ) -> Option<(DecryptedPacket, Option<ConnectionId>)> {
        let largest = self.long_pn[sender as usize][space as usize];
        let (pd, _) = PartialDecode::new(BytesMut::from(bytes), CID_LEN).ok()?;
        let version = Version::from_wire(pd.version()?)?;
        drop(pd);
        let try_keys = |cid: Option<&ConnectionId>| {
            self.with_long_keys(space, sender, version, cid, |hp, key| {
                // The largest packet number seen may come from packets the fuzzer made that
                // the endpoint never took (a number far ahead): the truncated number of a real
                // packet then expands wrong. Try as the endpoint may, from none seen too.
                [largest, None].into_iter().find_map(|largest| {
                    let (pd, _) = PartialDecode::new(BytesMut::from(bytes), CID_LEN).ok()?;
                    pd.unprotect(hp, largest).ok()?.decrypt(key).ok()
                })
            })
            .flatten()
        };
        match space {
            Space::Handshake => try_keys(None).map(|p| (p, None)),
            Space::Initial => self
                .initial_cids
                .iter()
                .rev()
                .find_map(|c| try_keys(Some(c)).map(|p| (p, Some(*c)))),
        }
    }

    /// Opens a 1-RTT packet `from` sent with the mirrored keys. With `commit`, follows a key
    /// update when the packet shows the next key phase and opens with the next keys, and
    /// records its packet number and DCID.
    pub fn open(&mut self, from: Who, d: &[u8], commit: bool) -> Option<Opened> {
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
        let next_keys;
        let keys = if next {
            next_keys = mirror.derive_next();
            &next_keys
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
        if commit {
            if next {
                mirror.update();
                mirror.prepare_next();
            }
            self.largest_pn[f] = Some(largest.map_or(pn, |l| l.max(pn)));
            self.last_dcid[f] = Some(dcid);
        }
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
    pub fn seal(&self, from: Who, o: &Opened, frames: &[u8], flip_phase: bool) -> Option<Vec<u8>> {
        let mirror = &self.mirrors.as_ref()?[from as usize];
        let next_keys;
        let keys = if flip_phase {
            next_keys = mirror.derive_next();
            &next_keys
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

    /// Seals `frames` as a long-header packet of `sender` in `space`, with Initial keys from
    /// `key_cid` (or the client's).
    #[allow(clippy::too_many_arguments)]
    pub fn seal_long(
        &self,
        space: Space,
        sender: Who,
        version: Version,
        key_cid: Option<&ConnectionId>,
        dcid: &ConnectionId,
        scid: &ConnectionId,
        token: &[u8],
        pn: u64,
        pn_len: usize,
        frames: &[u8],
    ) -> Option<Vec<u8>> {
        let ty = match space {
            Space::Initial => LongType::Initial,
            Space::Handshake => LongType::Handshake,
        };
        self.with_long_keys(space, sender, version, key_cid, |hp, key| {
            let mut buf = Vec::with_capacity(frames.len() + 64 + token.len());
            let pos = packet::write_long_header(
                &mut buf,
                version,
                ty,
                dcid,
                scid,
                token,
                pn,
                pn_len.clamp(1, 4),
            );
            buf.extend_from_slice(frames);
            while buf.len() < pos.payload_offset() + 4 {
                buf.push(0);
            }
            packet::seal_packet(&mut buf, &pos, pn, hp, key).ok()?;
            Some(buf)
        })
        .flatten()
    }

    /// Opens every packet of a datagram `from` sent that the harness has keys for, re-seals
    /// packet `which` (modulo their number) with `edit` applied to its frames, and returns the
    /// datagram. Packets that cannot be opened or sealed are kept as they were.
    pub fn reseal(
        &mut self,
        from: Who,
        d: &[u8],
        which: usize,
        flip_phase: bool,
        edit: impl FnOnce(&[u8]) -> Vec<u8>,
    ) -> Vec<u8> {
        let packets = split_packets(d);
        let n = packets.len().max(1);
        let pick = which % n;
        let mut out = Vec::with_capacity(d.len() + 256);
        let mut edit = Some(edit);
        for (i, p) in packets.iter().enumerate() {
            let sealed = if i == pick {
                self.reseal_one(from, p, flip_phase, edit.take().expect("once"))
            } else {
                None
            };
            out.extend_from_slice(sealed.as_deref().unwrap_or(p));
        }
        // A client's Initial datagram stays at least as long as it was (RFC 9000 §14.1).
        if out.len() < d.len() && d.len() >= packet::MIN_INITIAL_SIZE {
            out.resize(d.len(), 0);
        }
        out
    }

    fn reseal_one(
        &mut self,
        from: Who,
        p: &[u8],
        flip_phase: bool,
        edit: impl FnOnce(&[u8]) -> Vec<u8>,
    ) -> Option<Vec<u8>> {
        let first = *p.first()?;
        if first & 0x80 == 0 {
            let o = self.open(from, p, false)?;
            let frames = edit(&o.payload);
            return self.seal(from, &o, &frames, flip_phase);
        }
        let (pd, _) = PartialDecode::new(BytesMut::from(p), CID_LEN).ok()?;
        let space = match pd.ty() {
            PacketType::Long(LongType::Initial) => Space::Initial,
            PacketType::Long(LongType::Handshake) => Space::Handshake,
            _ => return None,
        };
        let version = Version::from_wire(pd.version()?)?;
        drop(pd);
        let (o, key_cid) = self.open_long(space, from, p)?;
        let frames = edit(&o.payload);
        let scid = o.header.src_cid?;
        self.seal_long(
            space,
            from,
            version,
            key_cid.as_ref(),
            &o.header.dst_cid,
            &scid,
            &o.token,
            o.header.pn,
            o.header.pn_len,
            &frames,
        )
    }

    // -----------------------------------------------------------------------------------------
    // Traffic

    /// Hands a datagram to `to`.
    pub fn deliver(&mut self, to: Who, from: SocketAddr, ecn: Option<EcnCodepoint>, data: &[u8]) {
        if to == self.target {
            if self.history.len() == 32 {
                self.history.pop_front();
            }
            self.history.push_back(data.to_vec());
        }
        self.refresh_keys();
        self.received(to, from, data);
        let now = self.now;
        self.ep(to)
            .handle_datagram(now, from, None, ecn, BytesMut::from(data));
        self.refresh_keys();
    }

    /// Counts a datagram `to` received from `from`, and marks addresses validated by what it
    /// carries.
    fn received(&mut self, to: Who, from: SocketAddr, data: &[u8]) {
        let b = self.acct[to as usize].entry(from).or_default();
        b.rx += data.len() as u64;
        let from_validated = b.validated;
        let pending_challenges = !self.challenges[to as usize].is_empty();
        if from_validated && !pending_challenges {
            return;
        }
        let sender = to.other();
        for p in split_packets(data) {
            let Some(&first) = p.first() else { break };
            if first & 0x80 == 0 {
                if !pending_challenges {
                    continue;
                }
                let Some(o) = self.open(sender, p, false) else {
                    continue;
                };
                for f in FrameIter::new(o.payload).map_while(Result::ok) {
                    if let Frame::PathResponse(d) = f {
                        let validated: Vec<SocketAddr> = self.challenges[to as usize]
                            .iter()
                            .filter(|(_, c)| *c == d)
                            .map(|(a, _)| *a)
                            .collect();
                        for a in validated {
                            self.validate(to, a, "PATH_RESPONSE");
                        }
                    }
                }
                continue;
            }
            if to != Who::Server || from_validated {
                continue;
            }
            let Ok((pd, _)) = PartialDecode::new(BytesMut::from(p), CID_LEN) else {
                continue;
            };
            match pd.ty() {
                PacketType::Long(LongType::Initial) if !pd.token().is_empty() => {
                    let key = &shared().servers[self.server_variant as usize];
                    if token::validate(
                        &key.token_key,
                        pd.token(),
                        from,
                        true,
                        self.unix_ms(),
                        key.retry_token_lifetime,
                        key.new_token_lifetime,
                    )
                    .is_ok()
                    {
                        self.validate(to, from, "token");
                    }
                }
                PacketType::Long(LongType::Handshake)
                    if self.server_initials_to.contains(&from)
                        && self.open_long(Space::Handshake, sender, p).is_some() =>
                {
                    self.validate(to, from, "Handshake packet");
                }
                _ => {}
            }
        }
    }

    fn validate(&mut self, who: Who, a: SocketAddr, why: &str) {
        let b = self.acct[who as usize].entry(a).or_default();
        if !b.validated && debug() {
            eprintln!("  {who:?} validated {a} ({why})");
        }
        b.validated = true;
    }

    /// Counts a datagram `from` sent to `to`, follows its packets, and checks the
    /// anti-amplification limit.
    fn sent(&mut self, from: Who, to: SocketAddr, d: &[u8]) {
        let (path_response, eliciting) = self.observe(from, to, d);
        if eliciting {
            self.non_eliciting_run = 0;
        } else {
            self.non_eliciting_run += 1;
        }
        let sk = skips();
        if sk.amplification || (sk.path_response && path_response) {
            return;
        }
        let factor = if sk.recount { 9 } else { 3 };
        let b = self.acct[from as usize].entry(to).or_default();
        b.tx += d.len() as u64;
        if !b.validated && b.tx > factor * b.rx {
            let b = *b;
            panic!(
                "amplification: the {from:?} sent {} bytes to {to}, which it has not validated, \
                 for {} bytes received from it (more than {factor}x, RFC 9000 §8); the last \
                 datagram: {} bytes, first byte {:#04x}{}; per address: {:?}",
                b.tx,
                b.rx,
                d.len(),
                d[0],
                if path_response {
                    " (carries a PATH_RESPONSE)"
                } else {
                    ""
                },
                self.acct[from as usize]
            );
        }
    }

    /// Follows the packets `from` sends to `to`: packet numbers, CIDs, key phases, the
    /// ClientHello, Retry tokens and path challenges. Returns whether the datagram carries a
    /// PATH_RESPONSE, and whether it may be ack-eliciting (true unless every packet was opened
    /// and none had an ack-eliciting frame).
    fn observe(&mut self, from: Who, to: SocketAddr, d: &[u8]) -> (bool, bool) {
        let mut path_response = false;
        let mut eliciting = false;
        let f = from as usize;
        for p in split_packets(d) {
            let Some(&first) = p.first() else { break };
            if first & 0x80 == 0 {
                let Some(o) = self.open(from, p, true) else {
                    eliciting = true;
                    continue;
                };
                debug_frames(from, "1-RTT", o.pn, &o.payload);
                eliciting |= any_eliciting(&o.payload);
                for fr in FrameIter::new(o.payload).map_while(Result::ok) {
                    match fr {
                        Frame::PathChallenge(c) => {
                            let ch = &mut self.challenges[f];
                            if ch.len() == 64 {
                                ch.remove(0);
                            }
                            ch.push((to, c));
                        }
                        Frame::PathResponse(_) => path_response = true,
                        _ => {}
                    }
                }
                continue;
            }
            let Ok((pd, _)) = PartialDecode::new(BytesMut::from(p), CID_LEN) else {
                eliciting = true;
                continue;
            };
            let space = match pd.ty() {
                PacketType::Long(LongType::Initial) => Space::Initial,
                PacketType::Long(LongType::Handshake) => Space::Handshake,
                PacketType::Long(LongType::Retry) => {
                    eliciting = true;
                    if from == Who::Server && self.retry_tokens.len() < 8 {
                        self.retry_tokens.push(Bytes::copy_from_slice(pd.token()));
                        if let Some(scid) = pd.src_cid() {
                            self.add_initial_cid(scid);
                        }
                    }
                    continue;
                }
                _ => {
                    eliciting = true;
                    continue;
                }
            };
            if space == Space::Initial && from == Who::Client && self.odcid.is_none() {
                let dcid = pd.dst_cid();
                self.odcid = Some(dcid);
                self.add_initial_cid(dcid);
            }
            if space == Space::Initial
                && from == Who::Server
                && !self.server_initials_to.contains(&to)
            {
                self.server_initials_to.push(to);
            }
            drop(pd);
            let Some((o, key_cid)) = self.open_long(space, from, p) else {
                eliciting = true;
                continue;
            };
            debug_frames(from, &format!("{space:?}"), o.header.pn, &o.payload);
            eliciting |= any_eliciting(&o.payload);
            let slot = &mut self.long_pn[f][space as usize];
            *slot = Some(slot.map_or(o.header.pn, |l| l.max(o.header.pn)));
            if let Some(scid) = o.header.src_cid {
                self.long_cids[f] = Some((o.header.dst_cid, scid));
            }
            if space == Space::Initial && from == Who::Client {
                if key_cid.is_some() {
                    self.initial_key_cid = key_cid;
                }
                if !self.client_hello_complete() {
                    for fr in FrameIter::new(o.payload).map_while(Result::ok) {
                        if let Frame::Crypto { offset, data } = fr {
                            let have = self.client_hello.len() as u64;
                            let end = offset + data.len() as u64;
                            if offset <= have && end > have {
                                self.client_hello
                                    .extend_from_slice(&data[(have - offset) as usize..]);
                            }
                        }
                    }
                }
            }
        }
        (path_response, eliciting)
    }

    /// Another CID the Initial keys may be derived from (a Retry's SCID).
    pub fn add_initial_cid(&mut self, cid: ConnectionId) {
        if !self.initial_cids.contains(&cid) && self.initial_cids.len() < 8 {
            self.initial_cids.push(cid);
        }
        if self.initial_key_cid.is_none() {
            self.initial_key_cid = Some(cid);
        }
    }

    /// Sends everything `from` has: delivered to the other side (or queued on the wire), or
    /// dropped; datagrams to an address nobody has are lost.
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
                self.sent(from, t.destination, d);
                if self.exchanged > MAX_DATAGRAMS && !self.cut {
                    if skips().ack_loop && self.non_eliciting_run >= 100 {
                        // Known: ACK-only packets answering ACK-only packets (see `Skips`).
                        self.cut = true;
                    } else {
                        panic!(
                            "endless exchange: more than {MAX_DATAGRAMS} datagrams without going \
                             quiet (last from the {from:?}, {} bytes, first byte {:#04x}; the \
                             last {} carried no ack-eliciting frame)",
                            d.len(),
                            d[0],
                            self.non_eliciting_run
                        );
                    }
                }
                let to = from.other();
                let reaches = to.owns(t.destination);
                if debug() && self.exchanged <= 40 {
                    eprintln!(
                        "  {from:?} -> {}: {} bytes, first byte {:#04x}{}",
                        t.destination,
                        d.len(),
                        d[0],
                        if !deliver || !reaches {
                            " (lost)"
                        } else if self.queued {
                            " (on the wire)"
                        } else {
                            ""
                        }
                    );
                }
                if !deliver || !reaches || self.cut {
                    continue;
                }
                if self.queued {
                    self.wire[to as usize].push_back(Pending {
                        from: from.addr(),
                        ecn: t.ecn,
                        data: d.to_vec(),
                    });
                } else {
                    self.deliver(to, from.addr(), t.ecn, d);
                }
            }
            self.buf = buf;
        }
    }

    /// Until neither side has anything to send: events, then traffic both ways.
    pub fn exchange(&mut self, deliver: bool) -> usize {
        self.exchanged = 0;
        self.cut = false;
        self.exchange_more(deliver)
    }

    fn exchange_more(&mut self, deliver: bool) -> usize {
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

    /// Everything the endpoints have to send goes out (onto the wire when it is queued).
    pub fn flush(&mut self) {
        self.exchange(true);
    }

    /// Delivers everything, the wire included, until neither side has more to say.
    pub fn settle(&mut self) {
        if !self.queued {
            self.exchange(true);
            return;
        }
        self.exchanged = 0;
        self.cut = false;
        loop {
            self.exchange_more(true);
            if self.cut {
                for w in &mut self.wire {
                    w.clear();
                }
            }
            if self.wire.iter().all(VecDeque::is_empty) {
                break;
            }
            for to in BOTH {
                while let Some(p) = self.wire[to as usize].pop_front() {
                    self.deliver(to, p.from, p.ecn, &p.data);
                }
            }
        }
    }

    /// Moves up to `n` datagrams from the wire to `toward`: `how & 3` delivers them, drops
    /// them, delivers each twice, or delivers the one behind first.
    pub fn step(&mut self, toward: Who, how: u8, n: usize) {
        for _ in 0..n {
            let q = &mut self.wire[toward as usize];
            let Some(p) = q.pop_front() else { break };
            match how & 3 {
                0 => self.deliver(toward, p.from, p.ecn, &p.data),
                1 => {}
                2 => {
                    self.deliver(toward, p.from, p.ecn, &p.data);
                    self.deliver(toward, p.from, p.ecn, &p.data);
                }
                _ => {
                    if let Some(q2) = self.wire[toward as usize].pop_front() {
                        self.deliver(toward, q2.from, q2.ecn, &q2.data);
                    }
                    self.deliver(toward, p.from, p.ecn, &p.data);
                }
            }
            self.flush();
        }
    }

    pub fn handle_events(&mut self) {
        for who in BOTH {
            let w = who as usize;
            while let Some(h) = self.eps[w].accept() {
                if self.main[w].is_none()
                    && let Some(c) = self.eps[w].connection(h)
                    && Some(c.original_dcid()) == self.odcid
                    && c.remote_address() == Who::Client.addr()
                {
                    self.main[w] = Some(h);
                }
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
                            if self.streams[w].len() < 64 && Some(h) == self.main[w] {
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

    /// The peer's next datagram for the target, undelivered: the first on the wire, or a new
    /// one (queueing a DATAGRAM frame if the peer has nothing else to say). Only datagrams the
    /// peer sends to the target's addresses.
    pub fn intercept(&mut self) -> Option<Vec<u8>> {
        let peer = self.target.other();
        if let Some(p) = self.wire[self.target as usize].pop_front() {
            return Some(p.data);
        }
        self.with_conn(peer, |c, _| {
            let _ = c.send_datagram(Bytes::from_static(b"kuai"));
        });
        let now = self.now;
        let mut buf = std::mem::take(&mut self.buf);
        let t = self.eps[peer as usize].poll_transmit(now, 1, &mut buf);
        let d = t.map(|t| {
            (
                t.destination,
                buf[..t.segment_size.unwrap_or(t.size).min(t.size)].to_vec(),
            )
        });
        self.buf = buf;
        let (dest, d) = d?;
        self.sent(peer, dest, &d);
        self.target.owns(dest).then_some(d)
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
    pub fn fire_timers(&mut self, deliver: bool) {
        let now = self.now;
        let mut stalled = 0;
        let mut silent = 0;
        let mut prev: Option<Instant> = None;
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
                silent = 0;
                prev = None;
                continue;
            }
            silent += 1;
            // A deadline that moves forward (a backoff doubling its way past a jump of the
            // clock) is progress, for a while.
            let moved = prev.is_some_and(|p| t > p);
            prev = Some(t);
            if !moved {
                stalled += 1;
            }
            if stalled >= MAX_STALLED_ROUNDS || silent >= MAX_SILENT_ROUNDS {
                let state = h
                    .and_then(|h| self.eps[who as usize].connection(h))
                    .map(|c| format!("{c:?}"))
                    .unwrap_or_default();
                panic!(
                    "timer livelock: the {who:?}'s deadline {:?} (connection {h:?}) stays at or \
                     before now ({:?} after the start) after {silent} rounds of handle_timeout \
                     without a datagram sent ({stalled} without the deadline moving); {state}",
                    t.saturating_duration_since(base()),
                    now.saturating_duration_since(base()),
                );
            }
        }
        panic!(
            "timers still due after 1000 rounds of handle_timeout at {:?}",
            now.saturating_duration_since(base())
        );
    }

    pub fn next_deadline(&mut self) -> Option<Instant> {
        BOTH.iter()
            .filter_map(|&w| self.eps[w as usize].poll_timeout())
            .min()
    }

    /// Moves the clock to `until`, running timers at each deadline on the way (or only at the
    /// end with `jump`).
    pub fn advance(&mut self, until: Instant, deliver: bool, jump: bool) {
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
    /// drain within `max(60 s, 6 x PTO)`, PTO the largest any connection had at a check.
    pub fn quiesce(&mut self) {
        for w in &mut self.wire {
            w.clear();
        }
        let start = self.now;
        let mut horizon = Duration::from_secs(60).max(self.max_pto * 6);
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
            let mut handles: Vec<ConnectionHandle> = ep.handles().collect();
            // Known (see `Skips`): made for an Initial that failed packet protection.
            handles.retain(|&h| {
                let c = ep.connection_mut(h).unwrap();
                !(skips().stuck_initial
                    && who == Who::Server
                    && c.stats().packets_received == 0
                    && c.poll_timeout().is_none())
            });
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

    pub fn check(&mut self) {
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
                self.max_pto = self.max_pto.max(pto_estimate(c));
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
                    // The closing period is 3 PTO as of the close (RFC 9000 §10.2); samples
                    // taken since may have made the PTO smaller.
                    let bound = Duration::from_secs(60).max(self.max_pto * 4);
                    assert!(
                        deadline.is_some_and(|t| t <= now + bound),
                        "closed connection {h:?} of the {who:?} will not drain: deadline {:?} \
                         from now, more than {bound:?}; {c:?}",
                        deadline.map(|t| t.saturating_duration_since(now))
                    );
                }
            }
        }
        let grown = alloc::grown_since(self.mem_base);
        assert!(
            skips().memory || grown <= MEM_BOUND,
            "memory: the heap grew by {grown} bytes during this input, more than {MEM_BOUND}; \
             connections: server {}, client {}",
            self.eps[0].connection_count(),
            self.eps[1].connection_count()
        );
    }

    /// An application action on `who`'s main connection, `body[0] % 11`: open bidi + write,
    /// open uni + write, write, finish, reset, stop, send datagram, key update, close, migrate
    /// (client), read everything; `body[1]` picks a stream, the rest is data or the code.
    pub fn app(&mut self, who: Who, body: &[u8]) {
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
                let dir = if action == 0 {
                    kuai_proto::Dir::Bi
                } else {
                    kuai_proto::Dir::Uni
                };
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
                    // Odd codes: the stop that waits for more than a FIN.
                    let _ = if code & 1 == 1 {
                        c.stop_stream_unless_ending(id, code)
                    } else {
                        c.stop_stream(id, code)
                    };
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

    /// Prints the state of both main connections (with `KUAI_FUZZ_DEBUG`).
    pub fn debug_state(&self) {
        if !debug() {
            return;
        }
        for who in BOTH {
            if let Some(c) = self.conn(who) {
                let s = c.stats();
                eprintln!(
                    "  {who:?}: established {} closed {} ({:?}), {} connection(s), rx {} tx {} \
                     dropped {}, rtt {:?}",
                    c.is_established(),
                    c.is_closed(),
                    c.close_reason(),
                    self.eps[who as usize].connection_count(),
                    s.packets_received,
                    s.packets_sent,
                    s.packets_dropped,
                    s.path.rtt
                );
            }
        }
        eprintln!(
            "  heap +{} bytes (peak), wire: {} to the server, {} to the client",
            alloc::grown_since(self.mem_base),
            self.wire[0].len(),
            self.wire[1].len()
        );
    }
}

/// Whether a payload has an ack-eliciting frame (RFC 9002 §2), or does not decode.
fn any_eliciting(payload: &Bytes) -> bool {
    FrameIter::new(payload.clone())
        .any(|f| f.is_err() || f.is_ok_and(|f| f.ty().is_ack_eliciting()))
}

/// Prints the frames of a packet (with `KUAI_FUZZ_DEBUG`).
fn debug_frames(from: Who, space: &str, pn: u64, payload: &Bytes) {
    if !debug() {
        return;
    }
    let frames: Vec<String> = FrameIter::new(payload.clone())
        .map(|f| match f {
            Ok(f) => {
                let s = format!("{f:?}");
                if s.len() > 80 {
                    format!("{}...", &s[..s.floor_char_boundary(80)])
                } else {
                    s
                }
            }
            Err(e) => format!("error {e:?}"),
        })
        .collect();
    eprintln!("    {from:?} {space} pn {pn}: {}", frames.join(", "));
}

/// The packets of a datagram, as `PartialDecode` splits them (the rest of the datagram as
/// one piece when a header does not parse).
pub fn split_packets(d: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < d.len() {
        let rest = &d[at..];
        let len = match PartialDecode::new(BytesMut::from(rest), CID_LEN) {
            Ok((pd, Some(_))) => pd.len(),
            _ => rest.len(),
        };
        let len = len.clamp(1, rest.len());
        out.push(&rest[..len]);
        at += len;
    }
    out
}

pub fn read_all(c: &mut Connection, id: StreamId) {
    for _ in 0..10_000 {
        match c.read(id, usize::MAX) {
            Ok(Some(b)) => assert!(!b.is_empty(), "read of {id:?} returned no bytes"),
            Ok(None) | Err(_) => return,
        }
    }
    panic!("reading {id:?} never ends");
}

/// XORs the body's `(pos u16 LE, xor)` triples into `d`.
pub fn flip(d: &mut [u8], body: &[u8]) {
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
pub fn pto_estimate(c: &Connection) -> Duration {
    let s = c.stats();
    let max_ack_delay = c
        .peer_params()
        .map_or(Duration::from_millis(25), |p| p.max_ack_delay_duration());
    s.path.rtt + (s.path.rtt_var * 4).max(Duration::from_millis(1)) + max_ack_delay
}

pub fn pattern(len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
}

/// The reset token `who` derives for `cid` (the key is fixed).
pub fn reset_token(who: Who, cid: &ConnectionId) -> [u8; 16] {
    token::reset_token(who.reset_key(), cid)
}
