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

/// Connects a client and a server endpoint in lock step; returns the client's handle.
fn connected(
    now: Instant,
    client: &mut Endpoint,
    caddr: SocketAddr,
    server: &mut Endpoint,
    saddr: SocketAddr,
    ccfg: &kuai_proto::ClientConfig,
) -> kuai_proto::ConnectionHandle {
    let ch = client.connect(now, ccfg, saddr, "localhost").unwrap();
    for _ in 0..50 {
        pump(now, client, caddr, server);
        pump(now, server, saddr, client);
        while let Some((_, e)) = client.poll_event() {
            if e == Event::Connected {
                return ch;
            }
        }
    }
    panic!("client did not connect");
}

const SADDR: &str = "127.0.0.1:4433";
const CADDR: &str = "127.0.0.1:5000";

/// A server and a client endpoint with these transport configs, connected in lock step at
/// `now`: (server, client, the client's connection, server address, client address).
fn connected_pair(
    now: Instant,
    stransport: TransportConfig,
    ctransport: TransportConfig,
) -> (
    Endpoint,
    Endpoint,
    kuai_proto::ConnectionHandle,
    SocketAddr,
    SocketAddr,
) {
    let certs = support::certs();
    let (saddr, caddr) = (SADDR.parse().unwrap(), CADDR.parse().unwrap());
    let scfg = Arc::new(support::server_config(&certs, stransport));
    let ccfg = support::client_config(&certs, ctransport);
    let mut server = Endpoint::new(support::endpoint_config(), Some(scfg), now, 0, Some(1));
    let mut client = Endpoint::new(support::endpoint_config(), None, now, 0, Some(2));
    let ch = connected(now, &mut client, caddr, &mut server, saddr, &ccfg);
    (server, client, ch, saddr, caddr)
}

/// `take_send_hint` says when a stream call queued something the endpoint must be polled to
/// send, and only then: an event loop wakes its sender on it.
#[test]
fn send_hints_mark_what_needs_a_transmit() {
    let now = Instant::now();
    let stransport = TransportConfig {
        stream_receive_window: 4096,
        max_stream_receive_window: 4096,
        ..TransportConfig::default()
    };
    let (mut server, mut client, ch, _, caddr) =
        connected_pair(now, stransport, TransportConfig::default());
    let c = client.connection_mut(ch).unwrap();
    let _ = c.take_send_hint();

    // The first bytes of a stream need a transmit; more behind them, and a FIN, do not.
    let a = c.open_stream(Dir::Bi).unwrap();
    assert_eq!(c.write(a, Bytes::from_static(b"first")).unwrap(), 5);
    assert!(c.take_send_hint());
    assert!(!c.take_send_hint(), "taking clears the hint");
    c.write(a, Bytes::from_static(b" and more")).unwrap();
    assert!(!c.take_send_hint(), "bytes behind unsent bytes");
    c.finish(a).unwrap();
    assert!(!c.take_send_hint(), "a FIN behind unsent bytes");

    // The server reads: credit to announce once enough of its 4 KiB stream window is read,
    // and room for a new stream once a peer's stream is read to its end.
    let b = c.open_stream(Dir::Bi).unwrap();
    c.write(b, Bytes::from(vec![7u8; 3000])).unwrap();
    let u = c.open_stream(Dir::Uni).unwrap();
    c.write(u, Bytes::from_static(b"uni")).unwrap();
    c.finish(u).unwrap();
    assert!(c.take_send_hint());
    pump(now, &mut client, caddr, &mut server);
    let sh = server.accept().expect("server connection");
    let mut hints = Vec::new();
    let mut got = 0;
    let s = server.connection_mut(sh).unwrap();
    let _ = s.take_send_hint();
    while let Ok(Some(chunk)) = s.read(b, 500) {
        got += chunk.len();
        hints.push(s.take_send_hint());
    }
    assert_eq!(got, 3000);
    assert!(
        hints.contains(&false),
        "small reads announce nothing: {hints:?}"
    );
    assert!(
        hints.contains(&true),
        "credit once the window is half read: {hints:?}"
    );
    assert_eq!(s.read(u, usize::MAX).unwrap().as_deref(), Some(&b"uni"[..]));
    let _ = s.take_send_hint();
    assert_eq!(s.read(u, usize::MAX).unwrap(), None);
    assert!(
        s.take_send_hint(),
        "a finished peer stream frees room for another"
    );

    // Once everything went out, a FIN alone needs its own frame.
    let c = client.connection_mut(ch).unwrap();
    c.finish(b).unwrap();
    assert!(c.take_send_hint(), "a FIN after all bytes were sent");
}

/// A writer whose send buffer filled is told it may write again once an eighth of the buffer
/// is free, not after each ACK frees a packet's worth: a bulk writer wakes for large writes.
#[test]
fn writable_waits_for_an_eighth_of_the_send_buffer() {
    let now = Instant::now();
    let send_buffer = 64 * 1024;
    let ctransport = TransportConfig {
        send_buffer,
        ..TransportConfig::default()
    };
    let (mut server, mut client, ch, saddr, caddr) =
        connected_pair(now, TransportConfig::default(), ctransport);
    let c = client.connection_mut(ch).unwrap();
    let a = c.open_stream(Dir::Uni).unwrap();
    let data = Bytes::from(vec![1u8; send_buffer as usize + 1]);
    assert_eq!(c.write(a, data).unwrap(), send_buffer as usize);
    let mut buf = Vec::new();
    let mut acked_steps = 0;
    let mut now = now;
    for _ in 0..2000 {
        // One datagram to the server, then whatever it answers (an ACK every 2 packets).
        now += Duration::from_micros(200);
        client.handle_timeout(now);
        server.handle_timeout(now);
        if let Some(t) = client.poll_transmit(now, 1, &mut buf) {
            server.handle_datagram(now, caddr, None, t.ecn, BytesMut::from(&buf[..t.size]));
        }
        if pump(now, &mut server, saddr, &mut client) > 0 {
            acked_steps += 1;
        }
        while let Some((_, e)) = client.poll_event() {
            if e == Event::Stream(StreamEvent::Writable(a)) {
                let room = client
                    .connection_mut(ch)
                    .unwrap()
                    .write_capacity(a)
                    .unwrap();
                assert!(
                    room >= send_buffer / 8,
                    "woken with {room} bytes of room after {acked_steps} ACKs"
                );
                assert!(acked_steps > 1, "one ACK freed an eighth of the buffer");
                return;
            }
        }
    }
    panic!("no Writable event");
}
