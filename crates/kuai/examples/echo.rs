//! Echo server and client in one program.
//!
//!     cargo run -p kuai --example echo -- server 127.0.0.1:4433
//!     cargo run -p kuai --example echo -- client 127.0.0.1:4433 "hello"
//!
//! The server prints its certificate as hex; pass it to the client with KUAI_CERT_HEX, or
//! run `echo -- demo` to run both in one process.

use std::net::SocketAddr;

use kuai::{ClientConfig, Endpoint, ServerConfig};

const ALPN: &[u8] = b"kuai-echo";

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn serve(server: Endpoint) {
    while let Some(connecting) = server.accept().await {
        tokio::spawn(async move {
            let conn = connecting.await?;
            println!("connection from {}", conn.remote_address());
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    // Echo until the client finishes its side.
                    while let Some(chunk) = recv.read_chunk(64 * 1024).await? {
                        send.write_chunk(chunk).await?;
                    }
                    send.finish()?;
                    send.stopped().await?;
                    Ok::<_, Error>(())
                });
            }
            Ok::<_, Error>(())
        });
    }
}

async fn echo_once(conn: &kuai::Connection, msg: &str) -> Result<String, Error> {
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(msg.as_bytes()).await?;
    send.finish()?;
    Ok(String::from_utf8(recv.read_to_end(1 << 20).await?)?)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, Error> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2).ok_or("odd hex")?, 16).map_err(Into::into))
        .collect()
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("server") => {
            let addr: SocketAddr = args
                .get(1)
                .map_or("127.0.0.1:4433", |s| s.as_str())
                .parse()?;
            let (cfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN])?;
            let server = Endpoint::server(cfg, addr)?;
            println!("echo server on {}", server.local_addr()?);
            println!("KUAI_CERT_HEX={}", hex(&cert));
            serve(server).await;
        }
        Some("client") => {
            let addr: SocketAddr = args.get(1).ok_or("usage: client ADDR MESSAGE")?.parse()?;
            let msg = args.get(2).cloned().unwrap_or_else(|| "hello".into());
            let cert = unhex(&std::env::var("KUAI_CERT_HEX").map_err(|_| "set KUAI_CERT_HEX")?)?;
            let client = Endpoint::client("0.0.0.0:0".parse()?)?;
            let cfg = ClientConfig::with_root(cert.into(), &[ALPN])?;
            let conn = client.connect_with(cfg, addr, "localhost")?.await?;
            println!("{}", echo_once(&conn, &msg).await?);
        }
        _ => {
            // Both sides in one process.
            let (cfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN])?;
            let server = Endpoint::server(cfg, "127.0.0.1:0".parse()?)?;
            let addr = server.local_addr()?;
            tokio::spawn(serve(server));
            let client = Endpoint::client("127.0.0.1:0".parse()?)?;
            let conn = client
                .connect_with(ClientConfig::with_root(cert, &[ALPN])?, addr, "localhost")?
                .await?;
            let reply = echo_once(&conn, "hello, kuai").await?;
            println!("echoed: {reply}");
            assert_eq!(reply, "hello, kuai");
        }
    }
    Ok(())
}
