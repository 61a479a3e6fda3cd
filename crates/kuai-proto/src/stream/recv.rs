//! Reassembly of out-of-order data (STREAM and CRYPTO frames) into an in-order byte stream.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::range_set::RangeSet;

/// Reassembles data arriving at arbitrary offsets. Each byte is stored at most once, so memory
/// is bounded by the span between the read offset and the highest offset accepted, which the
/// caller bounds with flow control.
#[derive(Debug, Default)]
pub struct Assembler {
    /// Stored chunks keyed by offset; they never overlap.
    chunks: BTreeMap<u64, Bytes>,
    /// Everything ever received (below `read` it may no longer be stored).
    received: RangeSet,
    /// Next offset the application reads.
    read: u64,
    /// Bytes currently stored.
    buffered: usize,
}

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `data` at `offset`; returns the number of new bytes stored.
    pub fn insert(&mut self, offset: u64, data: Bytes) -> usize {
        let end = offset + data.len() as u64;
        if end <= self.read || data.is_empty() {
            return 0;
        }
        let start = offset.max(self.read);
        if self.received.contains_range(start..end) {
            return 0;
        }
        // Store only the gaps not yet received.
        let mut added = 0;
        let mut cursor = start;
        let mut store = |chunks: &mut BTreeMap<u64, Bytes>, s: u64, e: u64| {
            let piece = data.slice((s - offset) as usize..(e - offset) as usize);
            added += piece.len();
            chunks.insert(s, piece);
        };
        for r in self.received.iter_within(start..end) {
            if r.start > cursor {
                store(&mut self.chunks, cursor, r.start);
            }
            cursor = r.end;
        }
        if cursor < end {
            store(&mut self.chunks, cursor, end);
        }
        self.received.insert(start..end);
        self.buffered += added;
        added
    }

    /// Next in-order chunk of at most `max` bytes, if any.
    pub fn read(&mut self, max: usize) -> Option<Bytes> {
        let mut entry = self.chunks.first_entry()?;
        if *entry.key() != self.read {
            return None;
        }
        let chunk = entry.get_mut();
        let out = if chunk.len() <= max {
            entry.remove()
        } else {
            let head = chunk.split_to(max);
            let rest = std::mem::take(chunk);
            entry.remove();
            self.chunks.insert(self.read + head.len() as u64, rest);
            head
        };
        self.read += out.len() as u64;
        self.buffered -= out.len();
        Some(out)
    }

    /// Bytes readable now, in order, without waiting for anything.
    pub fn readable(&self) -> u64 {
        match self.received.first() {
            Some(r) if r.start <= self.read => r.end.saturating_sub(self.read),
            _ => 0,
        }
    }

    /// Offset the application has read up to.
    pub fn read_offset(&self) -> u64 {
        self.read
    }

    /// Highest offset received plus one.
    pub fn received_end(&self) -> u64 {
        self.received.last().map_or(0, |r| r.end)
    }

    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Discards everything stored (e.g. after STOP_SENDING or a reset) and skips to `offset`.
    pub fn discard(&mut self, offset: u64) {
        self.chunks.clear();
        self.buffered = 0;
        self.read = self.read.max(offset);
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
