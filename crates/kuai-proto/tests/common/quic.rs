//! QUIC endpoints as simulator nodes, with small applications that fetch and serve patterned
//! data so that every byte delivered can be checked.
#![allow(dead_code)]

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kuai_proto::config::{ClientConfig, EndpointConfig, ServerConfig, TransportConfig};
use kuai_proto::connection::EcnCodepoint;
use kuai_proto::stream::StreamError;
use kuai_proto::{ConnectionHandle, Dir, Endpoint, Event, StreamEvent, StreamId};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::sim::{Network, Node, NodeId};

pub const ALPN: &[u8] = b"kuai-test";

/// An application running on a [`QuicNode`].
pub trait App: Any {
    fn on_event(&mut self, ep: &mut Endpoint, now: Instant, h: ConnectionHandle, ev: &Event);
    /// Called after every network interaction; lets the app push more data.
    fn poll(&mut self, _ep: &mut Endpoint, _now: Instant) {}
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// An endpoint plus an application, as a simulator node.
/// A datagram to send: destination, ECN bits, payload, and the source IP asked for.
type Outgoing = (SocketAddr, Option<u8>, Vec<u8>, Option<std::net::IpAddr>);

pub struct QuicNode {
    pub ep: Endpoint,
    pub app: Box<dyn App>,
    pending: VecDeque<Outgoing>,
    last_src_ip: Option<std::net::IpAddr>,
    buf: Vec<u8>,
    next: Option<Instant>,
    /// Datagrams per poll_transmit (GSO batch size).
    pub gso: usize,
    pub events: Vec<(Instant, ConnectionHandle, Event)>,
}

impl QuicNode {
    pub fn new(ep: Endpoint, app: impl App) -> Self {
        Self {
            ep,
            app: Box::new(app),
            pending: VecDeque::new(),
            last_src_ip: None,
            buf: Vec::new(),
            next: None,
            gso: 10,
            events: Vec::new(),
        }
    }

    pub fn app<T: App>(&self) -> &T {
        self.app.as_any().downcast_ref().expect("app type")
    }

    pub fn app_mut<T: App>(&mut self) -> &mut T {
        self.app.as_any_mut().downcast_mut().expect("app type")
    }

    fn after(&mut self, now: Instant) {
        while let Some((h, ev)) = self.ep.poll_event() {
            self.app.on_event(&mut self.ep, now, h, &ev);
            self.events.push((now, h, ev));
        }
        self.app.poll(&mut self.ep, now);
        while let Some((h, ev)) = self.ep.poll_event() {
            self.app.on_event(&mut self.ep, now, h, &ev);
            self.events.push((now, h, ev));
        }
        self.next = self.ep.poll_timeout();
    }

    pub fn saw(&self, pred: impl Fn(&Event) -> bool) -> bool {
        self.events.iter().any(|(_, _, e)| pred(e))
    }
}

impl Node for QuicNode {
    fn receive(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local: SocketAddr,
        ecn: Option<u8>,
        data: &[u8],
    ) {
        let ecn = ecn.and_then(EcnCodepoint::from_bits);
        self.ep
            .handle_datagram(now, remote, Some(local.ip()), ecn, BytesMut::from(data));
        self.after(now);
    }

    fn transmit(&mut self, now: Instant) -> Option<(SocketAddr, Option<u8>, Vec<u8>)> {
        if self.pending.is_empty() {
            self.app.poll(&mut self.ep, now);
            if let Some(t) = self.ep.poll_transmit(now, self.gso, &mut self.buf) {
                let seg = t.segment_size.unwrap_or(t.size);
                let ecn = t.ecn.map(|e| e as u8);
                for chunk in self.buf[..t.size].chunks(seg) {
                    self.pending
                        .push_back((t.destination, ecn, chunk.to_vec(), t.src_ip));
                }
            }
            self.after(now);
        }
        let (to, ecn, data, src_ip) = self.pending.pop_front()?;
        self.last_src_ip = src_ip;
        Some((to, ecn, data))
    }

    fn last_source_ip(&self) -> Option<std::net::IpAddr> {
        self.last_src_ip
    }

    fn next_timeout(&self) -> Option<Instant> {
        self.next
    }

    fn timeout(&mut self, now: Instant) {
        self.ep.handle_timeout(now);
        self.after(now);
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration

pub struct Certs {
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

pub fn certs() -> &'static Certs {
    static C: OnceLock<Certs> = OnceLock::new();
    C.get_or_init(|| {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        Certs {
            cert: ck.cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der())),
        }
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate with enough names to make the server's first flight larger than three
/// times the client's Initial (exercises the anti-amplification limit).
pub fn big_certs() -> &'static Certs {
    static C: OnceLock<Certs> = OnceLock::new();
    C.get_or_init(|| {
        let mut names: Vec<String> = (0..300).map(|i| format!("host-{i}.example.com")).collect();
        names.push("localhost".into());
        let ck = rcgen::generate_simple_self_signed(names).unwrap();
        Certs {
            cert: ck.cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der())),
        }
    })
}

pub fn server_tls() -> rustls::ServerConfig {
    server_tls_with(certs())
}

pub fn server_tls_with(c: &Certs) -> rustls::ServerConfig {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![c.cert.clone()], c.key.clone_key())
        .unwrap();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.max_early_data_size = u32::MAX;
    cfg.send_tls13_tickets = 2;
    cfg
}

pub fn client_tls() -> rustls::ClientConfig {
    client_tls_with(certs())
}

pub fn client_tls_with(c: &Certs) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(c.cert.clone()).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.enable_early_data = true;
    cfg
}

pub fn server_config(transport: TransportConfig) -> ServerConfig {
    let mut s = ServerConfig::new(Arc::new(server_tls()));
    s.transport = Arc::new(transport);
    s
}

pub fn client_config(transport: TransportConfig) -> ClientConfig {
    let mut cc = ClientConfig::new(Arc::new(client_tls()));
    cc.transport = Arc::new(transport);
    cc
}

pub fn server_addr() -> SocketAddr {
    "10.0.0.1:443".parse().unwrap()
}

pub fn client_addr() -> SocketAddr {
    "10.0.0.2:50000".parse().unwrap()
}

/// A network with a server running [`Server`] and a client running [`Client`].
pub struct Pair {
    pub net: Network,
    pub server: NodeId,
    pub client: NodeId,
    pub ch: ConnectionHandle,
}

pub fn pair(
    seed: u64,
    server_cfg: ServerConfig,
    client_cfg: &ClientConfig,
    client_app: Client,
) -> Pair {
    pair_with(seed, server_cfg, client_cfg, client_app, |_| {})
}

pub fn pair_with(
    seed: u64,
    server_cfg: ServerConfig,
    client_cfg: &ClientConfig,
    client_app: Client,
    setup: impl FnOnce(&mut Network),
) -> Pair {
    pair_with_endpoint(
        seed,
        EndpointConfig::default(),
        server_cfg,
        client_cfg,
        client_app,
        setup,
    )
}

/// [`pair_with`], the server endpoint made with `server_endpoint` (its CID generator, ...).
pub fn pair_with_endpoint(
    seed: u64,
    server_endpoint: EndpointConfig,
    server_cfg: ServerConfig,
    client_cfg: &ClientConfig,
    client_app: Client,
    setup: impl FnOnce(&mut Network),
) -> Pair {
    pair_prepared(
        seed,
        server_endpoint,
        server_cfg,
        client_cfg,
        client_app,
        setup,
        |_| {},
    )
}

/// [`pair_with_endpoint`], with `prepare` given the client endpoint before it connects (to
/// give it path hints, ...).
pub fn pair_prepared(
    seed: u64,
    server_endpoint: EndpointConfig,
    server_cfg: ServerConfig,
    client_cfg: &ClientConfig,
    client_app: Client,
    setup: impl FnOnce(&mut Network),
    prepare: impl FnOnce(&mut Endpoint),
) -> Pair {
    let mut net = Network::new(seed);
    setup(&mut net);
    let now = net.now();
    let sep = Endpoint::new(
        Arc::new(server_endpoint),
        Some(Arc::new(server_cfg)),
        now,
        1_700_000_000_000,
        Some(seed.wrapping_mul(3) + 1),
    );
    let mut cep = Endpoint::new(
        Arc::new(EndpointConfig::default()),
        None,
        now,
        1_700_000_000_000,
        Some(seed.wrapping_mul(5) + 2),
    );
    prepare(&mut cep);
    let ch = cep
        .connect(now, client_cfg, server_addr(), "localhost")
        .unwrap();
    let mut client_app = client_app;
    client_app.handle = Some(ch);
    let server = net.add_node(server_addr(), QuicNode::new(sep, Server::default()));
    let client = net.add_node(client_addr(), QuicNode::new(cep, client_app));
    Pair {
        net,
        server,
        client,
        ch,
    }
}

impl Pair {
    pub fn client(&self) -> &QuicNode {
        self.net.node::<QuicNode>(self.client)
    }

    pub fn client_mut(&mut self) -> &mut QuicNode {
        self.net.node_mut::<QuicNode>(self.client)
    }

    pub fn server(&self) -> &QuicNode {
        self.net.node::<QuicNode>(self.server)
    }

    pub fn server_mut(&mut self) -> &mut QuicNode {
        self.net.node_mut::<QuicNode>(self.server)
    }

    pub fn client_app(&self) -> &Client {
        self.client().app::<Client>()
    }

    pub fn server_app(&self) -> &Server {
        self.server().app::<Server>()
    }

    /// Runs until the client finished all its requests, or `limit` of virtual time passed.
    pub fn run_until_done(&mut self, limit: Duration) -> bool {
        let c = self.client;
        self.net
            .run_while(|n| !n.node::<QuicNode>(c).app::<Client>().all_done(), limit)
    }

    pub fn run_until(&mut self, limit: Duration, mut cond: impl FnMut(&Pair) -> bool) -> bool {
        let deadline = self.net.now() + limit;
        while self.net.now() < deadline {
            if cond(self) {
                return true;
            }
            if matches!(self.net.step(), super::sim::StepResult::Idle) {
                return cond(self);
            }
        }
        cond(self)
    }

    pub fn client_conn(&self) -> &kuai_proto::Connection {
        self.client()
            .ep
            .connection(self.ch)
            .expect("client connection alive")
    }

    pub fn server_conn(&self) -> Option<&kuai_proto::Connection> {
        let s = self.server();
        let h = s.ep.handles().next()?;
        s.ep.connection(h)
    }
}

// ---------------------------------------------------------------------------------------------
// Patterned data

/// Byte `i` of stream `sid`'s response.
pub fn pattern_byte(sid: u64, i: u64) -> u8 {
    ((i + sid * 7) % 251) as u8
}

fn pattern_block() -> &'static Bytes {
    static P: OnceLock<Bytes> = OnceLock::new();
    P.get_or_init(|| Bytes::from((0..251 * 262).map(|i| (i % 251) as u8).collect::<Vec<u8>>()))
}

/// `len` bytes of stream `sid`'s pattern starting at `offset` (at most 64 KiB).
pub fn pattern_chunk(sid: u64, offset: u64, len: usize) -> Bytes {
    let start = ((offset + sid * 7) % 251) as usize;
    let len = len.min(251 * 261);
    pattern_block().slice(start..start + len)
}

// ---------------------------------------------------------------------------------------------
// Server: answers "GET <n>" on each bidi stream with n patterned bytes.

#[derive(Default)]
pub struct Server {
    /// Request bytes per stream until the FIN.
    requests: HashMap<(ConnectionHandle, StreamId), Vec<u8>>,
    /// Responses being written: bytes still to write and the next offset.
    writing: HashMap<(ConnectionHandle, StreamId), (u64, u64)>,
    pub served: u64,
    pub connections: Vec<ConnectionHandle>,
    pub datagrams: Vec<Bytes>,
    /// Echo datagrams back.
    pub echo_datagrams: bool,
}

impl Server {
    fn pump(&mut self, ep: &mut Endpoint, key: (ConnectionHandle, StreamId)) {
        let Some(&(remaining, offset)) = self.writing.get(&key) else {
            return;
        };
        let Some(conn) = ep.connection_mut(key.0) else {
            self.writing.remove(&key);
            return;
        };
        let (mut remaining, mut offset) = (remaining, offset);
        while remaining > 0 {
            let n = remaining.min(32 * 1024) as usize;
            match conn.write(key.1, pattern_chunk(key.1.0, offset, n)) {
                Ok(0) => break,
                Ok(w) => {
                    remaining -= w as u64;
                    offset += w as u64;
                }
                Err(_) => {
                    self.writing.remove(&key);
                    return;
                }
            }
        }
        if remaining == 0 {
            let _ = conn.finish(key.1);
            self.writing.remove(&key);
            self.served += 1;
        } else {
            self.writing.insert(key, (remaining, offset));
        }
    }
}

impl App for Server {
    fn on_event(&mut self, ep: &mut Endpoint, _now: Instant, h: ConnectionHandle, ev: &Event) {
        match ev {
            Event::Connected => self.connections.push(h),
            Event::Stream(StreamEvent::Opened(_)) => {}
            Event::Stream(StreamEvent::Readable(sid)) => {
                let Some(conn) = ep.connection_mut(h) else {
                    return;
                };
                loop {
                    match conn.read(*sid, usize::MAX) {
                        Ok(Some(b)) => self
                            .requests
                            .entry((h, *sid))
                            .or_default()
                            .extend_from_slice(&b),
                        Ok(None) => {
                            let req = self.requests.remove(&(h, *sid)).unwrap_or_default();
                            let n = std::str::from_utf8(&req)
                                .ok()
                                .and_then(|s| s.strip_prefix("GET "))
                                .and_then(|s| s.trim().parse::<u64>().ok())
                                .unwrap_or(0);
                            self.writing.insert((h, *sid), (n, 0));
                            self.pump(ep, (h, *sid));
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            Event::Stream(StreamEvent::Writable(sid)) => self.pump(ep, (h, *sid)),
            Event::DatagramReceived => {
                let Some(conn) = ep.connection_mut(h) else {
                    return;
                };
                while let Some(d) = conn.recv_datagram() {
                    if self.echo_datagrams {
                        let _ = conn.send_datagram(d.clone());
                    }
                    self.datagrams.push(d);
                }
            }
            _ => {}
        }
    }

    fn poll(&mut self, ep: &mut Endpoint, _now: Instant) {
        // Accept connections (the handles also arrive with their events).
        while ep.accept().is_some() {}
        let keys: Vec<_> = self.writing.keys().copied().collect();
        for k in keys {
            self.pump(ep, k);
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Client: sends "GET <n>" requests and checks every byte of the responses.

#[derive(Debug, Clone)]
pub struct Request {
    pub size: u64,
    pub stream: Option<StreamId>,
    pub received: u64,
    pub done_at: Option<Instant>,
    pub corrupt: bool,
}

#[derive(Default)]
pub struct Client {
    pub handle: Option<ConnectionHandle>,
    pub requests: Vec<Request>,
    pub next: usize,
    /// Start requests in 0-RTT when the connection allows it.
    pub use_0rtt: bool,
    /// Requests in flight at most (0: unlimited).
    pub concurrency: usize,
    pub connected_at: Option<Instant>,
    pub started_at: Option<Instant>,
    pub lost: Option<kuai_proto::ConnectionError>,
    pub tokens: Vec<Bytes>,
    pub rejected_0rtt: bool,
    /// The application reads nothing while set (a slow consumer).
    pub paused: bool,
}

impl Client {
    pub fn with_requests(sizes: impl IntoIterator<Item = u64>) -> Self {
        Self {
            requests: sizes
                .into_iter()
                .map(|size| Request {
                    size,
                    stream: None,
                    received: 0,
                    done_at: None,
                    corrupt: false,
                })
                .collect(),
            ..Default::default()
        }
    }

    pub fn all_done(&self) -> bool {
        self.lost.is_some() || self.requests.iter().all(|r| r.done_at.is_some())
    }

    pub fn completed(&self) -> usize {
        self.requests
            .iter()
            .filter(|r| r.done_at.is_some() && !r.corrupt)
            .count()
    }

    pub fn assert_all_intact(&self) {
        assert!(self.lost.is_none(), "connection lost: {:?}", self.lost);
        for (i, r) in self.requests.iter().enumerate() {
            assert!(
                r.done_at.is_some(),
                "request {i} of {} bytes not done ({} received)",
                r.size,
                r.received
            );
            assert!(!r.corrupt, "request {i} corrupt");
            assert_eq!(r.received, r.size, "request {i} length");
        }
    }

    fn start_requests(&mut self, ep: &mut Endpoint, now: Instant) {
        let Some(h) = self.handle else { return };
        let Some(conn) = ep.connection_mut(h) else {
            return;
        };
        if !(conn.is_established() || self.use_0rtt && conn.is_0rtt_available()) {
            return;
        }
        self.started_at.get_or_insert(now);
        while self.next < self.requests.len() {
            if self.concurrency > 0 {
                let in_flight = self.requests[..self.next]
                    .iter()
                    .filter(|r| r.done_at.is_none())
                    .count();
                if in_flight >= self.concurrency {
                    break;
                }
            }
            let id = match conn.open_stream(Dir::Bi) {
                Ok(id) => id,
                Err(_) => break,
            };
            let req = format!("GET {}", self.requests[self.next].size);
            conn.write(id, Bytes::from(req))
                .expect("request fits the buffer");
            conn.finish(id).unwrap();
            self.requests[self.next].stream = Some(id);
            self.next += 1;
        }
    }

    fn read(&mut self, ep: &mut Endpoint, now: Instant, sid: StreamId) {
        let Some(h) = self.handle else { return };
        if self.paused {
            return;
        }
        let Some(conn) = ep.connection_mut(h) else {
            return;
        };
        let Some(r) = self.requests.iter_mut().find(|r| r.stream == Some(sid)) else {
            return;
        };
        // Events are edge-triggered and may be stale: a finished request reads nothing more.
        if r.done_at.is_some() {
            return;
        }
        loop {
            match conn.read(sid, usize::MAX) {
                Ok(Some(b)) => {
                    for (i, &byte) in b.iter().enumerate() {
                        if byte != pattern_byte(sid.0, r.received + i as u64) {
                            if !r.corrupt {
                                eprintln!(
                                    "corrupt byte at offset {} of stream {}",
                                    r.received + i as u64,
                                    sid.0
                                );
                            }
                            r.corrupt = true;
                        }
                    }
                    r.received += b.len() as u64;
                }
                Ok(None) => {
                    r.done_at = Some(now);
                    break;
                }
                Err(StreamError::WouldBlock) => break,
                Err(e) => {
                    eprintln!("read error on stream {}: {e:?}", sid.0);
                    r.corrupt = true;
                    r.done_at = Some(now);
                    break;
                }
            }
        }
    }
}

impl App for Client {
    fn on_event(&mut self, ep: &mut Endpoint, now: Instant, _h: ConnectionHandle, ev: &Event) {
        match ev {
            Event::Connected => {
                self.connected_at = Some(now);
                self.start_requests(ep, now);
            }
            Event::ZeroRttRejected => {
                self.rejected_0rtt = true;
                for r in &mut self.requests {
                    r.stream = None;
                    r.received = 0;
                    r.corrupt = false;
                }
                self.next = 0;
                self.start_requests(ep, now);
            }
            Event::Stream(StreamEvent::Readable(sid)) => self.read(ep, now, *sid),
            Event::Stream(StreamEvent::Available(_)) => self.start_requests(ep, now),
            Event::NewToken(t) => self.tokens.push(t.clone()),
            Event::ConnectionLost(e) => self.lost = Some(e.clone()),
            _ => {}
        }
    }

    fn poll(&mut self, ep: &mut Endpoint, now: Instant) {
        if self.next < self.requests.len() {
            self.start_requests(ep, now);
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub fn default_transport() -> TransportConfig {
    TransportConfig::default()
}
