//! `kuai server --upstream`: the gateway in front of a hyper HTTP/1.1 backend, reached over
//! HTTP/3 (`kuai get`, and quic-go's client when built: `interop/install.sh`), HTTP/2 and
//! HTTP/1.1 (curl, when installed), and Chromium over HTTP/3 (when installed);
//! `KUAI_REQUIRE_CURL=1`, `KUAI_REQUIRE_QUICGO=1` and `KUAI_REQUIRE_CHROMIUM=1` make a
//! missing one fail.

use std::convert::Infallible;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};

const KUAI: &str = env!("CARGO_BIN_EXE_kuai");
const FILE_LEN: usize = 1 << 20;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type B = UnsyncBoxBody<Bytes, BoxError>;

fn pattern(n: usize) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect()
}

fn full(b: impl Into<Bytes>) -> B {
    http_body_util::Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
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

/// A page that says how it reached the backend, and loads a script that says which protocol
/// brought the page and itself, as the browser saw them.
const PAGE: &str = r#"<!doctype html>
<html><head><meta charset="utf-8"><title>through the gateway</title></head>
<body><p id="via">reached the backend via VIA</p>
<p id="browser">the script did not run</p>
<script src="/app.js"></script></body></html>
"#;

const SCRIPT: &str = r#"const nav = performance.getEntriesByType("navigation")[0];
const me = performance.getEntriesByName(document.currentScript.src)[0];
document.getElementById("browser").textContent =
  "browser saw page " + nav.nextHopProtocol + ", script " + me.nextHopProtocol;
"#;

/// The backend's answers: `/` and `/app.js` the page, `/echo` the request body as it comes, `/headers` the request
/// line and fields, `/slow` a line, 400 ms, another line, `/file` FILE_LEN bytes.
async fn answer(req: Request<Incoming>, port: u16) -> Response<B> {
    match req.uri().path() {
        "/port" => Response::new(full(port.to_string())),
        "/echo" => Response::new(req.into_body().map_err(Into::into).boxed_unsync()),
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
        "/file" => Response::new(full(pattern(FILE_LEN))),
        "/" => {
            let via = req.headers().get("via").and_then(|v| v.to_str().ok());
            let page = PAGE.replace("VIA", via.unwrap_or("nothing"));
            let mut r = Response::new(full(page));
            r.headers_mut()
                .insert("content-type", "text/html; charset=utf-8".parse().unwrap());
            r
        }
        "/app.js" => {
            let mut r = Response::new(full(SCRIPT));
            r.headers_mut()
                .insert("content-type", "text/javascript".parse().unwrap());
            r
        }
        _ => {
            let mut r = Response::new(full("not found\n"));
            *r.status_mut() = StatusCode::NOT_FOUND;
            r
        }
    }
}

/// A hyper HTTP/1.1 backend on a free loopback port, on a thread of its own for the rest of
/// the test process.
fn backend() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = l.local_addr().unwrap().port();
            tx.send(l.local_addr().unwrap()).unwrap();
            loop {
                let Ok((tcp, _)) = l.accept().await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| async move {
                    Ok::<_, Infallible>(answer(req, port).await)
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc),
                );
            }
        });
    });
    rx.recv().unwrap()
}

struct Gateway {
    child: Child,
    port: u16,
    spki: String,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kuai server --upstream URL...` on a free port, once it listens.
fn gateway(upstreams: &[String]) -> Gateway {
    gateway_with(upstreams, &[])
}

fn gateway_with(upstreams: &[String], extra: &[&str]) -> Gateway {
    let mut cmd = Command::new(KUAI);
    cmd.args(["server", "--listen", "127.0.0.1:0"]).args(extra);
    for u in upstreams {
        cmd.args(["--upstream", u]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut port, mut spki) = (0, String::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        if let Some(addr) = line.strip_prefix("kuai server listening on udp ") {
            let addr = addr.split_whitespace().next().unwrap();
            port = addr.rsplit(':').next().unwrap().parse().unwrap();
        }
        if let Some(s) = line.strip_prefix("certificate SPKI sha256 (base64): ") {
            spki = s.trim().to_owned();
            break;
        }
    }
    assert!(port != 0, "the gateway did not start");
    std::thread::spawn(move || for _ in lines {});
    Gateway { child, port, spki }
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kuai-gw-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `cmd` to its end (60 s at most).
fn run(cmd: &mut Command) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn have_quietly(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn have(tool: &str, require: &str) -> bool {
    let found = have_quietly(tool);
    if !found && std::env::var_os(require).is_some() {
        panic!("{tool} is not installed and {require} is set");
    }
    if !found {
        eprintln!("{tool} not installed: its part of the test is skipped");
    }
    found
}

fn curl(args: &[&str]) -> std::process::Output {
    run(Command::new("curl").args(["-sS", "-k"]).args(args))
}

fn kuai_get(args: &[&str]) -> std::process::Output {
    run(Command::new(KUAI)
        .args(["get", "--insecure", "--state-file", "none", "--http3"])
        .args(args))
}

fn check_headers(text: &str, via: &str, port: u16) {
    assert!(text.starts_with("GET /headers HTTP/1.1\n"), "{text}");
    for want in [
        format!("host: localhost:{port}\n"),
        "x-forwarded-for: 127.0.0.1\n".into(),
        "x-forwarded-proto: https\n".into(),
        format!("forwarded: for=127.0.0.1;proto=https;host=\"localhost:{port}\"\n"),
        format!("via: {via} kuai\n"),
    ] {
        assert!(text.contains(&want), "no {want:?} at the backend:\n{text}");
    }
}

/// Bodies both ways byte for byte and the forwarding fields, over HTTP/3 (kuai get),
/// HTTP/2 and HTTP/1.1 (curl); a slow response streams through (curl reads its first line
/// before the backend writes the second); 502 with the backend down.
#[test]
fn the_gateway_forwards_every_protocol() {
    let b = backend();
    let gw = gateway(&[format!("http://{b}")]);
    let dir = temp_dir("bodies");
    let upload = dir.join("upload.bin");
    let body = pattern(3 * FILE_LEN / 2);
    std::fs::write(&upload, &body).unwrap();
    let url = |p: &str| format!("https://localhost:{}{p}", gw.port);
    let data = format!("@{}", upload.display());

    // HTTP/3: kuai get.
    let out = dir.join("h3.bin");
    let o = kuai_get(&[
        "--data-binary",
        &data,
        "-o",
        out.to_str().unwrap(),
        &url("/echo"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&out).unwrap() == body, "HTTP/3 echo differs");
    let o = kuai_get(&[&url("/headers")]);
    check_headers(&String::from_utf8_lossy(&o.stdout), "3", gw.port);

    if have("curl", "KUAI_REQUIRE_CURL") {
        for (flag, via) in [("--http2", "2"), ("--http1.1", "1.1")] {
            let out = dir.join("tcp.bin");
            let o = curl(&[
                flag,
                "--data-binary",
                &data,
                "-o",
                out.to_str().unwrap(),
                &url("/echo"),
            ]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert!(std::fs::read(&out).unwrap() == body, "{flag} echo differs");
            let o = curl(&[flag, &url("/headers")]);
            check_headers(&String::from_utf8_lossy(&o.stdout), via, gw.port);

            // Streaming: the first line comes before the backend has written the second.
            let start = Instant::now();
            let mut child = Command::new("curl")
                .args(["-sS", "-k", "-N", flag, &url("/slow")])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut stdout = child.stdout.take().unwrap();
            let mut first = [0u8; 6];
            stdout.read_exact(&mut first).unwrap();
            let at_first = start.elapsed();
            let mut rest = String::new();
            stdout.read_to_string(&mut rest).unwrap();
            let _ = child.wait();
            assert_eq!((&first, rest.as_str()), (b"first\n", "second\n"));
            assert!(
                at_first < Duration::from_millis(350)
                    && start.elapsed() >= Duration::from_millis(400),
                "{flag}: first line at {at_first:?}, all at {:?}",
                start.elapsed()
            );
        }
        // Nothing listening behind the gateway: 502. The port stays bound (not listening)
        // for the test's length: freed, it could be taken by another test, or by the
        // gateway's own listener, and answer.
        let dead_socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        dead_socket
            .bind(
                &"127.0.0.1:0"
                    .parse::<std::net::SocketAddr>()
                    .unwrap()
                    .into(),
            )
            .unwrap();
        let dead = dead_socket.local_addr().unwrap().as_socket().unwrap();
        let gw2 = gateway(&[format!("http://{dead}")]);
        let o = curl(&[
            "--http2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("https://localhost:{}/x", gw2.port),
        ]);
        assert_eq!(String::from_utf8_lossy(&o.stdout), "502");
        drop(dead_socket);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// quic-go's HTTP/3 client (the interop endpoint) downloads through the gateway.
#[test]
fn quic_go_downloads_through_the_gateway() {
    let endpoint =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../interop/quic-go/quic-go-endpoint");
    if !endpoint.exists() {
        assert!(
            std::env::var_os("KUAI_REQUIRE_QUICGO").is_none(),
            "{} not built (interop/install.sh) and KUAI_REQUIRE_QUICGO is set",
            endpoint.display()
        );
        eprintln!("quic-go endpoint not built: test skipped");
        return;
    }
    let b = backend();
    let gw = gateway(&[format!("http://{b}")]);
    let dir = temp_dir("quic-go");
    let o = run(Command::new(&endpoint)
        .env("ROLE", "client")
        .env("TESTCASE", "http3")
        .env("SERVER", format!("127.0.0.1:{}", gw.port))
        .env("REQUESTS", format!("https://localhost:{}/file", gw.port))
        .env("DOWNLOADS", &dir)
        .env("CERT_SPKI_SHA256", &gw.spki));
    assert!(
        o.status.success(),
        "quic-go client failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::read(dir.join("file")).unwrap() == pattern(FILE_LEN),
        "quic-go's download differs"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Chromium loads a page through the gateway over HTTP/3: the backend saw `Via: 3 kuai`, the
/// browser saw h3 for the page and its script.
#[test]
fn chromium_loads_a_page_through_the_gateway_over_http3() {
    let Some(chromium) = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| have_quietly(c))
    else {
        assert!(
            std::env::var_os("KUAI_REQUIRE_CHROMIUM").is_none(),
            "Chromium is not installed, and KUAI_REQUIRE_CHROMIUM is set"
        );
        eprintln!("Chromium is not installed: test skipped");
        return;
    };
    let b = backend();
    let gw = gateway(&[format!("http://{b}")]);
    let profile = temp_dir("chromium");
    let o = run(Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--enable-quic",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--origin-to-force-quic-on=localhost:{}", gw.port))
        .arg("--host-resolver-rules=MAP localhost 127.0.0.1")
        .arg(format!("--ignore-certificate-errors-spki-list={}", gw.spki))
        .arg("--dump-dom")
        .arg(format!("https://localhost:{}/", gw.port)));
    let _ = std::fs::remove_dir_all(&profile);
    let dom = String::from_utf8_lossy(&o.stdout);
    assert!(dom.contains("reached the backend via 3 kuai"), "{dom}");
    assert!(dom.contains("browser saw page h3, script h3"), "{dom}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `curl -s URL`'s body.
fn fetch_text(url: &str) -> String {
    String::from_utf8_lossy(&run(Command::new("curl").args(["-s", "--max-time", "5", url])).stdout)
        .into_owned()
}

/// `kuai server --metrics`: `/metrics` passes `promtool check metrics` and shows the
/// handshakes, 0-RTT and requests the test made; a real Prometheus scrapes it.
#[test]
fn metrics_pass_promtool_and_prometheus_scrapes_them() {
    let need = |tool: &str| {
        let found = have_quietly(tool);
        assert!(
            found || std::env::var_os("KUAI_REQUIRE_PROMETHEUS").is_none(),
            "{tool} is not installed and KUAI_REQUIRE_PROMETHEUS is set"
        );
        found
    };
    if !need("curl") || !need("promtool") || !need("prometheus") {
        eprintln!("curl, promtool or prometheus missing: test skipped");
        return;
    }
    let b = backend();
    let mport = free_port();
    let maddr = format!("127.0.0.1:{mport}");
    let gw = gateway_with(&[format!("http://{b}")], &["--metrics", &maddr]);
    let url = format!("https://localhost:{}/file", gw.port);
    // Three HTTP/3 connections from one process: the second and third resume in 0-RTT.
    let o = run(Command::new(KUAI).args([
        "get",
        "--insecure",
        "--state-file",
        "none",
        "--repeat",
        "3",
        "-o",
        "/dev/null",
        &url,
    ]));
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let o = curl(&["--http2", "-o", "/dev/null", &url]);
    assert!(o.status.success());
    let metrics_url = format!("http://{maddr}/metrics");
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let t = fetch_text(&metrics_url);
        if t.contains("kuai_http_requests_total{protocol=\"h3\",status=\"200\"} 3\n")
            && t.contains("kuai_quic_handshakes_total{result=\"ok\"} 3\n")
        {
            break t;
        }
        assert!(Instant::now() < deadline, "{t}");
        std::thread::sleep(Duration::from_millis(50));
    };
    for want in [
        "kuai_quic_zero_rtt_accepted_total 2\n",
        "kuai_http_requests_total{protocol=\"h2\",status=\"200\"} 1\n",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut promtool.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Prometheus scrapes it every second; its query API gives back what the test caused.
    let dir = temp_dir("prometheus");
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kuai\n    static_configs:\n      - targets: ['{maddr}']\n"
        ),
    )
    .unwrap();
    let pport = free_port();
    let mut prom = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let query = |q: &str| fetch_text(&format!("http://127.0.0.1:{pport}/api/v1/query?query={q}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let answer = loop {
        let a = query("sum(kuai_http_requests_total)");
        if a.contains("\"value\":[") && a.contains("\"4\"]") {
            break a;
        }
        if Instant::now() > deadline {
            let _ = prom.kill();
            panic!("Prometheus did not scrape the count: {a}");
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let zero_rtt = query("kuai_quic_zero_rtt_accepted_total");
    let _ = prom.kill();
    let _ = prom.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(answer.contains("\"status\":\"success\""), "{answer}");
    assert!(zero_rtt.contains("\"2\"]"), "{zero_rtt}");
}

/// A certificate for `name` (and `*.name`) in PEM files under `dir`: (cert, key).
fn cert_files(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let ck =
        rcgen::generate_simple_self_signed(vec![name.to_string(), format!("*.{name}")]).unwrap();
    let (c, k) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&c, ck.cert.pem()).unwrap();
    std::fs::write(&k, ck.key_pair.serialize_pem()).unwrap();
    (c, k)
}

/// `kuai server --config`: two hosts with certificates of their own (each client trusts only
/// its host's, so the right one must come by SNI), path-prefix routes to two backends and a
/// directory (prefix stripped), limits from the file; over HTTP/3 (kuai get) and HTTP/2
/// (curl).
#[test]
fn a_config_file_routes_hosts_and_prefixes() {
    let (a, b) = (backend(), backend());
    let dir = temp_dir("config");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("hello.txt"), "static hello\n").unwrap();
    let (ac, ak) = cert_files(&dir, "a.test");
    let (bc, bk) = cert_files(&dir, "b.test");
    let port = free_port();
    let file = dir.join("kuai.toml");
    std::fs::write(
        &file,
        format!(
            r#"listen = "127.0.0.1:{port}"
[limits]
max_body = 100

[[host]]
names = ["a.test"]
default = true
cert = "{ac}"
key = "{ak}"
[[host.route]]
prefix = "/"
upstreams = ["http://{a}"]
[[host.route]]
prefix = "/static/"
root = "{www}"
strip_prefix = true

[[host]]
names = ["b.test", "*.b.test"]
cert = "{bc}"
key = "{bk}"
[[host.route]]
prefix = "/"
upstreams = ["http://{b}"]
"#,
            ac = ac.display(),
            ak = ak.display(),
            bc = bc.display(),
            bk = bk.display(),
            www = www.display(),
        ),
    )
    .unwrap();
    let mut child = Command::new(KUAI)
        .args(["server", "--config"])
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        if line.starts_with("kuai server listening on tcp") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let gw = Gateway {
        child,
        port,
        spki: String::new(),
    };
    let get = |host: &str, ca: &Path, path: &str| {
        let o = run(Command::new(KUAI).args([
            "get",
            "--state-file",
            "none",
            "--http3",
            "--ca",
            ca.to_str().unwrap(),
            "--resolve",
            &format!("{host}:{}:127.0.0.1", gw.port),
            &format!("https://{host}:{}{path}", gw.port),
        ]));
        assert!(
            o.status.success(),
            "{host}{path}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(get("a.test", &ac, "/port"), a.port().to_string());
    assert_eq!(get("b.test", &bc, "/port"), b.port().to_string());
    assert_eq!(get("www.b.test", &bc, "/port"), b.port().to_string());
    assert_eq!(get("a.test", &ac, "/static/hello.txt"), "static hello\n");
    assert!(get("a.test", &ac, "/headers").contains(&format!("host: a.test:{}\n", gw.port)));
    if have("curl", "KUAI_REQUIRE_CURL") {
        let curl_to = |host: &str, ca: &Path, path: &str, extra: &[&str]| {
            run(Command::new("curl")
                .args([
                    "-sS",
                    "--http2",
                    "--cacert",
                    ca.to_str().unwrap(),
                    "--resolve",
                ])
                .arg(format!("{host}:{}:127.0.0.1", gw.port))
                .args(extra)
                .arg(format!("https://{host}:{}{path}", gw.port)))
        };
        let o = curl_to("b.test", &bc, "/port", &[]);
        assert_eq!(String::from_utf8_lossy(&o.stdout), b.port().to_string());
        // a.test's certificate does not do for b.test: SNI picked b's.
        assert!(!curl_to("b.test", &ac, "/port", &[]).status.success());
        // An unknown name gets the default host's certificate and site.
        let o = curl_to("c.test", &ac, "/port", &["-k"]);
        assert_eq!(String::from_utf8_lossy(&o.stdout), a.port().to_string());
        // The file's body limit.
        let o = curl_to(
            "a.test",
            &ac,
            "/echo",
            &[
                "--data-binary",
                &"x".repeat(500),
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ],
        );
        assert_eq!(String::from_utf8_lossy(&o.stdout), "413");
    }
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}
