//! Keys that rotate (no Redis: the in-memory store stands for the fleet's), and stateless
//! session tickets on real loopback connections.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kuai::kuai_proto::TokenKey;
use kuai_fleet::{KeyRotation, MemoryKeyStore, Ticketer};
use rustls::server::ProducesTickets;

/// Waits for the start of a second, so that a 1 s generation does not end mid-step.
async fn at_second_start() {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_millis();
    tokio::time::sleep(Duration::from_millis(u64::from(1000 - ms) + 20)).await;
}

/// Two servers rotating from one store every second: each opens what the other sealed in
/// the same or the neighbouring generation; three generations later, the old one is gone.
#[tokio::test]
async fn two_servers_rotate_together() {
    let store = Arc::new(MemoryKeyStore::default());
    let (a, b) = (Arc::new(TokenKey::random()), Arc::new(TokenKey::random()));
    at_second_start().await;
    let ra = KeyRotation::start(store.clone(), "t", Duration::from_secs(1), a.clone()).await;
    let rb = KeyRotation::start(store.clone(), "t", Duration::from_secs(1), b.clone()).await;
    assert_eq!(ra.sealing(), rb.sealing());
    let g0 = ra.sealing().unwrap();
    let sealed_a = a.seal(b"from a".to_vec());
    assert_eq!(b.open(&sealed_a).as_deref(), Some(&b"from a"[..]));
    assert_eq!(
        sealed_a[0],
        (g0 % 256) as u8,
        "sealed with the current generation"
    );
    // One generation later: both moved on, the previous key still opens.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(ra.sealing(), Some(g0 + 1));
    assert_eq!(rb.sealing(), Some(g0 + 1));
    let sealed_b = b.seal(b"from b".to_vec());
    assert_eq!(sealed_b[0], ((g0 + 1) % 256) as u8);
    assert!(a.open(&sealed_b).is_some());
    assert!(a.open(&sealed_a).is_some() && b.open(&sealed_a).is_some());
    // Three generations on, g0's key is gone everywhere.
    let deadline = Instant::now() + Duration::from_secs(5);
    while ra.sealing() < Some(g0 + 3) || rb.sealing() < Some(g0 + 3) {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(a.open(&sealed_a).is_none() && b.open(&sealed_a).is_none());
}

/// A ticket sealed by one server's ticketer opens at another's (same store), not at a
/// server of another fleet.
#[tokio::test]
async fn tickets_open_across_the_fleet() {
    let store = Arc::new(MemoryKeyStore::default());
    let (a, b) = (
        Arc::new(Ticketer::new(Duration::from_secs(3600))),
        Arc::new(Ticketer::new(Duration::from_secs(3600))),
    );
    let period = Duration::from_secs(3600);
    let _ra = KeyRotation::start(store.clone(), "k", period, a.clone()).await;
    let _rb = KeyRotation::start(store, "k", period, b.clone()).await;
    let t = a.encrypt(b"session").unwrap();
    assert_eq!(b.decrypt(&t).as_deref(), Some(&b"session"[..]));
    assert_eq!(a.lifetime(), 3600);
    let other = Arc::new(Ticketer::new(period));
    let _ro = KeyRotation::start(
        Arc::new(MemoryKeyStore::default()),
        "k",
        period,
        other.clone(),
    )
    .await;
    assert!(other.decrypt(&t).is_none());
}

/// One server with stateless tickets: every client of `KUAI_RESUME_CLIENTS` (1,000 by
/// default; 10,000 by hand) resumes on its second connection (1-RTT: rustls 0.23 allows no
/// 0-RTT with stateless tickets), and the server keeps no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_resume_with_stateless_tickets() {
    let n: usize = std::env::var("KUAI_RESUME_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    tls.alpn_protocols = vec![b"t".to_vec()];
    let period = Duration::from_secs(3600);
    let ticketer = Arc::new(Ticketer::new(period));
    let _r = KeyRotation::start(
        Arc::new(MemoryKeyStore::default()),
        "k",
        period,
        ticketer.clone(),
    )
    .await;
    tls.ticketer = ticketer;
    let sessions = kuai::session::SessionCache::with_defaults();
    tls.session_storage = sessions.clone();
    let server = kuai::Endpoint::server(
        kuai::ServerConfig::from_rustls(tls),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    tokio::spawn(async move {
        while let Some(c) = s.accept().await {
            tokio::spawn(async move {
                if let Ok(c) = c.await {
                    let _ = c.closed().await;
                }
            });
        }
    });
    let start = Instant::now();
    let ccfg = kuai::ClientConfig::with_root(cert, &[b"t"]).unwrap();
    let mut resumed = 0;
    let mut zero_rtt = 0;
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let mut tasks = Vec::new();
        for _ in chunk {
            let ccfg = ccfg.clone();
            tasks.push(tokio::spawn(async move {
                // A client of its own: its own session memory.
                let client = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
                let first = client
                    .connect_with(ccfg.clone(), addr, "localhost")
                    .unwrap()
                    .await
                    .unwrap();
                let _ = tokio::time::timeout(Duration::from_secs(5), first.session_ticket()).await;
                first.close(0, b"");
                let second = client
                    .connect_with(ccfg, addr, "localhost")
                    .unwrap()
                    .await
                    .unwrap();
                let st = second.stats();
                second.close(0, b"");
                (st.resumed, st.zero_rtt_accepted)
            }));
        }
        for t in tasks {
            let (r, z) = t.await.unwrap();
            resumed += usize::from(r);
            zero_rtt += usize::from(z);
        }
    }
    println!(
        "stateless tickets: {resumed} of {n} clients resumed ({:?}), {} sessions kept",
        start.elapsed(),
        sessions.len()
    );
    assert_eq!(resumed, n);
    assert_eq!(zero_rtt, 0);
    assert_eq!(sessions.len(), 0, "no session kept by the server");
}
