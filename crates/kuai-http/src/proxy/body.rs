//! The bodies a proxy passes on: the client's request body to a backend, and a backend's
//! response body (or the proxy's own answer) to the client.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use super::backend::{Backend, Received};
use crate::{Body, Error};
use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};

/// The request body read by the backend connection: not one byte of it yet.
const UNTOUCHED: u8 = 0;
/// Read to its end without any data: a retry may send an empty body.
const ENDED_EMPTY: u8 = 1;
/// Some data went out (or an error came): a retry cannot send it again.
const CONSUMED: u8 = 2;

/// A request body on its way to a backend, telling the proxy whether any of it was taken.
/// Frames can be read ahead ([`read_ahead`](Self::read_ahead)) and given back
/// ([`put_back`](Self::put_back)): they are read again, in order, before the rest.
#[derive(Debug)]
pub(crate) struct UpBody {
    inner: Body,
    seen: Arc<Progress>,
    /// Frames to be read first (last first).
    back: Vec<Frame<Bytes>>,
    /// The error read after `back`, to be read again after them.
    failed: Option<Error>,
    /// `inner` has ended (it is not polled again).
    ended: bool,
}

impl UpBody {
    pub(crate) fn new(inner: Body) -> (Self, BodyWatch) {
        // A body known to be over before anyone reads it (a GET without one) is empty: the
        // connection that sends the head may never poll it.
        let state = if inner.is_end_stream() {
            ENDED_EMPTY
        } else {
            UNTOUCHED
        };
        let seen = Arc::new(Progress {
            seen: AtomicU8::new(state),
            epoch: tokio::time::Instant::now(),
            last: AtomicU64::new(0),
            waiting: AtomicBool::new(false),
            client_failed: AtomicU8::new(CLIENT_OK),
        });
        (
            Self {
                inner,
                seen: seen.clone(),
                back: Vec::new(),
                failed: None,
                ended: false,
            },
            BodyWatch(seen),
        )
    }

    /// A watch on this body, for timing the exchange it goes out with.
    pub(crate) fn watch(&self) -> BodyWatch {
        BodyWatch(self.seen.clone())
    }

    /// Gives back `frames` (in the order they were read) that never left, to be read again
    /// before the rest; `ended`: the body's end had been read after them.
    pub(crate) fn put_back(&mut self, frames: Vec<Frame<Bytes>>, ended: bool) {
        self.back.extend(frames.into_iter().rev());
        self.ended |= ended;
    }

    /// Reads what the body has ready, up to two frames, so its framing can be chosen from
    /// what is known: an end already here, or a body that came whole. With `wait_first`,
    /// waits for the first frame (or the end) when nothing is there yet.
    pub(crate) async fn read_ahead(&mut self, wait_first: bool) {
        if !self.back.is_empty() || self.failed.is_some() || self.ended {
            return;
        }
        // `back` is empty here: the frames go into it in order, then it is turned round.
        std::future::poll_fn(|cx| {
            while self.back.len() < 2 && !self.ended && self.failed.is_none() {
                if self.inner.is_end_stream() {
                    self.ended = true;
                    break;
                }
                let r = Pin::new(&mut self.inner).poll_frame(cx);
                self.seen.progress(r.is_ready());
                match r {
                    Poll::Pending if self.back.is_empty() && wait_first => return Poll::Pending,
                    Poll::Pending => break,
                    Poll::Ready(None) => self.ended = true,
                    Poll::Ready(Some(Ok(f))) => self.back.push(f),
                    Poll::Ready(Some(Err(e))) => {
                        self.seen.client_failed(&e);
                        self.failed = Some(e);
                    }
                }
            }
            Poll::Ready(())
        })
        .await;
        // Its end read ahead with nothing before it: the body was empty, though whoever
        // sends it will not poll it (the request goes with no body framing).
        if self.ended && self.back.is_empty() && self.failed.is_none() {
            let _ = self
                .seen
                .seen
                .compare_exchange(UNTOUCHED, ENDED_EMPTY, Relaxed, Relaxed);
        }
        self.back.reverse();
    }

    /// Some of the body's data was read (it cannot be sent again).
    pub(crate) fn data_taken(&self) -> bool {
        self.seen.seen.load(Relaxed) == CONSUMED
    }
}

/// What an [`UpBody`] and its watches share: how much of it was taken, and when the
/// client last gave some of it.
#[derive(Debug)]
struct Progress {
    seen: AtomicU8,
    epoch: tokio::time::Instant,
    /// When the client's body last gave a frame or its end, in ms since `epoch`.
    last: AtomicU64,
    /// The body's last read from the client found nothing yet: it waits for the client.
    waiting: AtomicBool,
    /// Whether reading the client's body failed ([`CLIENT_OK`], [`CLIENT_FAILED`],
    /// [`CLIENT_TOO_LARGE`]).
    client_failed: AtomicU8,
}

/// The client's body has not failed.
const CLIENT_OK: u8 = 0;
/// The client's body failed (its stream broke, or it stopped coming).
const CLIENT_FAILED: u8 = 1;
/// The client's body went past the server's limit on request bodies.
const CLIENT_TOO_LARGE: u8 = 2;

impl Progress {
    /// A read of the client's body came back `ready` (or not).
    fn progress(&self, ready: bool) {
        if ready {
            let ms = self.epoch.elapsed().as_millis() as u64;
            self.last.store(ms, Relaxed);
        }
        self.waiting.store(!ready, Relaxed);
    }

    /// Reading the client's body gave `e`.
    fn client_failed(&self, e: &Error) {
        let kind = match e {
            Error::BodyTooLarge { .. } => CLIENT_TOO_LARGE,
            _ => CLIENT_FAILED,
        };
        self.client_failed.store(kind, Relaxed);
    }
}

/// What became of an [`UpBody`] handed to a connection: whether it was taken, and how the
/// client is keeping up with it.
pub(crate) struct BodyWatch(Arc<Progress>);

impl BodyWatch {
    /// The body was read to its end and had nothing in it: an empty one is the same.
    pub(crate) fn ended_empty(&self) -> bool {
        self.0.seen.load(Relaxed) == ENDED_EMPTY
    }

    /// When the client's body last gave something (or when it was made).
    pub(crate) fn last_progress(&self) -> tokio::time::Instant {
        self.0.epoch + Duration::from_millis(self.0.last.load(Relaxed))
    }

    /// The body is waiting for the client to send more.
    pub(crate) fn waiting_for_client(&self) -> bool {
        self.0.waiting.load(Relaxed)
    }

    /// Reading the client's body failed: an exchange that broke after it is not the
    /// backend's fault.
    pub(crate) fn client_failed(&self) -> bool {
        self.0.client_failed.load(Relaxed) != CLIENT_OK
    }

    /// The client's body went past the server's limit (413 rather than 400).
    pub(crate) fn client_too_large(&self) -> bool {
        self.0.client_failed.load(Relaxed) == CLIENT_TOO_LARGE
    }
}

impl http_body::Body for UpBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        let f = if let Some(f) = this.back.pop() {
            Some(Ok(f))
        } else if let Some(e) = this.failed.take() {
            // Read again by whoever polls next, then the body is over.
            this.ended = true;
            Some(Err(e))
        } else if this.ended {
            None
        } else {
            let r = Pin::new(&mut this.inner).poll_frame(cx);
            this.seen.progress(r.is_ready());
            let f = ready!(r);
            match &f {
                None => this.ended = true,
                Some(Err(e)) => this.seen.client_failed(e),
                Some(Ok(_)) => {}
            }
            f
        };
        match &f {
            None => {
                let _ = this
                    .seen
                    .seen
                    .compare_exchange(UNTOUCHED, ENDED_EMPTY, Relaxed, Relaxed);
            }
            Some(Ok(frame)) if frame.data_ref().is_some_and(Bytes::is_empty) => {}
            Some(_) => this.seen.seen.store(CONSUMED, Relaxed),
        }
        Poll::Ready(f)
    }

    fn is_end_stream(&self) -> bool {
        self.back.is_empty() && self.failed.is_none() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.failed.is_some() {
            return SizeHint::default();
        }
        if self.back.is_empty() && !self.ended {
            return self.inner.size_hint();
        }
        let back: u64 = self
            .back
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        if self.ended {
            return SizeHint::with_exact(back);
        }
        let inner = self.inner.size_hint();
        let mut h = SizeHint::new();
        if let Some(u) = inner.upper() {
            h.set_upper(u.saturating_add(back));
        }
        h.set_lower(inner.lower().saturating_add(back));
        h
    }
}

/// A request outstanding on a backend until its response is read to the end or dropped
/// (for least-outstanding balancing).
pub(crate) struct Outstanding(Arc<Backend>);

impl Outstanding {
    pub(crate) fn new(b: &Arc<Backend>) -> Self {
        b.outstanding.fetch_add(1, Relaxed);
        Self(b.clone())
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Relaxed);
    }
}

/// A response body from the proxy: a backend's, streamed as it comes (dropping it drops the
/// backend's response), or the proxy's own short answer (502, 504).
pub struct ProxyBody {
    kind: Kind,
}

// The HTTP/1.1 body is the common case and lives as long as its response: boxing it would
// cost an allocation per request.
#[allow(clippy::large_enum_variant)]
enum Kind {
    /// The body and the request's count on its backend, let go at the body's end.
    Upstream(Received, Option<Outstanding>, Idle),
    Local(Option<Bytes>),
    /// The backend's side of a WebSocket tunnel (HTTP/3 extended CONNECT).
    Tunnel(super::websocket::TunnelRead),
}

/// How long a backend's response body may keep the client waiting for its next piece
/// (nginx's `proxy_read_timeout`): the time counts only while the client asks for more and
/// the backend has nothing, so a client that reads slowly is not the backend's fault. The
/// timer is made the first time the body has to wait (a small response comes whole with its
/// head and never needs one).
struct Idle {
    after: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    waiting: bool,
}

impl ProxyBody {
    pub(crate) fn upstream(body: Received, outstanding: Outstanding, idle: Duration) -> Self {
        let idle = Idle {
            after: idle,
            timer: None,
            waiting: false,
        };
        Self {
            kind: Kind::Upstream(body, Some(outstanding), idle),
        }
    }

    pub(crate) fn tunnel(
        read: tokio::net::tcp::OwnedReadHalf,
        early: Bytes,
        activity: Arc<super::websocket::Activity>,
    ) -> Self {
        Self {
            kind: Kind::Tunnel(super::websocket::TunnelRead::new(read, early, activity)),
        }
    }

    pub(crate) fn local(text: Bytes) -> Self {
        Self {
            kind: Kind::Local(Some(text)),
        }
    }
}

impl std::fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.kind {
            Kind::Upstream(..) => "ProxyBody(upstream)",
            Kind::Local(_) => "ProxyBody(local)",
            Kind::Tunnel(_) => "ProxyBody(tunnel)",
        })
    }
}

impl http_body::Body for ProxyBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        match &mut self.get_mut().kind {
            Kind::Upstream(b, outstanding, idle) => {
                let f = match Pin::new(b).poll_frame(cx) {
                    Poll::Ready(f) => {
                        idle.waiting = false;
                        f
                    }
                    Poll::Pending => {
                        let deadline = tokio::time::Instant::now() + idle.after;
                        let timer = idle
                            .timer
                            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                        if !idle.waiting {
                            idle.waiting = true;
                            timer.as_mut().reset(deadline);
                        }
                        ready!(timer.as_mut().poll(cx));
                        let stalled = super::h1::Error::Stalled(idle.after);
                        Some(Err(Error::Upstream(super::UpstreamError(stalled))))
                    }
                };
                if !matches!(f, Some(Ok(_))) {
                    *outstanding = None;
                }
                Poll::Ready(f)
            }
            Kind::Local(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Kind::Tunnel(t) => t.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Upstream(b, ..) => b.is_end_stream(),
            Kind::Local(b) => b.is_none(),
            Kind::Tunnel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Upstream(b, ..) => b.size_hint(),
            Kind::Local(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Tunnel(_) => SizeHint::default(),
        }
    }
}

impl http_body::Body for Received {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        match self.get_mut() {
            Received::H1(b) => Pin::new(b).poll_frame(cx),
            Received::Hyper(b) | Received::H2(b, _) => {
                Pin::new(b).poll_frame(cx).map_err(Error::Hyper)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Received::H1(b) => b.is_end_stream(),
            Received::Hyper(b) | Received::H2(b, _) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Received::H1(b) => b.size_hint(),
            Received::Hyper(b) | Received::H2(b, _) => b.size_hint(),
        }
    }
}
