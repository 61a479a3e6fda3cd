//! The fleet's secrets: the stateless-reset key (any server can reset a connection another
//! held, RFC 9000 §10.3.2), and keys that rotate: the Retry / NEW_TOKEN token keys (a token
//! one server issued validates at another) and, with stateless tickets, the session-ticket
//! keys ([`Ticketer`](crate::Ticketer)).
//!
//! # Rotation without a leader or a clock trap
//!
//! Time is cut in generations of one period (generation `g` = Unix time / period). The key
//! of generation `g` is named `kuai:keys:<name>:<g>` and set by whichever server asks for it
//! first (`SET NX`, expiring after three periods); the others read it. Each server holds the
//! keys of generations `g − 1`, `g` and `g + 1` of its own clock, seals with `g`'s and opens
//! with all three. So a key is never made twice, no server waits for another to rotate,
//! and two servers whose clocks differ by less than a period still open each other's
//! tokens: one seals with a generation the other holds. A generation that cannot be fetched
//! (the store is away at the boundary) is not made up: the server goes on sealing with the
//! newest key it holds, which the others hold too, and logs it. Only a server that starts
//! with the store away makes keys of its own, until the store answers.
//!
//! The stateless-reset key does not rotate: a reset token is derived from a connection ID
//! when the ID is issued and must still match when the reset is sent, for as long as the
//! connection lives.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kuai::kuai_proto::TokenKey;

use crate::seal::Sealer;
use crate::{FleetError, Link};

/// The Redis key of the stateless-reset key.
const RESET_KEY: &str = "kuai:keys:stateless-reset";

/// A boxed future, for the object-safe [`KeyStore`].
pub type KeyFuture<'a> = Pin<Box<dyn Future<Output = Result<[u8; 32], FleetError>> + Send + 'a>>;

/// Where a fleet's keys live: the first server to ask for a key sets it, every later ask
/// (from any server) gets the same.
pub trait KeyStore: Send + Sync + 'static {
    /// The key named `name`: set to `fresh` (kept for `ttl`, or for ever) unless it is set.
    fn get_or_set<'a>(
        &'a self,
        name: &'a str,
        fresh: [u8; 32],
        ttl: Option<Duration>,
    ) -> KeyFuture<'a>;
}

/// Keys in this process only: a single server's, or a test's.
#[derive(Default)]
pub struct MemoryKeyStore(Mutex<crate::Remembered>);

impl KeyStore for MemoryKeyStore {
    fn get_or_set<'a>(
        &'a self,
        name: &'a str,
        fresh: [u8; 32],
        ttl: Option<Duration>,
    ) -> KeyFuture<'a> {
        let now = Instant::now();
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, (_, until)| until.is_none_or(|u| u > now));
        let k = m
            .entry(name.to_string())
            .or_insert((fresh, ttl.map(|t| now + t)))
            .0;
        Box::pin(async move { Ok(k) })
    }
}

/// Keys in the fleet's Redis (`SET NX`, then `GET`), as hex.
pub struct RedisKeyStore {
    pub(crate) link: Arc<Link>,
}

impl KeyStore for RedisKeyStore {
    fn get_or_set<'a>(
        &'a self,
        name: &'a str,
        fresh: [u8; 32],
        ttl: Option<Duration>,
    ) -> KeyFuture<'a> {
        Box::pin(async move {
            let sealer = self.link.sealer.as_deref();
            let pipe = set_nx_then_get(name, &stored_form(sealer, name, &fresh), ttl);
            let (stored,): (Vec<u8>,) = self.link.run(crate::Query::Pipe(&pipe)).await?;
            let k = read_form(sealer, name, &stored).ok_or(FleetError::Corrupt(match sealer {
                Some(_) => "key (not sealed with this fleet's secret)",
                None => "key (not 64 hex digits: sealed by servers with a fleet secret?)",
            }))?;
            self.link.remember(name, k, ttl);
            Ok(k)
        })
    }
}

/// A key as stored under `name`: sealed with the fleet's secret, or (without one) as hex.
pub(crate) fn stored_form(sealer: Option<&Sealer>, name: &str, key: &[u8; 32]) -> Vec<u8> {
    match sealer {
        Some(s) => s.seal(name.as_bytes(), key),
        None => hex(key).into_bytes(),
    }
}

/// The key `stored` under `name` holds, if it is in the form this server uses.
pub(crate) fn read_form(sealer: Option<&Sealer>, name: &str, stored: &[u8]) -> Option<[u8; 32]> {
    match sealer {
        Some(s) => s.open(name.as_bytes(), stored)?.try_into().ok(),
        None => parse_hex32(stored),
    }
}

/// `SET name value NX [PX ttl]`, then `GET name`: the value that holds, whoever set it.
pub(crate) fn set_nx_then_get(name: &str, value: &[u8], ttl: Option<Duration>) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    let set = pipe.cmd("SET").arg(name).arg(value).arg("NX");
    if let Some(t) = ttl {
        set.arg("PX").arg(t.as_millis().max(1) as u64);
    }
    pipe.ignore().cmd("GET").arg(name);
    pipe
}

/// A short name for a key (the first 4 bytes of its SHA-256), safe to print.
pub fn key_id(k: &[u8; 32]) -> String {
    hex(&ring::digest::digest(&ring::digest::SHA256, k).as_ref()[..4])
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &[u8]) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(s.chunks(2)) {
        let digit = |c: u8| (c as char).to_digit(16);
        *o = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

pub(crate) fn random_key() -> [u8; 32] {
    let mut k = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut k)
        .expect("system randomness");
    k
}

/// The fleet's stateless-reset key (set by the first server), within 5 s.
pub async fn reset_key(store: &dyn KeyStore) -> Result<[u8; 32], FleetError> {
    tokio::time::timeout(
        Duration::from_secs(5),
        store.get_or_set(RESET_KEY, random_key(), None),
    )
    .await
    .unwrap_or(Err(FleetError::Timeout))
}

/// A key set that rotates: a generation's key is added, sealing or not, and old ones go.
/// [`TokenKey`] (the transport's Retry / NEW_TOKEN keys) and
/// [`Ticketer`](crate::Ticketer) are.
pub trait RotatingKey: Send + Sync + 'static {
    /// Adds key `id` (the generation mod 256); with `seal`, it seals from now on.
    fn install(&self, id: u8, secret: &[u8; 32], seal: bool);
    /// Seals with key `id` (held) from now on; whether it is held.
    fn seal_with(&self, id: u8) -> bool;
    /// Forgets key `id` (never the sealing one).
    fn remove(&self, id: u8);
}

impl RotatingKey for TokenKey {
    fn install(&self, id: u8, secret: &[u8; 32], seal: bool) {
        TokenKey::install(self, id, secret, seal);
    }
    fn seal_with(&self, id: u8) -> bool {
        TokenKey::seal_with(self, id)
    }
    fn remove(&self, id: u8) {
        TokenKey::remove(self, id);
    }
}

/// A running rotation (see [`KeyRotation::start`]). Stops when dropped.
pub struct KeyRotation {
    task: tokio::task::JoinHandle<()>,
    state: Arc<Mutex<RotationState>>,
}

#[derive(Default)]
struct RotationState {
    /// Generations held, and the one sealing.
    held: Vec<u64>,
    sealing: Option<u64>,
}

impl Drop for KeyRotation {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for KeyRotation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("KeyRotation")
            .field("held", &s.held)
            .field("sealing", &s.sealing)
            .finish()
    }
}

impl KeyRotation {
    /// Rotates `target`'s keys named `name` every `period`, from `store`. The first round
    /// runs before this returns (within the store's timeout): the server starts with the
    /// fleet's keys, or, the store away, with keys of its own until it answers.
    pub async fn start(
        store: Arc<dyn KeyStore>,
        name: &'static str,
        period: Duration,
        target: Arc<dyn RotatingKey>,
    ) -> Self {
        let period = period.max(Duration::from_secs(1));
        let state = Arc::new(Mutex::new(RotationState::default()));
        let mut own: Option<u64> = None;
        round(&*store, name, period, &*target, &state, &mut own).await;
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let all_held = round(&*store, name, period, &*target, &st, &mut own).await;
                // Again at the next boundary, or in a second while a key is missing.
                let into = unix().as_millis() % period.as_millis();
                let to_boundary = period.as_millis() - into;
                let wait = if all_held {
                    Duration::from_millis(to_boundary as u64 + 10)
                } else {
                    Duration::from_secs(1)
                };
                tokio::time::sleep(wait.min(Duration::from_secs(60))).await;
            }
        });
        Self { task, state }
    }

    /// The generation sealing now, if any.
    pub fn sealing(&self) -> Option<u64> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).sealing
    }
}

fn unix() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// One round: fetch the keys of generations g−1, g, g+1 not held yet, seal with g's (or the
/// newest held), forget older ones. Whether all three are held.
async fn round(
    store: &dyn KeyStore,
    name: &str,
    period: Duration,
    target: &dyn RotatingKey,
    state: &Mutex<RotationState>,
    own: &mut Option<u64>,
) -> bool {
    let g = (unix().as_secs() / period.as_secs().max(1)).max(1);
    let ttl = period * 3;
    let mut all = true;
    for generation in [g - 1, g, g + 1] {
        let held = state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .held
            .contains(&generation);
        // A key made here while the store was away is replaced by the fleet's.
        if held && *own != Some(generation) {
            continue;
        }
        let key_name = format!("{name}:{generation}");
        match store.get_or_set(&key_name, random_key(), Some(ttl)).await {
            Ok(k) => {
                target.install((generation % 256) as u8, &k, false);
                let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                if !s.held.contains(&generation) {
                    s.held.push(generation);
                }
                if *own == Some(generation) {
                    *own = None;
                    tracing::info!(target: "kuai::fleet", key = name, "the fleet's key replaces this server's own");
                }
            }
            Err(e) => {
                all = false;
                tracing::warn!(target: "kuai::fleet", key = %key_name, error = %e,
                    "key not fetched: sealing with the newest key held");
                break;
            }
        }
    }
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if s.held.is_empty() {
        // Started with the store away: a key of this server's own for now.
        let k = random_key();
        target.install((g % 256) as u8, &k, true);
        s.held.push(g);
        s.sealing = Some(g);
        *own = Some(g);
        tracing::warn!(target: "kuai::fleet", key = name,
            "key store unreachable: sealing with a key of this server's own");
        return false;
    }
    let seal = if s.held.contains(&g) {
        g
    } else {
        *s.held.iter().max().expect("not empty")
    };
    if s.sealing != Some(seal) && target.seal_with((seal % 256) as u8) {
        s.sealing = Some(seal);
    }
    let old: Vec<u64> = s.held.iter().copied().filter(|&h| h + 1 < g).collect();
    for h in old {
        if Some(h) != s.sealing {
            target.remove((h % 256) as u8);
            s.held.retain(|&x| x != h);
        }
    }
    all
}
