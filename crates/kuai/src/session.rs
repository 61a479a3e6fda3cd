//! [`SessionCache`]: the server's store of TLS sessions for resumption and 0-RTT.
//!
//! rustls issues TLS 1.3 tickets in one of two ways: stateless (the session encrypted into
//! the ticket by a `ProducesTickets`) or stateful (a random ID, the session kept in a
//! `StoresServerSessions`). rustls 0.23 allows 0-RTT only with stateful tickets, each used
//! once (`take`), which is also the replay defence of RFC 8446 §8.1 for one server. Its
//! default store keeps 256 sessions: past 256 recent clients a server forgets sessions and
//! clients lose resumption and 0-RTT. This one keeps many more, for as long as a ticket says
//! it lives, in shards so that handshakes on several workers do not queue on one lock.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Shards (the first byte of a ticket ID picks one: IDs are random).
const SHARDS: usize = 16;

/// Sessions kept by default: about 20 MiB at most (a session is a few hundred bytes).
pub const DEFAULT_CAPACITY: usize = 64 * 1024;

/// How long a session is kept by default: rustls tells clients that a stateful ticket lives
/// a day.
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(24 * 60 * 60);

/// Sessions by ticket ID, the oldest dropped first past the capacity, none kept past the
/// lifetime; see the [module](self) docs.
pub struct SessionCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    lifetime: Duration,
}

/// The longest ticket ID kept: rustls's stateful tickets carry 32 random bytes.
const MAX_KEY: usize = 32;

/// A ticket ID, held inline: with the eviction order keeping a copy, two heap blocks per
/// session fewer (this store holds every client's sessions, two per handshake).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    len: u8,
    bytes: [u8; MAX_KEY],
}

impl Key {
    /// `None` for an ID longer than [`MAX_KEY`] (not one rustls makes).
    fn new(id: &[u8]) -> Option<Self> {
        let mut bytes = [0; MAX_KEY];
        bytes.get_mut(..id.len())?.copy_from_slice(id);
        Some(Self {
            len: id.len() as u8,
            bytes,
        })
    }
}

/// A session, when it came, and whether this server issued it (else a fleet's replica).
struct Entry {
    value: Box<[u8]>,
    at: Instant,
    local: bool,
}

#[derive(Default)]
struct Shard {
    map: HashMap<Key, Entry>,
    /// Insertion order, for eviction; may name sessions already taken (skipped).
    order: VecDeque<(Key, Instant)>,
}

impl std::fmt::Debug for SessionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionCache")
            .field("len", &self.len())
            .field("capacity", &(self.per_shard * SHARDS))
            .finish()
    }
}

impl SessionCache {
    /// A cache of about `capacity` sessions, each kept at most `lifetime`.
    pub fn new(capacity: usize, lifetime: Duration) -> Arc<Self> {
        Arc::new(Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            lifetime,
        })
    }

    /// [`DEFAULT_CAPACITY`] sessions for [`DEFAULT_LIFETIME`].
    pub fn with_defaults() -> Arc<Self> {
        Self::new(DEFAULT_CAPACITY, DEFAULT_LIFETIME)
    }

    /// Sessions held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &[u8]) -> &Mutex<Shard> {
        &self.shards[usize::from(key.first().copied().unwrap_or(0)) % SHARDS]
    }

    fn fresh(&self, at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(at) < self.lifetime
    }

    /// Whether it was kept (not with an ID longer than [`MAX_KEY`], nor issued `age` ago
    /// past its lifetime).
    fn insert(&self, id: &[u8], value: Vec<u8>, local: bool, age: Duration) -> bool {
        let Some(key) = Key::new(id) else {
            return false;
        };
        // Its lifetime counts from when it was issued, not from when a replica arrived.
        let Some(now) = Instant::now().checked_sub(age) else {
            return false;
        };
        if age >= self.lifetime {
            return false;
        }
        let mut s = lock(self.shard(id));
        while s.map.len() >= self.per_shard {
            let Some((old, at)) = s.order.pop_front() else {
                break;
            };
            // Only the entry that order slot was for (not a newer one under that key).
            if s.map.get(&old).is_some_and(|e| e.at == at) {
                s.map.remove(&old);
            }
        }
        s.order.push_back((key, now));
        s.map.insert(
            key,
            Entry {
                value: value.into_boxed_slice(),
                at: now,
                local,
            },
        );
        // Taken sessions leave their order slots behind: drop them now and then.
        if s.order.len() > 2 * self.per_shard {
            let Shard { map, order } = &mut *s;
            order.retain(|(k, t)| map.get(k).is_some_and(|e| e.at == *t));
        }
        true
    }

    /// Keeps a session another server of a fleet issued `age` ago (a replica: see
    /// [`take_session`](Self::take_session)); it lasts what is left of its lifetime.
    pub fn insert_replica(&self, key: Vec<u8>, value: Vec<u8>, age: Duration) {
        self.insert(&key, value, false, age);
    }

    /// Forgets a session (another server of the fleet used it); whether it was held.
    pub fn remove(&self, key: &[u8]) -> bool {
        Key::new(key).is_some_and(|k| lock(self.shard(key)).map.remove(&k).is_some())
    }

    /// Takes a session out for a resumption, with whether this server issued it; a replica
    /// only if `replicas`, else it stays.
    pub fn take_session(&self, key: &[u8], replicas: bool) -> Option<(Vec<u8>, bool)> {
        let k = Key::new(key)?;
        let now = Instant::now();
        let mut s = lock(self.shard(key));
        if !replicas && s.map.get(&k).is_some_and(|e| !e.local) {
            return None;
        }
        s.map
            .remove(&k)
            .filter(|e| self.fresh(e.at, now))
            .map(|e| (e.value.into_vec(), e.local))
    }
}

fn lock(m: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl rustls::server::StoresServerSessions for SessionCache {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.insert(&key, value, true, Duration::ZERO)
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let k = Key::new(key)?;
        let now = Instant::now();
        let s = lock(self.shard(key));
        s.map
            .get(&k)
            .filter(|e| self.fresh(e.at, now))
            .map(|e| e.value.to_vec())
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.take_session(key, true).map(|(v, _)| v)
    }

    fn can_cache(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::server::StoresServerSessions;

    #[test]
    fn sessions_are_taken_once_evicted_oldest_first_and_expire() {
        let c = SessionCache::new(SHARDS * 2, Duration::from_secs(3600));
        // Keys in one shard (first byte 0): the third evicts the first.
        for i in 1..=3u8 {
            assert!(c.put(vec![0, i], vec![i]));
        }
        assert_eq!(c.get(&[0, 1]), None);
        assert_eq!(c.get(&[0, 2]), Some(vec![2]));
        assert_eq!(c.take(&[0, 2]), Some(vec![2]));
        assert_eq!(c.take(&[0, 2]), None, "used once");
        // Many puts and takes leave no growing order list behind.
        for i in 0..10_000u32 {
            let k = [1, (i >> 8) as u8, i as u8];
            c.put(k.to_vec(), vec![1]);
            c.take(&k);
        }
        assert!(lock(c.shard(&[1])).order.len() <= 4 + 1);
        // Replicas: taken only when asked for, forgotten on notice.
        c.insert_replica(vec![2, 1], vec![7], Duration::ZERO);
        c.insert_replica(vec![2, 2], vec![8], Duration::ZERO);
        assert_eq!(c.take_session(&[2, 1], false), None, "a replica stays");
        assert_eq!(c.take_session(&[2, 1], true), Some((vec![7], false)));
        assert!(c.remove(&[2, 2]) && !c.remove(&[2, 2]));
        c.put(vec![2, 3], vec![9]);
        assert_eq!(c.take_session(&[2, 3], false), Some((vec![9], true)));
        // A replica lasts what is left of the lifetime from when it was issued.
        c.insert_replica(vec![2, 4], vec![1], Duration::from_secs(3000));
        let at = lock(c.shard(&[2])).map[&Key::new(&[2, 4]).unwrap()].at;
        let age = Instant::now() - at;
        assert!(age >= Duration::from_secs(3000) && age < Duration::from_secs(3010));
        c.insert_replica(vec![2, 5], vec![1], Duration::from_secs(3600));
        assert_eq!(c.get(&[2, 5]), None, "issued a lifetime ago");
        let short = SessionCache::new(16, Duration::ZERO);
        short.put(vec![5], vec![5]);
        assert_eq!(short.take(&[5]), None, "expired");
        // IDs are compared whole: one that is a prefix of another, or longer than kept, is
        // not the other.
        c.put(vec![3, 1, 0], vec![1]);
        assert_eq!(c.get(&[3, 1]), None);
        assert_eq!(c.get(&[3, 1, 0, 0]), None);
        assert!(c.put(vec![3; MAX_KEY], vec![2]));
        assert_eq!(c.take(&[3; MAX_KEY]), Some(vec![2]));
        assert!(!c.put(vec![3; MAX_KEY + 1], vec![3]), "not kept");
        assert_eq!(c.get(&[3; MAX_KEY + 1]), None);
    }
}
