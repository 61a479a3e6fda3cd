//! Streams (RFC 9000 §2–4): state machines, stream limits, flow control and the priority
//! scheduler (RFC 9218 urgency and incremental) that decides whose data goes out next.

mod flow;
mod recv;
mod send;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

pub use flow::RecvWindow;
pub use recv::{Assembler, to_keep};
pub use send::SendBuffer;

use crate::coding::BufMutExt;
use crate::error::TransportError;
use crate::frame::{FrameType, StreamHeader};
use crate::recovery::SentFrame;
use crate::transport_params::TransportParameters;
use crate::types::{Dir, IdMap, Side, StreamId};
use crate::varint::VarInt;

/// Stream priority as in RFC 9218: lower urgency first; incremental streams of the same
/// urgency share the bandwidth round-robin, non-incremental ones go one after another.
#[derive(Debug, Copy, Clone, Eq, PartialEq, Hash)]
pub struct Priority {
    /// 0 (highest) to 7 (lowest); 3 by default.
    pub urgency: u8,
    /// Whether its data may be interleaved with that of other streams of the same urgency.
    pub incremental: bool,
}

impl Default for Priority {
    fn default() -> Self {
        Self {
            urgency: 3,
            incremental: false,
        }
    }
}

/// Something the application should know about a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEvent {
    /// The peer opened a stream of this kind; take it with `accept`.
    Opened(Dir),
    /// Data or the end of the stream can be read.
    Readable(StreamId),
    /// Flow control or buffer space opened up: more can be written.
    Writable(StreamId),
    /// All data sent on the stream, FIN included, was acknowledged.
    Finished(StreamId),
    /// The peer asked us to stop sending (STOP_SENDING) with this code.
    Stopped(StreamId, u64),
    /// The stream was reset with this code at its delivery deadline (see
    /// [`Connection::set_delivery_deadline`](crate::Connection::set_delivery_deadline)): what
    /// it sent was not all acknowledged in time.
    Expired(StreamId, u64),
    /// The stream limit was raised: more streams of this kind can be opened.
    Available(Dir),
}

/// Why a stream operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamError {
    /// No such stream, or it is already closed on this side.
    UnknownStream,
    /// The stream limit is reached; wait for [`StreamEvent::Available`].
    Blocked,
    /// The send side was finished or reset already.
    ClosedStream,
    /// The peer sent STOP_SENDING with this code.
    Stopped(u64),
    /// The peer reset the stream with this code.
    Reset(u64),
    /// Nothing to read right now.
    WouldBlock,
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::UnknownStream => f.write_str("unknown or closed stream"),
            StreamError::Blocked => f.write_str("stream limit reached"),
            StreamError::ClosedStream => f.write_str("stream already finished or reset"),
            StreamError::Stopped(c) => write!(f, "peer stopped the stream with code {c}"),
            StreamError::Reset(c) => write!(f, "peer reset the stream with code {c}"),
            StreamError::WouldBlock => f.write_str("no data available yet"),
        }
    }
}

impl std::error::Error for StreamError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendState {
    /// Sending; `fin` tells whether the application finished writing.
    Open { fin: bool },
    /// Reset sent with this code; waiting for the RESET_STREAM to be acknowledged.
    ResetSent { code: u64 },
}

#[derive(Debug)]
struct SendStream {
    buf: SendBuffer,
    state: SendState,
    /// Peer's MAX_STREAM_DATA.
    max_data: u64,
    /// FIN is in flight or acknowledged, so it need not be sent again unless lost.
    fin_sent: bool,
    fin_acked: bool,
    priority: Priority,
    /// STREAM_DATA_BLOCKED was sent for this limit.
    blocked_sent_at: Option<u64>,
    stopped: Option<u64>,
    /// Final size announced in our RESET_STREAM.
    reset_final_size: u64,
    /// A write was refused or cut short; announce [`StreamEvent::Writable`] when room opens.
    want_writable: bool,
    /// Most bytes written and not yet sent once that the stream takes (see
    /// [`Streams::set_max_unsent`]).
    max_unsent: Option<u64>,
    /// A write was refused for `max_unsent`: announce writable when half of it has gone.
    unsent_blocked: bool,
    /// When the stream is reset unless all it sent was acknowledged by then (see
    /// [`Streams::set_delivery_deadline`]); its key in `Streams::deadlines`.
    deadline: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvState {
    Open,
    /// Peer reset the stream; the application learns it on its next read.
    ResetRecvd {
        code: u64,
    },
    /// All data up to the final size has been read, or the reset was delivered.
    Done,
}

#[derive(Debug)]
struct RecvStream {
    asm: Assembler,
    final_size: Option<u64>,
    window: RecvWindow,
    state: RecvState,
    /// We asked the peer to stop (STOP_SENDING with this code); data is discarded.
    stop_code: Option<u64>,
    /// The STOP_SENDING waits until more data arrives ([`Streams::stop_unless_ending`]).
    stop_deferred: bool,
    /// Some of its data arrived in 0-RTT packets (replayable: RFC 9001 §9.2, RFC 8470).
    early: bool,
}

impl RecvStream {
    fn highest(&self) -> u64 {
        self.final_size.unwrap_or_else(|| self.asm.received_end())
    }
}

/// Control frames waiting for room in a packet.
#[derive(Debug, Default)]
struct Pending {
    max_data: bool,
    max_stream_data: Vec<StreamId>,
    max_streams: [bool; 2],
    reset: Vec<StreamId>,
    stop: Vec<StreamId>,
    data_blocked: Option<u64>,
    stream_data_blocked: Vec<StreamId>,
    streams_blocked: [Option<u64>; 2],
}

/// Limits and windows from the local configuration.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub max_concurrent_bidi: u64,
    pub max_concurrent_uni: u64,
    pub stream_window: u64,
    pub stream_window_cap: u64,
    pub conn_window: u64,
    pub conn_window_cap: u64,
    /// Largest amount of unacknowledged data buffered per stream before writes are refused.
    pub send_buffer: u64,
    /// Largest amount of unacknowledged data buffered by all streams together.
    pub connection_send_buffer: u64,
}

impl StreamConfig {
    /// The initial receive windows of a connection made under memory pressure (see
    /// `crate::config::MemoryBudget`); they grow again by auto-tuning once it is over.
    pub(crate) fn shrink_for_pressure(&mut self) {
        self.stream_window = self.stream_window.min(PRESSURE_STREAM_WINDOW);
        self.conn_window = self.conn_window.min(PRESSURE_CONN_WINDOW);
    }
}

/// Bytes a stream may buffer beyond what the peer's flow-control credit lets it send: a peer
/// that grants little credit cannot make us hold much (a 1-byte window and a large response
/// pin 64 KiB, not the whole send buffer), while data is ready the moment credit arrives.
pub const SEND_AHEAD_OF_CREDIT: u64 = 64 * 1024;

/// Under memory pressure (see `crate::config::MemoryBudget`): a connection's send buffers
/// together, and the receive windows advertised per stream and per connection.
const PRESSURE_SEND_BUFFER: u64 = 256 * 1024;
const PRESSURE_STREAM_WINDOW: u64 = 64 * 1024;
const PRESSURE_CONN_WINDOW: u64 = 256 * 1024;

/// All streams of a connection.
#[derive(Debug)]
/// The send queues, one per urgency level (RFC 9218 §4), allocated when a stream first
/// queues and given back when a quiet connection has nothing queued. Reading an absent
/// queue sees an empty one.
#[derive(Default)]
struct SendQueues(Option<Box<[VecDeque<StreamId>; 8]>>);

static NO_QUEUE: VecDeque<StreamId> = VecDeque::new();

impl SendQueues {
    fn iter(&self) -> impl Iterator<Item = &VecDeque<StreamId>> {
        (0..8).map(move |i| &self[i])
    }

    fn release_if_empty(&mut self) {
        if self
            .0
            .as_ref()
            .is_some_and(|q| q.iter().all(VecDeque::is_empty))
        {
            self.0 = None;
        }
    }
}

impl std::ops::Index<usize> for SendQueues {
    type Output = VecDeque<StreamId>;

    fn index(&self, urgency: usize) -> &VecDeque<StreamId> {
        self.0.as_ref().map_or(&NO_QUEUE, |q| &q[urgency])
    }
}

impl std::ops::IndexMut<usize> for SendQueues {
    fn index_mut(&mut self, urgency: usize) -> &mut VecDeque<StreamId> {
        &mut self.0.get_or_insert_with(Default::default)[urgency]
    }
}

pub struct Streams {
    side: Side,
    cfg: StreamConfig,
    send: IdMap<StreamId, SendStream>,
    recv: IdMap<StreamId, RecvStream>,
    /// Streams opened by us: next index and the peer's limit, per direction.
    next_local: [u64; 2],
    max_local: [u64; 2],
    /// Streams opened by the peer: how many exist (implicitly opened included) and the limit
    /// we advertised.
    next_remote: [u64; 2],
    max_remote: [u64; 2],
    /// Remote streams opened but not yet handed to the application.
    accept_next: [u64; 2],
    /// The local limit for which STREAMS_BLOCKED was last queued.
    blocked_sent: [Option<u64>; 2],
    /// The connection limit for which DATA_BLOCKED was last queued.
    data_blocked_sent: Option<u64>,
    /// Streams with data waiting for the connection-level limit to rise.
    conn_blocked: Vec<StreamId>,
    /// Unacknowledged bytes buffered by all send streams.
    send_buffered: u64,
    /// Memory charged for received data held by all receive streams (see
    /// [`Assembler::charge`]).
    recv_charge: usize,
    /// The endpoint's memory budget is exceeded: windows shrink, send buffers too.
    memory_pressure: bool,
    /// Streams whose writes were refused because the connection's send buffers were full.
    send_buffer_blocked: Vec<StreamId>,
    // Connection flow control.
    send_max_data: u64,
    data_sent: u64,
    conn_window: RecvWindow,
    data_received: u64,
    data_consumed: u64,
    /// What the application read of all streams: `data_consumed` without the credit resets
    /// and stops gave back, for auto-tuning (see [`RecvWindow`]).
    data_read: u64,
    /// Initial stream windows the peer gave us, for streams as they open.
    peer_stream_window_bidi_local: u64,
    peer_stream_window_bidi_remote: u64,
    peer_stream_window_uni: u64,
    /// Streams with data to send, by urgency.
    sched: SendQueues,
    pending: Pending,
    events: VecDeque<StreamEvent>,
    /// An application call queued something that was not already waiting to go (see
    /// [`Streams::take_send_hint`]).
    send_hint: bool,
    /// Streams to reset, with their codes, unless delivered by the time (see
    /// [`Streams::set_delivery_deadline`]); earliest first.
    deadlines: std::collections::BTreeMap<(Instant, StreamId), u64>,
}

fn dir_idx(d: Dir) -> usize {
    d as usize
}

impl Streams {
    pub fn new(side: Side, cfg: StreamConfig) -> Self {
        Self {
            side,
            send: IdMap::default(),
            recv: IdMap::default(),
            next_local: [0; 2],
            max_local: [0; 2],
            next_remote: [0; 2],
            max_remote: [cfg.max_concurrent_bidi, cfg.max_concurrent_uni],
            accept_next: [0; 2],
            blocked_sent: [None; 2],
            data_blocked_sent: None,
            conn_blocked: Vec::new(),
            send_buffered: 0,
            recv_charge: 0,
            memory_pressure: false,
            send_buffer_blocked: Vec::new(),
            send_max_data: 0,
            data_sent: 0,
            conn_window: RecvWindow::new(cfg.conn_window, cfg.conn_window_cap),
            data_received: 0,
            data_consumed: 0,
            data_read: 0,
            peer_stream_window_bidi_local: 0,
            peer_stream_window_bidi_remote: 0,
            peer_stream_window_uni: 0,
            sched: Default::default(),
            pending: Pending::default(),
            events: VecDeque::new(),
            deadlines: std::collections::BTreeMap::new(),
            send_hint: false,
            cfg,
        }
    }

    /// Writes our limits into the transport parameters we send.
    pub fn local_params(&self, tp: &mut TransportParameters) {
        tp.initial_max_data = self.cfg.conn_window;
        tp.initial_max_stream_data_bidi_local = self.cfg.stream_window;
        tp.initial_max_stream_data_bidi_remote = self.cfg.stream_window;
        tp.initial_max_stream_data_uni = self.cfg.stream_window;
        tp.initial_max_streams_bidi = self.cfg.max_concurrent_bidi;
        tp.initial_max_streams_uni = self.cfg.max_concurrent_uni;
    }

    /// Applies the peer's transport parameters (also used with remembered ones for 0-RTT).
    pub fn apply_peer_params(&mut self, tp: &TransportParameters) {
        for (d, max) in [
            (Dir::Bi, tp.initial_max_streams_bidi),
            (Dir::Uni, tp.initial_max_streams_uni),
        ] {
            if max > self.max_local[dir_idx(d)] {
                self.max_local[dir_idx(d)] = max;
                self.events.push_back(StreamEvent::Available(d));
            }
        }
        // As MAX_DATA would: streams stopped on the old limit (0-RTT under remembered
        // ones) go back to the scheduler.
        self.on_max_data(tp.initial_max_data);
        self.peer_stream_window_bidi_local = tp.initial_max_stream_data_bidi_local;
        self.peer_stream_window_bidi_remote = tp.initial_max_stream_data_bidi_remote;
        self.peer_stream_window_uni = tp.initial_max_stream_data_uni;
        // Streams opened in 0-RTT get the new limits (RFC 9000 §7.4.1).
        let (side, bl, br, u) = (
            self.side,
            self.peer_stream_window_bidi_local,
            self.peer_stream_window_bidi_remote,
            self.peer_stream_window_uni,
        );
        let raised: Vec<(StreamId, u64)> = self
            .send
            .iter()
            .filter_map(|(&id, s)| {
                let w = match (id.dir(), id.initiator() == side) {
                    (Dir::Bi, true) => br,
                    (Dir::Bi, false) => bl,
                    (Dir::Uni, _) => u,
                };
                (w > s.max_data).then_some((id, w))
            })
            .collect();
        // As MAX_STREAM_DATA would: a stream blocked on its old limit is scheduled again
        // (nothing else would: the peer's answer to our STREAM_DATA_BLOCKED carries the
        // limit it just gave, no larger), and may buffer more.
        for (id, w) in raised {
            self.raise_send_credit(id, w);
        }
    }

    /// The peer lets send stream `id` (which exists) send up to `max`: a stream that was
    /// blocked on its old limit goes back to the scheduler, and may buffer more.
    fn raise_send_credit(&mut self, id: StreamId, max: u64) {
        let Some(s) = self.send.get_mut(&id).filter(|s| max > s.max_data) else {
            return;
        };
        let was_blocked = s.buf.unsent() >= s.max_data && s.buf.end() > s.max_data;
        s.max_data = max;
        let prio = s.priority;
        if was_blocked {
            self.schedule(id, prio);
        }
        self.maybe_writable(id);
    }

    /// The peer's initial send window for stream `id`.
    fn peer_window_for(&self, id: StreamId) -> u64 {
        match (id.dir(), id.initiator() == self.side) {
            // Peer's "bidi_remote" applies to streams we opened.
            (Dir::Bi, true) => self.peer_stream_window_bidi_remote,
            (Dir::Bi, false) => self.peer_stream_window_bidi_local,
            (Dir::Uni, _) => self.peer_stream_window_uni,
        }
    }

    /// Forgets 0-RTT stream state after the server rejected 0-RTT: the streams are gone.
    pub fn reset_for_0rtt_rejection(&mut self) {
        let cfg = self.cfg.clone();
        *self = Self::new(self.side, cfg);
    }

    /// Whether `id` is a stream the peer opened that the application has not accepted yet.
    pub fn is_unaccepted(&self, id: StreamId) -> bool {
        id.initiator() != self.side && id.index() >= self.accept_next[dir_idx(id.dir())]
    }

    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    pub fn poll_event(&mut self) -> Option<StreamEvent> {
        self.events.pop_front()
    }

    // ---------------------------------------------------------------------------------------
    // Application side

    /// Opens a new stream; `None` when the peer's limit is reached (STREAMS_BLOCKED is queued).
    pub fn open(&mut self, dir: Dir) -> Option<StreamId> {
        let i = dir_idx(dir);
        if self.next_local[i] >= self.max_local[i] {
            // STREAMS_BLOCKED once per limit (RFC 9000 §4.6).
            if self.blocked_sent[i] != Some(self.max_local[i]) {
                self.blocked_sent[i] = Some(self.max_local[i]);
                self.pending.streams_blocked[i] = Some(self.max_local[i]);
            }
            return None;
        }
        let id = StreamId::new(self.side, dir, self.next_local[i]);
        self.next_local[i] += 1;
        self.insert_send(id);
        if dir == Dir::Bi {
            self.insert_recv(id);
        }
        Some(id)
    }

    fn insert_send(&mut self, id: StreamId) {
        let max_data = self.peer_window_for(id);
        self.send.insert(
            id,
            SendStream {
                buf: SendBuffer::new(),
                state: SendState::Open { fin: false },
                max_data,
                fin_sent: false,
                fin_acked: false,
                priority: Priority::default(),
                blocked_sent_at: None,
                stopped: None,
                reset_final_size: 0,
                want_writable: false,
                max_unsent: None,
                unsent_blocked: false,
                deadline: None,
            },
        );
    }

    fn insert_recv(&mut self, id: StreamId) {
        self.recv.insert(
            id,
            RecvStream {
                asm: Assembler::new(),
                final_size: None,
                window: RecvWindow::new(self.cfg.stream_window, self.cfg.stream_window_cap),
                state: RecvState::Open,
                stop_code: None,
                stop_deferred: false,
                early: false,
            },
        );
    }

    /// Takes the next stream the peer opened, if any.
    pub fn accept(&mut self, dir: Dir) -> Option<StreamId> {
        let i = dir_idx(dir);
        if self.accept_next[i] >= self.next_remote[i] {
            return None;
        }
        let id = StreamId::new(self.side.peer(), dir, self.accept_next[i]);
        self.accept_next[i] += 1;
        Some(id)
    }

    /// Queues data; returns how much was accepted (0 when the send buffer is full).
    pub fn write(&mut self, id: StreamId, data: Bytes) -> Result<usize, StreamError> {
        let conn = self
            .connection_send_limit()
            .saturating_sub(self.send_buffered);
        let s = self.send.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        if let Some(code) = s.stopped {
            return Err(StreamError::Stopped(code));
        }
        match s.state {
            SendState::Open { fin: false } => {}
            _ => return Err(StreamError::ClosedStream),
        }
        let mut own = Self::stream_send_room(&self.cfg, s);
        if let Some(max) = s.max_unsent {
            let ahead = s.buf.end() - s.buf.unsent();
            if max.saturating_sub(ahead) < own {
                own = max.saturating_sub(ahead);
                if own < data.len() as u64 {
                    s.unsent_blocked = true;
                }
            }
        }
        let n = (data.len() as u64).min(own).min(conn) as usize;
        if n < data.len() {
            s.want_writable = true;
            if conn < own {
                push_unique(&mut self.send_buffer_blocked, id);
            }
        }
        if n == 0 {
            return Ok(0);
        }
        let was_idle = !s.buf.has_sendable();
        s.buf.write(data.slice(..n));
        self.send_buffered += n as u64;
        let prio = s.priority;
        if was_idle {
            self.schedule(id, prio);
            self.send_hint = true;
        }
        Ok(n)
    }

    /// Bytes the application can still write before the send buffer is full.
    pub fn write_capacity(&self, id: StreamId) -> Result<u64, StreamError> {
        let s = self.send.get(&id).ok_or(StreamError::UnknownStream)?;
        let conn = self
            .connection_send_limit()
            .saturating_sub(self.send_buffered);
        Ok(Self::stream_send_room(&self.cfg, s).min(conn))
    }

    /// Most unacknowledged bytes a stream may hold: what the peer's credit lets it send past
    /// the acknowledged prefix, plus [`SEND_AHEAD_OF_CREDIT`], within the send buffer size.
    fn stream_send_limit(cfg: &StreamConfig, s: &SendStream) -> u64 {
        let acked = s.buf.end() - s.buf.buffered();
        s.max_data
            .saturating_sub(acked)
            .saturating_add(SEND_AHEAD_OF_CREDIT)
            .min(cfg.send_buffer)
    }

    fn stream_send_room(cfg: &StreamConfig, s: &SendStream) -> u64 {
        Self::stream_send_limit(cfg, s).saturating_sub(s.buf.buffered())
    }

    /// Tells a writer that was refused that it may write again, once it has an eighth of its
    /// limit free (so a bulk writer wakes for a large write, not after every ACK).
    fn maybe_writable(&mut self, id: StreamId) {
        let conn_limit = self.connection_send_limit();
        let Some(s) = self.send.get_mut(&id) else {
            return;
        };
        let limit = Self::stream_send_limit(&self.cfg, s);
        if !s.want_writable || limit.saturating_sub(s.buf.buffered()) < writable_room(limit) {
            return;
        }
        if conn_limit.saturating_sub(self.send_buffered)
            >= writable_room(conn_limit).min(writable_room(limit))
        {
            s.want_writable = false;
            self.events.push_back(StreamEvent::Writable(id));
        } else {
            // Its own limit has room again but the connection's is full: wait with the
            // writers the connection refused, or nothing would wake it when others free room.
            push_unique(&mut self.send_buffer_blocked, id);
        }
    }

    /// Bytes buffered by a stream's send half were dropped (acknowledged or abandoned): the
    /// connection's send buffers have room again for the writers it refused.
    fn on_send_buffer_freed(&mut self, freed: u64) {
        self.send_buffered -= freed;
        if freed == 0 || self.send_buffer_blocked.is_empty() {
            return;
        }
        let limit = self.connection_send_limit();
        let room = limit.saturating_sub(self.send_buffered);
        if room >= writable_room(limit) {
            for id in std::mem::take(&mut self.send_buffer_blocked) {
                self.maybe_writable(id);
            }
        }
    }

    /// Unacknowledged bytes buffered by all send streams.
    pub fn send_buffered(&self) -> u64 {
        self.send_buffered
    }

    /// Whether some of the stream's data arrived in 0-RTT packets.
    pub fn received_in_0rtt(&self, id: StreamId) -> bool {
        self.recv.get(&id).is_some_and(|s| s.early)
    }

    /// The peer's RESET_STREAM code for `id`, received and not yet delivered by a read
    /// (which still delivers it); `UnknownStream` once the receiving side is over.
    pub fn reset_received(&self, id: StreamId) -> Result<Option<u64>, StreamError> {
        match self.recv.get(&id).ok_or(StreamError::UnknownStream)?.state {
            RecvState::ResetRecvd { code } => Ok(Some(code)),
            _ => Ok(None),
        }
    }

    /// Memory charged for received stream data not yet read.
    pub fn recv_charge(&self) -> usize {
        self.recv_charge
    }

    /// Drops every receive half and what it holds: the connection is closed and its received
    /// data will not be read (reads then find no stream).
    pub fn release_received(&mut self) {
        self.recv = IdMap::default();
        self.recv_charge = 0;
    }

    pub fn set_memory_pressure(&mut self, pressure: bool) {
        if self.memory_pressure && !pressure {
            // Writers held back by the smaller limit may write again.
            for id in std::mem::take(&mut self.send_buffer_blocked) {
                self.maybe_writable(id);
            }
        }
        self.memory_pressure = pressure;
    }

    /// Unacknowledged bytes all send streams may buffer together now.
    fn connection_send_limit(&self) -> u64 {
        if self.memory_pressure {
            self.cfg.connection_send_buffer.min(PRESSURE_SEND_BUFFER)
        } else {
            self.cfg.connection_send_buffer
        }
    }

    /// Marks the end of the stream's data.
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        let s = self.send.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        if let Some(code) = s.stopped {
            return Err(StreamError::Stopped(code));
        }
        match s.state {
            SendState::Open { fin: false } => s.state = SendState::Open { fin: true },
            _ => return Err(StreamError::ClosedStream),
        }
        // With data still to send the FIN goes in its last frame; alone it needs a frame.
        self.send_hint |= !s.buf.has_sendable();
        let prio = s.priority;
        self.schedule(id, prio);
        Ok(())
    }

    /// Abandons sending with an application error code (RESET_STREAM).
    pub fn reset(&mut self, id: StreamId, code: u64) -> Result<(), StreamError> {
        let s = self.send.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        if matches!(s.state, SendState::ResetSent { .. }) || s.fin_acked {
            return Err(StreamError::ClosedStream);
        }
        s.reset_final_size = s.buf.unsent();
        let freed = s.buf.buffered();
        s.buf.clear();
        s.state = SendState::ResetSent { code };
        let deadline = s.deadline.take();
        self.drop_deadline(id, deadline);
        self.pending.reset.push(id);
        self.send_hint = true;
        self.on_send_buffer_freed(freed);
        Ok(())
    }

    /// Resets stream `id` with `code` at `at` unless everything it sent (its FIN included)
    /// was acknowledged by then: a response the peer stops taking does not sit in the send
    /// buffer for the connection's life, and no task of the application has to wait for its
    /// delivery to enforce that. A stream already delivered has nothing to do.
    pub fn set_delivery_deadline(
        &mut self,
        id: StreamId,
        at: Instant,
        code: u64,
    ) -> Result<(), StreamError> {
        let Some(s) = self.send.get_mut(&id) else {
            return Ok(());
        };
        if matches!(s.state, SendState::ResetSent { .. }) {
            return Ok(());
        }
        if let Some(old) = s.deadline.replace(at) {
            self.deadlines.remove(&(old, id));
        }
        self.deadlines.insert((at, id), code);
        Ok(())
    }

    /// The earliest delivery deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first_key_value().map(|(&(at, _), _)| at)
    }

    /// Resets the streams whose delivery deadline passed.
    pub fn expire_deadlines(&mut self, now: Instant) {
        while let Some(entry) = self.deadlines.first_entry() {
            let (at, id) = *entry.key();
            if at > now {
                break;
            }
            let code = entry.remove();
            if let Some(s) = self.send.get_mut(&id) {
                s.deadline = None;
            }
            if self.reset(id, code).is_ok() {
                self.events.push_back(StreamEvent::Expired(id, code));
            }
        }
    }

    /// Forgets a stream's delivery deadline (the stream is done or reset).
    fn drop_deadline(&mut self, id: StreamId, deadline: Option<Instant>) {
        if let Some(at) = deadline {
            self.deadlines.remove(&(at, id));
        }
    }

    /// Takes at most `max` bytes ahead of what has been sent on stream `id` (`None`: as many
    /// as the send buffer holds). A writer whose data comes from memory it fills for the
    /// purpose (a file being read) then writes just before the data goes out, while it is
    /// still in the CPU's cache, instead of a send buffer ahead; a refused writer is told it
    /// may write again (`Writable`) once half of `max` has been sent.
    pub fn set_max_unsent(&mut self, id: StreamId, max: Option<u64>) -> Result<(), StreamError> {
        let s = self.send.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        s.max_unsent = max.map(|m| m.max(1));
        Ok(())
    }

    pub fn set_priority(&mut self, id: StreamId, p: Priority) -> Result<(), StreamError> {
        let s = self.send.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        let p = Priority {
            urgency: p.urgency.min(7),
            ..p
        };
        if s.priority != p {
            let old = s.priority.urgency as usize;
            s.priority = p;
            if let Some(pos) = self.sched[old].iter().position(|&x| x == id) {
                self.sched[old].remove(pos);
                self.schedule(id, p);
            }
        }
        Ok(())
    }

    pub fn priority(&self, id: StreamId) -> Option<Priority> {
        self.send.get(&id).map(|s| s.priority)
    }

    /// Reads up to `max` contiguous bytes. `Ok(None)` means the stream ended.
    pub fn read(&mut self, id: StreamId, max: usize) -> Result<Option<Bytes>, StreamError> {
        let s = self.recv.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        match s.state {
            RecvState::ResetRecvd { code } => {
                s.state = RecvState::Done;
                self.maybe_cleanup(id);
                return Err(StreamError::Reset(code));
            }
            RecvState::Done => return Ok(None),
            RecvState::Open => {}
        }
        let charge = s.asm.charge();
        if let Some(chunk) = s.asm.read(max) {
            self.recv_charge -= charge - s.asm.charge();
            let n = chunk.len() as u64;
            self.data_consumed += n;
            self.data_read += n;
            if s.window.wants_update(s.asm.read_offset()) && s.final_size.is_none() {
                push_unique(&mut self.pending.max_stream_data, id);
                self.send_hint = true;
            }
            if self.conn_window.wants_update(self.data_consumed) {
                self.pending.max_data = true;
                self.send_hint = true;
            }
            return Ok(Some(chunk));
        }
        if s.final_size == Some(s.asm.read_offset()) {
            s.state = RecvState::Done;
            self.maybe_cleanup(id);
            return Ok(None);
        }
        Err(StreamError::WouldBlock)
    }

    /// Asks the peer to stop sending (STOP_SENDING) and discards what arrives. True if more
    /// than the stream's end was left: data unread, the end not received yet, or a reset
    /// the application had not read.
    pub fn stop(&mut self, id: StreamId, code: u64) -> Result<bool, StreamError> {
        self.stop_with(id, code, false)
    }

    /// Stops reading like [`stop`](Self::stop), but when everything received so far has been
    /// read, the STOP_SENDING waits until more data arrives: a stream whose FIN is on its way
    /// ends quietly. RFC 9114 §4.1 lets a server stop a request stream once it has answered,
    /// but a client still finishing it (the h3 crate's writes a GREASE frame as it finishes)
    /// may take the stop for a failed request.
    pub fn stop_unless_ending(&mut self, id: StreamId, code: u64) -> Result<bool, StreamError> {
        self.stop_with(id, code, true)
    }

    fn stop_with(&mut self, id: StreamId, code: u64, defer: bool) -> Result<bool, StreamError> {
        let s = self.recv.get_mut(&id).ok_or(StreamError::UnknownStream)?;
        if let RecvState::ResetRecvd { .. } = s.state {
            // The peer reset it and the application gives up reading: the reset needs no
            // delivery, and the stream may close (and its credit go back to the peer) once
            // its sending half is done. Left here, it waited for a read that never comes.
            s.state = RecvState::Done;
            self.maybe_cleanup(id);
            return Ok(true);
        }
        if s.stop_code.is_some() || s.state != RecvState::Open {
            return Ok(false);
        }
        s.stop_code = Some(code);
        // Discarded data still counts as consumed for connection flow control.
        let unread = s.highest() - s.asm.read_offset();
        let more = unread > 0 || s.final_size.is_none();
        self.recv_charge -= s.asm.charge();
        s.asm.discard(s.highest());
        self.data_consumed += unread;
        if s.final_size.is_none() {
            if defer && unread == 0 {
                s.stop_deferred = true;
            } else {
                self.pending.stop.push(id);
                self.send_hint = true;
            }
        } else {
            s.state = RecvState::Done;
            self.maybe_cleanup(id);
        }
        self.maybe_conn_credit();
        Ok(more)
    }

    // ---------------------------------------------------------------------------------------
    // Frames from the peer

    /// Validates that the peer may use `id` to send to us and opens it (and every lower
    /// stream of its kind) if needed. Returns false for a stream already closed.
    fn remote_recv_stream(&mut self, id: StreamId, ft: FrameType) -> Result<bool, TransportError> {
        if id.initiator() == self.side {
            if id.dir() == Dir::Uni {
                return Err(
                    TransportError::STREAM_STATE_ERROR("data on a send-only stream").with_frame(ft),
                );
            }
            if id.index() >= self.next_local[dir_idx(id.dir())] {
                return Err(
                    TransportError::STREAM_STATE_ERROR("stream not yet opened").with_frame(ft)
                );
            }
            return Ok(self.recv.contains_key(&id));
        }
        self.open_remote(id, ft)?;
        Ok(self.recv.contains_key(&id))
    }

    fn open_remote(&mut self, id: StreamId, ft: FrameType) -> Result<(), TransportError> {
        let i = dir_idx(id.dir());
        if id.index() >= self.max_remote[i] {
            return Err(
                TransportError::STREAM_LIMIT_ERROR("stream beyond the advertised limit")
                    .with_frame(ft),
            );
        }
        while self.next_remote[i] <= id.index() {
            let new = StreamId::new(self.side.peer(), id.dir(), self.next_remote[i]);
            self.next_remote[i] += 1;
            self.insert_recv(new);
            if id.dir() == Dir::Bi {
                self.insert_send(new);
            }
            self.events.push_back(StreamEvent::Opened(id.dir()));
        }
        Ok(())
    }

    /// A STREAM frame's data, received in a datagram of `datagram_len` bytes, in a 0-RTT
    /// packet if `early`.
    pub fn on_stream_frame(
        &mut self,
        id: StreamId,
        offset: u64,
        data: Bytes,
        fin: bool,
        datagram_len: usize,
        early: bool,
    ) -> Result<(), TransportError> {
        let ft = FrameType::STREAM;
        if !self.remote_recv_stream(id, ft)? {
            return Ok(());
        }
        let s = self.recv.get_mut(&id).expect("checked above");
        s.early |= early;
        let end = offset + data.len() as u64;
        if let Some(fs) = s.final_size {
            if end > fs || (fin && end != fs) {
                return Err(
                    TransportError::FINAL_SIZE_ERROR("data beyond the final size").with_frame(ft),
                );
            }
        } else if fin && end < s.asm.received_end() {
            return Err(
                TransportError::FINAL_SIZE_ERROR("final size below data received").with_frame(ft),
            );
        }
        if end > s.window.max() {
            return Err(
                TransportError::FLOW_CONTROL_ERROR("stream flow control limit exceeded")
                    .with_frame(ft),
            );
        }
        let prev = s.highest();
        // A repeated FIN (its frame sent again) is no news for the application.
        let fin_new = fin && s.final_size.is_none();
        if fin {
            s.final_size = Some(end);
        }
        let new_highest = end.max(prev);
        let growth = new_highest - prev;
        if self.data_received + growth > self.conn_window.max() {
            return Err(TransportError::FLOW_CONTROL_ERROR(
                "connection flow control limit exceeded",
            )
            .with_frame(ft));
        }
        self.data_received += growth;
        if s.state != RecvState::Open {
            return Ok(());
        }
        if s.stop_code.is_some() {
            // Discarding: count as consumed immediately.
            self.data_consumed += growth;
            self.recv_charge -= s.asm.charge();
            s.asm.discard(new_highest);
            if s.final_size.is_some() {
                s.state = RecvState::Done;
                self.maybe_cleanup(id);
            } else if s.stop_deferred && growth > 0 {
                // More than a FIN is coming: ask for the stop after all.
                s.stop_deferred = false;
                self.pending.stop.push(id);
                self.send_hint = true;
            }
            self.maybe_conn_credit();
            return Ok(());
        }
        // Edge-triggered: announce when the stream becomes readable or complete; the
        // application reads until `WouldBlock`.
        let before = s.asm.readable();
        let charge = s.asm.charge();
        s.asm.insert(offset, data, datagram_len);
        self.recv_charge = self.recv_charge + s.asm.charge() - charge;
        let became_readable = before == 0 && s.asm.readable() > 0;
        let ended = s.final_size == Some(s.asm.read_offset() + s.asm.readable());
        if became_readable || (ended && (fin_new || s.asm.readable() > before)) {
            self.events.push_back(StreamEvent::Readable(id));
        }
        // The bytes held are bounded by the connection window; what they cost in memory
        // beyond that (small pieces between gaps) is bounded by the window again, so a
        // peer can make the connection hold at most twice the window it was given.
        // The window is what the peer may still send: at least the current window size,
        // and credit granted earlier (before memory pressure shrank it) counts too.
        let window = self
            .conn_window
            .window()
            .max(self.conn_window.max() - self.data_consumed) as usize;
        if self.recv_charge > 2 * window {
            return Err(TransportError::FLOW_CONTROL_ERROR(format!(
                "stream data too fragmented to hold: {} bytes of memory for a {window}-byte window",
                self.recv_charge
            ))
            .with_frame(ft));
        }
        Ok(())
    }

    pub fn on_reset_stream(
        &mut self,
        id: StreamId,
        code: u64,
        final_size: u64,
    ) -> Result<(), TransportError> {
        let ft = FrameType::RESET_STREAM;
        if !self.remote_recv_stream(id, ft)? {
            return Ok(());
        }
        let s = self.recv.get_mut(&id).expect("checked above");
        if let Some(fs) = s.final_size
            && fs != final_size
        {
            return Err(
                TransportError::FINAL_SIZE_ERROR("reset changes the final size").with_frame(ft),
            );
        }
        if final_size < s.asm.received_end() {
            return Err(
                TransportError::FINAL_SIZE_ERROR("reset below data received").with_frame(ft),
            );
        }
        if final_size > s.window.max() {
            return Err(
                TransportError::FLOW_CONTROL_ERROR("reset final size beyond the limit")
                    .with_frame(ft),
            );
        }
        let growth = final_size - s.highest();
        if self.data_received + growth > self.conn_window.max() {
            return Err(TransportError::FLOW_CONTROL_ERROR(
                "connection flow control limit exceeded",
            )
            .with_frame(ft));
        }
        self.data_received += growth;
        s.final_size = Some(final_size);
        // Unread data is released for connection flow control.
        self.data_consumed += final_size - s.asm.read_offset();
        self.recv_charge -= s.asm.charge();
        s.asm.discard(final_size);
        if s.state == RecvState::Open {
            if s.stop_code.is_some() {
                s.state = RecvState::Done;
                self.maybe_cleanup(id);
            } else {
                s.state = RecvState::ResetRecvd { code };
                self.events.push_back(StreamEvent::Readable(id));
            }
        }
        self.maybe_conn_credit();
        Ok(())
    }

    /// Queues MAX_DATA (and says there is something to send) when what was consumed,
    /// by reading or by discarding, makes a connection window update due. Without the
    /// hint an update from a discard waited for another frame to carry it: a peer that
    /// sends no DATA_BLOCKED and has filled the window waited with us.
    fn maybe_conn_credit(&mut self) {
        if self.conn_window.wants_update(self.data_consumed) {
            self.pending.max_data = true;
            self.send_hint = true;
        }
    }

    /// Validates that `id` names a stream we can send on (for STOP_SENDING / MAX_STREAM_DATA).
    fn remote_send_stream(&mut self, id: StreamId, ft: FrameType) -> Result<bool, TransportError> {
        if id.initiator() == self.side {
            if id.index() >= self.next_local[dir_idx(id.dir())] {
                return Err(
                    TransportError::STREAM_STATE_ERROR("stream not yet opened").with_frame(ft)
                );
            }
        } else {
            if id.dir() == Dir::Uni {
                return Err(
                    TransportError::STREAM_STATE_ERROR("frame for a receive-only stream")
                        .with_frame(ft),
                );
            }
            self.open_remote(id, ft)?;
        }
        Ok(self.send.contains_key(&id))
    }

    pub fn on_stop_sending(&mut self, id: StreamId, code: u64) -> Result<(), TransportError> {
        if !self.remote_send_stream(id, FrameType::STOP_SENDING)? {
            return Ok(());
        }
        let s = self.send.get_mut(&id).expect("checked above");
        if s.stopped.is_some() {
            return Ok(());
        }
        s.stopped = Some(code);
        self.events.push_back(StreamEvent::Stopped(id, code));
        // RFC 9000 §3.5: answer with RESET_STREAM unless everything was already sent.
        if !(s.fin_acked || matches!(s.state, SendState::ResetSent { .. })) {
            s.reset_final_size = s.buf.unsent();
            let freed = s.buf.buffered();
            s.buf.clear();
            s.state = SendState::ResetSent { code };
            // As `reset` does: a reset stream's delivery deadline has nothing left to do.
            let deadline = s.deadline.take();
            self.drop_deadline(id, deadline);
            self.pending.reset.push(id);
            self.send_hint = true;
            self.on_send_buffer_freed(freed);
        }
        Ok(())
    }

    pub fn on_max_stream_data(&mut self, id: StreamId, max: u64) -> Result<(), TransportError> {
        if !self.remote_send_stream(id, FrameType::MAX_STREAM_DATA)? {
            return Ok(());
        }
        self.raise_send_credit(id, max);
        Ok(())
    }

    pub fn on_stream_data_blocked(&mut self, id: StreamId) -> Result<(), TransportError> {
        let ft = FrameType::STREAM_DATA_BLOCKED;
        if !self.remote_recv_stream(id, ft)? {
            return Ok(());
        }
        // The peer is blocked: make sure it has our latest limit.
        push_unique(&mut self.pending.max_stream_data, id);
        Ok(())
    }

    pub fn on_max_data(&mut self, max: u64) {
        if max > self.send_max_data {
            self.send_max_data = max;
            // Streams that stopped on the connection limit go back to the scheduler.
            for id in std::mem::take(&mut self.conn_blocked) {
                if let Some(s) = self.send.get(&id) {
                    let prio = s.priority;
                    self.schedule(id, prio);
                }
            }
        }
    }

    pub fn on_max_streams(&mut self, dir: Dir, count: u64) {
        let i = dir_idx(dir);
        if count > self.max_local[i] {
            self.max_local[i] = count;
            self.events.push_back(StreamEvent::Available(dir));
        }
    }

    pub fn on_streams_blocked(&mut self, dir: Dir, limit: u64) -> Result<(), TransportError> {
        let _ = limit;
        self.pending.max_streams[dir_idx(dir)] = true;
        Ok(())
    }

    pub fn on_data_blocked(&mut self) {
        self.pending.max_data = true;
    }

    // ---------------------------------------------------------------------------------------
    // Acknowledgements and losses

    pub fn on_frame_acked(&mut self, f: &SentFrame) {
        match *f {
            SentFrame::Stream {
                id,
                offset,
                len,
                fin,
            } => {
                let Some(s) = self.send.get_mut(&id) else {
                    return;
                };
                // Reset after its FIN went out: its buffer is cleared, so an ACK of the FIN
                // would look like the whole stream delivered, and the send half would go
                // with the RESET_STREAM still to send or resend (RFC 9000 §3.1: only the
                // reset's acknowledgement ends a reset stream). The peer would keep a
                // stream with a known final size and missing data, for good.
                if matches!(s.state, SendState::ResetSent { .. }) {
                    return;
                }
                let before = s.buf.buffered();
                s.buf.ack(offset..offset + u64::from(len));
                let freed = before - s.buf.buffered();
                if fin {
                    s.fin_acked = true;
                }
                let done = s.fin_acked && s.buf.is_fully_acked();
                if done {
                    let deadline = s.deadline;
                    self.drop_deadline(id, deadline);
                    self.events.push_back(StreamEvent::Finished(id));
                    self.send.remove(&id);
                    self.maybe_cleanup(id);
                }
                // Free first, so the stream's own check counts the room its ACK made.
                self.on_send_buffer_freed(freed);
                if !done {
                    self.maybe_writable(id);
                }
            }
            SentFrame::ResetStream(id) => {
                self.send.remove(&id);
                self.maybe_cleanup(id);
            }
            _ => {}
        }
    }

    pub fn on_frame_lost(&mut self, f: &SentFrame) {
        match *f {
            SentFrame::Stream {
                id,
                offset,
                len,
                fin,
            } => {
                let Some(s) = self.send.get_mut(&id) else {
                    return;
                };
                if matches!(s.state, SendState::ResetSent { .. }) {
                    return;
                }
                s.buf.lost(offset..offset + u64::from(len));
                if fin && !s.fin_acked {
                    s.fin_sent = false;
                }
                let prio = s.priority;
                self.schedule(id, prio);
            }
            SentFrame::ResetStream(id) if self.send.contains_key(&id) => {
                push_unique(&mut self.pending.reset, id);
            }
            SentFrame::StopSending(id)
                if self.recv.get(&id).is_some_and(|s| s.final_size.is_none()) =>
            {
                push_unique(&mut self.pending.stop, id);
            }
            SentFrame::MaxData => self.pending.max_data = true,
            SentFrame::MaxStreamData(id)
                if self.recv.get(&id).is_some_and(|s| s.final_size.is_none()) =>
            {
                push_unique(&mut self.pending.max_stream_data, id);
            }
            SentFrame::MaxStreams(d) => self.pending.max_streams[dir_idx(d)] = true,
            SentFrame::DataBlocked if self.data_sent >= self.send_max_data => {
                self.pending.data_blocked = Some(self.send_max_data);
            }
            SentFrame::StreamDataBlocked(id) => {
                if let Some(s) = self.send.get(&id)
                    && s.buf.unsent() >= s.max_data
                {
                    push_unique(&mut self.pending.stream_data_blocked, id);
                }
            }
            SentFrame::StreamsBlocked(d) => {
                let i = dir_idx(d);
                if self.next_local[i] >= self.max_local[i] {
                    self.pending.streams_blocked[i] = Some(self.max_local[i]);
                }
            }
            _ => {}
        }
    }

    /// Drops a stream's state once both halves are done; remote streams then free a slot for
    /// the peer (MAX_STREAMS). The receive half goes last, so its removal marks the close.
    fn maybe_cleanup(&mut self, id: StreamId) {
        if self.send.contains_key(&id) {
            return;
        }
        match self.recv.get(&id) {
            Some(s) if s.state == RecvState::Done => {
                self.recv.remove(&id);
            }
            // Still receiving, or a local uni stream (no receive half), or already closed.
            _ => return,
        }
        if id.initiator() != self.side {
            let i = dir_idx(id.dir());
            self.max_remote[i] += 1;
            self.pending.max_streams[i] = true;
            self.send_hint = true;
        }
    }

    // ---------------------------------------------------------------------------------------
    // Sending

    /// Whether an application call since the last take queued something to send that was
    /// not already waiting to go: a stream's first unsent bytes, a FIN with nothing ahead of
    /// it, flow-control credit, a reset or STOP_SENDING. Writing more to a stream that still
    /// has bytes to send changes nothing the endpoint must act on now: whatever holds those
    /// bytes back (congestion window, pacing, flow control) releases them with an event of
    /// its own.
    pub fn take_send_hint(&mut self) -> bool {
        std::mem::take(&mut self.send_hint)
    }

    fn schedule(&mut self, id: StreamId, p: Priority) {
        let q = &mut self.sched[p.urgency as usize];
        if q.contains(&id) {
            return;
        }
        if p.incremental {
            q.push_back(id);
        } else {
            // Non-incremental streams go in stream-ID order, ahead of incremental ones.
            let incremental =
                |x: &StreamId| self.send.get(x).is_some_and(|s| s.priority.incremental);
            let pos = q
                .iter()
                .position(|x| incremental(x) || x.0 > id.0)
                .unwrap_or(q.len());
            q.insert(pos, id);
        }
    }

    /// Whether any stream or control frame is waiting to be sent.
    pub fn wants_to_send(&self) -> bool {
        self.has_control() || self.has_stream_data()
    }

    /// Whether a bidirectional stream has data queued (a request, typically).
    pub fn has_bidi_data(&self) -> bool {
        self.sched.iter().flatten().any(|id| id.dir() == Dir::Bi)
    }

    pub fn has_stream_data(&self) -> bool {
        self.sched.iter().any(|q| !q.is_empty())
    }

    /// Whether all stream data waiting to be sent (FINs included) amounts to at most `limit`
    /// bytes; gives up early past the limit.
    pub fn stream_data_within(&self, limit: u64) -> bool {
        let mut total = 0u64;
        for id in self.sched.iter().flatten() {
            if let Some(s) = self.send.get(id) {
                // A frame header per stream, roughly.
                total += s.buf.sendable_len() + 16;
                if total > limit {
                    return false;
                }
            }
        }
        true
    }

    pub fn has_control(&self) -> bool {
        let p = &self.pending;
        p.max_data
            || !p.max_stream_data.is_empty()
            || p.max_streams.iter().any(|&b| b)
            || !p.reset.is_empty()
            || !p.stop.is_empty()
            || p.data_blocked.is_some()
            || !p.stream_data_blocked.is_empty()
            || p.streams_blocked.iter().any(|b| b.is_some())
    }

    /// Writes pending control frames into `buf` while they fit in `max` total bytes of `buf`.
    pub fn write_control(
        &mut self,
        buf: &mut Vec<u8>,
        max: usize,
        sent: &mut Vec<SentFrame>,
        now: Instant,
        rtt: Duration,
    ) {
        let room = |buf: &Vec<u8>, need: usize| buf.len() + need <= max;
        if self.pending.max_data || self.conn_window.wants_update(self.data_consumed) {
            let v = self
                .conn_window
                .max()
                .max(self.data_consumed + self.conn_window.window());
            if room(buf, 1 + VarInt::size_of(v)) {
                if self.memory_pressure {
                    let w = self.conn_window.window().min(PRESSURE_CONN_WINDOW);
                    self.conn_window.set_window(w);
                }
                let v = self.conn_window.update(
                    self.data_consumed,
                    self.data_read,
                    now,
                    rtt,
                    !self.memory_pressure,
                );
                buf.push(0x10);
                buf.put_var(v);
                sent.push(SentFrame::MaxData);
                self.pending.max_data = false;
            }
        }
        while let Some(&id) = self.pending.max_stream_data.last() {
            let Some(s) = self.recv.get_mut(&id) else {
                self.pending.max_stream_data.pop();
                continue;
            };
            if s.final_size.is_some() || s.stop_code.is_some() {
                self.pending.max_stream_data.pop();
                continue;
            }
            if !room(buf, 1 + 8 + 8) {
                break;
            }
            if self.memory_pressure {
                let w = s.window.window().min(PRESSURE_STREAM_WINDOW);
                s.window.set_window(w);
            }
            let read = s.asm.read_offset();
            let v = s
                .window
                .update(read, read, now, rtt, !self.memory_pressure);
            buf.push(0x11);
            buf.put_var(id.0);
            buf.put_var(v);
            sent.push(SentFrame::MaxStreamData(id));
            self.pending.max_stream_data.pop();
        }
        for d in [Dir::Bi, Dir::Uni] {
            let i = dir_idx(d);
            if self.pending.max_streams[i] && room(buf, 9) {
                buf.push(if d == Dir::Bi { 0x12 } else { 0x13 });
                buf.put_var(self.max_remote[i]);
                sent.push(SentFrame::MaxStreams(d));
                self.pending.max_streams[i] = false;
            }
        }
        while let Some(&id) = self.pending.reset.last() {
            let Some(s) = self.send.get(&id) else {
                self.pending.reset.pop();
                continue;
            };
            let SendState::ResetSent { code } = s.state else {
                self.pending.reset.pop();
                continue;
            };
            if !room(buf, 1 + 8 + 8 + 8) {
                break;
            }
            buf.push(0x04);
            buf.put_var(id.0);
            buf.put_var(code);
            buf.put_var(s.reset_final_size);
            sent.push(SentFrame::ResetStream(id));
            self.pending.reset.pop();
        }
        while let Some(&id) = self.pending.stop.last() {
            let Some(code) = self.recv.get(&id).and_then(|s| s.stop_code) else {
                self.pending.stop.pop();
                continue;
            };
            if !room(buf, 1 + 8 + 8) {
                break;
            }
            buf.push(0x05);
            buf.put_var(id.0);
            buf.put_var(code);
            sent.push(SentFrame::StopSending(id));
            self.pending.stop.pop();
        }
        if let Some(limit) = self.pending.data_blocked
            && room(buf, 9)
        {
            buf.push(0x14);
            buf.put_var(limit);
            sent.push(SentFrame::DataBlocked);
            self.pending.data_blocked = None;
        }
        while let Some(&id) = self.pending.stream_data_blocked.last() {
            let Some(s) = self.send.get(&id) else {
                self.pending.stream_data_blocked.pop();
                continue;
            };
            if !room(buf, 17) {
                break;
            }
            buf.push(0x15);
            buf.put_var(id.0);
            buf.put_var(s.max_data);
            sent.push(SentFrame::StreamDataBlocked(id));
            self.pending.stream_data_blocked.pop();
        }
        for d in [Dir::Bi, Dir::Uni] {
            let i = dir_idx(d);
            if let Some(limit) = self.pending.streams_blocked[i]
                && room(buf, 9)
            {
                buf.push(if d == Dir::Bi { 0x16 } else { 0x17 });
                buf.put_var(limit);
                sent.push(SentFrame::StreamsBlocked(d));
                self.pending.streams_blocked[i] = None;
            }
        }
    }

    /// Writes STREAM frames into `buf` while they fit in `max` total bytes, in priority order.
    pub fn write_stream_frames(
        &mut self,
        buf: &mut Vec<u8>,
        max: usize,
        sent: &mut Vec<SentFrame>,
    ) {
        const MIN_USEFUL: usize = 16;
        'outer: for urgency in 0..8 {
            while let Some(&id) = self.sched[urgency].front() {
                if buf.len() + MIN_USEFUL > max {
                    break 'outer;
                }
                let Some(s) = self.send.get_mut(&id) else {
                    self.sched[urgency].pop_front();
                    continue;
                };
                if matches!(s.state, SendState::ResetSent { .. }) {
                    self.sched[urgency].pop_front();
                    continue;
                }
                let fin_wanted = matches!(s.state, SendState::Open { fin: true }) && !s.fin_sent;
                // New data is limited by stream and connection flow control.
                let conn_room = self.send_max_data.saturating_sub(self.data_sent);
                let max_new_end = s.max_data.min(s.buf.unsent() + conn_room);
                let space = max - buf.len();
                // As much as fits with no Length field: a frame that runs to the end of the
                // packet needs none (RFC 9000 §19.8), two bytes more of data in every full
                // packet of a transfer.
                let max_len = StreamHeader::max_data_to_end(id, s.buf.next_offset(), space);
                let range = s.buf.next_range(max_len, max_new_end);
                let (range, is_retransmit) = match range {
                    Some(r) => r,
                    None => {
                        let all_sent = s.buf.unsent() == s.buf.end() && !s.buf.has_retransmit();
                        if fin_wanted && all_sent {
                            // A lone FIN.
                            (s.buf.end()..s.buf.end(), false)
                        } else {
                            // Blocked by flow control, or nothing left.
                            if s.buf.unsent() < s.buf.end() {
                                if s.buf.unsent() >= s.max_data {
                                    if s.blocked_sent_at != Some(s.max_data) {
                                        s.blocked_sent_at = Some(s.max_data);
                                        push_unique(&mut self.pending.stream_data_blocked, id);
                                    }
                                } else if conn_room == 0 {
                                    if self.data_blocked_sent != Some(self.send_max_data) {
                                        self.data_blocked_sent = Some(self.send_max_data);
                                        self.pending.data_blocked = Some(self.send_max_data);
                                    }
                                    push_unique(&mut self.conn_blocked, id);
                                }
                            }
                            self.sched[urgency].pop_front();
                            continue;
                        }
                    }
                };
                let len = (range.end - range.start) as usize;
                let fin = fin_wanted && range.end == s.buf.end();
                let mut hdr = StreamHeader {
                    id,
                    offset: range.start,
                    len: None,
                    fin,
                };
                // Room left after the frame without a Length field: none, and the frame
                // ends the packet; enough for the field, and it gets one; less (1 to 7
                // bytes), and PADDING goes before the frame, which still ends the packet.
                let spare = space.saturating_sub(hdr.encoded_len() + len);
                if len == 0 || spare >= crate::VarInt::size_of(len as u64) {
                    hdr.len = Some(len);
                }
                if buf.len() + hdr.encoded_len() + len > max {
                    // Only possible for a lone FIN when out of room.
                    if len > 0 {
                        s.buf.unsend(range, is_retransmit);
                    }
                    break 'outer;
                }
                if hdr.len.is_none() {
                    buf.resize(buf.len() + spare, 0);
                }
                hdr.encode(buf);
                s.buf.copy_range(range.clone(), buf);
                if !is_retransmit {
                    self.data_sent += len as u64;
                    if s.unsent_blocked
                        && let Some(max) = s.max_unsent
                        && (s.buf.end() - s.buf.unsent()) * 2 <= max
                    {
                        s.unsent_blocked = false;
                        s.want_writable = false;
                        self.events.push_back(StreamEvent::Writable(id));
                    }
                }
                if fin {
                    s.fin_sent = true;
                }
                sent.push(SentFrame::Stream {
                    id,
                    offset: range.start,
                    len: len as u32,
                    fin,
                });
                // A stream with data left stays scheduled even when this frame used the last
                // of its credit: its next turn finds it blocked and files it where MAX_DATA or
                // MAX_STREAM_DATA will wake it (dropping it here lost it for good).
                let more = s.buf.has_sendable()
                    || (matches!(s.state, SendState::Open { fin: true }) && !s.fin_sent);
                let incremental = s.priority.incremental;
                if !more {
                    self.sched[urgency].pop_front();
                } else if incremental {
                    self.sched[urgency].rotate_left(1);
                }
            }
        }
    }

    /// Gives back the spare capacity of the stream tables and queues (a quiet connection).
    pub fn release_idle_memory(&mut self) {
        self.send.shrink_to_fit();
        self.recv.shrink_to_fit();
        self.conn_blocked.shrink_to_fit();
        self.send_buffer_blocked.shrink_to_fit();
        self.sched.release_if_empty();
        self.events.shrink_to_fit();
        let p = &mut self.pending;
        p.max_stream_data.shrink_to_fit();
        p.reset.shrink_to_fit();
        p.stop.shrink_to_fit();
        p.stream_data_blocked.shrink_to_fit();
    }

    /// Whether a receive stream still expects data from the peer.
    pub fn waiting_for_data(&self) -> bool {
        self.recv.values().any(|s| {
            s.state == RecvState::Open
                && s.stop_code.is_none()
                && s.final_size.is_none_or(|f| s.asm.received_end() < f)
        })
    }

    /// Whether a bidirectional stream this side opened is part-way through receiving: a
    /// response has begun and is not complete. The peer's streams (HTTP/3 control streams
    /// among them) are left out, since they may stay open and quiet for the connection's
    /// life, and so are responses not yet begun, which may wait on the peer's application.
    pub fn receiving_response(&self) -> bool {
        self.recv.iter().any(|(id, s)| {
            id.initiator() == self.side
                && id.dir() == Dir::Bi
                && s.state == RecvState::Open
                && s.stop_code.is_none()
                && s.asm.received_end() > 0
                && s.final_size.is_none_or(|f| s.asm.received_end() < f)
        })
    }

    /// Statistics: (open send streams, open receive streams).
    pub fn counts(&self) -> (usize, usize) {
        (self.send.len(), self.recv.len())
    }

    /// Connection-level flow-control state (sent, peer limit, received, our limit).
    pub fn flow_state(&self) -> (u64, u64, u64, u64) {
        (
            self.data_sent,
            self.send_max_data,
            self.data_received,
            self.conn_window.max(),
        )
    }
}

fn push_unique(v: &mut Vec<StreamId>, id: StreamId) {
    if !v.contains(&id) {
        v.push(id);
    }
}

/// Room a full send buffer must regain before its writer is told it may write again: an eighth
/// of the buffer, so a bulk writer wakes for a large write instead of after every ACK.
fn writable_room(send_buffer: u64) -> u64 {
    (send_buffer / 8).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 100 streams each way, 1 MiB windows and stream send buffers.
    fn config(connection_send_buffer: u64) -> StreamConfig {
        StreamConfig {
            max_concurrent_bidi: 100,
            max_concurrent_uni: 100,
            stream_window: 1 << 20,
            stream_window_cap: 1 << 20,
            conn_window: 1 << 20,
            conn_window_cap: 1 << 20,
            send_buffer: 1 << 20,
            connection_send_buffer,
        }
    }

    fn streams(connection_send_buffer: u64, stream_credit: u64) -> Streams {
        let mut s = Streams::new(Side::Client, config(connection_send_buffer));
        s.apply_peer_params(&TransportParameters {
            initial_max_data: 64 << 20,
            initial_max_streams_uni: 10,
            initial_max_stream_data_uni: stream_credit,
            ..TransportParameters::default()
        });
        s
    }

    /// Sends everything the flow-control limits allow; the frames sent per stream.
    fn send_all(s: &mut Streams) -> Vec<SentFrame> {
        let mut out = Vec::new();
        loop {
            let (mut buf, mut sent) = (Vec::new(), Vec::new());
            s.write_stream_frames(&mut buf, 1200, &mut sent);
            if sent.is_empty() {
                return out;
            }
            out.append(&mut sent);
        }
    }

    fn writable(s: &mut Streams) -> Vec<StreamId> {
        std::iter::from_fn(|| s.poll_event())
            .filter_map(|e| match e {
                StreamEvent::Writable(id) => Some(id),
                _ => None,
            })
            .collect()
    }

    /// A writer refused by its own limit, whose limit then grows while the connection's
    /// send buffer is full, is woken once other streams' ACKs free the connection's buffer
    /// (it was never woken before: only writers refused by the connection's limit were).
    #[test]
    fn a_writer_whose_own_limit_reopens_while_the_connection_is_full_is_woken_later() {
        let conn = 256 * 1024;
        let credit = 16 * 1024;
        let mut s = streams(conn, credit);
        let b = s.open(Dir::Uni).unwrap();
        let a = s.open(Dir::Uni).unwrap();
        // B: its own limit (credit + 64 KiB) refuses it; the connection has room.
        let own = credit + SEND_AHEAD_OF_CREDIT;
        assert_eq!(
            s.write(b, Bytes::from(vec![0; 200 * 1024])).unwrap() as u64,
            own
        );
        // A, with a large credit, fills the connection's send buffer.
        s.on_max_stream_data(a, 1 << 20).unwrap();
        assert_eq!(
            s.write(a, Bytes::from(vec![0; 400 * 1024])).unwrap() as u64,
            conn - own
        );
        let sent = send_all(&mut s);
        // B's credit grows while the connection is still full: not writable yet.
        s.on_max_stream_data(b, 200 * 1024).unwrap();
        assert_eq!(writable(&mut s), Vec::<StreamId>::new());
        // The peer acknowledges A's data: the connection has room for both again.
        for f in &sent {
            if matches!(f, SentFrame::Stream { id, .. } if *id == a) {
                s.on_frame_acked(f);
            }
        }
        let woken = writable(&mut s);
        assert!(woken.contains(&a), "A woken: {woken:?}");
        assert!(woken.contains(&b), "B woken: {woken:?}");
    }

    /// A stream reset after its FIN went out (a delivery deadline, say) keeps its send half
    /// until the RESET_STREAM is acknowledged: an ACK of the FIN does not finish it, and a
    /// lost RESET_STREAM is sent again. The FIN's ACK finished it before, the reset was
    /// dropped with the send half, and the peer kept a stream with data missing.
    #[test]
    fn a_stream_reset_after_its_fin_ends_only_with_the_reset_acknowledged() {
        let mut s = streams(1 << 20, 1 << 20);
        let id = s.open(Dir::Uni).unwrap();
        s.write(id, Bytes::from(vec![7; 2000])).unwrap();
        s.finish(id).unwrap();
        let sent = send_all(&mut s);
        assert!(sent.iter().any(|f| matches!(f, SentFrame::Stream { fin: true, .. })));
        s.reset(id, 9).unwrap();
        // The packet with the FIN is acknowledged, the first one lost.
        for f in &sent {
            match f {
                SentFrame::Stream { fin: true, .. } => s.on_frame_acked(f),
                _ => s.on_frame_lost(f),
            }
        }
        let events: Vec<_> = std::iter::from_fn(|| s.poll_event()).collect();
        assert!(
            !events.iter().any(|e| matches!(e, StreamEvent::Finished(_))),
            "{events:?}"
        );
        let resets = |s: &mut Streams| {
            let (mut buf, mut sent) = (Vec::new(), Vec::new());
            s.write_control(&mut buf, 1200, &mut sent, Instant::now(), Duration::from_millis(10));
            sent.into_iter()
                .filter(|f| matches!(f, SentFrame::ResetStream(_)))
                .collect::<Vec<_>>()
        };
        let first = resets(&mut s);
        assert_eq!(first.len(), 1, "the RESET_STREAM goes out");
        // Lost: sent again; acknowledged: the stream is gone.
        s.on_frame_lost(&first[0]);
        let again = resets(&mut s);
        assert_eq!(again.len(), 1, "the RESET_STREAM goes out again");
        s.on_frame_acked(&again[0]);
        assert!(resets(&mut s).is_empty());
        assert_eq!(s.reset(id, 9), Err(StreamError::UnknownStream));
    }

    /// 0-RTT under remembered limits, then the server's own, larger ones: streams stopped
    /// on the old limits (their own or the connection's) go on. They stayed blocked before:
    /// nothing scheduled them again.
    #[test]
    fn streams_blocked_in_0rtt_go_on_under_the_servers_larger_limits() {
        for (conn, stream) in [(1u64 << 20, 16 * 1024u64), (16 * 1024, 1 << 20)] {
            let mut s = Streams::new(Side::Client, config(4 << 20));
            let remembered = TransportParameters {
                initial_max_data: conn,
                initial_max_streams_uni: 10,
                initial_max_stream_data_uni: stream,
                ..TransportParameters::default()
            };
            s.apply_peer_params(&remembered);
            let id = s.open(Dir::Uni).unwrap();
            s.write(id, Bytes::from(vec![1; 64 * 1024])).unwrap();
            let sent = |f: &[SentFrame]| -> u64 {
                f.iter()
                    .map(|f| match f {
                        SentFrame::Stream { len, .. } => u64::from(*len),
                        _ => 0,
                    })
                    .sum()
            };
            assert_eq!(sent(&send_all(&mut s)), 16 * 1024);
            s.apply_peer_params(&TransportParameters {
                initial_max_data: 1 << 20,
                initial_max_stream_data_uni: 1 << 20,
                ..remembered
            });
            assert_eq!(sent(&send_all(&mut s)), 48 * 1024, "limits {conn} / {stream}");
        }
    }

    /// An empty STREAM frame at a new offset counts toward flow control once: a repeat of
    /// it (or a second empty frame there) is no new data. Each counted again before, and
    /// the second of two at half the window was a FLOW_CONTROL_ERROR.
    #[test]
    fn empty_stream_frames_count_toward_flow_control_once() {
        let mut s = Streams::new(Side::Server, config(1 << 20));
        let half = (1u64 << 20) / 2 + 1;
        for _ in 0..3 {
            s.on_stream_frame(StreamId(0), half, Bytes::new(), false, 1200, false)
                .unwrap();
        }
        assert_eq!(s.data_received, half);
    }

    /// `stop_unless_ending`: with everything received read, the STOP_SENDING waits; a FIN
    /// alone ends the stream without one, more data draws it, and unread data draws it at
    /// once (a server done with a request its client is still finishing: RFC 9114 §4.1).
    #[test]
    fn a_stop_unless_ending_is_sent_only_when_more_than_a_fin_comes() {
        let mut s = Streams::new(Side::Server, config(1 << 20));
        let now = Instant::now();
        let rtt = Duration::from_millis(10);
        let stops = |s: &mut Streams| {
            let (mut buf, mut sent) = (Vec::new(), Vec::new());
            s.write_control(&mut buf, 1200, &mut sent, now, rtt);
            sent.iter()
                .filter_map(|f| match f {
                    SentFrame::StopSending(id) => Some(*id),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let head = || Bytes::from_static(b"request head");
        let (a, b, c) = (StreamId(0), StreamId(4), StreamId(8));
        for id in [a, b, c] {
            s.on_stream_frame(id, 0, head(), false, 1200, false).unwrap();
        }
        for id in [a, b] {
            assert_eq!(s.read(id, usize::MAX).unwrap(), Some(head()));
            s.stop_unless_ending(id, 0x100).unwrap();
        }
        // C's head is still unread: its stop goes out at once.
        s.stop_unless_ending(c, 0x100).unwrap();
        assert_eq!(stops(&mut s), vec![c]);
        // A's FIN arrives alone: the stream ends, no stop was ever sent.
        s.on_stream_frame(a, 12, Bytes::new(), true, 1200, false)
            .unwrap();
        assert_eq!(s.recv[&a].state, RecvState::Done, "A's receive side is done");
        assert_eq!(stops(&mut s), Vec::<StreamId>::new());
        // B goes on with a body: now it is told to stop.
        s.on_stream_frame(b, 12, Bytes::from_static(b"body"), false, 1200, false)
            .unwrap();
        assert_eq!(stops(&mut s), vec![b]);
        // A plain stop does not wait.
        let d = StreamId(12);
        s.on_stream_frame(d, 0, head(), false, 1200, false).unwrap();
        s.read(d, usize::MAX).unwrap();
        s.stop(d, 0x100).unwrap();
        assert_eq!(stops(&mut s), vec![d]);
    }

    /// A stream the peer reset after its head was read, which the application then stops
    /// instead of reading again (a request its client cancelled), closes and gives its
    /// credit back: it waited for a read that never came, and after `max_concurrent` such
    /// cancellations the peer could open no more streams.
    #[test]
    fn a_reset_stream_the_application_stops_gives_its_credit_back() {
        let mut s = Streams::new(Side::Server, config(1 << 20));
        let id = StreamId(2); // the client's first unidirectional stream
        s.on_stream_frame(id, 0, Bytes::from_static(b"head"), false, 1200, false)
            .unwrap();
        assert_eq!(s.read(id, usize::MAX).unwrap(), Some(Bytes::from_static(b"head")));
        s.on_reset_stream(id, 0x10c, 4).unwrap();
        s.stop(id, 0x10c).unwrap();
        assert!(!s.recv.contains_key(&id), "the stream is gone");
        assert_eq!(s.max_remote[1], 101, "its credit went back");
    }

    /// A STREAM frame that fills the packet carries no Length field (RFC 9000 §19.8), one
    /// that leaves room carries one, and one that leaves less room than its Length field
    /// would take has PADDING before it and still ends the packet.
    #[test]
    fn a_frame_that_fills_the_packet_has_no_length_field() {
        use crate::frame::{Frame, FrameIter};
        let parse = |buf: Vec<u8>| -> Vec<Frame> { FrameIter::new(Bytes::from(buf)).map(|f| f.unwrap()).collect() };
        let mut s = streams(1 << 20, 1 << 20);
        let a = s.open(Dir::Uni).unwrap();
        // The first frame (offset 0): type, stream ID; 1,198 bytes of data fill 1,200.
        // The second (offset 1,198, two bytes): 1,196. Then 100 bytes are left.
        let total = 1198 + 1196 + 100;
        s.write(a, Bytes::from(vec![7; total])).unwrap();
        let mut sent = Vec::new();
        let mut buf = Vec::new();
        s.write_stream_frames(&mut buf, 1200, &mut sent);
        assert_eq!(buf.len(), 1200);
        assert_eq!(buf[0], 0x08, "STREAM with neither Offset nor Length");
        let mut buf = Vec::new();
        s.write_stream_frames(&mut buf, 1200, &mut sent);
        assert_eq!(buf.len(), 1200);
        assert_eq!(buf[0], 0x0c, "STREAM with an Offset, no Length");
        // The last 100 bytes in 105: type, ID and offset (2,394: two bytes) take 4, which
        // leaves one byte where a Length of 100 needs two: PADDING, then the frame to the
        // end. In 106 or more it would carry its Length.
        let mut buf = Vec::new();
        s.write_stream_frames(&mut buf, 105, &mut sent);
        assert_eq!(buf.len(), 105);
        let frames = parse(buf);
        assert!(matches!(frames[0], Frame::Padding(1)), "{frames:?}");
        assert!(matches!(&frames[1], Frame::Stream(f) if f.data.len() == 100), "{frames:?}");
        assert_eq!(frames.len(), 2);
        assert!(send_all(&mut s).is_empty());
        // A short frame leaves room for more: it has its Length.
        let b = s.open(Dir::Uni).unwrap();
        s.write(b, Bytes::from(vec![8; 10])).unwrap();
        let mut buf = Vec::new();
        s.write_stream_frames(&mut buf, 1200, &mut sent);
        assert_eq!(buf.len(), 1 + 1 + 1 + 10);
        assert_eq!(buf[0], 0x0a, "STREAM with a Length, no Offset");
    }

    /// `set_max_unsent`: a stream takes at most that much ahead of what it has sent, and its
    /// refused writer is told it may write again once half of it has gone; sent data does not
    /// count (only the send buffer bounds what is in flight).
    #[test]
    fn a_stream_with_max_unsent_takes_little_ahead_and_wakes_its_writer_as_it_sends() {
        let mut s = streams(16 << 20, 16 << 20);
        let a = s.open(Dir::Uni).unwrap();
        s.set_max_unsent(a, Some(64 * 1024)).unwrap();
        assert_eq!(s.write(a, Bytes::from(vec![1; 100 * 1024])).unwrap(), 64 * 1024);
        assert_eq!(s.write(a, Bytes::from(vec![1; 10])).unwrap(), 0);
        assert_eq!(writable(&mut s), Vec::<StreamId>::new());
        // Sending a quarter: 48 KiB still ahead, more than half of 64: no wake-up yet.
        let mut sent = Vec::new();
        while sent.iter().map(|f| match f {
            SentFrame::Stream { len, .. } => u64::from(*len),
            _ => 0,
        }).sum::<u64>() < 16 * 1024
        {
            let mut buf = Vec::new();
            s.write_stream_frames(&mut buf, 1200, &mut sent);
        }
        assert_eq!(writable(&mut s), Vec::<StreamId>::new());
        // Sending the rest: woken once at most 32 KiB are ahead.
        let rest = send_all(&mut s);
        assert!(!rest.is_empty());
        assert_eq!(writable(&mut s), vec![a]);
        // Sent but unacknowledged data does not hold it back: 64 KiB more are taken.
        assert_eq!(s.write(a, Bytes::from(vec![1; 100 * 1024])).unwrap(), 64 * 1024);
        // Without the limit, the send buffer (1 MiB here) is the bound again.
        s.set_max_unsent(a, None).unwrap();
        assert_eq!(s.write(a, Bytes::from(vec![1; 100 * 1024])).unwrap(), 100 * 1024);
    }

    /// A delivery deadline resets a stream that was not all acknowledged by then (the
    /// peer gave it no credit) and is forgotten for one that was.
    #[test]
    fn delivery_deadlines_reset_what_was_not_taken() {
        let mut s = streams(16 << 20, 8 * 1024);
        let t0 = Instant::now();
        let at = t0 + Duration::from_secs(60);
        let taken = s.open(Dir::Uni).unwrap();
        let stuck = s.open(Dir::Uni).unwrap();
        s.write(taken, Bytes::from(vec![1; 4 * 1024])).unwrap();
        s.write(stuck, Bytes::from(vec![1; 32 * 1024])).unwrap();
        for id in [taken, stuck] {
            s.finish(id).unwrap();
            s.set_delivery_deadline(id, at, 0x10c).unwrap();
        }
        assert_eq!(s.next_deadline(), Some(at));
        // The one within its credit goes whole and is acknowledged; the other sends its
        // 8 KiB of credit and waits.
        for f in send_all(&mut s) {
            if matches!(f, SentFrame::Stream { id, .. } if id == taken) {
                s.on_frame_acked(&f);
            }
        }
        assert!(!s.send.contains_key(&taken));
        assert_eq!(s.deadlines.len(), 1, "the delivered stream's deadline went");
        s.expire_deadlines(at - Duration::from_millis(1));
        assert!(s.pending.reset.is_empty());
        s.expire_deadlines(at);
        assert_eq!(s.pending.reset, vec![stuck]);
        assert_eq!(s.next_deadline(), None);
        // A stream already delivered (or reset) takes no deadline.
        s.set_delivery_deadline(taken, at, 0x10c).unwrap();
        s.set_delivery_deadline(stuck, at, 0x10c).unwrap();
        assert_eq!(s.next_deadline(), None);
    }
}
