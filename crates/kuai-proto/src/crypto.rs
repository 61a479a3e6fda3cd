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
    /// Keys of the next phase, derived ahead so a peer-initiated update costs nothing.
    pub next: PacketKeySet,
    /// The peer's keys of the previous phase, kept for reordered packets until discarded.
    pub prev_remote: Option<Box<dyn PacketKey>>,
    secrets: Secrets,
    /// Current key phase bit.
    pub phase: bool,
}

/// 1-RTT header protection keys; they never change on key update (RFC 9001 §6).
pub struct KeyPair0 {
    pub local: Box<dyn HeaderProtectionKey>,
    pub remote: Box<dyn HeaderProtectionKey>,
}

impl OneRttKeys {
    fn new(keys: quic::Keys, mut secrets: Secrets) -> Self {
        let current = PacketKeySet {
            local: keys.local.packet,
            remote: keys.remote.packet,
        };
        let next = secrets.next_packet_keys();
        Self {
            header: KeyPair0 {
                local: keys.local.header,
                remote: keys.remote.header,
            },
            current,
            next,
            prev_remote: None,
            secrets,
            phase: false,
        }
    }

    /// Switches to the next key phase (either side initiating).
    pub fn update(&mut self) {
        let next = std::mem::replace(&mut self.next, self.secrets.next_packet_keys());
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
    OneRttKeys(OneRttKeys),
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
                    out.push(HandshakeOutput::OneRttKeys(OneRttKeys::new(keys, next)));
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
