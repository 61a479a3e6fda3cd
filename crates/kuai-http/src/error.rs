//! The crate's error type.

use std::fmt;
use std::io;
use std::net::SocketAddr;

/// A boxed error from an application's service or body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What went wrong in the server, a request body or a response body.
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
    /// A request body grew past the server's limit ([`Limits::max_request_body`]).
    ///
    /// [`Limits::max_request_body`]: crate::Limits::max_request_body
    BodyTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Bind { addr, source } => write!(f, "cannot bind {addr}: {source}"),
            Error::Io(e) => write!(f, "{e}"),
            Error::Tls(e) => write!(f, "TLS configuration: {e}"),
            Error::H3(e) => write!(f, "HTTP/3: {e}"),
            Error::Hyper(e) => write!(f, "{e}"),
            Error::BodyTooLarge { limit } => {
                write!(f, "request body larger than the limit of {limit} bytes")
            }
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
            Error::Hyper(e) => Some(e),
            Error::BodyTooLarge { .. } => None,
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
