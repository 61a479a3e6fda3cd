//! HTTP/1.1 toward a backend without I/O (RFC 9112): the request head going out, and the
//! response head, its body's framing and the chunked transfer coding coming back. Every
//! input is the backend's and is treated as hostile: bounded sizes, no panics.

use std::fmt::{self, Write as _};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use http::{Method, StatusCode, Version};

/// Most bytes of a response head (status line and fields).
pub(crate) const MAX_HEAD: usize = 64 * 1024;
/// Most fields in a response head.
pub(crate) const MAX_HEADERS: usize = 128;
/// Longest chunk-size line or trailer line.
const MAX_LINE: usize = 4096;
/// Most bytes of trailer section (read and dropped).
const MAX_TRAILERS: usize = 16 * 1024;

/// What is wrong with what a backend sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseError {
    /// The status line or a field line is malformed.
    Head(httparse::Error),
    /// The head is longer than 64 KiB or has more than 128 fields.
    HeadTooLarge,
    /// A field name or value that HTTP does not allow.
    Field,
    /// `Content-Length` is not one number (RFC 9112 §6.3, item 5).
    ContentLength,
    /// `101 Switching Protocols` to a request that asked for no upgrade.
    UnexpectedUpgrade,
    /// A chunk-size line is malformed or too long (RFC 9112 §7.1).
    ChunkSize,
    /// A chunk's data is not followed by CRLF.
    ChunkEnd,
    /// The trailer section is malformed or longer than 16 KiB.
    Trailers,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Head(e) => write!(f, "malformed response head: {e}"),
            ParseError::HeadTooLarge => {
                write!(
                    f,
                    "response head over {MAX_HEAD} bytes or {MAX_HEADERS} fields"
                )
            }
            ParseError::Field => f.write_str("a response field HTTP does not allow"),
            ParseError::ContentLength => f.write_str("Content-Length is not one number"),
            ParseError::UnexpectedUpgrade => f.write_str("101 to a request without Upgrade"),
            ParseError::ChunkSize => f.write_str("malformed chunk size"),
            ParseError::ChunkEnd => f.write_str("chunk data not followed by CRLF"),
            ParseError::Trailers => f.write_str("malformed or oversized trailer section"),
        }
    }
}

impl std::error::Error for ParseError {}

/// A response head, taken off the front of the read buffer. Its map holds the end-to-end
/// fields only: the hop-by-hop ones (RFC 9110 §7.6.1) belong to the connection to the
/// backend, and what they say about it is in `hop`.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    pub(crate) status: StatusCode,
    pub(crate) version: Version,
    pub(crate) headers: HeaderMap,
    pub(crate) hop: Hop,
    /// The fields `Connection` names besides its `close` and `keep-alive` options: still in
    /// `headers` for the framing to read as the backend sent it, to be removed before the
    /// response is passed on ([`ResponseHead::into_headers`]). Empty, unallocated, for
    /// nearly every response.
    named: Vec<HeaderName>,
}

impl ResponseHead {
    /// The fields to pass on: the map without those `Connection` named, and without
    /// `Content-Length` when a transfer coding framed the body (RFC 9112 §6.3, item 3: a
    /// proxy removes it; the length it states is not the body's).
    pub(crate) fn into_headers(self) -> HeaderMap {
        let mut headers = self.headers;
        for n in self.named {
            headers.remove(n);
        }
        if self.hop.transfer_encoding.is_some() {
            headers.remove(http::header::CONTENT_LENGTH);
        }
        headers
    }
}

/// What a response head's hop-by-hop fields said about the connection and the body's
/// transfer coding, read as the head is parsed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hop {
    /// `Connection` lists `close`.
    close: bool,
    /// `Connection` lists `keep-alive`.
    keep_alive: bool,
    /// `Transfer-Encoding` is present; `Some(true)` when its last coding is `chunked`.
    transfer_encoding: Option<bool>,
}

/// The hop-by-hop fields (RFC 9110 §7.6.1, with the non-standard `Keep-Alive` and
/// `Proxy-Connection`; `Proxy-Authorization` is meant for the proxy and goes no further),
/// told by length first, as `name` came off the wire (any case).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HopField {
    Connection,
    TransferEncoding,
    Other,
}

fn hop_field(name: &[u8]) -> Option<HopField> {
    let is = |s: &str| name.eq_ignore_ascii_case(s.as_bytes());
    match name.len() {
        2 if is("te") => Some(HopField::Other),
        7 if is("trailer") || is("upgrade") => Some(HopField::Other),
        10 if is("connection") => Some(HopField::Connection),
        10 if is("keep-alive") => Some(HopField::Other),
        16 if is("proxy-connection") => Some(HopField::Other),
        17 if is("transfer-encoding") => Some(HopField::TransferEncoding),
        19 if is("proxy-authorization") => Some(HopField::Other),
        _ => None,
    }
}

/// Whether a field value is text a `HeaderValue` would give as a `str` (visible ASCII,
/// space and tab): list fields in anything else are not read, as before the map was bypassed.
fn is_text(v: &[u8]) -> bool {
    v.iter().all(|&b| (b' '..0x7f).contains(&b) || b == b'\t')
}

/// The tokens of a list field's value, trimmed, empty ones skipped.
fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',').map(trim).filter(|t| !t.is_empty())
}

/// Parses the response head at the start of `buf` and takes it off; `Ok(None)` while it is
/// incomplete. Field values share the head's bytes (no copy per field).
pub(crate) fn parse_head(buf: &mut BytesMut) -> Result<Option<ResponseHead>, ParseError> {
    // Most heads have a few fields: small arrays on the stack first, the full allowance only
    // for a head with more.
    match parse_head_with::<24>(buf) {
        Err(TooMany) => parse_head_with::<MAX_HEADERS>(buf).map_err(ParseError::from),
        r => r.map_err(ParseError::from),
    }
}

/// As [`parse_head`], when a line has ended since the last call: `seen` is how much of
/// `buf` earlier calls looked at (0 to start, and again after a head). A head that trickles
/// in a few bytes at a time is parsed once per line, not once per read (which is quadratic
/// in the head's size). A line's fault shows when the line ends, or when the head reaches
/// its limit.
pub(crate) fn parse_head_lines(
    buf: &mut BytesMut,
    seen: &mut usize,
) -> Result<Option<ResponseHead>, ParseError> {
    if !buf.get(*seen..).unwrap_or_default().contains(&b'\n') {
        *seen = buf.len();
        return if buf.len() >= MAX_HEAD {
            Err(ParseError::HeadTooLarge)
        } else {
            Ok(None)
        };
    }
    let r = parse_head(buf);
    *seen = match r {
        Ok(None) => buf.len(),
        _ => 0,
    };
    r
}

/// Why [`parse_head_with`] failed: more fields than its arrays hold, or the head itself.
enum HeadError {
    TooMany,
    Bad(ParseError),
}
use HeadError::TooMany;

impl From<HeadError> for ParseError {
    fn from(e: HeadError) -> Self {
        match e {
            TooMany => ParseError::HeadTooLarge,
            HeadError::Bad(e) => e,
        }
    }
}

impl From<ParseError> for HeadError {
    fn from(e: ParseError) -> Self {
        HeadError::Bad(e)
    }
}

fn parse_head_with<const N: usize>(buf: &mut BytesMut) -> Result<Option<ResponseHead>, HeadError> {
    let mut fields = [httparse::EMPTY_HEADER; N];
    let mut resp = httparse::Response::new(&mut fields);
    let end = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(ParseError::HeadTooLarge.into());
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(TooMany),
        Err(e) => return Err(ParseError::Head(e).into()),
    };
    if end > MAX_HEAD {
        return Err(ParseError::HeadTooLarge.into());
    }
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(ParseError::Head(httparse::Error::Status))?;
    let version = match resp.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    // The hop-by-hop fields are read here and kept out of the map: what they say about the
    // connection and the transfer coding goes in `hop`, the fields `Connection` names (other
    // than its `close` and `keep-alive` options) in `named`.
    let mut hop = Hop::default();
    let mut named = Vec::new();
    for h in resp.headers.iter() {
        match hop_field(h.name.as_bytes()) {
            Some(HopField::Connection) if is_text(h.value) => {
                for t in tokens(h.value) {
                    if t.eq_ignore_ascii_case(b"close") {
                        hop.close = true;
                    } else if t.eq_ignore_ascii_case(b"keep-alive") {
                        hop.keep_alive = true;
                    } else if let Ok(n) = HeaderName::from_bytes(t) {
                        named.push(n);
                    }
                }
            }
            // RFC 9112 §6.3, item 4: the last coding of the last field decides.
            Some(HopField::TransferEncoding) => {
                let last = h.value.rsplit(|&b| b == b',').next().map(trim);
                hop.transfer_encoding = Some(
                    is_text(h.value) && last.is_some_and(|c| c.eq_ignore_ascii_case(b"chunked")),
                );
            }
            _ => {}
        }
    }
    // Where each kept field's name and value lie in the head, to slice the frozen head later.
    let base = buf.as_ptr() as usize;
    let mut spans = [(0u32, 0u32, 0u32, 0u32); N];
    let mut count = 0;
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        if hop_field(name).is_some() {
            continue;
        }
        let at = |s: &[u8]| (s.as_ptr() as usize).wrapping_sub(base) as u32;
        // `count` < N: the fields kept are some of the N the arrays hold.
        if let Some(span) = spans.get_mut(count) {
            *span = (
                at(name),
                name.len() as u32,
                at(h.value),
                h.value.len() as u32,
            );
            count += 1;
        }
    }
    let head = buf.split_to(end).freeze();
    let mut headers = HeaderMap::with_capacity(count);
    for &(ns, nl, vs, vl) in &spans[..count] {
        let (ns, nl, vs, vl) = (ns as usize, nl as usize, vs as usize, vl as usize);
        let name = head
            .get(ns..ns + nl)
            .and_then(|n| HeaderName::from_bytes(n).ok())
            .ok_or(ParseError::Field)?;
        if vs + vl > head.len() {
            return Err(ParseError::Field.into());
        }
        let value = HeaderValue::from_maybe_shared(head.slice(vs..vs + vl))
            .map_err(|_| ParseError::Field)?;
        headers.append(name, value);
    }
    Ok(Some(ResponseHead {
        status,
        version,
        headers,
        hop,
        named,
    }))
}

/// How a response's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body (a response to HEAD, 204, 304).
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// The chunked transfer coding.
    Chunked,
    /// Everything until the backend closes the connection.
    Close,
}

/// The body's framing, and whether the connection can carry another request after it.
pub(crate) fn framing(head: &ResponseHead, to_head: bool) -> Result<(Framing, bool), ParseError> {
    let h = &head.headers;
    let mut keep_alive = match head.version {
        Version::HTTP_10 => head.hop.keep_alive,
        _ => !head.hop.close,
    };
    // RFC 9112 §6.3, in its order.
    if to_head
        || head.status == StatusCode::NO_CONTENT
        || head.status == StatusCode::NOT_MODIFIED
        || head.status.is_informational()
    {
        return Ok((Framing::Empty, keep_alive));
    }
    if let Some(chunked_last) = head.hop.transfer_encoding {
        // Item 4: chunked last means chunked; otherwise the body runs to the close. With
        // Content-Length beside it, or in HTTP/1.0 (§6.1), the framing is suspect: the
        // connection is not used again.
        if head.version == Version::HTTP_10 || h.contains_key(header::CONTENT_LENGTH) {
            keep_alive = false;
        }
        if head.version != Version::HTTP_10 && chunked_last {
            return Ok((Framing::Chunked, keep_alive));
        }
        return Ok((Framing::Close, false));
    }
    // Item 5: several values (fields or a list) must all be the same number.
    let mut length: Option<u64> = None;
    for v in h.get_all(header::CONTENT_LENGTH) {
        for part in v.as_bytes().split(|&b| b == b',') {
            let n = parse_decimal(trim(part)).ok_or(ParseError::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(ParseError::ContentLength);
            }
            length = Some(n);
        }
    }
    match length {
        Some(n) => Ok((Framing::Length(n), keep_alive)),
        None => Ok((Framing::Close, false)),
    }
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// 1 to 18 decimal digits (no sign, nothing else).
fn parse_decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 18 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Decodes the chunked transfer coding (RFC 9112 §7.1); chunk extensions and trailers are
/// read and dropped.
#[derive(Debug, Clone, Default)]
pub(crate) struct Chunked {
    state: ChunkState,
    /// Trailer bytes so far.
    trailers: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ChunkState {
    /// Before a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk's data, with this much left.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, in the trailer section.
    Trailers,
    Done,
}

impl Chunked {
    /// The body has ended (the last chunk and the trailer section were read).
    pub(crate) fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Consumes what it can from the front of `buf`: the next piece of the body's data, or
    /// `None` when more input is needed or the body has ended ([`is_done`](Self::is_done)).
    /// With `data` false it stops before a chunk's data instead of returning it (to notice
    /// the end as early as the bytes allow).
    pub(crate) fn decode(
        &mut self,
        buf: &mut BytesMut,
        data: bool,
    ) -> Result<Option<Bytes>, ParseError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(None),
                ChunkState::Size => {
                    let Some(line) = take_line(buf, ParseError::ChunkSize)? else {
                        return Ok(None);
                    };
                    let size = chunk_size(&line)?;
                    self.state = if size == 0 {
                        ChunkState::Trailers
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(left) => {
                    if !data || buf.is_empty() {
                        return Ok(None);
                    }
                    let n = (buf.len() as u64).min(left) as usize;
                    let piece = buf.split_to(n).freeze();
                    self.state = match left - n as u64 {
                        0 => ChunkState::DataEnd,
                        l => ChunkState::Data(l),
                    };
                    return Ok(Some(piece));
                }
                ChunkState::DataEnd => match buf.first() {
                    None => return Ok(None),
                    Some(b'\n') => {
                        buf.advance(1);
                        self.state = ChunkState::Size;
                    }
                    Some(b'\r') => match buf.get(1) {
                        None => return Ok(None),
                        Some(b'\n') => {
                            buf.advance(2);
                            self.state = ChunkState::Size;
                        }
                        Some(_) => return Err(ParseError::ChunkEnd),
                    },
                    Some(_) => return Err(ParseError::ChunkEnd),
                },
                ChunkState::Trailers => {
                    let before = buf.len();
                    let Some(line) = take_line(buf, ParseError::Trailers)? else {
                        return Ok(None);
                    };
                    self.trailers += before - buf.len();
                    if self.trailers > MAX_TRAILERS {
                        return Err(ParseError::Trailers);
                    }
                    if line.is_empty() {
                        self.state = ChunkState::Done;
                    }
                }
            }
        }
    }
}

/// Takes a line (up to LF, a CR before it dropped) off `buf`; `None` while there is no
/// LF yet, `err` when the line is longer than [`MAX_LINE`].
fn take_line(buf: &mut BytesMut, err: ParseError) -> Result<Option<BytesMut>, ParseError> {
    let window = &buf[..buf.len().min(MAX_LINE)];
    let Some(lf) = window.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= MAX_LINE {
            Err(err)
        } else {
            Ok(None)
        };
    };
    let mut line = buf.split_to(lf + 1);
    line.truncate(lf);
    if line.last() == Some(&b'\r') {
        line.truncate(lf - 1);
    }
    Ok(Some(line))
}

/// `chunk-size [ BWS ";" chunk-ext ]`: hexadecimal, at most 15 digits.
fn chunk_size(line: &[u8]) -> Result<u64, ParseError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 15 {
        return Err(ParseError::ChunkSize);
    }
    let rest = trim(&line[digits..]);
    if !(rest.is_empty() || rest[0] == b';') || rest.contains(&b'\r') {
        return Err(ParseError::ChunkSize);
    }
    let mut n = 0u64;
    for &b in &line[..digits] {
        let d = (b as char).to_digit(16).ok_or(ParseError::ChunkSize)?;
        n = n * 16 + u64::from(d);
    }
    Ok(n)
}

/// How a request's body goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestFraming {
    /// No body and no framing field (a GET, say).
    None,
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked`, for a body of unknown length.
    Chunked,
}

impl RequestFraming {
    /// The framing for a request with `method` and `headers` whose body has `ended` (known
    /// to hold nothing more) or has `exact` bytes: its exact length when known (from the
    /// body or the client's `Content-Length`), chunked when not; nothing for an empty body
    /// where the method gives a body no meaning.
    pub(crate) fn choose(
        method: &Method,
        headers: &HeaderMap,
        ended: bool,
        exact: Option<u64>,
    ) -> Self {
        if ended || exact == Some(0) {
            return match *method {
                Method::GET
                | Method::HEAD
                | Method::DELETE
                | Method::OPTIONS
                | Method::TRACE
                | Method::CONNECT => RequestFraming::None,
                _ => RequestFraming::Length(0),
            };
        }
        if let Some(n) = exact {
            return RequestFraming::Length(n);
        }
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| parse_decimal(trim(v.as_bytes())));
        match declared {
            Some(n) => RequestFraming::Length(n),
            None => RequestFraming::Chunked,
        }
    }
}

/// Writes the request head: `METHOD target HTTP/1.1`, the fields (but any framing field of
/// the client's: the body's framing is this hop's), and the framing field.
pub(crate) fn encode_head(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    framing: RequestFraming,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(if target.is_empty() {
        b"/"
    } else {
        target.as_bytes()
    });
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        RequestFraming::None => {}
        RequestFraming::Length(n) => {
            let mut s = String::with_capacity(40);
            let _ = write!(s, "content-length: {n}\r\n");
            out.extend_from_slice(s.as_bytes());
        }
        RequestFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
}

/// The line before a chunk of `len` bytes (`len` > 0), after the previous chunk's CRLF when
/// `after_chunk`.
pub(crate) fn chunk_prefix(out: &mut Vec<u8>, len: usize, after_chunk: bool) {
    if after_chunk {
        out.extend_from_slice(b"\r\n");
    }
    let mut s = String::with_capacity(20);
    let _ = write!(s, "{len:x}\r\n");
    out.extend_from_slice(s.as_bytes());
}

/// The end of a chunked body: the last chunk and an empty trailer section.
pub(crate) fn chunk_end(out: &mut Vec<u8>, after_chunk: bool) {
    if after_chunk {
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> ResponseHead {
        let mut b = BytesMut::from(text);
        parse_head(&mut b).unwrap().unwrap()
    }

    #[test]
    fn a_head_trickling_in_parses_once_its_lines_end() {
        let text = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi";
        let (mut b, mut seen, mut heads) = (BytesMut::new(), 0, vec![]);
        for &byte in text.iter() {
            b.extend_from_slice(&[byte]);
            while let Some(h) = parse_head_lines(&mut b, &mut seen).unwrap() {
                heads.push(h.status.as_u16());
            }
        }
        assert_eq!(heads, [103, 200]);
        assert_eq!(&b[..], b"hi");
        // A line that never ends is refused at the head's limit, as a whole one is.
        let (mut b, mut seen) = (BytesMut::from("HTTP/1.1 200 OK\r\nX: "), 0);
        assert!(parse_head_lines(&mut b, &mut seen).unwrap().is_none());
        while b.len() < MAX_HEAD {
            b.extend_from_slice(&[b'a'; 4096]);
            if b.len() < MAX_HEAD {
                assert!(parse_head_lines(&mut b, &mut seen).unwrap().is_none());
            }
        }
        assert!(matches!(
            parse_head_lines(&mut b, &mut seen),
            Err(ParseError::HeadTooLarge)
        ));
        // A fault shows when its line ends.
        let (mut b, mut seen) = (BytesMut::from("HTTP/1.1 2x0 OK"), 0);
        assert!(parse_head_lines(&mut b, &mut seen).unwrap().is_none());
        b.extend_from_slice(b"\r\n");
        assert!(parse_head_lines(&mut b, &mut seen).is_err());
    }

    #[test]
    fn a_head_parses_whole_or_waits() {
        let text = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b c\r\n\r\nhello";
        for cut in 0..text.len() {
            let mut b = BytesMut::from(&text[..cut]);
            let r = parse_head(&mut b).unwrap();
            assert_eq!(r.is_some(), cut >= text.len() - 5, "cut at {cut}");
        }
        let mut b = BytesMut::from(text);
        let h = parse_head(&mut b).unwrap().unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.headers["x-a"], "b c");
        assert_eq!(&b[..], b"hello");
        assert_eq!(framing(&h, false).unwrap(), (Framing::Length(5), true));
    }

    #[test]
    fn oversized_and_malformed_heads_are_refused() {
        let mut big = BytesMut::from("HTTP/1.1 200 OK\r\n");
        while big.len() < MAX_HEAD {
            big.extend_from_slice(b"X-Fill: 0123456789012345678901234567890123456789\r\n");
        }
        assert!(parse_head(&mut big).is_err());
        // More fields than the first try's arrays hold, fewer than the limit: parsed.
        let mut fifty = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..50 {
            fifty.push_str(&format!("X-{i}: v{i}\r\n"));
        }
        fifty.push_str("\r\n");
        // Also when a large read brought much of the body along.
        let mut with_body = BytesMut::from(&fifty[..]);
        with_body.extend_from_slice(&vec![b'x'; MAX_HEAD * 2]);
        assert!(parse_head(&mut with_body).unwrap().is_some());
        assert_eq!(with_body.len(), MAX_HEAD * 2);
        let h = parse_head(&mut BytesMut::from(&fifty[..]))
            .unwrap()
            .unwrap();
        assert_eq!(h.headers.len(), 50);
        assert_eq!(h.headers["x-49"], "v49");
        let mut many = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..=MAX_HEADERS {
            many.push_str(&format!("X-{i}: v\r\n"));
        }
        many.push_str("\r\n");
        assert_eq!(
            parse_head(&mut BytesMut::from(&many[..])).unwrap_err(),
            ParseError::HeadTooLarge
        );
        assert!(parse_head(&mut BytesMut::from("HTTP/1.1 2000 OK\r\n\r\n")).is_err());
        assert!(parse_head(&mut BytesMut::from("SSH-2.0-OpenSSH\r\n\r\n")).is_err());
    }

    #[test]
    fn framing_follows_rfc_9112_section_6_3() {
        let f = |t: &str, to_head| framing(&head(t), to_head);
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true).unwrap(),
            (Framing::Empty, true)
        );
        assert_eq!(
            f(
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false
            )
            .unwrap()
            .0,
            Framing::Empty
        );
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Chunked, true)
        );
        // Both framing fields: chunked wins, the connection is not reused.
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Chunked, false)
        );
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Close, false)
        );
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\nContent-Length: 7, 7\r\nContent-Length: 7\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Length(7), true)
        );
        for bad in ["7, 8", "-1", "+7", "0x7", "", "99999999999999999999"] {
            let t = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
            assert_eq!(
                f(&t, false).unwrap_err(),
                ParseError::ContentLength,
                "{bad:?}"
            );
        }
        assert_eq!(
            f("HTTP/1.1 200 OK\r\n\r\n", false).unwrap(),
            (Framing::Close, false)
        );
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 1\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Length(1), false)
        );
        assert_eq!(
            f("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false).unwrap(),
            (Framing::Length(1), false)
        );
        assert_eq!(
            f(
                "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
                false
            )
            .unwrap(),
            (Framing::Length(1), true)
        );
    }

    #[test]
    fn hop_by_hop_fields_stay_out_of_the_map() {
        let h = head(
            "HTTP/1.1 200 OK\r\nX-Secret: 1\r\nContent-Length: 2\r\nKeep-Alive: timeout=5\r\n\
             CONNECTION: Keep-Alive, x-secret\r\nTE: trailers\r\nUpgrade: h2c\r\n\
             Proxy-Connection: close\r\nTrailer: X-T\r\nProxy-Authorization: x\r\n\
             X-Kept: 2\r\n\r\n",
        );
        let names: Vec<&str> = h.headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["x-secret", "content-length", "x-kept"]);
        let passed_on = h.into_headers();
        let mut names: Vec<&str> = passed_on.keys().map(|n| n.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-length", "x-kept"]);
        let h = head("HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nCONNECTION: Keep-Alive\r\n\r\n");
        assert_eq!(
            h.hop,
            Hop {
                close: false,
                keep_alive: true,
                transfer_encoding: None
            }
        );
        // A field named in a later `Connection` field goes too, after the framing read the
        // head as it came (here a Content-Length beside chunked); one named in none stays.
        let h = head(
            "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nContent-Length: 3\r\n\
             Connection: close\r\nConnection: x-a, content-length\r\n\
             Transfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!(framing(&h, false).unwrap(), (Framing::Chunked, false));
        assert_eq!(
            h.hop,
            Hop {
                close: true,
                keep_alive: false,
                transfer_encoding: Some(true)
            }
        );
        let passed_on = h.into_headers();
        let names: Vec<&str> = passed_on.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["x-b"]);
        // The last Transfer-Encoding field decides.
        let h = head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
        );
        assert_eq!(h.hop.transfer_encoding, Some(false));
        assert_eq!(framing(&h, false).unwrap(), (Framing::Close, false));
    }

    /// Decodes `wire` fed in pieces of `step` bytes; the body, or the error.
    fn dechunk(wire: &[u8], step: usize) -> Result<(Vec<u8>, usize), ParseError> {
        let mut c = Chunked::default();
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for piece in wire.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            while let Some(d) = c.decode(&mut buf, true)? {
                out.extend_from_slice(&d);
            }
        }
        assert!(c.is_done(), "not done");
        Ok((out, buf.len()))
    }

    #[test]
    fn chunked_bodies_decode_in_any_pieces() {
        let wire =
            b"5;ext=1\r\nhello\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: 1\r\n\r\nNEXT";
        for step in 1..wire.len() {
            let (body, left) = dechunk(wire, step).unwrap();
            assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz");
            assert_eq!(left, 4, "the next response stays in the buffer");
        }
        // Bare LF line ends are accepted (RFC 9112 §2.2).
        assert_eq!(dechunk(b"3\nabc\n0\n\n", 1).unwrap().0, b"abc");
    }

    #[test]
    fn malformed_chunks_are_refused() {
        for bad in [
            &b"x\r\n"[..],
            b"-1\r\n",
            b"1000000000000000\r\n",
            b"3 x\r\nabc\r\n",
            b"3\r\nabcX\r\n",
        ] {
            assert!(
                dechunk(bad, 64).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let mut long = b"1".repeat(2);
        long.extend(std::iter::repeat_n(b' ', MAX_LINE));
        assert_eq!(dechunk(&long, 64).unwrap_err(), ParseError::ChunkSize);
        let mut trailers = b"0\r\n".to_vec();
        for _ in 0..2000 {
            trailers.extend_from_slice(b"X-T: 0123456789\r\n");
        }
        assert_eq!(dechunk(&trailers, 100).unwrap_err(), ParseError::Trailers);
    }

    #[test]
    fn request_heads_carry_this_hops_framing() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("example.com"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            &Method::POST,
            "/up?x=1",
            &h,
            RequestFraming::Chunked,
        );
        assert_eq!(
            out,
            b"POST /up?x=1 HTTP/1.1\r\nhost: example.com\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        let mut out = Vec::new();
        chunk_prefix(&mut out, 26, false);
        chunk_prefix(&mut out, 1, true);
        chunk_end(&mut out, true);
        assert_eq!(out, b"1a\r\n\r\n1\r\n\r\n0\r\n\r\n");
    }
}

/// Reads `wire` as a backend's responses would arrive, `step` bytes at a time: heads, their
/// framing and their bodies, one response after another. For the fuzz target: it must not
/// panic, no head may keep a hop-by-hop field in its map, and no body may yield more bytes
/// than arrived or than its length allows.
#[cfg(feature = "fuzzing")]
pub fn fuzz_responses(wire: &[u8], step: usize, to_head: bool) {
    let mut buf = BytesMut::new();
    let mut pieces = wire.chunks(step.max(1));
    let mut fill = |buf: &mut BytesMut| match pieces.next() {
        Some(p) => {
            buf.extend_from_slice(p);
            true
        }
        None => false,
    };
    let mut seen = 0;
    loop {
        let head = loop {
            match parse_head_lines(&mut buf, &mut seen) {
                Ok(Some(h)) => break h,
                Ok(None) if fill(&mut buf) => {}
                _ => return,
            }
        };
        // The map holds end-to-end fields only.
        assert!(head.headers.keys().all(|n| hop_field(n.as_ref()).is_none()));
        let Ok((framing, keep_alive)) = framing(&head, to_head) else {
            return;
        };
        let mut got = 0u64;
        match framing {
            Framing::Empty => {}
            Framing::Length(n) => {
                while got < n {
                    if buf.is_empty() && !fill(&mut buf) {
                        return;
                    }
                    let take = (buf.len() as u64).min(n - got);
                    got += buf.split_to(take as usize).len() as u64;
                }
                assert_eq!(got, n);
            }
            Framing::Chunked => {
                let mut c = Chunked::default();
                loop {
                    match c.decode(&mut buf, true) {
                        Ok(Some(d)) => got += d.len() as u64,
                        Ok(None) if c.is_done() => break,
                        Ok(None) if fill(&mut buf) => {}
                        _ => return,
                    }
                }
                assert!(got <= wire.len() as u64);
            }
            Framing::Close => return,
        }
        if !keep_alive {
            return;
        }
    }
}
