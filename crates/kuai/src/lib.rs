//! kuai: QUIC on tokio.
//!
//! An [`Endpoint`] owns a UDP port and drives every connection on it from one task per worker
//! (one by default), using UDP GSO and GRO where the kernel has them. Connections and streams are async handles in the
//! style of tokio: [`Connection::open_bi`], [`SendStream`] implements `AsyncWrite`,
//! [`RecvStream`] implements `AsyncRead`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use kuai::{ClientConfig, Endpoint, ServerConfig};
//!
//! // A server with a self-signed certificate.
//! let (server_config, cert) = ServerConfig::self_signed(&["localhost"], &[b"echo"])?;
//! let server = Endpoint::server(server_config, "127.0.0.1:0".parse()?)?;
//! let addr = server.local_addr()?;
//! tokio::spawn(async move {
//!     while let Some(connecting) = server.accept().await {
//!         tokio::spawn(async move {
//!             let conn = connecting.await?;
//!             let (mut send, mut recv) = conn.accept_bi().await?;
//!             let data = recv.read_to_end(64 * 1024).await?;
//!             send.write_all(&data).await?;
//!             send.finish()?;
//!             send.stopped().await?;
//!             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!         });
//!     }
//! });
//!
//! // A client trusting that certificate.
//! let client = Endpoint::client("127.0.0.1:0".parse()?)?;
//! let conn = client.connect_with(ClientConfig::with_root(cert, &[b"echo"])?, addr, "localhost")?.await?;
//! let (mut send, mut recv) = conn.open_bi().await?;
//! send.write_all(b"hello").await?;
//! send.finish()?;
//! assert_eq!(recv.read_to_end(1024).await?, b"hello");
//! # Ok(())
//! # }
//! ```
//!
//! Multi-core: [`EndpointBuilder::workers`] spreads an endpoint over N workers, each a socket
//! on the same port (SO_REUSEPORT) with its own driver task and its own share of the
//! connections. The last byte of every connection ID a worker issues names the worker, and a
//! classic BPF program attached to the port steers each datagram by its destination CID, so a
//! connection whose client address changes (migration, NAT rebinding) still reaches the worker
//! that holds it. What the kernel cannot steer (a peer's stateless reset, whose bytes are
//! random) the workers hand to each other.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod connection;
mod endpoint;
pub mod lb;
pub mod qlog;
pub mod replay;
pub mod session;
pub mod udp;

use std::sync::Arc;

pub use connection::{
    Connecting, Connection, ReadError, RecvStream, SendStream, WriteError, ZeroRttAccepted,
};
pub use endpoint::{ConnectError, Endpoint, EndpointBuilder};
pub use kuai_proto;
pub use kuai_proto::DatagramError;
pub use kuai_proto::cc::CongestionAlgorithm;
pub use kuai_proto::trace::ConnectionStats;
pub use kuai_proto::{ConnectionError, Dir, PathHint, Priority, StreamId, TransportError, Version};
pub use kuai_proto::{RetryPolicy, TransportConfig};
pub use rustls;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Errors building a configuration.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl From<rustls::Error> for ConfigError {
    fn from(e: rustls::Error) -> Self {
        Self(format!("TLS: {e}"))
    }
}

/// The crypto provider kuai uses: rustls with ring (AES-128/256-GCM, ChaCha20-Poly1305,
/// ECDSA and RSA), and aws-lc-rs's X25519 key exchange.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    // X25519 is the key exchange nearly every handshake uses. aws-lc-rs's (s2n-bignum's
    // verified assembly) took 44-55 us for a key pair and a shared secret here, ring's 85-100:
    // a tenth of a handshake's CPU on each side.
    for g in p.kx_groups.iter_mut() {
        if g.name() == rustls::NamedGroup::X25519 {
            *g = rustls::crypto::aws_lc_rs::kx_group::X25519;
        }
    }
    // AES-128-GCM first (ring lists AES-256 first): the cheapest suite per byte with AES
    // instructions, and what Initial packets use anyway (RFC 9001 §5.2). Peers with a
    // preference of their own still get it: the server follows the client's order.
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

/// Server settings: TLS (certificate, ALPN) and transport.
#[derive(Clone)]
pub struct ServerConfig {
    pub(crate) proto: kuai_proto::ServerConfig,
    pub(crate) anti_replay: Option<Arc<dyn replay::AntiReplay>>,
}

impl ServerConfig {
    /// From a rustls server config (TLS 1.3, ALPN set; `max_early_data_size` is set to allow
    /// 0-RTT, unless the config has a stateless ticketer, with which rustls 0.23 allows none
    /// and would warn at every ticket). Its session store stays as given: rustls's default
    /// keeps 256 sessions, so set `tls.session_storage` to a
    /// [`SessionCache`](crate::session::SessionCache) (as
    /// [`with_single_cert`](Self::with_single_cert) does) for more clients to resume.
    pub fn from_rustls(mut tls: rustls::ServerConfig) -> Self {
        tls.max_early_data_size = if tls.ticketer.enabled() { 0 } else { u32::MAX };
        Self {
            proto: kuai_proto::ServerConfig::new(Arc::new(tls)),
            anti_replay: None,
        }
    }

    /// A server presenting `certs` (leaf first) with `key`, offering `alpn` protocols.
    pub fn with_single_cert(
        certs: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        alpn: &[&[u8]],
    ) -> Result<Self, ConfigError> {
        let mut tls = rustls::ServerConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        tls.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        tls.session_storage = crate::session::SessionCache::with_defaults();
        Ok(Self::from_rustls(tls))
    }

    /// A server with a self-signed certificate for `names`, made now. Returns the certificate
    /// too, for clients to trust.
    pub fn self_signed(
        names: &[&str],
        alpn: &[&[u8]],
    ) -> Result<(Self, CertificateDer<'static>), ConfigError> {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .map_err(|e| ConfigError(format!("certificate: {e}")))?;
        let cert = ck.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
        Ok((Self::with_single_cert(vec![cert.clone()], key, alpn)?, cert))
    }

    /// Transport settings (windows, timeouts, congestion control, ...).
    pub fn transport(&mut self, t: TransportConfig) -> &mut Self {
        self.proto.transport = Arc::new(t);
        self
    }

    /// The secret Retry and NEW_TOKEN tokens are sealed with; servers that share it accept
    /// each other's tokens (random per process by default).
    pub fn token_secret(&mut self, secret: &[u8; 32]) -> &mut Self {
        self.proto.set_token_secret(secret);
        self
    }

    /// When to validate client addresses with Retry first.
    pub fn retry(&mut self, policy: RetryPolicy) -> &mut Self {
        self.proto.retry = policy;
        self
    }

    /// Versions in order of preference (compatible version negotiation picks the first the
    /// client supports).
    pub fn versions(&mut self, v: Vec<Version>) -> &mut Self {
        self.proto.versions = v;
        self
    }

    /// Whether resumed clients may send 0-RTT data.
    pub fn accept_0rtt(&mut self, on: bool) -> &mut Self {
        self.proto.accept_0rtt = on;
        self
    }

    /// A guard that records each 0-RTT ticket's first use for a fleet of servers sharing
    /// sessions: connections with 0-RTT reach the application only once it says first use,
    /// replays are refused. See [`replay`].
    pub fn anti_replay(&mut self, guard: Arc<dyn replay::AntiReplay>) -> &mut Self {
        self.anti_replay = Some(guard);
        self
    }

    /// Direct access to every transport-level server setting.
    pub fn proto_mut(&mut self) -> &mut kuai_proto::ServerConfig {
        &mut self.proto
    }
}

/// Client settings: TLS (trust, ALPN) and transport.
#[derive(Clone)]
pub struct ClientConfig {
    pub(crate) proto: kuai_proto::ClientConfig,
}

impl ClientConfig {
    /// From a rustls client config (TLS 1.3, ALPN set).
    pub fn from_rustls(mut tls: rustls::ClientConfig) -> Self {
        tls.enable_early_data = true;
        Self {
            proto: kuai_proto::ClientConfig::new(Arc::new(tls)),
        }
    }

    /// Trusting exactly `roots`.
    pub fn with_roots(roots: rustls::RootCertStore, alpn: &[&[u8]]) -> Result<Self, ConfigError> {
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(Self::from_rustls(tls))
    }

    /// Trusting one certificate (e.g. a server's self-signed one).
    pub fn with_root(cert: CertificateDer<'static>, alpn: &[&[u8]]) -> Result<Self, ConfigError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert)?;
        Self::with_roots(roots, alpn)
    }

    /// Accepting any server certificate. Only for tests and debugging: it offers no
    /// protection against an attacker on the path.
    pub fn insecure(alpn: &[&[u8]]) -> Result<Self, ConfigError> {
        let provider = crypto_provider();
        let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth();
        tls.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(Self::from_rustls(tls))
    }

    /// Transport settings (windows, timeouts, congestion control, ...).
    pub fn transport(&mut self, t: TransportConfig) -> &mut Self {
        self.proto.transport = Arc::new(t);
        self
    }

    /// The version of the first Initial, and those compatible negotiation may switch to.
    pub fn versions(&mut self, first: Version, accepted: Vec<Version>) -> &mut Self {
        self.proto.version = first;
        self.proto.versions = accepted;
        self
    }

    /// Direct access to every transport-level client setting.
    pub fn proto_mut(&mut self) -> &mut kuai_proto::ClientConfig {
        &mut self.proto
    }

    /// The rustls configuration inside (for example to use the same trust over TCP).
    pub fn proto_tls(&self) -> Arc<rustls::ClientConfig> {
        self.proto.tls.clone()
    }
}

/// Endpoint-wide settings (connection-ID generator, stateless reset key).
#[derive(Clone, Default)]
pub struct EndpointConfig {
    /// The transport-level endpoint settings.
    pub proto: kuai_proto::EndpointConfig,
}

#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
