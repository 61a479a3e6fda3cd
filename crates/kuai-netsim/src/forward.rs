//! The forwarding loop of one direction: read packets from one TUN device, pass them through
//! the direction's [`Pipe`], write them to the other device at their release time.
//!
//! One plain thread per direction waits in `ppoll(2)` on its input device with a timeout that
//! ends at the next release (nanosecond resolution, timer slack set to 1 µs), so releases are
//! not rounded to milliseconds as a millisecond timer wheel would.

use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, ppoll};
use nix::sys::time::TimeSpec;
use tun_rs::SyncDevice;

use crate::model::Pipe;
use crate::stats::{DirectionStats, Histogram};

/// The longest wait, so that a stop request is seen quickly.
const MAX_WAIT: Duration = Duration::from_millis(20);
/// Packets read in one go before due packets are released again.
const READ_BATCH: usize = 32;
/// Spare packet buffers kept for reuse.
const POOL: usize = 512;

/// What one direction did.
#[derive(Debug, Clone, Default)]
pub struct DirectionReport {
    /// The model's counters and the time packets spent in the link.
    pub stats: DirectionStats,
    /// How late the write of each packet started after its scheduled release: the emulator's
    /// timing error (the write itself, which runs the receiving stack, comes on top).
    pub lateness: Histogram,
    /// Packets the output device refused.
    pub write_errors: u64,
    /// UDP packets dropped by `block_udp`.
    pub blocked_udp: u64,
    /// Why the loop ended early, if it did.
    pub error: Option<String>,
}

/// Forwards until `stop` is set or a device fails.
pub(crate) fn run(
    input: Arc<SyncDevice>,
    output: Arc<SyncDevice>,
    mut pipe: Pipe<Vec<u8>>,
    stop: Arc<AtomicBool>,
) -> DirectionReport {
    let mut report = DirectionReport::default();
    if let Err(e) = forward(&input, &output, &mut pipe, &stop, &mut report) {
        report.error = Some(e.to_string());
    }
    report.stats = pipe.stats().clone();
    report
}

fn forward(
    input: &SyncDevice,
    output: &SyncDevice,
    pipe: &mut Pipe<Vec<u8>>,
    stop: &AtomicBool,
    report: &mut DirectionReport,
) -> io::Result<()> {
    input.set_nonblocking(true)?;
    // Best effort: the default slack of 50 µs would be most of the timing error.
    let _ = nix::sys::prctl::set_timerslack(1_000);
    let mut scratch = vec![0u8; 65_536];
    let mut pool: Vec<Vec<u8>> = Vec::with_capacity(POOL);
    let block_udp = pipe.model().config().block_udp;
    loop {
        let now = Instant::now();
        while let Some((packet, due)) = pipe.pop_due(now) {
            report
                .lateness
                .record(Instant::now().saturating_duration_since(due));
            if output.send(&packet).is_err() {
                report.write_errors += 1;
            }
            if pool.len() < POOL {
                pool.push(packet);
            }
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let wait = pipe
            .next_release()
            .map_or(MAX_WAIT, |t| t.saturating_duration_since(Instant::now()))
            .min(MAX_WAIT);
        if !wait.is_zero() {
            let mut fds = [PollFd::new(input.as_fd(), PollFlags::POLLIN)];
            match ppoll(&mut fds, Some(TimeSpec::from_duration(wait)), None) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(io::Error::other(format!("ppoll: {e}"))),
            }
        }
        for _ in 0..READ_BATCH {
            match input.recv(&mut scratch) {
                Ok(n) => {
                    if block_udp && crate::model::is_udp(&scratch[..n]) {
                        report.blocked_udp += 1;
                        continue;
                    }
                    let arrived = Instant::now();
                    let mut packet = pool.pop().unwrap_or_default();
                    packet.clear();
                    packet.extend_from_slice(&scratch[..n]);
                    if let Err((_, packet)) = pipe.push(arrived, n, packet)
                        && pool.len() < POOL
                    {
                        pool.push(packet);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}
