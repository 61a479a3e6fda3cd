//! Building datagrams: which space sends what, coalescing (RFC 9000 §12.2), padding
//! (§14.1), congestion and pacing gates (RFC 9002 §7), GSO batches, and closing packets.

use std::time::Instant;

use bytes::BufMut;

use super::paths::EcnState;
use super::{Connection, State, Timer, Transmit, ZeroRtt};
use crate::cc::CongestionController;
use crate::coding::BufMutExt;
use crate::frame::{Ack, Close, Frame, FrameType};
use crate::error::TransportError;
use crate::packet::{self, HeaderPos, LongType};
use crate::recovery::{SentFrame, SentPacket};
use crate::trace::{PacketKind, TraceEvent};
use crate::types::SpaceId;

use super::EcnCodepoint;

/// Smallest datagram a client sends with an Initial, and the size PATH_CHALLENGE and
/// PATH_RESPONSE datagrams are expanded to (RFC 9000 §14.1, §8.2).
pub(super) const MIN_DATAGRAM: usize = 1200;

/// Sent-packet records past which no new ack-eliciting data goes out (see `write_packet`).
const SEND_SPAN_LIMIT: usize = super::spaces::MAX_SENT_SPAN / 4 * 3;
/// AEAD tag length of every QUIC cipher suite.
const TAG_LEN: usize = 16;

/// What went into one packet.
struct PacketOut {
    ack_eliciting: bool,
    padded: bool,
}

/// What went into one datagram.
#[derive(Default)]
struct DatagramOut {
    size: usize,
    ack_eliciting: bool,
    /// Only Data-space packets: may be batched with GSO.
    data_only: bool,
}

/// Packets kept under the AEAD's confidentiality limit when the connection closes for it:
/// more than one `poll_transmit` can send, and the closing packets themselves.
const AEAD_CLOSE_ROOM: u64 = 4096;

impl Connection {
    /// Packets protected with the current 1-RTT key after which it is updated: the
    /// configured interval, at most seven eighths of the AEAD's confidentiality limit.
    fn key_update_due(&self) -> u64 {
        let limit = self.confidentiality_limit();
        self.config.key_update_interval.min(limit - limit / 8)
    }

    /// Packets the AEAD of the 1-RTT keys may protect under one key (RFC 9001 §6.6).
    fn confidentiality_limit(&self) -> u64 {
        self.one_rtt
            .as_ref()
            .map_or(u64::MAX, |k| k.current.local.confidentiality_limit())
    }

    /// Writes the next datagram(s) into `buf` (cleared first). With `max_datagrams > 1`,
    /// full-size datagrams are batched for GSO: see [`Transmit::segment_size`].
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        max_datagrams: usize,
        buf: &mut Vec<u8>,
    ) -> Option<Transmit> {
        self.sync_timers(now);
        self.now = now;
        buf.clear();
        match self.state {
            State::Drained | State::Draining => return None,
            State::Closing => return self.send_close(now, buf),
            _ => {}
        }
        // RFC 9001 §6.6: a key is not used past the AEAD's confidentiality limit. One that
        // could not be updated in time (the peer left the last update unacknowledged for an
        // eighth of the limit) ends the connection while its CONNECTION_CLOSE can still go
        // out under that key.
        let last_use = self.confidentiality_limit().saturating_sub(AEAD_CLOSE_ROOM);
        if self.key_update.packets_in_phase >= last_use {
            self.close_with_error(
                now,
                TransportError::AEAD_LIMIT_REACHED(
                    "packet key at the AEAD's confidentiality limit and not yet updatable",
                ),
            );
            return self.send_close(now, buf);
        }
        // Client with 0-RTT keys: hold the first flight a moment so the application's early
        // data fills the padded Initial datagram instead of following in its own packets.
        if let Some(t) = self.timers.get(Timer::FirstFlight) {
            if now < t && !self.streams.has_bidi_data() && self.datagrams_out.is_empty() {
                return None;
            }
            self.timers.set(Timer::FirstFlight, None);
        }
        if let Some(t) = self.send_off_path_response(buf) {
            return Some(t);
        }
        if let Some(t) = self.send_preferred_probe(now, buf) {
            return Some(t);
        }
        if let Some(t) = self.send_prev_path_challenge(buf) {
            return Some(t);
        }
        self.queue_redundant_copies(now);
        if let Some(t) = self.send_mtu_probe(now, buf) {
            return Some(t);
        }
        let mut mtu = usize::from(self.path.mtu());
        let probing = self.spaces.iter().any(|s| s.probes > 0);
        if probing && self.pto_count >= 2 && mtu > usize::from(self.config.initial_mtu) {
            // Repeated timeouts with large packets: the path may have stopped carrying them
            // (RFC 8899 §4.3 black hole). Probe with base-size packets, which get through
            // either way, and have the current size confirmed by a DPLPMTUD probe.
            mtu = usize::from(self.config.initial_mtu);
            self.path.mtud.suspect_black_hole(now);
        }
        let ecn = if self.path.ecn.should_mark() {
            Some(EcnCodepoint::Ect0)
        } else {
            None
        };
        let mut segment: Option<usize> = None;
        let mut count = 0;
        loop {
            let start = buf.len();
            let max = segment.unwrap_or(mtu);
            let d = self.write_datagram(now, buf, start, max, ecn.is_some());
            if d.size == 0 {
                buf.truncate(start);
                break;
            }
            count += 1;
            self.on_datagram_sent(d.size, ecn.is_some());
            if !d.data_only || max_datagrams <= 1 || count >= max_datagrams {
                if count == 1 {
                    segment = None;
                }
                break;
            }
            if count == 1 {
                if d.size != mtu {
                    break;
                }
                segment = Some(d.size);
            } else if d.size < max {
                // A short datagram ends the batch.
                break;
            }
        }
        if count == 0 {
            self.update_timers(now);
            return None;
        }
        if count == 1 {
            segment = None;
        }
        self.update_timers(now);
        Some(Transmit {
            destination: self.path.remote,
            ecn,
            size: buf.len(),
            segment_size: segment,
            src_ip: self.path.local_ip,
        })
    }

    fn on_datagram_sent(&mut self, size: usize, marked: bool) {
        self.stats.udp_tx_datagrams += 1;
        self.stats.udp_tx_bytes += size as u64;
        if !self.path.validated {
            self.path.amp_sent += size as u64;
        }
        if marked && let EcnState::Testing { marked } = &mut self.path.ecn {
            *marked += 1;
        }
    }

    /// Whether a space has anything it must send now (ACK due, handshake data, probe).
    fn space_wants_to_send(&self, space: SpaceId, now: Instant) -> bool {
        let sp = &self.spaces[space.index()];
        if sp.discarded {
            return false;
        }
        let has_keys = match space {
            SpaceId::Data => self.one_rtt.is_some() || self.can_send_0rtt(),
            _ => sp.keys.is_some(),
        };
        if !has_keys {
            return false;
        }
        // RFC 9000 §13.2.1: a packet with nothing but an ACK is never sent in answer to
        // packets that were not ack-eliciting (two endpoints would acknowledge each other's
        // acknowledgements for ever); the handshake spaces acknowledge ack-eliciting packets
        // at once (`immediate`), the Data space when the ACK delay says.
        let ack_due = if space == SpaceId::Data {
            sp.ack.due(now) && self.one_rtt.is_some()
        } else {
            sp.ack.new_since_ack && sp.ack.immediate
        };
        if ack_due || sp.probes > 0 || sp.crypto_send.has_sendable() {
            return true;
        }
        if space != SpaceId::Data {
            return false;
        }
        self.data_space_has_frames()
    }

    fn can_send_0rtt(&self) -> bool {
        self.side.is_client()
            && self.zero_rtt == ZeroRtt::Attempting
            && self.zero_rtt_keys.is_some()
            && self.one_rtt.is_none()
    }

    /// Whether the Data space has ack-eliciting frames waiting.
    fn data_space_has_frames(&self) -> bool {
        let one_rtt = self.one_rtt.is_some();
        (one_rtt
            && (self.handshake_done_pending
                || self.new_token_pending
                || self.path.challenge.as_ref().is_some_and(|c| !c.sent)
                || self.path_response.is_some()
                || self.local_cids.issued.values().any(|c| c.announce)
                || !self.remote_cids.to_retire.is_empty()
                || self.ack_frequency_pending.is_some()))
            || self.ping_pending
            || self.streams.wants_to_send()
            || !self.datagrams_out.is_empty()
    }

    fn write_datagram(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        start: usize,
        max_size: usize,
        ecn_marked: bool,
    ) -> DatagramOut {
        let budget = self.path.amplification_budget();
        let max_size = (max_size as u64).min(budget) as usize;
        let mut out = DatagramOut {
            data_only: true,
            ..Default::default()
        };
        if max_size < 64 {
            return out;
        }
        let wants: [bool; 3] = [
            self.space_wants_to_send(SpaceId::Initial, now),
            self.space_wants_to_send(SpaceId::Handshake, now),
            self.space_wants_to_send(SpaceId::Data, now),
        ];
        // RFC 9000 §14.1: datagrams with a client Initial, or an ack-eliciting server Initial,
        // are padded to 1200 bytes. We pad whenever an Initial is in the datagram.
        if wants[0] && max_size < MIN_DATAGRAM {
            return out;
        }
        // RFC 9000 §8.2.1, §8.2.2: a datagram with PATH_CHALLENGE or PATH_RESPONSE is expanded
        // to 1200 bytes too (it checks the path carries them), as far as the amplification
        // budget allows.
        let path_probe = wants[2]
            && self.one_rtt.is_some()
            && (self.path_response.is_some()
                || self.path.challenge.as_ref().is_some_and(|c| !c.sent));
        let pad_len = if wants[0] || path_probe {
            MIN_DATAGRAM.min(max_size)
        } else {
            0
        };
        // A challenge in this datagram cannot check the path's 1200 bytes (§8.2.1).
        self.probe_datagram_short = path_probe && max_size < MIN_DATAGRAM;
        let last = wants.iter().rposition(|&w| w);
        let Some(last) = last else { return out };
        for space in SpaceId::ALL {
            if !wants[space.index()] {
                continue;
            }
            let max_end = start + max_size;
            if buf.len() + 40 > max_end {
                break;
            }
            let pad_to = (pad_len > 0 && space.index() == last).then_some(start + pad_len);
            if let Some(p) = self.write_packet(now, space, buf, max_end, pad_to, ecn_marked) {
                out.ack_eliciting |= p.ack_eliciting;
                if space != SpaceId::Data {
                    out.data_only = false;
                }
                let _ = p.padded;
            }
        }
        out.size = buf.len() - start;
        // A packet that had to be padded for the sample can exceed nothing: sizes are bounded.
        out
    }

    /// Writes one packet of `space`; `None` if there was nothing worth sending.
    fn write_packet(
        &mut self,
        now: Instant,
        space: SpaceId,
        buf: &mut Vec<u8>,
        max_end: usize,
        pad_to: Option<usize>,
        ecn_marked: bool,
    ) -> Option<PacketOut> {
        let si = space.index();
        let zero_rtt = space == SpaceId::Data && self.one_rtt.is_none();
        // Automatic key update before the key wears out (RFC 9001 §6.6): at the configured
        // interval, and at the latest an eighth before the AEAD's confidentiality limit, which
        // leaves an update that must wait for an acknowledgement room to happen.
        if space == SpaceId::Data
            && !zero_rtt
            && self.key_update.packets_in_phase >= self.key_update_due()
            && self.may_update_keys()
        {
            self.update_keys(false);
        }
        let packet_start = buf.len();
        if space == SpaceId::Data && !zero_rtt && self.spaces[si].next_pn >= self.next_skip_pn {
            self.skip_packet_number();
        }
        let pn = self.spaces[si].next_pn;
        let pn_len = packet::pn_len_for(pn, self.spaces[si].largest_acked);
        let dcid = self.remote_cids.active().cid;
        let pos: HeaderPos = match space {
            SpaceId::Initial => packet::write_long_header(
                buf,
                self.version,
                LongType::Initial,
                &dcid,
                &self.handshake_cid,
                if self.side.is_client() {
                    &self.token
                } else {
                    &[]
                },
                pn,
                pn_len,
            ),
            SpaceId::Handshake => packet::write_long_header(
                buf,
                self.version,
                LongType::Handshake,
                &dcid,
                &self.handshake_cid,
                &[],
                pn,
                pn_len,
            ),
            SpaceId::Data if zero_rtt => packet::write_long_header(
                buf,
                self.version,
                LongType::ZeroRtt,
                &dcid,
                &self.handshake_cid,
                &[],
                pn,
                pn_len,
            ),
            SpaceId::Data => {
                let phase = self.one_rtt.as_ref().is_some_and(|k| k.phase);
                packet::write_short_header(buf, &dcid, self.spin, phase, pn, pn_len)
            }
        };
        if buf.len() + TAG_LEN + 8 > max_end {
            buf.truncate(packet_start);
            return None;
        }
        let mut payload_max = max_end - TAG_LEN;
        let mut frames = self.spaces[si].sent.take_frame_vec();
        let mut names: [&'static str; 16] = [""; 16];
        let mut n_names = 0usize;
        let note = |names: &mut [&'static str; 16], n: &mut usize, s: &'static str| {
            if *n < names.len() && !names[..*n].contains(&s) {
                names[*n] = s;
                *n += 1;
            }
        };
        let mut ack_eliciting = false;
        let probing = self.spaces[si].probes > 0;
        let (cwnd_ok, pacing_ok) = if space == SpaceId::Data {
            let mtu = u64::from(self.path.mtu());
            let room = self.path.window_room();
            // The sent-packet records span MAX_SENT_SPAN packet numbers at most (past it the
            // oldest are given up as lost, `record_sent`): a window wider than that (some
            // 1 Gbit/s x 200 ms) waits at three quarters of it, where records of packets
            // still in flight would otherwise be declared lost, again and again.
            let mut cwnd_ok = probing
                || (room >= mtu.min(self.path.cc.window())
                    && self.spaces[si].sent.span() < SEND_SPAN_LIMIT);
            // RFC 9002 §7: bytes in flight must stay within the window, which a packet smaller
            // than a full datagram may do. When what is left to send (the end of a response,
            // a FIN) fits in the room the window has, send it now in a short packet rather
            // than a round trip later when an ACK frees a full datagram's worth.
            let header = (buf.len() - packet_start) as u64;
            if !cwnd_ok
                && room >= header + TAG_LEN as u64 + 32
                && !self.ping_pending
                && !self.streams.has_control()
                && self
                    .streams
                    .stream_data_within(room - header - TAG_LEN as u64 - 16)
            {
                cwnd_ok = true;
                payload_max = payload_max.min(packet_start + (room as usize) - TAG_LEN);
            }
            let mut pacing_ok = true;
            if cwnd_ok && !probing && self.handshake_complete {
                let rate = self.path.pacing_rate();
                if let Some(t) = self.path.pacer.delay(now, mtu, rate) {
                    self.timers.set(Timer::Pacing, Some(t));
                    pacing_ok = false;
                }
            }
            (cwnd_ok, pacing_ok)
        } else {
            (true, true)
        };
        if !cwnd_ok {
            self.path.cwnd_limited = true;
        }

        // ACK first: it is never blocked by congestion control. In the Data space an ACK that
        // is not yet due rides only in a packet that can carry more: when the pacer or the
        // window holds the data back, it would leave alone, a non-ack-eliciting packet sent
        // in answer to the peer's ACKs (RFC 9000 §13.2.1 forbids that), and a downloading
        // peer's ACKs drew one each (276 in a 10 MiB download). It rides on the next data
        // packet instead, or goes out when its delay expires.
        let ack = &self.spaces[si].ack;
        let ack_fits = space != SpaceId::Data || (cwnd_ok && pacing_ok) || ack.due(now);
        if !zero_rtt && ack.new_since_ack && !ack.ranges.is_empty() && ack_fits {
            let delay_us = ack.delay(now).as_micros() as u64;
            let delay = delay_us >> self.config.ack_delay_exponent;
            let ecn = ack.ecn_seen.then_some(&ack.ecn);
            let len = Ack::encoded_len(delay, &ack.ranges, ecn, super::MAX_ACK_RANGES);
            if buf.len() + len <= payload_max {
                let largest = ack.ranges.max().expect("non-empty");
                Ack::encode(delay, &ack.ranges, ecn, super::MAX_ACK_RANGES, buf);
                frames.push(SentFrame::Ack(largest));
                self.spaces[si].ack.on_ack_sent();
                note(&mut names, &mut n_names, "ack");
            }
        }

        let can_eliciting = cwnd_ok && pacing_ok;
        if space != SpaceId::Data {
            if can_eliciting {
                // Every probe of a handshake space carries the unacknowledged handshake
                // data, so the loss of one probe costs nothing (RFC 9002 §6.2.4).
                if probing && !self.spaces[si].crypto_send.has_sendable() {
                    self.queue_probe_data(space);
                }
                let before = frames.len();
                self.write_crypto(space, buf, payload_max, &mut frames);
                if frames.len() > before {
                    ack_eliciting = true;
                    note(&mut names, &mut n_names, "crypto");
                }
            }
        } else if can_eliciting {
            ack_eliciting |= self.write_data_frames(now, buf, payload_max, &mut frames, zero_rtt);
            if ack_eliciting {
                note(&mut names, &mut n_names, "stream/control");
            }
        }
        // RFC 9000 §13.2.4: an endpoint sending only ACKs gets no acknowledgements, and
        // the records of its ACK-only packets pile up; now and then one carries a PING.
        let ping_for_acks = space == SpaceId::Data
            && !zero_rtt
            && can_eliciting
            && self.spaces[si].ack_only_sent >= super::spaces::ACK_ONLY_BEFORE_PING;
        // A probe must be ack-eliciting.
        if (probing || ping_for_acks || (space == SpaceId::Data && self.ping_pending))
            && !ack_eliciting
            && buf.len() < payload_max
        {
            buf.put_u8(0x01);
            ack_eliciting = true;
            note(&mut names, &mut n_names, "ping");
        }
        if space == SpaceId::Data && ack_eliciting {
            self.ping_pending = false;
        }
        if ack_eliciting {
            self.spaces[si].ack_only_sent = 0;
        } else {
            self.spaces[si].ack_only_sent += 1;
        }
        if probing && ack_eliciting {
            self.spaces[si].probes -= 1;
        }
        let payload_len = buf.len() - pos.payload_offset();
        if payload_len == 0 {
            buf.truncate(packet_start);
            self.spaces[si].sent.recycle(frames);
            return None;
        }
        // Padding: to the datagram minimum, and enough for the header-protection sample.
        let mut padded = false;
        let mut min_end = pos.pn_offset + 4;
        if let Some(p) = pad_to {
            min_end = min_end.max(p.saturating_sub(TAG_LEN));
        }
        // An ack-eliciting short-header packet is long enough to draw a stateless reset from
        // a peer that lost the connection (kuai answers only longer ones, RFC 9000 §10.3.3):
        // a few bytes on the rare small one, so a lost connection shows at once, not after
        // the idle timeout.
        if space == SpaceId::Data && !zero_rtt && ack_eliciting {
            let reset_min = packet_start + crate::endpoint::RESET_ANSWERS_ABOVE + 1 - TAG_LEN;
            min_end = min_end.max(reset_min.min(max_end - TAG_LEN));
        }
        if buf.len() < min_end {
            let n = min_end - buf.len();
            buf.put_bytes(0, n);
            padded = true;
            note(&mut names, &mut n_names, "padding");
        }
        if self.grease_quic_bit && space == SpaceId::Data && !zero_rtt && pn % 4 == 3 {
            packet::grease_fixed_bit(buf, &pos);
        }
        // Seal.
        let sealed = match space {
            SpaceId::Data if zero_rtt => {
                let k = self.zero_rtt_keys.as_ref().expect("0-RTT keys checked");
                packet::seal_packet(buf, &pos, pn, k.header.as_ref(), k.packet.as_ref())
            }
            SpaceId::Data => {
                let k = self.one_rtt.as_ref().expect("1-RTT keys checked");
                packet::seal_packet(
                    buf,
                    &pos,
                    pn,
                    k.header.local.as_ref(),
                    k.current.local.as_ref(),
                )
            }
            _ => {
                let k = &self.spaces[si].keys.as_ref().expect("keys checked").local;
                packet::seal_packet(buf, &pos, pn, k.header.as_ref(), k.packet.as_ref())
            }
        };
        if let Err(e) = sealed {
            tracing::error!(error = %e, "failed to seal packet");
            buf.truncate(packet_start);
            self.spaces[si].sent.recycle(frames);
            return None;
        }
        let size = buf.len() - packet_start;
        self.spaces[si].next_pn += 1;
        if space == SpaceId::Data && !zero_rtt {
            self.key_update.packets_in_phase += 1;
        }
        self.stats.packets_sent += 1;
        let in_flight = ack_eliciting || padded;
        self.record_sent(
            now,
            space,
            pn,
            size,
            ack_eliciting,
            in_flight,
            false,
            ecn_marked,
            frames,
        );
        if self.trace_packets {
            let kind = match space {
                SpaceId::Initial => PacketKind::Initial,
                SpaceId::Handshake => PacketKind::Handshake,
                SpaceId::Data if zero_rtt => PacketKind::ZeroRtt,
                SpaceId::Data => PacketKind::OneRtt,
            };
            let path = self.path.id;
            self.trace(TraceEvent::PacketSent {
                kind,
                pn,
                size,
                path,
                frames: &names[..n_names],
            });
        }
        // RFC 9001 §4.9.1: a client discards Initial keys when it first sends a Handshake packet.
        if space == SpaceId::Handshake && self.side.is_client() {
            self.discard_space(SpaceId::Initial, now);
            if ack_eliciting && !self.handshake_copy_armed {
                self.handshake_copy_armed = true;
                self.arm_flight_copy(now);
            }
        }
        Some(PacketOut {
            ack_eliciting,
            padded,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn record_sent(
        &mut self,
        now: Instant,
        space: SpaceId,
        pn: u64,
        size: usize,
        ack_eliciting: bool,
        in_flight: bool,
        mtu_probe: bool,
        ecn_marked: bool,
        frames: Vec<crate::recovery::SentFrame>,
    ) {
        let (delivered, delivered_time, first_sent_time, is_app_limited) =
            self.path.delivery.on_sent(now, self.path.bytes_in_flight);
        if in_flight {
            self.path.bytes_in_flight += size as u64;
            self.path
                .cc
                .on_packet_sent(now, size as u64, self.path.bytes_in_flight);
            self.path.pacer.on_sent(size as u64);
            if self.path.bytes_in_flight >= self.path.cc.window() {
                self.path.cwnd_limited = true;
            }
        }
        let si = space.index();
        if ack_eliciting {
            self.spaces[si].time_of_last_ack_eliciting = Some(now);
            if !self.sent_eliciting_since_rx {
                self.sent_eliciting_since_rx = true;
                self.reset_idle_timer(now);
            }
        }
        if ecn_marked {
            self.spaces[si].ecn_marked_sent += 1;
        }
        if space == SpaceId::Data && ack_eliciting && in_flight && !mtu_probe {
            self.path.count_sent_for_loss_rate();
        }
        let packet = SentPacket {
            time_sent: now,
            size: size.min(usize::from(u16::MAX)) as u16,
            ack_eliciting,
            in_flight,
            path: self.path.id,
            mtu_probe,
            ecn_marked,
            frames,
            delivered,
            delivered_time,
            first_sent_time,
            is_app_limited,
            copied: self.sending_copies,
        };
        self.spaces[si].sent.insert(pn, packet);
        if ack_eliciting || in_flight {
            // Set once by `update_timers` when the batch of datagrams is written.
            self.loss_timer_stale = true;
        }
        // A peer that acknowledges nothing (while it keeps us acknowledging its packets):
        // past four congestion windows' worth of packets (1,024 at least) the records older
        // than three probe timeouts are given up (as lost, if in flight), and past 32 K any.
        // A span of 32 K whatever the window let such a peer make each connection hold some
        // 7 MB of records, mostly of our ACK-only packets; the age spares a receiver that
        // sends tens of thousands of ACKs a round trip to a peer that does acknowledge.
        let cwnd_packets = 4 * self.path.cc.window() / u64::from(self.path.mtu()).max(1);
        let limit = usize::try_from(cwnd_packets)
            .unwrap_or(usize::MAX)
            .clamp(1024, super::spaces::MAX_SENT_SPAN);
        let span = self.spaces[si].sent.span();
        if span > limit {
            let hard = span > super::spaces::MAX_SENT_SPAN;
            let aged = now.checked_sub(self.pto_duration(space) * 3);
            let sent = &self.spaces[si].sent;
            let end = sent.first_pn().unwrap_or(pn) + (limit / 4) as u64;
            let old: Vec<u64> = sent
                .iter()
                .take_while(|(p, r)| *p < end && (hard || aged.is_some_and(|t| r.time_sent <= t)))
                .map(|(p, _)| p)
                .collect();
            if !old.is_empty() {
                self.on_packets_lost(now, space, &old, "unacknowledged_too_long");
                self.loss_timer_stale = true;
            }
        }
    }

    /// CRYPTO frames of a handshake space (or the Data space, for post-handshake messages).
    fn write_crypto(
        &mut self,
        space: SpaceId,
        buf: &mut Vec<u8>,
        payload_max: usize,
        frames: &mut Vec<SentFrame>,
    ) {
        let cs = &mut self.spaces[space.index()].crypto_send;
        while buf.len() + 16 < payload_max {
            let off = cs.next_offset();
            // Type + offset + a 2-byte length.
            let overhead = 1 + crate::VarInt::size_of(off) + 2;
            let room = payload_max - buf.len() - overhead;
            let Some((range, _)) = cs.next_range(room, u64::MAX) else {
                break;
            };
            let len = (range.end - range.start) as usize;
            buf.put_u8(0x06);
            buf.put_var(range.start);
            buf.put_u16(0x4000 | len as u16);
            cs.copy_range(range.clone(), buf);
            frames.push(SentFrame::Crypto {
                offset: range.start,
                len: len as u32,
            });
        }
    }

    /// Everything ack-eliciting the Data space sends. Returns whether anything was written.
    fn write_data_frames(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        payload_max: usize,
        frames: &mut Vec<SentFrame>,
        zero_rtt: bool,
    ) -> bool {
        let before = frames.len();
        let before_len = buf.len();
        if !zero_rtt {
            // PATH_RESPONSE to the active path's peer, with a PING: a challenge on the path
            // in use may come from a peer that took a copy of our packet, relayed from
            // elsewhere, for a migration; a non-probing packet takes it back here (RFC 9000
            // §9.3.3).
            if buf.len() + 10 <= payload_max
                && let Some(data) = self.path_response.take()
            {
                Frame::PathResponse(data).encode(buf);
                frames.push(SentFrame::PathResponse);
                buf.put_u8(0x01);
            }
            if let Some(ch) = self.path.challenge.as_mut()
                && !ch.sent
                && buf.len() + 9 <= payload_max
            {
                Frame::PathChallenge(ch.data).encode(buf);
                ch.sent = true;
                ch.small |= self.probe_datagram_short;
                ch.resend_at = now + self.path.rtt.pto_base();
                frames.push(SentFrame::PathChallenge);
            }
            if self.handshake_done_pending && buf.len() < payload_max {
                buf.put_u8(0x1e);
                frames.push(SentFrame::HandshakeDone);
                self.handshake_done_pending = false;
            }
            // Post-handshake TLS messages (session tickets).
            self.write_crypto(SpaceId::Data, buf, payload_max, frames);
            // Connection IDs.
            for (&seq, c) in self.local_cids.issued.iter_mut() {
                if !c.announce {
                    continue;
                }
                let f = Frame::NewConnectionId(crate::frame::NewConnectionId {
                    seq,
                    retire_prior_to: self.local_cids.retire_prior_to,
                    cid: c.cid,
                    reset_token: c.reset_token,
                });
                if buf.len() + f.encoded_len() > payload_max {
                    break;
                }
                f.encode(buf);
                c.announce = false;
                frames.push(SentFrame::NewConnectionId(seq));
            }
            while let Some(&seq) = self.remote_cids.to_retire.last() {
                if buf.len() + 9 > payload_max {
                    break;
                }
                buf.put_u8(0x19);
                buf.put_var(seq);
                frames.push(SentFrame::RetireConnectionId(seq));
                self.remote_cids.to_retire.pop();
            }
            if self.new_token_pending && self.side.is_server() {
                self.write_new_token(now, buf, payload_max, frames);
            }
            if let Some(af) = self.ack_frequency_pending {
                let f = Frame::AckFrequency(af);
                if buf.len() + f.encoded_len() <= payload_max {
                    f.encode(buf);
                    frames.push(SentFrame::AckFrequency(af.seq));
                    self.ack_frequency_pending = None;
                }
            }
        }
        let rtt = self.path.rtt.smoothed();
        self.streams
            .write_control(buf, payload_max, frames, now, rtt);
        // Datagrams go before stream data: they are latency-sensitive by nature.
        let fits_a_packet = if self.datagrams_out.is_empty() {
            0
        } else {
            self.max_datagram_size().unwrap_or(0)
        };
        while let Some(d) = self.datagrams_out.front() {
            // Queued when the path took it, too large since (a new path starts at the
            // minimum MTU, a black hole lowers it): dropped, as the network would, rather
            // than holding up every datagram behind it.
            if d.len() > fits_a_packet {
                self.datagrams_out.pop_front();
                self.stats.datagrams_unsendable += 1;
                continue;
            }
            let need = 1 + crate::VarInt::size_of(d.len() as u64) + d.len();
            if buf.len() + need > payload_max {
                break;
            }
            let d = self.datagrams_out.pop_front().expect("front exists");
            Frame::Datagram(d).encode(buf);
            frames.push(SentFrame::Datagram);
        }
        let stream_start = frames.len();
        let sent_before = self.streams.flow_state().0;
        self.streams.write_stream_frames(buf, payload_max, frames);
        for f in &frames[stream_start..] {
            if let SentFrame::Stream { len, .. } = f {
                self.stats.stream_bytes_sent += u64::from(*len);
            }
        }
        let new_bytes = self.streams.flow_state().0 - sent_before;
        let stream_bytes: u64 = frames[stream_start..]
            .iter()
            .map(|f| {
                if let SentFrame::Stream { len, .. } = f {
                    u64::from(*len)
                } else {
                    0
                }
            })
            .sum();
        self.stats.stream_bytes_retransmitted += stream_bytes.saturating_sub(new_bytes);
        // Application-limited: nothing more to send and the window is not full.
        if !self.streams.has_stream_data() && self.path.bytes_in_flight < self.path.cc.window() {
            self.path.cwnd_limited = false;
            self.path.delivery.on_app_limited(self.path.bytes_in_flight);
        }
        frames.len() > before || buf.len() > before_len
    }

    fn write_new_token(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        payload_max: usize,
        frames: &mut Vec<SentFrame>,
    ) {
        let Some(cfg) = self.server_config.as_ref() else {
            self.new_token_pending = false;
            return;
        };
        let token =
            crate::token::new_token(&cfg.token_key, self.path.remote.ip(), self.unix_ms(now));
        let need = 1 + crate::VarInt::size_of(token.len() as u64) + token.len();
        if buf.len() + need > payload_max {
            return;
        }
        buf.put_u8(0x07);
        buf.put_var(token.len() as u64);
        buf.put_slice(&token);
        frames.push(SentFrame::NewToken);
        self.new_token_pending = false;
    }

    /// A DPLPMTUD probe: PING padded to the probe size, in its own datagram.
    /// End of the wait for the first DPLPMTUD probe after the handshake, while it lasts.
    pub(super) fn mtu_probe_wait_until(&self, now: Instant) -> Option<Instant> {
        let end = self.confirmed_at? + self.path.rtt.smoothed();
        (now < end).then_some(end)
    }

    fn send_mtu_probe(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        if !self.handshake_confirmed || self.one_rtt.is_none() || !self.path.validated {
            return None;
        }
        let mut size = self.path.mtud.probe_size(now)?;
        let max_udp = self
            .peer_params
            .as_ref()
            .map_or(1200, |p| p.max_udp_payload_size);
        if u64::from(size) > max_udp {
            // A peer taking less than our maximum (1350, 1452): search up to its limit
            // (nothing was ever probed before, the first probe being the maximum).
            self.path
                .mtud
                .cap(u16::try_from(max_udp).unwrap_or(u16::MAX));
            size = self.path.mtud.probe_size(now)?;
            if u64::from(size) > max_udp {
                return None;
            }
        }
        // No probe in the first round trip after the handshake: a probe taking 1.4 KB of a
        // 12 KB initial window pushes the tail of a small response a round trip later. The
        // request may not even have arrived when the handshake completes (it follows the
        // client's Finished), so the wait does not depend on data being queued; the MTU
        // timer brings the probe back when it ends.
        if !self.path.mtud.confirm && self.mtu_probe_wait_until(now).is_some() {
            return None;
        }
        // A confirmation probe (suspected black hole) goes out whatever the window says: the
        // window may be full of packets the path silently drops.
        if !self.path.mtud.confirm && self.path.window_room() < u64::from(size) {
            return None;
        }
        let pn = self.spaces[SpaceId::Data.index()].next_pn;
        let pn_len = packet::pn_len_for(pn, self.spaces[SpaceId::Data.index()].largest_acked);
        let dcid = self.remote_cids.active().cid;
        let phase = self.one_rtt.as_ref().is_some_and(|k| k.phase);
        let pos = packet::write_short_header(buf, &dcid, self.spin, phase, pn, pn_len);
        buf.put_u8(0x01);
        let end = usize::from(size) - TAG_LEN;
        if buf.len() < end {
            buf.put_bytes(0, end - buf.len());
        }
        let k = self.one_rtt.as_ref().expect("checked");
        if packet::seal_packet(
            buf,
            &pos,
            pn,
            k.header.local.as_ref(),
            k.current.local.as_ref(),
        )
        .is_err()
        {
            buf.clear();
            return None;
        }
        self.spaces[SpaceId::Data.index()].next_pn += 1;
        self.key_update.packets_in_phase += 1;
        self.stats.packets_sent += 1;
        let frames = self.spaces[SpaceId::Data.index()].sent.take_frame_vec();
        self.record_sent(
            now,
            SpaceId::Data,
            pn,
            buf.len(),
            true,
            true,
            true,
            false,
            frames,
        );
        self.path.mtud.on_probe_sent(size, pn);
        self.on_datagram_sent(buf.len(), false);
        self.update_timers(now);
        Some(Transmit {
            destination: self.path.remote,
            ecn: None,
            size: buf.len(),
            segment_size: None,
            src_ip: self.path.local_ip,
        })
    }

    /// PATH_RESPONSE on a path other than the active one (a peer probing a new path), sent
    /// back the way the challenge came (RFC 9000 §8.2.2).
    fn send_off_path_response(&mut self, buf: &mut Vec<u8>) -> Option<Transmit> {
        self.one_rtt.as_ref()?;
        let i = self.off_paths.iter().position(|o| o.challenge.is_some())?;
        let o = &mut self.off_paths[i];
        let data = o.challenge.take().expect("found above");
        let (addr, local_ip) = (o.remote, o.local_ip);
        // RFC 9000 §8.2.2: expanded to 1200 bytes unless that exceeds the address's 3x
        // budget; then as large as the budget allows, or not at all.
        let size = o.amplification_budget().min(MIN_DATAGRAM as u64) as usize;
        // Client: the server's preferred address gets the connection ID meant for it. Other
        // probing addresses get an unused one of the peer's, the one we move to if it
        // migrates there (RFC 9000 §9.5: one ID to two addresses links them), or the
        // active one when the peer gave none to spare.
        let dcid = self
            .preferred
            .as_ref()
            .filter(|p| p.remote == addr)
            .and_then(|p| self.remote_cids.cids.get(&p.cid_seq))
            .map(|c| c.cid)
            .or_else(|| self.remote_cids.spare())
            .unwrap_or_else(|| self.remote_cids.active().cid);
        let t = self.send_probing_packet(
            buf,
            dcid,
            Frame::PathResponse(data),
            addr,
            local_ip.or(self.path.local_ip),
            size,
        )?;
        self.off_paths[i].amp_sent += t.size as u64;
        Some(t)
    }

    /// Server: the PATH_CHALLENGE owed to the path the peer apparently left (RFC 9000
    /// §9.3.3), once; with an unused connection ID of the peer's when it gave one to spare
    /// (the active one is the new path's).
    fn send_prev_path_challenge(&mut self, buf: &mut Vec<u8>) -> Option<Transmit> {
        let p = self.prev_path.as_ref()?;
        let ch = p.challenge.as_ref().filter(|c| !c.sent)?;
        let (remote, local_ip, data) = (p.remote, p.local_ip, ch.data);
        let dcid = self
            .remote_cids
            .spare()
            .unwrap_or_else(|| self.remote_cids.active().cid);
        if let Some(ch) = self.prev_path.as_mut().and_then(|p| p.challenge.as_mut()) {
            ch.sent = true;
        }
        self.send_probing_packet(
            buf,
            dcid,
            Frame::PathChallenge(data),
            remote,
            local_ip,
            MIN_DATAGRAM,
        )
    }

    /// Client: PATH_CHALLENGE to the server's preferred address (RFC 9000 §9.6.1), with the
    /// connection ID the server gave for it.
    fn send_preferred_probe(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        self.one_rtt.as_ref()?;
        let p = self.preferred.as_ref()?;
        let ch = p.challenge.as_ref().filter(|c| !c.sent)?;
        let (remote, data) = (p.remote, ch.data);
        let Some(dcid) = self.remote_cids.cids.get(&p.cid_seq).map(|c| c.cid) else {
            // The server retired that ID before we could use it: stay where we are.
            self.preferred = None;
            return None;
        };
        let t = self.send_probing_packet(
            buf,
            dcid,
            Frame::PathChallenge(data),
            remote,
            self.path.local_ip,
            MIN_DATAGRAM,
        )?;
        let resend = self.path.rtt.pto_base();
        if let Some(ch) = self.preferred.as_mut().and_then(|p| p.challenge.as_mut()) {
            ch.sent = true;
            ch.resend_at = now + resend;
        }
        self.update_timers(now);
        Some(t)
    }

    /// One 1-RTT packet of `size` bytes holding a single probing frame (RFC 9000 §8.2.1:
    /// 1200 bytes unless the anti-amplification limit forbids), off the active path: not in
    /// flight there and not retransmitted (a challenge is resent on its own timer, a response
    /// never). `None` if the frame does not fit in `size`.
    fn send_probing_packet(
        &mut self,
        buf: &mut Vec<u8>,
        dcid: crate::ConnectionId,
        frame: Frame,
        destination: std::net::SocketAddr,
        src_ip: Option<std::net::IpAddr>,
        size: usize,
    ) -> Option<Transmit> {
        let one_rtt = self.one_rtt.as_ref()?;
        let pn = self.spaces[SpaceId::Data.index()].next_pn;
        let pn_len = packet::pn_len_for(pn, self.spaces[SpaceId::Data.index()].largest_acked);
        let pos = packet::write_short_header(buf, &dcid, self.spin, one_rtt.phase, pn, pn_len);
        frame.encode(buf);
        // The frame leaves room for the header-protection sample (RFC 9001 §5.4.2).
        if buf.len() + TAG_LEN > size {
            buf.clear();
            return None;
        }
        buf.put_bytes(0, size - TAG_LEN - buf.len());
        if packet::seal_packet(
            buf,
            &pos,
            pn,
            one_rtt.header.local.as_ref(),
            one_rtt.current.local.as_ref(),
        )
        .is_err()
        {
            buf.clear();
            return None;
        }
        self.spaces[SpaceId::Data.index()].next_pn += 1;
        self.stats.packets_sent += 1;
        self.stats.udp_tx_datagrams += 1;
        self.stats.udp_tx_bytes += buf.len() as u64;
        Some(Transmit {
            destination,
            ecn: None,
            size: buf.len(),
            segment_size: None,
            src_ip,
        })
    }

    /// Leaves a 1-RTT packet number unused (RFC 9000 §21.4), and picks the next to skip: a
    /// few dozen packets after the handshake, then every 1,024 to 32,768 packets.
    fn skip_packet_number(&mut self) {
        use rand::Rng;
        let sp = &mut self.spaces[SpaceId::Data.index()];
        let first = self.skipped_pn.is_none() && self.next_skip_pn == 0;
        if !first {
            self.skipped_pn = Some(sp.next_pn);
            sp.next_pn += 1;
        }
        let gap = if first { 16..256 } else { 1024..32_768 };
        self.next_skip_pn = sp.next_pn + self.rng.draw().random_range(gap);
    }

    /// CONNECTION_CLOSE in every space the peer may be able to read.
    fn send_close(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        if !self.close_pending {
            return None;
        }
        self.close_pending = false;
        let frame = Close::clone(self.close_frame.as_deref()?);
        let max_end =
            (usize::from(self.path.mtu()) as u64).min(self.path.amplification_budget()) as usize;
        for space in SpaceId::ALL {
            let sp = &self.spaces[space.index()];
            let has_keys = match space {
                SpaceId::Data => self.one_rtt.is_some(),
                _ => sp.keys.is_some() && !sp.discarded,
            };
            if !has_keys {
                continue;
            }
            // RFC 9000 §10.2.3: before 1-RTT, an application close is sent as a transport
            // close with APPLICATION_ERROR and no details.
            let f = if space != SpaceId::Data && frame.is_application() {
                Close {
                    error_code: crate::error::TransportErrorCode::APPLICATION_ERROR.0,
                    frame_type: Some(0),
                    reason: bytes::Bytes::new(),
                }
            } else {
                frame.clone()
            };
            let pn = self.spaces[space.index()].next_pn;
            let pn_len = packet::pn_len_for(pn, self.spaces[space.index()].largest_acked);
            let dcid = self.remote_cids.active().cid;
            let start = buf.len();
            let pos = match space {
                SpaceId::Data => {
                    let phase = self.one_rtt.as_ref().is_some_and(|k| k.phase);
                    packet::write_short_header(buf, &dcid, self.spin, phase, pn, pn_len)
                }
                _ => packet::write_long_header(
                    buf,
                    self.version,
                    if space == SpaceId::Initial {
                        LongType::Initial
                    } else {
                        LongType::Handshake
                    },
                    &dcid,
                    &self.handshake_cid,
                    if self.side.is_client() && space == SpaceId::Initial {
                        &self.token
                    } else {
                        &[]
                    },
                    pn,
                    pn_len,
                ),
            };
            Frame::Close(f).encode(buf);
            let mut min_end = pos.pn_offset + 4;
            if space == SpaceId::Initial && self.side.is_client() {
                min_end = min_end.max(start + MIN_DATAGRAM - TAG_LEN);
            }
            if buf.len() < min_end {
                buf.put_bytes(0, min_end - buf.len());
            }
            if buf.len() + TAG_LEN > max_end {
                buf.truncate(start);
                break;
            }
            let sealed = match space {
                SpaceId::Data => {
                    let k = self.one_rtt.as_ref().expect("checked");
                    packet::seal_packet(
                        buf,
                        &pos,
                        pn,
                        k.header.local.as_ref(),
                        k.current.local.as_ref(),
                    )
                }
                _ => {
                    let k = &self.spaces[space.index()]
                        .keys
                        .as_ref()
                        .expect("checked")
                        .local;
                    packet::seal_packet(buf, &pos, pn, k.header.as_ref(), k.packet.as_ref())
                }
            };
            if sealed.is_err() {
                buf.truncate(start);
                continue;
            }
            self.spaces[space.index()].next_pn += 1;
            let _ = FrameType::CONNECTION_CLOSE;
        }
        if buf.is_empty() {
            return None;
        }
        self.on_datagram_sent(buf.len(), false);
        let _ = now;
        Some(Transmit {
            destination: self.path.remote,
            ecn: None,
            size: buf.len(),
            segment_size: None,
            src_ip: self.path.local_ip,
        })
    }
}
