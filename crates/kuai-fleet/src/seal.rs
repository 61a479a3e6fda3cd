//! What the fleet stores in Redis, sealed under a secret that Redis never sees.
//!
//! Keys and sessions are secrets: a session holds the resumption secret (whoever has it
//! reads the client's 0-RTT data and resumes as the server), the reset key forges stateless
//! resets, the token keys forge address tokens. With [`FleetOptions::secret`]
//! (crate::FleetOptions::secret) each value is sealed with AES-256-GCM under a key derived
//! from the secret (HKDF-SHA256), the Redis name it is stored under as associated data: whoever
//! reads Redis (or the traffic to it) learns nothing, and whoever writes it cannot make a
//! server take a key or a session of theirs, nor move a value to another name.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

/// Prefix of a sealed value, so that a plain one (a server without the secret) is told
/// apart rather than taken for a broken seal.
const SEALED: &[u8] = b"k1:";

/// The fleet's sealing key.
pub(crate) struct Sealer(LessSafeKey);

impl Sealer {
    /// The key derived from the fleet's secret.
    pub(crate) fn new(secret: &[u8; 32]) -> Self {
        let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"kuai fleet");
        let prk = salt.extract(secret);
        let okm = prk
            .expand(&[b"redis values v1"], &AES_256_GCM)
            .expect("one AES-256 key");
        Self(LessSafeKey::new(UnboundKey::from(okm)))
    }

    /// `value` sealed for the Redis name `name`.
    pub(crate) fn seal(&self, name: &[u8], value: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .expect("system randomness");
        let mut body = value.to_vec();
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name),
                &mut body,
            )
            .expect("sealing");
        let mut out = Vec::with_capacity(SEALED.len() + NONCE_LEN + body.len());
        out.extend_from_slice(SEALED);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        out
    }

    /// The value `stored` under `name`, if it was sealed for that name under this key.
    pub(crate) fn open(&self, name: &[u8], stored: &[u8]) -> Option<Vec<u8>> {
        let rest = stored.strip_prefix(SEALED)?;
        let (nonce, sealed) = rest.split_at_checked(NONCE_LEN)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut body = sealed.to_vec();
        let n = self
            .0
            .open_in_place(nonce, Aad::from(name), &mut body)
            .ok()?
            .len();
        body.truncate(n);
        Some(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_open_only_under_their_name_and_key() {
        let s = Sealer::new(&[7; 32]);
        let sealed = s.seal(b"kuai:keys:a", b"secret value");
        assert!(!sealed.windows(6).any(|w| w == b"secret"), "sealed");
        assert_eq!(
            s.open(b"kuai:keys:a", &sealed).as_deref(),
            Some(&b"secret value"[..])
        );
        assert_eq!(
            s.open(b"kuai:keys:b", &sealed),
            None,
            "moved to another name"
        );
        assert_eq!(Sealer::new(&[8; 32]).open(b"kuai:keys:a", &sealed), None);
        let mut bad = sealed.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(s.open(b"kuai:keys:a", &bad), None);
        assert_eq!(s.open(b"kuai:keys:a", b"plain"), None);
        assert_eq!(s.open(b"kuai:keys:a", b"k1:short"), None);
    }
}
