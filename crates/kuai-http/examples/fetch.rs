//! Fetches a URL the way an app would: HTTP/3 when it works, HTTP/2 or HTTP/1.1 over TCP when
//! it does not, remembering what it learned in a state file; prints how it went.
//!
//! ```text
//! cargo run -p kuai-http --example fetch -- https://localhost:4433/hello.txt [--insecure]
//! ```

use std::time::Duration;

use kuai_http::Client;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or("usage: fetch URL [--insecure]")?;
    let insecure = args.any(|a| a == "--insecure");
    let client = Client::builder()
        .danger_accept_invalid_certs(insecure)
        .state_file(std::env::temp_dir().join("kuai-fetch-example-state"))
        .build()?;
    for attempt in 1..=2 {
        let mut resp = client.get(&url).send().await?;
        let mut bytes = 0;
        while let Some(chunk) = resp.chunk().await? {
            bytes += chunk.len();
        }
        let t = resp.timings();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "request {attempt}: {} over {:?} from {}, {bytes} bytes; connect {:.1} ms, first byte {:.1} ms, total {:.1} ms{}",
            resp.status(),
            resp.protocol(),
            resp.remote_addr(),
            ms(t.connect),
            ms(t.first_byte),
            ms(t.total.unwrap_or_default()),
            if t.reused { " (connection reused)" } else { "" },
        );
    }
    Ok(())
}
