//! Bulk download over loopback: a server streams N bytes, the client measures goodput.
//!
//!     cargo run --release -p kuai --example bulk -- [MEBIBYTES] [STREAMS]

use std::time::Instant;

use bytes::Bytes;
use kuai::{ClientConfig, Endpoint, ServerConfig};

const ALPN: &[u8] = b"kuai-bulk";

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().map_or(Ok(1024), |s| s.parse())?;
    let streams: u64 = args.next().map_or(Ok(1), |s| s.parse())?;
    let per_stream = (mib << 20) / streams;

    let (cfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN])?;
    let server = Endpoint::server(cfg, "127.0.0.1:0".parse()?)?;
    let addr = server.local_addr()?;
    tokio::spawn(async move {
        while let Some(connecting) = server.accept().await {
            tokio::spawn(async move {
                let conn = connecting.await?;
                // The client asks for data by opening streams; each gets `per_stream` bytes.
                while let Ok((mut send, _recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        let block = Bytes::from(vec![0x5a; 1 << 20]);
                        let mut left = per_stream;
                        while left > 0 {
                            let n = left.min(block.len() as u64) as usize;
                            send.write_chunk(block.slice(..n)).await?;
                            left -= n as u64;
                        }
                        send.finish()?;
                        send.stopped().await?;
                        Ok::<_, Error>(())
                    });
                }
                Ok::<_, Error>(())
            });
        }
    });

    let client = Endpoint::client("127.0.0.1:0".parse()?)?;
    let conn = client
        .connect_with(ClientConfig::with_root(cert, &[ALPN])?, addr, "localhost")?
        .await?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await?;
            send.write_all(b"go").await?;
            send.finish()?;
            let mut n = 0u64;
            while let Some(chunk) = recv.read_chunk(usize::MAX).await? {
                n += chunk.len() as u64;
            }
            Ok::<_, Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    let st = conn.stats();
    println!(
        "{} MiB on {streams} stream(s) in {secs:.2} s: goodput {:.0} Mbit/s (rtt {:.2} ms, {} packets lost)",
        total >> 20,
        total as f64 * 8.0 / secs / 1e6,
        st.path.rtt.as_secs_f64() * 1000.0,
        st.packets_lost,
    );
    Ok(())
}
