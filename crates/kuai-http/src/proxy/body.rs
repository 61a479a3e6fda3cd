//! The bodies a proxy passes on: the client's request body to a backend, and a backend's
//! response body (or the proxy's own answer) to the client.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;

use super::backend::Backend;
use crate::{Body, Error};

/// The request body read by the backend connection: not one byte of it yet.
const UNTOUCHED: u8 = 0;
/// Read to its end without any data: a retry may send an empty body.
const ENDED_EMPTY: u8 = 1;
/// Some data went out (or an error came): a retry cannot send it again.
const CONSUMED: u8 = 2;

/// A request body on its way to a backend, telling the proxy whether any of it was taken.
#[derive(Debug)]
pub(crate) struct UpBody {
    inner: Body,
    seen: Arc<AtomicU8>,
}

impl UpBody {
    pub(crate) fn new(inner: Body) -> (Self, BodyWatch) {
        let seen = Arc::new(AtomicU8::new(UNTOUCHED));
        (
            Self {
                inner,
                seen: seen.clone(),
            },
            BodyWatch(seen),
        )
    }
}

/// What became of an [`UpBody`] handed to a connection that failed.
pub(crate) struct BodyWatch(Arc<AtomicU8>);

impl BodyWatch {
    /// The body was read to its end and had nothing in it: an empty one is the same.
    pub(crate) fn ended_empty(&self) -> bool {
        self.0.load(Relaxed) == ENDED_EMPTY
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
        let f = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &f {
            None => {
                let _ = this
                    .seen
                    .compare_exchange(UNTOUCHED, ENDED_EMPTY, Relaxed, Relaxed);
            }
            Some(Ok(frame)) if frame.data_ref().is_some_and(Bytes::is_empty) => {}
            Some(_) => this.seen.store(CONSUMED, Relaxed),
        }
        Poll::Ready(f)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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

enum Kind {
    /// The body and the request's count on its backend, let go at the body's end.
    Upstream(Incoming, Option<Outstanding>, Option<Recycle>),
    Local(Option<Bytes>),
    /// The backend's side of a WebSocket tunnel (HTTP/3 extended CONNECT).
    Tunnel(super::websocket::TunnelRead),
}

/// An HTTP/1.1 connection to give back to its backend's pool once its response has been
/// read to the end (a response abandoned half-way closes it instead).
pub(crate) struct Recycle {
    pub(crate) backend: Arc<Backend>,
    pub(crate) sender: http1::SendRequest<UpBody>,
    pub(crate) max_idle: usize,
}

impl Recycle {
    fn give_back(self) {
        self.backend.put_idle(self.sender, self.max_idle);
    }
}

impl ProxyBody {
    pub(crate) fn upstream(
        body: Incoming,
        outstanding: Outstanding,
        recycle: Option<Recycle>,
    ) -> Self {
        Self {
            kind: Kind::Upstream(body, Some(outstanding), recycle),
        }
    }

    pub(crate) fn tunnel(
        read: tokio::io::ReadHalf<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>,
        activity: Arc<super::websocket::Activity>,
    ) -> Self {
        Self {
            kind: Kind::Tunnel(super::websocket::TunnelRead::new(read, activity)),
        }
    }

    pub(crate) fn local(text: Bytes) -> Self {
        Self {
            kind: Kind::Local(Some(text)),
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        // A response with nothing (more) to read (after HEAD, a 204, or read to its last
        // frame without the end seen) leaves its connection reusable.
        if let Kind::Upstream(b, _, recycle) = &mut self.kind
            && http_body::Body::is_end_stream(b)
            && let Some(r) = recycle.take()
        {
            r.give_back();
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
            Kind::Upstream(b, outstanding, recycle) => {
                let f = ready!(Pin::new(b).poll_frame(cx));
                match &f {
                    Some(Ok(_)) => {}
                    None => {
                        *outstanding = None;
                        if let Some(r) = recycle.take() {
                            r.give_back();
                        }
                    }
                    Some(Err(_)) => {
                        *outstanding = None;
                        *recycle = None;
                    }
                }
                Poll::Ready(f.map(|r| r.map_err(Error::Hyper)))
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
