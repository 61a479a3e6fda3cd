//! quinn as an interop endpoint (MISSION.md §7), written for kuai's interop matrix.
//!
//! Configured by environment variables: `ROLE` (client, server or prepare), `TESTCASE` (the
//! quic-interop-runner's test name for this side), `ALPN` (`h3`, the default: HTTP/3 through
//! the h3 crate on h3-quinn; or `hq-interop`: HTTP/0.9 on plain quinn streams, one
//! bidirectional stream per request carrying `GET /path\r\n`), `LISTEN`, `WWW` and `CERTS`
//! (`cert.pem`, `priv.key`) for a server, `SERVER`, `REQUESTS` and `DOWNLOADS` for a client,
//! `SSLKEYLOGFILE` (read by rustls' KeyLogFile) for both.
//!
//! Exit codes: 0 success, 1 failure, 127 test case not supported.
//! Segmentation offload is off: one QUIC datagram per UDP datagram on the wire.

use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const UNSUPPORTED: u8 = 127;
/// H3_NO_ERROR (RFC 9114 §8.1).
const H3_NO_ERROR: u32 = 0x100;

/// The test names this endpoint takes, per side (quic-interop-runner's testname(): keyupdate
/// is "keyupdate" for a client only, connectionmigration "connectionmigration" for a server
/// only). What quinn 0.11 cannot do is left out: QUIC v2 (it speaks v1 only), starting a
/// connection in a version it does not support (the client's side of versionnegotiation),
/// and answering from a preferred address (the server's side of connectionmigration: a
/// connection keeps the local address of its first packet, so packets the client sends to
/// the preferred address are answered from the original one).
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
    "ecn",
];
const CLIENT_CASES: &[&str] = &[
    "handshake",
    "transfer",
    "chacha20",
    "retry",
    "resumption",
    "zerortt",
    "http3",
    "multiconnect",
    "keyupdate",
    "ecn",
];

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn say(msg: impl std::fmt::Display) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    eprintln!(
        "{}.{:03} quinn-endpoint: {msg}",
        t.as_secs() % 86400,
        t.subsec_millis()
    );
}

fn main() -> ExitCode {
    let role = env("ROLE").unwrap_or_default();
    let case = env("TESTCASE").unwrap_or_default();
    let alpn = env("ALPN").unwrap_or_else(|| "h3".into());
    if role == "prepare" {
        return ExitCode::SUCCESS;
    }
    if alpn != "h3" && alpn != "hq-interop" {
        say(format!("ALPN {alpn} not supported (h3 or hq-interop)"));
        return ExitCode::from(UNSUPPORTED);
    }
    if case == "http3" && alpn != "h3" {
        say("test case http3 needs ALPN h3");
        return ExitCode::from(UNSUPPORTED);
    }
    let cases = match role.as_str() {
        "server" => SERVER_CASES,
        "client" => CLIENT_CASES,
        _ => {
            say("ROLE must be client, server or prepare");
            return ExitCode::FAILURE;
        }
    };
    if !cases.contains(&case.as_str()) {
        let why = match case.as_str() {
            "v2" => ": quinn 0.11 speaks QUIC v1 only",
            "versionnegotiation" => {
                ": a quinn client starts only in a version it supports, never a reserved one"
            }
            "connectionmigration" => {
                ": a quinn connection answers from the local address of its first packet, \
                 never from a preferred address"
            }
            _ => "",
        };
        say(format!("test case {case:?} not supported as {role}{why}"));
        return ExitCode::from(UNSUPPORTED);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say(format!("tokio: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let h3 = alpn == "h3";
    let r = rt.block_on(async {
        if role == "server" {
            server(&case, &alpn, h3).await
        } else {
            client(&case, &alpn, h3).await
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(format!("{role} {case} failed: {e}"));
            ExitCode::FAILURE
        }
    }
}

fn provider(case: &str) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    if case == "chacha20" {
        p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256];
    }
    Arc::new(p)
}

/// The suite of Initial packets (RFC 9001 §5.3: AES-128-GCM), which quinn wants given on its
/// own when the handshake's suites leave it out (chacha20).
fn initial_suite() -> Result<rustls::quic::Suite, String> {
    rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
        .tls13()
        .and_then(|s| s.quic_suite())
        .ok_or_else(|| "no QUIC suite for AES-128-GCM".to_string())
}

fn transport(case: &str) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.enable_segmentation_offload(false)
        .max_concurrent_bidi_streams(1000u32.into())
        .max_idle_timeout(Some(Duration::from_secs(30).try_into().expect("30 s")));
    if case == "multiconnect" {
        // Fifty handshakes through 30 % loss: start from a 100 ms RTT estimate, as the
        // other peers of the matrix do, rather than quinn's 333 ms.
        t.initial_rtt(Duration::from_millis(100));
    }
    t
}

// ---------------------------------------------------------------------------------------------
// Server

async fn server(case: &str, alpn: &str, h3: bool) -> Result<(), String> {
    let listen: SocketAddr = env("LISTEN")
        .unwrap_or_else(|| "[::]:443".into())
        .parse()
        .map_err(|e| format!("bad LISTEN: {e}"))?;
    let www = PathBuf::from(env("WWW").unwrap_or_else(|| "/www".into()));
    let certs = PathBuf::from(env("CERTS").unwrap_or_else(|| "/certs".into()));
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(certs.join("cert.pem"))
        .map_err(|e| format!("cert.pem: {e}"))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cert.pem: {e}"))?;
    let key = PrivateKeyDer::from_pem_file(certs.join("priv.key"))
        .map_err(|e| format!("priv.key: {e}"))?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider(case))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![alpn.as_bytes().to_vec()];
    tls.key_log = Arc::new(rustls::KeyLogFile::new());
    if case == "zerortt" {
        // quinn takes any value but 0 as "accept 0-RTT" (RFC 9001 §4.6.1: the TLS field
        // must be 0xffffffff on the wire, which quinn sends).
        tls.max_early_data_size = u32::MAX;
    }
    let crypto = QuicServerConfig::with_initial(Arc::new(tls), initial_suite()?)
        .map_err(|e| e.to_string())?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport(case)));
    let bind = listen;
    let ep = quinn::Endpoint::server(cfg, bind).map_err(|e| format!("binding {bind}: {e}"))?;
    say(format!(
        "listening on {bind}, ALPN {alpn}, test case {case}, serving {}",
        www.display()
    ));
    let www = Arc::new(www);
    let retry = case == "retry";
    while let Some(incoming) = ep.accept().await {
        if retry && !incoming.remote_address_validated() {
            let _ = incoming.retry();
            continue;
        }
        let www = www.clone();
        tokio::spawn(async move {
            let connecting = match incoming.accept() {
                Ok(c) => c,
                Err(e) => return say(format!("refused a connection: {e}")),
            };
            // 0.5-RTT: serve 0-RTT requests before the handshake completes.
            let conn = match connecting.into_0rtt() {
                Ok((conn, _)) => conn,
                Err(connecting) => match connecting.await {
                    Ok(c) => c,
                    Err(e) => return say(format!("handshake failed: {e}")),
                },
            };
            let peer = conn.remote_address();
            let r = if h3 {
                serve_h3(conn, www).await
            } else {
                serve_hq(conn, www).await
            };
            if let Err(e) = r {
                say(format!("connection from {peer}: {e}"));
            }
        });
    }
    Ok(())
}

/// The file under `www` that a request path names, refusing any way out of it.
fn file_for(www: &Path, path: &str) -> Option<PathBuf> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let mut out = www.to_path_buf();
    for c in Path::new(path.trim_start_matches('/')).components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

async fn serve_hq(conn: quinn::Connection, www: Arc<PathBuf>) -> Result<(), String> {
    loop {
        let (mut send, mut recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(quinn::ConnectionError::ApplicationClosed(_)) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let www = www.clone();
        tokio::spawn(async move {
            let req = match recv.read_to_end(8192).await {
                Ok(r) => r,
                Err(e) => return say(format!("reading a request: {e}")),
            };
            let line = String::from_utf8_lossy(&req);
            let Some(path) = line.trim_end().strip_prefix("GET ") else {
                let _ = send.reset(1u32.into());
                return say(format!("bad request {line:?}"));
            };
            let file = file_for(&www, path.trim());
            let mut f = match file.as_ref().map(std::fs::File::open) {
                Some(Ok(f)) => tokio::fs::File::from_std(f),
                _ => {
                    let _ = send.reset(2u32.into());
                    return say(format!("{path}: not found"));
                }
            };
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match f.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if send.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = send.reset(3u32.into());
                        return say(format!("{path}: {e}"));
                    }
                }
            }
            let _ = send.finish();
        });
    }
}

async fn serve_h3(conn: quinn::Connection, www: Arc<PathBuf>) -> Result<(), String> {
    let mut h3c: h3::server::Connection<h3_quinn::Connection, Bytes> =
        h3::server::Connection::new(h3_quinn::Connection::new(conn))
            .await
            .map_err(|e| e.to_string())?;
    loop {
        match h3c.accept().await {
            Ok(Some(resolver)) => {
                let www = www.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer_h3(resolver, www).await {
                        say(format!("h3 request: {e}"));
                    }
                });
            }
            Ok(None) => return Ok(()),
            Err(e) if e.is_h3_no_error() => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

async fn answer_h3(
    resolver: h3::server::RequestResolver<h3_quinn::Connection, Bytes>,
    www: Arc<PathBuf>,
) -> Result<(), String> {
    let (req, mut stream) = resolver
        .resolve_request()
        .await
        .map_err(|e| e.to_string())?;
    let file = file_for(&www, req.uri().path());
    let f = match (req.method() == http::Method::GET, file) {
        (true, Some(p)) => std::fs::File::open(&p).ok(),
        _ => None,
    };
    let Some(f) = f else {
        let resp = http::Response::builder()
            .status(404)
            .body(())
            .map_err(|e| e.to_string())?;
        stream
            .send_response(resp)
            .await
            .map_err(|e| e.to_string())?;
        return stream.finish().await.map_err(|e| e.to_string());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let resp = http::Response::builder()
        .status(200)
        .header("content-length", len)
        .body(())
        .map_err(|e| e.to_string())?;
    stream
        .send_response(resp)
        .await
        .map_err(|e| e.to_string())?;
    let mut f = tokio::fs::File::from_std(f);
    loop {
        let mut buf = vec![0u8; 64 * 1024];
        let n = f.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        buf.truncate(n);
        stream
            .send_data(Bytes::from(buf))
            .await
            .map_err(|e| e.to_string())?;
    }
    stream.finish().await.map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// Client

/// Accepts any server certificate (interop servers use throwaway ones) but checks the
/// handshake signature made with it.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
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

struct Request {
    uri: http::Uri,
    path: String,
    name: String,
}

fn parse_request(s: &str) -> Result<Request, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("bad URL {s:?}: {e}"))?;
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let name = uri
        .path()
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("index.html")
        .to_string();
    Ok(Request { uri, path, name })
}

async fn client(case: &str, alpn: &str, h3: bool) -> Result<(), String> {
    let reqs: Vec<Request> = env("REQUESTS")
        .ok_or("REQUESTS is not set")?
        .split_whitespace()
        .map(parse_request)
        .collect::<Result<_, _>>()?;
    let first = reqs.first().ok_or("REQUESTS is empty")?;
    let sni = first.uri.host().unwrap_or("localhost").to_string();
    let downloads = PathBuf::from(env("DOWNLOADS").unwrap_or_else(|| "/downloads".into()));
    let server = match env("SERVER") {
        Some(s) => s,
        None => first.uri.authority().ok_or("no server")?.to_string(),
    };
    let server: SocketAddr = tokio::net::lookup_host(&server)
        .await
        .map_err(|e| format!("resolving {server}: {e}"))?
        .next()
        .ok_or_else(|| format!("{server} does not resolve"))?;

    let provider = provider(case);
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.as_bytes().to_vec()];
    tls.key_log = Arc::new(rustls::KeyLogFile::new());
    tls.enable_early_data = case == "zerortt";
    let crypto = QuicClientConfig::with_initial(Arc::new(tls), initial_suite()?)
        .map_err(|e| e.to_string())?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport(case)));
    let bind: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("address")
    } else {
        "[::]:0".parse().expect("address")
    };
    let mut ep = quinn::Endpoint::client(bind).map_err(|e| format!("binding {bind}: {e}"))?;
    ep.set_default_client_config(cfg);

    let work = async {
        match case {
            "multiconnect" => {
                for r in &reqs {
                    session(
                        &ep,
                        server,
                        &sni,
                        std::slice::from_ref(r),
                        &downloads,
                        h3,
                        false,
                        false,
                    )
                    .await?;
                }
                Ok(())
            }
            "resumption" | "zerortt" => {
                session(&ep, server, &sni, &reqs[..1], &downloads, h3, false, false).await?;
                let early = case == "zerortt";
                session(&ep, server, &sni, &reqs[1..], &downloads, h3, early, false).await
            }
            _ => {
                session(
                    &ep,
                    server,
                    &sni,
                    &reqs,
                    &downloads,
                    h3,
                    false,
                    case == "keyupdate",
                )
                .await
            }
        }
    };
    let r = tokio::time::timeout(Duration::from_secs(170), work)
        .await
        .map_err(|_| "timed out".to_string())
        .and_then(|r| r);
    // Let the CONNECTION_CLOSE frames go out.
    let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
    r
}

/// One connection fetching `reqs` in parallel (in 0-RTT when `early`).
#[allow(clippy::too_many_arguments)]
async fn session(
    ep: &quinn::Endpoint,
    server: SocketAddr,
    sni: &str,
    reqs: &[Request],
    downloads: &Path,
    h3: bool,
    early: bool,
    key_update: bool,
) -> Result<(), String> {
    let connecting = ep
        .connect(server, sni)
        .map_err(|e| format!("connect: {e}"))?;
    let conn = if early {
        match connecting.into_0rtt() {
            Ok((conn, _)) => conn,
            Err(connecting) => {
                say("0-RTT not possible (no ticket): a full handshake");
                connecting.await.map_err(|e| e.to_string())?
            }
        }
    } else {
        connecting.await.map_err(|e| e.to_string())?
    };
    if key_update {
        let c = conn.clone();
        tokio::spawn(async move {
            // Once the handshake is done; quinn ignores the call before.
            tokio::time::sleep(Duration::from_millis(20)).await;
            c.force_key_update();
        });
    }
    let r = if h3 {
        fetch_h3(&conn, reqs, downloads).await
    } else {
        fetch_hq(&conn, reqs, downloads).await
    };
    let (code, reason): (u32, &[u8]) = match (&r, h3) {
        (Ok(()), true) => (H3_NO_ERROR, b""),
        (Ok(()), false) => (0, b""),
        (Err(_), true) => (0x102, b"download failed"), // H3_INTERNAL_ERROR
        (Err(_), false) => (1, b"download failed"),
    };
    if r.is_ok() && !early {
        // A session ticket comes after the handshake: give it a moment to arrive.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn.close(code.into(), reason);
    r
}

async fn fetch_hq(
    conn: &quinn::Connection,
    reqs: &[Request],
    downloads: &Path,
) -> Result<(), String> {
    let mut tasks = Vec::new();
    for r in reqs {
        let conn = conn.clone();
        let path = r.path.clone();
        let out = downloads.join(&r.name);
        tasks.push(tokio::spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(format!("GET {path}\r\n").as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            let mut f = tokio::fs::File::create(&out)
                .await
                .map_err(|e| format!("{}: {e}", out.display()))?;
            while let Some(chunk) = recv
                .read_chunk(usize::MAX, true)
                .await
                .map_err(|e| format!("{path}: {e}"))?
            {
                f.write_all(&chunk.bytes).await.map_err(|e| e.to_string())?;
            }
            f.flush().await.map_err(|e| e.to_string())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

async fn fetch_h3(
    conn: &quinn::Connection,
    reqs: &[Request],
    downloads: &Path,
) -> Result<(), String> {
    let (mut driver, send_request) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
        .await
        .map_err(|e| e.to_string())?;
    let drive = tokio::spawn(async move {
        let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
    });
    let mut tasks = Vec::new();
    for r in reqs {
        let mut sr = send_request.clone();
        let uri = r.uri.clone();
        let out = downloads.join(&r.name);
        tasks.push(tokio::spawn(async move {
            let req = http::Request::get(uri.clone())
                .body(())
                .map_err(|e| e.to_string())?;
            let mut stream = sr
                .send_request(req)
                .await
                .map_err(|e| format!("{uri}: {e}"))?;
            stream.finish().await.map_err(|e| format!("{uri}: {e}"))?;
            let resp = stream
                .recv_response()
                .await
                .map_err(|e| format!("{uri}: {e}"))?;
            if resp.status() != http::StatusCode::OK {
                return Err(format!("{uri}: status {}", resp.status()));
            }
            let mut f = tokio::fs::File::create(&out)
                .await
                .map_err(|e| format!("{}: {e}", out.display()))?;
            while let Some(mut chunk) = stream
                .recv_data()
                .await
                .map_err(|e| format!("{uri}: {e}"))?
            {
                while chunk.has_remaining() {
                    let piece = chunk.chunk();
                    f.write_all(piece).await.map_err(|e| e.to_string())?;
                    let n = piece.len();
                    chunk.advance(n);
                }
            }
            f.flush().await.map_err(|e| e.to_string())
        }));
    }
    drop(send_request);
    let mut r = Ok(());
    for t in tasks {
        if let Err(e) = t.await.map_err(|e| e.to_string()).and_then(|r| r) {
            r = Err(e);
        }
    }
    drive.abort();
    r
}
