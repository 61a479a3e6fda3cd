//! A set of non-overlapping half-open `u64` ranges, used for received packet numbers (ACK
//! generation), received stream offsets (reassembly) and acknowledged stream data.

use std::collections::BTreeMap;
use std::ops::Range;

/// Ordered, coalesced set of `start..end` ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start -> end (exclusive); ranges never touch or overlap.
    map: BTreeMap<u64, u64>,
}

impl RangeSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Number of disjoint ranges.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn contains(&self, x: u64) -> bool {
        self.map
            .range(..=x)
            .next_back()
            .is_some_and(|(_, &end)| x < end)
    }

    /// Whether all of `r` is in the set.
    pub fn contains_range(&self, r: Range<u64>) -> bool {
        if r.is_empty() {
            return true;
        }
        self.map
            .range(..=r.start)
            .next_back()
            .is_some_and(|(_, &end)| r.end <= end)
    }

    /// Adds `r`; returns whether any value in it was new.
    pub fn insert(&mut self, r: Range<u64>) -> bool {
        if r.is_empty() {
            return false;
        }
        let (mut start, mut end) = (r.start, r.end);
        // Merge with a range that starts at or before `start` and reaches it.
        if let Some((&s, &e)) = self.map.range(..=start).next_back()
            && e >= start
        {
            if e >= end {
                return false;
            }
            start = s;
            end = end.max(e);
            self.map.remove(&s);
        }
        // Merge with every range that starts within [start, end].
        while let Some((&s, &e)) = self.map.range(start..=end).next() {
            end = end.max(e);
            self.map.remove(&s);
        }
        self.map.insert(start, end);
        true
    }

    pub fn insert_one(&mut self, x: u64) -> bool {
        self.insert(x..x + 1)
    }

    /// Removes `r` from the set.
    pub fn remove(&mut self, r: Range<u64>) {
        if r.is_empty() {
            return;
        }
        // A range that starts before r.start and overlaps it is cut in two.
        if let Some((&s, &e)) = self.map.range(..r.start).next_back()
            && e > r.start
        {
            self.map.insert(s, r.start);
            if e > r.end {
                self.map.insert(r.end, e);
                return;
            }
        }
        while let Some((&s, &e)) = self.map.range(r.start..r.end).next() {
            self.map.remove(&s);
            if e > r.end {
                self.map.insert(r.end, e);
                break;
            }
        }
    }

    pub fn min(&self) -> Option<u64> {
        self.map.first_key_value().map(|(&s, _)| s)
    }

    /// The largest value in the set.
    pub fn max(&self) -> Option<u64> {
        self.map.last_key_value().map(|(_, &e)| e - 1)
    }

    pub fn first(&self) -> Option<Range<u64>> {
        self.map.first_key_value().map(|(&s, &e)| s..e)
    }

    pub fn last(&self) -> Option<Range<u64>> {
        self.map.last_key_value().map(|(&s, &e)| s..e)
    }

    pub fn pop_first(&mut self) -> Option<Range<u64>> {
        self.map.pop_first().map(|(s, e)| s..e)
    }

    /// Drops the lowest ranges until at most `n` remain.
    pub fn truncate_low(&mut self, n: usize) {
        while self.map.len() > n {
            self.map.pop_first();
        }
    }

    /// Ranges in ascending order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Range<u64>> + '_ {
        self.map.iter().map(|(&s, &e)| s..e)
    }

    /// Ranges that intersect `r`, clipped to it, in ascending order.
    pub fn iter_within(&self, r: Range<u64>) -> impl Iterator<Item = Range<u64>> + '_ {
        let before = self
            .map
            .range(..r.start)
            .next_back()
            .filter(|&(_, &e)| e > r.start)
            .map(|(&s, &e)| s..e);
        let end = r.end;
        let start = r.start;
        before
            .into_iter()
            .chain(self.map.range(r.start..r.end).map(|(&s, &e)| s..e))
            .map(move |x| x.start.max(start)..x.end.min(end))
            .filter(|x| !x.is_empty())
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(s: &RangeSet) -> Vec<Range<u64>> {
        s.iter().collect()
    }

    #[test]
    fn insert_merges() {
        let mut s = RangeSet::new();
        assert!(s.insert(5..10));
        assert!(s.insert(20..30));
        assert!(!s.insert(6..8));
        assert!(s.insert(10..12));
        assert_eq!(ranges(&s), vec![5..12, 20..30]);
        assert!(s.insert(0..40));
        assert_eq!(ranges(&s), vec![0..40]);
        assert!(s.contains(39));
        assert!(!s.contains(40));
        assert_eq!(s.max(), Some(39));
    }

    #[test]
    fn remove_splits() {
        let mut s = RangeSet::new();
        s.insert(0..100);
        s.remove(10..20);
        assert_eq!(ranges(&s), vec![0..10, 20..100]);
        s.remove(5..50);
        assert_eq!(ranges(&s), vec![0..5, 50..100]);
        s.remove(0..200);
        assert!(s.is_empty());
    }

    #[test]
    fn within() {
        let mut s = RangeSet::new();
        s.insert(0..10);
        s.insert(20..30);
        let v: Vec<_> = s.iter_within(5..25).collect();
        assert_eq!(v, vec![5..10, 20..25]);
        assert!(s.contains_range(2..8));
        assert!(!s.contains_range(8..21));
    }

    #[test]
    fn random_against_model() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut s = RangeSet::new();
        let mut model = [false; 200];
        for _ in 0..2000 {
            let a = rng.random_range(0..200u64);
            let b = rng.random_range(a..=200u64.min(a + 30));
            if rng.random_bool(0.6) {
                s.insert(a..b);
                model[a as usize..b as usize].fill(true);
            } else {
                s.remove(a..b);
                model[a as usize..b as usize].fill(false);
            }
            for (i, &m) in model.iter().enumerate() {
                assert_eq!(s.contains(i as u64), m);
            }
            // Coalesced: no two ranges touch.
            let v = ranges(&s);
            for w in v.windows(2) {
                assert!(w[0].end < w[1].start);
            }
        }
    }
}
