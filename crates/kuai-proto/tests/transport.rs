//! Protocol behaviour over the in-memory network: handshakes, transfers under loss, streams,
//! 0-RTT, Retry, key updates, version negotiation, migration, resets, timeouts and limits.

#![allow(clippy::field_reassign_with_default)]

mod common;

use std::time::Duration;

use common::quic::{self, Client, pair};
use common::sim::LinkConfig;
use kuai_proto::config::{EndpointConfig, TransportConfig};

fn link(delay_ms: u64, loss: f64) -> LinkConfig {
    LinkConfig {
        delay: Duration::from_millis(delay_ms),
        loss,
        ..LinkConfig::default()
    }
}

/// [`link`] through a bottleneck of `rate_bps` with a drop-tail queue of `queue_bytes`.
fn bottleneck(delay_ms: u64, loss: f64, rate_bps: u64, queue_bytes: usize) -> LinkConfig {
    LinkConfig {
        rate_bps: Some(rate_bps),
        queue_bytes,
        ..link(delay_ms, loss)
    }
}

#[test]
fn handshake_completes() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        1,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::default(),
    );
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.client_app().connected_at.is_some()
    }));
    let c = p.client_conn();
    assert!(c.is_established());
    assert_eq!(c.alpn(), Some(quic::ALPN));
    // 1 RTT (2 x 10 ms) for the client; the server's handshake is done half an RTT later.
    let t = p.client_app().connected_at.unwrap() - p.net.base();
    assert!(t < Duration::from_millis(60), "handshake took {t:?}");
    assert!(p.run_until(Duration::from_secs(1), |p| {
        p.server_conn().is_some_and(|s| s.is_handshake_confirmed())
    }));
    // The server freed its TLS state after the handshake; what it knew stays available.
    let s = p.server_conn().unwrap();
    assert_eq!(s.alpn(), Some(quic::ALPN));
    assert_eq!(s.server_name(), Some("localhost"));
    assert!(s.stats().cipher_suite.is_some());
}

/// A server that takes no key share the client offered answers with a HelloRetryRequest
/// (RFC 8446 §4.1.4); the second ClientHello comes in Initial packets too, after the first
/// (RFC 9001 §4.1.3 allows it: TLS still reads the Initial level), and the handshake takes
/// a round trip more.
#[test]
fn hello_retry_request_completes() {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .kx_groups
        .retain(|g| g.name() == rustls::NamedGroup::secp256r1);
    let c = quic::certs();
    let mut tls = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![c.cert.clone()], c.key.clone_key())
        .unwrap();
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let mut scfg = kuai_proto::ServerConfig::new(std::sync::Arc::new(tls));
    scfg.transport = std::sync::Arc::new(TransportConfig::default());
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(3, scfg, &ccfg, Client::with_requests([1000]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    // Two round trips of 20 ms: the one the HelloRetryRequest costs, then the handshake.
    let t = p.client_app().connected_at.unwrap() - p.net.base();
    assert!(
        t >= Duration::from_millis(40),
        "no HelloRetryRequest: {t:?}"
    );
}

#[test]
fn small_request() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        2,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([1000]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
}

fn transfer_10mb(seed: u64, loss: f64) {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        seed,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([10 << 20]),
        |n| n.set_default_link(bottleneck(10, loss, 100_000_000, 256 * 1024)),
    );
    let ok = p.run_until_done(Duration::from_secs(600));
    assert!(
        p.client_app().lost.is_none(),
        "lost: {:?} after {:?}",
        p.client_app().lost,
        p.net.elapsed()
    );
    let stats = p.client_conn().stats();
    let sstats = p.server_conn().map(|c| c.stats());
    eprintln!(
        "loss {loss}: done={ok} t={:?} client {:?} server {:?}",
        p.net.elapsed(),
        stats,
        sstats
    );
    assert!(ok, "transfer did not finish");
    p.client_app().assert_all_intact();
}

#[test]
fn transfer_10mb_no_loss() {
    transfer_10mb(10, 0.0);
}

#[test]
fn transfer_10mb_2pct_loss() {
    transfer_10mb(11, 0.02);
}

#[test]
fn transfer_10mb_10pct_loss() {
    transfer_10mb(12, 0.10);
}

#[test]
fn transfer_10mb_30pct_loss() {
    transfer_10mb(13, 0.30);
}

/// Starts a second connection from the client endpoint with a fresh client application.
fn reconnect(p: &mut quic::Pair, ccfg: &kuai_proto::ClientConfig, mut app: Client) {
    let now = p.net.now();
    let node = p.client_mut();
    let token = node
        .app::<Client>()
        .tokens
        .first()
        .cloned()
        .unwrap_or_default();
    let h = node
        .ep
        .connect_with_token(now, ccfg, quic::server_addr(), "localhost", token)
        .unwrap();
    app.handle = Some(h);
    node.app = Box::new(app);
    p.ch = h;
}

/// Closes the client's current connection (which must still exist).
fn close_client(p: &mut quic::Pair) {
    let (now, ch) = (p.net.now(), p.ch);
    p.client_mut()
        .ep
        .connection_mut(ch)
        .expect("the client's connection")
        .close(now, 0, b"bye");
}

#[test]
fn thousand_concurrent_streams() {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams = 1000;
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        20,
        quic::server_config(t),
        &ccfg,
        Client::with_requests(vec![500; 1000]),
    );
    assert!(p.run_until_done(Duration::from_secs(30)));
    p.client_app().assert_all_intact();
    assert_eq!(p.server_app().served, 1000);
}

#[test]
fn streams_beyond_the_limit_wait_for_max_streams() {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams = 10;
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        21,
        quic::server_config(t),
        &ccfg,
        Client::with_requests(vec![2000; 300]),
    );
    assert!(p.run_until_done(Duration::from_secs(60)));
    p.client_app().assert_all_intact();
}

#[test]
fn zero_rtt_accepted() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        30,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    // Let the session ticket arrive.
    p.net.run_for(Duration::from_millis(200));
    let first = p.ch;
    let now = p.net.now();
    p.client_mut()
        .ep
        .connection_mut(first)
        .unwrap()
        .close(now, 0, b"bye");
    p.net.run_for(Duration::from_millis(200));
    reconnect(
        &mut p,
        &ccfg,
        Client {
            use_0rtt: true,
            ..Client::with_requests([5000])
        },
    );
    assert!(
        p.client_conn().is_0rtt_available(),
        "resumed session offers 0-RTT"
    );
    let start = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    let c = p.client_conn();
    assert_eq!(c.zero_rtt_accepted(), Some(true));
    assert!(c.stats().resumed);
    // The response arrives within one round trip of starting: the request went in 0-RTT.
    let done = p.client_app().requests[0].done_at.unwrap();
    assert!(
        done - start < Duration::from_millis(45),
        "0-RTT request took {:?}",
        done - start
    );
}

/// RFC 9000 §7.4.1: a server that accepts 0-RTT must not lower the limits the client
/// remembered; a client facing one that does closes with PROTOCOL_VIOLATION. The check
/// compared the new parameters with themselves (TLS holds only the new ones by then), so
/// the client went on with the larger remembered limits.
#[test]
fn a_server_accepting_0rtt_with_lower_limits_is_refused() {
    let ccfg = quic::client_config(TransportConfig::default());
    let scfg = quic::server_config(TransportConfig::default());
    let mut p = pair(34, scfg.clone(), &ccfg, Client::with_requests([100]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_millis(200));
    // The same TLS (sessions resume, 0-RTT is accepted), a smaller connection window.
    let mut lower = (*scfg.transport).clone();
    lower.receive_window /= 2;
    let lowered = kuai_proto::config::ServerConfig {
        transport: std::sync::Arc::new(lower),
        ..scfg
    };
    p.server_mut()
        .ep
        .set_server_config(Some(std::sync::Arc::new(lowered)));
    reconnect(
        &mut p,
        &ccfg,
        Client {
            use_0rtt: true,
            ..Client::with_requests([3000])
        },
    );
    assert!(p.client_conn().is_0rtt_available());
    assert!(p.run_until(Duration::from_secs(5), |p| p.client_conn().is_closed()));
    let reason = format!("{:?}", p.client_conn().close_reason());
    assert!(reason.contains("lowered a remembered limit"), "{reason}");
}

#[test]
fn zero_rtt_rejected_then_retried() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.accept_0rtt = false;
    let mut p = pair(31, scfg, &ccfg, Client::with_requests([100]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_millis(200));
    reconnect(
        &mut p,
        &ccfg,
        Client {
            use_0rtt: true,
            ..Client::with_requests([3000, 4000])
        },
    );
    assert!(p.client_conn().is_0rtt_available());
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert!(p.client_app().rejected_0rtt);
    assert_eq!(p.client_conn().zero_rtt_accepted(), Some(false));
}

/// A server over its memory budget makes new connections with smaller windows than a
/// resuming client remembers, so it takes no 0-RTT from them (RFC 9000 §7.4.1): the client
/// sends again in 1-RTT. (It accepted the early data with the lowered limits, and the client
/// closed the connection for them.)
#[test]
fn a_server_under_memory_pressure_takes_no_0rtt() {
    let budget = kuai_proto::config::MemoryBudget::new(256 << 10);
    let endpoint = EndpointConfig {
        memory_budget: budget.clone(),
        ..EndpointConfig::default()
    };
    let ccfg = quic::client_config(TransportConfig::default());
    let mut app = Client::with_requests([100, 8_000_000]);
    app.concurrency = 1;
    let mut p = quic::pair_with_endpoint(
        33,
        endpoint,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        app,
        |n| n.set_default_link(bottleneck(10, 0.0, 50_000_000, 1 << 20)),
    );
    // The first response brings the session ticket; the second keeps the server's send
    // buffer over the budget.
    assert!(p.run_until(Duration::from_secs(10), |p| {
        p.client_app().requests[1].received > 1 << 20 && budget.under_pressure()
    }));
    let now = p.net.now();
    let second = p
        .client_mut()
        .ep
        .connect(now, &ccfg, quic::server_addr(), "localhost")
        .unwrap();
    assert!(
        p.client()
            .ep
            .connection(second)
            .unwrap()
            .is_0rtt_available()
    );
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.client()
            .ep
            .connection(second)
            .is_some_and(|c| c.is_established() || c.is_closed())
    }));
    let c = p.client().ep.connection(second).unwrap();
    assert!(!c.is_closed(), "closed: {:?}", c.close_reason());
    assert_eq!(c.zero_rtt_accepted(), Some(false));
}

#[test]
fn retry_validates_the_address() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.retry = kuai_proto::config::RetryPolicy::Always;
    let mut p = pair(40, scfg, &ccfg, Client::with_requests([20_000]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert!(p.client_conn().stats().retry_received);
    assert_eq!(p.server().ep.stats().retries_sent, 1);
}

/// RFC 9000 §6.2: a client that has processed a Retry discards Version Negotiation. One
/// forged by an on-path observer after the Retry (its IDs copied from the client's first
/// Initial) restarted the handshake in another version with the Retry's token and keys
/// derived from the wrong ID: it hung until its timeout.
#[test]
fn version_negotiation_after_a_retry_is_ignored() {
    use std::sync::{Arc, Mutex};
    let ccfg = quic::client_config(TransportConfig::default());
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.retry = kuai_proto::config::RetryPolicy::Always;
    let mut p = pair(41, scfg, &ccfg, Client::with_requests([20_000]));
    // The IDs of the client's first Initial: destination (the original), then source.
    type Ids = Option<(Vec<u8>, Vec<u8>)>;
    let ids: Arc<Mutex<Ids>> = Arc::default();
    let seen = ids.clone();
    let client = p.client;
    p.net.set_filter(move |ctx| {
        let d = &ctx.data[..];
        if ctx.from_node == client && seen.lock().unwrap().is_none() && d[0] & 0x80 != 0 {
            let dl = d[5] as usize;
            let dcid = d[6..6 + dl].to_vec();
            let sl = d[6 + dl] as usize;
            let scid = d[7 + dl..7 + dl + sl].to_vec();
            *seen.lock().unwrap() = Some((dcid, scid));
        }
        common::sim::Verdict::Pass
    });
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.client_conn().stats().retry_received
    }));
    let (odcid, scid) = ids.lock().unwrap().clone().unwrap();
    // Only v2 offered, which the client also speaks: it would start again in it.
    let vn = kuai_proto::packet::build_version_negotiation(
        &scid,
        &odcid,
        &[kuai_proto::Version::V2.wire()],
    );
    p.net.inject(
        quic::server_addr(),
        quic::client_addr(),
        None,
        vn,
        Duration::ZERO,
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert_eq!(p.client_conn().version(), kuai_proto::Version::V1);
}

#[test]
fn new_token_skips_retry_next_time() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.retry = kuai_proto::config::RetryPolicy::Always;
    let mut p = pair(41, scfg, &ccfg, Client::with_requests([100]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_millis(100));
    assert!(!p.client_app().tokens.is_empty(), "server sent NEW_TOKEN");
    reconnect(&mut p, &ccfg, Client::with_requests([100]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert!(!p.client_conn().stats().retry_received);
    assert_eq!(p.server().ep.stats().retries_sent, 1);
}

/// Asks the client's or the server's connection to update its keys; false if not allowed yet.
fn initiate_key_update(p: &mut quic::Pair, client_side: bool) -> bool {
    if client_side {
        let ch = p.ch;
        p.client_mut()
            .ep
            .connection_mut(ch)
            .unwrap()
            .initiate_key_update()
    } else {
        let node = p.server_mut();
        let h = node.ep.handles().next().unwrap();
        node.ep.connection_mut(h).unwrap().initiate_key_update()
    }
}

/// A pair (seed `seed`, `t` on both sides) whose client downloads 4 MiB, run until a
/// quarter of it arrived.
fn mid_download(seed: u64, t: TransportConfig) -> quic::Pair {
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        seed,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([4 << 20]),
    );
    assert!(p.run_until(
        Duration::from_secs(10),
        |p| p.client_app().requests[0].received > (1 << 20)
    ));
    p
}

fn key_update_by(client_side: bool) {
    let mut p = mid_download(50 + client_side as u64, TransportConfig::default());
    let dropped = |p: &quic::Pair| {
        if client_side {
            p.client_conn().stats().packets_dropped
        } else {
            p.server_conn().unwrap().stats().packets_dropped
        }
    };
    let before = dropped(&p);
    let updated = initiate_key_update(&mut p, client_side);
    assert!(updated, "key update allowed");
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
    assert!(p.client_conn().stats().key_updates >= 1);
    assert!(p.server_conn().unwrap().stats().key_updates >= 1);
    // The peer's packets still in the old phase (sent before it saw ours) are opened with
    // the previous key, not taken for another update and dropped.
    assert_eq!(dropped(&p), before, "packets dropped around the update");
    // Both sides can update again once the new phase is acknowledged.
    p.net.run_for(Duration::from_millis(200));
}

/// RFC 9001 §4.1.2, §6.1: a server's handshake is confirmed when it completes, so it may
/// update keys before the client (waiting for HANDSHAKE_DONE) has confirmed its own; the
/// client closed with KEY_UPDATE_ERROR.
#[test]
fn a_server_updating_keys_as_its_handshake_completes_is_followed() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        53,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([200_000]),
    );
    // The server's 1-RTT packets are lost until its update (the first carries
    // HANDSHAKE_DONE): the client meets the new key phase before it confirms.
    let lose = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let lose_in = lose.clone();
    let server = p.server;
    p.net.set_filter(move |ctx| {
        let short = ctx.data[0] & 0x80 == 0;
        if ctx.from_node == server && short && lose_in.load(std::sync::atomic::Ordering::SeqCst) {
            common::sim::Verdict::Drop
        } else {
            common::sim::Verdict::Pass
        }
    });
    assert!(p.run_until(Duration::from_secs(5), |p| {
        let s = p.server();
        s.ep.handles()
            .next()
            .and_then(|h| s.ep.connection(h))
            .is_some_and(|c| c.is_handshake_confirmed())
    }));
    assert!(!p.client_conn().is_handshake_confirmed());
    assert!(initiate_key_update(&mut p, false), "key update allowed");
    lose.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
    assert!(p.client_conn().stats().key_updates >= 1);
}

#[test]
fn key_update_initiated_by_client() {
    key_update_by(true);
}

#[test]
fn key_update_initiated_by_server() {
    key_update_by(false);
}

#[test]
fn automatic_key_update_after_interval() {
    let mut t = TransportConfig::default();
    t.key_update_interval = 500;
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        52,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([8 << 20]),
    );
    assert!(p.run_until_done(Duration::from_secs(30)));
    p.client_app().assert_all_intact();
    let s = p.server_conn().unwrap().stats();
    assert!(
        s.key_updates >= 5,
        "server updated keys {} times",
        s.key_updates
    );
}

/// The server's 1-RTT key, worn to `packets` short of the confidentiality limit of its AEAD
/// (AES-GCM here: 2^23 packets, RFC 9001 §6.6).
fn wear_server_key(p: &mut quic::Pair, short_of_limit: u64) {
    let node = p.server_mut();
    let h = node.ep.handles().next().unwrap();
    let c = node.ep.connection_mut(h).unwrap();
    let suite = c.stats().cipher_suite.unwrap_or_default();
    assert!(suite.contains("AES"), "{suite}");
    c.wear_key((1 << 23) - short_of_limit);
}

/// RFC 9001 §6.6: however long the configured interval, the key is updated before the AEAD's
/// confidentiality limit.
#[test]
fn keys_are_updated_before_the_confidentiality_limit() {
    let mut t = TransportConfig::default();
    t.key_update_interval = u64::MAX;
    let mut p = mid_download(53, t);
    // An eighth of the limit before it, and a little more.
    wear_server_key(&mut p, (1 << 20) - 10);
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
    assert_eq!(p.server_conn().unwrap().stats().key_updates, 1);
}

/// RFC 9001 §6.6: a key that cannot be updated in time (the last update is not acknowledged
/// yet) is not used past the confidentiality limit; the connection closes with
/// AEAD_LIMIT_REACHED. Before, packets went on under the worn key.
#[test]
fn a_key_that_cannot_be_updated_by_the_confidentiality_limit_closes_the_connection() {
    let mut p = mid_download(54, TransportConfig::default());
    assert!(initiate_key_update(&mut p, false));
    // Before any packet of the new phase is acknowledged.
    wear_server_key(&mut p, 100);
    p.net.run_for(Duration::from_millis(1));
    let aead_limit =
        |e: Option<&kuai_proto::ConnectionError>| format!("{e:?}").contains("AEAD_LIMIT_REACHED");
    let s = p.server_conn().unwrap();
    assert!(
        s.is_closed() && aead_limit(s.close_reason()),
        "{:?}",
        s.close_reason()
    );
    p.net.run_for(Duration::from_secs(1));
    let lost = p.client_app().lost.as_ref();
    assert!(aead_limit(lost), "client: {lost:?}");
}

#[test]
fn idle_timeout_closes_both_sides() {
    let mut t = TransportConfig::default();
    t.max_idle_timeout = Duration::from_secs(2);
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        60,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    let done = p.net.now();
    p.net.run_for(Duration::from_secs(5));
    assert_eq!(
        p.client_app().lost,
        Some(kuai_proto::ConnectionError::TimedOut)
    );
    assert!(
        p.client().ep.connection(p.ch).is_none(),
        "client connection drained"
    );
    assert_eq!(
        p.server().ep.connection_count(),
        0,
        "server connection drained"
    );
    let (t_lost, _, _) = p
        .client()
        .events
        .iter()
        .find(|(_, _, e)| matches!(e, kuai_proto::Event::ConnectionLost(_)))
        .unwrap()
        .clone();
    let idle = t_lost - done;
    assert!(
        idle >= Duration::from_millis(1900) && idle < Duration::from_millis(2500),
        "idle {idle:?}"
    );
}

#[test]
fn keep_alive_prevents_idle_timeout() {
    let mut t = TransportConfig::default();
    t.max_idle_timeout = Duration::from_secs(2);
    t.keep_alive_interval = Some(Duration::from_millis(500));
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        61,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_secs(10));
    assert!(p.client_app().lost.is_none());
    assert!(p.client_conn().is_established());
}

/// An idle connection with a stream the peer may still send on (an HTTP/3 control stream)
/// stays quiet: the receiver's stall probe fires once per quiet spell, not every second.
/// A client that only downloads sends nothing but ACKs after the handshake, and ACK-only
/// packets are never acknowledged: its first key update must not wait for an
/// acknowledgment (RFC 9001 §6.1 asks one only before a subsequent update).
#[test]
fn receiver_that_only_acks_can_update_keys() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        64,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_millis(500));
    let ch = p.ch;
    let conn = p.client_mut().ep.connection_mut(ch).unwrap();
    assert!(conn.initiate_key_update(), "first key update refused");
    assert!(
        !conn.initiate_key_update(),
        "a second update before the first is acknowledged"
    );
}

/// A paced download: the client's ACKs (not ack-eliciting) draw no ACK-only packets from the
/// server (RFC 9000 §13.2.1). The server's ACKs of the client's few ack-eliciting packets
/// ride on its data packets; before, each client ACK that arrived while the pacer held the
/// data back drew one (276 in a 10 MiB download in the lab).
#[test]
fn a_senders_acks_ride_on_its_data() {
    use std::sync::{Arc, Mutex};
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        66,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([4 << 20]),
        |n| n.set_default_link(bottleneck(15, 0.0, 20_000_000, 100_000)),
    );
    let s = p.server;
    let small = Arc::new(Mutex::new(0u32));
    let counted = small.clone();
    p.net.set_filter(move |ctx| {
        // A 1-RTT packet with nothing but an ACK frame is well under 64 bytes.
        if ctx.from_node == s && ctx.data.len() < 64 {
            *counted.lock().unwrap() += 1;
        }
        common::sim::Verdict::Pass
    });
    assert!(p.run_until_done(Duration::from_secs(30)));
    p.client_app().assert_all_intact();
    let small = *small.lock().unwrap();
    let client_sent = p.client_conn().stats().packets_sent;
    eprintln!("server: {small} small datagrams; client sent {client_sent} packets");
    assert!(small <= 10, "{small} ACK-only datagrams from the server");
}

/// A 10 KB response fits the initial window: it arrives one round trip after the handshake,
/// not held back by an MTU probe taking part of that window.
#[test]
fn small_response_arrives_in_one_flight() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        65,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([10_000]),
        |n| n.set_default_link(link(50, 0.0)),
    );
    let start = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(5)));
    let took = p.client_app().requests[0].done_at.unwrap() - start;
    // Handshake (1 RTT) + request and response (1 RTT), plus a little processing.
    assert!(
        took < Duration::from_millis(230),
        "10 KB took {took:?} at 100 ms RTT"
    );
}

/// After a quiet spell a connection gives back its buffers and drops the records of packets
/// not in flight; when traffic resumes (here after a keep-alive PING) it carries on through
/// loss as before.
#[test]
fn traffic_resumes_after_a_quiet_spell() {
    let mut t = TransportConfig::default();
    t.keep_alive_interval = Some(Duration::from_secs(3));
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        66,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([40_000, 3_000]),
        |n| n.set_default_link(link(20, 0.05)),
    );
    assert!(p.run_until_done(Duration::from_secs(10)));
    // Quiet for longer than the spell (1 s) but shorter than the keep-alive interval.
    p.net.run_for(Duration::from_millis(2500));
    let more: Vec<_> = Client::with_requests([200_000, 100, 60_000]).requests;
    p.client_mut().app_mut::<Client>().requests.extend(more);
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
}

/// A quiet connection gives back its next-phase 1-RTT keys; an update by either side after
/// the spell must still go through (the receiver derives them again on the next packet).
#[test]
fn key_updates_after_a_quiet_spell() {
    for client_side in [true, false] {
        let mut t = TransportConfig::default();
        t.keep_alive_interval = Some(Duration::from_secs(3));
        let ccfg = quic::client_config(t.clone());
        let mut p = quic::pair_with(
            67 + client_side as u64,
            quic::server_config(t),
            &ccfg,
            Client::with_requests([40_000]),
            |n| n.set_default_link(link(20, 0.0)),
        );
        assert!(p.run_until_done(Duration::from_secs(10)));
        p.net.run_for(Duration::from_millis(2500));
        let updated = initiate_key_update(&mut p, client_side);
        assert!(updated, "key update allowed");
        let more: Vec<_> = Client::with_requests([300_000, 2_000]).requests;
        p.client_mut().app_mut::<Client>().requests.extend(more);
        assert!(p.run_until_done(Duration::from_secs(20)));
        p.client_app().assert_all_intact();
        assert_eq!(p.client_conn().stats().key_updates, 1);
        assert_eq!(p.server_conn().unwrap().stats().key_updates, 1);
    }
}

#[test]
fn idle_open_stream_does_not_ping_forever() {
    let mut t = TransportConfig::default();
    t.max_idle_timeout = Duration::from_secs(60);
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        63,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    let ch = p.ch;
    let conn = p.client_mut().ep.connection_mut(ch).unwrap();
    let id = conn.open_stream(kuai_proto::Dir::Uni).unwrap();
    conn.write(id, bytes::Bytes::from_static(b"control"))
        .unwrap();
    p.net.run_for(Duration::from_secs(2));
    let before = p.server_conn().unwrap().stats().packets_sent;
    p.net.run_for(Duration::from_secs(30));
    let during = p.server_conn().unwrap().stats().packets_sent - before;
    assert!(
        during <= 2,
        "server sent {during} packets in 30 idle seconds"
    );
    assert!(p.client_conn().is_established());
}

#[test]
fn application_close_reaches_the_peer() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        62,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    let ch = p.ch;
    let now = p.net.now();
    p.client_mut()
        .ep
        .connection_mut(ch)
        .unwrap()
        .close(now, 42, b"done here");
    p.net.run_for(Duration::from_secs(3));
    let server_saw = p.server().saw(|e| {
        matches!(e, kuai_proto::Event::ConnectionLost(kuai_proto::ConnectionError::ApplicationClosed { code: 42, reason }) if &reason[..] == b"done here")
    });
    assert!(server_saw, "server saw the application close");
    assert_eq!(p.server().ep.connection_count(), 0);
    assert_eq!(p.client().ep.connection_count(), 0);
}

#[test]
fn compatible_version_negotiation_v1_to_v2() {
    let ccfg = quic::client_config(TransportConfig::default());
    assert_eq!(ccfg.version, kuai_proto::Version::V1);
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.versions = vec![kuai_proto::Version::V2, kuai_proto::Version::V1];
    let mut p = pair(70, scfg, &ccfg, Client::with_requests([100_000]));
    p.net.record(true);
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert_eq!(p.client_conn().version(), kuai_proto::Version::V2);
    assert_eq!(p.server_conn().unwrap().version(), kuai_proto::Version::V2);
    // The client's first Initial was v1; the server answered in v2.
    let log = p.net.log();
    let first = log
        .iter()
        .find(|e| e.from_addr == quic::client_addr())
        .unwrap();
    assert_eq!(first.len, 1200);
}

#[test]
fn v2_only_server_sends_version_negotiation_to_v1_only_client() {
    let mut ccfg = quic::client_config(TransportConfig::default());
    ccfg.versions = vec![kuai_proto::Version::V1];
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.versions = vec![kuai_proto::Version::V2];
    let mut p = pair(71, scfg, &ccfg, Client::with_requests([100]));
    p.run_until(Duration::from_secs(3), |p| p.client_app().lost.is_some());
    assert_eq!(
        p.client_app().lost,
        Some(kuai_proto::ConnectionError::VersionMismatch)
    );
    assert_eq!(p.server().ep.stats().version_negotiations_sent, 1);
}

#[test]
fn nat_rebinding_in_the_middle_of_a_transfer() {
    let mut p = mid_download(80, TransportConfig::default());
    // The NAT gives the client a new port; the client knows nothing of it.
    let new_addr: std::net::SocketAddr = "10.0.0.2:50123".parse().unwrap();
    let c = p.client;
    p.net.set_address(c, new_addr);
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    let s = p.server_conn().unwrap();
    assert_eq!(s.remote_address(), new_addr);
    assert!(
        p.server()
            .saw(|e| matches!(e, kuai_proto::Event::PathMigrated { to, .. } if *to == new_addr))
    );
    assert!(
        p.server()
            .saw(|e| matches!(e, kuai_proto::Event::PathValidated(a) if *a == new_addr))
    );
}

#[test]
fn nat_rebinding_to_a_new_address() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        81,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([3 << 20]),
    );
    assert!(p.run_until(
        Duration::from_secs(10),
        |p| p.client_app().requests[0].received > (1 << 20)
    ));
    let new_addr: std::net::SocketAddr = "10.0.0.9:40000".parse().unwrap();
    let c = p.client;
    p.net.set_address(c, new_addr);
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    assert_eq!(p.server_conn().unwrap().remote_address(), new_addr);
}

#[test]
fn client_migration_with_a_new_connection_id() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        82,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([4 << 20]),
    );
    // The server's connection IDs for the client, by the address they were sent to.
    let cid_len = p.client_conn().local_cids().next().unwrap().len();
    type Sent = Vec<(std::net::SocketAddr, Vec<u8>)>;
    let sent: std::rc::Rc<std::cell::RefCell<Sent>> = Default::default();
    let seen = sent.clone();
    let s = p.server;
    p.net.set_filter(move |ctx| {
        if ctx.from_node == s && ctx.data[0] & 0x80 == 0 {
            seen.borrow_mut()
                .push((ctx.to, ctx.data[1..1 + cid_len].to_vec()));
        }
        common::sim::Verdict::Pass
    });
    assert!(p.run_until(
        Duration::from_secs(10),
        |p| p.client_app().requests[0].received > (1 << 20)
    ));
    let old_dcid_count = p.server_conn().unwrap().local_cids().count();
    assert!(old_dcid_count >= 2, "server issued spare CIDs");
    // The application moves to a new socket (e.g. Wi-Fi to cellular) and tells the connection.
    let new_addr: std::net::SocketAddr = "10.0.1.7:41000".parse().unwrap();
    let c = p.client;
    p.net.set_address(c, new_addr);
    let now = p.net.now();
    let ch = p.ch;
    p.client_mut()
        .ep
        .connection_mut(ch)
        .unwrap()
        .migrate(now, Some(new_addr.ip()))
        .unwrap();
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    assert_eq!(p.server_conn().unwrap().remote_address(), new_addr);
    assert!(
        p.client()
            .saw(|e| matches!(e, kuai_proto::Event::PathValidated(_)))
    );
    assert_eq!(p.client_conn().stats().migrations, 1);
    // RFC 9000 §9.5: the server moved to a new ID of the client's too; none went to both
    // addresses (an observer would link the paths).
    let sent = sent.borrow();
    let to_new: std::collections::HashSet<&Vec<u8>> = sent
        .iter()
        .filter(|(a, _)| *a == new_addr)
        .map(|(_, c)| c)
        .collect();
    let to_old: std::collections::HashSet<&Vec<u8>> = sent
        .iter()
        .filter(|(a, _)| *a != new_addr)
        .map(|(_, c)| c)
        .collect();
    assert!(!to_new.is_empty() && !to_old.is_empty());
    assert!(to_new.is_disjoint(&to_old), "{to_new:02x?} {to_old:02x?}");
}

/// RFC 9000 §9: a client discards packets from a server address it does not know, here a
/// copy of one of the server's own packets (lost on its way) relayed from elsewhere: not
/// processed, counted as dropped. The packet echoes a datagram, which the client would
/// otherwise have taken from it.
#[test]
fn a_client_drops_packets_from_an_unknown_server_address() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        83,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::default(),
    );
    p.server_mut().app_mut::<quic::Server>().echo_datagrams = true;
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.client_app().connected_at.is_some()
    }));
    p.net.run_for(Duration::from_millis(200));
    // The server's next 1-RTT datagram (the echo) is kept and lost on the way.
    let copy: std::rc::Rc<std::cell::RefCell<Option<Vec<u8>>>> = Default::default();
    let keep = copy.clone();
    let s = p.server;
    p.net.set_filter(move |ctx| {
        if ctx.from_node == s && ctx.data[0] & 0x80 == 0 && keep.borrow().is_none() {
            *keep.borrow_mut() = Some(ctx.data.clone());
            return common::sim::Verdict::Drop;
        }
        common::sim::Verdict::Pass
    });
    let ch = p.ch;
    let conn = p.client_mut().ep.connection_mut(ch).unwrap();
    conn.send_datagram(bytes::Bytes::from_static(b"echo me"))
        .unwrap();
    p.net.run_for(Duration::from_millis(100));
    let copy = copy.borrow().clone().expect("the server's echo");
    let before = p.client_conn().stats().packets_dropped;
    let elsewhere: std::net::SocketAddr = "203.0.113.5:4433".parse().unwrap();
    p.net
        .inject(elsewhere, quic::client_addr(), None, copy, Duration::ZERO);
    p.net.run_for(Duration::from_millis(10));
    let conn = p.client_mut().ep.connection_mut(ch).unwrap();
    assert_eq!(conn.recv_datagram(), None, "taken from an unknown address");
    assert_eq!(p.client_conn().stats().packets_dropped, before + 1);
}

/// A server behind an address clients reach first (say an anycast or load-balanced one)
/// that prefers its own address for the rest of the connection.
fn preferred_address_pair(
    seed: u64,
    client_transport: TransportConfig,
) -> (quic::Pair, std::net::SocketAddr) {
    preferred_address_pair_at(seed, client_transport, "10.0.9.1:4434".parse().unwrap())
}

fn preferred_address_pair_at(
    seed: u64,
    client_transport: TransportConfig,
    preferred: std::net::SocketAddr,
) -> (quic::Pair, std::net::SocketAddr) {
    let scfg = server_config_preferring(preferred);
    let ccfg = quic::client_config(client_transport);
    let p = pair(seed, scfg, &ccfg, Client::with_requests([4 << 20]));
    (p, preferred)
}

/// A server configuration offering the IPv4 address `preferred` (RFC 9000 §9.6).
fn server_config_preferring(preferred: std::net::SocketAddr) -> kuai_proto::ServerConfig {
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.preferred_address = Some(kuai_proto::config::PreferredAddressConfig {
        v4: match preferred {
            std::net::SocketAddr::V4(a) => Some(a),
            _ => None,
        },
        v6: None,
    });
    scfg
}

#[test]
fn client_moves_to_the_server_preferred_address() {
    let (mut p, preferred) = preferred_address_pair(84, TransportConfig::default());
    let s = p.server;
    p.net.add_address(s, preferred);
    p.net.record(true);
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    // RFC 9000 §9.6.1: the client validated the address, then moved all its traffic there,
    // with the connection ID the server gave for it (sequence 1).
    let c = p.client_conn();
    assert_eq!(c.remote_address(), preferred);
    assert_eq!(c.stats().migrations, 1);
    assert!(
        p.client()
            .saw(|e| matches!(e, kuai_proto::Event::PathValidated(a) if *a == preferred))
    );
    // The server validated the path from its preferred address and answers from it.
    assert!(
        p.server()
            .saw(|e| matches!(e, kuai_proto::Event::PathValidated(a) if *a == quic::client_addr()))
    );
    let log = p.net.log();
    let last_from_server = log
        .iter()
        .rev()
        .find(|e| e.to_addr == quic::client_addr())
        .unwrap();
    assert_eq!(last_from_server.from_addr, preferred);
    let to_preferred = log.iter().filter(|e| e.to_addr == preferred).count();
    assert!(
        to_preferred > 100,
        "the transfer went on at the preferred address"
    );
    // Nothing but probes crossed to the preferred address before the handshake was
    // confirmed, and the original address saw no traffic from the client at the end.
    let last_to_original = log
        .iter()
        .rev()
        .find(|e| e.to_addr == quic::server_addr())
        .unwrap()
        .time;
    let first_to_preferred = log.iter().find(|e| e.to_addr == preferred).unwrap().time;
    assert!(last_to_original < log.last().unwrap().time);
    assert!(first_to_preferred > log[0].time);
}

/// Makes 6-byte CIDs that start with 0xc1 0xd0 (a stand-in for routable IDs, as QUIC-LB's).
struct PrefixedCids(u8);

impl kuai_proto::ConnectionIdGenerator for PrefixedCids {
    fn generate(&mut self) -> kuai_proto::ConnectionId {
        self.0 = self.0.wrapping_add(1);
        kuai_proto::ConnectionId::new(&[0xc1, 0xd0, 1, 2, 3, self.0])
    }
    fn cid_len(&self) -> usize {
        6
    }
}

/// The CID offered with the preferred address comes from the endpoint's generator like
/// every other: a load balancer or a multi-worker host routes it, and it has the length the
/// endpoint parses short headers with.
#[test]
fn the_preferred_address_cid_comes_from_the_endpoint_generator() {
    let preferred: std::net::SocketAddr = "10.0.9.1:4434".parse().unwrap();
    let scfg = server_config_preferring(preferred);
    let ecfg = kuai_proto::EndpointConfig {
        cid_generator: std::sync::Arc::new(|| Box::new(PrefixedCids(0))),
        ..Default::default()
    };
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with_endpoint(
        85,
        ecfg,
        scfg,
        &ccfg,
        Client::with_requests([1 << 20]),
        |_| {},
    );
    let s = p.server;
    p.net.add_address(s, preferred);
    let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen2 = seen.clone();
    let c = p.client;
    p.net.set_filter(move |ctx| {
        if ctx.from_node == c && ctx.to == preferred && ctx.data[0] & 0x80 == 0 {
            seen2.borrow_mut().push(ctx.data[1..7].to_vec());
        }
        common::sim::Verdict::Pass
    });
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    assert_eq!(p.client_conn().remote_address(), preferred);
    let seen = seen.borrow();
    assert!(!seen.is_empty());
    assert!(
        seen.iter().all(|d| d[..2] == [0xc1, 0xd0]),
        "{:02x?}",
        &seen[..]
    );
}

/// Packets the client sent to the original address before it moved (and retired that
/// address's CID) arrive after the retirement: the server must still route them to the
/// connection, not answer them with a stateless reset that ends it.
#[test]
fn late_packets_with_a_retired_cid_do_not_draw_a_stateless_reset() {
    let mut resets = 0;
    for seed in 0..12 {
        let (mut p, preferred) = preferred_address_pair(300 + seed, TransportConfig::default());
        let (s, c) = (p.server, p.client);
        p.net.add_address(s, preferred);
        p.net.set_link(
            c,
            s,
            LinkConfig {
                reorder: 0.3,
                reorder_delay: Duration::from_millis(40),
                ..LinkConfig::default()
            },
        );
        assert!(p.run_until_done(Duration::from_secs(30)), "seed {seed}");
        p.client_app().assert_all_intact();
        assert_eq!(p.client_conn().remote_address(), preferred);
        resets += p.server().ep.stats().stateless_resets_sent;
    }
    assert_eq!(resets, 0);
}

#[test]
fn unreachable_preferred_address_keeps_the_original_one() {
    // The server advertises an address nothing answers on.
    let (mut p, preferred) = preferred_address_pair(85, TransportConfig::default());
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    let c = p.client_conn();
    assert_eq!(c.remote_address(), quic::server_addr());
    assert_eq!(c.stats().migrations, 0);
    // Keep the connection alive past the probe's deadline.
    p.net.run_for(Duration::from_secs(3));
    assert!(
        p.client()
            .saw(|e| matches!(e, kuai_proto::Event::PathValidationFailed(a) if *a == preferred))
    );
    assert_eq!(p.client_conn().remote_address(), quic::server_addr());
}

/// RFC 9000 §21.5.6: a server that is not on loopback cannot point the client at a loopback
/// address (or a multicast or broadcast one) and make it send there.
#[test]
fn suspicious_preferred_addresses_are_not_probed() {
    for (i, addr) in ["127.0.0.1:4434", "224.0.0.1:4434", "255.255.255.255:4434"]
        .iter()
        .enumerate()
    {
        let (p, preferred) = preferred_address_pair_at(
            87 + i as u64,
            TransportConfig::default(),
            addr.parse().unwrap(),
        );
        assert_stays_off_the_preferred_address(p, preferred);
    }
}

/// Runs the transfer with the server reachable at `preferred` too, and checks that the client
/// finished it at the original address without sending anything to `preferred`.
fn assert_stays_off_the_preferred_address(mut p: quic::Pair, preferred: std::net::SocketAddr) {
    let s = p.server;
    p.net.add_address(s, preferred);
    p.net.record(true);
    assert!(p.run_until_done(Duration::from_secs(20)));
    p.client_app().assert_all_intact();
    assert_eq!(p.client_conn().remote_address(), quic::server_addr());
    assert!(
        !p.net.log().iter().any(|e| e.to_addr == preferred),
        "{preferred} was probed"
    );
}

#[test]
fn client_can_decline_the_preferred_address() {
    let transport = TransportConfig {
        migrate_to_preferred_address: false,
        ..TransportConfig::default()
    };
    let (p, preferred) = preferred_address_pair(86, transport);
    assert_stays_off_the_preferred_address(p, preferred);
}

#[test]
fn stateless_reset_after_server_restart() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        90,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([1000]),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    // The server loses all connection state but keeps its configuration, and so its reset
    // key (a restart).
    let node = p.server_mut();
    assert_eq!(node.ep.connection_count(), 1);
    node.ep.forget_all_connections();
    // The client sends something; the server answers with a stateless reset.
    let ch = p.ch;
    let cnode = p.client_mut();
    let conn = cnode.ep.connection_mut(ch).unwrap();
    let id = conn.open_stream(kuai_proto::Dir::Bi).unwrap();
    conn.write(id, bytes::Bytes::from_static(b"GET 10"))
        .unwrap();
    p.net.run_for(Duration::from_secs(1));
    eprintln!(
        "server {:?} client {:?}",
        p.server().ep.stats(),
        p.client().ep.connection(ch).map(|c| c.stats())
    );
    assert_eq!(
        p.client_app().lost,
        Some(kuai_proto::ConnectionError::Reset)
    );
    assert!(p.server().ep.stats().stateless_resets_sent >= 1);
    assert_eq!(p.client().ep.connection_count(), 0);
}

/// Bytes sent from `from` to `to` in the log up to `until` (send time).
fn bytes_sent(
    log: &[common::sim::LogEntry],
    from: std::net::SocketAddr,
    to: std::net::SocketAddr,
    until: std::time::Instant,
) -> u64 {
    log.iter()
        .filter(|e| e.from_addr == from && e.to_addr == to && e.time <= until)
        .map(|e| e.len as u64)
        .sum()
}

#[test]
fn amplification_limit_never_exceeded() {
    let certs = quic::big_certs();
    let mut scfg = kuai_proto::ServerConfig::new(std::sync::Arc::new(quic::server_tls_with(certs)));
    scfg.transport = std::sync::Arc::new(TransportConfig::default());
    let ccfg = kuai_proto::ClientConfig::new(std::sync::Arc::new(quic::client_tls_with(certs)));
    // Drop everything the client sends after its first datagram for the first 3 seconds, so
    // the server can only ever count that one datagram.
    let mut p = quic::pair_with(100, scfg, &ccfg, Client::with_requests([1000]), |n| {
        let mut first = true;
        let start = n.now();
        n.set_filter(move |ctx| {
            if ctx.from == quic::client_addr() && ctx.now < start + Duration::from_secs(3) {
                if first {
                    first = false;
                    return common::sim::Verdict::Pass;
                }
                return common::sim::Verdict::Drop;
            }
            common::sim::Verdict::Pass
        });
    });
    p.net.record(true);
    p.net.run_for(Duration::from_secs(3));
    let log = p.net.log().to_vec();
    let t = p.net.now();
    let received = log
        .iter()
        .filter(|e| e.from_addr == quic::client_addr() && e.delivered)
        .map(|e| e.len as u64)
        .sum::<u64>();
    let sent = bytes_sent(&log, quic::server_addr(), quic::client_addr(), t);
    assert_eq!(received, 1200);
    assert!(
        sent <= 3 * received,
        "server sent {sent} bytes for {received} received"
    );
    assert!(sent >= 3000, "server used its budget ({sent})");
    // Once the client gets through, the handshake completes despite the big certificate.
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
}

#[test]
fn amplification_limit_holds_for_every_prefix_of_a_large_first_flight() {
    let certs = quic::big_certs();
    let mut scfg = kuai_proto::ServerConfig::new(std::sync::Arc::new(quic::server_tls_with(certs)));
    scfg.transport = std::sync::Arc::new(TransportConfig::default());
    let ccfg = kuai_proto::ClientConfig::new(std::sync::Arc::new(quic::client_tls_with(certs)));
    // Remember which client datagrams carry a Handshake packet (those validate the address).
    let handshake_dgrams = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let hd = handshake_dgrams.clone();
    let mut p = quic::pair_with(101, scfg, &ccfg, Client::with_requests([1000]), |n| {
        n.set_default_link(LinkConfig {
            loss: 0.2,
            ..link(30, 0.0)
        });
        n.set_filter(move |ctx| {
            if ctx.from == quic::client_addr() && has_handshake_packet(ctx.data) {
                hd.borrow_mut().push((ctx.now, ctx.data.len()));
            }
            common::sim::Verdict::Pass
        });
    });
    p.net.record(true);
    assert!(p.run_until_done(Duration::from_secs(30)));
    p.client_app().assert_all_intact();
    // Until the server got a Handshake packet it could only count delivered client bytes:
    // check the bound at every server send before the handshake completed on the server.
    let log = p.net.log();
    let hs = handshake_dgrams.borrow();
    let server_done = log
        .iter()
        .filter(|e| {
            e.delivered && e.from_addr == quic::client_addr() && hs.contains(&(e.time, e.len))
        })
        .filter_map(|e| e.arrival)
        .min()
        .expect("a client Handshake packet arrived");
    let mut received = 0u64;
    let mut sent = 0u64;
    let mut events: Vec<(std::time::Instant, bool, u64)> = Vec::new();
    for e in log {
        if e.from_addr == quic::client_addr() {
            if let Some(a) = e.arrival.filter(|_| e.delivered) {
                events.push((a, true, e.len as u64));
            }
        } else if e.from_addr == quic::server_addr() {
            events.push((e.time, false, e.len as u64));
        }
    }
    events.sort_by_key(|x| (x.0, !x.1));
    for (t, rx, len) in events {
        // From the arrival of the first client Handshake packet on, the address is validated.
        if t >= server_done {
            break;
        }
        if rx {
            received += len;
        } else {
            sent += len;
            assert!(
                sent <= 3 * received,
                "at {:?}: sent {sent} > 3 x {received}",
                t - p.net.base()
            );
        }
    }
}

#[test]
fn flow_control_limits_are_never_exceeded() {
    let mut t = TransportConfig::default();
    t.stream_receive_window = 16 * 1024;
    t.max_stream_receive_window = 16 * 1024;
    t.receive_window = 40 * 1024;
    t.max_receive_window = 40 * 1024;
    let ccfg = quic::client_config(t.clone());
    let mut p = pair(
        110,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([300_000, 200_000, 100_000, 50_000]),
    );
    let mut checks = 0;
    let ok = p.run_until(Duration::from_secs(60), |p| {
        if let Some(s) = p.server_conn() {
            let (sent, peer_max, _, _) = s.flow_control();
            assert!(
                sent <= peer_max,
                "server sent {sent} beyond the client's limit {peer_max}"
            );
            let (_, _, received, local_max) = p.client_conn().flow_control();
            assert!(received <= local_max);
            checks += 1;
        }
        p.client_app().all_done()
    });
    assert!(ok);
    assert!(
        checks > 100,
        "only {checks} checks in {:?}",
        p.net.elapsed()
    );
    p.client_app().assert_all_intact();
    // The small windows were the bottleneck: the limit was hit and raised many times.
    let (_, _, received, local_max) = p.client_conn().flow_control();
    assert!(
        received >= 650_000 && local_max >= received,
        "received {received} limit {local_max}"
    );
}

#[test]
fn receive_windows_auto_tune_up_to_the_cap() {
    let mut t = TransportConfig::default();
    t.stream_receive_window = 64 * 1024;
    t.max_stream_receive_window = 8 << 20;
    t.receive_window = 128 * 1024;
    t.max_receive_window = 16 << 20;
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        111,
        quic::server_config(t.clone()),
        &ccfg,
        Client::with_requests([16 << 20]),
        |n| n.set_default_link(bottleneck(25, 0.0, 200_000_000, 1 << 20)),
    );
    assert!(p.run_until_done(Duration::from_secs(60)));
    p.client_app().assert_all_intact();
    let elapsed = p.net.elapsed();
    // With a fixed 64 KiB window over 50 ms the transfer would take over 12 s; auto-tuning
    // must lift it close to the link rate.
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}");
    let (_, _, _, local_max) = p.client_conn().flow_control();
    assert!(local_max > 4 << 20, "connection window grew to {local_max}");
}

/// A receiver whose application stops reading grants no more than the window it had: the
/// sender's STREAM_DATA_BLOCKED / DATA_BLOCKED, each answered with the current limit, must not
/// grow the window (they said nothing about the reader), or the receiver buffers up to the
/// auto-tuning caps on the sender's say-so.
#[test]
fn a_reader_that_stops_reading_grants_no_more() {
    let t = TransportConfig::default();
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        112,
        quic::server_config(t.clone()),
        &ccfg,
        Client::with_requests([64 << 20]),
        |n| n.set_default_link(bottleneck(10, 0.0, 100_000_000, 1 << 20)),
    );
    assert!(p.run_until(Duration::from_secs(10), |p| {
        p.client_app().requests[0].received > 0
    }));
    p.client_mut().app_mut::<Client>().paused = true;
    let (_, _, before_received, before_max) = p.client_conn().flow_control();
    // Two seconds of a blocked sender: it says so once per limit, and each probe timeout's
    // packet may carry the blocked frames again.
    p.run_until(Duration::from_secs(2), |_| false);
    let (_, _, received, local_max) = p.client_conn().flow_control();
    assert!(p.client_app().lost.is_none());
    assert!(
        received >= t.stream_receive_window,
        "the sender used what it was given: {received} bytes"
    );
    assert!(
        received <= before_received + t.stream_receive_window
            && local_max <= before_received + t.receive_window,
        "{received} bytes received, the connection limit went from {before_max} to \
         {local_max}, with nothing read after {before_received} bytes"
    );
    let buffered = p.client_conn().memory().receive;
    assert!(
        buffered <= t.stream_receive_window + (256 << 10),
        "{buffered} bytes buffered for a stream whose window is {}",
        t.stream_receive_window
    );
}

fn has_handshake_packet(data: &[u8]) -> bool {
    let mut rest = Some(bytes::BytesMut::from(data));
    while let Some(d) = rest.take() {
        let Ok((pd, r)) = kuai_proto::packet::PartialDecode::new(d, 8) else {
            return false;
        };
        if pd.ty() == kuai_proto::packet::PacketType::Long(kuai_proto::packet::LongType::Handshake)
        {
            return true;
        }
        rest = r;
    }
    false
}

/// Records the kinds of packets a connection processed, and when its handshake completed.
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>);

impl kuai_proto::trace::Tracer for Recorder {
    fn event(&mut self, _t: std::time::Instant, ev: &kuai_proto::trace::TraceEvent<'_>) {
        use kuai_proto::trace::{PacketKind, TraceEvent};
        let mut v = self.0.lock().unwrap();
        match ev {
            TraceEvent::PacketReceived {
                kind: PacketKind::OneRtt,
                ..
            } => v.push("1rtt"),
            TraceEvent::ConnectionStateUpdated {
                new: "handshake_complete",
            } => v.push("complete"),
            TraceEvent::CongestionStateUpdated { state, .. } => v.push(state),
            _ => {}
        }
    }
}

#[test]
fn server_holds_1rtt_packets_until_the_client_finished_arrives() {
    let ccfg = quic::client_config(TransportConfig::default());
    // Drop the client's first datagram that carries a Handshake packet (its Finished), so
    // its 1-RTT requests reach the server before the handshake can complete.
    let mut p = quic::pair_with(
        120,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([1000, 2000]),
        |n| {
            let mut dropped = false;
            n.set_filter(move |ctx| {
                if !dropped && ctx.from == quic::client_addr() && has_handshake_packet(ctx.data) {
                    dropped = true;
                    // Cut the Handshake packet out, keep whatever else was coalesced (1-RTT).
                    let rest = without_handshake_packets(ctx.data);
                    if rest.is_empty() {
                        return common::sim::Verdict::Drop;
                    }
                    *ctx.data = rest;
                }
                common::sim::Verdict::Pass
            });
        },
    );
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    assert!(
        p.run_until(Duration::from_secs(1), |p| p.server().ep.connection_count()
            == 1)
    );
    let h = p.server().ep.handles().next().unwrap();
    p.server_mut()
        .ep
        .connection_mut(h)
        .unwrap()
        .set_tracer(Box::new(Recorder(log.clone())));
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
    let v = log.lock().unwrap();
    let complete = v
        .iter()
        .position(|e| *e == "complete")
        .expect("handshake completed");
    assert!(
        !v[..complete].contains(&"1rtt"),
        "1-RTT processed before completion: {v:?}"
    );
    assert!(v[complete..].contains(&"1rtt"));
}

fn without_handshake_packets(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = Some(bytes::BytesMut::from(data));
    while let Some(d) = rest.take() {
        let Ok((pd, r)) = kuai_proto::packet::PartialDecode::new(d, 8) else {
            break;
        };
        if pd.ty() != kuai_proto::packet::PacketType::Long(kuai_proto::packet::LongType::Handshake)
        {
            out.extend_from_slice(pd.data());
        }
        rest = r;
    }
    out
}

#[test]
fn version_negotiation_restarts_in_a_common_version() {
    // The client starts in v1 and also speaks v2; the server speaks only v2.
    let ccfg = quic::client_config(TransportConfig::default());
    let mut scfg = quic::server_config(TransportConfig::default());
    scfg.versions = vec![kuai_proto::Version::V2];
    let mut p = pair(72, scfg, &ccfg, Client::with_requests([10_000]));
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
    assert_eq!(p.client_conn().version(), kuai_proto::Version::V2);
    assert_eq!(p.server().ep.stats().version_negotiations_sent, 1);
}

#[test]
fn rtt_estimate_follows_a_change_of_path_delay() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        130,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([40 << 20]),
        |n| n.set_default_link(bottleneck(10, 0.0, 50_000_000, 1 << 20)),
    );
    assert!(p.run_until(
        Duration::from_secs(10),
        |p| p.client_app().requests[0].received > (4 << 20)
    ));
    let before = p.server_conn().unwrap().stats().path.min_rtt;
    assert!(
        before >= Duration::from_millis(20) && before < Duration::from_millis(25),
        "{before:?}"
    );
    // The path gets 80 ms longer each way; within a few round trips the estimate follows.
    let (s, c) = (p.server, p.client);
    p.net
        .modify_link_both(s, c, |l| l.delay = Duration::from_millis(90));
    p.net.run_for(Duration::from_secs(2));
    let srtt = p.server_conn().unwrap().stats().path.rtt;
    assert!(
        srtt >= Duration::from_millis(170),
        "smoothed RTT {srtt:?} after the change"
    );
}

/// Completion times of sequential 10 KB requests on one warm connection over a link losing
/// `loss` of the packets each way at 40 ms RTT (lab experiment 1), the first one left out.
fn warm_10k_times(t: TransportConfig, loss: f64, seed: u64) -> (Vec<Duration>, u64) {
    let ccfg = quic::client_config(t.clone());
    let mut client = Client::with_requests(vec![10_000; 81]);
    client.concurrency = 1;
    let mut p = quic::pair_with(seed, quic::server_config(t), &ccfg, client, |n| {
        n.set_default_link(link(20, loss))
    });
    assert!(p.run_until_done(Duration::from_secs(300)));
    let done: Vec<_> = p
        .client_app()
        .requests
        .iter()
        .map(|r| r.done_at.unwrap())
        .collect();
    let copies = p.server_conn().unwrap().stats().redundant_packets;
    (done.windows(2).map(|w| w[1] - w[0]).collect(), copies)
}

fn share_within(times: &[Duration], limit: Duration) -> f64 {
    times.iter().filter(|&&t| t <= limit).count() as f64 / times.len() as f64
}

#[test]
fn redundancy_cuts_the_tail_of_small_responses_under_heavy_loss() {
    use kuai_proto::cc::{BbrOptions, CongestionAlgorithm};
    use kuai_proto::config::Redundancy;
    let mut plain = TransportConfig::default();
    plain.redundancy = None;
    plain.congestion = CongestionAlgorithm::Bbr(BbrOptions {
        loss_response: kuai_proto::cc::LossResponse::Never,
    });
    let mut redundant = plain.clone();
    redundant.redundancy = Some(Redundancy::default());
    let ms200 = Duration::from_millis(200);
    let (without, none) = warm_10k_times(plain, 0.3, 71);
    let (with, copies) = warm_10k_times(redundant.clone(), 0.3, 71);
    assert_eq!(none, 0);
    assert!(copies > 0);
    let (a, b) = (share_within(&without, ms200), share_within(&with, ms200));
    // Measured: 0.44 without, 0.97 with.
    assert!(
        b > a + 0.25,
        "within 200 ms: {a:.2} without copies, {b:.2} with"
    );
    // A clean path sends no copies at all.
    let (clean, copies) = warm_10k_times(redundant, 0.0, 72);
    assert_eq!(copies, 0);
    assert!(share_within(&clean, ms200) == 1.0);
}

#[test]
fn loss_tolerant_bbr_keeps_its_window_under_random_loss() {
    use kuai_proto::cc::{BbrOptions, CongestionAlgorithm};
    let median = |cc: CongestionAlgorithm| {
        let mut t = TransportConfig::default();
        t.congestion = cc;
        let (mut times, _) = warm_10k_times(t, 0.05, 73);
        times.sort();
        times[times.len() / 2]
    };
    let reno = median(CongestionAlgorithm::NewReno);

    let bbr = median(CongestionAlgorithm::Bbr(BbrOptions {
        loss_response: kuai_proto::cc::LossResponse::Never,
    }));
    // NewReno halves its window on each loss and, application-limited, never grows it back:
    // a 10 KB response then takes several round trips. Measured: 80 ms against 40 ms (120
    // against 40 while every STREAM frame carried a Length field: one packet more).
    assert!(
        bbr < Duration::from_millis(60) && reno >= bbr * 2,
        "median at 5 % loss: NewReno {reno:?}, BBR (loss tolerant) {bbr:?}"
    );
}

#[test]
fn bbr_fills_a_bottleneck_without_flooding_its_queue() {
    use kuai_proto::cc::{BbrOptions, CongestionAlgorithm};
    let run = |cc| bottleneck_download(cc, 100_000, 74);
    let (bbr, bbr_lost) = run(CongestionAlgorithm::Bbr(BbrOptions::default()));
    let (reno, reno_lost) = run(CongestionAlgorithm::NewReno);
    // 4 MB at 20 Mbit/s is 1.6 s of serialisation. Measured: BBR 1.83 s with 72 packets
    // lost in Startup, NewReno 1.86 s with 154 lost.
    assert!(bbr < Duration::from_millis(2100), "BBR took {bbr:?}");
    assert!(
        bbr_lost < reno_lost,
        "BBR lost {bbr_lost}, NewReno {reno_lost}"
    );
    let _ = reno;
}

/// Several streams share a small connection window, so frames often use up the last of the
/// connection's credit. A stream whose frame did that still had data within its own limit,
/// left the send schedule and was not among those woken by MAX_DATA: the transfer stalled
/// until the idle timeout (seen on loopback with 8 streams at gigabit rates).
#[test]
fn streams_sharing_a_small_connection_window_all_finish() {
    // The client's windows stay small and the server's send buffers fill up, so a stream can
    // be left with unsent data, a full send buffer (its writer waiting) and no credit.
    let ccfg = quic::client_config(TransportConfig {
        receive_window: 256 << 10,
        max_receive_window: 256 << 10,
        ..TransportConfig::default()
    });
    let mut p = pair(
        91,
        quic::server_config(TransportConfig {
            send_buffer: 64 << 10,
            ..TransportConfig::default()
        }),
        &ccfg,
        Client::with_requests([1 << 20; 8]),
    );
    let (s, c) = (p.server, p.client);
    p.net
        .set_link_both(s, c, LinkConfig::with_delay(Duration::from_micros(50)));
    assert!(p.run_until_done(Duration::from_secs(60)));
    p.client_app().assert_all_intact();
}

/// At heavy loss the handshake's ACKs arrive late, after the endpoint already probed for
/// the packets they acknowledge: such samples measure the loss, not the path. Here whatever
/// the client sends after its ClientHello, for most of a second, takes 800 ms to arrive: the
/// first ACK the server gets acknowledges a packet it sent 0.8 s before, and it probed
/// meanwhile. As the first RTT sample on a 20 ms path it would make the server's probe
/// timeout seconds long for the rest of the connection.
#[test]
fn late_handshake_acks_do_not_inflate_the_rtt_estimate() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        910,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([1000]),
    );
    let (c, s) = (p.client, p.server);
    p.net.run_for(Duration::from_millis(5));
    p.net.set_link(
        c,
        s,
        LinkConfig {
            reorder: 1.0,
            reorder_delay: Duration::from_millis(800),
            ..LinkConfig::default()
        },
    );
    p.net.run_for(Duration::from_millis(700));
    p.net.set_link(c, s, LinkConfig::default());
    assert!(p.run_until(Duration::from_secs(30), |p| {
        p.server_conn().is_some_and(|s| s.is_handshake_confirmed())
            && p.client_conn().is_handshake_confirmed()
    }));
    let st = p.server_conn().unwrap().stats();
    assert!(
        st.pto_count > 0,
        "the server probed while the client's packets were held"
    );
    assert!(
        st.path.rtt < Duration::from_millis(200),
        "server smoothed RTT {:?}",
        st.path.rtt
    );
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
}

/// One 4 MB download over a 20 Mbit/s, 40 ms RTT bottleneck with a one-BDP queue: how long it
/// took and how many packets the server lost.
fn bottleneck_download(
    cc: kuai_proto::cc::CongestionAlgorithm,
    queue_bytes: usize,
    seed: u64,
) -> (Duration, u64) {
    let mut t = TransportConfig::default();
    t.congestion = cc;
    t.redundancy = None;
    // The congestion controller alone limits the sender: the receive windows start at their
    // caps (they grow only when the reader takes half a window within two round trips, and
    // a reader keeping pace with this link never has to).
    t.stream_receive_window = t.max_stream_receive_window;
    t.receive_window = t.max_receive_window;
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        seed,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([4_000_000]),
        |n| n.set_default_link(bottleneck(20, 0.0, 20_000_000, queue_bytes)),
    );
    let start = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(60)));
    let took = p.client_app().requests[0].done_at.unwrap() - start;
    let stats = p.server_conn().unwrap().stats();
    (took, stats.packets_lost)
}

/// Under heavy random loss (a lossy radio hop, no queue) BBR's delivery-rate samples count
/// only what arrived: at 30 % loss ProbeBW_UP's 1.25 x measured less than the estimate and
/// the estimate decayed every cycle. The defaults count random loss back into the samples.
#[test]
fn the_defaults_keep_their_rate_under_heavy_random_loss() {
    let mut t = TransportConfig::default();
    t.redundancy = None;
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        76,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([10_000_000]),
        |n| n.set_default_link(bottleneck(61, 0.3, 6_300_000, 150_000)),
    );
    let start = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(300)));
    let took = p.client_app().requests[0].done_at.unwrap() - start;
    // 10 MB over 6.3 Mbit/s of which 70 % arrives (lab experiment 2's 123 ms link at 30 %
    // loss): 18 s at best. Measured: 34.3 s, and 58.6 s with the samples as they came.
    assert!(took < Duration::from_secs(45), "10 MB took {took:?}");
}

/// HyStart++ sees the queue fill by the rise of each round's minimum RTT and slows down
/// (Conservative Slow Start) before the queue overflows; standard slow start doubles into it.
#[test]
fn hystart_leaves_slow_start_before_the_queue_overflows() {
    use kuai_proto::cc::{CongestionAlgorithm, CubicOptions};
    let plain = CongestionAlgorithm::Cubic(CubicOptions {
        hystart: false,
        ..CubicOptions::default()
    });
    let hystart = CongestionAlgorithm::Cubic(CubicOptions::default());
    // Queues of 4 and 8 times the path's 100 KB BDP. Measured: 86 packets lost against
    // 501, and 130 against 856; every run took 1.82 s (1.6 s of serialisation). (The RTT
    // rise shows in the round that takes the window from 350 to 450 KB; Conservative Slow
    // Start's five rounds at 1.25 x then reach 1.1 MB, past the 8-BDP queue. Before the
    // receive windows stopped growing on the sender's say-so their 1 MiB start held the
    // flow at the 8-BDP queue: 0 lost there.)
    for (queue, most) in [(400_000, 120), (800_000, 160)] {
        let (with, with_lost) = bottleneck_download(hystart.clone(), queue, 75);
        let (without, without_lost) = bottleneck_download(plain.clone(), queue, 75);
        assert!(with < Duration::from_millis(2000), "CUBIC took {with:?}");
        assert!(
            with_lost <= most && with_lost * 4 < without_lost,
            "queue {queue}: lost {with_lost} with HyStart++, {without_lost} without"
        );
        assert!(with <= without + Duration::from_millis(20));
    }
}

/// The defaults are the weak-network profile: warm 10 KB responses on a 40 ms path with random
/// loss each way (lab experiment 1) finish within 200 ms as often as with loss-tolerant BBR and
/// redundancy, and far more often than with NewReno.
#[test]
fn defaults_keep_small_responses_fast_under_random_loss() {
    use kuai_proto::cc::CongestionAlgorithm;
    let ms200 = Duration::from_millis(200);
    let mut reno = TransportConfig::default();
    reno.congestion = CongestionAlgorithm::NewReno;
    reno.redundancy = None;
    // Measured: defaults 1.00 / 1.00 / 0.94, NewReno alone 0.96 / 0.62 / 0.09.
    for (loss, least) in [(0.05, 0.97), (0.15, 0.93), (0.3, 0.8)] {
        let (times, _) = warm_10k_times(TransportConfig::default(), loss, 71);
        let (old, _) = warm_10k_times(reno.clone(), loss, 71);
        let (d, r) = (share_within(&times, ms200), share_within(&old, ms200));
        assert!(
            d >= least && d >= r,
            "{loss}: defaults {d:.2}, NewReno {r:.2}"
        );
    }
}

/// ... and when Startup overflows a bottleneck's drop-tail queue, the losses come with a queue
/// and end Startup as in BBRv3, where loss-tolerant BBR keeps doubling into it.
#[test]
fn defaults_back_off_when_a_queue_overflows() {
    use kuai_proto::cc::{BbrOptions, CongestionAlgorithm, LossResponse};
    let tolerant = CongestionAlgorithm::Bbr(BbrOptions {
        loss_response: LossResponse::Never,
    });
    let v3 = CongestionAlgorithm::Bbr(BbrOptions::default());
    // Measured (lost packets, 25 KB / 100 KB queue): defaults 104 / 56, BBRv3 104 / 56,
    // loss-tolerant 256 / 86 (185 / 72, 118 / 72 and 440 / 108 while Startup's pacing
    // stayed at its 1 ms placeholder).
    for queue in [25_000, 100_000] {
        let (_, d) = bottleneck_download(CongestionAlgorithm::default(), queue, 75);
        let (_, t) = bottleneck_download(tolerant.clone(), queue, 75);
        let (_, b) = bottleneck_download(v3.clone(), queue, 75);
        assert!(
            d * 2 < t * 3 / 2 && d <= b * 2,
            "queue {queue}: lost {d} by default, {t} loss-tolerant, {b} BBRv3"
        );
    }
}

/// Runs `p` until its client connection is established, after dropping the first datagram the
/// client sends from now (its Initial); returns how long that took.
fn handshake_with_first_initial_lost(p: &mut quic::Pair) -> Duration {
    let (c, start) = (p.client, p.net.now());
    let mut dropped = false;
    p.net.set_filter(move |ctx| {
        if ctx.from_node == c && !dropped {
            dropped = true;
            return common::sim::Verdict::Drop;
        }
        common::sim::Verdict::Pass
    });
    assert!(p.run_until(Duration::from_secs(5), |p| p.client_conn().is_established()));
    p.net.clear_filter();
    p.net.now() - start
}

/// A client remembers the path to a server: its next connection there starts its timers from
/// the last smoothed RTT (RFC 9002 §6.2.2), so on a 10 ms path a lost first Initial costs a
/// probe timeout of tens of milliseconds, not the 300 ms of the 100 ms initial RTT.
#[test]
fn a_new_connection_starts_from_the_last_rtt_to_its_server() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        77,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
        |n| n.set_default_link(link(5, 0.0)),
    );
    let first = handshake_with_first_initial_lost(&mut p);
    assert!(p.run_until_done(Duration::from_secs(5)));
    assert_eq!(p.client().ep.path_hint(quic::server_addr()), None);
    close_client(&mut p);
    // Past the draining period: the endpoint forgets the connection and keeps its hint.
    p.net.run_for(Duration::from_millis(500));
    let hint = p
        .client()
        .ep
        .path_hint(quic::server_addr())
        .expect("a hint");
    assert!(
        hint.rtt >= Duration::from_millis(10) && hint.rtt < Duration::from_millis(15),
        "{hint:?}"
    );
    assert_eq!(hint.loss_permille, 0);
    reconnect(&mut p, &ccfg, Client::with_requests([100]));
    let second = handshake_with_first_initial_lost(&mut p);
    assert!(p.run_until_done(Duration::from_secs(5)));
    eprintln!("lost first Initial: handshake in {first:?} without a hint, {second:?} with");
    assert!(first > Duration::from_millis(300), "first {first:?}");
    assert!(second < Duration::from_millis(80), "second {second:?}");
}

/// RFC 9002 §6.2.3: a server that gets the ClientHello again knows its whole first flight
/// was lost. It resends its Handshake data with its Initial, coalesced into the datagram
/// the Initial is padded to anyway, rather than a PTO later in a datagram of its own (a
/// round trip, and a third of what the repeated ClientHello allows it to send). The server's
/// first flight is dropped; the client (whose RTT hint makes its PTO shorter than the
/// server's) repeats its Initial after about 120 ms.
#[test]
fn a_repeated_client_hello_brings_the_handshake_flight_with_the_initial() {
    use std::cell::RefCell;
    use std::rc::Rc;
    // Server datagrams: (sent at, has a Handshake packet); when the client's second
    // datagram left.
    let server_sent = Rc::new(RefCell::new(Vec::new()));
    let client_second = Rc::new(RefCell::new(None));
    let (ss, cs) = (server_sent.clone(), client_second.clone());
    let mut client_count = 0;
    let hint = kuai_proto::PathHint {
        rtt: Duration::from_millis(40),
        ..Default::default()
    };
    let mut p = quic::pair_prepared(
        86,
        EndpointConfig::default(),
        quic::server_config(TransportConfig::default()),
        &quic::client_config(TransportConfig::default()),
        Client::with_requests([1000]),
        move |n| {
            n.set_default_link(link(20, 0.0));
            n.set_filter(move |ctx| {
                if ctx.from == quic::client_addr() {
                    client_count += 1;
                    if client_count == 2 {
                        *cs.borrow_mut() = Some(ctx.now);
                    }
                    return common::sim::Verdict::Pass;
                }
                ss.borrow_mut()
                    .push((ctx.now, has_handshake_packet(ctx.data)));
                // The whole first flight is lost (and any PTO of it before the client's
                // second Initial arrives).
                match *cs.borrow() {
                    Some(t) if ctx.now >= t + Duration::from_millis(20) => {
                        common::sim::Verdict::Pass
                    }
                    _ => common::sim::Verdict::Drop,
                }
            });
        },
        |ep| ep.remember_path(quic::server_addr(), hint),
    );
    let start = p.net.now();
    assert!(p.run_until(Duration::from_secs(5), |p| p.client_conn().is_established()));
    let established = p.net.now() - start;
    let second = client_second
        .borrow()
        .expect("the client repeated its Initial")
        - start;
    let answer = server_sent
        .borrow()
        .iter()
        .find(|(t, _)| *t - start >= second + Duration::from_millis(20))
        .copied()
        .expect("the server answered");
    eprintln!(
        "second ClientHello sent at {second:?}, answered at {:?} (Handshake packet: {}), \
         established at {established:?}",
        answer.0 - start,
        answer.1
    );
    assert!(second < Duration::from_millis(200), "{second:?}");
    assert!(answer.1, "the answer carries the Handshake flight");
    // One round trip after the repeated ClientHello (the server's own PTO is ~300 ms).
    assert!(
        established <= second + Duration::from_millis(45),
        "established at {established:?}, second ClientHello at {second:?}"
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
}

/// A server's PTO probe in the Initial space carries its unacknowledged Handshake data too,
/// in the same padded datagram (RFC 9002 §6.2.4), instead of waiting for the Handshake
/// space's own (backed-off) PTO. The server's first flight is lost and so are the client's
/// repeated Initials, so only the server's own timer can help.
#[test]
fn a_servers_initial_probe_brings_its_handshake_data() {
    use std::cell::RefCell;
    use std::rc::Rc;
    let server_sent = Rc::new(RefCell::new(Vec::new()));
    let ss = server_sent.clone();
    let mut client_count = 0;
    let mut start = None;
    let mut p = quic::pair_with(
        87,
        quic::server_config(TransportConfig::default()),
        &quic::client_config(TransportConfig::default()),
        Client::with_requests([1000]),
        move |n| {
            n.set_default_link(link(20, 0.0));
            n.set_filter(move |ctx| {
                let t0 = *start.get_or_insert(ctx.now);
                let since = ctx.now - t0;
                if ctx.from == quic::client_addr() {
                    client_count += 1;
                    // The first Initial arrives; the repeats before 350 ms do not.
                    return if client_count == 1 || since >= Duration::from_millis(350) {
                        common::sim::Verdict::Pass
                    } else {
                        common::sim::Verdict::Drop
                    };
                }
                ss.borrow_mut()
                    .push((since, has_handshake_packet(ctx.data)));
                if since < Duration::from_millis(100) {
                    common::sim::Verdict::Drop // the first flight
                } else {
                    common::sim::Verdict::Pass
                }
            });
        },
    );
    let start = p.net.now();
    assert!(p.run_until(Duration::from_secs(5), |p| p.client_conn().is_established()));
    let established = p.net.now() - start;
    let probe = server_sent
        .borrow()
        .iter()
        .find(|(t, _)| *t >= Duration::from_millis(100))
        .copied()
        .expect("the server probed");
    eprintln!(
        "server probe at {:?} (Handshake packet: {}), established at {established:?}",
        probe.0, probe.1
    );
    assert!(probe.1, "the probe carries the Handshake data");
    assert!(
        established <= probe.0 + Duration::from_millis(25),
        "established at {established:?}, probe at {:?}",
        probe.0
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.client_app().assert_all_intact();
}

/// Handshake time of a new connection over a 40 ms RTT path losing `loss` each way, from a
/// client endpoint that remembers `hint` for the server.
fn handshake_time_with_hint(seed: u64, loss: f64, hint: kuai_proto::PathHint) -> Duration {
    let mut p = quic::pair_prepared(
        seed,
        EndpointConfig::default(),
        quic::server_config(TransportConfig::default()),
        &quic::client_config(TransportConfig::default()),
        Client::with_requests([]),
        |n| n.set_default_link(link(20, loss)),
        |ep| ep.remember_path(quic::server_addr(), hint),
    );
    let start = p.net.now();
    if p.run_until(Duration::from_secs(30), |p| {
        p.client_conn().is_established()
    }) {
        p.net.now() - start
    } else {
        Duration::from_secs(30)
    }
}

/// On a path the client knows to be lossy, its first flights go out twice, a quarter of an RTT
/// apart: at 30 % loss each way the handshake completes sooner than with the same RTT hint
/// and no loss history, and a clean hint sends no copies.
#[test]
fn known_loss_sends_the_first_flights_twice() {
    let rtt = Duration::from_millis(40);
    let lossy = kuai_proto::PathHint {
        rtt,
        loss_permille: 300,
        ..Default::default()
    };
    let clean = kuai_proto::PathHint {
        rtt,
        loss_permille: 0,
        ..Default::default()
    };
    let median = |hint, loss| {
        let mut t: Vec<Duration> = (0..41)
            .map(|i| handshake_time_with_hint(900 + i, loss, hint))
            .collect();
        t.sort();
        t[t.len() / 2]
    };
    let (with, without) = (median(lossy, 0.3), median(clean, 0.3));
    eprintln!("30 % loss: handshake median {with:?} with copies, {without:?} without");
    assert!(with < without, "{with:?} with copies, {without:?} without");
    // On a clean path the copies cost one RTT / 4 of extra packets and nothing in time.
    let (c1, c0) = (median(lossy, 0.0), median(clean, 0.0));
    eprintln!("clean path: {c1:?} with copies, {c0:?} without");
    assert!(c1 <= c0 + Duration::from_millis(1), "{c1:?} against {c0:?}");
}

/// A server remembers what an established connection learnt about a client's path, by IP: the
/// client's next connection starts known-lossy on the server's side too, so the server copies
/// its handshake flight and the short responses that follow at once.
#[test]
fn a_server_remembers_a_lossy_client() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        78,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests(vec![10_000; 20]),
        |n| n.set_default_link(link(20, 0.2)),
    );
    assert!(p.run_until_done(Duration::from_secs(60)));
    let ip = quic::client_addr().ip();
    assert_eq!(p.server().ep.client_path_hint(ip), None);
    close_client(&mut p);
    p.net.run_for(Duration::from_secs(3));
    let hint = p.server().ep.client_path_hint(ip).expect("a hint");
    assert!(hint.loss_permille >= 100, "{hint:?}");
    reconnect(&mut p, &ccfg, Client::with_requests([10_000]));
    assert!(p.run_until_done(Duration::from_secs(30)));
    let s = p.server_conn().unwrap().stats();
    // The handshake flight and the response went out twice (a clean hint sends none: see
    // known_loss_sends_the_first_flights_twice).
    assert!(s.redundant_packets >= 2, "{s:?}");
}

/// Careful Resume (RFC 9959): the server remembers the window its connection to a client IP
/// carried, and the client's next download jumps to half of it once the first RTT sample
/// confirms the path, instead of doubling up from ten packets. 2 MB over a 100 Mbit/s path
/// of 40 ms RTT (a 500 KB BDP, the queue as large) takes fewer round trips the second time,
/// and the jump, half the saved two BDPs, overflows nothing.
#[test]
fn a_servers_next_connection_to_a_client_resumes_its_window() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        80,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([2 << 20]),
        |n| n.set_default_link(bottleneck(20, 0.0, 100_000_000, 500_000)),
    );
    let t0 = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(30)));
    let first = p.net.now() - t0;
    close_client(&mut p);
    p.net.run_for(Duration::from_secs(3));
    let ip = quic::client_addr().ip();
    let hint = p.server().ep.client_path_hint(ip).expect("a hint");
    // Two BDPs of what was measured: 1 MB, at the 40 ms minimum RTT.
    assert!(hint.window > 600_000 && hint.window < 1_400_000, "{hint:?}");
    assert!(hint.window_rtt >= Duration::from_millis(40), "{hint:?}");
    reconnect(&mut p, &ccfg, Client::with_requests([2 << 20]));
    let t1 = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(30)));
    let second = p.net.now() - t1;
    p.client_app().assert_all_intact();
    let s = p.server_conn().unwrap().stats();
    eprintln!("2 MB: {first:?} the first time, {second:?} resumed; {s:?}");
    assert!(second * 10 < first * 8, "{first:?} then {second:?}");
    assert_eq!(s.packets_lost, 0, "the jump overflowed the queue");
}

/// The server keeps a client's hint the moment the client closes, not when the connection
/// has drained three probe timeouts later: a client fetching one URL after another starts
/// its next connection in between, and it should start from what the last one learnt.
#[test]
fn a_hint_is_kept_when_the_connection_closes() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        81,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([200_000]),
        |n| n.set_default_link(link(20, 0.0)),
    );
    assert!(p.run_until_done(Duration::from_secs(30)));
    let ip = quic::client_addr().ip();
    assert_eq!(p.server().ep.client_path_hint(ip), None);
    close_client(&mut p);
    // One way (20 ms) and a little: the close has arrived, the draining period has not ended.
    p.net.run_for(Duration::from_millis(30));
    assert_eq!(p.server().ep.connection_count(), 1, "still draining");
    let hint = p
        .server()
        .ep
        .client_path_hint(ip)
        .expect("a hint at the close");
    assert!(hint.window > 0, "{hint:?}");
}

/// A handshake that never completes (a spoofed or lost client) leaves the server no hint for
/// that IP: only a client that proved its address shapes the next connection's start.
#[test]
fn an_unfinished_handshake_leaves_no_client_hint() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        79,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
        |n| n.set_default_link(link(20, 0.0)),
    );
    let s = p.server;
    // Nothing from the server reaches the client: the server sees the client's Initials and
    // never its Handshake packets.
    p.net.set_filter(move |ctx| {
        if ctx.from_node == s {
            common::sim::Verdict::Drop
        } else {
            common::sim::Verdict::Pass
        }
    });
    p.net.run_for(Duration::from_secs(60));
    assert_eq!(p.server().ep.connection_count(), 0);
    assert_eq!(
        p.server().ep.client_path_hint(quic::client_addr().ip()),
        None
    );
}

/// Times of `n` new connections, each resuming the one before and sending its 10 KB request
/// in 0-RTT, on a 40 ms path with `loss` each way (lab experiment 1, "new, 0-RTT"). The first
/// connection (no ticket yet) is left out; each run closes its connection 50 ms after its
/// response, as `kuai get --repeat` does, so a NEW_TOKEN may not make it to the next one.
fn zero_rtt_10k_times(loss: f64, seed: u64, n: usize) -> Vec<Duration> {
    let t = TransportConfig::default();
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        seed,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([10_000]),
        |net| net.set_default_link(link(20, loss)),
    );
    assert!(p.run_until_done(Duration::from_secs(30)));
    let mut out = Vec::new();
    for _ in 0..n {
        p.net.run_for(Duration::from_millis(50));
        let (now, ch) = (p.net.now(), p.ch);
        if let Some(c) = p.client_mut().ep.connection_mut(ch) {
            c.close(now, 0, b"bye");
        }
        p.net.run_for(Duration::from_millis(50));
        reconnect(
            &mut p,
            &ccfg,
            Client {
                use_0rtt: true,
                ..Client::with_requests([10_000])
            },
        );
        let start = p.net.now();
        assert!(p.run_until_done(Duration::from_secs(30)));
        p.client_app().assert_all_intact();
        out.push(p.client_app().requests[0].done_at.unwrap() - start);
    }
    out
}

/// New connections in 0-RTT on a lossy path finish within 200 ms as often as issue 18 asks
/// (90 / 75 / 45 % at 5 / 15 / 30 % loss): both endpoints remember the path's loss from the
/// packets they sent and the gaps in what they received, and copy their first flights.
#[test]
fn new_zero_rtt_connections_survive_loss() {
    // Measured over 4 seeds x 100 runs: 0.96 / 0.90 / 0.61 (before the receive side counted
    // towards the hint, and before the anti-deadlock fix: 0.92 / 0.70 / 0.61 on one seed).
    for (loss, least) in [(0.05, 0.9), (0.15, 0.8), (0.3, 0.5)] {
        let mut t = Vec::new();
        for seed in 91..93 {
            t.extend(zero_rtt_10k_times(loss, seed, 100));
        }
        let share = share_within(&t, Duration::from_millis(200));
        assert!(share >= least, "{loss}: within 200 ms {share:.2}");
    }
}

/// A client that only downloads sends too few packets to measure its path's loss by its
/// own; the gaps in the server's packet numbers tell it, so its next connection to that
/// server starts known-lossy.
#[test]
fn a_downloading_client_learns_the_loss_from_what_it_receives() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        81,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([30_000]),
        |n| n.set_default_link(link(20, 0.15)),
    );
    assert!(p.run_until_done(Duration::from_secs(30)));
    let sent = p.client_conn().stats().packets_sent;
    close_client(&mut p);
    p.net.run_for(Duration::from_secs(3));
    let hint = p
        .client()
        .ep
        .path_hint(quic::server_addr())
        .expect("a hint");
    assert!(sent < 32, "the client sent {sent} packets");
    assert!(hint.loss_permille >= 50, "{hint:?}");
}

/// RFC 9002 §6.2.4: a client with 0-RTT packets in flight but no Handshake packet yet probes
/// with a Handshake packet. Here the server has no token to validate the client, its
/// Handshake flight is lost, and so is the client's acknowledgment of its Initial: the server
/// has spent its 3x budget on its flight and 0.5-RTT data. 0-RTT probes would add only a
/// little budget each; a Handshake packet validates the client's address (RFC 9000 §8.1) and
/// the server resends at once.
#[test]
fn a_blocked_server_is_unblocked_by_the_clients_handshake_probe() {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with(
        82,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([100]),
        |n| n.set_default_link(link(20, 0.0)),
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    p.net.run_for(Duration::from_millis(200));
    close_client(&mut p);
    p.net.run_for(Duration::from_millis(500));
    // No token: the new connection's address is not validated.
    p.client_mut().app_mut::<Client>().tokens.clear();
    reconnect(
        &mut p,
        &ccfg,
        Client {
            use_0rtt: true,
            ..Client::with_requests([30_000])
        },
    );
    assert!(p.client_conn().is_0rtt_available());
    let c = p.client;
    let (mut server_flight_dropped, mut client_datagrams) = (false, 0);
    p.net.set_filter(move |ctx| {
        let long = ctx.data.first().is_some_and(|b| b & 0x80 != 0);
        if ctx.from_node == c {
            client_datagrams += 1;
            // The client's second datagram: its acknowledgment of the server's Initial.
            if client_datagrams == 2 {
                return common::sim::Verdict::Drop;
            }
        } else if long && !server_flight_dropped {
            server_flight_dropped = true;
            return common::sim::Verdict::Drop;
        }
        common::sim::Verdict::Pass
    });
    let start = p.net.now();
    assert!(p.run_until_done(Duration::from_secs(30)));
    p.client_app().assert_all_intact();
    let took = p.client_app().requests[0].done_at.unwrap() - start;
    // Measured: 0.49 s. With 0-RTT probes instead it had not finished after 30 s; in the
    // lossy run that showed it, the server waited 3.8 s for five of them.
    assert!(took < Duration::from_millis(600), "took {took:?}");
}

/// `initial_window_packets` sets a new path's first window: a 40 KB response on a clean
/// 40 ms path needs a round trip less from 32 packets than from RFC 9002's 10.
#[test]
fn the_initial_window_is_configurable() {
    let fetch = |packets: u32| {
        let mut t = TransportConfig::default();
        t.initial_window_packets = packets;
        let ccfg = quic::client_config(TransportConfig::default());
        let mut p = quic::pair_with(
            83,
            quic::server_config(t),
            &ccfg,
            Client::with_requests([40_000]),
            |n| n.set_default_link(link(20, 0.0)),
        );
        let start = p.net.now();
        assert!(p.run_until_done(Duration::from_secs(10)));
        p.client_app().assert_all_intact();
        p.client_app().requests[0].done_at.unwrap() - start
    };
    let (rfc, big) = (fetch(10), fetch(32));
    // Measured: 160 ms against 120 ms.
    assert!(
        big + Duration::from_millis(35) <= rfc,
        "10 packets: {rfc:?}, 32 packets: {big:?}"
    );
}

/// `cold_initial_window_packets` is the first window of a connection without a path hint
/// only: on a clean 40 ms path a server with 10 packets for hinted connections and 32 for
/// cold ones sends a cold client 40 KB a round trip sooner than from 10; after a 10 KB first
/// response (too small a saved window to resume from) the same client's next connection is
/// hinted and takes as long as from a server without the cold window.
#[test]
fn a_cold_connection_takes_the_cold_initial_window() {
    let ccfg = quic::client_config(TransportConfig::default());
    let first_and_second = |cold: Option<u32>, first_size: u64| {
        let mut t = TransportConfig::default();
        t.cold_initial_window_packets = cold;
        let mut p = quic::pair_with(
            85,
            quic::server_config(t),
            &ccfg,
            Client::with_requests([first_size]),
            |n| n.set_default_link(link(20, 0.0)),
        );
        let start = p.net.now();
        assert!(p.run_until_done(Duration::from_secs(10)));
        p.client_app().assert_all_intact();
        let first = p.client_app().requests[0].done_at.unwrap() - start;
        close_client(&mut p);
        p.net.run_for(Duration::from_secs(3));
        assert!(
            p.server()
                .ep
                .client_path_hint(quic::client_addr().ip())
                .is_some()
        );
        reconnect(&mut p, &ccfg, Client::with_requests([40_000]));
        let start = p.net.now();
        assert!(p.run_until_done(Duration::from_secs(10)));
        p.client_app().assert_all_intact();
        (first, p.client_app().requests[0].done_at.unwrap() - start)
    };
    let (cold10, _) = first_and_second(None, 40_000);
    let (cold32, _) = first_and_second(Some(32), 40_000);
    let (_, hinted10) = first_and_second(None, 10_000);
    let (_, hinted32) = first_and_second(Some(32), 10_000);
    // Measured: 160 against 122 ms cold; 40 KB hinted after 10 KB: 162 and 162 ms.
    eprintln!("cold {cold10:?} / {cold32:?}, hinted {hinted10:?} / {hinted32:?}");
    assert!(
        cold32 + Duration::from_millis(35) <= cold10,
        "cold: {cold10:?} from 10, {cold32:?} from 32"
    );
    assert!(
        hinted32.abs_diff(hinted10) < Duration::from_millis(5),
        "hinted: {hinted10:?} and {hinted32:?}"
    );
}

/// The end of slow start (BBR's Startup) is traced as qlog's congestion_state_updated, so a
/// trace shows when a transfer left it.
#[test]
fn the_end_of_startup_is_traced() {
    let t = TransportConfig::default();
    let ccfg = quic::client_config(t.clone());
    let mut p = quic::pair_with(
        84,
        quic::server_config(t),
        &ccfg,
        Client::with_requests([4_000_000]),
        |n| n.set_default_link(bottleneck(20, 0.0, 20_000_000, 100_000)),
    );
    assert!(
        p.run_until(Duration::from_secs(1), |p| p.server().ep.connection_count()
            == 1)
    );
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = p.server().ep.handles().next().unwrap();
    p.server_mut()
        .ep
        .connection_mut(h)
        .unwrap()
        .set_tracer(Box::new(Recorder(log.clone())));
    assert!(p.run_until_done(Duration::from_secs(30)));
    let v = log.lock().unwrap();
    assert_eq!(
        v.iter().filter(|e| **e == "congestion_avoidance").count(),
        1,
        "{v:?}"
    );
}

/// The endpoint's receive limit is what it tells peers (RFC 9000 §18.2 max_udp_payload_size):
/// an I/O layer that receives into 2048-byte buffers must not invite 9 KB datagrams.
#[test]
fn max_udp_payload_size_comes_from_the_endpoint() {
    let ecfg = EndpointConfig {
        max_udp_payload_size: 2048,
        ..Default::default()
    };
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = quic::pair_with_endpoint(
        86,
        ecfg,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([1000]),
        |_| {},
    );
    assert!(p.run_until_done(Duration::from_secs(5)));
    let seen_by_client = p.client_conn().peer_params().unwrap().max_udp_payload_size;
    assert_eq!(seen_by_client, 2048);
    // The client's endpoint has the default: the largest a UDP datagram carries.
    let seen_by_server = p.server_conn().unwrap().peer_params().unwrap();
    assert_eq!(seen_by_server.max_udp_payload_size, 65_527);
}
