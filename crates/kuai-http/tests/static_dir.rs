//! `StaticDir` on a real directory tree: what a file server may and may not reach.

use std::path::{Path, PathBuf};

use kuai_http::fs::{Found, StaticDir};

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
    let base = std::env::temp_dir().join(format!("kuai-static-{name}-{}", std::process::id()));
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
    let dir = StaticDir::new(root.to_path_buf());
    let path = path.split(['?', '#']).next().unwrap_or("");
    // Never blocks: a FIFO is not opened for reading in a blocking way.
    let Ok(file) = tokio::time::timeout(std::time::Duration::from_secs(3), dir.open(path)).await
    else {
        return Some(b"<blocked for 3 s>".to_vec());
    };
    {
        let mut f = file?;
        {
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
    // A directory named without its `/` (a link to one in the root too) is not its index:
    // the server redirects to the name with the `/`.
    let dir = StaticDir::new(root.to_path_buf());
    for path in ["/sub", "/in-dir-link"] {
        if !matches!(dir.find(path).await, Some(Found::Directory)) {
            wrong.push(format!("{path} not found as a directory"));
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
