//! `kuai lb`: the QUIC-LB load balancer (`kuai::lb`), and the QUIC-LB flags `kuai server`
//! shares with it.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kuai::lb::{LbConfig, LbRetry, LoadBalancer};
use kuai_proto::quic_lb::{QuicLbConfig, QuicLbDecoder};
use kuai_proto::retry_offload::RetryOffload;

/// The QUIC-LB configuration, as `kuai lb` and `kuai server` take it.
#[derive(clap::Args, Debug, Clone)]
pub struct QuicLbArgs {
    /// QUIC-LB key (32 hex digits): server IDs are encrypted into connection IDs
    /// (AES-128-ECB); without it they are in plaintext, which lets observers link a client's
    /// connection IDs to its server.
    #[arg(long, value_name = "HEX")]
    pub quic_lb_key: Option<String>,
    /// QUIC-LB config rotation codepoint (0 to 6).
    #[arg(long, default_value_t = 0)]
    pub quic_lb_config: u8,
    /// QUIC-LB nonce length in bytes (4 or more; server ID and nonce 19 at most).
    #[arg(long, default_value_t = 6)]
    pub quic_lb_nonce_len: usize,
}

impl QuicLbArgs {
    /// The configuration for server IDs of `sid_len` bytes.
    pub fn config(&self, sid_len: usize) -> Result<QuicLbConfig, String> {
        let key = match &self.quic_lb_key {
            Some(h) => Some(
                parse_hex(h)
                    .and_then(|k| <[u8; 16]>::try_from(k).ok())
                    .ok_or("--quic-lb-key: 32 hex digits")?,
            ),
            None => None,
        };
        QuicLbConfig::new(self.quic_lb_config, sid_len, self.quic_lb_nonce_len, key)
            .map_err(|e| format!("QUIC-LB: {e}"))
    }
}

/// Bytes from hex digits.
pub fn parse_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if s.is_empty() || !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[derive(clap::Args)]
pub struct Args {
    /// UDP address clients send to.
    #[arg(long, default_value = "[::]:4433")]
    listen: SocketAddr,
    /// A backend: its QUIC-LB server ID in hex and its address, `ID=ADDR` (repeatable; all
    /// IDs one length). `FIRST-LAST=ADDR` names the IDs from FIRST to LAST (differing in
    /// their last byte) at one address: a server's workers (`kuai server --workers`).
    #[arg(
        long = "backend",
        value_name = "ID=ADDR",
        required_unless_present = "backends_file"
    )]
    backends: Vec<String>,
    /// Backends in a file, one `ID=ADDR` (or `FIRST-LAST=ADDR`) per line, `drain` after it
    /// to send it no new connections, `#` for comments. Read again on SIGHUP: backends new in
    /// it are added, those marked `drain` drained (their connections keep their packets),
    /// those gone from it (and not given with --backend) removed.
    #[arg(long, value_name = "FILE")]
    backends_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    quic_lb: QuicLbArgs,
    /// Seconds a flow (a client address toward a backend) lives without traffic.
    #[arg(long, default_value_t = 60)]
    flow_idle: u64,
    /// Most flows at once (each a socket); datagrams that would open another are dropped.
    #[arg(long, default_value_t = 65_536)]
    max_flows: usize,
    /// Most flows from one client address (an IPv4 address, an IPv6 /64): the per-address
    /// connection limit the servers behind (run with --proxy) leave to the balancer.
    #[arg(long, default_value_t = 4096)]
    max_flows_per_address: usize,
    /// Milliseconds between health probes to each backend (a Version Negotiation probe; 0:
    /// none). A backend that misses three in a row gets no new connections until it answers.
    #[arg(long, default_value_t = 1000)]
    health_interval: u64,
    /// Validate client addresses with Retry at the balancer: a new client's Initial is
    /// answered with a Retry, and only one bringing its token back opens a flow, so spoofed
    /// sources open none with a long header. The tokens are sealed with the fleet's token keys (--redis); the
    /// servers run with `--redis ... --retry-offload`.
    #[arg(long, requires = "redis")]
    retry: bool,
    /// With --retry: retry only while this many flows or more are open (0: always).
    #[arg(long, default_value_t = 0, requires = "retry", value_name = "FLOWS")]
    retry_above: usize,
    #[command(flatten)]
    fleet: crate::server::FleetArgs,
    /// The servers' --key-period, in seconds: the token keys rotate with theirs.
    #[arg(long, default_value_t = 3600, value_name = "SECS")]
    key_period: u64,
}

pub async fn run(args: Args) -> ExitCode {
    match serve(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kuai lb: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The backends `spec` names: `ID=ADDR` or `FIRST-LAST=ADDR`.
fn parse_backend(spec: &str) -> Result<Vec<(Vec<u8>, SocketAddr)>, String> {
    let (id, addr) = spec
        .split_once('=')
        .ok_or_else(|| format!("backend {spec}: ID=ADDR"))?;
    let addr: SocketAddr = addr
        .trim()
        .parse()
        .map_err(|_| format!("backend {spec}: the address is IP:PORT"))?;
    let (first, last) = id.split_once('-').unwrap_or((id, id));
    let hex = |h: &str| parse_hex(h).ok_or_else(|| format!("backend {spec}: the ID is hex"));
    let (first, last) = (hex(first)?, hex(last)?);
    let n = first.len();
    if last.len() != n || first[..n - 1] != last[..n - 1] || last[n - 1] < first[n - 1] {
        return Err(format!(
            "backend {spec}: a range of IDs differs only in its last byte, rising"
        ));
    }
    Ok((first[n - 1]..=last[n - 1])
        .map(|k| {
            let mut id = first.clone();
            id[n - 1] = k;
            (id, addr)
        })
        .collect())
}

/// A backends file: each backend with whether it is to drain.
fn read_backends_file(path: &std::path::Path) -> Result<Vec<(Vec<u8>, SocketAddr, bool)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let spec = words.next().unwrap_or("");
        let drain = match words.next() {
            None => false,
            Some("drain") => true,
            Some(w) => {
                return Err(format!(
                    "{}: {w:?}: only `drain` may follow a backend",
                    path.display()
                ));
            }
        };
        for (id, addr) in parse_backend(spec)? {
            out.push((id, addr, drain));
        }
    }
    Ok(out)
}

fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Brings the balancer's backends in line with the file (and the fixed ones of --backend).
fn apply_backends(
    handle: &kuai::lb::LbHandle,
    fixed: &[(Vec<u8>, SocketAddr)],
    file: &[(Vec<u8>, SocketAddr, bool)],
) {
    let now = handle.backends();
    for (id, addr, drain) in file {
        let cur = now.iter().find(|b| b.server_id == *id);
        if cur.is_none_or(|b| b.addr != *addr || (b.draining && !drain)) {
            handle.add(id, *addr);
            println!("backend {} at {addr}", hex_id(id));
        }
        if *drain && !cur.is_some_and(|b| b.draining) {
            handle.drain(id);
            println!("backend {} draining", hex_id(id));
        }
    }
    for b in now {
        let kept = fixed.iter().any(|(id, _)| *id == b.server_id)
            || file.iter().any(|(id, _, _)| *id == b.server_id);
        if !kept {
            handle.remove(&b.server_id);
            println!("backend {} removed", hex_id(&b.server_id));
        }
    }
}

async fn serve(args: Args) -> Result<(), String> {
    let mut backends = Vec::new();
    for b in &args.backends {
        backends.extend(parse_backend(b)?);
    }
    let fixed = backends.clone();
    let from_file = match &args.backends_file {
        Some(p) => read_backends_file(p)?,
        None => Vec::new(),
    };
    for (id, addr, _) in &from_file {
        if !backends.iter().any(|(i, _)| i == id) {
            backends.push((id.clone(), *addr));
        }
    }
    if backends.is_empty() {
        return Err("no backend".into());
    }
    let sid_len = backends[0].0.len();
    if backends.iter().any(|(id, _)| id.len() != sid_len) {
        return Err("every backend's server ID has the same length".into());
    }
    let config = args.quic_lb.config(sid_len)?;
    let cid_len = config.cid_len();
    let mut decoder = QuicLbDecoder::new();
    decoder.add(config);
    let mut config = LbConfig::new(decoder, cid_len);
    config.flow_idle = Duration::from_secs(args.flow_idle.max(1));
    config.max_flows = args.max_flows.max(1);
    config.max_flows_per_address = args.max_flows_per_address.max(1);
    // A flow is a socket: as many as the open-file limit leaves room for (256 kept for the
    // rest).
    let mut lowered = None;
    if let Some(files) = crate::raise_open_file_limit() {
        let room = usize::try_from(files.saturating_sub(256)).unwrap_or(usize::MAX);
        if config.max_flows > room {
            lowered = Some(format!(
                "--max-flows {} lowered to {} (open-file limit {files})",
                config.max_flows,
                room.max(1)
            ));
            config.max_flows = room.max(1);
        }
    }
    config.health_interval =
        (args.health_interval > 0).then(|| Duration::from_millis(args.health_interval));
    // Kept as long as the balancer runs: the token keys' rotation.
    let mut _rotation = None;
    if args.retry {
        let fleet = args.fleet.start()?.ok_or("--retry needs --redis")?;
        let key = Arc::new(kuai_proto::TokenKey::random());
        let period = crate::server::token_key_period(Duration::from_secs(args.key_period.max(1)));
        let rotation = fleet.rotate_token_keys(key.clone(), period).await;
        // Without the fleet's key the balancer would seal with one of its own, which no
        // server holds: every client it validated would then fail its handshake.
        let Some(generation) = rotation.sealing() else {
            return Err(
                "--retry: no token key from redis (unreachable?): the servers \
                        could not read the balancer's Retry tokens"
                    .into(),
            );
        };
        println!("retry at the balancer: token keys of generation {generation} from redis");
        _rotation = Some((fleet, rotation));
        // The servers' Retry token lifetime (kuai_proto's default).
        let offload = RetryOffload::new(key, Duration::from_secs(15));
        let mut retry = LbRetry::new(offload, args.quic_lb.config(sid_len)?);
        retry.above_flows = args.retry_above;
        config.retry = Some(retry);
    }
    let listen = crate::wildcard_for_this_host(args.listen);
    let (lb, handle) = LoadBalancer::bind(listen, backends.clone(), config)
        .map_err(|e| format!("cannot bind {listen}: {e}"))?;
    println!("kuai lb listening on udp {}", lb.local_addr());
    if let Some(l) = lowered {
        println!("{l}");
    }
    for (id, addr) in &backends {
        println!("backend {} at {addr}", hex_id(id));
    }
    apply_backends(&handle, &fixed, &from_file);
    // SIGHUP reloads the backends file; without one it is ignored (its default action would
    // end the balancer).
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| format!("SIGHUP: {e}"))?;
    {
        let (handle, sid_len, path) = (handle.clone(), sid_len, args.backends_file.clone());
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                let Some(path) = &path else {
                    eprintln!("kuai lb: SIGHUP: no --backends-file to reload");
                    continue;
                };
                match read_backends_file(path) {
                    Ok(list) if list.iter().any(|(id, _, _)| id.len() != sid_len) => {
                        eprintln!(
                            "kuai lb: {}: server IDs of another length; kept the backends",
                            path.display()
                        );
                    }
                    Ok(list) => {
                        apply_backends(&handle, &fixed, &list);
                        println!("backends reloaded from {}", path.display());
                    }
                    Err(e) => eprintln!("kuai lb: {e}; kept the backends"),
                }
            }
        });
    }
    // Say when a backend stops or starts answering.
    let handle = handle.clone();
    tokio::spawn(async move {
        let mut seen: Vec<(Vec<u8>, bool)> = Vec::new();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for b in handle.backends() {
                let was = seen.iter().find(|(id, _)| *id == b.server_id).map(|s| s.1);
                if was.is_some_and(|w| w != b.up) {
                    let hex: String = b.server_id.iter().map(|x| format!("{x:02x}")).collect();
                    let state = if b.up {
                        "up"
                    } else {
                        "down (no new connections)"
                    };
                    println!("backend {hex} {state}");
                }
            }
            seen = handle
                .backends()
                .into_iter()
                .map(|b| (b.server_id, b.up))
                .collect();
        }
    });
    tokio::select! {
        r = lb.run() => r.map_err(|e| e.to_string()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
