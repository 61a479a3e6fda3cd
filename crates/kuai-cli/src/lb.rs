//! `kuai lb`: the QUIC-LB load balancer (`kuai::lb`), and the QUIC-LB flags `kuai server`
//! shares with it.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use kuai::lb::{LbConfig, LoadBalancer};
use kuai_proto::quic_lb::{QuicLbConfig, QuicLbDecoder};

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
    #[arg(long = "backend", value_name = "ID=ADDR", required = true)]
    backends: Vec<String>,
    #[command(flatten)]
    quic_lb: QuicLbArgs,
    /// Seconds a flow (a client address toward a backend) lives without traffic.
    #[arg(long, default_value_t = 60)]
    flow_idle: u64,
    /// Most flows at once (each a socket); datagrams that would open another are dropped.
    #[arg(long, default_value_t = 65_536)]
    max_flows: usize,
    /// Milliseconds between health probes to each backend (a Version Negotiation probe; 0:
    /// none). A backend that misses three in a row gets no new connections until it answers.
    #[arg(long, default_value_t = 1000)]
    health_interval: u64,
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

async fn serve(args: Args) -> Result<(), String> {
    let mut backends = Vec::new();
    for b in &args.backends {
        let (id, addr) = b
            .split_once('=')
            .ok_or_else(|| format!("--backend {b}: ID=ADDR"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| format!("--backend {b}: the address is IP:PORT"))?;
        let (first, last) = id.split_once('-').unwrap_or((id, id));
        let hex = |h: &str| parse_hex(h).ok_or_else(|| format!("--backend {b}: the ID is hex"));
        let (first, last) = (hex(first)?, hex(last)?);
        let n = first.len();
        if last.len() != n || first[..n - 1] != last[..n - 1] || last[n - 1] < first[n - 1] {
            return Err(format!(
                "--backend {b}: a range of IDs differs only in its last byte, rising"
            ));
        }
        for k in first[n - 1]..=last[n - 1] {
            let mut id = first.clone();
            id[n - 1] = k;
            backends.push((id, addr));
        }
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
    config.health_interval =
        (args.health_interval > 0).then(|| Duration::from_millis(args.health_interval));
    let (lb, handle) = LoadBalancer::bind(args.listen, backends.clone(), config)
        .map_err(|e| format!("cannot bind {}: {e}", args.listen))?;
    println!("kuai lb listening on udp {}", lb.local_addr());
    for (id, addr) in &backends {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        println!("backend {hex} at {addr}");
    }
    // Say when a backend stops or starts answering.
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
