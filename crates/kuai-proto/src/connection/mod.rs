//! The QUIC connection state machine (RFC 9000, 9001, 9002).
//!
//! A [`Connection`] is fed datagrams ([`handle_datagram`](Connection::handle_datagram)) and
//! timeouts ([`handle_timeout`](Connection::handle_timeout)), and produces datagrams
//! ([`poll_transmit`](Connection::poll_transmit)), a timer deadline
//! ([`poll_timeout`](Connection::poll_timeout)) and application events
//! ([`poll_event`](Connection::poll_event)). It never reads a clock or touches a socket.

mod cids;
mod paths;
mod recovery;
mod recv;
mod send;
mod seq_map;
mod spaces;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use paths::{EcnCodepoint, EcnState};

/// What a connection learnt about its path, for the next connection between the same peers:
/// a client endpoint keeps one per server address ([`crate::Endpoint::path_hint`]), a server
/// one per client IP ([`crate::Endpoint::client_path_hint`]). A new connection starts its
/// timers from `rtt` (RFC 9002 §6.2.2), its loss estimate, which decides redundancy and
/// the second copy of the handshake flights, from `loss_permille`, and its congestion
/// controller may resume from `window` (Careful Resume, RFC 9959).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathHint {
    /// The last connection's smoothed RTT.
    pub rtt: Duration,
    /// Its recent loss rate, per mille: the packets it lost and the peer's packets that
    /// never reached it, together (a downloading client sends too few to tell by itself).
    pub loss_permille: u32,
    /// What its congestion controller saw the path carry, in bytes (0: nothing measured),
    /// and the RTT it saw it at (its minimum, for BBR).
    pub window: u64,
    /// The RTT the window was measured at.
    pub window_rtt: Duration,
}

/// The initial RTT of a new connection: the hint's smoothed RTT when there is one (RFC 9002
/// §6.2.2 lets a connection start from an earlier one's), within 1 ms and 10 s.
fn hint_rtt(hint: Option<PathHint>, configured: Duration) -> Duration {
    hint.map_or(configured, |h| {
        h.rtt
            .clamp(crate::recovery::GRANULARITY, Duration::from_secs(10))
    })
}
pub use spaces::MAX_ACK_RANGES;

use self::cids::{LocalCids, RemoteCids};
use self::paths::Path;
use self::spaces::Spaces;
use crate::cid::ConnectionId;
use crate::config::{ClientConfig, ServerConfig, TransportConfig};
use crate::crypto::{self, HandshakeOutput, Keys, OneRttKeys, Tls};
use crate::error::TransportError;
use crate::frame::{AckFrequency, Close};
use crate::recovery::PathId;
use crate::stream::{Priority, StreamConfig, StreamError, StreamEvent, Streams};
use crate::trace::{ConnectionStats, Counters, PathStats, TraceEvent, Tracer};
use crate::transport_params::{PreferredAddress, TransportParameters, VersionInformation};
use crate::types::{Dir, Side, SpaceId, StreamId, Version};

/// One outgoing batch of datagrams: `size` bytes in the caller's buffer, cut into datagrams of
/// `segment_size` bytes (the last may be shorter) when it is `Some` (UDP GSO).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Where to send it.
    pub destination: SocketAddr,
    /// The ECN codepoint to mark it with.
    pub ecn: Option<EcnCodepoint>,
    /// Bytes written into the buffer.
    pub size: usize,
    /// With several datagrams in the buffer (GSO), the size of each but the last.
    pub segment_size: Option<usize>,
    /// Source IP to send from, when the connection is bound to one (multi-homed hosts).
    pub src_ip: Option<IpAddr>,
}

/// Why a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionError {
    /// We detected a protocol violation and closed with this error.
    TransportError(TransportError),
    /// The peer closed with a transport error.
    PeerTransportError(TransportError),
    /// The peer's application closed the connection.
    ApplicationClosed {
        /// The application's error code.
        code: u64,
        /// Its reason.
        reason: Bytes,
    },
    /// Our application closed the connection.
    LocallyClosed,
    /// The idle timeout expired.
    TimedOut,
    /// The peer sent a stateless reset.
    Reset,
    /// No version both sides support (Version Negotiation).
    VersionMismatch,
}

impl std::fmt::Display for ConnectionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectionError::TransportError(e) => write!(f, "closed locally: {e}"),
            ConnectionError::PeerTransportError(e) => write!(f, "closed by peer: {e}"),
            ConnectionError::ApplicationClosed { code, reason } => write!(
                f,
                "closed by peer application: code {code:#x} {:?}",
                String::from_utf8_lossy(reason)
            ),
            ConnectionError::LocallyClosed => f.write_str("closed by the application"),
            ConnectionError::TimedOut => f.write_str("idle timeout"),
            ConnectionError::Reset => f.write_str("stateless reset by peer"),
            ConnectionError::VersionMismatch => f.write_str("no QUIC version in common"),
        }
    }
}

impl std::error::Error for ConnectionError {}

/// What the application learns from a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The handshake completed: 1-RTT data can flow.
    Connected,
    /// The handshake is confirmed (RFC 9001 §4.1.2).
    HandshakeConfirmed,
    /// Client: the server refused 0-RTT. Streams opened and data written before the handshake
    /// were discarded; send the requests again.
    ZeroRttRejected,
    /// A stream became readable, writable, opened or finished.
    Stream(StreamEvent),
    /// A DATAGRAM frame arrived; take it with [`Connection::recv_datagram`].
    DatagramReceived,
    /// Client: the server issued a token for future connections (NEW_TOKEN).
    NewToken(Bytes),
    /// The connection moved to a new path (peer migration or NAT rebinding).
    PathMigrated {
        /// The address it was on.
        from: SocketAddr,
        /// The address it is on now.
        to: SocketAddr,
    },
    /// A path to this peer address was validated.
    PathValidated(SocketAddr),
    /// Validating a path to this peer address failed.
    PathValidationFailed(SocketAddr),
    /// The 1-RTT keys were updated (RFC 9001 §6).
    KeyUpdated {
        /// The key phase generation now in use.
        generation: u64,
    },
    /// Client: a session ticket from the server arrived (a NewSessionTicket message, handed
    /// to the rustls session store): a later connection can resume, and send 0-RTT data.
    SessionTicket,
    /// The connection is closed; it finishes draining on its own.
    ConnectionLost(ConnectionError),
}

/// What the endpoint must do for a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointEvent {
    /// Issue this many more connection IDs (see [`Connection::issue_cids`]).
    NeedCids(usize),
    /// Stop routing this ID to the connection.
    RetireCid(ConnectionId),
    /// Datagrams ending in this stateless reset token belong to the connection (RFC 9000
    /// §10.3.1); it replaces any token reported before.
    ResetToken([u8; 16]),
    /// The connection is gone; forget it.
    Drained,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Handshake,
    Established,
    /// We sent CONNECTION_CLOSE; answering further packets with it until the deadline.
    Closing,
    /// The peer closed; silent until the deadline.
    Draining,
    Drained,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ZeroRtt {
    None,
    /// Client: 0-RTT keys available, early data may be (or was) sent.
    Attempting,
    Accepted,
    Rejected,
}

/// How long response stall probes go out two PTOs apart before their interval grows with
/// the stall (doubling): long enough to cover a Wi-Fi / cellular hand-over.
const STALL_LINEAR_SPAN: Duration = Duration::from_secs(5);

/// Timers of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
enum Timer {
    Idle = 0,
    Loss,
    Ack,
    Close,
    KeyDiscard,
    Pacing,
    PathChallenge,
    KeepAlive,
    Mtu,
    /// Client: the first flight waits briefly for 0-RTT data to ride along.
    FirstFlight,
    /// A quiet spell: give back the buffers the last burst of activity grew.
    Quiet,
    /// Client on a path known to lose packets: its Initial, and later its Handshake flight,
    /// go out a second time this long after the first.
    CopyFlight,
    /// A stream's delivery deadline (see [`Connection::set_delivery_deadline`]).
    StreamDeadline,
}

const TIMER_COUNT: usize = 13;

/// The connection's deadlines, as nanoseconds after its start (0: unset): half the size of
/// an array of `Option<Instant>`. The start is the connection's own.
struct Timers {
    start: Instant,
    at: [u64; TIMER_COUNT],
}

impl Timers {
    fn new(start: Instant) -> Self {
        Self {
            start,
            at: [0; TIMER_COUNT],
        }
    }

    fn get_at(&self, i: usize) -> Option<Instant> {
        match self.at[i] {
            0 => None,
            n => Some(self.start + Duration::from_nanos(n - 1)),
        }
    }

    fn get(&self, t: Timer) -> Option<Instant> {
        self.get_at(t as usize)
    }

    fn set(&mut self, t: Timer, v: Option<Instant>) {
        self.at[t as usize] = v.map_or(0, |v| self.stamp(v));
    }

    /// `t` in the compact form of the deadlines (0 is kept for "none").
    fn stamp(&self, t: Instant) -> u64 {
        let n = t.saturating_duration_since(self.start).as_nanos();
        u64::try_from(n).unwrap_or(u64::MAX - 1) + 1
    }

    /// Whether `t` came before the time `stamp` made `n` from (never for 0).
    fn is_before(&self, t: Instant, n: u64) -> bool {
        n != 0 && self.stamp(t) < n
    }

    fn unset_at(&mut self, i: usize) {
        self.at[i] = 0;
    }

    fn clear(&mut self) {
        self.at = [0; TIMER_COUNT];
    }

    fn earliest(&self) -> Option<Instant> {
        let n = self.at.iter().copied().filter(|&n| n != 0).min()?;
        Some(self.start + Duration::from_nanos(n - 1))
    }
}

/// The min_ack_delay we advertise with ACK_FREQUENCY, in microseconds
/// (draft-ietf-quic-ack-frequency §3).
/// The min_ack_delay we advertise, in microseconds: no more than our max_ack_delay (peers
/// refuse it otherwise, draft-ietf-quic-ack-frequency §3).
pub(super) fn local_min_ack_delay_us(c: &TransportConfig) -> u64 {
    // max_ack_delay goes out in whole milliseconds.
    let max = std::time::Duration::from_millis(c.max_ack_delay.as_millis() as u64);
    c.min_ack_delay.min(max).as_micros().min(u128::from(u64::MAX)) as u64
}

/// Peer's request about how we acknowledge (ACK_FREQUENCY), or the defaults.
#[derive(Debug, Clone, Copy)]
struct AckPolicy {
    threshold: u64,
    max_delay: Duration,
    reorder_threshold: u64,
    last_seq: Option<u64>,
}

/// 1-RTT key-update bookkeeping (RFC 9001 §6).
#[derive(Debug, Default)]
struct KeyUpdateState {
    /// First packet number we sent in the current phase.
    local_phase_start: u64,
    /// A packet of the current phase was acknowledged: we may update again.
    phase_acked: bool,
    /// First packet number received in the current phase.
    remote_phase_start: Option<u64>,
    /// Packets protected under the current key.
    packets_in_phase: u64,
    /// Key generation (number of updates so far).
    generation: u64,
    /// Decryption failures (RFC 9001 §6.6 integrity limit).
    auth_failures: u64,
}

/// Memory a connection holds on the peer's behalf, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryUse {
    /// Unacknowledged stream data in the send buffers (bounded per stream by the peer's
    /// credit plus 64 KiB and the send buffer size, per connection by
    /// `TransportConfig::connection_send_buffer`).
    pub send: u64,
    /// Received data held until the application reads it or a gap fills: stream and CRYPTO
    /// reassembly (with a fixed charge per stored piece), unread DATAGRAM frames, packets
    /// waiting for their keys, a ClientHello being gathered. Bounded by twice the receive
    /// window plus small fixed amounts.
    pub receive: u64,
    /// Records of packets sent and neither acknowledged nor declared lost (ACK-only ones
    /// included), in all packet-number spaces: at most 32,768 per space.
    pub unacked_packets: u64,
}

/// Bytes of unread DATAGRAM frames a connection keeps before dropping the oldest.
pub const DATAGRAM_RECEIVE_BYTES: usize = 1 << 20;

/// Memory charged for each unread datagram on top of its bytes: its slot in the queue (a
/// `Bytes`) and the heap chunk of a small copy.
const DATAGRAM_OVERHEAD: usize = 64;

/// One QUIC connection's state: its packet-number spaces, paths, streams, keys, loss
/// recovery and congestion control.
///
/// Usually an [`Endpoint`](crate::Endpoint) owns the connections and routes datagrams to them;
/// a connection driven on its own (tests, a single-connection tool) follows the same contract
/// as the endpoint's, with its own methods:
///
/// 1. **Input**: [`handle_datagram`](Self::handle_datagram) for each datagram addressed to it,
///    and the application's calls (streams, datagrams, [`close`](Self::close), key update).
/// 2. **Output, after any input**: [`poll_transmit`](Self::poll_transmit) until `None`, sending
///    each datagram; then [`poll_event`](Self::poll_event) until `None` for the application
///    and [`poll_endpoint_event`](Self::poll_endpoint_event) for whoever routes its
///    connection IDs (new IDs, retired IDs, reset tokens).
/// 3. **Timers**: after the transmit loop, [`poll_timeout`](Self::poll_timeout); when that
///    instant passes, [`handle_timeout`](Self::handle_timeout), then step 2 again.
///
/// Time passed in never goes backwards. Nothing here blocks, allocates on a peer's say-so
/// beyond what was granted, or panics on input from the network.
pub struct Connection {
    side: Side,
    version: Version,
    /// Version of the client's first Initial (for compatible version negotiation).
    original_version: Version,
    config: Arc<TransportConfig>,
    client_config: Option<Box<ClientConfig>>,
    server_config: Option<Arc<ServerConfig>>,
    server_name: Option<String>,
    state: State,
    /// Boxed (it is large, and a server frees it after the handshake: see `release_tls`).
    tls: Option<Box<Tls>>,
    /// Server: TLS was released after the handshake; no further CRYPTO data is expected.
    tls_released: bool,
    /// The buffers grown during the handshake were given back once it was all acknowledged.
    trimmed_after_handshake: bool,
    /// Server: ClientHello bytes gathered before TLS starts (to pick the version first).
    client_hello: Vec<u8>,
    /// Server: the PSK identity (session ticket) of a ClientHello that asked for 0-RTT.
    early_data_identity: Option<Box<[u8]>>,
    /// Server: made under memory pressure, with smaller flow-control limits than a client
    /// may remember, so no 0-RTT (RFC 9000 §7.4.1).
    params_shrunk: bool,
    /// The version rustls derives keys for; differs from `version` after a client switched
    /// versions mid-handshake, and then kuai derives the keys itself.
    tls_version: Version,
    secret_capture: Option<Arc<crypto::SecretCapture>>,
    /// Client random of our ClientHello (to find captured secrets).
    client_random: Option<[u8; 32]>,
    /// The peer's reset token last reported to the endpoint.
    reported_reset_token: Option<[u8; 16]>,
    /// Client: already started over after a Version Negotiation packet (once only).
    vn_restarted: bool,
    /// Reused buffer for the packets one ACK acknowledges.
    acked_scratch: Vec<(u64, crate::recovery::SentPacket)>,
    /// When a packet was last processed.
    last_rx: Instant,
    /// Datagrams received while closing (CONNECTION_CLOSE is repeated at a decaying rate).
    closing_rx: u64,
    spaces: Spaces,
    /// Server: keys of the client's original version, while it may still send Initials in it.
    original_initial_keys: Option<Box<crypto::KeyPair>>,
    zero_rtt_keys: Option<Box<Keys>>,
    /// Client: the server's parameters remembered with the session 0-RTT started with, to
    /// check against those it sends now (RFC 9000 §7.4.1). By the handshake's end TLS holds
    /// only the new ones.
    zero_rtt_remembered: Option<Box<TransportParameters>>,
    zero_rtt: ZeroRtt,
    one_rtt: Option<Box<OneRttKeys>>,
    key_update: KeyUpdateState,
    handshake_complete: bool,
    handshake_confirmed: bool,
    /// Client: the server proved it has our Handshake keys (RFC 9002 §6.2.1 anti-deadlock).
    peer_validated_address: bool,
    local_cids: LocalCids,
    remote_cids: RemoteCids,
    /// Our source CID during the handshake (the first local ID).
    handshake_cid: ConnectionId,
    /// Client: DCID of its first Initial. Server: the same, as learned.
    original_dcid: ConnectionId,
    /// Client: SCID of the Retry it accepted.
    retry_scid: Option<ConnectionId>,
    /// Client: the token to put in Initials (from Retry or NEW_TOKEN).
    token: Bytes,
    local_params: Option<Box<TransportParameters>>,
    peer_params: Option<TransportParameters>,
    path: Path,
    /// The path before the latest migration, kept in case the new one fails validation.
    /// Boxed: most connections never migrate.
    prev_path: Option<Box<Path>>,
    /// The connection ID (ours) in the peer's last non-probing packet on the active path: a
    /// packet from a new address with another one is a migration (RFC 9000 §9.5).
    peer_dcid: Option<crate::cid::ConnectionId>,
    /// The datagram being built could not be padded to 1200 bytes for a path probe (see
    /// `paths::Challenge::small`).
    probe_datagram_short: bool,
    next_path_id: u32,
    /// PATH_RESPONSE owed on the active path: the latest challenge received on it.
    path_response: Option<[u8; 8]>,
    /// Other addresses that sent PATH_CHALLENGE, with their anti-amplification counters
    /// (at most [`paths::MAX_OFF_PATHS`]); our local IP is part of the path (a server's
    /// preferred address is a local IP of its own).
    off_paths: Vec<paths::OffPath>,
    streams: Streams,
    datagrams_in: VecDeque<Bytes>,
    datagrams_in_bytes: usize,
    datagrams_out: VecDeque<Bytes>,
    events: VecDeque<Event>,
    endpoint_events: VecDeque<EndpointEvent>,
    idle_timeout: Option<Duration>,
    /// An ack-eliciting packet was sent since the last packet received (idle timer rule).
    sent_eliciting_since_rx: bool,
    /// Redundant copies are queued and not all sent yet; packets sent meanwhile are copies.
    sending_copies: bool,
    /// Client: the handshake flight's second copy is scheduled (see `Timer::CopyFlight`).
    handshake_copy_armed: bool,
    /// Whether the last traced congestion state was slow start (traces only).
    traced_slow_start: bool,
    pto_count: u32,
    /// When a probe timeout last fired, before the handshake was confirmed (see
    /// `Timers::stamp`; 0: never). An ACK that arrives after we gave its packet up gives no
    /// RTT sample then.
    handshake_pto_at: u64,
    timers: Timers,
    /// Close frame to send while closing.
    close_frame: Option<Box<Close>>,
    close_pending: bool,
    error: Option<ConnectionError>,
    handshake_done_pending: bool,
    new_token_pending: bool,
    ping_pending: bool,
    /// When the handshake was confirmed.
    confirmed_at: Option<Instant>,
    /// Stream data arrived since the last stall probe (one probe per quiet spell).
    stall_probe_armed: bool,
    /// The first and the last response stall probe sent since stream data last arrived
    /// (`None`: none yet; see `update_timers`).
    stall_since: Instant,
    stall_probe_at: Option<Instant>,
    /// Buffers were given back after the last quiet spell (reset by every packet received).
    memory_released: bool,
    /// Datagrams arrived since the timers were last updated (see `sync_timers`).
    timers_stale: bool,
    /// Packets were sent since the loss-detection timer was last set.
    loss_timer_stale: bool,
    /// Client: where the server's post-handshake TLS messages end.
    post_handshake_messages: recv::TlsMessageScan,
    immediate_ack_pending: bool,
    ack_policy: AckPolicy,
    /// Our ACK_FREQUENCY request to the peer: sequence and whether it must be (re)sent.
    ack_frequency_seq: u64,
    ack_frequency_pending: Option<AckFrequency>,
    /// The last ACK_FREQUENCY request: threshold, delay, and when.
    ack_frequency_sent: Option<(u64, Duration, Instant)>,
    /// 1-RTT packet number skipped last, and the one to skip next (RFC 9000 §21.4: a peer
    /// that acknowledges a packet number we never used acknowledges packets it did not
    /// receive, to make us send faster: an optimistic ACK attack).
    skipped_pn: Option<u64>,
    next_skip_pn: u64,
    /// The packet being processed is a 0-RTT one.
    rx_0rtt: bool,
    /// Size of the datagram being processed (received data much smaller than its datagram
    /// is copied rather than kept as a slice of it: see `stream::Assembler`).
    rx_datagram_len: usize,
    /// Received packets we cannot decrypt yet (keys not available), bounded.
    undecryptable: Vec<(Instant, SocketAddr, Option<EcnCodepoint>, bytes::BytesMut)>,
    stats: Counters,
    tracer: Option<Box<dyn Tracer>>,
    /// The tracer wants every packet's events (building them costs).
    trace_packets: bool,
    rng: ConnRng,
    now: Instant,
    spin: bool,
    /// Peer accepts a greased QUIC bit (RFC 9287).
    grease_quic_bit: bool,
    /// Server: unix time in ms at the connection's start, for tokens.
    unix_ms_at_start: u64,
    /// Server: reset key to derive reset tokens for new CIDs.
    reset_key: [u8; 32],
    /// Client: the server's preferred address, probed once the handshake is confirmed.
    /// Boxed: few servers offer one.
    preferred: Option<Box<paths::PreferredProbe>>,
}

/// The connection's randomness (path challenges, connection IDs, transport parameter grease):
/// a seed and a count of draws, with a generator built for each draw. These draws are rare, and
/// this keeps 320 bytes of generator state out of every idle connection.
struct ConnRng {
    seed: u64,
    draws: u64,
}

impl ConnRng {
    fn new(seed: u64) -> Self {
        Self { seed, draws: 0 }
    }

    /// A generator no earlier draw has used.
    fn draw(&mut self) -> StdRng {
        self.draws += 1;
        StdRng::seed_from_u64(self.seed ^ self.draws.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("side", &self.side)
            .field("state", &self.state)
            .field("version", &self.version)
            .field("remote", &self.path.remote)
            .finish_non_exhaustive()
    }
}

/// Parameters for creating a server connection (filled in by the endpoint).
pub(crate) struct ServerConnectionParams {
    pub config: Arc<ServerConfig>,
    pub version: Version,
    /// DCID of the client's first Initial (from the Retry token if there was one).
    pub original_dcid: ConnectionId,
    /// DCID of the Initial that created this connection (keys are derived from it).
    pub initial_dcid: ConnectionId,
    pub client_cid: ConnectionId,
    pub local_cid: ConnectionId,
    pub reset_token: [u8; 16],
    /// The CID (sequence 1) offered with the server's preferred address, from the endpoint's
    /// generator like every CID we issue; `None` when there is no preferred address to offer
    /// (or our CIDs are empty, RFC 9000 §18.2).
    pub preferred_cid: Option<ConnectionId>,
    pub retry_scid: Option<ConnectionId>,
    pub remote: SocketAddr,
    pub local_ip: Option<IpAddr>,
    pub address_validated: bool,
    pub reset_key: [u8; 32],
    pub unix_ms: u64,
    pub seed: u64,
    /// The endpoint is over its memory budget: start with the small windows.
    pub memory_pressure: bool,
    /// What the last connection from this client's IP learnt about the path.
    pub hint: Option<PathHint>,
    /// The endpoint's receive limit, for the transport parameter.
    pub max_udp_payload_size: u16,
}

/// Why a client connection could not be started.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// The server name is not a valid DNS name or IP address.
    InvalidServerName(String),
    /// The TLS configuration was refused.
    Tls(rustls::Error),
    /// The configuration is unusable (e.g. no QUIC-capable cipher suite).
    Config(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::InvalidServerName(n) => write!(f, "invalid server name {n:?}"),
            ConnectError::Tls(e) => write!(f, "TLS: {e}"),
            ConnectError::Config(e) => write!(f, "configuration: {e}"),
        }
    }
}

impl std::error::Error for ConnectError {}

fn stream_config(c: &TransportConfig) -> StreamConfig {
    StreamConfig {
        max_concurrent_bidi: c.max_concurrent_bidi_streams,
        max_concurrent_uni: c.max_concurrent_uni_streams,
        stream_window: c.stream_receive_window,
        stream_window_cap: c.max_stream_receive_window,
        conn_window: c.receive_window,
        conn_window_cap: c.max_receive_window,
        send_buffer: c.send_buffer,
        connection_send_buffer: c.connection_send_buffer,
    }
}

fn local_transport_params(
    c: &TransportConfig,
    streams: &Streams,
    max_udp_payload_size: u16,
) -> TransportParameters {
    let mut tp = TransportParameters {
        max_idle_timeout: c.max_idle_timeout.as_millis() as u64,
        // RFC 9000 §18.2: values below 1200 are invalid.
        max_udp_payload_size: u64::from(max_udp_payload_size.max(1200)),
        ack_delay_exponent: u64::from(c.ack_delay_exponent),
        max_ack_delay: c.max_ack_delay.as_millis() as u64,
        disable_active_migration: c.disable_active_migration,
        active_connection_id_limit: c.active_connection_id_limit.max(2),
        max_datagram_frame_size: c.max_datagram_frame_size,
        grease_quic_bit: c.grease_quic_bit,
        min_ack_delay: c.ack_frequency.then(|| local_min_ack_delay_us(c)),
        ..TransportParameters::default()
    };
    streams.local_params(&mut tp);
    tp
}

impl Connection {
    /// Starts a client connection; the first flight is ready in
    /// [`poll_transmit`](Self::poll_transmit).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new_client(
        cfg: &ClientConfig,
        server_name: &str,
        remote: SocketAddr,
        local_cid: ConnectionId,
        token: Bytes,
        now: Instant,
        seed: u64,
        hint: Option<PathHint>,
        max_udp_payload_size: u16,
    ) -> Result<Self, ConnectError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
            .map_err(|_| ConnectError::InvalidServerName(server_name.to_owned()))?;
        let dcid = ConnectionId::random(&mut rng, 8);
        let config = cfg.transport.clone();
        let streams = Streams::new(Side::Client, stream_config(&config));
        let mut tp = local_transport_params(&config, &streams, max_udp_payload_size);
        tp.initial_source_connection_id = Some(local_cid);
        tp.version_information = Some(VersionInformation {
            chosen: cfg.version.wire(),
            available: cfg.versions.iter().map(|v| v.wire()).collect(),
        });
        let mut tp_bytes = Vec::new();
        tp.encode_with_rng(&mut tp_bytes, &mut rng);
        let tls =
            Tls::client(cfg.tls.clone(), cfg.version, name, tp_bytes).map_err(ConnectError::Tls)?;
        let mut path = Path::new(
            PathId(0),
            remote,
            None,
            now,
            hint_rtt(hint, config.initial_rtt),
            &config.congestion,
            config.initial_window_for(hint.is_some()),
            (config.initial_mtu, config.max_mtu),
            config.ecn,
            true,
        );
        if let Some(h) = hint {
            path.assume_hint(&h);
        }
        let mut conn = Self::base(
            Side::Client,
            cfg.version,
            config,
            streams,
            tp,
            path,
            local_cid,
            dcid,
            dcid,
            now,
            seed,
        );
        conn.secret_capture = cfg.secret_capture.clone();
        conn.client_config = Some(Box::new(cfg.clone()));
        conn.server_name = Some(server_name.to_owned());
        conn.token = token;
        conn.tls = Some(Box::new(tls));
        conn.spaces[SpaceId::Initial.index()].keys = Some(Box::new(crypto::initial_keys(
            cfg.version,
            &dcid,
            Side::Client,
        )));
        conn.drive_tls(now)?;
        conn.start_0rtt();
        conn.arm_flight_copy(now);
        if conn.zero_rtt == ZeroRtt::Attempting && !conn.config.zero_rtt_hold.is_zero() {
            conn.timers
                .set(Timer::FirstFlight, Some(now + conn.config.zero_rtt_hold));
        }
        conn.trace(TraceEvent::ConnectionStateUpdated {
            new: "handshake_started",
        });
        Ok(conn)
    }

    pub(crate) fn new_server(p: ServerConnectionParams, now: Instant) -> Self {
        let config = p.config.transport.clone();
        let mut scfg = stream_config(&config);
        if p.memory_pressure {
            // Credit in the transport parameters cannot be taken back later.
            scfg.shrink_for_pressure();
        }
        let mut streams = Streams::new(Side::Server, scfg);
        streams.set_memory_pressure(p.memory_pressure);
        let mut tp = local_transport_params(&config, &streams, p.max_udp_payload_size);
        tp.original_destination_connection_id = Some(p.original_dcid);
        tp.initial_source_connection_id = Some(p.local_cid);
        tp.retry_source_connection_id = p.retry_scid;
        tp.stateless_reset_token = Some(p.reset_token);
        let mut path = Path::new(
            PathId(0),
            p.remote,
            p.local_ip,
            now,
            hint_rtt(p.hint, config.initial_rtt),
            &config.congestion,
            config.initial_window_for(p.hint.is_some()),
            (config.initial_mtu, config.max_mtu),
            config.ecn,
            p.address_validated,
        );
        path.validated = p.address_validated;
        if let Some(h) = p.hint {
            path.assume_hint(&h);
        }
        let mut conn = Self::base(
            Side::Server,
            p.version,
            config,
            streams,
            tp,
            path,
            p.local_cid,
            p.client_cid,
            p.original_dcid,
            now,
            p.seed,
        );
        conn.local_cids
            .issued
            .get_mut(&0)
            .expect("first CID")
            .reset_token = p.reset_token;
        conn.unix_ms_at_start = p.unix_ms;
        conn.reset_key = p.reset_key;
        conn.params_shrunk = p.memory_pressure;
        if let (Some(pa), Some(cid)) = (p.config.preferred_address, p.preferred_cid) {
            // The preferred address gets its own CID (sequence 1) and reset token.
            let token = crate::token::reset_token(&p.reset_key, &cid);
            conn.local_cids.add(cid, token, false);
            conn.local_params
                .as_mut()
                .expect("set at creation")
                .preferred_address = Some(PreferredAddress {
                v4: pa.v4,
                v6: pa.v6,
                cid,
                reset_token: token,
            });
        }
        conn.server_config = Some(p.config);
        conn.arm_flight_copy(now);
        conn.spaces[SpaceId::Initial.index()].keys = Some(Box::new(crypto::initial_keys(
            p.version,
            &p.initial_dcid,
            Side::Server,
        )));
        conn.trace(TraceEvent::ConnectionStateUpdated {
            new: "handshake_started",
        });
        // The handshake timeout runs from the start, whatever the first datagram holds.
        conn.reset_idle_timer(now);
        conn
    }

    /// Packets authenticated and processed so far.
    pub(crate) fn packets_received(&self) -> u64 {
        self.stats.packets_received
    }

    #[allow(clippy::too_many_arguments)]
    fn base(
        side: Side,
        version: Version,
        config: Arc<TransportConfig>,
        streams: Streams,
        local_params: TransportParameters,
        path: Path,
        local_cid: ConnectionId,
        remote_cid: ConnectionId,
        original_dcid: ConnectionId,
        now: Instant,
        seed: u64,
    ) -> Self {
        let mut local_cids = LocalCids::default();
        local_cids.add(local_cid, [0; 16], false);
        let remote_cids = RemoteCids::new(remote_cid, config.active_connection_id_limit.max(2));
        let ack_policy = AckPolicy {
            threshold: config.ack_eliciting_threshold.max(1),
            max_delay: config.max_ack_delay,
            reorder_threshold: 1,
            last_seq: None,
        };
        Self {
            side,
            version,
            original_version: version,
            client_config: None,
            server_config: None,
            server_name: None,
            state: State::Handshake,
            tls: None,
            tls_released: false,
            trimmed_after_handshake: false,
            client_hello: Vec::new(),
            early_data_identity: None,
            params_shrunk: false,
            tls_version: version,
            secret_capture: None,
            client_random: None,
            reported_reset_token: None,
            vn_restarted: false,
            acked_scratch: Vec::new(),
            last_rx: now,
            closing_rx: 0,
            spaces: Spaces::new(),
            original_initial_keys: None,
            zero_rtt_keys: None,
            zero_rtt_remembered: None,
            zero_rtt: ZeroRtt::None,
            one_rtt: None,
            key_update: KeyUpdateState::default(),
            handshake_complete: false,
            handshake_confirmed: false,
            peer_validated_address: side.is_server(),
            local_cids,
            remote_cids,
            handshake_cid: local_cid,
            original_dcid,
            retry_scid: None,
            token: Bytes::new(),
            local_params: Some(Box::new(local_params)),
            peer_params: None,
            path,
            prev_path: None,
            peer_dcid: None,
            probe_datagram_short: false,
            next_path_id: 1,
            path_response: None,
            off_paths: Vec::new(),
            streams,
            datagrams_in: VecDeque::new(),
            datagrams_in_bytes: 0,
            datagrams_out: VecDeque::new(),
            events: VecDeque::new(),
            endpoint_events: VecDeque::new(),
            idle_timeout: (!config.max_idle_timeout.is_zero()).then_some(config.max_idle_timeout),
            sent_eliciting_since_rx: false,
            sending_copies: false,
            handshake_copy_armed: false,
            traced_slow_start: true,
            pto_count: 0,
            handshake_pto_at: 0,
            timers: Timers::new(now),
            close_frame: None,
            close_pending: false,
            error: None,
            handshake_done_pending: false,
            new_token_pending: false,
            ping_pending: false,
            confirmed_at: None,
            stall_probe_armed: false,
            stall_since: now,
            stall_probe_at: None,
            memory_released: false,
            timers_stale: false,
            loss_timer_stale: false,
            post_handshake_messages: recv::TlsMessageScan::default(),
            immediate_ack_pending: false,
            ack_policy,
            ack_frequency_seq: 0,
            ack_frequency_pending: None,
            ack_frequency_sent: None,
            rx_datagram_len: 0,
            skipped_pn: None,
            next_skip_pn: 0,
            rx_0rtt: false,
            undecryptable: Vec::new(),
            stats: Counters {
                version: Some(version),
                ..Default::default()
            },
            tracer: None,
            trace_packets: false,
            rng: ConnRng::new(seed),
            now,
            spin: false,
            grease_quic_bit: false,
            unix_ms_at_start: 0,
            reset_key: [0; 32],
            preferred: None,
            config,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Accessors

    /// Client or server.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The destination CID of the client's first Initial: the connection's name in qlog.
    pub fn original_dcid(&self) -> ConnectionId {
        self.original_dcid
    }

    /// The QUIC version in use.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The peer's address on the active path.
    pub fn remote_address(&self) -> SocketAddr {
        self.path.remote
    }

    /// What this connection learnt about its path, for the next connection to the same
    /// server: the smoothed RTT, the recent loss rate both ways and what the congestion
    /// controller saw the path carry. `None` before an RTT sample.
    pub fn path_hint(&self) -> Option<PathHint> {
        if !self.path.rtt.has_sample() {
            return None;
        }
        let (window, window_rtt) = crate::cc::CongestionController::resume_window(&self.path.cc)
            .unwrap_or((0, Duration::ZERO));
        Some(PathHint {
            rtt: self.path.rtt.smoothed(),
            loss_permille: self.path.hint_loss_permille(),
            window,
            window_rtt,
        })
    }

    /// Whether the handshake completed (1-RTT keys in use).
    pub fn is_established(&self) -> bool {
        self.handshake_complete
    }

    /// Whether the handshake is confirmed (RFC 9001 §4.1.2).
    pub fn is_handshake_confirmed(&self) -> bool {
        self.handshake_confirmed
    }

    /// Whether the connection is closing, draining or gone.
    pub fn is_closed(&self) -> bool {
        matches!(
            self.state,
            State::Closing | State::Draining | State::Drained
        )
    }

    /// Whether the connection is over and may be forgotten.
    pub fn is_drained(&self) -> bool {
        self.state == State::Drained
    }

    /// Why the connection closed, once it has.
    pub fn close_reason(&self) -> Option<&ConnectionError> {
        self.error.as_ref()
    }

    /// Negotiated ALPN protocol.
    pub fn alpn(&self) -> Option<&[u8]> {
        match &self.tls {
            Some(tls) => tls.alpn(),
            None => self.stats.alpn.as_deref(),
        }
    }

    /// Server: the SNI the client sent.
    pub fn server_name(&self) -> Option<&str> {
        match (self.side, &self.tls) {
            (Side::Server, Some(tls)) => tls.server_name(),
            // Client: the name it connected to; server: remembered when TLS was released.
            _ => self.server_name.as_deref(),
        }
    }

    /// Certificates the peer presented.
    pub fn peer_certificates(&self) -> Option<&[rustls::pki_types::CertificateDer<'static>]> {
        self.tls.as_ref()?.peer_certificates()
    }

    /// Client: whether 0-RTT may be used now (keys from a resumed session).
    pub fn is_0rtt_available(&self) -> bool {
        self.zero_rtt == ZeroRtt::Attempting && !self.handshake_complete
    }

    /// Server: whether 0.5-RTT data may go out now, before the client's Finished arrives: the
    /// 1-RTT keys are in and the client's transport parameters known (RFC 9001 §4.1.1). A
    /// response to a 0-RTT request then leaves one round trip earlier.
    pub fn is_half_rtt_available(&self) -> bool {
        self.side.is_server()
            && self.one_rtt.is_some()
            && self.peer_params.is_some()
            && !self.is_closed()
    }

    /// Server: whether the ClientHello has been read (TLS started), so that whether 0-RTT was
    /// accepted is known.
    pub fn client_hello_read(&self) -> bool {
        self.side.is_server() && (self.tls.is_some() || self.tls_released)
    }

    /// Server: the session ticket (the first PSK identity of the ClientHello, RFC 8446
    /// §4.2.10) whose 0-RTT data this connection accepted; `None` if it accepted none. A
    /// fleet records each ticket's first use to refuse replays at other servers (RFC 8446
    /// §8, RFC 9001 §9.2).
    pub fn accepted_0rtt_ticket(&self) -> Option<&[u8]> {
        if self.side.is_server() && matches!(self.zero_rtt, ZeroRtt::Attempting | ZeroRtt::Accepted)
        {
            // rustls accepted early data, so its ClientHello had a first identity.
            self.early_data_identity.as_deref()
        } else {
            None
        }
    }

    /// Server: the session ticket whose 0-RTT data the client offered, whether or not this
    /// connection accepted it. One offered and refused here must still count as used across
    /// a fleet: the client sends its early requests again in 1-RTT, here, and a copy of its
    /// first flight must not run them a second time at another server.
    pub fn offered_0rtt_ticket(&self) -> Option<&[u8]> {
        if self.side.is_server() {
            self.early_data_identity.as_deref()
        } else {
            None
        }
    }

    /// Client: whether the server accepted our 0-RTT data (`None` while unknown or not tried).
    pub fn zero_rtt_accepted(&self) -> Option<bool> {
        match self.zero_rtt {
            ZeroRtt::Accepted => Some(true),
            ZeroRtt::Rejected => Some(false),
            _ => None,
        }
    }

    /// The peer's transport parameters, once known.
    pub fn peer_params(&self) -> Option<&TransportParameters> {
        self.peer_params.as_ref()
    }

    /// Local connection IDs currently issued (for the endpoint's routing table).
    pub fn local_cids(&self) -> impl Iterator<Item = ConnectionId> + '_ {
        self.local_cids.issued.values().map(|c| c.cid)
    }

    /// Sends the connection's trace events to `tracer`. Given before the connection's first
    /// packet, it hears the handshake start.
    pub fn set_tracer(&mut self, tracer: Box<dyn Tracer>) {
        self.trace_packets = tracer.per_packet();
        self.tracer = Some(tracer);
        if self.state == State::Handshake && self.packets_received() == 0 {
            self.trace(TraceEvent::ConnectionStateUpdated {
                new: "handshake_started",
            });
            // A client's parameters went into its first flight as it was made; a server's go
            // once it has read the ClientHello.
            if self.side.is_client() {
                self.trace_local_params();
            }
        }
    }

    /// `quic:parameters_set` for our transport parameters, as they went (or go) to TLS.
    fn trace_local_params(&mut self) {
        if self.tracer.is_some()
            && let Some(lp) = self.local_params.clone()
        {
            self.trace_params(true, &lp);
        }
    }

    /// `quic:parameters_set` for `tp`, ours or the peer's.
    fn trace_params(&mut self, owner_local: bool, tp: &TransportParameters) {
        if self.tracer.is_none() {
            return;
        }
        let summary = format!("{tp:?}");
        let params = tp.qlog_params();
        self.trace(TraceEvent::ParametersSet {
            owner_local,
            summary,
            params: &params,
        });
    }

    fn trace(&mut self, ev: TraceEvent<'_>) {
        if let Some(t) = self.tracer.as_mut() {
            t.event(self.now, &ev);
        }
    }

    /// The versions we speak, in order of preference (from our configuration).
    fn versions(&self) -> &[Version] {
        match (&self.client_config, &self.server_config) {
            (Some(c), _) => &c.versions,
            (None, Some(s)) => &s.versions,
            (None, None) => &[],
        }
    }

    /// Statistics now.
    pub fn stats(&self) -> ConnectionStats {
        let p = &self.path;
        self.stats.with_path(PathStats {
            rtt: p.rtt.smoothed(),
            congestion_events: p.congestion_events,
            congestion_events_undone: u64::from(p.undo.undone),
            min_rtt: p.rtt.min(),
            rtt_var: p.rtt.var(),
            cwnd: crate::cc::CongestionController::window(&p.cc),
            ssthresh: crate::cc::CongestionController::ssthresh(&p.cc),
            bytes_in_flight: p.bytes_in_flight,
            mtu: p.mtu(),
            ecn_capable: p.ecn == EcnState::Capable,
            pacing_rate: p.pacing_rate(),
            congestion_algorithm: crate::cc::CongestionController::name(&p.cc),
        })
    }

    /// Whether the endpoint's memory budget is exceeded: while it is, the connection
    /// advertises small windows and buffers little send data (see
    /// [`crate::config::MemoryBudget`]).
    pub fn set_memory_pressure(&mut self, pressure: bool) {
        self.streams.set_memory_pressure(pressure);
    }

    /// Closes the connection because the endpoint's memory budget is past its hard limit and
    /// it holds more received data than its share (see [`crate::config::MemoryBudget`]),
    /// and releases what it received: nothing of it will be read.
    pub(crate) fn close_over_budget(&mut self, now: Instant) {
        self.close_with_error(
            now,
            TransportError::INTERNAL_ERROR("memory budget exhausted"),
        );
        self.streams.release_received();
        for i in 0..3 {
            if self.spaces[i].crypto_recv.charge() > 0 {
                self.spaces[i].crypto_recv = Default::default();
            }
        }
        self.datagrams_in = VecDeque::new();
        self.datagrams_in_bytes = 0;
        self.undecryptable = Vec::new();
        self.client_hello = Vec::new();
    }

    /// Server: whether some of the data of the peer's stream `id` arrived in 0-RTT packets.
    /// Early data can be replayed by an attacker (RFC 9001 §9.2, RFC 8446 §8): a request
    /// that arrived so should not have effects beyond those of a safe, idempotent method
    /// (RFC 8470 answers others with 425 Too Early).
    pub fn received_in_0rtt(&self, id: StreamId) -> bool {
        self.streams.received_in_0rtt(id)
    }

    /// Whether the peer reset `id`'s sending side (its RESET_STREAM code), before a read
    /// has delivered that: for a reader that waits on something else and must not take the
    /// stream's data meanwhile.
    pub fn stream_reset_received(&self, id: StreamId) -> Result<Option<u64>, StreamError> {
        self.streams.reset_received(id)
    }

    /// Memory the connection holds on the peer's behalf: see [`MemoryUse`].
    pub fn memory(&self) -> MemoryUse {
        let crypto: usize = self.spaces.iter().map(|s| s.crypto_recv.charge()).sum();
        let datagrams =
            self.datagrams_in_bytes + self.datagrams_in.len() * DATAGRAM_OVERHEAD;
        let undecryptable: usize = self.undecryptable.iter().map(|u| u.3.capacity()).sum();
        MemoryUse {
            send: self.streams.send_buffered(),
            receive: (self.streams.recv_charge()
                + crypto
                + datagrams
                + undecryptable
                + self.client_hello.capacity()) as u64,
            unacked_packets: self.spaces.iter().map(|s| s.sent.len() as u64).sum(),
        }
    }

    /// Connection-level flow control: (bytes sent, the peer's limit, bytes received, our
    /// limit).
    pub fn flow_control(&self) -> (u64, u64, u64, u64) {
        self.streams.flow_state()
    }

    /// Events for the application.
    /// Whether [`poll_event`](Self::poll_event) or
    /// [`poll_endpoint_event`](Self::poll_endpoint_event) has something.
    pub fn has_pending_events(&self) -> bool {
        !self.events.is_empty()
            || !self.endpoint_events.is_empty()
            || self.streams.has_events()
            || self
                .remote_cids
                .active()
                .reset_token
                .is_some_and(|t| self.reported_reset_token != Some(t))
    }

    /// Takes the next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        if let Some(e) = self.events.pop_front() {
            return Some(e);
        }
        self.streams.poll_event().map(Event::Stream)
    }

    /// Events for the endpoint.
    pub fn poll_endpoint_event(&mut self) -> Option<EndpointEvent> {
        if let Some(token) = self.remote_cids.active().reset_token
            && self.reported_reset_token != Some(token)
        {
            self.reported_reset_token = Some(token);
            self.endpoint_events
                .push_back(EndpointEvent::ResetToken(token));
        }
        self.endpoint_events.pop_front()
    }

    // -----------------------------------------------------------------------------------------
    // Streams and datagrams (application API)

    /// Opens a stream; `Err(Blocked)` when the peer's stream limit is reached.
    pub fn open_stream(&mut self, dir: Dir) -> Result<StreamId, StreamError> {
        if self.is_closed() {
            return Err(StreamError::ClosedStream);
        }
        if !self.handshake_complete
            && self.zero_rtt != ZeroRtt::Attempting
            && !self.is_half_rtt_available()
        {
            // Before the handshake only 0-RTT (client) and 0.5-RTT (server) streams exist;
            // otherwise the limits are not known yet.
            return Err(StreamError::Blocked);
        }
        self.streams.open(dir).ok_or(StreamError::Blocked)
    }

    /// Takes the next stream the peer opened.
    pub fn accept_stream(&mut self, dir: Dir) -> Option<StreamId> {
        self.streams.accept(dir)
    }

    /// Queues data on a stream; returns how much was taken (0 when the send buffer is full —
    /// wait for [`StreamEvent::Writable`]).
    pub fn write(&mut self, id: StreamId, data: Bytes) -> Result<usize, StreamError> {
        if self.is_closed() {
            return Err(StreamError::ClosedStream);
        }
        self.streams.write(id, data)
    }

    /// Whether the stream calls since the last take ([`write`](Self::write),
    /// [`finish`](Self::finish), [`read`](Self::read), resets and STOP_SENDING) queued
    /// something the endpoint must poll this connection to send; writing more behind unsent
    /// bytes does not. An event loop can wake its sender only when this is true.
    pub fn take_send_hint(&mut self) -> bool {
        self.streams.take_send_hint()
    }

    /// Bytes stream `id` would take now.
    pub fn write_capacity(&self, id: StreamId) -> Result<u64, StreamError> {
        self.streams.write_capacity(id)
    }

    /// Ends stream `id` after what was written (FIN).
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        self.streams.finish(id)
    }

    /// Abandons sending on stream `id` with an application error `code` (RESET_STREAM).
    pub fn reset_stream(&mut self, id: StreamId, code: u64) -> Result<(), StreamError> {
        self.streams.reset(id, code)
    }

    /// Sets stream `id`'s priority (RFC 9218).
    pub fn set_priority(&mut self, id: StreamId, priority: Priority) -> Result<(), StreamError> {
        self.streams.set_priority(id, priority)
    }

    /// Stream `id` takes at most `max` bytes ahead of what it has sent (`None`: as many as
    /// the send buffer holds). A writer whose data comes from memory it fills for the purpose
    /// (a file being read) then writes just before the data goes out, while it is still in
    /// the CPU's cache; a refused writer is told it may write again (`Writable`) once half
    /// of `max` has been sent.
    pub fn set_max_unsent(&mut self, id: StreamId, max: Option<u64>) -> Result<(), StreamError> {
        self.streams.set_max_unsent(id, max)
    }

    /// Whether `id` is a stream the peer opened that the application has not accepted yet
    /// (a STOP_SENDING for it must wait for its handle to be told).
    pub fn is_stream_unaccepted(&self, id: StreamId) -> bool {
        self.streams.is_unaccepted(id)
    }

    /// Resets stream `id` with application error `code` at `at` unless all it sent, its FIN
    /// included, was acknowledged by then. For a response the peer may stop taking (its
    /// flow-control credit never comes): the stream's buffers go at the deadline, and no
    /// application task waits for the delivery to see to it.
    pub fn set_delivery_deadline(
        &mut self,
        id: StreamId,
        at: Instant,
        code: u64,
    ) -> Result<(), StreamError> {
        self.streams.set_delivery_deadline(id, at, code)?;
        self.timers
            .set(Timer::StreamDeadline, self.streams.next_deadline());
        Ok(())
    }

    /// Reads up to `max` bytes. `Ok(None)` at the end of the stream; `Err(WouldBlock)` when
    /// nothing is available yet (wait for [`StreamEvent::Readable`]).
    pub fn read(&mut self, id: StreamId, max: usize) -> Result<Option<Bytes>, StreamError> {
        self.streams.read(id, max)
    }

    /// Asks the peer to stop sending on a stream (STOP_SENDING). True if more than the
    /// stream's end was left (data unread, the end not received yet, or an unread reset):
    /// what the application abandons.
    pub fn stop_stream(&mut self, id: StreamId, code: u64) -> Result<bool, StreamError> {
        self.streams.stop(id, code)
    }

    /// Stops reading a stream, sending STOP_SENDING only if more than its FIN is still to
    /// come: when everything received has been read, the frame waits for more data, and a
    /// FIN alone ends the stream quietly. For a server done with a request whose client may
    /// still be finishing it (RFC 9114 §4.1).
    pub fn stop_stream_unless_ending(
        &mut self,
        id: StreamId,
        code: u64,
    ) -> Result<bool, StreamError> {
        self.streams.stop_unless_ending(id, code)
    }

    /// Largest datagram payload the peer accepts and the path can carry now; `None` if the
    /// peer does not support datagrams.
    pub fn max_datagram_size(&self) -> Option<usize> {
        let peer = self.peer_params.as_ref()?.max_datagram_frame_size?;
        // RFC 9221 §3: 0 means no DATAGRAM support; 1 leaves no room for even an empty
        // frame (type and length: 2 bytes).
        if peer < 2 {
            return None;
        }
        // RFC 9221 §3: the limit covers the whole frame, type and length included.
        let mut peer_payload = peer.saturating_sub(1 + crate::VarInt::size_of(peer) as u64);
        while peer_payload > 0
            && 1 + crate::VarInt::size_of(peer_payload) as u64 + peer_payload > peer
        {
            peer_payload -= 1;
        }
        // Short header (1 + CID + 4) + tag (16) + frame type and length (1 + 2).
        let path_max = usize::from(self.path.mtu())
            .saturating_sub(1 + self.remote_cids.active().cid.len() + 4 + 16 + 3);
        Some(path_max.min(usize::try_from(peer_payload).unwrap_or(usize::MAX)))
    }

    /// Queues an unreliable datagram (RFC 9221). The oldest queued datagram is dropped when the
    /// queue is full.
    pub fn send_datagram(&mut self, data: Bytes) -> Result<(), DatagramError> {
        let max = self.max_datagram_size().ok_or(DatagramError::Unsupported)?;
        if data.len() > max {
            return Err(DatagramError::TooLarge(max));
        }
        if self.datagrams_out.len() >= self.config.datagram_send_buffer {
            self.datagrams_out.pop_front();
        }
        self.datagrams_out.push_back(data);
        Ok(())
    }

    /// The next DATAGRAM frame received (RFC 9221).
    pub fn recv_datagram(&mut self) -> Option<Bytes> {
        let d = self.datagrams_in.pop_front()?;
        self.datagrams_in_bytes -= d.len();
        Some(d)
    }

    /// Closes the connection with an application error code.
    pub fn close(&mut self, now: Instant, code: u64, reason: &[u8]) {
        self.now = now;
        if self.is_closed() {
            return;
        }
        self.error = Some(ConnectionError::LocallyClosed);
        self.events
            .push_back(Event::ConnectionLost(ConnectionError::LocallyClosed));
        self.enter_closing(
            now,
            Close {
                error_code: code,
                frame_type: None,
                reason: Bytes::copy_from_slice(reason),
            },
        );
    }

    /// Server: refuses the connection (CONNECTION_REFUSED, RFC 9000 §20.1), e.g. because its
    /// 0-RTT flight is a replay.
    pub fn refuse(&mut self, now: Instant, reason: &'static str) {
        self.now = now;
        self.close_with_error(now, TransportError::CONNECTION_REFUSED(reason));
    }

    /// Starts a 1-RTT key update (RFC 9001 §6). Fails while the previous update is not yet
    /// acknowledged or the handshake is not confirmed.
    pub fn initiate_key_update(&mut self) -> bool {
        if !self.may_update_keys() || self.one_rtt.is_none() {
            return false;
        }
        self.update_keys(false);
        true
    }

    /// Counts `packets` more as protected under the current 1-RTT key, as if they had been
    /// sent: lets a test reach the AEAD limits without sending millions of packets.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn wear_key(&mut self, packets: u64) {
        self.key_update.packets_in_phase += packets;
    }

    /// Client: migrate to a new local address (the application rebound its socket). Switches to
    /// a fresh connection ID, resets congestion state and validates the new path.
    pub fn migrate(&mut self, now: Instant, local_ip: Option<IpAddr>) -> Result<(), MigrateError> {
        self.now = now;
        if self.side.is_server() {
            return Err(MigrateError::ServerCannotMigrate);
        }
        if !self.handshake_confirmed {
            return Err(MigrateError::HandshakeNotConfirmed);
        }
        if self
            .peer_params
            .as_ref()
            .is_some_and(|p| p.disable_active_migration)
        {
            return Err(MigrateError::PeerDisallows);
        }
        // RFC 9000 §9.5: a new path uses a new connection ID.
        if !self.remote_cids.rotate() {
            return Err(MigrateError::NoSpareCid);
        }
        let remote = self.path.remote;
        let new = self.new_path(remote, local_ip, now, true);
        let old = std::mem::replace(&mut self.path, new);
        self.retire_path_packets(&old);
        self.prev_path = Some(Box::new(old));
        self.start_challenge(now);
        self.stats.migrations += 1;
        self.trace(TraceEvent::PathUpdated {
            path: self.path.id,
            remote,
            event: "client_migration",
        });
        Ok(())
    }

    fn new_path(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        now: Instant,
        validated: bool,
    ) -> Path {
        let id = PathId(self.next_path_id);
        self.next_path_id += 1;
        Path::new(
            id,
            remote,
            local_ip,
            now,
            self.config.initial_rtt,
            &self.config.congestion,
            self.config.initial_window(),
            (self.config.initial_mtu, self.config.max_mtu),
            self.config.ecn,
            validated,
        )
    }

    fn start_challenge(&mut self, now: Instant) {
        let mut data = [0u8; 8];
        self.rng.draw().fill(&mut data);
        let pto = self.path.rtt.pto_base();
        // RFC 9000 §8.2.4: give up after max(3 PTO, 6 kInitialRtt-based PTOs).
        let timeout = (pto * 3).max(self.config.initial_rtt * 6);
        self.path.challenge = Some(paths::Challenge {
            data,
            resend_at: now,
            deadline: now + timeout,
            sent: false,
            small: false,
        });
        self.stats.path_validations += 1;
    }

    /// Connection IDs the endpoint issued for this connection on request.
    pub fn issue_cids(&mut self, cids: Vec<(ConnectionId, [u8; 16])>) {
        for (cid, token) in cids {
            self.local_cids.add(cid, token, true);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Handshake driving

    /// Feeds TLS output into the spaces, installs keys and reacts to handshake progress.
    fn drive_tls(&mut self, now: Instant) -> Result<(), ConnectError> {
        self.process_tls(now)
            .map_err(|e| ConnectError::Config(e.to_string()))
    }

    fn process_tls(&mut self, now: Instant) -> Result<(), TransportError> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(());
        };
        let mut out = Vec::new();
        tls.poll_output(&mut out);
        for o in out {
            match o {
                HandshakeOutput::Data(space, data) => {
                    if self.client_random.is_none()
                        && self.side.is_client()
                        && data.first() == Some(&1)
                        && let Some(r) = data.get(6..38)
                    {
                        self.client_random = r.try_into().ok();
                    }
                    self.spaces[space.index()]
                        .crypto_send
                        .write(Bytes::from(data));
                }
                HandshakeOutput::HandshakeKeys(keys) => {
                    let keys = if self.version != self.tls_version {
                        self.derived_keys(crypto::derived_handshake_keys)?
                    } else {
                        keys
                    };
                    self.spaces[SpaceId::Handshake.index()].keys = Some(Box::new(keys));
                    self.retry_undecryptable(now);
                }
                HandshakeOutput::OneRttKeys(keys) => {
                    let keys = if self.version != self.tls_version {
                        Box::new(self.derived_keys(OneRttKeys::derived)?)
                    } else {
                        keys
                    };
                    self.one_rtt = Some(keys);
                    self.forget_secrets();
                    self.retry_undecryptable(now);
                }
            }
        }
        // Peer transport parameters, as soon as TLS has them.
        // A resuming client's TLS reports the remembered parameters until the server's
        // EncryptedExtensions arrive, so the client reads them once the handshake is done.
        if self.peer_params.is_none()
            && let Some(raw) = self.tls.as_ref().and_then(|t| t.peer_params())
            && (self.side.is_server() || self.tls.as_ref().is_some_and(|t| !t.is_handshaking()))
        {
            let raw = raw.to_vec();
            let tp = TransportParameters::decode(self.side.peer(), &raw)?;
            self.apply_peer_params(tp)?;
        }
        if !self.handshake_complete && self.tls.as_ref().is_some_and(|t| !t.is_handshaking()) {
            self.on_handshake_complete(now)?;
        }
        if self.side.is_server()
            && self.zero_rtt == ZeroRtt::None
            && self.zero_rtt_keys.is_none()
            && let Some(k) = self.tls.as_ref().and_then(|t| t.zero_rtt_keys())
        {
            self.zero_rtt_keys = Some(Box::new(k));
            self.zero_rtt = ZeroRtt::Attempting;
            self.stats.zero_rtt_attempted = true;
            self.retry_undecryptable(now);
        }
        self.release_tls();
        Ok(())
    }

    /// Server, handshake complete: the session tickets are out of TLS and the 1-RTT secrets
    /// (for key updates) are kuai's own, so rustls's state (several KB per connection) is
    /// freed. What is asked of it later (ALPN, SNI) was copied. Kept when the client
    /// presented certificates, which the application may still ask for.
    fn release_tls(&mut self) {
        if !self.side.is_server() || !self.handshake_complete || self.tls_released {
            return;
        }
        let Some(tls) = self.tls.as_mut() else {
            return;
        };
        if tls.is_handshaking() || tls.peer_certificates().is_some() {
            return;
        }
        let mut out = Vec::new();
        tls.poll_output(&mut out);
        for o in out {
            if let HandshakeOutput::Data(space, data) = o {
                self.spaces[space.index()]
                    .crypto_send
                    .write(Bytes::from(data));
            }
        }
        if let Some(tls) = self.tls.take() {
            self.server_name = tls.server_name().map(str::to_owned);
        }
        self.tls_released = true;
    }

    /// Keys for our current version derived from the captured TLS secrets (client after a
    /// compatible version negotiation).
    fn derived_keys<T>(
        &self,
        f: impl FnOnce(crypto::SuiteAlgs, Version, &crypto::CapturedSecrets) -> Option<T>,
    ) -> Result<T, TransportError> {
        let fail =
            || TransportError::INTERNAL_ERROR("cannot derive keys for the negotiated version");
        let capture = self.secret_capture.as_ref().ok_or_else(fail)?;
        let random = self.client_random.ok_or_else(fail)?;
        let suite = self
            .tls
            .as_ref()
            .and_then(|t| t.cipher_suite())
            .ok_or_else(fail)?;
        let algs = crypto::SuiteAlgs::of(suite).ok_or_else(fail)?;
        let secrets = capture.get(&random).ok_or_else(fail)?;
        f(algs, self.version, &secrets).ok_or_else(fail)
    }

    fn forget_secrets(&mut self) {
        if let (Some(c), Some(r)) = (self.secret_capture.as_ref(), self.client_random.as_ref()) {
            c.forget(r);
        }
    }

    /// Client: start 0-RTT if TLS resumed a session that allows early data.
    fn start_0rtt(&mut self) {
        let Some(tls) = self.tls.as_ref() else { return };
        let Some(keys) = tls.zero_rtt_keys() else {
            return;
        };
        let Some(raw) = tls.peer_params() else { return };
        let Ok(remembered) = TransportParameters::decode(Side::Server, raw) else {
            return;
        };
        self.zero_rtt_keys = Some(Box::new(keys));
        self.zero_rtt = ZeroRtt::Attempting;
        self.stats.zero_rtt_attempted = true;
        // RFC 9000 §7.4.1: 0-RTT uses the remembered limits.
        self.streams.apply_peer_params(&remembered);
        self.zero_rtt_remembered = Some(Box::new(remembered));
    }

    fn apply_peer_params(&mut self, tp: TransportParameters) -> Result<(), TransportError> {
        match self.side {
            Side::Client => {
                tp.validate_server_cids(
                    &self
                        .remote_cids
                        .cids
                        .get(&0)
                        .map_or(ConnectionId::EMPTY, |c| c.cid),
                    &self.original_dcid,
                    self.retry_scid.as_ref(),
                )?;
                if let Some(token) = tp.stateless_reset_token {
                    self.remote_cids.set_initial_reset_token(token);
                }
                // RFC 9368 §4: the server's chosen version must be the one in use, and a
                // version change must be allowed by our list.
                if let Some(vi) = &tp.version_information {
                    if vi.chosen != self.version.wire() {
                        return Err(TransportError::VERSION_NEGOTIATION_ERROR(
                            "server's chosen version differs from the packets' version",
                        ));
                    }
                    // RFC 9368 §4: after a Version Negotiation packet (unauthenticated), the
                    // version we would pick from the server's own list must be the one we
                    // picked from that packet, or it was a forged downgrade.
                    let would = self
                        .versions()
                        .iter()
                        .find(|v| vi.available.contains(&v.wire()));
                    if self.vn_restarted && would.is_some_and(|w| *w != self.version) {
                        return Err(TransportError::VERSION_NEGOTIATION_ERROR(
                            "version negotiation downgraded: the server offers a preferred version",
                        ));
                    }
                } else if self.version != self.original_version {
                    return Err(TransportError::VERSION_NEGOTIATION_ERROR(
                        "version changed without version_information",
                    ));
                }
                let remembered = self.zero_rtt_remembered.take();
                if self.zero_rtt == ZeroRtt::Attempting
                    && let Some(remembered) = remembered
                    && !tp.validate_for_0rtt(&remembered)
                    && self.tls.as_ref().and_then(|t| t.early_data_accepted()) == Some(true)
                {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "server accepted 0-RTT but lowered a remembered limit",
                    ));
                }
                if let Some(pa) = &tp.preferred_address {
                    self.on_preferred_address(pa)?;
                }
            }
            Side::Server => {
                tp.validate_client_cids(&self.remote_cids.cids[&0].cid)?;
            }
        }
        if tp.max_udp_payload_size < 1200 {
            return Err(TransportError::TRANSPORT_PARAMETER_ERROR(
                "max_udp_payload_size below 1200",
            ));
        }
        // Effective idle timeout: the minimum of both, ignoring zeros (RFC 9000 §10.1).
        let peer_idle = tp.max_idle_timeout_duration();
        self.idle_timeout = match (self.idle_timeout, peer_idle) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.streams.apply_peer_params(&tp);
        self.grease_quic_bit = tp.grease_quic_bit && self.config.grease_quic_bit;
        self.trace_params(false, &tp);
        self.peer_params = Some(tp);
        // Issue more CIDs up to the peer's limit.
        let want = self
            .cid_target()
            .saturating_sub(self.local_cids.active_count());
        if want > 0 {
            self.endpoint_events
                .push_back(EndpointEvent::NeedCids(want));
        }
        Ok(())
    }

    /// How many CIDs we keep issued: the peer's limit, capped at 8.
    fn cid_target(&self) -> usize {
        self.peer_params
            .as_ref()
            .map_or(2, |p| p.active_connection_id_limit.min(8) as usize)
    }

    /// The ACK_FREQUENCY request that suits the path now (draft-ietf-quic-ack-frequency §4):
    /// acknowledge about four times per congestion window, after at most a quarter RTT, and
    /// never decimate while the window is small (the sender needs the ACKs to grow it and to
    /// recover quickly).
    fn desired_ack_frequency(&self) -> Option<(u64, Duration)> {
        let min = self.peer_params.as_ref()?.min_ack_delay_duration()?;
        if !self.config.ack_frequency || !self.handshake_confirmed || !self.path.rtt.has_sample() {
            return None;
        }
        let packets = crate::cc::CongestionController::window(&self.path.cc)
            / u64::from(self.path.mtu()).max(1);
        // Ack-Eliciting Threshold: packets received without acknowledging; 1 is RFC 9000's
        // default of acknowledging every second packet.
        let threshold = (packets / 4).clamp(2, 10) - 1;
        let srtt = self.path.rtt.smoothed();
        // Never below what the peer can do (its min_ack_delay, §4), which may be above our
        // own max_ack_delay: the peer's word wins then (a clamp with its bounds crossed
        // would panic).
        let lo = min.max(Duration::from_millis(1));
        let delay = (srtt / 4).clamp(lo, self.config.max_ack_delay.max(lo));
        Some((threshold, delay))
    }

    /// Sends a new ACK_FREQUENCY when the desired one moved enough, at most once per RTT.
    fn update_ack_frequency(&mut self, now: Instant) {
        let Some((threshold, delay)) = self.desired_ack_frequency() else {
            return;
        };
        if let Some((t, d, at)) = self.ack_frequency_sent {
            let srtt = self.path.rtt.smoothed();
            let delay_moved = delay > d + d / 4 || delay + delay / 4 < d;
            if now.saturating_duration_since(at) < srtt || (t == threshold && !delay_moved) {
                return;
            }
        } else if threshold == 1 {
            // The peer already acknowledges every second packet.
            return;
        }
        self.ack_frequency_sent = Some((threshold, delay, now));
        self.ack_frequency_seq += 1;
        self.ack_frequency_pending = Some(AckFrequency {
            seq: self.ack_frequency_seq,
            ack_eliciting_threshold: threshold,
            request_max_ack_delay: delay.as_micros() as u64,
            reordering_threshold: self.path.reorder_threshold.min(u64::from(u8::MAX)),
        });
    }

    /// ACK_FREQUENCY was lost: send the current request again.
    fn resend_ack_frequency(&mut self) {
        if let Some((threshold, delay, _)) = self.ack_frequency_sent {
            self.ack_frequency_seq += 1;
            self.ack_frequency_pending = Some(AckFrequency {
                seq: self.ack_frequency_seq,
                ack_eliciting_threshold: threshold,
                request_max_ack_delay: delay.as_micros() as u64,
                reordering_threshold: self.path.reorder_threshold.min(u64::from(u8::MAX)),
            });
        }
    }

    fn on_handshake_complete(&mut self, now: Instant) -> Result<(), TransportError> {
        if self.peer_params.is_none() {
            return Err(TransportError::TRANSPORT_PARAMETER_ERROR(
                "peer sent no transport parameters",
            ));
        }
        self.handshake_complete = true;
        self.state = State::Established;
        self.stats.handshake_duration = Some(now.saturating_duration_since(self.timers.start));
        let tls = self.tls.as_ref().expect("handshake complete implies TLS");
        self.stats.cipher_suite = tls.cipher_suite().and_then(|s| s.as_str());
        self.stats.alpn = tls.alpn().map(<[u8]>::to_vec);
        self.stats.resumed = tls.resumed();
        self.stats.version = Some(self.version);
        match self.side {
            Side::Client => {
                if self.zero_rtt == ZeroRtt::Attempting {
                    if tls.early_data_accepted() == Some(true) {
                        self.zero_rtt = ZeroRtt::Accepted;
                        self.stats.zero_rtt_accepted = true;
                    } else {
                        self.zero_rtt = ZeroRtt::Rejected;
                        self.on_0rtt_rejected();
                    }
                }
                self.zero_rtt_keys = None;
            }
            Side::Server => {
                if self.zero_rtt == ZeroRtt::Attempting {
                    self.zero_rtt = ZeroRtt::Accepted;
                    self.stats.zero_rtt_accepted = true;
                }
                // RFC 9001 §4.1.2: the server's handshake is confirmed on completion.
                self.handshake_done_pending = true;
                self.new_token_pending = self.server_config.as_ref().is_some_and(|s| s.new_tokens);
                self.on_handshake_confirmed(now);
            }
        }
        self.events.push_back(Event::Connected);
        self.trace(TraceEvent::ConnectionStateUpdated {
            new: "handshake_complete",
        });
        if self.tracer.is_some() {
            let stats = self.stats();
            self.trace(TraceEvent::HandshakeCompleted { stats: &stats });
        }
        // 1-RTT packets held back until now (server) can be processed.
        self.retry_undecryptable(now);
        Ok(())
    }

    pub(super) fn on_0rtt_rejected(&mut self) {
        // Everything sent in 0-RTT is gone: forget those packets without congestion signals
        // and start the streams over (RFC 9000 §4.6.2 / §7.4.1).
        let space = &mut self.spaces[SpaceId::Data.index()];
        let drained: Vec<_> = space.sent.drain().collect();
        for (_, p) in drained {
            if p.in_flight {
                self.path.bytes_in_flight =
                    self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
            }
        }
        self.spaces[SpaceId::Data.index()].time_of_last_ack_eliciting = None;
        self.spaces[SpaceId::Data.index()].loss_time = None;
        self.streams.reset_for_0rtt_rejection();
        if let Some(tp) = self.peer_params.clone() {
            self.streams.apply_peer_params(&tp);
        }
        self.events.push_back(Event::ZeroRttRejected);
    }

    fn on_handshake_confirmed(&mut self, now: Instant) {
        if self.handshake_confirmed {
            return;
        }
        self.handshake_confirmed = true;
        self.confirmed_at = Some(now);
        self.peer_validated_address = true;
        self.discard_space(SpaceId::Handshake, now);
        // Our transport parameters served the handshake (and a version or Retry restart).
        self.local_params = None;
        self.events.push_back(Event::HandshakeConfirmed);
        if let Some(p) = self.preferred.as_mut() {
            // RFC 9000 §9.6.1: probe the preferred address once the handshake is confirmed.
            let mut data = [0u8; 8];
            self.rng.draw().fill(&mut data);
            let timeout = (self.path.rtt.pto_base() * 3).max(self.config.initial_rtt * 6);
            p.challenge = Some(paths::Challenge {
                data,
                resend_at: now,
                deadline: now + timeout,
                sent: false,
                small: false,
            });
            self.stats.path_validations += 1;
        }
    }

    /// Client: the server offered a preferred address (RFC 9000 §9.6, §18.2). Its connection
    /// ID is the peer's sequence 1, usable on any path; the address of our path's family is
    /// kept for a probe after the handshake.
    fn on_preferred_address(&mut self, pa: &PreferredAddress) -> Result<(), TransportError> {
        self.remote_cids
            .on_new(&crate::frame::NewConnectionId {
                seq: 1,
                retire_prior_to: 0,
                cid: pa.cid,
                reset_token: pa.reset_token,
            })
            .map_err(|_| {
                TransportError::TRANSPORT_PARAMETER_ERROR("preferred_address connection ID")
            })?;
        if !self.config.migrate_to_preferred_address {
            return Ok(());
        }
        let current = self.path.remote;
        let target = match current {
            SocketAddr::V4(_) => pa.v4.map(SocketAddr::V4),
            // A dual-stack socket reaches IPv4 servers at mapped addresses.
            SocketAddr::V6(a) if a.ip().to_ipv4_mapped().is_some() => pa
                .v4
                .map(|v4| SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())),
            SocketAddr::V6(_) => pa.v6.map(SocketAddr::V6),
        };
        if let Some(remote) = target.filter(|a| usable_preferred_address(*a, current)) {
            self.preferred = Some(Box::new(paths::PreferredProbe {
                remote,
                cid_seq: 1,
                challenge: None,
            }));
        }
        Ok(())
    }

    /// Client: the preferred address answered our challenge: all packets go there from now
    /// on, with the connection ID meant for it (RFC 9000 §9.6.1).
    fn migrate_to_preferred(&mut self, now: Instant) {
        let Some(probe) = self.preferred.take() else {
            return;
        };
        if !self.remote_cids.switch_to(probe.cid_seq) {
            // Its ID was retired meanwhile: any unused one will do (RFC 9000 §9.5).
            let _ = self.remote_cids.rotate();
        }
        let from = self.path.remote;
        let local_ip = self.path.local_ip;
        // A new server address: fresh RTT and congestion state (RFC 9000 §9.4).
        let new = self.new_path(probe.remote, local_ip, now, true);
        let old = std::mem::replace(&mut self.path, new);
        self.retire_path_packets(&old);
        self.prev_path = None;
        self.stats.migrations += 1;
        self.events.push_back(Event::PathValidated(probe.remote));
        self.events.push_back(Event::PathMigrated {
            from,
            to: probe.remote,
        });
        self.trace(TraceEvent::PathUpdated {
            path: self.path.id,
            remote: probe.remote,
            event: "preferred_address",
        });
        self.set_loss_timer(now);
    }

    /// Whether a datagram from `remote` to our `local_ip` belongs to the active path. An
    /// unknown local IP (a socket that does not report it) matches any.
    fn on_active_path(&self, remote: SocketAddr, local_ip: Option<IpAddr>) -> bool {
        remote == self.path.remote
            && (local_ip.is_none()
                || self.path.local_ip.is_none()
                || local_ip == self.path.local_ip)
    }

    /// Drops a space's keys and in-flight packets (RFC 9001 §4.9, RFC 9002 §6.4).
    fn discard_space(&mut self, space: SpaceId, now: Instant) {
        if self.spaces[space.index()].discarded {
            return;
        }
        let s = &mut self.spaces[space.index()];
        s.discarded = true;
        s.keys = None;
        let drained: Vec<_> = s.sent.drain().collect();
        s.loss_time = None;
        s.time_of_last_ack_eliciting = None;
        s.ack = Default::default();
        s.probes = 0;
        // Nothing is sent or received in this space any more: free its buffers (they held
        // the handshake's CRYPTO data and packets), which an idle connection would carry.
        s.sent = Default::default();
        s.crypto_send = Default::default();
        s.crypto_recv = Default::default();
        s.recently_lost = Default::default();
        for (_, p) in drained {
            if p.in_flight && p.path == self.path.id {
                self.path.bytes_in_flight =
                    self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
            }
        }
        if space == SpaceId::Initial {
            self.original_initial_keys = None;
        }
        self.spaces.release_discarded();
        self.pto_count = 0;
        self.trace(TraceEvent::KeyDiscarded { space });
        self.set_loss_timer(now);
    }

    /// RFC 9001 §6.1: the first update needs a confirmed handshake; each later one an
    /// acknowledgment of a packet sent in the current key phase. (A receiver that only sends
    /// ACKs never gets one acknowledged, so the first must not wait for it.)
    fn may_update_keys(&self) -> bool {
        self.handshake_confirmed && (self.key_update.phase_acked || self.key_update.generation == 0)
    }

    fn update_keys(&mut self, remote_initiated: bool) {
        let Some(keys) = self.one_rtt.as_mut() else {
            return;
        };
        keys.update();
        let next_pn = self.spaces[SpaceId::Data.index()].next_pn;
        self.key_update.local_phase_start = next_pn;
        self.key_update.phase_acked = false;
        self.key_update.packets_in_phase = 0;
        self.key_update.generation += 1;
        if !remote_initiated {
            self.key_update.remote_phase_start = None;
        }
        self.stats.key_updates += 1;
        // Keep the previous remote key for reordered packets for 3 PTO (RFC 9001 §6.5).
        let pto = self.pto_duration(SpaceId::Data);
        self.timers.set(Timer::KeyDiscard, Some(self.now + pto * 3));
        let generation = self.key_update.generation;
        self.events.push_back(Event::KeyUpdated { generation });
        self.trace(TraceEvent::KeyUpdated {
            trigger: if remote_initiated {
                "remote_update"
            } else {
                "local_update"
            },
            generation,
        });
    }

    // -----------------------------------------------------------------------------------------
    // Closing

    fn enter_closing(&mut self, now: Instant, frame: Close) {
        if self.is_closed() {
            return;
        }
        let pto = self.pto_duration(SpaceId::Data);
        self.state = State::Closing;
        self.close_frame = Some(Box::new(frame));
        self.close_pending = true;
        self.timers.clear();
        self.timers.set(Timer::Close, Some(now + pto * 3));
        self.trace(TraceEvent::ConnectionStateUpdated { new: "closing" });
    }

    /// Closes because of a protocol violation.
    fn close_with_error(&mut self, now: Instant, e: TransportError) {
        if self.is_closed() {
            return;
        }
        tracing::debug!(side = ?self.side, error = %e, "closing connection");
        let frame = Close {
            error_code: e.code.0,
            frame_type: Some(e.frame.map_or(0, |f| f.0)),
            reason: Bytes::copy_from_slice(&e.reason.as_bytes()[..e.reason.len().min(256)]),
        };
        let err = ConnectionError::TransportError(e);
        self.error = Some(err.clone());
        self.events.push_back(Event::ConnectionLost(err));
        self.enter_closing(now, frame);
    }

    fn enter_draining(&mut self, now: Instant, err: ConnectionError) {
        if matches!(self.state, State::Draining | State::Drained) {
            return;
        }
        let was_closing = self.state == State::Closing;
        let pto = self.pto_duration(SpaceId::Data);
        self.state = State::Draining;
        self.timers.clear();
        self.timers.set(Timer::Close, Some(now + pto * 3));
        if !was_closing {
            self.error = Some(err.clone());
            self.events.push_back(Event::ConnectionLost(err));
        }
        self.trace(TraceEvent::ConnectionStateUpdated { new: "draining" });
    }

    /// Ends the connection without a word, as the idle timeout does.
    pub(crate) fn abandon(&mut self) {
        if !self.is_closed() {
            self.error = Some(ConnectionError::TimedOut);
            self.events
                .push_back(Event::ConnectionLost(ConnectionError::TimedOut));
        }
        self.set_drained();
    }

    fn set_drained(&mut self) {
        self.forget_secrets();
        if self.state != State::Drained {
            self.state = State::Drained;
            self.timers.clear();
            self.endpoint_events.push_back(EndpointEvent::Drained);
            self.trace(TraceEvent::ConnectionStateUpdated { new: "closed" });
            self.trace_packets = false;
            if let Some(mut t) = self.tracer.take() {
                let stats = self.stats();
                t.event(
                    self.now,
                    &TraceEvent::ConnectionClosed {
                        stats: &stats,
                        error: self.error.as_ref(),
                        established: self.handshake_complete,
                    },
                );
                // Nothing comes after: the tracer (a subscriber's context) goes now.
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Timers

    /// The earliest time [`handle_timeout`](Self::handle_timeout) should be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.sync_timers(self.now);
        self.timers.earliest()
    }

    /// Brings the timers up to date after received datagrams, which leave that to the next
    /// call that reads or acts on them: one update for a batch instead of one per datagram.
    pub(super) fn sync_timers(&mut self, now: Instant) {
        if self.timers_stale {
            self.reset_idle_timer(self.last_rx);
            self.update_timers(now);
        }
    }

    /// Processes expired timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.sync_timers(now);
        self.now = now;
        for i in 0..TIMER_COUNT {
            let Some(t) = self.timers.get_at(i) else {
                continue;
            };
            if t > now {
                continue;
            }
            self.timers.unset_at(i);
            match i {
                x if x == Timer::Idle as usize => {
                    self.abandon();
                    return;
                }
                x if x == Timer::Close as usize => {
                    self.set_drained();
                    return;
                }
                x if x == Timer::Loss as usize => self.on_loss_timeout(now),
                x if x == Timer::Ack as usize => {
                    self.spaces[SpaceId::Data.index()].ack.immediate = true;
                }
                x if x == Timer::KeyDiscard as usize => {
                    if let Some(k) = self.one_rtt.as_mut() {
                        k.prev_remote = None;
                    }
                }
                x if x == Timer::Pacing as usize => {}
                x if x == Timer::PathChallenge as usize => self.on_challenge_timeout(now),
                // Keep-alive and stall probes: `update_timers` below decides whether a PING
                // is due (the stall deadline is armed before it is known to apply).
                x if x == Timer::KeepAlive as usize => {}
                x if x == Timer::Mtu as usize => {}
                x if x == Timer::FirstFlight as usize => {}
                x if x == Timer::Quiet as usize => self.release_idle_memory(),
                x if x == Timer::CopyFlight as usize => self.copy_flight(),
                x if x == Timer::StreamDeadline as usize => self.streams.expire_deadlines(now),
                _ => {}
            }
        }
        self.update_timers(now);
    }

    /// Whether the path is known to lose packets: redundancy is on and the loss estimate,
    /// remembered from an earlier connection or measured, reaches its threshold.
    fn known_lossy(&self) -> bool {
        self.config
            .redundancy
            .is_some_and(|r| self.path.recent_loss_permille() >= r.min_loss_permille)
    }

    /// On a known-lossy path: schedules a second copy of the handshake flight about to go
    /// out, a quarter of the RTT later (2 to 100 ms), so that one loss, or a short burst,
    /// does not cost a probe timeout. A client has no amplification limit; a server's copy
    /// waits for its budget like any packet (RFC 9000 §8.1).
    fn arm_flight_copy(&mut self, now: Instant) {
        if !self.known_lossy() {
            return;
        }
        let gap = (self.path.rtt.smoothed() / 4)
            .clamp(Duration::from_millis(2), Duration::from_millis(100));
        self.timers.set(Timer::CopyFlight, Some(now + gap));
    }

    /// Queues the flight's handshake data once more (and 0-RTT data waiting for its
    /// acknowledgment), without declaring anything lost.
    fn copy_flight(&mut self) {
        if self.handshake_complete {
            return;
        }
        let mut copied = 0;
        for space in [SpaceId::Initial, SpaceId::Handshake] {
            let s = &self.spaces[space.index()];
            if s.keys.is_none() {
                continue;
            }
            copied += s.sent.iter().filter(|(_, p)| p.ack_eliciting).count();
            self.queue_probe_data(space);
        }
        if self.zero_rtt == ZeroRtt::Attempting {
            self.queue_probe_data(SpaceId::Data);
        }
        self.stats.redundant_packets += copied as u64;
    }

    fn on_challenge_timeout(&mut self, now: Instant) {
        if let Some(p) = self.preferred.as_mut()
            && let Some(ch) = p.challenge.as_mut()
        {
            if now >= ch.deadline {
                // RFC 9000 §9.6.1: the client stays on the server's original address.
                let failed = p.remote;
                self.preferred = None;
                self.stats.path_validation_failures += 1;
                self.events.push_back(Event::PathValidationFailed(failed));
                self.trace(TraceEvent::PathUpdated {
                    path: self.path.id,
                    remote: failed,
                    event: "preferred_address_failed",
                });
            } else if now >= ch.resend_at {
                ch.sent = false;
            }
        }
        let Some(ch) = self.path.challenge.as_mut() else {
            return;
        };
        if now >= ch.deadline {
            self.path.challenge = None;
            let failed = self.path.remote;
            self.stats.path_validation_failures += 1;
            self.events.push_back(Event::PathValidationFailed(failed));
            if let Some(mut prev) = self.prev_path.take() {
                // RFC 9000 §9.3.2: go back to the last validated path (validated: the
                // challenge it may have been sent as the path left is moot).
                prev.challenge = None;
                let bad = std::mem::replace(&mut self.path, *prev);
                self.retire_path_packets(&bad);
                self.trace(TraceEvent::PathUpdated {
                    path: self.path.id,
                    remote: self.path.remote,
                    event: "validation_failed_reverted",
                });
            } else if !self.path.validated {
                self.close_with_error(
                    now,
                    TransportError::NO_VIABLE_PATH("path validation failed"),
                );
            }
            return;
        }
        if now >= ch.resend_at {
            // Resend the challenge at the next transmit.
            ch.sent = false;
        }
    }

    /// Recomputes the deadlines that depend on state.
    fn update_timers(&mut self, now: Instant) {
        self.timers_stale = false;
        if std::mem::take(&mut self.loss_timer_stale) {
            self.set_loss_timer(now);
        }
        if matches!(
            self.state,
            State::Closing | State::Draining | State::Drained
        ) {
            return;
        }
        // Delayed ACK deadline (Data space only; the handshake spaces acknowledge at once).
        // An expired deadline turns into "acknowledge at the next transmit".
        let ack = &mut self.spaces[SpaceId::Data.index()].ack;
        self.timers.set(
            Timer::Ack,
            match ack.deadline {
                Some(d) if ack.new_since_ack && d > now => Some(d),
                Some(_) if ack.new_since_ack => {
                    ack.immediate = true;
                    None
                }
                _ => None,
            },
        );
        // Path validation: an unsent challenge goes out at the next transmit.
        let preferred = self.preferred.as_ref().and_then(|p| p.challenge.as_ref());
        self.timers.set(
            Timer::PathChallenge,
            [self.path.challenge.as_ref(), preferred]
                .into_iter()
                .flatten()
                .filter(|c| c.sent)
                .map(|c| c.resend_at.min(c.deadline))
                .min(),
        );
        // Keep-alive: PING when nothing ack-eliciting went out for the interval.
        self.timers.set(Timer::KeepAlive, None);
        let mut due: Option<Instant> = None;
        if let Some(i) = self.config.keep_alive_interval
            && self.handshake_complete
        {
            let last = self.spaces[SpaceId::Data.index()]
                .time_of_last_ack_eliciting
                .unwrap_or(self.timers.start);
            due = Some(last + i);
        }
        // Stall probe: a receiver waiting for stream data that hears nothing sends no ACKs and
        // so has nothing to retransmit; if its address changed (NAT rebinding, a network
        // switch) the peer keeps sending to the dead address. A PING after a quiet spell
        // reaches the peer from the new address and restarts the exchange (RFC 9000 §9.3).
        // One probe per spell: an idle connection with streams open for the peer's later
        // use (HTTP/3 control streams) must not ping forever.
        //
        // A response that stops part-way is probed more often: a PING one PTO after the last
        // packet heard, then every two PTOs for STALL_LINEAR_SPAN, then backing off. The
        // peer's own probe timer backs off exponentially (RFC 9002 §6.2.1), so after a
        // hand-over or a tunnel of a few seconds it may wait about as long again before it
        // tries. A PING that gets through acknowledges what arrived just before the outage,
        // or else draws the peer's ACK, which the next PING acknowledges: any new
        // acknowledgment resets the peer's backoff (§6.2.1), so its probe goes out at once
        // (features.rs, `a_download_restarts_soon_after_an_outage`).
        // Chromium's "retransmittable-on-wire" PING serves the same purpose. What we have in
        // flight does not matter: a downloading receiver's flow-control updates lost in the
        // outage are probed on our own timer, which backs off just the same.
        // The streams are looked at only once the deadline has passed (a scan of the receive
        // streams, kept off the path of every packet); until then the timer is armed anyway,
        // which costs a connection that is not receiving one wake-up per quiet spell.
        let mut response_stalled = false;
        if self.handshake_confirmed {
            let pto = self.path.rtt.pto_base();
            let mut stall = self.last_rx + pto;
            if let Some(at) = self.stall_probe_at {
                let spell = at.saturating_duration_since(self.stall_since);
                let gap = if spell < STALL_LINEAR_SPAN {
                    pto * 2
                } else {
                    spell.max(pto * 2)
                };
                stall = stall.max(at + gap);
            }
            if stall > now {
                due = Some(due.map_or(stall, |d| d.min(stall)));
            } else if self.streams.receiving_response() {
                response_stalled = true;
                if self.stall_probe_at.is_none() {
                    self.stall_since = now;
                }
                self.stall_probe_at = Some(now);
                self.stall_probe_armed = false;
                self.ping_pending = true;
            }
        }
        if !response_stalled
            && self.stall_probe_armed
            && self.handshake_confirmed
            && !self.spaces[SpaceId::Data.index()]
                .sent
                .has_ack_eliciting_in_flight()
            && self.streams.waiting_for_data()
        {
            let quiet = (self.path.rtt.pto_base() * 3).max(Duration::from_secs(1));
            let stall = self.last_rx + quiet;
            if stall <= now {
                self.stall_probe_armed = false;
                self.ping_pending = true;
            } else {
                due = Some(due.map_or(stall, |d| d.min(stall)));
            }
        }
        if let Some(due) = due {
            if due <= now {
                self.ping_pending = true;
            } else {
                self.timers.set(Timer::KeepAlive, Some(due));
            }
        }
        // Quiet spell: nothing received for a while (and so nothing of ours acknowledged).
        self.timers.set(
            Timer::Quiet,
            (self.handshake_confirmed && !self.memory_released)
                .then(|| self.last_rx + (self.path.rtt.pto_base() * 3).max(Duration::from_secs(1))),
        );
        // Delivery deadlines: the earliest left (those of streams delivered since are gone).
        self.timers
            .set(Timer::StreamDeadline, self.streams.next_deadline());
        // MTU probe timer.
        self.timers.set(
            Timer::Mtu,
            if self.handshake_confirmed {
                let wait = self.mtu_probe_wait_until(now);
                self.path
                    .mtud
                    .next_probe
                    .map(|t| wait.map_or(t, |w| t.max(w)))
                    .filter(|&t| t > now)
            } else {
                None
            },
        );
    }

    /// After a quiet spell, frees what an idle connection does not need: sent-packet records
    /// that are not in flight (ACK-only packets, kept only to learn which of our ACKs the peer
    /// saw, RFC 9000 §13.2.4), and the spare capacity of queues and scratch space the last
    /// burst of activity grew. A connection that idles for minutes keeps only its state.
    fn release_idle_memory(&mut self) {
        self.memory_released = true;
        // Derived again when the next packet arrives, whatever its key phase.
        if let Some(keys) = self.one_rtt.as_mut() {
            keys.release_next();
        }
        let space = &mut self.spaces[SpaceId::Data.index()];
        if space.sent.has_ack_eliciting_in_flight() {
            return;
        }
        for (_, p) in space.sent.drain() {
            if p.in_flight && p.path == self.path.id {
                self.path.bytes_in_flight =
                    self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
            }
        }
        space.sent.release_memory();
        space.recently_lost.shrink_to_fit();
        self.acked_scratch = Vec::new();
        self.events.shrink_to_fit();
        self.endpoint_events.shrink_to_fit();
        self.off_paths.shrink_to_fit();
        self.datagrams_in.shrink_to_fit();
        self.datagrams_out.shrink_to_fit();
        self.undecryptable.shrink_to_fit();
        self.streams.release_idle_memory();
    }

    fn reset_idle_timer(&mut self, now: Instant) {
        // Server: a handshake in progress has its own, shorter timeout.
        let handshake = self
            .server_config
            .as_ref()
            .filter(|_| !self.handshake_complete)
            .map(|c| c.handshake_timeout);
        // The short one holds until the client sends a Handshake packet, which shows it holds
        // the handshake keys (the server then drops the Initial keys, RFC 9001 §4.9.1): a real
        // client whose Finished is lost again and again gets the idle timeout.
        let short = handshake.filter(|_| !self.spaces[SpaceId::Initial.index()].discarded);
        let t = match (self.idle_timeout, short) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // RFC 9000 §10.1: at least 3 PTO so probes can do their work.
        let pto = self.pto_duration(SpaceId::Data);
        let mut deadline = t.map(|t| now + t.max(pto * 3));
        if let Some(h) = handshake {
            // However often the client speaks, a handshake gets twice its timeout in all:
            // a trickle of packets cannot keep half-open state alive for good.
            let cap = self.timers.start + h * 2;
            deadline = Some(deadline.map_or(cap, |d| d.min(cap)));
        }
        if let Some(d) = deadline {
            self.timers.set(Timer::Idle, Some(d));
        }
    }

    /// The PTO duration of a space on the active path, without backoff (RFC 9002 §6.2.1).
    fn pto_duration(&self, space: SpaceId) -> Duration {
        let mut d = self.path.rtt.pto_base();
        if space == SpaceId::Data {
            d += self.peer_max_ack_delay();
        }
        d
    }

    fn peer_max_ack_delay(&self) -> Duration {
        if !self.handshake_confirmed {
            return Duration::ZERO;
        }
        let param = self
            .peer_params
            .as_ref()
            .map_or(Duration::from_millis(25), |p| p.max_ack_delay_duration());
        // An ACK_FREQUENCY we sent may have asked for a longer delay than the peer's own
        // (draft-ietf-quic-ack-frequency §4, §6: the PTO counts the larger while the request
        // may be in force).
        self.ack_frequency_sent
            .map_or(param, |(_, requested, _)| param.max(requested))
    }

    /// Moves packets in flight on a path we are leaving out of its congestion accounting.
    fn retire_path_packets(&mut self, _old: &Path) {
        // Packets sent on the old path stay in the sent list; their acknowledgement or loss is
        // attributed by path id and no longer touches the new path's controller.
    }

    /// Unix time in milliseconds corresponding to `now`, for tokens.
    fn unix_ms(&self, now: Instant) -> u64 {
        self.unix_ms_at_start + now.saturating_duration_since(self.timers.start).as_millis() as u64
    }
}

/// Whether a client may probe `preferred` while talking to `current` (RFC 9000 §9.6, §21.5.6):
/// an all-zero address means "none of this family"; multicast and broadcast addresses, a
/// loopback address offered by a server that is not on loopback, and an IPv4-mapped address in
/// the IPv6 field would turn the client's probes into requests to someone else.
fn usable_preferred_address(preferred: SocketAddr, current: SocketAddr) -> bool {
    let ip = preferred.ip().to_canonical();
    let from_loopback = current.ip().to_canonical().is_loopback();
    let mapped_in_v6 = matches!(preferred, SocketAddr::V6(a) if a.ip().to_ipv4_mapped().is_some())
        && matches!(current, SocketAddr::V6(c) if c.ip().to_ipv4_mapped().is_none());
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    preferred.port() != 0
        && preferred != current
        && !ip.is_unspecified()
        && !ip.is_multicast()
        && !broadcast
        && !mapped_in_v6
        && (from_loopback || !ip.is_loopback())
}

/// Why a datagram could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DatagramError {
    /// The peer did not enable DATAGRAM frames.
    Unsupported,
    /// Larger than this maximum.
    TooLarge(usize),
}

impl std::fmt::Display for DatagramError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DatagramError::Unsupported => f.write_str("peer does not accept datagrams"),
            DatagramError::TooLarge(m) => write!(f, "datagram larger than {m} bytes"),
        }
    }
}

impl std::error::Error for DatagramError {}

/// Why a migration could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrateError {
    /// Only clients migrate (RFC 9000 §9).
    ServerCannotMigrate,
    /// Migration waits for the handshake to be confirmed.
    HandshakeNotConfirmed,
    /// The peer sent disable_active_migration.
    PeerDisallows,
    /// The peer has not given us a spare connection ID to use on the new path.
    NoSpareCid,
}

impl std::fmt::Display for MigrateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            MigrateError::ServerCannotMigrate => "servers do not initiate migration",
            MigrateError::HandshakeNotConfirmed => "handshake not yet confirmed",
            MigrateError::PeerDisallows => "peer set disable_active_migration",
            MigrateError::NoSpareCid => "no spare connection ID from the peer",
        };
        f.write_str(s)
    }
}

impl std::error::Error for MigrateError {}
