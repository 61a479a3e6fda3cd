//! Reassembly of out-of-order data (STREAM and CRYPTO frames) into an in-order byte stream.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

/// Reassembles data arriving at arbitrary offsets. Each byte is stored at most once, so memory
/// is bounded by the span between the read offset and the highest offset accepted, which the
/// caller bounds with flow control.
///
/// Data that continues the readable prefix, the common case, goes to a queue without touching
/// the ordered map; only data past a gap is kept by offset until the gap fills.
#[derive(Debug, Default)]
pub struct Assembler {
    /// Contiguous chunks from `read` to `ready_end`, in order.
    ready: VecDeque<Bytes>,
    /// Chunks past a gap, keyed by offset: they never overlap, and all start after
    /// `ready_end`. Together with the readable prefix they are exactly what was received.
    pending: BTreeMap<u64, Bytes>,
    /// Next offset the application reads.
    read: u64,
    /// End of the readable prefix: everything below it was received.
    ready_end: u64,
    /// Highest offset received (or skipped by `discard`) plus one.
    max_end: u64,
    /// Bytes currently stored.
    buffered: usize,
}

/// A drained queue keeps at most this many slots: a stream that once had a long backlog does
/// not hold its slots for life, and a busy one does not give them back on every read.
const READY_SLOTS_KEPT: usize = 1024;

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `data` at `offset`; returns the number of new bytes stored.
    pub fn insert(&mut self, offset: u64, data: Bytes) -> usize {
        let end = offset + data.len() as u64;
        if end <= self.ready_end || data.is_empty() {
            return 0;
        }
        self.max_end = self.max_end.max(end);
        if offset <= self.ready_end {
            let next_stored = self.pending.first_key_value().map_or(u64::MAX, |(&k, _)| k);
            if end <= next_stored {
                let piece = data.slice((self.ready_end - offset) as usize..);
                let added = piece.len();
                self.push_ready(piece);
                if end == next_stored {
                    self.promote();
                }
                return added;
            }
        }
        // Past a gap, or overlapping stored chunks: store only what is not stored yet.
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
                self.pending.insert(cursor, piece);
            }
            cursor = resume;
        }
        self.buffered += added;
        self.promote();
        added
    }

    fn push_ready(&mut self, piece: Bytes) {
        self.ready_end += piece.len() as u64;
        self.buffered += piece.len();
        self.ready.push_back(piece);
    }

    /// Moves stored chunks that now continue the readable prefix onto the queue.
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
            let out = self.ready.pop_front().expect("front exists");
            if self.ready.is_empty() && self.ready.capacity() > READY_SLOTS_KEPT {
                self.ready.shrink_to(READY_SLOTS_KEPT);
            }
            out
        } else {
            front.split_to(max)
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

    /// Discards everything stored (e.g. after STOP_SENDING or a reset) and skips to `offset`:
    /// data below it is no longer stored, and it counts as received.
    pub fn discard(&mut self, offset: u64) {
        self.ready = VecDeque::new();
        self.pending.clear();
        self.buffered = 0;
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
        assert_eq!(a.insert(5, Bytes::from_static(b"fghij")), 5);
        assert_eq!(a.read(100), None);
        assert_eq!(a.insert(0, Bytes::from_static(b"abcdefg")), 5);
        assert_eq!(a.buffered(), 10);
        assert_eq!(a.readable(), 10);
        assert_eq!(read_all(&mut a), b"abcdefghij");
        assert_eq!(a.insert(3, Bytes::from_static(b"defghijk")), 1);
        assert_eq!(read_all(&mut a), b"k");
        assert_eq!(a.insert(0, Bytes::from_static(b"abc")), 0);
    }

    #[test]
    fn partial_reads() {
        let mut a = Assembler::new();
        a.insert(0, Bytes::from_static(b"0123456789"));
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
                assert_eq!(a.insert(s as u64, data.slice(s..e)), new);
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
        a.insert(0, Bytes::from_static(b"abc"));
        a.insert(10, Bytes::from_static(b"xyz"));
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
        assert_eq!(a.insert(15, Bytes::from_static(b"0123456789")), 5);
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
            a.insert(s as u64, data.slice(s..e));
            assert!(a.buffered() <= data.len());
            if rng.random_bool(0.3) {
                out.extend_from_slice(&read_all(&mut a));
            }
            if out.len() < data.len() && rng.random_bool(0.05) {
                let s = out.len();
                a.insert(s as u64, data.slice(s..(s + 100).min(data.len())));
            }
        }
        out.extend_from_slice(&read_all(&mut a));
        assert_eq!(&out[..], &data[..]);
    }
}
