//! Observability: qlog-shaped trace events (draft-ietf-quic-qlog-quic-events) delivered to a
//! callback, and per-connection statistics.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::recovery::PathId;
use crate::types::{SpaceId, Version};

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
    /// `recovery:packet_lost`
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
    /// `recovery:metrics_updated`
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
    /// `recovery:congestion_state_updated`
    CongestionStateUpdated {
        /// The path.
        path: PathId,
        /// The controller's new state (`slow_start`, `congestion_avoidance`, ...).
        state: &'static str,
    },
    /// `security:key_updated`
    KeyUpdated {
        /// `local_update` or `remote_update`.
        trigger: &'static str,
        /// The key phase generation now in use.
        generation: u64,
    },
    /// `security:key_discarded`
    KeyDiscarded {
        /// The packet-number space whose keys went.
        space: SpaceId,
    },
    /// `transport:parameters_set`
    ParametersSet {
        /// Ours (`true`) or the peer's.
        owner_local: bool,
        /// The parameters, as text.
        summary: String,
    },
    /// `connectivity:connection_state_updated`
    ConnectionStateUpdated {
        /// The new state, by qlog name.
        new: &'static str,
    },
    /// `connectivity:path_updated` / migration.
    PathUpdated {
        /// The path.
        path: PathId,
        /// The peer's address on it.
        remote: SocketAddr,
        /// What happened (`validated`, `migrated`, ...).
        event: &'static str,
    },
    /// `recovery:mtu_updated`
    MtuUpdated {
        /// The path.
        path: PathId,
        /// The largest datagram size known to get through, in bytes.
        mtu: u16,
        /// The search is over.
        done: bool,
    },
    /// `transport:version_information`
    VersionChosen {
        /// The version in use.
        version: Version,
    },
}

/// Receives a connection's trace events.
pub trait Tracer: Send {
    /// Called for each event as it happens, with the time the connection was given.
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>);
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
}
