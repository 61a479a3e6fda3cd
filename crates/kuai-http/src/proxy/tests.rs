//! The proxy between kuai-http's client (HTTP/3, HTTP/2, HTTP/1.1) and hyper backends.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::*;
use crate::client::{Client, Mode};
use crate::server::tests::{client_endpoint, h3_client_with, identity, slow_return_relay};
use crate::{BoxError, Listener, Server};

type BackendBody = UnsyncBoxBody<Bytes, BoxError>;

fn full(b: impl Into<Bytes>) -> BackendBody {
    http_body_util::Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// A backend: what it answers, and what it saw.
#[derive(Default)]
struct Seen {
    /// Requests whose handler is running (a cancelled one is dropped).
    live: AtomicUsize,
    requests: AtomicUsize,
    connections: AtomicUsize,
    /// Connections the backend closed after its answer (`Say::Close`).
    closed: AtomicUsize,
}

struct LiveGuard(Arc<Seen>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, SeqCst);
    }
}

/// A hyper backend on a free port: HTTP/1.1, or HTTP/2 with prior knowledge (`h2c`).
/// `/echo` sends the request body back as it comes; `/headers` lists the request line and
/// fields; `/slow` sends a line, waits 400 ms, sends another; `/hang` answers after 10 s;
/// `/early` answers 425 to a request marked `Early-Data: 1`; `/whoami` the backend's
/// name; `/big` 8 MiB; `/healthz` 200, or 503 for a backend named "sick".
async fn backend(name: &'static str, h2c: bool) -> (SocketAddr, Arc<Seen>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            s.connections.fetch_add(1, SeqCst);
            let s = s.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let s = s.clone();
                async move { Ok::<_, Infallible>(answer(name, &s, req).await) }
            });
            let io = TokioIo::new(tcp);
            tokio::spawn(async move {
                if h2c {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, svc)
                        .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .await;
                }
            });
        }
    });
    (addr, seen)
}

async fn answer(
    name: &'static str,
    s: &Arc<Seen>,
    req: Request<Incoming>,
) -> Response<BackendBody> {
    s.requests.fetch_add(1, SeqCst);
    s.live.fetch_add(1, SeqCst);
    let _live = LiveGuard(s.clone());
    match req.uri().path() {
        "/echo" => Response::new(req.into_body().map_err(Into::into).boxed_unsync()),
        // A backend advertising an HTTP/3 of its own.
        "/alt-svc" => {
            let mut r = Response::new(full("alt"));
            r.headers_mut()
                .insert("alt-svc", "h3=\":9999\"; ma=60".parse().unwrap());
            r
        }
        // The whole body read first, then its length.
        "/count" => {
            let n = req
                .into_body()
                .collect()
                .await
                .map_or(0, |b| b.to_bytes().len());
            Response::new(full(n.to_string()))
        }
        "/headers" => {
            let mut text = format!("{} {} {:?}\n", req.method(), req.uri(), req.version());
            for (k, v) in req.headers() {
                text.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
            }
            Response::new(full(text))
        }
        "/slow" => {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tokio::spawn(async move {
                let _ = tx.send(Bytes::from("first\n")).await;
                tokio::time::sleep(Duration::from_millis(400)).await;
                let _ = tx.send(Bytes::from("second\n")).await;
            });
            Response::new(Channel(rx).boxed_unsync())
        }
        "/hang" => {
            tokio::time::sleep(Duration::from_secs(10)).await;
            Response::new(full("late"))
        }
        "/early" => {
            let early = req.headers().get("early-data").is_some_and(|v| v == "1");
            let mut r = Response::new(full(if early { "too early" } else { "late" }));
            if early {
                *r.status_mut() = StatusCode::TOO_EARLY;
            }
            r
        }
        "/whoami" => Response::new(full(name)),
        "/big" => Response::new(full(vec![b'x'; 8 << 20])),
        "/healthz" if name == "sick" => {
            let mut r = Response::new(full("sick"));
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            r
        }
        "/healthz" => Response::new(full("ok")),
        _ => {
            let mut r = Response::new(full("not found"));
            *r.status_mut() = StatusCode::NOT_FOUND;
            r
        }
    }
}

/// A body of the pieces sent on a channel.
struct Channel(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for Channel {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// A gateway in front of `proxy` on a free port, and clients of it by protocol.
struct Gateway {
    port: u16,
    addr: SocketAddr,
    cert: rustls::pki_types::CertificateDer<'static>,
}

impl Gateway {
    async fn start(proxy: Proxy) -> Self {
        Self::start_with(proxy, None).await
    }

    /// With the server's limits set.
    async fn start_limited(proxy: Proxy, limits: crate::server::Limits) -> Self {
        Self::serve(proxy, None, Some(limits)).await
    }

    /// With statistics: the endpoint's subscriber and the server's request counts.
    async fn start_with(proxy: Proxy, metrics: Option<Arc<crate::metrics::Metrics>>) -> Self {
        Self::serve(proxy, metrics, None).await
    }

    async fn serve(
        proxy: Proxy,
        metrics: Option<Arc<crate::metrics::Metrics>>,
        limits: Option<crate::server::Limits>,
    ) -> Self {
        let (cert, tls) = identity();
        let mut ep = kuai::Endpoint::builder();
        if let Some(m) = &metrics {
            ep = ep.subscriber(m.subscriber());
        }
        let listener = Listener::bind_with("127.0.0.1:0".parse().unwrap(), tls, ep)
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let mut server = Server::new(proxy);
        if let Some(m) = metrics {
            server = server.metrics(m);
        }
        if let Some(l) = limits {
            server = server.limits(l);
        }
        tokio::spawn(server.serve(listener));
        Self {
            port: addr.port(),
            addr,
            cert,
        }
    }

    fn client(&self, mode: Mode) -> Client {
        Client::builder()
            .system_roots(false)
            .add_root_certificate(self.cert.clone())
            .resolve("localhost", self.port, self.addr)
            .mode(mode)
            .build()
            .unwrap()
    }

    fn url(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.port)
    }
}

fn proxy_to(addrs: &[(SocketAddr, bool)]) -> ProxyBuilder {
    let mut b = Proxy::builder();
    for (a, h2c) in addrs {
        let scheme = if *h2c { "h2c" } else { "http" };
        b = b.upstream(format!("{scheme}://{a}").parse().unwrap());
    }
    b
}

const MODES: [(Mode, &str); 3] = [
    (Mode::Http3, "3"),
    (Mode::Http2, "2"),
    (Mode::Http11, "1.1"),
];

/// Over HTTP/3, HTTP/2 and HTTP/1.1, to an HTTP/1.1 and to an HTTP/2 backend: a 1 MiB body
/// comes back byte for byte, and the backend sees the client's authority, the forwarding
/// fields, and no hop-by-hop field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_protocol_reaches_both_kinds_of_backend() {
    let body: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for h2c in [false, true] {
        let (b, _) = backend("b", h2c).await;
        let gw = Gateway::start(proxy_to(&[(b, h2c)]).build().unwrap()).await;
        for (mode, via) in MODES {
            let client = gw.client(mode);
            let resp = client
                .request(Method::POST, &gw.url("/echo"))
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let up_via = if h2c { "2 kuai" } else { "1.1 kuai" };
            assert_eq!(resp.headers()["via"], up_via, "{mode:?}");
            let got = resp.bytes().await.unwrap();
            assert!(got == body, "{mode:?} h2c={h2c}: {} bytes back", got.len());
            // A backend's own Alt-Svc does not reach the client (it named the backend's
            // port, and suppressed the gateway's): over TCP the gateway's, over HTTP/3 none.
            let resp = client.get(&gw.url("/alt-svc")).send().await.unwrap();
            let alt = resp.headers().get("alt-svc").cloned();
            resp.bytes().await.unwrap();
            match mode {
                Mode::Http3 => assert_eq!(alt, None),
                _ => assert_eq!(
                    alt.unwrap(),
                    format!("h3=\":{}\"; ma=86400", gw.port).as_str(),
                    "{mode:?}"
                ),
            }

            let resp = client
                .get(&gw.url("/headers?x=1"))
                .header("connection", "x-private")
                .header("x-private", "hop")
                .header("x-forwarded-for", "192.0.2.1")
                .header("x-real-ip", "192.0.2.2")
                .header("x-forwarded-host", "spoofed.example")
                .header("x-forwarded-port", "1")
                .send()
                .await
                .unwrap();
            let text = resp.text().await.unwrap();
            let want_line = if h2c {
                "GET http://localhost:{port}/headers?x=1 HTTP/2.0"
            } else {
                "GET /headers?x=1 HTTP/1.1"
            };
            let want_line = want_line.replace("{port}", &gw.port.to_string());
            assert!(text.starts_with(&want_line), "{mode:?}: {text}");
            if !h2c {
                assert!(
                    text.contains(&format!("host: localhost:{}\n", gw.port)),
                    "{text}"
                );
            }
            for want in [
                "x-forwarded-for: 192.0.2.1, 127.0.0.1\n".to_string(),
                "x-forwarded-proto: https\n".into(),
                "x-real-ip: 127.0.0.1\n".into(),
                format!(
                    "forwarded: for=127.0.0.1;proto=https;host=\"localhost:{}\"\n",
                    gw.port
                ),
                format!("via: {via} kuai\n"),
            ] {
                assert!(
                    text.contains(&want),
                    "{mode:?} h2c={h2c}: no {want:?} in\n{text}"
                );
            }
            // (HTTP/2 and HTTP/3 have no Connection field: the client drops it.)
            if mode == Mode::Http11 {
                assert!(!text.contains("x-private"), "{text}");
            }
            assert!(!text.contains("early-data"), "{text}");
            for spoofed in ["192.0.2.2", "spoofed.example", "x-forwarded-port"] {
                assert!(
                    !text.contains(spoofed),
                    "{mode:?}: {spoofed} passed on\n{text}"
                );
            }
        }
    }
}

/// A response the backend sends slowly reaches the client piece by piece.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_response_streams() {
    let (b, _) = backend("b", false).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    for (mode, _) in MODES {
        let start = Instant::now();
        let mut resp = gw.client(mode).get(&gw.url("/slow")).send().await.unwrap();
        let first = resp.chunk().await.unwrap().unwrap();
        let at_first = start.elapsed();
        assert_eq!(&first[..], b"first\n");
        let mut rest = Vec::new();
        while let Some(c) = resp.chunk().await.unwrap() {
            rest.extend_from_slice(&c);
        }
        assert_eq!(rest, b"second\n");
        assert!(
            at_first < Duration::from_millis(300) && start.elapsed() >= Duration::from_millis(400),
            "{mode:?}: first piece at {at_first:?}, all at {:?}",
            start.elapsed()
        );
    }
}

/// With nothing listening at the first backend, requests (with and without a body) go to
/// the second; with none left, 502. A backend too slow to answer gives 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_go_elsewhere_then_502_and_504() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (live, seen) = backend("live", false).await;
    let gw = Gateway::start(
        proxy_to(&[(dead, false), (live, false)])
            .fail_timeout(Duration::from_millis(1))
            .build()
            .unwrap(),
    )
    .await;
    let client = gw.client(Mode::Http3);
    for _ in 0..3 {
        let r = client.get(&gw.url("/whoami")).send().await.unwrap();
        assert_eq!(r.text().await.unwrap(), "live");
        let r = client
            .request(Method::POST, &gw.url("/echo"))
            .body(b"posted".to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(r.text().await.unwrap(), "posted");
    }
    assert_eq!(seen.requests.load(SeqCst), 6);

    let gw = Gateway::start(proxy_to(&[(dead, false)]).build().unwrap()).await;
    let r = gw
        .client(Mode::Http2)
        .get(&gw.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);

    let gw = Gateway::start(
        proxy_to(&[(live, false)])
            .response_timeout(Duration::from_millis(300))
            .build()
            .unwrap(),
    )
    .await;
    let r = gw
        .client(Mode::Http3)
        .get(&gw.url("/hang"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
}

/// A client that gives up on a request (HTTP/3: the stream is stopped; HTTP/2: reset;
/// HTTP/1.1: the connection closed) cancels the backend's request: its handler is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_the_upstream_request() {
    let (b, seen) = backend("b", false).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    for (mode, _) in MODES {
        let client = gw.client(mode);
        let before = seen.requests.load(SeqCst);
        let r = tokio::time::timeout(
            Duration::from_millis(500),
            client.get(&gw.url("/hang")).send(),
        )
        .await;
        assert!(r.is_err(), "{mode:?}: /hang answered");
        assert_eq!(seen.requests.load(SeqCst), before + 1, "{mode:?}");
        client.close_connections();
        let deadline = Instant::now() + Duration::from_secs(3);
        while seen.live.load(SeqCst) != 0 {
            assert!(
                Instant::now() < deadline,
                "{mode:?}: the backend still works on it"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A request that arrived in 0-RTT reaches the backend with `Early-Data: 1`, and the
/// backend's 425 reaches the client; a POST in 0-RTT is answered 425 by the gateway
/// without reaching the backend; after the handshake both go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_data_is_marked_and_425_comes_back() {
    let (b, seen) = backend("b", false).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    let cep = client_endpoint();
    let ccfg = kuai::ClientConfig::with_root(gw.cert.clone(), &[crate::server::ALPN_H3]).unwrap();
    let (conn, client) = h3_client_with(&cep, ccfg.clone(), gw.addr).await;
    assert_eq!(status(&client, Method::GET, "/whoami").await, 200);
    assert!(conn.session_ticket().await);
    conn.close(0, b"");
    drop(client);
    let relay = slow_return_relay(gw.addr, Duration::from_millis(300)).await;
    let Ok((conn, accepted)) = cep
        .connect_with(ccfg, relay, "localhost")
        .unwrap()
        .into_0rtt()
    else {
        panic!("the ticket allows 0-RTT");
    };
    let client = kuai_h3::Client::new(conn.clone(), kuai_h3::Config::default())
        .await
        .unwrap();
    let before = seen.requests.load(SeqCst);
    let (get, post) = tokio::join!(
        status(&client, Method::GET, "/early"),
        status(&client, Method::POST, "/echo")
    );
    assert!(accepted.await, "0-RTT accepted");
    assert_eq!((get, post), (425, 425));
    assert_eq!(
        seen.requests.load(SeqCst),
        before + 1,
        "only the GET went upstream"
    );
    assert_eq!(status(&client, Method::GET, "/early").await, 200);
    assert_eq!(status(&client, Method::POST, "/echo").await, 200);
}

async fn status(client: &kuai_h3::Client, method: Method, path: &str) -> u16 {
    let req = Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .body(())
        .unwrap();
    let mut s = client.send_request(req).await.unwrap();
    s.finish().unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), s.recv_response())
        .await
        .expect("answered within 5 s")
        .unwrap();
    resp.status().as_u16()
}

async fn whoami(client: &Client, gw: &Gateway) -> String {
    let r = client.get(&gw.url("/whoami")).send().await.unwrap();
    r.text().await.unwrap()
}

/// Round robin takes turns; least-outstanding avoids the backend busy with a long request;
/// a backend that fails its health check gets nothing until it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balancing_and_health_checks() {
    let (a, _) = backend("a", false).await;
    let (b, _) = backend("b", true).await;
    let gw = Gateway::start(proxy_to(&[(a, false), (b, true)]).build().unwrap()).await;
    let client = gw.client(Mode::Http3);
    let mut names = Vec::new();
    for _ in 0..4 {
        names.push(whoami(&client, &gw).await);
    }
    names.sort();
    assert_eq!(names, ["a", "a", "b", "b"]);

    let gw = Gateway::start(
        proxy_to(&[(a, false), (b, true)])
            .balance(Balance::LeastOutstanding)
            .build()
            .unwrap(),
    )
    .await;
    let client = gw.client(Mode::Http3);
    let url = gw.url("/hang");
    let busy = client.clone();
    let hung = tokio::spawn(async move { busy.get(&url).send().await.map(|r| r.status()) });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let first = whoami(&client, &gw).await;
    for _ in 0..3 {
        assert_eq!(
            whoami(&client, &gw).await,
            first,
            "the idle backend takes them all"
        );
    }
    hung.abort();

    let (sick, sick_seen) = backend("sick", false).await;
    let mut check = HealthCheck::new("/healthz");
    check.interval = Duration::from_millis(50);
    let gw = Gateway::start(
        proxy_to(&[(sick, false), (a, false)])
            .health_check(check)
            .build()
            .unwrap(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = gw.client(Mode::Http2);
    for _ in 0..4 {
        assert_eq!(whoami(&client, &gw).await, "a");
    }
    assert!(sick_seen.requests.load(SeqCst) >= 2, "checked");
}

/// Requests one after another share one backend connection, HEAD and bodies read to the end
/// alike; a response abandoned half-way costs its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_connections_are_reused() {
    for h2c in [false, true] {
        let (b, seen) = backend("b", h2c).await;
        let gw = Gateway::start(proxy_to(&[(b, h2c)]).build().unwrap()).await;
        let client = gw.client(Mode::Http3);
        for i in 0..20 {
            let method = if i % 5 == 4 {
                Method::HEAD
            } else {
                Method::GET
            };
            let r = client
                .request(method, &gw.url("/whoami"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        }
        assert_eq!(seen.connections.load(SeqCst), 1, "h2c={h2c}");
        if !h2c {
            let mut r = client.get(&gw.url("/slow")).send().await.unwrap();
            r.chunk().await.unwrap();
            drop(r);
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(whoami(&client, &gw).await, "b");
            assert_eq!(seen.connections.load(SeqCst), 2);
        }
    }
}

/// The statistics count what happened: handshakes (one of them in 0-RTT), requests by
/// protocol and status, the backend's answers and errors; `promtool check metrics` (Debian's
/// prometheus package) accepts the text when installed (`KUAI_REQUIRE_PROMTOOL=1`: must be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened() {
    let (b, _) = backend("b", false).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let m = crate::metrics::Metrics::new();
    let proxy = proxy_to(&[(b, false), (dead, false)])
        .balance(Balance::RoundRobin)
        .metrics(m.clone())
        .build()
        .unwrap();
    let gw = Gateway::start_with(proxy, Some(m.clone())).await;
    let client = gw.client(Mode::Http3);
    for _ in 0..3 {
        assert_eq!(whoami(&client, &gw).await, "b");
    }
    // A new connection: its request goes in 0-RTT.
    client.close_connections();
    let r = client.get(&gw.url("/whoami")).send().await.unwrap();
    assert_eq!(r.connection().early_data, Some(true), "0-RTT");
    r.bytes().await.unwrap();
    let h2 = gw.client(Mode::Http2);
    let r = h2.get(&gw.url("/nothing-here")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    client.close_connections();
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let t = m.render();
        if t.contains("kuai_quic_handshakes_total{result=\"ok\"} 2\n")
            && t.contains("kuai_http_requests_total{protocol=\"h3\",status=\"200\"} 4\n")
            && t.contains("kuai_quic_connections_open 0\n")
        {
            break t;
        }
        assert!(Instant::now() < deadline, "{t}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for want in [
        "kuai_quic_zero_rtt_attempted_total 1\n",
        "kuai_quic_zero_rtt_accepted_total 1\n",
        "kuai_quic_resumptions_total 1\n",
        "kuai_quic_connections_total{version=\"1\",cipher_suite=\"TLS13_AES_128_GCM_SHA256\",alpn=\"h3\"} 2\n",
        "kuai_http_requests_total{protocol=\"h2\",status=\"404\"} 1\n",
        "kuai_quic_rtt_seconds_count 2\n",
        "kuai_http_requests_in_flight 0\n",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    // Round robin sent some requests to the dead backend first: refused, then retried.
    let dead_errors = format!("kuai_upstream_errors_total{{backend=\"{dead}\",kind=\"connect\"}} ");
    let line = text.lines().find(|l| l.starts_with(&dead_errors)).unwrap();
    assert!(!line.ends_with(" 0"), "{line}");
    assert!(
        text.contains(&format!(
            "kuai_upstream_response_seconds_count{{backend=\"{b}\"}} 5\n"
        )),
        "{text}"
    );
    promtool_accepts(&text);
}

/// `promtool check metrics` on `text`, when promtool is installed.
fn promtool_accepts(text: &str) {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        assert!(
            std::env::var_os("KUAI_REQUIRE_PROMTOOL").is_none(),
            "promtool is not installed and KUAI_REQUIRE_PROMTOOL is set"
        );
        eprintln!("promtool not installed: the text was not checked");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[allow(clippy::result_large_err)] // tungstenite's callback type
/// A WebSocket echo backend (tokio-tungstenite, an independent implementation) on a free
/// port; what the last handshake's request carried goes to `seen`.
async fn websocket_backend() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    use futures_util::{SinkExt, StreamExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let cb = |req: &tokio_tungstenite::tungstenite::handshake::server::Request,
                          resp| {
                    let mut s = s.lock().unwrap();
                    s.push(format!("{} {}", req.method(), req.uri()));
                    for (k, v) in req.headers() {
                        s.push(format!("{k}: {}", v.to_str().unwrap_or("?")));
                    }
                    Ok(resp)
                };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(tcp, cb).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if m.is_text() || m.is_binary() {
                        if ws.send(m).await.is_err() {
                            return;
                        }
                    } else if m.is_close() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// Sends a text and a 100 KB binary message over `ws` and checks the echoes.
async fn echo_over<S>(mut ws: tokio_tungstenite::WebSocketStream<S>, label: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    for m in [
        Message::text(format!("hello over {label}")),
        Message::binary(big),
    ] {
        ws.send(m.clone()).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(5), ws.next())
            .await
            .unwrap_or_else(|_| panic!("{label}: no echo in 5 s"))
            .unwrap()
            .unwrap();
        assert_eq!(back, m, "{label}");
    }
    ws.close(None).await.unwrap();
}

/// A WebSocket echo through the gateway: HTTP/3 extended CONNECT (RFC 9220), HTTP/2
/// extended CONNECT (RFC 8441) and HTTP/1.1 Upgrade, each to an HTTP/1.1 backend's
/// `Upgrade: websocket`, with the forwarding fields at the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_go_through_on_every_protocol() {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let (b, seen) = websocket_backend().await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;

    // HTTP/3: the request stream's DATA frames are the tunnel.
    let cep = client_endpoint();
    let ccfg = kuai::ClientConfig::with_root(gw.cert.clone(), &[crate::server::ALPN_H3]).unwrap();
    let (_conn, client) = h3_client_with(&cep, ccfg, gw.addr).await;
    let mut req = Request::builder()
        .method(Method::CONNECT)
        .uri("https://localhost/ws?h3")
        .header("sec-websocket-version", "13")
        .body(())
        .unwrap();
    req.extensions_mut()
        .insert(kuai_h3::Protocol("websocket".into()));
    let mut stream = client.send_request(req).await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    assert_eq!(resp.status(), 200);
    let (mut send, mut recv) = stream.split();
    let (mine, theirs) = tokio::io::duplex(64 * 1024);
    let (mut rd, mut wr) = tokio::io::split(theirs);
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = rd.read(&mut buf).await {
            if n == 0
                || send
                    .send_data(Bytes::copy_from_slice(&buf[..n]))
                    .await
                    .is_err()
            {
                break;
            }
        }
        let _ = send.finish();
    });
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok(Some(d)) = recv.recv_data().await {
            if wr.write_all(&d).await.is_err() {
                break;
            }
        }
    });
    let ws = tokio_tungstenite::WebSocketStream::from_raw_socket(mine, Role::Client, None).await;
    echo_over(ws, "HTTP/3").await;
    {
        let s = seen.lock().unwrap();
        assert_eq!(s[0], "GET /ws?h3", "{s:?}");
        assert!(
            s.contains(&"x-forwarded-for: 127.0.0.1".to_string()),
            "{s:?}"
        );
        assert!(s.contains(&"via: 3 kuai".to_string()), "{s:?}");
        assert!(s.contains(&"host: localhost".to_string()), "{s:?}");
    }

    // HTTP/2: hyper's client, extended CONNECT, the stream upgraded.
    let ws = h2_websocket(gw.addr, &gw.cert, "/ws?h2").await;
    echo_over(ws, "HTTP/2").await;

    // HTTP/1.1: tungstenite's own client handshake over TLS.
    let tls = crate::server::tests::tls_to(gw.addr, &gw.cert, crate::server::ALPN_H1).await;
    let (ws, resp) =
        tokio_tungstenite::client_async(format!("wss://localhost:{}/ws?h1", gw.port), tls)
            .await
            .unwrap();
    assert_eq!(resp.status(), 101);
    echo_over(ws, "HTTP/1.1").await;
    let s = seen.lock().unwrap();
    assert!(s.iter().any(|l| l == "GET /ws?h1"), "{s:?}");
}

/// A WebSocket tunnel after an HTTP/1.1 upgrade outlives its connection's task: a server
/// shutting down waits for it (it still echoes), finishes once it ends, and ends one left
/// open with the drain timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_drains_websocket_tunnels() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let (b, _) = websocket_backend().await;
    let (cert, tls) = identity();
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let drain_timeout = Duration::from_millis(1500);
    let server =
        Server::new(proxy_to(&[(b, false)]).build().unwrap()).limits(crate::server::Limits {
            drain_timeout,
            ..Default::default()
        });
    let handle = server.handle();
    let mut serving = tokio::spawn(server.serve(listener));
    let open = || async {
        let tls = crate::server::tests::tls_to(addr, &cert, crate::server::ALPN_H1).await;
        let url = format!("wss://localhost:{}/ws", addr.port());
        tokio_tungstenite::client_async(url, tls).await.unwrap().0
    };
    let echo = |m: &'static str| Message::text(m);
    let mut first = open().await;
    let mut second = open().await;
    handle.shutdown();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!serving.is_finished(), "returned with tunnels open");
    first.send(echo("still here")).await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(2), first.next()).await;
    assert_eq!(back.unwrap().unwrap().unwrap(), echo("still here"));
    first.close(None).await.unwrap();
    // The second stays open: the drain timeout ends it, and then the server returns.
    let t = Instant::now();
    tokio::time::timeout(drain_timeout + Duration::from_secs(3), &mut serving)
        .await
        .expect("the server returns after the drain timeout")
        .unwrap()
        .unwrap();
    assert!(
        t.elapsed() + Duration::from_millis(400) >= drain_timeout,
        "{:?}",
        t.elapsed()
    );
    let end = tokio::time::timeout(Duration::from_secs(2), second.next()).await;
    assert!(
        matches!(end, Ok(None | Some(Err(_)))),
        "the tunnel still open: {end:?}"
    );
}

#[test]
fn upstream_urls() {
    let u: Upstream = "http://127.0.0.1:8080".parse().unwrap();
    assert_eq!(
        (u.protocol(), u.authority()),
        (UpstreamProtocol::Http1, "127.0.0.1:8080")
    );
    let u: Upstream = "h2c://backend".parse().unwrap();
    assert_eq!(
        (u.protocol(), u.authority()),
        (UpstreamProtocol::H2c, "backend:80")
    );
    assert_eq!(u.to_string(), "h2c://backend:80");
    for bad in [
        "https://x:1",
        "http://x:1/app",
        "x:1",
        "http://",
        "http://u@x:1",
    ] {
        assert!(bad.parse::<Upstream>().is_err(), "{bad}");
    }
    assert!(Proxy::builder().build().is_err());
}

/// A backend speaking HTTP/1.1 from a script: each request on a connection (read up to the
/// end of its head, and its body by `Content-Length` unless the script says not to) gets the
/// bytes `script` returns for its path; `Close` after them ends the connection.
enum Say {
    Keep(&'static [u8]),
    Close(&'static [u8]),
    /// Answer before reading the body, then read the body out, then close.
    Early(&'static [u8]),
    /// Send these bytes, then nothing more for a minute, the connection left open.
    Stall(&'static [u8]),
}

/// Reads into `buf` until it holds a whole HTTP/1.1 head; its length, or `None` when the
/// connection ends first.
async fn read_head(
    io: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut Vec<u8>,
) -> Option<usize> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        let mut b = [0u8; 4096];
        match io.read(&mut b).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
}

async fn scripted(script: fn(&str) -> Say) -> (SocketAddr, Arc<Seen>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = l.accept().await {
            s.connections.fetch_add(1, SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = read_head(&mut tcp, &mut buf).await else {
                        return;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    buf.drain(..end);
                    s.requests.fetch_add(1, SeqCst);
                    let path = head.split(' ').nth(1).unwrap_or("/").to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    let say = script(&path);
                    if let Say::Early(bytes) = say {
                        let _ = tcp.write_all(bytes).await;
                        let mut sink = vec![0u8; 65536];
                        while let Ok(n) = tcp.read(&mut sink).await {
                            if n == 0 {
                                break;
                            }
                        }
                        return;
                    }
                    while buf.len() < len {
                        let mut b = [0u8; 65536];
                        match tcp.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                    buf.drain(..len);
                    match say {
                        Say::Stall(bytes) => {
                            let _ = tcp.write_all(bytes).await;
                            tokio::time::sleep(Duration::from_secs(60)).await;
                            return;
                        }
                        Say::Keep(bytes) => {
                            if tcp.write_all(bytes).await.is_err() {
                                return;
                            }
                        }
                        Say::Close(bytes) | Say::Early(bytes) => {
                            let _ = tcp.write_all(bytes).await;
                            drop(tcp);
                            s.closed.fetch_add(1, SeqCst);
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// The proxy's own HTTP/1.1 client reads every framing RFC 9112 §6.3 allows (chunked with
/// extensions and trailers, to the close, after a 100 Continue), refuses the malformed with
/// 502, reports a response cut short, and keeps a connection only when its response ended
/// cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http1_client_reads_every_framing() {
    let (b, seen) = scripted(|path| match path {
        "/chunked" => Say::Keep(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
        ),
        "/continue" => Say::Keep(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ),
        "/close" => Say::Close(b"HTTP/1.1 200 OK\r\n\r\nuntil the close"),
        "/garbage" => Say::Close(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"),
        "/two-lengths" => Say::Close(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nab"),
        "/cut" => Say::Close(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"),
        "/conn-close" => Say::Keep(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbye"),
        "/te-and-length" => Say::Close(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        ),
        _ => Say::Keep(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Up: 1\r\n\r\nhi"),
    })
    .await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).max_fails(100).build().unwrap()).await;
    let client = gw.client(Mode::Http3);
    let get = |path: &'static str| {
        let client = client.clone();
        let url = gw.url(path);
        async move {
            let r = client.get(&url).send().await.expect(path);
            let status = r.status().as_u16();
            (status, r.bytes().await.map(|b| b.to_vec()))
        }
    };
    let (s, body) = get("/chunked").await;
    assert_eq!((s, body.unwrap()), (200, b"hello world".to_vec()));
    let (s, body) = get("/continue").await;
    assert_eq!((s, body.unwrap()), (200, b"ok".to_vec()));
    assert_eq!(get("/plain").await.1.unwrap(), b"hi");
    assert_eq!(seen.connections.load(SeqCst), 1, "one connection so far");
    assert_eq!(get("/close").await.1.unwrap(), b"until the close");
    assert_eq!(get("/conn-close").await.1.unwrap(), b"bye");
    assert_eq!(get("/plain").await.1.unwrap(), b"hi");
    assert_eq!(
        seen.connections.load(SeqCst),
        3,
        "closing responses end their connections"
    );
    // Chunked and a length: the chunks frame the body, the length goes no further
    // (RFC 9112 §6.3), over any protocol to the client.
    for mode in [Mode::Http3, Mode::Http11] {
        let r = gw
            .client(mode)
            .get(&gw.url("/te-and-length"))
            .send()
            .await
            .unwrap();
        assert!(r.headers().get("content-length").is_none(), "{mode:?}");
        assert_eq!(&r.bytes().await.unwrap()[..], b"hello", "{mode:?}");
    }
    assert_eq!(get("/garbage").await.0, 502);
    assert_eq!(get("/two-lengths").await.0, 502);
    // The head may not even reach the client before the stream is reset.
    let cut = match client.get(&gw.url("/cut")).send().await {
        Ok(r) => r.bytes().await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(
        cut.is_err(),
        "a response cut short is an error, not a short body"
    );
}

/// A pooled connection the backend has closed is not used (a POST, which may not be sent
/// twice, still goes through), and a backend that closes connections right after each
/// response costs no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_backend_closed_are_not_used() {
    let (b, seen) =
        scripted(|_| Say::Close(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    let client = gw.client(Mode::Http11);
    for i in 0..20 {
        if i % 4 == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let method = if i % 2 == 0 {
            // The backend has closed the connection it answered on (on a loaded machine
            // its close can come after the gateway pooled the connection and picked it
            // for this request: then nothing can tell a POST may be sent again, RFC 9112
            // §9.3.1).
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while seen.closed.load(SeqCst) < seen.requests.load(SeqCst)
                && std::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            Method::POST
        } else {
            Method::GET
        };
        let r = client
            .request(method, &gw.url("/x"))
            .body(vec![b'x'; 10])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(r.bytes().await.unwrap(), "ok");
    }
    assert_eq!(
        seen.requests.load(SeqCst),
        20,
        "each request reached the backend once"
    );
}

/// A backend that answers before it has read the request body (a 413, say) gets its answer
/// to the client while the upload still runs; that connection is not used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_upload_ends_comes_through() {
    let (b, seen) = scripted(|path| match path {
        "/upload" => Say::Early(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 4\r\n\r\nbig!"),
        _ => Say::Keep(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    })
    .await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    // (Over HTTP/1.1 the client would see its upload cut: the server closes a connection
    // whose request body was not read.)
    for mode in [Mode::Http3, Mode::Http2] {
        let client = gw.client(mode);
        let r = client
            .request(Method::POST, &gw.url("/upload"))
            .body(vec![7u8; 8 << 20])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413, "{mode:?}");
        assert_eq!(r.bytes().await.unwrap(), "big!");
        let r = client.get(&gw.url("/after")).send().await.unwrap();
        assert_eq!(r.bytes().await.unwrap(), "ok");
    }
    assert_eq!(
        seen.connections.load(SeqCst),
        3,
        "the early answer's connections were closed"
    );
}

/// A client that sends all of its upload before it reads the response, through a backend
/// that answers at once with a large body and reads the upload on its own: the upload must
/// keep going while nobody reads the response (the two would otherwise wait for each other
/// until the timeouts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_goes_on_while_the_response_waits() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const UP: usize = 24 << 20;
    const DOWN: usize = 48 << 20;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let b = l.local_addr().unwrap();
    let uploaded = Arc::new(Mutex::new(Vec::new()));
    let up = uploaded.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let up = up.clone();
            tokio::spawn(async move {
                let (mut rd, mut wr) = tcp.into_split();
                let mut buf = Vec::new();
                let Some(end) = read_head(&mut rd, &mut buf).await else {
                    return;
                };
                let writer = tokio::spawn(async move {
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {DOWN}\r\n\r\n");
                    wr.write_all(head.as_bytes()).await?;
                    let block = vec![b'd'; 1 << 20];
                    for _ in 0..DOWN >> 20 {
                        wr.write_all(&block).await?;
                    }
                    std::io::Result::Ok(wr)
                });
                let mut got = buf.len() - end;
                let mut b = vec![0u8; 65536];
                while let Ok(n) = rd.read(&mut b).await {
                    if n == 0 {
                        break;
                    }
                    got += n;
                    if got >= UP {
                        break;
                    }
                }
                up.lock().unwrap().push(got);
                let _ = writer.await;
            });
        }
    });
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    for mode in [Mode::Http3, Mode::Http2, Mode::Http11] {
        let client = gw.client(mode);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let req = client
            .request(Method::POST, &gw.url("/up"))
            .header("content-length", UP.to_string())
            .body(crate::RequestBody::wrap(Channel(rx)));
        let response = tokio::spawn(req.send());
        let feed = async {
            let block = Bytes::from(vec![b'u'; 64 << 10]);
            for _ in 0..UP / block.len() {
                tx.send(block.clone()).await.unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(30), feed)
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: the upload stopped while the response waited"));
        drop(tx);
        let r = response.await.unwrap().unwrap();
        assert_eq!(r.status(), 200, "{mode:?}");
        assert_eq!(r.bytes().await.unwrap().len(), DOWN, "{mode:?}");
        assert_eq!(uploaded.lock().unwrap().pop(), Some(UP), "{mode:?}");
    }
}

/// A backend that takes a request and closes without answering: an idempotent request
/// without a body (the commonest kind) goes once more, to the next backend (RFC 9110
/// §9.2.2); a POST that reached it does not, and gets 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bodiless_get_the_backend_dropped_goes_to_the_next() {
    let (dropper, dropped) = scripted(|_| Say::Close(b"")).await;
    let (live, seen) = backend("live", false).await;
    let gw = Gateway::start(
        proxy_to(&[(dropper, false), (live, false)])
            .fail_timeout(Duration::from_millis(1))
            .build()
            .unwrap(),
    )
    .await;
    for mode in [Mode::Http3, Mode::Http2, Mode::Http11] {
        let client = gw.client(mode);
        for _ in 0..2 {
            let r = client.get(&gw.url("/whoami")).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{mode:?}");
            assert_eq!(r.text().await.unwrap(), "live", "{mode:?}");
        }
    }
    assert!(
        dropped.requests.load(SeqCst) >= 3,
        "the first backend was tried"
    );
    assert_eq!(seen.requests.load(SeqCst), 6);
    let gw = Gateway::start(proxy_to(&[(dropper, false)]).build().unwrap()).await;
    let r = gw
        .client(Mode::Http3)
        .request(Method::POST, &gw.url("/echo"))
        .body(b"once".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
}

/// A backend that sends its response head and part of the body, then nothing: the client
/// gets an error once the response timeout passes without a byte (as nginx's
/// `proxy_read_timeout`), not a response that hangs; a slow reader is not cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_stalls_mid_body_is_cut_off() {
    let (b, _) = scripted(|path| match path {
        "/stall" => Say::Stall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart"),
        _ => Say::Keep(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"),
    })
    .await;
    let gw = Gateway::start(
        proxy_to(&[(b, false)])
            .response_timeout(Duration::from_millis(400))
            .max_fails(100)
            .build()
            .unwrap(),
    )
    .await;
    for mode in [Mode::Http3, Mode::Http2, Mode::Http11] {
        let client = gw.client(mode);
        let start = Instant::now();
        let r = client.get(&gw.url("/stall")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let body = tokio::time::timeout(Duration::from_secs(10), r.bytes())
            .await
            .expect("the body ends, one way or the other");
        assert!(
            body.is_err(),
            "{mode:?}: a stalled body is an error, not a short one"
        );
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(350) && took < Duration::from_secs(3),
            "{mode:?}: {took:?}"
        );
        // A response the client reads late is whole: the timer counts only waits for the
        // backend.
        let r = client.get(&gw.url("/ok")).send().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(&r.bytes().await.unwrap()[..], b"hi", "{mode:?}");
    }
}

/// The response timeout counts from the request body's last progress: an upload that keeps
/// coming, longer in all than the timeout, to a backend that reads it whole before it
/// answers, is not cut off; a client whose body stops coming gets 408, and the backend is not
/// blamed for it (the next request still goes there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_timeout_counts_from_the_uploads_last_progress() {
    for h2c in [false, true] {
        let (b, _) = backend("b", h2c).await;
        let gw = Gateway::start(
            proxy_to(&[(b, h2c)])
                .response_timeout(Duration::from_millis(300))
                .build()
                .unwrap(),
        )
        .await;
        for mode in [Mode::Http3, Mode::Http2, Mode::Http11] {
            let client = gw.client(mode);
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let req = client
                .request(Method::POST, &gw.url("/count"))
                .body(crate::RequestBody::wrap(Channel(rx)));
            let response = tokio::spawn(req.send());
            for _ in 0..8 {
                tx.send(Bytes::from_static(b"0123456789")).await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            drop(tx);
            let r = response.await.unwrap().unwrap();
            assert_eq!(r.status(), 200, "{mode:?} h2c {h2c}: a 0.8 s upload");
            assert_eq!(r.text().await.unwrap(), "80");
            // Then a body that stops.
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let req = client
                .request(Method::POST, &gw.url("/count"))
                .body(crate::RequestBody::wrap(Channel(rx)));
            let response = tokio::spawn(req.send());
            tx.send(Bytes::from_static(b"start")).await.unwrap();
            let r = tokio::time::timeout(Duration::from_secs(10), response)
                .await
                .expect("an answer while the body waits")
                .unwrap()
                .unwrap();
            assert_eq!(
                r.status(),
                StatusCode::REQUEST_TIMEOUT,
                "{mode:?} h2c {h2c}"
            );
            drop(tx);
            let r = client.get(&gw.url("/whoami")).send().await.unwrap();
            assert_eq!(
                r.status(),
                200,
                "{mode:?} h2c {h2c}: the backend is still in use"
            );
        }
    }
}

/// A client's `Forwarded` that ends inside a quoted string would swallow the element the
/// gateway appends (for a lenient parser at the backend): it is dropped, and the backend
/// sees the gateway's element alone; a well-formed one is kept and extended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_forwarded_left_open_is_dropped() {
    let (b, _) = backend("b", false).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    let client = gw.client(Mode::Http2);
    let forwarded = |value: &'static str| {
        let client = client.clone();
        let url = gw.url("/headers");
        async move {
            let r = client
                .get(&url)
                .header("forwarded", value)
                .send()
                .await
                .unwrap();
            let text = r.text().await.unwrap();
            text.lines()
                .find(|l| l.starts_with("forwarded: "))
                .unwrap()
                .to_string()
        }
    };
    let line = forwarded("for=6.6.6.6;x=\"").await;
    assert!(!line.contains("6.6.6.6"), "{line}");
    assert!(line.starts_with("forwarded: for=127.0.0.1"), "{line}");
    let line = forwarded("for=192.0.2.1").await;
    assert!(
        line.starts_with("forwarded: for=192.0.2.1, for=127.0.0.1"),
        "{line}"
    );
}

/// A plain CONNECT (not a WebSocket's extended CONNECT) is refused by the gateway, never
/// sent to a backend, whose 2xx would make a tunnel of the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_connect_is_refused() {
    use tower_service::Service;
    let (b, seen) = backend("b", false).await;
    let mut proxy = proxy_to(&[(b, false)]).build().unwrap();
    let mut req = Request::new(crate::Body::empty());
    *req.method_mut() = Method::CONNECT;
    *req.uri_mut() = "example.com:443".parse().unwrap();
    let resp = proxy.call(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(seen.requests.load(SeqCst), 0);
}

/// Clients that stop reading large responses from an HTTP/2 backend hold at most their own
/// streams' windows: the other requests on the backend's connection still get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_reading_do_not_stall_an_h2_backend() {
    let (b, _) = backend("b", true).await;
    let gw = Gateway::start(proxy_to(&[(b, true)]).build().unwrap()).await;
    // Each on a client of its own, so that no client's connection window is the limit.
    let mut held = Vec::new();
    for _ in 0..8 {
        let client = gw.client(Mode::Http2);
        let r = client.get(&gw.url("/big")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        held.push((client, r));
    }
    // Let the stalled responses fill every buffer on their way.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for mode in [Mode::Http3, Mode::Http2] {
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            gw.client(mode).get(&gw.url("/whoami")).send(),
        )
        .await
        .unwrap_or_else(|_| panic!("{mode:?}: no answer while 8 responses wait for readers"))
        .unwrap();
        assert_eq!(r.text().await.unwrap(), "b", "{mode:?}");
    }
    // The held ones still come whole once read.
    let (_, r) = held.pop().unwrap();
    assert_eq!(r.bytes().await.unwrap().len(), 8 << 20);
}

/// A request body that breaks off on its way to a backend (here: past the server's limit
/// on bodies, which only shows as it streams) is the client's fault: 413, and the backend
/// is not rested for it (one backend, which a failure would rest: its next answer comes
/// from a rest that the proxy must break through; the metrics count no upstream error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_fails_is_not_the_backends_fault() {
    for h2c in [false, true] {
        let (b, _) = backend("b", h2c).await;
        let metrics = crate::metrics::Metrics::new();
        let proxy = proxy_to(&[(b, h2c)])
            .metrics(metrics.clone())
            .build()
            .unwrap();
        let (cert, tls) = identity();
        let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = crate::Limits {
            max_request_body: Some(100_000),
            ..crate::Limits::default()
        };
        tokio::spawn(Server::new(proxy).limits(limits).serve(listener));
        let gw = Gateway {
            port: addr.port(),
            addr,
            cert,
        };
        for mode in [Mode::Http3, Mode::Http2] {
            let client = gw.client(mode);
            // No declared length: the limit shows part-way.
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let req = client
                .request(Method::POST, &gw.url("/count"))
                .body(crate::RequestBody::wrap(Channel(rx)));
            let response = tokio::spawn(req.send());
            for _ in 0..30 {
                if tx.send(Bytes::from(vec![b'x'; 10_000])).await.is_err() {
                    break;
                }
            }
            drop(tx);
            let r = tokio::time::timeout(Duration::from_secs(10), response)
                .await
                .expect("an answer")
                .unwrap();
            if let Ok(r) = r {
                assert_eq!(
                    r.status(),
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "{mode:?} h2c {h2c}"
                );
            }
            let text = metrics.render();
            let errors = text
                .lines()
                .filter(|l| l.starts_with("kuai_upstream_errors_total{") && !l.ends_with(" 0"))
                .collect::<Vec<_>>();
            assert!(
                errors.is_empty(),
                "{mode:?} h2c {h2c}: counted as the backend's failure: {errors:?}"
            );
        }
    }
}

/// The client's Host as the gateway reads it: read before `Connection` takes hop-by-hop
/// fields away; two of them, one that is no authority, or userinfo, refused (400) and not
/// forwarded. `TE: trailers` goes on to an HTTP/2 backend (gRPC needs it), not to an
/// HTTP/1.1 one. The client's X-Real-IP and X-Forwarded-Host go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_field_is_checked_and_te_trailers_reaches_h2() {
    use tower_service::Service;
    for h2c in [false, true] {
        let (b, seen) = backend("b", h2c).await;
        let mut proxy = proxy_to(&[(b, h2c)]).build().unwrap();
        let request = |fields: &[(&'static str, &'static str)]| {
            let mut req = Request::new(crate::Body::empty());
            *req.uri_mut() = "/headers".parse().unwrap();
            for (k, v) in fields {
                req.headers_mut().append(*k, v.parse().unwrap());
            }
            req
        };
        // No Host at all (HTTP/1.1 without it, HTTP/1.0), or an empty host: an h2c backend
        // was told "localhost", an HTTP/1.1 one got no Host.
        let refused: [&[(&str, &str)]; 5] = [
            &[("host", "a.example"), ("host", "b.example")],
            &[("host", "a b")],
            &[("host", "user@a.example")],
            &[],
            &[("host", ":443")],
        ];
        for fields in refused {
            let resp = proxy.call(request(fields)).await.unwrap();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{fields:?}");
        }
        // Another scheme than http(s): its path need not be one a backend can take.
        let mut other = request(&[("host", "a.example")]);
        *other.uri_mut() = "ftp://a.example/headers".parse().unwrap();
        let resp = proxy.call(other).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        // Targets that are no absolute path: `GET *` (HTTP/1.1 takes it with any method),
        // and a `:path` of "?x=1" (HTTP/2 takes it; its path reads as "/").
        for target in ["*", "?x=1"] {
            let mut r = request(&[("host", "a.example")]);
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(target.parse().unwrap());
            *r.uri_mut() = Uri::from_parts(parts).unwrap();
            let resp = proxy.call(r).await.unwrap();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{target}");
        }
        assert_eq!(seen.requests.load(SeqCst), 0, "h2c {h2c}");
        let resp = proxy
            .call(request(&[
                ("host", "a.example"),
                ("connection", "host, te"),
                ("te", "trailers"),
                ("x-real-ip", "6.6.6.6"),
                ("x-forwarded-host", "evil.example"),
                ("expect", "100-continue"),
                // What a CGI-style backend reads as X-Real-IP and X-Forwarded-Proto.
                ("x_real_ip", "7.7.7.7"),
                ("x_forwarded_proto", "http"),
            ]))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = String::from_utf8(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap();
        // Without the connection's facts (a service in the caller's own server) the
        // client's claims still do not pass.
        assert!(!text.contains("6.6.6.6"), "{text}");
        assert!(!text.contains("evil.example"), "{text}");
        assert!(!text.contains("7.7.7.7") && !text.contains("x_"), "{text}");
        // The gateway does not wait for a 100: the backend is not told to send one.
        assert!(!text.contains("\nexpect:"), "{text}");
        if h2c {
            assert!(text.contains("http://a.example/headers"), "{text}");
            assert!(text.contains("\nte: trailers\n"), "{text}");
        } else {
            assert!(text.contains("\nhost: a.example\n"), "{text}");
            assert!(!text.contains("\nte:"), "{text}");
        }
        // A server-wide OPTIONS goes on as `*`.
        let mut r = request(&[("host", "a.example")]);
        *r.method_mut() = Method::OPTIONS;
        *r.uri_mut() = "*".parse().unwrap();
        let before = seen.requests.load(SeqCst);
        let resp = proxy.call(r).await.unwrap();
        assert_ne!(resp.status(), StatusCode::BAD_REQUEST);
        assert_eq!(seen.requests.load(SeqCst), before + 1);
        // Underscores allowed when asked.
        let mut proxy = proxy_to(&[(b, h2c)])
            .underscores_in_headers(true)
            .build()
            .unwrap();
        let resp = proxy
            .call(request(&[("host", "a.example"), ("x_app", "1")]))
            .await
            .unwrap();
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(
            String::from_utf8_lossy(&text).contains("\nx_app: 1\n"),
            "{text:?}"
        );
    }
}

/// Opens an HTTP/3 extended CONNECT for a WebSocket to `path` through `gw`.
async fn h3_websocket(
    gw: &Gateway,
    path: &str,
) -> (
    (kuai::Connection, kuai_h3::Client),
    kuai_h3::RequestStream,
    Response<()>,
) {
    let cep = client_endpoint();
    let ccfg = kuai::ClientConfig::with_root(gw.cert.clone(), &[crate::server::ALPN_H3]).unwrap();
    let (conn, client) = h3_client_with(&cep, ccfg, gw.addr).await;
    let mut req = Request::builder()
        .method(Method::CONNECT)
        .uri(format!("https://localhost{path}"))
        .header("sec-websocket-version", "13")
        .body(())
        .unwrap();
    req.extensions_mut()
        .insert(kuai_h3::Protocol("websocket".into()));
    let mut stream = client.send_request(req).await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    ((conn, client), stream, resp)
}

/// An HTTP/2 extended CONNECT (RFC 8441) for a WebSocket to `path` at `addr`, upgraded.
async fn h2_websocket(
    addr: SocketAddr,
    cert: &rustls::pki_types::CertificateDer<'static>,
    path: &str,
) -> tokio_tungstenite::WebSocketStream<TokioIo<hyper::upgrade::Upgraded>> {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let mut h2 = crate::server::tests::Sender::connect(addr, cert, crate::server::ALPN_H2).await;
    let mut req = Request::builder()
        .method(Method::CONNECT)
        .uri(format!("https://localhost:{}{path}", addr.port()))
        .header("sec-websocket-version", "13")
        .body(crate::server::tests::empty())
        .unwrap();
    req.extensions_mut()
        .insert(hyper::ext::Protocol::from_static("websocket"));
    let resp = h2.send(req).await;
    assert_eq!(resp.status(), 200);
    let up = hyper::upgrade::on(resp).await.unwrap();
    tokio_tungstenite::WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Client, None).await
}

/// An HTTP/3 WebSocket tunnel that idles past the response timeout is closed on both
/// sides: the client's response stream ends too (it stayed open for the connection's life).
/// A backend that answers an extended CONNECT with a 2xx of its own (no 101) has not
/// switched: 502, not a tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http3_websocket_tunnels_end_when_idle() {
    let (b, _) = websocket_backend().await;
    let gw = Gateway::start(
        proxy_to(&[(b, false)])
            .response_timeout(Duration::from_millis(400))
            .build()
            .unwrap(),
    )
    .await;
    let (_conn, stream, resp) = h3_websocket(&gw, "/ws").await;
    assert_eq!(resp.status(), 200);
    let (_send, mut recv) = stream.split();
    let end = tokio::time::timeout(Duration::from_secs(5), recv.recv_data()).await;
    assert!(
        matches!(end, Ok(Ok(None) | Err(_))),
        "the idle tunnel is still open: {end:?}"
    );

    let (plain, _) = backend("b", false).await;
    let gw = Gateway::start(proxy_to(&[(plain, false)]).build().unwrap()).await;
    let (_conn, _stream, resp) = h3_websocket(&gw, "/whoami").await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
}

/// A WebSocket upgrade whose backend cannot be reached goes to the next backend, as other
/// requests do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_goes_to_the_next_backend_when_one_is_down() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (b, _) = websocket_backend().await;
    let gw = Gateway::start(
        proxy_to(&[(dead, false), (b, false)])
            .fail_timeout(Duration::from_millis(1))
            .build()
            .unwrap(),
    )
    .await;
    // Round robin starts at either backend: two upgrades meet the dead one at least once.
    for i in 0..2 {
        let tls = crate::server::tests::tls_to(gw.addr, &gw.cert, crate::server::ALPN_H1).await;
        let (ws, resp) =
            tokio_tungstenite::client_async(format!("wss://localhost:{}/ws", gw.port), tls)
                .await
                .unwrap_or_else(|e| panic!("upgrade {i}: {e}"));
        assert_eq!(resp.status(), 101);
        echo_over(ws, "HTTP/1.1").await;
    }
}

/// At its most connections a backend gets no more: a request that finds them all busy
/// waits for one within the connect timeout, then is answered 503, and the busy backend is
/// not counted as failing; once a connection is free the next request uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_gets_no_more_than_its_most_connections() {
    let (b, seen) = backend("b", false).await;
    let metrics = crate::metrics::Metrics::new();
    let gw = Gateway::start_with(
        proxy_to(&[(b, false)])
            .max_connections_per_backend(2)
            .connect_timeout(Duration::from_millis(300))
            .metrics(metrics.clone())
            .build()
            .unwrap(),
        Some(metrics.clone()),
    )
    .await;
    let client = gw.client(Mode::Http3);
    let hanging: Vec<_> = (0..2)
        .map(|_| tokio::spawn(client.get(&gw.url("/hang")).send()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    while seen.live.load(SeqCst) != 2 {
        assert!(
            Instant::now() < deadline,
            "the two requests reach the backend"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = Instant::now();
    let r = client.get(&gw.url("/whoami")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(seen.connections.load(SeqCst), 2);
    let text = metrics.render();
    let errors: Vec<_> = text
        .lines()
        .filter(|l| l.starts_with("kuai_upstream_errors_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(errors.is_empty(), "counted as failures: {errors:?}");
    // One of the hanging requests given up: its connection closes and the next request
    // takes its place.
    hanging[0].abort();
    client.close_connections();
    let client = gw.client(Mode::Http3);
    let r = client.get(&gw.url("/whoami")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "b");
    assert!(seen.connections.load(SeqCst) <= 4);
}

/// An HTTP/2 WebSocket tunnel keeps its connection busy: the server's idle timeout does not
/// close the connection (GOAWAY, then the drop that cut the tunnel about 80 s in with the
/// defaults) while the tunnel is open, whatever moves on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_websocket_outlives_the_connections_idle_timeout() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let (b, _) = websocket_backend().await;
    let idle_timeout = Duration::from_millis(300);
    let limits = crate::server::Limits {
        idle_timeout,
        ..Default::default()
    };
    let gw = Gateway::start_limited(proxy_to(&[(b, false)]).build().unwrap(), limits).await;
    let mut ws = h2_websocket(gw.addr, &gw.cert, "/ws").await;
    // Past the idle timeout and the 5 s an idle connection's GOAWAY gives its streams, a
    // message every half an idle timeout.
    for i in 0..40 {
        tokio::time::sleep(idle_timeout / 2).await;
        let m = Message::text(format!("ping {i}"));
        ws.send(m.clone()).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(2), ws.next()).await;
        assert!(
            matches!(&back, Ok(Some(Ok(b))) if *b == m),
            "message {i}: {back:?}"
        );
    }
    ws.close(None).await.unwrap();
}

/// WebSocket tunnels hold backend connections no other limit counts: past the proxy's caps
/// (in all, per client address) an upgrade is answered 503, and a closed tunnel gives its
/// place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_tunnels_are_capped() {
    let (b, _) = websocket_backend().await;
    let gw = Gateway::start(
        proxy_to(&[(b, false)])
            .max_websockets(3, 2)
            .build()
            .unwrap(),
    )
    .await;
    let (c1, s1, r1) = h3_websocket(&gw, "/ws").await;
    let (_c2, _s2, r2) = h3_websocket(&gw, "/ws").await;
    assert_eq!((r1.status(), r2.status()), (StatusCode::OK, StatusCode::OK));
    let (_c3, _s3, r3) = h3_websocket(&gw, "/ws").await;
    assert_eq!(
        r3.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "past 2 per address"
    );
    // The first tunnel ends (its client goes): its place comes back.
    drop((s1, c1));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (c, s, r) = h3_websocket(&gw, "/ws").await;
        if r.status() == 200 {
            std::mem::forget((c, s));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the closed tunnel kept its place"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A backend whose 101 is no WebSocket handshake (RFC 6455 §4.1: `Upgrade: websocket`,
/// `Connection: upgrade` and the Accept for the key) opens no tunnel: 502. The backend here
/// answers with the right Accept and leaves out one of the two others in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_101_without_the_websocket_handshake_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for leave_out in ["upgrade", "connection"] {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                // The field name in any case; the key (base64) as it came.
                let raw = String::from_utf8_lossy(&buf);
                let key = raw
                    .lines()
                    .find(|l| l.to_lowercase().starts_with("sec-websocket-key:"))
                    .map(|l| l["sec-websocket-key:".len()..].trim().to_string())
                    .unwrap_or_default();
                let mut answer = String::from("HTTP/1.1 101 Switching Protocols\r\n");
                if leave_out != "upgrade" {
                    answer.push_str("Upgrade: websocket\r\n");
                }
                if leave_out != "connection" {
                    answer.push_str("Connection: Upgrade\r\n");
                }
                answer.push_str(&format!(
                    "Sec-WebSocket-Accept: {}\r\n\r\n",
                    super::websocket::accept_for(key.as_bytes())
                ));
                let _ = s.write_all(answer.as_bytes()).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
        let (_c, _s, resp) = h3_websocket(&gw, "/ws").await;
        assert_eq!(
            resp.status(),
            StatusCode::BAD_GATEWAY,
            "without {leave_out}"
        );
    }
}

/// A WebSocket backend by hand, one connection: it answers the handshake with a 101 and, in
/// the same write, `early` bytes of tunnel data; then, with `reset`, it resets its
/// connection (SO_LINGER 0), or else it reads until the connection ends and reports how:
/// "eof" (a FIN) or "reset" (an RST).
async fn raw_websocket_backend(
    early: &'static [u8],
    reset: bool,
) -> (SocketAddr, tokio::sync::oneshot::Receiver<&'static str>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut tcp, _) = l.accept().await.unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tcp.read(&mut b).await.unwrap();
            assert!(n > 0, "the request head did not come");
            head.extend_from_slice(&b[..n]);
        }
        let text = String::from_utf8_lossy(&head).to_string();
        let key = text
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .starts_with("sec-websocket-key:")
                    .then(|| l[18..].trim().to_string())
            })
            .expect("no key");
        let mut out = format!(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n\r\n",
            super::websocket::accept_for(key.as_bytes())
        )
        .into_bytes();
        out.extend_from_slice(early);
        tcp.write_all(&out).await.unwrap();
        if reset {
            tokio::time::sleep(Duration::from_millis(200)).await;
            socket2::SockRef::from(&tcp)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
            drop(tcp);
            let _ = tx.send("reset sent");
            return;
        }
        let how = loop {
            match tcp.read(&mut b).await {
                Ok(0) => break "eof",
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break "reset",
                Err(_) => break "error",
            }
        };
        let _ = tx.send(how);
    });
    (addr, rx)
}

/// An HTTP/3 WebSocket tunnel carries what the backend sent with its 101; a client that
/// resets the tunnel has the backend's connection reset (a TCP RST, not a FIN), and a
/// backend that resets its connection has the client's stream reset with
/// H3_REQUEST_CANCELLED (RFC 9220 §3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_resets_cross_the_gateway_both_ways() {
    // The client resets.
    let (b, how) = raw_websocket_backend(b"\x81\x02hi", false).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    let (_conn, stream, resp) = h3_websocket(&gw, "/ws").await;
    assert_eq!(resp.status(), 200);
    let (mut send, mut recv) = stream.split();
    let first = tokio::time::timeout(Duration::from_secs(5), recv.recv_data())
        .await
        .expect("the backend's first bytes did not come")
        .unwrap();
    assert_eq!(first.as_deref(), Some(&b"\x81\x02hi"[..]));
    send.reset(kuai_h3::Code::REQUEST_CANCELLED);
    recv.stop(kuai_h3::Code::REQUEST_CANCELLED);
    let how = tokio::time::timeout(Duration::from_secs(5), how)
        .await
        .expect("the backend's connection did not end")
        .unwrap();
    assert_eq!(
        how, "reset",
        "the client's reset reached the backend as {how}"
    );

    // The backend resets.
    let (b, _) = raw_websocket_backend(b"", true).await;
    let gw = Gateway::start(proxy_to(&[(b, false)]).build().unwrap()).await;
    let (_conn, stream, resp) = h3_websocket(&gw, "/ws").await;
    assert_eq!(resp.status(), 200);
    let (_send, mut recv) = stream.split();
    let end = tokio::time::timeout(Duration::from_secs(5), recv.recv_data())
        .await
        .expect("the tunnel did not end");
    assert!(
        matches!(end, Err(kuai_h3::Error::StreamReset(c)) if c == kuai_h3::Code::REQUEST_CANCELLED),
        "{end:?}"
    );
}

/// An h2c backend whose listener drops SYNs (its accept queue full): requests that arrive
/// together while the first tries to connect fail with that attempt, not one connect
/// timeout after another (they queued on the backend's connection lock and each tried
/// in turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_on_an_h2_backend_that_does_not_answer_fail_together() {
    use tower_service::Service;
    // A listener that never accepts, its queue filled: further SYNs go unanswered.
    let l = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    l.listen(0).unwrap();
    let addr = l.local_addr().unwrap().as_socket().unwrap();
    let mut fill = Vec::new();
    for _ in 0..4 {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_nonblocking(true).unwrap();
        let _ = s.connect(&addr.into());
        fill.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let proxy = proxy_to(&[(addr, true)])
        .connect_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let mut proxy = proxy.clone();
        set.spawn(async move {
            let mut req = Request::new(crate::Body::empty());
            *req.uri_mut() = "/x".parse().unwrap();
            req.headers_mut()
                .insert("host", "a.example".parse().unwrap());
            proxy.call(req).await.unwrap().status()
        });
    }
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap(), StatusCode::GATEWAY_TIMEOUT);
    }
    let took = t.elapsed();
    assert!(took < Duration::from_millis(900), "{took:?}");
    drop((fill, l));
}
