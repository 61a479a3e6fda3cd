//! A synthetic but realistic header corpus: a browser loading a page from one origin, 100
//! requests and their responses. The tests measure compression ratios on it and the benchmark
//! times the encoder, the decoder and the Huffman code with it. Deterministic.

use bytes::Bytes;

use super::interop::Section;

const USER_AGENT: &str = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) \
                          Chrome/124.0.0.0 Safari/537.36";
const COOKIE: &str = "session_id=8f1c2b7a9e4d4c6fa0b3e5d7c9a1f2e4; _ga=GA1.2.1234567890.1700000000; \
                      _gid=GA1.2.987654321.1717000000; consent=analytics%3Dtrue%26ads%3Dfalse; \
                      cart=3f9a-77c1; theme=dark";

fn field(name: &str, value: impl Into<String>) -> (Bytes, Bytes) {
    (
        Bytes::copy_from_slice(name.as_bytes()),
        Bytes::from(value.into()),
    )
}

/// A small deterministic generator (xorshift), so the corpus needs no dependency.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Document,
    Script,
    Style,
    Image,
    Font,
    Api,
}

fn kind_of(i: usize) -> Kind {
    match i {
        0 => Kind::Document,
        _ => match i % 10 {
            1 | 5 => Kind::Script,
            2 => Kind::Style,
            3 | 4 | 6 | 7 => Kind::Image,
            8 => Kind::Font,
            _ => Kind::Api,
        },
    }
}

/// 100 request field sections of one page load: same authority, user agent, accept headers and
/// cookie; varying paths; a few referers.
pub fn page_load_requests() -> Vec<Section> {
    let mut g = Gen(0x9e37_79b9_7f4a_7c15);
    (0..100)
        .map(|i| {
            let kind = kind_of(i);
            let id = g.next() % 100_000;
            let hash = g.next() & 0xff_ffff;
            let (path, accept, dest, mode) = match kind {
                Kind::Document => (
                    "/products/espresso-machines?sort=popular".to_string(),
                    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,\
                     image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7",
                    "document",
                    "navigate",
                ),
                Kind::Script => (
                    format!("/static/js/chunk-{id}.{hash:06x}.js"),
                    "*/*",
                    "script",
                    "no-cors",
                ),
                Kind::Style => (
                    format!("/static/css/page-{id}.{hash:06x}.css"),
                    "text/css,*/*;q=0.1",
                    "style",
                    "no-cors",
                ),
                Kind::Image => (
                    format!("/images/products/{id}/thumb_640x480.webp?v={hash:x}"),
                    "image/avif,image/webp,image/apng,image/svg+xml,image/*,*/*;q=0.8",
                    "image",
                    "no-cors",
                ),
                Kind::Font => (
                    format!("/static/fonts/inter-{id}.woff2"),
                    "*/*",
                    "font",
                    "cors",
                ),
                Kind::Api => (
                    format!("/api/v2/recommendations?item={id}&limit=12"),
                    "application/json",
                    "empty",
                    "cors",
                ),
            };
            let mut f = vec![
                field(":method", "GET"),
                field(":scheme", "https"),
                field(":authority", "www.example-shop.com"),
                field(":path", path),
                field(
                    "sec-ch-ua",
                    "\"Chromium\";v=\"124\", \"Google Chrome\";v=\"124\", \"Not-A.Brand\";v=\"99\"",
                ),
                field("sec-ch-ua-mobile", "?0"),
                field("sec-ch-ua-platform", "\"Linux\""),
                field("user-agent", USER_AGENT),
                field("accept", accept),
                field(
                    "sec-fetch-site",
                    if i == 0 { "none" } else { "same-origin" },
                ),
                field("sec-fetch-mode", mode),
                field("sec-fetch-dest", dest),
            ];
            if i > 0 {
                let referer = match kind {
                    Kind::Font => "https://www.example-shop.com/static/css/main.css".to_string(),
                    _ if i % 17 == 0 => {
                        format!("https://www.example-shop.com/products/{}", g.next() % 1000)
                    }
                    _ => "https://www.example-shop.com/products/espresso-machines?sort=popular"
                        .to_string(),
                };
                f.push(field("referer", referer));
            }
            f.push(field("accept-encoding", "gzip, deflate, br, zstd"));
            f.push(field("accept-language", "en-US,en;q=0.9,de;q=0.8"));
            f.push(field("cookie", COOKIE));
            f.push(field("priority", if i == 0 { "u=0, i" } else { "u=1" }));
            f
        })
        .collect()
}

/// The 100 response field sections to [`page_load_requests`].
pub fn page_load_responses() -> Vec<Section> {
    let mut g = Gen(0x2545_f491_4f6c_dd1d);
    (0..100)
        .map(|i| {
            let kind = kind_of(i);
            let not_modified = i % 9 == 4;
            let mut f = vec![field(":status", if not_modified { "304" } else { "200" })];
            f.push(field("server", "nginx/1.25.4"));
            f.push(field(
                "date",
                format!("Mon, 03 Jun 2024 10:15:{:02} GMT", 20 + i / 10),
            ));
            let (ctype, cache) = match kind {
                Kind::Document => ("text/html; charset=utf-8", "no-cache"),
                Kind::Script => ("application/javascript", "public, max-age=31536000"),
                Kind::Style => ("text/css", "public, max-age=31536000"),
                Kind::Image => ("image/webp", "public, max-age=604800, immutable"),
                Kind::Font => ("font/woff2", "public, max-age=31536000"),
                Kind::Api => ("application/json", "private, max-age=0, must-revalidate"),
            };
            if !not_modified {
                f.push(field("content-type", ctype));
                f.push(field("content-length", (g.next() % 200_000).to_string()));
                if matches!(
                    kind,
                    Kind::Document | Kind::Script | Kind::Style | Kind::Api
                ) {
                    f.push(field("content-encoding", "br"));
                    f.push(field("vary", "accept-encoding"));
                }
            }
            f.push(field("cache-control", cache));
            f.push(field(
                "etag",
                format!("\"{:x}-{:x}\"", g.next() & 0xffff, g.next() & 0xffff_ffff),
            ));
            f.push(field(
                "last-modified",
                format!("Tue, {:02} May 2024 08:00:00 GMT", 1 + i % 3),
            ));
            f.push(field("x-request-id", format!("{:016x}", g.next())));
            f.push(field(
                "strict-transport-security",
                "max-age=63072000; includeSubDomains; preload",
            ));
            f.push(field("x-content-type-options", "nosniff"));
            f.push(field("alt-svc", "h3=\":443\"; ma=86400"));
            if matches!(kind, Kind::Font | Kind::Api) {
                f.push(field("access-control-allow-origin", "*"));
            }
            f.push(field("x-cache", if i % 4 == 0 { "MISS" } else { "HIT" }));
            f
        })
        .collect()
}
