//! The client's Alt-Svc parser (`kuai_http::client::state::parse_alt_svc`): a server's
//! header value, as lossy UTF-8. Checks beyond "no panic":
//!
//! - an `h3` alternative has a port other than 0 and a host that is empty, an IP address or
//!   letters, digits, `-` and `.` only (at most 253 bytes), so it can smuggle neither a path
//!   nor another authority into the URL the client builds from it;
//! - `clear` is only the answer to a value that is `clear` (any case, surrounding space);
//! - the host the parser returns is part of the input.

#![no_main]

use kuai_http::fuzzing::{AltSvcHeader, parse_alt_svc};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kuai_fuzz::alloc::reset_peak();
    let value = String::from_utf8_lossy(&data[..data.len().min(8 * 1024)]);
    match parse_alt_svc(&value) {
        None => {}
        Some(AltSvcHeader::Clear) => {
            assert!(value.trim().eq_ignore_ascii_case("clear"), "{value:?}");
        }
        Some(AltSvcHeader::H3 { host, port, .. }) => {
            assert_ne!(port, 0, "{value:?}");
            assert!(
                value.contains(host.as_str()),
                "{value:?} gave host {host:?}"
            );
            let ip = host.parse::<std::net::IpAddr>().is_ok();
            assert!(
                ip || (host.len() <= 253
                    && host
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')),
                "{value:?} gave host {host:?}"
            );
        }
    }
});
