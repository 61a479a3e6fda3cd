//! [`RedisAntiReplay`]: each 0-RTT ticket's first use recorded in Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kuai::replay::{AntiReplay, Verdict};

use crate::{FleetError, Link};

/// Records each ticket's first use with `SET kuai:0rtt:<SHA-256 of the ticket> 1 NX PX
/// <window>`; see the [crate](crate) docs. When Redis does not answer in time the ticket
/// counts as a replay, this server's own as much as another's: a server cut off from Redis
/// cannot know whether another, which can reach it, served the same flight. So does every
/// ticket while this server's clock is too far from Redis's (`TIME`, read with the `SET`),
/// and for a replay window after Redis restarted (its records may be gone).
pub struct RedisAntiReplay {
    link: Arc<Link>,
    window: Duration,
    max_skew: Duration,
    /// Whether the last reading found the clocks too far apart (said once per change).
    skewed: Arc<AtomicBool>,
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
    pub(crate) fn new(link: Arc<Link>, window: Duration, max_skew: Duration) -> Self {
        Self {
            link,
            window,
            max_skew,
            skewed: Arc::new(AtomicBool::new(false)),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Whether `ticket` is used for the first time (`Err` when Redis did not answer, when
    /// this server's clock is too far from Redis's: [`FleetError::ClockSkew`], or within a
    /// replay window of a Redis restart: [`FleetError::ReplayRecordsLost`]). The use is
    /// recorded either way.
    pub async fn first_use(&self, ticket: &[u8]) -> Result<bool, FleetError> {
        let name = format!(
            "kuai:0rtt:{}",
            crate::keys::hex(ring::digest::digest(&ring::digest::SHA256, ticket).as_ref())
        );
        let window_ms = self.window.as_millis() as u64;
        let mut pipe = redis::pipe();
        pipe.cmd("TIME")
            .cmd("SET")
            .arg(&name)
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(window_ms);
        let ((secs, micros), set): ((u64, u64), Option<String>) =
            self.link.run(crate::Query::Pipe(&pipe)).await?;
        let here = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let redis = Duration::from_secs(secs) + Duration::from_micros(micros);
        let ahead_ms = here.as_millis() as i64 - redis.as_millis() as i64;
        let too_far = here.abs_diff(redis) > self.max_skew;
        if too_far != self.skewed.swap(too_far, Ordering::Relaxed) {
            if too_far {
                tracing::warn!(target: "kuai::fleet", ahead_ms,
                    "this server's clock is too far from redis's: 0-RTT refused until it is back");
            } else {
                tracing::info!(target: "kuai::fleet", ahead_ms,
                    "this server's clock agrees with redis's again: 0-RTT accepted");
            }
        }
        if too_far {
            return Err(FleetError::ClockSkew { ahead_ms });
        }
        if let Some(ago) = self.link.records_lost() {
            return Err(FleetError::ReplayRecordsLost { ago });
        }
        Ok(set.is_some())
    }
}

impl RedisAntiReplay {
    /// A copy for a task of its own.
    fn detached(&self) -> Self {
        Self {
            link: self.link.clone(),
            window: self.window,
            max_skew: self.max_skew,
            skewed: self.skewed.clone(),
            runtime: self.runtime.clone(),
        }
    }
}

impl AntiReplay for RedisAntiReplay {
    fn record(&self, ticket: &[u8]) {
        let ticket = ticket.to_vec();
        let me = self.detached();
        self.runtime.spawn(async move {
            // (Recorded also when the clocks disagree or Redis restarted: the SET ran.)
            if let Err(e) = me.first_use(&ticket).await
                && !matches!(
                    e,
                    FleetError::ClockSkew { .. } | FleetError::ReplayRecordsLost { .. }
                )
            {
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
                // Both said once in the log when they begin.
                Err(FleetError::ClockSkew { .. } | FleetError::ReplayRecordsLost { .. }) => {
                    verdict.replayed()
                }
                Err(e) => {
                    tracing::info!(target: "kuai::fleet", error = %e,
                        "0-RTT refused: redis cannot say whether the ticket was used before");
                    verdict.replayed()
                }
            }
        });
    }
}
