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
    let server = Endpoint::server(cfg, localhost()).unwrap();
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
    let client = Endpoint::client(localhost()).unwrap();
    let conn = client
        .connect_with(
            ClientConfig::with_root(cert, &[ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    assert_eq!(conn.alpn().as_deref(), Some(ALPN));
    assert_eq!(fetch(&conn, 1000).await, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_100mb_intact_and_batched() {
    let (scfg, cert) = server_config();
    let (server, addr) = start_server(scfg).await;
    let client = Endpoint::client(localhost()).unwrap();
    let conn = client
        .connect_with(
            ClientConfig::with_root(cert, &[ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
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
