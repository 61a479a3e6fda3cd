//! What a proxy changes in the headers it forwards (RFC 9110 §7.6).

use std::fmt::Write;
use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// The request's Content-Length as one number, when its lines (and list elements) agree;
/// `None` when absent or unreadable (the server side has refused those already).
pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
    let mut n = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        for item in v.to_str().ok()?.split(',') {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let x: u64 = item.parse().ok()?;
            if n.is_some_and(|m| m != x) {
                return None;
            }
            n = Some(x);
        }
    }
    n
}

/// Removes the fields whose names hold `_` (see `ProxyBuilder::underscores_in_headers`).
pub(crate) fn strip_underscored(headers: &mut HeaderMap) {
    if !headers
        .keys()
        .any(|n| n.as_str().as_bytes().contains(&b'_'))
    {
        return;
    }
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().as_bytes().contains(&b'_'))
        .cloned()
        .collect();
    for n in names {
        tracing::debug!(field = %n, "request field with an underscore not forwarded");
        headers.remove(n);
    }
}

/// Removes the hop-by-hop fields: the fixed ones and every field `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_fields(headers, is_hop_by_hop)
}

/// Removes a backend response's hop-by-hop fields and its `Alt-Svc`: the alternatives a
/// backend names are its own (its ports, its hosts), not the gateway's, which advertises
/// its own HTTP/3 (and which a backend's `Alt-Svc` would otherwise suppress).
pub(crate) fn strip_response_fields(headers: &mut HeaderMap) {
    strip_fields(headers, |n| is_hop_by_hop(n) || n.as_str() == "alt-svc")
}

fn strip_fields(headers: &mut HeaderMap, strip: impl Fn(&HeaderName) -> bool) {
    // One pass over the names finds the ones to remove (most messages have none, or only
    // `Connection`): cheaper than a lookup, a hash, per hop-by-hop name. Nine can match.
    let mut found: [Option<HeaderName>; 9] = Default::default();
    for (slot, n) in found.iter_mut().zip(headers.keys().filter(|n| strip(n))) {
        *slot = Some(n.clone());
    }
    if found[0].is_none() {
        return;
    }
    if headers.contains_key(header::CONNECTION) {
        // `close` and `keep-alive`, the usual tokens, name no other field.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| !t.eq_ignore_ascii_case("close") && !t.eq_ignore_ascii_case("keep-alive"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for n in named {
            headers.remove(n);
        }
    }
    for n in found.into_iter().flatten() {
        headers.remove(n);
    }
}

/// Whether the request's `TE` has `trailers`: the client takes trailer fields.
pub(crate) fn asks_for_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|c| c.trim().eq_ignore_ascii_case("trailers"))
        })
}

/// Whether `name` belongs to one connection, not to the message (RFC 9110 §7.6.1, with the
/// non-standard `Keep-Alive` and `Proxy-Connection`); `Proxy-Authorization` is meant for
/// this proxy and goes no further. By length first: no hashing, nothing built.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    let s = name.as_str();
    match s.len() {
        2 => s == "te",
        7 => s == "trailer" || s == "upgrade",
        10 => s == "connection" || s == "keep-alive",
        16 => s == "proxy-connection",
        17 => s == "transfer-encoding",
        19 => s == "proxy-authorization",
        _ => false,
    }
}

/// Whether list field `name` holds `token` (case-insensitively).
pub(crate) fn has_token(h: &HeaderMap, name: HeaderName, token: &str) -> bool {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// A field value made of `text`, without copying it again.
fn value_of(mut text: String) -> Option<HeaderValue> {
    // Exactly sized, the string becomes `Bytes` without another allocation.
    text.shrink_to_fit();
    HeaderValue::from_maybe_shared(bytes::Bytes::from(text)).ok()
}

/// Appends `value` to the list in field `name`, the field's lines joined into one (as
/// nginx's `$proxy_add_x_forwarded_for` does); lines that are not text are dropped.
pub(crate) fn append_list(headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
    // One lookup (hashing the name once) whether the field is there or not.
    let mut entry = match headers.entry(name) {
        header::Entry::Vacant(e) => {
            e.insert(value);
            return;
        }
        header::Entry::Occupied(e) => e,
    };
    let mut joined = String::new();
    for v in entry.iter() {
        if let Ok(s) = v.to_str() {
            joined.push_str(s);
            joined.push_str(", ");
        }
    }
    match value.to_str() {
        Ok(v) => joined.push_str(v),
        Err(_) => return,
    }
    if let Some(v) = value_of(joined) {
        entry.insert(v);
    }
}

/// Appends `value` to the list in field `name`.
pub(crate) fn append_value(headers: &mut HeaderMap, name: HeaderName, value: &HeaderValue) {
    append_list(headers, name, value.clone());
}

/// Whether a `Forwarded` field value a client sent ends outside a quoted string (RFC 7239
/// §4: values are tokens or quoted strings, with backslash escapes inside them). One that does not
/// would swallow the element the proxy appends after it, for a lenient parser at the
/// backend: such a field is dropped rather than extended.
pub(crate) fn forwarded_is_closed(value: &[u8]) -> bool {
    let (mut quoted, mut escaped) = (false, false);
    for &b in value {
        if escaped {
            escaped = false;
        } else if quoted && b == b'\\' {
            escaped = true;
        } else if b == b'"' {
            quoted = !quoted;
        }
    }
    !quoted && !escaped
}

/// The `Forwarded` element for one hop (RFC 7239 §4): `for`, `proto` and, when known,
/// `host`; an IPv6 address and a host with a port are quoted strings (§6).
pub(crate) fn forwarded_element(client: IpAddr, host: Option<&str>) -> HeaderValue {
    let mut s = Line::default();
    match client {
        IpAddr::V4(_) => {
            s.push_str("for=");
            s.push_ip(client);
        }
        IpAddr::V6(_) => {
            s.push_str("for=\"[");
            s.push_ip(client);
            s.push_str("]\"");
        }
    }
    s.push_str(";proto=https");
    if let Some(h) = host.filter(|h| is_plain_host(h)) {
        if h.bytes().all(is_tchar) {
            s.push_str(";host=");
            s.push_str(h);
        } else {
            s.push_str(";host=\"");
            s.push_str(h);
            s.push_str("\"");
        }
    }
    s.value()
}

/// A client address as `X-Forwarded-For` lists it.
pub(crate) fn forwarded_for(client: IpAddr) -> HeaderValue {
    let mut s = Line::default();
    s.push_ip(client);
    s.value()
}

/// A short field value written on the stack, then copied once into the value's own bytes
/// (one allocation of its exact size, where a `String` grows and is shrunk again). What does
/// not fit in 256 bytes (a very long host) makes the line fall back to the heap.
struct Line {
    buf: Vec<u8>,
    stack: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Self {
            buf: Vec::new(),
            stack: [0; 256],
            len: 0,
        }
    }
}

impl Line {
    fn push_str(&mut self, s: &str) {
        let _ = self.write_str(s);
    }

    /// An address as `Display` writes it; an IPv4 one digit by digit (the formatter's
    /// padding logic cost more than the rest of a request's forwarding fields).
    fn push_ip(&mut self, ip: IpAddr) {
        let IpAddr::V4(a) = ip else {
            let _ = write!(self, "{ip}");
            return;
        };
        let mut out = [0u8; 15];
        let mut n = 0;
        for (i, octet) in a.octets().into_iter().enumerate() {
            if i > 0 {
                out[n] = b'.';
                n += 1;
            }
            if octet >= 100 {
                out[n] = b'0' + octet / 100;
                n += 1;
            }
            if octet >= 10 {
                out[n] = b'0' + octet / 10 % 10;
                n += 1;
            }
            out[n] = b'0' + octet % 10;
            n += 1;
        }
        // Digits and dots: always text.
        self.push_str(std::str::from_utf8(&out[..n]).unwrap_or_default());
    }

    fn value(&self) -> HeaderValue {
        let bytes = if self.buf.is_empty() {
            &self.stack[..self.len]
        } else {
            &self.buf[..]
        };
        HeaderValue::from_bytes(bytes).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if self.buf.is_empty() && self.len + s.len() <= self.stack.len() {
            self.stack[self.len..self.len + s.len()].copy_from_slice(s.as_bytes());
            self.len += s.len();
        } else {
            if self.buf.is_empty() {
                self.buf.extend_from_slice(&self.stack[..self.len]);
            }
            self.buf.extend_from_slice(s.as_bytes());
        }
        Ok(())
    }
}

/// A host as it may appear in `Forwarded` without escaping: letters, digits and the
/// punctuation of names, addresses and ports.
fn is_plain_host(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
}

/// RFC 9110 §5.6.2 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_is_one_number() {
        let mut h = HeaderMap::new();
        assert_eq!(content_length(&h), None);
        h.append(header::CONTENT_LENGTH, HeaderValue::from_static("5, 5"));
        h.append(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        assert_eq!(content_length(&h), Some(5));
        h.append(header::CONTENT_LENGTH, HeaderValue::from_static("6"));
        assert_eq!(content_length(&h), None);
    }

    #[test]
    fn forwarded_values_end_outside_quotes() {
        for ok in [
            &b"for=192.0.2.60;proto=http"[..],
            b"for=\"[2001:db8::1]:4711\"",
            b"for=x;note=\"a \\\" quote\", for=y",
            b"",
        ] {
            assert!(
                super::forwarded_is_closed(ok),
                "{}",
                String::from_utf8_lossy(ok)
            );
        }
        for bad in [&b"for=6.6.6.6;x=\""[..], b"for=\"a\\\"", b"x=\"\\"] {
            assert!(
                !super::forwarded_is_closed(bad),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn hop_by_hop_fields_and_those_connection_names_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, X-Secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key(header::ACCEPT));
    }

    #[test]
    fn the_hop_by_hop_names() {
        let hop_by_hop = [
            header::CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            header::TE,
            header::TRAILER,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::PROXY_AUTHORIZATION,
        ];
        for n in &hop_by_hop {
            assert!(is_hop_by_hop(n), "{n}");
        }
        for n in [
            "host",
            "tee",
            "trailers",
            "upgrade-insecure-requests",
            "via",
        ] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(n)), "{n}");
        }
    }

    #[test]
    fn a_list_field_grows_on_its_last_line() {
        let mut h = HeaderMap::new();
        append_list(&mut h, header::VIA, HeaderValue::from_static("3 kuai"));
        assert_eq!(h[header::VIA], "3 kuai");
        let name = HeaderName::from_static("x-forwarded-for");
        h.append(&name, HeaderValue::from_static("10.0.0.1"));
        h.append(&name, HeaderValue::from_static("10.0.0.2"));
        append_list(&mut h, name.clone(), forwarded_for([192, 0, 2, 7].into()));
        let all: Vec<_> = h.get_all(&name).iter().collect();
        assert_eq!(all, ["10.0.0.1, 10.0.0.2, 192.0.2.7"]);
    }

    #[test]
    fn forwarded_quotes_what_is_not_a_token() {
        let v4 = forwarded_element([192, 0, 2, 7].into(), Some("example.com"));
        assert_eq!(v4, "for=192.0.2.7;proto=https;host=example.com");
        let v6 = forwarded_element("2001:db8::1".parse().unwrap(), Some("example.com:8443"));
        assert_eq!(
            v6,
            "for=\"[2001:db8::1]\";proto=https;host=\"example.com:8443\""
        );
        let odd = forwarded_element([192, 0, 2, 7].into(), Some("a\"b"));
        assert_eq!(odd, "for=192.0.2.7;proto=https");
        let long = "h".repeat(300);
        let far = forwarded_element("2001:db8::1".parse().unwrap(), Some(&long));
        assert_eq!(
            far,
            format!("for=\"[2001:db8::1]\";proto=https;host={long}").as_str()
        );
        assert_eq!(forwarded_for("2001:db8::1".parse().unwrap()), "2001:db8::1");
        for a in [
            [0, 0, 0, 0],
            [10, 0, 0, 1],
            [192, 168, 100, 9],
            [255, 255, 255, 255],
            [1, 20, 199, 250],
        ] {
            let ip = IpAddr::from(a);
            assert_eq!(forwarded_for(ip), ip.to_string().as_str());
        }
    }
}
