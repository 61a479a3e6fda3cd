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

#[derive(Default)]
pub(crate) struct Queues {
    by_stream: Mutex<HashMap<u64, VecDeque<Bytes>>>,
    pub ready: Notify,
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
            let mut m = q.by_stream.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(d) = m.get_mut(&stream_id).and_then(|v| v.pop_front()) {
                return Ok(d);
            }
            if !m.contains_key(&stream_id) && m.len() < MAX_STREAMS {
                m.insert(stream_id, VecDeque::new());
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

/// Drops a stream's queue when the stream goes away.
pub(crate) fn forget(shared: &Shared, stream_id: u64) {
    queues(shared)
        .by_stream
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&stream_id);
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
        let mut m = q.by_stream.lock().unwrap_or_else(|e| e.into_inner());
        // Datagrams for streams nobody listens to are dropped (RFC 9297 §2.1 allows it).
        if let Some(v) = m.get_mut(&(quarter * 4)) {
            if v.len() >= QUEUE {
                v.pop_front();
            }
            v.push_back(payload);
            drop(m);
            q.ready.notify_waiters();
        }
    }
}
