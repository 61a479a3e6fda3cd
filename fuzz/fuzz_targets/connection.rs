//! A connection fed random datagrams after a real handshake (`kuai_proto::Endpoint`,
//! `kuai_proto::Connection`).
//!
//! Every input starts from the same place: a client and a server `Endpoint` (fixed seeds,
//! deterministic connection IDs, fixed reset and token keys, one Ed25519 certificate made once
//! per process with rcgen from a fixed key) complete a real TLS 1.3 handshake in lock step on a
//! virtual clock that starts at one `Instant` captured once per process, then open streams both
//! ways with some data. `Connection` cannot be cloned, so the handshake is simply run again for
//! every input (about a millisecond, so ~1000 inputs/s without sanitizer; keeping one pair alive
//! across inputs would make crashes depend on earlier inputs). An input never sees state left by
//! another one. What stays random is inside rustls (X25519 shares, nonces) and where kuai-proto
//! draws from the thread RNG (transport-parameter grease, token nonces, stateless reset filler):
//! the bytes on the wire differ between runs, what happens hardly ever does.
//!
//! The client's TLS key log hands the fuzzer the 1-RTT traffic secrets, from which it derives the
//! same packet keys as the connections (`OneRttKeys::derived`, following key updates by the key
//! phase bit). So it can take a datagram the peer really produced, open it, and deliver a packet
//! with the peer's packet number but fuzz-chosen frames: the target's frame processing is reached
//! with valid packets, and the peer's view stays consistent (it sent that packet number).
//!
//! # Input
//!
//! Byte 0: bit 0 picks the target (0 = server, 1 = client; the other endpoint is "the peer"),
//! bits 1-2 the number of datagrams asked of `poll_transmit` at once (1-4, exercising GSO
//! batches). Then up to `MAX_OPS` (128) chunks `[op][len][len bytes of body]` (a short last body is
//! taken as it is). `op & 7` is the operation, `op >> 3` five flag bits (`f0`..`f4`):
//!
//! | op | operation | flags |
//! |---|---|---|
//! | 0 | deliver the body to the target as a raw datagram | f0: from the peer's other port; f1: route it (short-header first byte from body\[0], then the DCID the peer uses, then the rest); f2-f3: ECN bits; f4: from a victim address instead (f0 picks which) |
//! | 1 | make the peer send a datagram (queueing a DATAGRAM frame if it has nothing to send), flip bytes in it — body is `(pos u16 LE, xor)` triples — and deliver it | f0: other port; f1: deliver the original first; f2: from a victim address instead (f0 picks which) |
//! | 2 | take the peer's next datagram as in 1, decrypt it and re-seal it with the same packet number around fuzz frames | f0-f1: 0 body replaces the frames, 1 frames then body, 2 body then frames, 3 the frames with the body's `(pos u16 LE, xor)` triples applied; f2: other port (a migration); f3: flip the key phase, sealing with the next keys (a peer-initiated key update); f4: ECN CE |
//! | 3 | advance the clock by `u16 LE` ms (body, 1 ms if empty) and run timeouts on both sides | f0: drop what is sent meanwhile instead of delivering it; f1: jump straight to the end instead of stepping through every deadline |
//! | 4 | pump: `body[0] % 16 + 1` rounds of timers and traffic both ways | f0: do not advance the clock (1 ms per round otherwise) |
//! | 5 | application action on a connection, `body[0] % 11`: open bidi + write, open uni + write, write, finish, reset, stop (an odd code: the stop that waits for more than a FIN), send datagram, key update, close, migrate (client), read everything; `body[1]` picks a stream, the rest is data or the code | f0: on the peer instead of the target |
//! | 6 | a stateless reset for the target: `[0x40 \| body[0] & 0x3f] ++ body[1..]`, padded to 5 bytes, `++` the peer's reset token for the CID the target last sent to | f0: corrupt the token |
//! | 7 | deliver again one of the last 32 datagrams the target received (`body[0]` back from the newest) | f0: other port; f1: from a victim address instead (f0 picks which) |
//!
//! After every operation both endpoints are drained: datagrams are delivered to the other side and
//! events handled (streams read, incoming streams accepted), until neither has anything to send.
//! At the end of the input the clock runs on without delivering anything until every connection
//! is gone.
//!
//! # Checks (a panic is a finding)
//!
//! - Nothing in kuai-proto panics.
//! - One exchange between the endpoints quiesces within `MAX_DATAGRAMS` (1000) datagrams.
//! - No timer livelock: after `handle_timeout(now)` on both endpoints and draining their output,
//!   a deadline at or before `now` (endpoint's or a connection's) may remain only while the
//!   endpoints keep sending or the deadline moves forward; three rounds without a datagram in
//!   which it did not move, or 64 without a datagram, is a livelock.
//! - After every operation, the endpoint's `poll_timeout` is at or before every live
//!   connection's own deadline (no connection's timer is lost), and `connection_count()` agrees
//!   with `handles()`.
//! - A closed connection has a deadline no later than `max(60 s, 4 x PTO)` ahead (its 3 x PTO
//!   drain timer), so it drains once the clock passes it; at the end of the input, with nothing
//!   delivered any more, every connection is gone after `max(60 s, 6 x PTO)` (twice the 30 s
//!   idle timeout or 3 x PTO, as one PTO probe may restart the idle timer).
//! - Amplification: to an address it has not validated, neither endpoint ever sends more than 3x
//!   the bytes it received from there (RFC 9000 §8, §9.3); and the heap never grows by more than
//!   `MEM_BOUND` during one input. How the harness decides what is validated, and the network
//!   model (datagrams to the two victim addresses are lost), are in `fuzz/src/quic.rs`, which
//!   this target shares with `handshake`.
//!
//! `KUAI_FUZZ_DEBUG=1` in the environment prints every operation, datagram (the first 40 of each
//! exchange) and event, to follow a reproducer.

#![no_main]

use std::time::Duration;

use kuai_fuzz::alloc;
use kuai_fuzz::quic::{self, CID_LEN, Harness, Who, debug, flip, victim};
use kuai_proto::connection::EcnCodepoint;
use libfuzzer_sys::fuzz_target;

/// Operations run per input at most.
const MAX_OPS: usize = 128;

fn run(h: &mut Harness, op: u8, body: &[u8]) {
    if debug() {
        eprintln!(
            "op {} flags {:#07b} at {:?}: {body:02x?}",
            op & 7,
            op >> 3,
            h.now - quic::base()
        );
    }
    let flags = op >> 3;
    let f = |i: u8| flags & (1 << i) != 0;
    let peer = h.target.other();
    let from = |alt: bool| if alt { peer.alt_addr() } else { peer.addr() };
    let spoofed = |v: bool, alt: bool| {
        if v {
            victim(usize::from(alt))
        } else {
            from(alt)
        }
    };
    match op & 7 {
        0 => {
            let mut d = body.to_vec();
            if f(1)
                && let Some(dcid) = h.last_dcid[peer as usize]
                && !body.is_empty()
            {
                d = Vec::with_capacity(body.len() + CID_LEN);
                d.push(body[0] & 0x7f);
                d.extend_from_slice(&dcid);
                d.extend_from_slice(&body[1..]);
            }
            let ecn = EcnCodepoint::from_bits(flags >> 2);
            let target = h.target;
            h.deliver(target, spoofed(f(4), f(0)), ecn, &d);
        }
        1 => {
            let Some(orig) = h.intercept() else { return };
            let src = spoofed(f(2), f(0));
            let target = h.target;
            if f(1) {
                h.deliver(target, src, None, &orig);
            }
            let mut d = orig;
            flip(&mut d, body);
            h.deliver(target, src, None, &d);
        }
        2 => {
            let Some(d) = h.intercept() else { return };
            let mode = flags & 3;
            let d = if d[0] & 0x80 == 0 {
                h.reseal(peer, &d, 0, f(3), |payload| match mode {
                    0 => body.to_vec(),
                    1 => [payload, body].concat(),
                    2 => [body, payload].concat(),
                    _ => {
                        let mut p = payload.to_vec();
                        flip(&mut p, body);
                        p
                    }
                })
            } else {
                // Not a 1-RTT packet: deliver it as it was.
                d
            };
            let ecn = f(4).then_some(EcnCodepoint::Ce);
            let target = h.target;
            h.deliver(target, from(f(2)), ecn, &d);
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
            let rounds = body.first().map_or(1, |b| b % 16 + 1);
            for _ in 0..rounds {
                if !f(0) {
                    h.now += Duration::from_millis(1);
                }
                h.fire_timers(true);
            }
        }
        5 => h.app(if f(0) { peer } else { h.target }, body),
        6 => {
            let target = h.target;
            let Some(dcid) = h.last_dcid[target as usize] else {
                return;
            };
            let mut tok = quic::reset_token(peer, &dcid);
            if f(0) {
                tok[15] ^= 1;
            }
            let mut d = vec![0x40 | body.first().map_or(0, |b| b & 0x3f)];
            d.extend_from_slice(body.get(1..).unwrap_or_default());
            // At least 21 bytes, like any stateless reset (RFC 9000 §10.3).
            while d.len() < 5 {
                d.push(0x5a);
            }
            d.extend_from_slice(&tok);
            h.deliver(target, peer.addr(), None, &d);
        }
        _ => {
            let back = body.first().map_or(0, |b| usize::from(*b));
            let n = h.history.len();
            if n == 0 {
                return;
            }
            let d = h.history[n - 1 - back % n].clone();
            let target = h.target;
            h.deliver(target, spoofed(f(1), f(0)), None, &d);
        }
    }
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
    let mem_base = alloc::reset_peak();
    let mut h = Harness::established(target, gso, mem_base);
    for _ in 0..MAX_OPS {
        let [op, len, tail @ ..] = rest else { break };
        let n = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(n);
        rest = next;
        run(&mut h, *op, body);
        h.settle();
        h.check();
        h.debug_state();
    }
    h.quiesce();
});
