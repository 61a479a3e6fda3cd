//! What both sides of an HTTP/3 connection share: the control and QPACK streams, settings,
//! GOAWAY, and connection errors (RFC 9114 §6.2, §7.2.4, §5.2; RFC 9204 §4.2).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use kuai::{Connection, RecvStream};
use kuai_proto::Side;
use kuai_proto::coding::BufMutExt;
use tokio::sync::Notify;

use crate::error::{Code, H3Error};
use crate::frame::{self, Frame, FrameReader, Settings};
use crate::qpack;

/// Unidirectional stream types (RFC 9114 §6.2, RFC 9204 §4.2).
pub mod stream_type {
    pub const CONTROL: u64 = 0x00;
    pub const PUSH: u64 = 0x01;
    pub const QPACK_ENCODER: u64 = 0x02;
    pub const QPACK_DECODER: u64 = 0x03;
}

/// HTTP/3 settings of this endpoint.
#[derive(Debug, Clone)]
pub struct Config {
    /// Largest header section we accept (SETTINGS_MAX_FIELD_SECTION_SIZE).
    pub max_field_section_size: u64,
    /// QPACK dynamic table we let the peer's encoder use.
    pub qpack_max_table_capacity: u64,
    /// Streams that may wait for QPACK encoder instructions at once.
    pub qpack_blocked_streams: u64,
    /// Accept extended CONNECT (RFC 9220).
    pub enable_connect_protocol: bool,
    /// Offer HTTP datagrams (RFC 9297).
    pub h3_datagram: bool,
    /// Send reserved ("grease") frame and stream types so peers stay tolerant of unknown ones.
    pub grease: bool,
    /// Bytes queued for one of our control and QPACK streams that QUIC's send buffer has not
    /// taken yet. Past it the peer is not reading that stream while making us write to it
    /// (Section Acknowledgments for its requests, Insert Count Increments for its inserts):
    /// the connection closes with H3_EXCESSIVE_LOAD (RFC 9204 §7.4, RFC 9114 §10.5).
    pub critical_backlog: usize,
    /// Server: a request stream's head must be complete this long after the stream
    /// arrived, or the stream is rejected (H3_REQUEST_REJECTED); `None`: no limit.
    pub request_head_timeout: Option<std::time::Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_field_section_size: 64 * 1024,
            qpack_max_table_capacity: 4096,
            qpack_blocked_streams: 16,
            enable_connect_protocol: true,
            h3_datagram: true,
            grease: true,
            critical_backlog: 64 * 1024,
            request_head_timeout: Some(std::time::Duration::from_secs(30)),
        }
    }
}

impl Config {
    fn settings(&self) -> Settings {
        Settings {
            qpack_max_table_capacity: self.qpack_max_table_capacity,
            qpack_blocked_streams: self.qpack_blocked_streams,
            max_field_section_size: Some(self.max_field_section_size),
            enable_connect_protocol: self.enable_connect_protocol,
            h3_datagram: self.h3_datagram,
        }
    }
}

pub(crate) struct State {
    pub encoder: qpack::Encoder,
    pub decoder: qpack::Decoder,
    pub peer_settings: Option<Settings>,
    /// Stream ID of the GOAWAY we received (client: requests at or above it will not be
    /// processed), or the one we sent (server).
    pub goaway_received: Option<u64>,
    pub goaway_sent: Option<u64>,
    pub error: Option<H3Error>,
    /// Server: the lowest request stream ID not yet seen (for GOAWAY).
    pub next_request_id: u64,
    /// Server: request streams accepted whose handling has not ended (their head still
    /// arriving, or their handler running).
    pub open_requests: usize,
    /// Which critical unidirectional stream types the peer has opened (indexed by type).
    pub seen_critical: [bool; 4],
    /// Where a decoded section's instructions (a Section Acknowledgment) are written before
    /// they are queued, kept between sections.
    decoder_out: Vec<u8>,
}

/// Shared per-connection HTTP/3 state.
pub(crate) struct Shared {
    pub quic: Connection,
    pub side: Side,
    pub config: Config,
    state: Mutex<State>,
    /// Encoder-stream progress: blocked header blocks may decode now.
    pub qpack_progress: Notify,
    /// Peer settings arrived, GOAWAY, a connection error, or (server) the last open
    /// request ended.
    pub changed: Notify,
    /// Bytes for our QPACK encoder stream, control stream and QPACK decoder stream.
    pub encoder_tx: Outbox,
    pub decoder_tx: Outbox,
    pub control_tx: Outbox,
    /// HTTP datagrams waiting for their request streams.
    pub datagrams: crate::datagram::Queues,
}

/// Bytes for one of our unidirectional streams.
///
/// While nothing waits and the stream is idle they go onto the QUIC stream at once, in the
/// sender's task: instructions reach the stream before anything the sender writes after
/// them (a header section that refers to a new dynamic-table entry is then never sent ahead
/// of the entry, however late the writer task runs), and a Section Acknowledgment costs no
/// task wake-up. Otherwise they wait for the stream's writer task, at most
/// `Config::critical_backlog` of them.
pub(crate) struct Outbox {
    inner: Arc<OutboxInner>,
    limit: usize,
    what: &'static str,
}

struct OutboxInner {
    state: Mutex<OutboxState>,
    /// Set when `buf` goes from empty to not, and when the sender goes away.
    ready: Notify,
    closed: AtomicBool,
}

struct OutboxState {
    /// What the writer task has not taken yet: instructions queued between two of its
    /// turns go out in one write.
    buf: BytesMut,
    /// The stream, while the writer task is not writing on it.
    idle: Option<kuai::SendStream>,
    /// Where bytes written at once are copied: one allocation for many small
    /// instructions (Section Acknowledgments are a few bytes each).
    arena: BytesMut,
}

/// The size of an [`OutboxState::arena`] block.
const ARENA: usize = 4096;

impl Outbox {
    fn new(limit: usize, what: &'static str) -> (Self, OutboxRx) {
        let inner = Arc::new(OutboxInner {
            state: Mutex::new(OutboxState {
                buf: BytesMut::new(),
                idle: None,
                arena: BytesMut::new(),
            }),
            ready: Notify::new(),
            closed: AtomicBool::new(false),
        });
        let rx = OutboxRx {
            inner: inner.clone(),
        };
        (Self { inner, limit, what }, rx)
    }

    /// Queues `b` for the stream; an H3_EXCESSIVE_LOAD error (nothing queued) once more than
    /// the backlog limit would wait.
    pub fn send(&self, b: &[u8]) -> Result<(), H3Error> {
        let mut guard = self.inner.lock();
        let st = &mut *guard;
        if st.buf.len() + b.len() > self.limit {
            return Err(H3Error::new(Code::EXCESSIVE_LOAD, self.what));
        }
        let mut rest = b;
        if st.buf.is_empty()
            && let Some(stream) = st.idle.as_mut()
        {
            if st.arena.capacity() - st.arena.len() < b.len() {
                st.arena = BytesMut::with_capacity(ARENA.max(b.len()));
            }
            st.arena.extend_from_slice(b);
            let data = st.arena.split().freeze();
            // What the stream's send buffer does not take now (or an error, such as 0-RTT
            // refused) is left to the writer task.
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(Ok(n)) = stream.poll_write_chunk(&mut cx, &data) {
                rest = &b[n..];
            }
        }
        if rest.is_empty() {
            return Ok(());
        }
        let wake = st.buf.is_empty();
        st.buf.extend_from_slice(rest);
        drop(guard);
        if wake {
            self.inner.ready.notify_one();
        }
        Ok(())
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.ready.notify_one();
    }
}

impl OutboxInner {
    fn lock(&self) -> MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The writer task's end of an [`Outbox`].
pub(crate) struct OutboxRx {
    inner: Arc<OutboxInner>,
}

impl OutboxRx {
    /// Leaves the stream for senders to write on directly while the task waits.
    fn park(&self, stream: kuai::SendStream) {
        self.inner.lock().idle = Some(stream);
    }

    /// The parked stream, taken back.
    fn unpark(&self) -> Option<kuai::SendStream> {
        self.inner.lock().idle.take()
    }

    /// Everything queued since the last call, with the parked stream to write it on;
    /// `None` once the sender is gone.
    async fn recv(&mut self) -> Option<(Bytes, Option<kuai::SendStream>)> {
        loop {
            {
                let mut st = self.inner.lock();
                if !st.buf.is_empty() {
                    let b = st.buf.split().freeze();
                    return Some((b, st.idle.take()));
                }
            }
            if self.inner.closed.load(Ordering::Acquire) {
                return None;
            }
            self.inner.ready.notified().await;
        }
    }
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the connection with an HTTP/3 error (RFC 9114 §8).
    pub fn fail(&self, e: H3Error) {
        tracing::debug!(error = %e, "HTTP/3 connection error");
        {
            let mut s = self.lock();
            if s.error.is_none() {
                s.error = Some(e.clone());
            }
        }
        self.quic.close(e.code.0, e.reason.as_bytes());
        self.changed.notify_waiters();
        self.qpack_progress.notify_waiters();
    }

    pub fn error(&self) -> Option<H3Error> {
        self.lock().error.clone()
    }

    /// Waits for the peer's SETTINGS (or a connection error).
    pub async fn peer_settings(&self) -> Result<Settings, crate::Error> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if let Some(e) = &s.error {
                    return Err(crate::Error::Protocol(e.clone()));
                }
                if let Some(p) = s.peer_settings {
                    return Ok(p);
                }
            }
            if let Some(e) = self.quic.close_reason() {
                return Err(crate::Error::Connection(e));
            }
            tokio::select! {
                _ = notified => {}
                e = self.quic.closed() => return Err(crate::Error::Connection(e)),
            }
        }
    }

    /// Decodes a header block, waiting while it is blocked on encoder instructions.
    pub async fn decode_fields(
        &self,
        stream_id: u64,
        block: &[u8],
        stream_gone: impl std::future::Future<Output = crate::Error>,
    ) -> Result<Vec<(Bytes, Bytes)>, crate::Error> {
        tokio::pin!(stream_gone);
        loop {
            let notified = self.qpack_progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (r, queued) = {
                let mut guard = self.lock();
                let s = &mut *guard;
                if let Some(e) = &s.error {
                    return Err(crate::Error::Protocol(e.clone()));
                }
                let out = &mut s.decoder_out;
                out.clear();
                let r = s.decoder.decode(stream_id, block, out);
                // Queued under the lock, so decoder instructions leave in the order the
                // decoder made them: a Section Acknowledgment overtaking the Insert Count
                // Increment for the same entries would count them twice (RFC 9204 §4.4).
                let queued = if out.is_empty() {
                    Ok(())
                } else {
                    self.decoder_tx.send(out)
                };
                (r, queued)
            };
            if let Err(e) = queued {
                self.fail(e.clone());
                return Err(crate::Error::Protocol(e));
            }
            match r {
                Ok(qpack::Decoded::Fields(f)) => return Ok(f),
                Ok(qpack::Decoded::Blocked) => {
                    tracing::trace!(stream_id, "header block waits for encoder instructions");
                }
                // Too large a section is a problem of this message only (RFC 9114 §4.2.2).
                Err(e) if e.code == Code::MESSAGE_ERROR.0 => {
                    return Err(crate::Error::Malformed(e.reason));
                }
                Err(e) => {
                    let e = H3Error::new(Code(e.code), e.reason);
                    self.fail(e.clone());
                    return Err(crate::Error::Protocol(e));
                }
            }
            // Blocked: wait for the encoder stream, unless the request stream goes first (a
            // reset section is never decoded; the caller cancels it, RFC 9204 §2.2.2.2).
            tokio::select! {
                _ = notified => {}
                e = self.quic.closed() => return Err(crate::Error::Connection(e)),
                e = &mut stream_gone => return Err(e),
            }
        }
    }

    /// Encodes a header section of `size` bytes (RFC 9114 §4.2.2: names and values plus 32
    /// a field) for `stream_id`, sending encoder instructions first. A section larger than
    /// the peer's SETTINGS_MAX_FIELD_SECTION_SIZE is not encoded (it would be refused):
    /// [`Error::TooLarge`](crate::Error::TooLarge).
    pub fn encode_fields<'a>(
        &self,
        stream_id: u64,
        size: u64,
        fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        block: &mut Vec<u8>,
    ) -> Result<(), crate::Error> {
        let mut enc = Vec::new();
        let mut s = self.lock();
        if s.peer_settings
            .and_then(|p| p.max_field_section_size)
            .is_some_and(|max| size > max)
        {
            return Err(crate::Error::TooLarge);
        }
        s.encoder
            .encode_with(stream_id, fields, block, &mut enc)
            .map_err(|e| crate::Error::Protocol(H3Error::new(Code(e.code), e.reason)))?;
        // Queued under the lock: two requests encoded at once must put their insertions on
        // the encoder stream in the order the table numbered them.
        let queued = if enc.is_empty() {
            Ok(())
        } else {
            self.encoder_tx.send(&enc)
        };
        drop(s);
        if let Err(e) = queued {
            self.fail(e.clone());
            return Err(crate::Error::Protocol(e));
        }
        Ok(())
    }

    /// A request stream went away before its headers were decoded (RFC 9204 §4.4.2).
    pub fn cancel_stream(&self, stream_id: u64) {
        let mut out = Vec::new();
        let mut s = self.lock();
        s.decoder.cancel_stream(stream_id, &mut out);
        let queued = if out.is_empty() {
            Ok(())
        } else {
            self.decoder_tx.send(&out)
        };
        drop(s);
        if let Err(e) = queued {
            self.fail(e);
        }
    }
}

/// Sets up the HTTP/3 layer on an established QUIC connection: opens our control and QPACK
/// streams, and starts the tasks that read the peer's.
pub(crate) async fn start(
    quic: Connection,
    side: Side,
    config: Config,
) -> Result<Arc<Shared>, crate::Error> {
    let backlog = config.critical_backlog;
    let (encoder_tx, encoder_rx) =
        Outbox::new(backlog, "the peer does not read our QPACK encoder stream");
    let (decoder_tx, decoder_rx) =
        Outbox::new(backlog, "the peer does not read our QPACK decoder stream");
    let (control_tx, control_rx) =
        Outbox::new(backlog, "the peer does not read our control stream");
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            // Until the peer's SETTINGS arrive, its QPACK limits are zero (RFC 9204 §3.2.2).
            encoder: qpack::Encoder::new(0, 0),
            decoder: qpack::Decoder::new(
                config.qpack_max_table_capacity,
                config.qpack_blocked_streams,
                config.max_field_section_size,
            ),
            peer_settings: None,
            goaway_received: None,
            goaway_sent: None,
            error: None,
            next_request_id: 0,
            open_requests: 0,
            seen_critical: [false; 4],
            decoder_out: Vec::new(),
        }),
        quic,
        side,
        qpack_progress: Notify::new(),
        changed: Notify::new(),
        encoder_tx,
        decoder_tx,
        control_tx,
        datagrams: Default::default(),
        config,
    });
    // Our unidirectional streams: control (SETTINGS first), QPACK encoder and decoder.
    let seed = rand_seed();
    let mut control = Vec::new();
    control.put_var(stream_type::CONTROL);
    shared.config.settings().encode(seed, &mut control);
    if shared.config.grease {
        // A reserved frame type after SETTINGS (RFC 9114 §7.2.8).
        frame::write_header(frame::grease_value(seed >> 16), 1, &mut control);
        control.push(0x2a);
    }
    open_uni(&shared, control, control_rx).await?;
    let mut enc = Vec::new();
    enc.put_var(stream_type::QPACK_ENCODER);
    open_uni(&shared, enc, encoder_rx).await?;
    let mut dec = Vec::new();
    dec.put_var(stream_type::QPACK_DECODER);
    open_uni(&shared, dec, decoder_rx).await?;
    if shared.config.grease {
        // A reserved stream type (RFC 9114 §6.2.3): the peer must ignore it.
        let s = shared.clone();
        tokio::spawn(async move {
            if let Ok(mut st) = s.quic.open_uni().await {
                let mut b = Vec::new();
                b.put_var(frame::grease_value(seed >> 32));
                b.extend_from_slice(b"kuai");
                let _ = st.write_all(&b).await;
                let _ = st.finish();
            }
        });
    }
    let s = shared.clone();
    tokio::spawn(async move { accept_uni(s).await });
    if shared.config.h3_datagram {
        tokio::spawn(crate::datagram::demux(shared.clone()));
    } else {
        // HTTP datagrams not offered, QUIC's may still be: what a peer sends anyway is read
        // and dropped, not left in the connection's queue (and its memory budget) for good.
        let s = shared.clone();
        tokio::spawn(async move { while s.quic.read_datagram().await.is_ok() {} });
    }
    Ok(shared)
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b75_6169);
    h.finish()
}

/// Opens one of our unidirectional streams, writes `first`, then forwards queued bytes.
///
/// A client's stream opened in 0-RTT is void if the server rejects the early data: it is
/// then opened again and `first` (the stream type, and SETTINGS on the control stream) sent
/// again. Nothing else can have been lost with it: until the server's SETTINGS arrive, which
/// is after the rejection is known, the QPACK encoder uses no dynamic table.
async fn open_uni(
    shared: &Arc<Shared>,
    first: Vec<u8>,
    mut rx: OutboxRx,
) -> Result<(), crate::Error> {
    let mut stream = shared.quic.open_uni().await?;
    critical(&stream);
    stream
        .write_all(&first)
        .await
        .map_err(crate::stream::write_error)?;
    let quic = shared.quic.clone();
    // Weak: the task ends when the connection state (holding the sender) goes away.
    let owner = Arc::downgrade(shared);
    // The task ends when the connection state (holding the sender) goes away, after the
    // connection closed; the stream stays open until then, as critical streams must.
    rx.park(stream);
    tokio::spawn(async move {
        let mut outcome = Some(quic.early_data_outcome());
        loop {
            let next = tokio::select! {
                b = rx.recv() => b,
                accepted = async { outcome.as_mut().expect("guarded").await }, if outcome.is_some() => {
                    outcome = None;
                    let Some(stream) = rx.unpark() else { break };
                    if !accepted && stream.is_0rtt_rejected() {
                        match reopen_uni(&quic, &first).await {
                            Some(s) => rx.park(s),
                            None => break,
                        }
                    } else {
                        rx.park(stream);
                    }
                    continue;
                }
            };
            let Some((b, Some(mut stream))) = next else {
                break;
            };
            let written = match stream.write_chunk(b.clone()).await {
                Ok(()) => true,
                Err(kuai::WriteError::ZeroRttRejected) => match reopen_uni(&quic, &first).await {
                    Some(s) => {
                        stream = s;
                        stream.write_chunk(b).await.is_ok()
                    }
                    None => false,
                },
                // RFC 9114 §6.2.1, RFC 9204 §4.2: the peer may not ask us to close a critical
                // stream; without this what we queue there would pile up unsent until the
                // backlog limit.
                Err(kuai::WriteError::Stopped(_)) => {
                    if let Some(s) = owner.upgrade() {
                        s.fail(H3Error::new(
                            Code::CLOSED_CRITICAL_STREAM,
                            "the peer stopped one of our critical streams",
                        ));
                    }
                    false
                }
                Err(_) => false,
            };
            if !written {
                break;
            }
            rx.park(stream);
        }
    });
    Ok(())
}

async fn reopen_uni(quic: &Connection, first: &[u8]) -> Option<kuai::SendStream> {
    let mut s = quic.open_uni().await.ok()?;
    critical(&s);
    s.write_all(first).await.ok()?;
    Some(s)
}

/// Our control and QPACK streams go out before any request or response data.
///
/// A header section may refer to dynamic-table entries that the encoder stream carries
/// (RFC 9204 §2.1.2: the peer's decoder waits for them), and encoder instructions are written
/// after the section they serve; at the default urgency they queued behind the bodies of
/// every response already scheduled, and a client saw the first byte of a 1 MB response
/// only after it had nearly all of it. RFC 9218 leaves these streams unprioritised; the
/// bytes are few.
fn critical(stream: &kuai::SendStream) {
    stream.set_priority(kuai::Priority {
        urgency: 0,
        incremental: true,
    });
}

/// Accepts the peer's unidirectional streams. Each one is read on its own task: a stream can
/// be opened implicitly by a higher-numbered one (RFC 9000 §3.2) and carry no byte for a long
/// time (a lazily used QPACK decoder stream), which must not hold up the streams after it.
async fn accept_uni(shared: Arc<Shared>) {
    while let Ok(recv) = shared.quic.accept_uni().await {
        let s = shared.clone();
        tokio::spawn(async move { dispatch_uni(s, recv).await });
    }
}

/// Reads a unidirectional stream's type and hands it to its reader (RFC 9114 §6.2).
async fn dispatch_uni(shared: Arc<Shared>, mut recv: RecvStream) {
    // The stream type is the first varint.
    let Some(ty) = read_varint(&mut recv).await else {
        return;
    };
    match ty {
        stream_type::CONTROL | stream_type::QPACK_ENCODER | stream_type::QPACK_DECODER => {
            let first = !std::mem::replace(&mut shared.lock().seen_critical[ty as usize], true);
            if !first {
                shared.fail(H3Error::new(
                    Code::STREAM_CREATION_ERROR,
                    "second critical stream of one type",
                ));
                return;
            }
        }
        stream_type::PUSH if shared.side.is_server() => {
            // Only servers push (RFC 9114 §6.2.2).
            shared.fail(H3Error::new(
                Code::STREAM_CREATION_ERROR,
                "push stream from a client",
            ));
            return;
        }
        stream_type::PUSH => {
            // We never send MAX_PUSH_ID, so a push stream is an error (RFC 9114 §4.6).
            shared.fail(H3Error::new(
                Code::ID_ERROR,
                "push stream without MAX_PUSH_ID",
            ));
            return;
        }
        _ => {
            // Unknown or reserved types are ignored (RFC 9114 §6.2).
            let _ = recv.stop(Code::STREAM_CREATION_ERROR.0);
            return;
        }
    }
    let e = match ty {
        stream_type::CONTROL => read_control(&shared, recv).await,
        stream_type::QPACK_ENCODER => read_encoder(&shared, recv).await,
        _ => read_decoder(&shared, recv).await,
    };
    if let Err(e) = e {
        shared.fail(e);
    }
}

async fn read_varint(recv: &mut RecvStream) -> Option<u64> {
    let mut buf = Vec::with_capacity(8);
    loop {
        if let Some(&first) = buf.first() {
            let len = 1usize << (first >> 6);
            if buf.len() >= len {
                let mut s = &buf[..len];
                return kuai_proto::coding::BufExt::get_var(&mut s).ok();
            }
        }
        let chunk = recv.read_chunk(1).await.ok()??;
        buf.extend_from_slice(&chunk);
    }
}

fn closed_critical() -> H3Error {
    H3Error::new(Code::CLOSED_CRITICAL_STREAM, "a critical stream was closed")
}

async fn read_control(shared: &Arc<Shared>, mut recv: RecvStream) -> Result<(), H3Error> {
    let mut reader = FrameReader::new(64 * 1024);
    let mut first = true;
    let mut max_push_id: Option<u64> = None;
    loop {
        let chunk = match recv.read_chunk(64 * 1024).await {
            Ok(Some(c)) => c,
            Ok(None) => return Err(closed_critical()),
            Err(kuai::ReadError::ConnectionLost(_)) => return Ok(()),
            Err(_) => return Err(closed_critical()),
        };
        reader.push_bytes(chunk);
        loop {
            let f = match reader.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                // An HTTP/2 frame type first is first of all not SETTINGS (RFC 9114 §6.2.1;
                // later it is H3_FRAME_UNEXPECTED, §7.2.8).
                Err(e) if first && e.code == Code::FRAME_UNEXPECTED => {
                    return Err(H3Error::new(
                        Code::MISSING_SETTINGS,
                        "control stream must start with SETTINGS",
                    ));
                }
                Err(e) => return Err(e),
            };
            if first && !matches!(f, Frame::Settings(_)) {
                return Err(H3Error::new(
                    Code::MISSING_SETTINGS,
                    "control stream must start with SETTINGS",
                ));
            }
            match f {
                Frame::Settings(p) if first => {
                    first = false;
                    let settings = Settings::decode(&p)?;
                    // HTTP datagrams ride QUIC DATAGRAM frames: a peer offering them
                    // without offering those is in error (RFC 9297 §2.1.1).
                    if settings.h3_datagram && shared.quic.max_datagram_size().is_none() {
                        return Err(H3Error::new(
                            Code::SETTINGS_ERROR,
                            "H3_DATAGRAM without the QUIC datagram transport parameter",
                        ));
                    }
                    {
                        let mut s = shared.lock();
                        // The peer's capacity sets MaxEntries; we use at most what we
                        // allow ourselves (16 KiB at least).
                        s.encoder.set_peer_settings(
                            settings.qpack_max_table_capacity,
                            settings.qpack_blocked_streams,
                            shared.config.qpack_max_table_capacity.max(16 * 1024),
                        );
                        s.peer_settings = Some(settings);
                    }
                    shared.changed.notify_waiters();
                }
                Frame::Settings(_) => {
                    return Err(H3Error::new(Code::FRAME_UNEXPECTED, "second SETTINGS"));
                }
                Frame::Goaway(id) => {
                    let mut s = shared.lock();
                    // A server's GOAWAY names a client-initiated bidirectional stream.
                    if shared.side.is_client() && id % 4 != 0 {
                        return Err(H3Error::new(
                            Code::ID_ERROR,
                            "GOAWAY with a non-request stream ID",
                        ));
                    }
                    if s.goaway_received.is_some_and(|prev| id > prev) {
                        return Err(H3Error::new(Code::ID_ERROR, "GOAWAY ID increased"));
                    }
                    s.goaway_received = Some(id);
                    drop(s);
                    shared.changed.notify_waiters();
                }
                Frame::MaxPushId(id) if shared.side.is_server() => {
                    // RFC 9114 §7.2.7: the maximum push ID cannot go down.
                    if max_push_id.is_some_and(|m| id < m) {
                        return Err(H3Error::new(Code::ID_ERROR, "MAX_PUSH_ID went down"));
                    }
                    max_push_id = Some(id);
                }
                Frame::CancelPush(_) => {
                    // RFC 9114 §7.2.3: we never send PUSH_PROMISE (server) nor MAX_PUSH_ID
                    // (client), so no push ID can be cancelled: every one is beyond what is
                    // allowed or was never promised.
                    return Err(H3Error::new(
                        Code::ID_ERROR,
                        "CANCEL_PUSH for a push that cannot exist",
                    ));
                }
                Frame::Unknown(_) => {}
                Frame::Data(_)
                | Frame::Headers(_)
                | Frame::HeadersTooLarge(_)
                | Frame::PushPromise
                | Frame::MaxPushId(_) => {
                    return Err(H3Error::new(
                        Code::FRAME_UNEXPECTED,
                        "frame not allowed on the control stream",
                    ));
                }
            }
        }
    }
}

async fn read_encoder(shared: &Arc<Shared>, mut recv: RecvStream) -> Result<(), H3Error> {
    loop {
        let chunk = match recv.read_chunk(64 * 1024).await {
            Ok(Some(c)) => c,
            Ok(None) => return Err(closed_critical()),
            Err(kuai::ReadError::ConnectionLost(_)) => return Ok(()),
            Err(_) => return Err(closed_critical()),
        };
        tracing::trace!(len = chunk.len(), "QPACK encoder stream data");
        let mut out = Vec::new();
        let (r, queued) = {
            let mut s = shared.lock();
            let r = s.decoder.on_encoder_stream(&chunk, &mut out);
            // Under the lock: see decode_fields.
            let queued = if out.is_empty() {
                Ok(())
            } else {
                shared.decoder_tx.send(&out)
            };
            (r, queued)
        };
        r.map_err(|e| H3Error::new(Code(e.code), e.reason))?;
        queued?;
        shared.qpack_progress.notify_waiters();
    }
}

async fn read_decoder(shared: &Arc<Shared>, mut recv: RecvStream) -> Result<(), H3Error> {
    loop {
        let chunk = match recv.read_chunk(64 * 1024).await {
            Ok(Some(c)) => c,
            Ok(None) => return Err(closed_critical()),
            Err(kuai::ReadError::ConnectionLost(_)) => return Ok(()),
            Err(_) => return Err(closed_critical()),
        };
        shared
            .lock()
            .encoder
            .on_decoder_stream(&chunk)
            .map_err(|e| H3Error::new(Code(e.code), e.reason))?;
    }
}

/// Closes the connection (H3_NO_ERROR) when the application's last handle goes.
pub(crate) struct CloseGuard(pub Arc<Shared>);

impl Drop for CloseGuard {
    fn drop(&mut self) {
        self.0.quic.close(Code::NO_ERROR.0, b"");
    }
}

/// Sends GOAWAY with `id` on our control stream.
pub(crate) fn send_goaway(shared: &Shared, id: u64) {
    let mut b = Vec::new();
    frame::write_header(
        frame::GOAWAY,
        kuai_proto::VarInt::size_of(id) as u64,
        &mut b,
    );
    b.put_var(id);
    if let Err(e) = shared.control_tx.send(&b) {
        shared.fail(e);
    }
}
