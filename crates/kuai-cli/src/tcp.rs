//! HTTP/2 and HTTP/1.1 over TLS 1.3 on TCP (hyper and rustls), the client side: `kuai get
//! --http2` / `--http1.1`, and the fallback when UDP is blocked. (The server side is in
//! `kuai_http::server`.)

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::url::Url;

pub use kuai_http::server::{ALPN_H1, ALPN_H2};

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
