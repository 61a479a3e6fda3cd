//! Configuration of transports, clients, servers and endpoints.

use std::net::{SocketAddrV4, SocketAddrV6};
use std::sync::Arc;
use std::time::Duration;

use crate::cc::CongestionAlgorithm;
use crate::cid::{ConnectionIdGenerator, RandomCidGenerator};
use crate::token::TokenKey;
use crate::types::Version;

/// Transport settings shared by both sides.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Idle timeout we advertise; the effective one is the smaller of both sides' (RFC 9000 §10.1).
    pub max_idle_timeout: Duration,
    /// Send a PING when nothing was sent for this long, to keep NAT bindings and the idle timer
    /// alive; `None` disables keep-alive.
    pub keep_alive_interval: Option<Duration>,
    /// Bidirectional streams the peer may open at once (initial_max_streams_bidi).
    pub max_concurrent_bidi_streams: u64,
    /// Unidirectional streams the peer may open at once (initial_max_streams_uni).
    pub max_concurrent_uni_streams: u64,
    /// Initial per-stream receive window.
    pub stream_receive_window: u64,
    /// Cap for auto-tuning of the per-stream window.
    pub max_stream_receive_window: u64,
    /// Initial connection receive window.
    pub receive_window: u64,
    /// Cap for auto-tuning of the connection window.
    pub max_receive_window: u64,
    /// Unacknowledged bytes buffered per stream before writes are refused (backpressure).
    /// A stream holds at most 64 KiB more than the peer's flow-control credit allows it to
    /// send, whatever this says.
    pub send_buffer: u64,
    /// Unacknowledged bytes buffered by all streams of a connection together.
    pub connection_send_buffer: u64,
    /// The congestion controller of each path.
    pub congestion: CongestionAlgorithm,
    /// The congestion window of a new path, in datagrams of `initial_mtu` bytes. RFC 9002
    /// §7.2 says 10 (12,000 bytes at 1,200), and caps it at 14,720 bytes; quic-go and
    /// Chromium use 32. A custom controller picks its own.
    pub initial_window_packets: u32,
    /// The initial window, in the same datagrams, of a connection that starts without a path
    /// hint ([`crate::PathHint`]: the first between two hosts while hints are kept); `None`:
    /// `initial_window_packets`. A larger one saves cold connections a round trip or more
    /// where the path has room, and risks a shallow queue only for them: hinted ones start
    /// from `initial_window_packets` and resume from what the path carried before.
    pub cold_initial_window_packets: Option<u32>,
    /// RTT assumed before the first sample. RFC 9002 §6.2.2 suggests 333 ms; kuai uses
    /// 100 ms, as Chromium and quic-go do, so a lost Initial is resent after about 300 ms
    /// instead of a second (the handshake on lossy links finishes several times sooner).
    pub initial_rtt: Duration,
    /// Our max_ack_delay (RFC 9000 §18.2).
    pub max_ack_delay: Duration,
    /// The ack_delay_exponent transport parameter (RFC 9000 §18.2).
    pub ack_delay_exponent: u8,
    /// Ack-eliciting packets received before an ACK is sent immediately (RFC 9000 §13.2.2).
    pub ack_eliciting_threshold: u64,
    /// Advertise min_ack_delay and ask the peer, with ACK_FREQUENCY, to acknowledge less often
    /// (draft-ietf-quic-ack-frequency).
    pub ack_frequency: bool,
    /// The shortest ACK delay this endpoint can keep to, advertised as min_ack_delay when
    /// `ack_frequency` is on (at most `max_ack_delay`); a peer's ACK_FREQUENCY asking for
    /// less is a PROTOCOL_VIOLATION. 1 ms.
    pub min_ack_delay: Duration,
    /// UDP payload size every path starts with; 1200 is always safe.
    pub initial_mtu: u16,
    /// Largest UDP payload DPLPMTUD will probe for over IPv4; over IPv6, 20 bytes less (its
    /// header is 20 bytes longer). The default, 1472, fills a 1500-byte Ethernet MTU (1452
    /// over IPv6). Equal to `initial_mtu` disables probing.
    pub max_mtu: u16,
    /// Mark packets ECT(0) and validate the path's ECN support (RFC 9000 §13.4).
    pub ecn: bool,
    /// Largest DATAGRAM frame we accept (RFC 9221); `None` disables datagrams.
    pub max_datagram_frame_size: Option<u64>,
    /// Received datagrams buffered before the oldest are dropped.
    pub datagram_receive_buffer: usize,
    /// Datagrams queued for sending before the oldest are dropped.
    pub datagram_send_buffer: usize,
    /// Number of connection IDs we accept from the peer (active_connection_id_limit).
    pub active_connection_id_limit: u64,
    /// Packets protected with one key before kuai updates keys on its own (RFC 9001 §6);
    /// whatever it is set to, keys are updated by seven eighths of the AEAD's
    /// confidentiality limit (2^23 packets for AES-GCM, RFC 9001 §6.6), and a connection
    /// whose key could not be updated by the limit closes with AEAD_LIMIT_REACHED.
    pub key_update_interval: u64,
    /// Client: how long the first flight waits for 0-RTT data when a resumed session allows
    /// it, so the data shares the Initial's datagram (zero sends at once).
    pub zero_rtt_hold: Duration,
    /// Send with the QUIC bit greased when the peer allows it (RFC 9287).
    pub grease_quic_bit: bool,
    /// Forbid the peer from migrating (disable_active_migration).
    pub disable_active_migration: bool,
    /// Client: move to the server's preferred address once the handshake is confirmed and
    /// the address answers a path challenge (RFC 9000 §9.6.1).
    pub migrate_to_preferred_address: bool,
    /// Redundant copies of short flights on lossy paths (on by default; they are sent only
    /// once the path loses 2 % of its packets); `None` sends none.
    pub redundancy: Option<Redundancy>,
}

/// Send a second copy of a short flight when the path is lossy, so that a lost packet of a
/// small response or request does not cost a loss-detection delay and a round trip (seed 001's
/// "add FEC packets dynamically under loss", as a repetition code: the copies are ordinary
/// retransmissions, so the peer needs no extension to use them).
///
/// When the sender has nothing new to send, every ack-eliciting packet still in flight that
/// was sent within the last smoothed RTT gets its frames queued once more, up to
/// `max_packets`, provided the path's recent loss rate is at least `min_loss_permille`.
/// Bulk transfers are not doubled: only the last flight, when the sender runs dry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redundancy {
    /// Loss rate (per mille of ack-eliciting packets) from which copies are sent.
    pub min_loss_permille: u32,
    /// Most packets copied per flight.
    pub max_packets: usize,
}

impl Default for Redundancy {
    fn default() -> Self {
        Self {
            min_loss_permille: 20,
            max_packets: 16,
        }
    }
}

impl TransportConfig {
    /// The initial congestion window in bytes: `initial_window_packets` datagrams of
    /// `initial_mtu` bytes, at least two.
    pub fn initial_window(&self) -> u64 {
        u64::from(self.initial_window_packets.max(2)) * u64::from(self.initial_mtu)
    }

    /// The initial congestion window in bytes of a connection with or without a path hint
    /// (see `cold_initial_window_packets`).
    pub fn initial_window_for(&self, hinted: bool) -> u64 {
        match self.cold_initial_window_packets {
            Some(n) if !hinted => u64::from(n.max(2)) * u64::from(self.initial_mtu),
            _ => self.initial_window(),
        }
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            max_idle_timeout: Duration::from_secs(30),
            keep_alive_interval: None,
            max_concurrent_bidi_streams: 100,
            max_concurrent_uni_streams: 100,
            stream_receive_window: 1 << 20,
            max_stream_receive_window: 16 << 20,
            receive_window: 4 << 20,
            max_receive_window: 48 << 20,
            send_buffer: 4 << 20,
            connection_send_buffer: 16 << 20,
            congestion: CongestionAlgorithm::default(),
            initial_window_packets: 10,
            cold_initial_window_packets: None,
            initial_rtt: Duration::from_millis(100),
            max_ack_delay: Duration::from_millis(25),
            ack_delay_exponent: 3,
            ack_eliciting_threshold: 2,
            ack_frequency: true,
            min_ack_delay: Duration::from_millis(1),
            initial_mtu: 1200,
            max_mtu: 1472,
            ecn: true,
            max_datagram_frame_size: Some(65_535),
            datagram_receive_buffer: 1024,
            datagram_send_buffer: 1024,
            active_connection_id_limit: 4,
            key_update_interval: 1 << 23,
            zero_rtt_hold: Duration::from_millis(2),
            grease_quic_bit: true,
            disable_active_migration: false,
            migrate_to_preferred_address: true,
            redundancy: Some(Redundancy::default()),
        }
    }
}

/// Client settings. (The connection IDs a client issues, and their length, come from its
/// endpoint's [`EndpointConfig::cid_generator`]: the endpoint routes short-header packets by
/// that length.)
#[derive(Clone)]
pub struct ClientConfig {
    /// TLS: trust, ALPN, session resumption.
    pub tls: Arc<rustls::ClientConfig>,
    /// Transport settings.
    pub transport: Arc<TransportConfig>,
    /// Version of the first Initial.
    pub version: Version,
    /// Versions we accept through compatible version negotiation, in preference order
    /// (RFC 9368); the first packet's version must be among them.
    pub versions: Vec<Version>,
    /// Captures traffic secrets so a compatible version negotiation can re-derive keys;
    /// installed by [`ClientConfig::new`].
    pub(crate) secret_capture: Option<Arc<crate::crypto::SecretCapture>>,
}

impl ClientConfig {
    /// A client with kuai's defaults around a rustls config (which must offer TLS 1.3 and an
    /// ALPN).
    pub fn new(tls: Arc<rustls::ClientConfig>) -> Self {
        let (tls, capture) = crate::crypto::with_secret_capture((*tls).clone());
        Self {
            tls: Arc::new(tls),
            secret_capture: Some(capture),
            transport: Arc::new(TransportConfig::default()),
            version: Version::V1,
            versions: vec![Version::V1, Version::V2],
        }
    }
}

impl ClientConfig {
    /// Sends the TLS secrets to `log` (e.g. an SSLKEYLOGFILE writer), keeping kuai's own
    /// secret capture in front of it.
    pub fn set_key_log(&mut self, log: Arc<dyn rustls::KeyLog>) {
        let mut tls = (*self.tls).clone();
        tls.key_log = log;
        let (tls, capture) = crate::crypto::with_secret_capture(tls);
        self.tls = Arc::new(tls);
        self.secret_capture = Some(capture);
    }
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("transport", &self.transport)
            .field("version", &self.version)
            .field("versions", &self.versions)
            .finish_non_exhaustive()
    }
}

/// When the server answers an Initial with a Retry to validate the client's address first
/// (RFC 9000 §8.1.2). A Retry is stateless: a flood of Initials from spoofed addresses then
/// costs the server one small packet each and no memory, and a real client one round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryPolicy {
    /// Never: Initials from unvalidated addresses past `max_handshakes` are refused with
    /// CONNECTION_REFUSED instead, which a flood turns into a lockout of every new client.
    Never,
    /// Every client address is validated with Retry before its handshake.
    Always,
    /// While this many handshakes or more are in flight (the default, a flood defence).
    AboveHandshakes(usize),
}

/// Handshakes in flight from which a server sends Retry by default. Half-open state is then
/// bounded by this many connections (about 13 KB each).
pub const DEFAULT_RETRY_ABOVE_HANDSHAKES: usize = 512;

/// A server's preferred address (RFC 9000 §9.6).
#[derive(Debug, Clone, Copy)]
pub struct PreferredAddressConfig {
    /// The IPv4 address offered, if any.
    pub v4: Option<SocketAddrV4>,
    /// The IPv6 address offered, if any.
    pub v6: Option<SocketAddrV6>,
}

/// Server settings.
#[derive(Clone)]
pub struct ServerConfig {
    /// TLS: certificates, ALPN, session tickets.
    pub tls: Arc<rustls::ServerConfig>,
    /// Transport settings.
    pub transport: Arc<TransportConfig>,
    /// When clients are asked to prove their address with Retry.
    pub retry: RetryPolicy,
    /// Key for Retry and NEW_TOKEN tokens; share it across a fleet so any server validates
    /// tokens from any other.
    pub token_key: Arc<TokenKey>,
    /// How long a Retry token stays valid.
    pub retry_token_lifetime: Duration,
    /// How long a NEW_TOKEN token stays valid.
    pub new_token_lifetime: Duration,
    /// Send NEW_TOKEN tokens, and take them as proof of a client's address (RFC 9000
    /// §8.1.3). Turn it off behind a proxy that gives every client its own address (such as
    /// `kuai lb`): a token binds the client's IP, which there is the proxy's for everyone,
    /// so a token from one client would validate an Initial spoofed from any address. Retry
    /// tokens still work there (they bind the port too, which the proxy gives each client).
    pub new_tokens: bool,
    /// Behind a Retry offload ([`crate::retry_offload`], such as `kuai lb` with Retry)
    /// sharing `token_key`: a Retry token's address is not compared with the one the client
    /// is seen at here (the offload's, for a full proxy), since the offload checked it
    /// against the client's own. Its lifetime and its binding to the Retry's source ID still
    /// hold. The server sends no Retry of its own then (past `max_handshakes` it refuses):
    /// its token would seal the proxy's address, which the offload refuses. Set it only
    /// where clients reach the server through the offload alone.
    pub retry_offload: bool,
    /// Addresses of full proxies in front of the server (`kuai lb`'s), from which every
    /// client arrives, each on a port of its own. A client arriving from one is counted by
    /// that address and port, not by the IP everyone shares there, for the per-IP limits
    /// (`max_connections_per_ip`, `max_validated_handshakes_per_ip`), and gets no path hint
    /// (a returning client comes on another port, another client may get this one's); the
    /// proxy bounds what one client address may open.
    pub proxies: Vec<std::net::IpAddr>,
    /// NEW_TOKEN tokens already used: each validates an address once. Share it with the
    /// `token_key`.
    pub token_log: Arc<crate::token::TokenLog>,
    /// Versions in our order of preference; a client's Initial in another version gets
    /// Version Negotiation, and compatible negotiation picks the first the client also has.
    pub versions: Vec<Version>,
    /// Accept 0-RTT when the client resumes with it.
    pub accept_0rtt: bool,
    /// Refuse new connections above this many.
    pub max_connections: usize,
    /// Refuse new connections from one IP (an IPv4 address or an IPv6 /64) holding this
    /// many (4096 by default: a large NAT still gets thousands, and one host cannot fill
    /// the table of `max_connections`). A load generator opening more from one address
    /// raises it.
    pub max_connections_per_ip: u32,
    /// Refuse (or Retry, per `retry`) new handshakes above this many in flight; clients whose
    /// address was validated (a Retry or NEW_TOKEN token) are refused only above twice this.
    pub max_handshakes: usize,
    /// Handshakes in flight begun with a validated address (a Retry or NEW_TOKEN token) from
    /// one IP (an IPv4 address or an IPv6 /64): past this the IP's new ones are refused, so one host with tokens for many
    /// ports cannot use up `2 x max_handshakes` for everyone. Spoofed Initials cannot count
    /// here: they carry no valid token. The default, `max_handshakes`, leaves half of the
    /// validated slots to other hosts while a load generator or a large NAT on one address
    /// still gets thousands at once.
    pub max_validated_handshakes_per_ip: u32,
    /// A handshake that hears nothing from the client for this long is dropped without a
    /// word, until the client sends a Handshake packet (the idle timeout applies after that):
    /// half-open state from spoofed or abandoned Initials does not stay for the whole idle
    /// timeout. One that has not completed twice this long after it began is dropped too,
    /// however often the client speaks.
    pub handshake_timeout: Duration,
    /// The address offered for clients to move to after the handshake (RFC 9000 §9.6).
    pub preferred_address: Option<PreferredAddressConfig>,
}

impl ServerConfig {
    /// Seals Retry and NEW_TOKEN tokens with a key made from `secret` (AES-256-GCM): servers
    /// that share it accept each other's tokens (a fleet behind one balancer).
    pub fn set_token_secret(&mut self, secret: &[u8; 32]) {
        self.token_key = Arc::new(TokenKey::new(secret));
    }

    /// A server with `tls` and the default transport settings.
    pub fn new(tls: Arc<rustls::ServerConfig>) -> Self {
        Self {
            tls,
            transport: Arc::new(TransportConfig::default()),
            retry: RetryPolicy::AboveHandshakes(DEFAULT_RETRY_ABOVE_HANDSHAKES),
            token_key: Arc::new(TokenKey::random()),
            retry_token_lifetime: Duration::from_secs(15),
            new_token_lifetime: Duration::from_secs(24 * 3600),
            new_tokens: true,
            retry_offload: false,
            proxies: Vec::new(),
            token_log: Arc::new(crate::token::TokenLog::new()),
            versions: vec![Version::V1, Version::V2],
            accept_0rtt: true,
            max_connections: 100_000,
            max_connections_per_ip: 4096,
            max_handshakes: 10_000,
            max_validated_handshakes_per_ip: 10_000,
            handshake_timeout: Duration::from_secs(10),
            preferred_address: None,
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("transport", &self.transport)
            .field("retry", &self.retry)
            .field("versions", &self.versions)
            .finish_non_exhaustive()
    }
}

/// Makes a connection-ID generator for an endpoint.
pub type CidGeneratorFactory = Arc<dyn Fn() -> Box<dyn ConnectionIdGenerator> + Send + Sync>;

/// Memory the connections of an endpoint may hold on their peers' behalf (send buffers,
/// received data not yet read, reassembly) before their windows shrink. Share one between
/// endpoints to bound them together (the workers of one port share their endpoint's).
///
/// Past the limit every connection advertises small receive windows (64 KiB a stream,
/// 256 KiB a connection) and buffers at most 256 KiB of send data, until the total falls
/// below the limit again: peers send more slowly instead of the process growing. Connections
/// accepted meanwhile start with those windows, and take no 0-RTT.
///
/// Credit already granted cannot be taken back (RFC 9000 §4), and together it can be far
/// more than the limit (every connection starts with its initial windows). So once the
/// received data held passes the [hard limit](Self::hard_limit), by default one and a half
/// times the limit, a connection found holding more received data than its
/// [share](Self::share) (the limit divided among the connections) when it receives or is
/// used is closed with INTERNAL_ERROR and what it held is released: the connections that
/// fill their windows and leave them unread go, those that hold little stay. (Send buffers
/// are the application's to fill; the pressure limits bound them.)
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    hard_limit: u64,
    used: std::sync::atomic::AtomicU64,
    /// The received part of `used`.
    received: std::sync::atomic::AtomicU64,
    /// Connections counted against the budget.
    connections: std::sync::atomic::AtomicU64,
}

/// Default [`MemoryBudget`] of an endpoint.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

impl MemoryBudget {
    /// A budget of `limit` bytes, its hard limit one and a half times that.
    pub fn new(limit: u64) -> Arc<Self> {
        Self::with_hard_limit(limit, limit.saturating_add(limit / 2))
    }

    /// A budget of `limit` bytes whose connections are closed past `hard_limit` (at least
    /// `limit`; `u64::MAX` never closes one).
    pub fn with_hard_limit(limit: u64, hard_limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            hard_limit: hard_limit.max(limit),
            used: std::sync::atomic::AtomicU64::new(0),
            received: std::sync::atomic::AtomicU64::new(0),
            connections: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes held by the connections counted against this budget.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the connections hold more than the budget allows, so windows shrink.
    pub fn under_pressure(&self) -> bool {
        self.used() > self.limit
    }

    /// Past this many bytes of received data held, connections holding more than their
    /// [share](Self::share) of it are closed (one and a half times the limit unless set).
    pub fn hard_limit(&self) -> u64 {
        self.hard_limit
    }

    /// Connections counted against the budget.
    pub fn connections(&self) -> u64 {
        self.connections
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A connection's share of the budget: the limit divided among the connections.
    pub fn share(&self) -> u64 {
        self.limit / self.connections().max(1)
    }

    /// A connection starts (`true`) or stops being counted.
    pub(crate) fn count(&self, starts: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if starts {
            self.connections.fetch_add(1, Relaxed);
        } else {
            self.connections.fetch_sub(1, Relaxed);
        }
    }

    /// Bytes of received data the connections hold (part of [`used`](Self::used)): what
    /// the [hard limit](Self::hard_limit) bounds.
    pub fn received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A connection's holding went from `old` to `new` bytes.
    pub(crate) fn update(&self, old: u64, new: u64) {
        shift(&self.used, old, new);
    }

    /// The received part of a connection's holding went from `old` to `new` bytes.
    pub(crate) fn update_received(&self, old: u64, new: u64) {
        shift(&self.received, old, new);
    }
}

/// `counter` less `old` plus `new`.
fn shift(counter: &std::sync::atomic::AtomicU64, old: u64, new: u64) {
    use std::sync::atomic::Ordering::Relaxed;
    if new > old {
        counter.fetch_add(new - old, Relaxed);
    } else if old > new {
        counter.fetch_sub(old - new, Relaxed);
    }
}

/// Endpoint-wide settings.
#[derive(Clone)]
pub struct EndpointConfig {
    /// Makes each connection's connection-ID generator.
    pub cid_generator: CidGeneratorFactory,
    /// Secret from which stateless reset tokens are derived (RFC 9000 §10.3.2); share it
    /// across a fleet so any server can reset any connection.
    pub reset_key: [u8; 32],
    /// Largest UDP payload the endpoint can receive, sent to peers as the
    /// max_udp_payload_size transport parameter (RFC 9000 §18.2; at least 1200). An I/O
    /// layer that receives into smaller buffers sets it to their size, or a peer whose path
    /// takes larger datagrams would send packets that arrive cut. The default, 65527, is the
    /// largest a UDP datagram carries.
    pub max_udp_payload_size: u16,
    /// Also answer unknown short-header packets with a stateless reset.
    pub stateless_reset: bool,
    /// What the endpoint's connections may hold before their windows shrink.
    pub memory_budget: Arc<MemoryBudget>,
    /// Who watches the endpoint and its connections (none by default: no event is built).
    pub subscribers: crate::trace::Subscribers,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        let mut reset_key = [0; 32];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut reset_key);
        Self {
            cid_generator: Arc::new(|| Box::new(RandomCidGenerator::default())),
            reset_key,
            max_udp_payload_size: 65_527,
            stateless_reset: true,
            memory_budget: MemoryBudget::new(DEFAULT_MEMORY_BUDGET),
            subscribers: crate::trace::Subscribers::default(),
        }
    }
}

impl std::fmt::Debug for EndpointConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointConfig")
            .field("max_udp_payload_size", &self.max_udp_payload_size)
            .field("stateless_reset", &self.stateless_reset)
            .finish_non_exhaustive()
    }
}
