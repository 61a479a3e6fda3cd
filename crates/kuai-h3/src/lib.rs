//! HTTP/3 (RFC 9114) and QPACK (RFC 9204) on kuai's QUIC streams, with HTTP datagrams
//! (RFC 9297) and extended CONNECT (RFC 9220).
//!
//! Requests and responses use the `http` crate's types; bodies stream in both directions.
//! [`Client`] sends requests on a connection; [`Server`] accepts them, or [`serve`] runs a
//! handler for each.
#![warn(missing_docs)]

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

/// A request extension ([`http::Request::extensions`]) a server finds on requests whose head
/// arrived (at least in part) in 0-RTT: an attacker can replay those, so a handler should
/// answer non-idempotent ones with 425 Too Early (RFC 8470 §5.2) and pass the fact on to
/// any backend (the `Early-Data: 1` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EarlyData;

/// The ALPN protocol ID of HTTP/3.
pub const ALPN: &[u8] = b"h3";
