//! HTTP/3 frame parsing: the incremental frame reader, SETTINGS and request-head validation
//! must never panic, whatever the bytes and however they are split; the zero-copy hand-over
//! (`push_bytes`) must read what the copying one (`push`) reads.
#![no_main]

use bytes::Bytes;
use kuai_h3::frame::{Frame, FrameReader, Settings};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(split % 17) + 1;
    let zero_copy = split >= 128;
    let mut reader = FrameReader::new(4096);
    let mut other = FrameReader::new(4096);
    let mut fields = Vec::new();
    'outer: for c in rest.chunks(chunk) {
        if zero_copy {
            reader.push_bytes(Bytes::copy_from_slice(c));
            other.push(c);
        } else {
            reader.push(c);
            other.push_bytes(Bytes::copy_from_slice(c));
        }
        // Both readers yield the same DATA bytes and the same other frames.
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut a_frames = Vec::new();
        let mut b_frames = Vec::new();
        let a_err = drain(&mut reader, &mut a, &mut a_frames);
        let b_err = drain(&mut other, &mut b, &mut b_frames);
        assert_eq!(a_err, b_err);
        assert_eq!(a, b);
        assert_eq!(a_frames, b_frames);
        if a_err {
            break 'outer;
        }
        for f in a_frames {
            match f {
                Frame::Settings(p) => {
                    let _ = Settings::decode(&p);
                }
                Frame::Headers(p) => {
                    // Treat the payload as name/value pairs split on 0x00 to exercise the
                    // message rules.
                    let parts: Vec<&[u8]> = p.split(|&b| b == 0).collect();
                    for pair in parts.chunks(2) {
                        if let [n, v] = pair {
                            fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let _ = kuai_h3::message::parse_request(&fields, true);
    let _ = kuai_h3::message::parse_response(&fields);
    let _ = kuai_h3::message::parse_trailers(&fields);
});

/// Reads every complete frame: DATA into `data`, the others into `frames`; true on an error.
fn drain(reader: &mut FrameReader, data: &mut Vec<u8>, frames: &mut Vec<Frame>) -> bool {
    loop {
        match reader.next_frame() {
            Ok(Some(Frame::Data(d))) => data.extend_from_slice(&d),
            Ok(Some(f)) => frames.push(f),
            Ok(None) => return false,
            Err(_) => return true,
        }
    }
}
