//! `kuai bench`: throughput, request rate, handshake rate and memory, over QUIC or over
//! TCP + TLS 1.3 (the kernel-path baseline), speaking the "perf" protocol of
//! draft-banks-quic-performance: on each bidirectional stream the client sends the number of
//! bytes it wants back (8 bytes, big endian) followed by its upload and FIN; the server
//! answers with that many bytes and FIN. Other stacks' bench programs in bench/ speak the same
//! protocol, so every pair runs the same workload.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kuai::{ClientConfig, Endpoint, TransportConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::tls::Identity;

/// ALPN of the perf protocol.
pub const ALPN: &[u8] = b"perf";

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(clap::Subcommand)]
enum Mode {
    /// Flood a QUIC server with client Initials that never complete, timing real clients
    /// during the flood (a test of how the server survives it).
    Flood(crate::flood::FloodArgs),
    /// HTTP load on a URL over one connection (HTTP/3, HTTP/2; HTTP/1.1 keeps one connection
    /// per request in flight): `--requests` GETs, `--concurrency` in flight, one JSON line of
    /// results. For gateways and servers: compare the server's CPU per request.
    Http(HttpLoad),
    /// Serve the perf protocol until killed.
    Server {
        #[arg(long, default_value = "127.0.0.1:4443")]
        listen: SocketAddr,
        /// tcp: TCP + TLS 1.3 instead of QUIC.
        #[arg(long, default_value = "quic")]
        transport: String,
        /// Disable UDP GSO/GRO.
        #[arg(long)]
        no_offload: bool,
        /// QUIC congestion control: bbr-adaptive (the library's default), bbr, bbr-loss-tolerant,
        /// cubic or newreno.
        #[arg(long)]
        cc: Option<kuai::CongestionAlgorithm>,
        /// Endpoint workers (sockets on the port, each with its own driver). One by default:
        /// with client and server sharing this machine's cores, more workers cost more in
        /// smaller batches than they gain in parallel crypto (BENCHMARKS.md).
        #[arg(long, default_value_t = 1)]
        workers: usize,
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
        /// How long the rate workloads run, in seconds.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        #[arg(long)]
        no_offload: bool,
        /// QUIC congestion control: bbr-adaptive (the library's default), bbr, bbr-loss-tolerant,
        /// cubic or newreno.
        #[arg(long)]
        cc: Option<kuai::CongestionAlgorithm>,
        /// Endpoint workers (sockets on the port, each with its own driver). One by default:
        /// with client and server sharing this machine's cores, more workers cost more in
        /// smaller batches than they gain in parallel crypto (BENCHMARKS.md).
        #[arg(long, default_value_t = 1)]
        workers: usize,
    },
}

#[derive(clap::Args)]
struct HttpLoad {
    /// The URL every request asks for.
    url: String,
    /// Requests in all.
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: u64,
    /// http3, http2 or http1.1.
    #[arg(long, default_value = "http3")]
    protocol: String,
    /// Accept any certificate (a benchmark's self-signed one).
    #[arg(long, short = 'k')]
    insecure: bool,
}

/// `kuai bench http`: `requests` GETs of one URL with `concurrency` in flight, each response
/// read to its end.
async fn http_load(h: HttpLoad) -> Result<(), String> {
    let mode = match h.protocol.as_str() {
        "http3" | "h3" => kuai_http::Mode::Http3,
        "http2" | "h2" => kuai_http::Mode::Http2,
        "http1.1" | "h1" => kuai_http::Mode::Http11,
        p => return Err(format!("--protocol {p}: http3, http2 or http1.1")),
    };
    let client = kuai_http::Client::builder()
        .mode(mode)
        .danger_accept_invalid_certs(h.insecure)
        .early_data(false)
        .build()
        .map_err(|e| e.to_string())?;
    // One request first: the connection, outside the measurement.
    let first = client.get(&h.url).send().await.map_err(|e| e.to_string())?;
    if !first.status().is_success() {
        return Err(format!("{}: {}", h.url, first.status()));
    }
    first.bytes().await.map_err(|e| e.to_string())?;
    let next = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..h.concurrency.max(1) {
        let (client, url) = (client.clone(), h.url.clone());
        let (next, bytes, failed, total) =
            (next.clone(), bytes.clone(), failed.clone(), h.requests);
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let r = match client.get(&url).send().await {
                    Ok(r) if r.status().is_success() => r.bytes().await.map(|b| b.len() as u64),
                    Ok(_) => Ok(u64::MAX),
                    Err(e) => Err(e),
                };
                match r {
                    Ok(n) if n != u64::MAX => {
                        bytes.fetch_add(n, Ordering::Relaxed);
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    let secs = start.elapsed().as_secs_f64();
    let failed = failed.load(Ordering::Relaxed);
    println!(
        "{{\"impl\":\"kuai\",\"workload\":\"http\",\"protocol\":\"{}\",\"requests\":{},\"failed\":{failed},\"concurrency\":{},\"bytes\":{},\"seconds\":{secs:.4},\"req_s\":{:.1},\"client_cpu_s\":{:.3}}}",
        h.protocol,
        h.requests,
        h.concurrency,
        bytes.load(Ordering::Relaxed),
        h.requests as f64 / secs,
        cpu_seconds() - cpu0,
    );
    if failed > 0 {
        return Err(format!("{failed} requests failed"));
    }
    Ok(())
}

pub async fn run(args: Args) -> ExitCode {
    let r = match args.mode {
        Mode::Flood(a) => tokio::task::spawn_blocking(move || crate::flood::run(a))
            .await
            .unwrap_or_else(|e| Err(e.to_string())),
        Mode::Http(h) => http_load(h).await,
        Mode::Server {
            listen,
            transport,
            no_offload,
            cc,
            workers,
        } => server(listen, &transport, no_offload, cc, workers).await,
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
            cc,
            workers,
        } => {
            client(Workload {
                server,
                transport,
                workload,
                bytes,
                streams,
                connections,
                response,
                seconds,
                no_offload,
                cc,
                workers,
            })
            .await
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kuai bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn transport_config(cc: &Option<kuai::CongestionAlgorithm>) -> TransportConfig {
    // Large windows so flow control never limits a loopback transfer.
    TransportConfig {
        congestion: cc.clone().unwrap_or_default(),
        stream_receive_window: 8 << 20,
        max_stream_receive_window: 64 << 20,
        receive_window: 16 << 20,
        max_receive_window: 256 << 20,
        send_buffer: 8 << 20,
        connection_send_buffer: 64 << 20,
        max_concurrent_bidi_streams: 1000,
        ..TransportConfig::default()
    }
}

/// The response body's bytes: one block for the whole process, sliced per response (a
/// fresh 256 KiB buffer per request made the request workload a memset benchmark).
fn pattern() -> Bytes {
    static BLOCK: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    BLOCK
        .get_or_init(|| Bytes::from(vec![0x5au8; 256 * 1024]))
        .clone()
}

/// CPU seconds this process used so far (user + system).
pub fn cpu_seconds() -> f64 {
    proc_cpu_seconds("self")
}

/// CPU seconds process `pid` ("self" for this one) used so far; 0 if it cannot be read.
pub fn proc_cpu_seconds(pid: &str) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) start after ") ".
    let Some(rest) = s.rsplit_once(") ").map(|x| x.1) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = 100.0; // USER_HZ on Linux
    let utime: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let stime: f64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    (utime + stime) / tick
}

/// Resident memory of this process, in bytes.
pub fn rss_bytes() -> u64 {
    proc_rss_bytes("self")
}

/// Resident memory of process `pid` ("self" for this one), in bytes; 0 if it cannot be read.
pub fn proc_rss_bytes(pid: &str) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/statm")) else {
        return 0;
    };
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

async fn server(
    listen: SocketAddr,
    transport: &str,
    no_offload: bool,
    cc: Option<kuai::CongestionAlgorithm>,
    workers: usize,
) -> Result<(), String> {
    let id = Identity::self_signed(&["localhost"])?;
    let served = Arc::new(AtomicU64::new(0));
    // Report CPU and memory on request (SIGUSR1-free: a tiny UDP status port is overkill);
    // print them every second to stderr so the runner can read the last line.
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
    match transport {
        "quic" => {
            let mut cfg = crate::server::server_config(&id, &[ALPN], None)?;
            cfg.transport(transport_config(&cc));
            cfg.proto_mut().max_connections = 200_000;
            cfg.proto_mut().max_handshakes = 200_000;
            // Its load generator opens them all from one address.
            cfg.proto_mut().max_connections_per_ip = u32::MAX;
            cfg.proto_mut().max_validated_handshakes_per_ip = u32::MAX;
            let ep = Endpoint::builder()
                .server(cfg)
                .workers(workers)
                .gso(!no_offload)
                .gro(!no_offload)
                .bind(listen)
                .map_err(|e| format!("bind {listen}: {e}"))?;
            println!(
                "kuai bench server on udp {}",
                ep.local_addr().map_err(|e| e.to_string())?
            );
            while let Some(c) = ep.accept().await {
                let served = served.clone();
                tokio::spawn(async move {
                    let Ok(conn) = c.await else { return };
                    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                        let served = served.clone();
                        tokio::spawn(async move {
                            let mut hdr = [0u8; 8];
                            let mut got = 0;
                            while got < 8 {
                                match recv.read_chunk(8 - got).await {
                                    Ok(Some(c)) => {
                                        hdr[got..got + c.len()].copy_from_slice(&c);
                                        got += c.len();
                                    }
                                    _ => return,
                                }
                            }
                            // Drain the upload.
                            while let Ok(Some(_)) = recv.read_chunk(usize::MAX).await {}
                            let mut left = u64::from_be_bytes(hdr);
                            let block = pattern();
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
        "tcp" => tcp_server(listen, &id, served).await,
        t => Err(format!("unknown transport {t}")),
    }
}

async fn tcp_server(
    listen: SocketAddr,
    id: &Identity,
    served: Arc<AtomicU64>,
) -> Result<(), String> {
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(id.certs.clone(), id.key.clone_key())
        .map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    println!(
        "kuai bench server on tcp {}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        let _ = sock.set_nodelay(true);
        let acceptor = acceptor.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let Ok(mut s) = acceptor.accept(sock).await else {
                return;
            };
            // Over TCP, requests follow each other on the connection: 8-byte size, then the
            // response of that size.
            let block = pattern();
            loop {
                let mut hdr = [0u8; 8];
                if s.read_exact(&mut hdr).await.is_err() {
                    return;
                }
                let mut left = u64::from_be_bytes(hdr);
                while left > 0 {
                    let n = left.min(block.len() as u64) as usize;
                    if s.write_all(&block[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                    served.fetch_add(n as u64, Ordering::Relaxed);
                }
                if s.flush().await.is_err() {
                    return;
                }
            }
        });
    }
}

struct Workload {
    server: SocketAddr,
    transport: String,
    workload: String,
    bytes: u64,
    streams: u64,
    connections: u64,
    response: u64,
    seconds: u64,
    no_offload: bool,
    cc: Option<kuai::CongestionAlgorithm>,
    workers: usize,
}

fn quic_client(w: &Workload) -> Result<(Endpoint, ClientConfig), String> {
    // Full handshakes every time: no session resumption.
    let mut tls = (*ClientConfig::insecure(&[ALPN])
        .map_err(|e| e.to_string())?
        .proto_tls())
    .clone();
    tls.resumption = rustls::client::Resumption::disabled();
    let mut cfg = ClientConfig::from_rustls(tls);
    cfg.transport(transport_config(&w.cc));
    let bind = crate::get::any_port_for(w.server);
    let ep = Endpoint::builder()
        .workers(w.workers)
        .gso(!w.no_offload)
        .gro(!w.no_offload)
        .bind(bind)
        .map_err(|e| e.to_string())?;
    Ok((ep, cfg))
}

async fn quic_request(conn: &kuai::Connection, bytes: u64) -> Result<u64, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(&bytes.to_be_bytes())
        .await
        .map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    let mut got = 0u64;
    while let Some(c) = recv
        .read_chunk(usize::MAX)
        .await
        .map_err(|e| e.to_string())?
    {
        got += c.len() as u64;
    }
    if got != bytes {
        return Err(format!("short response: {got} of {bytes}"));
    }
    Ok(got)
}

async fn client(w: Workload) -> Result<(), String> {
    let cpu0 = cpu_seconds();
    let result = match (w.transport.as_str(), w.workload.as_str()) {
        ("quic", "bulk") => {
            let (ep, cfg) = quic_client(&w)?;
            let conn = ep
                .connect_with(cfg, w.server, "localhost")
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())?;
            let start = Instant::now();
            let per = w.bytes / w.streams.max(1);
            let mut tasks = Vec::new();
            for _ in 0..w.streams.max(1) {
                let c = conn.clone();
                tasks.push(tokio::spawn(async move { quic_request(&c, per).await }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.map_err(|e| e.to_string())??;
            }
            let secs = start.elapsed().as_secs_f64();
            let st = conn.stats();
            format!(
                "\"bytes\":{total},\"seconds\":{secs:.4},\"mbit_s\":{:.1},\"packets_lost\":{},\"rtt_ms\":{:.3}",
                total as f64 * 8.0 / secs / 1e6,
                st.packets_lost,
                st.path.rtt.as_secs_f64() * 1e3
            )
        }
        ("quic", "requests") => {
            let (ep, cfg) = quic_client(&w)?;
            let mut conns = Vec::new();
            for _ in 0..w.connections.max(1) {
                conns.push(
                    ep.connect_with(cfg.clone(), w.server, "localhost")
                        .map_err(|e| e.to_string())?
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            let deadline = Instant::now() + Duration::from_secs(w.seconds);
            let done = Arc::new(AtomicU64::new(0));
            let start = Instant::now();
            let mut tasks = Vec::new();
            // 32 requests in flight per connection.
            for c in &conns {
                for _ in 0..32 {
                    let c = c.clone();
                    let done = done.clone();
                    let size = w.response;
                    tasks.push(tokio::spawn(async move {
                        while Instant::now() < deadline {
                            if quic_request(&c, size).await.is_err() {
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
        ("quic", "handshakes") => {
            let (ep, cfg) = quic_client(&w)?;
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
                                    conn.close(0, b"");
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
        ("quic", "idle") => {
            let (ep, cfg) = quic_client(&w)?;
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
        ("tcp", "bulk") => tcp_bulk(&w).await?,
        ("tcp", "requests") => tcp_requests(&w).await?,
        ("tcp", "handshakes") => tcp_handshakes(&w).await?,
        ("tcp", "idle") => tcp_idle(&w).await?,
        (t, wl) => return Err(format!("unsupported transport/workload {t}/{wl}")),
    };
    println!(
        "{{\"impl\":\"kuai\",\"transport\":\"{}\",\"workload\":\"{}\",{result},\"client_cpu_s\":{:.3},\"client_rss\":{}}}",
        w.transport,
        w.workload,
        cpu_seconds() - cpu0,
        rss_bytes()
    );
    Ok(())
}

fn tcp_connector() -> Result<tokio_rustls::TlsConnector, String> {
    let quic = ClientConfig::insecure(&[ALPN]).map_err(|e| e.to_string())?;
    let mut tls = (*quic.proto_tls()).clone();
    // Full handshakes every time, as the QUIC clients do.
    tls.resumption = rustls::client::Resumption::disabled();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(tls)))
}

async fn tcp_connect_to(
    server: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let sock = tokio::net::TcpStream::connect(server)
        .await
        .map_err(|e| e.to_string())?;
    let _ = sock.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("valid name");
    connector
        .connect(name, sock)
        .await
        .map_err(|e| e.to_string())
}

async fn tcp_bulk(w: &Workload) -> Result<String, String> {
    let connector = tcp_connector()?;
    let mut s = tcp_connect_to(w.server, &connector).await?;
    let start = Instant::now();
    s.write_all(&w.bytes.to_be_bytes())
        .await
        .map_err(|e| e.to_string())?;
    s.flush().await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0u64;
    while got < w.bytes {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("short response: {got} of {}", w.bytes));
        }
        got += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(format!(
        "\"bytes\":{got},\"seconds\":{secs:.4},\"mbit_s\":{:.1}",
        got as f64 * 8.0 / secs / 1e6
    ))
}

async fn tcp_handshakes(w: &Workload) -> Result<String, String> {
    let connector = tcp_connector()?;
    let deadline = Instant::now() + Duration::from_secs(w.seconds);
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    // `connections` handshakes in flight, each on a new TCP connection.
    for _ in 0..w.connections.max(1) {
        let (connector, done, failed) = (connector.clone(), done.clone(), failed.clone());
        let server = w.server;
        tasks.spawn(async move {
            while Instant::now() < deadline {
                match tcp_connect_to(server, &connector).await {
                    Ok(s) => {
                        drop(s);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    }
    tasks.join_all().await;
    let secs = start.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed);
    Ok(format!(
        "\"handshakes\":{n},\"failed\":{},\"seconds\":{secs:.3},\"handshakes_s\":{:.0}",
        failed.load(Ordering::Relaxed),
        n as f64 / secs
    ))
}

/// Requests over TCP: a connection carries one at a time, so each keeps 32 in flight by
/// pipelining them (the server answers in order), like HTTP/1.1 pipelining.
async fn tcp_requests(w: &Workload) -> Result<String, String> {
    const IN_FLIGHT: u64 = 32;
    let connector = tcp_connector()?;
    let mut conns = Vec::new();
    for _ in 0..w.connections.max(1) {
        conns.push(tcp_connect_to(w.server, &connector).await?);
    }
    let size = w.response.max(1);
    let deadline = Instant::now() + Duration::from_secs(w.seconds);
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for s in conns {
        let done = done.clone();
        tasks.spawn(async move {
            let (mut rd, mut wr) = tokio::io::split(s);
            let request = size.to_be_bytes();
            let mut out = request.repeat(IN_FLIGHT as usize);
            wr.write_all(&out).await.map_err(|e| e.to_string())?;
            wr.flush().await.map_err(|e| e.to_string())?;
            let mut outstanding = IN_FLIGHT;
            let mut partial = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            while outstanding > 0 {
                let n = rd.read(&mut buf).await.map_err(|e| e.to_string())?;
                if n == 0 {
                    return Err("the server closed the connection".to_string());
                }
                partial += n as u64;
                let finished = (partial / size).min(outstanding);
                partial -= finished * size;
                outstanding -= finished;
                done.fetch_add(finished, Ordering::Relaxed);
                // As many new requests as were answered, in one write.
                if finished > 0 && Instant::now() < deadline {
                    out.clear();
                    for _ in 0..finished {
                        out.extend_from_slice(&request);
                    }
                    wr.write_all(&out).await.map_err(|e| e.to_string())?;
                    wr.flush().await.map_err(|e| e.to_string())?;
                    outstanding += finished;
                }
            }
            Ok::<(), String>(())
        });
    }
    for r in tasks.join_all().await {
        r?;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed);
    Ok(format!(
        "\"requests\":{n},\"seconds\":{secs:.3},\"requests_s\":{:.0}",
        n as f64 / secs
    ))
}

/// Idle connections over TCP: `connections` TLS connections opened 64 at a time and held
/// (256 at a time overflowed the listener's accept queue, and each overflow costs the client a
/// 1 s SYN retransmission).
async fn tcp_idle(w: &Workload) -> Result<String, String> {
    let connector = tcp_connector()?;
    let mut conns = Vec::with_capacity(w.connections as usize);
    let start = Instant::now();
    let mut left = w.connections;
    while left > 0 {
        let batch = left.min(64);
        left -= batch;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..batch {
            let connector = connector.clone();
            let server = w.server;
            tasks.spawn(async move { tcp_connect_to(server, &connector).await });
        }
        for r in tasks.join_all().await {
            conns.push(r?);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // Hold them while the runner samples the server's memory.
    tokio::time::sleep(Duration::from_secs(w.seconds)).await;
    Ok(format!(
        "\"connections\":{},\"setup_seconds\":{secs:.3}",
        conns.len()
    ))
}
