//! HTTP/3 (RFC 9114) in front of the service.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kuai_h3::{Code, SendHalf};

use super::{AccessLog, ConnInfo, EarlyData, InFlight, Protocol, ReplyBody, RequestGuard, Shared};
use crate::Body;

/// Serves every request of a connection. A connection with no request in flight for the
/// idle timeout is closed with H3_NO_ERROR (RFC 9114 §5.2), as the TCP side closes idle
/// connections; on shutdown a GOAWAY goes out first, and the connection closes once its
/// requests are done or the drain timeout passes.
pub(super) async fn serve(conn: kuai::Connection, shared: &Arc<Shared>) {
    let remote = conn.remote_address();
    let limits = &shared.limits;
    let config = kuai_h3::Config {
        max_field_section_size: limits.max_header_size as u64,
        request_head_timeout: Some(limits.header_timeout),
        // Services see no HTTP datagrams (RFC 9297): not offered, so a client's are not
        // queued per request stream for nobody to read.
        h3_datagram: false,
        ..kuai_h3::Config::default()
    };
    let in_flight = InFlight::new();
    let cancels = Arc::new(Cancels::new(conn.clone()));
    // Each request is answered in the task that read its head.
    let handler = {
        let shared = shared.clone();
        let in_flight = in_flight.clone();
        move |req: Request<()>, stream: kuai_h3::RequestStream| {
            let request = RequestGuard::new(&in_flight);
            let shared = shared.clone();
            let cancels = cancels.clone();
            async move {
                let _request = request;
                answer(req, stream, &shared, remote, &cancels).await;
            }
        }
    };
    let mut server = match kuai_h3::Server::with_handler(conn, config, handler).await {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(%remote, error = %e, "HTTP/3 setup failed");
            return;
        }
    };
    let mut draining: Option<tokio::time::Instant> = None;
    let close = |server: &kuai_h3::Server, why: &'static [u8]| {
        server.shutdown();
        server.quic().close(Code::NO_ERROR.0, why);
    };
    loop {
        let idle = in_flight.is_idle();
        let deadline = draining.unwrap_or_else(|| in_flight.idle_since() + limits.idle_timeout);
        let drained = server.requests_done();
        let next = tokio::select! {
            r = server.accept() => r,
            _ = tokio::time::sleep_until(deadline), if idle || draining.is_some() => {
                if draining.is_some() {
                    tracing::debug!(%remote, "HTTP/3 connection not drained in time: closed");
                    close(&server, b"shutting down");
                    break;
                }
                // The deadline may have moved while asleep.
                if in_flight.idle_since() + limits.idle_timeout > tokio::time::Instant::now() {
                    continue;
                }
                tracing::debug!(%remote, "HTTP/3 connection idle: closed");
                close(&server, b"idle");
                break;
            }
            // A request began or ended.
            _ = in_flight.changed() => continue,
            // Draining, and every request below the GOAWAY's ID is answered: those whose
            // heads were still arriving count (the GOAWAY promised to process them).
            _ = drained, if draining.is_some() => {
                if let Some(d) = draining {
                    linger(&server, d).await;
                }
                close(&server, b"shutting down");
                break;
            }
            _ = shared.shutting_down(), if draining.is_none() => {
                // GOAWAY: requests already begun are answered, later ones refused so the
                // client can retry them elsewhere.
                server.shutdown();
                draining = Some(tokio::time::Instant::now() + limits.drain_timeout);
                continue;
            }
        };
        // Requests go to the handler; `accept` only tells that the connection is done.
        if next.is_none() {
            break;
        }
    }
}

/// Answers one request on its stream, and writes its access log line.
async fn answer(
    req: Request<()>,
    stream: kuai_h3::RequestStream,
    shared: &Arc<Shared>,
    remote: std::net::SocketAddr,
    cancels: &Cancels,
) {
    let (parts, ()) = req.into_parts();
    let method = parts.method.clone();
    // Its head arrived (at least in part) in 0-RTT: an attacker may replay it (RFC 9001
    // §9.2, RFC 8446 §8).
    let early = parts.extensions.get::<EarlyData>().is_some();
    let info = ConnInfo {
        remote,
        protocol: Protocol::Http3,
    };
    let mut log = AccessLog::new(shared, info, method.clone(), &parts.uri, early);
    let (mut send, recv) = stream.split();
    // A tunnel's body (extended CONNECT, RFC 9220) is one side of a WebSocket, not an
    // upload: no size limit, as over HTTP/2 and HTTP/1.1, where the tunnel is not a body.
    let limit = if method == Method::CONNECT {
        None
    } else {
        shared.limits.max_request_body
    };
    // A stalled upload ends its own request after the send timeout (not a tunnel's body,
    // which may be quiet for as long as its ends like).
    let mut body = Body::h3(recv, limit);
    if method != Method::CONNECT {
        body = body.stall_limit(shared.limits.send_timeout);
    }
    // A client that waits for 100 Continue before its body gets it when the service first
    // reads the body (RFC 9110 §10.1.1), as hyper does over TCP; a service that answers
    // without reading it sends none.
    let mut wants_continue = None;
    if expects_continue(&parts.headers) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        body = body.on_first_read(tx);
        wants_continue = Some(rx);
    }
    let req = Request::from_parts(parts, body);
    // A client that cancels the request (STOP_SENDING) or goes away drops the work
    // making its response: a proxied request's upstream exchange, for one.
    let respond = shared.respond(req, info);
    tokio::pin!(respond);
    // (Two ways, so that a request without the expectation, nearly all, pays nothing for it.)
    let resp = if let Some(mut read) = wants_continue {
        let mut read = Some(&mut read);
        loop {
            tokio::select! {
                r = &mut respond => break Some(r),
                first = async { read.as_mut().expect("guarded").await }, if read.is_some() => {
                    read = None;
                    if first.is_ok() {
                        let go_on = Response::builder().status(StatusCode::CONTINUE).body(());
                        if let Ok(go_on) = go_on {
                            let _ = send.send_informational(go_on).await;
                        }
                    }
                }
                e = send.cancelled() => {
                    tracing::debug!(%remote, %method, path = log.path(), error = %e, "h3 request cancelled");
                    break None;
                }
            }
        }
    } else {
        tokio::select! {
            r = &mut respond => Some(r),
            e = send.cancelled() => {
                tracing::debug!(%remote, %method, path = log.path(), error = %e, "h3 request cancelled");
                None
            }
        }
    };
    let Some(resp) = resp else {
        cancels.note(remote);
        return;
    };
    log.response(&resp);
    let send_timeout = shared.limits.send_timeout;
    match send_response(send, resp, &method, send_timeout).await {
        Ok(bytes) => {
            log.bytes = bytes;
            log.write();
        }
        Err(e) => {
            tracing::info!(%remote, %method, path = log.path(), error = %e, "h3 request failed")
        }
    }
}

/// Requests a client cancels before their answer, budgeted per connection: the HTTP/3 form
/// of HTTP/2's "rapid reset" (CVE-2023-44487), where a client opens a request and cancels it
/// at once, over and over, each one starting the service's work (a proxied request, a file
/// opened) for the price of a few bytes, faster than any limit on requests in flight can
/// hold. A budget of [`CANCEL_BURST`], refilled at [`CANCEL_RATE`] a second, covers what
/// browsers do (cancelling the rest of a page when the user moves on); past it the
/// connection is closed with H3_EXCESSIVE_LOAD (RFC 9114 §8.1), so each burst costs the
/// client a new handshake.
struct Cancels {
    quic: kuai::Connection,
    /// Tokens left, and when they were last counted.
    budget: std::sync::Mutex<(f64, std::time::Instant)>,
}

/// Cancelled requests a connection may have at once ...
const CANCEL_BURST: f64 = 200.0;
/// ... and more a second.
const CANCEL_RATE: f64 = 20.0;

impl Cancels {
    fn new(quic: kuai::Connection) -> Self {
        Self {
            quic,
            budget: std::sync::Mutex::new((CANCEL_BURST, std::time::Instant::now())),
        }
    }

    /// A request was cancelled before its answer: closes the connection past the budget.
    fn note(&self, remote: std::net::SocketAddr) {
        let over = {
            let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            let refill = now.duration_since(b.1).as_secs_f64() * CANCEL_RATE;
            b.0 = (b.0 + refill).min(CANCEL_BURST) - 1.0;
            b.1 = now;
            b.0 < 0.0
        };
        if over && self.quic.close_reason().is_none() {
            tracing::info!(%remote, "HTTP/3 client cancels requests faster than allowed: connection closed");
            self.quic
                .close(Code::EXCESSIVE_LOAD.0, b"too many requests cancelled");
        }
    }
}

/// Why a response was not sent whole.
#[derive(Debug)]
enum SendFailed {
    /// The stream or connection failed.
    H3(kuai_h3::Error),
    /// The client took nothing for the send timeout: the stream was reset.
    Stalled,
}

impl std::fmt::Display for SendFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendFailed::H3(e) => e.fmt(f),
            SendFailed::Stalled => f.write_str("the client took nothing for the send timeout"),
        }
    }
}

impl From<kuai_h3::Error> for SendFailed {
    fn from(e: kuai_h3::Error) -> Self {
        SendFailed::H3(e)
    }
}

/// The client took nothing for the send timeout (nginx's send_timeout, between two
/// writes): the stream is reset with H3_REQUEST_CANCELLED, so a client that stops reading a
/// response holds no task, stream or buffer past it.
fn stalled(stream: &mut SendHalf) -> SendFailed {
    stream.reset(Code::REQUEST_CANCELLED);
    SendFailed::Stalled
}

/// Response bytes a stream takes ahead of what it has sent: two of `FileChunks`' 256 KiB
/// chunks.
const MAX_UNSENT: u64 = 512 * 1024;

/// How long a drained connection stays open after its last response for the client to
/// read what it received and close first.
const LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// After the last response of a draining connection (its data acknowledged): waits for the
/// client to close, [`LINGER`] at most and never past `deadline`. A client's QUIC stack may
/// drop stream data its application has not read yet when the connection closes.
async fn linger(server: &kuai_h3::Server, deadline: tokio::time::Instant) {
    let until = deadline.min(tokio::time::Instant::now() + LINGER);
    tokio::select! {
        _ = server.quic().closed() => {}
        _ = tokio::time::sleep_until(until) => {}
    }
}

/// The code a response stream is reset with when its body fails: H3_REQUEST_CANCELLED when
/// the body's source was reset or aborted (a backend's connection reset under a proxied
/// response or a WebSocket tunnel: RFC 9220 §3 maps a TCP RST to it), H3_INTERNAL_ERROR
/// otherwise.
fn body_reset_code(e: &(dyn std::error::Error + 'static)) -> Code {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset};
    let io = match e.downcast_ref::<crate::Error>() {
        Some(crate::Error::Io(io)) => Some(io),
        _ => e.downcast_ref::<std::io::Error>(),
    };
    match io.map(std::io::Error::kind) {
        Some(ConnectionReset | ConnectionAborted) => Code::REQUEST_CANCELLED,
        _ => Code::INTERNAL_ERROR,
    }
}

/// Sends `resp` and its body (none after HEAD, 204 and 304: RFC 9110 §6.4.1) and finishes the
/// stream, which the transport resets with H3_REQUEST_CANCELLED unless the client has it all
/// within the send timeout; the body bytes sent.
async fn send_response(
    stream: SendHalf,
    resp: Response<ReplyBody>,
    method: &Method,
    send_timeout: std::time::Duration,
) -> Result<u64, SendFailed> {
    // Reset, not finished, if this ends before the body's end: a task that unwinds (a body
    // that panics) would otherwise leave the stream's FIN, and a cut body would look whole
    // (HTTP/2 resets the stream there, HTTP/1.1 closes the connection).
    let mut guard = ResetOnDrop(Some(stream));
    let stream = guard.0.as_mut().expect("just set");
    let (mut head, mut body) = resp.into_parts();
    // RFC 9110 §6.6.1: an origin server with a clock sends Date (hyper adds it over TCP).
    head.headers
        .entry(http::header::DATE)
        .or_insert_with(super::date_now);
    let status = head.status;
    let limit = send_timeout;
    match tokio::time::timeout(limit, stream.send_response(Response::from_parts(head, ()))).await {
        Ok(r) => r?,
        Err(_) => return Err(stalled(stream)),
    }
    // The body's next piece is made (a file read into fresh memory, often) when the last is
    // nearly sent, so it is still in the CPU's cache when copied into packets.
    stream.set_max_unsent(Some(MAX_UNSENT));
    let no_body = method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let mut sent = 0u64;
    if !no_body {
        loop {
            // A client that cancels the request (STOP_SENDING) or goes away while the body
            // has nothing to send (a long poll, an event stream, a proxied response the
            // backend is slow with) ends the body's work now, not at its next piece.
            let frame = tokio::select! {
                biased;
                f = body.frame() => f,
                e = stream.cancelled() => return Err(e.into()),
            };
            let Some(frame) = frame else { break };
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    // The client must not take a cut body for a whole one.
                    tracing::info!(error = %e, "response body failed: stream reset");
                    stream.reset(body_reset_code(&*e));
                    return Err(kuai_h3::Error::Malformed("response body failed").into());
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    sent += data.len() as u64;
                    match tokio::time::timeout(limit, stream.send_data(data)).await {
                        Ok(r) => r?,
                        Err(_) => return Err(stalled(stream)),
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        match tokio::time::timeout(limit, stream.send_trailers(&trailers)).await {
                            Ok(r) => r?,
                            Err(_) => return Err(stalled(stream)),
                        }
                        break;
                    }
                }
            }
        }
    }
    // The body's resources (a file, a proxied response's backend connection) go back
    // before the wait for the acknowledgements.
    drop(body);
    // The stream stays in the transport until the client has it all, or is reset once it
    // has taken nothing for the send timeout: no task waits for that.
    stream.finish_within(send_timeout, Code::REQUEST_CANCELLED)?;
    guard.0 = None;
    Ok(sent)
}

/// A response stream reset with H3_INTERNAL_ERROR when dropped while still held.
struct ResetOnDrop(Option<SendHalf>);

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if let Some(s) = self.0.as_mut() {
            s.reset(Code::INTERNAL_ERROR);
        }
    }
}

/// Whether a request asks for `100 Continue` before its body (RFC 9110 §10.1.1).
fn expects_continue(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_whose_source_was_reset_cancels_the_request() {
        use std::io::{Error, ErrorKind};
        let reset = crate::Error::Io(Error::from(ErrorKind::ConnectionReset));
        assert_eq!(body_reset_code(&reset), Code::REQUEST_CANCELLED);
        let aborted = Error::from(ErrorKind::ConnectionAborted);
        assert_eq!(body_reset_code(&aborted), Code::REQUEST_CANCELLED);
        let other = crate::Error::Io(Error::from(ErrorKind::UnexpectedEof));
        assert_eq!(body_reset_code(&other), Code::INTERNAL_ERROR);
    }
}
