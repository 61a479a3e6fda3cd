//! [`RedisAntiReplay`]: each 0-RTT ticket's first use recorded in Redis.

use std::sync::Arc;
use std::time::Duration;

use kuai::replay::{AntiReplay, Verdict};

use crate::{FleetError, Link};

/// Records each ticket's first use with `SET kuai:0rtt:<SHA-256 of the ticket> 1 NX PX
/// <window>`; see the [crate](crate) docs. When Redis does not answer in time the ticket
/// counts as a replay, this server's own as much as another's: a server cut off from Redis
/// cannot know whether another, which can reach it, served the same flight.
pub struct RedisAntiReplay {
    link: Arc<Link>,
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
    pub(crate) fn new(link: Arc<Link>, window: Duration) -> Self {
        Self {
            link,
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

impl RedisAntiReplay {
    /// A copy for a task of its own.
    fn detached(&self) -> Self {
        Self {
            link: self.link.clone(),
            window: self.window,
            runtime: self.runtime.clone(),
        }
    }
}

impl AntiReplay for RedisAntiReplay {
    fn record(&self, ticket: &[u8]) {
        let ticket = ticket.to_vec();
        let me = self.detached();
        self.runtime.spawn(async move {
            if let Err(e) = me.first_use(&ticket).await {
                tracing::info!(target: "kuai::fleet", error = %e,
                    "a ticket offered with 0-RTT, refused here, could not be recorded as used");
            }
        });
    }

    fn check(&self, ticket: &[u8], verdict: Verdict) {
        let ticket = ticket.to_vec();
        let me = self.detached();
        self.runtime.spawn(async move {
            match me.first_use(&ticket).await {
                Ok(true) => verdict.first_use(),
                Ok(false) => verdict.replayed(),
                // Fail closed. A server's own ticket is no exception: its session is taken
                // here, but the others hold replicas until this use reaches them through
                // Redis, and one that can reach Redis would record a replay's use as first.
                Err(e) => {
                    tracing::info!(target: "kuai::fleet", error = %e,
                        "0-RTT refused: redis cannot say whether the ticket was used before");
                    verdict.replayed()
                }
            }
        });
    }
}
