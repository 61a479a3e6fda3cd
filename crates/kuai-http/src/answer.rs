//! How to answer a GET or HEAD for a file: validators (`ETag`, `Last-Modified`), conditional
//! requests (RFC 9110 §13) and single byte ranges (RFC 9110 §14).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode};

/// What a file is, as far as the answer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    /// Its length in bytes.
    pub len: u64,
    /// When it was last modified, if the filesystem says.
    pub modified: Option<SystemTime>,
}

impl FileInfo {
    /// From a file's metadata.
    pub fn from_metadata(meta: &std::fs::Metadata) -> Self {
        Self {
            len: meta.len(),
            modified: meta.modified().ok(),
        }
    }

    /// A strong entity tag from the modification time and the length, as nginx makes
    /// them: a file rewritten in place within the same nanosecond at the same length would
    /// keep its tag.
    pub fn etag(&self) -> String {
        let since = self
            .modified
            .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default();
        format!(
            "\"{:x}-{:x}-{:x}\"",
            since.as_secs(),
            since.subsec_nanos(),
            self.len
        )
    }

    /// The modification time at HTTP's resolution (whole seconds).
    fn modified_secs(&self) -> Option<SystemTime> {
        // A modification time in the future (a clock set wrong when the file was written)
        // is sent as now (RFC 9110 §8.8.2.1).
        let modified = self.modified?.min(SystemTime::now());
        let since = modified.duration_since(UNIX_EPOCH).ok()?;
        Some(UNIX_EPOCH + Duration::from_secs(since.as_secs()))
    }
}

/// The answer to a request for a file: its status, the headers that go with it, and which
/// bytes of the file to send (none for 304, 412, 416 and HEAD).
#[derive(Debug, Clone)]
pub struct FileAnswer {
    /// 200, 206, 304, 412 or 416.
    pub status: StatusCode,
    /// `content-type`, `content-length`, `etag`, `last-modified`, `accept-ranges`, and
    /// `content-range` on 206 and 416.
    pub headers: HeaderMap,
    /// The bytes to send: their offset in the file and their length.
    pub body: Option<(u64, u64)>,
}

/// Answers `method` (GET or HEAD) with `request` headers for a file described by `info`.
///
/// Preconditions are evaluated in RFC 9110 §13.2.2's order: If-Match, If-Unmodified-Since,
/// If-None-Match, If-Modified-Since, then Range with If-Range. One byte range is served
/// (206); a request for several gets the whole file (200), which RFC 9110 §14.2 allows, and
/// a range that starts past the end gets 416.
pub fn answer(
    method: &Method,
    request: &HeaderMap,
    info: &FileInfo,
    content_type: &str,
) -> FileAnswer {
    let etag = info.etag();
    let modified = info.modified_secs();
    // Room for the file's fields and those the server adds (Date, Alt-Svc) without the map
    // growing: a reallocation and rehash per response.
    let mut headers = HeaderMap::with_capacity(12);
    if let Ok(v) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, v);
    }
    if let Some(m) = modified
        && let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(m))
    {
        headers.insert(header::LAST_MODIFIED, v);
    }
    let get_or_head = *method == Method::GET || *method == Method::HEAD;
    let no_body = |status, headers| FileAnswer {
        status,
        headers,
        body: None,
    };

    // Step 1 and 2: If-Match, else If-Unmodified-Since. Several field lines form one list
    // (RFC 9110 §5.3): the tag may be on any of them.
    let any_line = |name, weak| {
        let mut lines = request.get_all(name).iter().peekable();
        lines.peek()?;
        Some(lines.any(|v| matches_any(v, &etag, weak)))
    };
    if let Some(matched) = any_line(header::IF_MATCH, false) {
        if !matched {
            return no_body(StatusCode::PRECONDITION_FAILED, headers);
        }
    } else if let (Some(since), Some(m)) = (date(request, header::IF_UNMODIFIED_SINCE), modified)
        && m > since
    {
        return no_body(StatusCode::PRECONDITION_FAILED, headers);
    }
    // Step 3 and 4: If-None-Match, else If-Modified-Since (GET and HEAD only).
    if let Some(matched) = any_line(header::IF_NONE_MATCH, true) {
        if matched {
            let status = if get_or_head {
                StatusCode::NOT_MODIFIED
            } else {
                StatusCode::PRECONDITION_FAILED
            };
            return no_body(status, headers);
        }
    } else if get_or_head
        && let (Some(since), Some(m)) = (date(request, header::IF_MODIFIED_SINCE), modified)
        && m <= since
    {
        return no_body(StatusCode::NOT_MODIFIED, headers);
    }

    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(v) = HeaderValue::from_str(content_type) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    let range = if *method == Method::GET && if_range_holds(request, &etag, modified) {
        request.get(header::RANGE).map(|r| parse_range(r, info.len))
    } else {
        None
    };
    let (status, start, len) = match range {
        Some(Range::One(start, len)) => {
            let end = start + len - 1;
            let v = format!("bytes {start}-{end}/{}", info.len);
            headers.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&v).expect("ASCII"),
            );
            (StatusCode::PARTIAL_CONTENT, start, len)
        }
        Some(Range::Unsatisfiable) => {
            let v = format!("bytes */{}", info.len);
            headers.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&v).expect("ASCII"),
            );
            headers.remove(header::CONTENT_TYPE);
            return no_body(StatusCode::RANGE_NOT_SATISFIABLE, headers);
        }
        Some(Range::Ignored) | None => (StatusCode::OK, 0, info.len),
    };
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    FileAnswer {
        status,
        headers,
        body: (*method != Method::HEAD).then_some((start, len)),
    }
}

/// Whether an If-Match or If-None-Match value lists `etag` (or is `*`). If-None-Match
/// compares weakly (a `W/` prefix does not matter), If-Match strongly (RFC 9110 §8.8.3.2).
fn matches_any(value: &HeaderValue, etag: &str, weak: bool) -> bool {
    let Ok(v) = value.to_str() else {
        return false;
    };
    if v.trim() == "*" {
        return true;
    }
    v.split(',').map(str::trim).any(|tag| {
        let (is_weak, opaque) = match tag.strip_prefix("W/") {
            Some(rest) => (true, rest),
            None => (false, tag),
        };
        opaque == etag && (weak || !is_weak)
    })
}

fn date(request: &HeaderMap, name: header::HeaderName) -> Option<SystemTime> {
    httpdate::parse_http_date(request.get(name)?.to_str().ok()?).ok()
}

/// If-Range (RFC 9110 §13.1.5): a range applies only while the file is the one the client
/// has part of — the same strong entity tag, or exactly the Last-Modified date when that
/// date is a strong validator: the file last changed at least a second before now (§8.8.2.2;
/// two seconds from the date sent, which drops the fraction), or a change within the same
/// second would pass for the same file.
fn if_range_holds(request: &HeaderMap, etag: &str, modified: Option<SystemTime>) -> bool {
    let Some(v) = request.get(header::IF_RANGE) else {
        return true;
    };
    let Ok(v) = v.to_str() else {
        return false;
    };
    let v = v.trim();
    if v.starts_with('"') {
        return v == etag;
    }
    httpdate::parse_http_date(v).is_ok_and(|d| {
        Some(d) == modified
            && SystemTime::now()
                .duration_since(d)
                .is_ok_and(|age| age >= std::time::Duration::from_secs(2))
    })
}

#[derive(Debug, PartialEq, Eq)]
enum Range {
    /// Offset and length, both within the file.
    One(u64, u64),
    /// Not a range kuai serves (several ranges, another unit, a syntax error): the whole
    /// file (RFC 9110 §14.2: a server may ignore Range).
    Ignored,
    /// A valid range that selects nothing (RFC 9110 §15.5.17).
    Unsatisfiable,
}

/// A Range header value against a file of `len` bytes.
fn parse_range(value: &HeaderValue, len: u64) -> Range {
    let Some(spec) = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().strip_prefix("bytes="))
    else {
        return Range::Ignored;
    };
    let spec = spec.trim();
    if spec.contains(',') {
        return Range::Ignored;
    }
    let Some((first, last)) = spec.split_once('-') else {
        return Range::Ignored;
    };
    let digits = |s: &str| -> Option<Option<u64>> {
        let s = s.trim();
        if s.is_empty() {
            return Some(None);
        }
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // More digits than a u64 holds: as far as this file goes, "the end".
        Some(Some(s.parse().unwrap_or(u64::MAX)))
    };
    let (Some(first), Some(last)) = (digits(first), digits(last)) else {
        return Range::Ignored;
    };
    match (first, last) {
        // bytes=-N: the last N bytes.
        (None, Some(n)) => {
            if n == 0 {
                return Range::Unsatisfiable;
            }
            // RFC 9110 §14.1.1: a non-zero suffix is satisfiable even for an empty
            // representation, which is then sent whole (a 206 cannot describe no bytes).
            if len == 0 {
                return Range::Ignored;
            }
            let n = n.min(len);
            Range::One(len - n, n)
        }
        (Some(a), last) => {
            if last.is_some_and(|b| b < a) {
                return Range::Ignored;
            }
            if a >= len {
                return Range::Unsatisfiable;
            }
            let end = last.map_or(len - 1, |b| b.min(len - 1));
            Range::One(a, end - a + 1)
        }
        (None, None) => Range::Ignored,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> FileInfo {
        FileInfo {
            len: 1000,
            modified: Some(UNIX_EPOCH + Duration::new(1_700_000_000, 123)),
        }
    }

    fn ask(method: Method, headers: &[(&str, &str)]) -> FileAnswer {
        let mut h = HeaderMap::new();
        for (n, v) in headers {
            h.append(
                header::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        answer(&method, &h, &info(), "text/plain")
    }

    #[test]
    fn a_plain_get_is_the_whole_file_with_its_validators() {
        let a = ask(Method::GET, &[]);
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body, Some((0, 1000)));
        assert_eq!(a.headers[header::CONTENT_LENGTH], "1000");
        assert_eq!(a.headers[header::ETAG], info().etag().as_str());
        assert_eq!(
            a.headers[header::LAST_MODIFIED],
            "Tue, 14 Nov 2023 22:13:20 GMT"
        );
        assert_eq!(a.headers[header::ACCEPT_RANGES], "bytes");
        let head = ask(Method::HEAD, &[]);
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.body, None);
        assert_eq!(head.headers[header::CONTENT_LENGTH], "1000");
    }

    #[test]
    fn conditional_requests_follow_rfc_9110_order() {
        let tag = info().etag();
        let weak = format!("W/{tag}");
        assert_eq!(ask(Method::GET, &[("if-none-match", &tag)]).status, 304);
        assert_eq!(ask(Method::GET, &[("if-none-match", &weak)]).status, 304);
        let list = format!("\"x\", {tag}");
        assert_eq!(ask(Method::GET, &[("if-none-match", &list)]).status, 304);
        assert_eq!(ask(Method::GET, &[("if-none-match", "*")]).status, 304);
        assert_eq!(ask(Method::GET, &[("if-none-match", "\"x\"")]).status, 200);
        // The list over two field lines: the tag on the second.
        let two = [("if-none-match", "\"x\""), ("if-none-match", tag.as_str())];
        assert_eq!(ask(Method::GET, &two).status, 304);
        let two = [("if-match", "\"x\""), ("if-match", tag.as_str())];
        assert_eq!(ask(Method::GET, &two).status, 200);
        let same = "Tue, 14 Nov 2023 22:13:20 GMT";
        let before = "Tue, 14 Nov 2023 22:13:19 GMT";
        assert_eq!(ask(Method::GET, &[("if-modified-since", same)]).status, 304);
        assert_eq!(
            ask(Method::GET, &[("if-modified-since", before)]).status,
            200
        );
        // If-None-Match wins over If-Modified-Since (§13.2.2 step 3).
        let both = [("if-none-match", "\"x\""), ("if-modified-since", same)];
        assert_eq!(ask(Method::GET, &both).status, 200);
        assert_eq!(ask(Method::GET, &[("if-match", "\"x\"")]).status, 412);
        assert_eq!(
            ask(Method::GET, &[("if-match", &weak)]).status,
            412,
            "strong"
        );
        assert_eq!(ask(Method::GET, &[("if-match", &tag)]).status, 200);
        assert_eq!(
            ask(Method::GET, &[("if-unmodified-since", before)]).status,
            412
        );
        assert_eq!(
            ask(Method::GET, &[("if-unmodified-since", same)]).status,
            200
        );
        let not_modified = ask(Method::GET, &[("if-none-match", &tag)]);
        assert_eq!(not_modified.body, None);
        assert_eq!(not_modified.headers[header::ETAG], tag.as_str());
    }

    #[test]
    fn one_byte_range_is_served_and_others_are_not() {
        let r = |v: &str| ask(Method::GET, &[("range", v)]);
        let a = r("bytes=0-99");
        assert_eq!(
            (a.status, a.body),
            (StatusCode::PARTIAL_CONTENT, Some((0, 100)))
        );
        assert_eq!(a.headers[header::CONTENT_RANGE], "bytes 0-99/1000");
        assert_eq!(a.headers[header::CONTENT_LENGTH], "100");
        assert_eq!(r("bytes=990-").body, Some((990, 10)));
        assert_eq!(r("bytes=990-5000").body, Some((990, 10)));
        assert_eq!(r("bytes=-10").body, Some((990, 10)));
        assert_eq!(r("bytes=-5000").body, Some((0, 1000)));
        assert_eq!(r("bytes=5-99999999999999999999999").body, Some((5, 995)));
        let past = r("bytes=1000-");
        assert_eq!(past.status, StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(past.headers[header::CONTENT_RANGE], "bytes */1000");
        assert_eq!(past.body, None);
        assert_eq!(r("bytes=-0").status, 416);
        for whole in [
            "bytes=0-1,5-6",
            "items=0-1",
            "bytes=5-1",
            "bytes=x-1",
            "bytes=-",
        ] {
            let a = r(whole);
            assert_eq!(
                (a.status, a.body),
                (StatusCode::OK, Some((0, 1000))),
                "{whole}"
            );
        }
        // HEAD never gets a range (§14.2: GET only).
        assert_eq!(ask(Method::HEAD, &[("range", "bytes=0-1")]).status, 200);
        // A suffix of an empty file is satisfiable (§14.1.1): the whole, empty, file.
        let mut h = HeaderMap::new();
        h.insert(header::RANGE, HeaderValue::from_static("bytes=-10"));
        let empty = FileInfo {
            len: 0,
            modified: None,
        };
        let a = answer(&Method::GET, &h, &empty, "text/plain");
        assert_eq!((a.status, a.body), (StatusCode::OK, Some((0, 0))));
    }

    /// A modification time in the future is sent as now (RFC 9110 §8.8.2.1).
    #[test]
    fn a_future_modification_time_is_sent_as_now() {
        let future = FileInfo {
            len: 1,
            modified: Some(SystemTime::now() + Duration::from_secs(86_400)),
        };
        let a = answer(&Method::GET, &HeaderMap::new(), &future, "text/plain");
        let sent =
            httpdate::parse_http_date(a.headers[header::LAST_MODIFIED].to_str().unwrap()).unwrap();
        assert!(sent <= SystemTime::now());
    }

    #[test]
    fn if_range_keeps_a_range_to_the_same_file() {
        let tag = info().etag();
        let same = "Tue, 14 Nov 2023 22:13:20 GMT";
        let ranged = |v: &str| ask(Method::GET, &[("range", "bytes=0-9"), ("if-range", v)]);
        assert_eq!(ranged(&tag).status, 206);
        assert_eq!(ranged(same).status, 206);
        assert_eq!(ranged("\"other\"").status, 200);
        assert_eq!(ranged(&format!("W/{tag}")).status, 200, "strong comparison");
        assert_eq!(ranged("Tue, 14 Nov 2023 22:13:21 GMT").status, 200);
    }

    /// A Last-Modified of this very second is a weak validator (RFC 9110 §8.8.2.2): the file
    /// may change again within it. If-Range with that date serves the whole file.
    #[test]
    fn if_range_with_a_date_of_this_second_is_weak() {
        let now = SystemTime::now();
        let fresh = FileInfo {
            len: 1000,
            modified: Some(now),
        };
        let date = httpdate::fmt_http_date(now);
        let mut h = HeaderMap::new();
        h.insert(header::RANGE, "bytes=0-9".parse().unwrap());
        h.insert(header::IF_RANGE, date.parse().unwrap());
        assert_eq!(answer(&Method::GET, &h, &fresh, "text/plain").status, 200);
        // The same file, a minute later: strong, the range applies.
        let older = FileInfo {
            len: 1000,
            modified: Some(now - std::time::Duration::from_secs(60)),
        };
        let date = httpdate::fmt_http_date(now - std::time::Duration::from_secs(60));
        h.insert(header::IF_RANGE, date.parse().unwrap());
        assert_eq!(answer(&Method::GET, &h, &older, "text/plain").status, 206);
    }
}
