//! Network namespaces through iproute2 (`ip netns ...`), and TUN devices made inside them by
//! a thread that enters the namespace.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tun_rs::{DeviceBuilder, SyncDevice};

const NETNS_DIR: &str = "/run/netns";

/// Why namespaces cannot be made here, if they cannot.
pub(crate) fn unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not running as root (network namespaces and TUN devices need it)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing (no TUN support)".into());
    }
    match Command::new("ip")
        .args(["netns", "list"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!("`ip netns list` failed ({s})")),
        Err(e) => Some(format!("cannot run `ip` (iproute2): {e}")),
    }
}

/// Runs `ip ARGS...`; its error output becomes the error.
pub(crate) fn ip(args: &[&str]) -> io::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run `ip`: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(io::Error::other(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

fn path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// Whether a namespace of this name exists.
pub(crate) fn exists(name: &str) -> bool {
    path(name).exists()
}

/// Creates a namespace with its loopback up.
pub(crate) fn create(name: &str) -> io::Result<()> {
    ip(&["netns", "add", name])?;
    ip(&["-n", name, "link", "set", "lo", "up"])?;
    Ok(())
}

/// The processes in a namespace.
pub(crate) fn pids(name: &str) -> Vec<i32> {
    ip(&["netns", "pids", name])
        .map(|out| {
            out.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills every process left in a namespace (SIGKILL) and waits up to a second for them to go.
pub(crate) fn kill_all(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let left = pids(name);
        if left.is_empty() || Instant::now() > deadline {
            return;
        }
        for pid in left {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills what runs in a namespace and deletes it; a missing namespace is not an error.
pub(crate) fn delete(name: &str) -> io::Result<()> {
    if !exists(name) {
        return Ok(());
    }
    kill_all(name);
    ip(&["netns", "del", name]).map(drop)
}

/// Runs `f` on a thread that has entered the namespace.
pub(crate) fn within<T: Send>(
    name: &str,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    let ns = File::open(path(name))
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open namespace {name}: {e}")))?;
    std::thread::scope(|s| {
        s.spawn(move || {
            setns(&ns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| io::Error::other(format!("cannot enter namespace {name}: {e}")))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked")))
    })
}

/// Makes a TUN device inside a namespace, with an IPv4 address, the MTU, no IPv6 (so that the
/// kernel's own IPv6 chatter does not cross the link), and up.
pub(crate) fn create_tun(
    ns: &str,
    dev: &str,
    addr: Ipv4Addr,
    prefix: u8,
    mtu: u16,
) -> io::Result<SyncDevice> {
    within(ns, || {
        let tun = DeviceBuilder::new()
            .name(dev)
            .mtu(mtu)
            .ipv4(addr, prefix, None)
            // The emulator reads the device from userspace: a burst faster than it reads
            // waits in the device's queue, and past it would be dropped, a loss the emulated
            // link never decided. With 1,000 (the usual default) lab experiment 4's ten
            // parallel downloads lost 5,967 of 119,656 packets there. 10,000 full packets
            // are 15 MB of kernel memory at most, and the emulated queue (`--queue`) still
            // decides what a bottleneck drops.
            .tx_queue_len(10_000)
            .enable(false)
            .build_sync()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot create TUN {dev}: {e}")))?;
        // Net sysctls are those of the namespace of the thread that opens them.
        match std::fs::write(format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"), "1") {
            // A kernel without IPv6 has nothing to switch off.
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot switch IPv6 off on {dev}: {e}"),
                ));
            }
            _ => {}
        }
        tun.enabled(true)?;
        Ok(tun)
    })
}
