//! `kuai get`'s curl flags against an in-process kuai-http server running an axum app:
//! -H, -X, -d, --data-binary @file (streamed), -I, -L across protocols, -w, --resolve.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Redirect};
use axum::routing::any;
use kuai_http::{ConnInfo, Listener, Server};

const KUAI: &str = env!("CARGO_BIN_EXE_kuai");

/// Echoes the method, the protocol, the `x-test` header and the body.
async fn echo(
    method: Method,
    headers: HeaderMap,
    Extension(info): Extension<ConnInfo>,
    body: Body,
) -> impl IntoResponse {
    let body = axum::body::to_bytes(body, 16 << 20)
        .await
        .unwrap_or_default();
    let x = headers
        .get_all("x-test")
        .iter()
        .map(|v| v.to_str().unwrap_or("?"))
        .collect::<Vec<_>>()
        .join(",");
    format!(
        "{method} {} x-test={x} len={} sum={}\n",
        info.protocol.alpn(),
        body.len(),
        body.iter().map(|&b| u64::from(b)).sum::<u64>()
    )
}

fn app() -> Router {
    Router::new()
        .route("/echo", any(echo))
        .route("/moved", any(|| async { Redirect::temporary("/echo") }))
        .route("/see-other", any(|| async { Redirect::to("/echo") }))
        .route("/loop", any(|| async { Redirect::temporary("/loop") }))
        .route("/broken", any(|| async { Body::new(Broken::default()) }))
}

/// 300 KB, then (a moment later, so that they have arrived) the body fails: the response
/// breaks off.
#[derive(Default)]
struct Broken {
    sent: usize,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for Broken {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        use std::future::Future;
        if self.sent < 3 {
            self.sent += 1;
            let chunk = bytes::Bytes::from(vec![7u8; 100_000]);
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk))));
        }
        let pause = self
            .pause
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(Duration::from_millis(300))));
        std::task::ready!(pause.as_mut().poll(cx));
        std::task::Poll::Ready(Some(Err(std::io::Error::other("broken on purpose"))))
    }
}

struct Running {
    addr: SocketAddr,
    _rt: tokio::runtime::Runtime,
}

fn start() -> Running {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = rt.block_on(async {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
        let tls = kuai_http::server_tls(vec![ck.cert.der().clone()], key).unwrap();
        let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(Server::new(app()).serve(listener));
        addr
    });
    Running { addr, _rt: rt }
}

fn get(r: &Running, args: &[&str]) -> (bool, String, String) {
    let resolve = format!("localhost:{}:127.0.0.1", r.addr.port());
    let t = Instant::now();
    let out = Command::new(KUAI)
        .args(["get", "-k", "--state-file", "none", "--resolve", &resolve])
        .args(args)
        .output()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(30));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn curl_flags_work_on_every_protocol() {
    let r = start();
    let url = |p: &str| format!("https://localhost:{}{p}", r.addr.port());
    let upload = std::env::temp_dir().join(format!("kuai-get-upload-{}", std::process::id()));
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 256) as u8).collect();
    std::fs::write(&upload, &data).unwrap();
    let sum: u64 = data.iter().map(|&b| u64::from(b)).sum();
    for (flag, alpn) in [
        ("--http3", "h3"),
        ("--http2", "h2"),
        ("--http1.1", "http/1.1"),
    ] {
        // -H and -X.
        let (ok, out, err) = get(&r, &[flag, "-X", "PUT", "-H", "X-Test: yes", &url("/echo")]);
        assert!(ok, "{flag}: {err}");
        assert_eq!(
            out,
            format!("PUT {alpn} x-test=yes len=0 sum=0\n"),
            "{flag}"
        );
        // -d: a POST with the data.
        let (ok, out, err) = get(&r, &[flag, "-d", "a=1&b=2", &url("/echo")]);
        assert!(ok, "{flag}: {err}");
        let sum7: u64 = b"a=1&b=2".iter().map(|&b| u64::from(b)).sum();
        assert_eq!(
            out,
            format!("POST {alpn} x-test= len=7 sum={sum7}\n"),
            "{flag}"
        );
        // --data-binary @file: 3 MB streamed up.
        let at = format!("@{}", upload.display());
        let (ok, out, err) = get(&r, &[flag, "--data-binary", &at, &url("/echo")]);
        assert!(ok, "{flag}: {err}");
        assert_eq!(
            out,
            format!("POST {alpn} x-test= len=3000000 sum={sum}\n"),
            "{flag}"
        );
        // -I: the head only.
        let (ok, out, err) = get(&r, &[flag, "-I", &url("/echo")]);
        assert!(ok, "{flag}: {err}");
        let version = match alpn {
            "h3" => "HTTP/3 200",
            "h2" => "HTTP/2 200",
            _ => "HTTP/1.1 200",
        };
        assert!(out.starts_with(version), "{flag}: {out}");
        assert!(!out.contains("HEAD h"), "{flag}: a body after -I: {out}");
        // -L: 307 keeps the method and body; 303 goes on as GET.
        let (ok, out, err) = get(&r, &[flag, "-L", "-d", "x", &url("/moved")]);
        assert!(ok, "{flag}: {err}");
        assert_eq!(
            out,
            format!("POST {alpn} x-test= len=1 sum=120\n"),
            "{flag}"
        );
        let (ok, out, err) = get(&r, &[flag, "-L", &url("/moved")]);
        assert!(ok, "{flag}: {err}");
        assert_eq!(out, format!("GET {alpn} x-test= len=0 sum=0\n"), "{flag}");
        let (ok, out, err) = get(&r, &[flag, "-L", "-d", "x", &url("/see-other")]);
        assert!(ok, "{flag}: {err}");
        assert_eq!(out, format!("GET {alpn} x-test= len=0 sum=0\n"), "{flag}");
        // Without -L the redirect itself.
        let (_, out, _) = get(&r, &[flag, "-w", "%{http_code}", &url("/moved")]);
        assert_eq!(out, "307", "{flag}");
        // -w with the timing fields.
        let (ok, out, err) = get(
            &r,
            &[
                flag,
                "-w",
                "\\n%{http_code} %{http_version} %{size_download} %{num_redirects} %{time_total}",
                "-L",
                &url("/moved"),
            ],
        );
        assert!(ok, "{flag}: {err}");
        let last = out.lines().last().unwrap();
        let f: Vec<&str> = last.split(' ').collect();
        let v = match alpn {
            "h3" => "3",
            "h2" => "2",
            _ => "1.1",
        };
        let size = format!("GET {alpn} x-test= len=0 sum=0\n")
            .len()
            .to_string();
        assert_eq!(
            &f[..4],
            &["200", v, size.as_str(), "1"][..],
            "{flag}: {out}"
        );
        let total: f64 = f[4].parse().unwrap();
        assert!(total > 0.0 && total < 10.0, "{flag}: {out}");
        // -L into a loop fails (it exited 0 with the last redirect as the answer).
        let (ok, _, err) = get(&r, &[flag, "-L", &url("/loop")]);
        assert!(!ok, "{flag}: a redirect loop succeeded");
        assert!(err.contains("too many redirects"), "{flag}: {err}");
        // A response that breaks off fails, and what arrived of it is in the file.
        let partial = std::env::temp_dir().join(format!("kuai-get-partial-{}", std::process::id()));
        let out_path = partial.to_str().unwrap();
        let (ok, _, err) = get(&r, &[flag, "-o", out_path, &url("/broken")]);
        assert!(!ok, "{flag}: a broken response succeeded");
        let kept = std::fs::read(&partial).unwrap();
        assert_eq!(kept.len(), 300_000, "{flag}: {err}");
        assert!(kept.iter().all(|&b| b == 7));
        std::fs::remove_file(&partial).unwrap();
    }
    std::fs::remove_file(&upload).unwrap();
}

/// What curl does and `kuai get` did not: `--data-binary @-` reads standard input (a pipe's
/// size is 0: it sent an empty body), two -H lines of one name both go, two URLs saved as
/// one file are refused (they wrote over each other at once), an error answer leaves an
/// existing -o file alone and fails every --repeat run, -I -o saves the head, and a
/// --max-time no duration can hold is an error, not a panic.
#[test]
fn curl_flags_at_their_edges() {
    use std::io::Write;
    let r = start();
    let url = |p: &str| format!("https://localhost:{}{p}", r.addr.port());
    let resolve = format!("localhost:{}:127.0.0.1", r.addr.port());
    let mut child = Command::new(KUAI)
        .args(["get", "-k", "--state-file", "none", "--resolve", &resolve])
        .args(["--data-binary", "@-", &url("/echo")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"abc").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let sum: u64 = b"abc".iter().map(|&b| u64::from(b)).sum();
    assert!(
        String::from_utf8_lossy(&out.stdout).ends_with(&format!("len=3 sum={sum}\n")),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let (ok, out, err) = get(&r, &["-H", "X-Test: 1", "-H", "X-Test: 2", &url("/echo")]);
    assert!(ok, "{err}");
    assert!(out.contains("x-test=1,2"), "{out}");
    let dir = std::env::temp_dir().join(format!("kuai-get-edges-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let (ok, _, err) = get(&r, &["--output-dir", d, &url("/a/echo"), &url("/b/echo")]);
    assert!(!ok && err.contains("would both be saved"), "{err}");
    let kept = dir.join("kept");
    std::fs::write(&kept, b"old").unwrap();
    let (ok, _, _) = get(&r, &["-o", kept.to_str().unwrap(), &url("/missing")]);
    assert!(!ok);
    assert_eq!(std::fs::read(&kept).unwrap(), b"old");
    let (ok, out, _) = get(&r, &["--repeat", "2", &url("/missing")]);
    assert!(!ok);
    assert_eq!(out.matches("\"ok\":false").count(), 2, "{out}");
    let head = dir.join("head");
    let (ok, _, err) = get(&r, &["-I", "-o", head.to_str().unwrap(), &url("/echo")]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&head).unwrap();
    assert!(text.starts_with("HTTP/"), "{text}");
    let (ok, _, err) = get(&r, &["--max-time", "inf", &url("/echo")]);
    assert!(!ok && err.contains("--max-time"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
