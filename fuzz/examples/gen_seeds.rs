//! Writes the seed inputs under `fuzz/seeds/<target>/` (checked in; rerun after changing this
//! file). Runs on stable, no fuzzing toolchain needed:
//!
//! ```sh
//! cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds -- fuzz/seeds
//! ```
//!
//! Everything is deterministic: the transport parameters' grease value comes from a seeded RNG,
//! and the packets use fixed packet numbers and connection IDs. The `connection` seeds are
//! operation sequences (the format is described in `fuzz_targets/connection.rs`), with frames
//! made by `Frame::encode`. The RFC 9001 / RFC 9369
//! Appendix A packets are copied from `crates/kuai-proto/tests/vectors.rs`.

// ACK ranges are given as slices of ranges, often of one.
#![allow(clippy::single_range_in_vec_init)]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use kuai_proto::frame::{
    Ack, AckFrequency, Close, EcnCounts, Frame, FrameIter, NewConnectionId, StreamFrame,
};
use kuai_proto::packet::{
    LongType, build_retry, build_version_negotiation, initial_keys, seal_packet, write_long_header,
    write_short_header,
};
use kuai_proto::range_set::RangeSet;
use kuai_proto::transport_params::{PreferredAddress, TransportParameters, VersionInformation};
use kuai_proto::{ConnectionId, Dir, Side, StreamId, Version};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap();
}

// RFC 9001 Appendix A.2 client Initial CRYPTO frame (the ClientHello).
const CRYPTO_FRAME: &str = "\
    060040f1010000ed0303ebf8fa56f12939b9584a3896472ec40bb863cfd3e868\
    04fe3a47f06a2b69484c00000413011302010000c000000010000e00000b6578\
    616d706c652e636f6dff01000100000a00080006001d00170018001000070005\
    04616c706e000500050100000000003300260024001d00209370b2c9caa47fba\
    baf4559fedba753de171fa71f50f1ce15d43e994ec74d748002b000302030400\
    0d0010000e0403050306030203080408050806002d00020101001c0002400100\
    3900320408ffffffffffffffff05048000ffff07048000ffff08011001048000\
    75300901100f088394c8f03e51570806048000ffff";
// RFC 9001 Appendix A.3 server Initial payload (ACK + CRYPTO with the ServerHello).
const SERVER_PAYLOAD: &str = "\
    02000000000600405a020000560303eefce7f7b37ba1d1632e96677825ddf739\
    88cfc79825df566dc5430b9a045a1200130100002e00330024001d00209d3c94\
    0d89690b84d08a60993c144eca684d1081287c834d5311bcf32bb9da1a002b00\
    020304";
// The quic_transport_parameters extension body of that ClientHello.
const CLIENT_HELLO_TP: &str = "\
    0408ffffffffffffffff05048000ffff07048000ffff0801100104800075300901\
    100f088394c8f03e51570806048000ffff";

// RFC 9001 / RFC 9369 Appendix A.2 (client Initial), A.3, A.4, A.5.
const V1_CLIENT_PACKET: &str = "\
    c000000001088394c8f03e5157080000449e7b9aec34d1b1c98dd7689fb8ec11\
    d242b123dc9bd8bab936b47d92ec356c0bab7df5976d27cd449f63300099f399\
    1c260ec4c60d17b31f8429157bb35a1282a643a8d2262cad67500cadb8e7378c\
    8eb7539ec4d4905fed1bee1fc8aafba17c750e2c7ace01e6005f80fcb7df6212\
    30c83711b39343fa028cea7f7fb5ff89eac2308249a02252155e2347b63d58c5\
    457afd84d05dfffdb20392844ae812154682e9cf012f9021a6f0be17ddd0c208\
    4dce25ff9b06cde535d0f920a2db1bf362c23e596d11a4f5a6cf3948838a3aec\
    4e15daf8500a6ef69ec4e3feb6b1d98e610ac8b7ec3faf6ad760b7bad1db4ba3\
    485e8a94dc250ae3fdb41ed15fb6a8e5eba0fc3dd60bc8e30c5c4287e53805db\
    059ae0648db2f64264ed5e39be2e20d82df566da8dd5998ccabdae053060ae6c\
    7b4378e846d29f37ed7b4ea9ec5d82e7961b7f25a9323851f681d582363aa5f8\
    9937f5a67258bf63ad6f1a0b1d96dbd4faddfcefc5266ba6611722395c906556\
    be52afe3f565636ad1b17d508b73d8743eeb524be22b3dcbc2c7468d54119c74\
    68449a13d8e3b95811a198f3491de3e7fe942b330407abf82a4ed7c1b311663a\
    c69890f4157015853d91e923037c227a33cdd5ec281ca3f79c44546b9d90ca00\
    f064c99e3dd97911d39fe9c5d0b23a229a234cb36186c4819e8b9c5927726632\
    291d6a418211cc2962e20fe47feb3edf330f2c603a9d48c0fcb5699dbfe58964\
    25c5bac4aee82e57a85aaf4e2513e4f05796b07ba2ee47d80506f8d2c25e50fd\
    14de71e6c418559302f939b0e1abd576f279c4b2e0feb85c1f28ff18f58891ff\
    ef132eef2fa09346aee33c28eb130ff28f5b766953334113211996d20011a198\
    e3fc433f9f2541010ae17c1bf202580f6047472fb36857fe843b19f5984009dd\
    c324044e847a4f4a0ab34f719595de37252d6235365e9b84392b061085349d73\
    203a4a13e96f5432ec0fd4a1ee65accdd5e3904df54c1da510b0ff20dcc0c77f\
    cb2c0e0eb605cb0504db87632cf3d8b4dae6e705769d1de354270123cb11450e\
    fc60ac47683d7b8d0f811365565fd98c4c8eb936bcab8d069fc33bd801b03ade\
    a2e1fbc5aa463d08ca19896d2bf59a071b851e6c239052172f296bfb5e724047\
    90a2181014f3b94a4e97d117b438130368cc39dbb2d198065ae3986547926cd2\
    162f40a29f0c3c8745c0f50fba3852e566d44575c29d39a03f0cda721984b6f4\
    40591f355e12d439ff150aab7613499dbd49adabc8676eef023b15b65bfc5ca0\
    6948109f23f350db82123535eb8a7433bdabcb909271a6ecbcb58b936a88cd4e\
    8f2e6ff5800175f113253d8fa9ca8885c2f552e657dc603f252e1a8e308f76f0\
    be79e2fb8f5d5fbbe2e30ecadd220723c8c0aea8078cdfcb3868263ff8f09400\
    54da48781893a7e49ad5aff4af300cd804a6b6279ab3ff3afb64491c85194aab\
    760d58a606654f9f4400e8b38591356fbf6425aca26dc85244259ff2b19c41b9\
    f96f3ca9ec1dde434da7d2d392b905ddf3d1f9af93d1af5950bd493f5aa731b4\
    056df31bd267b6b90a079831aaf579be0a39013137aac6d404f518cfd4684064\
    7e78bfe706ca4cf5e9c5453e9f7cfd2b8b4c8d169a44e55c88d4a9a7f9474241\
    e221af44860018ab0856972e194cd934";
const V1_SERVER_PACKET: &str = "\
    cf000000010008f067a5502a4262b5004075c0d95a482cd0991cd25b0aac406a\
    5816b6394100f37a1c69797554780bb38cc5a99f5ede4cf73c3ec2493a1839b3\
    dbcba3f6ea46c5b7684df3548e7ddeb9c3bf9c73cc3f3bded74b562bfb19fb84\
    022f8ef4cdd93795d77d06edbb7aaf2f58891850abbdca3d20398c276456cbc4\
    2158407dd074ee";
const V1_RETRY: &str = "\
    ff000000010008f067a5502a4262b5746f6b656e04a265ba2eff4d829058fb3f\
    0f2496ba";
const V1_CHACHA_PACKET: &str = "4cfe4189655e5cd55c41f69080575d7999c25a5bfb";
const V2_SERVER_PACKET: &str = "\
    dc6b3343cf0008f067a5502a4262b5004075d92faaf16f05d8a4398c47089698\
    baeea26b91eb761d9b89237bbf87263017915358230035f7fd3945d88965cf17\
    f9af6e16886c61bfc703106fbaf3cb4cfa52382dd16a393e42757507698075b2\
    c984c707f0a0812d8cd5a6881eaf21ceda98f4bd23f6fe1a3e2c43edd9ce7ca8\
    4bed8521e2e140";
const V2_RETRY: &str = "\
    cf6b3343cf0008f067a5502a4262b5746f6b656ec8646ce8bfe33952d9555436\
    65dcc7b6";
const V2_CHACHA_PACKET: &str = "5558b1c60ae7b6b932bc27d786f4bc2bb20f2162ba";

fn ack(delay: u64, ranges: &[std::ops::Range<u64>], ecn: Option<EcnCounts>) -> Frame {
    let mut set = RangeSet::new();
    for r in ranges {
        set.insert(r.clone());
    }
    let mut buf = Vec::new();
    Ack::encode(delay, &set, ecn.as_ref(), usize::MAX, &mut buf);
    match FrameIter::new(Bytes::from(buf)).next() {
        Some(Ok(f @ Frame::Ack(_))) => f,
        other => panic!("{other:?}"),
    }
}

fn frames() -> Vec<(&'static str, Frame)> {
    vec![
        ("padding", Frame::Padding(3)),
        ("ping", Frame::Ping),
        ("ack", ack(0, &[0..1], None)),
        (
            "ack_ecn_ranges",
            ack(
                25,
                &[1..5, 10..11, 20..100, 200..70_000],
                Some(EcnCounts {
                    ect0: 5,
                    ect1: 0,
                    ce: 1,
                }),
            ),
        ),
        (
            "reset_stream",
            Frame::ResetStream {
                id: StreamId(4),
                error_code: 7,
                final_size: 1 << 40,
            },
        ),
        (
            "stop_sending",
            Frame::StopSending {
                id: StreamId(3),
                error_code: 0x100,
            },
        ),
        (
            "crypto",
            Frame::Crypto {
                offset: 1000,
                data: Bytes::from_static(b"hello"),
            },
        ),
        (
            "new_token",
            Frame::NewToken {
                token: Bytes::from_static(b"tok"),
            },
        ),
        (
            "stream_fin",
            Frame::Stream(StreamFrame {
                id: StreamId(8),
                offset: 0,
                fin: true,
                data: Bytes::from_static(b"x"),
            }),
        ),
        (
            "stream_off",
            Frame::Stream(StreamFrame {
                id: StreamId(8),
                offset: 77777,
                fin: false,
                data: Bytes::from_static(b"abc"),
            }),
        ),
        ("max_data", Frame::MaxData(1 << 30)),
        (
            "max_stream_data",
            Frame::MaxStreamData {
                id: StreamId(2),
                max: 9,
            },
        ),
        (
            "max_streams_bidi",
            Frame::MaxStreams {
                dir: Dir::Bi,
                count: 100,
            },
        ),
        (
            "max_streams_uni",
            Frame::MaxStreams {
                dir: Dir::Uni,
                count: 1 << 60,
            },
        ),
        ("data_blocked", Frame::DataBlocked(5)),
        (
            "stream_data_blocked",
            Frame::StreamDataBlocked {
                id: StreamId(1),
                limit: 2,
            },
        ),
        (
            "streams_blocked",
            Frame::StreamsBlocked {
                dir: Dir::Uni,
                limit: 8,
            },
        ),
        (
            "new_connection_id",
            Frame::NewConnectionId(NewConnectionId {
                seq: 3,
                retire_prior_to: 1,
                cid: ConnectionId::new(&[9; 8]),
                reset_token: [7; 16],
            }),
        ),
        ("retire_connection_id", Frame::RetireConnectionId { seq: 2 }),
        (
            "path_challenge",
            Frame::PathChallenge([1, 2, 3, 4, 5, 6, 7, 8]),
        ),
        ("path_response", Frame::PathResponse([8; 8])),
        (
            "connection_close",
            Frame::Close(Close {
                error_code: 0xa,
                frame_type: Some(0x08),
                reason: Bytes::from_static(b"bad"),
            }),
        ),
        (
            "application_close",
            Frame::Close(Close {
                error_code: 3,
                frame_type: None,
                reason: Bytes::new(),
            }),
        ),
        ("handshake_done", Frame::HandshakeDone),
        ("datagram", Frame::Datagram(Bytes::from_static(b"dgram"))),
        (
            "ack_frequency",
            Frame::AckFrequency(AckFrequency {
                seq: 1,
                ack_eliciting_threshold: 9,
                request_max_ack_delay: 25_000,
                reordering_threshold: 3,
            }),
        ),
        ("immediate_ack", Frame::ImmediateAck),
    ]
}

fn frame_seeds(dir: &Path) {
    let mut all = Vec::new();
    for (name, f) in frames() {
        let mut buf = Vec::new();
        f.encode(&mut buf);
        write(dir, &format!("{name}.bin"), &buf);
        all.extend_from_slice(&buf);
    }
    write(dir, "all_frames.bin", &all);

    let mut client_hello = hex(CRYPTO_FRAME);
    client_hello.resize(1162, 0);
    write(dir, "rfc9001_client_initial_payload.bin", &client_hello);
    write(
        dir,
        "rfc9001_server_initial_payload.bin",
        &hex(SERVER_PAYLOAD),
    );

    // Legitimate non-canonical encodings: STREAM without LEN running to the end, OFF bit with a
    // zero offset, DATAGRAM without length, 2- and 8-byte varints where 1 byte would do, and an
    // ACK whose range list uses long varints.
    write(dir, "stream_no_len.bin", &hex("0d04 400a 68656c6c6f"));
    write(dir, "stream_zero_off.bin", &hex("0e 00 00 03 616263 01"));
    write(dir, "datagram_no_len.bin", &hex("01 30 64677261"));
    write(
        dir,
        "max_data_long_varint.bin",
        &hex("10 c000000000000005 14 4005"),
    );
    write(
        dir,
        "ack_long_varints.bin",
        &hex("02 4064 4000 4002 4001 4001 4003 8000000000000000"),
    );
}

/// Seals one long header packet with the Initial keys derived from its own DCID, as a client
/// would, so that the target (which derives keys the same way) can decrypt it.
fn seal_long(
    version: Version,
    ty: LongType,
    dcid: &[u8],
    scid: &[u8],
    pn: u64,
    payload: &[u8],
) -> Vec<u8> {
    let dcid = ConnectionId::new(dcid);
    let keys = initial_keys(version, &dcid, Side::Client);
    let mut buf = Vec::new();
    let token: &[u8] = if ty == LongType::Initial { b"tok" } else { &[] };
    let pos = write_long_header(
        &mut buf,
        version,
        ty,
        &dcid,
        &ConnectionId::new(scid),
        token,
        pn,
        2,
    );
    buf.extend_from_slice(payload);
    seal_packet(&mut buf, &pos, pn, &*keys.local.header, &*keys.local.packet).unwrap();
    buf
}

fn seal_short(dcid: &[u8], pn: u64, payload: &[u8]) -> Vec<u8> {
    let dcid = ConnectionId::new(dcid);
    let keys = initial_keys(Version::V1, &dcid, Side::Client);
    let mut buf = Vec::new();
    let pos = write_short_header(&mut buf, &dcid, true, false, pn, 3);
    buf.extend_from_slice(payload);
    seal_packet(&mut buf, &pos, pn, &*keys.local.header, &*keys.local.packet).unwrap();
    buf
}

/// A packet_header input: the selector byte (local CID length + 21 * largest-pn index), then
/// the datagram.
fn datagram(local_cid_len: u8, pn_sel: u8, packets: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![local_cid_len + 21 * pn_sel];
    for p in packets {
        out.extend_from_slice(p);
    }
    out
}

fn packet_seeds(dir: &Path) {
    // The RFC vectors. The A.2 client Initial decrypts with the keys the target derives.
    let mut v1_client = hex(V1_CLIENT_PACKET);
    write(
        dir,
        "rfc9001_a2_client_initial.bin",
        &datagram(8, 0, &[&v1_client]),
    );
    write(
        dir,
        "rfc9001_a3_server_initial.bin",
        &datagram(0, 0, &[&hex(V1_SERVER_PACKET)]),
    );
    write(
        dir,
        "rfc9001_a4_retry.bin",
        &datagram(0, 0, &[&hex(V1_RETRY)]),
    );
    write(
        dir,
        "rfc9001_a5_chacha_short.bin",
        &datagram(0, 12, &[&hex(V1_CHACHA_PACKET)]),
    );
    write(
        dir,
        "rfc9369_a3_server_initial.bin",
        &datagram(0, 0, &[&hex(V2_SERVER_PACKET)]),
    );
    write(
        dir,
        "rfc9369_a4_retry.bin",
        &datagram(0, 0, &[&hex(V2_RETRY)]),
    );
    write(
        dir,
        "rfc9369_a5_chacha_short.bin",
        &datagram(0, 12, &[&hex(V2_CHACHA_PACKET)]),
    );

    // Sealed here with Initial keys from each packet's DCID: they all decrypt in the target.
    let mut payload = Vec::new();
    for (_, f) in frames() {
        f.encode(&mut payload);
    }
    let dcid = [0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08];
    let scid = [0xf0, 0x67, 0xa5, 0x50];
    let initial = seal_long(
        Version::V1,
        LongType::Initial,
        &dcid,
        &scid,
        0,
        &hex(CRYPTO_FRAME),
    );
    let handshake = seal_long(Version::V1, LongType::Handshake, &dcid, &scid, 1, &payload);
    let zero_rtt = seal_long(Version::V1, LongType::ZeroRtt, &dcid, &scid, 2, &payload);
    let short = seal_short(&dcid, 3, &payload);
    write(
        dir,
        "v1_coalesced.bin",
        &datagram(8, 1, &[&initial, &handshake, &zero_rtt, &short]),
    );
    let initial2 = seal_long(
        Version::V2,
        LongType::Initial,
        &dcid,
        &[],
        0x1234,
        &hex(SERVER_PAYLOAD),
    );
    let handshake2 = seal_long(Version::V2, LongType::Handshake, &[], &dcid, 7, &payload);
    write(
        dir,
        "v2_initial_handshake.bin",
        &datagram(0, 1, &[&initial2, &handshake2]),
    );
    write(
        dir,
        "short_header.bin",
        &datagram(8, 6, &[&seal_short(&dcid, 0xa82f_9b32, &payload)]),
    );

    // Unprotected packets.
    write(
        dir,
        "version_negotiation.bin",
        &datagram(
            0,
            0,
            &[&build_version_negotiation(&dcid, &scid, &[1, 0x6b33_43cf])],
        ),
    );
    let mut unknown = hex("c0 1a2a3a4a 08 8394c8f03e515708 00");
    unknown.resize(1200, 0);
    write(dir, "unknown_version.bin", &datagram(0, 0, &[&unknown]));
    let retry = build_retry(
        Version::V1,
        &ConnectionId::new(&scid),
        &ConnectionId::new(&[5; 8]),
        &ConnectionId::new(&dcid),
        b"retry token",
    );
    write(dir, "v1_retry_built.bin", &datagram(4, 0, &[&retry]));

    // A stateless-reset-looking short packet (random bytes and a token).
    v1_client.truncate(43);
    v1_client[0] = 0x41;
    write(
        dir,
        "stateless_reset_like.bin",
        &datagram(20, 0, &[&v1_client]),
    );
}

fn client_params() -> TransportParameters {
    TransportParameters {
        max_idle_timeout: 30_000,
        max_udp_payload_size: 1472,
        initial_max_data: 1 << 40,
        initial_max_stream_data_bidi_local: 1 << 20,
        initial_max_stream_data_bidi_remote: (1 << 20) + 1,
        initial_max_stream_data_uni: 100_000,
        initial_max_streams_bidi: 1 << 60,
        initial_max_streams_uni: 3,
        ack_delay_exponent: 20,
        max_ack_delay: (1 << 14) - 1,
        disable_active_migration: true,
        active_connection_id_limit: 8,
        initial_source_connection_id: Some(ConnectionId::EMPTY),
        version_information: Some(VersionInformation {
            chosen: 0x6b33_43cf,
            available: vec![0x6b33_43cf, 1, 0x0a1a_2a3a],
        }),
        max_datagram_frame_size: Some(65535),
        grease_quic_bit: true,
        min_ack_delay: Some(1000),
        ..TransportParameters::default()
    }
}

fn server_params() -> TransportParameters {
    TransportParameters {
        original_destination_connection_id: Some(ConnectionId::new(&[1, 2, 3, 4, 5, 6, 7, 8])),
        stateless_reset_token: Some([0xab; 16]),
        preferred_address: Some(PreferredAddress {
            v4: Some(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 4433)),
            v6: Some(SocketAddrV6::new(
                Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
                4434,
                0,
                0,
            )),
            cid: ConnectionId::new(&[9; 20]),
            reset_token: [0xcd; 16],
        }),
        initial_source_connection_id: Some(ConnectionId::new(&[0xf0, 0x67])),
        retry_source_connection_id: Some(ConnectionId::new(&[7; 4])),
        version_information: Some(VersionInformation {
            chosen: 1,
            available: vec![1, 0x6b33_43cf],
        }),
        ..client_params()
    }
}

fn tp_seeds(dir: &Path) {
    let encode = |p: &TransportParameters, seed: u64| {
        let mut buf = Vec::new();
        p.encode_with_rng(&mut buf, &mut StdRng::seed_from_u64(seed));
        buf
    };
    write(dir, "client_full.bin", &encode(&client_params(), 1));
    write(dir, "server_full.bin", &encode(&server_params(), 2));
    write(
        dir,
        "defaults.bin",
        &encode(&TransportParameters::default(), 3),
    );
    let no_v6 = TransportParameters {
        preferred_address: Some(PreferredAddress {
            v4: Some(SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 9), 443)),
            v6: None,
            cid: ConnectionId::new(&[1]),
            reset_token: [0; 16],
        }),
        ..TransportParameters::default()
    };
    write(dir, "server_preferred_v4_only.bin", &encode(&no_v6, 4));
    write(dir, "rfc9001_client_hello.bin", &hex(CLIENT_HELLO_TP));
}

// ---------------------------------------------------------------------------------------------
// `connection`: byte 0 picks the target (bit 0: client) and the GSO batch (bits 1-2), then
// `[op][len][body]` chunks with `op = kind | flags << 3` (see fuzz_targets/connection.rs).

const RAW: u8 = 0;
const MUTATE: u8 = 1;
const SEAL: u8 = 2;
const CLOCK: u8 = 3;
const PUMP: u8 = 4;
const APP: u8 = 5;
const RESET: u8 = 6;
const REPLAY: u8 = 7;

/// `(kind, flags, body)` of each operation.
type Ops = Vec<(u8, u8, Vec<u8>)>;

fn conn_input(config: u8, ops: &[(u8, u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![config];
    for (kind, flags, body) in ops {
        assert!(*kind < 8 && *flags < 32 && body.len() <= 255);
        out.push(kind | flags << 3);
        out.push(body.len() as u8);
        out.extend_from_slice(body);
    }
    out
}

fn encode_frames(frames: &[Frame]) -> Vec<u8> {
    let mut buf = Vec::new();
    for f in frames {
        f.encode(&mut buf);
    }
    buf
}

fn ms(n: u16) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

/// `(pos u16 LE, xor)` triples for the mutating operations.
fn flips(f: &[(u16, u8)]) -> Vec<u8> {
    f.iter()
        .flat_map(|&(pos, x)| [pos.to_le_bytes()[0], pos.to_le_bytes()[1], x])
        .collect()
}

/// An application action (`fuzz_targets/connection.rs`, `Harness::app`).
fn app(action: u8, pick: u8, data: &[u8]) -> Vec<u8> {
    [&[action, pick][..], data].concat()
}

fn stream(id: u64, offset: u64, fin: bool, data: &'static [u8]) -> Frame {
    Frame::Stream(StreamFrame {
        id: StreamId(id),
        offset,
        fin,
        data: Bytes::from_static(data),
    })
}

fn connection_seeds(dir: &Path) {
    const SERVER: u8 = 0;
    const CLIENT: u8 = 1;
    let both = [("s", SERVER), ("c", CLIENT)];

    // Every frame type, sealed into a packet of the peer (replacing its frames for the server,
    // after them for the client).
    for (name, f) in frames() {
        let body = encode_frames(&[f]);
        write(
            dir,
            &format!("seal_{name}_s.bin"),
            &conn_input(SERVER, &[(SEAL, 0, body.clone())]),
        );
        write(
            dir,
            &format!("seal_{name}_c.bin"),
            &conn_input(CLIENT, &[(SEAL, 1, body)]),
        );
    }
    // Frames that fit the streams and packet numbers of the setup.
    let to_server = [
        ("stream_more", vec![stream(0, 1500, true, b"more data")]),
        (
            "stream_new",
            vec![stream(4, 0, false, b"new"), stream(6, 10, true, b"uni")],
        ),
        (
            "stream_overlap",
            vec![stream(0, 1400, false, b"0123456789abcdef")],
        ),
        (
            "reset_own",
            vec![Frame::ResetStream {
                id: StreamId(0),
                error_code: 1,
                final_size: 1500,
            }],
        ),
        (
            "stop_reply",
            vec![Frame::StopSending {
                id: StreamId(0),
                error_code: 2,
            }],
        ),
        ("ack_recent", vec![ack(0, &[0..8], None)]),
        (
            "ack_ecn",
            vec![ack(
                3,
                &[2..9],
                Some(EcnCounts {
                    ect0: 3,
                    ect1: 0,
                    ce: 2,
                }),
            )],
        ),
        (
            "new_cids",
            vec![
                Frame::NewConnectionId(NewConnectionId {
                    seq: 4,
                    retire_prior_to: 2,
                    cid: ConnectionId::new(&[0x44; 8]),
                    reset_token: [4; 16],
                }),
                Frame::RetireConnectionId { seq: 0 },
            ],
        ),
        (
            "flow_limits",
            vec![
                Frame::MaxData(10),
                Frame::MaxStreamData {
                    id: StreamId(1),
                    max: 5,
                },
                Frame::MaxStreams {
                    dir: Dir::Bi,
                    count: 1,
                },
            ],
        ),
    ];
    for (name, frames) in to_server {
        let body = encode_frames(&frames);
        write(
            dir,
            &format!("seal_{name}.bin"),
            &conn_input(SERVER, &[(SEAL, 0, body)]),
        );
    }
    let ping = encode_frames(&[Frame::Ping, Frame::Padding(20)]);
    for (side, config) in both {
        let challenge = encode_frames(&[Frame::PathChallenge(*b"fuzzpath"), Frame::Ping]);
        let seeds: Vec<(&str, Ops)> = vec![
            // Raw datagrams: junk, junk routed to the connection, with ECN, from another port,
            // a long header.
            ("raw_junk", vec![(RAW, 0, vec![0x41; 40])]),
            (
                "raw_routed",
                vec![(RAW, 0b10, [&[0x41][..], &[0xee; 40]].concat())],
            ),
            (
                "raw_routed_ce_alt",
                vec![(RAW, 0b1111, [&[0x45][..], &[0x17; 60]].concat())],
            ),
            (
                "raw_long",
                vec![(
                    RAW,
                    0,
                    [
                        &hex("c0 00000001 08 0102030405060708 00 00 4020")[..],
                        &[0; 40],
                    ]
                    .concat(),
                )],
            ),
            // A real datagram, bit-flipped: first byte, DCID, packet number, payload, tag.
            ("mutate_key_phase", vec![(MUTATE, 0, flips(&[(0, 0x04)]))]),
            ("mutate_dcid", vec![(MUTATE, 0, flips(&[(3, 0xff)]))]),
            ("mutate_pn", vec![(MUTATE, 0, flips(&[(9, 0x01)]))]),
            (
                "mutate_payload",
                vec![(MUTATE, 0, flips(&[(30, 0x80), (31, 1)]))],
            ),
            (
                "mutate_tag_dup_alt",
                vec![(MUTATE, 0b11, flips(&[(0xffff, 0x10)]))],
            ),
            // Real frames re-sealed: replaced, appended, prepended, flipped; from another port
            // (a migration), with the next key phase, with ECN CE.
            ("seal_ping", vec![(SEAL, 0, ping.clone())]),
            (
                "seal_append",
                vec![(SEAL, 1, encode_frames(&[Frame::ImmediateAck]))],
            ),
            (
                "seal_prepend",
                vec![(SEAL, 2, encode_frames(&[ack(0, &[0..3], None)]))],
            ),
            ("seal_flip", vec![(SEAL, 3, flips(&[(0, 0x01), (5, 0x40)]))]),
            (
                "seal_migrate",
                vec![(SEAL, 0b100, challenge.clone()), (PUMP, 0, vec![3])],
            ),
            (
                "seal_key_update",
                vec![(SEAL, 0b1000, ping.clone()), (PUMP, 0, vec![3])],
            ),
            (
                "seal_ce",
                vec![(SEAL, 0b10000, ping.clone()), (PUMP, 0, vec![1])],
            ),
            // Time: a little, a loss period, past the idle timeout, in one jump.
            ("clock_100ms", vec![(CLOCK, 0, ms(100))]),
            (
                "clock_loss",
                vec![
                    (APP, 0, app(0, 0, &[0x33; 200])),
                    (CLOCK, 0b01, ms(5000)),
                    (CLOCK, 0, ms(1000)),
                    (PUMP, 0, vec![4]),
                ],
            ),
            ("clock_idle_jump", vec![(CLOCK, 0b10, ms(40_000))]),
            (
                "clock_drop_steps",
                vec![(APP, 1, app(2, 0, b"x")), (CLOCK, 0b01, ms(30_000))],
            ),
            ("pump", vec![(PUMP, 0, vec![5]), (PUMP, 1, vec![2])]),
            // Stateless resets, good and bad.
            ("reset", vec![(RESET, 0, vec![0x12; 24])]),
            ("reset_bad_token", vec![(RESET, 1, vec![0x12; 24])]),
            // Datagrams the target already had.
            (
                "replay",
                vec![
                    (SEAL, 0, ping.clone()),
                    (REPLAY, 0, vec![0]),
                    (REPLAY, 1, vec![3]),
                ],
            ),
            // Key updates one after the other.
            (
                "key_updates",
                vec![
                    (APP, 0, app(7, 0, &[])),
                    (PUMP, 0, vec![2]),
                    (APP, 1, app(7, 0, &[])),
                    (PUMP, 0, vec![2]),
                    (SEAL, 0, ping.clone()),
                ],
            ),
            (
                "close_and_drain",
                vec![(APP, 0, app(8, 0, b"\x07bye")), (CLOCK, 0, ms(60_000))],
            ),
        ];
        for (name, ops) in seeds {
            let config = if name == "pump" {
                config | 0b110
            } else {
                config
            };
            write(
                dir,
                &format!("{name}_{side}.bin"),
                &conn_input(config, &ops),
            );
        }
        // Every application action, on the target and on the peer.
        for action in 0..11u8 {
            for (who, flags) in [("target", 0), ("peer", 1)] {
                let ops = vec![
                    (APP, flags, app(action, action, b"\x00\x00\x00\x05fuzz")),
                    (PUMP, 0, vec![1]),
                ];
                write(
                    dir,
                    &format!("app{action}_{who}_{side}.bin"),
                    &conn_input(config, &ops),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `handshake`: byte 0 picks the target (bit 0: client), the GSO batch (bits 1-2) and the
// server's configuration (bits 3-4); then `[op][len][body]` chunks with `op = kind | flags << 4`
// (see fuzz_targets/handshake.rs).

mod hs {
    pub const RAW: u8 = 0;
    pub const MUTATE: u8 = 1;
    pub const SEAL: u8 = 2;
    pub const CLOCK: u8 = 3;
    pub const PUMP: u8 = 4;
    pub const APP: u8 = 5;
    pub const REPLAY: u8 = 7;
    pub const SPOOF: u8 = 8;
    pub const STEP: u8 = 9;
    pub const PACKET: u8 = 10;
    pub const COALESCED: u8 = 11;
    pub const RETRY: u8 = 12;
    pub const SETTLE: u8 = 13;
    pub const NEXT: u8 = 14;
    pub const DEADLINE: u8 = 15;
    /// Sources (the `s` flags): the peer, its other port, the two victims.
    pub const PEER: u8 = 0;
    pub const ALT: u8 = 1;
    pub const VICTIM: u8 = 2;
    pub const VICTIM2: u8 = 3;
}

fn hs_input(config: u8, ops: &[(u8, u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![config];
    for (kind, flags, body) in ops {
        assert!(*kind < 16 && *flags < 16 && body.len() <= 255);
        out.push(kind | flags << 4);
        out.push(body.len() as u8);
        out.extend_from_slice(body);
    }
    out
}

/// `(offset u16 LE, len)` triples cutting the ClientHello into CRYPTO frames.
fn pieces(p: &[(u16, u8)]) -> Vec<u8> {
    p.iter()
        .flat_map(|&(o, l)| [o.to_le_bytes()[0], o.to_le_bytes()[1], l])
        .collect()
}

fn handshake_seeds(dir: &Path) {
    use hs::*;
    const SERVER: u8 = 0;
    const CLIENT: u8 = 1;
    let both = [("s", SERVER), ("c", CLIENT)];
    let crypto = |offset: u64, data: &'static [u8]| {
        encode_frames(&[Frame::Crypto {
            offset,
            data: Bytes::from_static(data),
        }])
    };
    // Whole handshakes: at once, datagram by datagram, with loss, duplicates and reordering,
    // for each server configuration.
    for (side, t) in both {
        for variant in 0..4u8 {
            let config = t | variant << 3;
            write(
                dir,
                &format!("settle_v{variant}_{side}.bin"),
                &hs_input(config, &[(SETTLE, 0, vec![])]),
            );
        }
        let steps: Ops = (0..12)
            .map(|i| (STEP, (i % 2) as u8, vec![0]))
            .chain([(SETTLE, 0, vec![])])
            .collect();
        write(dir, &format!("steps_{side}.bin"), &hs_input(t, &steps));
        write(
            dir,
            &format!("lose_first_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 0b0010 | (t ^ 1), vec![0]),
                    (DEADLINE, 0, vec![]),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        write(
            dir,
            &format!("lose_server_flight_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 1, vec![0]),
                    (STEP, 0b0010, vec![7]),
                    (CLOCK, 0, ms(400)),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        write(
            dir,
            &format!("dup_reorder_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 0b0101, vec![0]),
                    (STEP, 0b0110, vec![3]),
                    (STEP, 0b0101, vec![3]),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        write(
            dir,
            &format!("gso_settle_{side}.bin"),
            &hs_input(
                t | 0b110,
                &[(SETTLE, 0, vec![]), (APP, 0, app(0, 1, b"hi"))],
            ),
        );
        // The peer's first datagram with bytes flipped, and re-sealed around extra frames.
        write(
            dir,
            &format!("mutate_first_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 0, vec![0]),
                    (MUTATE, ALT, flips(&[(30, 0x01), (200, 0x80)])),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        for (name, frames) in [
            ("ping", encode_frames(&[Frame::Ping])),
            ("ack", encode_frames(&[ack(0, &[0..1], None)])),
            ("crypto_gap", crypto(5000, b"late")),
            ("crypto_dup", crypto(0, b"\x01\x00")),
            (
                "close",
                encode_frames(&[Frame::Close(Close {
                    error_code: 0x0a,
                    frame_type: Some(0),
                    reason: Bytes::from_static(b"no"),
                })]),
            ),
            (
                "new_token",
                encode_frames(&[Frame::NewToken {
                    token: Bytes::from_static(b"not in Initial"),
                }]),
            ),
            ("stream", encode_frames(&[stream(0, 0, true, b"early")])),
            ("padding", vec![0; 40]),
        ] {
            for (mode, mname) in [(0u8, "replace"), (1, "append"), (2, "prepend")] {
                let body = [&[0u8][..], &frames].concat();
                let mut ops: Ops = Vec::new();
                if t == CLIENT {
                    // The server's first flight: deliver the client's Initial first.
                    ops.push((STEP, 1, vec![0]));
                }
                ops.push((SEAL, mode, body));
                ops.push((SETTLE, 0, vec![]));
                write(
                    dir,
                    &format!("seal_{name}_{mname}_{side}.bin"),
                    &hs_input(t, &ops),
                );
            }
        }
        // The second packet of the server's first datagram (its Handshake packet).
        write(
            dir,
            &format!("seal_second_packet_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 1, vec![0]),
                    (
                        SEAL,
                        1,
                        [&[1u8][..], &encode_frames(&[Frame::Ping])].concat(),
                    ),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        // Packets from scratch in each space, after the first flights.
        for (space, sname) in [(0u8, "initial"), (1, "handshake"), (2, "onertt")] {
            for (pn, pname) in [(0u8, "next"), (1, "same"), (2, "gap"), (3, "zero")] {
                let c = space | pn << 2 | 0x10;
                let frames = match space {
                    0 => [encode_frames(&[Frame::Ping, ack(0, &[0..1], None)])].concat(),
                    1 => crypto(3, b"\x14\x00\x00\x20odd"),
                    _ => encode_frames(&[Frame::Ping, Frame::MaxData(1 << 20)]),
                };
                write(
                    dir,
                    &format!("packet_{sname}_{pname}_{side}.bin"),
                    &hs_input(
                        t,
                        &[
                            (STEP, 1, vec![1]),
                            (STEP, 0, vec![1]),
                            (PACKET, PEER, [&[c][..], &frames].concat()),
                            (SETTLE, 0, vec![]),
                        ],
                    ),
                );
            }
        }
        // A Handshake and an Initial packet coalesced (in the wrong order), then sent.
        write(
            dir,
            &format!("coalesced_{side}.bin"),
            &hs_input(
                t,
                &[
                    (STEP, 1, vec![1]),
                    (STEP, 0, vec![1]),
                    (
                        PACKET,
                        0b1000,
                        [&[1u8][..], &encode_frames(&[Frame::Ping])].concat(),
                    ),
                    (
                        PACKET,
                        0b1100,
                        [&[0u8][..], &encode_frames(&[Frame::Ping])].concat(),
                    ),
                    (COALESCED, 0b0100, vec![]),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
    }
    // The server's accept path: the real ClientHello from spoofed addresses, whole, in pieces,
    // at odd offsets and beyond its end, with tokens, in v2, too short, coalesced.
    for variant in 0..4u8 {
        let config = SERVER | variant << 3;
        let ops: Ops = (0..8u8)
            .map(|k| {
                (
                    SPOOF,
                    [VICTIM, VICTIM2][usize::from(k % 2)],
                    vec![2 + k % 6],
                )
            })
            .chain([(SETTLE, 0, vec![])])
            .collect();
        write(
            dir,
            &format!("spoof_v{variant}.bin"),
            &hs_input(config, &ops),
        );
    }
    let spoofs: &[(&str, u8, u8, Vec<u8>)] = &[
        ("whole_odcid", VICTIM, 0, vec![]),
        ("whole_peer", PEER, 0, vec![]),
        ("whole_alt", ALT, 0, vec![]),
        ("v2", VICTIM, 2 | 16, vec![]),
        ("fixed_scid", VICTIM, 3 | 8, vec![]),
        ("junk_token", VICTIM, 4 | 2 << 5, vec![]),
        ("long_token", VICTIM, 5 | 3 << 5, vec![]),
        ("retry_token", ALT, 6 | 1 << 5, vec![]),
        ("halves", VICTIM, 2, pieces(&[(0, 150), (150, 255)])),
        ("reversed", VICTIM, 2, pieces(&[(150, 255), (0, 150)])),
        (
            "overlap",
            VICTIM,
            3,
            pieces(&[(0, 100), (50, 100), (100, 255)]),
        ),
        (
            "odd_offsets",
            VICTIM,
            4,
            pieces(&[(1, 7), (9, 3), (255, 255), (0, 1)]),
        ),
        (
            "beyond",
            VICTIM,
            5,
            pieces(&[(4000, 10), (65535, 255), (60000, 1)]),
        ),
        (
            "bytes",
            VICTIM,
            6,
            pieces(&(0..60).map(|i| (i * 3, 2)).collect::<Vec<_>>()),
        ),
    ];
    for (name, src, c, triples) in spoofs {
        write(
            dir,
            &format!("spoof_{name}.bin"),
            &hs_input(
                SERVER | 1 << 3,
                &[
                    (SPOOF, *src, [&[*c][..], triples].concat()),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
        write(
            dir,
            &format!("spoof_{name}_default.bin"),
            &hs_input(
                SERVER,
                &[
                    (SPOOF, *src, [&[*c][..], triples].concat()),
                    (SETTLE, 0, vec![]),
                ],
            ),
        );
    }
    // The ClientHello over many small Initials, then the rest of the handshake.
    let mut ops: Ops = Vec::new();
    for i in 0..40u16 {
        ops.push((SPOOF, VICTIM, [&[7u8][..], &pieces(&[(i * 8, 8)])].concat()));
    }
    ops.push((SETTLE, 0, vec![]));
    write(dir, "spoof_many_packets.bin", &hs_input(SERVER, &ops));
    // Unpadded (too short) and coalesced Initials, the real client's among them.
    write(
        dir,
        "spoof_short_coalesced.bin",
        &hs_input(
            SERVER,
            &[
                (
                    SPOOF,
                    VICTIM | 0b1100,
                    [&[2u8][..], &pieces(&[(0, 100)])].concat(),
                ),
                (
                    SPOOF,
                    VICTIM | 0b1100,
                    [&[2u8][..], &pieces(&[(100, 255)])].concat(),
                ),
                (COALESCED, VICTIM | 0b0100, vec![]),
                (SPOOF, VICTIM | 0b0100, vec![3]),
                (MUTATE, VICTIM, flips(&[(0, 0)])),
                (REPLAY, VICTIM2, vec![0]),
                (RAW, VICTIM | 0b0100, vec![0xc0, 0, 0, 0, 1, 8]),
                (SETTLE, 0, vec![]),
            ],
        ),
    );
    // As many half-open handshakes as an input can make (the memory bound is set from this).
    let flood: Ops = (0..127u8)
        .map(|k| (SPOOF, VICTIM | (k & 1), vec![(4 + k % 4) | (k & 0x60)]))
        .collect();
    write(dir, "spoof_flood.bin", &hs_input(SERVER, &flood));
    // Retry and Version Negotiation for the client.
    for (name, flags, body) in [
        ("retry", 0u8, [&[0u8][..], b"token"].concat()),
        ("retry_bad_tag", 0, vec![1, 1, 2, 3]),
        ("retry_other_odcid", 0, vec![2, 9]),
        ("retry_victim", 0b10, vec![0, 7]),
        (
            "vn",
            1,
            [0x0a0a_0a0au32, 0x6b33_43cf, 2]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
        ),
        ("vn_v1", 1, 1u32.to_be_bytes().to_vec()),
    ] {
        write(
            dir,
            &format!("client_{name}.bin"),
            &hs_input(CLIENT, &[(RETRY, flags, body), (SETTLE, 0, vec![])]),
        );
    }
    // Timers in the middle of the handshake, and the application before it completes.
    write(
        dir,
        "timers_midway.bin",
        &hs_input(
            SERVER,
            &[
                (NEXT, 0, vec![0]),
                (PUMP, 0b0001, vec![3]),
                (CLOCK, 0b0001, ms(1000)),
                (DEADLINE, 1, vec![]),
                (APP, 1, app(0, 0, b"0-rtt?")),
                (PUMP, 0b0010, vec![2]),
            ],
        ),
    );
}

fn main() {
    let root = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/seeds".into()),
    );
    for (name, f) in [
        ("frames", frame_seeds as fn(&Path)),
        ("packet_header", packet_seeds),
        ("transport_params", tp_seeds),
        ("connection", connection_seeds),
        ("handshake", handshake_seeds),
    ] {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        f(&dir);
        println!("wrote {}", dir.display());
    }
}
