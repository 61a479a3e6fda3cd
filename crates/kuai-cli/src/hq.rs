//! HTTP/0.9 over QUIC (ALPN `hq-interop`), the client side: one request per bidirectional
//! stream, `GET /path\r\n`, answered with the body and FIN. Used by the interop runner. (The
//! server side is in `kuai_http::server`.)

use kuai::Connection;

pub const ALPN: &[u8] = b"hq-interop";

/// Streams `path` into `out` (for large downloads), calling `progress` with the total so far.
pub async fn get_to(
    conn: &Connection,
    path: &str,
    out: &mut (dyn std::io::Write + Send),
    mut progress: impl FnMut(u64),
) -> Result<u64, String> {
    let request = || async {
        let (mut send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(format!("GET {path}\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        Ok::<_, String>(recv)
    };
    let mut recv = request().await?;
    let mut total = 0u64;
    let mut resent = false;
    loop {
        match recv.read_chunk(usize::MAX).await {
            // Sent in 0-RTT and rejected: the server never saw it; send it again in 1-RTT.
            Err(kuai::ReadError::ZeroRttRejected) if !resent && total == 0 => {
                resent = true;
                recv = request().await?;
            }
            Ok(Some(chunk)) => {
                out.write_all(&chunk)
                    .map_err(|e| format!("write failed: {e}"))?;
                total += chunk.len() as u64;
                progress(total);
            }
            Ok(None) => return Ok(total),
            Err(kuai::ReadError::Reset(0x10c)) => return Err("not found".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}
