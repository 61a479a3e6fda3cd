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
