//! Connection IDs (RFC 9000 §5.1) and the generator the endpoint draws them from.

use std::fmt;
use std::time::Duration;

use rand::RngCore;

/// The longest connection ID QUIC v1 and v2 allow.
pub const MAX_CID_SIZE: usize = 20;

/// A connection ID of 0 to 20 bytes, stored inline (no allocation).
#[derive(Clone, Copy, Eq)]
pub struct ConnectionId {
    len: u8,
    bytes: [u8; MAX_CID_SIZE],
}

impl ConnectionId {
    /// The zero-length connection ID.
    pub const EMPTY: Self = Self {
        len: 0,
        bytes: [0; MAX_CID_SIZE],
    };

    /// Builds a connection ID from `bytes`.
    ///
    /// # Panics
    /// If `bytes` is longer than [`MAX_CID_SIZE`]; use [`ConnectionId::try_from_slice`] for
    /// untrusted input.
    pub fn new(bytes: &[u8]) -> Self {
        Self::try_from_slice(bytes).expect("connection ID longer than 20 bytes")
    }

    /// The ID `bytes` spell; `None` past 20 bytes (RFC 9000 §17.2).
    pub fn try_from_slice(bytes: &[u8]) -> Option<Self> {
        if bytes.len() > MAX_CID_SIZE {
            return None;
        }
        let mut cid = Self {
            len: bytes.len() as u8,
            bytes: [0; MAX_CID_SIZE],
        };
        cid.bytes[..bytes.len()].copy_from_slice(bytes);
        Some(cid)
    }

    /// A random connection ID of `len` bytes.
    pub fn random<R: RngCore + ?Sized>(rng: &mut R, len: usize) -> Self {
        let len = len.min(MAX_CID_SIZE);
        let mut cid = Self {
            len: len as u8,
            bytes: [0; MAX_CID_SIZE],
        };
        rng.fill_bytes(&mut cid.bytes[..len]);
        cid
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether it is zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for ConnectionId {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl PartialEq for ConnectionId {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::hash::Hash for ConnectionId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (**self).hash(state)
    }
}

impl PartialOrd for ConnectionId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ConnectionId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (**self).cmp(&**other)
    }
}

impl fmt::Debug for ConnectionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.iter() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Makes the connection IDs an endpoint issues to its peers.
///
/// The endpoint routes incoming short-header packets by their destination CID, so every ID a
/// generator makes must have the same [`cid_len`](Self::cid_len). Implement this to encode
/// routing information in the ID, as QUIC-LB does, so that a load balancer or a multi-worker
/// host can find the connection from the ID alone.
pub trait ConnectionIdGenerator: Send + Sync {
    /// Makes a new connection ID. It must be unpredictable to anyone without the server's keys
    /// (RFC 9000 §5.1) and unique among the endpoint's live IDs.
    fn generate(&mut self) -> ConnectionId;

    /// The length of every ID this generator makes; 0 means the endpoint cannot route
    /// short-header packets by CID (only sensible for clients with one connection per socket).
    fn cid_len(&self) -> usize;

    /// How long an issued ID may stay in use before the connection should retire it; `None`
    /// means forever.
    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }

    /// Whether `cid` could have come from this generator; lets the endpoint drop junk cheaply.
    fn validate(&self, cid: &ConnectionId) -> bool {
        cid.len() == self.cid_len()
    }

    /// For an ID no connection here knows: `Some(false)` when it cannot be one this
    /// endpoint issued (a fleet's server ID names another server), so no stateless reset
    /// answers it: servers that share a reset key would otherwise reset each other's live
    /// connections for anyone who sends them such a packet (RFC 9000 §21.11). `None`: this
    /// generator cannot tell.
    fn issued_here(&self, _cid: &ConnectionId) -> Option<bool> {
        None
    }
}

/// The default generator: uniformly random IDs of a fixed length (8 bytes unless told).
#[derive(Debug, Clone)]
pub struct RandomCidGenerator {
    len: usize,
    lifetime: Option<Duration>,
}

impl RandomCidGenerator {
    /// Random IDs of `len` bytes.
    pub fn new(len: usize) -> Self {
        assert!(len <= MAX_CID_SIZE, "connection ID length above 20");
        Self {
            len,
            lifetime: None,
        }
    }

    /// IDs that are retired and replaced after `lifetime`.
    pub fn with_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = Some(lifetime);
        self
    }
}

impl Default for RandomCidGenerator {
    fn default() -> Self {
        Self::new(8)
    }
}

impl ConnectionIdGenerator for RandomCidGenerator {
    fn generate(&mut self) -> ConnectionId {
        ConnectionId::random(&mut rand::rng(), self.len)
    }

    fn cid_len(&self) -> usize {
        self.len
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        self.lifetime
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cid_basics() {
        let a = ConnectionId::new(&[1, 2, 3]);
        assert_eq!(a.len(), 3);
        assert_eq!(&*a, &[1, 2, 3]);
        assert_eq!(a.to_string(), "010203");
        assert!(ConnectionId::try_from_slice(&[0; 21]).is_none());
        let mut g = RandomCidGenerator::default();
        let x = g.generate();
        let y = g.generate();
        assert_eq!(x.len(), 8);
        assert_ne!(x, y);
    }
}
