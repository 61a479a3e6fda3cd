//! Malformed HTTP/3 from a raw QUIC peer: each case ends the request or the connection with
//! the RFC 9114 error code.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use kuai::{ClientConfig, Connection, ConnectionError, Endpoint, ServerConfig};
use kuai_h3::{Body, Code, Config, RecvHalf};

async fn handler(_req: Request<RecvHalf>) -> Response<Body> {
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

/// A client that sent no MAX_PUSH_ID allows no push ID: CANCEL_PUSH from the server names one
/// beyond what is allowed (§7.2.3).
#[tokio::test]
async fn cancel_push_to_a_client_is_an_id_error() {
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
    let _client = kuai_h3::Client::new(conn, Config::default()).await.unwrap();
    let raw = raw.await.unwrap();
    control_stream(&raw, &[0x04, 0x00, 0x03, 0x01, 0x00]).await;
    assert_eq!(closed_with(&raw).await, Code::ID_ERROR.0);
}
