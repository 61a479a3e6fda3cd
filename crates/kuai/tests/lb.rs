//! `kuai::lb`: three servers issuing QUIC-LB connection IDs behind one balancer, on real
//! loopback sockets.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kuai::lb::{LbConfig, LbHandle, LoadBalancer};
use kuai::{ClientConfig, Endpoint, EndpointConfig, ServerConfig};
use kuai_proto::quic_lb::{QuicLbCids, QuicLbConfig, QuicLbDecoder};

const ALPN: &[u8] = b"kuai-test";
const KEY: [u8; 16] = [7; 16];

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn lb_config() -> QuicLbConfig {
    QuicLbConfig::new(0, 1, 6, Some(KEY)).unwrap()
}

/// A server whose connection IDs carry `sid`, answering "GET n" with n bytes.
fn server(scfg: ServerConfig, sid: [u8; 1]) -> Endpoint {
    let mut ec = EndpointConfig::default();
    ec.proto.cid_generator =
        Arc::new(move || Box::new(QuicLbCids::new(lb_config(), &sid).unwrap()));
    serve_gets(
        Endpoint::builder()
            .endpoint_config(ec)
            .server(scfg)
            .bind(localhost())
            .unwrap(),
    )
}

/// Answers "GET n" with n bytes on every bidi stream of every connection of `ep`.
fn serve_gets(ep: Endpoint) -> Endpoint {
    let e = ep.clone();
    tokio::spawn(async move {
        while let Some(connecting) = e.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = connecting.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        let req = recv.read_to_end(64).await.unwrap();
                        let n: usize = std::str::from_utf8(&req[4..]).unwrap().parse().unwrap();
                        let block = Bytes::from(vec![0x5a; 60_000]);
                        let mut left = n;
                        while left > 0 {
                            let k = left.min(block.len());
                            send.write_chunk(block.slice(..k)).await.unwrap();
                            left -= k;
                        }
                        send.finish().unwrap();
                        let _ = send.stopped().await;
                    });
                }
            });
        }
    });
    ep
}

async fn fetch(conn: &kuai::Connection, n: usize) -> usize {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(format!("GET {n}").as_bytes()).await.unwrap();
    send.finish().unwrap();
    let mut got = 0;
    while let Some(c) = recv.read_chunk(usize::MAX).await.unwrap() {
        got += c.len();
    }
    got
}

struct Fleet {
    servers: Vec<Endpoint>,
    lb: SocketAddr,
    handle: LbHandle,
    ccfg: ClientConfig,
    scfg: ServerConfig,
}

async fn fleet() -> Fleet {
    fleet_checked(Duration::from_secs(1)).await
}

/// The fleet with health probes every `every`.
async fn fleet_checked(every: Duration) -> Fleet {
    fleet_on(localhost(), every, |_| {}).await
}

/// The fleet behind a balancer on `listen` with health probes every `every`, its
/// configuration changed by `tune`.
async fn fleet_on(listen: SocketAddr, every: Duration, tune: impl FnOnce(&mut LbConfig)) -> Fleet {
    fleet_with(listen, every, tune, |_| {}).await
}

/// [`fleet_on`] with the servers' configuration changed by `tune_servers`.
async fn fleet_with(
    listen: SocketAddr,
    every: Duration,
    tune: impl FnOnce(&mut LbConfig),
    tune_servers: impl FnOnce(&mut ServerConfig),
) -> Fleet {
    let (mut scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    tune_servers(&mut scfg);
    let servers: Vec<Endpoint> = (1..=3u8).map(|i| server(scfg.clone(), [i])).collect();
    let mut decoder = QuicLbDecoder::new();
    decoder.add(lb_config());
    let mut config = LbConfig {
        health_interval: Some(every),
        ..LbConfig::new(decoder, lb_config().cid_len())
    };
    tune(&mut config);
    let (lb, handle) = LoadBalancer::bind(
        listen,
        servers
            .iter()
            .enumerate()
            .map(|(i, s)| (vec![i as u8 + 1], s.local_addr().unwrap()))
            .collect(),
        config,
    )
    .unwrap();
    let mut addr = lb.local_addr();
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    tokio::spawn(lb.run());
    Fleet {
        servers,
        lb: addr,
        handle,
        ccfg: ClientConfig::with_root(cert, &[ALPN]).unwrap(),
        scfg,
    }
}

/// One server of two workers answering GETs, its worker bits in the QUIC-LB server ID
/// (worker 0 is server 1, worker 1 server 2, both at one address), behind a balancer
/// configured by `tune`: the server, the balancer's address and its handle.
fn two_workers_behind_a_balancer(
    scfg: ServerConfig,
    tune: impl FnOnce(&mut LbConfig),
) -> (Endpoint, SocketAddr, LbHandle) {
    let server = serve_gets(
        Endpoint::builder()
            .server(scfg)
            .workers(2)
            .quic_lb(lb_config(), &[1])
            .bind(localhost())
            .unwrap(),
    );
    let addr = server.local_addr().unwrap();
    let mut decoder = QuicLbDecoder::new();
    decoder.add(lb_config());
    let mut config = LbConfig::new(decoder, lb_config().cid_len());
    tune(&mut config);
    let (lb, handle) =
        LoadBalancer::bind(localhost(), vec![(vec![1], addr), (vec![2], addr)], config).unwrap();
    let lb_addr = lb.local_addr();
    tokio::spawn(lb.run());
    (server, lb_addr, handle)
}

/// A new connection through the balancer.
async fn connect(client: &Endpoint, f: &Fleet) -> kuai::Connection {
    client
        .connect_with(f.ccfg.clone(), f.lb, "localhost")
        .unwrap()
        .await
        .unwrap()
}

/// `n` new connections through the balancer, each fetching 1,000 bytes.
async fn connect_and_fetch(client: &Endpoint, f: &Fleet, n: usize) {
    for _ in 0..n {
        let c = connect(client, f).await;
        assert_eq!(fetch(&c, 1000).await, 1000);
    }
}

fn accepted(f: &Fleet) -> Vec<u64> {
    f.servers.iter().map(|s| s.stats().accepted).collect()
}

/// Connections through the balancer spread over the three servers and work; a client that
/// rebinds its socket mid-transfer (a NAT rebinding: a new address at the balancer) keeps
/// its connection, which the balancer routes by connection ID to the server holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_and_survive_rebinding() {
    let f = fleet().await;
    let client = Endpoint::client(localhost()).unwrap();
    let mut conns = Vec::new();
    for _ in 0..30 {
        let c = connect(&client, &f).await;
        assert_eq!(fetch(&c, 100_000).await, 100_000);
        conns.push(c);
    }
    let per = accepted(&f);
    assert_eq!(per.iter().sum::<u64>(), 30, "{per:?}");
    assert!(per.iter().all(|&n| n >= 1), "a server got none: {per:?}");

    let conn = conns.pop().unwrap();
    let c2 = conn.clone();
    let transfer = tokio::spawn(async move { fetch(&c2, 30 << 20).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    client.rebind(localhost()).unwrap();
    assert_eq!(transfer.await.unwrap(), 30 << 20);
    assert_eq!(conn.stats().migrations, 1);
    assert_eq!(accepted(&f).iter().sum::<u64>(), 30, "no new connection");
    let (forwarded, unroutable) = f.handle.counts();
    assert!(forwarded > 0 && unroutable == 0, "{forwarded} {unroutable}");
}

/// A drained server gets no new connection while its live ones keep working; a removed
/// one's share goes to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_drain_and_go_without_dropping_the_others() {
    let f = fleet().await;
    let client = Endpoint::client(localhost()).unwrap();
    // A connection on each server.
    let mut on: Vec<Option<kuai::Connection>> = vec![None, None, None];
    for _ in 0..40 {
        let before = accepted(&f);
        let c = connect(&client, &f).await;
        let after = accepted(&f);
        let i = (0..3).find(|&i| after[i] > before[i]).unwrap();
        on[i].get_or_insert(c);
        if on.iter().all(Option::is_some) {
            break;
        }
    }
    let on: Vec<kuai::Connection> = on.into_iter().map(Option::unwrap).collect();
    assert!(f.handle.drain(&[1]));
    let before = accepted(&f);
    connect_and_fetch(&client, &f, 12).await;
    let after = accepted(&f);
    assert_eq!(
        after[0], before[0],
        "the drained server got new connections"
    );
    assert_eq!(after[1] + after[2] - before[1] - before[2], 12);
    // Its live connection still works.
    assert_eq!(fetch(&on[0], 200_000).await, 200_000);
    // Server 3 removed: the others still answer.
    assert!(f.handle.remove(&[3]));
    assert_eq!(fetch(&on[1], 200_000).await, 200_000);
    let c = connect(&client, &f).await;
    assert_eq!(fetch(&c, 1000).await, 1000);
    assert_eq!(
        accepted(&f)[2],
        after[2],
        "no new connection on the removed server"
    );
}

/// `max_flows` bounds the sockets and tasks (what a spoofed flood can cost): past it a new
/// client takes the place of the flow whose client has been quiet longest, and that client
/// is not cut off either: its next datagram names its server and opens a flow again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_are_capped() {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    let s = server(scfg, [1]);
    let mut decoder = QuicLbDecoder::new();
    decoder.add(lb_config());
    let mut cfg = LbConfig::new(decoder, lb_config().cid_len());
    cfg.max_flows = 1;
    let (lb, handle) =
        LoadBalancer::bind(localhost(), vec![(vec![1], s.local_addr().unwrap())], cfg).unwrap();
    let addr = lb.local_addr();
    tokio::spawn(lb.run());
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let first = Endpoint::client(localhost()).unwrap();
    let c = first
        .connect_with(ccfg.clone(), addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    assert_eq!(fetch(&c, 1000).await, 1000);
    // The first client quiet before the second comes (its last acknowledgments out, the
    // server's last packets acknowledged): two clients busy at once on a one-flow table take
    // the flow from each other at every datagram, and either may stall for good.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = Endpoint::client(localhost()).unwrap();
    let c2 = tokio::time::timeout(
        Duration::from_secs(2),
        second.connect_with(ccfg, addr, "localhost").unwrap(),
    )
    .await
    .expect("the second client got a flow")
    .unwrap();
    assert_eq!(handle.flows(), 1);
    assert_eq!(fetch(&c2, 1000).await, 1000);
    // The second client done (two busy clients would take the one flow from each other at
    // every datagram), the first one's next request opens its flow again.
    c2.close(0, b"done");
    second.flush().await;
    assert_eq!(fetch(&c, 1000).await, 1000);
    assert_eq!(handle.flows(), 1);
}

/// A server that stops answering (it no longer takes connections, so its health probes go
/// unanswered) gets no new connection once it missed three probes; it is back once it
/// answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_stops_answering_gets_no_new_connections() {
    let f = fleet_checked(Duration::from_millis(100)).await;
    let up = |f: &Fleet| -> Vec<bool> { f.handle.backends().iter().map(|b| b.up).collect() };
    let wait_for = async |f: &Fleet, want: Vec<bool>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while up(f) != want {
            assert!(std::time::Instant::now() < deadline, "{:?}", up(f));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(
        up(&f),
        [true, true, true],
        "every server answers its probes"
    );
    f.servers[1].set_server_config(None);
    wait_for(&f, vec![true, false, true]).await;
    // Added again (a reload of the backends file), it stays out while it does not answer,
    // through later probe rounds too.
    f.handle.add(&[2], f.servers[1].local_addr().unwrap());
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(up(&f), [true, true, false], "re-added, ordered last");
    let client = Endpoint::client(localhost()).unwrap();
    let before = accepted(&f);
    connect_and_fetch(&client, &f, 15).await;
    let after = accepted(&f);
    assert_eq!(after[1], before[1], "the silent server got none");
    assert_eq!(after.iter().sum::<u64>() - before.iter().sum::<u64>(), 15);
    f.servers[1].set_server_config(Some(f.scfg.clone()));
    wait_for(&f, vec![true, true, true]).await;
}

/// A balancer on a dual-stack socket (`[::]`) checks IPv4 backends: they answer its
/// probes (IPv4 to IPv4) and stay up, a silent one goes down, and IPv4 clients get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_balancer_checks_ipv4_backends() {
    let listen: SocketAddr = "[::]:0".parse().unwrap();
    let f = fleet_on(listen, Duration::from_millis(100), |_| {}).await;
    let up = |f: &Fleet| -> Vec<bool> { f.handle.backends().iter().map(|b| b.up).collect() };
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        up(&f),
        [true, true, true],
        "every server answers its probes"
    );
    let client = Endpoint::client(localhost()).unwrap();
    connect_and_fetch(&client, &f, 3).await;
    f.servers[2].set_server_config(None);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while up(&f) != [true, true, false] {
        assert!(std::time::Instant::now() < deadline, "{:?}", up(&f));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Only what can begin a connection opens a flow (a socket and a task at the balancer):
/// short or unroutable datagrams from an unknown address are dropped, a 1200-byte long
/// header or an ID a server issued opens one, and a flow its server does not answer closes
/// after `unanswered_idle` while an answered one stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_what_can_begin_a_connection_opens_a_flow() {
    let f = fleet_on(localhost(), Duration::from_secs(1), |c| {
        c.unanswered_idle = Duration::from_millis(300);
    })
    .await;
    let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
    let flows_soon = async |want: usize| {
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while f.handle.flows() != want {
            assert!(
                std::time::Instant::now() < deadline,
                "{} flows, not {want}",
                f.handle.flows()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    // A short header: 8 bytes, then a longer one whose ID has codepoint 7 (unroutable).
    raw.send_to(&[0x40, 1, 2, 3, 4, 5, 6, 7], f.lb)
        .await
        .unwrap();
    let mut short = vec![0x40u8; 300];
    short[1] = 0xff;
    raw.send_to(&short, f.lb).await.unwrap();
    // A long header below 1200 bytes: no Initial is that short.
    let mut long = vec![0u8; 1199];
    long[0] = 0xc0;
    long[1..5].copy_from_slice(&1u32.to_be_bytes());
    long[5] = 8;
    raw.send_to(&long, f.lb).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(f.handle.flows(), 0);
    assert_eq!(f.handle.counts(), (0, 3));
    // 1200 bytes: it may be an Initial (this one is not: the server drops it unanswered).
    long.push(0);
    raw.send_to(&long, f.lb).await.unwrap();
    flows_soon(1).await;
    flows_soon(0).await;
    // An ID server 1 issued opens a flow from a new address (a rebound client's), in a
    // datagram as long as a packet with that ID can be (a header-protection sample after
    // the packet number), not shorter.
    let cid = lb_config().encode(&[1], &[9; 6]).unwrap();
    let mut d = vec![0x40u8];
    d.extend_from_slice(&cid);
    d.extend_from_slice(&[0; 19]);
    raw.send_to(&d, f.lb).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        f.handle.flows(),
        0,
        "a datagram too short for a packet opened a flow"
    );
    d.push(0);
    raw.send_to(&d, f.lb).await.unwrap();
    flows_soon(1).await;
    flows_soon(0).await;
    // A real connection's flow is answered and stays past `unanswered_idle`.
    let client = Endpoint::client(localhost()).unwrap();
    let c = connect(&client, &f).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(f.handle.flows(), 1);
    assert_eq!(fetch(&c, 100_000).await, 100_000);
}

/// Flows at their limit: a flood of would-be Initials from many (spoofed) addresses, none
/// of which ever speaks again, does not lock clients out. A new client's flow takes the
/// place of the quietest one, and a connection made before the flood keeps working (its
/// flow kept, or opened again by its server's connection ID).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_one_datagram_flows_does_not_lock_clients_out() {
    const MAX: usize = 8;
    let f = fleet_on(localhost(), Duration::from_secs(1), |c| {
        c.max_flows = MAX;
        c.unanswered_idle = Duration::from_secs(30);
    })
    .await;
    let before = Endpoint::client(localhost()).unwrap();
    let c1 = connect(&before, &f).await;
    assert_eq!(fetch(&c1, 10_000).await, 10_000);
    let mut long = vec![0u8; 1200];
    long[0] = 0xc0;
    long[1..5].copy_from_slice(&1u32.to_be_bytes());
    long[5] = 8;
    let mut spoofed = Vec::new();
    for i in 0..50u8 {
        let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
        long[6] = i;
        raw.send_to(&long, f.lb).await.unwrap();
        spoofed.push(raw);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(f.handle.flows(), MAX, "the table is full");
    let after = Endpoint::client(localhost()).unwrap();
    let c2 = tokio::time::timeout(Duration::from_secs(5), connect(&after, &f))
        .await
        .expect("a new client gets through");
    assert_eq!(fetch(&c2, 10_000).await, 10_000);
    assert_eq!(fetch(&c1, 10_000).await, 10_000);
    assert!(f.handle.flows() <= MAX);
}

/// The same flood, but the spoofed sources keep sending (a few bytes every 10 ms): they never
/// send to the connection ID the backend chose (they do not hear the answer), so their
/// flows make room first however often they speak, and a new client gets through. (Any
/// client datagram used to earn a flow a second chance; this test passed then too, the
/// eviction scan coming round to flows it had just requeued, so it guards the behaviour
/// rather than showing the change.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_flows_that_keep_sending_do_not_lock_clients_out() {
    // More than one eviction scan looks at (64), so that a scan cannot come round to a flow
    // it already gave a second chance.
    const MAX: usize = 100;
    let f = fleet_on(localhost(), Duration::from_secs(1), |c| {
        c.max_flows = MAX;
        c.unanswered_idle = Duration::from_secs(30);
    })
    .await;
    let mut spoofed = Vec::new();
    // As many as the table holds, so that none needs another's place.
    for _ in 0..MAX {
        spoofed.push(tokio::net::UdpSocket::bind(localhost()).await.unwrap());
    }
    let lb = f.lb;
    let flood = tokio::spawn(async move {
        let mut long = vec![0u8; 1200];
        long[0] = 0xc0;
        long[1..5].copy_from_slice(&1u32.to_be_bytes());
        long[5] = 8;
        for (i, raw) in spoofed.iter().enumerate() {
            long[6..8].copy_from_slice(&(i as u16).to_be_bytes());
            let _ = raw.send_to(&long, lb).await;
        }
        // Then a few bytes each every 10 ms, faster than a client's datagrams come: bounded,
        // 10 s at most.
        for _ in 0..1000 {
            for (i, raw) in spoofed.iter().enumerate() {
                long[6..8].copy_from_slice(&(i as u16).to_be_bytes());
                let _ = raw.send_to(&long[..20], lb).await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(f.handle.flows(), MAX, "the table is full");
    let client = Endpoint::client(localhost()).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), connect(&client, &f))
        .await
        .expect("a new client gets through");
    assert_eq!(fetch(&c, 10_000).await, 10_000);
    flood.abort();
}

/// Flows opened by a connection ID that names a backend (a client that moved, or a forged
/// ID: any ID of the right length decodes to some server ID, and an attacker can send its
/// own connection's from many addresses) are never confirmed, so a table full of them kept
/// busy with short datagrams makes room for each of a new client's datagrams. They counted
/// as confirmed before: the client's first datagrams were dropped (the flood had spoken
/// since each was queued), and a flood fast enough kept every one out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_opened_by_forged_connection_ids_do_not_lock_clients_out() {
    const MAX: usize = 100;
    let f = fleet_on(localhost(), Duration::from_secs(1), |c| {
        c.max_flows = MAX;
        c.unanswered_idle = Duration::from_secs(30);
    })
    .await;
    let mut forged = Vec::new();
    for i in 0..MAX {
        let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
        let cid = lb_config()
            .encode(&[i as u8 % 3 + 1], &[i as u8; 6])
            .expect("an ID");
        let mut d = vec![0x40];
        d.extend_from_slice(&cid);
        d.resize(40, 0x5a);
        forged.push((raw, d));
    }
    let lb = f.lb;
    let flood = tokio::spawn(async move {
        // Every 10 ms, faster than a client's datagrams come: bounded, 10 s at most.
        for _ in 0..1000 {
            for (raw, d) in &forged {
                let _ = raw.send_to(d, lb).await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(f.handle.flows(), MAX, "the table is full");
    let (_, dropped) = f.handle.counts();
    let client = Endpoint::client(localhost()).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), connect(&client, &f))
        .await
        .expect("a new client gets through");
    assert_eq!(fetch(&c, 10_000).await, 10_000);
    // Not even its first Initial waited for a retransmission: each found a place.
    assert_eq!(
        f.handle.counts().1,
        dropped,
        "datagrams dropped for want of room"
    );
    flood.abort();
}

/// Retry at the balancer in front of one server with two workers (server IDs 1 and 2 at
/// one address): each Retry's ID names the backend the hash picked, so validated clients
/// reach both workers. The first server ID at the address was named before: every
/// connection on worker 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_at_the_balancer_names_the_worker_the_hash_picked() {
    use kuai::lb::LbRetry;
    use kuai_proto::retry_offload::RetryOffload;
    let key = Arc::new(kuai_proto::TokenKey::random());
    let (mut scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    let p = scfg.proto_mut();
    p.token_key = key.clone();
    p.retry_offload = true;
    p.new_tokens = false;
    let (server, lb_addr, handle) = two_workers_behind_a_balancer(scfg, |c| {
        c.retry = Some(LbRetry::new(
            RetryOffload::new(key, Duration::from_secs(10)),
            lb_config(),
        ));
    });
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let mut conns = Vec::new();
    for _ in 0..16 {
        let client = Endpoint::client(localhost()).unwrap();
        let c = client
            .connect_with(ccfg.clone(), lb_addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        assert_eq!(fetch(&c, 1000).await, 1000);
        conns.push((client, c));
    }
    assert_eq!(handle.retries(), 16);
    let per = server.worker_connection_counts();
    println!("connections per worker: {per:?}");
    assert_eq!(per.iter().sum::<usize>(), 16);
    assert!(per.iter().all(|&n| n > 0), "{per:?}");
}

/// One server with two workers behind the balancer, its worker bits in the QUIC-LB server
/// ID (worker 0 is server 1, worker 1 server 2, both at one address): connections spread
/// over both workers, and a client that moves six times mid-transfer (each time landing
/// on whichever worker the kernel picks for its new address) keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_carry_their_bits_in_the_quic_lb_server_id() {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    let (server, lb_addr, _handle) = two_workers_behind_a_balancer(scfg, |_| {});
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    // Clients of their own (the kernel spreads datagrams over the workers by addresses
    // and ports, so one client address would reach one worker).
    let mut conns = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..20 {
        let client = Endpoint::client(localhost()).unwrap();
        let c = client
            .connect_with(ccfg.clone(), lb_addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        assert_eq!(fetch(&c, 10_000).await, 10_000);
        conns.push(c);
        clients.push(client);
    }
    let client = clients.pop().unwrap();
    let per = server.worker_connection_counts();
    println!("connections per worker: {per:?}");
    assert_eq!(per.iter().sum::<usize>(), 20);
    assert!(per.iter().all(|&n| n > 0), "{per:?}");
    let conn = conns.pop().unwrap();
    let c2 = conn.clone();
    let transfer = tokio::spawn(async move { fetch(&c2, 40 << 20).await });
    // Each move lands on either worker (the kernel's pick): six make it all but certain
    // that some land on the worker that does not hold the connection.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        client.rebind(localhost()).unwrap();
    }
    assert_eq!(transfer.await.unwrap(), 40 << 20);
    assert_eq!(conn.stats().migrations, 6);
    assert_eq!(server.stats().accepted, 20, "no new connection");
}

/// Retry at the balancer: every new client address's first Initial is answered by the
/// balancer with a Retry naming the backend its ID hashes to, the client's next Initial opens a flow to it,
/// and the backend takes the balancer's token (same key, `retry_offload`) and completes the
/// handshake without a Retry of its own. A spoofed source gets a Retry but no flow; a
/// token sent from another address opens none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_at_the_balancer_validates_clients_before_any_flow() {
    use kuai::lb::LbRetry;
    use kuai_proto::retry_offload::RetryOffload;
    let key = Arc::new(kuai_proto::TokenKey::random());
    let k = key.clone();
    let f = fleet_with(
        localhost(),
        Duration::from_secs(1),
        |c| {
            let offload = RetryOffload::new(key, Duration::from_secs(10));
            c.retry = Some(LbRetry::new(offload, lb_config()));
        },
        |s| {
            let p = s.proto_mut();
            p.token_key = k;
            p.retry_offload = true;
            p.new_tokens = false;
        },
    )
    .await;
    // Each from an address of its own (a source with a flow already is not asked again).
    for _ in 0..12 {
        let client = Endpoint::client(localhost()).unwrap();
        connect_and_fetch(&client, &f, 1).await;
    }
    assert_eq!(f.handle.retries(), 12);
    let accepted = accepted(&f);
    assert_eq!(accepted.iter().sum::<u64>(), 12, "{accepted:?}");
    assert!(
        accepted.iter().filter(|&&n| n > 0).count() >= 2,
        "all on one backend: {accepted:?}"
    );
    for s in &f.servers {
        assert_eq!(s.stats().retries_sent, 0);
        assert_eq!(s.stats().invalid_tokens, 0);
    }
    let flows = f.handle.flows();
    // A would-be Initial from an address that never answers: a Retry comes back, no flow.
    let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
    let mut initial = vec![0xc0u8];
    initial.extend_from_slice(&1u32.to_be_bytes());
    initial.push(8);
    initial.extend_from_slice(&[0x33; 8]);
    initial.push(4);
    initial.extend_from_slice(&[0x44; 4]);
    initial.push(0); // no token
    initial.resize(1200, 0);
    raw.send_to(&initial, f.lb).await.unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = tokio::time::timeout(Duration::from_secs(2), raw.recv_from(&mut buf))
        .await
        .expect("no Retry")
        .unwrap();
    let retry = &buf[..n];
    assert_eq!(retry[0] & 0xf0, 0xf0, "not a Retry: {:x}", retry[0]);
    assert_eq!(f.handle.flows(), flows);
    assert_eq!(f.handle.retries(), 13);
    // Its token, sent to the Retry's ID but from another port: dropped, no flow.
    let dcid_len = usize::from(retry[5]);
    let scid_at = 6 + dcid_len;
    let new_cid = &retry[scid_at + 1..scid_at + 1 + usize::from(retry[scid_at])];
    let token = &retry[scid_at + 1 + new_cid.len()..n - 16];
    let mut again = vec![0xc0u8];
    again.extend_from_slice(&1u32.to_be_bytes());
    again.push(new_cid.len() as u8);
    again.extend_from_slice(new_cid);
    again.push(4);
    again.extend_from_slice(&[0x44; 4]);
    again.push(0x40 | (token.len() >> 8) as u8);
    again.push(token.len() as u8);
    again.extend_from_slice(token);
    again.resize(1200, 0);
    let elsewhere = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
    let (_, dropped) = f.handle.counts();
    elsewhere.send_to(&again, f.lb).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        f.handle.flows(),
        flows,
        "a token from another address opened a flow"
    );
    assert_eq!(f.handle.counts().1, dropped + 1);
    assert_eq!(f.handle.retries(), 13);
    // It is answered with an Initial closing the attempt (INVALID_TOKEN, RFC 9000 §8.1.2).
    let mut close = [0u8; 1500];
    let (n, _) = tokio::time::timeout(Duration::from_secs(2), elsewhere.recv_from(&mut close))
        .await
        .expect("no close for the invalid token")
        .unwrap();
    assert_eq!(
        close[0] & 0xf0,
        0xc0,
        "not an Initial: {:x?}",
        &close[..n.min(8)]
    );
    assert!(n < 100);
    // Nor through a flow that source opened by ID with a short header (which opens one
    // whatever the source): the token is checked on every Initial.
    let mut short = vec![0x40u8];
    short.extend_from_slice(new_cid);
    short.resize(64, 0);
    elsewhere.send_to(&short, f.lb).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while f.handle.flows() != flows + 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the short header opened no flow"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (forwarded, dropped) = f.handle.counts();
    elsewhere.send_to(&again, f.lb).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        f.handle.counts(),
        (forwarded, dropped + 1),
        "another address's token went through an open flow"
    );
    // An Initial in a datagram under 1200 bytes gets no Retry (RFC 9000 §14.1: it would
    // amplify); a version the backends do not speak gets Version Negotiation.
    raw.send_to(&initial[..1199], f.lb).await.unwrap();
    let mut unknown = initial.clone();
    unknown[1..5].copy_from_slice(&0x1a2a_3a4au32.to_be_bytes());
    raw.send_to(&unknown, f.lb).await.unwrap();
    let (n, _) = tokio::time::timeout(Duration::from_secs(2), raw.recv_from(&mut buf))
        .await
        .expect("no Version Negotiation")
        .unwrap();
    assert_eq!(
        &buf[1..5],
        &[0; 4],
        "not Version Negotiation: {:x?}",
        &buf[..n]
    );
    assert_eq!(f.handle.retries(), 13);
    let flows = f.handle.flows();
    // From the address it was given to, the token opens a flow.
    raw.send_to(&again, f.lb).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while f.handle.flows() != flows + 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the token opened no flow"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Behind the balancer every client reaches a server from the balancer's address: servers
/// that list it in `proxies` count each flow as a client for their per-address limits (one
/// connection per client here: five clients over three servers would otherwise be refused
/// on some server), and the balancer caps the flows of one client address instead, where
/// flows never confirmed (a spoofer's in the address's name) make room first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_count_clients_behind_the_balancer_by_flow() {
    let f = fleet_with(
        localhost(),
        Duration::from_secs(1),
        |c| {
            c.max_flows_per_address = 5;
            // Unanswered flows would otherwise make room by idling out within the test.
            c.unanswered_idle = Duration::from_secs(60);
        },
        |s| {
            let p = s.proto_mut();
            p.max_connections_per_ip = 1;
            p.proxies = vec!["127.0.0.1".parse().unwrap()];
        },
    )
    .await;
    // Three flows from 127.0.0.1 that never confirm (a spoofer's, in its name): at the cap
    // they make room for the real clients' flows.
    let mut long = vec![0u8; 1200];
    long[0] = 0xc0;
    long[1..5].copy_from_slice(&1u32.to_be_bytes());
    long[5] = 8;
    let mut spoofers = Vec::new();
    for _ in 0..3 {
        let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
        raw.send_to(&long, f.lb).await.unwrap();
        spoofers.push(raw);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while f.handle.flows() != 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} flows",
            f.handle.flows()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut conns = Vec::new();
    for _ in 0..5 {
        let client = Endpoint::client(localhost()).unwrap();
        let c = connect(&client, &f).await;
        assert_eq!(fetch(&c, 1000).await, 1000);
        conns.push((client, c));
    }
    assert_eq!(f.handle.flows(), 5);
    // With five confirmed ones, a sixth flow from 127.0.0.1 is not opened; another
    // address's is.
    let raw = tokio::net::UdpSocket::bind(localhost()).await.unwrap();
    let mut long = vec![0u8; 1200];
    long[0] = 0xc0;
    long[1..5].copy_from_slice(&1u32.to_be_bytes());
    long[5] = 8;
    let (_, dropped) = f.handle.counts();
    raw.send_to(&long, f.lb).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(f.handle.flows(), 5);
    assert_eq!(f.handle.counts().1, dropped + 1);
    let other = Endpoint::client("127.0.0.2:0".parse().unwrap()).unwrap();
    let c = connect(&other, &f).await;
    assert_eq!(fetch(&c, 1000).await, 1000);
    assert_eq!(f.handle.flows(), 6);
}

/// IPv6 backends behind a dual-stack balancer: their health probes are answered (an IPv6
/// socket probes them), an IPv6 client and an IPv4 one both get through, and the IPv6
/// client keeps its connection when it rebinds mid-transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_backends_serve_ipv6_and_ipv4_clients() {
    let v6: SocketAddr = "[::1]:0".parse().unwrap();
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    let servers: Vec<Endpoint> = (1..=2u8)
        .map(|sid| {
            let mut ec = EndpointConfig::default();
            ec.proto.cid_generator =
                Arc::new(move || Box::new(QuicLbCids::new(lb_config(), &[sid]).unwrap()));
            serve_gets(
                Endpoint::builder()
                    .endpoint_config(ec)
                    .server(scfg.clone())
                    .bind(v6)
                    .unwrap(),
            )
        })
        .collect();
    let mut decoder = QuicLbDecoder::new();
    decoder.add(lb_config());
    let config = LbConfig {
        health_interval: Some(Duration::from_millis(100)),
        ..LbConfig::new(decoder, lb_config().cid_len())
    };
    let backends = servers
        .iter()
        .enumerate()
        .map(|(i, s)| (vec![i as u8 + 1], s.local_addr().unwrap()))
        .collect();
    let (lb, handle) = LoadBalancer::bind("[::]:0".parse().unwrap(), backends, config).unwrap();
    let port = lb.local_addr().port();
    tokio::spawn(lb.run());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        handle.backends().iter().all(|b| b.up),
        "an IPv6 backend missed its probes: {:?}",
        handle.backends()
    );
    let ccfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    for (bind, to) in [("[::1]:0", "[::1]"), ("127.0.0.1:0", "127.0.0.1")] {
        let client = Endpoint::client(bind.parse().unwrap()).unwrap();
        let lb_addr: SocketAddr = format!("{to}:{port}").parse().unwrap();
        let conn = client
            .connect_with(ccfg.clone(), lb_addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        assert_eq!(fetch(&conn, 100_000).await, 100_000);
        if to.starts_with('[') {
            let c2 = conn.clone();
            let transfer = tokio::spawn(async move { fetch(&c2, 8 << 20).await });
            tokio::time::sleep(Duration::from_millis(30)).await;
            client.rebind(v6).unwrap();
            assert_eq!(transfer.await.unwrap(), 8 << 20);
            assert_eq!(conn.stats().migrations, 1);
        }
    }
    let total: u64 = servers.iter().map(|s| s.stats().accepted).sum();
    assert_eq!(total, 2);
    assert_eq!(handle.counts().1, 0, "datagrams dropped");
}

/// A server whose connection IDs are shorter than 8 bytes (a QUIC-LB configuration with a
/// 4-byte nonce: 6-byte IDs) and that validates with Retry: the client's Initial after the
/// Retry goes to the Retry's 6-byte ID, which RFC 9000 §7.2's 8-byte minimum (for a
/// client's first ID only) must not refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_to_a_short_connection_id_completes() {
    let short = QuicLbConfig::new(0, 1, 4, Some(KEY)).unwrap();
    assert_eq!(short.cid_len(), 6);
    let (mut scfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
    scfg.retry(kuai_proto::RetryPolicy::Always);
    let mut ec = EndpointConfig::default();
    ec.proto.cid_generator =
        Arc::new(move || Box::new(QuicLbCids::new(short.clone(), &[1]).unwrap()));
    let server = serve_gets(
        Endpoint::builder()
            .endpoint_config(ec)
            .server(scfg)
            .bind(localhost())
            .unwrap(),
    );
    let client = Endpoint::client(localhost()).unwrap();
    let conn = client
        .connect_with(
            ClientConfig::with_root(cert, &[ALPN]).unwrap(),
            server.local_addr().unwrap(),
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    assert_eq!(fetch(&conn, 1000).await, 1000);
    assert_eq!(server.stats().retries_sent, 1);
}
