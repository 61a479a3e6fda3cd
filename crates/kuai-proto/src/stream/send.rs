//! The sending half of a stream (RFC 9000 §3.1): the application's bytes until the peer has
//! acknowledged them, what still has to go out, and what has to go out again.

use std::collections::VecDeque;
use std::ops::Range;

use bytes::Bytes;

use crate::range_set::RangeSet;

/// Buffered data of one stream's send side, addressed by stream offset.
#[derive(Debug, Default)]
pub struct SendBuffer {
    /// Unacknowledged chunks with their stream offsets; the first starts at `chunks_offset`.
    chunks: VecDeque<(u64, Bytes)>,
    chunks_offset: u64,
    /// End of the data the application wrote.
    end: u64,
    /// Next offset never sent before.
    unsent: u64,
    /// Ranges below `unsent` declared lost and not yet resent.
    retransmit: RangeSet,
    /// Ranges at or above `chunks_offset` acknowledged out of order.
    acked: RangeSet,
}

impl SendBuffer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends application data.
    pub fn write(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let start = self.end;
        self.end += data.len() as u64;
        self.chunks.push_back((start, data));
    }

    /// Total bytes the application wrote.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Next never-sent offset (the highest offset sent so far).
    pub fn unsent(&self) -> u64 {
        self.unsent
    }

    /// Bytes written but not yet acknowledged.
    pub fn buffered(&self) -> u64 {
        self.end - self.chunks_offset
    }

    /// Whether there is anything (new or lost data) to send.
    pub fn has_sendable(&self) -> bool {
        !self.retransmit.is_empty() || self.unsent < self.end
    }

    /// Offset of the range [`next_range`](Self::next_range) would return.
    pub fn next_offset(&self) -> u64 {
        self.retransmit.min().unwrap_or(self.unsent)
    }

    /// Bytes waiting to be sent: new data plus data to send again.
    pub fn sendable_len(&self) -> u64 {
        let lost: u64 = self.retransmit.iter().map(|r| r.end - r.start).sum();
        (self.end - self.unsent) + lost
    }

    pub fn has_retransmit(&self) -> bool {
        !self.retransmit.is_empty()
    }

    /// Whether every byte written has been acknowledged.
    pub fn is_fully_acked(&self) -> bool {
        self.chunks_offset == self.end
    }

    /// The next range to send: lost data first, then new data up to `max_new_end` (the
    /// flow-control limit), at most `max_len` bytes. Returns the range and whether it is a
    /// retransmission; marks it as sent.
    pub fn next_range(&mut self, max_len: usize, max_new_end: u64) -> Option<(Range<u64>, bool)> {
        if max_len == 0 {
            return None;
        }
        if let Some(r) = self.retransmit.first() {
            let end = r.end.min(r.start + max_len as u64);
            self.retransmit.remove(r.start..end);
            return Some((r.start..end, true));
        }
        let limit = self.end.min(max_new_end);
        if self.unsent >= limit {
            return None;
        }
        let start = self.unsent;
        let end = limit.min(start + max_len as u64);
        self.unsent = end;
        Some((start..end, false))
    }

    /// Gives back a range taken by [`next_range`](Self::next_range) that did not fit.
    pub fn unsend(&mut self, range: Range<u64>, retransmit: bool) {
        if retransmit || range.end != self.unsent {
            self.retransmit.insert(range);
        } else {
            self.unsent = range.start;
        }
    }

    /// The bytes of `range`, as slices of the written chunks (no copy). `range` must lie in
    /// unacknowledged data.
    pub fn slices(&self, range: Range<u64>) -> impl Iterator<Item = Bytes> + '_ {
        // Binary search for the first chunk that reaches into the range: packets are built
        // from the middle of large buffers, so a linear walk would cost O(chunks) each.
        let first = self
            .chunks
            .partition_point(|(start, b)| start + b.len() as u64 <= range.start);
        self.chunks
            .range(first..)
            .map_while(move |(chunk_start, chunk)| {
                let chunk_start = *chunk_start;
                let chunk_end = chunk_start + chunk.len() as u64;
                if chunk_start >= range.end {
                    return None;
                }
                let s = range.start.max(chunk_start);
                let e = range.end.min(chunk_end);
                Some(chunk.slice((s - chunk_start) as usize..(e - chunk_start) as usize))
            })
    }

    /// Copies `range` into `out`.
    pub fn copy_range(&self, range: Range<u64>, out: &mut Vec<u8>) {
        for s in self.slices(range) {
            out.extend_from_slice(&s);
        }
    }

    /// The peer acknowledged `range`; frees fully acknowledged chunks.
    pub fn ack(&mut self, range: Range<u64>) {
        if range.end <= self.chunks_offset {
            return;
        }
        let range = range.start.max(self.chunks_offset)..range.end;
        if !self.retransmit.is_empty() {
            self.retransmit.remove(range.clone());
        }
        if range.start == self.chunks_offset && self.acked.is_empty() {
            // In order, the usual case: the prefix goes without a trip through `acked`.
            self.free_prefix(range.end);
        } else {
            self.acked.insert(range);
        }
        // Drop the acknowledged prefix.
        while let Some(first) = self.acked.first() {
            if first.start != self.chunks_offset {
                break;
            }
            self.acked.pop_first();
            self.free_prefix(first.end);
        }
        if self.chunks.is_empty() && self.acked.is_empty() {
            // All acknowledged: let go of the buffers' memory (a long-lived stream such as a
            // control stream, or the CRYPTO stream after the tickets, then idles).
            self.chunks = VecDeque::new();
            self.acked.clear();
            if self.retransmit.is_empty() {
                self.retransmit.clear();
            }
        }
    }

    /// Frees the chunks' bytes below `end` (acknowledged, from `chunks_offset` on).
    fn free_prefix(&mut self, end: u64) {
        let mut to_free = end.saturating_sub(self.chunks_offset);
        while to_free > 0 {
            let Some((start, front)) = self.chunks.front_mut() else {
                break;
            };
            let len = front.len() as u64;
            if len <= to_free {
                self.chunks.pop_front();
                to_free -= len;
                self.chunks_offset += len;
            } else {
                let _ = front.split_to(to_free as usize);
                *start += to_free;
                self.chunks_offset += to_free;
                to_free = 0;
            }
        }
    }

    /// The packet carrying `range` was lost: queue whatever of it is still unacknowledged.
    pub fn lost(&mut self, range: Range<u64>) {
        let start = range.start.max(self.chunks_offset);
        let end = range.end.min(self.unsent);
        if start >= end {
            return;
        }
        // Only the parts not acknowledged meanwhile.
        let mut cursor = start;
        for a in self.acked.iter_within(start..end) {
            if a.start > cursor {
                self.retransmit.insert(cursor..a.start);
            }
            cursor = a.end;
        }
        if cursor < end {
            self.retransmit.insert(cursor..end);
        }
    }

    /// Drops all data (the stream was reset).
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.chunks_offset = self.end;
        self.unsent = self.end;
        self.retransmit.clear();
        self.acked.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(b: &SendBuffer, r: Range<u64>) -> Vec<u8> {
        let mut v = Vec::new();
        b.copy_range(r, &mut v);
        v
    }

    #[test]
    fn send_ack_retransmit() {
        let mut b = SendBuffer::new();
        b.write(Bytes::from_static(b"hello "));
        b.write(Bytes::from_static(b"world"));
        assert_eq!(b.end(), 11);
        let (r1, re) = b.next_range(4, u64::MAX).unwrap();
        assert_eq!((r1.clone(), re), (0..4, false));
        assert_eq!(collect(&b, r1.clone()), b"hell");
        let (r2, _) = b.next_range(100, 8).unwrap();
        assert_eq!(r2, 4..8);
        assert_eq!(collect(&b, r2.clone()), b"o wo");
        assert_eq!(b.next_range(100, 8), None);
        b.lost(r1.clone());
        assert_eq!(b.next_range(100, 8), Some((0..4, true)));
        b.ack(4..8);
        assert_eq!(b.buffered(), 11);
        b.ack(0..4);
        assert_eq!(b.buffered(), 3);
        assert_eq!(collect(&b, 8..11), b"rld");
        // Loss of already-acked data is ignored.
        b.lost(0..8);
        assert!(!b.has_retransmit());
        let (r3, _) = b.next_range(100, u64::MAX).unwrap();
        assert_eq!(r3, 8..11);
        b.ack(8..11);
        assert!(b.is_fully_acked());
    }

    /// Random chunks, acknowledged in random pieces, in order and out of it, some twice:
    /// what stays buffered is what a bitmap of acknowledged bytes says, and still reads back.
    #[test]
    fn acks_in_any_order_free_exactly_the_acknowledged_prefix() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut b = SendBuffer::new();
            let mut data = Vec::new();
            for _ in 0..1 + next(6) {
                let chunk: Vec<u8> = (0..1 + next(50)).map(|_| next(256) as u8).collect();
                data.extend_from_slice(&chunk);
                b.write(Bytes::from(chunk));
            }
            let end = data.len() as u64;
            while b.next_range(1 + next(40) as usize, u64::MAX).is_some() {}
            let mut acked = vec![false; data.len()];
            let mut cursor = 0;
            for _ in 0..40 {
                let (start, len) = if next(2) == 0 {
                    (cursor, 1 + next(30)) // in order
                } else {
                    (next(end), 1 + next(30))
                };
                let r = start..(start + len).min(end);
                if r.is_empty() {
                    continue;
                }
                cursor = r.end.min(end);
                b.ack(r.clone());
                for a in &mut acked[r.start as usize..r.end as usize] {
                    *a = true;
                }
                let prefix = acked.iter().take_while(|&&a| a).count() as u64;
                assert_eq!(b.buffered(), end - prefix);
                assert_eq!(collect(&b, prefix..end), &data[prefix as usize..]);
            }
        }
    }

    #[test]
    fn lost_skips_acked_holes() {
        let mut b = SendBuffer::new();
        b.write(Bytes::from(vec![0u8; 100]));
        b.next_range(100, u64::MAX).unwrap();
        b.ack(20..30);
        b.ack(50..60);
        b.lost(0..100);
        let mut got = Vec::new();
        while let Some((r, true)) = b.next_range(1000, u64::MAX) {
            got.push(r);
        }
        assert_eq!(got, vec![0..20, 30..50, 60..100]);
    }
}
