//! `kuai get`: fetch URLs over QUIC.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kuai::{ClientConfig, Endpoint};

use crate::hq;
use crate::keylog::FileKeyLog;
use crate::url::Url;

#[derive(clap::Args)]
pub struct Args {
    /// URLs to fetch (https://host:port/path); those on the same server share one connection.
    #[arg(required = true)]
    urls: Vec<String>,
    /// Write the body to this file (one URL only).
    #[arg(short = 'o', long)]
    output: Option<PathBuf>,
    /// Save each body under its own name in the current directory.
    #[arg(short = 'O', long)]
    remote_name: bool,
    /// Save each body under its own name in this directory.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Print timings, the negotiated parameters and connection statistics to stderr.
    #[arg(short, long)]
    pub verbose: bool,
    /// Do not verify the server's certificate (testing only).
    #[arg(long)]
    insecure: bool,
    /// Trust this CA certificate (PEM) instead of none.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Append TLS secrets to this file (NSS key log format).
    #[arg(long)]
    keylog: Option<PathBuf>,
    /// Give up if the connection is not up within this many seconds.
    #[arg(long, default_value_t = 10)]
    connect_timeout: u64,
    /// Write a qlog trace of the connection into this directory.
    #[arg(long)]
    qlog_dir: Option<PathBuf>,
    /// Application protocol: h3 (HTTP/3) or hq-interop (HTTP/0.9).
    #[arg(long, default_value = "h3")]
    alpn: String,
    /// Give up on the whole transfer after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_time: u64,
}

pub async fn run(args: Args) -> ExitCode {
    match fetch_all(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kuai get: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Builds the client TLS configuration from the trust options.
pub fn client_config(
    insecure: bool,
    ca: Option<&std::path::Path>,
    alpn: &[&[u8]],
    keylog: Option<&std::path::Path>,
) -> Result<ClientConfig, String> {
    let mut cfg = if insecure {
        ClientConfig::insecure(alpn).map_err(|e| e.to_string())?
    } else {
        let mut roots = rustls::RootCertStore::empty();
        if let Some(ca) = ca {
            use rustls_pki_types::pem::PemObject;
            for c in rustls_pki_types::CertificateDer::pem_file_iter(ca)
                .map_err(|e| format!("cannot read {}: {e}", ca.display()))?
            {
                let c = c.map_err(|e| format!("bad certificate in {}: {e}", ca.display()))?;
                roots
                    .add(c)
                    .map_err(|e| format!("bad certificate in {}: {e}", ca.display()))?;
            }
        } else {
            return Err("no trust anchors: pass --ca FILE, or --insecure for a test server".into());
        }
        ClientConfig::with_roots(roots, alpn).map_err(|e| e.to_string())?
    };
    if let Some(path) = keylog {
        let log =
            FileKeyLog::create(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        cfg.proto_mut().set_key_log(Arc::new(log));
    }
    Ok(cfg)
}

pub async fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let lookup = tokio::net::lookup_host((host, port));
    let addrs: Vec<SocketAddr> = tokio::time::timeout(Duration::from_secs(5), lookup)
        .await
        .map_err(|_| format!("{host}: name lookup timed out"))?
        .map_err(|e| format!("{host}: cannot resolve: {e}"))?
        .collect();
    // Prefer IPv4 loopback/addresses: our client socket is dual-stack either way.
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{host}: no address"))
}

async fn fetch_all(args: Args) -> Result<(), String> {
    let urls: Vec<Url> = args
        .urls
        .iter()
        .map(|u| Url::parse(u))
        .collect::<Result<_, _>>()?;
    if args.output.is_some() && urls.len() > 1 {
        return Err("-o takes one URL; use -O or --output-dir for several".into());
    }
    let first = &urls[0];
    if urls
        .iter()
        .any(|u| (u.host.as_str(), u.port) != (first.host.as_str(), first.port))
    {
        return Err("all URLs must be on the same server (one connection)".into());
    }
    let start = Instant::now();
    let addr = resolve(&first.host, first.port).await?;
    let resolved = start.elapsed();
    let alpn: &[u8] = match args.alpn.as_str() {
        "h3" => crate::h3::ALPN,
        "hq-interop" => hq::ALPN,
        other => return Err(format!("unknown ALPN {other:?} (h3 or hq-interop)")),
    };
    let cfg = client_config(
        args.insecure,
        args.ca.as_deref(),
        &[alpn],
        args.keylog.as_deref(),
    )?;
    let bind: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .expect("literal");
    let mut builder = Endpoint::builder();
    if let Some(d) = &args.qlog_dir {
        builder = builder.qlog_dir(d);
    }
    let ep = builder
        .bind(bind)
        .map_err(|e| format!("cannot open a UDP socket: {e}"))?;
    let connecting = ep
        .connect_with(cfg, addr, &first.host)
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(Duration::from_secs(args.connect_timeout), connecting)
        .await
        .map_err(|_| {
            format!(
                "{addr}: no answer within {} s (UDP blocked or server down?)",
                args.connect_timeout
            )
        })?
        .map_err(|e| format!("{addr}: {e}"))?;
    let connected = start.elapsed();
    let h3 = if alpn == crate::h3::ALPN {
        Some(
            kuai_h3::Client::new(conn.clone(), kuai_h3::Config::default())
                .await
                .map_err(|e| format!("HTTP/3: {e}"))?,
        )
    } else {
        None
    };
    let first_byte = Arc::new(std::sync::Mutex::new(None::<Duration>));
    // Progress bars for downloads to files when a person is watching.
    let bars = (std::io::IsTerminal::is_terminal(&std::io::stderr())
        && (args.output.is_some() || args.remote_name || args.output_dir.is_some()))
    .then(indicatif::MultiProgress::new);
    let mut tasks = Vec::new();
    for url in urls.clone() {
        let conn = conn.clone();
        let dest = match (&args.output, args.remote_name, &args.output_dir) {
            (Some(o), _, _) => Some(o.clone()),
            (None, _, Some(d)) => Some(d.join(url.file_name())),
            (None, true, None) => Some(PathBuf::from(url.file_name())),
            (None, false, None) => None,
        };
        let fb = first_byte.clone();
        let h3 = h3.clone();
        let bar = bars.as_ref().map(|m| {
            let b = m.add(indicatif::ProgressBar::new_spinner());
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} {msg} {bytes} ({bytes_per_sec}, {elapsed})",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            b.set_message(url.file_name());
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        tasks.push(tokio::spawn(async move {
            let mut out: Box<dyn Write + Send> = match &dest {
                Some(p) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p)
                        .map_err(|e| format!("cannot create {}: {e}", p.display()))?,
                )),
                None => Box::new(Vec::new()),
            };
            let mut body = Vec::new();
            let sink: &mut (dyn Write + Send) = if dest.is_some() { &mut *out } else { &mut body };
            let on_data = |total: u64| {
                if let Some(b) = &bar {
                    b.set_position(total);
                }
                let mut f = fb.lock().unwrap_or_else(|e| e.into_inner());
                if f.is_none() {
                    *f = Some(start.elapsed());
                }
            };
            let n = match &h3 {
                Some(client) => {
                    let (status, n) = crate::h3::get_to(client, &url, sink, on_data)
                        .await
                        .map_err(|e| format!("{url}: {e}"))?;
                    if !status.is_success() {
                        return Err(format!("{url}: {status}"));
                    }
                    n
                }
                None => hq::get_to(&conn, &url.path, sink, on_data)
                    .await
                    .map_err(|e| format!("{url}: {e}"))?,
            };
            out.flush().map_err(|e| format!("write failed: {e}"))?;
            if let Some(b) = &bar {
                b.finish();
            }
            Ok::<_, String>((url, n, body))
        }));
    }
    let overall = async {
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.map_err(|e| e.to_string())??);
        }
        Ok::<_, String>(results)
    };
    let results = if args.max_time > 0 {
        tokio::time::timeout(Duration::from_secs(args.max_time), overall)
            .await
            .map_err(|_| format!("not done within {} s", args.max_time))??
    } else {
        overall.await?
    };
    let total = start.elapsed();
    let mut stdout = std::io::stdout().lock();
    for (_, _, body) in &results {
        stdout.write_all(body).map_err(|e| format!("stdout: {e}"))?;
    }
    if args.verbose {
        let st = conn.stats();
        let bytes: u64 = results.iter().map(|r| r.1).sum();
        eprintln!(
            "* resolved {} to {addr} in {:.1} ms",
            first.host,
            ms(resolved)
        );
        eprintln!("* handshake done at {:.1} ms", ms(connected));
        if let Some(fb) = *first_byte.lock().unwrap_or_else(|e| e.into_inner()) {
            eprintln!("* first byte at {:.1} ms", ms(fb));
        }
        eprintln!(
            "* total {:.1} ms, {bytes} bytes in {} responses",
            ms(total),
            results.len()
        );
        eprintln!(
            "* {:?}, {}, ALPN {}, 0-RTT {}, resumed {}",
            st.version.unwrap_or(kuai::Version::V1),
            st.cipher_suite.as_deref().unwrap_or("?"),
            String::from_utf8_lossy(st.alpn.as_deref().unwrap_or(b"?")),
            if st.zero_rtt_accepted {
                "accepted"
            } else if st.zero_rtt_attempted {
                "rejected"
            } else {
                "not used"
            },
            st.resumed,
        );
        eprintln!(
            "* rtt {:.1} ms (min {:.1}), cwnd {} B, mtu {}, sent {} / received {} packets, lost {}",
            ms(st.path.rtt),
            ms(st.path.min_rtt),
            st.path.cwnd,
            st.path.mtu,
            st.packets_sent,
            st.packets_received,
            st.packets_lost
        );
    }
    conn.close(0, b"done");
    let _ = tokio::time::timeout(Duration::from_millis(300), ep.wait_idle()).await;
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
