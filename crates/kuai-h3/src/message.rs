//! HTTP messages as QPACK field lists: conversion to and from the `http` crate's types, and
//! the validity rules of RFC 9114 §4.1.2 and §4.3.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};

/// Spare field slots in a request's header map (see `parse_request`).
const REQUEST_SLACK: usize = 6;

/// Field lines in a section at most. Each line costs 32 bytes of the section size limit,
/// but a dynamic-table reference is one byte on the wire: a large limit would let a peer
/// send tens of thousands of lines, and `HeaderMap` panics past 2^15 entries.
pub const MAX_FIELD_LINES: usize = 4096;

/// A field list as QPACK takes it.
pub type Fields = Vec<(Bytes, Bytes)>;

/// Header fields HTTP/3 forbids (RFC 9114 §4.2: connection-specific).
const CONNECTION_SPECIFIC: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// Header fields as the QPACK encoder takes them, borrowed, but the connection-specific ones.
pub(crate) fn regular_field_refs(headers: &HeaderMap) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers
        .iter()
        .filter(|(n, _)| !CONNECTION_SPECIFIC.contains(&n.as_str()))
        .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
}

/// Owned copies of borrowed fields.
fn owned<'a>(fields: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> Fields {
    fields
        .map(|(n, v)| (Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
        .collect()
}

/// Fields of a request (pseudo-headers first).
pub fn request_fields(parts: &http::request::Parts) -> Result<Fields, &'static str> {
    let mut f = Fields::new();
    let method = parts.method.as_str();
    f.push((
        Bytes::from_static(b":method"),
        Bytes::copy_from_slice(method.as_bytes()),
    ));
    let protocol = parts.extensions.get::<Protocol>();
    let authority = parts
        .uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        });
    if protocol.is_some() && parts.method != Method::CONNECT {
        // RFC 9220 §3 (RFC 8441 §4): :protocol only on an extended CONNECT.
        return Err(":protocol on a request that is not a CONNECT");
    }
    if parts.method == Method::CONNECT && protocol.is_none() {
        // Plain CONNECT (RFC 9114 §4.4): only :method and :authority.
        let a = authority.ok_or("CONNECT needs an authority")?;
        f.push((Bytes::from_static(b":authority"), Bytes::from(a)));
    } else {
        if protocol.is_some() && authority.is_none() {
            // An extended CONNECT names its target as any https request does (RFC 9220
            // §3, RFC 9114 §4.3.1): a server takes one without :authority as malformed.
            return Err("an extended CONNECT needs an authority");
        }
        let scheme = parts.uri.scheme_str().unwrap_or("https");
        f.push((
            Bytes::from_static(b":scheme"),
            Bytes::copy_from_slice(scheme.as_bytes()),
        ));
        if let Some(a) = authority {
            f.push((Bytes::from_static(b":authority"), Bytes::from(a)));
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        f.push((
            Bytes::from_static(b":path"),
            Bytes::copy_from_slice(path.as_bytes()),
        ));
        if let Some(p) = protocol {
            f.push((
                Bytes::from_static(b":protocol"),
                Bytes::copy_from_slice(p.0.as_bytes()),
            ));
        }
    }
    // Host is carried as :authority.
    let regular = regular_field_refs(&parts.headers).filter(|(n, _)| *n != b"host");
    f.extend(owned(regular));
    Ok(f)
}

/// Fields of a response.
pub fn response_fields(parts: &http::response::Parts) -> Fields {
    owned(response_field_refs(parts))
}

/// A response head's fields as the QPACK encoder takes them, borrowed: `:status`, then the
/// header fields but the connection-specific ones.
pub(crate) fn response_field_refs(
    parts: &http::response::Parts,
) -> impl Iterator<Item = (&[u8], &[u8])> {
    std::iter::once((&b":status"[..], parts.status.as_str().as_bytes()))
        .chain(regular_field_refs(&parts.headers))
}

/// Fields of a trailer section.
pub fn trailer_fields(headers: &HeaderMap) -> Fields {
    owned(regular_field_refs(headers))
}

/// The extended CONNECT protocol (RFC 9220 `:protocol`), carried in request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protocol(pub String);

/// Checks regular fields and builds a header map (RFC 9114 §4.2, §4.1.2).
fn regular_headers(fields: &[(Bytes, Bytes)], out: &mut HeaderMap) -> Result<(), &'static str> {
    if fields.len() > MAX_FIELD_LINES {
        return Err("too many field lines");
    }
    // Cookie lines after the first, joined once at the end: joining as they come copied
    // the whole value so far for each line (quadratic in the lines, which QPACK makes one
    // byte each).
    let mut cookies: Option<Vec<u8>> = None;
    for (n, v) in fields {
        if n.first() == Some(&b':') {
            return Err("pseudo-header after regular header");
        }
        if n.iter().any(|c| c.is_ascii_uppercase()) {
            return Err("uppercase header name");
        }
        let name = HeaderName::from_bytes(n).map_err(|_| "invalid header name")?;
        if CONNECTION_SPECIFIC.contains(&name.as_str()) {
            return Err("connection-specific header");
        }
        if name == http::header::TE && &v[..] != b"trailers" {
            return Err("TE other than trailers");
        }
        // field-content (RFC 9110 §5.5) neither starts nor ends with whitespace; a value
        // that does is malformed (RFC 9114 §10.3).
        if matches!(v.first(), Some(b' ' | b'\t')) || matches!(v.last(), Some(b' ' | b'\t')) {
            return Err("header value with leading or trailing whitespace");
        }
        let value =
            HeaderValue::from_maybe_shared(v.clone()).map_err(|_| "invalid header value")?;
        // RFC 9114 §4.2.1: clients split Cookie into several field lines to compress them
        // better; joined with "; " into one before an application sees them (or an
        // HTTP/1.1 backend, which must get one Cookie field, RFC 6265 §5.4).
        if name == http::header::COOKIE
            && let Some(first) = out.get(http::header::COOKIE)
        {
            let joined = cookies.get_or_insert_with(|| first.as_bytes().to_vec());
            joined.extend_from_slice(b"; ");
            joined.extend_from_slice(value.as_bytes());
            continue;
        }
        out.append(name, value);
    }
    if let Some(joined) = cookies {
        let v = HeaderValue::from_maybe_shared(Bytes::from(joined))
            .map_err(|_| "invalid header value")?;
        out.insert(http::header::COOKIE, v);
    }
    Ok(())
}

/// The number of pseudo-header fields at the front (RFC 9114 §4.3: they come first).
fn pseudo_count(fields: &[(Bytes, Bytes)]) -> usize {
    fields
        .iter()
        .take_while(|(n, _)| n.first() == Some(&b':'))
        .count()
}

/// An authority whose host is not empty and whose port, if any, is a number.
/// (Userinfo is refused before this is asked.) One pass over the bytes: this runs for every
/// request.
fn authority_ok(a: &http::uri::Authority) -> bool {
    let s = a.as_str().as_bytes();
    // The host: an IPv6 literal to its bracket, else up to the port's colon.
    let host_end = if s.first() == Some(&b'[') {
        match s.iter().position(|&c| c == b']') {
            Some(i) => i + 1,
            None => return false,
        }
    } else {
        s.iter().position(|&c| c == b':').unwrap_or(s.len())
    };
    match &s[host_end..] {
        _ if host_end == 0 => false,
        [] => true,
        [b':', port @ ..] => {
            !port.is_empty()
                && port.len() <= 5
                && port.iter().all(u8::is_ascii_digit)
                && port.iter().fold(0u32, |n, d| n * 10 + u32::from(d - b'0')) <= 65_535
        }
        _ => false,
    }
}

/// Sets a pseudo-header's slot; each may appear once.
fn once<'a>(slot: &mut Option<&'a Bytes>, v: &'a Bytes) -> Result<(), &'static str> {
    if slot.replace(v).is_some() {
        return Err("repeated pseudo-header");
    }
    Ok(())
}

/// A request head from its fields. `extended_connect` tells whether we allowed `:protocol`.
pub fn parse_request(
    fields: &[(Bytes, Bytes)],
    extended_connect: bool,
) -> Result<http::request::Parts, &'static str> {
    let n = pseudo_count(fields);
    let (pseudo, regular) = fields.split_at(n);
    let (mut method, mut scheme, mut authority, mut path, mut protocol) =
        (None, None, None, None, None);
    for (n, v) in pseudo {
        match &n[..] {
            b":method" => once(&mut method, v)?,
            b":scheme" => once(&mut scheme, v)?,
            b":authority" => once(&mut authority, v)?,
            b":path" => once(&mut path, v)?,
            b":protocol" if extended_connect => once(&mut protocol, v)?,
            _ => return Err("unknown pseudo-header in a request"),
        }
    }
    let method = Method::from_bytes(method.ok_or("request without :method")?)
        .map_err(|_| "invalid :method")?;
    let mut builder = http::Request::builder()
        .method(method.clone())
        .version(http::Version::HTTP_3);
    if method == Method::CONNECT && protocol.is_none() {
        if scheme.is_some() || path.is_some() {
            return Err("CONNECT with :scheme or :path");
        }
        let a = authority.ok_or("CONNECT without :authority")?;
        // RFC 9114 §4.4: the host and port to connect to (RFC 9110 §9.3.6: no userinfo).
        let a =
            http::uri::Authority::from_maybe_shared(a.clone()).map_err(|_| "invalid :authority")?;
        if a.as_str().contains('@') || a.port_u16().is_none() || !authority_ok(&a) {
            return Err("CONNECT :authority not host:port");
        }
        builder = builder.uri(
            Uri::builder()
                .authority(a)
                .build()
                .map_err(|_| "invalid :authority")?,
        );
    } else {
        if protocol.is_some() && method != Method::CONNECT {
            return Err(":protocol outside CONNECT");
        }
        let scheme = scheme.ok_or("request without :scheme")?;
        let path = path.ok_or("request without :path")?;
        if path.is_empty() {
            return Err("empty :path");
        }
        // A target's path and query have no fragment (RFC 9114 §4.3.1, RFC 9110 §7.1):
        // the `http` crate would drop it without a word.
        if path.contains(&b'#') {
            return Err("fragment in :path");
        }
        // RFC 9114 §4.3.1: http and https have a mandatory authority: :authority or Host,
        // not empty (the same if both, checked below); their :path is an absolute path, or
        // "*" for a server-wide OPTIONS.
        let web = scheme.eq_ignore_ascii_case(b"http") || scheme.eq_ignore_ascii_case(b"https");
        let host = host_header(regular)?;
        let authority = authority.or(host);
        if web {
            match authority.map(|a| &a[..]) {
                None => return Err("request without :authority or host"),
                Some([]) => return Err("empty :authority or host"),
                // RFC 9114 §4.3.1: no userinfo ("user:pass@") in an http or https
                // authority; a proxy that read the host after the "@" differently from
                // its backend would send the request elsewhere.
                Some(a) if a.contains(&b'@') => return Err("userinfo in :authority or host"),
                Some(_) => {}
            }
            if !(path.starts_with(b"/") || (method == Method::OPTIONS && &path[..] == b"*")) {
                return Err(":path neither absolute nor * for OPTIONS");
            }
        }
        // The target's parts share the decoded fields' bytes (no copy).
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(match &scheme[..] {
            b"https" => http::uri::Scheme::HTTPS,
            b"http" => http::uri::Scheme::HTTP,
            other => other.try_into().map_err(|_| "invalid :scheme")?,
        });
        if let Some(a) = authority {
            let a = http::uri::Authority::from_maybe_shared(a.clone())
                .map_err(|_| "invalid :authority")?;
            // RFC 9110 §4.2.1 (§4.2.2): an http(s) authority has a host, and a port is
            // digits; a backend would read either its own way.
            if web && !authority_ok(&a) {
                return Err("invalid :authority or host");
            }
            uri.authority = Some(a);
        }
        uri.path_and_query = Some(
            http::uri::PathAndQuery::from_maybe_shared(path.clone())
                .map_err(|_| "invalid :path")?,
        );
        builder = builder.uri(Uri::from_parts(uri).map_err(|_| "invalid request target")?);
    }
    let (mut parts, ()) = builder
        .body(())
        .map_err(|_| "invalid request")?
        .into_parts();
    // Room for the fields a server commonly adds before passing a request on (a proxy's
    // forwarding fields, a trace ID), so that doing so does not grow the map again.
    if regular.len() > MAX_FIELD_LINES {
        return Err("too many field lines");
    }
    parts.headers.reserve(regular.len() + REQUEST_SLACK);
    regular_headers(regular, &mut parts.headers)?;
    if let (Some(a), Some(host)) = (authority, parts.headers.get(http::header::HOST))
        && host.as_bytes() != &a[..]
    {
        return Err(":authority and host differ");
    }
    if let Some(p) = protocol {
        parts
            .extensions
            .insert(Protocol(String::from_utf8_lossy(p).into_owned()));
    }
    Ok(parts)
}

/// The value of the Host field among `regular`, if there is one; two are malformed.
fn host_header(regular: &[(Bytes, Bytes)]) -> Result<Option<&Bytes>, &'static str> {
    let mut hosts = regular.iter().filter(|(n, _)| &n[..] == b"host");
    let first = hosts.next().map(|(_, v)| v);
    if hosts.next().is_some() {
        return Err("more than one host");
    }
    Ok(first)
}

/// A response head from its fields.
pub fn parse_response(fields: &[(Bytes, Bytes)]) -> Result<http::response::Parts, &'static str> {
    let (pseudo, regular) = fields.split_at(pseudo_count(fields));
    let mut status = None;
    for (n, v) in pseudo {
        match &n[..] {
            b":status" => once(&mut status, v)?,
            _ => return Err("unknown pseudo-header in a response"),
        }
    }
    let status = status.ok_or("response without :status")?;
    if status.len() != 3 {
        return Err("invalid :status");
    }
    let status = StatusCode::from_bytes(status).map_err(|_| "invalid :status")?;
    let (mut parts, ()) = http::Response::builder()
        .status(status)
        .body(())
        .map_err(|_| "invalid response")?
        .into_parts();
    if regular.len() > MAX_FIELD_LINES {
        return Err("too many field lines");
    }
    parts.headers.reserve(regular.len());
    regular_headers(regular, &mut parts.headers)?;
    Ok(parts)
}

/// Trailers from their fields (no pseudo-headers allowed).
pub fn parse_trailers(fields: &[(Bytes, Bytes)]) -> Result<HeaderMap, &'static str> {
    let mut h = HeaderMap::new();
    regular_headers(fields, &mut h)?;
    Ok(h)
}

/// The declared content-length, if any and valid.
///
/// Content-Length = 1*DIGIT (RFC 9110 §8.6): no sign, no spaces inside, no other base. A list
/// of identical values (from one field line "5, 5" or several lines) stands for that value;
/// any member that is not 1*DIGIT, or two that differ, make the message malformed
/// (RFC 9114 §4.1.2).
pub fn content_length(headers: &HeaderMap) -> Result<Option<u64>, &'static str> {
    let mut n = None;
    for v in headers.get_all(http::header::CONTENT_LENGTH) {
        let v = v.as_bytes();
        if v.first().is_some_and(u8::is_ascii_whitespace)
            || v.last().is_some_and(u8::is_ascii_whitespace)
        {
            return Err("invalid content-length");
        }
        for member in v.split(|&c| c == b',') {
            // Optional whitespace around list commas (RFC 9110 §5.6.1).
            let member = member.trim_ascii();
            if member.is_empty() || !member.iter().all(u8::is_ascii_digit) {
                return Err("invalid content-length");
            }
            let value = member.iter().try_fold(0u64, |acc, &d| {
                acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            });
            let value = value.ok_or("content-length out of range")?;
            if n.is_some_and(|n| n != value) {
                return Err("conflicting content-length");
            }
            n = Some(value);
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    Bytes::copy_from_slice(n.as_bytes()),
                    Bytes::copy_from_slice(v.as_bytes()),
                )
            })
            .collect()
    }

    #[test]
    fn request_round_trip() {
        let req = http::Request::builder()
            .method("POST")
            .uri("https://example.com:4433/upload?x=1")
            .header("content-type", "text/plain")
            .header("connection", "close")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let fields = request_fields(&parts).unwrap();
        assert_eq!(&fields[0].0[..], b":method");
        assert!(!fields.iter().any(|(n, _)| &n[..] == b"connection"));
        let back = parse_request(&fields, false).unwrap();
        assert_eq!(back.method, Method::POST);
        assert_eq!(back.uri.to_string(), "https://example.com:4433/upload?x=1");
        assert_eq!(back.headers["content-type"], "text/plain");
    }

    /// What a client sends is what a server accepts: no :protocol but on a CONNECT, and an
    /// extended CONNECT with an authority (RFC 9220 §3).
    #[test]
    fn extended_connect_requests_are_well_formed() {
        let parts = |method: &str, uri: &str| {
            let mut req = http::Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap();
            req.extensions_mut().insert(Protocol("websocket".into()));
            req.into_parts().0
        };
        assert!(request_fields(&parts("GET", "https://example.com/chat")).is_err());
        assert!(request_fields(&parts("CONNECT", "/chat")).is_err());
        let fields = request_fields(&parts("CONNECT", "https://example.com/chat")).unwrap();
        let back = parse_request(&fields, true).unwrap();
        assert_eq!(back.method, Method::CONNECT);
    }

    /// Authorities with no host or a port that is no number, CONNECT targets that are not
    /// host:port, and fragments are refused; requests say HTTP/3.
    #[test]
    fn targets_are_checked() {
        let req = |authority: &str, path: &str| {
            parse_request(
                &f(&[
                    (":method", "GET"),
                    (":scheme", "https"),
                    (":path", path),
                    (":authority", authority),
                ]),
                false,
            )
        };
        assert_eq!(
            req("a.example", "/").unwrap().version,
            http::Version::HTTP_3
        );
        for ok in ["a.example:443", "[::1]:443", "[::1]", "192.0.2.1:8443"] {
            assert!(req(ok, "/").is_ok(), "{ok}");
        }
        for bad in [":443", "a:b", "a.example:"] {
            assert!(req(bad, "/").is_err(), "{bad}");
        }
        assert!(req("a.example", "/a#b").is_err());
        let connect = |authority: &str| {
            parse_request(
                &f(&[(":method", "CONNECT"), (":authority", authority)]),
                false,
            )
        };
        assert!(connect("a.example:443").is_ok());
        for bad in ["a.example", "u@a.example:443", ":443", "a:b"] {
            assert!(connect(bad).is_err(), "{bad}");
        }
    }

    /// Cookie field lines reach the application as one field (RFC 9114 §4.2.1).
    #[test]
    fn cookie_lines_are_joined() {
        let parts = parse_request(
            &f(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                (":authority", "a"),
                ("cookie", "a=1"),
                ("accept", "*/*"),
                ("cookie", "b=2"),
                ("cookie", "c=3"),
            ]),
            false,
        )
        .unwrap();
        let all: Vec<_> = parts.headers.get_all("cookie").iter().collect();
        assert_eq!(all, ["a=1; b=2; c=3"]);
    }

    /// A section of thousands of lines (QPACK makes a repeated line one byte): cookie lines
    /// are joined once, and past [`MAX_FIELD_LINES`] the section is refused instead of
    /// making `HeaderMap` panic (it does past 2^15 entries) in requests, responses and
    /// trailers alike.
    #[test]
    fn sections_of_many_lines() {
        let head = [
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/"),
            (":authority", "a"),
        ];
        let with = |n: usize, name: &'static str| {
            let mut v = f(&head);
            v.extend((0..n).map(|_| {
                (
                    Bytes::from_static(name.as_bytes()),
                    Bytes::from_static(b"x=1"),
                )
            }));
            v
        };
        let parts = parse_request(&with(MAX_FIELD_LINES, "cookie"), false).unwrap();
        let cookie = parts.headers.get("cookie").unwrap();
        assert_eq!(cookie.len(), MAX_FIELD_LINES * 5 - 2);
        assert_eq!(parts.headers.get_all("cookie").iter().count(), 1);
        for name in ["cookie", "x"] {
            let many = with(30_000, name);
            assert_eq!(
                parse_request(&many, false).unwrap_err(),
                "too many field lines"
            );
            let regular = &many[4..];
            assert!(parse_trailers(regular).is_err());
            let mut resp = vec![(Bytes::from_static(b":status"), Bytes::from_static(b"200"))];
            resp.extend_from_slice(regular);
            assert!(parse_response(&resp).is_err());
        }
    }

    #[test]
    fn malformed_requests() {
        let ok = f(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/"),
            (":authority", "a"),
        ]);
        assert!(parse_request(&ok, false).is_ok());
        let cases: &[&[(&str, &str)]] = &[
            &[(":scheme", "https"), (":path", "/")],
            &[(":method", "GET"), (":scheme", "https")],
            &[(":method", "GET"), (":scheme", "https"), (":path", "")],
            &[
                (":method", "GET"),
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                (":status", "200"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                ("x", "1"),
                (":authority", "a"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                ("Upper", "1"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                ("connection", "close"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                ("te", "gzip"),
            ],
            &[(":method", "CONNECT"), (":authority", "a"), (":path", "/")],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                (":protocol", "websocket"),
            ],
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                (":authority", "a"),
                ("host", "b"),
            ],
        ];
        for c in cases {
            assert!(parse_request(&f(c), false).is_err(), "accepted {c:?}");
        }
        // Extended CONNECT only when enabled.
        let ws = f(&[
            (":method", "CONNECT"),
            (":protocol", "websocket"),
            (":scheme", "https"),
            (":path", "/chat"),
            (":authority", "a"),
        ]);
        assert!(parse_request(&ws, false).is_err());
        let p = parse_request(&ws, true).unwrap();
        assert_eq!(
            p.extensions.get::<Protocol>(),
            Some(&Protocol("websocket".into()))
        );
    }

    #[test]
    fn responses() {
        assert_eq!(
            parse_response(&f(&[(":status", "204")])).unwrap().status,
            204
        );
        assert!(parse_response(&f(&[(":status", "2000")])).is_err());
        assert!(parse_response(&f(&[("x", "1")])).is_err());
        assert!(parse_response(&f(&[(":status", "200"), (":path", "/")])).is_err());
        assert!(parse_trailers(&f(&[(":status", "200")])).is_err());
    }

    #[test]
    fn content_length_rules() {
        let mut h = HeaderMap::new();
        assert_eq!(content_length(&h), Ok(None));
        h.append("content-length", HeaderValue::from_static("10"));
        assert_eq!(content_length(&h), Ok(Some(10)));
        h.append("content-length", HeaderValue::from_static("11"));
        assert!(content_length(&h).is_err());
    }

    /// Content-Length = 1*DIGIT (RFC 9110 §8.6): no sign, no inner space, no other base; a
    /// list is accepted only when every member is the same number.
    #[test]
    fn content_length_is_digits_only() {
        let one = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.append("content-length", HeaderValue::from_static(v));
            content_length(&h)
        };
        for bad in [
            "+5",
            "-5",
            "+0",
            " 5",
            "5 ",
            "5 5",
            "",
            "0x5",
            "5.0",
            "1e3",
            "5,6",
            "5, 6",
            "5,",
            ",5",
            "5,,5",
            "18446744073709551616",
            "99999999999999999999999",
        ] {
            assert!(one(bad).is_err(), "content-length {bad:?} accepted");
        }
        assert_eq!(one("0"), Ok(Some(0)));
        assert_eq!(one("007"), Ok(Some(7)));
        assert_eq!(one("18446744073709551615"), Ok(Some(u64::MAX)));
        assert_eq!(one("5, 5"), Ok(Some(5)));
        assert_eq!(one("5,5"), Ok(Some(5)));
        // Two field lines that disagree, or one of them malformed.
        let mut h = HeaderMap::new();
        h.append("content-length", HeaderValue::from_static("5"));
        h.append("content-length", HeaderValue::from_static("+5"));
        assert!(content_length(&h).is_err());
        let mut h = HeaderMap::new();
        h.append("content-length", HeaderValue::from_static("5"));
        h.append("content-length", HeaderValue::from_static("5, 5"));
        assert_eq!(content_length(&h), Ok(Some(5)));
    }

    /// RFC 9114 §4.3.1: an http or https request carries :authority or Host, neither empty
    /// nor with userinfo, and the same if both; :path starts with "/" (or is "*" for
    /// OPTIONS).
    #[test]
    fn requests_need_an_authority() {
        let base = [(":method", "GET"), (":scheme", "https"), (":path", "/")];
        let with = |extra: &[(&str, &str)]| {
            let mut v: Vec<(&str, &str)> = base.to_vec();
            v.extend_from_slice(extra);
            parse_request(&f(&v), false)
        };
        assert!(with(&[]).is_err(), "no :authority and no host");
        assert!(with(&[(":authority", "")]).is_err(), "empty :authority");
        assert!(with(&[("host", "")]).is_err(), "empty host");
        assert!(
            with(&[(":authority", "user:pw@example.com")]).is_err(),
            "userinfo in :authority"
        );
        assert!(
            with(&[("host", "u@example.com")]).is_err(),
            "userinfo in host"
        );
        let p = with(&[("host", "example.com")]).expect("host alone is enough");
        assert_eq!(p.uri.authority().unwrap().as_str(), "example.com");
        assert_eq!(p.uri.to_string(), "https://example.com/");
        let p = with(&[(":authority", "example.com")]).unwrap();
        assert_eq!(p.uri.to_string(), "https://example.com/");
        // The same value in both is fine (host after the pseudo-headers).
        let v = [
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/"),
            (":authority", "a.example"),
            ("host", "a.example"),
        ];
        assert!(parse_request(&f(&v), false).is_ok());
        for path in ["foo", "*", "?q"] {
            let v = [
                (":method", "GET"),
                (":scheme", "https"),
                (":path", path),
                (":authority", "a"),
            ];
            assert!(parse_request(&f(&v), false).is_err(), ":path {path:?}");
        }
        let v = [
            (":method", "OPTIONS"),
            (":scheme", "https"),
            (":path", "*"),
            (":authority", "a"),
        ];
        assert!(parse_request(&f(&v), false).is_ok(), "OPTIONS *");
    }

    /// Field values are field-content (RFC 9110 §5.5): no leading or trailing whitespace;
    /// anything else is malformed (RFC 9114 §10.3).
    #[test]
    fn field_values_without_surrounding_whitespace() {
        for v in [" x", "x ", "\tx", "x\t"] {
            let fields = f(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/"),
                (":authority", "a"),
                ("x-h", v),
            ]);
            assert!(parse_request(&fields, false).is_err(), "value {v:?}");
        }
        let fields = f(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/"),
            (":authority", "a"),
            ("x-h", "a b"),
            ("x-empty", ""),
        ]);
        assert!(parse_request(&fields, false).is_ok());
    }
}
