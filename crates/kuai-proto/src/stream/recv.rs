//! Reassembly of out-of-order data (STREAM and CRYPTO frames) into an in-order byte stream.

use std::collections::{BTreeMap, VecDeque};

use bytes::{Bytes, BytesMut};

/// Memory charged for each stored piece on top of its bytes: its slot in the queue or map and
/// the handle to its buffer. A piece past a gap costs about 90 bytes of B-tree node (leaves
/// of 11 entries, about half full when pieces arrive in order) and a 32-byte heap chunk at
/// least for a copy of a byte or two: 64 undercounted tiny pieces by half.
pub const PIECE_OVERHEAD: usize = 128;

/// Received data is kept as a slice of the datagram it came in (no copy) only when it is at
/// least this long and fills at least half the datagram; anything smaller is copied, so a
/// peer cannot make a byte of stream data hold a whole datagram.
const SHARE_MIN: usize = 512;

/// Copies of small pieces are appended to the copy before them up to this size.
const OWNED_MAX: usize = 64 * 1024;

/// A stored piece of received data.
#[derive(Debug)]
enum Piece {
    /// A slice of the datagram it arrived in.
    Shared(Bytes),
    /// A copy of its own, which later contiguous small pieces are appended to.
    Owned(BytesMut),
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Shared(b) => b.len(),
            Piece::Owned(b) => b.len(),
        }
    }

    /// Memory held: the bytes (the whole allocation of a copy) and [`PIECE_OVERHEAD`].
    fn charge(&self) -> usize {
        PIECE_OVERHEAD
            + match self {
                Piece::Shared(b) => b.len(),
                Piece::Owned(b) => b.capacity(),
            }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Piece::Shared(b) => b,
            Piece::Owned(b) => b.freeze(),
        }
    }

    /// Takes the first `n` bytes (`n` < `len`).
    fn split_to(&mut self, n: usize) -> Bytes {
        match self {
            Piece::Shared(b) => b.split_to(n),
            Piece::Owned(b) => b.split_to(n).freeze(),
        }
    }

    /// Appends a copy of `data` if this is a copy with room to grow; returns the growth of
    /// its charge.
    fn append(&mut self, data: &[u8]) -> Option<usize> {
        let Piece::Owned(b) = self else { return None };
        if b.len() + data.len() > OWNED_MAX {
            return None;
        }
        let before = b.capacity();
        if b.capacity() - b.len() < data.len() {
            // Doubling, so appending many small pieces costs amortized constant time.
            b.reserve(data.len().max(b.len()));
        }
        b.extend_from_slice(data);
        Some(b.capacity() - before)
    }
}

/// Whether data of `len` bytes from a datagram of `datagram_len` is kept without a copy.
fn shareable(len: usize, datagram_len: usize) -> bool {
    len >= SHARE_MIN && 2 * len >= datagram_len
}

/// `data`, received in a datagram of `datagram_len` bytes, as something to keep: the slice
/// itself when it is large and fills most of its datagram, a copy otherwise (so what is kept
/// never holds a datagram much larger than itself).
pub fn to_keep(data: Bytes, datagram_len: usize) -> Bytes {
    if shareable(data.len(), datagram_len) {
        data
    } else {
        Bytes::copy_from_slice(&data)
    }
}

/// Reassembles data arriving at arbitrary offsets. Each byte is stored at most once, so the
/// bytes held are bounded by the span between the read offset and the highest offset
/// accepted, which the caller bounds with flow control; what that costs in memory is
/// [`charge`](Self::charge), which the caller bounds too.
///
/// Data that continues the readable prefix, the common case, goes to a queue without touching
/// the ordered map; only data past a gap is kept by offset until the gap fills. Large pieces
/// stay slices of their datagrams; small ones are copied and merged with the copy they
/// continue.
#[derive(Debug, Default)]
pub struct Assembler {
    /// Contiguous pieces from `read` to `ready_end`, in order.
    ready: VecDeque<Piece>,
    /// Pieces past a gap, keyed by offset: they never overlap, and all start after
    /// `ready_end`. Together with the readable prefix they are exactly what was received.
    pending: BTreeMap<u64, Piece>,
    /// Next offset the application reads.
    read: u64,
    /// End of the readable prefix: everything below it was received.
    ready_end: u64,
    /// Highest offset received (or skipped by `discard`) plus one.
    max_end: u64,
    /// Bytes currently stored.
    buffered: usize,
    /// Memory charged for what is stored (see [`Piece::charge`]).
    charge: usize,
}

/// A drained queue keeps at most this many slots: a stream that once had a long backlog does
/// not hold its slots for life, and a busy one does not give them back on every read.
const READY_SLOTS_KEPT: usize = 1024;

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `data` at `offset`, received in a datagram of `datagram_len` bytes; returns the
    /// number of new bytes stored.
    pub fn insert(&mut self, offset: u64, data: Bytes, datagram_len: usize) -> usize {
        let end = offset + data.len() as u64;
        if end <= self.ready_end {
            return 0;
        }
        // An empty piece still says how far the stream reaches (the caller charged it to
        // flow control once: it must not again for a repeat).
        self.max_end = self.max_end.max(end);
        if data.is_empty() {
            return 0;
        }
        if offset <= self.ready_end {
            let next_stored = self.pending.first_key_value().map_or(u64::MAX, |(&k, _)| k);
            if end <= next_stored {
                let piece = data.slice((self.ready_end - offset) as usize..);
                let added = piece.len();
                self.push_ready(piece, datagram_len);
                if end == next_stored {
                    self.promote();
                }
                return added;
            }
        }
        // Past a gap, or overlapping stored pieces: store only what is not stored yet.
        let start = offset.max(self.ready_end);
        let mut cursor = start;
        if let Some((&k, b)) = self.pending.range(..cursor).next_back() {
            cursor = cursor.max(k + b.len() as u64);
        }
        let mut added = 0;
        while cursor < end {
            let next = self
                .pending
                .range(cursor..end)
                .next()
                .map(|(&k, b)| (k, k + b.len() as u64));
            let (gap_end, resume) = match next {
                Some((k, k_end)) => (k, k_end),
                None => (end, end),
            };
            if gap_end > cursor {
                let piece = data.slice((cursor - offset) as usize..(gap_end - offset) as usize);
                added += piece.len();
                self.store_pending(cursor, piece, datagram_len);
            }
            cursor = resume;
        }
        self.buffered += added;
        self.promote();
        added
    }

    fn push_ready(&mut self, piece: Bytes, datagram_len: usize) {
        self.ready_end += piece.len() as u64;
        self.buffered += piece.len();
        if shareable(piece.len(), datagram_len) {
            self.charge += PIECE_OVERHEAD + piece.len();
            self.ready.push_back(Piece::Shared(piece));
        } else if let Some(grown) = self.ready.back_mut().and_then(|b| b.append(&piece)) {
            self.charge += grown;
        } else {
            let p = Piece::Owned(BytesMut::from(&piece[..]));
            self.charge += p.charge();
            self.ready.push_back(p);
        }
    }

    /// Stores a piece past the readable prefix at `at` (nothing is stored there yet).
    fn store_pending(&mut self, at: u64, piece: Bytes, datagram_len: usize) {
        if !shareable(piece.len(), datagram_len)
            && let Some((&k, prev)) = self.pending.range_mut(..at).next_back()
            && k + prev.len() as u64 == at
            && let Some(grown) = prev.append(&piece)
        {
            self.charge += grown;
            return;
        }
        let p = if shareable(piece.len(), datagram_len) {
            Piece::Shared(piece)
        } else {
            Piece::Owned(BytesMut::from(&piece[..]))
        };
        self.charge += p.charge();
        self.pending.insert(at, p);
    }

    /// Moves stored pieces that now continue the readable prefix onto the queue.
    fn promote(&mut self) {
        while let Some(entry) = self.pending.first_entry() {
            if *entry.key() != self.ready_end {
                break;
            }
            let piece = entry.remove();
            self.ready_end += piece.len() as u64;
            self.ready.push_back(piece);
        }
    }

    /// Next in-order chunk of at most `max` bytes, if any.
    pub fn read(&mut self, max: usize) -> Option<Bytes> {
        let front = self.ready.front_mut()?;
        let out = if front.len() <= max {
            let piece = self.ready.pop_front().expect("front exists");
            self.charge -= piece.charge();
            if self.ready.is_empty() && self.ready.capacity() > READY_SLOTS_KEPT {
                self.ready.shrink_to(READY_SLOTS_KEPT);
            }
            piece.into_bytes()
        } else {
            let before = front.charge();
            let out = front.split_to(max);
            self.charge -= before - front.charge();
            out
        };
        self.read += out.len() as u64;
        self.buffered -= out.len();
        Some(out)
    }

    /// Bytes readable now, in order, without waiting for anything.
    pub fn readable(&self) -> u64 {
        self.ready_end - self.read
    }

    /// Offset the application has read up to.
    pub fn read_offset(&self) -> u64 {
        self.read
    }

    /// Highest offset received plus one.
    pub fn received_end(&self) -> u64 {
        self.max_end
    }

    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Memory held for what is stored: its bytes (whole allocations for copies) plus
    /// [`PIECE_OVERHEAD`] per piece.
    pub fn charge(&self) -> usize {
        self.charge
    }

    /// Discards everything stored (e.g. after STOP_SENDING or a reset) and skips to `offset`:
    /// data below it is no longer stored, and it counts as received.
    pub fn discard(&mut self, offset: u64) {
        self.ready = VecDeque::new();
        self.pending.clear();
        self.buffered = 0;
        self.charge = 0;
        self.read = self.read.max(offset).max(self.ready_end);
        self.ready_end = self.read;
        self.max_end = self.max_end.max(offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(a: &mut Assembler) -> Vec<u8> {
        let mut v = Vec::new();
        while let Some(b) = a.read(usize::MAX) {
            v.extend_from_slice(&b);
        }
        v
    }

    #[test]
    fn reorders_and_dedups() {
        let mut a = Assembler::new();
        assert_eq!(a.insert(5, Bytes::from_static(b"fghij"), 0), 5);
        assert_eq!(a.read(100), None);
        assert_eq!(a.insert(0, Bytes::from_static(b"abcdefg"), 0), 5);
        assert_eq!(a.buffered(), 10);
        assert_eq!(a.readable(), 10);
        assert_eq!(read_all(&mut a), b"abcdefghij");
        assert_eq!(a.insert(3, Bytes::from_static(b"defghijk"), 0), 1);
        assert_eq!(read_all(&mut a), b"k");
        assert_eq!(a.insert(0, Bytes::from_static(b"abc"), 0), 0);
    }

    #[test]
    fn partial_reads() {
        let mut a = Assembler::new();
        a.insert(0, Bytes::from_static(b"0123456789"), 0);
        assert_eq!(&a.read(3).unwrap()[..], b"012");
        assert_eq!(&a.read(3).unwrap()[..], b"345");
        assert_eq!(a.read_offset(), 6);
        assert_eq!(&a.read(100).unwrap()[..], b"6789");
        assert_eq!(a.buffered(), 0);
    }

    #[test]
    fn overlaps_store_each_byte_once() {
        use rand::{Rng, SeedableRng};
        let data: Vec<u8> = (0..4000).map(|i| (i * 13 % 251) as u8).collect();
        let data = Bytes::from(data);
        for seed in 0..50 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut a = Assembler::new();
            let mut seen = vec![false; data.len()];
            let mut out = Vec::new();
            for _ in 0..400 {
                let s = rng.random_range(0..data.len());
                let e = (s + rng.random_range(1..200)).min(data.len());
                let from = s.max(out.len()).min(e);
                let new = seen[from..e].iter().filter(|&&x| !x).count();
                assert_eq!(a.insert(s as u64, data.slice(s..e), 0), new);
                seen[s..e].iter_mut().for_each(|x| *x = true);
                assert_eq!(
                    a.received_end(),
                    (seen.iter().rposition(|&x| x).unwrap() + 1) as u64
                );
                let prefix = seen.iter().position(|&x| !x).unwrap_or(data.len());
                assert_eq!(a.readable(), (prefix - out.len()) as u64);
                let stored = seen[out.len()..].iter().filter(|&&x| x).count();
                assert_eq!(a.buffered(), stored);
                if rng.random_bool(0.2) {
                    while let Some(b) = a.read(rng.random_range(1..500)) {
                        out.extend_from_slice(&b);
                    }
                    assert_eq!(&out[..], &data[..out.len()]);
                }
            }
        }
    }

    #[test]
    fn discard_skips_and_counts_as_received() {
        let mut a = Assembler::new();
        a.insert(0, Bytes::from_static(b"abc"), 0);
        a.insert(10, Bytes::from_static(b"xyz"), 0);
        a.discard(20);
        assert_eq!(
            (
                a.buffered(),
                a.readable(),
                a.read_offset(),
                a.received_end()
            ),
            (0, 0, 20, 20)
        );
        assert_eq!(a.insert(15, Bytes::from_static(b"0123456789"), 0), 5);
        assert_eq!(&a.read(100).unwrap()[..], b"56789");
    }

    #[test]
    fn random_fragments_reassemble() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let data: Vec<u8> = (0..5000).map(|i| (i * 7 % 251) as u8).collect();
        let data = Bytes::from(data);
        let mut a = Assembler::new();
        let mut out = Vec::new();
        while out.len() < data.len() {
            let s = rng.random_range(0..data.len());
            let e = (s + rng.random_range(1..300)).min(data.len());
            a.insert(s as u64, data.slice(s..e), 0);
            assert!(a.buffered() <= data.len());
            if rng.random_bool(0.3) {
                out.extend_from_slice(&read_all(&mut a));
            }
            if out.len() < data.len() && rng.random_bool(0.05) {
                let s = out.len();
                a.insert(s as u64, data.slice(s..(s + 100).min(data.len())), 0);
            }
        }
        out.extend_from_slice(&read_all(&mut a));
        assert_eq!(&out[..], &data[..]);
    }

    #[test]
    fn large_dense_pieces_are_not_copied_small_ones_are_merged() {
        let mut a = Assembler::new();
        let big = Bytes::from(vec![7u8; 1200]);
        let ptr = big.as_ptr();
        a.insert(0, big, 1250);
        assert_eq!(a.charge(), 1200 + PIECE_OVERHEAD);
        assert_eq!(a.read(usize::MAX).unwrap().as_ptr(), ptr, "copied");
        assert_eq!(a.charge(), 0);
        // A large piece that fills little of its datagram is copied.
        let big = Bytes::from(vec![7u8; 600]);
        let ptr = big.as_ptr();
        a.insert(1200, big, 1500);
        assert_ne!(a.read(usize::MAX).unwrap().as_ptr(), ptr);
        // Small pieces in order, unread, share one growing copy.
        let mut off = 1800;
        for _ in 0..10_000 {
            a.insert(off, Bytes::from_static(b"x"), 1200);
            off += 1;
        }
        assert_eq!(a.buffered(), 10_000);
        assert!(a.charge() <= 2 * 10_000 + PIECE_OVERHEAD, "{}", a.charge());
        // Small pieces past a gap likewise.
        for i in 1..10_000 {
            a.insert(off + i, Bytes::from_static(b"y"), 1200);
        }
        assert!(
            a.charge() <= 4 * 20_000 + 2 * PIECE_OVERHEAD,
            "{}",
            a.charge()
        );
        // Each piece between gaps costs its overhead.
        let before = a.charge();
        let base = off + 20_000;
        for i in 0..1000 {
            a.insert(base + 2 * i, Bytes::from_static(b"z"), 1200);
        }
        assert!(a.charge() - before >= 1000 * PIECE_OVERHEAD);
        a.discard(base + 5000);
        assert_eq!(a.charge(), 0);
    }

    #[test]
    fn charge_follows_reads() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let data: Vec<u8> = (0..200_000).map(|i| (i * 31 % 251) as u8).collect();
        let data = Bytes::from(data);
        let mut a = Assembler::new();
        let mut out = Vec::new();
        while out.len() < data.len() {
            let s = rng.random_range(out.len()..data.len());
            let e = (s + rng.random_range(1..1500)).min(data.len());
            let dgram = if rng.random_bool(0.5) {
                e - s + 40
            } else {
                1452
            };
            a.insert(s as u64, data.slice(s..e), dgram);
            assert!(a.charge() >= a.buffered());
            if rng.random_bool(0.2) {
                while let Some(b) = a.read(rng.random_range(1..3000)) {
                    out.extend_from_slice(&b);
                }
            }
            if rng.random_bool(0.1) {
                let s = out.len();
                let e = (s + 1400).min(data.len());
                a.insert(s as u64, data.slice(s..e), 1452);
            }
        }
        out.extend_from_slice(&read_all(&mut a));
        assert_eq!(&out[..], &data[..]);
        assert_eq!(a.charge(), 0);
        assert_eq!(a.buffered(), 0);
    }
}
