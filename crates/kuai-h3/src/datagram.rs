//! HTTP datagrams (RFC 9297 §2.1): QUIC DATAGRAM frames whose payload starts with the
//! quarter stream ID of the request they belong to.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kuai_proto::coding::{BufExt, BufMutExt};
use tokio::sync::Notify;

use crate::conn::Shared;
use crate::error::{Code, Error, H3Error};

/// Datagrams held per request stream before the oldest are dropped.
const QUEUE: usize = 64;
/// Streams with queued datagrams at most (datagrams for others are dropped).
const MAX_STREAMS: usize = 1024;
/// Payload bytes held for all streams of a connection: past it a stream's oldest datagrams
/// make room for its new one, or the new one is dropped (RFC 9297 §5: they are unreliable).
/// Without it 1,024 streams of 64 full datagrams each could hold about 90 MB.
const MAX_BYTES: usize = 1 << 20;

#[derive(Default)]
pub(crate) struct Queues {
    inner: Mutex<Inner>,
    pub ready: Notify,
}

#[derive(Default)]
struct Inner {
    by_stream: HashMap<u64, VecDeque<Bytes>>,
    /// Payload bytes queued in `by_stream`.
    bytes: usize,
}

impl Queues {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// Queues a datagram of `stream`; whether it was kept. Datagrams for streams nobody
    /// listens to are dropped (RFC 9297 §2.1 allows it). Room is made by dropping the
    /// stream's oldest: past its count, or past the connection's bytes; when the other
    /// streams hold the bytes, the new one is dropped.
    fn push(&mut self, stream: u64, payload: Bytes) -> bool {
        let Some(v) = self.by_stream.get_mut(&stream) else {
            return false;
        };
        while v.len() >= QUEUE || (self.bytes + payload.len() > MAX_BYTES && !v.is_empty()) {
            if let Some(old) = v.pop_front() {
                self.bytes -= old.len();
            }
        }
        if self.bytes + payload.len() > MAX_BYTES {
            return false;
        }
        self.bytes += payload.len();
        v.push_back(payload);
        true
    }
}

fn queues(shared: &Shared) -> &Queues {
    &shared.datagrams
}

/// Sends `payload` as an HTTP datagram of request stream `stream_id`.
pub(crate) fn send(shared: &Shared, stream_id: u64, payload: &[u8]) -> Result<(), Error> {
    let peer = shared.lock().peer_settings;
    if !shared.config.h3_datagram || !peer.is_some_and(|p| p.h3_datagram) {
        return Err(Error::Protocol(H3Error::new(
            Code::DATAGRAM_ERROR,
            "HTTP datagrams not negotiated",
        )));
    }
    let mut d = Vec::with_capacity(payload.len() + 8);
    d.put_var(stream_id / 4);
    d.extend_from_slice(payload);
    shared
        .quic
        .send_datagram(Bytes::from(d))
        .map_err(|e| match e {
            kuai::DatagramError::TooLarge(_) => Error::TooLarge,
            kuai::DatagramError::Unsupported => Error::Protocol(H3Error::new(
                Code::DATAGRAM_ERROR,
                "QUIC datagrams not negotiated",
            )),
            _ => Error::Protocol(H3Error::new(Code::DATAGRAM_ERROR, "datagram not sent")),
        })
}

/// Waits for the next HTTP datagram of `stream_id`.
pub(crate) async fn recv(shared: &Shared, stream_id: u64) -> Result<Bytes, Error> {
    let q = queues(shared);
    loop {
        let notified = q.ready.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut guard = q.lock();
            let m = &mut *guard;
            if let Some(d) = m.by_stream.get_mut(&stream_id).and_then(|v| v.pop_front()) {
                m.bytes -= d.len();
                return Ok(d);
            }
            if !m.by_stream.contains_key(&stream_id) && m.by_stream.len() < MAX_STREAMS {
                m.by_stream.insert(stream_id, VecDeque::new());
            }
        }
        if let Some(e) = shared.error() {
            return Err(Error::Protocol(e));
        }
        tokio::select! {
            _ = notified => {}
            e = shared.quic.closed() => return Err(Error::Connection(e)),
        }
    }
}

/// Gives a new request stream its queue, so that datagrams that come before the
/// application first asks for one are kept (RFC 9297 §2.1 allows dropping them, but a peer
/// that sends right after the response head would lose its first ones).
pub(crate) fn register(shared: &Shared, stream_id: u64) {
    if !shared.config.h3_datagram {
        return;
    }
    let mut m = queues(shared).lock();
    if m.by_stream.len() < MAX_STREAMS {
        m.by_stream.entry(stream_id).or_default();
    }
}

/// Drops a stream's queue when the stream goes away.
pub(crate) fn forget(shared: &Shared, stream_id: u64) {
    let mut m = queues(shared).lock();
    if let Some(v) = m.by_stream.remove(&stream_id) {
        m.bytes -= v.iter().map(Bytes::len).sum::<usize>();
    }
}

/// Reads QUIC datagrams and files them by stream.
pub(crate) async fn demux(shared: Arc<Shared>) {
    while let Ok(d) = shared.quic.read_datagram().await {
        let mut b = &d[..];
        let Ok(quarter) = b.get_var() else {
            shared.fail(H3Error::new(
                Code::DATAGRAM_ERROR,
                "datagram without a quarter stream ID",
            ));
            return;
        };
        if quarter >= 1 << 60 {
            shared.fail(H3Error::new(
                Code::DATAGRAM_ERROR,
                "quarter stream ID out of range",
            ));
            return;
        }
        let payload = d.slice(d.len() - b.len()..);
        let q = queues(&shared);
        let queued = q.lock().push(quarter * 4, payload);
        if queued {
            q.ready.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per stream at most `QUEUE` datagrams, oldest dropped first; over all streams at most
    /// `MAX_BYTES`, a stream's own oldest making room, and a stream with none queued
    /// dropping its new ones while the others hold the bytes; unknown streams get nothing.
    #[test]
    fn queues_are_bounded_in_count_and_bytes() {
        let mut q = Inner::default();
        assert!(!q.push(0, Bytes::from_static(b"x")), "nobody listens on 0");
        for s in 0..40u64 {
            q.by_stream.insert(s * 4, VecDeque::new());
        }
        for i in 0..100u8 {
            assert!(q.push(0, Bytes::from(vec![i; 10])));
        }
        assert_eq!(q.by_stream[&0].len(), QUEUE);
        assert_eq!(q.by_stream[&0][0][0], 100 - QUEUE as u8, "the oldest went");
        let big = Bytes::from(vec![0u8; 1200]);
        for s in 1..40u64 {
            for _ in 0..QUEUE {
                q.push(s * 4, big.clone());
            }
        }
        assert!(q.bytes <= MAX_BYTES, "{} bytes", q.bytes);
        let total: usize = q.by_stream.values().flatten().map(Bytes::len).sum();
        assert_eq!(total, q.bytes);
        assert!(q.bytes + big.len() > MAX_BYTES, "the budget is full");
        // A stream holding some: one more of its own replaces its oldest.
        let s = (1..40u64)
            .map(|s| s * 4)
            .find(|s| !q.by_stream[s].is_empty())
            .unwrap();
        let n = q.by_stream[&s].len();
        assert!(q.push(s, big.clone()));
        assert_eq!(q.by_stream[&s].len(), n);
        // A stream holding none: its datagram is dropped.
        assert!(q.by_stream[&(39 * 4)].is_empty());
        assert!(!q.push(39 * 4, big));
        assert!(q.bytes <= MAX_BYTES);
    }
}
