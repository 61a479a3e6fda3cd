//! Malformed HTTP/3 from a raw QUIC peer: each case ends the request or the connection with
//! the RFC 9114 error code.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use kuai::{ClientConfig, Connection, ConnectionError, Endpoint, ServerConfig};
use kuai_h3::{Body, Code, Config, RecvHalf};

async fn handler(req: Request<RecvHalf>) -> Response<Body> {
    // /read-all: the body and the trailers are read before the answer.
    if req.uri().path() == "/read-all" {
        let mut body = req.into_body();
        let _ = body.recv_body(1 << 20).await;
        let _ = body.recv_trailers().await;
    }
    Response::new(Body::from("ok"))
}

async fn server() -> (
    Endpoint,
    SocketAddr,
    kuai::rustls::pki_types::CertificateDer<'static>,
) {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[kuai_h3::ALPN]).unwrap();
    let ep = Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = ep.local_addr().unwrap();
    let e = ep.clone();
    tokio::spawn(async move {
        while let Some(c) = e.accept().await {
            tokio::spawn(async move {
                if let Ok(conn) = c.await {
                    let _ = kuai_h3::serve(conn, Config::default(), handler).await;
                }
            });
        }
    });
    (ep, addr, cert)
}

async fn raw_client() -> (Endpoint, Connection, Endpoint) {
    let (sep, addr, cert) = server().await;
    let ep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = ep
        .connect_with(
            ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    (ep, conn, sep)
}

/// Waits for the connection to close and returns the application error code the server used.
async fn closed_with(conn: &Connection) -> u64 {
    match tokio::time::timeout(Duration::from_secs(5), conn.closed())
        .await
        .expect("server closed the connection")
    {
        ConnectionError::ApplicationClosed { code, .. } => code,
        e => panic!("unexpected close: {e:?}"),
    }
}

async fn control_stream(conn: &Connection, frames: &[u8]) {
    let mut s = conn.open_uni().await.unwrap();
    let mut b = vec![0x00];
    b.extend_from_slice(frames);
    s.write_all(&b).await.unwrap();
    std::mem::forget(s); // keep it open: closing a control stream is its own error
}

#[tokio::test]
async fn data_before_headers_is_frame_unexpected() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&[0x00, 0x03, b'a', b'b', b'c'])
        .await
        .unwrap();
    send.finish().unwrap();
    assert_eq!(closed_with(&conn).await, Code::FRAME_UNEXPECTED.0);
}

#[tokio::test]
async fn control_stream_must_start_with_settings() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x07, 0x01, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::MISSING_SETTINGS.0);
}

/// RFC 9114 §6.2.1: an HTTP/2 frame type (here PING, 0x06) as the control stream's first
/// frame is first of all a missing SETTINGS.
#[tokio::test]
async fn an_http2_frame_first_on_the_control_stream_is_missing_settings() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x06, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::MISSING_SETTINGS.0);
}

#[tokio::test]
async fn second_settings_is_frame_unexpected() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00, 0x04, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::FRAME_UNEXPECTED.0);
}

#[tokio::test]
async fn http2_setting_is_a_settings_error() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x02, 0x02, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::SETTINGS_ERROR.0);
}

#[tokio::test]
async fn closing_the_control_stream_is_critical() {
    let (_ep, conn, _s) = raw_client().await;
    let mut s = conn.open_uni().await.unwrap();
    s.write_all(&[0x00, 0x04, 0x00]).await.unwrap();
    s.finish().unwrap();
    assert_eq!(closed_with(&conn).await, Code::CLOSED_CRITICAL_STREAM.0);
}

#[tokio::test]
async fn two_control_streams_are_a_stream_creation_error() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    control_stream(&conn, &[0x04, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::STREAM_CREATION_ERROR.0);
}

#[tokio::test]
async fn qpack_reference_to_a_missing_entry_fails_decompression() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    // HEADERS whose encoded Required Insert Count (300) exceeds 2 * MaxEntries (2 * 4096 / 32):
    // invalid whatever the table holds (RFC 9204 §4.5.1.1).
    send.write_all(&[0x01, 0x04, 0xff, 0x2d, 0x00, 0x80])
        .await
        .unwrap();
    send.finish().unwrap();
    assert_eq!(closed_with(&conn).await, 0x200);
}

#[tokio::test]
async fn malformed_request_is_a_stream_error_only() {
    let (_ep, conn, _s) = raw_client().await;
    let client = kuai_h3::Client::new(conn.clone(), Config::default())
        .await
        .unwrap();
    // A request with an uppercase header name is malformed: the stream is reset with
    // H3_MESSAGE_ERROR, the connection lives on.
    let req = Request::get("https://localhost/")
        .header("x-ok", "1")
        .body(())
        .unwrap();
    let mut s = client.send_request(req).await.unwrap();
    s.finish().unwrap();
    assert_eq!(s.recv_response().await.unwrap().status(), 200);
    // Now a raw malformed request on a new stream.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    // HEADERS with a literal field line (static name ref :authority) and a pseudo-header
    // after... simplest malformed: a field section without :method. Encoded: RIC 0, base 0,
    // literal with static name reference index 1 (":path") value "/".
    send.write_all(&[0x01, 0x05, 0x00, 0x00, 0x51, 0x01, b'/'])
        .await
        .unwrap();
    send.finish().unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1024))
        .await
        .unwrap();
    assert_eq!(r, Err(kuai::ReadError::Reset(Code::MESSAGE_ERROR.0)));
    // The connection still works.
    let mut s = client
        .send_request(Request::get("https://localhost/").body(()).unwrap())
        .await
        .unwrap();
    s.finish().unwrap();
    assert_eq!(s.recv_response().await.unwrap().status(), 200);
}

#[tokio::test]
async fn goaway_rejects_new_requests() {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[kuai_h3::ALPN]).unwrap();
    let ep = Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = ep.local_addr().unwrap();
    let e = ep.clone();
    tokio::spawn(async move {
        let conn = e.accept().await.unwrap().await.unwrap();
        let mut server = kuai_h3::Server::new(conn, Config::default()).await.unwrap();
        let (_req, mut stream) = server.accept().await.unwrap();
        // Shut down while the first request is in flight; it still completes.
        server.shutdown();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stream.send_response(Response::new(())).await.unwrap();
        stream.send_data(Bytes::from_static(b"last")).await.unwrap();
        stream.finish().unwrap();
        stream.finished().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    let cep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = cep
        .connect_with(
            ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    let client = kuai_h3::Client::new(conn, Config::default()).await.unwrap();
    let mut s = client
        .send_request(Request::get("https://localhost/").body(()).unwrap())
        .await
        .unwrap();
    s.finish().unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // After the GOAWAY arrived, new requests fail locally.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = client
        .send_request(Request::get("https://localhost/").body(()).unwrap())
        .await;
    assert!(matches!(r, Err(kuai_h3::Error::GoingAway)), "{:?}", r.err());
    // The request sent before completes.
    assert_eq!(s.recv_response().await.unwrap().status(), 200);
    assert_eq!(&s.recv_body(100).await.unwrap()[..], b"last");
}

/// A peer's uni stream that is opened (implicitly, by a higher-numbered one) but carries no
/// byte yet must not hold up the streams after it: here the QPACK encoder stream, which a
/// request depends on (Chromium opens its decoder stream lazily in just this way).
#[tokio::test]
async fn an_empty_uni_stream_does_not_hold_up_later_ones() {
    let (_ep, conn, _s) = raw_client().await;
    let silent = conn.open_uni().await.unwrap(); // stream 2: never written
    control_stream(&conn, &[0x04, 0x00]).await;
    let mut enc = conn.open_uni().await.unwrap();
    // Encoder stream: Set Dynamic Table Capacity 4096; Insert With Name Reference to the
    // static ":path" (index 1), value "/" (RFC 9204 §4.3).
    enc.write_all(&[0x02, 0x3f, 0xe1, 0x1f, 0xc1, 0x01, b'/'])
        .await
        .unwrap();
    // A request whose :path is dynamic entry 0: Required Insert Count 1 (encoded 2), base 1.
    let mut block = vec![0x02, 0x00, 0xd1, 0xd7, 0x50, 0x09];
    block.extend_from_slice(b"localhost");
    block.push(0x80);
    let mut req = vec![0x01, block.len() as u8];
    req.extend_from_slice(&block);
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&req).await.unwrap();
    send.finish().unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(64 * 1024))
        .await
        .expect("response within 5 s")
        .unwrap();
    // HEADERS frame first, then DATA "ok".
    assert_eq!(resp[0], 0x01, "response starts with HEADERS");
    assert!(resp.ends_with(b"ok"));
    drop((silent, enc));
}

/// A HEADERS frame: the field section prefix (Required Insert Count 0, Base 0), then `lines`.
fn headers_frame(lines: &[u8]) -> Vec<u8> {
    use kuai::kuai_proto::coding::BufMutExt;
    let mut f = Vec::new();
    f.put_var(0x01);
    f.put_var(lines.len() as u64 + 2);
    f.extend_from_slice(&[0x00, 0x00]);
    f.extend_from_slice(lines);
    f
}

/// A literal field line with a static name reference (RFC 9204 §4.5.4); `value` under 127
/// bytes.
fn literal(index: u8, value: &[u8]) -> Vec<u8> {
    assert!(index < 16 && value.len() < 127);
    let mut l = vec![0x50 | index, value.len() as u8];
    l.extend_from_slice(value);
    l
}

/// :method GET, :scheme https, :path / (static entries 17, 23, 1).
const GET_HTTPS_ROOT: [u8; 3] = [0xd1, 0xd7, 0xc1];

/// Sends one request on a new stream and returns how the server ended it: the response
/// bytes, or the reset code.
async fn raw_request(conn: &Connection, frame: &[u8]) -> Result<Vec<u8>, kuai::ReadError> {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(frame).await.unwrap();
    send.finish().unwrap();
    tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1 << 20))
        .await
        .expect("server answered within 5 s")
}

/// RFC 9114 §4.1.2, §4.3.1 and RFC 9110 §8.6: a request without :authority or Host, or with
/// a Content-Length that is not 1*DIGIT (or a list that disagrees), is malformed: the
/// stream is reset with H3_MESSAGE_ERROR and the connection lives on.
#[tokio::test]
async fn malformed_authority_and_content_length_reset_the_stream() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let authority = literal(0, b"localhost");
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    cases.push(("no :authority, no host", GET_HTTPS_ROOT.to_vec()));
    cases.push((
        "empty :authority",
        [&GET_HTTPS_ROOT[..], &literal(0, b"")].concat(),
    ));
    for cl in [&b"+5"[..], b"-5", b" 5", b"5 5", b"0x5", b"5, 6", b""] {
        // content-length is static entry 4.
        cases.push((
            "bad content-length",
            [&GET_HTTPS_ROOT[..], &authority, &literal(4, cl)].concat(),
        ));
    }
    for (what, lines) in &cases {
        let r = raw_request(&conn, &headers_frame(lines)).await;
        assert_eq!(
            r,
            Err(kuai::ReadError::Reset(Code::MESSAGE_ERROR.0)),
            "{what}: {lines:x?}"
        );
    }
    // Well-formed: :authority, or Host alone (static entry... none: literal name "host").
    let ok = raw_request(
        &conn,
        &headers_frame(&[&GET_HTTPS_ROOT[..], &authority].concat()),
    )
    .await
    .unwrap();
    assert!(ok.ends_with(b"ok"));
    // Literal field line with a literal name (RFC 9204 §4.5.6): "host: localhost".
    let mut host = vec![0x24];
    host.extend_from_slice(b"host");
    host.push(9);
    host.extend_from_slice(b"localhost");
    let ok = raw_request(
        &conn,
        &headers_frame(&[&GET_HTTPS_ROOT[..], &host].concat()),
    )
    .await
    .unwrap();
    assert!(ok.ends_with(b"ok"));
    assert!(conn.close_reason().is_none(), "the connection lives on");
}

/// RFC 9114 §10.5: a SETTINGS frame with thousands of entries costs the receiver work for
/// nothing. It closes the connection with H3_EXCESSIVE_LOAD.
#[tokio::test]
async fn settings_with_thousands_of_entries_are_excessive_load() {
    use kuai::kuai_proto::coding::BufMutExt;
    let (_ep, conn, _s) = raw_client().await;
    let mut payload = Vec::new();
    for n in 0..10_000u64 {
        payload.put_var(0x21 + 0x1f * n); // distinct reserved ids, each ignored alone
        payload.put_var(0);
    }
    assert!(payload.len() < 64 * 1024);
    let mut frame = Vec::new();
    frame.put_var(0x04);
    frame.put_var(payload.len() as u64);
    frame.extend_from_slice(&payload);
    control_stream(&conn, &frame).await;
    assert_eq!(closed_with(&conn).await, Code::EXCESSIVE_LOAD.0);
}

/// RFC 9114 §4.2.2: a header section larger than the SETTINGS_MAX_FIELD_SECTION_SIZE we
/// advertised (64 KiB; 500 cookie lines of 100 bytes count 69 KB) is refused for that
/// request only: the stream is reset with H3_MESSAGE_ERROR and nothing more of it is held.
#[tokio::test]
async fn oversized_header_section_resets_only_its_stream() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let mut lines = [&GET_HTTPS_ROOT[..], &literal(0, b"localhost")].concat();
    for _ in 0..500 {
        lines.extend_from_slice(&literal(5, &[b'c'; 100])); // cookie: static entry 5
    }
    let r = raw_request(&conn, &headers_frame(&lines)).await;
    assert_eq!(r, Err(kuai::ReadError::Reset(Code::MESSAGE_ERROR.0)));
    let ok = raw_request(
        &conn,
        &headers_frame(&[&GET_HTTPS_ROOT[..], &literal(0, b"localhost")].concat()),
    )
    .await
    .unwrap();
    assert!(ok.ends_with(b"ok"));
}

/// A HEADERS frame longer than the reader takes (here about 100 KB, past our 64 KiB
/// SETTINGS_MAX_FIELD_SECTION_SIZE) is that request's problem only (RFC 9114 §4.2.2): its
/// stream is reset with H3_MESSAGE_ERROR without the frame being buffered, and the
/// connection serves the next request.
#[tokio::test]
async fn an_oversized_headers_frame_resets_only_its_stream() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let mut lines = [&GET_HTTPS_ROOT[..], &literal(0, b"localhost")].concat();
    for _ in 0..1000 {
        lines.extend_from_slice(&literal(5, &[b'c'; 100]));
    }
    let frame = headers_frame(&lines);
    assert!(frame.len() > 100_000);
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    // The server may stop the stream before all of it is written.
    let _ = send.write_all(&frame).await;
    let _ = send.finish();
    let r = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1 << 20))
        .await
        .expect("server answered within 5 s");
    assert_eq!(r, Err(kuai::ReadError::Reset(Code::MESSAGE_ERROR.0)));
    let ok = raw_request(
        &conn,
        &headers_frame(&[&GET_HTTPS_ROOT[..], &literal(0, b"localhost")].concat()),
    )
    .await
    .unwrap();
    assert!(ok.ends_with(b"ok"));
    assert!(conn.close_reason().is_none());
}

/// A GET whose HEADERS frame names dynamic entry 0: Required Insert Count 1 (encoded 2),
/// Base 1 (delta 0), GET https /, then entry 0 (indexed, relative index 0).
fn dynamic_entry_headers_frame() -> Vec<u8> {
    let mut block = vec![0x02, 0x00];
    block.extend_from_slice(&GET_HTTPS_ROOT);
    block.push(0x80);
    let mut frame = vec![0x01, block.len() as u8];
    frame.extend_from_slice(&block);
    frame
}

/// The first instruction on the server's QPACK decoder stream (of its uni streams: control,
/// QPACK encoder, QPACK decoder, type 0x03), within 3 s.
async fn first_decoder_instruction(conn: &kuai::Connection) -> Vec<u8> {
    decoder_instruction_within(conn, Duration::from_secs(3))
        .await
        .expect("a decoder instruction within 3 s")
}

/// The first instruction on the server's QPACK decoder stream, if one comes within `wait`.
async fn decoder_instruction_within(conn: &kuai::Connection, wait: Duration) -> Option<Vec<u8>> {
    let mut decoder = None;
    tokio::time::timeout(wait, async {
        loop {
            let mut uni = conn.accept_uni().await.unwrap();
            let first = uni.read_chunk(1).await.unwrap().unwrap();
            if first[0] != 0x03 {
                std::mem::forget(uni);
                continue;
            }
            let mut got = Vec::new();
            let uni = decoder.insert(uni);
            while got.is_empty() {
                got.extend_from_slice(&uni.read_chunk(64).await.unwrap().unwrap());
            }
            return got;
        }
    })
    .await
    .ok()
    .inspect(|_| std::mem::forget(decoder))
}

/// A request whose handler answers without reading the body: what the client still sends
/// on the stream (here, trailers after the DATA it has sent) is never decoded, so the server
/// cancels the stream towards the client's encoder (RFC 9204 §4.4.2, "abandons reading"),
/// which otherwise would keep such a section outstanding, the entries it names pinned. A
/// request that had ended (its FIN came with the head) needs no cancellation, and gets none.
#[tokio::test]
async fn a_request_body_the_handler_leaves_unread_is_cancelled() {
    let mut head = GET_HTTPS_ROOT.to_vec();
    head.extend(literal(0, b"localhost"));
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&headers_frame(&head)).await.unwrap();
    send.write_all(&[0x00, 0x02, b'h', b'i']).await.unwrap();
    let answer = recv.read_to_end(1 << 16).await.unwrap();
    assert!(answer.ends_with(b"ok"));
    assert_eq!(first_decoder_instruction(&conn).await, [0x40]);
    assert!(conn.close_reason().is_none());

    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let ok = raw_request(&conn, &headers_frame(&head)).await.unwrap();
    assert!(ok.ends_with(b"ok"));
    let none = decoder_instruction_within(&conn, Duration::from_millis(500)).await;
    assert_eq!(none, None, "a cancellation for a request that had ended");
}

/// A request head waiting on QPACK (its section names a dynamic entry the encoder stream
/// has not brought) whose stream the client then resets is given up: the server's decoder
/// stream carries a Stream Cancellation for it (RFC 9204 §2.2.2.2, §4.4.2), instead of the
/// server waiting on the entry for as long as the connection lives.
#[tokio::test]
async fn a_blocked_head_whose_stream_is_reset_is_cancelled() {
    // Blocked until the first insert, which never comes.
    reset_while_blocked_is_cancelled(&dynamic_entry_headers_frame()).await;
}

/// Sends `bytes` on the first request stream, lets the server read them and block on a
/// section, resets the stream, and expects the server's Stream Cancellation for it.
async fn reset_while_blocked_is_cancelled(bytes: &[u8]) {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    assert_eq!(send.id().0, 0);
    send.write_all(bytes).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    send.reset(Code::REQUEST_CANCELLED.0).unwrap();
    let cancelled = first_decoder_instruction(&conn).await;
    // Stream Cancellation (01xxxxxx) for stream 0.
    assert_eq!(cancelled, [0x40]);
    assert!(conn.close_reason().is_none());
}

/// The same for a trailer section after a decoded head: blocked on QPACK, then the stream
/// reset: the section is cancelled (it stayed outstanding at the peer's encoder, pinning
/// its table, once any section of the stream had been decoded).
#[tokio::test]
async fn blocked_trailers_whose_stream_is_reset_are_cancelled() {
    let mut head = vec![0xd1, 0xd7];
    head.extend(literal(1, b"/read-all"));
    head.extend(literal(0, b"localhost"));
    let mut bytes = headers_frame(&head);
    bytes.extend_from_slice(&[0x00, 0x02, b'h', b'i']);
    // Trailers naming the first dynamic entry, which never comes.
    bytes.extend(dynamic_entry_headers_frame());
    reset_while_blocked_is_cancelled(&bytes).await;
}

/// RFC 9204 §4.2: a peer that stops our QPACK decoder stream closed a critical stream: the
/// connection ends with H3_CLOSED_CRITICAL_STREAM when we next write there (the instructions
/// piled up unsent until the backlog limit, then H3_EXCESSIVE_LOAD).
#[tokio::test]
async fn stopping_our_decoder_stream_closes_the_connection() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let mut uni = conn.accept_uni().await.unwrap();
            let first = uni.read_chunk(1).await.unwrap().unwrap();
            if first[0] == 0x03 {
                uni.stop(Code::NO_ERROR.0).unwrap();
                return;
            }
            std::mem::forget(uni);
        }
    })
    .await
    .expect("the server's decoder stream");
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Our encoder stream: Set Dynamic Table Capacity 100, Insert With Literal Name a: b. The
    // server's decoder answers with an Insert Count Increment on the stopped stream.
    let mut enc = conn.open_uni().await.unwrap();
    enc.write_all(&[0x02, 0x3f, 0x45, 0x41, b'a', 0x01, b'b'])
        .await
        .unwrap();
    assert_eq!(closed_with(&conn).await, Code::CLOSED_CRITICAL_STREAM.0);
    std::mem::forget(enc);
}

/// A request head waiting on QPACK behind which the client goes on sending (4 MiB of DATA
/// frames) does not make the server hold all of it: past 64 KiB read ahead the stream is
/// left unread, so flow control stops the client; its reset is still seen and the head
/// cancelled.
#[tokio::test]
async fn a_blocked_head_does_not_buffer_what_follows_it() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let frame = dynamic_entry_headers_frame();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&frame).await.unwrap();
    // DATA frames of 16 KiB (type 0, length 0x4000 as a two-byte varint).
    let mut data = vec![0x00, 0x40 | 0x40, 0x00];
    data.resize(3 + 16 * 1024, 0x61);
    let pushed = tokio::time::timeout(Duration::from_secs(2), async {
        for _ in 0..256 {
            send.write_all(&data).await.unwrap();
        }
    })
    .await;
    assert!(
        pushed.is_err(),
        "4 MiB went into a stream whose head is blocked"
    );
    send.reset(Code::REQUEST_CANCELLED.0).unwrap();
    let cancelled = first_decoder_instruction(&conn).await;
    assert_eq!(cancelled, [0x40]);
    assert!(conn.close_reason().is_none());
}

/// RFC 9114 §6.2: a unidirectional stream of an unknown type is not read: the server stops
/// it with H3_STREAM_CREATION_ERROR, so nothing of it is buffered, however much is sent.
#[tokio::test]
async fn unknown_uni_streams_are_stopped() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    for ty in [0x21u8, 0x3f] {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(&[ty]).await.unwrap();
        let stopped = tokio::time::timeout(Duration::from_secs(5), async {
            // Keep writing until the server's STOP_SENDING arrives.
            loop {
                if let Err(e) = s.write_all(&[0u8; 1024]).await {
                    return e;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("stopped within 5 s");
        assert_eq!(
            stopped,
            kuai::WriteError::Stopped(Code::STREAM_CREATION_ERROR.0)
        );
    }
    assert!(conn.close_reason().is_none());
}

/// RFC 9204 §7.4 and RFC 9114 §10.5: what we queue for our QPACK decoder stream (Section
/// Acknowledgments here) is bounded. A client that makes the server acknowledge sections but
/// never reads the decoder stream (its 1 KiB stream window and the server's 1 KiB send
/// buffer fill) makes the queue reach `Config::critical_backlog` and the connection close
/// with H3_EXCESSIVE_LOAD, instead of growing for as long as requests come.
#[tokio::test]
async fn unread_decoder_stream_is_bounded() {
    let (mut scfg, cert) = ServerConfig::self_signed(&["localhost"], &[kuai_h3::ALPN]).unwrap();
    scfg.transport(kuai::TransportConfig {
        send_buffer: 1024,
        ..Default::default()
    });
    let sep = Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = sep.local_addr().unwrap();
    let e = sep.clone();
    tokio::spawn(async move {
        while let Some(c) = e.accept().await {
            tokio::spawn(async move {
                if let Ok(conn) = c.await {
                    let config = Config {
                        critical_backlog: 512,
                        ..Config::default()
                    };
                    let _ = kuai_h3::serve(conn, config, handler).await;
                }
            });
        }
    });
    let mut ccfg = ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap();
    ccfg.transport(kuai::TransportConfig {
        stream_receive_window: 1024,
        max_stream_receive_window: 1024,
        ..Default::default()
    });
    let ep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = ep
        .connect_with(ccfg, addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    control_stream(&conn, &[0x04, 0x00]).await;
    let mut enc = conn.open_uni().await.unwrap();
    // Set Dynamic Table Capacity 4096; insert :authority "localhost" (static name 0).
    let mut ins = vec![0x02, 0x3f, 0xe1, 0x1f, 0xc0, 0x09];
    ins.extend_from_slice(b"localhost");
    enc.write_all(&ins).await.unwrap();
    // Each request references dynamic entry 0 (Required Insert Count 1, encoded 2), so the
    // server acknowledges each section on its decoder stream.
    let frame = dynamic_entry_headers_frame();
    let mut sent = 0;
    let closed = 'outer: {
        for _ in 0..200 {
            let mut batch = Vec::new();
            for _ in 0..20 {
                let c = conn.clone();
                let frame = frame.clone();
                batch.push(tokio::spawn(async move {
                    let (mut send, mut recv) = c.open_bi().await.ok()?;
                    send.write_all(&frame).await.ok()?;
                    send.finish().ok()?;
                    recv.read_to_end(1 << 16).await.ok()
                }));
            }
            for t in batch {
                let _ = t.await;
                sent += 1;
            }
            if let Some(e) = conn.close_reason() {
                break 'outer Some(e);
            }
        }
        None
    };
    // 4,000 requests at 2-3 bytes of acknowledgment each is over 8 KiB for the decoder stream.
    eprintln!("closed after {sent} requests: {closed:?}");
    match closed {
        Some(ConnectionError::ApplicationClosed { code, .. }) => {
            assert_eq!(code, Code::EXCESSIVE_LOAD.0, "after {sent} requests")
        }
        other => panic!("after {sent} requests the connection is {other:?}"),
    }
    drop(enc);
}

/// A request stream whose head never completes (opened empty, or a HEADERS frame cut
/// short) is rejected after `Config::request_head_timeout` with H3_REQUEST_REJECTED: a
/// client cannot hold the server's request slots with heads it never finishes.
#[tokio::test]
async fn an_unfinished_request_head_is_rejected_after_the_timeout() {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[kuai_h3::ALPN]).unwrap();
    let sep = Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = sep.local_addr().unwrap();
    let e = sep.clone();
    tokio::spawn(async move {
        while let Some(c) = e.accept().await {
            tokio::spawn(async move {
                if let Ok(conn) = c.await {
                    let config = Config {
                        request_head_timeout: Some(Duration::from_millis(300)),
                        ..Config::default()
                    };
                    let _ = kuai_h3::serve(conn, config, handler).await;
                }
            });
        }
    });
    let ep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = ep
        .connect_with(
            ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    control_stream(&conn, &[0x04, 0x00]).await;
    // A HEADERS frame declaring 20 bytes, 3 of them sent; and a stream with one byte only
    // (a stream the server learns of needs a byte).
    let mut streams = Vec::new();
    for first in [&[0x01u8, 20, 0x00, 0x00, 0xd1][..], &[0x01]] {
        let (mut send, recv) = conn.open_bi().await.unwrap();
        send.write_all(first).await.unwrap();
        streams.push((send, recv));
    }
    let t = std::time::Instant::now();
    for (_send, mut recv) in streams {
        let r = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1024))
            .await
            .expect("answered within 5 s");
        assert_eq!(r, Err(kuai::ReadError::Reset(Code::REQUEST_REJECTED.0)));
    }
    let took = t.elapsed();
    eprintln!("rejected after {took:?}");
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert!(conn.close_reason().is_none(), "the connection lives on");
}

// Found by the h3_control fuzz target: the control and push stream rules of RFC 9114 that
// kuai-h3 did not enforce.

/// Only servers push: a client's push stream is H3_STREAM_CREATION_ERROR (RFC 9114 §6.2.2).
#[tokio::test]
async fn push_stream_from_a_client_is_a_stream_creation_error() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let mut s = conn.open_uni().await.unwrap();
    s.write_all(&[0x01, 0x00]).await.unwrap();
    std::mem::forget(s);
    assert_eq!(closed_with(&conn).await, Code::STREAM_CREATION_ERROR.0);
}

/// The server never promised a push, so CANCEL_PUSH names one it cannot have (§7.2.3).
#[tokio::test]
async fn cancel_push_to_a_server_is_an_id_error() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00, 0x03, 0x01, 0x00]).await;
    assert_eq!(closed_with(&conn).await, Code::ID_ERROR.0);
}

/// MAX_PUSH_ID cannot go down (§7.2.7).
#[tokio::test]
async fn max_push_id_cannot_go_down() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00, 0x0d, 0x01, 0x09, 0x0d, 0x01, 0x03]).await;
    assert_eq!(closed_with(&conn).await, Code::ID_ERROR.0);
}

/// A raw QUIC server connection with a kuai-h3 client at the other end (for frames a
/// kuai server would never send): the two endpoints, the server's side, the client.
async fn raw_server_with_client() -> ((Endpoint, Endpoint), Connection, kuai_h3::Client) {
    let (scfg, cert) = ServerConfig::self_signed(&["localhost"], &[kuai_h3::ALPN]).unwrap();
    let sep = Endpoint::server(scfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = sep.local_addr().unwrap();
    let e = sep.clone();
    let raw = tokio::spawn(async move { e.accept().await.unwrap().await.unwrap() });
    let cep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = cep
        .connect_with(
            ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap(),
            addr,
            "localhost",
        )
        .unwrap()
        .await
        .unwrap();
    let client = kuai_h3::Client::new(conn, Config::default()).await.unwrap();
    let raw = raw.await.unwrap();
    ((sep, cep), raw, client)
}

/// A client that sent no MAX_PUSH_ID allows no push ID: CANCEL_PUSH from the server names one
/// beyond what is allowed (§7.2.3).
#[tokio::test]
async fn cancel_push_to_a_client_is_an_id_error() {
    let (_eps, raw, _client) = raw_server_with_client().await;
    control_stream(&raw, &[0x04, 0x00, 0x03, 0x01, 0x00]).await;
    assert_eq!(closed_with(&raw).await, Code::ID_ERROR.0);
}

/// RFC 9114 §4.1: a server may stop a request stream once it has answered, but a client
/// still finishing its request (the h3 crate's client writes a GREASE frame as it finishes)
/// may take that stop for a failed request. kuai's server says nothing while only the FIN is
/// left to come, and still stops a body its handler does not read.
#[tokio::test]
async fn an_answered_request_is_stopped_only_if_a_body_comes() {
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    let get = headers_frame(&[&GET_HTTPS_ROOT[..], &literal(0, b"localhost")].concat());
    let answered = |mut recv: kuai::RecvStream| async move {
        let resp = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(64 * 1024))
            .await
            .expect("response within 5 s")
            .unwrap();
        assert!(resp.ends_with(b"ok"));
    };
    // The head alone; the FIN comes long after the answer (200 ms: many round trips here).
    let (mut send, recv) = conn.open_bi().await.unwrap();
    send.write_all(&get).await.unwrap();
    answered(recv).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A reserved frame (RFC 9114 §7.2.8), then the FIN: the stream was not stopped.
    send.write_all(&[0x21, 0x00]).await.unwrap();
    send.finish().unwrap();
    // A body after the answer: the server asks for it to stop (H3_NO_ERROR).
    let (mut send, recv) = conn.open_bi().await.unwrap();
    send.write_all(&get).await.unwrap();
    answered(recv).await;
    let stopped = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            // DATA frames of 1 KiB until the STOP_SENDING arrives.
            let mut frame = vec![0x00, 0x44, 0x00];
            frame.resize(3 + 1024, b'b');
            if let Err(e) = send.write_all(&frame).await {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("stopped within 5 s");
    assert_eq!(stopped, kuai::WriteError::Stopped(Code::NO_ERROR.0));
    assert!(conn.close_reason().is_none());
}

/// RFC 9114 §7.2.5: a client that never sent MAX_PUSH_ID treats a PUSH_PROMISE as a push ID
/// beyond its maximum, H3_ID_ERROR (a server receiving one says H3_FRAME_UNEXPECTED).
#[tokio::test]
async fn push_promise_to_a_client_is_an_id_error() {
    let (_eps, raw, client) = raw_server_with_client().await;
    control_stream(&raw, &[0x04, 0x00]).await;
    let req = Request::get("https://localhost/").body(()).unwrap();
    let mut stream = client.send_request(req).await.unwrap();
    stream.finish().unwrap();
    let (mut send, _recv) = raw.accept_bi().await.unwrap();
    // PUSH_PROMISE: push ID 0, an empty field section.
    send.write_all(&[0x05, 0x03, 0x00, 0x00, 0x00])
        .await
        .unwrap();
    assert!(stream.recv_response().await.is_err());
    assert_eq!(closed_with(&raw).await, Code::ID_ERROR.0);
}

/// RFC 9297 §2.1.1: SETTINGS_H3_DATAGRAM=1 from a peer that did not send the QUIC
/// max_datagram_frame_size transport parameter is H3_SETTINGS_ERROR.
#[tokio::test]
async fn h3_datagram_without_quic_datagrams_is_a_settings_error() {
    let (_sep, addr, cert) = server().await;
    let ep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut ccfg = ClientConfig::with_root(cert, &[kuai_h3::ALPN]).unwrap();
    ccfg.transport(kuai::TransportConfig {
        max_datagram_frame_size: None,
        ..Default::default()
    });
    let conn = ep
        .connect_with(ccfg, addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    control_stream(&conn, &[0x04, 0x02, 0x33, 0x01]).await;
    assert_eq!(closed_with(&conn).await, Code::SETTINGS_ERROR.0);
}

/// RFC 9114 §4.1: a HEADERS frame after the trailers is a frame out of sequence, a
/// connection error, whatever its size: one over the field section limit was answered
/// with a stream error (H3_MESSAGE_ERROR) as an oversized trailer section would be.
#[tokio::test]
async fn an_oversized_headers_after_trailers_is_frame_unexpected() {
    use kuai::kuai_proto::coding::BufMutExt;
    let (_ep, conn, _s) = raw_client().await;
    control_stream(&conn, &[0x04, 0x00]).await;
    // GET https, :path /read-all (its handler reads the body and trailers), :authority.
    let mut lines = GET_HTTPS_ROOT[..2].to_vec();
    lines.extend(literal(1, b"/read-all"));
    lines.extend(literal(0, b"localhost"));
    let mut b = headers_frame(&lines);
    // Trailers: one literal field (x-t: 1).
    b.extend(headers_frame(&[0x23, b'x', b'-', b't', 0x01, b'1']));
    // A third HEADERS announcing 70,000 bytes (over the 64 KiB limit), a few of them sent.
    b.put_var(0x01);
    b.put_var(70_000);
    b.extend_from_slice(&[0, 0, 0, 0]);
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&b).await.unwrap();
    std::mem::forget(send);
    assert_eq!(closed_with(&conn).await, Code::FRAME_UNEXPECTED.0);
}
