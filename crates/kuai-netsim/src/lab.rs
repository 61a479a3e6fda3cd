//! The lab: two namespaces, a TUN device in each, and the two forwarding threads.
//!
//! | namespace        | address       | device    |
//! |------------------|---------------|-----------|
//! | `<name>-server`  | 10.77.0.1/24  | `netsim0` |
//! | `<name>-client`  | 10.77.0.2/24  | `netsim0` |
//!
//! Both have their loopback up and an MTU of 1500. "Up" is the client-to-server direction,
//! "down" server-to-client. Dropping a [`Lab`] (or [`Lab::stop`]) stops the forwarding, kills
//! whatever still runs in the namespaces and deletes them; the TUN devices go with the
//! process's file descriptors.

use std::io;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::kill;
use nix::unistd::Pid;

pub use crate::forward::DirectionReport;
use crate::model::{DEFAULT_PIPE_LIMIT, Impairment, LinkConfig, Pipe, sub_seed};
use crate::{forward, netns};

/// The server namespace's address.
pub const SERVER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// The client namespace's address.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
/// The prefix length of both addresses.
pub const PREFIX: u8 = 24;
/// The MTU of both TUN devices.
pub const MTU: u16 = 1500;
/// The name of the TUN device in each namespace.
pub const DEVICE: &str = "netsim0";
/// Where running labs record their process id, so that a second lab of the same name does not
/// tear down a live one.
const RUN_DIR: &str = "/run/kuai-netsim";

/// What to build.
#[derive(Debug, Clone)]
pub struct LabConfig {
    /// The lab's name; the namespaces are `<name>-server` and `<name>-client`.
    pub name: String,
    /// Client to server.
    pub up: LinkConfig,
    /// Server to client.
    pub down: LinkConfig,
    /// The seed of every random choice.
    pub seed: u64,
}

/// A running lab.
pub struct Lab {
    name: String,
    server_ns: String,
    client_ns: String,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<DirectionReport>>,
    started: Instant,
    owned: bool,
}

/// What the lab did, per direction.
#[derive(Debug, Clone)]
pub struct LabReport {
    /// Client to server.
    pub up: DirectionReport,
    /// Server to client.
    pub down: DirectionReport,
    /// How long the link ran.
    pub elapsed: Duration,
}

/// The namespace names of a lab: (server, client).
pub fn namespaces(name: &str) -> (String, String) {
    (format!("{name}-server"), format!("{name}-client"))
}

/// Why a lab cannot be started on this machine (not root, no TUN, no `ip netns`), if so.
pub fn unavailable() -> Option<String> {
    netns::unavailable()
}

fn check_name(name: &str) -> io::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("lab name `{name}`: use up to 64 letters, digits, - and _"),
        ))
    }
}

fn pid_file(name: &str) -> PathBuf {
    PathBuf::from(RUN_DIR).join(format!("{name}.pid"))
}

/// Refuses to start if another live process runs a lab of this name; records our pid.
fn claim(name: &str) -> io::Result<()> {
    std::fs::create_dir_all(RUN_DIR)?;
    let file = pid_file(name);
    if let Ok(text) = std::fs::read_to_string(&file)
        && let Ok(pid) = text.trim().parse::<i32>()
        && pid != std::process::id() as i32
        && kill(Pid::from_raw(pid), None).is_ok()
    {
        let exe = |p: String| std::fs::read_link(p).ok();
        if exe(format!("/proc/{pid}/exe")) == exe("/proc/self/exe".into()) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("a lab named `{name}` is running in process {pid}; choose another name"),
            ));
        }
    }
    std::fs::write(&file, format!("{}\n", std::process::id()))
}

impl Lab {
    /// Builds the namespaces and devices (deleting leftovers of a crashed lab of the same
    /// name first) and starts forwarding.
    pub fn start(cfg: LabConfig) -> io::Result<Lab> {
        check_name(&cfg.name)?;
        for (dir, link) in [("up", &cfg.up), ("down", &cfg.down)] {
            link.validate()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{dir}: {e}")))?;
        }
        if let Some(why) = netns::unavailable() {
            return Err(io::Error::new(io::ErrorKind::Unsupported, why));
        }
        claim(&cfg.name)?;
        let (server_ns, client_ns) = namespaces(&cfg.name);
        let mut lab = Lab {
            name: cfg.name.clone(),
            server_ns,
            client_ns,
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            started: Instant::now(),
            owned: true,
        };
        // From here on, dropping `lab` on an error cleans up.
        for ns in [&lab.server_ns, &lab.client_ns] {
            netns::delete(ns)?;
            netns::create(ns)?;
        }
        let server = Arc::new(netns::create_tun(
            &lab.server_ns,
            DEVICE,
            SERVER_ADDR,
            PREFIX,
            MTU,
        )?);
        let client = Arc::new(netns::create_tun(
            &lab.client_ns,
            DEVICE,
            CLIENT_ADDR,
            PREFIX,
            MTU,
        )?);
        let start = Instant::now();
        lab.started = start;
        let directions = [
            ("netsim-up", &client, &server, cfg.up, 1),
            ("netsim-down", &server, &client, cfg.down, 2),
        ];
        for (thread, input, output, link, stream) in directions {
            let model = Impairment::new(link, sub_seed(cfg.seed, stream), start);
            let pipe = Pipe::new(model, DEFAULT_PIPE_LIMIT);
            let (input, output, stop) = (input.clone(), output.clone(), lab.stop.clone());
            lab.threads.push(
                std::thread::Builder::new()
                    .name(thread.into())
                    .spawn(move || forward::run(input, output, pipe, stop))?,
            );
        }
        Ok(lab)
    }

    /// The lab's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's namespace (10.77.0.1).
    pub fn server_netns(&self) -> &str {
        &self.server_ns
    }

    /// The client's namespace (10.77.0.2).
    pub fn client_netns(&self) -> &str {
        &self.client_ns
    }

    /// Whether both directions still forward (a device error ends a direction early).
    pub fn is_forwarding(&self) -> bool {
        self.threads.iter().all(|t| !t.is_finished())
    }

    /// Stops forwarding, deletes the namespaces (killing what still runs in them) and returns
    /// the statistics.
    pub fn stop(mut self) -> LabReport {
        let (up, down) = self.shut_down();
        LabReport {
            up,
            down,
            elapsed: self.started.elapsed(),
        }
    }

    fn shut_down(&mut self) -> (DirectionReport, DirectionReport) {
        self.stop.store(true, Ordering::Relaxed);
        let mut reports = self.threads.drain(..).map(|t| {
            t.join().unwrap_or_else(|_| DirectionReport {
                error: Some("the forwarding thread panicked".into()),
                ..Default::default()
            })
        });
        let up = reports.next().unwrap_or_default();
        let down = reports.next().unwrap_or_default();
        if self.owned {
            self.owned = false;
            for ns in [&self.server_ns, &self.client_ns] {
                if let Err(e) = netns::delete(ns) {
                    eprintln!("netsim: cannot delete namespace {ns}: {e}");
                }
            }
            let _ = std::fs::remove_file(pid_file(&self.name));
        }
        (up, down)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.owned {
            self.shut_down();
        }
    }
}

/// Runs `f` on a thread inside the namespace `ns` (for tests and tools that talk across the
/// link without spawning processes).
pub fn within<T: Send>(ns: &str, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    netns::within(ns, f)
}
