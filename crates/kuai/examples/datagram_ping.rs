//! Unreliable datagrams (RFC 9221): ping a server that echoes datagrams and print the RTTs.
//!
//!     cargo run -p kuai --example datagram_ping -- [COUNT]

use std::time::{Duration, Instant};

use bytes::Bytes;
use kuai::{ClientConfig, Endpoint, ServerConfig};

const ALPN: &[u8] = b"kuai-ping";

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let count: u32 = std::env::args().nth(1).map_or(Ok(10), |s| s.parse())?;
    let (cfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN])?;
    let server = Endpoint::server(cfg, "127.0.0.1:0".parse()?)?;
    let addr = server.local_addr()?;
    tokio::spawn(async move {
        while let Some(connecting) = server.accept().await {
            tokio::spawn(async move {
                let conn = connecting.await?;
                while let Ok(d) = conn.read_datagram().await {
                    conn.send_datagram(d)?;
                }
                Ok::<_, Error>(())
            });
        }
    });
    let client = Endpoint::client("127.0.0.1:0".parse()?)?;
    let conn = client
        .connect_with(ClientConfig::with_root(cert, &[ALPN])?, addr, "localhost")?
        .await?;
    println!(
        "max datagram payload: {} bytes",
        conn.max_datagram_size().unwrap_or(0)
    );
    let mut received = 0;
    for seq in 0..count {
        let sent = Instant::now();
        conn.send_datagram(Bytes::from(seq.to_be_bytes().to_vec()))?;
        match tokio::time::timeout(Duration::from_secs(1), conn.read_datagram()).await {
            Ok(Ok(d)) if d[..] == seq.to_be_bytes() => {
                received += 1;
                println!(
                    "seq={seq} rtt={:.3} ms",
                    sent.elapsed().as_secs_f64() * 1000.0
                );
            }
            Ok(Ok(_)) => println!("seq={seq} out of order reply"),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => println!("seq={seq} lost"),
        }
    }
    println!("{received}/{count} datagrams came back");
    Ok(())
}
