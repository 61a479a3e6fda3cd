//! Acknowledgement processing, loss detection and probe timeouts (RFC 9002 §5–7, Appendix A).

use std::time::{Duration, Instant};

use super::paths::EcnState;
use super::{Connection, Event, State, Timer};
use crate::cc::{AckEvent, CongestionController, LossEvent};
use crate::error::TransportError;
use crate::frame::{Ack, FrameType};
use crate::recovery::{GRANULARITY, PERSISTENT_CONGESTION_THRESHOLD, RateSampler, SentFrame};
use crate::trace::TraceEvent;
use crate::types::SpaceId;

impl Connection {
    /// Processes an ACK frame received in `space`.
    pub(super) fn on_ack_frame(
        &mut self,
        now: Instant,
        space: SpaceId,
        ack: &Ack,
    ) -> Result<(), TransportError> {
        let si = space.index();
        // The packet's earlier frames may have finished the handshake and discarded this
        // space (RFC 9001 §4.9.2: a server confirms as its client's Finished arrives): what
        // it acknowledges there is gone with it.
        if self.spaces[si].discarded {
            return Ok(());
        }
        if ack.largest >= self.spaces[si].next_pn {
            return Err(
                TransportError::PROTOCOL_VIOLATION("ACK for a packet never sent")
                    .with_frame(FrameType::ACK),
            );
        }
        let prior_in_flight = self.path.bytes_in_flight;
        // A reused buffer: no allocation per ACK.
        let mut newly = std::mem::take(&mut self.acked_scratch);
        newly.clear();
        let skipped = self.skipped_pn.filter(|_| space == SpaceId::Data);
        {
            let sent = &mut self.spaces[si].sent;
            for r in ack.iter() {
                if skipped.is_some_and(|s| r.contains(&s)) {
                    self.acked_scratch = newly;
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "ACK of a packet number never used (optimistic ACK)",
                    )
                    .with_frame(FrameType::ACK));
                }
                let (Some(first), Some(last)) = (sent.first_pn(), sent.last_slot_pn()) else {
                    break;
                };
                // Within the records: numbers past the newest (probe answers, say, keep
                // none) were walked one by one, for every repeat of the frame.
                let lo = (*r.start()).max(first);
                let hi = (*r.end()).min(last);
                // Descending, so `newly[0]` is the largest newly acknowledged packet.
                for pn in (lo..=hi).rev() {
                    if let Some(p) = sent.remove(pn) {
                        newly.push((pn, p));
                    }
                }
            }
        }
        let sp = &mut self.spaces[si];
        let raised = sp.largest_acked.is_none_or(|l| ack.largest > l);
        sp.largest_acked = Some(sp.largest_acked.map_or(ack.largest, |l| l.max(ack.largest)));
        self.detect_spurious_losses(space, ack);
        if newly.is_empty() {
            self.acked_scratch = newly;
            // A higher largest acknowledged makes older packets lost by the packet
            // threshold (RFC 9002 §6.1.1) even when the ACK took nothing new (numbers
            // without records: probe answers). Left alone, a record below them stayed, and
            // with it the span an ACK of those numbers walked.
            if raised {
                self.detect_lost_packets(now, space);
                self.set_loss_timer(now);
            }
            return Ok(());
        }
        // Newest first, as the ACK ranges were walked from the top.
        let (largest_pn, largest_sent_time) = (newly[0].0, newly[0].1.time_sent);
        let any_eliciting = newly.iter().any(|(_, p)| p.ack_eliciting);
        if largest_pn == ack.largest && any_eliciting {
            let sample = now.saturating_duration_since(largest_sent_time);
            // RFC 9002 §5.3: the ack delay of Initial ACKs may be ignored (they are not
            // delayed on purpose); that of Handshake and 1-RTT ACKs counts, limited to the
            // peer's max_ack_delay only once the handshake is confirmed.
            let reported = if space == SpaceId::Initial {
                Duration::ZERO
            } else {
                let exp = self
                    .peer_params
                    .as_ref()
                    .map_or(3, |p| p.ack_delay_exponent);
                Duration::from_micros(ack.delay.saturating_mul(1 << exp.min(20)))
            };
            let mut delay = reported;
            if self.handshake_confirmed {
                delay = delay.min(self.peer_max_ack_delay());
            }
            // RFC 9002 §5.3 lets an endpoint ignore RTT samples before the handshake is
            // confirmed, when the ack delay cannot be taken out of them. At heavy loss an ACK
            // of the handshake can arrive long after its packet, because the peer's earlier
            // ACKs were lost: the sample then measures the loss, not the path, and as the
            // first sample it would set a probe timeout of several times that for the rest
            // of the connection. We ignore the samples of packets sent before a probe timeout
            // of the handshake fired (whenever their ACK comes: it may come with the packet
            // that confirms the handshake), and, before confirmation, samples the peer says
            // it held the ACK for most of.
            let late = self
                .timers
                .is_before(largest_sent_time, self.handshake_pto_at)
                || (!self.handshake_confirmed && reported > sample / 2);
            if newly[0].1.path == self.path.id && !late {
                self.path.rtt.update(delay, sample);
                self.path.first_rtt_sample.get_or_insert(now);
            }
        }
        if space == SpaceId::Handshake && self.side.is_client() {
            // RFC 9002 §6.2.1: the server has our Handshake packets, so it validated us.
            self.peer_validated_address = true;
        }

        // Per-packet effects.
        let mut sampler = RateSampler::default();
        let mut acked_bytes = 0u64;
        let mut ecn_marked_acked = 0u64;
        for (pn, p) in newly.iter() {
            if p.in_flight {
                if p.path == self.path.id {
                    self.path.bytes_in_flight =
                        self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
                    acked_bytes += u64::from(p.size);
                    sampler.on_acked(&mut self.path.delivery, now, p);
                } else if let Some(prev) = self.prev_path.as_mut().filter(|x| x.id == p.path) {
                    prev.bytes_in_flight = prev.bytes_in_flight.saturating_sub(u64::from(p.size));
                }
            }
            if p.ecn_marked {
                ecn_marked_acked += 1;
            }
            if p.path == self.path.id {
                if p.mtu_probe {
                    if let Some(mtu) = self.path.mtud.on_probe_acked(*pn, now) {
                        self.path.set_mtu(mtu);
                        self.trace(TraceEvent::MtuUpdated {
                            path: self.path.id,
                            mtu,
                            done: false,
                        });
                    }
                } else if p.size > self.config.initial_mtu {
                    self.path.mtud.on_full_size_acked();
                }
            }
            if space == SpaceId::Data && *pn >= self.key_update.local_phase_start {
                self.key_update.phase_acked = true;
            }
        }
        // Oldest first: a stream's frames then come acknowledged in the order of their
        // offsets, and its send buffer frees each prefix directly instead of keeping the
        // ranges acknowledged ahead of a gap (an ACK of several packets was walked newest
        // first above).
        for (_, p) in newly.iter().rev() {
            for f in &p.frames {
                self.on_frame_acked(space, f);
            }
        }

        // ECN (RFC 9000 §13.4.2).
        // RFC 9000 §13.4.2.1: not on an ACK that does not raise the largest acknowledged
        // (a reordered ACK carries older counts).
        if raised {
            self.process_ecn(now, space, ack, ecn_marked_acked, largest_sent_time);
        }

        // Loss detection, then the controller sees the ACK.
        self.detect_lost_packets(now, space);
        if acked_bytes > 0 {
            let app_limited = !self.path.cwnd_limited;
            let rate = sampler.finish(&self.path.delivery, now);
            let ev = AckEvent {
                acked_bytes,
                largest_acked_sent_time: largest_sent_time,
                rtt: &self.path.rtt,
                rate,
                prior_in_flight,
                bytes_in_flight: self.path.bytes_in_flight,
                app_limited,
            };
            self.path.cc.on_ack(now, &ev);
            self.trace_metrics();
            if space == SpaceId::Data {
                self.update_ack_frequency(now);
            }
        }
        for (_, p) in newly.drain(..) {
            self.spaces[si].sent.recycle(p.frames);
        }
        self.acked_scratch = newly;
        if space == SpaceId::Data
            && self.handshake_confirmed
            && !self.trimmed_after_handshake
            && !self.spaces[si].sent.has_ack_eliciting_in_flight()
        {
            // Everything of the handshake period is acknowledged: give back what it grew
            // (a connection that now idles would keep it for its whole life).
            self.trimmed_after_handshake = true;
            self.spaces[si].sent.release_memory();
            self.acked_scratch = Vec::new();
        }
        // RFC 9002 §6.2.1: reset the backoff, except a client not yet sure the server
        // validated its address.
        if self.peer_validated_address {
            self.pto_count = 0;
        }
        self.set_loss_timer(now);
        Ok(())
    }

    fn on_frame_acked(&mut self, space: SpaceId, f: &SentFrame) {
        match *f {
            SentFrame::Crypto { offset, len } => {
                self.spaces[space.index()]
                    .crypto_send
                    .ack(offset..offset + u64::from(len));
            }
            SentFrame::Ack(largest) => self.spaces[space.index()].ack.on_ack_acked(largest),
            SentFrame::RetireConnectionId(seq) => self.remote_cids.on_retire_acked(seq),
            SentFrame::Stream { .. } | SentFrame::ResetStream(_) => {
                self.streams.on_frame_acked(f);
            }
            _ => {}
        }
    }

    fn on_frame_lost(&mut self, space: SpaceId, f: &SentFrame) {
        match *f {
            SentFrame::Crypto { offset, len } => {
                self.spaces[space.index()]
                    .crypto_send
                    .lost(offset..offset + u64::from(len));
            }
            SentFrame::NewConnectionId(seq) => {
                if let Some(c) = self.local_cids.issued.get_mut(&seq) {
                    c.announce = true;
                }
            }
            SentFrame::RetireConnectionId(seq) => self.remote_cids.on_retire_lost(seq),
            SentFrame::HandshakeDone => self.handshake_done_pending = true,
            SentFrame::NewToken => self.new_token_pending = true,
            SentFrame::AckFrequency(seq) => {
                if seq == self.ack_frequency_seq && self.ack_frequency_pending.is_none() {
                    self.resend_ack_frequency();
                }
            }
            SentFrame::Ack(_)
            | SentFrame::Datagram
            | SentFrame::PathChallenge
            | SentFrame::PathResponse => {}
            _ => self.streams.on_frame_lost(f),
        }
    }

    fn process_ecn(
        &mut self,
        now: Instant,
        space: SpaceId,
        ack: &Ack,
        marked_acked: u64,
        largest_sent_time: Instant,
    ) {
        if matches!(self.path.ecn, EcnState::Failed | EcnState::Off) {
            return;
        }
        let sp = &mut self.spaces[space.index()];
        let Some(counts) = ack.ecn else {
            if marked_acked > 0 {
                // The peer or the path drops ECN information (RFC 9000 §13.4.2.1).
                self.path.ecn = EcnState::Failed;
            }
            return;
        };
        let prev = sp.peer_ecn;
        if counts.ect0 < prev.ect0 || counts.ect1 < prev.ect1 || counts.ce < prev.ce {
            self.path.ecn = EcnState::Failed;
            return;
        }
        let increase = (counts.ect0 - prev.ect0) + (counts.ce - prev.ce);
        // Every newly acknowledged ECT(0) packet must show up as ECT(0) or CE; we never send
        // ECT(1), so reports of it mean mangling, as do more ECT(0) and CE packets than we
        // sent marked (RFC 9000 §13.4.2.1).
        if increase < marked_acked
            || counts.ect1 > 0
            || counts.ect0.saturating_add(counts.ce) > sp.ecn_marked_sent
        {
            self.path.ecn = EcnState::Failed;
            sp.peer_ecn = counts;
            return;
        }
        sp.peer_ecn = counts;
        if marked_acked > 0 && matches!(self.path.ecn, EcnState::Testing { .. }) {
            self.path.ecn = EcnState::Capable;
        }
        if counts.ce > prev.ce {
            // RFC 9002 §7.1: CE is a congestion signal.
            let ev = LossEvent {
                largest_sent_time,
                lost_bytes: 0,
                ecn_ce: true,
                bytes_in_flight: self.path.bytes_in_flight,
                latest_rtt: self.path.rtt.has_sample().then(|| self.path.rtt.latest()),
            };
            self.congestion_event(now, &ev);
            // A CE mark is congestion whatever the losses around it turn out to be.
            self.path.undo.lost = 0;
        }
    }

    /// Declares lost what the ACKs say must be lost (RFC 9002 §6.1) and reacts.
    pub(super) fn detect_lost_packets(&mut self, now: Instant, space: SpaceId) {
        let si = space.index();
        let Some(largest_acked) = self.spaces[si].largest_acked else {
            return;
        };
        let rtt = &self.path.rtt;
        let loss_delay = rtt.loss_delay(self.path.time_threshold_eighths);
        let packet_threshold = self.path.reorder_threshold;
        let lost_send_time = now.checked_sub(loss_delay);
        let mut lost_pns = Vec::new();
        let mut loss_time: Option<Instant> = None;
        for (pn, p) in self.spaces[si].sent.iter() {
            if pn > largest_acked {
                break;
            }
            let by_time = lost_send_time.is_some_and(|t| p.time_sent <= t);
            if by_time || largest_acked >= pn + packet_threshold {
                lost_pns.push(pn);
            } else {
                let t = p.time_sent + loss_delay;
                loss_time = Some(loss_time.map_or(t, |l: Instant| l.min(t)));
            }
        }
        self.spaces[si].loss_time = loss_time;
        if lost_pns.is_empty() {
            return;
        }
        self.on_packets_lost(now, space, &lost_pns, "reordering_or_time_threshold");
    }

    /// Removes `pns` from flight as lost.
    pub(super) fn on_packets_lost(
        &mut self,
        now: Instant,
        space: SpaceId,
        pns: &[u64],
        trigger: &'static str,
    ) {
        let si = space.index();
        let mut lost_bytes = 0u64;
        let mut largest_sent: Option<Instant> = None;
        // For persistent congestion: ack-eliciting lost packets (time) in pn order.
        let mut eliciting_times: Vec<Instant> = Vec::new();
        let pto = self.pto_duration(space);
        let mut lost_frames = Vec::new();
        let largest_acked = self.spaces[si].largest_acked.unwrap_or(0);
        let mut mtu_reduced = None;
        // Losses an undo would have to see proven spurious (those `detect_spurious_losses`
        // counts), and the lowest of their numbers.
        let mut undoable = 0u32;
        let mut undo_floor = u64::MAX;
        for &pn in pns {
            let Some(p) = self.spaces[si].sent.remove(pn) else {
                continue;
            };
            if p.ack_eliciting && !p.mtu_probe {
                let rl = &mut self.spaces[si].recently_lost;
                if rl.len() >= super::spaces::MAX_RECENTLY_LOST {
                    rl.pop_front();
                }
                // Kept in packet-number order (losses are declared in that order but for
                // rare exceptions), for the single walk of `detect_spurious_losses`.
                let at = if rl.back().is_none_or(|l| l.pn < pn) {
                    rl.len()
                } else {
                    rl.partition_point(|l| l.pn < pn)
                };
                rl.insert(
                    at,
                    super::spaces::LostRecord {
                        pn,
                        reorder_distance: largest_acked.saturating_sub(pn),
                        path: p.path,
                    },
                );
            }
            if p.ack_eliciting && !p.mtu_probe && p.path == self.path.id {
                undoable += 1;
                undo_floor = undo_floor.min(pn);
            }
            self.stats.packets_lost += 1;
            self.stats.bytes_lost += u64::from(p.size);
            if space == SpaceId::Data && p.ack_eliciting && !p.mtu_probe && p.path == self.path.id {
                self.path.recent_lost = (self.path.recent_lost + 1).min(self.path.recent_sent);
            }
            if self.trace_packets {
                self.trace(TraceEvent::PacketLost {
                    space,
                    pn,
                    size: usize::from(p.size),
                    trigger,
                });
            }
            let on_active = p.path == self.path.id;
            if p.in_flight {
                if on_active {
                    self.path.bytes_in_flight =
                        self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
                } else if let Some(prev) = self.prev_path.as_mut().filter(|x| x.id == p.path) {
                    prev.bytes_in_flight = prev.bytes_in_flight.saturating_sub(u64::from(p.size));
                }
            }
            if on_active && p.mtu_probe {
                // A lost probe says nothing about congestion (RFC 9000 §14.4).
                if let Some(mtu) = self.path.mtud.on_probe_lost(pn, now, pto) {
                    self.path.set_mtu(mtu);
                    self.trace(TraceEvent::MtuUpdated {
                        path: self.path.id,
                        mtu,
                        done: false,
                    });
                    mtu_reduced = Some(mtu);
                }
            } else if on_active && p.in_flight {
                if p.size > self.config.initial_mtu {
                    self.path.mtud.on_full_size_lost(now);
                }
                lost_bytes += u64::from(p.size);
                largest_sent = Some(largest_sent.map_or(p.time_sent, |t| t.max(p.time_sent)));
                if p.ack_eliciting {
                    eliciting_times.push(p.time_sent);
                }
            }
            lost_frames.push(p.frames);
        }
        for frames in lost_frames {
            for f in &frames {
                self.on_frame_lost(space, f);
            }
            self.spaces[si].sent.recycle(frames);
        }
        if let Some(mtu) = mtu_reduced {
            self.drop_oversized_flight(space, mtu);
        }
        let Some(largest_sent_time) = largest_sent else {
            return;
        };
        let ev = LossEvent {
            largest_sent_time,
            lost_bytes,
            ecn_ce: false,
            bytes_in_flight: self.path.bytes_in_flight,
            latest_rtt: self.path.rtt.has_sample().then(|| self.path.rtt.latest()),
        };
        let reduced = self.congestion_event(now, &ev);
        let undo = &mut self.path.undo;
        if reduced {
            *undo = super::paths::UndoWatch {
                lost: undoable,
                spurious: 0,
                floor: undo_floor,
                undone: undo.undone,
            };
        } else if undo.lost > 0 {
            // Within the recovery period: the same reduction.
            undo.lost = undo.lost.saturating_add(undoable);
            undo.floor = undo.floor.min(undo_floor);
        }
        // RFC 9002 §7.6: persistent congestion when the lost ack-eliciting packets span more
        // than the threshold duration with nothing acknowledged in between (the lost set here
        // comes from one contiguous scan), counting only packets sent after the path's first
        // RTT sample (§7.6.2: before it, the duration means nothing; 0-RTT packets a server
        // dropped before it had state were counted).
        if let Some(sampled) = self.path.first_rtt_sample {
            eliciting_times.retain(|&t| t > sampled);
        } else {
            eliciting_times.clear();
        }
        if eliciting_times.len() >= 2 {
            let first = eliciting_times.iter().min().copied().expect("non-empty");
            let last = eliciting_times.iter().max().copied().expect("non-empty");
            // §7.6.1: with max_ack_delay in every space, confirmed or not (the PTO's
            // leaves it out before the handshake is confirmed).
            let max_ack_delay = self
                .peer_params
                .as_ref()
                .map_or(Duration::from_millis(25), |p| p.max_ack_delay_duration())
                .max(self.peer_max_ack_delay());
            let duration = (self.path.rtt.smoothed()
                + (self.path.rtt.var() * 4).max(GRANULARITY)
                + max_ack_delay)
                * PERSISTENT_CONGESTION_THRESHOLD;
            // Conservative: the whole batch must be consecutive packet numbers, so no packet
            // between the first and the last was acknowledged.
            let contiguous = pns.windows(2).all(|w| w[1] == w[0] + 1);
            if last.saturating_duration_since(first) >= duration && contiguous {
                self.path.cc.on_persistent_congestion(now);
                self.path.rtt.on_persistent_congestion();
                self.path.undo.lost = 0;
                self.trace(TraceEvent::CongestionStateUpdated {
                    path: self.path.id,
                    state: "persistent_congestion",
                });
            }
        }
        self.trace_metrics();
    }

    /// The path MTU shrank: packets larger than it will never arrive. Send their frames again
    /// and take them out of flight without a congestion signal (the path, not the load,
    /// dropped them).
    fn drop_oversized_flight(&mut self, space: SpaceId, mtu: u16) {
        let si = space.index();
        let big: Vec<u64> = self.spaces[si]
            .sent
            .iter()
            .filter(|(_, p)| p.size > mtu && p.path == self.path.id)
            .map(|(pn, _)| pn)
            .collect();
        for pn in big {
            let Some(p) = self.spaces[si].sent.remove(pn) else {
                continue;
            };
            if p.in_flight {
                self.path.bytes_in_flight =
                    self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
            }
            for f in &p.frames {
                self.on_frame_lost(space, f);
            }
            self.spaces[si].sent.recycle(p.frames);
        }
    }

    /// Tells the controller; true if it reduced the window.
    fn congestion_event(&mut self, now: Instant, ev: &LossEvent) -> bool {
        let before = self.path.cc.window();
        self.path.cc.on_congestion_event(now, ev);
        let reduced = self.path.cc.window() < before;
        if reduced {
            self.path.congestion_events += 1;
        }
        reduced
    }

    /// An ACK covered packets we had declared lost: the loss was reordering. Widen the
    /// reordering thresholds so it does not happen again, and let the controller undo its
    /// reduction (RFC 9002 §6.1: thresholds may adapt).
    fn detect_spurious_losses(&mut self, space: SpaceId, ack: &Ack) {
        let si = space.index();
        if self.spaces[si].recently_lost.is_empty() {
            return;
        }
        let mut spurious = 0u64;
        let mut undone = 0u32;
        let mut max_distance = 0u64;
        let active = self.path.id;
        let floor = self.path.undo.floor;
        // Per range, largest first, the records it covers found by binary search (the
        // records are in packet-number order): O(ranges × log records) plus what matches. A
        // walk of the records for each frame let a packet of many tiny ACK frames spanning
        // them (duplicates, acknowledging nothing new) cost a walk of all 256 records each.
        let rl = &mut self.spaces[si].recently_lost;
        let mut found = false;
        for r in ack.iter() {
            // Records marked below (`pn = u64::MAX`) lie above this range, where the
            // searches' answers are false anyway: the order they rely on holds.
            let hi = rl.partition_point(|l| l.pn <= *r.end());
            if hi == 0 {
                break; // no record this low: nor in the ranges below
            }
            let lo = rl.partition_point(|l| l.pn < *r.start());
            for l in rl.range_mut(lo..hi) {
                if l.path == active {
                    spurious += 1;
                    undone += u32::from(l.pn >= floor);
                    max_distance = max_distance.max(l.reorder_distance);
                }
                l.pn = u64::MAX;
                found = true;
            }
        }
        if found {
            rl.retain(|l| l.pn != u64::MAX);
        }
        if spurious == 0 {
            return;
        }
        self.stats.spurious_losses += spurious;
        const MAX_REORDER_THRESHOLD: u64 = 64;
        self.path.reorder_threshold = self
            .path
            .reorder_threshold
            .max(max_distance + 1)
            .min(MAX_REORDER_THRESHOLD);
        // Up to twice the RTT, as RACK does for timing-based reordering.
        self.path.time_threshold_eighths = (self.path.time_threshold_eighths + 1).min(16);
        // The reduction is undone once every loss behind it proved spurious (RFC 9438
        // §4.9 leaves how to tell to the implementation).
        let undo = &mut self.path.undo;
        if undo.lost > 0 {
            undo.spurious = undo.spurious.saturating_add(undone);
            if undo.spurious >= undo.lost {
                undo.lost = 0;
                undo.undone = undo.undone.saturating_add(1);
                self.path.cc.on_spurious_congestion_event();
            }
        }
    }

    fn trace_metrics(&mut self) {
        if !self.trace_packets {
            return;
        }
        let slow_start = self.path.cc.in_slow_start();
        if slow_start != self.traced_slow_start {
            // qlog's recovery:congestion_state_updated: when slow start (BBR's Startup) ends,
            // or starts again.
            self.traced_slow_start = slow_start;
            self.trace(TraceEvent::CongestionStateUpdated {
                path: self.path.id,
                state: if slow_start {
                    "slow_start"
                } else {
                    "congestion_avoidance"
                },
            });
        }
        let p = &self.path;
        let ev = TraceEvent::MetricsUpdated {
            path: p.id,
            min_rtt: p.rtt.min(),
            smoothed_rtt: p.rtt.smoothed(),
            latest_rtt: p.rtt.latest(),
            rtt_variance: p.rtt.var(),
            cwnd: p.cc.window(),
            bytes_in_flight: p.bytes_in_flight,
            ssthresh: p.cc.ssthresh(),
            pacing_rate: p.pacing_rate(),
        };
        self.trace(ev);
    }

    fn earliest_loss_time(&self) -> Option<(Instant, SpaceId)> {
        SpaceId::ALL
            .iter()
            .filter_map(|&s| self.spaces[s.index()].loss_time.map(|t| (t, s)))
            .min_by_key(|(t, _)| *t)
    }

    fn any_eliciting_in_flight(&self) -> bool {
        self.spaces
            .iter()
            .any(|s| s.sent.has_ack_eliciting_in_flight())
    }

    /// RFC 9002 Appendix A.8 GetPtoTimeAndSpace.
    fn pto_time_and_space(&self, now: Instant) -> Option<(Instant, SpaceId)> {
        let dur = backoff(self.path.rtt.pto_base(), self.pto_count);
        let handshake_in_flight = [SpaceId::Initial, SpaceId::Handshake]
            .iter()
            .any(|s| self.spaces[s.index()].sent.has_ack_eliciting_in_flight());
        if !self.any_eliciting_in_flight()
            || (!handshake_in_flight && !self.peer_validated_address && !self.handshake_confirmed)
        {
            // Anti-deadlock probe from a client whose address the server may not have
            // validated yet (RFC 9002 §6.2.2.1, §6.2.4): a Handshake packet once it has the
            // keys. 0-RTT packets in flight do not count: a server blocked by its
            // amplification limit cannot answer them, while a Handshake packet validates
            // the client's address (RFC 9000 §8.1) and unblocks it.
            let space = if self.spaces[SpaceId::Handshake.index()].keys.is_some() {
                SpaceId::Handshake
            } else {
                SpaceId::Initial
            };
            return Some((now + dur, space));
        }
        let mut best: Option<(Instant, SpaceId)> = None;
        for s in SpaceId::ALL {
            let sp = &self.spaces[s.index()];
            if !sp.sent.has_ack_eliciting_in_flight() {
                continue;
            }
            let mut d = dur;
            if s == SpaceId::Data {
                // RFC 9002 A.8: skip the Data space until the handshake is confirmed.
                if !self.handshake_confirmed && best.is_some() {
                    continue;
                }
                d += backoff(self.peer_max_ack_delay(), self.pto_count);
            }
            let Some(t) = sp.time_of_last_ack_eliciting else {
                continue;
            };
            let t = t + d;
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, s));
            }
        }
        best
    }

    /// RFC 9002 Appendix A.8 SetLossDetectionTimer.
    pub(super) fn set_loss_timer(&mut self, now: Instant) {
        if matches!(
            self.state,
            State::Closing | State::Draining | State::Drained
        ) {
            return;
        }
        if let Some((t, _)) = self.earliest_loss_time() {
            self.timers.set(Timer::Loss, Some(t));
            return;
        }
        // Blocked by the amplification limit: a probe could not be sent anyway, and a PTO
        // that fires for nothing still backs the next one off. Short of what the probe
        // needs is blocked too: a padded Initial (1,200 bytes), else the smallest datagram
        // `write_datagram` builds (64).
        let budget = self.path.amplification_budget();
        if self.side.is_server()
            && budget < super::send::MIN_DATAGRAM as u64
            && (budget < 64
                || matches!(
                    self.pto_time_and_space(now),
                    Some((_, SpaceId::Initial))
                ))
        {
            self.timers.set(Timer::Loss, None);
            return;
        }
        if !self.any_eliciting_in_flight() && self.peer_validated_address {
            self.timers.set(Timer::Loss, None);
            return;
        }
        self.timers
            .set(Timer::Loss, self.pto_time_and_space(now).map(|(t, _)| t));
    }

    /// RFC 9002 Appendix A.9 OnLossDetectionTimeout.
    pub(super) fn on_loss_timeout(&mut self, now: Instant) {
        if let Some((_, space)) = self.earliest_loss_time() {
            self.detect_lost_packets(now, space);
            self.set_loss_timer(now);
            return;
        }
        let Some((_, space)) = self.pto_time_and_space(now) else {
            return;
        };
        self.stats.pto_count += 1;
        if !self.handshake_confirmed {
            self.handshake_pto_at = self.timers.stamp(now);
        }
        if !self.any_eliciting_in_flight() {
            // Anti-deadlock: one probe in the highest handshake space we have.
            self.spaces[space.index()].probes = 1;
        } else {
            self.spaces[space.index()].probes = 2;
            self.queue_probe_data(space);
            // A server's Initial probe is padded to 1,200 bytes (RFC 9000 §14.1): its
            // unacknowledged Handshake data rides in the same datagrams rather than in its own
            // at the Handshake space's PTO, which before the client's address is validated
            // would spend the amplification budget twice (RFC 9002 §6.2.4 lets a probe carry
            // data of another space; the client cannot read our Handshake packets without
            // the Initial anyway).
            let hs = SpaceId::Handshake.index();
            if space == SpaceId::Initial
                && self.side.is_server()
                && self.spaces[hs].sent.has_ack_eliciting_in_flight()
            {
                self.spaces[hs].probes = self.spaces[hs].probes.max(1);
                self.queue_probe_data(SpaceId::Handshake);
            }
        }
        self.pto_count += 1;
        self.set_loss_timer(now);
    }

    /// Makes sure a PTO probe carries something useful: the oldest unacknowledged data of the
    /// space is queued again (RFC 9002 §6.2.4), without declaring it lost.
    pub(super) fn queue_probe_data(&mut self, space: SpaceId) {
        let si = space.index();
        if space != SpaceId::Data {
            // Handshake data is small: resend all of it that is unacknowledged.
            let frames: Vec<SentFrame> = self.spaces[si]
                .sent
                .iter()
                .flat_map(|(_, p)| p.frames.iter().cloned())
                .filter(|f| matches!(f, SentFrame::Crypto { .. }))
                .collect();
            for f in &frames {
                self.on_frame_lost(space, f);
            }
            return;
        }
        if self.streams.has_stream_data() {
            return;
        }
        let frames: Vec<SentFrame> = self.spaces[si]
            .sent
            .iter()
            .filter(|(_, p)| p.ack_eliciting && p.in_flight)
            .take(2)
            .flat_map(|(_, p)| p.frames.iter().cloned())
            .collect();
        for f in &frames {
            self.on_frame_lost(space, f);
        }
    }

    /// Redundancy (see [`crate::config::Redundancy`]): when everything new has been sent on
    /// a lossy path, queue the frames of the flight's recent packets once more. The copies
    /// are ordinary retransmissions (RFC 9000 §13.3 lets data be sent again in any packet);
    /// the originals stay in flight and are acknowledged or declared lost as usual.
    pub(super) fn queue_redundant_copies(&mut self, now: Instant) {
        let Some(r) = self.config.redundancy else {
            return;
        };
        if self.streams.has_stream_data() {
            return; // originals or queued copies still to send
        }
        self.sending_copies = false;
        if self.one_rtt.is_none() || self.path.recent_loss_permille() < r.min_loss_permille {
            return;
        }
        let si = SpaceId::Data.index();
        let horizon = self.path.rtt.smoothed();
        let path = self.path.id;
        // The newest packets, back to one smoothed RTT ago: the end of a flight is where a
        // loss costs a timeout. Send times grow with packet numbers, so the scan stops early.
        let mut pns = Vec::new();
        for (pn, p) in self.spaces[si].sent.iter().rev() {
            if now.saturating_duration_since(p.time_sent) > horizon || pns.len() >= r.max_packets {
                break;
            }
            if !p.copied && p.ack_eliciting && p.in_flight && !p.mtu_probe && p.path == path {
                pns.push(pn);
            }
        }
        if pns.is_empty() {
            return;
        }
        let n = pns.len();
        let mut frames = Vec::new();
        for pn in pns {
            if let Some(p) = self.spaces[si].sent.get_mut(pn) {
                p.copied = true;
                frames.extend(p.frames.iter().cloned());
            }
        }
        for f in &frames {
            self.on_frame_lost(SpaceId::Data, f);
        }
        self.sending_copies = true;
        self.stats.redundant_packets += n as u64;
    }

    /// Declares lost every packet in flight on the old path after a migration; used when the
    /// path is abandoned.
    #[allow(dead_code)]
    pub(super) fn abandon_flight(&mut self, now: Instant) {
        let pns: Vec<u64> = self.spaces[SpaceId::Data.index()]
            .sent
            .iter()
            .map(|(pn, _)| pn)
            .collect();
        if !pns.is_empty() {
            self.on_packets_lost(now, SpaceId::Data, &pns, "path_abandoned");
        }
        let _ = Event::Connected;
    }
}

use crate::recovery::backoff;
