//! [`Body`]: the body of a request the server received, over any protocol.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use kuai_h3::RecvHalf;

use crate::Error;

type Next = Pin<Box<dyn Future<Output = (RecvHalf, Result<Option<Frame<Bytes>>, Error>)> + Send>>;

/// A message body as it arrives (a request's at the server, a response's at the client):
/// HTTP/3 DATA frames, HTTP/2 DATA frames or HTTP/1.1 content,
/// read on demand (the sender is held back by flow control while the service does not read)
/// and never gathered in memory by the server. Trailers come last when the client sent any.
///
/// A body longer than [`Limits::max_request_body`](crate::Limits::max_request_body) ends in
/// [`Error::BodyTooLarge`] (a request that declares such a length is answered 413 before the
/// service sees it).
pub struct Body {
    kind: Kind,
    limit: Option<u64>,
    received: u64,
    /// Called once the body has been read to its end.
    on_end: Option<Box<dyn FnOnce() + Send>>,
    /// Counted while its reader waits for the sender (see [`Body::watched`]).
    waiting: Option<Waiting>,
    /// Ends the body when a read waits too long for the sender (see [`Body::stall_limit`]).
    stall: Option<Stall>,
    /// Told at the first read (see [`Body::on_first_read`]).
    on_first_read: Option<tokio::sync::oneshot::Sender<()>>,
}

/// A body's own timeout for a sender that stops: how long a read may wait, and the timer,
/// made at the first read that waits and running only while reads wait.
struct Stall {
    limit: std::time::Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

/// Counts a body in a shared tally while a read of it found nothing yet: a TCP
/// connection's watchdog then knows the service waits on the client.
struct Waiting {
    tally: Arc<AtomicUsize>,
    counted: bool,
}

impl Waiting {
    fn set(&mut self, waiting: bool) {
        if waiting != self.counted {
            if waiting {
                self.tally.fetch_add(1, Ordering::Relaxed);
            } else {
                self.tally.fetch_sub(1, Ordering::Relaxed);
            }
            self.counted = waiting;
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.set(false);
    }
}

enum Kind {
    Empty,
    H3(Box<H3Body>),
    Hyper(hyper::body::Incoming),
    /// A QUIC stream's bytes as they are (an HTTP/0.9 response), after a first chunk
    /// already read.
    Quic(Option<Bytes>, kuai::RecvStream),
}

/// An HTTP/3 stream's receiving half, or the decoding of its trailers in progress.
struct H3Body {
    half: Option<RecvHalf>,
    next: Option<Next>,
}

impl Body {
    /// A body with nothing in it.
    pub fn empty() -> Self {
        Self {
            kind: Kind::Empty,
            limit: None,
            received: 0,
            on_end: None,
            waiting: None,
            stall: None,
            on_first_read: None,
        }
    }

    pub(crate) fn h3(half: RecvHalf, limit: Option<u64>) -> Self {
        Self {
            kind: Kind::H3(Box::new(H3Body {
                half: Some(half),
                next: None,
            })),
            limit,
            received: 0,
            on_end: None,
            waiting: None,
            stall: None,
            on_first_read: None,
        }
    }

    pub(crate) fn hyper(b: hyper::body::Incoming, limit: Option<u64>) -> Self {
        Self {
            kind: Kind::Hyper(b),
            limit,
            received: 0,
            on_end: None,
            waiting: None,
            stall: None,
            on_first_read: None,
        }
    }

    /// The rest of a QUIC stream of which `first` was read (`None`: it had ended).
    pub(crate) fn quic_with_first(first: Option<Bytes>, stream: kuai::RecvStream) -> Self {
        Self {
            kind: match first {
                Some(b) => Kind::Quic(Some(b), stream),
                None => Kind::Empty,
            },
            limit: None,
            received: 0,
            on_end: None,
            waiting: None,
            stall: None,
            on_first_read: None,
        }
    }

    /// Calls `f` once the body has been read to its end.
    pub(crate) fn on_end(mut self, f: Box<dyn FnOnce() + Send>) -> Self {
        self.on_end = Some(f);
        self
    }

    /// Counts this body in `tally` while a read of it is waiting for data.
    pub(crate) fn watched(mut self, tally: Arc<AtomicUsize>) -> Self {
        self.waiting = Some(Waiting {
            tally,
            counted: false,
        });
        self
    }

    /// Ends the body in [`Error::Timeout`] once a read of it has waited `limit` for the
    /// sender with nothing coming (nginx's client_body_timeout, for one stream): a stalled
    /// upload on a multiplexed connection ends its own request, not the connection.
    /// Tells `tx` when the body is first read: the moment a server owes `100 Continue` to
    /// a client that asked for it (RFC 9110 §10.1.1), as hyper does over TCP.
    pub(crate) fn on_first_read(mut self, tx: tokio::sync::oneshot::Sender<()>) -> Self {
        self.on_first_read = Some(tx);
        self
    }

    pub(crate) fn stall_limit(mut self, limit: std::time::Duration) -> Self {
        self.stall = Some(Stall {
            limit,
            timer: None,
            armed: false,
        });
        self
    }

    /// Counts `frame` against the limit.
    fn counted(
        &mut self,
        frame: Option<Result<Frame<Bytes>, Error>>,
    ) -> Option<Result<Frame<Bytes>, Error>> {
        if let Some(Ok(f)) = &frame
            && let Some(d) = f.data_ref()
        {
            self.received += d.len() as u64;
            if let Some(limit) = self.limit
                && self.received > limit
            {
                // Stop reading: no more of it is wanted.
                self.kind = Kind::Empty;
                return Some(Err(Error::BodyTooLarge { limit }));
            }
        }
        frame
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Empty => "empty",
            Kind::H3(_) => "HTTP/3",
            Kind::Hyper(_) => "HTTP/2 or HTTP/1.1",
            Kind::Quic(..) => "HTTP/0.9",
        };
        f.debug_struct("Body")
            .field("kind", &kind)
            .field("received", &self.received)
            .finish()
    }
}

/// Decodes the trailers that ended the body.
async fn trailers(mut half: RecvHalf) -> (RecvHalf, Result<Option<Frame<Bytes>>, Error>) {
    let r = match half.recv_trailers().await {
        Ok(t) => Ok(t.map(Frame::trailers)),
        Err(e) => Err(Error::H3(e)),
    };
    (half, r)
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        if let Some(tx) = this.on_first_read.take() {
            let _ = tx.send(());
        }
        let r = this.poll_body(cx);
        if let Some(w) = &mut this.waiting {
            w.set(r.is_pending());
        }
        if let Some(s) = &mut this.stall {
            if !r.is_pending() {
                s.armed = false;
                return r;
            }
            let deadline = tokio::time::Instant::now() + s.limit;
            let timer = s
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            if !s.armed {
                timer.as_mut().reset(deadline);
                s.armed = true;
            }
            if timer.as_mut().poll(cx).is_ready() {
                let after = s.limit;
                // What is left of it is not wanted.
                this.kind = Kind::Empty;
                this.stall = None;
                return Poll::Ready(Some(Err(Error::Timeout {
                    what: "request body",
                    after,
                })));
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Hyper(b) => b.is_end_stream(),
            Kind::H3(_) | Kind::Quic(..) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Hyper(b) => b.size_hint(),
            Kind::H3(_) | Kind::Quic(..) => SizeHint::default(),
        }
    }
}

impl Body {
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self;
        let frame = match &mut this.kind {
            Kind::Empty => None,
            Kind::Hyper(b) => ready!(http_body::Body::poll_frame(Pin::new(b), cx))
                .map(|r| r.map_err(Error::Hyper)),
            Kind::Quic(first, _) if first.is_some() => first.take().map(|b| Ok(Frame::data(b))),
            Kind::Quic(_, s) => match ready!(s.poll_read_chunk(cx, usize::MAX)) {
                Ok(Some(b)) => Some(Ok(Frame::data(b))),
                Ok(None) => {
                    this.kind = Kind::Empty;
                    None
                }
                Err(e) => {
                    this.kind = Kind::Empty;
                    Some(Err(Error::Read(e)))
                }
            },
            Kind::H3(b) => {
                let H3Body { half, next } = &mut **b;
                loop {
                    // The trailers being decoded (rare: they may wait for QPACK).
                    if let Some(fut) = next.as_mut() {
                        let (_, r) = ready!(fut.as_mut().poll(cx));
                        *next = None;
                        this.kind = Kind::Empty;
                        break match r {
                            Ok(f) => f.map(Ok),
                            Err(e) => Some(Err(e)),
                        };
                    }
                    let Some(h) = half.as_mut() else {
                        break None;
                    };
                    match ready!(h.poll_data(cx)) {
                        Ok(Some(d)) => break Some(Ok(Frame::data(d))),
                        Ok(None) if h.has_trailers() => {
                            if let Some(h) = half.take() {
                                *next = Some(Box::pin(trailers(h)));
                            }
                        }
                        Ok(None) => {
                            this.kind = Kind::Empty;
                            break None;
                        }
                        Err(e) => {
                            this.kind = Kind::Empty;
                            break Some(Err(Error::H3(e)));
                        }
                    }
                }
            }
        };
        // At the end, or at the last frame when the body knows it is the last (hyper does
        // when a Content-Length is used up): a reader that stops there (`bytes()` after one
        // chunk, or one that reads exactly the length) has read it all.
        let last = match &frame {
            None => true,
            Some(Ok(_)) => http_body::Body::is_end_stream(&*this),
            Some(Err(_)) => false,
        };
        if last && let Some(f) = this.on_end.take() {
            f();
        }
        Poll::Ready(this.counted(frame))
    }
}
