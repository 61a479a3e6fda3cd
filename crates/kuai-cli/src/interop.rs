//! The interop endpoint (MISSION.md §7): configured by environment variables, as the interop
//! runner and `interop/run.sh` start every implementation.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kuai::{ClientConfig, Endpoint, Version};

use crate::keylog::FileKeyLog;
use crate::tls::Identity;
use crate::url::Url;

/// Exit code for a test case this endpoint does not implement.
const UNSUPPORTED: u8 = 127;

/// Test cases the endpoint implements, per role, by the names quic-interop-runner passes in
/// `TESTCASE` (its `testname()` for each side, not the case's name; MISSION.md §7):
/// `multiconnect` is handshakeloss and handshakecorruption; `transfer` is also multiplexing,
/// transferloss, transfercorruption, blackhole, rebind-port, rebind-addr, amplificationlimit,
/// ipv6, goodput, the server's side of keyupdate and the client's side of connectionmigration;
/// `handshake` is also longrtt.
const SERVER_CASES: &[&str] = &[
    "versionnegotiation",
    "handshake",
    "transfer",
    "chacha20",
    "retry",
    "resumption",
    "zerortt",
    "http3",
    "multiconnect",
    "v2",
    "ecn",
    "connectionmigration",
];
const CLIENT_CASES: &[&str] = &[
    "versionnegotiation",
    "handshake",
    "transfer",
    "chacha20",
    "retry",
    "resumption",
    "zerortt",
    "http3",
    "multiconnect",
    "keyupdate",
    "v2",
    "ecn",
];

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

pub async fn run() -> ExitCode {
    let role = env("ROLE").unwrap_or_default();
    let case = env("TESTCASE").unwrap_or_default();
    let alpn = env("ALPN").unwrap_or_else(|| "h3".into());
    if role == "prepare" {
        return ExitCode::SUCCESS;
    }
    // A server holds a socket per request in flight, a client a file per download.
    crate::raise_open_file_limit();
    if alpn != "hq-interop" && alpn != "h3" {
        eprintln!("kuai interop: ALPN {alpn} not supported");
        return ExitCode::from(UNSUPPORTED);
    }
    let supported = match role.as_str() {
        "server" => SERVER_CASES,
        "client" => CLIENT_CASES,
        _ => {
            eprintln!("kuai interop: ROLE must be client, server or prepare");
            return ExitCode::FAILURE;
        }
    };
    if !supported.contains(&case.as_str()) {
        eprintln!("kuai interop: test case {case:?} not supported as {role}");
        return ExitCode::from(UNSUPPORTED);
    }
    let r = if role == "server" {
        server(&case, &alpn).await
    } else {
        client(&case, &alpn).await
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kuai interop {role} {case}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn keylog() -> Option<PathBuf> {
    env("SSLKEYLOGFILE").map(PathBuf::from)
}

fn cipher_suites(case: &str) -> Vec<rustls::SupportedCipherSuite> {
    use rustls::crypto::ring::cipher_suite as cs;
    if case == "chacha20" {
        vec![cs::TLS13_CHACHA20_POLY1305_SHA256]
    } else {
        vec![
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS13_CHACHA20_POLY1305_SHA256,
        ]
    }
}

fn provider(case: &str) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = (*kuai::crypto_provider()).clone();
    p.cipher_suites = cipher_suites(case);
    Arc::new(p)
}

async fn server(case: &str, alpn: &str) -> Result<(), String> {
    let listen: SocketAddr = env("LISTEN")
        .unwrap_or_else(|| "[::]:443".into())
        .parse()
        .map_err(|e| format!("bad LISTEN: {e}"))?;
    let listen = crate::wildcard_for_this_host(listen);
    let www = PathBuf::from(env("WWW").unwrap_or_else(|| "/www".into()));
    let certs = PathBuf::from(env("CERTS").unwrap_or_else(|| "/certs".into()));
    let identity = Identity::load(&certs.join("cert.pem"), &certs.join("priv.key"))?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider(case))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())
        .map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![alpn.as_bytes().to_vec()];
    if let Some(k) = keylog() {
        tls.key_log = Arc::new(FileKeyLog::create(&k).map_err(|e| e.to_string())?);
    }
    let mut cfg = kuai::ServerConfig::from_rustls(tls);
    if case == "retry" {
        cfg.retry(kuai::RetryPolicy::Always);
    }
    if case == "v2" {
        cfg.versions(vec![Version::V2, Version::V1]);
    }
    // One worker per core, as a production server would run: every case also checks that
    // the kernel steers each packet to the worker holding its connection.
    let mut builder = Endpoint::builder()
        .server(cfg)
        .max_segments(1)
        .workers(crate::cores());
    if let Some(d) = env("QLOGDIR") {
        builder = builder.qlog_dir(d);
    }
    if case == "connectionmigration" {
        let preferred = preferred_address(listen)?;
        tracing::info!("offering {preferred} as the preferred address");
        builder = builder.preferred_address(preferred);
    }
    let ep = builder
        .bind(listen)
        .map_err(|e| format!("cannot bind {listen} (and the preferred address): {e}"))?;
    tracing::info!(
        "interop server on {listen}, test case {case}, serving {}",
        www.display()
    );
    // The runner's clients are not browsers: no Alt-Svc.
    kuai_http::Server::new(kuai_http::ServeDir::new(www))
        .alt_svc_max_age(None)
        .serve(kuai_http::Listener::new(ep))
        .await
        .map_err(|e| e.to_string())
}

/// The preferred address for `connectionmigration`: `PREFERRED_ADDRESS` if set, else the
/// listening port on another loopback IP (127.0.0.2, or 127.0.0.3 when listening on that),
/// which a capture filtered on the port still sees.
fn preferred_address(listen: SocketAddr) -> Result<SocketAddr, String> {
    if let Some(a) = env("PREFERRED_ADDRESS") {
        return a.parse().map_err(|e| format!("bad PREFERRED_ADDRESS: {e}"));
    }
    match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.is_loopback() => {
            let other = if ip.octets()[3] == 2 { 3 } else { 2 };
            Ok(SocketAddr::from(([127, 0, 0, other], listen.port())))
        }
        _ => Err(format!(
            "connectionmigration: set PREFERRED_ADDRESS (an address of this host other than \
             {listen})"
        )),
    }
}

/// Accepts the server's certificate if its SPKI hash matches `CERT_SPKI_SHA256`, or any
/// certificate without it (interop servers use throwaway certificates).
#[derive(Debug)]
struct InteropVerifier {
    provider: Arc<rustls::crypto::CryptoProvider>,
    spki: Option<String>,
}

impl rustls::client::danger::ServerCertVerifier for InteropVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if let Some(want) = &self.spki {
            let id = Identity {
                certs: vec![end_entity.clone().into_owned()],
                key: rustls::pki_types::PrivateKeyDer::Pkcs8(Vec::new().into()),
                self_signed: false,
            };
            if id.spki_sha256().as_deref() != Some(want.as_str()) {
                return Err(rustls::Error::General(
                    "certificate SPKI does not match the pin".into(),
                ));
            }
        }
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn client_config(case: &str, alpn: &str) -> Result<ClientConfig, String> {
    let provider = provider(case);
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(InteropVerifier {
            provider,
            spki: env("CERT_SPKI_SHA256"),
        }))
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.as_bytes().to_vec()];
    if let Some(k) = keylog() {
        tls.key_log = Arc::new(FileKeyLog::create(&k).map_err(|e| e.to_string())?);
    }
    let mut cfg = ClientConfig::from_rustls(tls);
    // v1 first; in the "v2" case v2 is listed first, as our preference, so the server
    // upgrades us (RFC 9368 §4: the list is in descending preference).
    if case == "v2" {
        cfg.versions(Version::V1, vec![Version::V2, Version::V1]);
    } else {
        cfg.versions(Version::V1, vec![Version::V1, Version::V2]);
    }
    Ok(cfg)
}

async fn client(case: &str, alpn: &str) -> Result<(), String> {
    let h3 = alpn == "h3";
    let requests: Vec<Url> = env("REQUESTS")
        .ok_or("REQUESTS is not set")?
        .split_whitespace()
        .map(Url::parse)
        .collect::<Result<_, _>>()?;
    if requests.is_empty() {
        return Err("REQUESTS is empty".into());
    }
    let downloads = PathBuf::from(env("DOWNLOADS").unwrap_or_else(|| "/downloads".into()));
    let first = &requests[0];
    let server: SocketAddr = match env("SERVER") {
        Some(s) => match s.parse() {
            Ok(a) => a,
            Err(_) => {
                let (h, p) = s.rsplit_once(':').ok_or("SERVER must be host:port")?;
                crate::get::resolve(h, p.parse().map_err(|_| "bad SERVER port")?).await?
            }
        },
        None => crate::get::resolve(&first.host, first.port).await?,
    };
    if case == "versionnegotiation" {
        return version_negotiation(server).await;
    }
    let cfg = client_config(case, alpn)?;
    let bind = crate::get::any_port_for(server);
    let mut builder = Endpoint::builder().client(cfg).max_segments(1);
    if let Some(d) = env("QLOGDIR") {
        builder = builder.qlog_dir(d);
    }
    let ep = builder
        .bind(bind)
        .map_err(|e| format!("cannot open a UDP socket: {e}"))?;
    // The runner's own limit for its longest cases (300 s for handshakeloss and
    // handshakecorruption: 50 connections one after another through 30 % loss): the
    // runner, not a shorter limit here, decides when a run took too long.
    let limit = Duration::from_secs(300);
    let work = async {
        match case {
            "multiconnect" => {
                // One connection per request, one after another.
                for url in &requests {
                    let (conn, early) = connect(&ep, server, &url.host, false).await?;
                    fetch(
                        &conn,
                        early,
                        std::slice::from_ref(url),
                        &downloads,
                        false,
                        h3,
                    )
                    .await?;
                    conn.close(0, b"");
                }
                Ok(())
            }
            "resumption" | "zerortt" => {
                let (conn, early) = connect(&ep, server, &first.host, false).await?;
                fetch(&conn, early, &requests[..1], &downloads, false, h3).await?;
                // The server sends its ticket after the handshake: wait for it (bounded:
                // without one the second connection does a full handshake and the case fails
                // with a clear reason).
                if tokio::time::timeout(Duration::from_secs(5), conn.session_ticket())
                    .await
                    .is_err()
                {
                    tracing::warn!("no session ticket within 5 s");
                }
                conn.close(0, b"");
                let (conn, early) = connect(&ep, server, &first.host, case == "zerortt").await?;
                fetch(&conn, early, &requests[1..], &downloads, false, h3).await?;
                conn.close(0, b"");
                Ok(())
            }
            _ => {
                let (conn, early) = connect(&ep, server, &first.host, false).await?;
                fetch(&conn, early, &requests, &downloads, case == "keyupdate", h3).await?;
                // A server's preferred address is taken by itself (the client's side of
                // connectionmigration is "transfer"): say where the transfer ended.
                if conn.remote_address() != server {
                    tracing::info!("moved from {server} to {}", conn.remote_address());
                }
                conn.close(0, b"");
                Ok(())
            }
        }
    };
    let r = tokio::time::timeout(limit, work)
        .await
        .map_err(|_| "timed out".to_string())?;
    let _ = tokio::time::timeout(Duration::from_millis(500), ep.wait_idle()).await;
    r
}

/// A version reserved to exercise version negotiation (RFC 9000 §15: 0x?a?a?a?a).
const RESERVED_VERSION: u32 = 0x1a2a_3a4a;

/// The client's side of `versionnegotiation`: elicit a Version Negotiation packet and act on
/// it. kuai's transport starts connections only in the versions it speaks, so the endpoint
/// sends the first packet itself: a 1,200-byte long-header packet in a reserved version
/// (large enough that a server must answer, RFC 9000 §6.1 and §14.1), then reads the answer
/// as a client must (RFC 9000 §6.2): the connection IDs echoed, the version it tried not
/// listed. Like the runner's clients, it then gives up the attempt: exit 0 when the server
/// offers a version kuai speaks.
async fn version_negotiation(server: SocketAddr) -> Result<(), String> {
    let rng = ring::rand::SystemRandom::new();
    let mut ids = [0u8; 16];
    ring::rand::SecureRandom::fill(&rng, &mut ids).map_err(|_| "no randomness")?;
    let (dcid, scid) = ids.split_at(8);
    let probe = version_probe(RESERVED_VERSION, dcid, scid);
    let sock = tokio::net::UdpSocket::bind(crate::get::any_port_for(server))
        .await
        .map_err(|e| format!("cannot open a UDP socket: {e}"))?;
    let mut buf = vec![0u8; 65535];
    // The probe or its answer may be lost on an impaired path: try a few times.
    for attempt in 1..=5 {
        sock.send_to(&probe, server)
            .await
            .map_err(|e| format!("sending to {server}: {e}"))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            let got = tokio::time::timeout_at(deadline, sock.recv_from(&mut buf)).await;
            let Ok(got) = got else { break };
            let (n, from) = got.map_err(|e| format!("receiving: {e}"))?;
            if from != server {
                continue;
            }
            match parse_version_negotiation(&buf[..n], dcid, scid, RESERVED_VERSION) {
                Ok(versions) => {
                    let names: Vec<String> =
                        versions.iter().map(|v| format!("0x{v:08x}")).collect();
                    tracing::info!(
                        "version negotiation from {server} (attempt {attempt}): {}",
                        names.join(" ")
                    );
                    return if versions.iter().any(|v| Version::from_wire(*v).is_some()) {
                        Ok(())
                    } else {
                        Err(format!("no version in common with the server: {names:?}"))
                    };
                }
                Err(e) => tracing::info!("ignoring a datagram from {server}: {e}"),
            }
        }
    }
    Err(format!("no Version Negotiation packet from {server}"))
}

/// A long-header packet in `version` padded to 1,200 bytes (RFC 9000 §17.2): what a client's
/// first Initial looks like to a server that does not know the version.
fn version_probe(version: u32, dcid: &[u8], scid: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(1200);
    p.push(0xc0); // long header, fixed bit
    p.extend_from_slice(&version.to_be_bytes());
    p.push(dcid.len() as u8);
    p.extend_from_slice(dcid);
    p.push(scid.len() as u8);
    p.extend_from_slice(scid);
    p.resize(1200, 0);
    p
}

/// Reads a Version Negotiation packet (RFC 9000 §17.2.1) sent in answer to a packet with
/// `dcid`, `scid` and `tried`; returns the versions it lists. Per §6.2 a client discards one
/// that does not echo its connection IDs or that lists the version it tried.
fn parse_version_negotiation(
    d: &[u8],
    dcid: &[u8],
    scid: &[u8],
    tried: u32,
) -> Result<Vec<u32>, String> {
    let mut at = 0;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let piece = d.get(at..at + n).ok_or("truncated")?;
        at += n;
        Ok(piece)
    };
    if take(1)?[0] & 0x80 == 0 {
        return Err("not a long header".into());
    }
    if take(4)? != [0, 0, 0, 0] {
        return Err("not a Version Negotiation packet".into());
    }
    let n = take(1)?[0] as usize;
    if take(n)? != scid {
        return Err("its destination connection ID is not our source connection ID".into());
    }
    let n = take(1)?[0] as usize;
    if take(n)? != dcid {
        return Err("its source connection ID is not our destination connection ID".into());
    }
    let list = &d[at..];
    if list.is_empty() || !list.len().is_multiple_of(4) {
        return Err(format!("a version list of {} bytes", list.len()));
    }
    let versions: Vec<u32> = list
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if versions.contains(&tried) {
        return Err(format!("it lists 0x{tried:08x}, the version we tried"));
    }
    Ok(versions)
}

/// A connection, and with 0-RTT what tells whether the server took the early data (the
/// HTTP session sends rejected requests again).
type Connected = (kuai::Connection, Option<kuai::ZeroRttAccepted>);

async fn connect(
    ep: &Endpoint,
    server: SocketAddr,
    name: &str,
    zero_rtt: bool,
) -> Result<Connected, String> {
    let connecting = ep.connect(server, name).map_err(|e| e.to_string())?;
    if zero_rtt {
        match connecting.into_0rtt() {
            Ok((conn, accepted)) => return Ok((conn, Some(accepted))),
            Err(c) => {
                tracing::warn!("0-RTT not available; doing a full handshake");
                return Ok((c.await.map_err(|e| e.to_string())?, None));
            }
        }
    }
    Ok((connecting.await.map_err(|e| e.to_string())?, None))
}

async fn fetch(
    conn: &kuai::Connection,
    early: Option<kuai::ZeroRttAccepted>,
    urls: &[Url],
    downloads: &Path,
    key_update: bool,
    h3: bool,
) -> Result<(), String> {
    let session = Arc::new(
        if h3 {
            kuai_http::QuicConnection::http3(conn.clone(), early).await
        } else {
            kuai_http::QuicConnection::http09(conn.clone(), early).await
        }
        .map_err(|e| e.to_string())?,
    );
    let mut tasks = Vec::new();
    let mut names = HashSet::new();
    for url in urls {
        let name = url.file_name();
        if !names.insert(name.clone()) {
            return Err(format!("two requests save to the same file {name}"));
        }
        let path = downloads.join(&name);
        let url = url.clone();
        let session = session.clone();
        tasks.push(tokio::spawn(async move {
            let req = http::Request::get(url.to_string())
                .body(kuai_http::RequestBody::empty())
                .map_err(|e| e.to_string())?;
            let mut resp = session.send(req).await.map_err(|e| format!("{url}: {e}"))?;
            if !resp.status().is_success() {
                return Err(format!("{url}: {}", resp.status()));
            }
            // Opened once the response comes, not when the request is queued: the
            // multiplexing case asks for some 2,000 files at once, past a common limit of
            // 1,024 open files, while the server's stream limit bounds the responses.
            let mut f = std::fs::File::create(&path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            while let Some(chunk) = resp.chunk().await.map_err(|e| format!("{url}: {e}"))? {
                std::io::Write::write_all(&mut f, &chunk).map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        }));
    }
    if key_update {
        // Update keys once the handshake is confirmed and data is flowing.
        let c = conn.clone();
        tokio::spawn(async move {
            for _ in 0..100 {
                if c.force_key_update() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vn(dcid: &[u8], scid: &[u8], versions: &[u32]) -> Vec<u8> {
        let mut p = vec![0x80 | 0x3f, 0, 0, 0, 0, dcid.len() as u8];
        p.extend_from_slice(dcid);
        p.push(scid.len() as u8);
        p.extend_from_slice(scid);
        for v in versions {
            p.extend_from_slice(&v.to_be_bytes());
        }
        p
    }

    #[test]
    fn probe_is_a_padded_long_header() {
        let p = version_probe(RESERVED_VERSION, &[1; 8], &[2; 8]);
        assert_eq!(p.len(), 1200);
        assert_eq!(p[0] & 0xc0, 0xc0);
        assert_eq!(&p[1..5], &RESERVED_VERSION.to_be_bytes());
        assert_eq!(p[5], 8);
        assert_eq!(&p[6..14], &[1; 8]);
        assert_eq!(p[14], 8);
        assert_eq!(&p[15..23], &[2; 8]);
    }

    #[test]
    fn version_negotiation_is_checked_as_rfc_9000_6_2_says() {
        let (d, s) = ([1u8; 8], [2u8; 8]);
        // The server's answer swaps the IDs.
        let ok = vn(&s, &d, &[Version::V1_WIRE, Version::V2_WIRE]);
        assert_eq!(
            parse_version_negotiation(&ok, &d, &s, RESERVED_VERSION).unwrap(),
            vec![Version::V1_WIRE, Version::V2_WIRE]
        );
        // Not echoing our IDs, listing the version we tried, malformed or truncated lists.
        let bad = [
            vn(&d, &s, &[1]),
            vn(&s, &d, &[1, RESERVED_VERSION]),
            vn(&s, &d, &[]),
            ok[..ok.len() - 1].to_vec(),
            ok[..10].to_vec(),
            vec![0x80, 0, 0, 0, 1],
            Vec::new(),
        ];
        for b in bad {
            assert!(parse_version_negotiation(&b, &d, &s, RESERVED_VERSION).is_err());
        }
    }

    #[test]
    fn every_runner_testname_is_known_and_no_case_name() {
        for c in [
            "multiconnect",
            "transfer",
            "handshake",
            "versionnegotiation",
        ] {
            assert!(
                SERVER_CASES.contains(&c) && CLIENT_CASES.contains(&c),
                "{c}"
            );
        }
        // The runner never passes these: they are cases, not test names.
        for c in [
            "handshakeloss",
            "multiplexing",
            "transferloss",
            "goodput",
            "longrtt",
            "ipv6",
        ] {
            assert!(
                !SERVER_CASES.contains(&c) && !CLIENT_CASES.contains(&c),
                "{c}"
            );
        }
        assert!(CLIENT_CASES.contains(&"keyupdate") && !SERVER_CASES.contains(&"keyupdate"));
        assert!(
            SERVER_CASES.contains(&"connectionmigration")
                && !CLIENT_CASES.contains(&"connectionmigration")
        );
    }
}
