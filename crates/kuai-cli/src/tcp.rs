//! HTTP/1.1 and HTTP/2 over TLS 1.3 on TCP (hyper and rustls): the server side that
//! `kuai server` runs on the same port as HTTP/3, advertising HTTP/3 with Alt-Svc, and the
//! client side `kuai get --http2` / `--http1.1` (and the fallback when UDP is blocked).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::hq::{self, Site};
use crate::url::Url;

pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_H1: &[u8] = b"http/1.1";

/// A response body: nothing, bytes in memory, a file streamed in 64 KiB chunks, or the demo
/// site's generated pattern.
pub enum RespBody {
    Bytes(Option<Bytes>),
    File(tokio::fs::File, u64),
    Pattern(Bytes, u64),
}

impl http_body::Body for RespBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            RespBody::Bytes(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::File(file, left) => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                let mut chunk = vec![0u8; (*left).min(64 * 1024) as usize];
                let mut buf = ReadBuf::new(&mut chunk);
                ready!(Pin::new(file).poll_read(cx, &mut buf))?;
                let n = buf.filled().len();
                if n == 0 {
                    return Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())));
                }
                chunk.truncate(n);
                *left -= n as u64;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(chunk)))))
            }
            RespBody::Pattern(block, left) => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                let n = (*left).min(block.len() as u64) as usize;
                *left -= n as u64;
                Poll::Ready(Some(Ok(Frame::data(block.slice(..n)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Bytes(b) => b.is_none(),
            RespBody::File(_, left) | RespBody::Pattern(_, left) => *left == 0,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            RespBody::Bytes(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            RespBody::File(_, left) | RespBody::Pattern(_, left) => {
                http_body::SizeHint::with_exact(*left)
            }
        }
    }
}

/// The TLS configuration of the TCP listener: the QUIC server's certificate, ALPN h2 and
/// http/1.1.
pub fn server_tls(
    identity: &crate::tls::Identity,
    keylog: Option<&std::path::Path>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    Ok(Arc::new(crate::server::rustls_server_config(
        identity,
        &[ALPN_H2, ALPN_H1],
        keylog,
    )?))
}

/// Accepts TCP connections and serves HTTP/1.1 or HTTP/2 (by ALPN) until the listener fails.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    site: Arc<Site>,
    alt_svc: Option<String>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let (sock, remote) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors and the like: wait a little rather than spin.
                tracing::warn!(error = %e, "TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let acceptor = acceptor.clone();
        let site = site.clone();
        let alt_svc = alt_svc.clone();
        tokio::spawn(async move {
            let tls =
                match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(sock)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::info!(%remote, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%remote, "TLS handshake timed out");
                        return;
                    }
                };
            let h2 = tls.get_ref().1.alpn_protocol() == Some(ALPN_H2);
            let proto = if h2 { "h2" } else { "http/1.1" };
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let site = site.clone();
                let alt_svc = alt_svc.clone();
                async move {
                    Ok::<_, Infallible>(
                        respond(req, &site, alt_svc.as_deref(), remote, proto).await,
                    )
                }
            });
            let io = TokioIo::new(tls);
            let r = if h2 {
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, svc)
                    .await
            } else {
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await
            };
            if let Err(e) = r {
                tracing::debug!(%remote, error = %e, "{proto} connection ended");
            }
        });
    }
}

async fn respond(
    req: Request<Incoming>,
    site: &Site,
    alt_svc: Option<&str>,
    remote: SocketAddr,
    proto: &str,
) -> Response<RespBody> {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let head_only = method == http::Method::HEAD;
    let mut builder = Response::builder().header("server", "kuai");
    if let Some(a) = alt_svc {
        builder = builder.header("alt-svc", a);
    }
    let (status, len, resp) = if method != http::Method::GET && !head_only {
        let r = builder
            .status(StatusCode::METHOD_NOT_ALLOWED)
            .header("allow", "GET, HEAD")
            .body(RespBody::Bytes(None));
        (StatusCode::METHOD_NOT_ALLOWED, 0, r)
    } else {
        match hq::resolve(site, &path).await {
            None => {
                let msg = Bytes::from_static(b"404 not found\n");
                let r = builder
                    .status(StatusCode::NOT_FOUND)
                    .header("content-type", "text/plain")
                    .header("content-length", msg.len())
                    .body(RespBody::Bytes(Some(msg)));
                (StatusCode::NOT_FOUND, 14, r)
            }
            Some(body) => {
                let (len, ctype, body) = match body {
                    hq::Body::File(f, n) => {
                        (n, crate::h3::content_type(&path), RespBody::File(f, n))
                    }
                    hq::Body::Bytes(b) => (
                        b.len() as u64,
                        crate::h3::content_type(&path),
                        RespBody::Bytes(Some(b)),
                    ),
                    hq::Body::Pattern(n) => (
                        n,
                        "application/octet-stream",
                        RespBody::Pattern(crate::demo::pattern_block().clone(), n),
                    ),
                };
                let body = if head_only {
                    RespBody::Bytes(None)
                } else {
                    body
                };
                let r = builder
                    .header("content-type", ctype)
                    .header("content-length", len)
                    .body(body);
                (StatusCode::OK, if head_only { 0 } else { len }, r)
            }
        }
    };
    tracing::info!(
        %remote, %method, path, status = status.as_u16(), bytes = len,
        ms = start.elapsed().as_millis() as u64, "{proto} request"
    );
    resp.unwrap_or_else(|_| {
        let mut r = Response::new(RespBody::Bytes(None));
        *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        r
    })
}

// ---------------------------------------------------------------------------------------------
// Client

/// HTTP/2 or HTTP/1.1 over TLS.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Proto {
    H2,
    H1,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::H2 => "h2",
            Proto::H1 => "http/1.1",
        }
    }
}

/// Facts about a TLS connection, for `-v`.
#[derive(Clone, Debug, Default)]
pub struct ConnInfo {
    pub cipher_suite: Option<String>,
    pub resumed: bool,
}

/// A TCP + TLS client for one origin: one multiplexed HTTP/2 connection, or a pool of up to
/// `max_h1` HTTP/1.1 connections (one request at a time each, as browsers do).
pub struct TcpClient {
    proto: Proto,
    addr: SocketAddr,
    host: String,
    connector: tokio_rustls::TlsConnector,
    h2: Option<hyper::client::conn::http2::SendRequest<Empty<Bytes>>>,
    h1_idle: Mutex<Vec<hyper::client::conn::http1::SendRequest<Empty<Bytes>>>>,
    h1_slots: Semaphore,
    pub info: ConnInfo,
}

async fn connect_tls(
    addr: SocketAddr,
    host: &str,
    connector: &tokio_rustls::TlsConnector,
    want: &[u8],
) -> Result<(tokio_rustls::client::TlsStream<TcpStream>, ConnInfo), String> {
    let sock = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("{addr}: TCP connect failed: {e}"))?;
    let _ = sock.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|_| format!("{host}: not a valid server name"))?;
    let tls = connector
        .connect(name, sock)
        .await
        .map_err(|e| format!("{addr}: TLS handshake failed: {e}"))?;
    let c = tls.get_ref().1;
    if c.alpn_protocol() != Some(want) {
        return Err(format!(
            "{addr}: the server did not agree to {} (ALPN {:?})",
            String::from_utf8_lossy(want),
            c.alpn_protocol().map(String::from_utf8_lossy)
        ));
    }
    let info = ConnInfo {
        cipher_suite: c
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite())),
        resumed: c.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
    };
    Ok((tls, info))
}

impl TcpClient {
    /// Connects (the first connection; HTTP/1.1 opens more on demand).
    pub async fn connect(
        proto: Proto,
        addr: SocketAddr,
        host: &str,
        tls: Arc<rustls::ClientConfig>,
        max_h1: usize,
    ) -> Result<Self, String> {
        let mut tls = (*tls).clone();
        let alpn = match proto {
            Proto::H2 => ALPN_H2,
            Proto::H1 => ALPN_H1,
        };
        tls.alpn_protocols = vec![alpn.to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
        let (stream, info) = connect_tls(addr, host, &connector, alpn).await?;
        let mut client = TcpClient {
            proto,
            addr,
            host: host.to_string(),
            connector,
            h2: None,
            h1_idle: Mutex::new(Vec::new()),
            h1_slots: Semaphore::new(max_h1.max(1)),
            info,
        };
        match proto {
            Proto::H2 => {
                let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                    .initial_stream_window_size(4 << 20)
                    .initial_connection_window_size(16 << 20)
                    .handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("HTTP/2: {e}"))?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                client.h2 = Some(send);
            }
            Proto::H1 => {
                let send = h1_handshake(stream).await?;
                client.idle().push(send);
            }
        }
        Ok(client)
    }

    fn idle(
        &self,
    ) -> std::sync::MutexGuard<'_, Vec<hyper::client::conn::http1::SendRequest<Empty<Bytes>>>> {
        self.h1_idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn proto(&self) -> Proto {
        self.proto
    }

    /// GETs `url` into `out`; returns (status, body bytes).
    pub async fn get_to(
        &self,
        url: &Url,
        out: &mut (dyn std::io::Write + Send),
        mut progress: impl FnMut(u64),
    ) -> Result<(StatusCode, u64), String> {
        let mut req = Request::get(match self.proto {
            // HTTP/2 takes the authority from the URI (the :authority pseudo-header).
            Proto::H2 => url.to_string(),
            Proto::H1 => url.path.clone(),
        })
        .header("user-agent", concat!("kuai/", env!("CARGO_PKG_VERSION")));
        if self.proto == Proto::H1 {
            req = req.header("host", url.authority());
        }
        let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
        let (resp, h1) = match self.proto {
            Proto::H2 => {
                let mut send = self.h2.clone().ok_or("no HTTP/2 connection")?;
                send.ready().await.map_err(|e| format!("HTTP/2: {e}"))?;
                let resp = send
                    .send_request(req)
                    .await
                    .map_err(|e| format!("HTTP/2: {e}"))?;
                (resp, None)
            }
            Proto::H1 => {
                let permit = self
                    .h1_slots
                    .acquire()
                    .await
                    .map_err(|_| "client closed".to_string())?;
                let pooled = self.idle().pop();
                let mut send = match pooled {
                    Some(s) if !s.is_closed() => s,
                    _ => {
                        let (stream, _) =
                            connect_tls(self.addr, &self.host, &self.connector, ALPN_H1).await?;
                        h1_handshake(stream).await?
                    }
                };
                send.ready().await.map_err(|e| format!("HTTP/1.1: {e}"))?;
                let resp = send
                    .send_request(req)
                    .await
                    .map_err(|e| format!("HTTP/1.1: {e}"))?;
                (resp, Some((send, permit)))
            }
        };
        let status = resp.status();
        let mut body = resp.into_body();
        let mut total = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("{}: body: {e}", self.proto.name()))?;
            if let Ok(data) = frame.into_data() {
                out.write_all(&data)
                    .map_err(|e| format!("write failed: {e}"))?;
                total += data.len() as u64;
                progress(total);
            }
        }
        if let Some((send, _permit)) = h1 {
            // Back to the pool for the next request (the permit goes with the drop).
            self.idle().push(send);
        }
        Ok((status, total))
    }
}

async fn h1_handshake(
    stream: tokio_rustls::client::TlsStream<TcpStream>,
) -> Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>, String> {
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP/1.1: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}
