//! Protocol behaviour over the in-memory network: handshakes, transfers under loss, streams,
//! 0-RTT, Retry, key updates, version negotiation, migration, resets, timeouts and limits.

mod common;

use std::time::Duration;

use common::quic::{self, Client, pair};
use common::sim::LinkConfig;
use kuai_proto::config::TransportConfig;

fn link(delay_ms: u64, loss: f64) -> LinkConfig {
    LinkConfig {
        delay: Duration::from_millis(delay_ms),
        loss,
        ..LinkConfig::default()
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
        |n| {
            n.set_default_link(LinkConfig {
                rate_bps: Some(100_000_000),
                queue_bytes: 256 * 1024,
                ..link(10, loss)
            })
        },
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

fn key_update_by(client_side: bool) {
    let ccfg = quic::client_config(TransportConfig::default());
    let mut p = pair(
        50 + client_side as u64,
        quic::server_config(TransportConfig::default()),
        &ccfg,
        Client::with_requests([4 << 20]),
    );
    // Until part of the data arrived.
    assert!(p.run_until(
        Duration::from_secs(10),
        |p| p.client_app().requests[0].received > (1 << 20)
    ));
    let updated = if client_side {
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
    };
    assert!(updated, "key update allowed");
    assert!(p.run_until_done(Duration::from_secs(10)));
    p.client_app().assert_all_intact();
    assert!(p.client_conn().stats().key_updates >= 1);
    assert!(p.server_conn().unwrap().stats().key_updates >= 1);
    // Both sides can update again once the new phase is acknowledged.
    p.net.run_for(Duration::from_millis(200));
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
