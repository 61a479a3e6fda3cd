//! [`RedisAntiReplay`]: each 0-RTT ticket's first use recorded in Redis.

use std::sync::Arc;
use std::time::Duration;

use kuai::replay::{AntiReplay, Verdict};

use crate::sessions::FleetSessions;
use crate::{FleetError, Link};

/// Records each ticket's first use with `SET kuai:0rtt:<SHA-256 of the ticket> 1 NX PX
/// <window>`; see the [crate](crate) docs. When Redis does not answer in time, a server's
/// own ticket counts as first use (it was handed out once, here) and another's as a replay.
pub struct RedisAntiReplay {
    link: Arc<Link>,
    sessions: Arc<FleetSessions>,
    window: Duration,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for RedisAntiReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAntiReplay")
            .field("window", &self.window)
            .finish()
    }
}

impl RedisAntiReplay {
    pub(crate) fn new(link: Arc<Link>, sessions: Arc<FleetSessions>, window: Duration) -> Self {
        Self {
            link,
            sessions,
            window,
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Whether `ticket` is used for the first time (`Err` when Redis did not answer).
    pub async fn first_use(&self, ticket: &[u8]) -> Result<bool, FleetError> {
        let name = format!(
            "kuai:0rtt:{}",
            crate::keys::hex(ring::digest::digest(&ring::digest::SHA256, ticket).as_ref())
        );
        let window_ms = self.window.as_millis() as u64;
        let mut cmd = redis::cmd("SET");
        cmd.arg(&name).arg(1).arg("NX").arg("PX").arg(window_ms);
        let set: Option<String> = self.link.run(crate::Query::Cmd(&cmd)).await?;
        Ok(set.is_some())
    }
}

impl AntiReplay for RedisAntiReplay {
    fn check(&self, ticket: &[u8], verdict: Verdict) {
        let ticket = ticket.to_vec();
        let (link, sessions, window) = (self.link.clone(), self.sessions.clone(), self.window);
        let me = Self {
            link,
            sessions,
            window,
            runtime: self.runtime.clone(),
        };
        self.runtime.spawn(async move {
            match me.first_use(&ticket).await {
                Ok(true) => verdict.first_use(),
                Ok(false) => verdict.replayed(),
                Err(e) if me.sessions.took_own(&ticket) => {
                    tracing::debug!(target: "kuai::fleet", error = %e,
                        "0-RTT first use not recorded: this server's own ticket, used once here");
                    verdict.first_use()
                }
                Err(e) => {
                    tracing::info!(target: "kuai::fleet", error = %e,
                        "0-RTT refused: another server's ticket and redis cannot say whether it was used");
                    verdict.replayed()
                }
            }
        });
    }
}
