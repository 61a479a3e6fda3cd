//! kuai-proto: a sans-IO QUIC transport.
//!
//! Nothing in this crate touches sockets, threads or clocks. Datagrams and [`std::time::Instant`]s
//! go in; datagrams and timer deadlines come out. See `docs/architecture.md` for the event flow.

#![forbid(unsafe_code)]
#![cfg_attr(not(feature = "internals"), warn(missing_docs))]

// The public surface: congestion control (a trait users implement), connection-ID
// generation and QUIC-LB routable IDs, the varint codec HTTP/3 shares, tracing (qlog and other subscribers), and the
// re-exports below. The rest is internal; the `internals` feature opens it to this crate's
// tests, benchmarks and fuzz targets (not a stable interface).
pub mod cc;
pub mod cid;
pub mod coding;
pub mod quic_lb;
pub mod retry_offload;
pub mod trace;
pub mod varint;

macro_rules! internal {
    ($($m:ident),* $(,)?) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $m;
        // Some items exist for the tests, benchmarks and fuzz targets only.
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code)]
        mod $m;
    )*};
}

internal!(
    config,
    connection,
    crypto,
    endpoint,
    error,
    frame,
    packet,
    range_set,
    recovery,
    stream,
    token,
    transport_params,
    types,
);

pub use cid::{ConnectionId, ConnectionIdGenerator, RandomCidGenerator};
pub use config::{
    ClientConfig, EndpointConfig, MemoryBudget, PreferredAddressConfig, Redundancy, RetryPolicy,
    ServerConfig, TransportConfig,
};
pub use connection::{
    ConnectError, Connection, ConnectionError, DatagramError, EcnCodepoint, EcnState,
    EndpointEvent, Event, MemoryUse, MigrateError, PathHint, Transmit,
};
pub use endpoint::{ConnectionHandle, Endpoint, EndpointStats, address_key};
pub use error::{TransportError, TransportErrorCode};
pub use recovery::PathId;
pub use stream::{Priority, StreamError, StreamEvent};
pub use token::{TokenKey, TokenLog};
pub use types::{Dir, IdMap, Side, SpaceId, StreamId, Version};
pub use varint::VarInt;
