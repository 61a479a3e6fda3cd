//! kuai-proto: a sans-IO QUIC transport.
//!
//! Nothing in this crate touches sockets, threads or clocks. Datagrams and [`std::time::Instant`]s
//! go in; datagrams and timer deadlines come out. See `docs/architecture.md` for the event flow.

#![forbid(unsafe_code)]

pub mod cid;
pub mod coding;
pub mod error;
pub mod frame;
pub mod range_set;
pub mod types;
pub mod varint;

pub use cid::{ConnectionId, ConnectionIdGenerator, RandomCidGenerator};
pub use error::{TransportError, TransportErrorCode};
pub use types::{Dir, Side, SpaceId, StreamId, Version};
pub use varint::VarInt;
