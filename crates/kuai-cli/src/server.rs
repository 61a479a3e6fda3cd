//! `kuai server`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use kuai::{Endpoint, ServerConfig};

use crate::hq::{self, Site};
use crate::keylog::FileKeyLog;
use crate::tls::Identity;

#[derive(clap::Args)]
pub struct Args {
    /// Directory to serve; without it, a built-in demo site.
    #[arg(long)]
    root: Option<PathBuf>,
    /// UDP address to listen on.
    #[arg(long, default_value = "[::]:4433")]
    listen: SocketAddr,
    /// Certificate chain (PEM); without it, a self-signed certificate is made at start.
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Private key (PEM).
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// Append TLS secrets to this file (NSS key log format, for Wireshark).
    #[arg(long)]
    keylog: Option<PathBuf>,
    /// Validate every client address with Retry before its handshake (by default only past
    /// 512 handshakes in flight, a flood defence).
    #[arg(long)]
    retry: bool,
    /// Write a qlog trace of every connection into this directory.
    #[arg(long)]
    qlog_dir: Option<PathBuf>,
    /// Do not serve HTTP/1.1 and HTTP/2 over TCP on the same port.
    #[arg(long)]
    no_tcp: bool,
    /// QUIC congestion control: newreno, bbr (BBRv3) or bbr-loss-tolerant.
    #[arg(long, default_value = "newreno")]
    cc: kuai::CongestionAlgorithm,
    /// On a lossy path (2 % or more of packets lost), send a second copy of the last packets
    /// of each flight (up to 16) when there is nothing new to send.
    #[arg(long)]
    redundancy: bool,
    /// Also listen on this address and offer it to clients as the server's preferred address
    /// (RFC 9000 §9.6): they move to it after the handshake. It needs an IP address other
    /// than the one of --listen.
    #[arg(long)]
    preferred_address: Option<SocketAddr>,
    /// Spread connections over this many workers: UDP sockets sharing the port, each with a
    /// driver of its own, the kernel steering each packet by its connection ID (Linux).
    #[arg(long, default_value_t = 1)]
    workers: usize,
}

pub async fn run(args: Args) -> ExitCode {
    match serve(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kuai server: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The rustls server configuration (TLS 1.3 only) for `alpn`, shared by QUIC and TCP.
pub fn rustls_server_config(
    identity: &Identity,
    alpn: &[&[u8]],
    keylog: Option<&std::path::Path>,
) -> Result<rustls::ServerConfig, String> {
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())
        .map_err(|e| format!("certificate and key do not match: {e}"))?;
    tls.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    if let Some(path) = keylog {
        tls.key_log = Arc::new(
            FileKeyLog::create(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?,
        );
    }
    Ok(tls)
}

/// Builds the TLS and transport configuration shared by `kuai server` and the interop server.
pub fn server_config(
    identity: &Identity,
    alpn: &[&[u8]],
    keylog: Option<&std::path::Path>,
) -> Result<ServerConfig, String> {
    Ok(ServerConfig::from_rustls(rustls_server_config(
        identity, alpn, keylog,
    )?))
}

async fn serve(args: Args) -> Result<(), String> {
    let identity = match (&args.cert, &args.key) {
        (Some(c), Some(k)) => Identity::load(c, k)?,
        _ => Identity::self_signed(&["localhost", "127.0.0.1", "::1"])?,
    };
    let site = match &args.root {
        Some(dir) => {
            if !dir.is_dir() {
                return Err(format!("{} is not a directory", dir.display()));
            }
            Site::Dir(dir.clone())
        }
        None => Site::Demo,
    };
    let mut cfg = server_config(
        &identity,
        &[crate::h3::ALPN, hq::ALPN],
        args.keylog.as_deref(),
    )?;
    if args.retry {
        cfg.retry(kuai::RetryPolicy::Always);
    }
    crate::set_transport(&mut cfg.proto_mut().transport, &args.cc, args.redundancy);
    let mut builder = Endpoint::builder().server(cfg).workers(args.workers);
    if let Some(d) = &args.qlog_dir {
        builder = builder.qlog_dir(d);
    }
    if let Some(a) = args.preferred_address {
        builder = builder.preferred_address(a);
    }
    let ep = builder.bind(args.listen).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidInput => e.to_string(),
        _ => format!("cannot bind {}: {e}", args.listen),
    })?;
    let local = ep.local_addr().map_err(|e| e.to_string())?;
    let port = local.port();
    println!(
        "kuai server listening on udp {local} (HTTP/3, and HTTP/0.9 as hq-interop){}",
        match ep.workers() {
            1 => String::new(),
            n => format!(", {n} workers"),
        }
    );
    if let Some(p) = ep.preferred_address() {
        println!("kuai server preferred address: udp {p} (clients move there after the handshake)");
    }
    let tcp = if args.no_tcp {
        None
    } else {
        let addr = SocketAddr::new(local.ip(), port);
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot bind tcp {addr}: {e} (--no-tcp serves UDP only)"))?;
        println!("kuai server listening on tcp {addr} (HTTP/2 and HTTP/1.1, Alt-Svc: h3)");
        Some(l)
    };
    match &args.root {
        Some(dir) => println!("serving {}", dir.display()),
        None => println!("serving the built-in demo site"),
    }
    if identity.self_signed {
        println!("certificate: self-signed for localhost, made at start");
    }
    if let Some(spki) = identity.spki_sha256() {
        println!("certificate SPKI sha256 (base64): {spki}");
        println!("open it in Chromium over HTTP/3:");
        // Chromium resolves localhost to ::1 first; point it at an IPv4-only listener.
        let resolve = match local.ip() {
            std::net::IpAddr::V4(ip) if !ip.is_unspecified() => {
                format!(" --host-resolver-rules=\"MAP localhost {ip}\"")
            }
            _ => String::new(),
        };
        println!(
            "  chromium --user-data-dir=$(mktemp -d) --enable-quic --origin-to-force-quic-on=localhost:{port}{resolve} \\\n    --ignore-certificate-errors-spki-list={spki} https://localhost:{port}/"
        );
    }
    println!("or: cargo run --release -- get --insecure -v https://localhost:{port}/hello.txt");
    let site = Arc::new(site);
    if let Some(l) = tcp {
        let tls = crate::tcp::server_tls(&identity, args.keylog.as_deref())?;
        let alt_svc = Some(format!("h3=\":{port}\"; ma=86400"));
        tokio::spawn(crate::tcp::serve(l, tls, site.clone(), alt_svc));
    }
    let serve = async {
        while let Some(connecting) = ep.accept().await {
            let site = site.clone();
            let alt_svc = Some(format!("h3=\":{port}\"; ma=86400"));
            tokio::spawn(async move {
                let remote = connecting.remote_address();
                // Serve at once: a 0-RTT request is answered in 0.5-RTT.
                let conn = match connecting.into_0rtt() {
                    Ok((conn, _)) => Ok(conn),
                    Err(c) => c.await,
                };
                match conn {
                    Ok(conn) if conn.alpn().as_deref() == Some(hq::ALPN) => {
                        hq::serve_connection(conn, site).await
                    }
                    Ok(conn) => crate::h3::serve_connection(conn, site, alt_svc).await,
                    Err(e) => tracing::info!(%remote, error = %e, "handshake failed"),
                }
            });
        }
    };
    tokio::select! {
        _ = serve => {}
        _ = tokio::signal::ctrl_c() => {
            println!("shutting down");
            ep.close(0, b"server shutting down");
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), ep.wait_idle()).await;
        }
    }
    Ok(())
}
