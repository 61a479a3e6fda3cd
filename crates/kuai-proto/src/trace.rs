//! Observability: qlog-shaped trace events (draft-ietf-quic-qlog-quic-events) delivered to a
//! callback, and per-connection statistics.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::recovery::PathId;
use crate::types::{SpaceId, Version};

/// A packet type as qlog names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketKind {
    Initial,
    Handshake,
    ZeroRtt,
    OneRtt,
    Retry,
    VersionNegotiation,
    StatelessReset,
}

impl PacketKind {
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
    KeyUnavailable,
    DecryptionFailure,
    Duplicate,
    HeaderParseError,
    UnexpectedVersion,
    ConnectionClosing,
    /// An Initial in a datagram under 1200 bytes (RFC 9000 §14.1).
    DatagramTooSmall,
}

/// A trace event. Field names follow qlog's `quic:` event schema so a JSON writer can map them
/// one to one.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TraceEvent<'a> {
    /// `quic:packet_sent`
    PacketSent {
        kind: PacketKind,
        pn: u64,
        size: usize,
        path: PathId,
        frames: &'a [&'static str],
    },
    /// `quic:packet_received`
    PacketReceived {
        kind: PacketKind,
        pn: u64,
        size: usize,
        frames: &'a [&'static str],
    },
    /// `quic:packet_dropped`
    PacketDropped {
        kind: Option<PacketKind>,
        size: usize,
        reason: DropReason,
    },
    /// `recovery:packet_lost`
    PacketLost {
        space: SpaceId,
        pn: u64,
        size: usize,
        trigger: &'static str,
    },
    /// `recovery:metrics_updated`
    MetricsUpdated {
        path: PathId,
        min_rtt: Duration,
        smoothed_rtt: Duration,
        latest_rtt: Duration,
        rtt_variance: Duration,
        cwnd: u64,
        bytes_in_flight: u64,
        ssthresh: Option<u64>,
        pacing_rate: u64,
    },
    /// `recovery:congestion_state_updated`
    CongestionStateUpdated { path: PathId, state: &'static str },
    /// `security:key_updated`
    KeyUpdated {
        trigger: &'static str,
        generation: u64,
    },
    /// `security:key_discarded`
    KeyDiscarded { space: SpaceId },
    /// `transport:parameters_set`
    ParametersSet { owner_local: bool, summary: String },
    /// `connectivity:connection_state_updated`
    ConnectionStateUpdated { new: &'static str },
    /// `connectivity:path_updated` / migration.
    PathUpdated {
        path: PathId,
        remote: SocketAddr,
        event: &'static str,
    },
    /// `recovery:mtu_updated`
    MtuUpdated { path: PathId, mtu: u16, done: bool },
    /// `transport:version_information`
    VersionChosen { version: Version },
}

/// Receives a connection's trace events.
pub trait Tracer: Send {
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>);
}

/// Per-path statistics.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct PathStats {
    pub rtt: Duration,
    pub min_rtt: Duration,
    pub rtt_var: Duration,
    pub cwnd: u64,
    pub ssthresh: Option<u64>,
    pub bytes_in_flight: u64,
    pub mtu: u16,
    pub congestion_events: u64,
    pub ecn_capable: bool,
    pub pacing_rate: u64,
    pub congestion_algorithm: &'static str,
}

/// Declares [`ConnectionStats`] and the crate's `Counters`: the same fields without the path
/// figures, which a connection reads from its path when asked instead of keeping a copy.
macro_rules! connection_stats {
    ($($(#[$meta:meta])* $field:ident: $ty:ty,)*) => {
        /// Connection statistics.
        #[derive(Debug, Clone, Default)]
        pub struct ConnectionStats {
            $($(#[$meta])* pub $field: $ty,)*
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

    udp_tx_datagrams: u64,
    udp_tx_bytes: u64,
    udp_rx_datagrams: u64,
    udp_rx_bytes: u64,
    packets_sent: u64,
    packets_received: u64,
    packets_lost: u64,
    bytes_lost: u64,
    /// Stream bytes sent again after loss.
    stream_bytes_retransmitted: u64,
    /// Packets whose frames were sent a second time as redundancy on a lossy path.
    redundant_packets: u64,
    stream_bytes_sent: u64,
    packets_dropped: u64,
    spurious_losses: u64,
    pto_count: u64,
    key_updates: u64,
    /// Set once the handshake completes.
    handshake_duration: Option<Duration>,
    zero_rtt_attempted: bool,
    zero_rtt_accepted: bool,
    resumed: bool,
    /// The TLS 1.3 cipher suite's IANA name, e.g. `TLS13_AES_128_GCM_SHA256`.
    cipher_suite: Option<&'static str>,
    alpn: Option<Vec<u8>>,
    version: Option<Version>,
    migrations: u64,
    path_validations: u64,
    path_validation_failures: u64,
    retry_received: bool,
    max_concurrent_streams: usize,
}
