//! HTTP/3 serving and fetching for the command line.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Response, StatusCode};
use kuai::Connection;
use kuai_h3::{Config, RequestStream, Server};

use crate::hq::Site;

pub use kuai_h3::ALPN;

/// Serves every request of a connection.
pub async fn serve_connection(conn: Connection, site: Arc<Site>, alt_svc: Option<String>) {
    serve_connection_with(conn, site, alt_svc, Config::default(), None).await
}

/// RFC 8470 §5.2 and RFC 9110 §9.2.2: a request in early data whose method is not
/// idempotent is not processed; 425 asks the client to send it again after the handshake.
pub(crate) fn too_early(method: &http::Method, in_0rtt: bool) -> bool {
    in_0rtt && !method.is_idempotent()
}

/// Requests of a connection in flight, and since when there have been none.
struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle_since: std::sync::Mutex<tokio::time::Instant>,
    changed: tokio::sync::Notify,
}

/// One request in flight, for as long as it lives.
struct Request(Arc<InFlight>);

impl Request {
    fn new(f: &Arc<InFlight>) -> Self {
        f.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(f.clone())
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = tokio::time::Instant::now();
        self.0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        self.0.changed.notify_one();
    }
}

/// Serves every request of a connection, with HTTP/3 settings of its own. With
/// `idle_timeout`, a connection with no request in flight for that long is closed with
/// H3_NO_ERROR (RFC 9114 §5.2), as the TCP server closes idle connections.
pub async fn serve_connection_with(
    conn: Connection,
    site: Arc<Site>,
    alt_svc: Option<String>,
    config: Config,
    idle_timeout: Option<std::time::Duration>,
) {
    let remote = conn.remote_address();
    let mut server = match Server::new(conn, config).await {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(%remote, error = %e, "HTTP/3 setup failed");
            return;
        }
    };
    let in_flight = Arc::new(InFlight {
        count: Default::default(),
        idle_since: std::sync::Mutex::new(tokio::time::Instant::now()),
        changed: Default::default(),
    });
    loop {
        let idle = in_flight.count.load(std::sync::atomic::Ordering::Relaxed) == 0;
        let deadline = idle_timeout.map(|t| {
            *in_flight
                .idle_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                + t
        });
        let next = tokio::select! {
            r = server.accept() => r,
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)),
                if idle && deadline.is_some() => {
                tracing::debug!(%remote, "HTTP/3 connection idle: closed");
                server.shutdown();
                server.quic().close(kuai_h3::Code::NO_ERROR.0, b"idle");
                break;
            }
            // A request ended: the deadline moved.
            _ = in_flight.changed.notified() => continue,
        };
        let Some((req, stream)) = next else { break };
        let request = Request::new(&in_flight);
        let site = site.clone();
        let alt_svc = alt_svc.clone();
        // Its head arrived (at least in part) in 0-RTT: an attacker may replay it (RFC 9001
        // §9.2, RFC 8446 §8).
        let in_0rtt = req.extensions().get::<kuai_h3::EarlyData>().is_some();
        tokio::spawn(async move {
            let _request = request;
            let start = Instant::now();
            let method = req.method().clone();
            let path = req.uri().path().to_owned();
            match respond(stream, &req, &site, alt_svc.as_deref(), in_0rtt).await {
                Ok((status, bytes)) => tracing::info!(
                    %remote, %method, path, status = status.as_u16(), bytes,
                    ms = start.elapsed().as_millis() as u64, "h3 request"
                ),
                Err(e) => tracing::info!(%remote, %method, path, error = %e, "h3 request failed"),
            }
        });
    }
}

async fn respond(
    mut stream: RequestStream,
    req: &http::Request<()>,
    site: &Site,
    alt_svc: Option<&str>,
    in_0rtt: bool,
) -> Result<(StatusCode, u64), kuai_h3::Error> {
    if too_early(req.method(), in_0rtt) {
        let resp = Response::builder()
            .status(StatusCode::TOO_EARLY)
            .body(())
            .expect("static response");
        stream.send_response(resp).await?;
        stream.finish()?;
        return Ok((StatusCode::TOO_EARLY, 0));
    }
    let path = req.uri().path();
    let resp = crate::site::response(site, req.method(), path, req.headers(), alt_svc).await;
    send(stream, resp).await
}

/// Sends `resp` and its body, and finishes the stream; the status and the body bytes sent.
async fn send<B>(
    mut stream: RequestStream,
    resp: Response<B>,
) -> Result<(StatusCode, u64), kuai_h3::Error>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    use http_body_util::BodyExt;
    let (head, mut body) = resp.into_parts();
    let status = head.status;
    stream.send_response(Response::from_parts(head, ())).await?;
    let mut sent = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| kuai_h3::Error::Malformed("response body failed"))?;
        if let Ok(data) = frame.into_data() {
            sent += data.len() as u64;
            stream.send_data(data).await?;
        }
    }
    stream.finish()?;
    let _ = stream.finished().await;
    Ok((status, sent))
}

/// Fetches `url`'s path on an HTTP/3 connection into `out`; returns (status, bytes).
pub async fn get_to(
    client: &kuai_h3::Client,
    url: &crate::url::Url,
    out: &mut (dyn std::io::Write + Send),
    mut progress: impl FnMut(u64),
) -> Result<(StatusCode, u64), String> {
    let uri = url.to_string();
    let request = || {
        http::Request::get(&uri)
            .header("user-agent", concat!("kuai/", env!("CARGO_PKG_VERSION")))
            .body(())
            .map_err(|e| e.to_string())
    };
    let send = |req| async {
        let mut stream = client.send_request(req).await?;
        stream.finish()?;
        let resp = stream.recv_response().await?;
        Ok::<_, kuai_h3::Error>((stream, resp))
    };
    // A request sent in 0-RTT that the server rejected never reached it: send it again, now
    // in 1-RTT on the same connection.
    let (mut stream, resp) = match send(request()?).await {
        Err(kuai_h3::Error::ZeroRttRejected) => {
            tracing::info!(%uri, "0-RTT rejected; sending the request again");
            send(request()?).await
        }
        r => r,
    }
    .map_err(|e| e.to_string())?;
    let mut total = 0u64;
    while let Some(chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
        out.write_all(&chunk)
            .map_err(|e| format!("write failed: {e}"))?;
        total += chunk.len() as u64;
        progress(total);
    }
    Ok((resp.status(), total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::time::Duration;

    #[test]
    fn only_non_idempotent_early_requests_are_too_early() {
        use http::Method;
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            assert!(too_early(&m, true), "{m}");
            assert!(!too_early(&m, false), "{m}");
        }
        for m in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::PUT,
            Method::DELETE,
        ] {
            assert!(!too_early(&m, true), "{m}");
        }
    }

    /// A UDP relay in front of `server` for one client, delaying what the server sends by
    /// `delay`, so the client's Finished comes that much later and its 0-RTT requests are
    /// handled before the handshake completes.
    async fn slow_return_relay(server: SocketAddr, delay: Duration) -> SocketAddr {
        let sock = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = sock.local_addr().unwrap();
        tokio::spawn(async move {
            let mut client = None;
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                if from == server {
                    let (sock, data) = (sock.clone(), buf[..n].to_vec());
                    if let Some(to) = client {
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let _ = sock.send_to(&data, to).await;
                        });
                    }
                } else {
                    client = Some(from);
                    let _ = sock.send_to(&buf[..n], server).await;
                }
            }
        });
        addr
    }

    async fn status(client: &kuai_h3::Client, method: http::Method) -> u16 {
        let req = http::Request::builder()
            .method(method)
            .uri("https://localhost/hello.txt")
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

    /// RFC 8470: `kuai server` answers a POST that came in 0-RTT with 425 Too Early, a GET
    /// in the same flight with 200, and the POST sent again after the handshake with what
    /// it answers any POST (405).
    /// `kuai server`'s HTTP/3 side on a free loopback port: its address and a client
    /// configuration that trusts it.
    fn start(h3: crate::server::H3Settings) -> (kuai::Endpoint, SocketAddr, kuai::ClientConfig) {
        start_site(h3, Site::Demo)
    }

    fn start_site(
        h3: crate::server::H3Settings,
        site: Site,
    ) -> (kuai::Endpoint, SocketAddr, kuai::ClientConfig) {
        let site = Arc::new(site);
        let identity = crate::tls::Identity::self_signed(&["localhost"]).unwrap();
        let scfg = crate::server::server_config(&identity, &[ALPN], None).unwrap();
        let ep = kuai::Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = ep.local_addr().unwrap();
        let e = ep.clone();
        tokio::spawn(async move {
            while let Some(c) = e.accept().await {
                tokio::spawn(crate::server::handle(c, site.clone(), None, h3.clone()));
            }
        });
        let ccfg = kuai::ClientConfig::with_root(identity.certs[0].clone(), &[ALPN]).unwrap();
        (ep, addr, ccfg)
    }

    /// A connection from `cep` to `addr` and an HTTP/3 client on it.
    async fn h3_client(
        cep: &kuai::Endpoint,
        ccfg: kuai::ClientConfig,
        addr: SocketAddr,
    ) -> (kuai::Connection, kuai_h3::Client) {
        let conn = cep
            .connect_with(ccfg, addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        let client = kuai_h3::Client::new(conn.clone(), Config::default())
            .await
            .unwrap();
        (conn, client)
    }

    fn settings(idle_timeout: Option<Duration>) -> crate::server::H3Settings {
        crate::server::H3Settings {
            config: Config::default(),
            idle_timeout,
        }
    }

    /// An HTTP/3 connection with no request in flight for the idle timeout is closed with
    /// H3_NO_ERROR; one that keeps making requests stays open.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_http3_connection_is_closed() {
        let (_ep, addr, ccfg) = start(settings(Some(Duration::from_millis(500))));
        let cep = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let (conn, client) = h3_client(&cep, ccfg, addr).await;
        // A request every 200 ms for 1.2 s: never idle for 500 ms.
        for _ in 0..6 {
            assert_eq!(status(&client, http::Method::GET).await, 200);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(conn.close_reason().is_none(), "closed while in use");
        let t = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(5), conn.closed())
            .await
            .expect("closed within 5 s");
        let took = t.elapsed();
        eprintln!(
            "closed {took:?} after the last pause of 200 ms (the last response + 200 ms): {e:?}"
        );
        assert!(
            matches!(
                e,
                kuai::ConnectionError::ApplicationClosed { code: 0x100, .. }
            ),
            "{e:?}"
        );
        assert!(took >= Duration::from_millis(200), "{took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn early_non_idempotent_requests_get_425() {
        let (_ep, addr, ccfg) = start(settings(None));
        let cep = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        // A first connection for a session ticket that allows early data.
        let (conn, client) = h3_client(&cep, ccfg.clone(), addr).await;
        assert_eq!(status(&client, http::Method::GET).await, 200);
        assert!(conn.session_ticket().await);
        conn.close(0, b"");
        drop(client);
        // The second, through a relay that holds the server's flight back 300 ms.
        let relay = slow_return_relay(addr, Duration::from_millis(300)).await;
        let connecting = cep.connect_with(ccfg, relay, "localhost").unwrap();
        let Ok((conn, accepted)) = connecting.into_0rtt() else {
            panic!("the ticket allows 0-RTT");
        };
        let client = kuai_h3::Client::new(conn.clone(), Config::default())
            .await
            .unwrap();
        let (post, get) = tokio::join!(
            status(&client, http::Method::POST),
            status(&client, http::Method::GET)
        );
        assert!(accepted.await, "0-RTT accepted");
        assert_eq!((post, get), (425, 200));
        // After the handshake the same POST is not early any more.
        assert_eq!(status(&client, http::Method::POST).await, 405);
    }

    /// Over HTTP/3, a file answers with its validators, a byte range with 206, and a
    /// request that already has it with 304 (kuai_http::answer; tcp.rs's test of the same
    /// name covers HTTP/2 and HTTP/1.1).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn files_answer_ranges_and_conditional_requests() {
        let dir = std::env::temp_dir().join(format!("kuai-h3-range-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("f.bin"), &data).unwrap();
        let (_ep, addr, ccfg) = start_site(settings(None), Site::Dir(dir.clone()));
        let cep = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let (_conn, client) = h3_client(&cep, ccfg, addr).await;
        let get = |headers: Vec<(&'static str, String)>| {
            let client = client.clone();
            async move {
                let mut req = http::Request::builder().uri("https://localhost/f.bin");
                for (n, v) in headers {
                    req = req.header(n, v);
                }
                let mut s = client.send_request(req.body(()).unwrap()).await.unwrap();
                s.finish().unwrap();
                let resp = s.recv_response().await.unwrap();
                let body = s.recv_body(1 << 20).await.unwrap();
                (resp, body)
            }
        };
        let (whole, body) = get(vec![]).await;
        assert_eq!(whole.status(), 200);
        assert_eq!(&body[..], &data[..]);
        let etag = whole.headers()["etag"].to_str().unwrap().to_owned();
        assert_eq!(whole.headers()["accept-ranges"], "bytes");
        let (part, body) = get(vec![("range", "bytes=70000-70099".into())]).await;
        assert_eq!(part.status(), 206);
        assert_eq!(part.headers()["content-range"], "bytes 70000-70099/100000");
        assert_eq!(&body[..], &data[70_000..70_100]);
        let (same, body) = get(vec![("if-none-match", etag)]).await;
        assert_eq!(same.status(), 304);
        assert!(body.is_empty());
        let (past, _) = get(vec![("range", "bytes=100000-".into())]).await;
        assert_eq!(past.status(), 416);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
