//! [`Ticketer`]: stateless TLS session tickets under keys that rotate.

use std::time::Duration;

use kuai::kuai_proto::TokenKey;

use crate::RotatingKey;

/// Seals each TLS session into its ticket (rustls `ProducesTickets`) with AES-256-GCM,
/// under the keys of a [`KeyRotation`](crate::KeyRotation): a ticket opens at every server
/// of the fleet while its key's generation is held (see the [keys](crate::KeyRotation)
/// docs), and no server keeps any session. rustls 0.23 accepts no 0-RTT with stateless
/// tickets; for 0-RTT use [`FleetSessions`](crate::FleetSessions).
pub struct Ticketer {
    key: TokenKey,
    lifetime: u32,
}

impl std::fmt::Debug for Ticketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticketer")
            .field("keys", &self.key.ids())
            .field("lifetime", &self.lifetime)
            .finish()
    }
}

impl Ticketer {
    /// Tickets that live one `period` (the rotation's): a ticket sealed at the end of
    /// generation g still opens during g + 1.
    pub fn new(period: Duration) -> Self {
        Self {
            key: TokenKey::random(),
            lifetime: period.as_secs().clamp(1, u64::from(u32::MAX)) as u32,
        }
    }
}

impl rustls::server::ProducesTickets for Ticketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        self.lifetime
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        Some(self.key.seal(plain.to_vec()))
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.key.open(cipher)
    }
}

impl RotatingKey for Ticketer {
    fn install(&self, id: u8, secret: &[u8; 32], seal: bool) {
        self.key.install(id, secret, seal);
    }
    fn seal_with(&self, id: u8) -> bool {
        self.key.seal_with(id)
    }
    fn remove(&self, id: u8) {
        self.key.remove(id);
    }
}
