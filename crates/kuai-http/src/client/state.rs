//! What the client learns about servers and networks: HTTP/3 advertisements (Alt-Svc,
//! RFC 7838), HTTP/3 found broken on a network, and round-trip times; kept in memory and,
//! when the client has a state file, on disk.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The first time HTTP/3 fails on a network it is not tried again for 5 minutes; each further
/// failure doubles that, up to 48 hours (Chromium's schedule).
const BROKEN_FIRST: Duration = Duration::from_secs(5 * 60);
const BROKEN_MAX: Duration = Duration::from_secs(48 * 3600);
/// Entries kept at most, of each kind (the oldest go first).
const MAX_ENTRIES: usize = 1000;

/// The longest an Alt-Svc entry is kept, whatever its `ma` says (a week): a mistaken or
/// hostile advertisement does not stay on disk for years.
const MAX_ALT_SVC_AGE: u64 = 7 * 24 * 3600;

/// The largest RTT kept, in microseconds (a minute: more is no measurement of a path).
const MAX_RTT_US: u64 = 60_000_000;

/// An origin: `https://host:port`.
pub(crate) type Origin = (String, u16);

/// One HTTP/3 alternative (RFC 7838 §3): where an origin's HTTP/3 is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AltSvc {
    /// Empty: the origin's own host.
    pub host: String,
    pub port: u16,
    /// Seconds since the Unix epoch.
    pub expires: u64,
    /// `persist=1`: kept across network changes.
    pub persist: bool,
    /// The network it was learnt on ([`network_id`]; empty if unknown): without `persist` it
    /// holds on that network only (RFC 7838 §2.2: an alternative chosen for one network
    /// may be wrong on the next).
    pub network: String,
}

/// HTTP/3 failed on a network: when it may be tried again, and the back-off that set it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Broken {
    pub until: u64,
    pub backoff: u64,
}

/// An entry of the state file, for the changes merged into it (see [`State::write`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    AltSvc(Origin),
    Broken((Origin, String)),
    Rtt(SocketAddr),
}

#[derive(Default, Debug)]
pub(crate) struct State {
    alt_svc: HashMap<Origin, AltSvc>,
    /// By origin and network.
    broken: HashMap<(Origin, String), Broken>,
    /// Smoothed RTT per server address, in microseconds.
    rtt: HashMap<SocketAddr, u64>,
    /// Origins whose HTTP/3 completed a handshake in this process, and at which address
    /// (kept in memory, as the sessions that 0-RTT needs are).
    h3_worked: HashMap<Origin, SocketAddr>,
    /// The address of each origin that answered last (kept in memory), tried first next
    /// time.
    answered: HashMap<Origin, SocketAddr>,
    path: Option<PathBuf>,
    /// When a changed RTT last saved the file (see [`State::remember_rtt`]).
    rtt_saved: Option<std::time::Instant>,
    /// When the file was last written, and whether a change waits for the next write.
    saved_at: Option<std::time::Instant>,
    dirty: bool,
    /// Entries this state changed (set or removed) since it last wrote the file: only these
    /// replace what the file holds, so two clients sharing it (two processes) keep each
    /// other's changes.
    changed: HashSet<Key>,
}

/// Writes of the state file at most this often: a server that changes its Alt-Svc on
/// every response (or many origins at once) would otherwise have the file rewritten per
/// response, under the lock every connection attempt takes. A change within it waits for
/// the next write, or for [`State::flush`] (when the client closes or goes).
const SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Drop for State {
    fn drop(&mut self) {
        self.flush();
    }
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl State {
    /// The state kept at `path` (empty if there is none or it does not parse), saved there
    /// on change.
    pub fn load(path: Option<&Path>) -> Self {
        let mut s = State::default();
        s.path = path.map(Path::to_path_buf);
        if let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) {
            s.parse(&text);
        }
        s
    }

    fn parse(&mut self, text: &str) {
        let now = now();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            match f.as_slice() {
                [
                    "alt-svc",
                    host,
                    port,
                    alt_host,
                    alt_port,
                    expires,
                    rest @ ..,
                ] if rest.is_empty() || rest.len() == 2 => {
                    let (Ok(port), Ok(alt_port), Ok(expires)) =
                        (port.parse(), alt_port.parse(), expires.parse::<u64>())
                    else {
                        continue;
                    };
                    // Lines of an older version have neither: kept on any network.
                    let (persist, network) = match rest {
                        [p, n] => (*p == "1", if *n == "-" { "" } else { n }),
                        _ => (true, ""),
                    };
                    if expires > now && self.alt_svc.len() < MAX_ENTRIES {
                        let alt = if *alt_host == "-" { "" } else { alt_host };
                        // What was written by hand or by another version is bounded as
                        // what is learned.
                        let expires = expires.min(now.saturating_add(MAX_ALT_SVC_AGE));
                        self.alt_svc.insert(
                            (host.to_string(), port),
                            AltSvc {
                                host: alt.to_string(),
                                port: alt_port,
                                expires,
                                persist,
                                network: network.to_string(),
                            },
                        );
                    }
                }
                ["broken", host, port, network, until, backoff] => {
                    let (Ok(port), Ok(until), Ok(backoff)) = (
                        port.parse::<u16>(),
                        until.parse::<u64>(),
                        backoff.parse::<u64>(),
                    ) else {
                        continue;
                    };
                    if self.broken.len() >= MAX_ENTRIES {
                        continue;
                    }
                    let max = BROKEN_MAX.as_secs();
                    let (until, backoff) = (until.min(now.saturating_add(max)), backoff.min(max));
                    self.broken.insert(
                        ((host.to_string(), port), network.to_string()),
                        Broken { until, backoff },
                    );
                }
                ["rtt", addr, us] => {
                    if self.rtt.len() >= MAX_ENTRIES {
                        continue;
                    }
                    if let (Ok(a), Ok(us)) = (addr.parse(), us.parse::<u64>()) {
                        self.rtt.insert(a, us.min(MAX_RTT_US));
                    }
                }
                _ => {}
            }
        }
    }

    fn text(&self) -> String {
        let mut out =
            String::from("# kuai client state: HTTP/3 alternatives, broken marks, RTTs\n");
        for ((host, port), a) in &self.alt_svc {
            let alt = if a.host.is_empty() { "-" } else { &a.host };
            let net = if a.network.is_empty() {
                "-"
            } else {
                &a.network
            };
            out += &format!(
                "alt-svc {host} {port} {alt} {} {} {} {net}\n",
                a.port,
                a.expires,
                u8::from(a.persist)
            );
        }
        for (((host, port), net), b) in &self.broken {
            out += &format!("broken {host} {port} {net} {} {}\n", b.until, b.backoff);
        }
        for (addr, us) in &self.rtt {
            out += &format!("rtt {addr} {us}\n");
        }
        out
    }

    /// Saves a change: now, or within [`SAVE_EVERY`] of the last write.
    fn save(&mut self) {
        if self.saved_at.is_some_and(|t| t.elapsed() < SAVE_EVERY) {
            self.dirty = true;
            return;
        }
        self.write();
    }

    /// Writes a change still waiting (see [`SAVE_EVERY`]).
    pub fn flush(&mut self) {
        if self.dirty {
            self.write();
        }
    }

    /// Writes the state to its file (atomically: a temporary file renamed over it). The file
    /// is read again first, under a lock that other writers take too, and what this state
    /// changed since its last write goes into what is there: another client's changes in
    /// between are kept (and learnt here), not overwritten with what this one loaded.
    fn write(&mut self) {
        self.saved_at = Some(std::time::Instant::now());
        self.dirty = false;
        let Some(path) = self.path.clone() else {
            return;
        };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let lock = lock_file(&path);
        self.merge_file(&path);
        self.changed.clear();
        let path = &path;
        // A name no other writer uses (several clients in one process may share the file),
        // made anew (never through a link someone left there), readable by its owner only
        // (it tells which sites were visited).
        static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}.{n}", std::process::id()));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
            o.open(&tmp)?.write_all(self.text().as_bytes())?;
            std::fs::rename(&tmp, path)
        };
        let r = write();
        if let Err(e) = r {
            tracing::debug!(path = %path.display(), error = %e, "client state not saved");
            let _ = std::fs::remove_file(&tmp);
        }
        drop(lock);
    }

    /// Takes in the file's entries, with this state's own changes over them.
    fn merge_file(&mut self, path: &Path) {
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let mut disk = State::default();
        disk.parse(&text);
        for key in &self.changed {
            match key {
                Key::AltSvc(k) => match self.alt_svc.get(k) {
                    Some(v) => disk.alt_svc.insert(k.clone(), v.clone()),
                    None => disk.alt_svc.remove(k),
                }
                .map(drop),
                Key::Broken(k) => match self.broken.get(k) {
                    Some(v) => disk.broken.insert(k.clone(), v.clone()),
                    None => disk.broken.remove(k),
                }
                .map(drop),
                Key::Rtt(k) => match self.rtt.get(k) {
                    Some(v) => disk.rtt.insert(*k, *v),
                    None => disk.rtt.remove(k),
                }
                .map(drop),
            };
        }
        // Bounded as what is learnt: past the bound the oldest entries go.
        trim(&mut disk.alt_svc, |a| a.expires);
        trim(&mut disk.broken, |b| b.until);
        trim(&mut disk.rtt, |_| 0);
        self.alt_svc = std::mem::take(&mut disk.alt_svc);
        self.broken = std::mem::take(&mut disk.broken);
        self.rtt = std::mem::take(&mut disk.rtt);
    }

    /// Where `origin` serves HTTP/3 seen from `network` ([`network_id`]; `None`: the one it
    /// was learnt on), if it said so and it has not expired. An entry learnt on another
    /// network without `persist=1` is forgotten (RFC 7838 §2.2).
    pub fn alt_svc(&mut self, origin: &Origin, network: Option<&str>) -> Option<AltSvc> {
        let a = self.alt_svc.get(origin)?;
        if let Some(network) = network
            && !a.persist
            && !a.network.is_empty()
            && a.network != network
        {
            self.alt_svc.remove(origin);
            self.changed.insert(Key::AltSvc(origin.clone()));
            self.save();
            return None;
        }
        Some(a).filter(|a| a.expires > now()).cloned()
    }

    /// Takes in an Alt-Svc header `value` from `origin` (RFC 7838 §3), received on
    /// `network` ([`network_id`]): its first `h3` alternative, or `clear` to forget.
    pub fn learn_alt_svc(&mut self, origin: &Origin, value: &str, network: &str) {
        let before = self.alt_svc.get(origin).cloned();
        match parse_alt_svc(value) {
            Some(AltSvcHeader::Clear) => {
                self.alt_svc.remove(origin);
            }
            Some(AltSvcHeader::H3 {
                host,
                port,
                max_age,
                persist,
            }) => {
                if max_age == 0 {
                    self.alt_svc.remove(origin);
                } else {
                    if self.alt_svc.len() >= MAX_ENTRIES && !self.alt_svc.contains_key(origin) {
                        let oldest = self
                            .alt_svc
                            .iter()
                            .min_by_key(|(_, a)| a.expires)
                            .map(|(k, _)| k.clone());
                        if let Some(k) = oldest {
                            self.alt_svc.remove(&k);
                        }
                    }
                    self.alt_svc.insert(
                        origin.clone(),
                        AltSvc {
                            host,
                            port,
                            expires: now().saturating_add(max_age.min(MAX_ALT_SVC_AGE)),
                            persist,
                            network: network.to_string(),
                        },
                    );
                }
            }
            // A field with no h3 alternative this client can use replaces what was
            // cached as well (RFC 7838 §3: a received Alt-Svc invalidates and replaces all
            // of the origin's cached alternatives).
            None => {
                self.alt_svc.remove(origin);
            }
        }
        // Saved when what is known changed, not on every response that repeats it (the
        // expiry moving by less than an hour is not a change worth a write).
        let after = self.alt_svc.get(origin);
        let changed = match (&before, after) {
            (Some(b), Some(a)) => {
                b.host != a.host
                    || b.port != a.port
                    || b.persist != a.persist
                    || b.network != a.network
                    || a.expires.abs_diff(b.expires) > 3600
            }
            (None, None) => false,
            _ => true,
        };
        if changed {
            self.changed.insert(Key::AltSvc(origin.clone()));
            self.save();
        }
    }

    /// Whether HTTP/3 to `origin` is marked broken on `network`.
    pub fn is_broken(&self, origin: &Origin, network: &str) -> bool {
        self.broken
            .get(&(origin.clone(), network.to_string()))
            .is_some_and(|b| b.until > now())
    }

    /// HTTP/3 to `origin` failed on `network` where TCP worked: not tried again there for the
    /// back-off, which doubles each time.
    pub fn mark_broken(&mut self, origin: &Origin, network: &str) {
        let key = (origin.clone(), network.to_string());
        let backoff = match self.broken.get(&key) {
            Some(b) => b.backoff.saturating_mul(2).min(BROKEN_MAX.as_secs()),
            None => BROKEN_FIRST.as_secs(),
        };
        if self.broken.len() >= MAX_ENTRIES {
            let oldest = self
                .broken
                .iter()
                .min_by_key(|(_, b)| b.until)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.broken.remove(&k);
            }
        }
        self.broken.insert(
            key.clone(),
            Broken {
                until: now().saturating_add(backoff),
                backoff,
            },
        );
        self.changed.insert(Key::Broken(key));
        self.save();
    }

    /// Whether HTTP/3 to `origin` at `addr` completed a handshake before (in this process).
    /// A session is kept by server name: 0-RTT to an address of the name that never
    /// answered would make a "connection" to where nothing may listen.
    pub fn h3_worked(&self, origin: &Origin, addr: SocketAddr) -> bool {
        self.h3_worked.get(origin) == Some(&addr)
    }

    /// HTTP/3 to `origin` at `addr` completed a handshake.
    pub fn note_h3_worked(&mut self, origin: &Origin, addr: SocketAddr) {
        if self.h3_worked.len() < MAX_ENTRIES || self.h3_worked.contains_key(origin) {
            self.h3_worked.insert(origin.clone(), addr);
        }
    }

    /// `origin` answered at `addr` (resolved, before any Alt-Svc): tried first next time.
    pub fn note_answered(&mut self, origin: &Origin, addr: SocketAddr) {
        if self.answered.len() < MAX_ENTRIES || self.answered.contains_key(origin) {
            self.answered.insert(origin.clone(), addr);
        }
    }

    /// The address of `origin` that answered last.
    pub fn answered(&self, origin: &Origin) -> Option<SocketAddr> {
        self.answered.get(origin).copied()
    }

    /// HTTP/3 to `origin` at `addr` worked on `network`: the mark (and its back-off) goes.
    pub fn mark_working(&mut self, origin: &Origin, network: &str, addr: SocketAddr) {
        self.note_h3_worked(origin, addr);
        let key = (origin.clone(), network.to_string());
        if self.broken.remove(&key).is_some() {
            self.changed.insert(Key::Broken(key));
            self.save();
        }
    }

    /// The last smoothed RTT measured to `addr`.
    pub fn rtt(&self, addr: SocketAddr) -> Option<Duration> {
        self.rtt.get(&addr).map(|&us| Duration::from_micros(us))
    }

    /// Remembers the smoothed RTT to `addr`; saved when it moved by a quarter or more.
    pub fn remember_rtt(&mut self, addr: SocketAddr, rtt: Duration) {
        let us = rtt.as_micros().min(u128::from(MAX_RTT_US)) as u64;
        let old = self.rtt.insert(addr, us);
        if self.rtt.len() > MAX_ENTRIES {
            let other = self.rtt.keys().find(|&&a| a != addr).copied();
            if let Some(a) = other {
                self.rtt.remove(&a);
            }
        }
        // A new server's RTT is saved at once; a changed one (by a quarter) at most every
        // 10 s: this runs on every HTTP/3 response, and a save is a file write.
        let due = self
            .rtt_saved
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(10));
        if old.is_none() || (due && old.is_some_and(|o| us.abs_diff(o).saturating_mul(4) >= o)) {
            self.rtt_saved = Some(std::time::Instant::now());
            self.changed.insert(Key::Rtt(addr));
            self.save();
        }
    }

    #[cfg(test)]
    pub fn broken_entry(&self, origin: &Origin, network: &str) -> Option<Broken> {
        self.broken
            .get(&(origin.clone(), network.to_string()))
            .cloned()
    }
}

/// What an Alt-Svc header says about HTTP/3.
#[derive(Debug, PartialEq, Eq)]
pub enum AltSvcHeader {
    /// `clear`: forget the origin's alternatives.
    Clear,
    /// The first `h3` alternative.
    H3 {
        /// Its host; empty for the origin's own.
        host: String,
        /// Its UDP port.
        port: u16,
        /// How long it may be remembered, in seconds (`ma`).
        max_age: u64,
        /// `persist=1`: kept when the client's network changes (RFC 7838 §2.2).
        persist: bool,
    },
}

/// Parses an Alt-Svc field value (RFC 7838 §3) for its first `h3` alternative; `None` when it
/// has none (or does not parse).
pub fn parse_alt_svc(value: &str) -> Option<AltSvcHeader> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("clear") {
        return Some(AltSvcHeader::Clear);
    }
    for alt in split_outside_quotes(value, ',') {
        let mut parts = split_outside_quotes(alt, ';').into_iter();
        let Some((proto, authority)) = parts.next().and_then(|p| p.split_once('=')) else {
            continue;
        };
        if proto.trim() != "h3" {
            continue;
        }
        let Some((host, port)) = authority
            .trim()
            .strip_prefix('"')
            .and_then(|a| a.strip_suffix('"'))
            .and_then(|a| a.rsplit_once(':'))
        else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        if port == 0 {
            continue;
        }
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if !host.is_empty() && host.parse::<IpAddr>().is_err() && !valid_host(host) {
            continue;
        }
        let mut max_age = 86400;
        let mut persist = false;
        for p in parts {
            if let Some((k, v)) = p.split_once('=') {
                let v = v.trim().trim_matches('"');
                match k.trim() {
                    "ma" => max_age = v.parse().unwrap_or(max_age),
                    "persist" => persist = v == "1",
                    _ => {}
                }
            }
        }
        return Some(AltSvcHeader::H3 {
            host: host.to_string(),
            port,
            max_age,
            persist,
        });
    }
    None
}

/// Drops the entries of `map` with the least `age` until at most [`MAX_ENTRIES`] are left.
fn trim<K: Clone + Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>, age: impl Fn(&V) -> u64) {
    while map.len() > MAX_ENTRIES {
        let oldest = map
            .iter()
            .min_by_key(|(_, v)| age(v))
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => map.remove(&k),
            None => break,
        };
    }
}

/// An exclusive lock on the state file's companion `<file>.lock`, held while the file is
/// read and replaced (the state file itself is replaced by a rename, so it cannot carry
/// the lock). Waits up to 200 ms for another writer, then goes on without it: a client
/// stuck with the lock must not stall this one's connections.
fn lock_file(path: &Path) -> Option<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let file = o.open(path.with_extension("lock")).ok()?;
    #[cfg(target_os = "linux")]
    for _ in 0..40 {
        use rustix::fs::{FlockOperation, flock};
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Some(file),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
    // Closing the file releases the lock.
    None
}

fn valid_host(h: &str) -> bool {
    h.len() <= 253
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// Splits on `sep` where it is not inside double quotes.
fn split_outside_quotes(s: &str, sep: char) -> Vec<&str> {
    let mut out = Vec::new();
    let mut quoted = false;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                out.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// Names the network a connection to `server` goes out on: the local address the kernel
/// picks for it and, on Linux, the default route's gateway. When either changes (another
/// Wi-Fi, cellular instead of Wi-Fi, a VPN), HTTP/3 found broken before is tried again.
pub(crate) fn network_id(server: SocketAddr) -> String {
    let any: SocketAddr = match server {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("address"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("address"),
    };
    // Connecting a UDP socket sends nothing; it only picks the route.
    let local = std::net::UdpSocket::bind(any)
        .and_then(|s| s.connect(server).and_then(|()| s.local_addr()))
        .map_or_else(|_| "?".to_string(), |a| a.ip().to_string());
    format!(
        "{local}/{}",
        default_gateway().unwrap_or_else(|| "-".into())
    )
}

/// The default route's gateway (Linux, IPv4).
fn default_gateway() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&"00000000")).then(|| {
            let gw = u32::from_str_radix(f.get(2)?, 16).ok()?;
            Some(std::net::Ipv4Addr::from(gw.to_le_bytes()).to_string())
        })?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alt_svc_values_parse() {
        let h3 = |host: &str, port, max_age| {
            Some(AltSvcHeader::H3 {
                host: host.into(),
                port,
                max_age,
                persist: false,
            })
        };
        assert_eq!(parse_alt_svc(r#"h3=":443"; ma=86400"#), h3("", 443, 86400));
        assert_eq!(parse_alt_svc(r#"h3=":4433""#), h3("", 4433, 86400));
        assert_eq!(
            parse_alt_svc(r#"h3-29=":443"; ma=1, h3="alt.example.com:8443"; ma=60; persist=1"#),
            Some(AltSvcHeader::H3 {
                host: "alt.example.com".into(),
                port: 8443,
                max_age: 60,
                persist: true,
            })
        );
        assert_eq!(parse_alt_svc(r#"h3="[::1]:443""#), h3("::1", 443, 86400));
        assert_eq!(parse_alt_svc("clear"), Some(AltSvcHeader::Clear));
        assert_eq!(parse_alt_svc(r#"h2=":443""#), None);
        // A malformed alternative is skipped, not the whole field.
        assert_eq!(parse_alt_svc(r#"h3=:443, h3=":8443""#), h3("", 8443, 86400));
        assert_eq!(
            parse_alt_svc(r#"h3="nocolon", h3=":8443""#),
            h3("", 8443, 86400)
        );
        for bad in [
            "",
            "h3",
            "h3=:443",
            r#"h3=":0""#,
            r#"h3=":99999""#,
            r#"h3="bad host:443""#,
            r#"h3=""#,
            "\"",
        ] {
            assert_eq!(parse_alt_svc(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn broken_marks_back_off_and_state_round_trips() {
        let path = std::env::temp_dir().join(format!("kuai-client-state-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let o: Origin = ("example.com".into(), 443);
        let mut s = State::load(Some(&path));
        assert!(!s.is_broken(&o, "net-a"));
        s.mark_broken(&o, "net-a");
        assert!(s.is_broken(&o, "net-a"));
        assert!(!s.is_broken(&o, "net-b"), "another network is tried");
        assert_eq!(s.broken_entry(&o, "net-a").unwrap().backoff, 300);
        s.mark_broken(&o, "net-a");
        assert_eq!(s.broken_entry(&o, "net-a").unwrap().backoff, 600);
        for _ in 0..20 {
            s.mark_broken(&o, "net-a");
        }
        assert_eq!(s.broken_entry(&o, "net-a").unwrap().backoff, 48 * 3600);
        s.learn_alt_svc(&o, r#"h3=":8443"; ma=3600"#, "net-a");
        s.remember_rtt("192.0.2.1:443".parse().unwrap(), Duration::from_millis(42));
        s.flush();
        let mut t = State::load(Some(&path));
        assert!(t.is_broken(&o, "net-a"));
        assert_eq!(t.alt_svc(&o, None).map(|a| a.port), Some(8443));
        assert_eq!(
            t.rtt("192.0.2.1:443".parse().unwrap()),
            Some(Duration::from_millis(42))
        );
        t.mark_working(&o, "net-a", "192.0.2.1:443".parse().unwrap());
        // A field without an h3 alternative replaces it too (RFC 7838 §3).
        t.learn_alt_svc(&o, r#"h2=":443""#, "net-a");
        assert_eq!(t.alt_svc(&o, None), None);
        t.learn_alt_svc(&o, r#"h3=":8443"; ma=3600"#, "net-a");
        t.learn_alt_svc(&o, "clear", "net-a");
        t.flush();
        let mut u = State::load(Some(&path));
        assert!(!u.is_broken(&o, "net-a"));
        assert_eq!(u.alt_svc(&o, None), None);
        // Garbage in the file is skipped, not fatal.
        std::fs::write(&path, "alt-svc x\nbroken a b c d e\n\u{0}\nrtt nope 1\n").unwrap();
        let v = State::load(Some(&path));
        assert!(v.alt_svc.is_empty() && v.broken.is_empty() && v.rtt.is_empty());
        std::fs::remove_file(&path).unwrap();
    }

    /// A hostile or hand-edited file is bounded as what is learned: expiries and back-offs
    /// clamped (a back-off that doubles cannot overflow), at most `MAX_ENTRIES` of each
    /// kind; the file is written readable by its owner only.
    #[test]
    fn a_loaded_file_is_bounded_and_written_privately() {
        let path = std::env::temp_dir().join(format!("kuai-client-state-b-{}", std::process::id()));
        let mut text = format!(
            "alt-svc a.example 443 - 8443 {m}\nbroken a.example 443 net {m} {m}\n",
            m = u64::MAX
        );
        for i in 0..2 * MAX_ENTRIES {
            text += &format!("rtt 192.0.2.1:{} 1000\n", 1000 + i);
        }
        std::fs::write(&path, text).unwrap();
        let mut s = State::load(Some(&path));
        let o: Origin = ("a.example".into(), 443);
        let a = s.alt_svc(&o, None).unwrap();
        assert!(a.expires <= now() + MAX_ALT_SVC_AGE);
        let b = s.broken_entry(&o, "net").unwrap();
        assert!(b.until <= now() + BROKEN_MAX.as_secs());
        assert_eq!(b.backoff, BROKEN_MAX.as_secs());
        assert_eq!(s.rtt.len(), MAX_ENTRIES);
        s.mark_broken(&o, "net");
        assert_eq!(
            s.broken_entry(&o, "net").unwrap().backoff,
            BROKEN_MAX.as_secs()
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{mode:o}");
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// A server that changes its Alt-Svc on every response gets one write a second, not
    /// one per response; what changed since is written when the state goes.
    #[test]
    fn changes_are_written_at_most_once_a_second() {
        let path = std::env::temp_dir().join(format!("kuai-client-state-c-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let o: Origin = ("example.com".into(), 443);
        let mut s = State::load(Some(&path));
        let written = |p: &Path| std::fs::metadata(p).map(|m| m.modified().unwrap()).ok();
        s.learn_alt_svc(&o, r#"h3=":8443"; ma=3600"#, "net-a");
        let first = written(&path).expect("the first change is written at once");
        for i in 0..200 {
            s.learn_alt_svc(&o, &format!(r#"h3=":{}"; ma=3600"#, 9000 + i % 2), "net-a");
        }
        assert_eq!(written(&path), Some(first), "rewritten within the second");
        assert_eq!(
            State::load(Some(&path)).alt_svc(&o, None).unwrap().port,
            8443
        );
        drop(s);
        assert_eq!(
            State::load(Some(&path)).alt_svc(&o, None).unwrap().port,
            9001
        );
        std::fs::remove_file(&path).unwrap();
    }

    /// Two clients sharing a state file (two `kuai get` processes) keep each other's
    /// changes: each write takes in the file as it is and replaces only what its writer
    /// changed.
    #[test]
    fn two_writers_keep_each_others_changes() {
        let path = std::env::temp_dir().join(format!("kuai-client-state-d-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let o: Origin = ("a.example".into(), 443);
        let mut first = State::load(Some(&path));
        first.learn_alt_svc(&o, r#"h3=":8443"; ma=3600"#, "net-a");
        let mut a = State::load(Some(&path));
        let mut b = State::load(Some(&path));
        assert!(a.alt_svc(&o, None).is_some() && b.alt_svc(&o, None).is_some());
        b.learn_alt_svc(&o, "clear", "net-a");
        let other: SocketAddr = "192.0.2.9:443".parse().unwrap();
        a.remember_rtt(other, Duration::from_millis(20));
        let mut c = State::load(Some(&path));
        assert_eq!(
            c.alt_svc(&o, None),
            None,
            "b's clear was undone by a's write"
        );
        assert_eq!(c.rtt(other), Some(Duration::from_millis(20)));
        // And a learnt b's change when it wrote.
        assert_eq!(a.alt_svc(&o, None), None);
        drop((first, a, b, c));
        std::fs::remove_file(&path).unwrap();
        let _ = std::fs::remove_file(path.with_extension("lock"));
    }

    /// An RTT from a hostile file is bounded: comparing a new one with it cannot overflow.
    #[test]
    fn a_huge_rtt_in_the_file_is_bounded() {
        let path = std::env::temp_dir().join(format!("kuai-client-state-e-{}", std::process::id()));
        std::fs::write(&path, format!("rtt 192.0.2.1:443 {}\n", u64::MAX)).unwrap();
        let mut s = State::load(Some(&path));
        let addr: SocketAddr = "192.0.2.1:443".parse().unwrap();
        assert_eq!(s.rtt(addr), Some(Duration::from_micros(MAX_RTT_US)));
        s.remember_rtt(addr, Duration::from_millis(20));
        assert_eq!(s.rtt(addr), Some(Duration::from_millis(20)));
        drop(s);
        std::fs::remove_file(&path).unwrap();
        let _ = std::fs::remove_file(path.with_extension("lock"));
    }

    #[test]
    fn the_network_id_names_the_route() {
        let id = network_id("127.0.0.1:443".parse().unwrap());
        assert!(id.starts_with("127.0.0.1/"), "{id}");
    }
}
