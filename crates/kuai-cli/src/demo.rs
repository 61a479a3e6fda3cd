//! The built-in demo site `kuai server` serves without `--root`.

use std::sync::OnceLock;

use bytes::Bytes;

const INDEX: &str = r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kuai 快 — QUIC demo</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 3rem auto; padding: 0 1rem; line-height: 1.5; color: #222; }
code { background: #f3f3f3; padding: 0 .25rem; }
h1 span { color: #c0392b; }
</style>
</head>
<body>
<h1><span>快</span> kuai</h1>
<p>This page came to you over QUIC, served by <strong>kuai</strong>, a QUIC stack written in Rust.</p>
<h2>Try</h2>
<ul>
<li><a href="/hello.txt">/hello.txt</a> — a small text file</li>
<li><a href="/bytes/1048576">/bytes/1048576</a> — 1 MiB of generated data (any size up to 10 GiB: <code>/bytes/N</code>)</li>
</ul>
</body>
</html>
"#;

const HELLO: &str = "hello from kuai over QUIC\n";

/// Largest `/bytes/N` response.
pub const MAX_GENERATED: u64 = 10 << 30;

/// 64 KiB of a repeating byte pattern, shared by all generated responses.
pub fn pattern_block() -> &'static Bytes {
    static P: OnceLock<Bytes> = OnceLock::new();
    P.get_or_init(|| Bytes::from((0..65536u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>()))
}

/// A page of the demo site.
pub enum Page {
    Bytes(Bytes),
    /// `n` bytes of [`pattern_block`].
    Pattern(u64),
}

/// The demo page at `path` (its query ignored).
pub fn lookup(path: &str) -> Option<Page> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    match path {
        "" | "/" | "/index.html" => Some(Page::Bytes(Bytes::from_static(INDEX.as_bytes()))),
        "/hello.txt" => Some(Page::Bytes(Bytes::from_static(HELLO.as_bytes()))),
        p => {
            let n: u64 = p.strip_prefix("/bytes/")?.parse().ok()?;
            (n <= MAX_GENERATED).then_some(Page::Pattern(n))
        }
    }
}
