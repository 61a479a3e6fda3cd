//! HTTP for applications and servers built on kuai.
//!
//! This crate is where issue 21's library grows: one server for HTTP/3, HTTP/2 and HTTP/1.1
//! and a client that picks the fastest way. It starts with what every server of files needs:
//! [`fs::StaticDir`], which maps request paths to files below a root without ever leaving
//! it, [`fs::FileChunks`], which reads a file (or a byte range of it) in large chunks without
//! stalling the runtime, and [`answer()`], which picks the status and headers of a file's
//! response: validators, conditional requests and byte ranges. [`ServeDir`] puts them
//! together as a `tower` service.
#![warn(missing_docs)]

pub mod answer;
mod body;
pub mod client;
mod error;
pub mod fs;
mod serve_dir;
pub mod server;

/// Internals for the fuzz targets; not a stable interface.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::server::hq_request_path;
}

pub use answer::{FileAnswer, FileInfo, answer};
pub use body::Body;
pub use client::{
    Client, ClientBuilder, ConnectionInfo, Mode, QuicConnection, RequestBody, Response, Timings,
};
pub use error::{BoxError, ConnectError, Error};
pub use serve_dir::{FileBody, ServeDir};
pub use server::{ConnInfo, EarlyData, Handle, Limits, Listener, Protocol, Server, server_tls};
