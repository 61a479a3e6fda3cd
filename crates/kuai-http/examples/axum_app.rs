//! An axum app served by kuai-http over HTTP/3 (UDP) and HTTP/2 and HTTP/1.1 (TCP) on one
//! port, unchanged: the `Router` is the service.
//!
//! ```text
//! cargo run --release -p kuai-http --example axum_app -- 127.0.0.1:4433
//! ```
//!
//! It prints the Chromium command line that opens it over HTTP/3 (the certificate is
//! self-signed, made at start); `curl -k https://127.0.0.1:4433/` reaches it over HTTP/2.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, Path};
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use kuai_http::{ConnInfo, Listener, Server};

/// The page: says which protocol brought it, and loads a script that says which protocol
/// brought the page and itself, as the browser saw them.
pub const PAGE: &str = r#"<!doctype html>
<html><head><meta charset="utf-8"><title>kuai + axum</title></head>
<body>
<h1>axum over kuai</h1>
<p id="server">served over PROTO</p>
<p id="browser">the script did not run</p>
<script src="/app.js"></script>
</body></html>
"#;

/// The script of the page.
pub const SCRIPT: &str = r#"const nav = performance.getEntriesByType("navigation")[0];
const me = performance.getEntriesByName(document.currentScript.src)[0];
document.getElementById("browser").textContent =
  "browser saw page " + nav.nextHopProtocol + ", script " + me.nextHopProtocol;
"#;

/// `n` bytes of a pattern, the same on every call.
pub fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// The app: `/` (the page), `/app.js`, `/data/{n}` (n bytes, at most 16 MiB) and `POST /echo`
/// (the request body streamed back).
pub fn app() -> Router {
    Router::new()
        .route("/", get(page))
        .route("/app.js", get(script))
        .route("/data/{n}", get(bytes))
        .route("/echo", post(echo))
}

async fn page(Extension(info): Extension<ConnInfo>) -> Html<String> {
    Html(PAGE.replace("PROTO", info.protocol.alpn()))
}

async fn script() -> impl IntoResponse {
    ([("content-type", "text/javascript")], SCRIPT)
}

async fn bytes(Path(n): Path<usize>) -> impl IntoResponse {
    data(n.min(16 << 20))
}

async fn echo(body: Body) -> Body {
    body
}

/// A self-signed certificate for localhost: the TLS configuration and the base64 SHA-256 of
/// its public key, as Chromium's `--ignore-certificate-errors-spki-list` takes it.
pub fn self_signed() -> (
    rustls::ServerConfig,
    String,
    rustls::pki_types::CertificateDer<'static>,
) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("a certificate");
    let spki = ring::digest::digest(&ring::digest::SHA256, &ck.key_pair.public_key_der());
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let tls = kuai_http::server_tls(vec![cert.clone()], key).expect("TLS configuration");
    (tls, base64(spki.as_ref()), cert)
}

/// Standard base64 with padding.
pub fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = u32::from(c[0]) << 16
            | u32::from(*c.get(1).unwrap_or(&0)) << 8
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

#[tokio::main]
#[allow(dead_code)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:4433".into())
        .parse()?;
    let (tls, spki, _) = self_signed();
    let listener = Listener::bind(addr, tls).await?;
    let port = listener.local_addr()?.port();
    println!("axum app on udp and tcp {}", listener.local_addr()?);
    println!(
        "chromium --user-data-dir=$(mktemp -d) --enable-quic --origin-to-force-quic-on=localhost:{port} \\\n  --host-resolver-rules=\"MAP localhost {}\" --ignore-certificate-errors-spki-list={spki} https://localhost:{port}/",
        addr.ip()
    );
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    Server::new(app())
        .serve_with_shutdown(listener, shutdown)
        .await?;
    Ok(())
}
