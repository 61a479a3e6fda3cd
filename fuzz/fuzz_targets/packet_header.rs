//! Packet header parsing and packet protection removal (`kuai_proto::packet`).
//!
//! Input layout: byte 0 chooses the local connection ID length (`byte % 21`, the DCID length of
//! short header packets) and the largest packet number already received (`byte / 21`, fed to
//! the packet number recovery); the rest is one UDP datagram.
//!
//! Every coalesced packet is split off with [`PartialDecode::new`] and all its accessors are
//! called. Protected packets of QUIC v1/v2 then go through `unprotect` + `decrypt` with the Initial
//! keys derived from the packet's own DCID, once with each side's receive keys; Retry packets get
//! their integrity tag checked; a successfully decrypted payload is walked with [`FrameIter`].
//! The Retry offload (`kuai_proto::retry_offload`) must read the first packet as the parser does.
//! Nothing may panic, and the split must account for every byte of the datagram.

#![no_main]

use bytes::BytesMut;
use kuai_proto::frame::FrameIter;
use kuai_proto::packet::{
    LongType, PacketDecodeError, PacketType, PartialDecode, initial_keys, reset_token_of,
    retry_integrity_ok,
};
use kuai_proto::{ConnectionId, Side, Version};
use libfuzzer_sys::fuzz_target;

/// Values for the largest packet number received so far, picked by `input[0] / 21` (0..=12).
const LARGEST_PN: [Option<u64>; 13] = [
    None,
    Some(0),
    Some(1),
    Some(0x7f),
    Some(0xff),
    Some(0x1_0000),
    Some(0xa82f_30ea),
    Some(0xffff_fffe),
    Some(1 << 32),
    Some(1 << 40),
    Some((1 << 62) - 0x1_0000),
    Some((1 << 62) - 2),
    Some((1 << 62) - 1),
];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, datagram)) = data.split_first() else {
        return;
    };
    let local_cid_len = usize::from(sel % 21);
    let largest_pn = LARGEST_PN[usize::from(sel / 21)];

    let _ = reset_token_of(datagram);
    check_retry_offload(datagram, local_cid_len);

    let mut rest = Some(BytesMut::from(datagram));
    let mut accounted = 0usize;
    // Every packet consumes at least one byte, so this terminates.
    while let Some(buf) = rest.take() {
        let before = buf.len();
        let (pd, next) = match PartialDecode::new(buf, local_cid_len) {
            Ok(x) => x,
            Err(e) => {
                let _ = format!("{e:?} {e}");
                break;
            }
        };
        // The packet and the remainder partition what went in.
        let next_len = next.as_ref().map_or(0, |b| b.len());
        assert_eq!(pd.len() + next_len, before, "bytes lost splitting {pd:?}");
        assert!(!pd.is_empty());
        if let Some(n) = &next {
            assert!(!n.is_empty(), "empty remainder returned");
        }
        accounted += pd.len();
        check_packet(pd, local_cid_len, largest_pn);
        rest = next;
    }
    assert!(accounted <= datagram.len());
});

/// The Retry offload reads a datagram's first packet as the packet parser does: an Initial
/// of v1 or v2 that parses, in 1200 bytes or more, its client ID long enough, is unvalidated (the offload's key is
/// new, so no token is its own) with the same IDs, and the Retry answering it carries a
/// valid integrity tag.
fn check_retry_offload(datagram: &[u8], local_cid_len: usize) {
    use kuai_proto::retry_offload::{RetryOffload, Verdict};
    use std::sync::{Arc, OnceLock};
    static OFFLOAD: OnceLock<RetryOffload> = OnceLock::new();
    let offload = OFFLOAD.get_or_init(|| {
        RetryOffload::new(
            Arc::new(kuai_proto::TokenKey::random()),
            std::time::Duration::from_secs(10),
        )
    });
    let client: std::net::SocketAddr = "192.0.2.1:4433".parse().unwrap();
    let verdict = offload.check(datagram, client, 1_000);
    let parsed = PartialDecode::new(BytesMut::from(datagram), local_cid_len).ok();
    let initial = parsed.as_ref().and_then(|(pd, _)| {
        let v = pd.version().and_then(Version::from_wire)?;
        (pd.ty() == PacketType::Long(LongType::Initial)).then(|| (v, pd))
    });
    if let Some((v, pd)) = initial
        && pd.dst_cid_bytes().len() >= 8
        && datagram.len() >= 1200
    {
        let Verdict::Unvalidated(ids) = &verdict else {
            panic!("an Initial judged {verdict:?}");
        };
        assert_eq!(ids.version, v);
        assert_eq!(&ids.dcid[..], pd.dst_cid_bytes());
        assert_eq!(Some(&ids.scid[..]), pd.src_cid_bytes());
        let new = ConnectionId::new(&[7; 8]);
        let retry = offload.retry(ids, client, 1_000, &new);
        assert!(retry_integrity_ok(v, &ids.dcid, &retry));
    }
    // Nothing shorter than a client's first datagram is answered (RFC 9000 §14.1).
    if datagram.len() < 1200 {
        assert!(!matches!(verdict, Verdict::Unvalidated(_)), "{verdict:?}");
        assert!(kuai_proto::retry_offload::version_negotiation(datagram).is_none());
    }
}

fn check_packet(pd: PartialDecode, local_cid_len: usize, largest_pn: Option<u64>) {
    let ty = pd.ty();
    let version = pd.version();
    let dst_cid = pd.dst_cid();
    let dst_cid_bytes = pd.dst_cid_bytes().to_vec();
    let src_cid = pd.src_cid();
    let src_cid_bytes = pd.src_cid_bytes().map(<[u8]>::to_vec);
    let token = pd.token().to_vec();
    let versions: Vec<u32> = pd.supported_versions().collect();
    let space = pd.space();
    let _ = (pd.is_long(), pd.is_initial(), pd.fixed_bit(), pd.len());
    let _ = format!("{pd:?}");
    let raw = pd.data().to_vec();

    // Accessor consistency.
    assert_eq!(pd.is_long(), ty.is_long());
    assert_eq!(space, ty.space());
    assert_eq!(pd.is_long(), raw[0] & 0x80 != 0);
    match ty {
        PacketType::Short => {
            assert_eq!(version, None);
            assert_eq!(src_cid, None);
            assert_eq!(dst_cid_bytes.len(), local_cid_len);
        }
        PacketType::VersionNegotiation => assert_eq!(version, Some(0)),
        _ => assert!(version.is_some_and(|v| v != 0)),
    }
    if dst_cid_bytes.len() <= 20 {
        assert_eq!(&dst_cid[..], &dst_cid_bytes[..]);
    } else {
        assert!(dst_cid.is_empty());
    }
    assert_eq!(src_cid.is_some(), src_cid_bytes.is_some());
    if ty != PacketType::VersionNegotiation {
        assert!(versions.is_empty());
    }
    if !matches!(ty, PacketType::Long(LongType::Initial | LongType::Retry)) {
        assert!(token.is_empty(), "{ty:?} with a token");
    }

    // Re-parsing the packet's own bytes finds the same packet and nothing after it.
    let (again, tail) = PartialDecode::new(BytesMut::from(&raw[..]), local_cid_len)
        .unwrap_or_else(|e| panic!("packet bytes of {pd:?} no longer parse: {e:?}"));
    assert!(tail.is_none(), "re-parsed packet has a remainder");
    assert_eq!(again.ty(), ty);
    assert_eq!(again.dst_cid_bytes(), &dst_cid_bytes[..]);
    assert_eq!(again.len(), raw.len());

    let wire_version = version.and_then(Version::from_wire);

    if let (PacketType::Long(LongType::Retry), Some(v)) = (ty, wire_version) {
        // Check the tag against the packet's own DCID and against an empty one.
        let _ = retry_integrity_ok(v, &dst_cid, &raw);
        let _ = retry_integrity_ok(v, &ConnectionId::EMPTY, &raw);
    }

    // Header protection and decryption with Initial keys from the packet's DCID, both sides.
    // Short header packets use v1 keys so that their unprotect path is exercised too.
    let keys_version = match ty {
        PacketType::Long(LongType::Initial | LongType::ZeroRtt | LongType::Handshake) => {
            wire_version
        }
        PacketType::Short => Some(Version::V1),
        _ => None,
    };
    let Some(keys_version) = keys_version else {
        // Unsupported versions, Version Negotiation and Retry carry no protection.
        match pd.unprotect(
            &*initial_keys(Version::V1, &dst_cid, Side::Server)
                .remote
                .header,
            None,
        ) {
            Err(PacketDecodeError::UnsupportedVersion {
                version: v,
                dst_cid: d,
                src_cid: s,
            }) => {
                assert_eq!(ty, PacketType::UnsupportedVersion);
                assert_eq!(Some(v), version);
                assert_eq!(&d[..], &dst_cid_bytes[..]);
                assert_eq!(Some(&s[..]), src_cid_bytes.as_deref());
            }
            Err(PacketDecodeError::NotProtected(t)) => assert_eq!(t, ty),
            Err(e) => panic!("unexpected error for {ty:?}: {e:?}"),
            Ok(up) => panic!("{ty:?} packet was unprotected: {up:?}"),
        }
        return;
    };

    for side in [Side::Server, Side::Client] {
        let keys = initial_keys(keys_version, &dst_cid, side);
        let (pd, _) =
            PartialDecode::new(BytesMut::from(&raw[..]), local_cid_len).expect("parsed above");
        let up = match pd.unprotect(&*keys.remote.header, largest_pn) {
            Ok(up) => up,
            Err(e) => {
                let _ = format!("{e}");
                continue;
            }
        };
        let _ = format!("{up:?}");
        let header = *up.header();
        assert_eq!(up.ty(), ty);
        assert_eq!(up.version(), version);
        assert_eq!(up.dst_cid(), dst_cid);
        assert_eq!(up.src_cid(), src_cid);
        assert_eq!(up.token(), &token[..]);
        assert_eq!(up.len(), raw.len());
        assert!((1..=4).contains(&header.pn_len));
        assert!(up.header_len() <= up.len());
        assert_eq!(up.header_bytes().len(), up.header_len());
        assert_eq!(up.space(), space);
        assert_eq!(up.is_long(), ty.is_long());
        if !ty.is_long() {
            assert_eq!(up.reset_token().as_ref(), reset_token_of(&raw));
        } else {
            assert!(up.reset_token().is_none());
            assert!(!up.key_phase() && !up.spin());
        }
        // The recovered packet number ends in the truncated bits.
        let truncated = up.header_bytes()[up.header_len() - header.pn_len..]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        let mask = (1u64 << (8 * header.pn_len)) - 1;
        assert_eq!(
            up.pn() & mask,
            truncated,
            "pn {} from {truncated:#x}",
            up.pn()
        );
        let _ = (up.reserved_bits_nonzero(), up.pn());

        match up.decrypt(&*keys.remote.packet) {
            Ok(dp) => {
                assert_eq!(dp.header, header);
                assert_eq!(&dp.token[..], &token[..]);
                assert!(dp.payload.len() + header.header_len <= raw.len());
                let _ = format!("{dp:?}");
                for frame in FrameIter::new(dp.payload.clone()) {
                    if frame.is_err() {
                        break;
                    }
                }
            }
            Err(e) => assert_eq!(e, PacketDecodeError::DecryptionFailed),
        }
    }
}
