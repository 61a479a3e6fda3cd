//! HTTP/0.9 over QUIC (ALPN `hq-interop`): one request per bidirectional stream,
//! `GET /path\r\n`, answered with the body and FIN. Used by the interop runner.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kuai::{Connection, RecvStream, SendStream};
use tokio::io::AsyncReadExt;

use crate::demo;

pub const ALPN: &[u8] = b"hq-interop";

/// Where responses come from.
#[derive(Clone)]
pub enum Site {
    /// Files under a directory.
    Dir(PathBuf),
    /// The built-in demo site.
    Demo,
}

/// Serves every request of a connection.
pub async fn serve_connection(conn: Connection, site: Arc<Site>) {
    let remote = conn.remote_address();
    while let Ok((send, recv)) = conn.accept_bi().await {
        let site = site.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_request(send, recv, &site, remote).await {
                tracing::debug!(%remote, error = %e, "request failed");
            }
        });
    }
}

async fn serve_request(
    mut send: SendStream,
    mut recv: RecvStream,
    site: &Site,
    remote: std::net::SocketAddr,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let start = Instant::now();
    let req = recv.read_to_end(8 * 1024).await?;
    let line = String::from_utf8_lossy(&req);
    let path = request_path(&line);
    let (status, bytes) = match resolve(site, path).await {
        Some(Body::File(mut f, len)) => {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = f.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                send.write_chunk(Bytes::copy_from_slice(&buf[..n])).await?;
            }
            (200, len)
        }
        Some(Body::Bytes(b)) => {
            let len = b.len() as u64;
            send.write_chunk(b).await?;
            (200, len)
        }
        Some(Body::Pattern(n)) => {
            let block = demo::pattern_block();
            let mut left = n;
            while left > 0 {
                let len = left.min(block.len() as u64) as usize;
                send.write_chunk(block.slice(..len)).await?;
                left -= len as u64;
            }
            (200, n)
        }
        None => {
            // HTTP/0.9 has no status line: an empty body reset with an error code says 404.
            send.reset(0x10c)?;
            tracing::info!(%remote, path, status = 404, "hq request");
            return Ok(());
        }
    };
    send.finish()?;
    tracing::info!(%remote, path, status, bytes, ms = start.elapsed().as_millis() as u64, "hq request");
    let _ = send.stopped().await;
    Ok(())
}

/// The path of an HTTP/0.9 request, `GET /path\r\n`; empty when it is not a GET.
pub(crate) fn request_path(request: &str) -> &str {
    request
        .trim()
        .strip_prefix("GET ")
        .map(str::trim)
        .unwrap_or("")
}

pub enum Body {
    File(tokio::fs::File, u64),
    Bytes(Bytes),
    Pattern(u64),
}

/// Maps a request path to a body; `None` for a missing or forbidden path.
pub async fn resolve(site: &Site, path: &str) -> Option<Body> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    match site {
        Site::Demo => demo::lookup(path),
        Site::Dir(root) => {
            let rel = safe_relative(path)?;
            let mut full = root.join(rel);
            if full.is_dir() {
                full = full.join("index.html");
            }
            let f = tokio::fs::File::open(&full).await.ok()?;
            let len = f.metadata().await.ok()?.len();
            Some(Body::File(f, len))
        }
    }
}

/// The path below the root, refusing anything that would leave it.
pub(crate) fn safe_relative(path: &str) -> Option<PathBuf> {
    let p = Path::new(path.trim_start_matches('/'));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(x) => out.push(x),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

/// Streams `path` into `out` (for large downloads), calling `progress` with the total so far.
pub async fn get_to(
    conn: &Connection,
    path: &str,
    out: &mut (dyn std::io::Write + Send),
    mut progress: impl FnMut(u64),
) -> Result<u64, String> {
    let request = || async {
        let (mut send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(format!("GET {path}\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        Ok::<_, String>(recv)
    };
    let mut recv = request().await?;
    let mut total = 0u64;
    let mut resent = false;
    loop {
        match recv.read_chunk(usize::MAX).await {
            // Sent in 0-RTT and rejected: the server never saw it; send it again in 1-RTT.
            Err(kuai::ReadError::ZeroRttRejected) if !resent && total == 0 => {
                resent = true;
                recv = request().await?;
            }
            Ok(Some(chunk)) => {
                out.write_all(&chunk)
                    .map_err(|e| format!("write failed: {e}"))?;
                total += chunk.len() as u64;
                progress(total);
            }
            Ok(None) => return Ok(total),
            Err(kuai::ReadError::Reset(0x10c)) => return Err("not found".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_below_the_root() {
        assert_eq!(safe_relative("/a/b.txt"), Some(PathBuf::from("a/b.txt")));
        assert_eq!(safe_relative("/./x"), Some(PathBuf::from("x")));
        assert_eq!(safe_relative("/../etc/passwd"), None);
        assert_eq!(safe_relative("/a/../../x"), None);
        assert_eq!(safe_relative("/"), Some(PathBuf::new()));
    }
}
