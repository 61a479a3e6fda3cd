//! `kuai get`: fetch URLs over HTTP/3 (or HTTP/0.9 over QUIC), or over TCP + TLS with HTTP/2
//! or HTTP/1.1; with `--repeat`, a measurement loop that prints one JSON line per run.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kuai::{ClientConfig, Endpoint};

use crate::hq;
use crate::keylog::FileKeyLog;
use crate::tcp::{Proto, TcpClient};
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
    #[arg(long, default_value_t = 10.0)]
    connect_timeout: f64,
    /// Write a qlog trace of the connection into this directory.
    #[arg(long)]
    qlog_dir: Option<PathBuf>,
    /// HTTP/3 only: no fallback to TCP.
    #[arg(long, group = "protocol")]
    http3: bool,
    /// HTTP/2 over TCP + TLS 1.3 only.
    #[arg(long, group = "protocol")]
    http2: bool,
    /// HTTP/1.1 over TCP + TLS 1.3 only (up to --h1-connections in parallel).
    #[arg(long = "http1.1", group = "protocol")]
    http1: bool,
    /// HTTP/0.9 over QUIC (ALPN hq-interop), for interop tests.
    #[arg(long, group = "protocol")]
    hq: bool,
    /// Without a protocol flag: start TCP (HTTP/2) if the QUIC handshake is not done after
    /// this many milliseconds, and use whichever connects first.
    #[arg(long, default_value_t = 1000)]
    fallback_after_ms: u64,
    /// Parallel HTTP/1.1 connections (like a browser's per-host limit).
    #[arg(long, default_value_t = 6)]
    h1_connections: usize,
    /// Send the requests in 0-RTT when a session ticket from an earlier connection in this
    /// run allows (with --repeat and a new connection per run).
    #[arg(long = "0rtt")]
    zero_rtt: bool,
    /// Fetch the URLs this many times; print one JSON line per run to stdout (bodies are
    /// discarded unless saved to files).
    #[arg(long, default_value_t = 0)]
    repeat: u64,
    /// With --repeat: keep one connection for all runs (warm) instead of a new one per run.
    #[arg(long)]
    reuse: bool,
    /// Load the URLs like a page: the first one (the HTML) alone, then the others in parallel.
    #[arg(long)]
    page: bool,
    /// Milliseconds to wait between runs.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Give up on a fetch (one run with --repeat) after this many seconds (0: no limit). A
    /// run cut short reports the bytes it received until then.
    #[arg(long, default_value_t = 0.0)]
    max_time: f64,
    /// QUIC congestion control: bbr-adaptive (the default: BBRv3 that keeps its rate through
    /// random loss on an empty queue), bbr (BBRv3), bbr-loss-tolerant, cubic or newreno.
    #[arg(long)]
    cc: Option<kuai::CongestionAlgorithm>,
    /// QUIC initial congestion window in 1,200-byte packets (the library's default, 10, as
    /// RFC 9002 says, when not given).
    #[arg(long, value_name = "PACKETS", value_parser = clap::value_parser!(u32).range(2..=1000))]
    initial_window: Option<u32>,
    /// Never send redundant copies. By default, on a lossy path (2 % or more of packets
    /// lost), the last packets of each flight (up to 16) go out twice when there is nothing
    /// new to send.
    #[arg(long)]
    no_redundancy: bool,
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

/// An ephemeral local address of `peer`'s family, for a client socket.
pub fn any_port_for(peer: SocketAddr) -> SocketAddr {
    if peer.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    }
}

/// Which protocols a run may use.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// HTTP/3, falling back to HTTP/2 over TCP.
    Auto,
    H3,
    Hq,
    Tcp(Proto),
}

/// Longest wait for a session ticket before a connection that is done closes.
const TICKET_WAIT_MAX: Duration = Duration::from_millis(300);

/// One connection to the origin, whatever the protocol.
enum Session {
    H3 {
        conn: kuai::Connection,
        client: kuai_h3::Client,
        /// The requests went out in 0-RTT.
        early: bool,
    },
    Hq {
        conn: kuai::Connection,
        early: bool,
    },
    Tcp(TcpClient),
}

impl Session {
    fn protocol(&self) -> &'static str {
        match self {
            Session::H3 { .. } => "h3",
            Session::Hq { .. } => "hq-interop",
            Session::Tcp(c) => c.proto().name(),
        }
    }

    async fn get_to(
        &self,
        url: &Url,
        out: &mut (dyn Write + Send),
        progress: impl FnMut(u64),
    ) -> Result<u64, String> {
        let (status, n) = match self {
            Session::H3 { client, .. } => crate::h3::get_to(client, url, out, progress).await?,
            Session::Hq { conn, .. } => (
                http::StatusCode::OK,
                hq::get_to(conn, &url.path, out, progress).await?,
            ),
            Session::Tcp(c) => c.get_to(url, out, progress).await?,
        };
        if !status.is_success() {
            return Err(status.to_string());
        }
        Ok(n)
    }

    /// 0-RTT: "accepted", "rejected" or "none".
    fn zero_rtt(&self) -> &'static str {
        match self {
            Session::H3 { early: false, .. } | Session::Hq { early: false, .. } => "none",
            Session::H3 { conn, .. } | Session::Hq { conn, .. } => {
                let st = conn.stats();
                if st.zero_rtt_accepted {
                    "accepted"
                } else if st.zero_rtt_attempted {
                    "rejected"
                } else {
                    "none"
                }
            }
            Session::Tcp(_) => "none",
        }
    }

    fn resumed(&self) -> bool {
        match self {
            Session::H3 { conn, .. } | Session::Hq { conn, .. } => conn.stats().resumed,
            Session::Tcp(c) => c.info.resumed,
        }
    }

    /// Waits, a few round trips at most, for the server's session ticket: the server sends it
    /// only after the handshake, so a short exchange can end before it arrives and leave the
    /// next connection nothing to resume.
    async fn await_ticket(&self) {
        if let Session::H3 { conn, .. } | Session::Hq { conn, .. } = self {
            let bound =
                (conn.stats().path.rtt * 3).clamp(Duration::from_millis(20), TICKET_WAIT_MAX);
            let _ = tokio::time::timeout(bound, conn.session_ticket()).await;
        }
    }

    fn close(&self) {
        match self {
            Session::H3 { conn, .. } | Session::Hq { conn, .. } => conn.close(0, b"done"),
            // The TCP connections close when the client is dropped.
            Session::Tcp(_) => {}
        }
    }

    fn print_stats(&self) {
        match self {
            Session::H3 { conn, .. } | Session::Hq { conn, .. } => {
                let st = conn.stats();
                eprintln!(
                    "* {:?}, {}, ALPN {}, 0-RTT {}, resumed {}",
                    st.version.unwrap_or(kuai::Version::V1),
                    st.cipher_suite.unwrap_or("?"),
                    String::from_utf8_lossy(st.alpn.as_deref().unwrap_or(b"?")),
                    self.zero_rtt(),
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
                eprintln!(
                    "* server address {}, path migrations {}",
                    conn.remote_address(),
                    st.migrations
                );
            }
            Session::Tcp(c) => eprintln!(
                "* TCP + TLS 1.3, {}, ALPN {}, resumed {}",
                c.info.cipher_suite.as_deref().unwrap_or("?"),
                c.proto().name(),
                c.info.resumed
            ),
        }
    }
}

/// Everything needed to open sessions to one origin.
struct Origin {
    mode: Mode,
    addr: SocketAddr,
    host: String,
    ep: Option<Endpoint>,
    quic: ClientConfig,
    tcp_tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
    fallback_after: Duration,
    h1_connections: usize,
    zero_rtt: bool,
}

impl Origin {
    async fn connect(&self) -> Result<Session, String> {
        let limit = self.connect_timeout;
        let timeout = |what: &str| {
            format!(
                "{}: no {what} connection within {:.1} s",
                self.addr,
                limit.as_secs_f64()
            )
        };
        match self.mode {
            Mode::H3 | Mode::Hq => tokio::time::timeout(limit, self.connect_quic())
                .await
                .map_err(|_| timeout("QUIC (UDP blocked or server down?)"))?,
            Mode::Tcp(p) => tokio::time::timeout(limit, self.connect_tcp(p))
                .await
                .map_err(|_| timeout("TCP"))?,
            Mode::Auto => tokio::time::timeout(limit, self.connect_auto())
                .await
                .map_err(|_| timeout("QUIC or TCP"))?,
        }
    }

    /// HTTP/3 first; TCP (HTTP/2) joins the race when QUIC is slow, and takes over when it
    /// fails (UDP blocked).
    async fn connect_auto(&self) -> Result<Session, String> {
        let quic = self.connect_quic();
        tokio::pin!(quic);
        let quic_err = tokio::select! {
            r = &mut quic => match r {
                Ok(s) => return Ok(s),
                Err(e) => Some(e),
            },
            _ = tokio::time::sleep(self.fallback_after) => None,
        };
        let tcp = self.connect_tcp(Proto::H2);
        tokio::pin!(tcp);
        let Some(quic_err) = quic_err else {
            tracing::info!("QUIC is slow to connect; racing TCP");
            return tokio::select! {
                r = &mut quic => match r {
                    Ok(s) => Ok(s),
                    Err(e) => {
                        tracing::info!(error = %e, "HTTP/3 failed; falling back to HTTP/2");
                        tcp.await
                    }
                },
                r = &mut tcp => match r {
                    Ok(s) => Ok(s),
                    Err(_) => quic.await,
                },
            };
        };
        tracing::info!(error = %quic_err, "HTTP/3 failed; falling back to HTTP/2");
        tcp.await
            .map_err(|e| format!("HTTP/3: {quic_err}; HTTP/2: {e}"))
    }

    async fn connect_quic(&self) -> Result<Session, String> {
        let Some(ep) = &self.ep else {
            return Err("QUIC is not enabled".into());
        };
        let connecting = ep
            .connect_with(self.quic.clone(), self.addr, &self.host)
            .map_err(|e| e.to_string())?;
        let (conn, early) = if self.zero_rtt {
            match connecting.into_0rtt() {
                Ok((conn, _accepted)) => (conn, true),
                Err(c) => (c.await.map_err(|e| format!("{}: {e}", self.addr))?, false),
            }
        } else {
            let c = connecting
                .await
                .map_err(|e| format!("{}: {e}", self.addr))?;
            (c, false)
        };
        if self.mode == Mode::Hq {
            return Ok(Session::Hq { conn, early });
        }
        let client = kuai_h3::Client::new(conn.clone(), kuai_h3::Config::default())
            .await
            .map_err(|e| format!("HTTP/3: {e}"))?;
        Ok(Session::H3 {
            conn,
            client,
            early,
        })
    }

    async fn connect_tcp(&self, proto: Proto) -> Result<Session, String> {
        TcpClient::connect(
            proto,
            self.addr,
            &self.host,
            self.tcp_tls.clone(),
            self.h1_connections,
        )
        .await
        .map(Session::Tcp)
    }
}

/// The timings of one run, from its start.
#[derive(Default)]
struct RunReport {
    connected: Option<Duration>,
    first_byte: Option<Duration>,
    total: Duration,
    bytes: u64,
    responses: usize,
    error: Option<String>,
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
    let mode = if args.http3 {
        Mode::H3
    } else if args.http2 {
        Mode::Tcp(Proto::H2)
    } else if args.http1 {
        Mode::Tcp(Proto::H1)
    } else if args.hq {
        Mode::Hq
    } else {
        Mode::Auto
    };
    let start = Instant::now();
    let addr = resolve(&first.host, first.port).await?;
    let resolved = start.elapsed();
    let quic_alpn: &[u8] = if mode == Mode::Hq {
        hq::ALPN
    } else {
        crate::h3::ALPN
    };
    let mut cfg = client_config(
        args.insecure,
        args.ca.as_deref(),
        &[quic_alpn],
        args.keylog.as_deref(),
    )?;
    crate::set_transport(
        &mut cfg.proto_mut().transport,
        &args.cc,
        args.initial_window,
        args.no_redundancy,
    );
    let tcp_tls = cfg.proto_tls();
    let ep = if matches!(mode, Mode::Tcp(_)) {
        None
    } else {
        let bind = any_port_for(addr);
        let mut builder = Endpoint::builder();
        if let Some(d) = &args.qlog_dir {
            builder = builder.qlog_dir(d);
        }
        Some(
            builder
                .bind(bind)
                .map_err(|e| format!("cannot open a UDP socket: {e}"))?,
        )
    };
    let origin = Origin {
        mode,
        addr,
        host: first.host.clone(),
        ep,
        quic: cfg,
        tcp_tls,
        connect_timeout: Duration::from_secs_f64(args.connect_timeout.max(0.001)),
        fallback_after: Duration::from_millis(args.fallback_after_ms),
        h1_connections: args.h1_connections,
        zero_rtt: args.zero_rtt,
    };
    let max_time = (args.max_time > 0.0).then(|| Duration::from_secs_f64(args.max_time));

    if args.repeat > 0 {
        return repeat(&args, &origin, &urls, max_time).await;
    }

    let session = Arc::new(origin.connect().await?);
    let connected = start.elapsed();
    let progress = Arc::new(Progress::default());
    let work = fetch_urls(&args, &session, &urls, start, progress.clone(), true);
    let results = match max_time {
        Some(t) => tokio::time::timeout(t, work)
            .await
            .map_err(|_| format!("not done within {} s", args.max_time))??,
        None => work.await?,
    };
    let total = start.elapsed();
    let mut stdout = std::io::stdout().lock();
    for (_, body) in &results {
        stdout.write_all(body).map_err(|e| format!("stdout: {e}"))?;
    }
    if args.verbose {
        let bytes: u64 = results.iter().map(|r| r.0).sum();
        eprintln!(
            "* resolved {} to {addr} in {:.1} ms",
            first.host,
            ms(resolved)
        );
        eprintln!(
            "* {} connection up at {:.1} ms",
            session.protocol(),
            ms(connected)
        );
        if let Some(fb) = progress.first_byte() {
            eprintln!("* first byte at {:.1} ms", ms(fb));
        }
        eprintln!(
            "* total {:.1} ms, {bytes} bytes in {} responses",
            ms(total),
            results.len()
        );
        session.print_stats();
    }
    session.close();
    if let Some(ep) = &origin.ep {
        // Exit once the CONNECTION_CLOSE is out, without waiting out the closing period.
        let _ = tokio::time::timeout(Duration::from_millis(300), ep.flush()).await;
    }
    Ok(())
}

/// What a run has received so far, across its URLs: when the first byte came and how many.
#[derive(Default)]
struct Progress {
    first_byte: std::sync::Mutex<Option<Duration>>,
    bytes: std::sync::atomic::AtomicU64,
}

impl Progress {
    fn first_byte(&self) -> Option<Duration> {
        *self.first_byte.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bytes(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Fetches every URL in parallel on `session`; returns (bytes, body kept for stdout) per URL.
async fn fetch_urls(
    args: &Args,
    session: &Arc<Session>,
    urls: &[Url],
    start: Instant,
    progress: Arc<Progress>,
    keep_bodies: bool,
) -> Result<Vec<(u64, Vec<u8>)>, String> {
    // Progress bars for downloads to files when a person is watching.
    let bars = (args.repeat == 0
        && std::io::IsTerminal::is_terminal(&std::io::stderr())
        && (args.output.is_some() || args.remote_name || args.output_dir.is_some()))
    .then(indicatif::MultiProgress::new);
    let mut tasks = Vec::new();
    let mut page_html = None;
    for (i, url) in urls.iter().enumerate() {
        if args.page && i == 1 {
            // The page's resources are known once its HTML is in.
            let t: tokio::task::JoinHandle<Result<(u64, Vec<u8>), String>> =
                tasks.pop().expect("the HTML task");
            page_html = Some(t.await.map_err(|e| e.to_string())??);
        }
        let url = url.clone();
        let session = session.clone();
        let dest = match (&args.output, args.remote_name, &args.output_dir) {
            (Some(o), _, _) => Some(o.clone()),
            (None, _, Some(d)) => Some(d.join(url.file_name())),
            (None, true, None) => Some(PathBuf::from(url.file_name())),
            (None, false, None) => None,
        };
        let progress = progress.clone();
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
            let mut file: Option<Box<dyn Write + Send>> = match &dest {
                Some(p) => Some(Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p)
                        .map_err(|e| format!("cannot create {}: {e}", p.display()))?,
                ))),
                None => None,
            };
            let mut body = Vec::new();
            let mut discard = std::io::sink();
            let sink: &mut (dyn Write + Send) = match &mut file {
                Some(f) => &mut **f,
                None if keep_bodies => &mut body,
                None => &mut discard,
            };
            let mut seen = 0u64;
            let on_data = |total: u64| {
                if let Some(b) = &bar {
                    b.set_position(total);
                }
                progress.bytes.fetch_add(
                    total.saturating_sub(seen),
                    std::sync::atomic::Ordering::Relaxed,
                );
                seen = seen.max(total);
                let mut f = progress
                    .first_byte
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if f.is_none() {
                    *f = Some(start.elapsed());
                }
            };
            let n = session
                .get_to(&url, sink, on_data)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            if let Some(f) = &mut file {
                f.flush().map_err(|e| format!("write failed: {e}"))?;
            }
            if let Some(b) = &bar {
                b.finish();
            }
            Ok::<_, String>((n, body))
        }));
    }
    let mut results: Vec<(u64, Vec<u8>)> = page_html.into_iter().collect();
    let mut failure = None;
    for t in tasks {
        match t.await.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok(r) => results.push(r),
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(results),
    }
}

/// `--repeat`: runs the fetch again and again and prints one JSON line per run.
async fn repeat(
    args: &Args,
    origin: &Origin,
    urls: &[Url],
    max_time: Option<Duration>,
) -> Result<(), String> {
    let mut session: Option<Arc<Session>> = None;
    let mut failed = 0u64;
    let mut stdout = std::io::stdout();
    for run in 0..args.repeat {
        if run > 0 && args.interval_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
        }
        let start = Instant::now();
        let mut report = RunReport::default();
        let new_connection = session.is_none() || !args.reuse;
        let progress = Arc::new(Progress::default());
        let work = async {
            if new_connection {
                if let Some(old) = session.take() {
                    old.close();
                }
                session = Some(Arc::new(origin.connect().await?));
                report.connected = Some(start.elapsed());
            }
            let s = session.as_ref().expect("connected").clone();
            fetch_urls(args, &s, urls, start, progress.clone(), false).await
        };
        let r = match max_time {
            Some(t) => tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| Err(format!("not done within {} s", args.max_time))),
            None => work.await,
        };
        report.total = start.elapsed();
        report.first_byte = progress.first_byte();
        match r {
            Ok(results) => {
                report.bytes = results.iter().map(|r| r.0).sum();
                report.responses = results.len();
            }
            Err(e) => {
                // A run cut short (--max-time) reports what it received until then.
                report.bytes = progress.bytes();
                report.error = Some(e);
                failed += 1;
            }
        }
        let line = run_json(run, new_connection, session.as_deref(), &report);
        writeln!(stdout, "{line}").map_err(|e| format!("stdout: {e}"))?;
        if report.error.is_some() {
            // A connection that failed a run is not trusted with the next one.
            if let Some(old) = session.take() {
                old.close();
            }
        }
        if !args.reuse
            && run + 1 < args.repeat
            && let Some(s) = &session
        {
            s.await_ticket().await;
        }
        if args.verbose
            && let Some(s) = &session
        {
            s.print_stats();
        }
    }
    if let Some(s) = session.take() {
        s.close();
    }
    if let Some(ep) = &origin.ep {
        let _ = tokio::time::timeout(Duration::from_millis(300), ep.flush()).await;
    }
    if failed > 0 {
        return Err(format!("{failed} of {} runs failed", args.repeat));
    }
    Ok(())
}

fn run_json(run: u64, new_connection: bool, session: Option<&Session>, r: &RunReport) -> String {
    let opt = |d: Option<Duration>| d.map_or("null".to_string(), |d| format!("{:.3}", ms(d)));
    let error = match &r.error {
        Some(e) => format!("\"{}\"", kuai::qlog::json_escape(e)),
        None => "null".into(),
    };
    format!(
        "{{\"run\":{run},\"ok\":{},\"protocol\":\"{}\",\"new_connection\":{new_connection},\"connect_ms\":{},\"first_byte_ms\":{},\"total_ms\":{:.3},\"bytes\":{},\"responses\":{},\"zero_rtt\":\"{}\",\"resumed\":{},\"error\":{error}}}",
        r.error.is_none(),
        session.map_or("none", |s| s.protocol()),
        opt(r.connected),
        opt(r.first_byte),
        ms(r.total),
        r.bytes,
        r.responses,
        session.map_or("none", |s| s.zero_rtt()),
        session.is_some_and(|s| s.resumed()),
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
