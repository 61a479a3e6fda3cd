//! The client against kuai-http's server on loopback: protocol choice, racing, Alt-Svc,
//! broken HTTP/3, 0-RTT, uploads.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::Method;

use super::*;
use crate::server::tests::{TestSite, identity};
use crate::{Limits, Listener, Server};

/// A server for `TestSite` with TCP and QUIC on different ports, advertising its QUIC port
/// with Alt-Svc or not: its TCP address, its QUIC address, the certificate.
async fn split_server(
    alt_svc: bool,
) -> (
    SocketAddr,
    SocketAddr,
    rustls::pki_types::CertificateDer<'static>,
) {
    let (cert, tls) = identity();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (tcp_addr, quic_addr) = serve_split(tcp, tls, alt_svc);
    (tcp_addr, quic_addr, cert)
}

/// Serves `TestSite` over `tcp` and a QUIC endpoint on a port of its own; the two addresses.
fn serve_split(
    tcp: tokio::net::TcpListener,
    tls: rustls::ServerConfig,
    alt_svc: bool,
) -> (SocketAddr, SocketAddr) {
    let tcp_addr = tcp.local_addr().unwrap();
    let mut qtls = tls.clone();
    qtls.alpn_protocols = vec![ALPN_H3.to_vec()];
    let ep = kuai::Endpoint::builder()
        .server(kuai::ServerConfig::from_rustls(qtls))
        .bind("127.0.0.1:0".parse().unwrap())
        .unwrap();
    let quic_addr = ep.local_addr().unwrap();
    let listener = Listener::new(ep).with_tcp(tcp, tls);
    let max_age = alt_svc.then_some(Duration::from_secs(86400));
    tokio::spawn(
        Server::new(TestSite { dir: None })
            .limits(Limits::default())
            .alt_svc_max_age(max_age)
            .serve(listener),
    );
    (tcp_addr, quic_addr)
}

/// A server for `TestSite` on one port of 127.0.0.1 (HTTP/3, HTTP/2 and HTTP/1.1): its
/// address and certificate.
async fn site() -> (SocketAddr, rustls::pki_types::CertificateDer<'static>) {
    let (cert, tls) = identity();
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Server::new(TestSite { dir: None }).serve(listener));
    (addr, cert)
}

/// Counts and drops every datagram that reaches `addr` (a UDP port a firewall blocks).
async fn udp_sink(addr: SocketAddr) -> Arc<AtomicUsize> {
    let sink = tokio::net::UdpSocket::bind(addr).await.unwrap();
    let swallowed = Arc::new(AtomicUsize::new(0));
    let n = swallowed.clone();
    tokio::spawn(async move {
        let mut b = vec![0u8; 65536];
        while sink.recv_from(&mut b).await.is_ok() {
            n.fetch_add(1, Ordering::Relaxed);
        }
    });
    swallowed
}

fn client(cert: &rustls::pki_types::CertificateDer<'static>) -> ClientBuilder {
    Client::builder()
        .system_roots(false)
        .add_root_certificate(cert.clone())
}

fn url(addr: SocketAddr, path: &str) -> String {
    format!("https://localhost:{}{path}", addr.port())
}

/// HTTP/3 on the URL's port when the server has it there; a body goes up and comes back;
/// the next connection resumes and sends its GET in 0-RTT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http3_first_uploads_and_0rtt() {
    let (addr, cert) = site().await;
    let c = client(&cert)
        .resolve("localhost", addr.port(), addr)
        .build()
        .unwrap();
    let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http3);
    assert_eq!(resp.status(), 200);
    assert_eq!(
        &resp.bytes().await.unwrap()[..],
        b"hello from kuai over QUIC\n"
    );
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 249) as u8).collect();
    let resp = c
        .request(Method::POST, &url(addr, "/echo"))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-protocol"], "h3");
    assert!(resp.bytes().await.unwrap() == data);
    c.await_session_tickets().await;
    c.close_connections();
    let resp = c.get(&url(addr, "/echo")).send().await.unwrap();
    let info = resp.connection();
    assert!(info.resumed, "{info:?}");
    assert_eq!(resp.headers()["x-early"], "true", "the GET went in 0-RTT");
    assert!(!resp.timings().reused);
    resp.bytes().await.unwrap();
    let again = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
    assert!(again.timings().reused);
    again.bytes().await.unwrap();
    // An idempotent but unsafe method waits for the handshake (RFC 8470 §2.1).
    c.await_session_tickets().await;
    c.close_connections();
    let resp = c
        .request(Method::PUT, &url(addr, "/echo"))
        .body(b"put".to_vec())
        .send()
        .await
        .unwrap();
    assert!(resp.connection().resumed);
    assert_eq!(
        resp.headers()["x-early"],
        "false",
        "the PUT waited for the handshake"
    );
}

/// Nothing on the URL's UDP port: the host says so (ICMP), and TCP starts at once, long
/// before the race delay (5 s here). The HTTP/2 response's Alt-Svc points at the HTTP/3
/// port: the next request goes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_quic_port_falls_back_at_once_and_alt_svc_moves_to_http3() {
    let (tcp, quic, cert) = split_server(true).await;
    let c = client(&cert)
        .resolve("localhost", tcp.port(), tcp)
        .race_delay(Duration::from_secs(5))
        .build()
        .unwrap();
    let t = Instant::now();
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    let took = t.elapsed();
    assert_eq!(resp.protocol(), Protocol::Http2);
    assert_eq!(
        resp.headers()["alt-svc"],
        format!("h3=\":{}\"; ma=86400", quic.port()).as_str()
    );
    resp.bytes().await.unwrap();
    eprintln!("HTTP/2 after {took:?} (race delay 5 s)");
    assert!(took < Duration::from_secs(1), "{took:?}");
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    assert_eq!(
        resp.protocol(),
        Protocol::Http3,
        "the next request after Alt-Svc"
    );
    assert_eq!(resp.remote_addr(), quic);
    resp.bytes().await.unwrap();
}

/// Nothing listening at all: the error says refused, at once (not after the connect
/// timeout), as curl does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_refused_at_once() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let c = Client::builder()
        .system_roots(false)
        .race_delay(Duration::from_secs(5))
        .build()
        .unwrap();
    let t = Instant::now();
    let e = c
        .get(&format!("https://127.0.0.1:{port}/"))
        .send()
        .await
        .unwrap_err();
    eprintln!("{e} after {:?}", t.elapsed());
    assert!(e.is_refused(), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// UDP blocked (a socket on the port swallows every datagram, as a firewall would): TCP
/// wins the race, HTTP/3 is marked broken when it times out, and a later client with the
/// same state file goes straight to TCP without sending a single datagram.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_udp_is_marked_broken_and_skipped_next_time() {
    let (tcp, _, cert) = split_server(false).await;
    let swallowed = udp_sink(tcp).await;
    let state = std::env::temp_dir().join(format!("kuai-client-broken-{}", std::process::id()));
    let _ = std::fs::remove_file(&state);
    let build = || {
        client(&cert)
            .resolve("localhost", tcp.port(), tcp)
            .state_file(&state)
            .connect_timeout(Duration::from_millis(1500))
            .build()
            .unwrap()
    };
    let c = build();
    let t = Instant::now();
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http2);
    let took = t.elapsed();
    eprintln!(
        "HTTP/2 after {took:?}, {} datagrams swallowed",
        swallowed.load(Ordering::Relaxed)
    );
    assert!(
        took >= Duration::from_millis(240),
        "TCP waited for the race delay: {took:?}"
    );
    assert!(swallowed.load(Ordering::Relaxed) > 0, "HTTP/3 was tried");
    resp.bytes().await.unwrap();
    // While the HTTP/3 attempt goes on in the background, the next requests take the open
    // TCP connection at once: HTTP/3 had its head start and lost.
    for _ in 0..3 {
        let t = Instant::now();
        let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
        assert_eq!(resp.protocol(), Protocol::Http2);
        resp.bytes().await.unwrap();
        let took = t.elapsed();
        assert!(took < Duration::from_millis(150), "waited again: {took:?}");
    }
    // The HTTP/3 attempt, silent, marks the network broken, on disk too; it ends at its
    // timeout (1.5 s).
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(&state).unwrap_or_default();
        if text.contains("broken localhost") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not marked broken: {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(c);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let before = swallowed.load(Ordering::Relaxed);
    let c = build();
    let t = Instant::now();
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    let took = t.elapsed();
    assert_eq!(resp.protocol(), Protocol::Http2);
    resp.bytes().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    eprintln!("straight to HTTP/2: {took:?}");
    assert!(took < Duration::from_millis(200), "{took:?}");
    assert_eq!(
        swallowed.load(Ordering::Relaxed),
        before,
        "no HTTP/3 attempt on a network where it is broken"
    );
    std::fs::remove_file(&state).unwrap();
}

/// A short-lived client (one `kuai get`) never sees its HTTP/3 attempt time out: when not
/// one datagram came back while TCP connected, HTTP/3 is marked broken at once, so the
/// next process goes straight to TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_udp_is_marked_broken_before_the_attempt_times_out() {
    let (tcp, _, cert) = split_server(false).await;
    let swallowed = udp_sink(tcp).await;
    let state = std::env::temp_dir().join(format!("kuai-client-silent-{}", std::process::id()));
    let _ = std::fs::remove_file(&state);
    let build = || {
        client(&cert)
            .resolve("localhost", tcp.port(), tcp)
            .state_file(&state)
            .connect_timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    };
    let c = build();
    let start = Instant::now();
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http2);
    resp.bytes().await.unwrap();
    drop(c);
    let text = std::fs::read_to_string(&state).unwrap_or_default();
    assert!(
        text.contains("broken localhost"),
        "not marked broken: {text}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    // The first client's attempt goes on in the background until its timeout (a late
    // answer would clear the mark): the next client is counted after it.
    tokio::time::sleep_until((start + Duration::from_millis(2300)).into()).await;
    let before = swallowed.load(Ordering::Relaxed);
    assert!(before > 0, "HTTP/3 was tried");
    let c = build();
    let t = Instant::now();
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http2);
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    resp.bytes().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        swallowed.load(Ordering::Relaxed),
        before,
        "HTTP/3 tried again"
    );
    std::fs::remove_file(&state).unwrap();
}

/// Only HTTP/2, only HTTP/1.1: the mode is obeyed, and HTTP/1.1 connections are reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_modes_and_http11_reuse() {
    let (addr, cert) = site().await;
    for (mode, proto) in [
        (Mode::Http2, Protocol::Http2),
        (Mode::Http11, Protocol::Http11),
    ] {
        let c = client(&cert)
            .mode(mode)
            .resolve("localhost", addr.port(), addr)
            .build()
            .unwrap();
        for i in 0..3 {
            let resp = c.get(&url(addr, "/bytes/100000")).send().await.unwrap();
            assert_eq!(resp.protocol(), proto);
            assert_eq!(resp.timings().reused, i > 0, "{mode:?} request {i}");
            assert_eq!(resp.bytes().await.unwrap().len(), 100_000);
        }
        let resp = c
            .request(Method::POST, &url(addr, "/echo"))
            .body("up")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.text().await.unwrap(), "up");
        // A small body read whole in one chunk (hyper knows it ended with that chunk):
        // the connection still goes back to the pool, the next request reuses it.
        let mut remotes = Vec::new();
        for _ in 0..2 {
            let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
            remotes.push(resp.headers()["x-remote"].clone());
            assert_eq!(
                &resp.bytes().await.unwrap()[..],
                b"hello from kuai over QUIC\n"
            );
        }
        assert_eq!(remotes[0], remotes[1], "{mode:?}: one connection for both");
    }
}

/// One listener, two hosts: each name gets its own certificate (SNI), over HTTP/3 and TCP; a
/// name not added gets the default one; with no default, its handshake fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_chosen_by_server_name() {
    let make = |name: &str| {
        let ck = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
        (ck.cert.der().clone(), key)
    };
    let (a, a_key) = make("a.test");
    let (b, b_key) = make("*.b.test");
    let (d, d_key) = make("default.test");
    let mut certs = crate::Certificates::new();
    certs.add("a.test", vec![a.clone()], a_key).unwrap();
    certs
        .add("*.b.test", vec![b.clone()], b_key.clone_key())
        .unwrap();
    let tls = certs.into_tls().unwrap();
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Server::new(TestSite { dir: None }).serve(listener));
    for mode in [Mode::Http3, Mode::Http2] {
        let c = Client::builder()
            .system_roots(false)
            .mode(mode)
            .add_root_certificate(a.clone())
            .add_root_certificate(b.clone())
            .resolve("a.test", addr.port(), addr)
            .resolve("www.b.test", addr.port(), addr)
            .resolve("c.test", addr.port(), addr)
            .connect_timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        for host in ["a.test", "www.b.test"] {
            let u = format!("https://{host}:{}/hello.txt", addr.port());
            let r = c.get(&u).send().await;
            assert!(r.is_ok(), "{mode:?} {host}: {:?}", r.err());
        }
        let u = format!("https://c.test:{}/hello.txt", addr.port());
        assert!(
            c.get(&u).send().await.is_err(),
            "{mode:?}: c.test has no certificate"
        );
    }
    // With a default, an unknown name gets it.
    let mut certs = crate::Certificates::new();
    // A key that is not the certificate's is refused.
    assert!(
        certs
            .add("a.test", vec![a.clone()], make("a.test").1)
            .is_err()
    );
    certs.default_certificate(vec![d.clone()], d_key).unwrap();
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), certs.into_tls().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Server::new(TestSite { dir: None }).serve(listener));
    let c = Client::builder()
        .system_roots(false)
        .add_root_certificate(d)
        .resolve("default.test", addr.port(), addr)
        .build()
        .unwrap();
    let u = format!("https://default.test:{}/hello.txt", addr.port());
    assert_eq!(c.get(&u).send().await.unwrap().status(), 200);
}

/// A redirect from an HTTP/3 server to another origin that only TCP reaches: followed, over
/// HTTP/2 there, with the body sent again (307); with redirects off, the 307 is the answer.
/// (Both servers are "localhost": the session from the first must not put the second in
/// 0-RTT, where nothing listens on its UDP port.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_are_followed_across_servers_and_protocols() {
    let (cert, tls) = identity();
    let a = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let a_addr = a.local_addr().unwrap();
    tokio::spawn(Server::new(TestSite { dir: None }).serve(a));
    let (b_addr, _, b_cert) = split_server(false).await;
    let build = |n| {
        client(&cert)
            .add_root_certificate(b_cert.clone())
            .resolve("localhost", a_addr.port(), a_addr)
            .resolve("localhost", b_addr.port(), b_addr)
            .redirects(n)
            .build()
            .unwrap()
    };
    let c = build(10);
    // A Host the caller set is for the first origin only (as curl does), and so are
    // credentials.
    let resp = c
        .request(
            Method::POST,
            &url(a_addr, &format!("/to/{}/echo", b_addr.port())),
        )
        .header("host", format!("localhost:{}", a_addr.port()))
        .header("authorization", "Basic YTpi")
        .header("proxy-authorization", "Basic YTpi")
        .header("cookie", "a=b")
        .body("again")
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["x-credentials"],
        "",
        "credentials went to another origin"
    );
    assert_eq!(resp.redirects(), 1);
    assert_eq!(resp.protocol(), Protocol::Http2);
    assert_eq!(resp.url().port_u16(), Some(b_addr.port()));
    assert_ne!(
        resp.headers()["x-host"],
        format!("localhost:{}", a_addr.port()).as_str(),
        "the first origin's Host went to the second"
    );
    assert_eq!(resp.text().await.unwrap(), "again");
    let c = build(0);
    let resp = c
        .get(&url(a_addr, &format!("/to/{}/hello.txt", b_addr.port())))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 307);
    assert_eq!(resp.protocol(), Protocol::Http3);
    // Only the redirects of RFC 9110 §15.4 are followed: a 305 (Use Proxy, deprecated), a
    // 300 or a code no RFC defines is the answer, and its POST goes nowhere else.
    let c = build(10);
    for code in [300, 305, 306, 399] {
        let resp = c
            .request(
                Method::POST,
                &url(a_addr, &format!("/to/{}/echo?{code}", b_addr.port())),
            )
            .body("once")
            .send()
            .await
            .unwrap();
        assert_eq!((resp.status().as_u16(), resp.redirects()), (code, 0));
    }
    // Asked to follow: one past the limit (a loop), or to plain http, is an error, not the
    // redirect as if it were the answer.
    let c = build(2);
    let a = a_addr.port();
    let e = c
        .get(&url(a_addr, &format!("/to/{a}/to/{a}/to/{a}/hello.txt")))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Redirect {
                reason: "too many redirects",
                ..
            }
        ),
        "{e}"
    );
    let ok = c
        .get(&url(a_addr, &format!("/to/{a}/to/{a}/hello.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!((ok.status().as_u16(), ok.redirects()), (200, 2));
    let e = c.get(&url(a_addr, "/insecure")).send().await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Redirect {
                reason: "not https",
                ..
            }
        ),
        "{e}"
    );
}

/// HTTP/3 worked at an address, then its UDP port went silent (a socket swallows every
/// datagram, as a firewall would): the next connection goes in 0-RTT, gets no answer, its
/// handshake does not complete within the connect timeout, HTTP/3 is marked broken and the
/// request goes over TCP, long before QUIC's idle timeout (30 s). A GET went out in 0-RTT
/// and is sent again; a POST waited for the handshake and so was never sent: it goes over
/// TCP too rather than failing. Whether the 0-RTT connection is up before TCP is raced or
/// wins the race (a race delay of zero, as a loaded scheduler makes it, with TCP's TLS
/// answered late), it is watched alike. One thread: the attempt cannot be up before the
/// zero delay has run out, so the second case takes the race every time.
#[tokio::test]
async fn a_0rtt_attempt_to_a_silent_port_falls_back_to_tcp() {
    let cases = [Method::GET, Method::POST]
        .into_iter()
        .flat_map(|m| [(m.clone(), None), (m, Some(Duration::ZERO))]);
    for (method, race) in cases {
        let (cert, tls) = identity();
        let mut qtls = tls.clone();
        qtls.alpn_protocols = vec![ALPN_H3.to_vec()];
        // The TCP port is held but its TLS never answered: HTTP/3 wins the first race. (The
        // UDP port's number may be another test's TCP port: then another pair.)
        let mut pair = None;
        for _ in 0..50 {
            let ep = kuai::Endpoint::builder()
                .server(kuai::ServerConfig::from_rustls(qtls.clone()))
                .bind("127.0.0.1:0".parse().unwrap())
                .unwrap();
            let addr = ep.local_addr().unwrap();
            if let Ok(tcp) = tokio::net::TcpListener::bind(addr).await {
                pair = Some((ep, addr, tcp));
                break;
            }
        }
        let (ep, addr, tcp) = pair.expect("no port free for both UDP and TCP");
        let server = Server::new(TestSite { dir: None });
        let handle = server.handle();
        let served = tokio::spawn(server.serve(Listener::new(ep)));
        let mut b = client(&cert)
            .resolve("localhost", addr.port(), addr)
            .connect_timeout(Duration::from_millis(800));
        if let Some(d) = race {
            b = b.race_delay(d);
        }
        let c = b.build().unwrap();
        let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
        assert_eq!(resp.protocol(), Protocol::Http3);
        resp.bytes().await.unwrap();
        c.await_session_tickets().await;
        c.close_connections();
        handle.shutdown();
        served.await.unwrap().unwrap();
        // The same port again: UDP swallowed, TCP served after 300 ms (a connection is
        // forwarded to the server that late), so a 0-RTT connection wins any race with it.
        let swallowed = udp_sink(addr).await;
        let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (inner, _) = serve_split(inner, tls, false);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = tcp.accept().await {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if let Ok(mut b) = tokio::net::TcpStream::connect(inner).await {
                        let _ = tokio::io::copy_bidirectional(&mut s, &mut b).await;
                    }
                });
            }
        });
        let t = Instant::now();
        let resp = tokio::time::timeout(
            Duration::from_secs(10),
            c.request(method.clone(), &url(addr, "/echo"))
                .body(b"posted".to_vec())
                .send(),
        )
        .await
        .expect("not at QUIC's idle timeout")
        .unwrap();
        let took = t.elapsed();
        eprintln!(
            "{method} (race delay {race:?}): {:?} after {took:?}; {} datagrams swallowed",
            resp.protocol(),
            swallowed.load(Ordering::Relaxed)
        );
        assert_eq!(resp.protocol(), Protocol::Http2);
        assert!(
            swallowed.load(Ordering::Relaxed) > 1,
            "HTTP/3 was tried in 0-RTT"
        );
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert_eq!(&resp.bytes().await.unwrap()[..], b"posted");
    }
}

/// A name with two addresses, the first with nothing listening (`localhost` as `::1` before
/// `127.0.0.1`, to a server on IPv4 only): the refusal moves the client on to the next
/// address at once, where HTTP/3 answers, racing TCP or alone. The next connection goes to
/// the address that answered first, and in 0-RTT (the session's server answers there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_address_moves_on_to_the_next_at_once() {
    let (addr, cert) = site().await;
    let nobody = SocketAddr::new("::1".parse().unwrap(), addr.port());
    for mode in [Mode::Auto, Mode::Http3] {
        let c = client(&cert)
            .mode(mode)
            .resolve("localhost", addr.port(), nobody)
            .resolve("localhost", addr.port(), addr)
            .race_delay(Duration::from_secs(5))
            .build()
            .unwrap();
        let t = Instant::now();
        let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
        let took = t.elapsed();
        eprintln!(
            "{mode:?}: {:?} at {} after {took:?}",
            resp.protocol(),
            resp.remote_addr()
        );
        assert_eq!(resp.protocol(), Protocol::Http3);
        assert_eq!(resp.remote_addr(), addr);
        assert!(took < Duration::from_millis(240), "{took:?}");
        resp.bytes().await.unwrap();
        c.await_session_tickets().await;
        c.close_connections();
        let resp = c.get(&url(addr, "/echo")).send().await.unwrap();
        assert_eq!(resp.remote_addr(), addr);
        assert_eq!(
            resp.headers()["x-early"],
            "true",
            "{mode:?}: the GET in 0-RTT"
        );
        resp.bytes().await.unwrap();
    }
}

/// A name with two addresses, the first silent (UDP swallowed, TCP accepted by the kernel
/// and never answered): the second joins after the attempt delay and wins, long before the
/// connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_address_is_joined_by_the_next_after_the_attempt_delay() {
    let (addr, cert) = site().await;
    let silent = SocketAddr::new("127.0.0.2".parse().unwrap(), addr.port());
    let swallowed = udp_sink(silent).await;
    let _never_accepted = tokio::net::TcpListener::bind(silent).await.unwrap();
    let c = client(&cert)
        .resolve("localhost", addr.port(), silent)
        .resolve("localhost", addr.port(), addr)
        .build()
        .unwrap();
    let t = Instant::now();
    let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
    let took = t.elapsed();
    eprintln!(
        "{:?} at {} after {took:?}; {} datagrams swallowed",
        resp.protocol(),
        resp.remote_addr(),
        swallowed.load(Ordering::Relaxed)
    );
    assert_eq!(resp.remote_addr(), addr);
    assert_eq!(resp.protocol(), Protocol::Http3);
    assert!(swallowed.load(Ordering::Relaxed) > 0, "the first was tried");
    assert!(took >= ATTEMPT_DELAY, "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    resp.bytes().await.unwrap();
    // The losing attempt ended with the race: no more Initials to the silent address
    // (its retransmissions would come within 1.5 s). What it sent as it ended (a close)
    // has arrived after 300 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = swallowed.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        swallowed.load(Ordering::Relaxed),
        after,
        "the lost attempt went on"
    );
}

#[test]
fn families_are_interleaved_from_the_first() {
    let a = |s: &str| s.parse::<SocketAddr>().unwrap();
    let got = interleave_families(vec![
        a("[::1]:1"),
        a("[::2]:1"),
        a("[::1]:1"),
        a("[::3]:1"),
        a("10.0.0.1:1"),
    ]);
    assert_eq!(
        got,
        [a("[::1]:1"), a("10.0.0.1:1"), a("[::2]:1"), a("[::3]:1")]
    );
    let got = interleave_families(vec![a("10.0.0.1:1"), a("10.0.0.2:1"), a("[::1]:1")]);
    assert_eq!(got, [a("10.0.0.1:1"), a("[::1]:1"), a("10.0.0.2:1")]);
    assert!(interleave_families(vec![]).is_empty());
}

/// A server that refuses 0-RTT (its tickets still allow it) while the client's request head
/// is still being written in 0-RTT: the refusal fails the head's write, not the response,
/// and the request goes again after the handshake. Here the head is larger than the stream
/// credit the client remembers (1 KiB) plus what a stream buffers beyond credit (64 KiB),
/// so writing it waits for the handshake, which ends with the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0rtt_refusal_while_the_head_is_written_sends_the_request_again() {
    let (cert, tls) = identity();
    let mut qtls = tls.clone();
    qtls.alpn_protocols = vec![ALPN_H3.to_vec()];
    let mut scfg = kuai::ServerConfig::from_rustls(qtls);
    scfg.accept_0rtt(false).transport(kuai::TransportConfig {
        stream_receive_window: 1024,
        ..Default::default()
    });
    let ep = kuai::Endpoint::builder()
        .server(scfg)
        .bind("127.0.0.1:0".parse().unwrap())
        .unwrap();
    let addr = ep.local_addr().unwrap();
    let limits = Limits {
        max_header_size: 256 * 1024,
        ..Limits::default()
    };
    tokio::spawn(
        Server::new(TestSite { dir: None })
            .limits(limits)
            .serve(Listener::new(ep)),
    );
    let c = client(&cert)
        .resolve("localhost", addr.port(), addr)
        .build()
        .unwrap();
    let resp = c.get(&url(addr, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http3);
    resp.bytes().await.unwrap();
    c.await_session_tickets().await;
    c.close_connections();
    let big = "x".repeat(80 * 1024);
    let resp = c
        .get(&url(addr, "/echo"))
        .header("x-filler", big.as_str())
        .send()
        .await
        .unwrap();
    let info = resp.connection();
    assert!(info.resumed, "{info:?}");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-early"],
        "false",
        "sent again after the refusal"
    );
}

/// A QUIC endpoint on 127.0.0.1 offering HTTP/3 only, for tests that script their own
/// kuai-h3 server: the endpoint, its address and its certificate.
fn h3_endpoint() -> (
    kuai::Endpoint,
    SocketAddr,
    rustls::pki_types::CertificateDer<'static>,
) {
    let (cert, mut tls) = identity();
    tls.alpn_protocols = vec![ALPN_H3.to_vec()];
    let ep = kuai::Endpoint::builder()
        .server(kuai::ServerConfig::from_rustls(tls))
        .bind("127.0.0.1:0".parse().unwrap())
        .unwrap();
    let addr = ep.local_addr().unwrap();
    (ep, addr, cert)
}

/// A server that sends GOAWAY on its first connection after answering one request and keeps
/// that connection open (as servers do after their per-connection request limit, or at the
/// start of a graceful restart): the next requests, a GET and a POST, go on a new
/// connection instead of failing on the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_goaway_requests_go_on_a_new_connection() {
    let (ep, addr, cert) = h3_endpoint();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Some(connecting) = ep.accept().await {
            let n = count.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                let Ok(quic) = connecting.await else { return };
                let mut server = kuai_h3::Server::new(quic, kuai_h3::Config::default())
                    .await
                    .unwrap();
                let mut served = 0;
                while let Some((req, mut stream)) = server.accept().await {
                    let body = stream.recv_body(1 << 20).await.unwrap();
                    let resp = http::Response::builder()
                        .header("x-connection", n.to_string())
                        .body(())
                        .unwrap();
                    stream.send_response(resp).await.unwrap();
                    let answer = format!("{} {} bytes", req.method(), body.len());
                    stream.send_data(answer.into()).await.unwrap();
                    stream.finish().unwrap();
                    served += 1;
                    if n == 0 && served == 1 {
                        server.shutdown();
                    }
                }
                // Keep a connection that went away open a while, as a draining server does.
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
        }
    });
    let c = client(&cert)
        .resolve("localhost", addr.port(), addr)
        .build()
        .unwrap();
    let resp = c.get(&url(addr, "/")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http3);
    assert_eq!(resp.headers()["x-connection"], "0");
    resp.bytes().await.unwrap();
    // The GOAWAY comes right after the response.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = c.get(&url(addr, "/")).send().await.unwrap();
    assert_eq!(resp.headers()["x-connection"], "1");
    assert_eq!(&resp.bytes().await.unwrap()[..], b"GET 0 bytes");
    let resp = c
        .request(Method::POST, &url(addr, "/"))
        .body(b"twelve bytes".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-connection"], "1");
    assert_eq!(&resp.bytes().await.unwrap()[..], b"POST 12 bytes");
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
}

/// A server that takes early data but answers 425 (Too Early) to every request that came
/// in it, as a server in front of a replay-sensitive application may: the client sends the
/// request again after the handshake, not in early data (RFC 8470 §5.2), and the caller
/// gets the real answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_425_to_an_early_request_is_retried_after_the_handshake() {
    let (ep, addr, cert) = h3_endpoint();
    let early_seen = Arc::new(AtomicUsize::new(0));
    let seen = early_seen.clone();
    tokio::spawn(async move {
        while let Some(connecting) = ep.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(quic) = connecting.await else { return };
                let mut server = kuai_h3::Server::new(quic, kuai_h3::Config::default())
                    .await
                    .unwrap();
                while let Some((req, mut stream)) = server.accept().await {
                    let early = req.extensions().get::<kuai_h3::EarlyData>().is_some();
                    seen.fetch_add(usize::from(early), Ordering::Relaxed);
                    let status = if early { 425 } else { 200 };
                    let resp = http::Response::builder().status(status).body(()).unwrap();
                    stream.send_response(resp).await.unwrap();
                    stream.send_data("answer".into()).await.unwrap();
                    stream.finish().unwrap();
                }
            });
        }
    });
    let c = client(&cert)
        .resolve("localhost", addr.port(), addr)
        .build()
        .unwrap();
    let resp = c.get(&url(addr, "/")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    c.await_session_tickets().await;
    c.close_connections();
    let resp = c.get(&url(addr, "/")).send().await.unwrap();
    assert!(resp.connection().resumed);
    assert_eq!(
        early_seen.load(Ordering::Relaxed),
        1,
        "the GET went in 0-RTT once"
    );
    assert_eq!(resp.status(), 200);
    assert_eq!(&resp.bytes().await.unwrap()[..], b"answer");
}

/// A URL whose host is an IPv6 literal (`https://[::1]:PORT/`), to a server whose
/// certificate names that address: the brackets belong to the URL, not to the name the
/// certificate is checked against, over HTTP/3 and over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_literal_url_connects() {
    let ck = rcgen::generate_simple_self_signed(vec!["::1".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let tls = crate::server::server_tls(vec![cert.clone()], key).unwrap();
    let listener = Listener::bind("[::1]:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Server::new(TestSite { dir: None }).serve(listener));
    for (mode, proto) in [
        (Mode::Http3, Protocol::Http3),
        (Mode::Http2, Protocol::Http2),
        (Mode::Http11, Protocol::Http11),
    ] {
        let c = client(&cert).mode(mode).build().unwrap();
        let resp = c
            .get(&format!("https://[::1]:{}/hello.txt", addr.port()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.protocol(), proto);
        assert_eq!(
            &resp.bytes().await.unwrap()[..],
            b"hello from kuai over QUIC\n"
        );
    }
}

/// An HTTP/2 connection the server closes for idleness (GOAWAY, then a grace period): a
/// request after the GOAWAY goes on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_h2_goaway_requests_go_on_a_new_connection() {
    let srv = crate::server::tests::start(
        Limits {
            idle_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
        None,
    )
    .await;
    let c = client(&srv.cert)
        .mode(Mode::Http2)
        .resolve("localhost", srv.addr.port(), srv.addr)
        .build()
        .unwrap();
    let mut remotes = Vec::new();
    for method in [Method::GET, Method::POST] {
        let resp = c
            .request(method, &url(srv.addr, "/hello.txt"))
            .send()
            .await
            .unwrap();
        remotes.push(resp.headers()["x-remote"].clone());
        resp.bytes().await.unwrap();
        // Past the idle timeout: the server has sent its GOAWAY.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    assert_ne!(remotes[0], remotes[1]);
}

/// HTTP/1.1: when the server a pool's connections go to is gone (its pooled connection
/// closed, new ones refused), the request goes on a new connection made the whole way,
/// to the name's next address, and so do later ones (before, the pool knocked on the gone
/// address for the rest of the client's life).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http11_pool_whose_server_is_gone_moves_to_the_next_address() {
    let (cert, tls) = identity();
    let mut servers = Vec::new();
    for _ in 0..2 {
        let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls.clone())
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Server::new(TestSite { dir: None });
        let handle = server.handle();
        servers.push((addr, handle, tokio::spawn(server.serve(listener))));
    }
    let (a, b) = (servers[0].0, servers[1].0);
    let c = client(&cert)
        .mode(Mode::Http11)
        .resolve("localhost", a.port(), a)
        .resolve("localhost", a.port(), b)
        .build()
        .unwrap();
    let resp = c.get(&url(a, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.remote_addr(), a);
    resp.bytes().await.unwrap();
    // The first server goes away: its connections close, its port refuses.
    let (_, handle, served) = servers.remove(0);
    handle.shutdown();
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("the first server stopped")
        .unwrap()
        .unwrap();
    for i in 0..3 {
        let resp =
            tokio::time::timeout(Duration::from_secs(5), c.get(&url(a, "/hello.txt")).send())
                .await
                .expect("answered within 5 s")
                .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(resp.remote_addr(), b, "request {i}");
        assert_eq!(
            &resp.bytes().await.unwrap()[..],
            b"hello from kuai over QUIC\n"
        );
    }
}

/// Alt-Svc for a name pinned to addresses (`resolve`) is used only on the same host (a test
/// server's advertisement cannot steer the pinned name elsewhere); other names take any
/// host; no entry lives past a week whatever its `ma`; and nothing is learned with
/// certificates unchecked.
#[tokio::test]
async fn alternatives_are_bounded_by_the_pin_and_a_week() {
    let c = Client::builder()
        .system_roots(false)
        .resolve("localhost", 4433, "127.0.0.1:4433".parse().unwrap())
        .build()
        .unwrap();
    let pinned: state::Origin = ("localhost".into(), 4433);
    lock(&c.inner.state).learn_alt_svc(&pinned, "h3=\"other.example:443\"; ma=100", "net-a");
    assert!(
        c.alternative(&pinned, Some("net-a")).is_none(),
        "another host for a pinned name"
    );
    lock(&c.inner.state).learn_alt_svc(&pinned, "h3=\":4434\"; ma=100", "net-a");
    assert_eq!(
        c.alternative(&pinned, Some("net-a")).map(|a| a.port),
        Some(4434)
    );
    let free: state::Origin = ("example.com".into(), 443);
    lock(&c.inner.state).learn_alt_svc(&free, "h3=\"other.example:443\"; ma=2147483647", "net-a");
    let a = c
        .alternative(&free, Some("net-a"))
        .expect("another host for a name not pinned");
    assert_eq!(a.host, "other.example");
    assert!(a.expires <= state::now() + 7 * 24 * 3600, "{}", a.expires);
    // A server on an unprivileged port cannot move its clients to a system port; the other
    // way is allowed.
    let high: state::Origin = ("example.com".into(), 8443);
    lock(&c.inner.state).learn_alt_svc(&high, "h3=\":53\"; ma=100", "net-a");
    assert!(c.alternative(&high, Some("net-a")).is_none());
    lock(&c.inner.state).learn_alt_svc(&free, "h3=\":8443\"; ma=100", "net-a");
    assert_eq!(
        c.alternative(&free, Some("net-a")).map(|a| a.port),
        Some(8443)
    );
    // On another network an alternative goes (RFC 7838 §2.2), unless it said persist=1;
    // beside an open TCP connection (no network given) it stays.
    assert!(c.alternative(&free, None).is_some());
    assert!(c.alternative(&free, Some("net-b")).is_none());
    assert!(
        c.alternative(&free, Some("net-a")).is_none(),
        "forgotten, not hidden"
    );
    lock(&c.inner.state).learn_alt_svc(&free, "h3=\":8443\"; ma=100; persist=1", "net-a");
    assert_eq!(
        c.alternative(&free, Some("net-b")).map(|a| a.port),
        Some(8443)
    );
    // Nor to this machine, for a server elsewhere.
    let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
    for (origin, alt, ok) in [
        ("192.0.2.1:443", "192.0.2.7:443", true),
        ("192.0.2.1:443", "127.0.0.1:5353", false),
        ("192.0.2.1:443", "[::1]:443", false),
        ("192.0.2.1:443", "0.0.0.0:443", false),
        ("127.0.0.1:8443", "127.0.0.1:4433", true),
        ("[::1]:8443", "127.0.0.1:4433", true),
    ] {
        assert_eq!(
            alternative_in_scope(sa(origin), sa(alt)),
            ok,
            "{origin} -> {alt}"
        );
    }
    // With certificates unchecked, responses teach nothing; checked, they do.
    let (tcp, _quic, cert) = split_server(true).await;
    for insecure in [true, false] {
        let c = client(&cert)
            .danger_accept_invalid_certs(insecure)
            .resolve("localhost", tcp.port(), tcp)
            .build()
            .unwrap();
        let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
        assert_eq!(resp.protocol(), Protocol::Http2);
        assert!(resp.headers().contains_key("alt-svc"));
        resp.bytes().await.unwrap();
        let origin: state::Origin = ("localhost".into(), tcp.port());
        let learned = lock(&c.inner.state).alt_svc(&origin, None).is_some();
        assert_eq!(learned, !insecure, "insecure {insecure}");
    }
}

/// An alternative on another host whose name does not resolve (or not within the race
/// delay) marks HTTP/3 broken, as any failure to reach it does: the next connections go
/// straight to TCP without looking the name up again. (It was tried on the origin's own
/// port instead, where this server has HTTP/3 too, and looked up again every time.)
#[tokio::test]
async fn an_alternative_that_does_not_resolve_marks_http3_broken() {
    let (tcp, cert) = site().await;
    // Not pinned: an alternative on another host is taken.
    let c = client(&cert).build().unwrap();
    let origin: state::Origin = ("localhost".into(), tcp.port());
    let network = state::network_id(tcp);
    lock(&c.inner.state).learn_alt_svc(&origin, "h3=\"nowhere.invalid:8443\"; ma=600", &network);
    assert_eq!(
        c.alternative(&origin, Some(&network)).unwrap().host,
        "nowhere.invalid"
    );
    assert!(!lock(&c.inner.state).is_broken(&origin, &network));
    let resp = c.get(&url(tcp, "/hello.txt")).send().await.unwrap();
    assert_eq!(resp.protocol(), Protocol::Http2);
    resp.bytes().await.unwrap();
    assert!(lock(&c.inner.state).is_broken(&origin, &network));
}

/// Location references resolved as RFC 3986 §5.2 says (its §5.4 examples that apply to a
/// server's Location, on an https base).
#[test]
fn locations_resolve_as_rfc_3986_says() {
    let base: http::Uri = "https://a/b/c/d;p?q".parse().unwrap();
    for (reference, want) in [
        ("g", "https://a/b/c/g"),
        ("./g", "https://a/b/c/g"),
        ("g/", "https://a/b/c/g/"),
        ("/g", "https://a/g"),
        ("//g", "https://g/"),
        ("?y", "https://a/b/c/d;p?y"),
        ("g?y", "https://a/b/c/g?y"),
        ("#s", "https://a/b/c/d;p?q"),
        ("g#s", "https://a/b/c/g"),
        (";x", "https://a/b/c/;x"),
        ("", "https://a/b/c/d;p?q"),
        (".", "https://a/b/c/"),
        ("./", "https://a/b/c/"),
        ("..", "https://a/b/"),
        ("../", "https://a/b/"),
        ("../g", "https://a/b/g"),
        ("../..", "https://a/"),
        ("../../g", "https://a/g"),
        ("../../../g", "https://a/g"),
        ("/./g", "https://a/g"),
        ("/../g", "https://a/g"),
        ("g.", "https://a/b/c/g."),
        ("..g", "https://a/b/c/..g"),
        ("./../g", "https://a/b/g"),
        ("g/./h", "https://a/b/c/g/h"),
        ("g/../h", "https://a/b/c/h"),
        ("HTTPS://b/x", "https://b/x"),
    ] {
        assert_eq!(
            join(&base, reference).unwrap().to_string(),
            want,
            "{reference:?}"
        );
    }
    assert_eq!(
        join(&base, "http://b/x").unwrap().scheme_str(),
        Some("http"),
        "resolved, and then not followed"
    );
}

/// An origin's port is checked for its range (the http crate checks only its characters)
/// and a URL with credentials in it is refused (they would go out in Host / :authority).
#[test]
fn origins_refuse_bad_ports_and_userinfo() {
    let origin = |u: &str| origin_of(&u.parse::<Uri>().unwrap());
    assert_eq!(
        origin("https://a.example/").unwrap(),
        ("a.example".into(), 443)
    );
    assert_eq!(
        origin("https://a.example:/").unwrap(),
        ("a.example".into(), 443)
    );
    assert_eq!(
        origin("https://A.example:8443/").unwrap(),
        ("a.example".into(), 8443)
    );
    assert_eq!(origin("https://[::1]:8443/").unwrap(), ("::1".into(), 8443));
    for bad in [
        "https://a.example:70000/",
        "https://a.example:65536/",
        "https://u:pw@a.example/",
        "https://u@a.example/",
        "http://a.example/",
    ] {
        assert!(
            matches!(origin(bad), Err(Error::InvalidUrl { .. })),
            "{bad}: {:?}",
            origin(bad)
        );
    }
}

/// An origin with no request for the pool's idle timeout has its connections closed the
/// next time the client connects anywhere; one whose response is still being read keeps
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_origins_are_closed() {
    let (a, cert) = site().await;
    let (b, cert_b) = site().await;
    let c = client(&cert)
        .add_root_certificate(cert_b)
        .mode(Mode::Http2)
        .resolve("localhost", a.port(), a)
        .resolve("localhost", b.port(), b)
        .pool_idle_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let origin = |p: u16| -> state::Origin { ("localhost".into(), p) };
    let held = c.get(&url(a, "/bytes/1000000")).send().await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.get(&url(b, "/hello.txt"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(
        lock(&c.inner.slots).contains_key(&origin(a.port())),
        "closed while a response was read"
    );
    held.bytes().await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.get(&url(b, "/hello.txt"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let slots = lock(&c.inner.slots);
    assert!(
        !slots.contains_key(&origin(a.port())),
        "the idle origin kept"
    );
    assert!(slots.contains_key(&origin(b.port())));
}

/// A server that goes silent on an HTTP/2 connection (here: it takes the TLS handshake,
/// then never reads or writes again) is found by an unanswered PING: the request fails
/// instead of waiting for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_server_gone_silent_is_found_by_pings() {
    let (cert, mut tls) = identity();
    tls.alpn_protocols = vec![ALPN_H2.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = l.accept().await {
            if let Ok(tls) = acceptor.accept(tcp).await {
                held.push(tls);
            }
        }
    });
    let c = client(&cert)
        .mode(Mode::Http2)
        .resolve("localhost", addr.port(), addr)
        .http2_keep_alive(Some((
            Duration::from_millis(200),
            Duration::from_millis(200),
        )))
        .build()
        .unwrap();
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), c.get(&url(addr, "/x")).send())
        .await
        .expect("the request still waits");
    assert!(r.is_err(), "answered?");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
