//! `kuai bench flood`: a handshake flood against a QUIC server, with real clients timed during
//! it. Many valid client Initials (each from a real ClientHello, never completed) are sent
//! from many source ports at a steady rate; meanwhile `kuai get --http3` fetches a URL at
//! intervals, and the server's resident memory is sampled when its PID is given. It measures
//! what a flood of half-open handshakes does to a server: whether real clients still get
//! answered, and how much memory the flood costs.

use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kuai::kuai_proto;

#[derive(clap::Args)]
pub struct FloodArgs {
    /// The server's UDP address.
    #[arg(long, default_value = "127.0.0.1:4433")]
    server: SocketAddr,
    /// Client Initials sent in all (each a new connection attempt).
    #[arg(long, default_value_t = 30_000)]
    initials: u64,
    /// Over how many seconds they are spread.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Source ports the flood comes from.
    #[arg(long, default_value_t = 64)]
    ports: usize,
    /// Real clients (`kuai get --http3`) started during the flood.
    #[arg(long, default_value_t = 24)]
    probes: usize,
    /// What the probes fetch (default: https://localhost:PORT/ on the server's port).
    #[arg(long)]
    url: Option<String>,
    /// The server's process ID: its resident memory is sampled before, during and after.
    #[arg(long)]
    server_pid: Option<u32>,
    /// How long a probe may take before it counts as failed, in seconds.
    #[arg(long, default_value_t = 5)]
    probe_timeout: u64,
}

pub fn run(a: FloodArgs) -> Result<(), String> {
    if a.ports == 0 || a.initials == 0 || a.seconds <= 0.0 {
        return Err("--initials, --seconds and --ports must be positive".into());
    }
    let made = Instant::now();
    let initials = make_initials(a.server, a.initials as usize)?;
    eprintln!(
        "made {} Initials in {:.1} s",
        initials.len(),
        made.elapsed().as_secs_f64()
    );
    let sockets: Vec<UdpSocket> = (0..a.ports)
        .map(|_| UdpSocket::bind(crate::get::any_port_for(a.server)))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bind: {e}"))?;

    let rss_before = a.server_pid.map(rss_of).unwrap_or(0);
    let cpu_before = a.server_pid.map(cpu_of).unwrap_or(0.0);
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = a.server_pid.map(|pid| {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_of(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    });

    // The probes: real clients started at even intervals over the flood.
    let url = a
        .url
        .clone()
        .unwrap_or_else(|| format!("https://localhost:{}/", a.server.port()));
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let interval = Duration::from_secs_f64(a.seconds / a.probes.max(1) as f64);
    let probe_timeout = a.probe_timeout;
    let prober = std::thread::spawn(move || {
        let mut results = Vec::new();
        let start = Instant::now();
        for i in 0..a.probes {
            let at = interval * i as u32 + interval / 2;
            if let Some(wait) = at.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            let t = Instant::now();
            let ok = Command::new(&exe)
                .args(["get", "--insecure", "--http3", "--max-time"])
                .arg(probe_timeout.to_string())
                .args(["-o", "/dev/null", &url])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            results.push((ok, t.elapsed()));
        }
        results
    });

    // The flood: Initials spread evenly over the time, round robin over the ports.
    let start = Instant::now();
    let per_ms = a.initials as f64 / (a.seconds * 1000.0);
    let mut sent = 0u64;
    let mut send_errors = 0u64;
    while (sent as usize) < initials.len() {
        let due = ((start.elapsed().as_secs_f64() * 1000.0 + 1.0) * per_ms) as u64;
        while sent < due.min(initials.len() as u64) {
            let s = &sockets[sent as usize % sockets.len()];
            if s.send_to(&initials[sent as usize], a.server).is_err() {
                send_errors += 1;
            }
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let flood_time = start.elapsed();
    let probes = prober.join().map_err(|_| "the prober panicked")?;
    // Memory once the flood's half-open handshakes had time to time out is not waited for:
    // the figure that matters is the peak.
    done.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.join();
    }
    let rss_after = a.server_pid.map(rss_of).unwrap_or(0);
    let cpu = a.server_pid.map(cpu_of).unwrap_or(0.0) - cpu_before;

    let ok: Vec<f64> = probes
        .iter()
        .filter(|p| p.0)
        .map(|p| p.1.as_secs_f64() * 1000.0)
        .collect();
    let mut sorted = ok.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let max = sorted.last().copied().unwrap_or(f64::NAN);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "{{\"initials\":{sent},\"send_errors\":{send_errors},\"flood_s\":{:.2},\
         \"probes\":{},\"probes_ok\":{},\"probe_ms_median\":{median:.0},\"probe_ms_max\":{max:.0},\
         \"rss_before_mib\":{:.1},\"rss_peak_mib\":{:.1},\"rss_after_mib\":{:.1},\
         \"server_cpu_s\":{cpu:.2}}}",
        flood_time.as_secs_f64(),
        probes.len(),
        ok.len(),
        mib(rss_before),
        mib(peak.load(Ordering::Relaxed)),
        mib(rss_after),
    );
    Ok(())
}

/// `n` first datagrams of real client connections to `server`: padded Initials, each with
/// its own ClientHello and connection IDs.
fn make_initials(server: SocketAddr, n: usize) -> Result<Vec<Vec<u8>>, String> {
    let mut base = kuai::ClientConfig::insecure(&[b"h3"]).map_err(|e| e.to_string())?;
    let mut cfg = base.proto_mut().clone();
    // Full ClientHellos only (no session to resume), as a flood would send.
    let mut tls = (*cfg.tls).clone();
    tls.resumption = rustls::client::Resumption::disabled();
    cfg.tls = Arc::new(tls);
    let econfig = Arc::new(kuai_proto::EndpointConfig::default());
    let now = Instant::now();
    let mut out = Vec::with_capacity(n);
    let mut buf = Vec::new();
    // A fresh client endpoint every thousand attempts keeps the abandoned connections'
    // memory bounded.
    let mut ep = kuai_proto::Endpoint::new(econfig.clone(), None, now, 0, None);
    for i in 0..n {
        if i % 1000 == 999 {
            ep = kuai_proto::Endpoint::new(econfig.clone(), None, now, 0, None);
        }
        ep.connect(now, &cfg, server, "localhost")
            .map_err(|e| e.to_string())?;
        let t = ep
            .poll_transmit(now, 1, &mut buf)
            .ok_or("a client had nothing to send")?;
        out.push(buf[..t.size].to_vec());
        // The rest of the flight (none expected) is not sent.
        while ep.poll_transmit(now, 1, &mut buf).is_some() {}
    }
    Ok(out)
}

fn cpu_of(pid: u32) -> f64 {
    crate::bench::proc_cpu_seconds(&pid.to_string())
}

fn rss_of(pid: u32) -> u64 {
    crate::bench::proc_rss_bytes(&pid.to_string())
}
