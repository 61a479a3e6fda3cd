//! A request stream: HEADERS, DATA and trailers in both directions (RFC 9114 §4.1).

use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use kuai::{RecvStream, SendStream};

use crate::conn::Shared;
use crate::error::{Code, Error, H3Error};
use crate::frame::{self, Frame, FrameReader};
use crate::message::{self, Fields};

/// What a request stream may hold read ahead while its head waits for the QPACK encoder
/// stream (RFC 9204 §2.1.2): past it, the stream is left unread until the head decodes.
const BLOCKED_READ_AHEAD: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvState {
    /// Waiting for the (next) header section.
    Headers,
    /// Reading the body.
    Body,
    /// Trailers arrived; only the end of the stream may follow.
    Trailers,
    Done,
}

/// A request stream (RFC 9114 §4.1): a [`SendHalf`] and a [`RecvHalf`] on one bidirectional
/// QUIC stream. Split it to send and receive from different tasks.
pub struct RequestStream {
    pub(crate) send: SendHalf,
    pub(crate) recv: RecvHalf,
}

/// The receiving half of a request stream: a header section, the body, trailers.
pub struct RecvHalf {
    pub(crate) shared: Arc<Shared>,
    recv: RecvStream,
    id: u64,
    reader: FrameReader,
    state: RecvState,
    trailers: Option<HeaderMap>,
    /// A trailer section read by [`RecvHalf::poll_data`], decoded by `recv_trailers`.
    trailer_block: Option<Bytes>,
    expected_len: Option<u64>,
    received_len: u64,
    /// A header block was decoded, so QPACK needs no stream cancellation.
    decoded: bool,
    /// A later section (trailers, the final response after a 1xx) is being decoded, or was
    /// skipped undecoded (too large): the peer's encoder holds it outstanding until a
    /// Stream Cancellation (RFC 9204 §4.4.2) if it is never acknowledged.
    section_pending: bool,
    /// A Stream Cancellation went to the peer's encoder: no section of this stream may be
    /// decoded (acknowledged) after it.
    cancelled: bool,
    /// Client: the request was HEAD, so the response has no body whatever it declares.
    head_request: bool,
    /// The stream's end was read (ahead, while a section waited on QPACK): the frame reader
    /// holds all that is left, and the stream is not read again.
    fin: bool,
}

/// The sending half of a request stream.
pub struct SendHalf {
    pub(crate) shared: Arc<Shared>,
    send: Option<SendStream>,
    /// The stream once finished: kept to wait for its acknowledgement, or to reset what
    /// is still undelivered ([`finished`](Self::finished), [`reset`](Self::reset)).
    ended: Option<SendStream>,
    id: u64,
    /// The peer stopped reading with H3_NO_ERROR: it has what it needs (RFC 9114 §4.1.1),
    /// so whatever else we send is dropped quietly.
    peer_done: bool,
}

impl RequestStream {
    pub(crate) fn new(shared: Arc<Shared>, send: SendStream, recv: RecvStream) -> Self {
        let id = recv.id().0;
        crate::datagram::register(&shared, id);
        let max = shared.config.max_field_section_size.max(16 * 1024);
        Self {
            send: SendHalf {
                shared: shared.clone(),
                send: Some(send),
                ended: None,
                id,
                peer_done: false,
            },
            recv: RecvHalf {
                shared,
                recv,
                id,
                reader: FrameReader::new(max),
                state: RecvState::Headers,
                trailers: None,
                trailer_block: None,
                expected_len: None,
                received_len: 0,
                decoded: false,
                section_pending: false,
                cancelled: false,
                head_request: false,
                fin: false,
            },
        }
    }

    /// The QUIC stream ID.
    pub fn id(&self) -> u64 {
        self.recv.id
    }

    /// Separates the two directions.
    pub fn split(self) -> (SendHalf, RecvHalf) {
        (self.send, self.recv)
    }

    /// See [`RecvHalf::recv_data`].
    pub async fn recv_data(&mut self) -> Result<Option<Bytes>, Error> {
        self.recv.recv_data().await
    }

    /// See [`RecvHalf::recv_body`].
    pub async fn recv_body(&mut self, limit: usize) -> Result<Bytes, Error> {
        self.recv.recv_body(limit).await
    }

    /// See [`RecvHalf::recv_trailers`].
    pub async fn recv_trailers(&mut self) -> Result<Option<HeaderMap>, Error> {
        self.recv.recv_trailers().await
    }

    /// See [`SendHalf::send_data`].
    pub async fn send_data(&mut self, data: Bytes) -> Result<(), Error> {
        self.send.send_data(data).await
    }

    /// See [`SendHalf::send_trailers`].
    pub async fn send_trailers(&mut self, trailers: &HeaderMap) -> Result<(), Error> {
        self.send.send_trailers(trailers).await
    }

    /// See [`SendHalf::finish`].
    pub fn finish(&mut self) -> Result<(), Error> {
        self.send.finish()
    }

    /// See [`SendHalf::finished`].
    pub async fn finished(&mut self) -> Result<(), Error> {
        self.send.finished().await
    }

    /// Abandons the stream in both directions with `code` (e.g. H3_REQUEST_CANCELLED).
    pub fn cancel(&mut self, code: Code) {
        self.send.reset(code);
        self.recv.stop(code);
    }

    /// Rejects a malformed message (RFC 9114 §4.1.2).
    pub(crate) fn malformed(&mut self, why: &'static str) -> Error {
        self.send.reset(Code::MESSAGE_ERROR);
        self.recv.malformed(why)
    }

    /// Sets the priority of what we send (RFC 9218).
    pub fn set_priority(&self, p: kuai::Priority) {
        self.send.set_priority(p);
    }

    /// Sends an HTTP datagram bound to this stream (RFC 9297).
    pub fn send_datagram(&self, payload: &[u8]) -> Result<(), Error> {
        crate::datagram::send(&self.send.shared, self.recv.id, payload)
    }

    /// Receives the next HTTP datagram bound to this stream.
    pub async fn recv_datagram(&self) -> Result<Bytes, Error> {
        crate::datagram::recv(&self.recv.shared, self.recv.id).await
    }
}

impl RecvHalf {
    /// Server: whether some of the request arrived in 0-RTT (see
    /// [`kuai::RecvStream::received_in_0rtt`]).
    pub fn received_in_0rtt(&self) -> bool {
        self.recv.received_in_0rtt()
    }

    /// The QUIC stream ID.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Stops reading (STOP_SENDING with `code`).
    pub fn stop(&mut self, code: Code) {
        self.abandon(code, false);
    }

    /// Stops reading the stream before its end (`unless_ending`: a STOP_SENDING only if
    /// more than the FIN is to come). What the peer sent or may still send on it is never
    /// decoded: a trailer section among it would stay outstanding at the peer's encoder, the
    /// entries it names never evicted, so the stream is cancelled towards it (RFC 9204
    /// §4.4.2: "abandons reading of a stream") unless nothing but the end was left.
    fn abandon(&mut self, code: Code, unless_ending: bool) {
        if self.state == RecvState::Done {
            return;
        }
        self.state = RecvState::Done;
        let more = if unless_ending {
            self.recv.stop_unless_ending(code.0)
        } else {
            self.recv.stop(code.0)
        };
        if !self.cancelled
            && (matches!(more, Ok(true))
                || self.reader.buffered() > 0
                || self.trailer_block.is_some()
                || self.section_pending)
        {
            self.cancelled = true;
            self.trailer_block = None;
            self.shared.cancel_stream(self.id);
        }
    }

    fn conn_error(&self, e: kuai::ConnectionError) -> Error {
        match self.shared.error() {
            Some(h3) => Error::Protocol(h3),
            None => Error::Connection(e),
        }
    }

    /// Reads the next frame; `None` at the end of the stream.
    async fn read_frame(&mut self) -> Result<Option<Frame>, Error> {
        loop {
            match self.reader.next_frame() {
                Ok(Some(f)) => return Ok(Some(f)),
                Ok(None) => {}
                Err(e) => {
                    self.shared.fail(e.clone());
                    return Err(Error::Protocol(e));
                }
            }
            let next = if self.fin {
                Ok(None)
            } else {
                self.recv.read_chunk(64 * 1024).await
            };
            match next {
                Ok(Some(chunk)) => self.reader.push_bytes(chunk),
                Ok(None) => {
                    if self.reader.is_mid_frame() {
                        let e = H3Error::new(Code::FRAME_ERROR, "stream ended inside a frame");
                        self.shared.fail(e.clone());
                        return Err(Error::Protocol(e));
                    }
                    return Ok(None);
                }
                Err(kuai::ReadError::Reset(code)) => return Err(Error::StreamReset(Code(code))),
                Err(kuai::ReadError::ConnectionLost(e)) => return Err(self.conn_error(e)),
                Err(kuai::ReadError::ZeroRttRejected) => return Err(Error::ZeroRttRejected),
                Err(_) => return Err(Error::StreamReset(Code::REQUEST_CANCELLED)),
            }
        }
    }

    /// A frame a request stream may not carry: H3_FRAME_UNEXPECTED, but a PUSH_PROMISE to
    /// a client, which never sent MAX_PUSH_ID, carries a push ID past its maximum:
    /// H3_ID_ERROR (RFC 9114 §7.2.5).
    fn not_allowed(&self, f: &Frame) -> Error {
        if matches!(f, Frame::PushPromise) && !self.shared.side.is_server() {
            let e = H3Error::new(Code::ID_ERROR, "PUSH_PROMISE without MAX_PUSH_ID");
            self.shared.fail(e.clone());
            return Error::Protocol(e);
        }
        self.unexpected("frame not allowed on a request stream")
    }

    fn unexpected(&self, what: &'static str) -> Error {
        let e = H3Error::new(Code::FRAME_UNEXPECTED, what);
        self.shared.fail(e.clone());
        Error::Protocol(e)
    }

    /// Rejects a malformed message: stops the stream with H3_MESSAGE_ERROR (RFC 9114 §4.1.2).
    pub(crate) fn malformed(&mut self, why: &'static str) -> Error {
        self.abandon(Code::MESSAGE_ERROR, false);
        Error::Malformed(why)
    }

    /// The next header section's fields; `None` if the stream ends first.
    pub(crate) async fn recv_fields(&mut self) -> Result<Option<Fields>, Error> {
        loop {
            match self.read_frame().await? {
                None => return Ok(None),
                Some(Frame::Headers(block)) => {
                    let fields = self.decode(&block).await?;
                    let size: u64 = fields
                        .iter()
                        .map(|(n, v)| (n.len() + v.len() + 32) as u64)
                        .sum();
                    if size > self.shared.config.max_field_section_size {
                        return Err(self.malformed("header section larger than allowed"));
                    }
                    return Ok(Some(fields));
                }
                Some(Frame::Unknown(_)) => continue,
                // RFC 9114 §4.2.2: this request's problem, not the connection's.
                Some(Frame::HeadersTooLarge(_)) => {
                    // Never seen by the decoder (a final response after a 1xx, say).
                    self.section_pending = true;
                    return Err(self.malformed("header section larger than allowed"));
                }
                Some(Frame::Data(_)) => return Err(self.unexpected("DATA before HEADERS")),
                Some(f) => return Err(self.not_allowed(&f)),
            }
        }
    }

    /// Decodes a header section. One larger than our SETTINGS_MAX_FIELD_SECTION_SIZE is a
    /// malformed message (RFC 9114 §4.2.2): the stream is stopped with H3_MESSAGE_ERROR (the
    /// decoder acknowledged the section, so QPACK state stays in step).
    async fn decode(&mut self, block: &[u8]) -> Result<Fields, Error> {
        // A section decoded after the stream's cancellation would be acknowledged after it:
        // the peer's encoder has forgotten the stream, and takes that for a decoder-stream
        // error (RFC 9204 §4.4.1).
        if self.cancelled {
            return Err(Error::StreamReset(Code::REQUEST_CANCELLED));
        }
        // Cleared when the section is decoded; left set if this is dropped or fails while
        // waiting (a reset, the connection lost), so that the drop cancels the section.
        self.section_pending = true;
        // While the section waits for the encoder stream, the request stream is read on
        // (into the frame reader, within its flow-control window) so that a reset is seen.
        let (shared, recv, reader, fin) = (
            &self.shared,
            &mut self.recv,
            &mut self.reader,
            &mut self.fin,
        );
        let stream_gone = async {
            loop {
                if *fin {
                    std::future::pending::<()>().await;
                }
                // Past a few frames' worth held, nothing more is read (flow control then
                // holds the peer back): a reset is still seen. A peer that kept streaming
                // behind a blocked head made us hold all it sent.
                if reader.buffered() >= BLOCKED_READ_AHEAD {
                    return match recv.reset_received().await {
                        Ok(code) => Error::StreamReset(Code(code)),
                        Err(kuai::ReadError::ConnectionLost(e)) => match shared.error() {
                            Some(h3) => Error::Protocol(h3),
                            None => Error::Connection(e),
                        },
                        Err(kuai::ReadError::ZeroRttRejected) => Error::ZeroRttRejected,
                        Err(_) => Error::StreamReset(Code::REQUEST_CANCELLED),
                    };
                }
                match recv.read_chunk(64 * 1024).await {
                    Ok(Some(chunk)) => reader.push_bytes(chunk),
                    Ok(None) => *fin = true,
                    Err(kuai::ReadError::Reset(code)) => return Error::StreamReset(Code(code)),
                    Err(kuai::ReadError::ConnectionLost(e)) => {
                        return match shared.error() {
                            Some(h3) => Error::Protocol(h3),
                            None => Error::Connection(e),
                        };
                    }
                    Err(kuai::ReadError::ZeroRttRejected) => return Error::ZeroRttRejected,
                    Err(_) => return Error::StreamReset(Code::REQUEST_CANCELLED),
                }
            }
        };
        match shared.decode_fields(self.id, block, stream_gone).await {
            Ok(fields) => {
                self.decoded = true;
                self.section_pending = false;
                Ok(fields)
            }
            Err(Error::Malformed(why)) => {
                self.decoded = true;
                self.section_pending = false;
                Err(self.malformed(why))
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn set_head_request(&mut self, head: bool) {
        self.head_request = head;
    }

    /// Notes what body a response may have: none after HEAD, 204 and 304 (RFC 9110 §6.4.1).
    pub(crate) fn set_response_head(
        &mut self,
        status: &http::StatusCode,
        headers: &HeaderMap,
    ) -> Result<(), Error> {
        self.set_expected_len(headers)?;
        if self.head_request
            || *status == http::StatusCode::NO_CONTENT
            || *status == http::StatusCode::NOT_MODIFIED
        {
            self.expected_len = Some(0);
        }
        Ok(())
    }

    /// Notes the head's content-length, for checking the body against it.
    pub(crate) fn set_expected_len(&mut self, headers: &HeaderMap) -> Result<(), Error> {
        match message::content_length(headers) {
            Ok(n) => {
                self.expected_len = n;
                self.state = RecvState::Body;
                Ok(())
            }
            Err(why) => Err(self.malformed(why)),
        }
    }

    /// The next piece of the body; `None` at its end (then trailers, if any, are available
    /// from [`recv_trailers`](Self::recv_trailers)).
    pub async fn recv_data(&mut self) -> Result<Option<Bytes>, Error> {
        loop {
            if matches!(self.state, RecvState::Done) {
                return Ok(None);
            }
            match self.read_frame().await? {
                None => {
                    self.state = RecvState::Done;
                    if let Some(n) = self.expected_len
                        && n != self.received_len
                    {
                        return Err(self.malformed("body length differs from content-length"));
                    }
                    return Ok(None);
                }
                Some(Frame::Data(d)) => {
                    if self.state == RecvState::Trailers {
                        return Err(self.unexpected("DATA after trailers"));
                    }
                    self.received_len += d.len() as u64;
                    if self.expected_len.is_some_and(|n| self.received_len > n) {
                        return Err(self.malformed("body longer than content-length"));
                    }
                    if d.is_empty() {
                        continue;
                    }
                    return Ok(Some(d));
                }
                Some(Frame::Headers(block)) => {
                    if self.state == RecvState::Trailers {
                        return Err(self.unexpected("HEADERS after trailers"));
                    }
                    let fields = self.decode(&block).await?;
                    match message::parse_trailers(&fields) {
                        Ok(t) => self.trailers = Some(t),
                        Err(why) => return Err(self.malformed(why)),
                    }
                    self.state = RecvState::Trailers;
                }
                Some(Frame::Unknown(_)) => continue,
                Some(Frame::HeadersTooLarge(_)) => {
                    // A third section is a frame out of sequence whatever its size (RFC
                    // 9114 §4.1: a connection error).
                    if self.state == RecvState::Trailers {
                        return Err(self.unexpected("HEADERS after trailers"));
                    }
                    // Never seen by the decoder: cancelled when this is dropped.
                    self.section_pending = true;
                    return Err(self.malformed("trailer section larger than allowed"));
                }
                Some(f) => return Err(self.not_allowed(&f)),
            }
        }
    }

    /// Polls for the next piece of the body without allocating: `Ready(Ok(None))` at its end.
    /// A trailer section is kept undecoded (decoding may wait for QPACK's encoder stream);
    /// [`recv_trailers`](Self::recv_trailers) decodes it, and a stream dropped without that
    /// is cancelled towards the peer's encoder as any undecoded section is (RFC 9204
    /// §2.2.2.2).
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, Error>> {
        loop {
            if self.state == RecvState::Done {
                return Poll::Ready(Ok(None));
            }
            let frame = match self.reader.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => match if self.fin {
                    Ok(None)
                } else {
                    ready!(self.recv.poll_read_chunk(cx, 64 * 1024))
                } {
                    Ok(Some(chunk)) => {
                        self.reader.push_bytes(chunk);
                        continue;
                    }
                    Ok(None) => {
                        if self.reader.is_mid_frame() {
                            let e = H3Error::new(Code::FRAME_ERROR, "stream ended inside a frame");
                            self.shared.fail(e.clone());
                            return Poll::Ready(Err(Error::Protocol(e)));
                        }
                        self.state = RecvState::Done;
                        if let Some(n) = self.expected_len
                            && n != self.received_len
                        {
                            return Poll::Ready(Err(
                                self.malformed("body length differs from content-length")
                            ));
                        }
                        return Poll::Ready(Ok(None));
                    }
                    Err(kuai::ReadError::Reset(code)) => {
                        return Poll::Ready(Err(Error::StreamReset(Code(code))));
                    }
                    Err(kuai::ReadError::ConnectionLost(e)) => {
                        return Poll::Ready(Err(self.conn_error(e)));
                    }
                    Err(kuai::ReadError::ZeroRttRejected) => {
                        return Poll::Ready(Err(Error::ZeroRttRejected));
                    }
                    Err(_) => {
                        return Poll::Ready(Err(Error::StreamReset(Code::REQUEST_CANCELLED)));
                    }
                },
                Err(e) => {
                    self.shared.fail(e.clone());
                    return Poll::Ready(Err(Error::Protocol(e)));
                }
            };
            match frame {
                Frame::Data(d) => {
                    if self.state == RecvState::Trailers {
                        return Poll::Ready(Err(self.unexpected("DATA after trailers")));
                    }
                    self.received_len += d.len() as u64;
                    if self.expected_len.is_some_and(|n| self.received_len > n) {
                        return Poll::Ready(Err(self.malformed("body longer than content-length")));
                    }
                    if !d.is_empty() {
                        return Poll::Ready(Ok(Some(d)));
                    }
                }
                Frame::Headers(block) => {
                    if self.state == RecvState::Trailers {
                        return Poll::Ready(Err(self.unexpected("HEADERS after trailers")));
                    }
                    self.trailer_block = Some(block);
                    self.state = RecvState::Trailers;
                }
                Frame::Unknown(_) => {}
                Frame::HeadersTooLarge(_) => {
                    if self.state == RecvState::Trailers {
                        return Poll::Ready(Err(self.unexpected("HEADERS after trailers")));
                    }
                    self.section_pending = true;
                    return Poll::Ready(Err(self.malformed("trailer section larger than allowed")));
                }
                f => return Poll::Ready(Err(self.not_allowed(&f))),
            }
        }
    }

    /// Reads the rest of the body, up to `limit` bytes.
    pub async fn recv_body(&mut self, limit: usize) -> Result<Bytes, Error> {
        let mut out = BytesMut::new();
        while let Some(d) = self.recv_data().await? {
            if out.len() + d.len() > limit {
                self.abandon(Code::EXCESSIVE_LOAD, false);
                return Err(Error::TooLarge);
            }
            out.extend_from_slice(&d);
        }
        Ok(out.freeze())
    }

    /// Trailers, once the body was read to its end.
    pub async fn recv_trailers(&mut self) -> Result<Option<HeaderMap>, Error> {
        while self.state != RecvState::Done {
            if self.recv_data().await?.is_some() {
                // Body data the caller did not read is skipped.
                continue;
            }
        }
        if let Some(block) = self.trailer_block.take() {
            let fields = self.decode(&block).await?;
            match message::parse_trailers(&fields) {
                Ok(t) => self.trailers = Some(t),
                Err(why) => return Err(self.malformed(why)),
            }
        }
        Ok(self.trailers.take())
    }

    /// Whether a trailer section came that [`recv_trailers`](Self::recv_trailers) has not
    /// decoded yet.
    pub fn has_trailers(&self) -> bool {
        self.trailer_block.is_some() || self.trailers.is_some()
    }
}

impl SendHalf {
    /// See [`kuai::SendStream::set_max_unsent`].
    pub fn set_max_unsent(&self, max: Option<u64>) {
        if let Some(s) = &self.send {
            s.set_max_unsent(max);
        }
    }
}

impl SendHalf {
    /// Turns a write result into ours; a STOP_SENDING with H3_NO_ERROR is not an error.
    fn outcome(&mut self, r: Result<(), kuai::WriteError>) -> Result<(), Error> {
        match r {
            Err(kuai::WriteError::Stopped(c)) if c == Code::NO_ERROR.0 => {
                self.peer_done = true;
                self.send = None;
                Ok(())
            }
            r => r.map_err(write_error),
        }
    }

    fn send_stream(&mut self) -> Result<&mut SendStream, Error> {
        self.send.as_mut().ok_or(Error::Protocol(H3Error::new(
            Code::INTERNAL_ERROR,
            "stream already finished",
        )))
    }

    pub(crate) async fn send_fields(&mut self, fields: &Fields) -> Result<(), Error> {
        let frame = self.headers_frame(|| fields.iter().map(|(n, v)| (&n[..], &v[..])))?;
        self.send_headers_frame(frame).await
    }

    /// A HEADERS frame for `fields`, encoded straight into the buffer that goes out.
    pub(crate) fn headers_frame<'a, I>(&self, fields: impl Fn() -> I) -> Result<Bytes, Error>
    where
        I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
    {
        // Encoding for a voided stream would leave the QPACK encoder a section no one acks;
        // so would one for a stream the peer stopped or that is finished (the frame would
        // not go out, RFC 9204 §2.1.1: its entries could never be evicted).
        if self.send.as_ref().is_some_and(SendStream::is_0rtt_rejected) {
            return Err(Error::ZeroRttRejected);
        }
        if self.peer_done {
            return Ok(Bytes::new());
        }
        if self.send.is_none() {
            return Err(Error::Protocol(H3Error::new(
                Code::INTERNAL_ERROR,
                "stream already finished",
            )));
        }
        // Room for the longest frame header in front; the header goes right before the
        // block once its length is known.
        const ROOM: usize = 9;
        let mut buf = Vec::with_capacity(256);
        buf.resize(ROOM, 0);
        let size = fields()
            .into_iter()
            .map(|(n, v)| (n.len() + v.len() + 32) as u64)
            .sum();
        self.shared
            .encode_fields(self.id, size, fields(), &mut buf)?;
        let len = (buf.len() - ROOM) as u64;
        let start = ROOM - frame::header_len(frame::HEADERS, len);
        let mut room = &mut buf[start..ROOM];
        frame::write_header(frame::HEADERS, len, &mut room);
        let mut b = Bytes::from(buf);
        bytes::Buf::advance(&mut b, start);
        Ok(b)
    }

    pub(crate) async fn send_headers_frame(&mut self, frame: Bytes) -> Result<(), Error> {
        if self.peer_done {
            return Ok(());
        }
        let s = self.send_stream()?;
        let r = s.write_chunk(frame).await;
        self.outcome(r)
    }

    /// Sends a piece of the body (one DATA frame; the payload is not copied).
    pub async fn send_data(&mut self, data: Bytes) -> Result<(), Error> {
        if data.is_empty() || self.peer_done {
            return Ok(());
        }
        let mut hdr = [0u8; 16];
        let mut room = &mut hdr[..];
        frame::write_header(frame::DATA, data.len() as u64, &mut room);
        let n = 16 - room.len();
        let s = self.send_stream()?;
        let r = s.write_chunk(Bytes::copy_from_slice(&hdr[..n])).await;
        self.outcome(r)?;
        let Some(s) = self.send.as_mut() else {
            return Ok(());
        };
        let r = s.write_chunk(data).await;
        self.outcome(r)
    }

    /// Sends trailers (a final header section).
    pub async fn send_trailers(&mut self, trailers: &HeaderMap) -> Result<(), Error> {
        let frame = self.headers_frame(|| message::regular_field_refs(trailers))?;
        self.send_headers_frame(frame).await
    }

    /// Ends our side of the stream.
    pub fn finish(&mut self) -> Result<(), Error> {
        if let Some(mut s) = self.send.take() {
            let r = s.finish();
            self.ended = Some(s);
            self.outcome(r)?;
        }
        Ok(())
    }

    /// Ends our side of the stream, and has the transport reset it with `code` unless
    /// everything sent is acknowledged within `timeout` (see
    /// [`kuai::SendStream::set_delivery_timeout`]): nothing needs to wait on the delivery.
    pub fn finish_within(&mut self, timeout: std::time::Duration, code: Code) -> Result<(), Error> {
        if let Some(s) = self.send.as_ref() {
            s.set_delivery_timeout(timeout, code.0);
        }
        self.finish()
    }

    /// Waits until everything we sent was acknowledged (or the peer stopped reading),
    /// before or after [`finish`](Self::finish).
    pub async fn finished(&mut self) -> Result<(), Error> {
        if let Some(s) = self.send.as_mut().or(self.ended.as_mut()) {
            let r = s.stopped().await;
            self.outcome(r)?;
        }
        Ok(())
    }

    /// Resolves when the peer can no longer receive what this half would send: it stopped
    /// the stream (cancelled the request), the connection was lost, or the 0-RTT was
    /// rejected. Pending for as long as the stream can deliver; a finished half resolves at
    /// once.
    pub async fn cancelled(&mut self) -> Error {
        match self.send.as_mut() {
            Some(s) => write_error(s.cancelled().await),
            None => Error::Protocol(H3Error::new(
                Code::INTERNAL_ERROR,
                "stream already finished",
            )),
        }
    }

    /// Abandons sending with `code` (RESET_STREAM).
    pub fn reset(&mut self, code: Code) {
        // After `finish`, what the peer has not acknowledged yet is abandoned as well
        // (RFC 9000 §3.1: a stream in Data Sent may still be reset).
        if let Some(mut s) = self.send.take().or(self.ended.take()) {
            let _ = s.reset(code.0);
        }
    }

    /// Sets the priority of what we send (RFC 9218).
    pub fn set_priority(&self, p: kuai::Priority) {
        if let Some(s) = self.send.as_ref() {
            s.set_priority(p);
        }
    }
}

impl Drop for RecvHalf {
    fn drop(&mut self) {
        // A request voided by a 0-RTT rejection left no state here, and its stream ID may
        // already name the request sent again: a QPACK Stream Cancellation for it would
        // cancel that one's sections (RFC 9204 §4.4.2).
        if self.recv.is_0rtt_rejected() {
            return;
        }
        // An unread body: tell the peer we are not interested (RFC 9114 §4.1.1), and cancel
        // what it may still send a section in (trailers). A server that has answered waits
        // for more than a FIN before it says so (§4.1 allows the stop, but a client still
        // finishing its request may fail on it).
        let server = self.shared.side.is_server();
        self.abandon(Code::NO_ERROR, server);
        // A section read but never decoded (a reader that stops at the body's end before
        // the trailers, an undecoded head) is abandoned too: without the cancellation the
        // peer's encoder keeps it outstanding, and the entries it names can never be
        // evicted (RFC 9204 §2.2.2.2, §4.4.2).
        if !self.cancelled
            && (!self.decoded || self.trailer_block.is_some() || self.section_pending)
        {
            self.shared.cancel_stream(self.id);
        }
        crate::datagram::forget(&self.shared, self.id);
    }
}

pub(crate) fn write_error(e: kuai::WriteError) -> Error {
    match e {
        kuai::WriteError::Stopped(c) => Error::Stopped(Code(c)),
        kuai::WriteError::ConnectionLost(c) => Error::Connection(c),
        kuai::WriteError::ZeroRttRejected => Error::ZeroRttRejected,
        kuai::WriteError::ClosedStream => {
            Error::Protocol(H3Error::new(Code::INTERNAL_ERROR, "stream closed"))
        }
        _ => Error::Protocol(H3Error::new(Code::INTERNAL_ERROR, "stream not writable")),
    }
}
