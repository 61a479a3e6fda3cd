//! Operational statistics (seed 000 §10) in the Prometheus text format: QUIC handshakes and
//! their duration, 0-RTT and resumption, connections by version, cipher suite and ALPN, RTT,
//! congestion window and loss at close, migrations, the endpoint's stateless answers and
//! drops; HTTP requests by protocol and status; a gateway's upstream latency and errors per
//! backend.
//!
//! One [`Metrics`] gathers them from three places:
//! - the QUIC endpoint: [`Metrics::subscriber`] is a [`kuai::kuai_proto::trace::Subscriber`]
//!   (it asks for no per-packet event: the packet path pays nothing for it);
//! - the [`Server`](crate::Server): [`Server::metrics`](crate::Server::metrics);
//! - the [`Proxy`](crate::Proxy): [`ProxyBuilder::metrics`](crate::proxy::ProxyBuilder::metrics).
//!
//! [`Metrics::render`] writes the text format (version 0.0.4); [`Metrics::serve`] answers
//! `GET /metrics` on a TCP listener. Units are the base ones (seconds, bytes, ratios),
//! counters end in `_total`, and no label names a connection.
//!
//! ```
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let metrics = kuai_http::metrics::Metrics::new();
//! let endpoint = kuai::Endpoint::builder()
//!     .subscriber(metrics.subscriber())
//!     .bind("127.0.0.1:0".parse()?)?;
//! let text = metrics.render();
//! assert!(text.contains("# TYPE kuai_quic_handshakes_total counter"));
//! # drop(endpoint);
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use kuai::kuai_proto::trace::{
    ConnectionMeta, EndpointDropReason, EndpointTraceEvent, Subscriber, TraceEvent,
};

use crate::Protocol;

/// Latency buckets, in seconds: 1 ms to 10 s.
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Congestion-window buckets, in bytes: 4 KiB to 64 MiB.
const BYTES: &[f64] = &[
    4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0,
];
/// Loss-ratio buckets.
const RATIO: &[f64] = &[0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5];
/// Streams-at-once buckets.
const COUNT: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// A histogram with fixed buckets; every operation is a few atomic adds.
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last is +Inf.
    counts: Box<[AtomicU64]>,
    count: AtomicU64,
    sum: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        let _ = self.sum.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = match self.bounds.get(i) {
                Some(b) => format!("{b}"),
                None => "+Inf".into(),
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let sum = f64::from_bits(self.sum.load(Relaxed));
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        // The count is the +Inf bucket as rendered: an observation landing during the
        // render would otherwise make the two disagree.
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// Scrapers served at once by [`Metrics::serve`].
const METRICS_CONNECTIONS: usize = 16;
/// How long a scraper has to send its request (and twice that for the whole exchange).
const METRICS_TIMEOUT: Duration = Duration::from_secs(10);

/// Counters keyed by label values, for label sets that are few and known only at run time
/// (versions, cipher suites, ALPNs); updated per connection, not per packet.
#[derive(Default)]
struct Labeled(Mutex<BTreeMap<Vec<String>, u64>>);

impl Labeled {
    fn add(&self, key: &[&str]) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Most calls find the key: no allocation then.
        if let Some((_, v)) = m.iter_mut().find(|(k, _)| k.iter().eq(key.iter())) {
            *v += 1;
        } else {
            m.insert(key.iter().map(|s| (*s).to_owned()).collect(), 1);
        }
    }

    fn render(&self, out: &mut String, name: &str, labels: &[&str]) {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (values, n) in m.iter() {
            let l: Vec<String> = labels
                .iter()
                .zip(values)
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {n}", l.join(","));
        }
    }
}

/// Counters with one label whose values are static names (drop reasons), counted per
/// packet: found by a scan of a few slots without a lock (the [`Labeled`] map takes one
/// process-wide, which a flood of junk datagrams would make every worker queue on).
struct ByReason {
    slots: [(std::sync::OnceLock<&'static str>, AtomicU64); REASON_SLOTS],
}

/// Distinct reasons a [`ByReason`] holds (kuai-proto names about ten of each kind); more
/// are not counted.
const REASON_SLOTS: usize = 32;

impl Default for ByReason {
    fn default() -> Self {
        Self {
            slots: std::array::from_fn(|_| (std::sync::OnceLock::new(), AtomicU64::new(0))),
        }
    }
}

impl ByReason {
    fn add(&self, reason: &'static str) {
        for (name, n) in &self.slots {
            // Claims a free slot, or finds the one another thread claimed for it.
            if *name.get_or_init(|| reason) == reason {
                n.fetch_add(1, Relaxed);
                return;
            }
        }
    }

    fn render(&self, out: &mut String, name: &str, label: &str) {
        let mut all: Vec<(&str, u64)> = self
            .slots
            .iter()
            .filter_map(|(r, n)| r.get().map(|r| (*r, n.load(Relaxed))))
            .collect();
        all.sort_unstable();
        for (r, n) in all {
            let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {n}", escape(r));
        }
    }
}

/// A label value as the text format wants it (RFC-less, but Prometheus's rules: backslash,
/// double quote and line feed escaped).
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// What the QUIC endpoint reports.
struct Quic {
    open: AtomicI64,
    handshakes_ok: AtomicU64,
    handshakes_failed: AtomicU64,
    handshakes_timeout: AtomicU64,
    handshake_seconds: Histogram,
    zero_rtt_attempted: AtomicU64,
    zero_rtt_accepted: AtomicU64,
    zero_rtt_rejected: AtomicU64,
    resumptions: AtomicU64,
    by_kind: Labeled,
    rtt: Histogram,
    cwnd: Histogram,
    loss: Histogram,
    streams: Histogram,
    migrations: AtomicU64,
    retries: AtomicU64,
    version_negotiations: AtomicU64,
    resets: AtomicU64,
    refused: AtomicU64,
    replays_refused: AtomicU64,
    closed_over_budget: AtomicU64,
    invalid_tokens: AtomicU64,
    dropped: ByReason,
    packets_dropped: ByReason,
}

/// HTTP requests by protocol (index) and status (100-599).
struct Http {
    requests: Box<[AtomicU64]>,
    in_flight: AtomicI64,
}

const PROTOCOLS: [Protocol; 4] = [
    Protocol::Http3,
    Protocol::Http2,
    Protocol::Http11,
    Protocol::Http09,
];

fn protocol_index(p: Protocol) -> usize {
    match p {
        Protocol::Http3 => 0,
        Protocol::Http2 => 1,
        Protocol::Http11 => 2,
        Protocol::Http09 => 3,
    }
}

/// One backend of a proxy.
pub(crate) struct Upstream {
    name: Arc<str>,
    seconds: Histogram,
    errors_connect: AtomicU64,
    errors_timeout: AtomicU64,
    errors_exchange: AtomicU64,
}

impl Upstream {
    /// A response head came after `d`.
    pub(crate) fn answered(&self, d: Duration) {
        self.seconds.observe(d.as_secs_f64());
    }

    /// An attempt failed: `timeout` (connect or response) or `connect` or else `exchange`.
    pub(crate) fn failed(&self, kind: &str) {
        match kind {
            "timeout" => &self.errors_timeout,
            "connect" => &self.errors_connect,
            _ => &self.errors_exchange,
        }
        .fetch_add(1, Relaxed);
    }
}

/// A server's statistics; see the [module](self) docs.
pub struct Metrics {
    quic: Quic,
    http: Http,
    upstreams: Mutex<Vec<Arc<Upstream>>>,
    start: Instant,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Statistics with every count at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            quic: Quic {
                open: AtomicI64::new(0),
                handshakes_ok: AtomicU64::new(0),
                handshakes_failed: AtomicU64::new(0),
                handshakes_timeout: AtomicU64::new(0),
                handshake_seconds: Histogram::new(SECONDS),
                zero_rtt_attempted: AtomicU64::new(0),
                zero_rtt_accepted: AtomicU64::new(0),
                zero_rtt_rejected: AtomicU64::new(0),
                resumptions: AtomicU64::new(0),
                by_kind: Labeled::default(),
                rtt: Histogram::new(SECONDS),
                cwnd: Histogram::new(BYTES),
                loss: Histogram::new(RATIO),
                streams: Histogram::new(COUNT),
                migrations: AtomicU64::new(0),
                retries: AtomicU64::new(0),
                version_negotiations: AtomicU64::new(0),
                resets: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                replays_refused: AtomicU64::new(0),
                closed_over_budget: AtomicU64::new(0),
                invalid_tokens: AtomicU64::new(0),
                dropped: ByReason::default(),
                packets_dropped: ByReason::default(),
            },
            http: Http {
                requests: (0..PROTOCOLS.len() * 500)
                    .map(|_| AtomicU64::new(0))
                    .collect(),
                in_flight: AtomicI64::new(0),
            },
            upstreams: Mutex::new(Vec::new()),
            start: Instant::now(),
        })
    }

    /// The QUIC endpoint's subscriber feeding these statistics (register it with
    /// `kuai::EndpointBuilder::subscriber`).
    pub fn subscriber(self: &Arc<Self>) -> MetricsSubscriber {
        MetricsSubscriber(self.clone())
    }

    /// A request began.
    pub(crate) fn request_started(&self) {
        self.http.in_flight.fetch_add(1, Relaxed);
    }

    /// A request ended with `status` (0: no response was sent).
    pub(crate) fn request_ended(&self, protocol: Protocol, status: u16) {
        self.http.in_flight.fetch_sub(1, Relaxed);
        if (100..600).contains(&status) {
            let i = protocol_index(protocol) * 500 + usize::from(status - 100);
            self.http.requests[i].fetch_add(1, Relaxed);
        }
    }

    /// Registers a proxy's backend (one entry per name: proxies sharing a backend share
    /// its series).
    pub(crate) fn upstream(&self, name: Arc<str>) -> Arc<Upstream> {
        let mut list = self.upstreams.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(u) = list.iter().find(|u| u.name == name) {
            return u.clone();
        }
        let u = Arc::new(Upstream {
            name,
            seconds: Histogram::new(SECONDS),
            errors_connect: AtomicU64::new(0),
            errors_timeout: AtomicU64::new(0),
            errors_exchange: AtomicU64::new(0),
        });
        list.push(u.clone());
        u
    }

    /// The statistics in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut o = String::with_capacity(16 * 1024);
        let q = &self.quic;
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let one = |o: &mut String, name: &str, kind: &str, help: &str, v: String| {
            head(o, name, kind, help);
            let _ = writeln!(o, "{name} {v}");
        };
        one(
            &mut o,
            "kuai_quic_connections_open",
            "gauge",
            "QUIC connections open now (handshaking ones included).",
            q.open.load(Relaxed).to_string(),
        );
        head(
            &mut o,
            "kuai_quic_handshakes_total",
            "counter",
            "QUIC handshakes by result (ok; timeout or failed: the connection ended first).",
        );
        for (r, v) in [
            ("ok", &q.handshakes_ok),
            ("failed", &q.handshakes_failed),
            ("timeout", &q.handshakes_timeout),
        ] {
            let _ = writeln!(
                o,
                "kuai_quic_handshakes_total{{result=\"{r}\"}} {}",
                v.load(Relaxed)
            );
        }
        head(
            &mut o,
            "kuai_quic_handshake_duration_seconds",
            "histogram",
            "Time from a connection's start to its completed handshake.",
        );
        q.handshake_seconds
            .render(&mut o, "kuai_quic_handshake_duration_seconds", "");
        for (name, help, v) in [
            (
                "kuai_quic_zero_rtt_attempted_total",
                "Handshakes in which the client sent 0-RTT data.",
                &q.zero_rtt_attempted,
            ),
            (
                "kuai_quic_zero_rtt_accepted_total",
                "Handshakes whose 0-RTT data was accepted.",
                &q.zero_rtt_accepted,
            ),
            (
                "kuai_quic_zero_rtt_rejected_total",
                "Handshakes whose 0-RTT data was rejected.",
                &q.zero_rtt_rejected,
            ),
            (
                "kuai_quic_resumptions_total",
                "Handshakes that resumed a TLS session.",
                &q.resumptions,
            ),
            (
                "kuai_quic_migrations_total",
                "Path migrations (the client's, or seen from the peer).",
                &q.migrations,
            ),
            (
                "kuai_quic_retry_sent_total",
                "Retry packets sent.",
                &q.retries,
            ),
            (
                "kuai_quic_version_negotiation_sent_total",
                "Version Negotiation packets sent.",
                &q.version_negotiations,
            ),
            (
                "kuai_quic_stateless_resets_sent_total",
                "Stateless resets sent.",
                &q.resets,
            ),
            (
                "kuai_quic_connections_refused_total",
                "Connection attempts refused at a limit.",
                &q.refused,
            ),
            (
                "kuai_quic_zero_rtt_replays_refused_total",
                "Connections refused because their 0-RTT ticket had been used before (a fleet's replay guard).",
                &q.replays_refused,
            ),
            (
                "kuai_quic_connections_closed_over_budget_total",
                "Connections closed because the memory budget was past its hard limit and they held more than their share.",
                &q.closed_over_budget,
            ),
            (
                "kuai_quic_invalid_tokens_total",
                "Address-validation tokens that did not check out.",
                &q.invalid_tokens,
            ),
        ] {
            one(&mut o, name, "counter", help, v.load(Relaxed).to_string());
        }
        head(
            &mut o,
            "kuai_quic_connections_total",
            "counter",
            "Completed handshakes by QUIC version, TLS cipher suite and ALPN.",
        );
        q.by_kind.render(
            &mut o,
            "kuai_quic_connections_total",
            &["version", "cipher_suite", "alpn"],
        );
        for (name, help, h) in [
            (
                "kuai_quic_rtt_seconds",
                "Smoothed RTT of established connections, sampled at close.",
                &q.rtt,
            ),
            (
                "kuai_quic_congestion_window_bytes",
                "Congestion window of established connections, sampled at close.",
                &q.cwnd,
            ),
            (
                "kuai_quic_loss_ratio",
                "Share of packets declared lost, per established connection at close.",
                &q.loss,
            ),
            (
                "kuai_quic_concurrent_streams",
                "Most streams open at once, per established connection at close.",
                &q.streams,
            ),
        ] {
            head(&mut o, name, "histogram", help);
            h.render(&mut o, name, "");
        }
        head(
            &mut o,
            "kuai_quic_datagrams_dropped_total",
            "counter",
            "Datagrams the endpoint dropped before any connection saw them, by reason.",
        );
        q.dropped
            .render(&mut o, "kuai_quic_datagrams_dropped_total", "reason");
        head(
            &mut o,
            "kuai_quic_packets_dropped_total",
            "counter",
            "Packets connections dropped, by reason.",
        );
        q.packets_dropped
            .render(&mut o, "kuai_quic_packets_dropped_total", "reason");

        one(
            &mut o,
            "kuai_http_requests_in_flight",
            "gauge",
            "HTTP requests being answered now.",
            self.http.in_flight.load(Relaxed).to_string(),
        );
        head(
            &mut o,
            "kuai_http_requests_total",
            "counter",
            "HTTP requests answered, by protocol and status.",
        );
        for (pi, p) in PROTOCOLS.iter().enumerate() {
            for s in 0..500 {
                let n = self.http.requests[pi * 500 + s].load(Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        o,
                        "kuai_http_requests_total{{protocol=\"{}\",status=\"{}\"}} {n}",
                        p.alpn(),
                        s + 100
                    );
                }
            }
        }
        let ups = self
            .upstreams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        head(
            &mut o,
            "kuai_upstream_response_seconds",
            "histogram",
            "Time from sending a request to a backend to its response head.",
        );
        for u in &ups {
            let l = format!("backend=\"{}\"", escape(&u.name));
            u.seconds
                .render(&mut o, "kuai_upstream_response_seconds", &l);
        }
        head(
            &mut o,
            "kuai_upstream_errors_total",
            "counter",
            "Requests to a backend that failed, by kind (connect, timeout, exchange).",
        );
        for u in &ups {
            for (k, v) in [
                ("connect", &u.errors_connect),
                ("timeout", &u.errors_timeout),
                ("exchange", &u.errors_exchange),
            ] {
                let _ = writeln!(
                    o,
                    "kuai_upstream_errors_total{{backend=\"{}\",kind=\"{k}\"}} {}",
                    escape(&u.name),
                    v.load(Relaxed)
                );
            }
        }
        one(
            &mut o,
            "kuai_uptime_seconds",
            "gauge",
            "Time since these statistics began.",
            format!("{:.3}", self.start.elapsed().as_secs_f64()),
        );
        o
    }

    /// Answers `GET /metrics` (the text format) on `listener` until the task is dropped;
    /// other paths get 404. At most 16 scrapers at once (more wait to be accepted), each
    /// with 10 s to send its request and one request per connection; an accept error (out of descriptors) is logged and the loop goes on.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let slots = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return Ok(());
            };
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed; trying again in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let m = self.clone();
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let m = m.clone();
                async move { Ok::<_, Infallible>(m.answer(&req)) }
            });
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(METRICS_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
                // A scraper that stops reading its answer: the same bound, whole.
                let _ = tokio::time::timeout(METRICS_TIMEOUT * 2, conn).await;
                drop(slot);
            });
        }
    }

    fn answer<B>(&self, req: &Request<B>) -> Response<http_body_util::Full<Bytes>> {
        let (status, body, ty) = if req.uri().path() == "/metrics" {
            (
                StatusCode::OK,
                self.render(),
                "text/plain; version=0.0.4; charset=utf-8",
            )
        } else {
            (
                StatusCode::NOT_FOUND,
                "not found: try /metrics\n".into(),
                "text/plain",
            )
        };
        let mut r = Response::new(http_body_util::Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = http::HeaderValue::from_str(ty) {
            r.headers_mut().insert(header::CONTENT_TYPE, v);
        }
        r
    }
}

/// The QUIC side of [`Metrics`]: a subscriber that asks for no per-packet event.
#[derive(Debug, Clone)]
pub struct MetricsSubscriber(Arc<Metrics>);

/// A connection being counted; it leaves the open-connection gauge when dropped.
pub struct ConnectionCount {
    metrics: Arc<Metrics>,
}

impl Drop for ConnectionCount {
    fn drop(&mut self) {
        self.metrics.quic.open.fetch_sub(1, Relaxed);
    }
}

fn version_name(v: Option<kuai::Version>) -> String {
    match v.map(|v| v.wire()) {
        Some(1) => "1".into(),
        Some(0x6b33_43cf) => "2".into(),
        Some(w) => format!("{w:#010x}"),
        None => "unknown".into(),
    }
}

impl Subscriber for MetricsSubscriber {
    type ConnectionContext = ConnectionCount;

    fn create_connection_context(&self, _: &ConnectionMeta, _: Instant) -> ConnectionCount {
        self.0.quic.open.fetch_add(1, Relaxed);
        ConnectionCount {
            metrics: self.0.clone(),
        }
    }

    fn on_connection_event(&self, _: &mut ConnectionCount, _: Instant, event: &TraceEvent<'_>) {
        let q = &self.0.quic;
        match event {
            TraceEvent::HandshakeCompleted { stats } => {
                q.handshakes_ok.fetch_add(1, Relaxed);
                if let Some(d) = stats.handshake_duration {
                    q.handshake_seconds.observe(d.as_secs_f64());
                }
                if stats.zero_rtt_attempted {
                    q.zero_rtt_attempted.fetch_add(1, Relaxed);
                    if stats.zero_rtt_accepted {
                        q.zero_rtt_accepted.fetch_add(1, Relaxed);
                    } else {
                        q.zero_rtt_rejected.fetch_add(1, Relaxed);
                    }
                }
                if stats.resumed {
                    q.resumptions.fetch_add(1, Relaxed);
                }
                let alpn = stats
                    .alpn
                    .as_deref()
                    .map_or_else(|| "none".into(), String::from_utf8_lossy);
                q.by_kind.add(&[
                    &version_name(stats.version),
                    stats.cipher_suite.unwrap_or("unknown"),
                    &alpn,
                ]);
            }
            TraceEvent::ConnectionClosed {
                stats,
                error,
                established,
            } => {
                if !established {
                    if matches!(error, Some(kuai::ConnectionError::TimedOut)) {
                        q.handshakes_timeout.fetch_add(1, Relaxed);
                    } else {
                        q.handshakes_failed.fetch_add(1, Relaxed);
                    }
                    return;
                }
                q.rtt.observe(stats.path.rtt.as_secs_f64());
                q.cwnd.observe(stats.path.cwnd as f64);
                q.loss
                    .observe(stats.packets_lost as f64 / stats.packets_sent.max(1) as f64);
                q.streams.observe(stats.max_concurrent_streams as f64);
            }
            TraceEvent::PathUpdated { event, .. }
                if *event == "client_migration" || *event == "peer_migration" =>
            {
                q.migrations.fetch_add(1, Relaxed);
            }
            TraceEvent::PacketDropped { reason, .. } => q.packets_dropped.add(reason.name()),
            _ => {}
        }
    }

    fn on_endpoint_event(&self, _: Instant, event: &EndpointTraceEvent) {
        let q = &self.0.quic;
        match event {
            EndpointTraceEvent::RetrySent { .. } => q.retries.fetch_add(1, Relaxed),
            EndpointTraceEvent::VersionNegotiationSent { .. } => {
                q.version_negotiations.fetch_add(1, Relaxed)
            }
            EndpointTraceEvent::StatelessResetSent { .. } => q.resets.fetch_add(1, Relaxed),
            EndpointTraceEvent::ConnectionRefused { .. } => q.refused.fetch_add(1, Relaxed),
            EndpointTraceEvent::ZeroRttReplayRefused { .. } => {
                q.replays_refused.fetch_add(1, Relaxed)
            }
            EndpointTraceEvent::InvalidToken { .. } => q.invalid_tokens.fetch_add(1, Relaxed),
            EndpointTraceEvent::ClosedOverBudget { .. } => {
                q.closed_over_budget.fetch_add(1, Relaxed)
            }
            EndpointTraceEvent::DatagramDropped { reason, .. } => {
                q.dropped.add(drop_name(*reason));
                0
            }
            _ => 0,
        };
    }

    fn per_packet_events(&self) -> bool {
        false
    }
}

fn drop_name(r: EndpointDropReason) -> &'static str {
    r.name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connection that sends no request is closed after the timeout (it held a task and a
    /// descriptor for good), and a scrape is answered beside it.
    #[tokio::test]
    async fn an_idle_scraper_is_let_go() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(Metrics::new().serve(listener));
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut scrape = tokio::net::TcpStream::connect(addr).await.unwrap();
        scrape
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        // One request per connection: closed once answered.
        tokio::time::timeout(Duration::from_secs(5), scrape.read_to_end(&mut got))
            .await
            .expect("the scrape is answered and closed")
            .unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("kuai_uptime_seconds"), "{text}");
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(METRICS_TIMEOUT * 2, idle.read(&mut buf))
            .await
            .expect("the idle connection is closed within the timeout");
        // Closed, or answered 408 and closed (hyper's choice).
        assert!(n.is_ok());
    }

    /// Per-reason counters from several threads at once: every add counted under its name.
    #[test]
    fn reasons_are_counted_without_a_lock() {
        let r = Arc::new(ByReason::default());
        let names = ["malformed", "unknown_connection", "unexpected"];
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..3000 {
                        r.add(names[(i + t) % 3]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut out = String::new();
        r.render(&mut out, "d", "reason");
        assert_eq!(
            out,
            "d{reason=\"malformed\"} 4000\nd{reason=\"unexpected\"} 4000\nd{reason=\"unknown_connection\"} 4000\n"
        );
    }

    /// A histogram's count is its +Inf bucket.
    #[test]
    fn a_histograms_count_is_its_last_bucket() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 3.0, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count 4\n"), "{out}");
        assert!(out.contains("x_sum 8\n"), "{out}");
    }
}
