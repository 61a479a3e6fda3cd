//! [`FleetSessions`]: every server keeps every session of the fleet, replicated through a
//! Redis stream; see the [crate](crate) docs.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kuai::kuai_proto::TokenLog;
use kuai::session::SessionCache;
use redis::Value;
use tokio::sync::mpsc;

use crate::{FleetOptions, Link};

/// The Redis stream sessions and their uses go through.
const STREAM: &str = "kuai:sessions";

/// Entries read at once from the stream.
const READ_BATCH: usize = 1024;

/// Announcements waiting for the writer; past this, new ones are dropped (counted).
const QUEUE: usize = 16 * 1024;

/// How long a blocking read of the stream waits for news.
const BLOCK: Duration = Duration::from_secs(2);

/// What the writer appends to the stream.
enum Note {
    /// A session this server issued, and when (this server's clock, unix ms).
    Issued(Vec<u8>, Vec<u8>, u64),
    /// A session used here (the replicas drop it).
    Used(Vec<u8>),
    /// A NEW_TOKEN token used here: its ID and issue time (unix ms).
    TokenUsed([u8; TOKEN_ID_LEN], u64),
}

/// The length of a NEW_TOKEN token's ID (its nonce).
const TOKEN_ID_LEN: usize = 12;

/// The fleet's session store: this server's sessions and replicas of the others', for
/// rustls (`ServerConfig::session_storage`). See the [crate](crate) docs.
pub struct FleetSessions {
    cache: Arc<SessionCache>,
    link: Arc<Link>,
    /// Tells this server's entries from the others' on the stream.
    origin: u64,
    notes: mpsc::Sender<Note>,
    dropped_notes: std::sync::atomic::AtomicU64,
    /// When a dropped note was last said in the log.
    dropped_said: std::sync::Mutex<Option<std::time::Instant>>,
    /// The transport's NEW_TOKEN log and the tokens' lifetime, once shared.
    token_log: std::sync::OnceLock<(Arc<TokenLog>, Duration)>,
    /// Other servers' token uses read before the log was shared (the reader starts at
    /// once, from the stream's start), applied when it is: at most [`QUEUE`].
    early_token_uses: std::sync::Mutex<Vec<([u8; TOKEN_ID_LEN], u64)>>,
    /// How far ahead of Redis an issuer's clock may be (`FleetOptions::max_clock_skew`).
    max_skew: Duration,
}

impl std::fmt::Debug for FleetSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetSessions")
            .field("held", &self.cache.len())
            .finish()
    }
}

impl FleetSessions {
    pub(crate) fn start(link: Arc<Link>, options: &FleetOptions) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let mut origin = [0u8; 8];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut origin);
        let s = Arc::new(Self {
            cache: SessionCache::new(options.capacity, options.lifetime),
            link,
            origin: u64::from_le_bytes(origin),
            notes: tx,
            dropped_notes: Default::default(),
            dropped_said: std::sync::Mutex::new(None),
            token_log: std::sync::OnceLock::new(),
            early_token_uses: std::sync::Mutex::new(Vec::new()),
            max_skew: options.max_clock_skew,
        });
        tokio::spawn(write(Arc::downgrade(&s), rx, options.capacity));
        tokio::spawn(read(Arc::downgrade(&s), options.lifetime));
        s
    }

    /// Sessions held (this server's and replicas).
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Shares `log` with the fleet: each token's first use here goes on the stream, and the
    /// others' uses are recorded in it, so a NEW_TOKEN token validates an address once in the
    /// fleet, not once per server (RFC 9000 §8.1.4). Within the stream's delay a copy may
    /// still pass at a second server.
    pub(crate) fn share_token_log(self: &Arc<Self>, log: Arc<TokenLog>, lifetime: Duration) {
        if self.token_log.set((log.clone(), lifetime)).is_err() {
            return;
        }
        let early = std::mem::take(&mut *lock(&self.early_token_uses));
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        for (id, issued) in early {
            log.mark_used(&id, issued, now_ms, lifetime);
        }
        let me = Arc::downgrade(self);
        log.on_first_use(move |id, issued_ms| {
            if let Some(s) = me.upgrade() {
                s.note(Note::TokenUsed(*id, issued_ms));
            }
        });
    }

    fn note(&self, n: Note) {
        if self.notes.try_send(n).is_err() {
            let dropped = self
                .dropped_notes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            // A use the others never hear of leaves their replica of the session usable
            // (first-use records in Redis still refuse a replay within the window).
            let now = std::time::Instant::now();
            let mut said = lock(&self.dropped_said);
            if said.is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(60)) {
                *said = Some(now);
                tracing::warn!(target: "kuai::fleet", dropped,
                    "the fleet's session notes queue is full: notes dropped");
            }
        }
    }

    /// Applies another server's note, written `age` ago.
    fn apply(&self, kind: &[u8], origin: u64, id: Vec<u8>, value: Vec<u8>, age: Duration) {
        if origin == self.origin {
            return;
        }
        match kind {
            b"i" => {
                // Sealed under the fleet's secret when there is one: a session another
                // server did not seal (or that a writer to Redis made up) is not taken.
                let value = match &self.link.sealer {
                    Some(s) => match s.open(&session_name(&id), &value) {
                        Some(v) => v,
                        None => {
                            tracing::debug!(target: "kuai::fleet", "a session not sealed with this fleet's secret: ignored");
                            return;
                        }
                    },
                    None => value,
                };
                self.cache.insert_replica(id, value, age)
            }
            b"u" => {
                self.cache.remove(&id);
            }
            b"t" => {
                let (Ok(id), Ok(issued)) = (
                    <[u8; TOKEN_ID_LEN]>::try_from(&id[..]),
                    <[u8; 8]>::try_from(&value[..]),
                ) else {
                    return;
                };
                let Some((log, lifetime)) = self.token_log.get() else {
                    let mut early = lock(&self.early_token_uses);
                    if early.len() < QUEUE {
                        early.push((id, u64::from_le_bytes(issued)));
                    }
                    return;
                };
                let now_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                log.mark_used(&id, u64::from_le_bytes(issued), now_ms, *lifetime);
            }
            _ => {}
        }
    }
}

impl rustls::server::StoresServerSessions for FleetSessions {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.note(Note::Issued(key.clone(), value.clone(), now_ms));
        self.cache.put(key, value)
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.cache.get(key)
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        // No resumption (so no 0-RTT) while Redis cannot record the ticket's first use (see
        // the crate docs): the session stays for when it can. This server's own sessions
        // too, since the others hold replicas of them.
        if !self.link.is_up() {
            tracing::debug!(target: "kuai::fleet", "redis away: a ticket gets a full handshake");
            return None;
        }
        // Nor for a replay window after Redis restarted (its first-use records may be gone):
        // a full handshake, where a 0-RTT flight taken now would be refused at the check.
        if self.link.records_lost().is_some() {
            tracing::debug!(target: "kuai::fleet", "redis restarted: a ticket gets a full handshake");
            return None;
        }
        let Some((value, _)) = self.cache.take_session(key, true) else {
            tracing::debug!(target: "kuai::fleet", held = self.cache.len(), "no session for a ticket");
            return None;
        };
        self.note(Note::Used(key.to_vec()));
        Some(value)
    }

    fn can_cache(&self) -> bool {
        true
    }
}

/// Appends this server's notes to the stream, in batches. While Redis is away a batch is
/// tried again every half second, and later notes wait in the queue (past [`QUEUE`], they
/// are dropped): sessions issued meanwhile reach the others once Redis is back.
async fn write(
    sessions: std::sync::Weak<FleetSessions>,
    mut rx: mpsc::Receiver<Note>,
    capacity: usize,
) {
    let mut batch = Vec::with_capacity(256);
    while rx.recv_many(&mut batch, 256).await > 0 {
        let Some(s) = sessions.upgrade() else { return };
        let origin = s.origin.to_le_bytes();
        let mut pipe = redis::pipe();
        for n in batch.drain(..) {
            let (kind, id, value, issued) = match n {
                Note::Issued(id, value, at) => {
                    let value = match &s.link.sealer {
                        Some(sealer) => sealer.seal(&session_name(&id), &value),
                        None => value,
                    };
                    ("i", id, value, Some(at))
                }
                Note::Used(id) => ("u", id, Vec::new(), None),
                Note::TokenUsed(id, issued) => {
                    ("t", id.to_vec(), issued.to_le_bytes().to_vec(), None)
                }
            };
            let xadd = pipe.cmd("XADD");
            xadd.arg(STREAM)
                .arg("MAXLEN")
                .arg("~")
                .arg(capacity)
                .arg("*")
                .arg("k")
                .arg(kind)
                .arg("o")
                .arg(&origin[..])
                .arg("i")
                .arg(id)
                .arg("v")
                .arg(value);
            // The issuer's clock at issue: a replica from a server whose clock runs ahead
            // is not taken (its tickets would look fresh for that much longer elsewhere).
            if let Some(at) = issued {
                xadd.arg("t").arg(at);
            }
            xadd.ignore();
        }
        let link = s.link.clone();
        drop(s);
        let mut wait = Duration::from_millis(100);
        while link.run::<()>(crate::Query::Pipe(&pipe)).await.is_err() {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
            if sessions.strong_count() == 0 {
                return;
            }
        }
    }
}

/// The name a session is sealed for: the stream and its ticket ID, so that a sealed session
/// cannot be passed off under another ticket.
fn session_name(id: &[u8]) -> Vec<u8> {
    let mut n = Vec::with_capacity(STREAM.len() + 1 + id.len());
    n.extend_from_slice(STREAM.as_bytes());
    n.push(b'/');
    n.extend_from_slice(id);
    n
}

/// Tails the stream from its start, applying the other servers' notes.
async fn read(sessions: std::sync::Weak<FleetSessions>, lifetime: Duration) {
    let mut last = "0".to_string();
    let max_skew_ms = sessions
        .upgrade()
        .map_or(0, |s| s.max_skew.as_millis() as u64);
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(link) = sessions.upgrade().map(|s| s.link.clone()) else {
            return;
        };
        let mut conn = match link.connect(BLOCK + link.timeout).await {
            Ok(c) => c,
            Err(e) => {
                link.failed(&e);
                drop(link);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        loop {
            let r: redis::RedisResult<Value> = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(READ_BATCH)
                .arg("BLOCK")
                .arg(BLOCK.as_millis() as u64)
                .arg("STREAMS")
                .arg(STREAM)
                .arg(&last)
                .query_async(&mut conn)
                .await;
            let v = match r {
                Ok(v) => v,
                Err(e) => {
                    link.failed(&crate::FleetError::Redis(e));
                    // Redis went away: the command connection is stale too. Or it answers
                    // every read with an error (the stream's key holds another type, the
                    // user may not read it): either way not again at once.
                    link.reset().await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    break;
                }
            };
            backoff = Duration::from_millis(100);
            // Reads work; whether writes do (the anti-replay record a resumption needs) only a
            // write tells: Redis out of memory, or a user who may read but not write, answers
            // XREAD and refuses SET. A write probe while the link counts as down.
            if !link.is_up() {
                let mut probe = redis::cmd("SET");
                probe.arg("kuai:probe").arg(1).arg("PX").arg(10_000);
                let _ = link.run::<()>(crate::Query::Cmd(&probe)).await;
            }
            let Some(s) = sessions.upgrade() else { return };
            for_each_entry(&v, |id, fields| {
                last = id.to_string();
                // Entry IDs start with their time in ms: skip sessions past their lifetime.
                let ms: u64 = id
                    .split('-')
                    .next()
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(0);
                let now_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let age = now_ms.saturating_sub(ms);
                if age > lifetime.as_millis() as u64 {
                    return;
                }
                let mut kind: &[u8] = b"";
                let mut origin = 0u64;
                let (mut tid, mut value) = (Vec::new(), Vec::new());
                let mut issued: Option<u64> = None;
                for (k, v) in fields {
                    match k {
                        b"k" => kind = v,
                        b"o" => origin = parse_origin(v),
                        b"i" => tid = v.to_vec(),
                        b"v" => value = v.to_vec(),
                        b"t" => issued = std::str::from_utf8(v).ok().and_then(|t| t.parse().ok()),
                        _ => {}
                    }
                }
                // rustls judges a ticket's age by its issuer's clock: a session issued by a
                // server whose clock ran ahead of Redis's (the entry ID's time) by more than
                // the allowed skew would stay 0-RTT-fresh here for that much longer.
                if kind == b"i" && issued.is_some_and(|t| t > ms.saturating_add(max_skew_ms)) {
                    tracing::debug!(target: "kuai::fleet", ahead_ms = issued.unwrap_or(0) - ms,
                        "a session from a server whose clock is ahead of redis's: not taken");
                    return;
                }
                if !tid.is_empty() {
                    s.apply(kind, origin, tid, value, Duration::from_millis(age));
                }
            });
        }
    }
}

/// The origin tag of a stream entry (8 bytes; anything else names no server).
fn parse_origin(raw: &[u8]) -> u64 {
    <[u8; 8]>::try_from(raw).map_or(0, u64::from_le_bytes)
}

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// Calls `f(id, fields)` for each entry of an XREAD reply (RESP2 arrays or RESP3 maps).
fn for_each_entry(v: &Value, mut f: impl FnMut(&str, Vec<(&[u8], &[u8])>)) {
    let streams: Vec<&Value> = match v {
        Value::Array(a) => a
            .iter()
            .filter_map(|s| match s {
                Value::Array(pair) if pair.len() == 2 => Some(&pair[1]),
                _ => None,
            })
            .collect(),
        Value::Map(m) => m.iter().map(|(_, e)| e).collect(),
        _ => return,
    };
    for entries in streams {
        let Value::Array(entries) = entries else {
            continue;
        };
        for e in entries {
            let Value::Array(e) = e else { continue };
            let (Some(id), Some(Value::Array(kv))) = (e.first().and_then(bytes), e.get(1)) else {
                continue;
            };
            let Ok(id) = std::str::from_utf8(id) else {
                continue;
            };
            let fields = kv
                .chunks(2)
                .filter_map(|p| Some((bytes(p.first()?)?, bytes(p.get(1)?)?)))
                .collect();
            f(id, fields);
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
