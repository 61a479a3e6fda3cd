//! HTTP/0.9 over QUIC (ALPN `hq-interop`), as the QUIC interop runner speaks it: one request
//! per bidirectional stream, `GET /path\r\n`, answered with the body and FIN. The service
//! answers it as a GET with version HTTP/0.9; there is no status line, so anything but 200
//! resets the stream.

use std::sync::Arc;

use http::{Method, Request, StatusCode, Version};
use http_body_util::BodyExt;

use super::{AccessLog, ConnInfo, EarlyData, InFlight, Protocol, RequestGuard, Shared};
use crate::Body;

/// Longest request line.
const MAX_REQUEST: usize = 8 * 1024;
/// The stream error that says "not found" (the interop runner's convention).
const NOT_FOUND: u64 = 0x10c;
/// H3_REQUEST_REJECTED (RFC 9114 §8.1): the request was not processed.
const REQUEST_REJECTED: u64 = 0x10b;
/// H3_REQUEST_CANCELLED (RFC 9114 §8.1): a response given up.
const REQUEST_CANCELLED: u64 = 0x10c;

/// Serves every request of a connection; on shutdown, the requests in flight get the drain
/// timeout to finish.
pub(super) async fn serve(conn: kuai::Connection, shared: &Arc<Shared>) {
    let remote = conn.remote_address();
    let in_flight = InFlight::new();
    loop {
        let (send, recv) = tokio::select! {
            r = conn.accept_bi() => match r {
                Ok(s) => s,
                Err(_) => return,
            },
            _ = shared.shutting_down() => {
                let _ = tokio::time::timeout(shared.limits.drain_timeout, in_flight.drained()).await;
                conn.close(0, b"shutting down");
                return;
            }
        };
        let request = RequestGuard::new(&in_flight);
        let shared = shared.clone();
        tokio::spawn(async move {
            let _request = request;
            let info = ConnInfo {
                remote,
                protocol: Protocol::Http09,
            };
            if let Err(e) = serve_request(send, recv, &shared, info).await {
                tracing::debug!(%remote, error = %e, "hq request failed");
            }
        });
    }
}

async fn serve_request(
    mut send: kuai::SendStream,
    mut recv: kuai::RecvStream,
    shared: &Shared,
    info: ConnInfo,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let early = recv.received_in_0rtt();
    // The request line within the header timeout, as HTTP/3's head: a client that opens
    // streams and never ends them holds no task past it.
    let line =
        match tokio::time::timeout(shared.limits.header_timeout, recv.read_to_end(MAX_REQUEST))
            .await
        {
            Ok(line) => line?,
            Err(_) => {
                // Not processed: HTTP/3's code for that (there is no HTTP/0.9 one).
                let _ = recv.stop(REQUEST_REJECTED);
                send.reset(REQUEST_REJECTED)?;
                return Ok(());
            }
        };
    let line = String::from_utf8_lossy(&line);
    let path = request_path(&line);
    let req = Request::builder()
        .method(Method::GET)
        .version(Version::HTTP_09)
        .uri(if path.starts_with('/') { path } else { "/" })
        .body(Body::empty());
    // A target that is no URI (`GET /a b`) is refused, not served as `/`.
    let Ok(mut req) = req else {
        send.reset(NOT_FOUND)?;
        return Ok(());
    };
    if early {
        req.extensions_mut().insert(EarlyData);
    }
    let mut log = AccessLog::new(shared, info, Method::GET, req.uri(), early);
    let resp = shared.respond(req, info).await;
    log.response(&resp);
    if resp.status() != StatusCode::OK {
        send.reset(NOT_FOUND)?;
        log.write();
        return Ok(());
    }
    let mut body = resp.into_body();
    let mut sent = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            // HTTP/0.9 has no length: a body that fails part-way (a file read error) must
            // reset the stream, or the client takes the cut file for the whole one (a
            // dropped send stream ends it normally).
            Err(e) => {
                let _ = send.reset(NOT_FOUND);
                return Err(e);
            }
        };
        if let Ok(data) = frame.into_data() {
            sent += data.len() as u64;
            // The send timeout between two writes, as HTTP/3's: a client that stops
            // reading holds nothing past it.
            match tokio::time::timeout(shared.limits.send_timeout, send.write_chunk(data)).await {
                Ok(r) => r?,
                Err(_) => {
                    let _ = send.reset(REQUEST_CANCELLED);
                    return Ok(());
                }
            }
        }
    }
    // The stream stays until the client has it all, or is reset by the transport once it
    // has taken nothing for the send timeout.
    send.set_delivery_timeout(shared.limits.send_timeout, REQUEST_CANCELLED);
    send.finish()?;
    log.bytes = sent;
    log.write();
    Ok(())
}

/// The path of an HTTP/0.9 request, `GET /path\r\n`; empty when it is not a GET.
pub fn request_path(request: &str) -> &str {
    request
        .trim()
        .strip_prefix("GET ")
        .map(str::trim)
        .unwrap_or("")
}
