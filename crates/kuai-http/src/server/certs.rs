//! [`Certificates`]: a certificate per server name (SNI), for one listener serving several
//! hosts.

use std::collections::HashMap;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::Error;

/// Certificates chosen by the name the client asks for (TLS SNI, RFC 6066 §3): exact names
/// first, then a wildcard one label up (`*.example.com` for `www.example.com`), then the
/// default, if any; otherwise the handshake fails. [`into_tls`](Self::into_tls) makes the
/// TLS configuration [`Listener::bind`](crate::Listener::bind) takes, for HTTP/3 and TCP
/// alike.
#[derive(Debug, Default)]
pub struct Certificates {
    by_name: HashMap<String, Arc<CertifiedKey>>,
    default: Option<Arc<CertifiedKey>>,
}

impl Certificates {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn certified(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Arc<CertifiedKey>, Error> {
        let signing = kuai::crypto_provider().key_provider.load_private_key(key)?;
        let ck = CertifiedKey::new(chain, signing);
        ck.keys_match()?;
        Ok(Arc::new(ck))
    }

    /// Presents `chain` (leaf first) with `key` to clients asking for `name` (`*.` + a
    /// domain for a wildcard).
    pub fn add(
        &mut self,
        name: &str,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<&mut Self, Error> {
        let ck = Self::certified(chain, key)?;
        self.by_name
            .insert(name.trim_end_matches('.').to_ascii_lowercase(), ck);
        Ok(self)
    }

    /// Presents `chain` with `key` to clients that send no name or one not added.
    pub fn default_certificate(
        &mut self,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<&mut Self, Error> {
        self.default = Some(Self::certified(chain, key)?);
        Ok(self)
    }

    /// The TLS 1.3 server configuration that picks among them.
    pub fn into_tls(self) -> Result<rustls::ServerConfig, Error> {
        let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(self));
        tls.session_storage = kuai::session::SessionCache::with_defaults();
        Ok(tls)
    }

    fn pick(&self, name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        if let Some(name) = name {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if let Some(ck) = self.by_name.get(&name) {
                return Some(ck.clone());
            }
            if let Some((_, parent)) = name.split_once('.')
                && let Some(ck) = self.by_name.get(&format!("*.{parent}"))
            {
                return Some(ck.clone());
            }
        }
        self.default.clone()
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.pick(hello.server_name())
    }
}
