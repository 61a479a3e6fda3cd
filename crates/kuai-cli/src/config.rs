//! `kuai server --config FILE`: what flags cannot say, in TOML — several hosts by name
//! (SNI) with certificates of their own, path-prefix routes to upstream pools or
//! directories, limits and timeouts. docs/gateway.md has an example.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kuai_http::metrics::Metrics;
use kuai_http::proxy::{Balance, HealthCheck, Proxy, Upstream};
use kuai_http::{Certificates, Limits, Router, ServeDir};
use serde::Deserialize;

use crate::server::Timeout;
use crate::tls::Identity;

/// The file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// UDP and TCP address (the flag's when absent).
    pub listen: Option<SocketAddr>,
    /// Prometheus address (`--metrics` when absent).
    pub metrics: Option<SocketAddr>,
    /// QUIC workers (`--workers` when absent).
    pub workers: Option<usize>,
    /// Limits; each absent one is the flag's.
    #[serde(default)]
    pub limits: LimitsFile,
    /// The sites.
    #[serde(rename = "host", default)]
    pub hosts: Vec<HostFile>,
}

/// `[limits]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    handshake_timeout: Option<Timeout>,
    header_timeout: Option<Timeout>,
    idle_timeout: Option<Timeout>,
    send_timeout: Option<Timeout>,
    drain_timeout: Option<Timeout>,
    h2_max_streams: Option<u32>,
    max_header_size: Option<usize>,
    max_body: Option<u64>,
    /// Bytes the TCP connections may be granted together (HTTP/2 windows, response
    /// buffers); past it new ones get small windows.
    tcp_memory_budget: Option<u64>,
    /// Bytes the QUIC connections may hold on their peers' behalf (kuai_proto's
    /// `MemoryBudget`): past it windows shrink, past one and a half times it the
    /// connections holding most are closed.
    quic_memory_budget: Option<u64>,
}

/// `[[host]]`: a site.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFile {
    /// Its names (`*.example.com` for a wildcard), for SNI and for the request's host.
    names: Vec<String>,
    /// Requests for no host named anywhere go here (the first host when none says so).
    #[serde(default)]
    default: bool,
    /// Certificate chain (PEM); every host has one, or none has (a self-signed one is made
    /// at start for all names).
    cert: Option<PathBuf>,
    /// Its private key (PEM).
    key: Option<PathBuf>,
    /// The routes, longest prefix first whatever their order here.
    #[serde(rename = "route", default)]
    routes: Vec<RouteFile>,
}

/// `[[host.route]]`: a path prefix and what serves it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteFile {
    prefix: String,
    /// Backends (`http://` or `h2c://`), or...
    #[serde(default)]
    upstreams: Vec<String>,
    /// ...a directory of files.
    root: Option<PathBuf>,
    #[serde(default)]
    strip_prefix: bool,
    balance: Option<String>,
    health_check: Option<String>,
    health_interval: Option<Timeout>,
    connect_timeout: Option<Timeout>,
    response_timeout: Option<Timeout>,
    max_connections: Option<usize>,
    /// Request fields with `_` in their names go to the backends (nginx's
    /// `underscores_in_headers`); dropped by default.
    #[serde(default)]
    underscores_in_headers: bool,
}

impl<'de> Deserialize<'de> for Timeout {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl File {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let f: File = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        f.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(f)
    }

    fn check(&self) -> Result<(), String> {
        if self.hosts.is_empty() {
            return Err("no [[host]]".into());
        }
        if self.hosts.iter().filter(|h| h.default).count() > 1 {
            return Err("more than one default host".into());
        }
        let with_cert = self.hosts.iter().filter(|h| h.cert.is_some()).count();
        if with_cert != 0 && with_cert != self.hosts.len() {
            return Err("some hosts have a certificate and some not: give every host one".into());
        }
        for h in &self.hosts {
            let who = h.names.first().map_or("(no name)", String::as_str);
            if h.names.is_empty() || h.names.iter().any(|n| n.is_empty()) {
                return Err("a host needs names".into());
            }
            if h.cert.is_some() != h.key.is_some() {
                return Err(format!("host {who}: cert and key go together"));
            }
            if h.routes.is_empty() {
                return Err(format!("host {who}: no [[host.route]]"));
            }
            for r in &h.routes {
                if !r.prefix.starts_with('/') {
                    return Err(format!(
                        "host {who}: prefix {:?} must start with /",
                        r.prefix
                    ));
                }
                match (r.upstreams.is_empty(), &r.root) {
                    (false, None) => {
                        for u in &r.upstreams {
                            u.parse::<Upstream>()
                                .map_err(|e| format!("host {who}: {e}"))?;
                        }
                    }
                    (true, Some(d)) if d.is_dir() => {}
                    (true, Some(d)) => {
                        return Err(format!("host {who}: {} is not a directory", d.display()));
                    }
                    _ => {
                        return Err(format!(
                            "host {who}, prefix {}: give upstreams or a root (one of them)",
                            r.prefix
                        ));
                    }
                }
                if let Some(b) = &r.balance {
                    b.parse::<Balance>()
                        .map_err(|e| format!("host {who}: {e}"))?;
                }
            }
        }
        Ok(())
    }

    /// The QUIC endpoint's memory budget, if the file sets one.
    pub fn quic_memory_budget(&self) -> Option<u64> {
        self.limits.quic_memory_budget
    }

    /// `base` with the file's limits over it.
    pub fn limits(&self, mut base: Limits) -> Limits {
        let l = &self.limits;
        if let Some(v) = l.max_connections {
            base.max_connections = v;
        }
        if let Some(v) = l.max_connections_per_address {
            base.max_connections_per_address = v;
        }
        if let Some(v) = l.handshake_timeout {
            base.handshake_timeout = v.0;
        }
        if let Some(v) = l.header_timeout {
            base.header_timeout = v.0;
        }
        if let Some(v) = l.idle_timeout {
            base.idle_timeout = v.0;
        }
        if let Some(v) = l.send_timeout {
            base.send_timeout = v.0;
        }
        if let Some(v) = l.drain_timeout {
            base.drain_timeout = v.0;
        }
        if let Some(v) = l.h2_max_streams {
            base.h2_max_concurrent_streams = v;
        }
        if let Some(v) = l.max_header_size {
            base.max_header_size = v;
        }
        if l.max_body.is_some() {
            base.max_request_body = l.max_body;
        }
        if let Some(v) = l.tcp_memory_budget {
            base.tcp_memory_budget = v;
        }
        base
    }

    /// The TLS configuration: each host's certificate by SNI (the default host's for
    /// clients that name none, or another name), or one self-signed certificate for every
    /// name when the file gives none (its SPKI hash comes back, for Chromium).
    pub fn tls(&self) -> Result<(rustls::ServerConfig, Option<Identity>), String> {
        if self.hosts.iter().all(|h| h.cert.is_none()) {
            let mut names: Vec<&str> = self
                .hosts
                .iter()
                .flat_map(|h| h.names.iter().map(String::as_str))
                .collect();
            names.extend(["localhost", "127.0.0.1", "::1"]);
            let id = Identity::self_signed(&names)?;
            let tls = kuai_http::server_tls(id.certs.clone(), id.key.clone_key())
                .map_err(|e| e.to_string())?;
            return Ok((tls, Some(id)));
        }
        let mut certs = Certificates::new();
        let default = self.default_index();
        for (i, h) in self.hosts.iter().enumerate() {
            let (Some(c), Some(k)) = (&h.cert, &h.key) else {
                unreachable!("checked: every host has both");
            };
            let id = Identity::load(c, k)?;
            for n in &h.names {
                certs
                    .add(n, id.certs.clone(), id.key.clone_key())
                    .map_err(|e| format!("{}: {e}", c.display()))?;
            }
            if i == default {
                certs
                    .default_certificate(id.certs.clone(), id.key.clone_key())
                    .map_err(|e| format!("{}: {e}", c.display()))?;
            }
        }
        let tls = certs.into_tls().map_err(|e| e.to_string())?;
        Ok((tls, None))
    }

    fn default_index(&self) -> usize {
        self.hosts.iter().position(|h| h.default).unwrap_or(0)
    }

    /// The router: every host's routes, each an upstream pool or a directory.
    pub fn router(
        &self,
        metrics: Option<&Arc<Metrics>>,
        proxies: &[std::net::IpAddr],
    ) -> Result<Router, String> {
        let mut router = Router::new();
        for h in &self.hosts {
            let names: Vec<&str> = h.names.iter().map(String::as_str).collect();
            for r in &h.routes {
                router = if let Some(root) = &r.root {
                    router.route(&names, &r.prefix, ServeDir::new(root))
                } else {
                    router.route(&names, &r.prefix, r.proxy(metrics, proxies)?)
                }
                .strip_prefix(r.strip_prefix);
            }
        }
        Ok(router.default_host(&self.hosts[self.default_index()].names[0]))
    }

    /// What the server prints of its sites.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        for h in &self.hosts {
            for r in &h.routes {
                let what = match &r.root {
                    Some(d) => format!("files in {}", d.display()),
                    None => format!("upstreams {}", r.upstreams.join(", ")),
                };
                out.push(format!("{}{}: {what}", h.names.join(" "), r.prefix));
            }
        }
        out
    }
}

impl RouteFile {
    fn proxy(
        &self,
        metrics: Option<&Arc<Metrics>>,
        proxies: &[std::net::IpAddr],
    ) -> Result<Proxy, String> {
        let mut upstreams = Vec::new();
        for u in &self.upstreams {
            upstreams.push(u.parse().map_err(|e: kuai_http::Error| e.to_string())?);
        }
        let balance = match &self.balance {
            Some(b) => b.parse().map_err(|e: kuai_http::Error| e.to_string())?,
            None => Balance::default(),
        };
        Pool {
            upstreams: &upstreams,
            balance,
            connect_timeout: self.connect_timeout,
            response_timeout: self.response_timeout,
            health_check: self.health_check.as_deref(),
            health_interval: self.health_interval,
            max_connections: self.max_connections,
            proxies,
            underscores_in_headers: self.underscores_in_headers,
        }
        .proxy(metrics)
    }
}

/// An upstream pool as flags or the file describe it.
pub struct Pool<'a> {
    pub upstreams: &'a [Upstream],
    pub balance: Balance,
    pub connect_timeout: Option<Timeout>,
    pub response_timeout: Option<Timeout>,
    pub health_check: Option<&'a str>,
    pub health_interval: Option<Timeout>,
    pub max_connections: Option<usize>,
    /// Full proxies in front (`--proxy`).
    pub proxies: &'a [std::net::IpAddr],
    /// Request fields with `_` in their names are forwarded.
    pub underscores_in_headers: bool,
}

impl Pool<'_> {
    /// The proxy to it.
    pub fn proxy(&self, metrics: Option<&Arc<Metrics>>) -> Result<Proxy, String> {
        let mut b = Proxy::builder()
            .balance(self.balance)
            .proxies(self.proxies.to_vec())
            .underscores_in_headers(self.underscores_in_headers);
        for u in self.upstreams {
            b = b.upstream(u.clone());
        }
        if let Some(t) = self.connect_timeout {
            b = b.connect_timeout(t.0);
        }
        if let Some(t) = self.response_timeout {
            b = b.response_timeout(t.0);
        }
        if let Some(n) = self.max_connections {
            if n == 0 {
                return Err("max_connections: at least 1".into());
            }
            b = b.max_connections_per_backend(n);
        }
        if let Some(path) = self.health_check {
            if !path.starts_with('/') {
                return Err(format!("health check {path:?}: a path starting with /"));
            }
            let mut h = HealthCheck::new(path);
            if let Some(i) = self.health_interval {
                h.interval = i.0;
                h.timeout = h.timeout.min(i.0);
            }
            b = b.health_check(h);
        }
        if let Some(m) = metrics {
            b = b.metrics(m.clone());
        }
        b.build().map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_checked() {
        let ok = r#"
            listen = "127.0.0.1:4433"
            [limits]
            idle_timeout = "30s"
            max_body = 1000
            tcp_memory_budget = 268435456
            quic_memory_budget = 536870912
            [[host]]
            names = ["a.example", "*.a.example"]
            [[host.route]]
            prefix = "/api/"
            upstreams = ["http://127.0.0.1:8080", "h2c://127.0.0.1:8081"]
            balance = "least-outstanding"
            max_connections = 64
            strip_prefix = true
            [[host.route]]
            prefix = "/"
            root = "/"
        "#;
        let f: File = toml::from_str(ok).unwrap();
        f.check().unwrap();
        let l = f.limits(Limits::default());
        assert_eq!(l.idle_timeout, std::time::Duration::from_secs(30));
        assert_eq!(l.max_request_body, Some(1000));
        assert_eq!(l.tcp_memory_budget, 256 << 20);
        assert_eq!(f.quic_memory_budget(), Some(512 << 20));
        for (bad, why) in [
            ("[[host]]\nnames = [\"a\"]\nroutes = []", "unknown field"),
            (
                "[[host]]\nnames = [\"a\"]\n[[host.route]]\nprefix = \"x\"\nroot = \"/\"",
                "must start with /",
            ),
            (
                "[[host]]\nnames = [\"a\"]\n[[host.route]]\nprefix = \"/\"",
                "give upstreams or a root",
            ),
            (
                "[[host]]\nnames = [\"a\"]\n[[host.route]]\nprefix = \"/\"\nupstreams = [\"ftp://x\"]",
                "http://HOST:PORT",
            ),
            (
                "[[host]]\nnames = [\"a\"]\ncert = \"/x\"\n[[host.route]]\nprefix = \"/\"\nroot = \"/\"",
                "go together",
            ),
            (
                "[limits]\nidle_timeout = \"soon\"\n[[host]]\nnames = [\"a\"]",
                "not a duration",
            ),
        ] {
            let e = toml::from_str::<File>(bad)
                .map_err(|e| e.to_string())
                .and_then(|f| f.check());
            let e = e.expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
