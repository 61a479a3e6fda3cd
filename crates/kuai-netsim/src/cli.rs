//! `kuai netsim`: build the lab, run a server command in one namespace and a client command
//! in the other, tear everything down when the client ends, print the link's statistics.

use std::io::{self, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::lab::{self, CLIENT_ADDR, DirectionReport, Lab, LabConfig, LabReport, SERVER_ADDR};
use crate::model::{
    Blackhole, DEFAULT_QUEUE, DEFAULT_REORDER_DELAY, GilbertElliott, LinkConfig, QueueLimit, Rate,
};
use crate::parse;
use crate::stats::Short;
use crate::trace::Trace;

/// The exit code when netsim itself fails (like `env` and container runners).
const EXIT_NETSIM_ERROR: u8 = 125;
/// The exit code when `--timeout` ends the client (like `timeout`).
const EXIT_TIMEOUT: u8 = 124;

/// Two network namespaces joined by an emulated link; runs a server and a client across it.
///
/// The server namespace has 10.77.0.1, the client namespace 10.77.0.2 (both /24, MTU 1500,
/// loopback up). "Up" is client to server, "down" server to client; each impairment option
/// sets both directions and its --up-/--down- form overrides one. Delays are one-way: --delay
/// 20ms gives a 40 ms round trip.
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = "\
The server namespace NAME-server has 10.77.0.1, the client namespace NAME-client 10.77.0.2
(both /24 on device netsim0, MTU 1500, loopback up). Up is client to server, down server to
client; delays are one-way.

Examples:
  kuai netsim --delay 20ms --loss 5% --rate 10mbit --queue 25 -- kuai server --listen 10.77.0.1:4433 -- kuai get --insecure https://10.77.0.1:4433/
  kuai netsim --delay 50ms --wait-port 8000 -- python3 -m http.server -b 10.77.0.1 -- curl -so /dev/null http://10.77.0.1:8000/
  kuai netsim --down-trace lte.down --up-trace lte.up --shell

The server command runs until the client command ends, then gets SIGTERM (SIGKILL after 2 s);
netsim exits with the client's exit code (128+N if a signal N ended it, 124 on --timeout, 125
if netsim itself failed). Other programs can join a running lab with
`ip netns exec NAME-server ...` or `ip netns exec NAME-client ...`.")]
pub struct Args {
    /// One-way delay, both directions (like 20ms).
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub delay: Option<Duration>,
    /// One-way delay client to server.
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub up_delay: Option<Duration>,
    /// One-way delay server to client.
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub down_delay: Option<Duration>,

    /// Uniform jitter around the delay (5ms gives 15..25 ms on 20ms); never reorders (packets
    /// closer together than the jitter's span then share the latest of their delays; see
    /// --netem).
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub jitter: Option<Duration>,
    /// Jitter client to server.
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub up_jitter: Option<Duration>,
    /// Jitter server to client.
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub down_jitter: Option<Duration>,

    /// Random loss (like 5% or 0.05).
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub loss: Option<f64>,
    /// Random loss client to server.
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub up_loss: Option<f64>,
    /// Random loss server to client.
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub down_loss: Option<f64>,

    /// Gilbert-Elliott burst loss: P,R, then optionally LOSS_BAD and LOSS_GOOD (good-to-bad
    /// and bad-to-good transition probabilities per packet; loss in each state, default 100%
    /// and 0%).
    #[arg(long, value_name = "P,R[,BAD[,GOOD]]", value_parser = parse::gilbert)]
    pub burst_loss: Option<GilbertElliott>,
    /// Burst loss client to server.
    #[arg(long, value_name = "P,R[,BAD[,GOOD]]", value_parser = parse::gilbert)]
    pub up_burst_loss: Option<GilbertElliott>,
    /// Burst loss server to client.
    #[arg(long, value_name = "P,R[,BAD[,GOOD]]", value_parser = parse::gilbert)]
    pub down_burst_loss: Option<GilbertElliott>,

    /// Share of packets held back by --reorder-delay, so that later packets overtake them.
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub reorder: Option<f64>,
    /// Reordering client to server.
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub up_reorder: Option<f64>,
    /// Reordering server to client.
    #[arg(long, value_name = "SHARE", value_parser = parse::share)]
    pub down_reorder: Option<f64>,
    /// How long a reordered packet is held back [default: 10ms].
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub reorder_delay: Option<Duration>,

    /// Bottleneck rate (like 10mbit, 500kbit, 1gbit; IP bytes, no link-layer overhead).
    #[arg(long, value_name = "RATE", value_parser = parse::rate)]
    pub rate: Option<u64>,
    /// Rate client to server.
    #[arg(long, value_name = "RATE", value_parser = parse::rate)]
    pub up_rate: Option<u64>,
    /// Rate server to client.
    #[arg(long, value_name = "RATE", value_parser = parse::rate)]
    pub down_rate: Option<u64>,

    /// The bottleneck's drop-tail queue, in packets (25) or bytes (64kb) [default: 1000].
    #[arg(long, value_name = "SIZE", value_parser = parse::queue)]
    pub queue: Option<QueueLimit>,
    /// Queue client to server.
    #[arg(long, value_name = "SIZE", value_parser = parse::queue)]
    pub up_queue: Option<QueueLimit>,
    /// Queue server to client.
    #[arg(long, value_name = "SIZE", value_parser = parse::queue)]
    pub down_queue: Option<QueueLimit>,

    /// Mahimahi packet-delivery trace as the bottleneck, both directions (one millisecond
    /// timestamp per line, one 1500-byte packet per line; the trace loops).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Trace client to server.
    #[arg(long, value_name = "FILE", visible_alias = "trace-up")]
    pub up_trace: Option<PathBuf>,
    /// Trace server to client.
    #[arg(long, value_name = "FILE", visible_alias = "trace-down")]
    pub down_trace: Option<PathBuf>,

    /// Outages: UP/DOWN, the link works for UP then drops everything for DOWN, repeating from
    /// the start (like 5s/2s).
    #[arg(long, value_name = "UP/DOWN", value_parser = parse::blackhole)]
    pub blackhole: Option<Blackhole>,
    /// Outages client to server only.
    #[arg(long, value_name = "UP/DOWN", value_parser = parse::blackhole)]
    pub up_blackhole: Option<Blackhole>,
    /// Outages server to client only.
    #[arg(long, value_name = "UP/DOWN", value_parser = parse::blackhole)]
    pub down_blackhole: Option<Blackhole>,

    /// Drop every UDP packet in both directions (a network that blocks UDP; TCP passes).
    #[arg(long)]
    pub block_udp: bool,

    /// Jitter and reordering as Linux netem without a rate: each packet leaves at its own
    /// delay +- jitter (jitter reorders), and the --reorder share is sent without the delay,
    /// ahead of the packets before it (--reorder-delay unused), as `tc qdisc ... netem delay
    /// 20ms 5ms reorder 10%` does.
    #[arg(long)]
    pub netem: bool,

    /// Seed of every random choice (printed when not given), for repeatable runs.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// The lab's name: namespaces NAME-server and NAME-client.
    #[arg(long, value_name = "NAME", default_value = "netsim")]
    pub name: String,
    /// Start the client only once something listens on this TCP port, or is bound to this UDP
    /// port, in the server's namespace (waits up to 10 s).
    #[arg(long, value_name = "PORT")]
    pub wait_port: Option<u16>,
    /// End the client after this long (exit code 124).
    #[arg(long, value_name = "TIME", value_parser = parse::duration)]
    pub timeout: Option<Duration>,
    /// Run an interactive shell ($SHELL) in the client namespace as the client command.
    #[arg(long)]
    pub shell: bool,
    /// Print only errors (no banner, no statistics).
    #[arg(short, long)]
    pub quiet: bool,

    /// -- SERVER-COMMAND... -- CLIENT-COMMAND... (leave the server command empty for none:
    /// `-- -- CLIENT...`).
    #[arg(last = true, value_name = "COMMANDS", allow_hyphen_values = true)]
    pub commands: Vec<String>,
}

fn trace(path: &Option<PathBuf>) -> Result<Option<Arc<Trace>>, String> {
    path.as_ref()
        .map(|p| Trace::load(p).map(Arc::new))
        .transpose()
}

impl Args {
    /// The two directions' configurations: (up, down).
    pub fn links(&self) -> Result<(LinkConfig, LinkConfig), String> {
        for (rate, trace, flags) in [
            (self.rate, &self.trace, "--rate and --trace"),
            (self.up_rate, &self.up_trace, "--up-rate and --up-trace"),
            (
                self.down_rate,
                &self.down_trace,
                "--down-rate and --down-trace",
            ),
        ] {
            if rate.is_some() && trace.is_some() {
                return Err(format!("{flags} exclude each other"));
            }
        }
        let both_trace = trace(&self.trace)?;
        let up_trace = trace(&self.up_trace)?.or_else(|| both_trace.clone());
        let down_trace = trace(&self.down_trace)?.or(both_trace);
        let make = |dir: &str,
                    delay: Option<Duration>,
                    jitter: Option<Duration>,
                    loss: Option<f64>,
                    burst: Option<GilbertElliott>,
                    reorder: Option<f64>,
                    rate: Option<u64>,
                    queue: Option<QueueLimit>,
                    trace: Option<Arc<Trace>>,
                    blackhole: Option<Blackhole>| {
            let link = LinkConfig {
                delay: delay.or(self.delay).unwrap_or_default(),
                jitter: jitter.or(self.jitter).unwrap_or_default(),
                loss: loss.or(self.loss).unwrap_or(0.0),
                gilbert: burst.or(self.burst_loss),
                reorder: reorder.or(self.reorder).unwrap_or(0.0),
                reorder_delay: self.reorder_delay.unwrap_or(DEFAULT_REORDER_DELAY),
                // A direction's own trace replaces the common rate, and the other way round.
                rate: rate.or(if trace.is_some() { None } else { self.rate }),
                trace: if rate.is_some() { None } else { trace },
                queue: queue.or(self.queue).unwrap_or(DEFAULT_QUEUE),
                blackhole: blackhole.or(self.blackhole),
                block_udp: self.block_udp,
                netem: self.netem,
            };
            link.validate().map_err(|e| format!("{dir}: {e}"))?;
            Ok::<_, String>(link)
        };
        let up = make(
            "up",
            self.up_delay,
            self.up_jitter,
            self.up_loss,
            self.up_burst_loss,
            self.up_reorder,
            self.up_rate,
            self.up_queue,
            up_trace,
            self.up_blackhole,
        )?;
        let down = make(
            "down",
            self.down_delay,
            self.down_jitter,
            self.down_loss,
            self.down_burst_loss,
            self.down_reorder,
            self.down_rate,
            self.down_queue,
            down_trace,
            self.down_blackhole,
        )?;
        Ok((up, down))
    }

    /// The server and client commands (either may be empty).
    pub fn split_commands(&self) -> Result<(Vec<String>, Vec<String>), String> {
        let (server, client) = match self.commands.iter().position(|a| a == "--") {
            Some(i) => (self.commands[..i].to_vec(), self.commands[i + 1..].to_vec()),
            None if self.shell => (self.commands.clone(), Vec::new()),
            None => {
                return Err(
                    "give the commands as `-- SERVER-COMMAND... -- CLIENT-COMMAND...` \
                     (`-- -- CLIENT...` for no server), or use --shell"
                        .into(),
                );
            }
        };
        if client.is_empty() && !self.shell {
            return Err("the client command is missing (after the second `--`)".into());
        }
        if !client.is_empty() && self.shell {
            return Err("--shell replaces the client command; give one or the other".into());
        }
        Ok((server, client))
    }
}

/// Runs `kuai netsim`.
pub fn run(args: Args) -> ExitCode {
    match run_inner(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("netsim: {e}");
            ExitCode::from(EXIT_NETSIM_ERROR)
        }
    }
}

/// Kills a child's process group (or the child alone) on drop, if it still runs.
struct Proc {
    child: Child,
    group: bool,
    status: Option<ExitStatus>,
}

impl Proc {
    fn spawn(ns: &str, argv: &[String], own_group: bool) -> io::Result<Proc> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns]).args(argv);
        if own_group {
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run `ip netns exec`: {e}")))?;
        Ok(Proc {
            child,
            group: own_group,
            status: None,
        })
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(self.child.id() as i32);
        if self.group {
            let _ = killpg(pid, sig);
        } else {
            let _ = kill(pid, sig);
        }
    }

    /// SIGTERM, then SIGKILL if it has not ended within `grace`.
    fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        if self.poll().is_some() {
            if self.group {
                // The leader is gone; its group may not be.
                self.signal(Signal::SIGKILL);
            }
            return self.status;
        }
        self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.poll().is_some() {
                if self.group {
                    self.signal(Signal::SIGKILL);
                }
                return self.status;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.signal(Signal::SIGKILL);
        self.status = self.child.wait().ok();
        self.status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.poll().is_none() {
            self.signal(Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(s)) => 128u8.wrapping_add(s as u8),
        _ => 1,
    }
}

/// Listens for SIGINT, SIGTERM and SIGHUP on a thread of its own (with its own small runtime,
/// so it works whatever the calling program's threads do with signals) until `done`.
fn watch_signals(
    got: Arc<AtomicI32>,
    done: Arc<AtomicBool>,
) -> io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    use tokio::signal::unix::{SignalKind, signal};
    // Registered here, before any child starts, so that no signal is missed.
    let mut streams = rt.block_on(async {
        Ok::<_, io::Error>([
            (signal(SignalKind::interrupt())?, Signal::SIGINT),
            (signal(SignalKind::terminate())?, Signal::SIGTERM),
            (signal(SignalKind::hangup())?, Signal::SIGHUP),
        ])
    })?;
    std::thread::Builder::new()
        .name("netsim-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                let [(int, _), (term, _), (hup, _)] = &mut streams;
                while !done.load(Ordering::Relaxed) {
                    let sig = tokio::select! {
                        _ = int.recv() => Signal::SIGINT,
                        _ = term.recv() => Signal::SIGTERM,
                        _ = hup.recv() => Signal::SIGHUP,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    };
                    got.store(sig as i32, Ordering::Relaxed);
                }
            })
        })
}

/// Whether `port` is a listening TCP or a bound UDP port in the namespace of process `pid`.
fn port_open(pid: u32, port: u16) -> bool {
    let hex = format!(":{port:04X}");
    ["tcp", "tcp6", "udp", "udp6"].iter().any(|table| {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            return false;
        };
        text.lines().skip(1).any(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&hex) && (table.starts_with("udp") || f[3] == "0A")
        })
    })
}

fn run_inner(args: Args) -> Result<u8, String> {
    let (up, down) = args.links()?;
    let (server_cmd, mut client_cmd) = args.split_commands()?;
    if args.shell {
        client_cmd = vec![std::env::var("SHELL").unwrap_or_else(|_| "/bin/sh".into())];
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    if let Some(why) = lab::unavailable() {
        return Err(format!("cannot build the lab: {why}"));
    }

    let got_signal = Arc::new(AtomicI32::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = watch_signals(got_signal.clone(), done.clone())
        .map_err(|e| format!("cannot watch signals: {e}"))?;
    let result = run_lab(&args, up, down, seed, &server_cmd, &client_cmd, &got_signal);
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    result
}

#[allow(clippy::too_many_arguments)]
fn run_lab(
    args: &Args,
    up: LinkConfig,
    down: LinkConfig,
    seed: u64,
    server_cmd: &[String],
    client_cmd: &[String],
    got_signal: &AtomicI32,
) -> Result<u8, String> {
    let lab = Lab::start(LabConfig {
        name: args.name.clone(),
        up: up.clone(),
        down: down.clone(),
        seed,
    })
    .map_err(|e| format!("cannot build the lab: {e}"))?;
    if !args.quiet {
        eprintln!(
            "netsim: lab {}: server {} in namespace {}, client {} in namespace {}, seed {seed}",
            lab.name(),
            SERVER_ADDR,
            lab.server_netns(),
            CLIENT_ADDR,
            lab.client_netns()
        );
        eprintln!("netsim: up   (client → server): {up}");
        eprintln!("netsim: down (server → client): {down}");
    }

    let signalled = || got_signal.load(Ordering::Relaxed) != 0;
    let mut server = if server_cmd.is_empty() {
        None
    } else {
        Some(Proc::spawn(lab.server_netns(), server_cmd, true).map_err(|e| e.to_string())?)
    };
    if let (Some(port), Some(s)) = (args.wait_port, server.as_mut()) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !port_open(s.child.id(), port) {
            if let Some(status) = s.poll() {
                return Err(format!(
                    "the server command ended ({status}) before port {port} opened"
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "nothing opened port {port} in the server namespace within 10 s"
                ));
            }
            if signalled() {
                return Err("interrupted".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    if signalled() {
        return Err("interrupted".into());
    }
    let mut client =
        Proc::spawn(lab.client_netns(), client_cmd, false).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut server_ended = false;
    let mut failure = None;
    let code = loop {
        if let Some(status) = client.poll() {
            break exit_code(status);
        }
        if let Some(s) = server.as_mut()
            && !server_ended
            && let Some(status) = s.poll()
        {
            server_ended = true;
            if !args.quiet {
                eprintln!("netsim: the server command ended ({status}); the client goes on");
            }
        }
        if signalled() {
            // The client may have had the terminal's SIGINT too: give it a moment.
            let status = client.terminate(Duration::from_secs(2));
            break status.map_or(130, exit_code);
        }
        if args.timeout.is_some_and(|t| started.elapsed() > t) {
            if !args.quiet {
                eprintln!("netsim: timeout: ending the client");
            }
            client.terminate(Duration::from_secs(2));
            break EXIT_TIMEOUT;
        }
        if !lab.is_forwarding() {
            failure = Some("the link stopped forwarding".to_string());
            client.terminate(Duration::from_secs(1));
            break EXIT_NETSIM_ERROR;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if let Some(s) = server.as_mut() {
        s.terminate(Duration::from_secs(2));
    }
    let report = lab.stop();
    if !args.quiet {
        print_report(&report);
    }
    for (dir, r) in [("up", &report.up), ("down", &report.down)] {
        if let Some(e) = &r.error {
            eprintln!("netsim: {dir}: {e}");
        }
    }
    match failure {
        Some(f) => Err(f),
        None => Ok(code),
    }
}

fn print_direction(
    out: &mut impl Write,
    name: &str,
    r: &DirectionReport,
    secs: f64,
) -> io::Result<()> {
    let s = &r.stats;
    writeln!(
        out,
        "netsim: {name}: {} packets in, {} delivered ({} bytes, {} mean), {} dropped \
         (loss {}, burst {}, queue {}, blackhole {}{}), {} reordered",
        s.packets_in,
        s.delivered,
        s.bytes_delivered,
        Rate(s.bytes_delivered as f64 * 8.0 / secs.max(1e-9)),
        s.dropped(),
        s.dropped_loss,
        s.dropped_burst,
        s.dropped_queue,
        s.dropped_blackhole,
        if s.dropped_overflow > 0 {
            format!(", overflow {}", s.dropped_overflow)
        } else {
            String::new()
        },
        s.reordered,
    )?;
    if r.blocked_udp > 0 {
        writeln!(
            out,
            "netsim: {name}:   UDP packets blocked: {}",
            r.blocked_udp
        )?;
    }
    if s.delivered > 0 {
        writeln!(out, "netsim: {name}:   time in link: {}", s.delay)?;
        writeln!(
            out,
            "netsim: {name}:   release lateness: p50 {} p99 {} max {}{}",
            Short(r.lateness.quantile(0.5)),
            Short(r.lateness.quantile(0.99)),
            Short(r.lateness.max()),
            if r.write_errors > 0 {
                format!(", {} write errors", r.write_errors)
            } else {
                String::new()
            }
        )?;
    }
    Ok(())
}

/// Prints the per-direction statistics (to stderr).
pub fn print_report(report: &LabReport) {
    let secs = report.elapsed.as_secs_f64();
    let mut err = io::stderr().lock();
    let _ = print_direction(&mut err, "up  ", &report.up, secs);
    let _ = print_direction(&mut err, "down", &report.down, secs);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("netsim").chain(argv.iter().copied()))
            .unwrap_or_else(|e| panic!("{e}"))
            .args
    }

    #[test]
    fn commands_split_at_the_second_separator() {
        let a = parse(&[
            "--delay", "20ms", "--", "server", "-x", "--flag", "--", "client", "--", "more",
        ]);
        let (s, c) = a.split_commands().unwrap();
        assert_eq!(s, ["server", "-x", "--flag"]);
        assert_eq!(c, ["client", "--", "more"]);
        let a = parse(&["--", "--", "client"]);
        let (s, c) = a.split_commands().unwrap();
        assert!(s.is_empty());
        assert_eq!(c, ["client"]);
        assert!(parse(&["--", "server"]).split_commands().is_err());
        assert!(parse(&["--", "server", "--"]).split_commands().is_err());
        let a = parse(&["--shell"]);
        assert_eq!(a.split_commands().unwrap(), (vec![], vec![]));
    }

    #[test]
    fn per_direction_overrides() {
        let a = parse(&[
            "--delay",
            "20ms",
            "--up-delay",
            "5ms",
            "--loss",
            "5%",
            "--down-loss",
            "0",
            "--rate",
            "10mbit",
            "--queue",
            "25",
            "--up-rate",
            "2mbit",
            "--blackhole",
            "5s/2s",
            "--seed",
            "7",
            "--",
            "--",
            "true",
        ]);
        let (up, down) = a.links().unwrap();
        assert_eq!(up.delay, Duration::from_millis(5));
        assert_eq!(down.delay, Duration::from_millis(20));
        assert_eq!((up.loss, down.loss), (0.05, 0.0));
        assert_eq!((up.rate, down.rate), (Some(2_000_000), Some(10_000_000)));
        assert_eq!(up.queue, QueueLimit::Packets(25));
        assert!(up.blackhole.is_some() && down.blackhole.is_some());
        assert_eq!(a.seed, Some(7));
        assert!(up.to_string().contains("rate 2.000 Mbit/s"), "{up}");
    }

    #[test]
    fn a_trace_replaces_the_common_rate() {
        let dir = std::env::temp_dir().join(format!("netsim-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.trace");
        std::fs::write(&file, "1\n2\n3\n").unwrap();
        let f = file.to_str().unwrap();
        let a = parse(&["--rate", "10mbit", "--trace-down", f, "--", "--", "true"]);
        let (up, down) = a.links().unwrap();
        assert_eq!(up.rate, Some(10_000_000));
        assert!(up.trace.is_none());
        assert!(down.rate.is_none());
        assert_eq!(down.trace.as_ref().unwrap().len(), 3);
        let a = parse(&["--trace", f, "--up-rate", "1mbit", "--", "--", "true"]);
        let (up, down) = a.links().unwrap();
        assert!(up.trace.is_none() && up.rate == Some(1_000_000));
        assert!(down.trace.is_some() && down.rate.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_values_are_refused() {
        for argv in [
            &["--loss", "5", "--", "--", "x"][..],
            &["--rate", "10mbps", "--", "--", "x"],
            &["--delay", "20", "--", "--", "x"],
            &["--burst-loss", "1%", "--", "--", "x"],
        ] {
            assert!(
                Cli::try_parse_from(std::iter::once("netsim").chain(argv.iter().copied())).is_err(),
                "{argv:?}"
            );
        }
    }
}
