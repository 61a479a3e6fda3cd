//! Transport error codes (RFC 9000 §20.1) and the error a connection closes with.

use std::borrow::Cow;
use std::fmt;

use crate::frame::FrameType;

/// A transport error code as carried in CONNECTION_CLOSE (type 0x1c).
#[derive(Copy, Clone, Eq, PartialEq, Hash)]
pub struct TransportErrorCode(pub u64);

macro_rules! codes {
    ($($name:ident = $val:expr, $text:expr;)*) => {
        impl TransportErrorCode {
            $(
                #[doc = concat!("`", $text, "` (RFC 9000 §20.1).")]
                pub const $name: Self = Self($val);
            )*

            /// The code's name in RFC 9000 §20.1 (RFC 9368 for version negotiation), or
            /// `CRYPTO_ERROR` for the TLS alert range; `None` for codes it does not define.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($val => Some($text),)*
                    0x0100..=0x01ff => Some("CRYPTO_ERROR"),
                    _ => None,
                }
            }
        }
    };
}

codes! {
    NO_ERROR = 0x0, "NO_ERROR";
    INTERNAL_ERROR = 0x1, "INTERNAL_ERROR";
    CONNECTION_REFUSED = 0x2, "CONNECTION_REFUSED";
    FLOW_CONTROL_ERROR = 0x3, "FLOW_CONTROL_ERROR";
    STREAM_LIMIT_ERROR = 0x4, "STREAM_LIMIT_ERROR";
    STREAM_STATE_ERROR = 0x5, "STREAM_STATE_ERROR";
    FINAL_SIZE_ERROR = 0x6, "FINAL_SIZE_ERROR";
    FRAME_ENCODING_ERROR = 0x7, "FRAME_ENCODING_ERROR";
    TRANSPORT_PARAMETER_ERROR = 0x8, "TRANSPORT_PARAMETER_ERROR";
    CONNECTION_ID_LIMIT_ERROR = 0x9, "CONNECTION_ID_LIMIT_ERROR";
    PROTOCOL_VIOLATION = 0xa, "PROTOCOL_VIOLATION";
    INVALID_TOKEN = 0xb, "INVALID_TOKEN";
    APPLICATION_ERROR = 0xc, "APPLICATION_ERROR";
    CRYPTO_BUFFER_EXCEEDED = 0xd, "CRYPTO_BUFFER_EXCEEDED";
    KEY_UPDATE_ERROR = 0xe, "KEY_UPDATE_ERROR";
    AEAD_LIMIT_REACHED = 0xf, "AEAD_LIMIT_REACHED";
    NO_VIABLE_PATH = 0x10, "NO_VIABLE_PATH";
    // RFC 9368 §10.2
    VERSION_NEGOTIATION_ERROR = 0x11, "VERSION_NEGOTIATION_ERROR";
}

impl TransportErrorCode {
    /// A TLS alert mapped into the CRYPTO_ERROR range (RFC 9001 §4.8).
    pub const fn crypto(alert: u8) -> Self {
        Self(0x100 | alert as u64)
    }
}

impl fmt::Debug for TransportErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) if self.0 >= 0x100 => write!(f, "{n}(alert {})", self.0 & 0xff),
            Some(n) => f.write_str(n),
            None => write!(f, "unknown({:#x})", self.0),
        }
    }
}

impl fmt::Display for TransportErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A transport-level error: the code, the frame type that caused it (if any), and a reason
/// phrase for humans.
#[derive(Clone, PartialEq, Eq)]
pub struct TransportError {
    /// The error code.
    pub code: TransportErrorCode,
    /// The type of the frame that caused it, if one did.
    pub frame: Option<FrameType>,
    /// Why, for the peer and the logs.
    pub reason: Cow<'static, str>,
}

impl TransportError {
    /// An error with `code` and `reason`.
    pub fn new(code: TransportErrorCode, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            code,
            frame: None,
            reason: reason.into(),
        }
    }

    /// Names the frame type that caused it.
    pub fn with_frame(mut self, frame: FrameType) -> Self {
        self.frame = Some(frame);
        self
    }
}

macro_rules! ctors {
    ($($fn:ident => $code:ident),* $(,)?) => {
        impl TransportError {
            $(
                #[allow(non_snake_case)]
                #[doc = concat!("A `", stringify!($code), "` error with `reason`.")]
                pub fn $fn(reason: impl Into<Cow<'static, str>>) -> Self {
                    Self::new(TransportErrorCode::$code, reason)
                }
            )*
        }
    };
}

ctors! {
    INTERNAL_ERROR => INTERNAL_ERROR,
    CONNECTION_REFUSED => CONNECTION_REFUSED,
    FLOW_CONTROL_ERROR => FLOW_CONTROL_ERROR,
    STREAM_LIMIT_ERROR => STREAM_LIMIT_ERROR,
    STREAM_STATE_ERROR => STREAM_STATE_ERROR,
    FINAL_SIZE_ERROR => FINAL_SIZE_ERROR,
    FRAME_ENCODING_ERROR => FRAME_ENCODING_ERROR,
    TRANSPORT_PARAMETER_ERROR => TRANSPORT_PARAMETER_ERROR,
    CONNECTION_ID_LIMIT_ERROR => CONNECTION_ID_LIMIT_ERROR,
    PROTOCOL_VIOLATION => PROTOCOL_VIOLATION,
    INVALID_TOKEN => INVALID_TOKEN,
    CRYPTO_BUFFER_EXCEEDED => CRYPTO_BUFFER_EXCEEDED,
    KEY_UPDATE_ERROR => KEY_UPDATE_ERROR,
    AEAD_LIMIT_REACHED => AEAD_LIMIT_REACHED,
    NO_VIABLE_PATH => NO_VIABLE_PATH,
    VERSION_NEGOTIATION_ERROR => VERSION_NEGOTIATION_ERROR,
}

impl fmt::Debug for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.code)?;
        if let Some(frame) = self.frame {
            write!(f, " in {frame:?}")?;
        }
        if !self.reason.is_empty() {
            f.write_str(": ")?;
            write_reason(f, &self.reason)?;
        }
        Ok(())
    }
}

/// A reason phrase as it may go into a log: a peer chooses it (CONNECTION_CLOSE), so control
/// characters (line breaks, terminal escapes) are escaped and at most [`REASON_SHOWN`]
/// characters shown.
fn write_reason(f: &mut fmt::Formatter<'_>, reason: &str) -> fmt::Result {
    use fmt::Write;
    for (i, c) in reason.chars().enumerate() {
        if i == REASON_SHOWN {
            return write!(f, "… ({} bytes)", reason.len());
        }
        if c.is_control() {
            for e in c.escape_default() {
                f.write_char(e)?;
            }
        } else {
            f.write_char(c)?;
        }
    }
    Ok(())
}

/// Characters of a reason phrase shown (see [`write_reason`]).
const REASON_SHOWN: usize = 256;

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for TransportError {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's reason phrase cannot forge log lines or send terminal escapes, nor make a
    /// line as long as its packet.
    #[test]
    fn a_peers_reason_is_escaped_and_cut() {
        let e = TransportError::new(
            TransportErrorCode::PROTOCOL_VIOLATION,
            "bad\r\nINFO forged line \u{1b}[31mred",
        );
        let shown = e.to_string();
        assert!(!shown.contains('\n') && !shown.contains('\r') && !shown.contains('\u{1b}'));
        assert!(shown.contains("bad\\r\\nINFO forged line \\u{1b}[31mred"), "{shown}");
        let long = TransportError::new(TransportErrorCode::PROTOCOL_VIOLATION, "x".repeat(1100));
        let shown = long.to_string();
        assert!(shown.len() < 320 && shown.ends_with("… (1100 bytes)"), "{shown}");
    }
}
