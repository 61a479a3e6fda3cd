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
//! is refused (see [`kuai::replay`]). rustls accepts early data only from a ClientHello whose
//! ticket age is within 60 s of the age the server computes (RFC 8446 §8.3), so a record
//! kept 120 s covers every replay it would accept, with up to 60 s of clock difference
//! between the server that issued a ticket and the one that checks it.
//!
//! # When Redis is away
//!
//! Servers keep serving. Sessions they issue stay local (the stream cannot carry them); a
//! replica is not used for 0-RTT while Redis cannot record its first use (the client then
//! does a full handshake), and a server's own sessions still are, used once as on a single
//! server. When Redis comes back the servers catch up on the stream. If Redis restarted
//! empty, nothing is lost: every server still holds the sessions and keys it had, and the
//! keys are put back (`SET NX`, the same values everywhere). kuai writes no key or session to
//! disk; Redis does if its operator configured persistence.

#![warn(missing_docs)]

mod keys;
mod replay;
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
    /// How long a ticket's first use is remembered; see the [crate](crate) docs.
    pub replay_window: Duration,
    /// How long a Redis command may take before the server goes on without it.
    pub timeout: Duration,
    /// PEM certificates to trust for `rediss://` instead of the system's roots.
    pub ca_pem: Option<Vec<u8>>,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            capacity: kuai::session::DEFAULT_CAPACITY,
            lifetime: kuai::session::DEFAULT_LIFETIME,
            replay_window: Duration::from_secs(120),
            timeout: Duration::from_secs(1),
            ca_pem: None,
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
    /// A value in Redis is not what kuai puts there.
    Corrupt(&'static str),
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "redis configuration: {e}"),
            Self::Redis(e) => write!(f, "redis: {e}"),
            Self::Timeout => f.write_str("redis did not answer in time"),
            Self::Corrupt(what) => write!(f, "redis holds a malformed {what}"),
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
/// anti-replay guard. See the [crate](crate) docs.
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
            sessions.clone(),
            options.replay_window,
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

    /// Whether the last exchange with Redis went well.
    pub fn is_redis_up(&self) -> bool {
        self.link.is_up()
    }
}

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
    /// Keys read from Redis, to put back if it restarts empty: name, key, expiry, lifetime.
    remembered: std::sync::Mutex<Remembered>,
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
            remembered: Default::default(),
        })
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// A connection for commands (made if needed), within the timeout.
    pub(crate) async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, FleetError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = self.connect(self.timeout).await?;
        *slot = Some(c.clone());
        drop(slot);
        self.came_back().await;
        Ok(c)
    }

    /// A connection of its own (for blocking reads), answers allowed `response` long.
    pub(crate) async fn connect(
        &self,
        response: Duration,
    ) -> Result<redis::aio::MultiplexedConnection, FleetError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(response);
        Ok(self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }

    /// Runs a command or pipeline within the timeout; a failure drops the connection, to be
    /// made again next time.
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        query: Query<'_>,
    ) -> Result<T, FleetError> {
        let mut r = self.try_run(&query).await;
        // A connection made before Redis restarted fails its first command: once more on a
        // new one.
        if let Err(FleetError::Redis(e)) = &r
            && (e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error())
        {
            r = self.try_run(&query).await;
        }
        match &r {
            Ok(_) => self.succeeded(),
            Err(e) => self.failed(e),
        }
        r
    }

    async fn try_run<T: redis::FromRedisValue>(&self, query: &Query<'_>) -> Result<T, FleetError> {
        let mut c = self.conn().await?;
        let call = async {
            match query {
                Query::Cmd(q) => q.query_async(&mut c).await,
                Query::Pipe(q) => q.query_async(&mut c).await,
            }
        };
        let r = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(FleetError::Redis(e)),
            Err(_) => Err(FleetError::Timeout),
        };
        if r.is_err() {
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
    /// started meanwhile made new ones).
    async fn came_back(&self) {
        let now = std::time::Instant::now();
        let keys: Vec<(String, [u8; 32], Option<Duration>)> = self
            .remembered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, (_, until))| until.is_none_or(|u| u > now))
            .map(|(n, (k, until))| (n.clone(), *k, until.map(|u| u - now)))
            .collect();
        let slot = self.conn.lock().await.clone();
        let Some(mut c) = slot else { return };
        for (name, key, left) in keys {
            let pipe = keys::set_nx_then_get(&name, &key, left);
            let put = tokio::time::timeout(self.timeout, pipe.query_async::<(Vec<u8>,)>(&mut c));
            if let Ok(Ok((stored,))) = put.await
                && stored != keys::hex(&key).into_bytes()
            {
                tracing::warn!(target: "kuai::fleet", key = %name,
                    "redis holds another key than this server: restart this server to share it");
            }
        }
    }
}
