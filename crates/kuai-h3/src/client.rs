//! The HTTP/3 client.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::{Request, Response};

use crate::conn::{self, CloseGuard, Config, Shared};
use crate::error::{Code, Error, H3Error};
use crate::message;
use crate::stream::{RecvHalf, RequestStream};

/// An HTTP/3 client on one QUIC connection. Cheap to clone; requests run concurrently on
/// their own streams. The connection closes when the last clone is dropped.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
    _guard: Arc<CloseGuard>,
}

impl Client {
    /// Starts HTTP/3 on an established connection (ALPN `h3`).
    pub async fn new(quic: kuai::Connection, config: Config) -> Result<Self, Error> {
        let shared = conn::start(quic, kuai_proto::Side::Client, config).await?;
        // Servers must not open bidirectional streams (RFC 9114 §6.1).
        let s = shared.clone();
        tokio::spawn(async move {
            if s.quic.accept_bi().await.is_ok() {
                s.fail(H3Error::new(
                    Code::STREAM_CREATION_ERROR,
                    "server opened a bidirectional stream",
                ));
            }
        });
        Ok(Self {
            _guard: Arc::new(CloseGuard(shared.clone())),
            shared,
        })
    }

    /// Sends a request's head. Write the body with [`RequestStream::send_data`], end it with
    /// [`RequestStream::finish`], then read the answer with [`RequestStream::recv_response`].
    pub async fn send_request(&self, req: Request<()>) -> Result<RequestStream, Error> {
        if self.shared.lock().goaway_received.is_some() {
            return Err(Error::GoingAway);
        }
        let (parts, ()) = req.into_parts();
        if parts.extensions.get::<message::Protocol>().is_some() {
            let peer = self.shared.peer_settings().await?;
            if !peer.enable_connect_protocol {
                return Err(Error::Malformed("server does not accept extended CONNECT"));
            }
        }
        let fields = message::request_fields(&parts).map_err(Error::Malformed)?;
        let (send, recv) = self.shared.quic.open_bi().await?;
        let mut stream = RequestStream::new(self.shared.clone(), send, recv);
        stream
            .recv
            .set_head_request(parts.method == http::Method::HEAD);
        stream.send.send_fields(&fields).await?;
        Ok(stream)
    }

    /// Sends a request with a whole body and reads the whole response (up to `limit` bytes).
    pub async fn request(
        &self,
        req: Request<Bytes>,
        limit: usize,
    ) -> Result<Response<Bytes>, Error> {
        let (parts, body) = req.into_parts();
        let mut stream = self.send_request(Request::from_parts(parts, ())).await?;
        stream.send_data(body).await?;
        stream.finish()?;
        let resp = stream.recv_response().await?;
        let mut out = BytesMut::new();
        while let Some(d) = stream.recv_data().await? {
            if out.len() + d.len() > limit {
                stream.cancel(Code::REQUEST_CANCELLED);
                return Err(Error::TooLarge);
            }
            out.extend_from_slice(&d);
        }
        let (parts, ()) = resp.into_parts();
        Ok(Response::from_parts(parts, out.freeze()))
    }

    /// GET `uri` (absolute, `https://authority/path`), reading up to `limit` bytes.
    pub async fn get(&self, uri: &str, limit: usize) -> Result<Response<Bytes>, Error> {
        let req = Request::get(uri)
            .body(Bytes::new())
            .map_err(|_| Error::Malformed("invalid URI"))?;
        self.request(req, limit).await
    }

    /// Closes the connection (H3_NO_ERROR).
    pub fn close(&self) {
        self.shared.quic.close(Code::NO_ERROR.0, b"");
    }

    /// Whether the server sent GOAWAY (RFC 9114 §5.2): no new request may go on this
    /// connection; [`send_request`](Self::send_request) fails with [`Error::GoingAway`].
    pub fn is_going_away(&self) -> bool {
        self.shared.lock().goaway_received.is_some()
    }

    /// The underlying QUIC connection.
    pub fn quic(&self) -> &kuai::Connection {
        &self.shared.quic
    }

    /// The server's HTTP/3 settings, once they arrived.
    pub async fn peer_settings(&self) -> Result<crate::frame::Settings, Error> {
        self.shared.peer_settings().await
    }
}

impl RequestStream {
    /// Client: reads the response head, skipping informational (1xx) responses. A malformed
    /// one resets both directions (RFC 9114 §4.1.2).
    pub async fn recv_response(&mut self) -> Result<Response<()>, Error> {
        let r = self.recv.recv_response().await;
        if let Err(Error::Malformed(_)) = &r {
            self.send.reset(Code::MESSAGE_ERROR);
        }
        r
    }
}

/// Informational (1xx) responses a client reads before the final one.
const MAX_INTERIM: usize = 32;

impl RecvHalf {
    /// Client: reads the next response head, informational (1xx: 100 Continue, 103 Early
    /// Hints) or final; a caller that wants the 1xx reads until a final one, and answers
    /// for how many it reads ([`recv_response`](Self::recv_response) skips them).
    pub async fn recv_any_response(&mut self) -> Result<Response<()>, Error> {
        let Some(fields) = self.recv_fields().await? else {
            return Err(Error::StreamReset(Code::REQUEST_INCOMPLETE));
        };
        let parts = match message::parse_response(&fields) {
            Ok(p) => p,
            Err(why) => return Err(self.malformed(why)),
        };
        if parts.status == http::StatusCode::SWITCHING_PROTOCOLS {
            // RFC 9114 §4.5: no 101 in HTTP/3.
            return Err(self.malformed("101 Switching Protocols"));
        }
        if !parts.status.is_informational() {
            self.set_response_head(&parts.status, &parts.headers)?;
        }
        Ok(Response::from_parts(parts, ()))
    }

    /// Client: reads the response head, skipping informational (1xx) responses (for a
    /// request whose body is still being sent from the [`SendHalf`](crate::SendHalf)).
    pub async fn recv_response(&mut self) -> Result<Response<()>, Error> {
        let mut interim = 0;
        loop {
            let resp = self.recv_any_response().await?;
            if !resp.status().is_informational() {
                return Ok(resp);
            }
            // A server may send several (103 then 100, say), not without end: each is work
            // for nothing, and the request would never be answered.
            interim += 1;
            if interim > MAX_INTERIM {
                return Err(self.malformed("too many informational (1xx) responses"));
            }
        }
    }
}
