//! HTTP/3 frame parsing: the incremental frame reader, SETTINGS and request-head validation
//! must never panic, whatever the bytes and however they are split.
#![no_main]

use bytes::Bytes;
use kuai_h3::frame::{Frame, FrameReader, Settings};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(split % 17) + 1;
    let mut reader = FrameReader::new(4096);
    let mut fields = Vec::new();
    'outer: for c in rest.chunks(chunk) {
        reader.push(c);
        loop {
            match reader.next_frame() {
                Ok(Some(Frame::Settings(p))) => {
                    let _ = Settings::decode(&p);
                }
                Ok(Some(Frame::Headers(p))) => {
                    // Treat the payload as name/value pairs split on 0x00 to exercise the
                    // message rules.
                    let parts: Vec<&[u8]> = p.split(|&b| b == 0).collect();
                    for pair in parts.chunks(2) {
                        if let [n, v] = pair {
                            fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)));
                        }
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => break 'outer,
            }
        }
    }
    let _ = kuai_h3::message::parse_request(&fields, true);
    let _ = kuai_h3::message::parse_response(&fields);
    let _ = kuai_h3::message::parse_trailers(&fields);
});
