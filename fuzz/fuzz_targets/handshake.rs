//! The handshake and the server's accept path (`kuai_proto::Endpoint::handle_datagram` with
//! Initials), fed fuzz-made and mutated packets in the Initial and Handshake spaces.
//!
//! Every input starts with a client `Endpoint` that has just called `connect` and a server
//! `Endpoint` that has seen nothing: the client's first flight is on the wire. Unlike
//! `connection`, datagrams stay on the wire until an operation moves them (delivered, dropped,
//! duplicated, reordered), so an input can stop the handshake anywhere, mutate any of its
//! packets, and speak for the peer in any packet number space: the fuzzer re-seals real
//! packets with the Initial keys (derived from the client's DCID, RFC 9001 §5.2) and the
//! Handshake and 1-RTT keys (from the client's TLS key log), builds packets from scratch, and
//! replays the real ClientHello from spoofed addresses, whole or cut into CRYPTO frames at any
//! offsets, over as many packets and datagrams as it likes, coalesced with other packets. The
//! harness (network, keys, invariants) is `fuzz/src/quic.rs`, shared with `connection`.
//!
//! # Input
//!
//! Byte 0: bit 0 picks the target (0 = server, 1 = client; the other endpoint is "the peer"),
//! bits 1-2 the datagrams asked of `poll_transmit` at once (1-4), bits 3-4 the server's
//! configuration: kuai's defaults, Retry always, Retry above one handshake in flight, or
//! CONNECTION_REFUSED above one. Then up to [`MAX_OPS`] chunks `[op][len][len bytes of body]`.
//! `op & 15` is the operation, `op >> 4` four flag bits `f0`..`f3`. A *source* `s` picks where
//! a datagram for the target comes from: 0 the peer's address, 1 the peer's other port, 2 and 3
//! the two victim addresses (spoofed: what is sent there is lost).
//!
//! | op | operation | flags |
//! |---|---|---|
//! | 0 | deliver the body to the target as a raw datagram | s = f0-f1; f2: pad with zeros to 1200 bytes; f3: route it (short header with the DCID the peer uses) |
//! | 1 | take the peer's next datagram for the target (from the wire, or a new one), flip bytes in it (body: `(pos u16 LE, xor)` triples) and deliver it | s = f0-f1; f2: deliver the original first |
//! | 2 | take the peer's next datagram, open its packet number `body[0]` (of those coalesced in it: Initial, Handshake or 1-RTT) and re-seal it with the same header around fuzz frames `body[1..]`, keeping the datagram's size | f0-f1: the frames replace the packet's, follow them, precede them, or are `(pos, xor)` triples applied to them; s = f2-f3 |
//! | 3 | advance the clock by `u16 LE` ms and run timeouts | f0: drop what is sent meanwhile (else it waits on the wire); f1: jump to the end |
//! | 4 | `body[0] % 16 + 1` rounds of timers | f0: do not advance the clock (1 ms per round otherwise); f1: deliver everything after each round |
//! | 5 | application action (as in `connection`) | f0: on the peer |
//! | 6 | a stateless reset for the target (as in `connection`) | f0: corrupt the token |
//! | 7 | deliver again one of the last 32 datagrams the target received (`body[0]` back) | s = f0-f1 |
//! | 8 | a client Initial made from scratch carrying the real ClientHello: `body[0]` = `c` picks the DCID (`c & 7`: 0 the client's first, 1 the one its Initial keys come from now, 2 and 3 two fixed ones, else a new one for each packet; 8 to 20 bytes), the SCID (`c & 8`: a fixed one, else the client's), the version (`c & 16`: v2), the token (`c >> 5 & 3`: none, the last Retry token the server sent, 16 junk bytes, 200 junk bytes); `body[1..]` are `(offset u16 LE, len)` triples, each a CRYPTO frame with the ClientHello bytes from `offset` (`offset` beyond its end: bytes from `offset % len` at `offset`); no triple: the whole ClientHello in one frame | s = f0-f1; f2: no padding to 1200 bytes; f3: add the packet to the coalescing buffer instead of sending it |
//! | 9 | move up to `body[0] % 8 + 1` datagrams off the wire | f0: toward the peer (else toward the target); f1-f2: deliver, drop, deliver twice, deliver the one behind first |
//! | 10 | a packet of the peer made from scratch, `body[0]` = `c`: space `c % 3` (Initial, Handshake, 1-RTT), packet number `c >> 2 & 3`: next, the last again, next + 16 x `c >> 4`, zero; frames `body[1..]`; with the CIDs (and keys) the peer uses | s = f0-f1; f2: no padding of a client Initial to 1200 bytes; f3: add it to the coalescing buffer |
//! | 11 | send the coalescing buffer with `body` after it | s = f0-f1; f2: pad with zeros to 1200 bytes |
//! | 12 | a Retry for the client, `body[0]` = `c`: token `body[1..]`, integrity tag broken (`c & 1`), for another original DCID (`c & 2`), new SCID from `c`; or (f0) a Version Negotiation packet listing the versions in `body` (4 bytes each) | f1: from a victim address |
//! | 13 | deliver everything until neither side has more to say | |
//! | 14 | as 9 toward the target, delivering in order (`body[0] % 8 + 1` datagrams) | |
//! | 15 | advance to the next deadline and run it | f0: drop what is sent |
//!
//! After every operation both endpoints' output goes onto the wire (to an address nobody has:
//! lost). At the end the wire is cleared and the clock runs on until every connection is gone.
//!
//! # Checks
//!
//! Those of `connection` (no panic, no endless exchange, no timer livelock or lost timer,
//! closed connections drain, everything gone at the end) and the amplification and memory
//! invariants of `fuzz/src/quic.rs`: to an address it has not validated an endpoint never sends
//! more than 3x the bytes it received from it, counted per address over all its connections and
//! its stateless answers; the heap never grows more than `MEM_BOUND` during one input.

#![no_main]

use std::time::Duration;

use bytes::Bytes;
use kuai_fuzz::alloc;
use kuai_fuzz::quic::{
    self, CID_LEN, Harness, Opened, ServerVariant, Space, Who, debug, flip, source, victim,
};
use kuai_proto::frame::Frame;
use kuai_proto::packet::{self, MIN_INITIAL_SIZE};
use kuai_proto::{ConnectionId, Version};
use libfuzzer_sys::fuzz_target;

/// Operations run per input at most.
const MAX_OPS: usize = 128;

/// State of one input beyond the harness.
struct Input {
    /// Packets waiting to be sent in one datagram (ops 8, 10, 11).
    coalesce: Vec<u8>,
    /// Packet numbers of the fuzz-made client Initials.
    spoof_pn: u64,
}

/// A CID of 8 to 20 bytes made from `k` and `n`.
fn fresh_cid(k: u8, n: u64) -> ConnectionId {
    let len = 8 + usize::from(k) * 5 % 13;
    let n = n.to_le_bytes();
    let bytes: Vec<u8> = (0..len)
        .map(|i| 0xd0 ^ k ^ (i as u8).wrapping_mul(17) ^ n[i % 8])
        .collect();
    ConnectionId::new(&bytes)
}

fn crypto(offset: u64, data: &[u8], out: &mut Vec<u8>) {
    Frame::Crypto {
        offset,
        data: Bytes::copy_from_slice(data),
    }
    .encode(out);
}

/// Adds PADDING frames so that a packet sealed from `frames` makes a datagram of at least
/// 1200 bytes after `already` bytes of other packets (headers and tag counted generously).
fn pad_frames(frames: &mut Vec<u8>, already: usize, header: usize) {
    let want = MIN_INITIAL_SIZE.saturating_sub(already + header + 16 + frames.len());
    frames.resize(frames.len() + want, 0);
}

/// Sends `d` to the target from `src`, or keeps it for coalescing.
fn emit(h: &mut Harness, inp: &mut Input, src: std::net::SocketAddr, d: Vec<u8>, hold: bool) {
    if hold {
        if inp.coalesce.len() < 4096 {
            inp.coalesce.extend_from_slice(&d);
        }
        return;
    }
    let d = if inp.coalesce.is_empty() {
        d
    } else {
        let mut all = std::mem::take(&mut inp.coalesce);
        all.extend_from_slice(&d);
        all
    };
    let target = h.target;
    h.deliver(target, src, None, &d);
}

fn run(h: &mut Harness, inp: &mut Input, op: u8, body: &[u8]) {
    if debug() {
        eprintln!(
            "op {} flags {:#06b} at {:?}: {body:02x?}",
            op & 15,
            op >> 4,
            h.now - quic::base()
        );
    }
    let flags = op >> 4;
    let f = |i: u8| flags & (1 << i) != 0;
    let peer = h.target.other();
    let target = h.target;
    let src = source(peer, flags);
    let c = body.first().copied().unwrap_or(0);
    let rest = body.get(1..).unwrap_or_default();
    match op & 15 {
        0 => {
            let mut d = body.to_vec();
            if f(3)
                && let Some(dcid) = h.last_dcid[peer as usize]
                && !body.is_empty()
            {
                d = Vec::with_capacity(body.len() + CID_LEN);
                d.push(body[0] & 0x7f);
                d.extend_from_slice(&dcid);
                d.extend_from_slice(&body[1..]);
            }
            if f(2) && d.len() < MIN_INITIAL_SIZE {
                d.resize(MIN_INITIAL_SIZE, 0);
            }
            h.deliver(target, src, None, &d);
        }
        1 => {
            let Some(orig) = h.intercept() else { return };
            if f(2) {
                h.deliver(target, src, None, &orig);
            }
            let mut d = orig;
            flip(&mut d, body);
            h.deliver(target, src, None, &d);
        }
        2 => {
            let Some(d) = h.intercept() else { return };
            let mode = flags & 3;
            let d = h.reseal(peer, &d, usize::from(c), false, |payload| match mode {
                0 => rest.to_vec(),
                1 => [payload, rest].concat(),
                2 => [rest, payload].concat(),
                _ => {
                    let mut p = payload.to_vec();
                    flip(&mut p, rest);
                    p
                }
            });
            h.deliver(target, source(peer, flags >> 2), None, &d);
        }
        3 => {
            let ms = match body {
                [] => 1,
                [a] => u64::from(*a),
                [a, b, ..] => u64::from(u16::from_le_bytes([*a, *b])),
            };
            let until = h.now + Duration::from_millis(ms);
            h.advance(until, !f(0), f(1));
        }
        4 => {
            for _ in 0..c % 16 + 1 {
                if !f(0) {
                    h.now += Duration::from_millis(1);
                }
                h.fire_timers(true);
                if f(1) {
                    h.settle();
                }
            }
        }
        5 => h.app(if f(0) { peer } else { target }, body),
        6 => {
            let Some(dcid) = h.last_dcid[target as usize] else {
                return;
            };
            let mut tok = quic::reset_token(peer, &dcid);
            if f(0) {
                tok[15] ^= 1;
            }
            let mut d = vec![0x40 | (c & 0x3f)];
            d.extend_from_slice(rest);
            while d.len() < 5 {
                d.push(0x5a);
            }
            d.extend_from_slice(&tok);
            h.deliver(target, peer.addr(), None, &d);
        }
        7 => {
            let n = h.history.len();
            if n == 0 {
                return;
            }
            let d = h.history[n - 1 - usize::from(c) % n].clone();
            h.deliver(target, src, None, &d);
        }
        8 => spoofed_initial(h, inp, c, rest, src, !f(2), f(3)),
        9 | 14 => {
            let (toward, how) = if op & 15 == 14 {
                (target, 0)
            } else {
                (if f(0) { peer } else { target }, (flags >> 1) & 3)
            };
            h.step(toward, how, usize::from(c % 8) + 1);
        }
        10 => peer_packet(h, inp, c, rest, src, !f(2), f(3)),
        11 => {
            let mut d = std::mem::take(&mut inp.coalesce);
            d.extend_from_slice(body);
            if d.is_empty() {
                return;
            }
            if f(2) && d.len() < MIN_INITIAL_SIZE {
                d.resize(MIN_INITIAL_SIZE, 0);
            }
            h.deliver(target, src, None, &d);
        }
        12 => {
            let client_scid =
                h.long_cids[Who::Client as usize].map_or(ConnectionId::new(&[0; 8]), |(_, s)| s);
            let odcid = h.odcid.unwrap_or(ConnectionId::new(&[0; 8]));
            let from = if f(1) { victim(0) } else { Who::Server.addr() };
            let d = if f(0) {
                let versions: Vec<u32> = body
                    .chunks_exact(4)
                    .map(|v| u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
                    .collect();
                packet::build_version_negotiation(&client_scid, &odcid, &versions)
            } else {
                let scid = ConnectionId::new(&[0x7e, c, c ^ 0x55, 1, 2, 3, 4, 5]);
                let for_odcid = if c & 2 != 0 { fresh_cid(c, 0) } else { odcid };
                let mut d = packet::build_retry(Version::V1, &client_scid, &scid, &for_odcid, rest);
                if c & 1 != 0
                    && let Some(last) = d.last_mut()
                {
                    *last ^= 1;
                }
                h.add_initial_cid(scid);
                d
            };
            h.deliver(target, from, None, &d);
        }
        13 => h.settle(),
        _ => {
            if let Some(t) = h.next_deadline() {
                h.advance(t, !f(0), false);
            }
        }
    }
}

/// Op 8: an Initial with pieces of the real ClientHello, as a spoofing client would send.
fn spoofed_initial(
    h: &mut Harness,
    inp: &mut Input,
    c: u8,
    triples: &[u8],
    src: std::net::SocketAddr,
    pad: bool,
    hold: bool,
) {
    let ch = h.client_hello.clone();
    if ch.is_empty() {
        return;
    }
    let dcid = match c & 7 {
        0 => h.odcid,
        1 => h.initial_key_cid,
        // The same two CIDs in every input, or a new one for each packet.
        k @ 2..=3 => Some(fresh_cid(k, 0)),
        k => Some(fresh_cid(k, inp.spoof_pn + 1)),
    };
    let Some(dcid) = dcid else { return };
    let scid = match h.long_cids[Who::Client as usize] {
        Some((_, s)) if c & 8 == 0 => s,
        _ => ConnectionId::new(&[0x5c; 8]),
    };
    let version = if c & 16 != 0 {
        Version::V2
    } else {
        Version::V1
    };
    let token: Vec<u8> = match (c >> 5) & 3 {
        0 => Vec::new(),
        1 => h
            .retry_tokens
            .last()
            .map(|t| t.to_vec())
            .unwrap_or_default(),
        2 => vec![c; 16],
        _ => vec![c ^ 0xa5; 200],
    };
    let mut frames = Vec::new();
    if triples.len() < 3 {
        crypto(0, &ch, &mut frames);
    }
    for t in triples.chunks_exact(3) {
        let offset = usize::from(u16::from_le_bytes([t[0], t[1]]));
        let len = usize::from(t[2]);
        let from = if offset < ch.len() {
            offset
        } else {
            offset % ch.len()
        };
        let data = &ch[from..(from + len).min(ch.len())];
        crypto(offset as u64, data, &mut frames);
    }
    if pad {
        let header = packet::long_header_len(
            packet::LongType::Initial,
            dcid.len(),
            scid.len(),
            token.len(),
            4,
        );
        pad_frames(&mut frames, inp.coalesce.len(), header);
    }
    let pn = inp.spoof_pn;
    inp.spoof_pn += 1;
    let Some(d) = h.seal_long(
        Space::Initial,
        Who::Client,
        version,
        Some(&dcid),
        &dcid,
        &scid,
        &token,
        pn,
        4,
        &frames,
    ) else {
        return;
    };
    emit(h, inp, src, d, hold);
}

/// Op 10: a packet of the peer made from scratch in the Initial, Handshake or 1-RTT space.
fn peer_packet(
    h: &mut Harness,
    inp: &mut Input,
    c: u8,
    frames: &[u8],
    src: std::net::SocketAddr,
    pad: bool,
    hold: bool,
) {
    let peer = h.target.other();
    let space = c % 3;
    let pick_pn = |largest: Option<u64>| match (c >> 2) & 3 {
        0 => largest.map_or(0, |l| l + 1),
        1 => largest.unwrap_or(0),
        2 => largest.map_or(0, |l| l + 1) + 16 * u64::from(c >> 4),
        _ => 0,
    };
    if space == 2 {
        let Some(dcid) = h.last_dcid[peer as usize] else {
            return;
        };
        let Some(phase) = h.mirrors.as_ref().map(|m| m[peer as usize].phase) else {
            return;
        };
        let pn = pick_pn(h.largest_pn[peer as usize]);
        let o = Opened {
            pn,
            pn_len: 4,
            key_phase: phase,
            spin: false,
            fixed_bit: true,
            dcid,
            payload: Bytes::new(),
        };
        if let Some(d) = h.seal(peer, &o, frames, false) {
            emit(h, inp, src, d, hold);
        }
        return;
    }
    let space = if space == 0 {
        Space::Initial
    } else {
        Space::Handshake
    };
    let (dcid, scid) = match h.long_cids[peer as usize] {
        Some(ids) => ids,
        None if peer == Who::Client => match h.odcid {
            Some(d) => (d, ConnectionId::new(&[0x5c; 8])),
            None => return,
        },
        None => return,
    };
    let version = h
        .conn(Who::Client)
        .map_or(Version::V1, |conn| conn.version());
    let token: Vec<u8> = if space == Space::Initial && peer == Who::Client && c & 0x40 != 0 {
        h.retry_tokens
            .last()
            .map(|t| t.to_vec())
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut frames = frames.to_vec();
    if pad && space == Space::Initial && peer == Who::Client {
        let header = packet::long_header_len(
            packet::LongType::Initial,
            dcid.len(),
            scid.len(),
            token.len(),
            4,
        );
        pad_frames(&mut frames, inp.coalesce.len(), header);
    }
    let slot = &mut h.long_pn[peer as usize][space as usize];
    let pn = pick_pn(*slot);
    *slot = Some(slot.map_or(pn, |l| l.max(pn)));
    let Some(d) = h.seal_long(
        space, peer, version, None, &dcid, &scid, &token, pn, 4, &frames,
    ) else {
        return;
    };
    emit(h, inp, src, d, hold);
}

fuzz_target!(|data: &[u8]| {
    let Some((&config, mut rest)) = data.split_first() else {
        return;
    };
    let target = if config & 1 == 0 {
        Who::Server
    } else {
        Who::Client
    };
    let gso = 1 + usize::from((config >> 1) & 3);
    let variant = ServerVariant::from_bits(config >> 3);
    let mem_base = alloc::reset_peak();
    let mut h = Harness::handshaking(target, gso, variant, mem_base);
    let mut inp = Input {
        coalesce: Vec::new(),
        spoof_pn: 0,
    };
    for _ in 0..MAX_OPS {
        let [op, len, tail @ ..] = rest else { break };
        let n = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(n);
        rest = next;
        run(&mut h, &mut inp, *op, body);
        h.flush();
        h.check();
        h.debug_state();
    }
    h.quiesce();
});
