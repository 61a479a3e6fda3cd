//! HTTP/3 serving and fetching for the command line.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Response, StatusCode};
use kuai::Connection;
use kuai_h3::{Config, RequestStream, Server};
use tokio::io::AsyncReadExt;

use crate::demo;
use crate::hq::{self, Body, Site};

pub use kuai_h3::ALPN;

/// Serves every request of a connection.
pub async fn serve_connection(conn: Connection, site: Arc<Site>, alt_svc: Option<String>) {
    serve_connection_with(conn, site, alt_svc, Config::default()).await
}

/// Serves every request of a connection, with HTTP/3 settings of its own.
pub async fn serve_connection_with(
    conn: Connection,
    site: Arc<Site>,
    alt_svc: Option<String>,
    config: Config,
) {
    let remote = conn.remote_address();
    let mut server = match Server::new(conn, config).await {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(%remote, error = %e, "HTTP/3 setup failed");
            return;
        }
    };
    while let Some((req, stream)) = server.accept().await {
        let site = site.clone();
        let alt_svc = alt_svc.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let method = req.method().clone();
            let path = req.uri().path().to_owned();
            match respond(stream, &req, &site, alt_svc.as_deref()).await {
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
) -> Result<(StatusCode, u64), kuai_h3::Error> {
    let head_only = req.method() == http::Method::HEAD;
    if req.method() != http::Method::GET && !head_only {
        let resp = Response::builder()
            .status(StatusCode::METHOD_NOT_ALLOWED)
            .header("allow", "GET, HEAD")
            .body(())
            .expect("static response");
        stream.send_response(resp).await?;
        stream.finish()?;
        return Ok((StatusCode::METHOD_NOT_ALLOWED, 0));
    }
    let path = req.uri().path();
    let mut builder = Response::builder().header("server", "kuai");
    if let Some(a) = alt_svc {
        builder = builder.header("alt-svc", a);
    }
    let Some(body) = hq::resolve(site, path).await else {
        let msg = Bytes::from_static(b"404 not found\n");
        let resp = builder
            .status(StatusCode::NOT_FOUND)
            .header("content-type", "text/plain")
            .header("content-length", msg.len())
            .body(())
            .expect("valid");
        stream.send_response(resp).await?;
        stream.send_data(msg).await?;
        stream.finish()?;
        return Ok((StatusCode::NOT_FOUND, 14));
    };
    let (len, ctype) = match &body {
        Body::File(_, n) => (*n, content_type(path)),
        Body::Bytes(b) => (b.len() as u64, content_type(path)),
        Body::Pattern(n) => (*n, "application/octet-stream"),
    };
    let resp = builder
        .header("content-type", ctype)
        .header("content-length", len)
        .body(())
        .expect("valid");
    stream.send_response(resp).await?;
    if !head_only {
        match body {
            Body::File(mut f, _) => {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = f
                        .read(&mut buf)
                        .await
                        .map_err(|_| kuai_h3::Error::Malformed("file read failed"))?;
                    if n == 0 {
                        break;
                    }
                    stream.send_data(Bytes::copy_from_slice(&buf[..n])).await?;
                }
            }
            Body::Bytes(b) => stream.send_data(b).await?,
            Body::Pattern(n) => {
                let block = demo::pattern_block();
                let mut left = n;
                while left > 0 {
                    let k = left.min(block.len() as u64) as usize;
                    stream.send_data(block.slice(..k)).await?;
                    left -= k as u64;
                }
            }
        }
    }
    stream.finish()?;
    let _ = stream.finished().await;
    Ok((StatusCode::OK, if head_only { 0 } else { len }))
}

pub(crate) fn content_type(path: &str) -> &'static str {
    let ext = path.rsplit('.').next().unwrap_or("");
    match ext {
        "html" | "htm" => "text/html; charset=utf-8",
        "" if path.ends_with('/') => "text/html; charset=utf-8",
        "txt" => "text/plain; charset=utf-8",
        "css" => "text/css",
        "js" => "text/javascript",
        "json" => "application/json",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "webp" => "image/webp",
        _ if path == "/" => "text/html; charset=utf-8",
        _ => "application/octet-stream",
    }
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
