//! `kuai`: a QUIC server, a curl-like client and an interop endpoint.

mod bench;
mod config;
mod demo;
mod flood;
mod get;
mod interop;
mod keylog;
mod lb;
mod server;
mod site;
mod tls;
mod url;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kuai",
    version,
    about = "kuai (快): QUIC server, client and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a directory, or a built-in demo site, over QUIC.
    Server(Box<server::Args>),
    /// Fetch URLs over QUIC, several in parallel on one connection.
    Get(Box<get::Args>),
    /// Run as an endpoint of the interop matrix (configured by ROLE, TESTCASE, ...).
    Interop,
    /// Measure throughput, request and handshake rates, memory and CPU (perf protocol).
    Bench(bench::Args),
    /// A QUIC-LB load balancer: routes datagrams to backends by the server ID in their
    /// connection IDs (a full proxy).
    Lb(lb::Args),
    /// Two network namespaces joined by an emulated link (delay, loss, rate, outages, traces).
    Netsim(Box<kuai_netsim::cli::Args>),
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

/// The machine's cores (the interop server runs one endpoint worker per core).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kuai: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Server(args) => {
            init_logging("info");
            rt.block_on(server::run(*args))
        }
        Command::Get(args) => {
            init_logging(if args.verbose { "info" } else { "warn" });
            rt.block_on(get::run(*args))
        }
        Command::Bench(args) => {
            init_logging("warn");
            rt.block_on(bench::run(args))
        }
        Command::Interop => {
            init_logging("info");
            rt.block_on(interop::run())
        }
        Command::Lb(args) => {
            init_logging("info");
            rt.block_on(lb::run(args))
        }
        Command::Netsim(args) => kuai_netsim::cli::run(*args),
    }
}

/// `listen` as given, or the IPv4 wildcard on its port when it is the IPv6 wildcard (the
/// default of `kuai server` and `kuai lb`) and this host has no IPv6 at all: a kernel
/// booted with `ipv6.disable=1` refuses IPv6 sockets, and "every address" then means every
/// IPv4 one. A host with IPv6 keeps the dual-stack wildcard.
pub fn wildcard_for_this_host(listen: std::net::SocketAddr) -> std::net::SocketAddr {
    ipv4_without_ipv6(listen, || std::net::UdpSocket::bind("[::]:0").map(drop))
}

fn ipv4_without_ipv6(
    listen: std::net::SocketAddr,
    probe: impl FnOnce() -> std::io::Result<()>,
) -> std::net::SocketAddr {
    match listen {
        std::net::SocketAddr::V6(a) if a.ip().is_unspecified() => match probe() {
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                let v4 = std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, a.port()));
                eprintln!(
                    "kuai: this host has no IPv6 ({e}); listening on {v4} instead of {listen}"
                );
                v4
            }
            _ => listen,
        },
        _ => listen,
    }
}

/// A path argument, for clap.
pub type PathArg = PathBuf;

/// Sets the congestion controller (when chosen) and turns redundancy off (when asked) in a
/// client's or server's transport; the library's defaults stand otherwise.
fn set_transport(
    t: &mut std::sync::Arc<kuai::TransportConfig>,
    cc: &Option<kuai::CongestionAlgorithm>,
    initial_window: Option<u32>,
    no_redundancy: bool,
) {
    let t = std::sync::Arc::make_mut(t);
    if let Some(cc) = cc {
        t.congestion = cc.clone();
    }
    if let Some(n) = initial_window {
        t.initial_window_packets = n;
    }
    if no_redundancy {
        t.redundancy = None;
    }
}

/// Raises the soft limit on open files to the hard one (at most 2^20), as Go's runtime
/// does at start; returns the soft limit in force.
#[cfg(unix)]
pub fn raise_open_file_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        let want = lim.rlim_max.min(1 << 20);
        if lim.rlim_cur < want {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = want;
            }
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every Unix
    Some(lim.rlim_cur as u64)
}

#[cfg(not(unix))]
pub fn raise_open_file_limit() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ipv6_wildcard_becomes_ipv4_only_on_a_host_without_ipv6() {
        let any6: std::net::SocketAddr = "[::]:4433".parse().unwrap();
        let no_ipv6 = || Err(std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT));
        assert_eq!(
            ipv4_without_ipv6(any6, no_ipv6),
            "0.0.0.0:4433".parse().unwrap()
        );
        assert_eq!(ipv4_without_ipv6(any6, || Ok(())), any6);
        // Another failure is not a missing IPv6: the bind itself reports it.
        let busy = || Err(std::io::Error::from_raw_os_error(libc::EADDRINUSE));
        assert_eq!(ipv4_without_ipv6(any6, busy), any6);
        // A chosen address is never changed.
        let one: std::net::SocketAddr = "[::1]:4433".parse().unwrap();
        assert_eq!(ipv4_without_ipv6(one, no_ipv6), one);
        // On this machine (IPv6 present) the wildcard stays.
        assert_eq!(wildcard_for_this_host(any6), any6);
    }
}
