//! QUIC-LB routable connection IDs (draft-ietf-quic-load-balancers-21): a server ID that a
//! load balancer can read back out of every connection ID the server issues, so a migrated or
//! NAT-rebound connection still reaches its server.
//!
//! ```text
//! CID = First Octet (config rotation: 3 bits, length: 5 bits) || Server ID || Nonce
//! ```
//!
//! With a key, the server ID and nonce are encrypted with AES-128-ECB: in one pass when
//! together they are 16 bytes (§4.4.1), else by a four-round Feistel network whose round
//! function is AES-ECB of an `expand`ed half (§4.4.2). [`QuicLbCids`] is the server's
//! [`ConnectionIdGenerator`]; [`QuicLbDecoder`] is the load balancer's side.

use std::time::Duration;

use aws_lc_rs::cipher::{AES_128, DecryptingKey, EncryptingKey, UnboundCipherKey};

use crate::cid::{ConnectionId, ConnectionIdGenerator};

/// Config rotation codepoint of unroutable IDs (§3.2).
pub const UNROUTABLE: u8 = 0b111;

/// Why a QUIC-LB configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuicLbError {
    /// The config rotation codepoint is above 6 (7 means unroutable).
    ConfigId(u8),
    /// The server ID is empty, or it and the nonce exceed 19 bytes (QUIC v1's 20-byte IDs
    /// with the first octet).
    Lengths {
        /// Server ID length.
        server_id: usize,
        /// Nonce length.
        nonce: usize,
    },
    /// The nonce is under 4 bytes (§4.3).
    NonceTooShort(usize),
    /// The key was refused by the cipher.
    Key,
}

impl std::fmt::Display for QuicLbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuicLbError::ConfigId(c) => write!(f, "config rotation {c}: 0 to 6"),
            QuicLbError::Lengths { server_id, nonce } => write!(
                f,
                "server ID of {server_id} and nonce of {nonce} bytes: the ID is 1 byte or more, the two 19 at most"
            ),
            QuicLbError::NonceTooShort(n) => write!(f, "nonce of {n} bytes: at least 4"),
            QuicLbError::Key => f.write_str("the QUIC-LB key was refused"),
        }
    }
}

impl std::error::Error for QuicLbError {}

/// A QUIC-LB configuration: what servers and load balancers share.
#[derive(Clone)]
pub struct QuicLbConfig {
    config_id: u8,
    server_id_len: usize,
    nonce_len: usize,
    cipher: Option<Cipher>,
}

impl std::fmt::Debug for QuicLbConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicLbConfig")
            .field("config_id", &self.config_id)
            .field("server_id_len", &self.server_id_len)
            .field("nonce_len", &self.nonce_len)
            .field("encrypted", &self.cipher.is_some())
            .finish()
    }
}

/// AES-128 in ECB mode, one block at a time, both ways; the key schedules made once.
#[derive(Clone)]
struct Cipher {
    enc: std::sync::Arc<EncryptingKey>,
    dec: std::sync::Arc<DecryptingKey>,
}

impl Cipher {
    fn new(key: &[u8; 16]) -> Result<Self, QuicLbError> {
        let k = |_| QuicLbError::Key;
        let enc =
            EncryptingKey::ecb(UnboundCipherKey::new(&AES_128, key).map_err(k)?).map_err(k)?;
        let dec =
            DecryptingKey::ecb(UnboundCipherKey::new(&AES_128, key).map_err(k)?).map_err(k)?;
        Ok(Self {
            enc: std::sync::Arc::new(enc),
            dec: std::sync::Arc::new(dec),
        })
    }

    fn encrypt_block(&self, block: &mut [u8; 16]) {
        let _ = self.enc.encrypt(block);
    }

    fn decrypt_block(&self, block: &mut [u8; 16]) {
        let _ = self
            .dec
            .decrypt(block, aws_lc_rs::cipher::DecryptionContext::None);
    }
}

impl QuicLbConfig {
    /// A configuration: codepoint `config_id` (0 to 6), server IDs of `server_id_len` bytes,
    /// nonces of `nonce_len` bytes, encrypted with `key` when there is one (plaintext IDs
    /// let observers link a client's connection IDs to its server: §4.3).
    pub fn new(
        config_id: u8,
        server_id_len: usize,
        nonce_len: usize,
        key: Option<[u8; 16]>,
    ) -> Result<Self, QuicLbError> {
        if config_id >= UNROUTABLE {
            return Err(QuicLbError::ConfigId(config_id));
        }
        if server_id_len == 0 || server_id_len + nonce_len > 19 {
            return Err(QuicLbError::Lengths {
                server_id: server_id_len,
                nonce: nonce_len,
            });
        }
        if nonce_len < 4 {
            return Err(QuicLbError::NonceTooShort(nonce_len));
        }
        let cipher = key.as_ref().map(Cipher::new).transpose()?;
        Ok(Self {
            config_id,
            server_id_len,
            nonce_len,
            cipher,
        })
    }

    /// The config rotation codepoint.
    pub fn config_id(&self) -> u8 {
        self.config_id
    }

    /// Server ID length in bytes.
    pub fn server_id_len(&self) -> usize {
        self.server_id_len
    }

    /// Nonce length in bytes.
    pub fn nonce_len(&self) -> usize {
        self.nonce_len
    }

    /// The length of the IDs: the first octet, the server ID and the nonce.
    pub fn cid_len(&self) -> usize {
        1 + self.server_id_len + self.nonce_len
    }

    /// The connection ID for `server_id` and `nonce` (of the configured lengths), its
    /// length self-described in the first octet (§3.3).
    pub fn encode(&self, server_id: &[u8], nonce: &[u8]) -> Option<ConnectionId> {
        if server_id.len() != self.server_id_len || nonce.len() != self.nonce_len {
            return None;
        }
        let len = self.server_id_len + self.nonce_len;
        let mut out = [0u8; 20];
        out[0] = (self.config_id << 5) | len as u8;
        out[1..1 + self.server_id_len].copy_from_slice(server_id);
        out[1 + self.server_id_len..1 + len].copy_from_slice(nonce);
        if let Some(c) = &self.cipher {
            let body = &mut out[1..1 + len];
            if len == 16 {
                let block: &mut [u8; 16] = body.try_into().ok()?;
                c.encrypt_block(block);
            } else {
                feistel(c, body, true);
            }
        }
        ConnectionId::try_from_slice(&out[..1 + len])
    }

    /// The server ID and nonce in `cid`, if its first octet names this configuration and
    /// it has this configuration's length.
    pub fn decode(&self, cid: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
        let mut body = [0u8; 19];
        let body = self.decode_into(cid, &mut body)?;
        Some((
            body[..self.server_id_len].to_vec(),
            body[self.server_id_len..].to_vec(),
        ))
    }

    /// [`decode`](Self::decode) without allocating: the server ID followed by the nonce,
    /// in `out`.
    pub fn decode_into<'a>(&self, cid: &[u8], out: &'a mut [u8; 19]) -> Option<&'a [u8]> {
        let len = self.server_id_len + self.nonce_len;
        if cid.len() != 1 + len || cid[0] >> 5 != self.config_id {
            return None;
        }
        let body = &mut out[..len];
        body.copy_from_slice(&cid[1..]);
        if let Some(c) = &self.cipher {
            if len == 16 {
                let block: &mut [u8; 16] = body.try_into().ok()?;
                c.decrypt_block(block);
            } else {
                feistel(c, body, false);
            }
        }
        Some(body)
    }
}

/// `expand(length, pass, half)` (§4.4.2): the half, zero padding, the plaintext length
/// and the pass number, as one AES block.
fn expand(len: usize, pass: u8, half: &[u8]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..half.len()].copy_from_slice(half);
    b[14] = len as u8;
    b[15] = pass;
    b
}

/// One Feistel round: `into ^= AES(expand(len, pass, from))`, first `into.len()` bytes.
fn round(c: &Cipher, len: usize, pass: u8, from: &[u8], into: &mut [u8]) {
    let mut block = expand(len, pass, from);
    c.encrypt_block(&mut block);
    for (x, k) in into.iter_mut().zip(block.iter()) {
        *x ^= k;
    }
}

/// The four-pass Feistel network (§4.4.2) over `body` (server ID and nonce), encrypting
/// or decrypting in place. With an odd length the middle byte is split: the left half
/// keeps its high nibble, the right half its low one.
fn feistel(c: &Cipher, body: &mut [u8], encrypt: bool) {
    let len = body.len();
    let half = len.div_ceil(2);
    let odd = len % 2 == 1;
    let mut left = [0u8; 10];
    let mut right = [0u8; 10];
    let (l, r) = (&mut left[..half], &mut right[..half]);
    l.copy_from_slice(&body[..half]);
    r.copy_from_slice(&body[len - half..]);
    let clear_left = |l: &mut [u8]| {
        if odd {
            l[half - 1] &= 0xf0;
        }
    };
    let clear_right = |r: &mut [u8]| {
        if odd {
            r[0] &= 0x0f;
        }
    };
    clear_left(l);
    clear_right(r);
    if encrypt {
        round(c, len, 1, l, r);
        clear_right(r);
        round(c, len, 2, r, l);
        clear_left(l);
        round(c, len, 3, l, r);
        clear_right(r);
        round(c, len, 4, r, l);
        clear_left(l);
    } else {
        round(c, len, 4, r, l);
        clear_left(l);
        round(c, len, 3, l, r);
        clear_right(r);
        round(c, len, 2, r, l);
        clear_left(l);
        round(c, len, 1, l, r);
        clear_right(r);
    }
    body[..half].copy_from_slice(l);
    if odd {
        // The shared byte: the left half's high nibble, the right half's low one.
        body[half - 1] = l[half - 1] | r[0];
        body[half..].copy_from_slice(&r[1..]);
    } else {
        body[half..].copy_from_slice(r);
    }
}

/// A server's QUIC-LB connection IDs: its server ID and a counter nonce that starts at a
/// random value (§7.5: never reused under one key). Past the nonce space the IDs wrap, which
/// a deployment avoids by rotating the configuration first.
pub struct QuicLbCids {
    config: QuicLbConfig,
    server_id: Vec<u8>,
    nonce: u128,
    lifetime: Option<Duration>,
}

impl std::fmt::Debug for QuicLbCids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicLbCids")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl QuicLbCids {
    /// IDs of `config` naming `server_id` (of the configured length).
    pub fn new(config: QuicLbConfig, server_id: &[u8]) -> Result<Self, QuicLbError> {
        if server_id.len() != config.server_id_len {
            return Err(QuicLbError::Lengths {
                server_id: server_id.len(),
                nonce: config.nonce_len,
            });
        }
        Ok(Self {
            server_id: server_id.to_vec(),
            nonce: rand::random::<u128>(),
            config,
            lifetime: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &QuicLbConfig {
        &self.config
    }
}

impl ConnectionIdGenerator for QuicLbCids {
    fn generate(&mut self) -> ConnectionId {
        let n = self.config.nonce_len;
        self.nonce = self.nonce.wrapping_add(1);
        let bytes = self.nonce.to_be_bytes();
        // The nonce's low bytes (a counter); a plaintext configuration has no key to hide
        // the counter, so its nonces are random (§4.3: no observable relationship).
        let nonce: Vec<u8> = if self.config.cipher.is_some() {
            bytes[16 - n.min(16)..]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, n.saturating_sub(16)))
                .collect()
        } else {
            (0..n).map(|_| rand::random::<u8>()).collect()
        };
        self.config
            .encode(&self.server_id, &nonce)
            .unwrap_or(ConnectionId::EMPTY)
    }

    fn cid_len(&self) -> usize {
        self.config.cid_len()
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        self.lifetime
    }

    fn validate(&self, cid: &ConnectionId) -> bool {
        cid.len() == self.cid_len() && cid.first().is_some_and(|b| b >> 5 == self.config.config_id)
    }

    /// Only an ID carrying this server's ID can be ours; any other (another server's, or
    /// one that does not decode) is not answered with a reset.
    fn issued_here(&self, cid: &ConnectionId) -> Option<bool> {
        let mut body = [0u8; 19];
        Some(
            self.validate(cid)
                && self
                    .config
                    .decode_into(cid, &mut body)
                    .is_some_and(|b| b.get(..self.server_id.len()) == Some(&self.server_id[..])),
        )
    }
}

/// A load balancer's view: the configurations in use by codepoint, and the server ID in a
/// connection ID.
#[derive(Debug, Clone, Default)]
pub struct QuicLbDecoder {
    configs: [Option<QuicLbConfig>; 7],
}

impl QuicLbDecoder {
    /// None yet: every ID is unroutable.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the configuration at its codepoint.
    pub fn add(&mut self, config: QuicLbConfig) -> &mut Self {
        let i = usize::from(config.config_id);
        self.configs[i] = Some(config);
        self
    }

    /// The length of a connection ID whose first octet is `first`: that of the configuration
    /// its codepoint names, or `None` when none does. (A short header does not say how long
    /// its destination connection ID is.)
    pub fn cid_len(&self, first: u8) -> Option<usize> {
        let config = self.configs.get(usize::from(first >> 5))?.as_ref()?;
        Some(config.cid_len())
    }

    /// The server ID in `cid`, or `None` when it is unroutable (codepoint 7, one with no
    /// configuration here, or the wrong length).
    pub fn server_id(&self, cid: &[u8]) -> Option<Vec<u8>> {
        let first = *cid.first()?;
        let config = self.configs.get(usize::from(first >> 5))?.as_ref()?;
        config.decode(cid).map(|(sid, _)| sid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const KEY: &str = "8f95f09245765f80256934e50c66207f";

    fn key(s: &str) -> [u8; 16] {
        hex(s).try_into().unwrap()
    }

    /// Appendix B of draft-ietf-quic-load-balancers-21: each vector's server ID and nonce
    /// encode to its ID and back (its last encrypted vector's first octet says config 0
    /// where it lists 3, against its own rules: the codepoint is taken from the list).
    #[test]
    fn the_drafts_vectors_decode() {
        let plain = QuicLbConfig::new(0, 3, 4, None).unwrap();
        assert_eq!(
            plain.decode(&hex("07c4605e4504cc4f")),
            Some((hex("c4605e"), hex("4504cc4f")))
        );
        for (cr, sid, nonce, cid) in [
            (0, "ed793a", "ee080dbf", "0720b1d07b359d3c"),
            (
                1,
                "ed793a51d49b8f5fab65",
                "ee080dbf48",
                "2fcc381bc74cb4fbad2823a3d1f8fed2",
            ),
            (
                2,
                "ed793a51d49b8f5f",
                "ee080dbf48c0d1e5",
                "504dd2d05a7b0de9b2b9907afb5ecf8cc3",
            ),
            (
                3,
                "ed793a51d49b8f5fab",
                "ee080dbf48c0d1e55d",
                "125779c9cc86beb3a3a4a3ca96fce4bfe0cdbc",
            ),
        ] {
            let (sid, nonce, cid) = (hex(sid), hex(nonce), hex(cid));
            let c = QuicLbConfig::new(cr, sid.len(), nonce.len(), Some(key(KEY))).unwrap();
            // The body as the draft has it, under this vector's codepoint.
            let mut ours = cid.clone();
            ours[0] = (cr << 5) | (ours[0] & 0x1f);
            assert_eq!(
                c.decode(&ours),
                Some((sid.clone(), nonce.clone())),
                "vector {cr}"
            );
            let made = c.encode(&sid, &nonce).unwrap();
            assert_eq!(&made[..], &ours[..], "vector {cr}");
        }
    }

    /// §4.4.2's worked example (7 bytes, the odd middle byte split). Its step 10 shows the
    /// XOR with a mistyped AES output (0xb3e4357c for 0xb334357c); its result and the final
    /// ID are right.
    #[test]
    fn the_worked_example_round_trips() {
        let c = QuicLbConfig::new(0, 3, 4, Some(key("fdf726a9893ec05c0632d3956680baf0"))).unwrap();
        let (sid, nonce) = (hex("31441a"), hex("9c69c275"));
        let cid = c.encode(&sid, &nonce).unwrap();
        assert_eq!(&cid[..], &hex("0767947d29be054a")[..]);
        assert_eq!(c.decode(&cid), Some((sid, nonce)));
    }

    #[test]
    fn every_length_round_trips_and_servers_are_told_apart() {
        for sid_len in 1..=15 {
            for nonce_len in 4..=(19 - sid_len) {
                for key in [None, Some(key(KEY))] {
                    let c = QuicLbConfig::new(5, sid_len, nonce_len, key).unwrap();
                    let sid: Vec<u8> = (0..sid_len as u8)
                        .map(|i| i.wrapping_mul(37) ^ 0xa5)
                        .collect();
                    let mut g = QuicLbCids::new(c.clone(), &sid).unwrap();
                    let mut dec = QuicLbDecoder::new();
                    dec.add(c.clone());
                    let mut seen = std::collections::HashSet::new();
                    for _ in 0..20 {
                        let id = g.generate();
                        assert_eq!(id.len(), 1 + sid_len + nonce_len);
                        assert!(g.validate(&id));
                        assert_eq!(dec.server_id(&id), Some(sid.clone()));
                        assert!(seen.insert(id.to_vec()), "IDs repeat");
                    }
                }
            }
        }
        let mut dec = QuicLbDecoder::new();
        dec.add(QuicLbConfig::new(1, 2, 6, Some(key(KEY))).unwrap());
        assert_eq!(dec.server_id(&[0xe0; 9]), None, "codepoint 7 is unroutable");
        assert_eq!(dec.server_id(&[0x20; 5]), None, "wrong length");
        assert_eq!(dec.server_id(&[0x40; 9]), None, "no configuration 2");
        assert!(QuicLbConfig::new(7, 2, 6, None).is_err());
        assert!(QuicLbConfig::new(0, 2, 3, None).is_err());
        assert!(QuicLbConfig::new(0, 10, 10, None).is_err());
    }
}
