//! The async endpoint on real loopback sockets.

use std::net::SocketAddr;
use std::time::Instant;

use bytes::Bytes;
use kuai::{ClientConfig, Endpoint, ServerConfig};

const ALPN: &[u8] = b"kuai-test";

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A server that answers each bidi stream "GET n" with n patterned bytes, and echoes
/// datagrams.
async fn start_server(cfg: ServerConfig) -> (Endpoint, SocketAddr) {
    start_server_on(Endpoint::server(cfg, localhost()).unwrap())
}

fn start_server_on(server: Endpoint) -> (Endpoint, SocketAddr) {
    let addr = server.local_addr().unwrap();
    let ep = server.clone();
    tokio::spawn(async move {
        while let Some(connecting) = ep.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = connecting.await else { return };
                let c2 = conn.clone();
                tokio::spawn(async move {
                    while let Ok(d) = c2.read_datagram().await {
                        let _ = c2.send_datagram(d);
                    }
                });
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        let req = recv.read_to_end(1024).await.unwrap();
                        let n: u64 = std::str::from_utf8(&req)
                            .unwrap()
                            .strip_prefix("GET ")
                            .unwrap()
                            .parse()
                            .unwrap();
                        let block = Bytes::from(
                            (0..65536u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
                        );
                        let mut left = n;
                        let mut off = 0u64;
                        while left > 0 {
                            let start = (off % 251) as usize;
                            let len = left.min(60_000) as usize;
                            send.write_chunk(block.slice(start..start + len))
                                .await
                                .unwrap();
                            left -= len as u64;
                            off += len as u64;
                        }
                        send.finish().unwrap();
                        let _ = send.stopped().await;
                    });
                }
            });
        }
    });
    (server, addr)
}

fn server_config() -> (ServerConfig, rustls::pki_types::CertificateDer<'static>) {
    ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap()
}

/// A client endpoint on an ephemeral port, connected to `addr` and trusting `cert`.
async fn connect(
    cert: rustls::pki_types::CertificateDer<'static>,
    addr: SocketAddr,
) -> (Endpoint, kuai::Connection) {
    let client = Endpoint::client(localhost()).unwrap();
    let conn = connect_from(&client, cert, addr).await;
    (client, conn)
}

/// A connection from `client` to `addr`, trusting `cert`.
async fn connect_from(
    client: &Endpoint,
    cert: rustls::pki_types::CertificateDer<'static>,
    addr: SocketAddr,
) -> kuai::Connection {
    client
        .connect_with(
            ClientConfig::with_root(cert, &[ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap()
}

async fn fetch(conn: &kuai::Connection, n: u64) -> u64 {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(format!("GET {n}").as_bytes()).await.unwrap();
    send.finish().unwrap();
    let mut got = 0u64;
    while let Some(chunk) = recv.read_chunk(usize::MAX).await.unwrap() {
        for (i, b) in chunk.iter().enumerate() {
            assert_eq!(
                *b,
                ((got + i as u64) % 251) as u8,
                "byte {}",
                got + i as u64
            );
        }
        got += chunk.len() as u64;
    }
    got
}

#[tokio::test]
async fn handshake_and_small_request() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (_client, conn) = connect(cert, addr).await;
    assert_eq!(conn.alpn().as_deref(), Some(ALPN));
    assert_eq!(fetch(&conn, 1000).await, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_100mb_intact_and_batched() {
    let (scfg, cert) = server_config();
    let (server, addr) = start_server(scfg).await;
    let (client, conn) = connect(cert, addr).await;
    let start = Instant::now();
    assert_eq!(fetch(&conn, 100 << 20).await, 100 << 20);
    let secs = start.elapsed().as_secs_f64();
    let s = server.udp_stats();
    let c = client.udp_stats();
    eprintln!(
        "100 MiB in {secs:.2}s = {:.0} Mbit/s; server: {} datagrams in {} send calls (GSO max {}), client: {} datagrams in {} recv calls",
        800.0 / secs * 1.048576,
        s.sent_datagrams,
        s.send_calls,
        server.max_gso_segments(),
        c.recv_datagrams,
        c.recv_calls
    );
    if server.max_gso_segments() > 1 {
        assert!(
            s.sent_datagrams > s.send_calls * 2,
            "GSO batches more than one datagram per call"
        );
    }
    assert!(c.recv_datagrams >= c.recv_calls, "GRO/recvmmsg counted");
}

/// Without GSO, datagrams still leave in batches: one sendmmsg(2) per batch (Linux).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gso_sendmmsg_batches_datagrams() {
    let (scfg, cert) = server_config();
    let server = Endpoint::builder()
        .server(scfg)
        .gso(false)
        .bind(localhost())
        .unwrap();
    let (server, addr) = start_server_on(server);
    let (_client, conn) = connect(cert, addr).await;
    assert_eq!(fetch(&conn, 20 << 20).await, 20 << 20);
    let s = server.udp_stats();
    eprintln!(
        "GSO off: {} datagrams in {} send calls",
        s.sent_datagrams, s.send_calls
    );
    assert!(
        s.sent_datagrams > s.send_calls * 2,
        "sendmmsg batches more than one datagram per call: {s:?}"
    );
}

/// A receiver without GRO (`gro(false)`) gets whole datagrams from a sender that batches
/// with GSO: the kernel's GRO, which quinn-udp turns on, is turned off again; left on, it
/// handed coalesced batches to one-datagram slots, cut short without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gro_a_gso_sender_is_received_whole() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let client = Endpoint::builder().gro(false).bind(localhost()).unwrap();
    let conn = connect_from(&client, cert, addr).await;
    let got = tokio::time::timeout(std::time::Duration::from_secs(30), fetch(&conn, 20 << 20))
        .await
        .expect("the transfer stalled");
    assert_eq!(got, 20 << 20);
    // Truncated datagrams fail to decrypt (11,046 of about 26,000 without the fix).
    let dropped = conn.stats().packets_dropped;
    assert!(dropped < 10, "{dropped} packets dropped as undecryptable");
}

/// A rebind keeps the endpoint's socket options: without GRO before, without GRO after (a
/// rebind made its sockets with the defaults, GRO on, into one-datagram receive slots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebind_keeps_the_socket_options() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let client = Endpoint::builder().gro(false).bind(localhost()).unwrap();
    let conn = connect_from(&client, cert, addr).await;
    assert_eq!(fetch(&conn, 1000).await, 1000);
    client.rebind(localhost()).unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(30), fetch(&conn, 20 << 20))
        .await
        .expect("the transfer stalled");
    assert_eq!(got, 20 << 20);
    let dropped = conn.stats().packets_dropped;
    assert!(dropped < 10, "{dropped} packets dropped as undecryptable");
}

/// A client endpoint keeps what a finished connection learnt of its server's path, and takes
/// a hint saved by an earlier process.
#[tokio::test]
async fn a_client_endpoint_remembers_its_servers_path() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (client, conn) = connect(cert, addr).await;
    assert_eq!(fetch(&conn, 100_000).await, 100_000);
    assert_eq!(client.path_hint(addr), None, "the connection is still open");
    conn.close(0, b"");
    drop(conn);
    // The hint is kept once the connection is gone (after its draining period).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let hint = loop {
        if let Some(h) = client.path_hint(addr) {
            break h;
        }
        assert!(std::time::Instant::now() < deadline, "no hint after 5 s");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(hint.rtt < std::time::Duration::from_millis(100), "{hint:?}");
    // Loopback loses nothing, but the server leaves one packet number unused early on (RFC
    // 9000 §21.4), which the receiving side cannot tell from a loss: about 1 % here, below
    // the 2 % that makes a path count as lossy.
    assert!(hint.loss_permille < 20, "{hint:?}");
    let elsewhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let saved = kuai::PathHint {
        rtt: std::time::Duration::from_millis(80),
        loss_permille: 150,
        ..Default::default()
    };
    client.remember_path(elsewhere, saved);
    assert_eq!(client.path_hint(elsewhere), Some(saved));
}

/// On a dual-stack endpoint an IPv4 server's hint is found by its IPv4 address (the
/// connection knew it IPv4-mapped, and the hint was kept under that form).
#[tokio::test]
async fn a_dual_stack_endpoint_finds_an_ipv4_servers_hint() {
    let Ok(client) = Endpoint::client("[::]:0".parse().unwrap()) else {
        eprintln!("no IPv6 here: skipped");
        return;
    };
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let conn = connect_from(&client, cert, addr).await;
    assert_eq!(fetch(&conn, 10_000).await, 10_000);
    conn.close(0, b"");
    drop(conn);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while client.path_hint(addr).is_none() {
        assert!(std::time::Instant::now() < deadline, "no hint for {addr}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let saved = kuai::PathHint {
        rtt: std::time::Duration::from_millis(80),
        ..Default::default()
    };
    let elsewhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    client.remember_path(elsewhere, saved);
    assert_eq!(client.path_hint(elsewhere), Some(saved));
}

#[tokio::test]
async fn zero_rtt_on_the_second_connection() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let conn = client
        .connect_with(ccfg.clone(), addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    assert_eq!(fetch(&conn, 100).await, 100);
    // The server's session ticket comes after the handshake: wait for it before closing.
    let ticket = tokio::time::timeout(std::time::Duration::from_secs(5), conn.session_ticket());
    assert!(ticket.await.expect("a ticket within 5 s"));
    conn.close(0, b"");
    // A ticket that already came counts, even once the connection is closed.
    assert!(conn.session_ticket().await);
    let connecting = client.connect_with(ccfg, addr, "localhost").unwrap();
    let (conn, accepted) = connecting.into_0rtt().map_err(|_| "no 0-RTT").unwrap();
    // The request goes out before the handshake completes.
    let got = fetch(&conn, 5000).await;
    assert_eq!(got, 5000);
    assert!(accepted.await, "server accepted 0-RTT");
    let st = conn.stats();
    assert!(st.resumed && st.zero_rtt_accepted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_migrates_by_rebinding_its_socket_mid_transfer() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (client, conn) = connect(cert, addr).await;
    let old = client.local_addr().unwrap();
    let c2 = conn.clone();
    let transfer = tokio::spawn(async move { fetch(&c2, 30 << 20).await });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    client.rebind(localhost()).unwrap();
    assert_ne!(client.local_addr().unwrap(), old);
    assert_eq!(transfer.await.unwrap(), 30 << 20);
    assert_eq!(conn.stats().migrations, 1);
}

#[tokio::test]
async fn datagrams_round_trip() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (_client, conn) = connect(cert, addr).await;
    let max = conn.max_datagram_size().unwrap();
    assert!(max > 1000);
    for i in 0..50u8 {
        conn.send_datagram(Bytes::from(vec![i; 100])).unwrap();
        let back = tokio::time::timeout(std::time::Duration::from_secs(2), conn.read_datagram())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&back[..], &[i; 100][..]);
    }
    // DPLPMTUD may have raised the limit meanwhile: ask again.
    let max = conn.max_datagram_size().unwrap();
    assert!(matches!(
        conn.send_datagram(Bytes::from(vec![0; max + 1])),
        Err(kuai::DatagramError::TooLarge(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_connections() {
    let (scfg, cert) = server_config();
    let (server, addr) = start_server(scfg).await;
    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let mut conns = Vec::new();
    for _ in 0..1000 {
        conns.push(
            client
                .connect_with(ccfg.clone(), addr, "localhost")
                .unwrap(),
        );
    }
    let mut established = Vec::new();
    for c in conns {
        established.push(
            tokio::time::timeout(std::time::Duration::from_secs(30), c)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(server.connection_count(), 1000);
    let mut tasks = Vec::new();
    for c in &established {
        let c = c.clone();
        tasks.push(tokio::spawn(async move { fetch(&c, 1000).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 1000);
    }
    // Dropping the handles closes the connections; each drains after 3 PTO (long here: a
    // thousand handshakes at once in a debug build inflate the RTT estimates).
    drop(established);
    tokio::time::timeout(std::time::Duration::from_secs(60), client.wait_idle())
        .await
        .unwrap();
}

#[tokio::test]
async fn unreachable_server_times_out_with_an_error() {
    // A bound socket that never answers.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let (_, cert) = server_config();
    let mut ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    ccfg.transport(kuai::TransportConfig {
        max_idle_timeout: std::time::Duration::from_secs(1),
        ..Default::default()
    });
    let client = Endpoint::client(localhost()).unwrap();
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        client.connect_with(ccfg, addr, "localhost").unwrap(),
    )
    .await;
    assert_eq!(
        r.expect("bounded by the idle timeout").unwrap_err(),
        kuai::ConnectionError::TimedOut
    );
}

#[tokio::test]
async fn binding_a_used_port_fails_cleanly() {
    let a = Endpoint::client(localhost()).unwrap();
    let addr = a.local_addr().unwrap();
    assert!(Endpoint::client(addr).is_err());
}

#[tokio::test]
async fn qlog_traces_are_written() {
    let dir = std::env::temp_dir().join(format!("kuai-qlog-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let client = Endpoint::builder()
        .qlog_dir(&dir)
        .bind(localhost())
        .unwrap();
    let conn = connect_from(&client, cert, addr).await;
    assert_eq!(fetch(&conn, 10_000).await, 10_000);
    conn.close(0, b"");
    drop(conn);
    tokio::time::timeout(std::time::Duration::from_secs(5), client.wait_idle())
        .await
        .unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1);
    let text = std::fs::read_to_string(&files[0]).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    check_qlog(&text);
}

/// `text` is a qlog JSON-SEQ file of the current drafts (main schema -13, QUIC events -14):
/// RFC 7464 records that are JSON each, a `QlogFileSeq` header, and events whose names are
/// the draft's, with the fields it requires.
fn check_qlog(text: &str) {
    use serde_json::Value;
    const NAMES: &[&str] = &[
        "quic:parameters_set",
        "quic:packet_sent",
        "quic:packet_received",
        "quic:packet_dropped",
        "quic:packet_lost",
        "quic:recovery_metrics_updated",
        "quic:congestion_state_updated",
        "quic:key_updated",
        "quic:key_discarded",
        "quic:connection_state_updated",
        "quic:tuple_assigned",
        "quic:migration_state_updated",
        "quic:mtu_updated",
        "quic:version_information",
        "quic:connection_closed",
    ];
    assert!(text.starts_with('\u{1e}') && text.ends_with('\n'));
    let records: Vec<Value> = text
        .split('\u{1e}')
        .skip(1)
        .map(|r| serde_json::from_str(r).unwrap_or_else(|e| panic!("{e}: {r}")))
        .collect();
    let head = &records[0];
    assert_eq!(head["file_schema"], "urn:ietf:params:qlog:file:sequential");
    assert_eq!(head["serialization_format"], "application/qlog+json-seq");
    assert_eq!(
        head["trace"]["event_schemas"][0],
        "urn:ietf:params:qlog:events:quic-14"
    );
    assert_eq!(head["trace"]["vantage_point"]["type"], "client");
    let rt = &head["trace"]["common_fields"]["reference_time"];
    assert_eq!(
        (&rt["clock_type"], &rt["epoch"]),
        (&Value::from("monotonic"), &Value::from("unknown"))
    );
    assert!(rt["wall_clock_time"].as_str().unwrap().ends_with('Z'));
    let mut seen = std::collections::BTreeSet::new();
    let mut last = 0.0;
    for e in &records[1..] {
        let name = e["name"].as_str().unwrap();
        assert!(
            NAMES.contains(&name),
            "event {name} is not a quic-events-14 name: {e}"
        );
        let t = e["time"].as_f64().unwrap();
        assert!(t >= last, "time went back: {e}");
        last = t;
        let d = &e["data"];
        assert!(d.is_object(), "{e}");
        match name {
            "quic:packet_sent" | "quic:packet_received" => {
                assert!(
                    d["header"]["packet_type"].is_string() && d["header"]["packet_number"].is_u64(),
                    "{e}"
                );
                assert!(
                    d["frames"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .all(|f| f["frame_type"].is_string()),
                    "{e}"
                );
            }
            "quic:parameters_set" => {
                // Ours and the peer's, each once.
                let who = d["initiator"].as_str().unwrap_or_default();
                assert!(who == "local" || who == "remote", "{e}");
                assert!(
                    seen.insert(if who == "local" {
                        "parameters_set local"
                    } else {
                        "parameters_set remote"
                    }),
                    "parameters set twice: {e}"
                );
                assert!(
                    d["initial_max_data"].is_u64() && d["disable_active_migration"].is_boolean(),
                    "{e}"
                );
            }
            "quic:recovery_metrics_updated" => {
                assert!(
                    d["smoothed_rtt"].is_f64() && d["congestion_window"].is_u64(),
                    "{e}"
                );
            }
            "quic:connection_closed" => assert_eq!(d["initiator"], "local", "{e}"),
            _ => {}
        }
        seen.insert(name);
    }
    for want in [
        "parameters_set local",
        "parameters_set remote",
        "quic:packet_sent",
        "quic:packet_received",
        "quic:recovery_metrics_updated",
        "quic:connection_state_updated",
        "quic:connection_closed",
    ] {
        assert!(seen.contains(want), "no {want} in the trace: {seen:?}");
    }
}

/// The peer stops reading (STOP_SENDING) and answers; once the reset that follows is
/// acknowledged the transport forgets the stream, and a late write or finish must still
/// say that the peer stopped it, with its code (an HTTP/3 server may stop a request's
/// stream with H3_NO_ERROR before the request's FIN, RFC 9114 §4.1).
#[tokio::test]
async fn stopped_stream_reports_the_code_after_it_is_forgotten() {
    let (scfg, cert) = server_config();
    let server = Endpoint::server(scfg, localhost()).unwrap();
    let addr = server.local_addr().unwrap();
    let ep = server.clone();
    tokio::spawn(async move {
        let conn = ep.accept().await.unwrap().await.unwrap();
        let (mut send, mut recv) = conn.accept_bi().await.unwrap();
        let _ = recv.read_chunk(1024).await;
        recv.stop(7).unwrap();
        send.write_all(b"done").await.unwrap();
        send.finish().unwrap();
        let _ = conn.closed().await;
    });
    let (_client, conn) = connect(cert, addr).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(b"request without its end").await.unwrap();
    assert_eq!(recv.read_to_end(1024).await.unwrap(), b"done");
    assert!(matches!(
        send.stopped().await,
        Err(kuai::WriteError::Stopped(7))
    ));
    // Time for the RESET_STREAM to be acknowledged and the stream forgotten.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(matches!(
        send.write_all(b"more").await,
        Err(kuai::WriteError::Stopped(7))
    ));
    assert!(matches!(send.finish(), Err(kuai::WriteError::Stopped(7))));
}

/// The server listens on 127.0.0.1 and offers 127.0.0.2 as its preferred address: the
/// client checks it with a PATH_CHALLENGE once the handshake is confirmed and finishes the
/// transfer there (RFC 9000 §9.6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_moves_to_the_server_preferred_address() {
    let (scfg, cert) = server_config();
    let server = Endpoint::builder()
        .server(scfg)
        .preferred_address("127.0.0.2:0".parse().unwrap())
        .bind(localhost())
        .unwrap();
    let preferred = server.preferred_address().unwrap();
    assert_eq!(preferred.ip().to_string(), "127.0.0.2");
    let (_server, addr) = start_server_on(server);
    // No check of the address right after connecting: the probe takes two loopback round
    // trips after confirmation, and a busy machine can let the move happen before this task
    // runs again.
    let (_client, conn) = connect(cert, addr).await;
    assert_eq!(fetch(&conn, 8 << 20).await, 8 << 20);
    assert_eq!(conn.remote_address(), preferred);
    assert_eq!(conn.stats().migrations, 1);
    // More requests after the move.
    assert_eq!(fetch(&conn, 1000).await, 1000);
}

#[test]
fn preferred_address_needs_its_own_ip() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _g = rt.enter();
    let (scfg, _) = server_config();
    let e = Endpoint::builder()
        .server(scfg)
        .preferred_address("127.0.0.1:0".parse().unwrap())
        .bind(localhost())
        .unwrap_err();
    assert!(e.to_string().contains("IP address of its own"), "{e}");
}

/// A client endpoint of `workers` workers on an ephemeral port.
fn client_with_workers(workers: usize) -> Endpoint {
    Endpoint::builder()
        .workers(workers)
        .bind(localhost())
        .unwrap()
}

/// Two workers on each side: connections spread over both, each stays on its worker (the
/// kernel steers by the last byte of the destination CID), and a client that moves to a new
/// port mid-transfer still reaches its server worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_share_a_port_and_keep_their_connections() {
    let (scfg, cert) = server_config();
    let server = Endpoint::builder()
        .server(scfg)
        .workers(2)
        .bind(localhost())
        .unwrap();
    assert_eq!(server.workers(), 2);
    let (server, addr) = start_server_on(server);
    let client = client_with_workers(2);
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let mut conns = Vec::new();
    for _ in 0..32 {
        let c = client
            .connect_with(ccfg.clone(), addr, "localhost")
            .unwrap();
        conns.push(
            tokio::time::timeout(std::time::Duration::from_secs(20), c)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(server.stats().accepted, 32);
    let mut tasks = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        let c = c.clone();
        let n = if i < 2 { 8 << 20 } else { 20_000 };
        tasks.push(tokio::spawn(async move { (fetch(&c, n).await, n) }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let old = client.local_addr().unwrap();
    client.rebind(localhost()).unwrap();
    assert_ne!(client.local_addr().unwrap(), old);
    for t in tasks {
        let (got, want) = t.await.unwrap();
        assert_eq!(got, want);
    }
    for c in &conns {
        assert_eq!(fetch(c, 1000).await, 1000);
    }
    let migrations: Vec<_> = conns.iter().map(|c| c.stats().migrations).collect();
    assert!(
        migrations.iter().all(|&m| m == 1),
        "every connection moved to the new port once: {migrations:?}"
    );
}

/// A server that loses its state answers with stateless resets. A reset's bytes are random
/// where a CID would be, so the kernel steers it to any worker of the client; each must
/// still reach the connection it is for (instead of that connection waiting for its idle
/// timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stateless_reset_finds_its_connection_on_any_worker() {
    let (mut scfg, cert) = server_config();
    // The client's probe timeout includes the server's max_ack_delay: a reset the client
    // missed would cost it 4 s before it sent again and drew another.
    scfg.transport(kuai::TransportConfig {
        max_ack_delay: std::time::Duration::from_secs(4),
        ..Default::default()
    });
    let endpoint_config = kuai::EndpointConfig {
        proto: kuai::kuai_proto::EndpointConfig {
            reset_key: [7; 32],
            ..Default::default()
        },
    };
    // The first server runs on a runtime of its own, so that dropping the runtime drops
    // it with all its state and frees the port (a crash: its handle goes after the
    // runtime, when nothing can be sent any more). It never accepts: no connection handle
    // closes anything when it goes.
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (ecfg, scfg2) = (endpoint_config.clone(), scfg.clone());
    let first = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let server = rt.block_on(async {
            let server = Endpoint::builder()
                .server(scfg2)
                .endpoint_config(ecfg)
                .bind(localhost())
                .unwrap();
            tx.send(server.local_addr().unwrap()).unwrap();
            tokio::task::spawn_blocking(move || stop_rx.recv())
                .await
                .unwrap()
                .unwrap();
            server
        });
        drop(rt);
        drop(server);
    });
    let addr = rx.recv().unwrap();
    let client = client_with_workers(2);
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let mut conns = Vec::new();
    for _ in 0..12 {
        let c = client
            .connect_with(ccfg.clone(), addr, "localhost")
            .unwrap();
        conns.push(c.await.unwrap());
    }
    stop_tx.send(()).unwrap();
    first.join().unwrap();
    // The same port, the same reset key, no connections.
    let _second = Endpoint::builder()
        .server(scfg)
        .endpoint_config(endpoint_config)
        .bind(addr)
        .unwrap();
    let start = Instant::now();
    for c in &conns {
        let c = c.clone();
        tokio::spawn(async move {
            if let Ok((mut send, _recv)) = c.open_bi().await {
                let _ = send.write_all(b"GET 1").await;
            }
        });
    }
    for c in &conns {
        let e = tokio::time::timeout(std::time::Duration::from_secs(3), c.closed())
            .await
            .expect("reset by the first answer, without a probe timeout");
        assert_eq!(e, kuai::ConnectionError::Reset);
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(3));
}

/// The preferred address with two workers: each connection's probe reaches the worker that
/// holds it on the preferred address's sockets too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_answer_on_the_preferred_address() {
    let (scfg, cert) = server_config();
    let server = Endpoint::builder()
        .server(scfg)
        .workers(2)
        .preferred_address("127.0.0.2:0".parse().unwrap())
        .bind(localhost())
        .unwrap();
    let preferred = server.preferred_address().unwrap();
    let (_server, addr) = start_server_on(server);
    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    for _ in 0..16 {
        let conn = client
            .connect_with(ccfg.clone(), addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        assert_eq!(fetch(&conn, 2 << 20).await, 2 << 20);
        assert_eq!(conn.remote_address(), preferred);
        assert_eq!(fetch(&conn, 1000).await, 1000);
    }
}

/// `Endpoint::flush` returns once a driver turn begun after it has sent what was queued: a
/// client that closes, flushes and exits at once still tells the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_then_flush_reaches_the_server_before_the_client_is_gone() {
    let (scfg, cert) = server_config();
    let server = Endpoint::server(scfg, localhost()).unwrap();
    let addr = server.local_addr().unwrap();
    let ep = server.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let conn = ep.accept().await.unwrap().await.unwrap();
        let _ = tx.send(conn.closed().await);
    });
    // The client on a runtime of its own, dropped at the end as a process exit would: its
    // driver runs only while the client awaits something.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (client, conn) = connect(cert, addr).await;
            conn.close(42, b"bye");
            let start = std::time::Instant::now();
            tokio::time::timeout(std::time::Duration::from_secs(2), client.flush())
                .await
                .expect("flush returns");
            assert!(start.elapsed() < std::time::Duration::from_millis(100));
        });
        drop(rt);
        let _ = done_tx.send(());
    });
    done_rx.await.expect("the client thread finishes");
    let why = tokio::time::timeout(std::time::Duration::from_secs(5), rx)
        .await
        .expect("the server learns of the close long before its idle timeout")
        .unwrap();
    assert!(
        matches!(
            why,
            kuai::ConnectionError::ApplicationClosed { code: 42, .. }
        ),
        "{why:?}"
    );
}

/// What a test subscriber saw.
#[derive(Default)]
struct Seen {
    contexts: std::sync::atomic::AtomicUsize,
    dropped_contexts: std::sync::atomic::AtomicUsize,
    log: std::sync::Mutex<Vec<String>>,
}

struct Watch(std::sync::Arc<Seen>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0
            .dropped_contexts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

struct Sub(std::sync::Arc<Seen>);

impl kuai::kuai_proto::trace::Subscriber for Sub {
    type ConnectionContext = (Watch, bool);

    fn create_connection_context(
        &self,
        meta: &kuai::kuai_proto::trace::ConnectionMeta,
        _: Instant,
    ) -> (Watch, bool) {
        self.0
            .contexts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.0
            .log
            .lock()
            .unwrap()
            .push(format!("begin {:?}", meta.side));
        (Watch(self.0.clone()), false)
    }

    fn on_connection_event(
        &self,
        ctx: &mut (Watch, bool),
        _: Instant,
        event: &kuai::kuai_proto::trace::TraceEvent<'_>,
    ) {
        use kuai::kuai_proto::trace::TraceEvent as E;
        let line = match event {
            // The first packet only: the context was there before it.
            E::PacketReceived { kind, .. } if !ctx.1 => {
                ctx.1 = true;
                format!("first packet {}", kind.qlog_name())
            }
            E::HandshakeCompleted { stats } => format!(
                "handshake {} {}",
                String::from_utf8_lossy(stats.alpn.as_deref().unwrap_or_default()),
                stats.cipher_suite.unwrap_or("?")
            ),
            E::ConnectionClosed {
                stats, established, ..
            } => format!(
                "closed established={established} sent={}",
                stats.packets_sent > 0
            ),
            _ => return,
        };
        self.0.log.lock().unwrap().push(line);
    }

    fn on_endpoint_event(&self, _: Instant, event: &kuai::kuai_proto::trace::EndpointTraceEvent) {
        use kuai::kuai_proto::trace::EndpointTraceEvent as E;
        let line = match event {
            E::VersionNegotiationSent { .. } => "version negotiation sent".to_string(),
            E::DatagramDropped { reason, .. } => format!("dropped {}", reason.name()),
            E::StatelessResetSent { .. } => "stateless reset sent".to_string(),
            _ => return,
        };
        self.0.log.lock().unwrap().push(line);
    }
}

/// A subscriber gets a context per connection before its first packet, the handshake and
/// the close with statistics, the endpoint's stateless answers and drops; the context goes
/// with the connection.
#[tokio::test]
async fn a_subscriber_sees_connections_and_the_endpoint() {
    let (scfg, cert) = server_config();
    let seen = std::sync::Arc::new(Seen::default());
    let server = Endpoint::builder()
        .server(scfg)
        .subscriber(Sub(seen.clone()))
        .bind(localhost())
        .unwrap();
    let (server, addr) = start_server_on(server);
    let (_client, conn) = connect(cert, addr).await;
    assert_eq!(fetch(&conn, 1000).await, 1000);
    conn.close(0, b"done");
    // An unknown version in a full-size datagram gets Version Negotiation; a short
    // datagram for no connection is dropped.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut odd = vec![0u8; 1200];
    odd[0] = 0xc0;
    odd[1..5].copy_from_slice(&0x1a2a_3a4au32.to_be_bytes());
    odd[5] = 8;
    odd[14] = 8;
    udp.send_to(&odd, addr).unwrap();
    udp.send_to(&[0x40, 1, 2], addr).unwrap();
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let log = seen.log.lock().unwrap().clone();
        let done = log.iter().any(|l| l.starts_with("closed"))
            && log.iter().any(|l| l.starts_with("version negotiation"))
            && log.iter().any(|l| l.starts_with("dropped"));
        if done
            && seen
                .dropped_contexts
                .load(std::sync::atomic::Ordering::SeqCst)
                == 1
        {
            break;
        }
        assert!(Instant::now() < deadline, "saw only {log:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let log = seen.log.lock().unwrap().clone();
    assert_eq!(seen.contexts.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(log[0], "begin Server");
    assert_eq!(log[1], "first packet initial", "{log:?}");
    assert!(
        log.iter()
            .any(|l| l.starts_with("handshake kuai-test TLS13_")),
        "{log:?}"
    );
    assert!(
        log.contains(&"closed established=true sent=true".to_string()),
        "{log:?}"
    );
    assert!(log.contains(&"dropped malformed".to_string()), "{log:?}");
    drop(server);
}

/// Clients that resume (in 0-RTT) out of `n` different ones, each with a session store of
/// its own, connecting to `scfg` twice, 32 at a time.
async fn clients_resuming(
    scfg: ServerConfig,
    cert: rustls::pki_types::CertificateDer<'static>,
    n: usize,
) -> usize {
    let (_server, addr) = start_server(scfg).await;
    let client = Endpoint::client(localhost()).unwrap();
    let configs: Vec<ClientConfig> = (0..n)
        .map(|_| ClientConfig::with_root(cert.clone(), &[ALPN]).unwrap())
        .collect();
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
    // Every client once, for its tickets.
    let mut tasks = Vec::new();
    for c in &configs {
        let (client, c, limit) = (client.clone(), c.clone(), limit.clone());
        tasks.push(tokio::spawn(async move {
            let _p = limit.acquire().await.unwrap();
            let conn = client
                .connect_with(c, addr, "localhost")
                .unwrap()
                .await
                .unwrap();
            assert_eq!(fetch(&conn, 10).await, 10);
            assert!(conn.session_ticket().await);
            conn.close(0, b"");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Then again: resumed, requests in 0-RTT.
    let mut tasks = Vec::new();
    for c in configs {
        let (client, limit) = (client.clone(), limit.clone());
        tasks.push(tokio::spawn(async move {
            let _p = limit.acquire().await.unwrap();
            let connecting = client.connect_with(c, addr, "localhost").unwrap();
            let Ok((conn, accepted)) = connecting.into_0rtt() else {
                return false;
            };
            // The request goes in 0-RTT; a server that rejects it voids the stream.
            let got = async {
                let (mut send, mut recv) = conn.open_bi().await.ok()?;
                send.write_all(b"GET 10").await.ok()?;
                send.finish().ok()?;
                recv.read_to_end(1024).await.ok().map(|b| b.len())
            }
            .await;
            let ok = accepted.await && conn.stats().resumed && got == Some(10);
            conn.close(0, b"");
            ok
        }));
    }
    let mut resumed = 0;
    for t in tasks {
        resumed += usize::from(t.await.unwrap());
    }
    resumed
}

/// Many clients resume with 0-RTT: kuai's servers keep their sessions in a
/// `kuai::session::SessionCache`; with rustls's default store (256 sessions) most of them
/// could not. `KUAI_RESUME_CLIENTS` sets how many (1,000 by default; 10,000 by hand).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_all_resume_in_0rtt() {
    let n: usize = std::env::var("KUAI_RESUME_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let start = Instant::now();
    let (scfg, cert) = server_config();
    let resumed = clients_resuming(scfg, cert, n).await;
    println!(
        "{resumed} of {n} clients resumed in 0-RTT ({:?})",
        start.elapsed()
    );
    assert_eq!(resumed, n);

    // The same with rustls's own store: it remembers 256 sessions (2 tickets a client).
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let mut tls = rustls::ServerConfig::builder_with_provider(kuai::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let few = clients_resuming(ServerConfig::from_rustls(tls), cert, n.min(1000)).await;
    println!("with rustls's default store: {few} of {}", n.min(1000));
    assert!(few <= 256, "{few}");
}

/// Connections closed while the transport still held them (the peer closed, or the last
/// handle went with the connection open) leave no state behind once they drain, at the
/// server or at the client: the wake state of each stayed for the process's life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_leave_no_state_behind() {
    let (scfg, cert) = server_config();
    let (server, addr) = start_server(scfg).await;
    let client = Endpoint::client(localhost()).unwrap();
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    for _ in 0..20 {
        let conn = client
            .connect_with(ccfg.clone(), addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        assert_eq!(fetch(&conn, 1000).await, 1000);
        conn.close(0, b"done");
        drop(conn);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (c, s) = (client.tracked_connections(), server.tracked_connections());
        if c == 0 && s == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "state kept for {c} client and {s} server connections after they drained \
             ({} and {} live)",
            client.connection_count(),
            server.connection_count()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// An endpoint all of whose handles are dropped (without `close`) stops once its last
/// connection has drained: its driver ends and its socket closes (the port can be bound
/// again). Its drivers ran for the process's life before, each with its socket and buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_endpoint_lets_its_socket_go() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (client, conn) = connect(cert, addr).await;
    assert_eq!(fetch(&conn, 1000).await, 1000);
    let local = client.local_addr().unwrap();
    drop(conn);
    drop(client);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::net::UdpSocket::bind(local).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the dropped endpoint still holds {local}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A delivery deadline resets a response the client never takes (its credit never comes),
/// and the writer still waiting on the stream hears of it: `stopped()` ends with the
/// deadline's code instead of waiting for the connection to close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_deadline_resets_what_the_peer_does_not_take() {
    let (scfg, cert) = server_config();
    let server = Endpoint::server(scfg, localhost()).unwrap();
    let addr = server.local_addr().unwrap();
    let client = Endpoint::client(localhost()).unwrap();
    let mut ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    ccfg.transport(kuai::TransportConfig {
        stream_receive_window: 16 * 1024,
        max_stream_receive_window: 16 * 1024,
        ..Default::default()
    });
    let conn = client
        .connect_with(ccfg, addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(b"x").await.unwrap();
    send.finish().unwrap();
    let sconn = server.accept().await.unwrap().await.unwrap();
    let (mut ssend, _srecv) = sconn.accept_bi().await.unwrap();
    // 50 KB: all taken by the send buffer (credit and 64 KiB ahead of it), never sent whole.
    ssend.write_all(&[7u8; 50_000]).await.unwrap();
    ssend.set_delivery_timeout(std::time::Duration::from_millis(300), 7);
    ssend.finish().unwrap();
    let t = Instant::now();
    let r = tokio::time::timeout(std::time::Duration::from_secs(3), ssend.stopped())
        .await
        .expect("the writer heard of the reset");
    assert!(
        matches!(r, Err(kuai::WriteError::Stopped(7))),
        "{r:?} after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() >= std::time::Duration::from_millis(250));
    assert!(conn.close_reason().is_none(), "the connection goes on");
}

/// A STOP_SENDING that arrives before the server accepts the stream is not lost: the
/// handle `accept_bi` makes reports it (`cancelled()` waited for the connection's end, and
/// a server racing its work against the client's cancellation never saw it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sending_before_the_accept_reaches_the_stream() {
    let (scfg, cert) = server_config();
    let server = Endpoint::server(scfg, localhost()).unwrap();
    let addr = server.local_addr().unwrap();
    let (_client, conn) = connect(cert, addr).await;
    let sconn = server.accept().await.unwrap().await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(b"request").await.unwrap();
    send.finish().unwrap();
    recv.stop(7).unwrap();
    // The server's transport takes the STOP_SENDING (and acknowledges its own reset)
    // before the application accepts the stream.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (mut ssend, _srecv) = sconn.accept_bi().await.unwrap();
    let e = tokio::time::timeout(std::time::Duration::from_secs(1), ssend.cancelled())
        .await
        .expect("the stop was kept for the accepted stream");
    assert!(matches!(e, kuai::WriteError::Stopped(7)), "{e:?}");
}

/// An empty write completes at once (it waited for room that no event would announce).
#[tokio::test]
async fn an_empty_write_completes() {
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (_client, conn) = connect(cert, addr).await;
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(1), send.write_all(&[]))
        .await
        .expect("an empty write completed")
        .unwrap();
    // Through AsyncWrite, where an empty buffer reaches the stream.
    let n = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        tokio::io::AsyncWriteExt::write(&mut send, &[]),
    )
    .await
    .expect("an empty write through AsyncWrite completed")
    .unwrap();
    assert_eq!(n, 0);
}

/// A read abandoned and its stream dropped leaves no waker behind (it held the waiting
/// task's memory for the connection's life: no event comes for a stopped stream).
#[tokio::test]
async fn a_dropped_stream_keeps_no_waker() {
    struct Counted;
    impl std::task::Wake for Counted {
        fn wake(self: std::sync::Arc<Self>) {}
    }
    let (scfg, cert) = server_config();
    let (_server, addr) = start_server(scfg).await;
    let (_client, conn) = connect(cert, addr).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(b"GET 100").await.unwrap();
    let w = std::sync::Arc::new(Counted);
    let waker = std::task::Waker::from(w.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    // Nothing has come back yet: the read waits, its waker kept.
    assert!(recv.poll_read_chunk(&mut cx, 1024).is_pending());
    drop(waker);
    assert_eq!(std::sync::Arc::strong_count(&w), 2);
    drop(recv);
    assert_eq!(
        std::sync::Arc::strong_count(&w),
        1,
        "the waker outlived its stream"
    );
    drop(send);
}
