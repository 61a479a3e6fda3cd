//! A fleet of kuai servers behind a load balancer, sharing through Redis what lets any of
//! them resume any client's session in 0-RTT, refuse a replayed 0-RTT flight wherever it
//! lands, validate another's address tokens and reset another's connections.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! # use std::time::Duration;
//! let fleet = kuai_fleet::Fleet::start("redis://127.0.0.1:6379", Default::default())?;
//! let mut tls: kuai::rustls::ServerConfig = todo!("certificates, ALPN");
//! tls.session_storage = fleet.sessions();
//! let mut config = kuai::ServerConfig::from_rustls(tls);
//! config.anti_replay(fleet.anti_replay());
//! // Retry / NEW_TOKEN keys rotating hourly with the fleet's (keep the rotation alive).
//! let token_key = config.proto_mut().token_key.clone();
//! let _rotation = fleet.rotate_token_keys(token_key, Duration::from_secs(3600)).await;
//! let mut endpoint_config = kuai::EndpointConfig::default();
//! endpoint_config.proto.reset_key = fleet.reset_key().await?;
//! # Ok(()) }
//! ```
//!
//! # Sessions
//!
//! rustls 0.23 accepts 0-RTT only for sessions kept by the server (stateful tickets: the
//! ticket is a random ID, the session stays in a `StoresServerSessions`); a session sealed
//! into the ticket itself (stateless) never allows early data. So each server keeps every
//! session of the fleet: [`FleetSessions`] appends each session it issues to a Redis stream
//! (`kuai:sessions`, capped at the cache's capacity) and tails the stream for the others',
//! keeping them as replicas in a [`SessionCache`](kuai::session::SessionCache). A resumption
//! reads the local copy: nothing in a handshake waits on Redis. A session used anywhere is
//! announced on the same stream, and the replicas drop it. A server that starts (or comes
//! back) reads the stream from its start, so it knows the sessions issued before it.
//!
//! # Anti-replay
//!
//! A replica may still be there when a replay arrives within the notice's propagation
//! delay, so the first use of each ticket is also recorded in Redis
//! (`SET kuai:0rtt:<hash> NX PX <window>`, [`RedisAntiReplay`]): a connection whose 0-RTT
//! data a server accepted reaches its application only once Redis said first use; a replay
//! is refused (see [`kuai::replay`]). A ticket offered with 0-RTT data that a server did not
//! take is recorded as used too (its requests come again in 1-RTT at that server, so a
//! copy of the flight at another must not run them). rustls accepts early data only from a
//! ClientHello whose
//! ticket age is within 60 s of the age the server computes (RFC 8446 §8.3), so a record
//! kept 120 s covers every replay it would accept, with up to 60 s of clock difference
//! between the server that issued a ticket and the one that checks it. That difference is
//! checked, not assumed: each first-use record reads Redis's clock in the same round trip
//! (`TIME`), and a server more than [`FleetOptions::max_clock_skew`] (30 s) from it accepts
//! no 0-RTT until its clock is back (it says so in its log). Any two servers that accept
//! are then within 60 s of each other. An issuer's clock is checked as well: a session note
//! carries the time it was issued, and a replica from an issuer more than that skew ahead
//! of Redis (the stream entry's time) is not taken.
//!
//! # When Redis is away
//!
//! Servers keep serving. Sessions they issue stay local (the stream cannot carry them), and
//! no session resumes while Redis cannot record its first use (the client does a full
//! handshake, without 0-RTT): not a replica, nor a server's own session, whose replicas the
//! others hold. A first use Redis does not confirm in time counts as a replay: a server
//! cut off from Redis cannot know whether another, which reaches it, served the same
//! flight. Commands give up after the timeout (1 s) counted from their start, and after a
//! failed attempt to connect the next comes at most every 250 ms, so a burst of handshakes
//! fails at once rather than queueing behind one attempt after another. When Redis comes back the servers catch up on the stream. If Redis restarted
//! empty, no key or session is lost: every server still holds the sessions and keys it had,
//! and the keys are put back (`SET NX`, the same values everywhere). The first-use records
//! are lost, and with them the notices of sessions used just before that had not reached
//! every replica yet: a server that connects again reads Redis's `run_id` (`INFO server`),
//! and when it is another than before (a restart, or a replica that took over) it accepts
//! no 0-RTT for a replay window ([`FleetError::ReplayRecordsLost`]; clients resume in
//! 1-RTT), recording the uses meanwhile. A server that starts after the restart has no
//! `run_id` to compare; it holds only the sessions the stream still has. kuai writes no key or session to
//! disk; Redis does if its operator configured persistence.

#![warn(missing_docs)]

mod keys;
mod replay;
mod seal;
mod sessions;
mod tickets;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub use keys::{
    KeyFuture, KeyRotation, KeyStore, MemoryKeyStore, RedisKeyStore, RotatingKey, key_id, reset_key,
};
pub use replay::RedisAntiReplay;
pub use sessions::FleetSessions;
pub use tickets::Ticketer;

/// The key names rotations use in the store.
pub const TOKEN_KEYS: &str = "kuai:keys:address-token";
/// See [`TOKEN_KEYS`].
pub const TICKET_KEYS: &str = "kuai:keys:session-ticket";

/// Settings of a [`Fleet`].
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// Sessions each server keeps, its own and replicas (and the stream's length).
    pub capacity: usize,
    /// How long a session is kept.
    pub lifetime: Duration,
    /// How long a ticket's first use is remembered; see the [crate] docs.
    pub replay_window: Duration,
    /// How long a Redis command may take before the server goes on without it.
    pub timeout: Duration,
    /// How far this server's clock may be from Redis's while it accepts 0-RTT: half the
    /// difference between two servers that the replay window covers (see the
    /// [crate] docs). Past it 0-RTT is refused (clients resume in 1-RTT).
    pub max_clock_skew: Duration,
    /// PEM certificates to trust for `rediss://` instead of the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// The fleet's secret, the same on every server and never in Redis: every key and
    /// session stored there is sealed under it (AES-256-GCM, HKDF-derived, the Redis name as
    /// associated data), so whoever can read Redis, or the traffic to it, learns none of
    /// them, and whoever can write it cannot plant one. Without it they are stored in clear
    /// and Redis must be as trusted as the servers. A server with another secret (or none)
    /// takes nothing from the others: give it to all at once.
    pub secret: Option<[u8; 32]>,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            capacity: kuai::session::DEFAULT_CAPACITY,
            lifetime: kuai::session::DEFAULT_LIFETIME,
            replay_window: Duration::from_secs(120),
            timeout: Duration::from_secs(1),
            max_clock_skew: Duration::from_secs(30),
            ca_pem: None,
            secret: None,
        }
    }
}

/// Why the fleet's Redis could not be used.
#[derive(Debug)]
#[non_exhaustive]
pub enum FleetError {
    /// The URL (or the CA) is not usable.
    Config(String),
    /// Redis answered with an error, or the connection failed.
    Redis(redis::RedisError),
    /// Redis did not answer in time.
    Timeout,
    /// The last attempt to connect to Redis, moments ago, failed (how); the next is not
    /// made yet.
    Unreachable(String),
    /// A value in Redis is not what kuai puts there.
    Corrupt(&'static str),
    /// This server's clock is this far ahead of Redis's (behind when negative), past
    /// [`FleetOptions::max_clock_skew`].
    ClockSkew {
        /// Milliseconds; the sign says which way.
        ahead_ms: i64,
    },
    /// Redis restarted (or another took its place) this long ago, so the first-use records
    /// of the replay window before it may be gone: 0-RTT is refused until the records kept
    /// since cover a whole [`FleetOptions::replay_window`].
    ReplayRecordsLost {
        /// Since this server saw the new Redis.
        ago: Duration,
    },
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "redis configuration: {e}"),
            Self::Redis(e) => write!(f, "redis: {e}"),
            Self::Timeout => f.write_str("redis did not answer in time"),
            Self::Unreachable(last) => {
                write!(f, "redis unreachable ({last}); connecting again shortly")
            }
            Self::Corrupt(what) => write!(f, "redis holds a malformed {what}"),
            Self::ClockSkew { ahead_ms } => write!(
                f,
                "this server's clock is {:.1} s {} redis's: too far for the 0-RTT replay window",
                ahead_ms.unsigned_abs() as f64 / 1000.0,
                if *ahead_ms >= 0 { "ahead of" } else { "behind" }
            ),
            Self::ReplayRecordsLost { ago } => write!(
                f,
                "redis restarted {:.1} s ago: 0-RTT refused until its first-use records cover \
                 the replay window",
                ago.as_secs_f64()
            ),
        }
    }
}

impl std::error::Error for FleetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Redis(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for FleetError {
    fn from(e: redis::RedisError) -> Self {
        Self::Redis(e)
    }
}

/// One server's membership in a fleet: its link to Redis, its session store and its
/// anti-replay guard. See the [crate] docs.
#[derive(Clone)]
pub struct Fleet {
    link: Arc<Link>,
    sessions: Arc<FleetSessions>,
    anti_replay: Arc<RedisAntiReplay>,
}

impl fmt::Debug for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("redis_up", &self.link.is_up())
            .field("sessions", &self.sessions)
            .finish()
    }
}

impl Fleet {
    /// Joins the fleet whose Redis is at `url` (`redis://[[user]:password@]host:port[/db]`,
    /// or `rediss://` for TLS). Returns at once: the link comes up in the background, and is
    /// retried while Redis is away. Call it within a tokio runtime.
    pub fn start(url: &str, options: FleetOptions) -> Result<Self, FleetError> {
        let link = Arc::new(Link::new(url, &options)?);
        let sessions = FleetSessions::start(link.clone(), &options);
        let anti_replay = Arc::new(RedisAntiReplay::new(
            link.clone(),
            options.replay_window,
            options.max_clock_skew,
        ));
        Ok(Self {
            link,
            sessions,
            anti_replay,
        })
    }

    /// The session store to set as the rustls `ServerConfig::session_storage`.
    pub fn sessions(&self) -> Arc<FleetSessions> {
        self.sessions.clone()
    }

    /// The guard to set with [`kuai::ServerConfig::anti_replay`].
    pub fn anti_replay(&self) -> Arc<RedisAntiReplay> {
        self.anti_replay.clone()
    }

    /// The fleet's keys in Redis (see [`KeyStore`]).
    pub fn key_store(&self) -> Arc<RedisKeyStore> {
        Arc::new(RedisKeyStore {
            link: self.link.clone(),
        })
    }

    /// The fleet's stateless-reset key: set by the first server, read by the others. Fails
    /// when Redis cannot be reached within 5 s; the server should then go on with a key of
    /// its own.
    pub async fn reset_key(&self) -> Result<[u8; 32], FleetError> {
        keys::reset_key(&*self.key_store()).await
    }

    /// Rotates the transport's Retry / NEW_TOKEN keys (`kuai_proto::ServerConfig::token_key`)
    /// every `period` with the fleet's (see [`KeyRotation`]).
    pub async fn rotate_token_keys(
        &self,
        key: Arc<kuai::kuai_proto::TokenKey>,
        period: Duration,
    ) -> KeyRotation {
        KeyRotation::start(self.key_store(), TOKEN_KEYS, period, key).await
    }

    /// A stateless ticketer (`rustls::ServerConfig::ticketer`) whose keys rotate every
    /// `period` with the fleet's. rustls 0.23 allows no 0-RTT with it: resumption only.
    pub async fn ticketer(&self, period: Duration) -> (Arc<Ticketer>, KeyRotation) {
        let t = Arc::new(Ticketer::new(period));
        let r = KeyRotation::start(self.key_store(), TICKET_KEYS, period, t.clone()).await;
        (t, r)
    }

    /// Shares the transport's NEW_TOKEN log (`kuai_proto::ServerConfig::token_log`, tokens
    /// of `lifetime`) through the session stream: a token used at one server validates no
    /// address at the others (RFC 9000 §8.1.4), as it does at the server itself.
    pub fn share_token_log(&self, log: Arc<kuai::kuai_proto::TokenLog>, lifetime: Duration) {
        self.sessions.share_token_log(log, lifetime);
    }

    /// Whether the last exchange with Redis went well.
    pub fn is_redis_up(&self) -> bool {
        self.link.is_up()
    }
}

/// How long after a connection attempt to Redis began the next may be made.
const RECONNECT_PAUSE: Duration = Duration::from_millis(250);

/// What [`Link::run`] sends.
pub(crate) enum Query<'a> {
    Cmd(&'a redis::Cmd),
    Pipe(&'a redis::Pipeline),
}

pub(crate) type Remembered =
    std::collections::HashMap<String, ([u8; 32], Option<std::time::Instant>)>;

/// The connection to Redis shared by the fleet's tasks, re-made after a failure.
pub(crate) struct Link {
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
    up: AtomicBool,
    timeout: Duration,
    /// Until when commands fail at once rather than connect again, and why the last
    /// attempt failed: set as a connection attempt starts, cleared when it succeeds (see
    /// [`RECONNECT_PAUSE`]).
    connect_after: std::sync::Mutex<Option<(tokio::time::Instant, String)>>,
    /// Keys read from Redis, to put back if it restarts empty: name, key, expiry, lifetime.
    remembered: std::sync::Mutex<Remembered>,
    /// Seals what goes into Redis (see [`FleetOptions::secret`]).
    pub(crate) sealer: Option<Arc<seal::Sealer>>,
    /// The `run_id` of the Redis last connected to (`INFO server`): it changes when Redis
    /// restarts, and with it the first-use records it held may be gone.
    run_id: std::sync::Mutex<Option<String>>,
    /// `INFO` was refused or unanswered (said once).
    info_refused: std::sync::atomic::AtomicBool,
    /// When this server last found Redis restarted, and the replay window from then on.
    restarted: std::sync::Mutex<Option<std::time::Instant>>,
    replay_window: Duration,
}

impl Link {
    fn new(url: &str, options: &FleetOptions) -> Result<Self, FleetError> {
        let client = if url.starts_with("rediss://") {
            // redis's rustls needs a process-wide provider: kuai's, unless one is set.
            let _ = (*kuai::crypto_provider()).clone().install_default();
            match &options.ca_pem {
                Some(ca) => redis::Client::build_with_tls(
                    url,
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(ca.clone()),
                    },
                ),
                None => redis::Client::open(url),
            }
        } else {
            redis::Client::open(url)
        }
        .map_err(|e| FleetError::Config(e.to_string()))?;
        Ok(Self {
            client,
            conn: tokio::sync::Mutex::new(None),
            up: AtomicBool::new(false),
            timeout: options.timeout,
            connect_after: std::sync::Mutex::new(None),
            remembered: Default::default(),
            run_id: std::sync::Mutex::new(None),
            info_refused: Default::default(),
            restarted: std::sync::Mutex::new(None),
            replay_window: options.replay_window,
            sealer: options
                .secret
                .as_ref()
                .map(|s| Arc::new(seal::Sealer::new(s))),
        })
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// A connection for commands (made if needed, at most once per [`RECONNECT_PAUSE`]:
    /// while Redis is away, the commands queued behind a failed attempt fail at once instead
    /// of each trying again in turn).
    pub(crate) async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, FleetError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let now = tokio::time::Instant::now();
        {
            let mut after = self.connect_after.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((until, why)) = &*after
                && now < *until
            {
                return Err(FleetError::Unreachable(why.clone()));
            }
            // Set before trying: an attempt that fails, or whose caller gives up on it,
            // holds the others off as much as one that times out.
            *after = Some((now + RECONNECT_PAUSE, "still connecting".into()));
        }
        let c = match self.connect(self.timeout).await {
            Ok(c) => c,
            Err(e) => {
                if let Some((_, why)) =
                    &mut *self.connect_after.lock().unwrap_or_else(|e| e.into_inner())
                {
                    *why = e.to_string();
                }
                return Err(e);
            }
        };
        *self.connect_after.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *slot = Some(c.clone());
        drop(slot);
        // Before the command that made the connection: a key it reads is back by then.
        let _ = self.came_back(c.clone()).await;
        Ok(c)
    }

    /// Reads the new connection's `run_id`; a different one than before means Redis
    /// restarted (or a replica took over), and the ticket uses it recorded in the replay
    /// window before may be gone with it (unless it keeps them on disk, and then only up to
    /// its last save): a replay of a flight accepted then would be taken as a first use.
    /// 0-RTT is refused for a replay window from now ([`Link::records_lost`]). A Redis that
    /// does not answer `INFO` (a user without the right) is taken as the same.
    async fn check_run_id(&self, mut c: redis::aio::MultiplexedConnection) {
        let info = redis::cmd("INFO").arg("server").to_owned();
        let id = match tokio::time::timeout(self.timeout, info.query_async::<String>(&mut c)).await
        {
            Ok(Ok(text)) => text
                .lines()
                .find_map(|l| l.strip_prefix("run_id:"))
                .map(|id| id.trim().to_string()),
            _ => None,
        };
        let Some(id) = id else {
            // Said once: without `INFO` (an ACL user without @dangerous, say) a Redis
            // restart goes unseen, and with it the pause that keeps 0-RTT safe after one.
            if !self
                .info_refused
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(target: "kuai::fleet",
                    "redis does not answer INFO: a restart of redis will not be seen (allow \
                     INFO to this user, or run redis with persistence)");
            }
            return;
        };
        let mut known = self.run_id.lock().unwrap_or_else(|e| e.into_inner());
        if known.as_ref().is_some_and(|k| *k != id) {
            *self.restarted.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(std::time::Instant::now());
            tracing::warn!(target: "kuai::fleet", window_s = self.replay_window.as_secs(),
                "redis restarted: 0-RTT refused for a replay window (its first-use records \
                 may be lost)");
        }
        *known = Some(id);
    }

    /// How long ago Redis was found restarted, while that is less than a replay window.
    pub(crate) fn records_lost(&self) -> Option<Duration> {
        let at = (*self.restarted.lock().unwrap_or_else(|e| e.into_inner()))?;
        let ago = at.elapsed();
        (ago < self.replay_window).then_some(ago)
    }

    /// A connection of its own (for blocking reads), answers allowed `response` long.
    pub(crate) async fn connect(
        &self,
        response: Duration,
    ) -> Result<redis::aio::MultiplexedConnection, FleetError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(response);
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        // Before any command uses it: whether this is the Redis of before.
        self.check_run_id(c.clone()).await;
        Ok(c)
    }

    /// Runs a command or pipeline within the timeout, counted from the call: waiting for
    /// the connection, making it and the command all fit in it. A failed command drops the
    /// connection, to be made again next time.
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        query: Query<'_>,
    ) -> Result<T, FleetError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut r = self.try_run(&query, deadline).await;
        // A connection made before Redis restarted fails its first command: once more on a
        // new one. (If that cannot be made yet, the first error says more.)
        if let Err(FleetError::Redis(e)) = &r
            && (e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error())
        {
            match self.try_run(&query, deadline).await {
                Err(FleetError::Unreachable(_)) => {}
                again => r = again,
            }
        }
        match &r {
            Ok(_) => self.succeeded(),
            Err(e) => self.failed(e),
        }
        r
    }

    async fn try_run<T: redis::FromRedisValue>(
        &self,
        query: &Query<'_>,
        deadline: tokio::time::Instant,
    ) -> Result<T, FleetError> {
        // Whether the failure, if any, came from a command on a connection (which is then
        // dropped) rather than from getting one.
        let mut sent = false;
        let call = async {
            let mut c = self.conn().await?;
            sent = true;
            match query {
                Query::Cmd(q) => q.query_async(&mut c).await,
                Query::Pipe(q) => q.query_async(&mut c).await,
            }
            .map_err(FleetError::Redis)
        };
        let r = tokio::time::timeout_at(deadline, call)
            .await
            .unwrap_or(Err(FleetError::Timeout));
        if r.is_err() && sent {
            self.reset().await;
        }
        r
    }

    /// Drops the command connection (the next command makes a new one).
    pub(crate) async fn reset(&self) {
        *self.conn.lock().await = None;
    }

    pub(crate) fn succeeded(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            tracing::info!(target: "kuai::fleet", "redis reachable");
        }
    }

    pub(crate) fn failed(&self, e: &FleetError) {
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(target: "kuai::fleet", error = %e,
                "redis unreachable: serving with the keys and sessions held here");
        }
    }

    pub(crate) fn remember(&self, name: &str, key: [u8; 32], ttl: Option<Duration>) {
        let now = std::time::Instant::now();
        let mut r = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|_, (_, until)| until.is_none_or(|u| u > now));
        r.insert(name.to_string(), (key, ttl.map(|t| now + t)));
    }

    /// A new connection came up: put the keys back (`SET NX`, for what is left of their
    /// lifetime) in case Redis restarted empty; warn if it holds others (a server that
    /// started meanwhile made new ones). On a task of its own, so that a caller that gives up
    /// waiting does not cut it short.
    fn came_back(&self, mut c: redis::aio::MultiplexedConnection) -> tokio::task::JoinHandle<()> {
        let now = std::time::Instant::now();
        let keys: Vec<(String, [u8; 32], Option<Duration>)> = self
            .remembered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, (_, until))| until.is_none_or(|u| u > now))
            .map(|(n, (k, until))| (n.clone(), *k, until.map(|u| u - now)))
            .collect();
        let timeout = self.timeout;
        let sealer = self.sealer.clone();
        tokio::spawn(async move {
            for (name, key, left) in keys {
                let value = keys::stored_form(sealer.as_deref(), &name, &key);
                let pipe = keys::set_nx_then_get(&name, &value, left);
                let put = tokio::time::timeout(timeout, pipe.query_async::<(Vec<u8>,)>(&mut c));
                if let Ok(Ok((stored,))) = put.await
                    && keys::read_form(sealer.as_deref(), &name, &stored) != Some(key)
                {
                    tracing::warn!(target: "kuai::fleet", key = %name,
                        "redis holds another key than this server: restart this server to share it");
                }
            }
        })
    }
}
