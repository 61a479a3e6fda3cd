//! HTTP/1.1 to a backend (RFC 9112), driven inside the request's own task: the request head
//! and body are written and the response read on the same poll, with no connection task,
//! channel or wake-up between them. A connection is given back to its backend's pool the
//! moment its response's last byte has been read (for a small response: with its head).
//!
//! Full duplex as HTTP/1.1 allows: a response that starts before the request body has all
//! gone out is returned at once, and the rest of the request body goes out from a task of its
//! own, whether or not the response body is being read (a client that sends its whole upload
//! before it reads, and a backend that answers early and reads on, would otherwise wait for
//! each other); the connection is then not reused unless the upload finished.

pub mod parse;

use std::fmt;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Request, Response, header};
use http_body::{Body as _, Frame, SizeHint};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use self::parse::{Chunked, Framing, ParseError, RequestFraming};
use super::backend::Backend;
use super::body::UpBody;

/// Read buffer allocations: a connection starts with the first and doubles up to the second
/// while its reads fill the buffer (a large response: fewer, larger reads).
const READ_SIZE: usize = 16 * 1024;
const MAX_READ_SIZE: usize = 256 * 1024;
/// Below this much room a new read buffer is taken.
const MIN_ROOM: usize = 4 * 1024;
/// Request body data up to this size is copied beside its framing (one write); larger
/// pieces go out from their own buffer.
const COPY_MAX: usize = 8 * 1024;

/// Why an exchange with a backend failed.
#[derive(Debug)]
pub(crate) enum Error {
    Io(io::Error),
    /// The backend closed the connection before a response head.
    Closed,
    /// The backend closed the connection in the middle of the response body.
    Truncated,
    Parse(ParseError),
    /// The client's request body failed (the client went away).
    ClientBody(Box<crate::Error>),
    /// The client's body did not match the length it declared.
    BodyLength,
    /// The backend sent nothing more of the response body for this long.
    Stalled(std::time::Duration),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::Closed => f.write_str("the backend closed the connection without a response"),
            Error::Truncated => f.write_str("the backend closed the connection mid-response"),
            Error::Stalled(d) => write!(f, "the backend sent nothing of the response for {d:?}"),
            Error::Parse(e) => write!(f, "{e}"),
            Error::ClientBody(e) => write!(f, "request body: {e}"),
            Error::BodyLength => f.write_str("request body length differs from its Content-Length"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) => Some(e),
            Error::Parse(e) => Some(e),
            Error::ClientBody(e) => Some(e),
            _ => None,
        }
    }
}

/// One keep-alive connection to a backend with its buffers.
pub(crate) struct Conn {
    /// Shared only while the rest of an upload goes out from its own task (see
    /// [`Duplex`]).
    io: Arc<TcpStream>,
    /// What was read and not yet taken.
    rbuf: BytesMut,
    /// Bytes to write, from `wpos`, then `data`.
    wbuf: Vec<u8>,
    wpos: usize,
    data: Bytes,
    /// Some bytes were written on this connection for the current request.
    wrote: bool,
    /// The next read buffer's size.
    read_size: usize,
    /// Counted among the backend's connections while it lives (the upload task's
    /// writer, sharing the socket, is not counted again).
    _slot: Option<super::backend::ConnSlot>,
}

impl Conn {
    pub(crate) fn new(io: TcpStream, slot: super::backend::ConnSlot) -> Self {
        Self {
            _slot: Some(slot),
            io: Arc::new(io),
            rbuf: BytesMut::new(),
            wbuf: Vec::with_capacity(1024),
            wpos: 0,
            data: Bytes::new(),
            wrote: false,
            read_size: READ_SIZE,
        }
    }

    /// An idle connection can take a request: the backend has neither closed it nor sent
    /// anything unasked. (Costs no system call while the reactor has seen nothing.)
    pub(crate) fn is_open(&self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.io.try_read(&mut b), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    fn queued(&self) -> usize {
        self.wbuf.len() - self.wpos + self.data.len()
    }

    /// Writes everything queued.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.queued() > 0 {
            let slices = [
                IoSlice::new(&self.wbuf[self.wpos..]),
                IoSlice::new(&self.data),
            ];
            let n = loop {
                ready!(self.io.poll_write_ready(cx))?;
                match self.io.try_write_vectored(&slices) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    r => break r?,
                }
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.wrote = true;
            let from_buf = n.min(self.wbuf.len() - self.wpos);
            self.wpos += from_buf;
            self.data.advance(n - from_buf);
        }
        self.wbuf.clear();
        self.wpos = 0;
        Poll::Ready(Ok(()))
    }

    /// Reads more into `rbuf`; 0 at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.rbuf.capacity() - self.rbuf.len() < MIN_ROOM {
            self.rbuf.reserve(self.read_size);
        }
        let room = self.rbuf.capacity() - self.rbuf.len();
        let n = loop {
            ready!(self.io.poll_read_ready(cx))?;
            // A read that leaves room shows the socket drained (epoll is edge-triggered), so
            // its readiness is cleared with it, as tokio's own `poll_read` does: the next
            // read, or the pool's `is_open`, then costs no system call that would only say
            // EAGAIN. (A readiness event after the read began keeps it set.)
            let mut got = None;
            let (io, rbuf) = (&self.io, &mut self.rbuf);
            match io.try_io(Interest::READABLE, || {
                let n = io.try_read_buf(rbuf)?;
                if n > 0 && n < room {
                    got = Some(n);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            }) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match got {
                    Some(n) => break n,
                    None => continue,
                },
                r => break r?,
            }
        };
        if n == room {
            self.read_size = (self.read_size * 2).min(MAX_READ_SIZE);
        }
        Poll::Ready(Ok(n))
    }
}

/// What a body's `poll_frame` gave.
type Polled = Option<Result<Frame<Bytes>, crate::Error>>;

/// Methods whose requests rarely carry content.
fn bodiless(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    )
}

/// Whether a request's body is worth waiting for before its head goes out: a method whose
/// requests rarely carry content, without a declared length, goes without a body when its
/// end comes (an HTTP/3 FIN after the HEADERS frame) rather than chunked. (A client that
/// waits for 100 Continue gets it from the gateway's server when the body is first read,
/// so the wait does not stall it; the backend never sees its `Expect`.)
pub(crate) fn wait_for_body_end(req: &Request<UpBody>) -> bool {
    bodiless(req.method()) && !req.headers().contains_key(header::CONTENT_LENGTH)
}

/// A request body going out on a connection.
struct Upload {
    body: UpBody,
    framing: RequestFraming,
    /// Bytes a `Content-Length` still promises.
    left: u64,
    /// Frames taken before anything was written (copies): given back to the body when the
    /// connection fails before its first byte, with whether the end had been read.
    replay: Vec<Frame<Bytes>>,
    replay_end: bool,
    /// A chunk went out (the next chunk line starts with the CRLF ending it).
    chunked_any: bool,
    done: bool,
}

impl Upload {
    fn new(body: UpBody, framing: RequestFraming) -> Self {
        Self {
            body,
            framing,
            left: match framing {
                RequestFraming::Length(n) => n,
                _ => 0,
            },
            replay: Vec::new(),
            replay_end: false,
            chunked_any: false,
            done: framing == RequestFraming::None,
        }
    }

    /// Everything the request declared has been written (only its end may be unseen).
    fn sent_all(&self, conn: &Conn) -> bool {
        conn.queued() == 0
            && (self.done || matches!(self.framing, RequestFraming::Length(_)) && self.left == 0)
    }

    /// Reads the rest of a body whose bytes were all sent, to its end, in the background
    /// (for at most a few seconds; anything more is dropped).
    fn drain(self) {
        if self.done || self.body.is_end_stream() {
            return;
        }
        let mut body = self.body;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let wait = async {
                    while let Some(Ok(_)) =
                        std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
                    {
                    }
                };
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), wait).await;
            });
        }
    }

    /// The body with what never left given back to it: the frames taken before the first
    /// byte was written, when none was.
    fn into_unsent(mut self, wrote: bool) -> UpBody {
        if !wrote && (!self.replay.is_empty() || self.replay_end) {
            let frames = std::mem::take(&mut self.replay);
            self.body.put_back(frames, self.replay_end);
        }
        self.body
    }

    /// Sends what the body has, as it comes; `Ready(Ok)` once all of it went out.
    fn poll_send(&mut self, conn: &mut Conn, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        loop {
            // Takes what the body has ready while little is queued, so a small body goes
            // out with the head in one write.
            while !self.done && conn.data.is_empty() && conn.queued() < 16 * 1024 {
                match Pin::new(&mut self.body).poll_frame(cx) {
                    Poll::Pending => break,
                    Poll::Ready(f) => self.take(f, conn)?,
                }
            }
            if conn.queued() == 0 {
                return if self.done {
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                };
            }
            ready!(conn.poll_flush(cx)).map_err(Error::Io)?;
            if !self.replay.is_empty() {
                self.replay = Vec::new();
            }
        }
    }

    fn take(&mut self, frame: Polled, conn: &mut Conn) -> Result<(), Error> {
        if !conn.wrote {
            match &frame {
                Some(Ok(f)) if f.data_ref().is_some_and(|d| !d.is_empty()) => {
                    let d = f.data_ref().cloned().unwrap_or_default();
                    self.replay.push(Frame::data(d));
                }
                None => self.replay_end = true,
                _ => {}
            }
        }
        match frame {
            None => {
                match self.framing {
                    RequestFraming::Length(_) if self.left > 0 => return Err(Error::BodyLength),
                    RequestFraming::Chunked => parse::chunk_end(&mut conn.wbuf, self.chunked_any),
                    _ => {}
                }
                self.done = true;
            }
            Some(Err(e)) => return Err(Error::ClientBody(Box::new(e))),
            Some(Ok(frame)) => {
                // Trailers have nowhere to go in a Content-Length body; they are dropped.
                let Ok(data) = frame.into_data() else {
                    return Ok(());
                };
                if data.is_empty() {
                    return Ok(());
                }
                match self.framing {
                    RequestFraming::Length(_) => {
                        self.left = self
                            .left
                            .checked_sub(data.len() as u64)
                            .ok_or(Error::BodyLength)?;
                    }
                    RequestFraming::Chunked => {
                        parse::chunk_prefix(&mut conn.wbuf, data.len(), self.chunked_any);
                        self.chunked_any = true;
                    }
                    RequestFraming::None => return Err(Error::BodyLength),
                }
                let copied = data.len() <= COPY_MAX;
                if copied {
                    conn.wbuf.extend_from_slice(&data);
                } else {
                    conn.data = data;
                }
                // A body that knows it has ended needs no further poll for its end (the
                // last chunk's line goes after a piece that is not copied: next time).
                if self.body.is_end_stream() && (copied || self.framing != RequestFraming::Chunked)
                {
                    return self.take(None, conn);
                }
            }
        }
        Ok(())
    }
}

/// The rest of an upload the backend answered early, going out from a task of its own on
/// the connection's socket while the response body is read (or not) by the request's task.
struct Duplex {
    /// How the upload ended: `Ok` once all of it went out with its end.
    done: oneshot::Receiver<Result<(), Error>>,
    /// Dropped when the response is over: the task then stops, except that a body whose
    /// bytes have all gone out is still read to its end aside (for a few seconds), since
    /// dropping it would look to the client's connection like a body abandoned half-way (an
    /// HTTP/3 FIN still to come, say).
    _over: oneshot::Sender<()>,
}

impl Duplex {
    /// Moves `up` and what `conn` has queued to write into a task of its own.
    fn spawn(mut up: Upload, conn: &mut Conn) -> Box<Self> {
        let mut w = Conn {
            io: Arc::clone(&conn.io),
            rbuf: BytesMut::new(),
            wbuf: std::mem::take(&mut conn.wbuf),
            wpos: std::mem::take(&mut conn.wpos),
            data: std::mem::take(&mut conn.data),
            wrote: conn.wrote,
            read_size: 0,
            _slot: None,
        };
        let (done_tx, done) = oneshot::channel();
        let (over, mut over_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let sent = tokio::select! {
                r = std::future::poll_fn(|cx| up.poll_send(&mut w, cx)) => Some(r),
                _ = &mut over_rx => None,
            };
            let sent_all = up.sent_all(&w);
            // The socket is the response's alone again before the result is told.
            drop(w);
            match sent {
                Some(r) => {
                    let _ = done_tx.send(r);
                }
                None if sent_all => up.drain(),
                None => {}
            }
        });
        Box::new(Self { done, _over: over })
    }
}

/// Where a connection goes back once its response is read.
pub(crate) struct Home {
    pub(crate) backend: Arc<Backend>,
    pub(crate) max_idle: usize,
}

/// An exchange that failed, with the request back.
pub(crate) struct Failed {
    pub(crate) error: Error,
    pub(crate) request: Request<UpBody>,
    /// Some of the request was written.
    pub(crate) sent: bool,
    /// Some bytes of a response came.
    pub(crate) answered: bool,
}

/// Sends `req` on `conn` (its target and fields as they go on the wire) and waits for the
/// response head.
pub(crate) async fn exchange(
    mut conn: Conn,
    req: Request<UpBody>,
    home: Home,
) -> Result<Response<Body>, Box<Failed>> {
    let (parts, body) = req.into_parts();
    // What of the body is known decides its framing (see `UpBody::read_ahead`): nothing
    // more to come, a body that came whole, or chunked.
    let framing = RequestFraming::choose(
        &parts.method,
        &parts.headers,
        body.is_end_stream(),
        body.size_hint().exact(),
    );
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    conn.wbuf.clear();
    conn.wpos = 0;
    conn.wrote = false;
    parse::encode_head(
        &mut conn.wbuf,
        &parts.method,
        target,
        &parts.headers,
        framing,
    );
    let to_head = parts.method == http::Method::HEAD;
    let mut x = Exchange {
        conn: Some(conn),
        upload: Some(Upload::new(body, framing)),
        write_error: None,
        answered: false,
        seen: 0,
    };
    let r = std::future::poll_fn(|cx| x.poll(cx)).await;
    let conn = x.conn.take().expect("kept until the end");
    let upload = x.upload.take();
    match r {
        Ok(head) => Body::start(conn, head, to_head, upload, x.write_error.is_none(), home)
            .map_err(|error| {
                Box::new(Failed {
                    error,
                    request: Request::from_parts(parts, UpBody::new(crate::Body::empty()).0),
                    sent: true,
                    answered: true,
                })
            }),
        Err(error) => {
            let body = upload.map_or_else(
                || UpBody::new(crate::Body::empty()).0,
                |u| u.into_unsent(conn.wrote),
            );
            Err(Box::new(Failed {
                error,
                request: Request::from_parts(parts, body),
                sent: conn.wrote,
                answered: x.answered,
            }))
        }
    }
}

struct Exchange {
    conn: Option<Conn>,
    upload: Option<Upload>,
    /// Writing failed; the backend may still have answered (a 413, say).
    write_error: Option<Error>,
    answered: bool,
    /// How much of the read buffer the head parser has looked at.
    seen: usize,
}

impl Exchange {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<parse::ResponseHead, Error>> {
        let conn = self.conn.as_mut().expect("polled after the end");
        if let Some(up) = self.upload.as_mut()
            && self.write_error.is_none()
        {
            match up.poll_send(conn, cx) {
                Poll::Ready(Ok(())) | Poll::Pending => {}
                // The client's body failed or broke its declared length: the backend would
                // wait for the rest until the response timeout.
                Poll::Ready(Err(e @ (Error::ClientBody(_) | Error::BodyLength))) => {
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Err(e)) => self.write_error = Some(e),
            }
        }
        loop {
            match parse::parse_head_lines(&mut conn.rbuf, &mut self.seen) {
                Err(e) => return Poll::Ready(Err(Error::Parse(e))),
                // 1xx: interim (100 Continue, 103 Early Hints), the final head follows
                // (RFC 9110 §15.2); an upgrade was not asked for.
                Ok(Some(h)) if h.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                    return Poll::Ready(Err(Error::Parse(ParseError::UnexpectedUpgrade)));
                }
                Ok(Some(h)) if h.status.is_informational() => continue,
                Ok(Some(h)) => return Poll::Ready(Ok(h)),
                Ok(None) => {}
            }
            match ready!(conn.poll_fill(cx)) {
                Ok(0) => {
                    return Poll::Ready(Err(self.write_error.take().unwrap_or(Error::Closed)));
                }
                Ok(_) => self.answered = true,
                Err(e) => return Poll::Ready(Err(Error::Io(e))),
            }
        }
    }
}

/// A backend's response body over HTTP/1.1, read from the connection as the client asks
/// for it.
pub(crate) struct Body {
    /// Until the body has been read to its end.
    conn: Option<Conn>,
    decode: Decode,
    /// The rest of a request body the backend answered before it had all of it, going out
    /// from its own task (rare: boxed to keep the body small).
    upload: Option<Box<Duplex>>,
    /// The connection may carry another request after this response.
    reusable: bool,
    home: Option<Home>,
    /// The whole body when it came with the head.
    ready: Option<Bytes>,
}

enum Decode {
    Length(u64),
    Chunked(Chunked),
    Close,
    Done,
}

impl Body {
    fn start(
        conn: Conn,
        head: parse::ResponseHead,
        to_head: bool,
        upload: Option<Upload>,
        wrote_all: bool,
        home: Home,
    ) -> Result<Response<Self>, Error> {
        let (framing, keep_alive) = parse::framing(&head, to_head).map_err(Error::Parse)?;
        // A request whose writing failed leaves the connection unusable.
        let mut conn = conn;
        let upload = upload
            .filter(|u| !(u.done && conn.queued() == 0) && wrote_all)
            .map(|u| Duplex::spawn(u, &mut conn));
        let mut body = Body {
            conn: Some(conn),
            decode: match framing {
                Framing::Empty | Framing::Length(0) => Decode::Done,
                Framing::Length(n) => Decode::Length(n),
                Framing::Chunked => Decode::Chunked(Chunked::default()),
                Framing::Close => Decode::Close,
            },
            upload,
            reusable: keep_alive && wrote_all,
            home: Some(home),
            ready: None,
        };
        // A body that came whole with the head is taken now, and the connection goes back
        // to the pool before the response is passed on.
        match &mut body.decode {
            Decode::Length(n) => {
                let conn = body.conn.as_mut().expect("just set");
                if conn.rbuf.len() as u64 >= *n {
                    body.ready = Some(conn.rbuf.split_to(*n as usize).freeze());
                    body.decode = Decode::Done;
                }
            }
            Decode::Chunked(c) => {
                let conn = body.conn.as_mut().expect("just set");
                c.decode(&mut conn.rbuf, false).map_err(Error::Parse)?;
                if c.is_done() {
                    body.decode = Decode::Done;
                }
            }
            _ => {}
        }
        if matches!(body.decode, Decode::Done) {
            body.finish();
        }
        let mut r = Response::new(body);
        *r.status_mut() = head.status;
        *r.version_mut() = head.version;
        *r.headers_mut() = head.into_headers();
        Ok(r)
    }

    /// The response has been read: the connection goes back to its pool when nothing of
    /// this exchange is left on it.
    fn finish(&mut self) {
        self.decode = Decode::Done;
        let Some(conn) = self.conn.take() else {
            return;
        };
        // An upload still going ends with the response (its task reads a body whose bytes
        // have all gone out to its end, aside; see `Duplex`); the connection is kept only
        // when the upload had finished.
        let sent_all = match self.upload.take() {
            None => true,
            Some(mut d) => matches!(d.done.try_recv(), Ok(Ok(()))),
        };
        if self.reusable
            && sent_all
            && conn.rbuf.is_empty()
            && let Some(home) = self.home.take()
        {
            home.backend.put_idle(conn, home.max_idle);
        }
    }

    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, crate::Error>>> {
        self.conn = None;
        self.upload = None;
        self.decode = Decode::Done;
        Poll::Ready(Some(Err(crate::Error::Upstream(super::UpstreamError(e)))))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = crate::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::Error>>> {
        let this = self.get_mut();
        if let Some(data) = this.ready.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if let Some(up) = this.upload.as_mut() {
                match Pin::new(&mut up.done).poll(cx) {
                    Poll::Pending => {}
                    Poll::Ready(Ok(Ok(()))) => this.upload = None,
                    // The client's body failed: the backend may be waiting for the rest.
                    Poll::Ready(Ok(Err(e @ (Error::ClientBody(_) | Error::BodyLength)))) => {
                        return this.fail(e);
                    }
                    // The backend has answered; what it did not take of the request is
                    // its business, but the connection is not used again.
                    Poll::Ready(Ok(Err(_)) | Err(_)) => {
                        this.upload = None;
                        this.reusable = false;
                    }
                }
            }
            let step: Result<(Option<Bytes>, bool), Error> = match &mut this.decode {
                Decode::Done => Ok((None, true)),
                Decode::Length(left) if conn.rbuf.is_empty() => Ok((None, *left == 0)),
                Decode::Length(left) => {
                    let n = (conn.rbuf.len() as u64).min(*left);
                    *left -= n;
                    Ok((Some(conn.rbuf.split_to(n as usize).freeze()), *left == 0))
                }
                // After a piece, the decoder goes on to notice the end as soon as its
                // bytes are here.
                Decode::Chunked(c) => c
                    .decode(&mut conn.rbuf, true)
                    .and_then(|d| c.decode(&mut conn.rbuf, false).map(|_| d))
                    .map(|d| (d, c.is_done()))
                    .map_err(Error::Parse),
                Decode::Close => Ok((
                    (!conn.rbuf.is_empty()).then(|| conn.rbuf.split().freeze()),
                    false,
                )),
            };
            let (piece, ended) = match step {
                Ok(s) => s,
                Err(e) => return this.fail(e),
            };
            if ended {
                this.finish();
            }
            if let Some(d) = piece {
                return Poll::Ready(Some(Ok(Frame::data(d))));
            }
            if ended {
                return Poll::Ready(None);
            }
            let conn = this.conn.as_mut().expect("not done");
            match ready!(conn.poll_fill(cx)) {
                Ok(0) if matches!(this.decode, Decode::Close) => {
                    this.reusable = false;
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(0) => return this.fail(Error::Truncated),
                Ok(_) => {}
                Err(e) => return this.fail(Error::Io(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none() && matches!(self.decode, Decode::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.ready, &self.decode) {
            (Some(d), _) => SizeHint::with_exact(d.len() as u64),
            (None, Decode::Length(n)) => SizeHint::with_exact(*n),
            (None, Decode::Done) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
