//! HTTP/3 (RFC 9114) and QPACK (RFC 9204) on kuai's QUIC streams, with HTTP datagrams
//! (RFC 9297) and extended CONNECT (RFC 9220).
//!
//! Requests and responses use the `http` crate's types; bodies stream in both directions.
//! [`Client`] sends requests on a connection; [`Server`] accepts them, or [`serve`] runs a
//! handler for each.

mod client;
mod conn;
mod datagram;
pub mod error;
pub mod frame;
pub mod message;
pub mod qpack;
mod server;
mod stream;

pub use client::Client;
pub use conn::Config;
pub use error::{Code, Error, H3Error};
pub use message::Protocol;
pub use server::{Body, Server, serve};
pub use stream::{RecvHalf, RequestStream, SendHalf};

/// The ALPN protocol ID of HTTP/3.
pub const ALPN: &[u8] = b"h3";
