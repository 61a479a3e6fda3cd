//! HTTP/0.9 over QUIC (ALPN `hq-interop`): one request per bidirectional stream,
//! `GET /path\r\n`, answered with the body and FIN. Used by the interop runner.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kuai::{Connection, RecvStream, SendStream};
use kuai_http::fs::{FileChunks, StaticDir};

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
            while let Some(chunk) = f.next().await {
                send.write_chunk(chunk?).await?;
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
    File(FileChunks, u64),
    Bytes(Bytes),
    Pattern(u64),
}

/// Maps a request path to a body; `None` for a missing or forbidden path (see
/// [`kuai_http::fs::StaticDir`] for what a directory site serves).
pub async fn resolve(site: &Site, path: &str) -> Option<Body> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    match site {
        Site::Demo => demo::lookup(path),
        Site::Dir(root) => {
            let file = StaticDir::new(root.clone()).open(path).await?;
            let len = file.len();
            Some(Body::File(file, len))
        }
    }
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
    use std::path::Path;

    /// A directory tree with every kind of thing a request must not reach, and a file
    /// outside it.
    struct Tree {
        base: PathBuf,
        root: PathBuf,
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }

    fn tree(name: &str) -> Tree {
        use std::os::unix::fs::symlink;
        let base = std::env::temp_dir().join(format!("kuai-hq-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("www");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::create_dir_all(root.join("dir-link-target")).unwrap();
        std::fs::write(base.join("outside.txt"), "secret outside the root").unwrap();
        std::fs::write(root.join("a.txt"), "aaa").unwrap();
        std::fs::write(root.join("with space.txt"), "spaced").unwrap();
        std::fs::write(root.join("sub/index.html"), "<p>sub</p>").unwrap();
        std::fs::write(root.join(".env"), "PASSWORD=hunter2").unwrap();
        std::fs::write(root.join(".git/config"), "[core]").unwrap();
        std::fs::write(root.join("dir-link-target/b.txt"), "bbb").unwrap();
        symlink(base.join("outside.txt"), root.join("out-link")).unwrap();
        symlink("../outside.txt", root.join("out-rel-link")).unwrap();
        symlink(&base, root.join("out-dir-link")).unwrap();
        symlink("a.txt", root.join("in-link")).unwrap();
        symlink("dir-link-target", root.join("in-dir-link")).unwrap();
        symlink(".env", root.join("dot-link")).unwrap();
        symlink("/dev/zero", root.join("dev-link")).unwrap();
        let fifo = root.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        std::os::unix::net::UnixListener::bind(root.join("socket")).unwrap();
        Tree { base, root }
    }

    async fn get(root: &Path, path: &str) -> Option<Vec<u8>> {
        let site = Site::Dir(root.to_path_buf());
        // Never blocks: a FIFO is not opened for reading in a blocking way.
        let Ok(body) =
            tokio::time::timeout(std::time::Duration::from_secs(3), resolve(&site, path)).await
        else {
            return Some(b"<blocked for 3 s>".to_vec());
        };
        match body? {
            Body::File(mut f, _) => {
                // At most 64 KiB, within a second: a device such as /dev/zero never ends.
                let mut v = Vec::new();
                let read = async {
                    while let Some(Ok(chunk)) = f.next().await {
                        v.extend_from_slice(&chunk);
                        if v.len() >= 64 * 1024 {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), read).await;
                v.truncate(64 * 1024);
                Some(v)
            }
            _ => panic!("a directory site serves files"),
        }
    }

    /// `kuai server --root`: regular files below the root are served; dotfiles, symlinks that
    /// leave the root, FIFOs, sockets and devices are 404, and no spelling of a path (`..`,
    /// `%2e%2e`, `%2f`, backslashes, NUL) leaves the root.
    #[tokio::test]
    async fn the_file_server_serves_regular_files_below_the_root_only() {
        let t = tree("serve");
        let root = &t.root;
        let mut wrong = Vec::new();
        // What is served.
        for (path, want) in [
            ("/a.txt", &b"aaa"[..]),
            ("/sub/", b"<p>sub</p>"),
            ("/sub", b"<p>sub</p>"),
            ("/./a.txt?x=1", b"aaa"),
            ("/%61.txt", b"aaa"),
            ("/with%20space.txt", b"spaced"),
            ("/in-link", b"aaa"),
            ("/in-dir-link/b.txt", b"bbb"),
        ] {
            if get(root, path).await.as_deref() != Some(want) {
                wrong.push(format!("{path} not served"));
            }
        }
        // What is not.
        for path in [
            "/.env",
            "/.git/config",
            "/sub/../.env",
            "/%2eenv",
            "/%2Eenv",
            "/dot-link",
            "/out-link",
            "/out-rel-link",
            "/out-dir-link/outside.txt",
            "/dev-link",
            "/fifo",
            "/socket",
            "/../outside.txt",
            "/%2e%2e/outside.txt",
            "/%2E%2E/outside.txt",
            "/sub/..%2f..%2foutside.txt",
            "/..%2Foutside.txt",
            "/..\\outside.txt",
            "/sub\\..\\..\\outside.txt",
            "/%5c..%5coutside.txt",
            "/a.txt%00",
            "/a.txt%00.html",
            "/%00",
            "/%",
            "/%zz",
            "/%c0%ae%c0%ae/outside.txt",
            "/nonexistent",
            "/a.txt/",
        ] {
            if let Some(body) = get(root, path).await {
                wrong.push(format!(
                    "{path} served {:?}",
                    String::from_utf8_lossy(&body[..body.len().min(24)])
                ));
            }
        }
        // A device node inside the root (made only where this process may).
        let dev = root.join("null-device");
        let c = std::ffi::CString::new(dev.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mknod only creates a node.
        let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        if made != 0 {
            eprintln!("mknod not permitted here: the device case was not run");
        } else if get(root, "/null-device").await.is_some() {
            wrong.push("/null-device served".into());
        }
        // Whatever happened, unblock a reader left waiting on the FIFO (the runtime waits for
        // it when the test ends).
        let fifo = root.join("fifo");
        std::thread::spawn(move || drop(std::fs::OpenOptions::new().write(true).open(fifo)));
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}
