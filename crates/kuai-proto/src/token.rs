//! Address-validation tokens (RFC 9000 §8.1.3–8.1.4) and stateless reset tokens (§10.3.2).
//!
//! Tokens are sealed with AES-256-GCM under a server key, so only servers holding the key can
//! read or forge them; a fleet shares the key to accept each other's tokens. A token carries
//! its kind, its issue time and the client address it was issued to.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::BufMut;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hmac;

use crate::cid::ConnectionId;
use crate::coding::BufExt;

/// The keys tokens are sealed with: one seals, a few more (earlier and next generations)
/// open, so that keys can rotate without refusing the tokens sealed just before (see
/// [`install`](Self::install)). Each token starts with the one-byte ID of its key.
///
/// A token is sealed with AES-256-GCM under the key, so only servers holding it can read or
/// forge tokens; a fleet shares its keys to accept each other's tokens.
pub struct TokenKey {
    keys: std::sync::RwLock<Keys>,
}

struct Keys {
    /// The ID of the key that seals.
    current: u8,
    /// Keys that open, by ID (at most [`MAX_KEYS`]).
    all: Vec<(u8, LessSafeKey)>,
}

/// Keys kept at once: the previous, current and next generations, and one spare.
const MAX_KEYS: usize = 4;

impl TokenKey {
    /// One key (ID 0), sealing and opening.
    pub fn new(secret: &[u8; 32]) -> Self {
        Self {
            keys: std::sync::RwLock::new(Keys {
                current: 0,
                all: vec![(0, aead_key(secret))],
            }),
        }
    }

    /// One random key (ID 0).
    pub fn random() -> Self {
        let mut k = [0; 32];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut k);
        Self::new(&k)
    }

    /// Adds (or replaces) key `id`; with `seal`, new tokens are sealed with it. Past
    /// four keys (`MAX_KEYS`) the keys that are neither sealing nor just added go, those of IDs
    /// furthest from the sealing one first, before or after it (IDs are generation numbers
    /// mod 256).
    pub fn install(&self, id: u8, secret: &[u8; 32], seal: bool) {
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        k.all.retain(|(i, _)| *i != id);
        k.all.push((id, aead_key(secret)));
        if seal {
            k.current = id;
        }
        while k.all.len() > MAX_KEYS {
            let cur = k.current;
            let (pos, _) = k
                .all
                .iter()
                .enumerate()
                .filter(|(_, (i, _))| *i != cur && *i != id)
                .max_by_key(|(_, (i, _))| (cur.wrapping_sub(*i) as i8).unsigned_abs())
                .expect("more than two keys");
            k.all.remove(pos);
        }
    }

    /// Seals with key `id` from now on; whether it is held.
    pub fn seal_with(&self, id: u8) -> bool {
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        let held = k.all.iter().any(|(i, _)| *i == id);
        if held {
            k.current = id;
        }
        held
    }

    /// Forgets key `id` (unless it seals); whether it was held.
    pub fn remove(&self, id: u8) -> bool {
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        let before = k.all.len();
        let cur = k.current;
        k.all.retain(|(i, _)| *i != id || *i == cur);
        k.all.len() != before
    }

    /// The IDs held, the sealing one first.
    pub fn ids(&self) -> Vec<u8> {
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<u8> = k.all.iter().map(|(i, _)| *i).collect();
        ids.sort_by_key(|i| *i != k.current);
        ids
    }

    /// Seals `plain` under the sealing key: its ID, a random nonce, the ciphertext and tag.
    /// (Tokens are made by `retry_token` and `new_token`; this is for other sealed
    /// values a server hands out, such as session tickets.)
    pub fn seal(&self, mut plain: Vec<u8>) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut nonce);
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let id = k.current;
        let key = &k.all.iter().find(|(i, _)| *i == id).expect("sealing key held").1;
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from([id]),
            &mut plain,
        )
        .expect("token fits AES-GCM limits");
        let mut out = Vec::with_capacity(1 + NONCE_LEN + plain.len());
        out.push(id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&plain);
        out
    }

    /// Opens what [`seal`](Self::seal) made under a key still held (at most 4 KiB).
    pub fn open(&self, token: &[u8]) -> Option<Vec<u8>> {
        if token.len() < 1 + NONCE_LEN + AES_256_GCM.tag_len() || token.len() > 4096 {
            return None;
        }
        let id = token[0];
        let nonce = Nonce::try_assume_unique_for_key(&token[1..1 + NONCE_LEN]).ok()?;
        let mut buf = token[1 + NONCE_LEN..].to_vec();
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let key = &k.all.iter().find(|(i, _)| *i == id)?.1;
        let plain = key.open_in_place(nonce, Aad::from([id]), &mut buf).ok()?;
        let n = plain.len();
        buf.truncate(n);
        Some(buf)
    }
}

fn aead_key(secret: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, secret).expect("32-byte key"))
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

const KIND_RETRY: u8 = 0;
const KIND_NEW_TOKEN: u8 = 1;

/// What a valid token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValidToken {
    /// From a Retry: the original destination CID of the client's first Initial, and the
    /// source CID of the Retry, which the client's next Initial must be sent to.
    Retry {
        odcid: ConnectionId,
        retry_scid: ConnectionId,
    },
    /// From NEW_TOKEN: when it was issued (unix ms) and its nonce, which tells it from
    /// every other token (see [`TokenLog`]).
    NewToken { issued_ms: u64, id: [u8; NONCE_LEN] },
}

/// Seals a Retry token for `client` (address and port must match on return), sent in a
/// Retry whose source CID is `retry_scid`: the token validates only the Initial sent to
/// that ID, so one Retry validates one connection, not as many as the client opens with the
/// token within its lifetime.
pub fn retry_token(
    key: &TokenKey,
    client: SocketAddr,
    odcid: &ConnectionId,
    retry_scid: &ConnectionId,
    unix_ms: u64,
) -> Vec<u8> {
    let mut p = Vec::with_capacity(80);
    p.put_u8(KIND_RETRY);
    p.put_u64(unix_ms);
    put_addr(&mut p, client.ip());
    p.put_u16(client.port());
    p.put_u8(odcid.len() as u8);
    p.put_slice(odcid);
    p.put_u8(retry_scid.len() as u8);
    p.put_slice(retry_scid);
    key.seal(p)
}

/// Seals a NEW_TOKEN token for `client` (only the IP must match later: ports change with NAT).
pub fn new_token(key: &TokenKey, client: IpAddr, unix_ms: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.put_u8(KIND_NEW_TOKEN);
    p.put_u64(unix_ms);
    put_addr(&mut p, client);
    key.seal(p)
}

/// NEW_TOKEN tokens already used, so each is accepted once (RFC 9000 §8.1.4: an attacker
/// who copies a token off the wire must not validate its address with it, and a token
/// SHOULD be usable once). Share one between servers that share a token key (the workers
/// of one port do).
///
/// Memory is fixed whatever the number of tokens: a Bloom filter (2^20 bits, 4 hashes)
/// per half token lifetime of issue time, three of them, so every token still within its
/// lifetime falls in one kept filter. A false positive only makes a client's token count as
/// used: its handshake goes on as an unvalidated one (within the 3x limit, or after a
/// Retry under load), never fails. About 1 % of tokens at 100,000 used per half lifetime.
#[derive(Default)]
pub struct TokenLog {
    state: std::sync::Mutex<TokenLogState>,
    /// Told of each first use here (see [`TokenLog::on_first_use`]).
    listener: std::sync::OnceLock<TokenListener>,
}

/// What [`TokenLog::on_first_use`] calls: a token's ID and issue time (unix ms).
type TokenListener = Box<dyn Fn(&[u8; NONCE_LEN], u64) + Send + Sync>;

struct TokenLogState {
    hasher: std::hash::RandomState,
    /// Filters by issue-time slot (issue time in half lifetimes), at `slot % 3`.
    slots: [(u64, Vec<u64>); 3],
}

impl Default for TokenLogState {
    fn default() -> Self {
        Self {
            hasher: std::hash::RandomState::new(),
            slots: std::array::from_fn(|_| (u64::MAX, Vec::new())),
        }
    }
}

const TOKEN_LOG_BITS: usize = 1 << 20;
const TOKEN_LOG_HASHES: u64 = 4;

impl TokenLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the token `id` issued at `issued_ms` with this lifetime; false if it was
    /// (probably) used before. A first use is told to the listener, if one is set.
    pub fn first_use(
        &self,
        id: &[u8; NONCE_LEN],
        issued_ms: u64,
        now_ms: u64,
        lifetime: Duration,
    ) -> bool {
        let first = self.record(id, issued_ms, now_ms, lifetime);
        if first && let Some(tell) = self.listener.get() {
            tell(id, issued_ms);
        }
        first
    }

    /// Records a use of `id` made elsewhere (another server of a fleet that shares the
    /// token key), so that the token validates no address here either.
    pub fn mark_used(&self, id: &[u8; NONCE_LEN], issued_ms: u64, now_ms: u64, lifetime: Duration) {
        self.record(id, issued_ms, now_ms, lifetime);
    }

    /// Calls `tell` with each token's ID and issue time (unix ms) at its first use here
    /// (from the packet path: it must not block), for a fleet to pass on; one listener at
    /// most (false when one was set already).
    pub fn on_first_use(&self, tell: impl Fn(&[u8; NONCE_LEN], u64) + Send + Sync + 'static) -> bool {
        self.listener.set(Box::new(tell)).is_ok()
    }

    fn record(&self, id: &[u8; NONCE_LEN], issued_ms: u64, now_ms: u64, lifetime: Duration) -> bool {
        use std::hash::BuildHasher;
        let slot_ms = (lifetime.as_millis() as u64 / 2).max(1);
        // A token from the future (another server's clock ahead of ours) is logged as issued
        // now: its own slot would take the place of one whose tokens are still valid.
        let slot = issued_ms.min(now_ms) / slot_ms;
        // Tokens issued three slots or more ago are past their lifetime: their filters go.
        if slot + 2 < now_ms / slot_ms {
            return false;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let h = st.hasher.hash_one(id);
        let (owner, bits) = &mut st.slots[(slot % 3) as usize];
        if *owner != slot {
            *owner = slot;
            bits.clear();
            bits.resize(TOKEN_LOG_BITS / 64, 0);
        }
        // Double hashing: bit i is h1 + i * h2 (Kirsch and Mitzenmacher).
        let (h1, h2) = (h & 0xffff_ffff, (h >> 32) | 1);
        let mut seen = true;
        for i in 0..TOKEN_LOG_HASHES {
            let bit = (h1.wrapping_add(i.wrapping_mul(h2)) % TOKEN_LOG_BITS as u64) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            seen &= bits[word] & mask != 0;
            bits[word] |= mask;
        }
        !seen
    }
}

impl std::fmt::Debug for TokenLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenLog").finish_non_exhaustive()
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenError {
    /// Not sealed by our key, or malformed.
    Invalid,
    /// Sealed by us but for another address, or too old.
    Stale,
}

/// Whether `token` opens under `key` as a Retry token (whatever it says).
pub fn is_retry_token(key: &TokenKey, token: &[u8]) -> bool {
    token.len() <= 512 && key.open(token).is_some_and(|p| p.first() == Some(&KIND_RETRY))
}

/// Opens and checks a token presented by `client`. Without `retry_address` a Retry token's
/// address is not compared with `client`'s (it was checked by a Retry offload in front,
/// which saw the client's own: see [`crate::retry_offload`]).
pub fn validate(
    key: &TokenKey,
    token: &[u8],
    client: SocketAddr,
    retry_address: bool,
    unix_ms: u64,
    retry_lifetime: Duration,
    new_token_lifetime: Duration,
) -> Result<ValidToken, TokenError> {
    if token.len() > 512 {
        return Err(TokenError::Invalid);
    }
    let plain = key.open(token).ok_or(TokenError::Invalid)?;
    let mut b = &plain[..];
    let kind = b.get_u8_checked().map_err(|_| TokenError::Invalid)?;
    let issued = b.get_u64_checked().map_err(|_| TokenError::Invalid)?;
    let ip = get_addr(&mut b).ok_or(TokenError::Invalid)?;
    let address_checked = retry_address || kind != KIND_RETRY;
    if address_checked && ip != client.ip() {
        return Err(TokenError::Stale);
    }
    let age = Duration::from_millis(unix_ms.saturating_sub(issued));
    match kind {
        KIND_RETRY => {
            let port = b.get_u16_checked().map_err(|_| TokenError::Invalid)?;
            let mut cid = || {
                let len = b.get_u8_checked().ok()? as usize;
                let bytes = b.get(..len)?;
                let id = ConnectionId::try_from_slice(bytes)?;
                b = &b[len..];
                Some(id)
            };
            let odcid = cid().ok_or(TokenError::Invalid)?;
            let retry_scid = cid().ok_or(TokenError::Invalid)?;
            if !b.is_empty() {
                return Err(TokenError::Invalid);
            }
            if (address_checked && port != client.port()) || age > retry_lifetime {
                return Err(TokenError::Stale);
            }
            Ok(ValidToken::Retry { odcid, retry_scid })
        }
        KIND_NEW_TOKEN => {
            if age > new_token_lifetime {
                return Err(TokenError::Stale);
            }
            let mut id = [0; NONCE_LEN];
            id.copy_from_slice(&token[1..1 + NONCE_LEN]);
            Ok(ValidToken::NewToken {
                issued_ms: issued,
                id,
            })
        }
        _ => Err(TokenError::Invalid),
    }
}

fn put_addr(p: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => {
            p.put_u8(4);
            p.put_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            p.put_u8(6);
            p.put_slice(&a.octets());
        }
    }
}

fn get_addr(b: &mut &[u8]) -> Option<IpAddr> {
    match b.get_u8_checked().ok()? {
        4 => {
            let mut o = [0; 4];
            b.copy_to_checked(&mut o).ok()?;
            Some(IpAddr::from(o))
        }
        6 => {
            let mut o = [0; 16];
            b.copy_to_checked(&mut o).ok()?;
            Some(IpAddr::from(o))
        }
        _ => None,
    }
}

/// Derives the stateless reset token of a connection ID (RFC 9000 §10.3.2): an HMAC of the
/// CID under the endpoint's reset key, so it can be recomputed without per-connection state.
pub fn reset_token(reset_key: &[u8; 32], cid: &ConnectionId) -> [u8; 16] {
    let key = hmac::Key::new(hmac::HMAC_SHA256, reset_key);
    let tag = hmac::sign(&key, cid);
    let mut out = [0; 16];
    out.copy_from_slice(&tag.as_ref()[..16]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token issued "in the future" by a server whose clock is ahead must not clear the
    /// log of tokens still valid (it shared their filter's place), letting them be replayed.
    #[test]
    fn a_token_from_the_future_does_not_clear_the_log() {
        let log = TokenLog::new();
        let life = Duration::from_secs(24 * 3600);
        let hour = 3600 * 1000;
        let now = 100 * 12 * hour + hour;
        let old = [1; NONCE_LEN];
        assert!(log.first_use(&old, now - 20 * hour, now, life));
        assert!(log.first_use(&[2; NONCE_LEN], now + 12 * hour, now, life));
        assert!(
            !log.first_use(&old, now - 20 * hour, now, life),
            "a token used before validated again"
        );
    }

    #[test]
    fn retry_token_roundtrip_and_checks() {
        let key = TokenKey::random();
        let addr: SocketAddr = "192.0.2.1:4433".parse().unwrap();
        let odcid = ConnectionId::new(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let retry_scid = ConnectionId::new(&[9; 8]);
        let t = retry_token(&key, addr, &odcid, &retry_scid, 1000);
        let life = Duration::from_secs(10);
        assert_eq!(
            validate(&key, &t, addr, true, 2000, life, life),
            Ok(ValidToken::Retry { odcid, retry_scid })
        );
        let other_port: SocketAddr = "192.0.2.1:4434".parse().unwrap();
        assert_eq!(
            validate(&key, &t, other_port, true, 2000, life, life),
            Err(TokenError::Stale)
        );
        assert_eq!(
            validate(&key, &t, addr, true, 20_000, life, life),
            Err(TokenError::Stale)
        );
        // Behind a Retry offload the address is not compared; the lifetime still holds.
        let proxy: SocketAddr = "198.51.100.9:7000".parse().unwrap();
        assert!(matches!(
            validate(&key, &t, proxy, false, 2000, life, life),
            Ok(ValidToken::Retry { .. })
        ));
        assert_eq!(
            validate(&key, &t, proxy, false, 20_000, life, life),
            Err(TokenError::Stale)
        );
        let mut bad = t.clone();
        bad[20] ^= 1;
        assert_eq!(
            validate(&key, &bad, addr, true, 2000, life, life),
            Err(TokenError::Invalid)
        );
        assert_eq!(
            validate(&TokenKey::random(), &t, addr, true, 2000, life, life),
            Err(TokenError::Invalid)
        );
        assert_eq!(
            validate(&key, &[1, 2, 3], addr, true, 2000, life, life),
            Err(TokenError::Invalid)
        );
    }

    /// Keys rotate: a token sealed under the previous key still opens while that key is
    /// held; one whose key went, or whose key ID byte was changed, does not.
    #[test]
    fn tokens_outlive_a_key_rotation_while_their_key_is_held() {
        let key = TokenKey::new(&[1; 32]);
        let addr: SocketAddr = "192.0.2.1:4433".parse().unwrap();
        let life = Duration::from_secs(10);
        let t0 = new_token(&key, addr.ip(), 0);
        assert_eq!(t0[0], 0, "the key ID leads");
        key.install(1, &[2; 32], true);
        let t1 = new_token(&key, addr.ip(), 0);
        assert_eq!(t1[0], 1);
        for t in [&t0, &t1] {
            assert!(validate(&key, t, addr, true, 5, life, life).is_ok());
        }
        let mut moved = t1.clone();
        moved[0] = 0;
        assert_eq!(
            validate(&key, &moved, addr, true, 5, life, life),
            Err(TokenError::Invalid),
            "the ID is authenticated"
        );
        // A server holding only key 1 (another member of the fleet) opens t1, not t0.
        let other = TokenKey::new(&[9; 32]);
        other.install(1, &[2; 32], true);
        assert!(validate(&other, &t1, addr, true, 5, life, life).is_ok());
        assert!(validate(&other, &t0, addr, true, 5, life, life).is_err());
        // Generations 2..=4 push the oldest out; the sealing key always stays; a next
        // generation's key (installed ahead) is nearer than an old one.
        for g in 2..=4u8 {
            key.install(g, &[g + 1; 32], true);
        }
        assert_eq!(key.ids(), [4, 1, 2, 3]);
        key.install(5, &[6; 32], false);
        assert_eq!(key.ids(), [4, 2, 3, 5]);
        key.install(6, &[7; 32], false);
        assert_eq!(key.ids(), [4, 3, 5, 6]);
        assert!(validate(&key, &t0, addr, true, 5, life, life).is_err());
        assert!(validate(&key, &t1, addr, true, 5, life, life).is_err(), "key 1 went");
        assert!(key.remove(3) && !key.remove(4), "the sealing key stays");
        assert_eq!(key.ids(), [4, 5, 6]);
        assert!(key.seal_with(5) && !key.seal_with(3));
        assert_eq!(key.seal(b"x".to_vec())[0], 5);
    }

    #[test]
    fn new_token_ignores_port() {
        let key = TokenKey::random();
        let ip: IpAddr = "2001:db8::1".parse().unwrap();
        let t = new_token(&key, ip, 0);
        let life = Duration::from_secs(10);
        let a = SocketAddr::new(ip, 999);
        assert!(matches!(
            validate(&key, &t, a, true, 5, life, life),
            Ok(ValidToken::NewToken { issued_ms: 0, .. })
        ));
    }

    #[test]
    fn a_new_token_is_accepted_once() {
        let life = Duration::from_secs(24 * 3600);
        let log = TokenLog::new();
        let day = 24 * 3600 * 1000;
        let issued = 10 * day;
        for i in 0..10_000u32 {
            let mut id = [0u8; NONCE_LEN];
            id[..4].copy_from_slice(&i.to_be_bytes());
            assert!(
                log.first_use(&id, issued, issued + 1000, life),
                "token {i} refused"
            );
            assert!(
                !log.first_use(&id, issued, issued + 2000, life),
                "token {i} replayed"
            );
            // Still caught near the end of its lifetime.
            assert!(!log.first_use(&id, issued, issued + day - 1, life));
        }
        // A token issued long after: its own slot, and the old ones are forgotten.
        let mut id = [0u8; NONCE_LEN];
        id[0] = 0xff;
        assert!(log.first_use(&id, issued + 3 * day, issued + 3 * day, life));
    }

    #[test]
    fn reset_tokens_differ_per_cid() {
        let k = [7; 32];
        let a = reset_token(&k, &ConnectionId::new(&[1]));
        let b = reset_token(&k, &ConnectionId::new(&[2]));
        assert_ne!(a, b);
        assert_eq!(a, reset_token(&k, &ConnectionId::new(&[1])));
    }
}
