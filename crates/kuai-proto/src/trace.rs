//! Observability: qlog-shaped trace events (draft-ietf-quic-qlog-quic-events-14) delivered to a
//! callback, per-connection statistics, and [`Subscriber`]s: what an application registers
//! with an endpoint to get a context of its own per connection and every event, typed.
//!
//! A subscriber is set in [`EndpointConfig::subscribers`](crate::EndpointConfig): the
//! endpoint calls [`Subscriber::create_connection_context`] when it creates a connection
//! (a server: for the client's first Initial, before its first packet is read), then
//! [`Subscriber::on_connection_event`] for each of the connection's events with that
//! context, and [`Subscriber::on_endpoint_event`] for what it does without a connection
//! (Retry, Version Negotiation, stateless resets, dropped datagrams). The context is dropped
//! with the connection. With no subscriber the endpoint builds no event at all.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cid::ConnectionId;
use crate::connection::ConnectionError;
use crate::recovery::PathId;
use crate::types::{Side, SpaceId, Version};

/// A packet type as qlog names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketKind {
    /// An Initial packet.
    Initial,
    /// A Handshake packet.
    Handshake,
    /// A 0-RTT packet.
    ZeroRtt,
    /// A 1-RTT (short header) packet.
    OneRtt,
    /// A Retry packet.
    Retry,
    /// A Version Negotiation packet.
    VersionNegotiation,
    /// A stateless reset.
    StatelessReset,
}

impl PacketKind {
    /// Its name in qlog (`packet_type`).
    pub fn qlog_name(self) -> &'static str {
        match self {
            PacketKind::Initial => "initial",
            PacketKind::Handshake => "handshake",
            PacketKind::ZeroRtt => "0RTT",
            PacketKind::OneRtt => "1RTT",
            PacketKind::Retry => "retry",
            PacketKind::VersionNegotiation => "version_negotiation",
            PacketKind::StatelessReset => "stateless_reset",
        }
    }
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DropReason {
    /// Its keys are not available (yet, or any more).
    KeyUnavailable,
    /// It did not decrypt (corrupt, forged, or under other keys).
    DecryptionFailure,
    /// Its packet number was seen before.
    Duplicate,
    /// Its header did not parse.
    HeaderParseError,
    /// A version this connection does not use.
    UnexpectedVersion,
    /// The connection is closing: only a CONNECTION_CLOSE goes back.
    ConnectionClosing,
    /// An Initial in a datagram under 1200 bytes (RFC 9000 §14.1).
    DatagramTooSmall,
    /// Client: from a server address it does not know (RFC 9000 §9).
    UnknownServerAddress,
}

impl DropReason {
    /// A short name, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::KeyUnavailable => "key_unavailable",
            DropReason::DecryptionFailure => "decryption_failure",
            DropReason::Duplicate => "duplicate",
            DropReason::HeaderParseError => "header_parse_error",
            DropReason::UnexpectedVersion => "unexpected_version",
            DropReason::ConnectionClosing => "connection_closing",
            DropReason::DatagramTooSmall => "datagram_too_small",
            DropReason::UnknownServerAddress => "unknown_server_address",
        }
    }
}

/// A trace event. Field names follow qlog's `quic:` event schema so a JSON writer can map them
/// one to one.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TraceEvent<'a> {
    /// `quic:packet_sent`
    PacketSent {
        /// The packet type.
        kind: PacketKind,
        /// Its packet number.
        pn: u64,
        /// Its size on the wire, in bytes.
        size: usize,
        /// The path it went on.
        path: PathId,
        /// The frame types in it, by qlog name.
        frames: &'a [&'static str],
    },
    /// `quic:packet_received`
    PacketReceived {
        /// The packet type.
        kind: PacketKind,
        /// Its packet number.
        pn: u64,
        /// Its size on the wire, in bytes.
        size: usize,
        /// The frame types in it, by qlog name.
        frames: &'a [&'static str],
    },
    /// `quic:packet_dropped`
    PacketDropped {
        /// The packet type, when the header said.
        kind: Option<PacketKind>,
        /// Its size in bytes.
        size: usize,
        /// Why it was dropped.
        reason: DropReason,
    },
    /// `quic:packet_lost`
    PacketLost {
        /// Its packet-number space.
        space: SpaceId,
        /// Its packet number.
        pn: u64,
        /// Its size in bytes.
        size: usize,
        /// What declared it lost (`reordering_threshold`, `time_threshold`, `pto_expired`).
        trigger: &'static str,
    },
    /// `quic:recovery_metrics_updated`
    MetricsUpdated {
        /// The path.
        path: PathId,
        /// Its minimum RTT.
        min_rtt: Duration,
        /// Its smoothed RTT (RFC 9002 §5.3).
        smoothed_rtt: Duration,
        /// The latest RTT sample.
        latest_rtt: Duration,
        /// The RTT variation.
        rtt_variance: Duration,
        /// The congestion window, in bytes.
        cwnd: u64,
        /// Bytes sent and not yet acknowledged or lost.
        bytes_in_flight: u64,
        /// The slow-start threshold, when the controller has one.
        ssthresh: Option<u64>,
        /// The pacing rate, in bytes per second.
        pacing_rate: u64,
    },
    /// `quic:congestion_state_updated`
    CongestionStateUpdated {
        /// The path.
        path: PathId,
        /// The controller's new state (`slow_start`, `congestion_avoidance`, ...).
        state: &'static str,
    },
    /// `quic:key_updated`
    KeyUpdated {
        /// `local_update` or `remote_update`.
        trigger: &'static str,
        /// The key phase generation now in use.
        generation: u64,
    },
    /// `quic:key_discarded`
    KeyDiscarded {
        /// The packet-number space whose keys went.
        space: SpaceId,
    },
    /// `quic:parameters_set`
    ParametersSet {
        /// Ours (`true`) or the peer's.
        owner_local: bool,
        /// The parameters, as text.
        summary: String,
        /// The parameters by their qlog names (RFC 9000 §18.2's, lower case).
        params: &'a [(&'static str, ParamValue)],
    },
    /// `quic:connection_state_updated`
    ConnectionStateUpdated {
        /// The new state, by qlog name.
        new: &'static str,
    },
    /// `quic:tuple_assigned` and `quic:migration_state_updated`.
    PathUpdated {
        /// The path.
        path: PathId,
        /// The peer's address on it.
        remote: SocketAddr,
        /// What happened (`validated`, `migrated`, ...).
        event: &'static str,
    },
    /// `quic:mtu_updated`
    MtuUpdated {
        /// The path.
        path: PathId,
        /// The largest datagram size known to get through, in bytes.
        mtu: u16,
        /// The search is over.
        done: bool,
    },
    /// `quic:version_information`
    VersionChosen {
        /// The version in use.
        version: Version,
    },
    /// The handshake completed: the statistics then (its duration, the version, cipher
    /// suite and ALPN, resumption, 0-RTT attempted and accepted).
    HandshakeCompleted {
        /// The connection's statistics at that moment.
        stats: &'a ConnectionStats,
    },
    /// `quic:connection_closed`: the connection is gone (drained, timed out, or
    /// abandoned); its final statistics, and why it ended.
    ConnectionClosed {
        /// The connection's final statistics.
        stats: &'a ConnectionStats,
        /// Why it ended (`None`: closed quietly before anything happened).
        error: Option<&'a ConnectionError>,
        /// Whether its handshake had completed.
        established: bool,
    },
}

/// A transport parameter's value, as qlog writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParamValue {
    /// A number.
    Number(u64),
    /// Present (true) or not.
    Flag(bool),
    /// Bytes (a connection ID, a token), in hexadecimal.
    Hex(String),
}

/// Receives a connection's trace events.
pub trait Tracer: Send {
    /// Called for each event as it happens, with the time the connection was given.
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>);

    /// Whether it wants the events of every packet (see [`Subscriber::per_packet_events`]).
    fn per_packet(&self) -> bool {
        true
    }
}

/// Why an endpoint dropped a datagram before any connection saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EndpointDropReason {
    /// Its header did not parse (cut short, a connection ID of the wrong length).
    Malformed,
    /// A short-header packet for no connection here, and no stateless reset owed for it.
    UnknownConnection,
    /// A long-header packet for no connection here that is not a client's first Initial
    /// (or this endpoint takes no connections).
    Unexpected,
    /// A client's Initial in a datagram under 1200 bytes (RFC 9000 §14.1).
    InitialTooSmall,
    /// A client's Initial whose destination connection ID is under 8 bytes (RFC 9000 §7.2).
    InitialCidTooShort,
    /// A client's Initial in which no packet could be opened (RFC 9001 §5.2).
    InitialUndecryptable,
    /// A version this endpoint does not speak in a datagram too small for an answer, or a
    /// Version Negotiation packet (RFC 9000 §6.1).
    UnsupportedVersion,
    /// Too many stateless answers (Retry, Version Negotiation, resets) waiting to be sent.
    ResponsesQueueFull,
}

impl EndpointDropReason {
    /// A short name, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            EndpointDropReason::Malformed => "malformed",
            EndpointDropReason::UnknownConnection => "unknown_connection",
            EndpointDropReason::Unexpected => "unexpected",
            EndpointDropReason::InitialTooSmall => "initial_too_small",
            EndpointDropReason::InitialCidTooShort => "initial_cid_too_short",
            EndpointDropReason::InitialUndecryptable => "initial_undecryptable",
            EndpointDropReason::UnsupportedVersion => "unsupported_version",
            EndpointDropReason::ResponsesQueueFull => "responses_queue_full",
        }
    }
}

/// What an endpoint does without a connection.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum EndpointTraceEvent {
    /// A Retry went to `remote` (RFC 9000 §8.1.2).
    RetrySent {
        /// The client's address.
        remote: SocketAddr,
    },
    /// A Version Negotiation packet went to `remote` (RFC 9000 §6.1).
    VersionNegotiationSent {
        /// The client's address.
        remote: SocketAddr,
    },
    /// A stateless reset went to `remote` (RFC 9000 §10.3).
    StatelessResetSent {
        /// The peer's address.
        remote: SocketAddr,
    },
    /// A connection attempt was refused (CONNECTION_REFUSED) at a limit.
    ConnectionRefused {
        /// The client's address.
        remote: SocketAddr,
    },
    /// A connection whose 0-RTT data was accepted was refused (CONNECTION_REFUSED): its
    /// session ticket had been used before, at this server or another of its fleet.
    ZeroRttReplayRefused {
        /// The client's address.
        remote: SocketAddr,
    },
    /// A connection was closed (INTERNAL_ERROR) because the endpoint's memory budget was
    /// past its hard limit and it held more received data than its share (see
    /// [`crate::config::MemoryBudget`]).
    ClosedOverBudget {
        /// The peer's address.
        remote: SocketAddr,
        /// Bytes of received data it held.
        held: u64,
    },
    /// An address-validation token (Retry or NEW_TOKEN) did not check out.
    InvalidToken {
        /// The client's address.
        remote: SocketAddr,
    },
    /// A datagram was dropped.
    DatagramDropped {
        /// Where it came from.
        remote: SocketAddr,
        /// Its size in bytes.
        size: usize,
        /// Why.
        reason: EndpointDropReason,
    },
}

/// What a subscriber learns of a connection when it begins.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConnectionMeta {
    /// Client or server (this end).
    pub side: Side,
    /// The peer's address at the start.
    pub remote: SocketAddr,
    /// The client's first destination connection ID (qlog's ODCID).
    pub original_dcid: ConnectionId,
}

/// Watches an endpoint: a context per connection and every event, typed (see the
/// [module](self) docs). Register it in [`EndpointConfig::subscribers`](crate::EndpointConfig)
/// (the `kuai` crate: `EndpointBuilder::subscriber`). Its methods run on the endpoint's
/// driver, in the packet path: they should be quick (count, sample, queue).
pub trait Subscriber: Send + Sync + 'static {
    /// What the subscriber keeps per connection; dropped with the connection.
    type ConnectionContext: Send + 'static;

    /// A connection begins (a server: a client's Initial arrived).
    fn create_connection_context(
        &self,
        meta: &ConnectionMeta,
        now: Instant,
    ) -> Self::ConnectionContext;

    /// One of the connection's events.
    fn on_connection_event(
        &self,
        context: &mut Self::ConnectionContext,
        now: Instant,
        event: &TraceEvent<'_>,
    ) {
        let _ = (context, now, event);
    }

    /// One of the endpoint's events.
    fn on_endpoint_event(&self, now: Instant, event: &EndpointTraceEvent) {
        let _ = (now, event);
    }

    /// Whether it wants the events that come with every packet: `PacketSent`,
    /// `PacketReceived` (the frames named: a decoding pass), `PacketLost`, `MetricsUpdated`
    /// and `CongestionStateUpdated`. A subscriber that counts connections, handshakes and
    /// closes (their statistics carry the totals) says no, and costs the packet path
    /// nothing.
    fn per_packet_events(&self) -> bool {
        true
    }
}

/// The subscribers of an endpoint (none by default).
#[derive(Clone, Default)]
pub struct Subscribers {
    list: Vec<Arc<dyn ErasedSubscriber>>,
}

impl std::fmt::Debug for Subscribers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Subscribers({})", self.list.len())
    }
}

impl Subscribers {
    /// Adds a subscriber.
    pub fn push<S: Subscriber>(&mut self, s: S) {
        self.push_shared(Arc::new(s));
    }

    /// Adds a subscriber the application keeps a handle to (to read what it gathers).
    pub fn push_shared<S: Subscriber>(&mut self, s: Arc<S>) {
        self.list.push(Arc::new(Holder(s)));
    }

    /// Adds all of `other`'s.
    pub fn extend(&mut self, other: Subscribers) {
        self.list.extend(other.list);
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The tracer a new connection reports to, if anyone listens.
    pub(crate) fn connection_tracer(
        &self,
        meta: &ConnectionMeta,
        now: Instant,
    ) -> Option<Box<dyn Tracer>> {
        match self.list.as_slice() {
            [] => None,
            [one] => Some(one.tracer(meta, now)),
            many => Some(Box::new(Fanout(
                many.iter().map(|s| s.tracer(meta, now)).collect(),
            ))),
        }
    }

    /// Hands an endpoint event to every subscriber.
    pub(crate) fn endpoint_event(&self, now: Instant, event: &EndpointTraceEvent) {
        for s in &self.list {
            s.endpoint_event(now, event);
        }
    }
}

/// A subscriber without its context type.
trait ErasedSubscriber: Send + Sync {
    fn tracer(&self, meta: &ConnectionMeta, now: Instant) -> Box<dyn Tracer>;
    fn endpoint_event(&self, now: Instant, event: &EndpointTraceEvent);
}

struct Holder<S>(Arc<S>);

impl<S: Subscriber> ErasedSubscriber for Holder<S> {
    fn tracer(&self, meta: &ConnectionMeta, now: Instant) -> Box<dyn Tracer> {
        Box::new(ContextTracer {
            context: self.0.create_connection_context(meta, now),
            subscriber: self.0.clone(),
        })
    }

    fn endpoint_event(&self, now: Instant, event: &EndpointTraceEvent) {
        self.0.on_endpoint_event(now, event);
    }
}

/// A connection's context and its subscriber.
struct ContextTracer<S: Subscriber> {
    subscriber: Arc<S>,
    context: S::ConnectionContext,
}

impl<S: Subscriber> Tracer for ContextTracer<S> {
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>) {
        self.subscriber
            .on_connection_event(&mut self.context, time, event);
    }

    fn per_packet(&self) -> bool {
        self.subscriber.per_packet_events()
    }
}

/// Several subscribers' tracers for one connection.
struct Fanout(Vec<Box<dyn Tracer>>);

impl Tracer for Fanout {
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>) {
        for t in &mut self.0 {
            t.event(time, event);
        }
    }

    fn per_packet(&self) -> bool {
        self.0.iter().any(|t| t.per_packet())
    }
}

/// Per-path statistics.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct PathStats {
    /// Smoothed RTT (RFC 9002 §5.3).
    pub rtt: Duration,
    /// Minimum RTT seen.
    pub min_rtt: Duration,
    /// RTT variation.
    pub rtt_var: Duration,
    /// Congestion window, in bytes.
    pub cwnd: u64,
    /// Slow-start threshold, when the controller has one.
    pub ssthresh: Option<u64>,
    /// Bytes sent and not yet acknowledged or lost.
    pub bytes_in_flight: u64,
    /// Largest datagram size in use, in bytes.
    pub mtu: u16,
    /// Congestion events (window reductions) so far.
    pub congestion_events: u64,
    /// Of them, undone because every loss behind the reduction turned out spurious
    /// (reordering).
    pub congestion_events_undone: u64,
    /// ECN validated on the path (RFC 9000 §13.4.2).
    pub ecn_capable: bool,
    /// Pacing rate, in bytes per second.
    pub pacing_rate: u64,
    /// The congestion controller's name.
    pub congestion_algorithm: &'static str,
}

/// Declares [`ConnectionStats`] and the crate's `Counters`: the same fields without the path
/// figures, which a connection reads from its path when asked instead of keeping a copy.
macro_rules! connection_stats {
    ($($(#[$meta:meta])* $field:ident: $ty:ty,)*) => {
        /// Connection statistics.
        #[derive(Debug, Clone, Default)]
        #[non_exhaustive]
        pub struct ConnectionStats {
            $($(#[$meta])* pub $field: $ty,)*
            /// The current path's figures.
            pub path: PathStats,
        }

        /// What a connection counts as it goes.
        #[derive(Debug, Clone, Default)]
        pub(crate) struct Counters {
            $(pub $field: $ty,)*
        }

        impl Counters {
            pub(crate) fn with_path(&self, path: PathStats) -> ConnectionStats {
                ConnectionStats {
                    $($field: self.$field.clone(),)*
                    path,
                }
            }
        }
    };
}

connection_stats! {

    /// UDP datagrams sent.
    udp_tx_datagrams: u64,
    /// UDP payload bytes sent.
    udp_tx_bytes: u64,
    /// UDP datagrams received.
    udp_rx_datagrams: u64,
    /// UDP payload bytes received.
    udp_rx_bytes: u64,
    /// QUIC packets sent.
    packets_sent: u64,
    /// QUIC packets received.
    packets_received: u64,
    /// Packets declared lost.
    packets_lost: u64,
    /// Bytes in packets declared lost.
    bytes_lost: u64,
    /// Stream bytes sent again after loss.
    stream_bytes_retransmitted: u64,
    /// Packets whose frames were sent a second time as redundancy on a lossy path.
    redundant_packets: u64,
    /// Stream bytes sent, retransmissions included.
    stream_bytes_sent: u64,
    /// Packets received and dropped (see `TraceEvent::PacketDropped`).
    packets_dropped: u64,
    /// Packets declared lost and acknowledged after all.
    spurious_losses: u64,
    /// Probe timeouts.
    pto_count: u64,
    /// 1-RTT key updates.
    key_updates: u64,
    /// Set once the handshake completes.
    handshake_duration: Option<Duration>,
    /// 0-RTT was attempted (client) or offered to (server).
    zero_rtt_attempted: bool,
    /// 0-RTT was accepted.
    zero_rtt_accepted: bool,
    /// The TLS session was resumed.
    resumed: bool,
    /// The TLS 1.3 cipher suite's IANA name, e.g. `TLS13_AES_128_GCM_SHA256`.
    cipher_suite: Option<&'static str>,
    /// The application protocol agreed.
    alpn: Option<Vec<u8>>,
    /// The QUIC version in use.
    version: Option<Version>,
    /// Path migrations.
    migrations: u64,
    /// Paths validated.
    path_validations: u64,
    /// Path validations that failed.
    path_validation_failures: u64,
    /// The client went through a Retry.
    retry_received: bool,
    /// Most streams open at once.
    max_concurrent_streams: usize,
    /// Queued DATAGRAM frames dropped unsent: larger than the path took by then.
    datagrams_unsendable: u64,
}
