//! `kuai_http::answer`: the status, headers and byte range a file server sends for a request's
//! Range, If-Range and precondition headers, whatever their values.
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode};
use kuai_http::{FileInfo, answer};
use libfuzzer_sys::fuzz_target;

const NAMES: [header::HeaderName; 6] = [
    header::RANGE,
    header::IF_RANGE,
    header::IF_MATCH,
    header::IF_NONE_MATCH,
    header::IF_MODIFIED_SINCE,
    header::IF_UNMODIFIED_SINCE,
];

fuzz_target!(|data: &[u8]| {
    // Bytes 0..8: the file's length; 8..12: its mtime in seconds; 12: the method; then
    // header values separated by 0xff, in the order of NAMES (an empty one is left out).
    if data.len() < 13 {
        return;
    }
    let len = u64::from_le_bytes(data[..8].try_into().unwrap()) % (1 << 40);
    let secs = u32::from_le_bytes(data[8..12].try_into().unwrap());
    let info = FileInfo {
        len,
        modified: (secs != 0).then(|| UNIX_EPOCH + Duration::from_secs(secs.into())),
    };
    let method = if data[12] % 2 == 0 {
        Method::GET
    } else {
        Method::HEAD
    };
    let mut headers = HeaderMap::new();
    for (name, value) in NAMES.iter().zip(data[13..].split(|&b| b == 0xff)) {
        if let (false, Ok(v)) = (value.is_empty(), HeaderValue::from_bytes(value)) {
            headers.insert(name.clone(), v);
        }
    }
    let a = answer(&method, &headers, &info, "application/octet-stream");
    let content_length = a
        .headers
        .get(header::CONTENT_LENGTH)
        .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
    match a.status {
        StatusCode::OK => {
            assert_eq!(content_length, Some(len));
            assert_eq!(a.body, (method == Method::GET).then_some((0, len)));
        }
        StatusCode::PARTIAL_CONTENT => {
            assert_eq!(method, Method::GET);
            let (start, n) = a.body.expect("a 206 has a body");
            assert!(n >= 1 && start + n <= len, "{start} + {n} within {len}");
            assert_eq!(content_length, Some(n));
            let range = a.headers[header::CONTENT_RANGE].to_str().unwrap();
            assert_eq!(range, format!("bytes {start}-{}/{len}", start + n - 1));
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            assert_eq!(a.body, None);
            assert_eq!(
                a.headers[header::CONTENT_RANGE],
                format!("bytes */{len}").as_str()
            );
        }
        StatusCode::NOT_MODIFIED | StatusCode::PRECONDITION_FAILED => {
            assert_eq!(a.body, None);
            assert!(content_length.is_none());
        }
        s => panic!("unexpected status {s}"),
    }
    assert!(a.headers.contains_key(header::ETAG));
});
