//! Handshake and a small transfer in lock step (no simulated network), as a smoke test.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kuai_proto::config::TransportConfig;
use kuai_proto::{Dir, Endpoint, Event, StreamEvent};

fn pump(now: Instant, from: &mut Endpoint, from_addr: SocketAddr, to: &mut Endpoint) -> usize {
    let mut buf = Vec::new();
    let mut n = 0;
    while let Some(t) = from.poll_transmit(now, 1, &mut buf) {
        assert!(n < 1000, "endless transmit");
        if n < 20 {
            eprintln!("tx {} bytes first={:02x}", t.size, buf[0]);
        }
        to.handle_datagram(now, from_addr, None, t.ecn, BytesMut::from(&buf[..t.size]));
        n += 1;
    }
    n
}

#[test]
fn handshake_and_echo_in_lock_step() {
    let certs = support::certs();
    let mut now = Instant::now();
    let saddr: SocketAddr = "127.0.0.1:4433".parse().unwrap();
    let caddr: SocketAddr = "127.0.0.1:5000".parse().unwrap();
    let scfg = Arc::new(support::server_config(&certs, TransportConfig::default()));
    let ccfg = support::client_config(&certs, TransportConfig::default());
    let mut server = Endpoint::new(support::endpoint_config(), Some(scfg), now, 0, Some(1));
    let mut client = Endpoint::new(support::endpoint_config(), None, now, 0, Some(2));
    let ch = client.connect(now, &ccfg, saddr, "localhost").unwrap();
    let mut connected = false;
    for _ in 0..50 {
        let a = pump(now, &mut client, caddr, &mut server);
        let b = pump(now, &mut server, saddr, &mut client);
        while let Some((_, e)) = client.poll_event() {
            if e == Event::Connected {
                connected = true;
            }
        }
        if a + b == 0 {
            now += Duration::from_millis(1);
            client.handle_timeout(now);
            server.handle_timeout(now);
        }
        if connected {
            break;
        }
    }
    assert!(connected, "client did not connect");
    let c = client.connection_mut(ch).unwrap();
    let id = c.open_stream(Dir::Bi).unwrap();
    c.write(id, Bytes::from_static(b"hello kuai")).unwrap();
    c.finish(id).unwrap();
    let mut got = Vec::new();
    let mut sh = None;
    for _ in 0..50 {
        pump(now, &mut client, caddr, &mut server);
        pump(now, &mut server, saddr, &mut client);
        while let Some(h) = server.accept() {
            sh = Some(h);
        }
        while let Some((h, e)) = server.poll_event() {
            if let Event::Stream(StreamEvent::Readable(sid)) = e {
                let conn = server.connection_mut(h).unwrap();
                while let Ok(Some(b)) = conn.read(sid, usize::MAX) {
                    got.extend_from_slice(&b);
                }
            }
        }
        now += Duration::from_millis(1);
        client.handle_timeout(now);
        server.handle_timeout(now);
    }
    assert!(sh.is_some());
    assert_eq!(got, b"hello kuai");
}
