//! Connection-ID bookkeeping (RFC 9000 §5.1): the IDs we issued and the IDs the peer issued.

use super::seq_map::SeqMap;

use crate::cid::ConnectionId;
use crate::error::TransportError;
use crate::frame::{FrameType, NewConnectionId};

/// An ID we issued to the peer.
#[derive(Debug, Clone)]
pub struct LocalCid {
    pub cid: ConnectionId,
    pub reset_token: [u8; 16],
    /// NEW_CONNECTION_ID still has to be (re)sent.
    pub announce: bool,
}

/// IDs we issued, by sequence number.
#[derive(Debug, Default)]
pub struct LocalCids {
    pub issued: SeqMap<LocalCid>,
    pub next_seq: u64,
    /// Everything below this was asked to be retired (retire_prior_to we send).
    pub retire_prior_to: u64,
}

impl LocalCids {
    /// Records an ID; `announce` when it must be sent in NEW_CONNECTION_ID (not for the
    /// handshake's first ID, which the peer learns from the packet header).
    pub fn add(&mut self, cid: ConnectionId, reset_token: [u8; 16], announce: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.issued.insert(
            seq,
            LocalCid {
                cid,
                reset_token,
                announce,
            },
        );
        seq
    }

    /// The peer retired `seq`. Returns the retired ID for the endpoint to forget.
    pub fn on_retire(
        &mut self,
        seq: u64,
        packet_dcid: &ConnectionId,
    ) -> Result<Option<ConnectionId>, TransportError> {
        let ft = FrameType::RETIRE_CONNECTION_ID;
        if seq >= self.next_seq {
            return Err(
                TransportError::PROTOCOL_VIOLATION("retiring a CID never issued").with_frame(ft),
            );
        }
        match self.issued.get(&seq) {
            Some(c) if c.cid == *packet_dcid => Err(TransportError::PROTOCOL_VIOLATION(
                "retiring the CID the packet was sent to",
            )
            .with_frame(ft)),
            Some(_) => Ok(self.issued.remove(&seq).map(|c| c.cid)),
            None => Ok(None),
        }
    }

    pub fn active_count(&self) -> usize {
        self.issued.len()
    }
}

/// An ID the peer issued to us.
#[derive(Debug, Clone, Copy)]
pub struct RemoteCid {
    pub cid: ConnectionId,
    pub reset_token: Option<[u8; 16]>,
}

/// IDs the peer issued, by sequence number; one of them is in use as our DCID.
#[derive(Debug)]
pub struct RemoteCids {
    pub cids: SeqMap<RemoteCid>,
    pub active_seq: u64,
    retire_prior_to: u64,
    /// Sequence numbers to retire with RETIRE_CONNECTION_ID (sent next).
    pub to_retire: Vec<u64>,
    /// Sequence numbers retired whose RETIRE_CONNECTION_ID was not acknowledged yet (those
    /// of `to_retire` included); at most `2 * limit` (RFC 9000 §5.1.2).
    unacked_retirements: Vec<u64>,
    /// Our active_connection_id_limit.
    limit: u64,
    /// Sequence numbers retired: a NEW_CONNECTION_ID for one of them again (a
    /// retransmission that crossed our RETIRE_CONNECTION_ID) is ignored, not made live
    /// again (RFC 9000 §5.1.2: a retired ID is not used again, nor its reset token checked,
    /// §10.3.1). Mostly one range.
    retired: crate::range_set::RangeSet,
}

impl RemoteCids {
    pub fn new(initial: ConnectionId, limit: u64) -> Self {
        let mut cids = SeqMap::new();
        cids.insert(
            0,
            RemoteCid {
                cid: initial,
                reset_token: None,
            },
        );
        Self {
            cids,
            active_seq: 0,
            retire_prior_to: 0,
            to_retire: Vec::new(),
            unacked_retirements: Vec::new(),
            limit,
            retired: crate::range_set::RangeSet::new(),
        }
    }

    pub fn active(&self) -> RemoteCid {
        self.cids[&self.active_seq]
    }

    /// Replaces the ID of sequence 0 (the client learns the server's chosen ID from its first
    /// Initial, or a Retry).
    pub fn set_initial(&mut self, cid: ConnectionId) {
        if let Some(c) = self.cids.get_mut(&0) {
            c.cid = cid;
        }
    }

    pub fn set_initial_reset_token(&mut self, token: [u8; 16]) {
        if let Some(c) = self.cids.get_mut(&0) {
            c.reset_token = Some(token);
        }
    }

    pub fn on_new(&mut self, f: &NewConnectionId) -> Result<(), TransportError> {
        let ft = FrameType::NEW_CONNECTION_ID;
        if let Some(existing) = self.cids.get(&f.seq) {
            if existing.cid != f.cid || existing.reset_token.is_some_and(|t| t != f.reset_token) {
                return Err(TransportError::PROTOCOL_VIOLATION(
                    "sequence number reused for a different CID",
                )
                .with_frame(ft));
            }
            return Ok(());
        }
        if self.retired.contains(f.seq) {
            return Ok(());
        }
        if f.seq < self.retire_prior_to {
            // RFC 9000 §19.15: an ID below Retire Prior To is retired at once.
            return self.retire(f.seq);
        }
        self.cids.insert(
            f.seq,
            RemoteCid {
                cid: f.cid,
                reset_token: Some(f.reset_token),
            },
        );
        if f.retire_prior_to > self.retire_prior_to {
            self.retire_prior_to = f.retire_prior_to;
            let old: Vec<u64> = self.cids.keys_below(f.retire_prior_to).collect();
            for &s in &old {
                self.cids.remove(&s);
            }
            if self.active_seq < self.retire_prior_to {
                // Switch to the lowest remaining ID.
                self.active_seq = *self.cids.keys().next().expect("the new CID remains");
            }
            // Only now, with an active ID in place even if this fails.
            for s in old {
                self.retire(s)?;
            }
        }
        if self.cids.len() as u64 > self.limit {
            return Err(TransportError::CONNECTION_ID_LIMIT_ERROR(
                "more active CIDs than active_connection_id_limit",
            )
            .with_frame(ft));
        }
        Ok(())
    }

    /// The unused ID [`rotate`](Self::rotate) would move to, without moving: for packets to
    /// an address the peer probes from (RFC 9000 §9.5).
    pub fn spare(&self) -> Option<crate::cid::ConnectionId> {
        let seq = self.cids.keys().copied().find(|&s| s > self.active_seq)?;
        self.cids.get(&seq).map(|c| c.cid)
    }

    /// Moves to an unused ID (for migration, RFC 9000 §9.5) and retires the old one.
    /// Returns false if the peer gave us no spare ID.
    pub fn rotate(&mut self) -> bool {
        let next = self.cids.keys().copied().find(|&s| s > self.active_seq);
        next.is_some_and(|seq| self.switch_to(seq))
    }

    /// Moves to the ID of sequence `seq` and retires the active one (the preferred address's
    /// ID, RFC 9000 §9.6.1). False if `seq` is unknown (retired meanwhile) or active already.
    pub fn switch_to(&mut self, seq: u64) -> bool {
        if seq == self.active_seq
            || self.cids.get(&seq).is_none()
            || self.unacked_retirements.len() >= self.max_unacked_retirements()
        {
            return false;
        }
        let old = self.active_seq;
        self.cids.remove(&old);
        let _ = self.retire(old);
        self.active_seq = seq;
        true
    }

    /// Retirements that may await acknowledgement at once: twice our
    /// active_connection_id_limit, as RFC 9000 §5.1.2 asks to allow at least.
    fn max_unacked_retirements(&self) -> usize {
        (2 * self.limit).max(8) as usize
    }

    /// Queues RETIRE_CONNECTION_ID for `seq` unless it awaits acknowledgement already.
    /// A peer that makes us retire more IDs than we can track without acknowledging our
    /// retirements is answered with CONNECTION_ID_LIMIT_ERROR (RFC 9000 §5.1.2), so the
    /// queue cannot grow without bound (quic-go CVE-2024-22189).
    fn retire(&mut self, seq: u64) -> Result<(), TransportError> {
        if self.unacked_retirements.contains(&seq) {
            return Ok(());
        }
        if self.unacked_retirements.len() >= self.max_unacked_retirements() {
            return Err(TransportError::CONNECTION_ID_LIMIT_ERROR(
                "too many connection IDs retired without acknowledgement",
            )
            .with_frame(FrameType::NEW_CONNECTION_ID));
        }
        self.unacked_retirements.push(seq);
        self.to_retire.push(seq);
        self.retired.insert_one(seq);
        Ok(())
    }

    /// Our RETIRE_CONNECTION_ID for `seq` was acknowledged.
    pub fn on_retire_acked(&mut self, seq: u64) {
        self.unacked_retirements.retain(|&s| s != seq);
    }

    /// Our RETIRE_CONNECTION_ID for `seq` was lost: it goes again.
    pub fn on_retire_lost(&mut self, seq: u64) {
        if self.unacked_retirements.contains(&seq) && !self.to_retire.contains(&seq) {
            self.to_retire.push(seq);
        }
    }

    /// Whether `token` is the stateless reset token of one of the peer's IDs.
    pub fn is_reset_token(&self, token: &[u8; 16]) -> bool {
        self.cids
            .values()
            .any(|c| c.reset_token.is_some_and(|t| constant_time_eq(&t, token)))
    }
}

fn constant_time_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ncid(seq: u64, rpt: u64, b: u8) -> NewConnectionId {
        NewConnectionId {
            seq,
            retire_prior_to: rpt,
            cid: ConnectionId::new(&[b; 8]),
            reset_token: [b; 16],
        }
    }

    #[test]
    fn remote_cids_limit_and_retire() {
        let mut r = RemoteCids::new(ConnectionId::new(&[0; 8]), 3);
        r.on_new(&ncid(1, 0, 1)).unwrap();
        r.on_new(&ncid(2, 0, 2)).unwrap();
        assert!(r.on_new(&ncid(3, 0, 3)).is_err());
        let mut r = RemoteCids::new(ConnectionId::new(&[0; 8]), 3);
        r.on_new(&ncid(1, 0, 1)).unwrap();
        r.on_new(&ncid(2, 0, 2)).unwrap();
        r.on_new(&ncid(3, 2, 3)).unwrap();
        assert_eq!(r.to_retire, vec![0, 1]);
        assert_eq!(r.active_seq, 2);
        assert!(r.is_reset_token(&[3; 16]));
        assert!(r.rotate());
        assert_eq!(r.active().cid, ConnectionId::new(&[3; 8]));
        assert!(!r.rotate());
        // Same sequence, different CID.
        assert!(r.on_new(&ncid(3, 2, 9)).is_err());
    }

    /// A NEW_CONNECTION_ID retransmitted for an ID we have since moved off and retired
    /// (its RETIRE_CONNECTION_ID crossed it) is ignored: it was live again, counted against
    /// our limit (the peer's next ID closed the connection with CONNECTION_ID_LIMIT_ERROR)
    /// and its reset token checked again (RFC 9000 §10.3.1).
    #[test]
    fn a_retired_id_announced_again_stays_retired() {
        let mut r = RemoteCids::new(ConnectionId::new(&[0; 8]), 4);
        for s in 1..=3 {
            r.on_new(&ncid(s, 0, s as u8)).unwrap();
        }
        assert!(r.rotate());
        assert!(r.rotate());
        r.on_new(&ncid(4, 0, 4)).unwrap();
        r.on_new(&ncid(5, 0, 5)).unwrap();
        r.on_new(&ncid(1, 0, 1)).unwrap();
        assert!(!r.is_reset_token(&[1; 16]));
        assert_eq!(r.cids.len(), 4);
        r.on_new(&ncid(0, 0, 0)).unwrap();
        assert_eq!(r.cids.len(), 4);
    }

    #[test]
    fn local_retire_rules() {
        let mut l = LocalCids::default();
        let a = ConnectionId::new(&[1; 8]);
        let b = ConnectionId::new(&[2; 8]);
        l.add(a, [0; 16], false);
        l.add(b, [0; 16], true);
        assert!(l.on_retire(5, &a).is_err());
        assert!(l.on_retire(0, &a).is_err());
        assert_eq!(l.on_retire(0, &b).unwrap(), Some(a));
        assert_eq!(l.on_retire(0, &b).unwrap(), None);
    }
}
