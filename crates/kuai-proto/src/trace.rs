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
pub enum DropReason {
    KeyUnavailable,
    DecryptionFailure,
    Duplicate,
    HeaderParseError,
    UnexpectedVersion,
    ConnectionClosing,
}

/// A trace event. Field names follow qlog's `quic:` event schema so a JSON writer can map them
/// one to one.
#[derive(Debug, Clone)]
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

/// Connection statistics.
#[derive(Debug, Clone, Default)]
pub struct ConnectionStats {
    pub udp_tx_datagrams: u64,
    pub udp_tx_bytes: u64,
    pub udp_rx_datagrams: u64,
    pub udp_rx_bytes: u64,
    pub packets_sent: u64,
    pub packets_received: u64,
    pub packets_lost: u64,
    pub bytes_lost: u64,
    /// Stream bytes sent again after loss.
    pub stream_bytes_retransmitted: u64,
    /// Packets whose frames were sent a second time as redundancy on a lossy path.
    pub redundant_packets: u64,
    pub stream_bytes_sent: u64,
    pub packets_dropped: u64,
    pub spurious_losses: u64,
    pub pto_count: u64,
    pub key_updates: u64,
    /// Set once the handshake completes.
    pub handshake_duration: Option<Duration>,
    pub zero_rtt_attempted: bool,
    pub zero_rtt_accepted: bool,
    pub resumed: bool,
    /// The TLS 1.3 cipher suite's IANA name, e.g. `TLS13_AES_128_GCM_SHA256`.
    pub cipher_suite: Option<&'static str>,
    pub alpn: Option<Vec<u8>>,
    pub version: Option<Version>,
    pub migrations: u64,
    pub path_validations: u64,
    pub path_validation_failures: u64,
    pub retry_received: bool,
    pub max_concurrent_streams: usize,
    pub path: PathStats,
}
