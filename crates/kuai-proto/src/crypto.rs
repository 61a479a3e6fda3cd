//! TLS 1.3 for QUIC through rustls (RFC 9001): the handshake session, packet keys per space,
//! and 1-RTT key updates (RFC 9001 §6).

use std::sync::Arc;

use rustls::quic::{
    self, Connection as TlsConnection, DirectionalKeys, HeaderProtectionKey, KeyChange, PacketKey,
    PacketKeySet, Secrets,
};

use crate::cid::ConnectionId;
use crate::error::{TransportError, TransportErrorCode};
use crate::types::{Side, SpaceId, Version};

/// Header and packet keys for one direction of one space.
pub struct Keys {
    pub header: Box<dyn HeaderProtectionKey>,
    pub packet: Box<dyn PacketKey>,
}

impl From<DirectionalKeys> for Keys {
    fn from(k: DirectionalKeys) -> Self {
        Self {
            header: k.header,
            packet: k.packet,
        }
    }
}

/// Keys for both directions of one space.
pub struct KeyPair {
    pub local: Keys,
    pub remote: Keys,
}

impl From<quic::Keys> for KeyPair {
    fn from(k: quic::Keys) -> Self {
        Self {
            local: k.local.into(),
            remote: k.remote.into(),
        }
    }
}

/// Initial keys (RFC 9001 §5.2), derived from the client's first destination CID.
pub fn initial_keys(version: Version, client_dst_cid: &ConnectionId, side: Side) -> KeyPair {
    let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
        .tls13()
        .and_then(|s| s.quic_suite())
        .expect("AES-128-GCM supports QUIC");
    let side = match side {
        Side::Client => rustls::Side::Client,
        Side::Server => rustls::Side::Server,
    };
    suite.keys(client_dst_cid, side, version.rustls()).into()
}

/// 1-RTT packet keys with key-update state.
pub struct OneRttKeys {
    pub header: KeyPair0,
    /// Keys of the current key phase.
    pub current: PacketKeySet,
    /// The peer's key of the next phase, derived ahead of a peer-initiated update (see
    /// [`prepare_next`](Self::prepare_next)); a quiet connection gives it back. Ours for
    /// that phase is derived when the update happens: only receiving has a timing to hide.
    next_remote: Option<Box<dyn PacketKey>>,
    /// The peer's keys of the previous phase, kept for reordered packets until discarded.
    pub prev_remote: Option<Box<dyn PacketKey>>,
    schedule: KeySchedule,
    /// Current key phase bit.
    pub phase: bool,
}

/// 1-RTT header protection keys; they never change on key update (RFC 9001 §6).
pub struct KeyPair0 {
    pub local: Box<dyn HeaderProtectionKey>,
    pub remote: Box<dyn HeaderProtectionKey>,
}

impl OneRttKeys {
    fn new(keys: quic::Keys, secrets: Secrets) -> Self {
        let current = PacketKeySet {
            local: keys.local.packet,
            remote: keys.remote.packet,
        };
        Self {
            header: KeyPair0 {
                local: keys.local.header,
                remote: keys.remote.header,
            },
            current,
            next_remote: None,
            prev_remote: None,
            schedule: KeySchedule::Rustls(secrets),
            phase: false,
        }
    }

    /// Derives the peer's next-phase key if it is not at hand. RFC 9001 §6.3: deriving it
    /// when a packet shows the other key phase would tell an observer, by the time it takes,
    /// that the phase changed; call this before looking at a packet's key phase, whatever it
    /// is. Our own next key is not kept (an AEAD key schedule per connection): it is
    /// derived by [`update`](Self::update), after a packet of the new phase authenticated
    /// or when we initiate, which tells an observer nothing the packets do not.
    pub fn prepare_next(&mut self) {
        if self.next_remote.is_none() {
            self.next_remote = Some(self.derive_next().remote);
        }
    }

    /// The peer's key of the next phase; [`prepare_next`](Self::prepare_next) derives it.
    pub fn next_remote(&self) -> Option<&dyn PacketKey> {
        self.next_remote.as_deref()
    }

    /// Both directions' keys of the next phase, derived afresh and not kept (for a tool that
    /// mirrors a connection's keys, as the fuzz harness does).
    pub fn derive_next(&self) -> PacketKeySet {
        self.schedule.clone().next_packet_keys()
    }

    /// Gives back the peer's next-phase key (an AEAD key schedule) until
    /// [`prepare_next`](Self::prepare_next) is called again.
    pub fn release_next(&mut self) {
        self.next_remote = None;
    }

    /// Switches to the next key phase (either side initiating).
    pub fn update(&mut self) {
        // The schedule moves on either way; its remote key is what `next_remote` holds when
        // prepared (an update is rare enough that deriving it twice does not matter).
        let derived = self.schedule.next_packet_keys();
        let next = PacketKeySet {
            local: derived.local,
            remote: self.next_remote.take().unwrap_or(derived.remote),
        };
        let old = std::mem::replace(&mut self.current, next);
        self.prev_remote = Some(old.remote);
        self.phase = !self.phase;
    }
}

/// What the handshake produced when fed data or asked for output.
pub enum HandshakeOutput {
    /// Handshake bytes for a space's CRYPTO stream.
    Data(SpaceId, Vec<u8>),
    /// Handshake keys became available.
    HandshakeKeys(KeyPair),
    /// 1-RTT keys became available.
    OneRttKeys(Box<OneRttKeys>),
}

/// The TLS session of a connection.
pub struct Tls {
    conn: TlsConnection,
    /// Space the next handshake bytes rustls writes belong to.
    write_space: SpaceId,
}

impl Tls {
    pub fn client(
        config: Arc<rustls::ClientConfig>,
        version: Version,
        server_name: rustls::pki_types::ServerName<'static>,
        params: Vec<u8>,
    ) -> Result<Self, rustls::Error> {
        let conn = quic::ClientConnection::new(config, version.rustls(), server_name, params)?;
        Ok(Self {
            conn: conn.into(),
            write_space: SpaceId::Initial,
        })
    }

    pub fn server(
        config: Arc<rustls::ServerConfig>,
        version: Version,
        params: Vec<u8>,
    ) -> Result<Self, rustls::Error> {
        let conn = quic::ServerConnection::new(config, version.rustls(), params)?;
        Ok(Self {
            conn: conn.into(),
            write_space: SpaceId::Initial,
        })
    }

    /// Feeds handshake bytes received in a CRYPTO frame.
    pub fn read(&mut self, data: &[u8]) -> Result<(), TransportError> {
        self.conn.read_hs(data).map_err(|e| self.tls_error(e))
    }

    /// Maps a rustls error to the CRYPTO_ERROR the connection closes with (RFC 9001 §4.8).
    fn tls_error(&self, e: rustls::Error) -> TransportError {
        let alert = self.conn.alert().map_or(0x50, u8::from); // internal_error
        TransportError::new(TransportErrorCode::crypto(alert), format!("TLS: {e}"))
    }

    /// Drains what the handshake wants to send, and new keys, in order.
    pub fn poll_output(&mut self, out: &mut Vec<HandshakeOutput>) {
        loop {
            let mut buf = Vec::new();
            let change = self.conn.write_hs(&mut buf);
            if !buf.is_empty() {
                out.push(HandshakeOutput::Data(self.write_space, buf));
            }
            match change {
                Some(KeyChange::Handshake { keys }) => {
                    self.write_space = SpaceId::Handshake;
                    out.push(HandshakeOutput::HandshakeKeys(keys.into()));
                }
                Some(KeyChange::OneRtt { keys, next }) => {
                    self.write_space = SpaceId::Data;
                    out.push(HandshakeOutput::OneRttKeys(Box::new(OneRttKeys::new(
                        keys, next,
                    ))));
                }
                None => break,
            }
        }
    }

    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// The peer's transport parameters (for a resuming client: the remembered ones, until the
    /// server's arrive).
    pub fn peer_params(&self) -> Option<&[u8]> {
        self.conn.quic_transport_parameters()
    }

    pub fn zero_rtt_keys(&self) -> Option<Keys> {
        self.conn.zero_rtt_keys().map(Keys::from)
    }

    /// Client: whether the server accepted 0-RTT.
    pub fn early_data_accepted(&self) -> Option<bool> {
        match &self.conn {
            TlsConnection::Client(c) => Some(c.is_early_data_accepted()),
            TlsConnection::Server(_) => None,
        }
    }

    /// Server: refuses any 0-RTT the client attempts.
    pub fn reject_early_data(&mut self) {
        if let TlsConnection::Server(s) = &mut self.conn {
            s.reject_early_data();
        }
    }

    pub fn alpn(&self) -> Option<&[u8]> {
        self.conn.alpn_protocol()
    }

    pub fn server_name(&self) -> Option<&str> {
        match &self.conn {
            TlsConnection::Server(s) => s.server_name(),
            TlsConnection::Client(_) => None,
        }
    }

    pub fn cipher_suite(&self) -> Option<rustls::CipherSuite> {
        self.conn.negotiated_cipher_suite().map(|s| s.suite())
    }

    /// Whether this session resumed an earlier one (no certificate was exchanged).
    pub fn resumed(&self) -> bool {
        matches!(
            self.conn.handshake_kind(),
            Some(rustls::HandshakeKind::Resumed)
        )
    }

    pub fn peer_certificates(&self) -> Option<&[rustls::pki_types::CertificateDer<'static>]> {
        self.conn.peer_certificates()
    }
}

// ---------------------------------------------------------------------------------------------
// Keys derived by kuai itself from TLS secrets.
//
// rustls fixes a connection's QUIC version when the connection is created, but compatible
// version negotiation (RFC 9368) can move a client from v1 to v2 in the middle of its
// handshake, after which the handshake and 1-RTT keys must use the v2 labels (RFC 9369 §3.3).
// For that case the client captures its traffic secrets through rustls's key-log hook and
// derives the packet keys here, with ring's AEAD and header-protection primitives.

use std::collections::HashMap;
use std::sync::Mutex;

use ring::aead::{self, quic as ring_quic};
use ring::hkdf;

/// Labels of the secrets kuai needs from the key log.
const SECRET_LABELS: [&str; 4] = [
    "CLIENT_HANDSHAKE_TRAFFIC_SECRET",
    "SERVER_HANDSHAKE_TRAFFIC_SECRET",
    "CLIENT_TRAFFIC_SECRET_0",
    "SERVER_TRAFFIC_SECRET_0",
];

/// Most handshakes whose secrets are held at once; older ones are dropped.
const MAX_CAPTURED: usize = 4096;

/// A [`rustls::KeyLog`] that keeps the traffic secrets of client handshakes (by client random)
/// for the connection to pick up, and forwards everything to the user's key log.
#[derive(Debug)]
pub struct SecretCapture {
    inner: Arc<dyn rustls::KeyLog>,
    secrets: Mutex<HashMap<[u8; 32], CapturedSecrets>>,
}

/// Traffic secrets of one handshake.
#[derive(Debug, Default, Clone)]
pub struct CapturedSecrets {
    pub client_handshake: Vec<u8>,
    pub server_handshake: Vec<u8>,
    pub client_traffic: Vec<u8>,
    pub server_traffic: Vec<u8>,
}

impl SecretCapture {
    pub fn new(inner: Arc<dyn rustls::KeyLog>) -> Self {
        Self {
            inner,
            secrets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes what was captured for `client_random` (removing it once 1-RTT secrets are in).
    pub fn get(&self, client_random: &[u8; 32]) -> Option<CapturedSecrets> {
        let mut map = self.secrets.lock().unwrap_or_else(|e| e.into_inner());
        let s = map.get(client_random)?.clone();
        if !s.client_traffic.is_empty() && !s.server_traffic.is_empty() {
            map.remove(client_random);
        }
        Some(s)
    }

    /// Forgets a handshake's secrets.
    pub fn forget(&self, client_random: &[u8; 32]) {
        self.secrets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(client_random);
    }
}

impl rustls::KeyLog for SecretCapture {
    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        if self.inner.will_log(label) {
            self.inner.log(label, client_random, secret);
        }
        let Ok(random) = <[u8; 32]>::try_from(client_random) else {
            return;
        };
        let Some(i) = SECRET_LABELS.iter().position(|l| *l == label) else {
            return;
        };
        let mut map = self.secrets.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_CAPTURED && !map.contains_key(&random) {
            // Handshakes that never finished; forget an arbitrary one.
            if let Some(k) = map.keys().next().copied() {
                map.remove(&k);
            }
        }
        let e = map.entry(random).or_default();
        let slot = match i {
            0 => &mut e.client_handshake,
            1 => &mut e.server_handshake,
            2 => &mut e.client_traffic,
            _ => &mut e.server_traffic,
        };
        *slot = secret.to_vec();
    }

    fn will_log(&self, label: &str) -> bool {
        SECRET_LABELS.contains(&label) || self.inner.will_log(label)
    }
}

/// Installs a [`SecretCapture`] in a client config (keeping its key log behind it).
pub fn with_secret_capture(
    mut cfg: rustls::ClientConfig,
) -> (rustls::ClientConfig, Arc<SecretCapture>) {
    let capture = Arc::new(SecretCapture::new(cfg.key_log.clone()));
    cfg.key_log = capture.clone();
    (cfg, capture)
}

/// The algorithms of a TLS 1.3 cipher suite as QUIC uses them.
#[derive(Clone, Copy)]
pub struct SuiteAlgs {
    aead: &'static aead::Algorithm,
    hp: &'static ring_quic::Algorithm,
    hkdf: hkdf::Algorithm,
    key_len: usize,
}

impl SuiteAlgs {
    pub fn of(suite: rustls::CipherSuite) -> Option<Self> {
        use rustls::CipherSuite as C;
        Some(match suite {
            C::TLS13_AES_128_GCM_SHA256 => Self {
                aead: &aead::AES_128_GCM,
                hp: &ring_quic::AES_128,
                hkdf: hkdf::HKDF_SHA256,
                key_len: 16,
            },
            C::TLS13_AES_256_GCM_SHA384 => Self {
                aead: &aead::AES_256_GCM,
                hp: &ring_quic::AES_256,
                hkdf: hkdf::HKDF_SHA384,
                key_len: 32,
            },
            C::TLS13_CHACHA20_POLY1305_SHA256 => Self {
                aead: &aead::CHACHA20_POLY1305,
                hp: &ring_quic::CHACHA20,
                hkdf: hkdf::HKDF_SHA256,
                key_len: 32,
            },
            _ => return None,
        })
    }

    fn hash_len(&self) -> usize {
        if self.hkdf == hkdf::HKDF_SHA384 {
            48
        } else {
            32
        }
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label (RFC 8446 §7.1) with an empty context.
fn expand_label(alg: hkdf::Algorithm, secret: &[u8], label: &[u8], len: usize) -> Vec<u8> {
    let prk = hkdf::Prk::new_less_safe(alg, secret);
    let full_len = 6 + label.len();
    let info = [
        &(len as u16).to_be_bytes()[..],
        &[full_len as u8][..],
        b"tls13 ",
        label,
        &[0u8][..],
    ];
    let mut out = vec![0; len];
    prk.expand(&info, Len(len))
        .and_then(|okm| okm.fill(&mut out))
        .expect("HKDF output length within limits");
    out
}

fn labels(version: Version) -> (&'static [u8], &'static [u8], &'static [u8], &'static [u8]) {
    match version {
        Version::V1 => (b"quic key", b"quic iv", b"quic hp", b"quic ku"),
        Version::V2 => (b"quicv2 key", b"quicv2 iv", b"quicv2 hp", b"quicv2 ku"),
    }
}

/// A packet key on ring's AEAD.
struct DerivedPacketKey {
    key: aead::LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    confidentiality_limit: u64,
    integrity_limit: u64,
}

impl DerivedPacketKey {
    fn nonce(&self, pn: u64) -> aead::Nonce {
        let mut n = self.iv;
        for (a, b) in n[4..].iter_mut().zip(pn.to_be_bytes()) {
            *a ^= b;
        }
        aead::Nonce::assume_unique_for_key(n)
    }
}

impl PacketKey for DerivedPacketKey {
    fn encrypt_in_place(
        &self,
        packet_number: u64,
        header: &[u8],
        payload: &mut [u8],
    ) -> Result<quic::Tag, rustls::Error> {
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(packet_number), aead::Aad::from(header), payload)
            .map_err(|_| rustls::Error::EncryptError)?;
        Ok(quic::Tag::from(tag.as_ref()))
    }

    fn decrypt_in_place<'a>(
        &self,
        packet_number: u64,
        header: &[u8],
        payload: &'a mut [u8],
    ) -> Result<&'a [u8], rustls::Error> {
        let plain = self
            .key
            .open_in_place(self.nonce(packet_number), aead::Aad::from(header), payload)
            .map_err(|_| rustls::Error::DecryptError)?;
        Ok(plain)
    }

    fn tag_len(&self) -> usize {
        self.key.algorithm().tag_len()
    }

    fn confidentiality_limit(&self) -> u64 {
        self.confidentiality_limit
    }

    fn integrity_limit(&self) -> u64 {
        self.integrity_limit
    }
}

/// A header-protection key on ring (RFC 9001 §5.4).
struct DerivedHeaderKey(ring_quic::HeaderProtectionKey);

impl DerivedHeaderKey {
    fn apply(
        &self,
        sample: &[u8],
        first: &mut u8,
        pn: &mut [u8],
        remove: bool,
    ) -> Result<(), rustls::Error> {
        let mask = self
            .0
            .new_mask(sample)
            .map_err(|_| rustls::Error::General("sample".into()))?;
        if pn.len() > 4 {
            return Err(rustls::Error::General("packet number too long".into()));
        }
        let bits = if *first & 0x80 != 0 { 0x0f } else { 0x1f };
        // When removing, the packet-number length comes from the unmasked first byte.
        let first_plain = if remove {
            *first ^ (mask[0] & bits)
        } else {
            *first
        };
        let pn_len = usize::from(first_plain & 0x03) + 1;
        *first ^= mask[0] & bits;
        for (b, m) in pn.iter_mut().zip(&mask[1..]).take(pn_len) {
            *b ^= m;
        }
        Ok(())
    }
}

impl HeaderProtectionKey for DerivedHeaderKey {
    fn encrypt_in_place(
        &self,
        sample: &[u8],
        first: &mut u8,
        pn: &mut [u8],
    ) -> Result<(), rustls::Error> {
        self.apply(sample, first, pn, false)
    }

    fn decrypt_in_place(
        &self,
        sample: &[u8],
        first: &mut u8,
        pn: &mut [u8],
    ) -> Result<(), rustls::Error> {
        self.apply(sample, first, pn, true)
    }

    fn sample_len(&self) -> usize {
        self.0.algorithm().sample_len()
    }
}

fn derive_packet_key(algs: SuiteAlgs, version: Version, secret: &[u8]) -> Box<dyn PacketKey> {
    let (k, iv, _, _) = labels(version);
    let key = expand_label(algs.hkdf, secret, k, algs.key_len);
    let ivb = expand_label(algs.hkdf, secret, iv, aead::NONCE_LEN);
    let mut iv_arr = [0; aead::NONCE_LEN];
    iv_arr.copy_from_slice(&ivb);
    let chacha = std::ptr::eq(algs.aead, &aead::CHACHA20_POLY1305);
    Box::new(DerivedPacketKey {
        key: aead::LessSafeKey::new(aead::UnboundKey::new(algs.aead, &key).expect("key length")),
        iv: iv_arr,
        // RFC 9001 §6.6.
        confidentiality_limit: if chacha { u64::MAX } else { 1 << 23 },
        integrity_limit: if chacha { 1 << 36 } else { 1 << 52 },
    })
}

fn derive_header_key(
    algs: SuiteAlgs,
    version: Version,
    secret: &[u8],
) -> Box<dyn HeaderProtectionKey> {
    let (_, _, hp, _) = labels(version);
    let key = expand_label(algs.hkdf, secret, hp, algs.key_len);
    Box::new(DerivedHeaderKey(
        ring_quic::HeaderProtectionKey::new(algs.hp, &key).expect("key length"),
    ))
}

fn derive_keys(algs: SuiteAlgs, version: Version, secret: &[u8]) -> Keys {
    Keys {
        header: derive_header_key(algs, version, secret),
        packet: derive_packet_key(algs, version, secret),
    }
}

/// Handshake keys of `version` for a client, from captured secrets.
pub fn derived_handshake_keys(
    algs: SuiteAlgs,
    version: Version,
    s: &CapturedSecrets,
) -> Option<KeyPair> {
    if s.client_handshake.is_empty() || s.server_handshake.is_empty() {
        return None;
    }
    Some(KeyPair {
        local: derive_keys(algs, version, &s.client_handshake),
        remote: derive_keys(algs, version, &s.server_handshake),
    })
}

/// The next 1-RTT secret (RFC 9001 §6.1).
fn next_secret(algs: SuiteAlgs, version: Version, secret: &[u8]) -> Vec<u8> {
    let (_, _, _, ku) = labels(version);
    expand_label(algs.hkdf, secret, ku, algs.hash_len())
}

/// Key schedule for 1-RTT keys derived by kuai (see [`OneRttKeys`]).
#[derive(Clone)]
pub struct DerivedSchedule {
    algs: SuiteAlgs,
    version: Version,
    local: Vec<u8>,
    remote: Vec<u8>,
}

impl DerivedSchedule {
    fn next_set(&mut self) -> PacketKeySet {
        self.local = next_secret(self.algs, self.version, &self.local);
        self.remote = next_secret(self.algs, self.version, &self.remote);
        PacketKeySet {
            local: derive_packet_key(self.algs, self.version, &self.local),
            remote: derive_packet_key(self.algs, self.version, &self.remote),
        }
    }
}

/// Where the next generation of 1-RTT keys comes from: each call of `next_packet_keys`
/// yields the generation after the last it yielded.
#[derive(Clone)]
enum KeySchedule {
    Rustls(Secrets),
    Derived(DerivedSchedule),
}

impl KeySchedule {
    fn next_packet_keys(&mut self) -> PacketKeySet {
        match self {
            KeySchedule::Rustls(s) => s.next_packet_keys(),
            KeySchedule::Derived(d) => d.next_set(),
        }
    }
}

impl OneRttKeys {
    /// Client 1-RTT keys of `version` from captured secrets.
    pub fn derived(algs: SuiteAlgs, version: Version, s: &CapturedSecrets) -> Option<Self> {
        if s.client_traffic.is_empty() || s.server_traffic.is_empty() {
            return None;
        }
        let schedule = DerivedSchedule {
            algs,
            version,
            local: s.client_traffic.clone(),
            remote: s.server_traffic.clone(),
        };
        let current = PacketKeySet {
            local: derive_packet_key(algs, version, &schedule.local),
            remote: derive_packet_key(algs, version, &schedule.remote),
        };
        Some(Self {
            header: KeyPair0 {
                local: derive_header_key(algs, version, &s.client_traffic),
                remote: derive_header_key(algs, version, &s.server_traffic),
            },
            current,
            next_remote: None,
            prev_remote: None,
            schedule: KeySchedule::Derived(schedule),
            phase: false,
        })
    }
}

#[cfg(test)]
mod derived_tests {
    use super::*;

    /// The derived v1 keys must agree with rustls's for the same secret: protect with one,
    /// open with the other.
    #[test]
    fn derived_initial_keys_match_rustls() {
        // RFC 9001 A.1 client initial secret.
        let secret = [
            0xc0, 0x0c, 0xf1, 0x51, 0xca, 0x5b, 0xe0, 0x75, 0xed, 0x0e, 0xbf, 0xb5, 0xc8, 0x03,
            0x23, 0xc4, 0x2d, 0x6b, 0x7d, 0xb6, 0x78, 0x81, 0x28, 0x9a, 0xf4, 0x00, 0x8f, 0x1f,
            0x6c, 0x35, 0x7a, 0xea,
        ];
        let algs = SuiteAlgs::of(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256).unwrap();
        let ours = derive_keys(algs, Version::V1, &secret);
        let theirs = initial_keys(
            Version::V1,
            &ConnectionId::new(&[0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08]),
            Side::Client,
        );
        let header = [0xc3u8, 0, 0, 0, 1];
        let mut payload = b"hello quic".to_vec();
        let tag = ours
            .packet
            .encrypt_in_place(7, &header, &mut payload)
            .unwrap();
        payload.extend_from_slice(tag.as_ref());
        let plain = theirs
            .local
            .packet
            .decrypt_in_place(7, &header, &mut payload)
            .unwrap();
        assert_eq!(plain, b"hello quic");
        // Header protection: apply with ours, remove with rustls.
        let sample = [0x5au8; 16];
        let (mut first, mut pn) = (0xc3u8, [1u8, 2, 3, 4]);
        ours.header
            .encrypt_in_place(&sample, &mut first, &mut pn)
            .unwrap();
        theirs
            .local
            .header
            .decrypt_in_place(&sample, &mut first, &mut pn)
            .unwrap();
        assert_eq!((first, pn), (0xc3, [1, 2, 3, 4]));
    }
}
