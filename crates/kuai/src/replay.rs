//! 0-RTT anti-replay across servers: [`AntiReplay`].
//!
//! An attacker who captures a client's first flight (Initial with the ClientHello, then
//! 0-RTT packets) can send it again, to the same server or to another one of a fleet. One
//! server refuses the copy on its own: its session store hands each ticket out once
//! (RFC 8446 §8.1). A fleet whose servers share sessions must also record each ticket's first
//! use where every server sees it (RFC 8446 §8, RFC 9001 §9.2).
//!
//! With an [`AntiReplay`] set on the [`ServerConfig`](crate::ServerConfig), a connection
//! whose 0-RTT data the server accepted is held back from
//! [`Endpoint::accept`](crate::Endpoint::accept) until the guard has answered for its ticket: first use, and the
//! application gets the connection and its early requests; a replay, and the connection is
//! refused (CONNECTION_REFUSED) before the application sees a byte of it. Its packets go on
//! meanwhile (nothing waits in the packet path); only the application's first look at the
//! early data waits for the answer. Connections without 0-RTT are not held.

use std::sync::{Arc, Weak};

use kuai_proto::ConnectionHandle;

use crate::endpoint::Shared;

/// Records the first use of each 0-RTT session ticket; see the [module](self) docs.
///
/// `check` must not block: it starts the lookup (e.g. a Redis `SET NX` on a task) and
/// answers through `verdict` when it has it. A verdict dropped unanswered counts as a
/// replay.
pub trait AntiReplay: Send + Sync + 'static {
    /// Whether `ticket` (the first PSK identity of the ClientHello, RFC 8446 §4.2.10) is used
    /// for the first time; answer through `verdict`.
    fn check(&self, ticket: &[u8], verdict: Verdict);

    /// Records `ticket` as used, with no answer awaited: a client offered 0-RTT data with it
    /// and this server did not take the data (its requests come again in 1-RTT, here), so a
    /// copy of that first flight at another server must count as a replay. Must not block.
    fn record(&self, ticket: &[u8]) {
        let _ = ticket;
    }
}

/// The answer for one held connection; see [`AntiReplay::check`].
pub struct Verdict {
    worker: Weak<Shared>,
    handle: ConnectionHandle,
    seq: u64,
    answered: bool,
}

impl std::fmt::Debug for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verdict").field("seq", &self.seq).finish()
    }
}

impl Verdict {
    pub(crate) fn new(worker: &Arc<Shared>, handle: ConnectionHandle, seq: u64) -> Self {
        Self {
            worker: Arc::downgrade(worker),
            handle,
            seq,
            answered: false,
        }
    }

    /// The ticket's first use: the application gets the connection.
    pub fn first_use(mut self) {
        self.answer(true);
    }

    /// A replay: the connection is refused.
    pub fn replayed(mut self) {
        self.answer(false);
    }

    fn answer(&mut self, first: bool) {
        if std::mem::replace(&mut self.answered, true) {
            return;
        }
        if let Some(w) = self.worker.upgrade() {
            w.lock().verdicts.push((self.handle, self.seq, first));
            w.kick();
        }
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        self.answer(false);
    }
}

/// A connection held back from `accept` (see the [module](self) docs).
pub(crate) struct Held {
    pub handle: ConnectionHandle,
    pub seq: u64,
    /// The guard was asked.
    pub asked: bool,
}
