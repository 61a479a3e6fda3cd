//! The crate's error type.

use std::fmt;
use std::io;
use std::net::SocketAddr;

/// A boxed error from an application's service or body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What went wrong in the server, the client, or a message body.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A socket could not be bound.
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Another I/O failure.
    Io(io::Error),
    /// The TLS configuration was refused.
    Tls(rustls::Error),
    /// HTTP/3 failed (the connection, the stream, or a malformed message).
    H3(kuai_h3::Error),
    /// HTTP/2 or HTTP/1.1 failed (hyper).
    Hyper(hyper::Error),
    /// A kept-alive HTTP/1.1 connection ended before the response came: the server gave
    /// the connection up as the request went out (RFC 9112 §9.3.1). The client sends an
    /// idempotent request again on a new connection.
    Stale(hyper::Error),
    /// A request body grew past the server's limit ([`Limits::max_request_body`]).
    ///
    /// [`Limits::max_request_body`]: crate::Limits::max_request_body
    BodyTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// A URL the client cannot fetch (not `https`, no host, malformed).
    InvalidUrl {
        /// The URL.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The server's name did not resolve.
    Resolve {
        /// The name.
        host: String,
        /// Why.
        source: io::Error,
    },
    /// No connection: what HTTP/3 and TCP each ran into (those that were tried).
    Connect(Box<ConnectError>),
    /// Something did not happen in time.
    Timeout {
        /// What.
        what: &'static str,
        /// The time allowed.
        after: std::time::Duration,
    },
    /// The QUIC connection was lost or refused.
    Quic(kuai::ConnectionError),
    /// A configuration that cannot work (a proxy without upstreams, say).
    Config(String),
    /// A QUIC stream failed.
    Read(kuai::ReadError),
    /// A backend's response broke off (see [`proxy`](crate::proxy)).
    Upstream(crate::proxy::UpstreamError),
    /// A redirect the client was asked to follow could not be: one past the limit, or to
    /// a URL it cannot fetch (not `https`: no downgrade).
    Redirect {
        /// Where the last response pointed.
        location: String,
        /// Why it was not followed.
        reason: &'static str,
    },
}

/// Why the client could not connect to a server.
#[derive(Debug)]
#[non_exhaustive]
pub struct ConnectError {
    /// The server's address.
    pub addr: SocketAddr,
    /// Why HTTP/3 failed, if it was tried.
    pub http3: Option<Error>,
    /// Why TCP (HTTP/2 or HTTP/1.1) failed, if it was tried.
    pub tcp: Option<Error>,
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot connect to {}", self.addr)?;
        if let Some(e) = &self.http3 {
            write!(f, "; HTTP/3: {e}")?;
        }
        if let Some(e) = &self.tcp {
            write!(f, "; TCP: {e}")?;
        }
        Ok(())
    }
}

impl Error {
    /// Whether the server refused the connection (nothing listens on the port).
    pub fn is_refused(&self) -> bool {
        match self {
            Error::Io(e) => e.kind() == io::ErrorKind::ConnectionRefused,
            Error::Connect(c) => {
                c.http3.as_ref().is_none_or(Error::is_refused)
                    && c.tcp.as_ref().is_none_or(Error::is_refused)
            }
            _ => false,
        }
    }

    /// Whether the request is known not to have been processed, so that it may be sent
    /// again whatever its method: refused after the server's GOAWAY (RFC 9114 §5.2), reset
    /// with H3_REQUEST_REJECTED (§8.1), or never sent because its connection did not
    /// come up.
    pub fn is_unprocessed(&self) -> bool {
        matches!(
            self,
            Error::H3(
                kuai_h3::Error::GoingAway
                    | kuai_h3::Error::StreamReset(kuai_h3::Code::REQUEST_REJECTED)
            ) | Error::Connect(_)
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Bind { addr, source } => write!(f, "cannot bind {addr}: {source}"),
            Error::Io(e) => write!(f, "{e}"),
            Error::Tls(e) => write!(f, "TLS configuration: {e}"),
            Error::H3(e) => write!(f, "HTTP/3: {e}"),
            Error::Hyper(e) => write!(f, "{e}"),
            Error::Stale(e) => write!(f, "{e} (on a kept-alive connection the server closed)"),
            Error::BodyTooLarge { limit } => {
                write!(f, "request body larger than the limit of {limit} bytes")
            }
            Error::InvalidUrl { url, reason } => write!(f, "{url}: {reason}"),
            Error::Resolve { host, source } => write!(f, "cannot resolve {host}: {source}"),
            Error::Connect(c) => write!(f, "{c}"),
            Error::Timeout { what, after } => {
                write!(f, "{what}: nothing within {:.1} s", after.as_secs_f64())
            }
            Error::Quic(e) => write!(f, "QUIC: {e}"),
            Error::Config(why) => write!(f, "configuration: {why}"),
            Error::Redirect { location, reason } => {
                write!(f, "redirect to {location} not followed: {reason}")
            }
            Error::Read(e) => write!(f, "QUIC stream: {e}"),
            Error::Upstream(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Bind { source, .. } => Some(source),
            Error::Io(e) => Some(e),
            Error::Tls(e) => Some(e),
            Error::H3(e) => Some(e),
            Error::Hyper(e) | Error::Stale(e) => Some(e),
            Error::Resolve { source, .. } => Some(source),
            Error::Quic(e) => Some(e),
            Error::Read(e) => Some(e),
            Error::Upstream(e) => Some(e),
            Error::BodyTooLarge { .. }
            | Error::InvalidUrl { .. }
            | Error::Connect(_)
            | Error::Config(_)
            | Error::Timeout { .. }
            | Error::Redirect { .. } => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<rustls::Error> for Error {
    fn from(e: rustls::Error) -> Self {
        Error::Tls(e)
    }
}

impl From<kuai_h3::Error> for Error {
    fn from(e: kuai_h3::Error) -> Self {
        Error::H3(e)
    }
}

impl From<hyper::Error> for Error {
    fn from(e: hyper::Error) -> Self {
        Error::Hyper(e)
    }
}
