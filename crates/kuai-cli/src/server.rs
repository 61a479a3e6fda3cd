//! `kuai server`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kuai::{Endpoint, ServerConfig};
use kuai_http::metrics::Metrics;
use kuai_http::proxy::{Balance, Proxy, Upstream};
use kuai_http::{Limits, Listener, Server};

use crate::config;
use crate::keylog::FileKeyLog;
use crate::site::{Site, SiteService};
use crate::tls::Identity;

#[derive(clap::Args)]
pub struct Args {
    /// A TOML file with several hosts (certificates by SNI), path-prefix routes to upstream
    /// pools or directories, limits and timeouts (docs/gateway.md); its settings win over
    /// the flags'.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["root", "upstream", "cert", "key", "health_check"])]
    config: Option<PathBuf>,
    /// Directory to serve; without it (and without --upstream), a built-in demo site.
    #[arg(long, conflicts_with = "upstream")]
    root: Option<PathBuf>,
    /// Be a gateway: forward every request to this backend, `http://HOST:PORT` (HTTP/1.1,
    /// pooled keep-alive connections) or `h2c://HOST:PORT` (cleartext HTTP/2). Repeat it
    /// for several backends.
    #[arg(long, value_name = "URL")]
    upstream: Vec<Upstream>,
    /// Gateway: how a backend is picked, round-robin or least-outstanding.
    #[arg(long, default_value = "round-robin", requires = "upstream")]
    balance: Balance,
    /// Gateway: check each backend with a GET of this path (2xx or 3xx is healthy); a
    /// failing backend gets no requests until it passes again.
    #[arg(long, value_name = "PATH", requires = "upstream")]
    health_check: Option<String>,
    /// Gateway: time between health checks.
    #[arg(long, default_value = "5s", requires = "health_check")]
    health_interval: Timeout,
    /// Gateway: time allowed to connect to a backend (then the next is tried, 504 when none
    /// is left).
    #[arg(long, default_value = "5s", requires = "upstream")]
    upstream_connect_timeout: Timeout,
    /// Gateway: time allowed for a backend's response head (then 504), and between two
    /// pieces of its body (then the response is cut off).
    #[arg(long, default_value = "60s", requires = "upstream")]
    upstream_timeout: Timeout,
    /// Gateway: connections open to one backend at most; a request that finds them all
    /// busy waits for one within the connect timeout, then gets 503.
    #[arg(long, default_value_t = 1024, requires = "upstream", value_parser = clap::value_parser!(u32).range(1..))]
    upstream_max_connections: u32,
    /// Gateway: forward request fields with `_` in their names (dropped by default, as
    /// nginx does: a CGI-style backend reads `X_Real_IP` as `X-Real-IP`).
    #[arg(long, requires = "upstream")]
    underscores_in_headers: bool,
    /// UDP address to listen on.
    #[arg(long, default_value = "[::]:4433")]
    listen: SocketAddr,
    /// The UDP port Alt-Svc advertises, when clients reach HTTP/3 at another port than
    /// --listen's (a port mapping, a `kuai lb` in front).
    #[arg(long, value_name = "PORT")]
    alt_svc_port: Option<u16>,
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
    /// Send no NEW_TOKEN tokens and take none. Pass it behind `kuai lb` (a full proxy: every
    /// client reaches the server from the balancer's address, so a token, which binds an IP,
    /// would validate any spoofed client); Retry works there as everywhere.
    #[arg(long)]
    no_new_tokens: bool,
    /// Behind `kuai lb --retry`, which validates client addresses with Retry itself: take
    /// its Retry tokens (sealed with the fleet's token keys, so it needs --redis) without
    /// comparing their address with the balancer's, from which every client arrives; send
    /// no Retry of its own. Implies --no-new-tokens. Only where clients reach the server
    /// through the balancer alone.
    #[arg(long, requires = "redis")]
    retry_offload: bool,
    /// The address of a full proxy in front (repeatable; `kuai lb`'s, as the server sees
    /// it): every client arrives from it on a port of its own, so a client from there is
    /// counted by address and port for the per-address limits (QUIC connections and
    /// handshakes, the gateway's WebSockets) and path hints (`kuai lb` caps the flows of
    /// one client address itself, --max-flows-per-address).
    #[arg(long = "proxy", value_name = "IP")]
    proxies: Vec<std::net::IpAddr>,
    /// Write a qlog trace of every connection into this directory.
    #[arg(long)]
    qlog_dir: Option<PathBuf>,
    /// Serve statistics in the Prometheus text format at http://ADDR/metrics: handshakes,
    /// 0-RTT, connections by version / cipher suite / ALPN, RTT, congestion window and loss,
    /// migrations, stateless answers and drops, requests by protocol and status, upstream
    /// latency and errors.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Do not serve HTTP/1.1 and HTTP/2 over TCP on the same port.
    #[arg(long)]
    no_tcp: bool,
    /// QUIC congestion control: bbr-adaptive (the default: BBRv3 that keeps its rate through
    /// random loss on an empty queue), bbr (BBRv3), bbr-loss-tolerant, cubic or newreno.
    #[arg(long)]
    cc: Option<kuai::CongestionAlgorithm>,
    /// QUIC initial congestion window in 1,200-byte packets (the library's default, 10, as
    /// RFC 9002 says, when not given).
    #[arg(long, value_name = "PACKETS", value_parser = clap::value_parser!(u32).range(2..=1000))]
    initial_window: Option<u32>,
    /// QUIC initial congestion window, in the same packets, of a connection from a client
    /// the server has no path hint for (its first connection while hints are kept); the
    /// initial window when not given.
    #[arg(long, value_name = "PACKETS", value_parser = clap::value_parser!(u32).range(2..=1000))]
    cold_initial_window: Option<u32>,
    /// Never send redundant copies. By default, on a lossy path (2 % or more of packets
    /// lost), the last packets of each flight (up to 16) go out twice when there is nothing
    /// new to send.
    #[arg(long)]
    no_redundancy: bool,
    /// Also listen on this address and offer it to clients as the server's preferred address
    /// (RFC 9000 §9.6): they move to it after the handshake. It needs an IP address other
    /// than the one of --listen.
    #[arg(long)]
    preferred_address: Option<SocketAddr>,
    /// This server's QUIC-LB server ID (hex): every connection ID it issues carries it, so a
    /// QUIC-LB load balancer (`kuai lb`) routes the connection's packets here whatever the
    /// client's address. With --workers N, worker i's server ID is this one plus i (in its
    /// last byte): give the balancer each of them, at this server's address.
    #[arg(long, value_name = "HEX")]
    server_id: Option<String>,
    #[command(flatten)]
    quic_lb: crate::lb::QuicLbArgs,
    #[command(flatten)]
    fleet: FleetArgs,
    /// TLS session tickets: `replicated` (the server keeps sessions; with --redis, every
    /// server keeps the fleet's; resumption and 0-RTT) or `stateless` (each session sealed
    /// into its ticket under keys that rotate, shared through --redis; resumption, no 0-RTT:
    /// rustls 0.23 allows none with stateless tickets).
    #[arg(long, value_enum, default_value_t = TicketMode::Replicated)]
    session_tickets: TicketMode,
    /// Seconds between rotations of the fleet's stateless ticket keys, and of its
    /// Retry/NEW_TOKEN keys when longer than a NEW_TOKEN token's lifetime (24 h); each
    /// key is accepted for the periods before and after its own.
    #[arg(long, default_value_t = 3600, value_name = "SECS")]
    key_period: u64,
    /// Spread connections over this many workers: UDP sockets sharing the port, each with a
    /// driver of its own, the kernel steering each packet by its connection ID (Linux).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// TCP: most connections held at once. At the cap a new connection closes the oldest one
    /// with no request in flight; if every one has a request in flight it is refused.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// TCP: most connections held at once from one client address (an IPv6 /64). At it, a
    /// new one from there closes that address's oldest one with no request in flight.
    #[arg(long, default_value_t = Limits::default().max_connections_per_address)]
    max_connections_per_address: usize,
    /// TCP: time allowed for the TLS handshake (units ms, s, m; a bare number is seconds).
    #[arg(long, default_value_t = Timeout(Limits::default().handshake_timeout))]
    handshake_timeout: Timeout,
    /// Time allowed for a request head. TCP: the first one from the end of the handshake, a
    /// later HTTP/1.1 one from its first byte; HTTP/3: from the opening of its stream.
    #[arg(long, default_value_t = Timeout(Limits::default().header_timeout))]
    header_timeout: Timeout,
    /// How long a connection (TCP or HTTP/3) waits for another request after a response.
    #[arg(long, default_value_t = Timeout(Limits::default().idle_timeout))]
    idle_timeout: Timeout,
    /// TCP: a connection waiting on its client this long without progress is closed (a
    /// response the client stopped reading, a request body that stopped coming).
    #[arg(long, default_value_t = Timeout(Limits::default().send_timeout))]
    send_timeout: Timeout,
    /// HTTP/2: most requests in flight per connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = Limits::default().h2_max_concurrent_streams)]
    h2_max_streams: u32,
    /// Largest request header section in bytes, every protocol (HTTP/1.1: 431 past it;
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE; HTTP/3 SETTINGS_MAX_FIELD_SECTION_SIZE).
    #[arg(long, default_value_t = Limits::default().max_header_size)]
    max_header_size: usize,
    /// Largest request body in bytes, every protocol: a request declaring more gets 413, one
    /// sending more is cut off (no limit by default: bodies stream under flow control).
    #[arg(long, value_name = "BYTES")]
    max_body: Option<u64>,
    /// After Ctrl-C, how long requests in flight have to finish (GOAWAY first on HTTP/3 and
    /// HTTP/2).
    #[arg(long, default_value_t = Timeout(Limits::default().drain_timeout))]
    drain_timeout: Timeout,
}

/// A duration on the command line: `500ms`, `10s`, `2m`, or a number of seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timeout(pub Duration);

impl std::str::FromStr for Timeout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: not a duration (e.g. 500ms, 10s, 2m)");
        let (n, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
            Some(i) => s.split_at(i),
            None => (s, "s"),
        };
        let n: f64 = n.trim().parse().map_err(|_| bad())?;
        let secs = match unit {
            "ms" => n / 1000.0,
            "s" => n,
            "m" => n * 60.0,
            _ => return Err(bad()),
        };
        if !(secs > 0.0 && secs < 1e9) {
            return Err(format!("{s:?}: must be above zero"));
        }
        let d = Duration::from_secs_f64(secs);
        if d < Duration::from_millis(1) {
            return Err(format!("{s:?}: must be at least 1ms"));
        }
        Ok(Timeout(d))
    }
}

impl std::fmt::Display for Timeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
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

/// The server's limits from the flags, with at most as many TCP connections as the
/// open-file limit leaves room for (one descriptor for the socket and one for a file each,
/// 256 kept for the rest).
fn limits(args: &Args) -> Limits {
    let mut max_connections = args.max_connections;
    if let Some(files) = crate::raise_open_file_limit() {
        let room = usize::try_from(files.saturating_sub(256) / 2).unwrap_or(usize::MAX);
        if max_connections > room {
            println!(
                "--max-connections {max_connections} lowered to {} (open-file limit {files})",
                room.max(1)
            );
            max_connections = room.max(1);
        }
    }
    let mut l = Limits::default();
    l.max_connections = max_connections;
    l.max_connections_per_address = args.max_connections_per_address;
    l.handshake_timeout = args.handshake_timeout.0;
    l.header_timeout = args.header_timeout.0;
    l.idle_timeout = args.idle_timeout.0;
    l.send_timeout = args.send_timeout.0;
    l.h2_max_concurrent_streams = args.h2_max_streams;
    l.max_header_size = args.max_header_size;
    l.max_request_body = args.max_body;
    l.drain_timeout = args.drain_timeout.0;
    l
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
    tls.session_storage = kuai::session::SessionCache::with_defaults();
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

/// How TLS session tickets are made (`--session-tickets`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TicketMode {
    Replicated,
    Stateless,
}

async fn serve(args: Args) -> Result<(), String> {
    let file = args.config.as_deref().map(config::File::load).transpose()?;
    let site = match &args.root {
        Some(dir) => {
            if !dir.is_dir() {
                return Err(format!("{} is not a directory", dir.display()));
            }
            Site::Dir(dir.clone())
        }
        None => Site::Demo,
    };
    // The TLS configuration for both transports (ALPN set per transport below), and the
    // certificate to print the SPKI hash of when it was made here.
    let (mut tls, shown) = match &file {
        Some(f) => f.tls()?,
        None => {
            let identity = match (&args.cert, &args.key) {
                (Some(c), Some(k)) => Identity::load(c, k)?,
                _ => Identity::self_signed(&["localhost", "127.0.0.1", "::1"])?,
            };
            let tls = kuai_http::server_tls(identity.certs.clone(), identity.key.clone_key())
                .map_err(|e| e.to_string())?;
            (tls, Some(identity))
        }
    };
    let keylog = match args.keylog.as_deref() {
        Some(path) => {
            Some(Arc::new(FileKeyLog::create(path).map_err(|e| {
                format!("cannot open {}: {e}", path.display())
            })?))
        }
        None => None,
    };
    let fleet = args.fleet.start()?;
    let key_period = Duration::from_secs(args.key_period.max(1));
    // Rotations run as long as the server: kept here.
    let mut rotations = Vec::new();
    match (args.session_tickets, &fleet) {
        (TicketMode::Replicated, Some(f)) => tls.session_storage = f.sessions(),
        (TicketMode::Replicated, None) => {}
        (TicketMode::Stateless, f) => {
            let (ticketer, rotation) = match f {
                Some(f) => f.ticketer(key_period).await,
                None => {
                    let t = Arc::new(kuai_fleet::Ticketer::new(key_period));
                    let store = Arc::new(kuai_fleet::MemoryKeyStore::default());
                    let r = kuai_fleet::KeyRotation::start(
                        store,
                        kuai_fleet::TICKET_KEYS,
                        key_period,
                        t.clone(),
                    )
                    .await;
                    (t, r)
                }
            };
            tls.ticketer = ticketer;
            rotations.push(rotation);
            println!(
                "stateless session tickets, keys rotating every {} s (no 0-RTT)",
                key_period.as_secs()
            );
        }
    }
    let with_alpn = |alpn: &[&[u8]]| {
        let mut t = tls.clone();
        t.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        if let Some(k) = &keylog {
            t.key_log = k.clone();
        }
        t
    };
    let mut cfg = ServerConfig::from_rustls(with_alpn(&[
        kuai_http::server::ALPN_H3,
        kuai_http::server::ALPN_HQ,
    ]));
    if args.retry {
        cfg.retry(kuai::RetryPolicy::Always);
    }
    cfg.proto_mut().new_tokens = !args.no_new_tokens && !args.retry_offload;
    cfg.proto_mut().retry_offload = args.retry_offload;
    cfg.proto_mut().proxies = args.proxies.clone();
    // The fleet's stateless-reset key only with a QUIC-LB server ID: then a server answers
    // with a reset only the IDs it issued itself (`issued_here`). Without one, a packet of a
    // live connection that reaches another server (a 4-tuple balancer after a NAT
    // rebinding, or a packet sent there on purpose) would draw a reset that ends it (RFC
    // 9000 §21.11): each server keeps a key of its own.
    let shares_reset = args.server_id.is_some();
    let reset_key = match &fleet {
        Some(f) => {
            let reset = if shares_reset {
                Some(f.reset_key().await)
            } else {
                None
            };
            // The token keys rotate with the fleet's whether Redis answers now or later:
            // until it does, this process seals with keys of its own.
            let token_period = token_key_period(key_period).max(cfg.proto_mut().new_token_lifetime);
            let token_keys = f
                .rotate_token_keys(cfg.proto_mut().token_key.clone(), token_period)
                .await;
            let generation = token_keys
                .sealing()
                .map_or("none".into(), |g| g.to_string());
            rotations.push(token_keys);
            // A NEW_TOKEN token validates once in the fleet, not once per server.
            f.share_token_log(
                cfg.proto_mut().token_log.clone(),
                cfg.proto_mut().new_token_lifetime,
            );
            match reset {
                Some(Ok(k)) => {
                    println!(
                        "fleet keys from redis: reset key {}, token keys of generation {generation} (every {} s)",
                        kuai_fleet::key_id(&k),
                        token_period.as_secs()
                    );
                    Some(k)
                }
                None => {
                    println!(
                        "fleet keys from redis: token keys of generation {generation} (every {} s); this process's own reset key (shared only with --server-id)",
                        token_period.as_secs()
                    );
                    None
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "redis unreachable: serving with this process's own keys");
                    println!(
                        "fleet keys: redis unreachable ({e}); this process's own reset key, token keys from redis once it answers"
                    );
                    None
                }
            }
        }
        None => None,
    };
    if let Some(f) = &fleet
        && args.session_tickets == TicketMode::Replicated
    {
        cfg.anti_replay(f.anti_replay());
        println!("fleet sessions and 0-RTT first uses through redis");
    }
    crate::set_transport(
        &mut cfg.proto_mut().transport,
        &args.cc,
        args.initial_window,
        args.no_redundancy,
    );
    if let Some(n) = args.cold_initial_window {
        Arc::make_mut(&mut cfg.proto_mut().transport).cold_initial_window_packets = Some(n);
    }
    let workers = file
        .as_ref()
        .and_then(|f| f.workers)
        .unwrap_or(args.workers);
    let listen =
        crate::wildcard_for_this_host(file.as_ref().and_then(|f| f.listen).unwrap_or(args.listen));
    let mut builder = Endpoint::builder().server(cfg).workers(workers);
    let mut ec = kuai::EndpointConfig::default();
    if let Some(hex) = &args.server_id {
        let sid = crate::lb::parse_hex(hex).ok_or("--server-id: hex digits")?;
        let config = args.quic_lb.config(sid.len())?;
        kuai_proto::quic_lb::QuicLbCids::new(config.clone(), &sid).map_err(|e| e.to_string())?;
        // With several workers, worker i's server ID is this one plus i (in its last byte).
        builder = builder.quic_lb(config, &sid);
        if workers > 1 {
            let mut last = sid.clone();
            if let Some(l) = last.last_mut() {
                *l = u8::try_from(workers - 1)
                    .ok()
                    .and_then(|k| l.checked_add(k))
                    .ok_or(
                    "--server-id: its last byte plus --workers passes ff (worker i's ID is the ID plus i)",
                )?;
            }
            let to: String = last.iter().map(|b| format!("{b:02x}")).collect();
            println!(
                "QUIC-LB server IDs {hex} to {to} (one per worker; list each at the balancer)"
            );
        } else {
            println!("QUIC-LB server ID {hex}");
        }
    }
    if let Some(k) = &reset_key {
        ec.proto.reset_key = *k;
    }
    if let Some(b) = file.as_ref().and_then(|f| f.quic_memory_budget()) {
        ec.proto.memory_budget = kuai_proto::MemoryBudget::new(b);
    }
    builder = builder.endpoint_config(ec);
    if let Some(d) = &args.qlog_dir {
        builder = builder.qlog_dir(d);
    }
    let metrics = match file.as_ref().and_then(|f| f.metrics).or(args.metrics) {
        Some(addr) => {
            let m = Metrics::new();
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot bind the metrics address {addr}: {e}"))?;
            let local = l.local_addr().map_err(|e| e.to_string())?;
            println!("metrics at http://{local}/metrics");
            tokio::spawn(m.clone().serve(l));
            builder = builder.subscriber(m.subscriber());
            Some(m)
        }
        None => None,
    };
    if let Some(a) = args.preferred_address {
        builder = builder.preferred_address(a);
    }
    // With port 0 the UDP port the kernel picks may be taken on TCP (by any socket, a
    // client's ephemeral one too): then another pair, a few times. The server exited with
    // its UDP port announced and nothing behind it.
    let tries = if listen.port() == 0 && !args.no_tcp {
        8
    } else {
        1
    };
    let mut bound = None;
    for attempt in 1..=tries {
        let ep = builder.clone().bind(listen).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => e.to_string(),
            _ => format!("cannot bind {listen}: {e}"),
        })?;
        let local = ep.local_addr().map_err(|e| e.to_string())?;
        if args.no_tcp {
            bound = Some((ep, None));
            break;
        }
        match tokio::net::TcpListener::bind(local).await {
            Ok(l) => {
                bound = Some((ep, Some(l)));
                break;
            }
            Err(e) if attempt == tries => {
                return Err(format!(
                    "cannot bind tcp {local}: {e} (--no-tcp serves UDP only)"
                ));
            }
            Err(_) => drop(ep),
        }
    }
    let (ep, tcp_listener) = bound.ok_or("no port free for both UDP and TCP")?;
    // Started without the fleet's reset key (Redis away): take it up once Redis answers,
    // so the other servers can reset the connections made from then on.
    if let Some(f) = &fleet
        && reset_key.is_none()
        && shares_reset
    {
        let (f, ep) = (f.clone(), ep.clone());
        tokio::spawn(async move {
            let mut pause = Duration::from_secs(1);
            loop {
                tokio::time::sleep(pause).await;
                if let Ok(k) = f.reset_key().await {
                    ep.set_reset_key(k);
                    println!(
                        "fleet reset key from redis: {} (for connections from now on)",
                        kuai_fleet::key_id(&k)
                    );
                    return;
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        });
    }
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
    let tcp = tcp_listener.inspect(|_| {
        let addr = SocketAddr::new(local.ip(), port);
        println!("kuai server listening on tcp {addr} (HTTP/2 and HTTP/1.1, Alt-Svc: h3)");
    });
    match &args.root {
        _ if file.is_some() => {
            for line in file.as_ref().map(|f| f.describe()).unwrap_or_default() {
                println!("serving {line}");
            }
        }
        Some(dir) => println!("serving {}", dir.display()),
        None if !args.upstream.is_empty() => {
            let list: Vec<String> = args.upstream.iter().map(|u| u.to_string()).collect();
            println!("gateway to {} ({})", list.join(", "), args.balance);
        }
        None => println!("serving the built-in demo site"),
    }
    if shown.as_ref().is_some_and(|i| i.self_signed) {
        println!("certificate: self-signed for localhost, made at start");
    }
    if let Some(spki) = shown.as_ref().and_then(Identity::spki_sha256) {
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
    let path = if args.upstream.is_empty() {
        "/hello.txt"
    } else {
        "/"
    };
    println!("or: cargo run --release -- get --insecure -v https://localhost:{port}{path}");
    let mut listener = Listener::new(ep);
    if let Some(l) = tcp {
        listener = listener.with_tcp(l, with_alpn(&[]));
    }
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
        println!("shutting down: requests in flight may finish (Ctrl-C again to stop now)");
        tokio::spawn(async {
            let _ = tokio::signal::ctrl_c().await;
            std::process::exit(130);
        });
    };
    let mut limits = limits(&args);
    if let Some(f) = &file {
        limits = f.limits(limits);
    }
    let served = if let Some(f) = &file {
        let mut server = Server::new(f.router(metrics.as_ref(), &args.proxies)?)
            .limits(limits)
            .alt_svc_port(args.alt_svc_port);
        if let Some(m) = &metrics {
            server = server.metrics(m.clone());
        }
        server.serve_with_shutdown(listener, shutdown).await
    } else if args.upstream.is_empty() {
        let mut server = Server::new(SiteService::new(&site))
            .limits(limits)
            .alt_svc_port(args.alt_svc_port);
        if let Some(m) = &metrics {
            server = server.metrics(m.clone());
        }
        server.serve_with_shutdown(listener, shutdown).await
    } else {
        let mut server = Server::new(proxy(&args, metrics.as_ref())?)
            .limits(limits)
            .alt_svc_port(args.alt_svc_port);
        if let Some(m) = &metrics {
            server = server.metrics(m.clone());
        }
        server.serve_with_shutdown(listener, shutdown).await
    };
    served.map_err(|e| e.to_string())
}

/// How often the fleet's Retry/NEW_TOKEN keys rotate for a `--key-period` of `key_period`:
/// not faster than a NEW_TOKEN token lives (24 h by default), or a client's token would die
/// with its key long before (a key opens for one period after its own). `kuai lb --retry`
/// rotates with the servers.
pub(crate) fn token_key_period(key_period: Duration) -> Duration {
    // kuai_proto's default new_token_lifetime.
    key_period.max(Duration::from_secs(24 * 3600))
}

/// How to join a fleet through Redis: `kuai server --redis`, `kuai lb --retry --redis`.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// Join a fleet through this Redis (`redis://[[user]:password@]host:port[/db]`, or
    /// `rediss://` for TLS): every server keeps every session of the fleet, so a client
    /// resumes in 0-RTT on any of them; each ticket's first use is recorded there, so a
    /// replayed 0-RTT flight is refused on all; the stateless-reset and Retry/NEW_TOKEN keys
    /// are shared (`kuai lb --retry` takes the token keys). Redis away: a server serves
    /// with what it holds (docs/fleet.md).
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,
    /// PEM certificate(s) to trust for a `rediss://` Redis instead of the system's roots.
    #[arg(long, value_name = "FILE", requires = "redis")]
    pub redis_ca: Option<PathBuf>,
    /// The fleet's secret (a file holding 64 hex digits, the same on every server, e.g.
    /// from `openssl rand -hex 32`): the keys and sessions kept in Redis are sealed under
    /// it, so whoever reads Redis learns none of them and whoever writes it plants none.
    /// Without it they are stored in clear.
    #[arg(long, value_name = "FILE", requires = "redis")]
    pub fleet_secret_file: Option<PathBuf>,
}

impl FleetArgs {
    /// Joins the fleet when `--redis` names one.
    pub(crate) fn start(&self) -> Result<Option<kuai_fleet::Fleet>, String> {
        let Some(url) = &self.redis else {
            return Ok(None);
        };
        let ca_pem = match &self.redis_ca {
            Some(p) => {
                Some(std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?)
            }
            None => None,
        };
        let secret = match &self.fleet_secret_file {
            Some(p) => Some(read_fleet_secret(p)?),
            None => {
                println!(
                    "fleet: keys and sessions are stored in redis in clear (--fleet-secret-file seals them)"
                );
                None
            }
        };
        let options = kuai_fleet::FleetOptions {
            ca_pem,
            secret,
            ..Default::default()
        };
        kuai_fleet::Fleet::start(url, options)
            .map(Some)
            .map_err(|e| e.to_string())
    }
}

/// The fleet's secret from `path`: 64 hex digits (surrounding whitespace ignored).
fn read_fleet_secret(path: &std::path::Path) -> Result<[u8; 32], String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let hex = text.trim();
    let bad = || format!("{}: the fleet secret is 64 hex digits", path.display());
    if hex.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
        *o = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The gateway's proxy from the flags.
fn proxy(args: &Args, metrics: Option<&Arc<Metrics>>) -> Result<Proxy, String> {
    config::Pool {
        upstreams: &args.upstream,
        balance: args.balance,
        connect_timeout: Some(args.upstream_connect_timeout),
        response_timeout: Some(args.upstream_timeout),
        health_check: args.health_check.as_deref(),
        health_interval: Some(args.health_interval),
        max_connections: Some(args.upstream_max_connections as usize),
        proxies: &args.proxies,
        underscores_in_headers: args.underscores_in_headers,
    }
    .proxy(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_and_print() {
        let t = |s: &str| s.parse::<Timeout>().map(|t| t.0);
        assert_eq!(t("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(t("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(t("10"), Ok(Duration::from_secs(10)));
        assert_eq!(t("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(t("2m"), Ok(Duration::from_secs(120)));
        for bad in [
            "", "0", "-1s", "10h", "s", "1e99", "NaN", "inf", "0.0001ms", "1e-12",
        ] {
            assert!(t(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Timeout(Duration::from_secs(75)).to_string(), "75s");
        assert_eq!(Timeout(Duration::from_millis(400)).to_string(), "400ms");
    }
}
