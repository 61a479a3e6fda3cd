//! 0-RTT anti-replay between servers that share sessions: a client's captured first flight
//! (Initial + 0-RTT), sent again to another server of the fleet, is refused there before its
//! application sees the request; without the guard, the same replay is served (the attack
//! the guard exists for).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kuai::replay::{AntiReplay, Verdict};
use kuai::session::SessionCache;
use kuai::{ClientConfig, Endpoint, ServerConfig};
use rustls::server::StoresServerSessions;
use tokio::net::UdpSocket;

const ALPN: &[u8] = b"kuai-test";

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// The session store of the server that issues tickets: each session is also copied into
/// the other servers' stores (a fleet's replication, without the consumption notices that
/// would race a fast replay).
#[derive(Debug)]
struct Replicating {
    own: Arc<SessionCache>,
    replicas: Vec<Arc<SessionCache>>,
}

impl StoresServerSessions for Replicating {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        for r in &self.replicas {
            r.put(key.clone(), value.clone());
        }
        self.own.put(key, value)
    }
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.own.get(key)
    }
    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.own.take(key)
    }
    fn can_cache(&self) -> bool {
        true
    }
}

/// First uses in memory, shared by the servers (Redis `SET NX` in a real fleet); answers on
/// a task, as a remote store would.
#[derive(Default)]
struct SeenTickets(Mutex<HashSet<Vec<u8>>>);

impl AntiReplay for SeenTickets {
    fn record(&self, ticket: &[u8]) {
        self.0.lock().unwrap().insert(ticket.to_vec());
    }

    fn check(&self, ticket: &[u8], verdict: Verdict) {
        let first = self.0.lock().unwrap().insert(ticket.to_vec());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if first {
                verdict.first_use()
            } else {
                verdict.replayed()
            }
        });
    }
}

/// Counts the endpoint's refused replays.
#[derive(Default)]
struct Refusals(AtomicUsize);

impl kuai::kuai_proto::trace::Subscriber for Refusals {
    type ConnectionContext = ();
    fn create_connection_context(
        &self,
        _: &kuai::kuai_proto::trace::ConnectionMeta,
        _: std::time::Instant,
    ) {
    }
    fn on_endpoint_event(
        &self,
        _: std::time::Instant,
        event: &kuai::kuai_proto::trace::EndpointTraceEvent,
    ) {
        if let kuai::kuai_proto::trace::EndpointTraceEvent::ZeroRttReplayRefused { .. } = event {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn per_packet_events(&self) -> bool {
        false
    }
}

struct Server {
    addr: SocketAddr,
    refusals: Arc<Refusals>,
    /// Requests its application read, and of those, arrived in 0-RTT.
    requests: Arc<AtomicUsize>,
    early: Arc<AtomicUsize>,
    _ep: Endpoint,
}

/// A server that answers each bidi stream with "ok", reading 0-RTT requests at once.
fn start(
    cert: &rcgen::CertifiedKey,
    store: Arc<dyn StoresServerSessions>,
    guard: Option<Arc<SeenTickets>>,
) -> Server {
    start_with(cert, store, guard, true)
}

/// [`start`], taking 0-RTT data or not.
fn start_with(
    cert: &rcgen::CertifiedKey,
    store: Arc<dyn StoresServerSessions>,
    guard: Option<Arc<SeenTickets>>,
    accept_0rtt: bool,
) -> Server {
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into()),
        )
        .unwrap();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.session_storage = store;
    let mut cfg = ServerConfig::from_rustls(tls);
    cfg.accept_0rtt(accept_0rtt);
    if let Some(g) = guard {
        cfg.anti_replay(g);
    }
    let refusals = Arc::new(Refusals::default());
    let ep = Endpoint::builder()
        .server(cfg)
        .subscriber_shared(refusals.clone())
        .bind(localhost())
        .unwrap();
    let addr = ep.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let early = Arc::new(AtomicUsize::new(0));
    let (e2, r2, x2) = (ep.clone(), requests.clone(), early.clone());
    tokio::spawn(async move {
        while let Some(connecting) = e2.accept().await {
            let (r, x) = (r2.clone(), x2.clone());
            tokio::spawn(async move {
                let conn = match connecting.into_0rtt() {
                    Ok((c, _)) => c,
                    Err(c) => match c.await {
                        Ok(c) => c,
                        Err(_) => return,
                    },
                };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    // The request is acted on once its bytes are in, FIN or not: the
                    // client's FIN can leave in a later (1-RTT) packet than its data, and a
                    // replayed 0-RTT flight then carries the request without its end.
                    let mut got = 0;
                    while got < b"GET /".len() {
                        match recv.read_chunk(1024).await {
                            Ok(Some(c)) => got += c.len(),
                            _ => return,
                        }
                    }
                    r.fetch_add(1, Ordering::SeqCst);
                    if recv.received_in_0rtt() {
                        x.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = send.write_all(b"ok").await;
                    let _ = send.finish();
                }
            });
        }
    });
    Server {
        addr,
        refusals,
        requests,
        early,
        _ep: ep,
    }
}

async fn get(conn: &kuai::Connection) -> Vec<u8> {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(b"GET /").await.unwrap();
    send.finish().unwrap();
    recv.read_to_end(100).await.unwrap()
}

/// Relays datagrams between a client and `server`, keeping a copy of what the client sent.
async fn recording_relay(server: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<Vec<u8>>>>) {
    let front = Arc::new(UdpSocket::bind(localhost()).await.unwrap());
    let back = Arc::new(UdpSocket::bind(localhost()).await.unwrap());
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let (f, b, s, c) = (front.clone(), back.clone(), sent.clone(), client.clone());
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = f.recv_from(&mut buf).await {
            *c.lock().unwrap() = Some(from);
            s.lock().unwrap().push(buf[..n].to_vec());
            let _ = b.send(&buf[..n]).await;
        }
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = back.recv(&mut buf).await {
            let to = *client.lock().unwrap();
            if let Some(to) = to {
                let _ = front.send_to(&buf[..n], to).await;
            }
        }
    });
    (addr, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_0rtt_flight_is_refused_by_another_server() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (ca, cb, cc) = (
        SessionCache::with_defaults(),
        SessionCache::with_defaults(),
        SessionCache::with_defaults(),
    );
    let guard = Arc::new(SeenTickets::default());
    let a = start(
        &cert,
        Arc::new(Replicating {
            own: ca,
            replicas: vec![cb.clone(), cc.clone()],
        }),
        Some(guard.clone()),
    );
    let b = start(&cert, cb.clone(), Some(guard.clone()));
    // The control: a replica without the guard.
    let c = start(&cert, cc.clone(), None);

    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert.cert.der().clone(), &[ALPN]).unwrap();
    let first = client
        .connect_with(ccfg.clone(), a.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    assert_eq!(get(&first).await, b"ok");
    let ticket = tokio::time::timeout(Duration::from_secs(5), first.session_ticket());
    assert!(ticket.await.unwrap());
    first.close(0, b"");
    assert!(!cb.is_empty() && !cc.is_empty(), "sessions replicated");

    // The second connection resumes in 0-RTT through a relay that records its flight.
    let (relay, sent) = recording_relay(a.addr).await;
    let (conn, accepted) = client
        .connect_with(ccfg, relay, "localhost")
        .unwrap()
        .into_0rtt()
        .map_err(|_| "no 0-RTT")
        .unwrap();
    assert_eq!(get(&conn).await, b"ok");
    assert!(accepted.await, "server A accepted 0-RTT");
    assert_eq!(
        a.early.load(Ordering::SeqCst),
        1,
        "A read the 0-RTT request"
    );
    conn.close(0, b"");
    let flight = sent.lock().unwrap().clone();
    assert!(flight.len() >= 2, "Initial and 0-RTT captured");

    // The attacker sends the captured datagrams to B (guarded) and C (not).
    let attacker = UdpSocket::bind(localhost()).await.unwrap();
    for target in [b.addr, c.addr] {
        for d in &flight {
            attacker.send_to(d, target).await.unwrap();
        }
    }
    // The unguarded replica serves it within a few ms on a quiet machine; allow a loaded
    // one up to 5 s, then as long again as that took for the guarded one to have answered.
    let t = std::time::Instant::now();
    while c.requests.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(t.elapsed().max(Duration::from_millis(300))).await;
    let (rb, rc) = (
        b.requests.load(Ordering::SeqCst),
        c.requests.load(Ordering::SeqCst),
    );
    println!("replayed request served: by the guarded server {rb} times, by the unguarded {rc}");
    assert_eq!(rb, 0, "the guarded server refused the replay");
    assert_eq!(
        rc, 1,
        "the unguarded replica served it (the attack is real)"
    );
    assert_eq!(c.early.load(Ordering::SeqCst), 1);
    assert_eq!(
        b.refusals.0.load(Ordering::SeqCst),
        1,
        "subscribers hear of it"
    );
    assert_eq!(a.refusals.0.load(Ordering::SeqCst), 0);
}

/// A server that does not take a client's 0-RTT data (it resumes the session, the client
/// sends its request again in 1-RTT and the server serves it) still records the ticket as
/// used: the captured first flight, replayed to another server that holds the session, is
/// refused there, where it ran the request a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0rtt_flight_refused_by_one_server_is_not_served_by_another() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (ca, cb) = (SessionCache::with_defaults(), SessionCache::with_defaults());
    let guard = Arc::new(SeenTickets::default());
    let store = Arc::new(Replicating {
        own: ca,
        replicas: vec![cb.clone()],
    });
    let a = start_with(&cert, store.clone(), Some(guard.clone()), true);
    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert.cert.der().clone(), &[ALPN]).unwrap();
    let first = client
        .connect_with(ccfg.clone(), a.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    assert_eq!(get(&first).await, b"ok");
    let ticket = tokio::time::timeout(Duration::from_secs(5), first.session_ticket());
    assert!(ticket.await.unwrap());
    first.close(0, b"");
    // A now refuses 0-RTT data (a rollout, say): its next connection resumes without it.
    drop(a);
    let a = start_with(&cert, store, Some(guard.clone()), false);
    let b = start(&cert, cb.clone(), Some(guard.clone()));

    let (relay, sent) = recording_relay(a.addr).await;
    let (conn, accepted) = client
        .connect_with(ccfg, relay, "localhost")
        .unwrap()
        .into_0rtt()
        .map_err(|_| "no 0-RTT")
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    let _ = send.write_all(b"GET /").await;
    let _ = send.finish();
    assert!(!accepted.await, "A refused the 0-RTT data");
    assert_eq!(get(&conn).await, b"ok", "the request again, in 1-RTT");
    assert_eq!(a.requests.load(Ordering::SeqCst), 1);
    conn.close(0, b"");
    let flight = sent.lock().unwrap().clone();

    let attacker = UdpSocket::bind(localhost()).await.unwrap();
    for d in &flight {
        attacker.send_to(d, b.addr).await.unwrap();
    }
    let t = std::time::Instant::now();
    while b.refusals.0.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        b.requests.load(Ordering::SeqCst),
        0,
        "B did not run it again"
    );
    assert_eq!(
        b.refusals.0.load(Ordering::SeqCst),
        1,
        "B refused the replay"
    );
}
