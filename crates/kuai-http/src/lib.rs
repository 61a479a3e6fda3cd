//! HTTP for applications and servers built on kuai: one server for HTTP/3, HTTP/2 and
//! HTTP/1.1, and a client that picks the fastest way to each server.
//!
//! - [`Server`] runs one `tower` service — an axum `Router` as it is, or [`ServeDir`] for a
//!   directory — over HTTP/3 on a QUIC endpoint and HTTP/2 and HTTP/1.1 on a TCP listener,
//!   normally on the same port ([`Listener::bind`]). See [`server`].
//! - [`Client`] sends requests over HTTP/3, raced against TCP, and learns which works where.
//!   See [`client`].
//! - [`fs::StaticDir`] maps request paths to files below a root without ever leaving it,
//!   [`fs::FileChunks`] reads a file in large chunks without stalling the runtime, and
//!   [`answer()`] picks a file response's status and headers: validators, conditional
//!   requests, byte ranges.
//!
//! A server and a client on loopback:
//!
//! ```
//! use kuai_http::{Client, Listener, Server, ServeDir};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A self-signed certificate for localhost.
//! let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()])?;
//! let cert = ck.cert.der().clone();
//! let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
//! let dir = std::env::temp_dir().join(format!("kuai-http-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! std::fs::write(dir.join("hello.txt"), "hello")?;
//!
//! // HTTP/3 on UDP and HTTP/2 + HTTP/1.1 on TCP, one port.
//! let tls = kuai_http::server_tls(vec![cert.clone()], key)?;
//! let listener = Listener::bind("127.0.0.1:0".parse()?, tls).await?;
//! let port = listener.local_addr()?.port();
//! let server = Server::new(ServeDir::new(&dir));
//! let handle = server.handle();
//! let served = tokio::spawn(server.serve(listener));
//!
//! let client = Client::builder()
//!     .system_roots(false)
//!     .add_root_certificate(cert)
//!     .resolve("localhost", port, ([127, 0, 0, 1], port).into())
//!     .build()?;
//! let resp = client.get(&format!("https://localhost:{port}/hello.txt")).send().await?;
//! assert_eq!(resp.protocol(), kuai_http::Protocol::Http3);
//! assert_eq!(&resp.bytes().await?[..], b"hello");
//!
//! client.close_connections();
//! handle.shutdown();
//! served.await??;
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

pub mod answer;
mod body;
pub mod client;
mod error;
pub mod fs;
pub mod metrics;
pub mod proxy;
pub mod router;
mod serve_dir;
pub mod server;

/// Internals for the fuzz targets; not a stable interface.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::client::state::{AltSvcHeader, parse_alt_svc};
    pub use crate::proxy::h1::parse::fuzz_responses;
    pub use crate::server::hq_request_path;
}

pub use answer::{FileAnswer, FileInfo, answer};
pub use body::Body;
pub use client::{
    Client, ClientBuilder, ConnectionInfo, Mode, QuicConnection, RequestBody, Response, Timings,
};
pub use error::{BoxError, ConnectError, Error};
pub use proxy::Proxy;
pub use router::Router;
pub use serve_dir::{FileBody, ServeDir};
pub use server::{
    Certificates, ConnInfo, EarlyData, Handle, Limits, Listener, Protocol, Server, server_tls,
};
