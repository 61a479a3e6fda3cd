//! HTTP/3 error codes (RFC 9114 §8.1, RFC 9204 §6, RFC 9297 §5.2).

use std::fmt;

/// An HTTP/3 application error code.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Code(pub u64);

macro_rules! codes {
    ($($name:ident = $v:expr,)*) => {
        impl Code {
            $(
                #[doc = concat!("`", stringify!($name), "` (", stringify!($v), ").")]
                pub const $name: Code = Code($v);
            )*

            fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($v => Some(concat!("H3_", stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}

codes! {
    NO_ERROR = 0x100,
    GENERAL_PROTOCOL_ERROR = 0x101,
    INTERNAL_ERROR = 0x102,
    STREAM_CREATION_ERROR = 0x103,
    CLOSED_CRITICAL_STREAM = 0x104,
    FRAME_UNEXPECTED = 0x105,
    FRAME_ERROR = 0x106,
    EXCESSIVE_LOAD = 0x107,
    ID_ERROR = 0x108,
    SETTINGS_ERROR = 0x109,
    MISSING_SETTINGS = 0x10a,
    REQUEST_REJECTED = 0x10b,
    REQUEST_CANCELLED = 0x10c,
    REQUEST_INCOMPLETE = 0x10d,
    MESSAGE_ERROR = 0x10e,
    CONNECT_ERROR = 0x10f,
    VERSION_FALLBACK = 0x110,
    QPACK_DECOMPRESSION_FAILED = 0x200,
    QPACK_ENCODER_STREAM_ERROR = 0x201,
    QPACK_DECODER_STREAM_ERROR = 0x202,
    DATAGRAM_ERROR = 0x33,
}

impl fmt::Debug for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "H3 error {:#x}", self.0),
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// An HTTP/3 error: a code and a reason.
#[derive(Clone, PartialEq, Eq)]
pub struct H3Error {
    /// The error code (RFC 9114 §8.1, RFC 9204 §6).
    pub code: Code,
    /// Why, for the peer and the logs.
    pub reason: std::borrow::Cow<'static, str>,
}

impl H3Error {
    /// An error with `code` and `reason`.
    pub fn new(code: Code, reason: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        Self {
            code,
            reason: reason.into(),
        }
    }
}

impl fmt::Debug for H3Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.reason)
    }
}

impl fmt::Display for H3Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for H3Error {}

/// What went wrong with a request or a connection, as the application sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The connection failed or was closed.
    Connection(kuai::ConnectionError),
    /// A protocol error on this stream or connection.
    Protocol(H3Error),
    /// The peer reset the stream (request cancelled, rejected, ...).
    StreamReset(Code),
    /// The peer stopped reading our body.
    Stopped(Code),
    /// The message is malformed (RFC 9114 §4.1.2); the stream was reset with H3_MESSAGE_ERROR.
    Malformed(&'static str),
    /// The server is going away (GOAWAY) and will not process this request.
    GoingAway,
    /// A body or header section exceeded a configured limit.
    TooLarge,
    /// The request went out in 0-RTT and the server rejected the early data, so it never
    /// saw it: send it again (the connection is usable; RFC 9114 §4.1, RFC 9001 §4.6.2).
    ZeroRttRejected,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Connection(e) => write!(f, "connection: {e}"),
            Error::Protocol(e) => write!(f, "protocol: {e}"),
            Error::StreamReset(c) => write!(f, "stream reset by peer: {c}"),
            Error::Stopped(c) => write!(f, "peer stopped reading: {c}"),
            Error::Malformed(r) => write!(f, "malformed message: {r}"),
            Error::GoingAway => f.write_str("server is going away"),
            Error::TooLarge => f.write_str("message too large"),
            Error::ZeroRttRejected => {
                f.write_str("the server rejected 0-RTT; send the request again")
            }
        }
    }
}

impl std::error::Error for Error {}

impl From<kuai::ConnectionError> for Error {
    fn from(e: kuai::ConnectionError) -> Self {
        Error::Connection(e)
    }
}

impl From<H3Error> for Error {
    fn from(e: H3Error) -> Self {
        Error::Protocol(e)
    }
}
