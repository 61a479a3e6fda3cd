//! qlog output: a [`Tracer`] writing the connection's events as JSON text sequences
//! (`.sqlog`, RFC 7464 records): the main schema's `QlogFileSeq`
//! (draft-ietf-quic-qlog-main-schema-13, `urn:ietf:params:qlog:file:sequential`) with the
//! QUIC events of draft-ietf-quic-qlog-quic-events-14 (`urn:ietf:params:qlog:events:quic-14`,
//! every name in the `quic` namespace). The header also carries `qlog_format` and
//! `qlog_version`, which the drafts dropped and qvis still looks for.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The QUIC event schema written (draft-ietf-quic-qlog-quic-events-14 §3.1: a draft's URI
/// ends in its number).
pub const EVENT_SCHEMA: &str = "urn:ietf:params:qlog:events:quic-14";

/// `t` as an RFC 3339 UTC date and time with milliseconds.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

use kuai_proto::SpaceId;
use kuai_proto::trace::{ConnectionMeta, PacketKind, ParamValue, Subscriber, TraceEvent, Tracer};
use kuai_proto::{ConnectionId, Side};

/// Events a server keeps in memory for a connection whose client has not proved its address
/// yet; later ones are counted, not kept. A handshake's events before that take 2-4 KiB; with
/// 10,000 half-open handshakes (the server's default limit) this is at most 160 MiB.
const PENDING_MAX: usize = 16 * 1024;

/// Trace files open at once in the process; a connection past it is not traced (a flood of
/// connections would otherwise hold a descriptor and a buffer each, and fill the disk).
pub const MAX_OPEN_TRACES: usize = 1024;
/// Bytes one trace file takes at most; the trace stops there (a long transfer's events
/// are a few hundred bytes per packet).
pub const MAX_TRACE_BYTES: u64 = 512 << 20;

static OPEN_TRACES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// When a qlog warning was last given (seconds since the Unix epoch): one a minute at most.
static WARNED_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether a warning may be given now (see [`WARNED_AT`]).
fn may_warn() -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = WARNED_AT.load(Relaxed);
    now >= last + 60
        && WARNED_AT
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
}

/// Writes one connection's trace to a file.
///
/// A server opens the file only once the client has proved its address (a Handshake or
/// 1-RTT packet from it arrived, RFC 9000 §8.1): until then the events wait in memory (16 KiB
/// at most), so Initials from spoofed addresses, which never get that far, create no files.
/// Files are never overwritten: a name in use gets a numbered suffix. They are readable by
/// their owner only (a trace holds addresses and the connection's stateless reset token).
/// At most [`MAX_OPEN_TRACES`] are open at once and each stops at [`MAX_TRACE_BYTES`].
pub struct QlogWriter {
    out: Out,
    start: Instant,
    line: String,
}

enum Out {
    /// The file, and the bytes written to it.
    File(BufWriter<File>, u64),
    /// Not opened yet: where it will be, and what it will start with.
    Pending {
        dir: PathBuf,
        name: String,
        buf: Vec<u8>,
        dropped: u64,
    },
    /// The file could not be created; events are discarded.
    Failed,
}

impl QlogWriter {
    /// A trace for `<dir>/<odcid>_<client|server>.sqlog`, beginning with the qlog header; a
    /// client's file is created at once, a server's once the client's address is validated.
    pub fn create(
        dir: &Path,
        odcid: &ConnectionId,
        side: Side,
        start: Instant,
    ) -> std::io::Result<Self> {
        let role = if side.is_client() { "client" } else { "server" };
        let wall = rfc3339(SystemTime::now());
        let mut buf = Vec::with_capacity(512);
        // Times are milliseconds from the connection's start on a monotonic clock, whose
        // epoch qlog calls "unknown"; the wall-clock time says when that was (main schema
        // §7.1). The group is the connection's original destination ID.
        writeln!(
            buf,
            "\u{1e}{{\"file_schema\":\"urn:ietf:params:qlog:file:sequential\",\
             \"serialization_format\":\"application/qlog+json-seq\",\"title\":\"kuai\",\
             \"qlog_format\":\"JSON-SEQ\",\"qlog_version\":\"0.3\",\
             \"trace\":{{\"event_schemas\":[\"{EVENT_SCHEMA}\"],\
             \"vantage_point\":{{\"name\":\"kuai\",\"type\":\"{role}\"}},\
             \"common_fields\":{{\"group_id\":\"{odcid}\",\"time_format\":\"relative_to_epoch\",\
             \"reference_time\":{{\"clock_type\":\"monotonic\",\"epoch\":\"unknown\",\
             \"wall_clock_time\":\"{wall}\"}}}}}}}}"
        )?;
        let mut w = Self {
            out: Out::Pending {
                dir: dir.to_path_buf(),
                name: format!("{odcid}_{role}"),
                buf,
                dropped: 0,
            },
            start,
            line: String::with_capacity(256),
        };
        if side.is_client() {
            w.open()?;
        }
        Ok(w)
    }

    /// Creates the file (under a name not in use) and writes what waited.
    fn open(&mut self) -> std::io::Result<()> {
        let Out::Pending {
            dir,
            name,
            buf,
            dropped,
        } = std::mem::replace(&mut self.out, Out::Failed)
        else {
            return Ok(());
        };
        use std::sync::atomic::Ordering::Relaxed;
        if OPEN_TRACES.fetch_add(1, Relaxed) >= MAX_OPEN_TRACES {
            OPEN_TRACES.fetch_sub(1, Relaxed);
            return Err(std::io::Error::other(format!(
                "{MAX_OPEN_TRACES} traces open: this connection is not traced"
            )));
        }
        // Counted from here: the decrement comes with the writer's drop once a file is open.
        let opened = (|| {
            std::fs::create_dir_all(&dir)?;
            Self::create_file(&dir, &name)
        })();
        let file = match opened {
            Ok(f) => f,
            Err(e) => {
                OPEN_TRACES.fetch_sub(1, Relaxed);
                return Err(e);
            }
        };
        let mut out = BufWriter::new(file);
        let written = buf.len() as u64;
        let r = out.write_all(&buf);
        if dropped > 0 {
            tracing::debug!(
                dropped,
                "qlog events dropped before the address was validated"
            );
        }
        self.out = Out::File(out, written);
        r
    }

    /// A new file for `name` in `dir` (a numbered suffix when the name is taken).
    fn create_file(dir: &Path, name: &str) -> std::io::Result<File> {
        let mut file = None;
        for n in 0..100 {
            let path = if n == 0 {
                dir.join(format!("{name}.sqlog"))
            } else {
                dir.join(format!("{name}_{n}.sqlog"))
            };
            let mut o = OpenOptions::new();
            o.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
            match o.open(&path) {
                Ok(f) => {
                    file = Some(f);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        file.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, "100 traces of that name")
        })
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The packet type of a packet-number space's packets (1-RTT for application data).
fn space_packet_type(space: SpaceId) -> &'static str {
    match space {
        SpaceId::Initial => "initial",
        SpaceId::Handshake => "handshake",
        SpaceId::Data => "1RTT",
    }
}

/// A qlog `TupleEndpointInfo` for a peer's address.
fn tuple_json(a: &std::net::SocketAddr) -> String {
    match a {
        std::net::SocketAddr::V4(a) => {
            format!("{{\"ip_v4\":\"{}\",\"port_v4\":{}}}", a.ip(), a.port())
        }
        std::net::SocketAddr::V6(a) => {
            format!("{{\"ip_v6\":\"{}\",\"port_v6\":{}}}", a.ip(), a.port())
        }
    }
}

/// `quic:connection_closed`: who closed, the error (its RFC 9000 name, lower case, or
/// `unknown` with the code), the reason, and the trigger.
fn connection_closed_json(l: &mut String, error: Option<&kuai_proto::ConnectionError>) {
    use kuai_proto::ConnectionError as E;
    let _ = write!(l, "\"name\":\"quic:connection_closed\",\"data\":{{");
    let transport = |l: &mut String, initiator: &str, e: &kuai_proto::TransportError| {
        let code = e.code;
        let name = match code.name() {
            Some(_) if code.0 >= 0x100 => format!("crypto_error_{:#x}", code.0),
            Some(n) => n.to_ascii_lowercase(),
            None => "unknown".into(),
        };
        let _ = write!(
            l,
            "\"initiator\":\"{initiator}\",\"connection_error\":\"{name}\",\"error_code\":{},\"reason\":\"{}\",\"trigger\":\"error\"",
            code.0,
            json_escape(&e.reason)
        );
    };
    match error {
        Some(E::TransportError(e)) => transport(l, "local", e),
        Some(E::PeerTransportError(e)) => transport(l, "remote", e),
        Some(E::ApplicationClosed { code, reason }) => {
            let _ = write!(
                l,
                "\"initiator\":\"remote\",\"application_error\":\"unknown\",\"error_code\":{code},\"reason\":\"{}\",\"trigger\":\"application\"",
                json_escape(&String::from_utf8_lossy(reason))
            );
        }
        Some(E::LocallyClosed) => l.push_str("\"initiator\":\"local\",\"trigger\":\"application\""),
        Some(E::TimedOut) => l.push_str("\"initiator\":\"local\",\"trigger\":\"idle_timeout\""),
        Some(E::Reset) => l.push_str("\"initiator\":\"remote\",\"trigger\":\"stateless_reset\""),
        Some(E::VersionMismatch) => {
            l.push_str("\"initiator\":\"local\",\"trigger\":\"version_mismatch\"")
        }
        _ => l.push_str("\"trigger\":\"unspecified\""),
    }
    l.push('}');
}

fn frames_json(out: &mut String, frames: &[&str]) {
    out.push('[');
    for (i, f) in frames.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{{\"frame_type\":\"{}\"}}", f.to_ascii_lowercase());
    }
    out.push(']');
}

/// `s` escaped for the inside of a JSON string (quotes, backslashes, control characters).
pub fn json_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

impl Tracer for QlogWriter {
    fn event(&mut self, time: Instant, event: &TraceEvent<'_>) {
        let t = ms(time.saturating_duration_since(self.start));
        let l = &mut self.line;
        l.clear();
        let _ = write!(l, "\u{1e}{{\"time\":{t:.3},");
        match event {
            TraceEvent::PacketSent {
                kind,
                pn,
                size,
                frames,
                ..
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:packet_sent\",\"data\":{{\"header\":{{\"packet_type\":\"{}\",\"packet_number\":{pn}}},\"raw\":{{\"length\":{size}}},\"frames\":",
                    kind.qlog_name()
                );
                frames_json(l, frames);
                l.push('}');
            }
            TraceEvent::PacketReceived {
                kind,
                pn,
                size,
                frames,
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:packet_received\",\"data\":{{\"header\":{{\"packet_type\":\"{}\",\"packet_number\":{pn}}},\"raw\":{{\"length\":{size}}},\"frames\":",
                    kind.qlog_name()
                );
                frames_json(l, frames);
                l.push('}');
            }
            TraceEvent::PacketDropped { kind, size, reason } => {
                use kuai_proto::trace::DropReason as D;
                let trigger = match reason {
                    D::KeyUnavailable => "key_unavailable",
                    D::DecryptionFailure => "decryption_failure",
                    D::Duplicate => "duplicate",
                    D::UnexpectedVersion => "unsupported",
                    D::ConnectionClosing => "rejected",
                    D::HeaderParseError | D::DatagramTooSmall => "invalid",
                    _ => "general",
                };
                let _ = write!(l, "\"name\":\"quic:packet_dropped\",\"data\":{{");
                if let Some(k) = kind {
                    let _ = write!(l, "\"header\":{{\"packet_type\":\"{}\"}},", k.qlog_name());
                }
                let _ = write!(
                    l,
                    "\"raw\":{{\"length\":{size}}},\"trigger\":\"{trigger}\",\"details\":{{\"reason\":\"{}\"}}}}",
                    reason.name()
                );
            }
            TraceEvent::PacketLost {
                space, pn, trigger, ..
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:packet_lost\",\"data\":{{\"header\":{{\"packet_type\":\"{}\",\"packet_number\":{pn}}},\"trigger\":\"{trigger}\"}}",
                    space_packet_type(*space)
                );
            }
            TraceEvent::MetricsUpdated {
                min_rtt,
                smoothed_rtt,
                latest_rtt,
                rtt_variance,
                cwnd,
                bytes_in_flight,
                ssthresh,
                pacing_rate,
                ..
            } => {
                // RTTs in milliseconds, the pacing rate in bits per second.
                let _ = write!(
                    l,
                    "\"name\":\"quic:recovery_metrics_updated\",\"data\":{{\"min_rtt\":{:.3},\"smoothed_rtt\":{:.3},\"latest_rtt\":{:.3},\"rtt_variance\":{:.3},\"congestion_window\":{cwnd},\"bytes_in_flight\":{bytes_in_flight},\"pacing_rate\":{}",
                    ms(*min_rtt),
                    ms(*smoothed_rtt),
                    ms(*latest_rtt),
                    ms(*rtt_variance),
                    pacing_rate.saturating_mul(8),
                );
                if let Some(s) = ssthresh {
                    let _ = write!(l, ",\"ssthresh\":{s}");
                }
                l.push('}');
            }
            TraceEvent::CongestionStateUpdated { state, .. } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:congestion_state_updated\",\"data\":{{\"new\":\"{state}\"}}"
                );
            }
            TraceEvent::KeyUpdated {
                trigger,
                generation,
            } => {
                // Both directions' 1-RTT keys change together: one record each.
                let _ = write!(
                    l,
                    "\"name\":\"quic:key_updated\",\"data\":{{\"key_type\":\"client_1rtt_secret\",\"trigger\":\"{trigger}\",\"key_phase\":{generation}}}}}\n\u{1e}{{\"time\":{t:.3},\"name\":\"quic:key_updated\",\"data\":{{\"key_type\":\"server_1rtt_secret\",\"trigger\":\"{trigger}\",\"key_phase\":{generation}}}"
                );
            }
            TraceEvent::KeyDiscarded { space } => {
                let level = match space {
                    SpaceId::Initial => "initial",
                    SpaceId::Handshake => "handshake",
                    SpaceId::Data => "0rtt",
                };
                let _ = write!(
                    l,
                    "\"name\":\"quic:key_discarded\",\"data\":{{\"key_type\":\"client_{level}_secret\",\"trigger\":\"tls\"}}}}\n\u{1e}{{\"time\":{t:.3},\"name\":\"quic:key_discarded\",\"data\":{{\"key_type\":\"server_{level}_secret\",\"trigger\":\"tls\"}}"
                );
            }
            TraceEvent::ParametersSet {
                owner_local,
                params,
                ..
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:parameters_set\",\"data\":{{\"initiator\":\"{}\"",
                    if *owner_local { "local" } else { "remote" },
                );
                for (name, v) in params.iter() {
                    let _ = match v {
                        ParamValue::Number(n) => write!(l, ",\"{name}\":{n}"),
                        ParamValue::Flag(b) => write!(l, ",\"{name}\":{b}"),
                        ParamValue::Hex(h) => write!(l, ",\"{name}\":\"{}\"", json_escape(h)),
                        _ => Ok(()),
                    };
                }
                l.push('}');
            }
            TraceEvent::ConnectionStateUpdated { new } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:connection_state_updated\",\"data\":{{\"new\":\"{new}\"}}"
                );
            }
            TraceEvent::PathUpdated {
                path,
                remote,
                event,
            } => {
                // The path's tuple (its ID: kuai's path number), then what happened to it.
                let tuple = tuple_json(remote);
                let state = match *event {
                    "validated" => "probing_successful",
                    "client_migration" | "peer_migration" | "preferred_address" => {
                        "migration_started"
                    }
                    _ => "migration_abandoned",
                };
                let _ = write!(
                    l,
                    "\"name\":\"quic:tuple_assigned\",\"data\":{{\"tuple_id\":\"{}\",\"tuple_remote\":{tuple}}}}}\n\u{1e}{{\"time\":{t:.3},\"name\":\"quic:migration_state_updated\",\"data\":{{\"new\":\"{state}\",\"tuple_id\":\"{}\",\"tuple_remote\":{tuple},\"kuai_event\":\"{event}\"}}",
                    path.0, path.0
                );
            }
            TraceEvent::MtuUpdated { mtu, done, .. } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:mtu_updated\",\"data\":{{\"new\":{mtu},\"done\":{done}}}"
                );
            }
            TraceEvent::VersionChosen { version } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:version_information\",\"data\":{{\"chosen_version\":\"{:08x}\"}}",
                    version.wire()
                );
            }
            TraceEvent::ConnectionClosed { error, .. } => {
                connection_closed_json(l, *error);
            }
            // An event this writer does not know yet (kuai-proto's list may grow), or one
            // qlog has no place for (HandshakeCompleted: connection_state_updated says it).
            _ => return,
        }
        l.push_str("}\n");
        let validated = matches!(
            event,
            TraceEvent::PacketReceived {
                kind: PacketKind::Handshake | PacketKind::OneRtt,
                ..
            }
        );
        match &mut self.out {
            Out::File(f, written) => {
                *written += l.len() as u64;
                if *written > MAX_TRACE_BYTES {
                    if may_warn() {
                        tracing::warn!(
                            "a qlog trace reached {MAX_TRACE_BYTES} bytes: stopped there (said once a minute)"
                        );
                    }
                    // Flushed as it goes; the count of open traces with it.
                    self.out = Out::Failed;
                    OPEN_TRACES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                if let Err(e) = f.write_all(l.as_bytes()) {
                    // A full disk, say: the trace stops there, said in the log, instead of
                    // every event trying again.
                    if may_warn() {
                        tracing::warn!(error = %e,
                            "a qlog trace could not be written: stopped there (said once a minute)");
                    }
                    self.out = Out::Failed;
                    OPEN_TRACES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Out::Pending { buf, dropped, .. } => {
                if buf.len() + l.len() <= PENDING_MAX {
                    buf.extend_from_slice(l.as_bytes());
                } else {
                    *dropped += 1;
                }
                if validated
                    && let Err(e) = self.open()
                    && may_warn()
                {
                    tracing::warn!(error = %e, "cannot write qlog (said once a minute)");
                }
            }
            Out::Failed => {}
        }
    }
}

/// qlog for every connection of an endpoint: a [`Subscriber`] writing each connection's trace
/// to `<dir>/<original DCID>_<client|server>.sqlog` ([`QlogWriter`]).
#[derive(Debug, Clone)]
pub struct QlogDir {
    dir: PathBuf,
}

impl QlogDir {
    /// Traces into `dir` (created when the first trace is written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }
}

impl Subscriber for QlogDir {
    /// `None` when the trace could not be started (logged once).
    type ConnectionContext = Option<QlogWriter>;

    fn create_connection_context(&self, meta: &ConnectionMeta, now: Instant) -> Option<QlogWriter> {
        match QlogWriter::create(&self.dir, &meta.original_dcid, meta.side, now) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, dir = %self.dir.display(), "cannot write qlog");
                None
            }
        }
    }

    fn on_connection_event(
        &self,
        w: &mut Option<QlogWriter>,
        now: Instant,
        event: &TraceEvent<'_>,
    ) {
        if let Some(w) = w {
            w.event(now, event);
        }
    }
}

impl Drop for QlogWriter {
    fn drop(&mut self) {
        if let Out::File(f, _) = &mut self.out {
            let _ = f.flush();
            OPEN_TRACES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that open traces, one at a time: the count of open traces is the process's.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn received(w: &mut QlogWriter, kind: PacketKind) {
        w.event(
            Instant::now(),
            &TraceEvent::PacketReceived {
                kind,
                pn: 0,
                size: 1200,
                frames: &["crypto"],
            },
        );
    }

    /// At most `MAX_OPEN_TRACES` files are open at once (a connection past it is not
    /// traced), and each is readable by its owner only.
    #[test]
    fn open_traces_are_capped_and_private() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("kuai-qlog-cap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut open = Vec::new();
        let mut refused = 0;
        for i in 0..MAX_OPEN_TRACES as u32 + 5 {
            let odcid = ConnectionId::new(&i.to_be_bytes());
            match QlogWriter::create(&dir, &odcid, Side::Client, Instant::now()) {
                Ok(w) => open.push(w),
                Err(_) => refused += 1,
            }
        }
        assert_eq!(open.len(), MAX_OPEN_TRACES);
        assert_eq!(refused, 5);
        drop(open.pop());
        let again = QlogWriter::create(
            &dir,
            &ConnectionId::new(&[9; 8]),
            Side::Client,
            Instant::now(),
        );
        assert!(again.is_ok(), "a closed trace makes room");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let f = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap();
            let mode = f.metadata().unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{mode:o}");
        }
        drop(open);
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A server's trace file appears only once the client proved its address: Initials
    /// from spoofed addresses create none, and an existing file is never overwritten.
    #[test]
    fn server_traces_wait_for_a_validated_address() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("kuai-qlog-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let odcid = ConnectionId::new(&[0xab; 8]);
        let files = || std::fs::read_dir(&dir).map_or(0, |d| d.count());
        for _ in 0..3 {
            let mut w = QlogWriter::create(&dir, &odcid, Side::Server, Instant::now()).unwrap();
            for _ in 0..10_000 {
                received(&mut w, PacketKind::Initial);
            }
        }
        assert_eq!(files(), 0, "spoofed Initials created trace files");
        for n in 1..=2 {
            let mut w = QlogWriter::create(&dir, &odcid, Side::Server, Instant::now()).unwrap();
            received(&mut w, PacketKind::Initial);
            received(&mut w, PacketKind::Handshake);
            received(&mut w, PacketKind::OneRtt);
            drop(w);
            assert_eq!(files(), n);
        }
        let first = std::fs::read_to_string(dir.join(format!("{odcid}_server.sqlog"))).unwrap();
        assert_eq!(first.matches("quic:packet_received").count(), 3, "{first}");
        assert!(dir.join(format!("{odcid}_server_1.sqlog")).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
