//! `kuai get`: a curl-like client over `kuai_http::Client` (HTTP/3 raced against HTTP/2 and
//! HTTP/1.1 over TCP, or one protocol); with `--repeat`, a measurement loop that prints one
//! JSON line per run.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method};
use kuai_http::{Client, Mode, Protocol, RequestBody, Response};

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
    /// An extra request header, "Name: value" (repeatable).
    #[arg(short = 'H', long = "header", value_name = "HEADER")]
    headers: Vec<String>,
    /// The request method (GET by default; POST with -d).
    #[arg(short = 'X', long = "request", value_name = "METHOD")]
    method: Option<String>,
    /// Send this as the body (POST): a string, or @FILE read whole with its line breaks
    /// removed, as curl does; content type application/x-www-form-urlencoded.
    #[arg(short = 'd', long = "data", value_name = "DATA")]
    data: Option<String>,
    /// Send this as the body exactly: a string, or @FILE streamed as it is.
    #[arg(long = "data-binary", value_name = "DATA", conflicts_with = "data")]
    data_binary: Option<String>,
    /// HEAD: print the response head only.
    #[arg(short = 'I', long = "head")]
    head: bool,
    /// Follow redirects (up to 20), to other servers and protocols too.
    #[arg(short = 'L', long = "location")]
    location: bool,
    /// After each transfer, print this to stdout with curl's variables filled in:
    /// %{http_code} %{http_version} %{time_namelookup} %{time_connect} %{time_appconnect}
    /// %{time_starttransfer} %{time_total} %{size_download} %{remote_ip} %{remote_port}
    /// %{url_effective} %{num_redirects}.
    #[arg(short = 'w', long = "write-out", value_name = "FORMAT")]
    write_out: Option<String>,
    /// Connect to ADDR for HOST:PORT instead of resolving HOST (repeatable), as curl's
    /// --resolve; several addresses (HOST:PORT:ADDR1,ADDR2,...) are tried in turn.
    #[arg(long, value_name = "HOST:PORT:ADDR")]
    resolve: Vec<String>,
    /// Do not verify the server's certificate (testing only).
    #[arg(short = 'k', long)]
    insecure: bool,
    /// Also trust the CA certificates in this PEM file (the system's are trusted already).
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
    /// Without a protocol flag: start TCP if the QUIC handshake is not done after this many
    /// milliseconds (by default 1.5 x the RTT last measured to the server, 250 ms when none
    /// is known); TCP starts at once when the server's host refuses the UDP port.
    #[arg(long)]
    fallback_after_ms: Option<u64>,
    /// Parallel HTTP/1.1 connections (like a browser's per-host limit).
    #[arg(long, default_value_t = 6)]
    h1_connections: usize,
    /// Send safe requests (GET, HEAD, OPTIONS) in 0-RTT when a session from an earlier connection allows
    /// (the default; kept for scripts that pass it).
    #[arg(long = "0rtt", conflicts_with = "no_zero_rtt")]
    zero_rtt: bool,
    /// Never send requests in 0-RTT (resumed connections send them after the handshake).
    #[arg(long = "no-0rtt")]
    no_zero_rtt: bool,
    /// Keep what the client learns (Alt-Svc, HTTP/3 broken on a network, RTTs) in this file
    /// (by default $XDG_CACHE_HOME/kuai/client-state or ~/.cache/kuai/client-state; "none":
    /// in memory only).
    #[arg(long, value_name = "FILE")]
    state_file: Option<String>,
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

/// Where the client keeps what it learns, unless told otherwise.
fn default_state_file() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kuai").join("client-state"))
}

/// The client the flags describe.
fn build_client(args: &Args) -> Result<Client, String> {
    let mode = if args.http3 {
        Mode::Http3
    } else if args.http2 {
        Mode::Http2
    } else if args.http1 {
        Mode::Http11
    } else if args.hq {
        Mode::Http09
    } else {
        Mode::Auto
    };
    let mut b = Client::builder()
        .mode(mode)
        .danger_accept_invalid_certs(args.insecure)
        .connect_timeout(
            Duration::try_from_secs_f64(args.connect_timeout.max(0.001)).map_err(|_| {
                format!("--connect-timeout {}: not a duration", args.connect_timeout)
            })?,
        )
        .http1_max_connections(args.h1_connections)
        .early_data(!args.no_zero_rtt)
        .redirects(if args.location { 20 } else { 0 });
    if let Some(ms) = args.fallback_after_ms {
        b = b.race_delay(Duration::from_millis(ms));
    }
    if let Some(ca) = &args.ca {
        use rustls_pki_types::pem::PemObject;
        for c in rustls_pki_types::CertificateDer::pem_file_iter(ca)
            .map_err(|e| format!("cannot read {}: {e}", ca.display()))?
        {
            b = b.add_root_certificate(
                c.map_err(|e| format!("bad certificate in {}: {e}", ca.display()))?,
            );
        }
    }
    if let Some(path) = &args.keylog {
        let log =
            FileKeyLog::create(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        b = b.keylog(Arc::new(log));
    }
    if let Some(d) = &args.qlog_dir {
        b = b.qlog_dir(d);
    }
    if args.cc.is_some() || args.initial_window.is_some() || args.no_redundancy {
        let mut t = Arc::new(kuai::TransportConfig::default());
        crate::set_transport(&mut t, &args.cc, args.initial_window, args.no_redundancy);
        b = b.transport((*t).clone());
    }
    match args.state_file.as_deref() {
        Some("none") => {}
        Some(p) => b = b.state_file(p),
        // A measurement loop starts from nothing learned, so runs do not depend on history.
        None if args.repeat > 0 => {}
        None => {
            if let Some(p) = default_state_file() {
                b = b.state_file(p);
            }
        }
    }
    for r in &args.resolve {
        let bad = || format!("--resolve {r}: expected HOST:PORT:ADDR[,ADDR]...");
        let (host, rest) = r.split_once(':').ok_or_else(bad)?;
        let (port, addrs) = rest.split_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        for addr in addrs.split(',') {
            let ip: std::net::IpAddr = addr
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .map_err(|_| bad())?;
            b = b.resolve(host, port, SocketAddr::new(ip, port));
        }
    }
    b.build().map_err(|e| e.to_string())
}

/// The bytes of `@source` for -d / --data-binary: a file, or standard input for `-`.
fn read_source(f: &str) -> Result<Vec<u8>, String> {
    if f == "-" {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)
            .map_err(|e| format!("cannot read standard input: {e}"))?;
        return Ok(v);
    }
    std::fs::read(f).map_err(|e| format!("cannot read {f}: {e}"))
}

/// The request body and its content type, from -d / --data-binary.
enum Upload {
    None,
    Bytes(Bytes, Option<&'static str>),
    File(PathBuf),
}

impl Upload {
    fn from_args(args: &Args) -> Result<Self, String> {
        if let Some(d) = &args.data {
            let bytes = match d.strip_prefix('@') {
                Some(f) => {
                    let raw = read_source(f)?;
                    raw.into_iter()
                        .filter(|&b| b != b'\n' && b != b'\r')
                        .collect()
                }
                None => d.as_bytes().to_vec(),
            };
            return Ok(Upload::Bytes(
                Bytes::from(bytes),
                Some("application/x-www-form-urlencoded"),
            ));
        }
        if let Some(d) = &args.data_binary {
            return Ok(match d.strip_prefix('@') {
                // A regular file streams with its length; standard input (`@-`, as curl),
                // a pipe or a device is read whole first: its size says nothing (a pipe's
                // is 0, which sent an empty body).
                Some(f) if f != "-" && std::fs::metadata(f).is_ok_and(|m| m.is_file()) => {
                    Upload::File(PathBuf::from(f))
                }
                Some(f) => Upload::Bytes(Bytes::from(read_source(f)?), None),
                None => Upload::Bytes(Bytes::from(d.clone().into_bytes()), None),
            });
        }
        Ok(Upload::None)
    }

    fn is_some(&self) -> bool {
        !matches!(self, Upload::None)
    }

    async fn body(&self) -> Result<RequestBody, String> {
        Ok(match self {
            Upload::None => RequestBody::empty(),
            Upload::Bytes(b, _) => RequestBody::from(b.clone()),
            Upload::File(p) => {
                let f = tokio::fs::File::open(p)
                    .await
                    .map_err(|e| format!("cannot open {}: {e}", p.display()))?;
                let len = f.metadata().await.map_err(|e| e.to_string())?.len();
                let chunks = kuai_http::fs::FileChunks::new(f.into_std().await, len);
                RequestBody::wrap(kuai_http::FileBody::file(chunks))
            }
        })
    }

    fn length(&self) -> Option<u64> {
        match self {
            Upload::None => None,
            Upload::Bytes(b, _) => Some(b.len() as u64),
            Upload::File(p) => std::fs::metadata(p).ok().map(|m| m.len()),
        }
    }
}

/// What each request of a run shares.
struct Plan {
    client: Client,
    method: Method,
    headers: Vec<(http::HeaderName, HeaderValue)>,
    upload: Upload,
}

/// One transfer's outcome.
struct Fetched {
    resp: Option<Response>,
    bytes: u64,
    redirects: u32,
    url: String,
}

impl Plan {
    fn from_args(args: &Args, client: Client) -> Result<Self, String> {
        let upload = Upload::from_args(args)?;
        let method = match &args.method {
            Some(m) => Method::from_bytes(m.as_bytes()).map_err(|_| format!("bad method {m}"))?,
            None if args.head => Method::HEAD,
            None if upload.is_some() => Method::POST,
            None => Method::GET,
        };
        let mut headers = Vec::new();
        if let Upload::Bytes(_, Some(ct)) = &upload {
            headers.push((http::header::CONTENT_TYPE, HeaderValue::from_static(ct)));
        }
        if let Some(n) = upload.length() {
            headers.push((http::header::CONTENT_LENGTH, HeaderValue::from(n)));
        }
        // The fields set above give way to the user's of the same name; the user's own
        // repeated ones all go (two -H lines of one name are two field lines).
        let mut user: Vec<(http::HeaderName, HeaderValue)> = Vec::new();
        for h in &args.headers {
            let (n, v) = h
                .split_once(':')
                .ok_or_else(|| format!("-H {h:?}: expected \"Name: value\""))?;
            let n = http::HeaderName::from_bytes(n.trim().as_bytes())
                .map_err(|_| format!("-H {h:?}: bad header name"))?;
            let v = HeaderValue::from_str(v.trim())
                .map_err(|_| format!("-H {h:?}: bad header value"))?;
            user.push((n, v));
        }
        headers.retain(|(auto, _)| user.iter().all(|(n, _)| n != auto));
        headers.append(&mut user);
        Ok(Self {
            client,
            method,
            headers,
            upload,
        })
    }

    /// Sends the request for `url` (the client follows redirects with -L).
    async fn send(&self, url: &str) -> Result<Fetched, String> {
        let mut req = self.client.request(self.method.clone(), url);
        for (n, v) in &self.headers {
            req = req.header(n.clone(), v.clone());
        }
        let resp = req
            .body(self.upload.body().await?)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        Ok(Fetched {
            redirects: resp.redirects(),
            url: resp.url().to_string(),
            resp: Some(resp),
            bytes: 0,
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Http3 => "h3",
        Protocol::Http2 => "h2",
        Protocol::Http11 => "http/1.1",
        _ => "hq-interop",
    }
}

/// The response head as curl -I prints it.
fn head_text(resp: &Response) -> String {
    let version = match resp.protocol() {
        Protocol::Http3 => "HTTP/3",
        Protocol::Http2 => "HTTP/2",
        Protocol::Http11 => "HTTP/1.1",
        _ => "HTTP/0.9",
    };
    let mut s = format!("{version} {}\r\n", resp.status().as_u16());
    for (n, v) in resp.headers() {
        s += &format!("{n}: {}\r\n", String::from_utf8_lossy(v.as_bytes()));
    }
    s + "\r\n"
}

/// curl's -w with the variables kuai knows.
fn write_out(format: &str, f: &Fetched) -> String {
    let secs = |d: Option<Duration>| format!("{:.6}", d.map_or(0.0, |d| d.as_secs_f64()));
    let mut out = format.replace("\\n", "\n").replace("\\t", "\t");
    let Some(resp) = &f.resp else { return out };
    let t = resp.timings();
    let vars = [
        ("http_code", resp.status().as_u16().to_string()),
        (
            "http_version",
            match resp.protocol() {
                Protocol::Http3 => "3".into(),
                Protocol::Http2 => "2".into(),
                Protocol::Http11 => "1.1".into(),
                _ => "0.9".into(),
            },
        ),
        ("time_namelookup", secs(Some(t.dns))),
        ("time_connect", secs(Some(t.tcp.unwrap_or(t.connect)))),
        ("time_appconnect", secs(Some(t.connect))),
        ("time_starttransfer", secs(Some(t.first_byte))),
        ("time_total", secs(t.total)),
        ("size_download", f.bytes.to_string()),
        ("remote_ip", resp.remote_addr().ip().to_string()),
        ("remote_port", resp.remote_addr().port().to_string()),
        ("url_effective", f.url.clone()),
        ("num_redirects", f.redirects.to_string()),
    ];
    for (k, v) in vars {
        out = out.replace(&format!("%{{{k}}}"), &v);
    }
    out
}

/// What a run has received so far, across its URLs: when the first byte came and how many.
#[derive(Default)]
struct Progress {
    first_byte: std::sync::Mutex<Option<Duration>>,
    bytes: AtomicU64,
    /// The protocol of the first response head, for a run cut short before its end.
    protocol: std::sync::OnceLock<kuai_http::Protocol>,
}

impl Progress {
    fn first_byte(&self) -> Option<Duration> {
        *self.first_byte.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn saw(&self, n: u64, start: Instant) {
        self.bytes.fetch_add(n, Relaxed);
        let mut f = self.first_byte.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(start.elapsed());
        }
    }
}

/// Where a body goes.
enum Sink {
    File(Batched),
    /// Standard output as the body comes (one URL).
    Stdout,
    /// Held until the responses before it are printed (several URLs to standard output),
    /// [`MAX_HELD_BODY`] at most.
    Memory(Vec<u8>),
    Discard,
}

/// The most of one body held in memory for standard output: past it the transfer fails
/// (`-o`, `-O` or `--output-dir` write any size), so an endless or huge response cannot
/// take the machine's memory.
const MAX_HELD_BODY: usize = 256 << 20;

/// A file written in large pieces: received chunks (often a packet's worth each) are gathered
/// into a 1 MiB buffer that goes out with one `write`. (Handing the chunks to `writev` as they
/// are, without the copy, cost more on tmpfs: about 1.7 s per GiB against the copy's 0.1.)
struct Batched {
    file: std::fs::File,
    buf: Vec<u8>,
}

impl Batched {
    const BATCH: usize = 1 << 20;

    fn new(file: std::fs::File) -> Self {
        Self {
            file,
            buf: Vec::with_capacity(Self::BATCH),
        }
    }

    fn write(&mut self, chunk: Bytes) -> std::io::Result<()> {
        if self.buf.len() + chunk.len() > Self::BATCH {
            self.flush()?;
        }
        if chunk.len() >= Self::BATCH {
            return self.file.write_all(&chunk);
        }
        self.buf.extend_from_slice(&chunk);
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

/// A transfer that fails or runs out of time leaves in the file every byte it received
/// (and reported), as curl does; the error is what the command says.
impl Drop for Batched {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Fetches every URL in parallel (the first alone with --page); the outcome and the body
/// kept for stdout, per URL.
/// Writes `b` to standard output.
fn to_stdout(b: &[u8]) -> Result<(), String> {
    std::io::stdout()
        .lock()
        .write_all(b)
        .map_err(|e| format!("stdout: {e}"))
}

async fn fetch_urls(
    args: &Args,
    plan: &Arc<Plan>,
    urls: &[Url],
    start: Instant,
    progress: Arc<Progress>,
    keep_bodies: bool,
) -> Result<Vec<(Fetched, Vec<u8>)>, String> {
    // Progress bars for downloads to files when a person is watching.
    let bars = (args.repeat == 0
        && std::io::IsTerminal::is_terminal(&std::io::stderr())
        && (args.output.is_some() || args.remote_name || args.output_dir.is_some()))
    .then(indicatif::MultiProgress::new);
    let print_head = args.head && args.repeat == 0;
    // One URL's body goes to standard output as it comes; several are printed in turn.
    let stream_stdout = urls.len() == 1 && !args.page;
    let dests: Vec<Option<PathBuf>> = urls
        .iter()
        .map(
            |url| match (&args.output, args.remote_name, &args.output_dir) {
                (Some(o), _, _) => Some(o.clone()),
                (None, _, Some(d)) => Some(d.join(url.file_name())),
                (None, true, None) => Some(PathBuf::from(url.file_name())),
                (None, false, None) => None,
            },
        )
        .collect();
    // Two transfers writing one file at once leave a mix of both bodies.
    for (i, d) in dests.iter().enumerate() {
        if let Some(d) = d
            && let Some(j) = dests[..i].iter().position(|e| e.as_ref() == Some(d))
        {
            return Err(format!(
                "{} and {} would both be saved as {}",
                urls[j],
                urls[i],
                d.display()
            ));
        }
    }
    let mut tasks = Vec::new();
    // The transfers end with this call, also when it is dropped unfinished (--max-time):
    // they went on downloading (and writing their files) under the next runs.
    let mut aborts = AbortOnDrop(Vec::new());
    let mut page_html = None;
    for (i, url) in urls.iter().enumerate() {
        if args.page && i == 1 {
            // The page's resources are known once its HTML is in.
            let t: tokio::task::JoinHandle<Result<(Fetched, Vec<u8>), String>> =
                tasks.pop().expect("the HTML task");
            page_html = Some(t.await.map_err(|e| e.to_string())??);
        }
        let url = url.clone();
        let plan = plan.clone();
        let dest = dests[i].clone();
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
            let mut f = plan.send(&url.to_string()).await?;
            // An error answer (which fails the command, as curl --fail) leaves an existing
            // file as it was.
            let failed = f
                .resp
                .as_ref()
                .is_some_and(|r| r.status().is_client_error() || r.status().is_server_error());
            let mut sink = match &dest {
                Some(_) if failed => Sink::Discard,
                Some(p) => Sink::File(Batched::new(
                    std::fs::File::create(p)
                        .map_err(|e| format!("cannot create {}: {e}", p.display()))?,
                )),
                None if keep_bodies && stream_stdout => Sink::Stdout,
                None if keep_bodies => Sink::Memory(Vec::new()),
                None => Sink::Discard,
            };
            let resp = f.resp.as_mut().expect("a response");
            let _ = progress.protocol.set(resp.connection().protocol);
            if print_head {
                match &mut sink {
                    Sink::Memory(v) => v.extend_from_slice(head_text(resp).as_bytes()),
                    Sink::Stdout => to_stdout(head_text(resp).as_bytes())?,
                    Sink::File(file) => file
                        .write(Bytes::from(head_text(resp)))
                        .map_err(|e| format!("write failed: {e}"))?,
                    Sink::Discard => {}
                }
            }
            while let Some(chunk) = resp.chunk().await.map_err(|e| format!("{url}: {e}"))? {
                f.bytes += chunk.len() as u64;
                progress.saw(chunk.len() as u64, start);
                if let Some(b) = &bar {
                    b.set_position(f.bytes);
                }
                match &mut sink {
                    Sink::File(file) => file
                        .write(chunk)
                        .map_err(|e| format!("write failed: {e}"))?,
                    Sink::Stdout if !print_head => to_stdout(&chunk)?,
                    Sink::Memory(v) if !print_head => {
                        if v.len() + chunk.len() > MAX_HELD_BODY {
                            return Err(format!(
                                "{url}: the body passed {} MiB held for standard output; \
                                 write it with -o, -O or --output-dir",
                                MAX_HELD_BODY >> 20
                            ));
                        }
                        v.extend_from_slice(&chunk)
                    }
                    _ => {}
                }
            }
            if let Sink::Stdout = sink {
                std::io::stdout()
                    .flush()
                    .map_err(|e| format!("stdout: {e}"))?;
            }
            if let Sink::File(file) = &mut sink {
                file.flush().map_err(|e| format!("write failed: {e}"))?;
            }
            if let Some(b) = &bar {
                b.finish();
            }
            if !resp.status().is_success() && !resp.status().is_redirection() {
                tracing::debug!(%url, status = %resp.status(), "not a success");
            }
            let body = match sink {
                Sink::Memory(v) => v,
                _ => Vec::new(),
            };
            Ok::<_, String>((f, body))
        }));
        if let Some(t) = tasks.last() {
            aborts.0.push(t.abort_handle());
        }
    }
    let mut results: Vec<(Fetched, Vec<u8>)> = page_html.into_iter().collect();
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

fn print_stats(resp: &Response) {
    let c = resp.connection();
    match &c.quic {
        Some(st) => {
            let zero_rtt = match c.early_data {
                Some(true) => "accepted",
                Some(false) => "rejected",
                None => "none",
            };
            eprintln!(
                "* {:?}, {}, ALPN {}, 0-RTT {zero_rtt}, resumed {}",
                st.version.unwrap_or(kuai::Version::V1),
                st.cipher_suite.unwrap_or("?"),
                String::from_utf8_lossy(st.alpn.as_deref().unwrap_or(b"?")),
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
                c.remote, st.migrations
            );
        }
        None => eprintln!(
            "* TCP + TLS 1.3, {}, ALPN {}, resumed {}",
            c.cipher_suite.as_deref().unwrap_or("?"),
            protocol_name(c.protocol),
            c.resumed
        ),
    }
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
    let client = build_client(&args)?;
    let plan = Arc::new(Plan::from_args(&args, client.clone())?);
    let max_time = match args.max_time {
        t if t > 0.0 => Some(
            Duration::try_from_secs_f64(t)
                .map_err(|_| format!("--max-time {t}: not a duration"))?,
        ),
        _ => None,
    };
    if args.repeat > 0 {
        return repeat(&args, &plan, &urls, max_time).await;
    }
    let start = Instant::now();
    let progress = Arc::new(Progress::default());
    let work = fetch_urls(&args, &plan, &urls, start, progress.clone(), true);
    let results = match max_time {
        Some(t) => tokio::time::timeout(t, work)
            .await
            .map_err(|_| format!("not done within {} s", args.max_time))??,
        None => work.await?,
    };
    let total = start.elapsed();
    let mut stdout = std::io::stdout().lock();
    for (f, body) in &results {
        stdout.write_all(body).map_err(|e| format!("stdout: {e}"))?;
        if let Some(w) = &args.write_out {
            stdout
                .write_all(write_out(w, f).as_bytes())
                .map_err(|e| format!("stdout: {e}"))?;
        }
    }
    // What the standard output could not take fails the command (a full disk, a closed
    // pipe), as curl does.
    stdout.flush().map_err(|e| format!("stdout: {e}"))?;
    if args.verbose
        && let Some((f, _)) = results.first()
        && let Some(resp) = &f.resp
    {
        let t = resp.timings();
        let bytes: u64 = results.iter().map(|r| r.0.bytes).sum();
        eprintln!(
            "* {} at {}: resolved in {:.1} ms",
            urls[0].host,
            resp.remote_addr(),
            ms(t.dns)
        );
        if t.reused {
            eprintln!("* {} connection reused", protocol_name(resp.protocol()));
        } else {
            eprintln!(
                "* {} connection up at {:.1} ms",
                protocol_name(resp.protocol()),
                ms(t.connect)
            );
        }
        if let Some(fb) = progress.first_byte() {
            eprintln!("* first byte at {:.1} ms", ms(fb));
        }
        eprintln!(
            "* total {:.1} ms, {bytes} bytes in {} responses",
            ms(total),
            results.len()
        );
        print_stats(resp);
    }
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(f, _)| f.resp.as_ref())
        .filter(|r| {
            r.status().is_client_error()
                || r.status().is_server_error()
                // With -L a redirect that is still the answer was not followed (an
                // upload streamed from a file cannot be sent again): not the download.
                || (args.location
                    && r.status().is_redirection()
                    && r.status() != http::StatusCode::NOT_MODIFIED
                    && r.headers().contains_key(http::header::LOCATION))
        })
        .map(|r| format!("{}: {}", r.url(), r.status()))
        .collect();
    client.close_connections();
    // An error status fails the command (as curl --fail does), unless -w reports it.
    if let Some(e) = failed.first()
        && args.write_out.is_none()
    {
        return Err(e.clone());
    }
    Ok(())
}

/// The timings of one run, from its start.
#[derive(Default)]
struct RunReport {
    connected: Option<Duration>,
    first_byte: Option<Duration>,
    total: Duration,
    bytes: u64,
    responses: usize,
    protocol: Option<Protocol>,
    zero_rtt: &'static str,
    resumed: bool,
    error: Option<String>,
}

/// Aborts tasks when dropped.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for a in &self.0 {
            a.abort();
        }
    }
}

/// `--repeat`: runs the fetch again and again and prints one JSON line per run.
async fn repeat(
    args: &Args,
    plan: &Arc<Plan>,
    urls: &[Url],
    max_time: Option<Duration>,
) -> Result<(), String> {
    let mut failed = 0u64;
    let mut stdout = std::io::stdout();
    let mut connected_once = false;
    for run in 0..args.repeat {
        if run > 0 && args.interval_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
        }
        let new_connection = !connected_once || !args.reuse;
        if new_connection && run > 0 {
            plan.client.close_connections();
        }
        let start = Instant::now();
        let progress = Arc::new(Progress::default());
        let work = fetch_urls(args, plan, urls, start, progress.clone(), false);
        let r = match max_time {
            Some(t) => tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| Err(format!("not done within {} s", args.max_time))),
            None => work.await,
        };
        let mut report = RunReport {
            total: start.elapsed(),
            first_byte: progress.first_byte(),
            zero_rtt: "none",
            ..RunReport::default()
        };
        match r {
            Ok(results) => {
                report.bytes = results.iter().map(|r| r.0.bytes).sum();
                report.responses = results.len();
                // An error answer fails the run, as it fails a single fetch.
                if let Some(status) = results
                    .iter()
                    .filter_map(|r| r.0.resp.as_ref().map(|r| r.status()))
                    .find(|s| s.is_client_error() || s.is_server_error())
                {
                    report.error = Some(format!("HTTP {status}"));
                    failed += 1;
                }
                if let Some(resp) = results.first().and_then(|r| r.0.resp.as_ref()) {
                    let t = resp.timings();
                    connected_once = true;
                    if !t.reused {
                        report.connected = Some(t.connect);
                    }
                    let c = resp.connection();
                    report.protocol = Some(c.protocol);
                    report.resumed = c.resumed;
                    report.zero_rtt = match c.early_data {
                        Some(true) => "accepted",
                        Some(false) => "rejected",
                        None => "none",
                    };
                    if args.verbose {
                        print_stats(resp);
                    }
                }
            }
            Err(e) => {
                // A run cut short (--max-time) reports what it received until then, and over
                // which protocol.
                report.bytes = progress.bytes.load(Relaxed);
                report.protocol = progress.protocol.get().copied();
                report.error = Some(e);
                failed += 1;
                // A connection that failed a run is not trusted with the next one.
                plan.client.close_connections();
                connected_once = false;
            }
        }
        let line = run_json(run, new_connection, &report);
        writeln!(stdout, "{line}").map_err(|e| format!("stdout: {e}"))?;
        if !args.reuse && run + 1 < args.repeat {
            plan.client.await_session_tickets().await;
        }
    }
    plan.client.close_connections();
    if failed > 0 {
        return Err(format!("{failed} of {} runs failed", args.repeat));
    }
    Ok(())
}

fn run_json(run: u64, new_connection: bool, r: &RunReport) -> String {
    let opt = |d: Option<Duration>| d.map_or("null".to_string(), |d| format!("{:.3}", ms(d)));
    let error = match &r.error {
        Some(e) => format!("\"{}\"", kuai::qlog::json_escape(e)),
        None => "null".into(),
    };
    format!(
        "{{\"run\":{run},\"ok\":{},\"protocol\":\"{}\",\"new_connection\":{new_connection},\"connect_ms\":{},\"first_byte_ms\":{},\"total_ms\":{:.3},\"bytes\":{},\"responses\":{},\"zero_rtt\":\"{}\",\"resumed\":{},\"error\":{error}}}",
        r.error.is_none(),
        r.protocol.map_or("none", protocol_name),
        opt(r.connected),
        opt(r.first_byte),
        ms(r.total),
        r.bytes,
        r.responses,
        r.zero_rtt,
        r.resumed,
    )
}
