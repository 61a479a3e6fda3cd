//! The gateway's HTTP/1.1 client reading a backend's responses (`kuai_http::proxy`): the
//! response head, its framing (RFC 9112 §6.3) and the chunked coding, from bytes arriving
//! in pieces of any size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Byte 0: the piece size (1–128) and whether the request was HEAD; the rest: the wire.
    let Some((&first, wire)) = data.split_first() else {
        return;
    };
    let step = usize::from(first & 0x7f) + 1;
    kuai_http::fuzzing::fuzz_responses(wire, step, first & 0x80 != 0);
});
