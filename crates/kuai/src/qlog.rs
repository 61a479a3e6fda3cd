//! qlog output: a [`Tracer`] writing the connection's events as JSON text sequences
//! (`.sqlog`, RFC 7464 records; the qlog main schema's JSON-SEQ format), readable by qvis.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kuai_proto::trace::{ConnectionMeta, PacketKind, Subscriber, TraceEvent, Tracer};
use kuai_proto::{ConnectionId, Side};

/// Events a server keeps in memory for a connection whose client has not proved its address
/// yet; later ones are counted, not kept. A handshake's events before that take 2-4 KiB; with
/// 10,000 half-open handshakes (the server's default limit) this is at most 160 MiB.
const PENDING_MAX: usize = 16 * 1024;

/// Writes one connection's trace to a file.
///
/// A server opens the file only once the client has proved its address (a Handshake or
/// 1-RTT packet from it arrived, RFC 9000 §8.1): until then the events wait in memory (16 KiB
/// at most), so Initials from spoofed addresses, which never get that far, create no files.
/// Files are never overwritten: a name in use gets a numbered suffix.
pub struct QlogWriter {
    out: Out,
    start: Instant,
    line: String,
}

enum Out {
    File(BufWriter<File>),
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
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        let mut buf = Vec::with_capacity(512);
        writeln!(
            buf,
            "\u{1e}{{\"qlog_version\":\"0.4\",\"qlog_format\":\"JSON-SEQ\",\"title\":\"kuai\",\
             \"trace\":{{\"vantage_point\":{{\"name\":\"kuai\",\"type\":\"{role}\"}},\
             \"common_fields\":{{\"ODCID\":\"{odcid}\",\"time_format\":\"relative\",\
             \"reference_time\":{unix_ms:.3}}}}}}}"
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
        std::fs::create_dir_all(&dir)?;
        let mut file = None;
        for n in 0..100 {
            let path = if n == 0 {
                dir.join(format!("{name}.sqlog"))
            } else {
                dir.join(format!("{name}_{n}.sqlog"))
            };
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => {
                    file = Some(f);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        let file = file.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, "100 traces of that name")
        })?;
        let mut out = BufWriter::new(file);
        out.write_all(&buf)?;
        if dropped > 0 {
            tracing::debug!(
                dropped,
                "qlog events dropped before the address was validated"
            );
        }
        self.out = Out::File(out);
        Ok(())
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
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
                let _ = write!(
                    l,
                    "\"name\":\"quic:packet_dropped\",\"data\":{{\"header\":{{\"packet_type\":\"{}\"}},\"raw\":{{\"length\":{size}}},\"trigger\":\"{reason:?}\"}}",
                    kind.map_or("unknown", |k| k.qlog_name())
                );
            }
            TraceEvent::PacketLost {
                space,
                pn,
                size,
                trigger,
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"recovery:packet_lost\",\"data\":{{\"header\":{{\"packet_number_space\":\"{space:?}\",\"packet_number\":{pn}}},\"raw\":{{\"length\":{size}}},\"trigger\":\"{trigger}\"}}"
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
                let _ = write!(
                    l,
                    "\"name\":\"recovery:metrics_updated\",\"data\":{{\"min_rtt\":{:.3},\"smoothed_rtt\":{:.3},\"latest_rtt\":{:.3},\"rtt_variance\":{:.3},\"congestion_window\":{cwnd},\"bytes_in_flight\":{bytes_in_flight},\"pacing_rate\":{}",
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
                    "\"name\":\"recovery:congestion_state_updated\",\"data\":{{\"new\":\"{state}\"}}"
                );
            }
            TraceEvent::KeyUpdated {
                trigger,
                generation,
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"security:key_updated\",\"data\":{{\"key_type\":\"1rtt\",\"trigger\":\"{trigger}\",\"key_phase\":{generation}}}"
                );
            }
            TraceEvent::KeyDiscarded { space } => {
                let _ = write!(
                    l,
                    "\"name\":\"security:key_discarded\",\"data\":{{\"key_type\":\"{space:?}\"}}"
                );
            }
            TraceEvent::ParametersSet {
                owner_local,
                summary,
            } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:parameters_set\",\"data\":{{\"owner\":\"{}\",\"kuai_summary\":\"{}\"}}",
                    if *owner_local { "local" } else { "remote" },
                    json_escape(summary)
                );
            }
            TraceEvent::ConnectionStateUpdated { new } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:connection_state_updated\",\"data\":{{\"new\":\"{new}\"}}"
                );
            }
            TraceEvent::PathUpdated { remote, event, .. } => {
                let _ = write!(
                    l,
                    "\"name\":\"quic:path_assigned\",\"data\":{{\"path_remote\":\"{remote}\",\"kuai_event\":\"{event}\"}}"
                );
            }
            TraceEvent::MtuUpdated { mtu, done, .. } => {
                let _ = write!(
                    l,
                    "\"name\":\"recovery:mtu_updated\",\"data\":{{\"new\":{mtu},\"done\":{done}}}"
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
                use kuai_proto::ConnectionError as E;
                let (owner, trigger) = match error {
                    Some(E::TransportError(_) | E::LocallyClosed) => ("local", None),
                    Some(E::PeerTransportError(_) | E::ApplicationClosed { .. }) => {
                        ("remote", None)
                    }
                    Some(E::TimedOut) => ("local", Some("idle_timeout")),
                    Some(E::Reset) => ("remote", Some("stateless_reset")),
                    Some(E::VersionMismatch) => ("local", Some("version_mismatch")),
                    _ => ("local", Some("unspecified")),
                };
                let _ = write!(
                    l,
                    "\"name\":\"quic:connection_closed\",\"data\":{{\"owner\":\"{owner}\""
                );
                match error {
                    Some(E::TransportError(e) | E::PeerTransportError(e)) => {
                        let _ =
                            write!(l, ",\"connection_code\":{},\"trigger\":\"error\"", e.code.0);
                    }
                    Some(E::ApplicationClosed { code, .. }) => {
                        let _ = write!(
                            l,
                            ",\"application_code\":{code},\"trigger\":\"application\""
                        );
                    }
                    Some(E::LocallyClosed) => l.push_str(",\"trigger\":\"application\""),
                    _ => {}
                }
                if let Some(t) = trigger {
                    let _ = write!(l, ",\"trigger\":\"{t}\"");
                }
                l.push('}');
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
            Out::File(f) => {
                let _ = f.write_all(l.as_bytes());
            }
            Out::Pending { buf, dropped, .. } => {
                if buf.len() + l.len() <= PENDING_MAX {
                    buf.extend_from_slice(l.as_bytes());
                } else {
                    *dropped += 1;
                }
                if validated && let Err(e) = self.open() {
                    tracing::warn!(error = %e, "cannot write qlog");
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
        if let Out::File(f) = &mut self.out {
            let _ = f.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A server's trace file appears only once the client proved its address: Initials
    /// from spoofed addresses create none, and an existing file is never overwritten.
    #[test]
    fn server_traces_wait_for_a_validated_address() {
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
