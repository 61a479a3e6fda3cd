//! QUIC-LB connection IDs as a load balancer reads them (`kuai_proto::quic_lb`): any bytes
//! as a destination connection ID, against a plaintext, a single-pass (16-byte) and two
//! four-pass configurations (odd and even lengths). Checks beyond "no panic":
//!
//! - a decoded ID has the configuration's length and codepoint, and its server ID and nonce
//!   have the configured lengths;
//! - encoding that server ID and nonce gives back the same ID (the cipher is a permutation);
//! - codepoint 7 (unroutable) never yields a server ID.

#![no_main]

use kuai_proto::quic_lb::{QuicLbConfig, QuicLbDecoder};
use libfuzzer_sys::fuzz_target;

const KEY: [u8; 16] = *b"kuai-fuzz-qlb-k!";

fuzz_target!(|data: &[u8]| {
    kuai_fuzz::alloc::reset_peak();
    let configs = [
        QuicLbConfig::new(0, 3, 4, None).unwrap(),
        QuicLbConfig::new(1, 8, 8, Some(KEY)).unwrap(),
        QuicLbConfig::new(2, 3, 4, Some(KEY)).unwrap(),
        QuicLbConfig::new(3, 9, 10, Some(KEY)).unwrap(),
    ];
    let mut lb = QuicLbDecoder::new();
    for c in &configs {
        lb.add(c.clone());
    }
    let cid = &data[..data.len().min(32)];
    let sid = lb.server_id(cid);
    if cid.first().is_some_and(|b| b >> 5 == 7) {
        assert!(sid.is_none());
    }
    for c in &configs {
        if let Some((sid, nonce)) = c.decode(cid) {
            assert_eq!(cid.len(), c.cid_len());
            assert_eq!(cid[0] >> 5, c.config_id());
            assert_eq!((sid.len(), nonce.len()), (c.server_id_len(), c.nonce_len()));
            let back = c.encode(&sid, &nonce).expect("lengths fit");
            // The first octet's low bits are the length; the rest must match exactly.
            assert_eq!(&back[1..], &cid[1..], "{cid:02x?}");
        }
    }
});
