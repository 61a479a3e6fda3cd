//! qlog output: a [`Tracer`] writing the connection's events as JSON text sequences
//! (`.sqlog`, RFC 7464 records; the qlog main schema's JSON-SEQ format), readable by qvis.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kuai_proto::trace::{TraceEvent, Tracer};
use kuai_proto::{ConnectionId, Side};

/// Writes one connection's trace to a file.
pub struct QlogWriter {
    out: BufWriter<File>,
    start: Instant,
    line: String,
}

impl QlogWriter {
    /// Creates `<dir>/<odcid>_<client|server>.sqlog` and writes the qlog header.
    pub fn create(
        dir: &Path,
        odcid: &ConnectionId,
        side: Side,
        start: Instant,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let role = if side.is_client() { "client" } else { "server" };
        let path = dir.join(format!("{odcid}_{role}.sqlog"));
        let mut out = BufWriter::new(File::create(path)?);
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        writeln!(
            out,
            "\u{1e}{{\"qlog_version\":\"0.4\",\"qlog_format\":\"JSON-SEQ\",\"title\":\"kuai\",\
             \"trace\":{{\"vantage_point\":{{\"name\":\"kuai\",\"type\":\"{role}\"}},\
             \"common_fields\":{{\"ODCID\":\"{odcid}\",\"time_format\":\"relative\",\
             \"reference_time\":{unix_ms:.3}}}}}}}"
        )?;
        Ok(Self {
            out,
            start,
            line: String::with_capacity(256),
        })
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
        }
        l.push_str("}\n");
        let _ = self.out.write_all(l.as_bytes());
    }
}

impl Drop for QlogWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}
