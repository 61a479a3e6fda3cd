//! kuai-proto: a sans-IO QUIC transport.
//!
//! Nothing in this crate touches sockets, threads or clocks. Datagrams and [`std::time::Instant`]s
//! go in; datagrams and timer deadlines come out. See `docs/architecture.md` for the event flow.

#![forbid(unsafe_code)]

pub mod cc;
pub mod cid;
pub mod coding;
pub mod config;
pub mod connection;
pub mod crypto;
pub mod endpoint;
pub mod error;
pub mod frame;
pub mod packet;
pub mod range_set;
pub mod recovery;
pub mod stream;
pub mod token;
pub mod trace;
pub mod transport_params;
pub mod types;
pub mod varint;

pub use cid::{ConnectionId, ConnectionIdGenerator, RandomCidGenerator};
pub use config::{ClientConfig, EndpointConfig, ServerConfig, TransportConfig};
pub use connection::{Connection, ConnectionError, Event, MemoryUse, PathHint, Transmit};
pub use endpoint::{ConnectionHandle, Endpoint};
pub use error::{TransportError, TransportErrorCode};
pub use stream::{Priority, StreamEvent};
pub use types::{Dir, IdMap, Side, SpaceId, StreamId, Version};
pub use varint::VarInt;
