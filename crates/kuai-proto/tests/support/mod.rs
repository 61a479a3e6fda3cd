//! Shared test setup: certificates, TLS configs and endpoint pairs.
#![allow(dead_code)]

pub mod hostile;

use std::sync::Arc;

use kuai_proto::config::{ClientConfig, EndpointConfig, ServerConfig, TransportConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

pub const ALPN: &[u8] = b"kuai-test";

pub struct Certs {
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

pub fn certs() -> Certs {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    Certs {
        cert: ck.cert.der().clone(),
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der())),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub fn server_tls(c: &Certs) -> rustls::ServerConfig {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![c.cert.clone()], c.key.clone_key())
        .unwrap();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.max_early_data_size = u32::MAX;
    cfg
}

pub fn client_tls(c: &Certs) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(c.cert.clone()).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.enable_early_data = true;
    cfg
}

pub fn server_config(c: &Certs, transport: TransportConfig) -> ServerConfig {
    let mut s = ServerConfig::new(Arc::new(server_tls(c)));
    s.transport = Arc::new(transport);
    s
}

pub fn client_config(c: &Certs, transport: TransportConfig) -> ClientConfig {
    let mut cc = ClientConfig::new(Arc::new(client_tls(c)));
    cc.transport = Arc::new(transport);
    cc
}

pub fn endpoint_config() -> Arc<EndpointConfig> {
    Arc::new(EndpointConfig::default())
}
