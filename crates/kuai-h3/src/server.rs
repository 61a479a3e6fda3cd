//! The HTTP/3 server.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tokio::sync::mpsc;

use crate::conn::{self, CloseGuard, Config, Shared};
use crate::error::{Code, Error};
use crate::message;
use crate::stream::{RecvHalf, RequestStream, SendHalf};

/// Requests whose heads were read but not yet accepted by the application.
const ACCEPT_QUEUE: usize = 256;

/// The server side of an HTTP/3 connection.
pub struct Server {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<(Request<()>, RequestStream)>,
    _guard: Arc<CloseGuard>,
}

impl Server {
    /// Starts HTTP/3 on an accepted connection (ALPN `h3`); requests come from
    /// [`accept`](Self::accept).
    pub async fn new(quic: kuai::Connection, config: Config) -> Result<Self, Error> {
        let (tx, rx) = mpsc::channel(ACCEPT_QUEUE);
        let queue = tx.clone();
        let handler = move |req, stream| {
            let queue = queue.clone();
            async move {
                let _ = queue.send((req, stream)).await;
            }
        };
        Self::start(quic, config, tx, rx, handler).await
    }

    /// Starts HTTP/3 on an accepted connection and hands each request to `handler` in the
    /// task that read its head: no second task and no queue between them. [`accept`]
    /// yields no request then; it returns `None` once the connection is closed (or, after
    /// [`shutdown`](Self::shutdown), drained) and every handler has returned.
    ///
    /// [`accept`]: Self::accept
    pub async fn with_handler<H, F>(
        quic: kuai::Connection,
        config: Config,
        handler: H,
    ) -> Result<Self, Error>
    where
        H: Fn(Request<()>, RequestStream) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(1);
        Self::start(quic, config, tx, rx, handler).await
    }

    async fn start<H, F>(
        quic: kuai::Connection,
        config: Config,
        tx: mpsc::Sender<(Request<()>, RequestStream)>,
        rx: mpsc::Receiver<(Request<()>, RequestStream)>,
        handler: H,
    ) -> Result<Self, Error>
    where
        H: Fn(Request<()>, RequestStream) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let shared = conn::start(quic, kuai_proto::Side::Server, config).await?;
        tokio::spawn(accept_requests(shared.clone(), tx, Arc::new(handler)));
        Ok(Self {
            _guard: Arc::new(CloseGuard(shared.clone())),
            shared,
            rx,
        })
    }

    /// The next request (its head; the body is read from the stream). `None` once the
    /// connection is closed or, after [`shutdown`](Self::shutdown), drained.
    pub async fn accept(&mut self) -> Option<(Request<()>, RequestStream)> {
        self.rx.recv().await
    }

    /// Graceful shutdown (RFC 9114 §5.2): GOAWAY tells the client which requests will be
    /// processed; later ones are rejected so it can retry them elsewhere.
    pub fn shutdown(&self) {
        let id = {
            let mut s = self.shared.lock();
            let id = s.next_request_id;
            s.goaway_sent = Some(id);
            id
        };
        conn::send_goaway(&self.shared, id);
        self.shared.changed.notify_waiters();
    }

    /// The underlying QUIC connection.
    pub fn quic(&self) -> &kuai::Connection {
        &self.shared.quic
    }

    /// The client's HTTP/3 settings, once they arrived (HTTP datagrams, for one, may be
    /// sent only after them: RFC 9297 §2.1.1).
    pub async fn peer_settings(&self) -> Result<crate::frame::Settings, Error> {
        self.shared.peer_settings().await
    }

    /// Request streams the client opened that are not done with: their head still
    /// arriving, or (with [`with_handler`](Self::with_handler)) their handler running.
    /// After [`shutdown`](Self::shutdown), the connection is drained when this is zero:
    /// the GOAWAY promised the client that every stream below its ID would be processed
    /// (RFC 9114 §5.2), and a head still on its way counts.
    pub fn open_requests(&self) -> usize {
        self.shared.lock().open_requests
    }

    /// Resolves when [`open_requests`](Self::open_requests) is zero (it borrows nothing,
    /// so it can be awaited beside [`accept`](Self::accept)).
    pub fn requests_done(&self) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            loop {
                let notified = shared.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if shared.lock().open_requests == 0 {
                    return;
                }
                notified.await;
            }
        }
    }
}

/// Counts a request stream among [`Server::open_requests`] until dropped.
struct OpenRequest(Arc<Shared>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        let done = {
            let mut s = self.0.lock();
            s.open_requests = s.open_requests.saturating_sub(1);
            s.open_requests == 0
        };
        if done {
            self.0.changed.notify_waiters();
        }
    }
}

/// Reads request heads as streams arrive, each in a task of its own that then runs
/// `handler`; one slow request does not hold up the others. Every such task holds a clone
/// of `tx`, so the server's `accept` ends only after the last of them.
async fn accept_requests<H, F>(
    shared: Arc<Shared>,
    tx: mpsc::Sender<(Request<()>, RequestStream)>,
    handler: Arc<H>,
) where
    H: Fn(Request<()>, RequestStream) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    loop {
        let (send, recv) = tokio::select! {
            r = shared.quic.accept_bi() => match r {
                Ok(s) => s,
                Err(_) => return,
            },
            _ = tx.closed() => return,
        };
        let id = recv.id().0;
        tracing::trace!(id, "request stream accepted");
        let mut stream = RequestStream::new(shared.clone(), send, recv);
        {
            let mut s = shared.lock();
            if s.goaway_sent.is_some_and(|g| id >= g) {
                drop(s);
                // After GOAWAY: not processed, safe to retry (RFC 9114 §5.2).
                stream.cancel(Code::REQUEST_REJECTED);
                continue;
            }
            s.next_request_id = s.next_request_id.max(id + 4);
            s.open_requests += 1;
        }
        let open = OpenRequest(shared.clone());
        let alive = tx.clone();
        let handler = handler.clone();
        let extended_connect = shared.config.enable_connect_protocol;
        let head_timeout = shared.config.request_head_timeout;
        tokio::spawn(async move {
            // Counted until this task ends, whichever way.
            let _open = open;
            let head = match head_timeout {
                Some(t) => tokio::time::timeout(t, stream.recv.recv_fields()).await,
                None => Ok(stream.recv.recv_fields().await),
            };
            let Ok(head) = head else {
                // Not processed, so the client may send it again (RFC 9114 §8.1).
                tracing::debug!(id, "request head not complete in time");
                stream.cancel(Code::REQUEST_REJECTED);
                return;
            };
            let head = match head {
                Ok(Some(f)) => f,
                Ok(None) => {
                    stream.cancel(Code::REQUEST_INCOMPLETE);
                    return;
                }
                // A malformed head: reset our side too (RFC 9114 §4.1.2).
                Err(Error::Malformed(why)) => {
                    tracing::debug!(why, "malformed request head");
                    stream.malformed(why);
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "request head failed");
                    return;
                }
            };
            let mut parts = match message::parse_request(&head, extended_connect) {
                Ok(p) => p,
                Err(why) => {
                    tracing::debug!(why, "malformed request");
                    stream.malformed(why);
                    return;
                }
            };
            if let Err(Error::Malformed(why)) = stream.recv.set_expected_len(&parts.headers) {
                tracing::debug!(why, "malformed request");
                stream.malformed(why);
                return;
            }
            // The head (some of it at least) came in 0-RTT: the handler sees it.
            if stream.recv.received_in_0rtt() {
                parts.extensions.insert(crate::EarlyData);
            }
            // Boxed: the task then moves (at spawn and when it ends) only its own small state,
            // not the handler's.
            Box::pin(handler(Request::from_parts(parts, ()), stream)).await;
            drop(alive);
        });
    }
}

impl RequestStream {
    /// Server: sends the response head.
    pub async fn send_response(&mut self, resp: Response<()>) -> Result<(), Error> {
        self.send.send_response(resp).await
    }

    /// Server: sends an informational (1xx) response before the final one.
    pub async fn send_informational(&mut self, resp: Response<()>) -> Result<(), Error> {
        self.send.send_informational(resp).await
    }
}

impl SendHalf {
    /// Server: sends the response head.
    pub async fn send_response(&mut self, resp: Response<()>) -> Result<(), Error> {
        let (parts, ()) = resp.into_parts();
        if parts.status.is_informational() {
            return Err(Error::Malformed("use send_informational for 1xx"));
        }
        let frame = self.headers_frame(|| message::response_field_refs(&parts))?;
        self.send_headers_frame(frame).await
    }

    /// Server: sends an informational (1xx) response before the final one.
    pub async fn send_informational(&mut self, resp: Response<()>) -> Result<(), Error> {
        let (parts, ()) = resp.into_parts();
        if !parts.status.is_informational() || parts.status == http::StatusCode::SWITCHING_PROTOCOLS
        {
            return Err(Error::Malformed("not an informational status"));
        }
        let frame = self.headers_frame(|| message::response_field_refs(&parts))?;
        self.send_headers_frame(frame).await
    }
}

/// A response body for [`serve`].
pub enum Body {
    /// No body.
    Empty,
    /// The whole body.
    Full(Bytes),
    /// Chunks as they are produced (see [`Body::channel`]).
    Stream(mpsc::Receiver<Bytes>),
}

impl Body {
    /// A streaming body and the sender feeding it.
    pub fn channel(depth: usize) -> (mpsc::Sender<Bytes>, Body) {
        let (tx, rx) = mpsc::channel(depth.max(1));
        (tx, Body::Stream(rx))
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Self {
        Body::Full(b)
    }
}

impl From<&'static str> for Body {
    fn from(s: &'static str) -> Self {
        Body::Full(Bytes::from_static(s.as_bytes()))
    }
}

impl From<String> for Body {
    fn from(s: String) -> Self {
        Body::Full(Bytes::from(s))
    }
}

/// Serves a connection with `handler`: every request gets its own task; the handler sees the
/// request head with its body as a [`RecvHalf`], and returns the response.
pub async fn serve<H, F>(quic: kuai::Connection, config: Config, handler: H) -> Result<(), Error>
where
    H: Fn(Request<RecvHalf>) -> F + Send + Sync + Clone + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let mut server = Server::new(quic, config).await?;
    while let Some((req, stream)) = server.accept().await {
        let handler = handler.clone();
        tokio::spawn(async move {
            let (mut send, recv) = stream.split();
            let (parts, ()) = req.into_parts();
            let resp = handler(Request::from_parts(parts, recv)).await;
            let (parts, body) = resp.into_parts();
            let r: Result<(), Error> = async {
                let head = send.headers_frame(|| message::response_field_refs(&parts))?;
                send.send_headers_frame(head).await?;
                match body {
                    Body::Empty => {}
                    Body::Full(b) => send.send_data(b).await?,
                    Body::Stream(mut rx) => {
                        while let Some(chunk) = rx.recv().await {
                            send.send_data(chunk).await?;
                        }
                    }
                }
                send.finish()?;
                send.finished().await
            }
            .await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "response not delivered");
            }
        });
    }
    Ok(())
}
