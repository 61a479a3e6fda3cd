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
    /// What [`AntiReplay::record`] may still write now (see [`RECORD_RATE`]).
    records: Arc<std::sync::Mutex<Bucket>>,
}

/// Uses of tickets offered with 0-RTT and refused here ([`AntiReplay::record`]) written per
/// second at most, in bursts of as many. Any ClientHello can offer any ticket identity: a
/// flood of made-up ones would otherwise each cost a Redis write and a key kept for the
/// replay window. A real client's offer refused here is rare (a busy server, a replica not
/// there yet); while a Redis restart pauses 0-RTT, every server refuses it anyway.
const RECORD_RATE: f64 = 1024.0;

/// A token bucket for [`RECORD_RATE`].
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: std::time::Instant,
    skipped: u64,
    said: Option<std::time::Instant>,
}

impl Bucket {
    fn new() -> Self {
        Self {
            tokens: RECORD_RATE,
            at: std::time::Instant::now(),
            skipped: 0,
            said: None,
        }
    }

    /// Whether one more record may be written now.
    fn take(&mut self, now: std::time::Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * RECORD_RATE).min(RECORD_RATE);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        self.skipped += 1;
        if self
            .said
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(60))
        {
            self.said = Some(now);
            tracing::warn!(target: "kuai::fleet", skipped = self.skipped,
                "more 0-RTT offers refused here than can be recorded: some not recorded as used");
        }
        false
    }
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
            records: Arc::new(std::sync::Mutex::new(Bucket::new())),
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
        // (A reply no Redis gives, far beyond any clock, counts as skewed, not a panic.)
        let redis = Duration::from_secs(secs)
            .checked_add(Duration::from_micros(micros))
            .unwrap_or(Duration::MAX);
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
            records: self.records.clone(),
        }
    }
}

impl AntiReplay for RedisAntiReplay {
    fn record(&self, ticket: &[u8]) {
        let now = std::time::Instant::now();
        if !self
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(now)
        {
            return;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood of offers refused here is recorded at [`RECORD_RATE`] a second, in bursts of
    /// as many, and no more.
    #[test]
    fn records_of_refused_offers_are_rate_limited() {
        let t = std::time::Instant::now();
        let mut b = Bucket::new();
        b.at = t;
        let burst = (0..5000).filter(|_| b.take(t)).count();
        assert_eq!(burst, RECORD_RATE as usize);
        let later = t + Duration::from_millis(500);
        let refilled = (0..5000).filter(|_| b.take(later)).count();
        assert_eq!(refilled, RECORD_RATE as usize / 2);
        assert_eq!(b.skipped, 2 * 5000 - burst as u64 - refilled as u64);
    }
}
