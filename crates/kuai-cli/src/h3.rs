//! HTTP/3 fetching for the command line. (The server side is in `kuai_http::server`.)

use http::StatusCode;

pub use kuai_h3::ALPN;

/// Fetches `url`'s path on an HTTP/3 connection into `out`; returns (status, bytes).
pub async fn get_to(
    client: &kuai_h3::Client,
    url: &crate::url::Url,
    out: &mut (dyn std::io::Write + Send),
    mut progress: impl FnMut(u64),
) -> Result<(StatusCode, u64), String> {
    let uri = url.to_string();
    let request = || {
        http::Request::get(&uri)
            .header("user-agent", concat!("kuai/", env!("CARGO_PKG_VERSION")))
            .body(())
            .map_err(|e| e.to_string())
    };
    let send = |req| async {
        let mut stream = client.send_request(req).await?;
        stream.finish()?;
        let resp = stream.recv_response().await?;
        Ok::<_, kuai_h3::Error>((stream, resp))
    };
    // A request sent in 0-RTT that the server rejected never reached it: send it again, now
    // in 1-RTT on the same connection.
    let (mut stream, resp) = match send(request()?).await {
        Err(kuai_h3::Error::ZeroRttRejected) => {
            tracing::info!(%uri, "0-RTT rejected; sending the request again");
            send(request()?).await
        }
        r => r,
    }
    .map_err(|e| e.to_string())?;
    let mut total = 0u64;
    while let Some(chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
        out.write_all(&chunk)
            .map_err(|e| format!("write failed: {e}"))?;
        total += chunk.len() as u64;
        progress(total);
    }
    Ok((resp.status(), total))
}
