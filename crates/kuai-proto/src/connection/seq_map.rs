//! A map from sequence numbers to values in a sorted vector: connection IDs come a few at a
//! time (the active_connection_id_limit, 2 to 8), where a `BTreeMap`'s first node alone costs
//! over 500 bytes per connection.

/// Sorted by key; keys are unique.
#[derive(Debug, Clone)]
pub struct SeqMap<V> {
    entries: Vec<(u64, V)>,
}

impl<V> Default for SeqMap<V> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

impl<V> SeqMap<V> {
    pub fn new() -> Self {
        Self::default()
    }

    fn find(&self, k: u64) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&k, |(s, _)| *s)
    }

    /// Inserts or replaces; returns the old value.
    pub fn insert(&mut self, k: u64, v: V) -> Option<V> {
        match self.find(k) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, v)),
            Err(i) => {
                self.entries.insert(i, (k, v));
                None
            }
        }
    }

    pub fn get(&self, k: &u64) -> Option<&V> {
        self.find(*k).ok().map(|i| &self.entries[i].1)
    }

    pub fn get_mut(&mut self, k: &u64) -> Option<&mut V> {
        self.find(*k).ok().map(|i| &mut self.entries[i].1)
    }

    pub fn remove(&mut self, k: &u64) -> Option<V> {
        self.find(*k).ok().map(|i| self.entries.remove(i).1)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Keys in ascending order.
    pub fn keys(&self) -> impl Iterator<Item = &u64> + '_ {
        self.entries.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.entries.iter().map(|(_, v)| v)
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&u64, &mut V)> + '_ {
        self.entries.iter_mut().map(|(k, v)| (&*k, v))
    }

    /// Keys below `end`, ascending.
    pub fn keys_below(&self, end: u64) -> impl Iterator<Item = u64> + '_ {
        self.entries
            .iter()
            .map(|(k, _)| *k)
            .take_while(move |&k| k < end)
    }
}

impl<V> std::ops::Index<&u64> for SeqMap<V> {
    type Output = V;

    fn index(&self, k: &u64) -> &V {
        self.get(k).expect("key present")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_an_ordered_map() {
        let mut m = SeqMap::new();
        assert_eq!(m.insert(5, "e"), None);
        assert_eq!(m.insert(1, "a"), None);
        assert_eq!(m.insert(3, "c"), None);
        assert_eq!(m.insert(3, "C"), Some("c"));
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), [1, 3, 5]);
        assert_eq!(m[&3], "C");
        assert_eq!(m.keys_below(4).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(m.remove(&1), Some("a"));
        assert_eq!(m.remove(&1), None);
        assert_eq!(m.get(&5), Some(&"e"));
        *m.get_mut(&5).unwrap() = "E";
        assert_eq!(m.values().copied().collect::<Vec<_>>(), ["C", "E"]);
        assert_eq!(m.len(), 2);
    }
}
