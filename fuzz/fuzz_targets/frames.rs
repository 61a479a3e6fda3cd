//! Frame decoding and re-encoding (`kuai_proto::frame`).
//!
//! The input is a decrypted packet payload. Every frame [`FrameIter`] decodes successfully is
//! re-encoded with [`Frame::encode`]; the encoding must be exactly [`Frame::encoded_len`] bytes,
//! must decode back to one frame equal to the original, and must be a fixed point (encoding the
//! re-decoded frame gives the same bytes). The comparison is semantic where the wire format allows
//! more than one encoding of the same frame (non-minimal varints, STREAM without LEN, DATAGRAM
//! 0x30, ACK ranges). ACK frames are additionally walked with [`Ack::iter`], whose ranges must be
//! well-formed, descending and separated by at least one missing packet number, and re-encoded
//! canonically from a [`RangeSet`] with [`Ack::encode`].

#![no_main]

use std::ops::RangeInclusive;

use bytes::Bytes;
use kuai_proto::VarInt;
use kuai_proto::frame::{Ack, Frame, FrameIter, FrameType};
use kuai_proto::range_set::RangeSet;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut decoded = Vec::new();
    for result in FrameIter::new(Bytes::copy_from_slice(data)) {
        match result {
            Ok(frame) => {
                check_frame(&frame);
                decoded.push(frame);
            }
            Err(e) => {
                // Errors must be printable and convertible; the iterator stops after one.
                let _ = format!("{e:?}");
                let _ = kuai_proto::TransportError::from(e);
            }
        }
    }

    // The whole sequence of good frames re-encodes to a payload that decodes to the same
    // sequence: every frame that runs to the end of the payload on the wire (STREAM without LEN,
    // DATAGRAM 0x30) is the last one decoded, and is re-encoded with an explicit length.
    let mut all = Vec::new();
    for f in &decoded {
        f.encode(&mut all);
    }
    assert_eq!(
        all.len(),
        decoded.iter().map(Frame::encoded_len).sum::<usize>()
    );
    let again: Vec<Frame> = FrameIter::new(Bytes::from(all))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("re-encoded frame sequence does not decode: {e:?}"));
    assert_eq!(again.len(), decoded.len(), "{decoded:?} became {again:?}");
    for (a, b) in decoded.iter().zip(&again) {
        assert_same(a, b);
    }
});

fn check_frame(frame: &Frame) {
    // Accessors and formatting must not panic.
    let ty = frame.ty();
    let _ = format!("{frame:?} {ty:?}");
    let _ = (
        ty.is_ack_eliciting(),
        ty.allowed_in_handshake_spaces(),
        ty.allowed_in_0rtt(),
        ty.counts_in_flight(),
    );

    let mut buf = Vec::new();
    frame.encode(&mut buf);
    assert_eq!(buf.len(), frame.encoded_len(), "encoded_len of {frame:?}");
    assert!(!buf.is_empty(), "{frame:?} encoded to nothing");

    // The wire type of the re-encoding agrees with `Frame::ty`.
    let wire_ty = VarInt::decode(&mut &buf[..])
        .expect("encoding starts with a frame type")
        .into_inner();
    match frame {
        Frame::Stream(s) => {
            assert_eq!(wire_ty & !0x07, FrameType::STREAM.0);
            assert_eq!(wire_ty & 0x01 != 0, s.fin);
        }
        _ => assert_eq!(wire_ty, ty.0, "{frame:?}"),
    }

    // Decodes back to exactly one, equal frame.
    let mut it = FrameIter::new(Bytes::from(buf.clone()));
    let back = match it.next() {
        Some(Ok(f)) => f,
        other => panic!("re-encoding of {frame:?} ({buf:02x?}) decoded as {other:?}"),
    };
    assert!(
        it.next().is_none(),
        "re-encoding of {frame:?} decoded as more than one frame"
    );
    assert_same(frame, &back);

    // Encoding is a fixed point after one round trip.
    let mut buf2 = Vec::new();
    back.encode(&mut buf2);
    assert_eq!(buf, buf2, "re-encoding of {frame:?} is not stable");

    if let Frame::Ack(ack) = frame {
        check_ack(ack, &buf);
    }
}

/// Semantic equality: ACK frames compare by the packet numbers they acknowledge (their range
/// list may legitimately use non-minimal varints on the wire); everything else structurally.
fn assert_same(a: &Frame, b: &Frame) {
    match (a, b) {
        (Frame::Ack(x), Frame::Ack(y)) => {
            assert_eq!(x.largest, y.largest);
            assert_eq!(x.delay, y.delay);
            assert_eq!(x.ecn, y.ecn);
            assert!(x.iter().eq(y.iter()), "ACK ranges {x:?} became {y:?}");
        }
        _ => assert_eq!(a, b),
    }
}

fn check_ack(ack: &Ack, encoded: &[u8]) {
    // The Ack Range Count, read from the re-encoding: type, largest, delay, count.
    let mut r = encoded;
    let mut next = || VarInt::decode(&mut r).unwrap().into_inner();
    let (_ty, largest, _delay, range_count) = (next(), next(), next(), next());
    assert_eq!(largest, ack.largest);

    let ranges: Vec<RangeInclusive<u64>> = ack.iter().collect();
    // Decoding validated every range, so the walk yields all of them.
    assert_eq!(
        ranges.len() as u64,
        range_count + 1,
        "ACK iter stopped early: {ack:?}"
    );
    assert_eq!(
        *ranges[0].end(),
        ack.largest,
        "first range must end at largest"
    );
    for r in &ranges {
        assert!(r.start() <= r.end(), "empty or inverted ACK range {r:?}");
    }
    for w in ranges.windows(2) {
        // Descending, non-overlapping and not adjacent: a gap field encodes at least one missing
        // packet number between two ranges (RFC 9000 §19.3.1).
        assert!(
            w[1].end().checked_add(1).is_some_and(|e| e < *w[0].start()),
            "ACK ranges not descending with a gap: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    assert_eq!(
        ack.smallest(),
        *ranges.last().unwrap().start(),
        "Ack::smallest"
    );

    // Canonical re-encoding through a RangeSet with Ack::encode.
    let mut set = RangeSet::new();
    for r in &ranges {
        set.insert(*r.start()..*r.end() + 1);
    }
    assert_eq!(set.len(), ranges.len(), "ranges merged in the RangeSet");
    for max_ranges in [usize::MAX, 1, 2] {
        let mut buf = Vec::new();
        Ack::encode(ack.delay, &set, ack.ecn.as_ref(), max_ranges, &mut buf);
        assert_eq!(
            buf.len(),
            Ack::encoded_len(ack.delay, &set, ack.ecn.as_ref(), max_ranges),
            "Ack::encoded_len"
        );
        let mut it = FrameIter::new(Bytes::from(buf));
        let Some(Ok(Frame::Ack(canon))) = it.next() else {
            panic!("Ack::encode output of {ack:?} does not decode as an ACK");
        };
        assert!(it.next().is_none());
        assert_eq!(canon.largest, ack.largest);
        assert_eq!(canon.delay, ack.delay);
        assert_eq!(canon.ecn, ack.ecn);
        // The highest `max_ranges` ranges, in the same order.
        let kept: Vec<_> = canon.iter().collect();
        assert_eq!(kept.len(), ranges.len().min(max_ranges));
        assert_eq!(kept[..], ranges[..kept.len()], "canonical ACK differs");
    }
}
