//! An axum app (examples/axum_app.rs) served by kuai-http, reached by real clients: curl
//! (HTTP/2 and HTTP/1.1 over TCP), kuai's HTTP/3 client, and Chromium over HTTP/3.
//!
//! curl must be installed. Chromium is used when installed; with `KUAI_REQUIRE_CHROMIUM=1`
//! (as CI sets it) its absence fails the test.

#[allow(dead_code)]
#[path = "../examples/axum_app.rs"]
mod app;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use kuai_http::{Listener, Server};
use tokio::process::Command;

struct Running {
    addr: SocketAddr,
    spki: String,
    cert: rustls::pki_types::CertificateDer<'static>,
}

async fn start() -> Running {
    let (tls, spki, cert) = app::self_signed();
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), tls)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Server::new(app::app()).serve(listener));
    Running { addr, spki, cert }
}

/// Runs `cmd` for at most `limit`; its standard output, or why it failed.
async fn run(cmd: &mut Command, limit: Duration) -> Result<Vec<u8>, String> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .map_err(|_| format!("{cmd:?} still running after {limit:?}"))?
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out.stdout)
}

async fn curl(proto: &str, r: &Running, path: &str, upload: Option<&std::path::Path>) -> Vec<u8> {
    let url = format!("https://localhost:{}{path}", r.addr.port());
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--fail", "-k", proto, "--max-time", "20"])
        .arg("--resolve")
        .arg(format!("localhost:{}:127.0.0.1", r.addr.port()));
    if let Some(f) = upload {
        cmd.arg("--data-binary").arg(format!("@{}", f.display()));
    }
    cmd.arg(&url);
    run(&mut cmd, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("curl {proto} {path}: {e}"))
}

/// The same bytes over HTTP/2 and HTTP/1.1 (curl) and HTTP/3 (kuai's client), the page saying
/// which protocol served it, and a 2 MB upload streamed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_and_http3_get_the_same_bytes() {
    let r = start().await;
    let upload = std::env::temp_dir().join(format!("kuai-axum-up-{}", std::process::id()));
    let up: Vec<u8> = (0..2_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&upload, &up).unwrap();
    for (flag, alpn) in [("--http2", "h2"), ("--http1.1", "http/1.1")] {
        let page = curl(flag, &r, "/", None).await;
        assert_eq!(
            String::from_utf8(page).unwrap(),
            app::PAGE.replace("PROTO", alpn)
        );
        assert_eq!(
            curl(flag, &r, "/app.js", None).await,
            app::SCRIPT.as_bytes()
        );
        assert_eq!(
            curl(flag, &r, "/data/1000000", None).await,
            app::data(1_000_000)
        );
        assert!(
            curl(flag, &r, "/echo", Some(&upload)).await == up,
            "{flag} echo"
        );
    }
    std::fs::remove_file(&upload).unwrap();
    let cep = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let ccfg = kuai::ClientConfig::with_root(r.cert.clone(), &[kuai_h3::ALPN]).unwrap();
    let conn = cep
        .connect_with(ccfg, r.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let client = kuai_h3::Client::new(conn, kuai_h3::Config::default())
        .await
        .unwrap();
    let get = |path: &'static str| {
        let client = client.clone();
        async move {
            let resp = client
                .get(&format!("https://localhost{path}"), 4 << 20)
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{path}");
            resp.into_body()
        }
    };
    assert_eq!(
        &get("/").await[..],
        app::PAGE.replace("PROTO", "h3").as_bytes()
    );
    assert_eq!(&get("/app.js").await[..], app::SCRIPT.as_bytes());
    assert_eq!(&get("/data/1000000").await[..], &app::data(1_000_000)[..]);
}

/// Chromium loads the app over HTTP/3: the server saw h3, and so did the browser for the page
/// and its script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_loads_the_app_over_http3() {
    let Some(chromium) = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
    else {
        assert!(
            std::env::var_os("KUAI_REQUIRE_CHROMIUM").is_none(),
            "Chromium is not installed, and KUAI_REQUIRE_CHROMIUM is set"
        );
        eprintln!("Chromium is not installed: the browser half of the test was not run");
        return;
    };
    let r = start().await;
    let port = r.addr.port();
    let profile = std::env::temp_dir().join(format!("kuai-axum-chromium-{}", std::process::id()));
    let mut cmd = Command::new(chromium);
    cmd.args([
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--enable-quic",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .arg(format!("--origin-to-force-quic-on=localhost:{port}"))
    .arg("--host-resolver-rules=MAP localhost 127.0.0.1")
    .arg(format!("--ignore-certificate-errors-spki-list={}", r.spki))
    .arg("--dump-dom")
    .arg(format!("https://localhost:{port}/"));
    let dom = run(&mut cmd, Duration::from_secs(60)).await;
    let _ = std::fs::remove_dir_all(&profile);
    let dom = String::from_utf8_lossy(&dom.unwrap()).into_owned();
    assert!(dom.contains("served over h3"), "{dom}");
    assert!(dom.contains("browser saw page h3, script h3"), "{dom}");
}
