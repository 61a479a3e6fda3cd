//! `kuai netsim`: a userspace link emulator for this machine, whose kernel has no netem.
//!
//! Two network namespaces, a server's (10.77.0.1) and a client's (10.77.0.2), each get a TUN
//! device; one process in the root namespace holds both devices and forwards the IP packets
//! between them through an impairment model per direction ("up" is client to server, "down"
//! server to client): delay and jitter, random and Gilbert-Elliott burst loss, reordering, a
//! rate limit or Mahimahi delivery trace with a finite drop-tail queue, and blackhole outages.
//!
//! - [`model`] is the impairment model: pure, deterministic from a seed, no I/O.
//! - [`trace`] reads Mahimahi traces.
//! - [`lab`] creates the namespaces and devices and runs the forwarding threads.
//! - [`cli`] is the `kuai netsim` command.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod cli;
mod forward;
pub mod lab;
pub mod model;
mod netns;
pub mod parse;
pub mod stats;
pub mod trace;

pub use lab::{Lab, LabConfig, LabReport};
pub use model::{Blackhole, GilbertElliott, Impairment, LinkConfig, Pipe, QueueLimit, Verdict};
pub use stats::{DirectionStats, DropReason, Histogram};
pub use trace::Trace;
