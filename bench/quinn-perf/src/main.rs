//! quinn-perf: the "perf" protocol of draft-banks-quic-performance on quinn, with the same
//! command line and the same JSON output as `kuai bench`, so bench/run.sh drives both alike
//! (and either side can face the other).
//!
//! On each bidirectional stream the client sends the number of bytes it wants back (8 bytes,
//! big endian) and FIN; the server answers with that many bytes and FIN.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer, ServerName, UnixTime};

const ALPN: &[u8] = b"perf";

#[derive(Parser)]
#[command(about = "perf-protocol benchmarks on quinn")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Serve the perf protocol until killed.
    Server {
        #[arg(long, default_value = "127.0.0.1:4443")]
        listen: SocketAddr,
        /// Only quic.
        #[arg(long, default_value = "quic")]
        transport: String,
        /// Disable UDP GSO (quinn has no switch for GRO).
        #[arg(long)]
        no_offload: bool,
    },
    /// Run one workload against a perf server and print its result as one JSON line.
    Client {
        #[arg(long, default_value = "127.0.0.1:4443")]
        server: SocketAddr,
        #[arg(long, default_value = "quic")]
        transport: String,
        /// bulk | requests | handshakes | idle
        #[arg(long, default_value = "bulk")]
        workload: String,
        /// Bytes to download in total (bulk).
        #[arg(long, default_value_t = 1 << 30)]
        bytes: u64,
        /// Streams the bulk download is split over.
        #[arg(long, default_value_t = 1)]
        streams: u64,
        /// Connections (requests, handshakes in flight, idle).
        #[arg(long, default_value_t = 1)]
        connections: u64,
        /// Size of each response (requests).
        #[arg(long, default_value_t = 1000)]
        response: u64,
        /// How long the rate workloads run (and idle holds), in seconds.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        #[arg(long)]
        no_offload: bool,
    },
}

struct Workload {
    server: SocketAddr,
    workload: String,
    bytes: u64,
    streams: u64,
    connections: u64,
    response: u64,
    seconds: u64,
    no_offload: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("quinn-perf: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async move {
        match cli.mode {
            Mode::Server {
                listen,
                transport,
                no_offload,
            } => {
                if transport != "quic" {
                    return Err(format!("unsupported transport {transport}"));
                }
                server(listen, no_offload).await
            }
            Mode::Client {
                server,
                transport,
                workload,
                bytes,
                streams,
                connections,
                response,
                seconds,
                no_offload,
            } => {
                if transport != "quic" {
                    return Err(format!("unsupported transport {transport}"));
                }
                client(Workload {
                    server,
                    workload,
                    bytes,
                    streams,
                    connections,
                    response,
                    seconds,
                    no_offload,
                })
                .await
            }
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quinn-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

/// rustls with ring, AES-128-GCM first as in kuai's provider (ring lists AES-256-GCM first),
/// so every pair in the comparison negotiates TLS_AES_128_GCM_SHA256.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

/// Windows as large as kuai bench's maximums, so flow control never limits a loopback
/// transfer (quinn does not auto-tune its windows). 100 concurrent streams (quinn's default;
/// kuai bench allows 1000): the workloads keep at most 32 in flight per connection, and quinn
/// sets up state for every stream the peer may open, which would cost about 80 KB per idle
/// connection at 1000.
fn transport_config(no_offload: bool) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(64 << 20))
        .receive_window(quinn::VarInt::from_u32(256 << 20))
        .send_window(256 << 20)
        .max_concurrent_bidi_streams(quinn::VarInt::from_u32(100))
        .max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
            60_000,
        ))))
        .enable_segmentation_offload(!no_offload);
    t
}

/// CPU seconds this process used so far (user + system).
fn cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(rest) = s.rsplit_once(") ").map(|x| x.1) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let stime: f64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    (utime + stime) / 100.0 // USER_HZ
}

/// Resident memory of this process, in bytes.
fn rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// A quinn endpoint on a UDP socket whose buffers are raised like kuai's and quic-go's (8 MB
/// asked, capped by net.core.rmem_max / wmem_max): with the kernel's default the bursts of
/// hundreds of concurrent handshakes overflow the receive buffer.
fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    let _ = sock.set_recv_buffer_size(8 << 20);
    let _ = sock.set_send_buffer_size(8 << 20);
    sock.bind(&addr.into())?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        sock.into(),
        Arc::new(quinn::TokioRuntime),
    )
}

async fn server(listen: SocketAddr, no_offload: bool) -> Result<(), String> {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .map_err(|e| e.to_string())?;
    let cert_der = CertificateDer::from(cert.cert);
    let key = PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der], key.into())
        .map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport_config(no_offload)));
    cfg.max_incoming(200_000);
    let ep = endpoint(listen, Some(cfg)).map_err(|e| format!("bind {listen}: {e}"))?;
    println!(
        "quinn-perf server on udp {}",
        ep.local_addr().map_err(|e| e.to_string())?
    );

    let served = Arc::new(AtomicU64::new(0));
    let s2 = served.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            eprintln!(
                "{{\"server_cpu_s\":{:.3},\"server_rss\":{},\"served_bytes\":{}}}",
                cpu_seconds(),
                rss_bytes(),
                s2.load(Ordering::Relaxed)
            );
        }
    });

    let block = Bytes::from(vec![0x5au8; 256 * 1024]);
    while let Some(incoming) = ep.accept().await {
        let served = served.clone();
        let block = block.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                let served = served.clone();
                let block = block.clone();
                tokio::spawn(async move {
                    let mut hdr = [0u8; 8];
                    if recv.read_exact(&mut hdr).await.is_err() {
                        return;
                    }
                    // Drain the upload.
                    while let Ok(Some(_)) = recv.read_chunk(usize::MAX, true).await {}
                    let mut left = u64::from_be_bytes(hdr);
                    while left > 0 {
                        let n = left.min(block.len() as u64) as usize;
                        if send.write_chunk(block.slice(..n)).await.is_err() {
                            return;
                        }
                        left -= n as u64;
                        served.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    let _ = send.finish();
                    let _ = send.stopped().await;
                });
            }
        });
    }
    Ok(())
}

/// Accepts any certificate but checks the handshake signatures, like kuai's insecure client.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
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

fn quic_client(w: &Workload) -> Result<(quinn::Endpoint, quinn::ClientConfig), String> {
    let p = provider();
    let mut tls = rustls::ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoVerify(p)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // Full handshakes every time: no session resumption.
    tls.resumption = rustls::client::Resumption::disabled();
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport_config(w.no_offload)));
    let bind: SocketAddr = if w.server.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .expect("literal");
    let ep = endpoint(bind, None).map_err(|e| e.to_string())?;
    Ok((ep, cfg))
}

async fn connect(
    ep: &quinn::Endpoint,
    cfg: &quinn::ClientConfig,
    server: SocketAddr,
) -> Result<quinn::Connection, String> {
    ep.connect_with(cfg.clone(), server, "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())
}

async fn request(conn: &quinn::Connection, bytes: u64) -> Result<u64, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(&bytes.to_be_bytes())
        .await
        .map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    let mut got = 0u64;
    while let Some(c) = recv
        .read_chunk(usize::MAX, true)
        .await
        .map_err(|e| e.to_string())?
    {
        got += c.bytes.len() as u64;
    }
    if got != bytes {
        return Err(format!("short response: {got} of {bytes}"));
    }
    Ok(got)
}

async fn client(w: Workload) -> Result<(), String> {
    let cpu0 = cpu_seconds();
    let (ep, cfg) = quic_client(&w)?;
    let result = match w.workload.as_str() {
        "bulk" => {
            let conn = connect(&ep, &cfg, w.server).await?;
            let start = Instant::now();
            let per = w.bytes / w.streams.max(1);
            let mut tasks = Vec::new();
            for _ in 0..w.streams.max(1) {
                let c = conn.clone();
                tasks.push(tokio::spawn(async move { request(&c, per).await }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.map_err(|e| e.to_string())??;
            }
            let secs = start.elapsed().as_secs_f64();
            let st = conn.stats();
            conn.close(0u32.into(), b"");
            format!(
                "\"bytes\":{total},\"seconds\":{secs:.4},\"mbit_s\":{:.1},\"packets_lost\":{},\"rtt_ms\":{:.3}",
                total as f64 * 8.0 / secs / 1e6,
                st.path.lost_packets,
                conn.rtt().as_secs_f64() * 1e3
            )
        }
        "requests" => {
            let mut conns = Vec::new();
            for _ in 0..w.connections.max(1) {
                conns.push(connect(&ep, &cfg, w.server).await?);
            }
            let deadline = Instant::now() + Duration::from_secs(w.seconds);
            let done = Arc::new(AtomicU64::new(0));
            let start = Instant::now();
            let mut tasks = Vec::new();
            // 32 requests in flight per connection, as kuai bench.
            for c in &conns {
                for _ in 0..32 {
                    let c = c.clone();
                    let done = done.clone();
                    let size = w.response;
                    tasks.push(tokio::spawn(async move {
                        while Instant::now() < deadline {
                            if request(&c, size).await.is_err() {
                                break;
                            }
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                }
            }
            for t in tasks {
                let _ = t.await;
            }
            let secs = start.elapsed().as_secs_f64();
            let n = done.load(Ordering::Relaxed);
            format!(
                "\"requests\":{n},\"seconds\":{secs:.3},\"requests_s\":{:.0}",
                n as f64 / secs
            )
        }
        "handshakes" => {
            let deadline = Instant::now() + Duration::from_secs(w.seconds);
            let done = Arc::new(AtomicU64::new(0));
            let failed = Arc::new(AtomicU64::new(0));
            let start = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..w.connections.max(1) {
                let ep = ep.clone();
                let cfg = cfg.clone();
                let done = done.clone();
                let failed = failed.clone();
                let server = w.server;
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < deadline {
                        match ep.connect_with(cfg.clone(), server, "localhost") {
                            Ok(c) => match c.await {
                                Ok(conn) => {
                                    conn.close(0u32.into(), b"");
                                    done.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(_) => {
                                    failed.fetch_add(1, Ordering::Relaxed);
                                }
                            },
                            Err(_) => break,
                        }
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
            let secs = start.elapsed().as_secs_f64();
            let n = done.load(Ordering::Relaxed);
            format!(
                "\"handshakes\":{n},\"failed\":{},\"seconds\":{secs:.3},\"handshakes_s\":{:.0}",
                failed.load(Ordering::Relaxed),
                n as f64 / secs
            )
        }
        "idle" => {
            let mut conns = Vec::with_capacity(w.connections as usize);
            let start = Instant::now();
            let mut pending = Vec::new();
            for _ in 0..w.connections {
                pending.push(
                    ep.connect_with(cfg.clone(), w.server, "localhost")
                        .map_err(|e| e.to_string())?,
                );
                if pending.len() >= 256 {
                    for c in pending.drain(..) {
                        conns.push(c.await.map_err(|e| e.to_string())?);
                    }
                }
            }
            for c in pending.drain(..) {
                conns.push(c.await.map_err(|e| e.to_string())?);
            }
            let secs = start.elapsed().as_secs_f64();
            // Hold them while the runner samples the server's memory.
            tokio::time::sleep(Duration::from_secs(w.seconds)).await;
            format!(
                "\"connections\":{},\"setup_seconds\":{secs:.3}",
                conns.len()
            )
        }
        wl => return Err(format!("unsupported workload {wl}")),
    };
    println!(
        "{{\"impl\":\"quinn\",\"transport\":\"quic\",\"workload\":\"{}\",{result},\"client_cpu_s\":{:.3},\"client_rss\":{}}}",
        w.workload,
        cpu_seconds() - cpu0,
        rss_bytes()
    );
    Ok(())
}
