//! Receiving: datagrams into packets (RFC 9000 §12.2), packet protection (RFC 9001 §5),
//! key phases (§6), duplicates, address changes (RFC 9000 §9), and frame processing.

use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::paths::EcnCodepoint;
use super::{Connection, ConnectionError, Event, State, Timer, ZeroRtt};
use crate::cid::ConnectionId;
use crate::error::TransportError;
use crate::frame::{Frame, FrameIter, FrameType};
use crate::packet::{
    self, DecryptedPacket, LongType, PacketDecodeError, PacketType, PartialDecode,
};
use crate::trace::{DropReason, PacketKind, TraceEvent};
use crate::types::{Side, SpaceId, Version};

/// Most undecryptable packets buffered while waiting for keys (RFC 9001 §5.7).
const MAX_UNDECRYPTABLE: usize = 16;
/// ... and most bytes of them: 16 full packets of a 1500-byte path and then some. Datagrams
/// of up to 64 KiB would have let a peer (or anyone with a spoofed Initial) park 1 MiB per
/// connection.
const MAX_UNDECRYPTABLE_BYTES: usize = 32 * 1024;

/// Outcome of processing one packet, for the datagram-level logic.
#[derive(Default)]
struct PacketResult {
    /// The packet was authenticated and processed.
    processed: bool,
    /// It carried a frame other than PATH_CHALLENGE, PATH_RESPONSE, NEW_CONNECTION_ID and
    /// PADDING (RFC 9000 §9.1).
    non_probing: bool,
    /// Its packet number was the largest seen in its space.
    largest: bool,
    space: Option<SpaceId>,
    /// Its destination connection ID (one of ours).
    dcid: Option<ConnectionId>,
}

impl Connection {
    /// Processes a UDP datagram from `remote`.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
    ) {
        self.process_datagram(now, remote, local_ip, ecn, data, true);
    }

    /// A datagram, `fresh` from the network or a packet of one buffered until its keys came
    /// (already counted, toward statistics and the anti-amplification budget alike).
    fn process_datagram(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
        fresh: bool,
    ) {
        self.now = now;
        if matches!(self.state, State::Draining | State::Drained) {
            return;
        }
        // RFC 9000 §9: a client discards packets from a server address it does not know:
        // the one it talks to, or the preferred address it may be probing. Off-path
        // senders cannot make it answer PATH_CHALLENGEs then, however little that costs.
        if self.side.is_client()
            && remote != self.path.remote
            && self.preferred.as_ref().is_none_or(|p| p.remote != remote)
        {
            self.drop_packet(None, data.len(), DropReason::UnknownServerAddress);
            return;
        }
        let len = data.len() as u64;
        self.rx_datagram_len = data.len();
        if fresh {
            self.stats.udp_rx_datagrams += 1;
            self.stats.udp_rx_bytes += len;
            if self.on_active_path(remote, local_ip) && !self.path.validated {
                self.path.amp_received += len;
            }
        }
        let reset_token = packet::reset_token_of(&data).copied();
        if self.state == State::Closing {
            // RFC 9000 §10.3.1: a stateless reset ends the closing period at once.
            if let Some(token) = reset_token
                && self.remote_cids.is_reset_token(&token)
            {
                self.set_drained();
                return;
            }
            // RFC 9000 §10.2.1: answer with CONNECTION_CLOSE at a reduced rate — after the
            // 1st, 2nd, 4th, 8th, ... datagram — so two endpoints cannot ping-pong.
            self.closing_rx += 1;
            if self.closing_rx.is_power_of_two() {
                self.close_pending = true;
            }
            return;
        }
        let mut rest = Some(data);
        let mut any_processed = false;
        let mut migrate_hint = false;
        let mut hint_dcid = None;
        let cid_len = self
            .local_cids
            .issued
            .values()
            .next()
            .map_or(0, |c| c.cid.len());
        while let Some(d) = rest.take() {
            let (pd, r) = match PartialDecode::new(d, cid_len) {
                Ok(x) => x,
                Err(_) => {
                    self.stats.packets_dropped += 1;
                    break;
                }
            };
            rest = r;
            let res = self.handle_packet(now, remote, local_ip, ecn, pd);
            if res.processed {
                any_processed = true;
                if res.non_probing && res.largest && res.space == Some(SpaceId::Data) {
                    migrate_hint = true;
                    hint_dcid = res.dcid;
                }
            }
            if self.is_closed() {
                break;
            }
        }
        if !any_processed {
            // RFC 9000 §10.3.1: a datagram we could not process may be a stateless reset.
            if let Some(token) = reset_token
                && self.remote_cids.is_reset_token(&token)
            {
                self.trace(TraceEvent::PacketDropped {
                    kind: Some(PacketKind::StatelessReset),
                    size: len as usize,
                    reason: DropReason::DecryptionFailure,
                });
                self.enter_draining(now, ConnectionError::Reset);
                self.set_drained();
            }
            return;
        }
        self.sent_eliciting_since_rx = false;
        self.last_rx = now;
        self.memory_released = false;
        if self.on_active_path(remote, local_ip) {
            if migrate_hint && hint_dcid.is_some() {
                self.peer_dcid = hint_dcid;
            }
        } else {
            // RFC 9000 §8.1, §9.3: what came from an address that sent a challenge is what
            // may be sent back there before it is validated.
            if let Some(o) = self
                .off_paths
                .iter_mut()
                .find(|o| o.matches(remote, local_ip))
                .filter(|_| fresh)
            {
                o.amp_received += len;
            }
            if migrate_hint {
                self.on_peer_address_change(now, remote, local_ip, len, hint_dcid);
            }
        }
        // The idle and other timers are brought up to date once for a run of datagrams, by
        // the next call that reads or acts on them.
        self.timers_stale = true;
    }

    fn handle_packet(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        pd: PartialDecode,
    ) -> PacketResult {
        let size = pd.len();
        let pkt_dcid = pd.dst_cid();
        match pd.ty() {
            PacketType::VersionNegotiation => {
                self.on_version_negotiation(now, &pd);
                return PacketResult::default();
            }
            PacketType::Long(LongType::Retry) => {
                self.on_retry(now, &pd);
                return PacketResult::default();
            }
            PacketType::UnsupportedVersion => {
                self.drop_packet(None, size, DropReason::UnexpectedVersion);
                return PacketResult::default();
            }
            _ => {}
        }
        // RFC 9000 §17.2.2: a server's Initial carries no token; a client discards one that
        // does (before it could switch the version below or be decrypted).
        if self.side.is_client()
            && pd.ty() == PacketType::Long(LongType::Initial)
            && !pd.token().is_empty()
        {
            self.drop_packet(Some(PacketKind::Initial), size, DropReason::HeaderParseError);
            return PacketResult::default();
        }
        // Version checks for long headers.
        let mut original_version_initial = false;
        if let Some(v) = pd.version()
            && v != self.version.wire()
        {
            let Some(pv) = Version::from_wire(v) else {
                self.drop_packet(None, size, DropReason::UnexpectedVersion);
                return PacketResult::default();
            };
            match self.side {
                // Compatible version negotiation (RFC 9368 §2.3): the server's first
                // Initial may use another version from our list.
                Side::Client
                    if pd.ty() == PacketType::Long(LongType::Initial)
                        && self.spaces[SpaceId::Initial.index()].ack.largest.is_none()
                        && self.versions().contains(&pv)
                        && self.secret_capture.is_some() =>
                {
                    self.switch_version(pv);
                }
                // The client keeps using its original version until it sees ours.
                Side::Server if pv == self.original_version => {
                    original_version_initial = true;
                }
                _ => {
                    self.drop_packet(None, size, DropReason::UnexpectedVersion);
                    return PacketResult::default();
                }
            }
        }
        let Some(space) = pd.space() else {
            return PacketResult::default();
        };
        let kind = packet_kind(pd.ty());
        // RFC 9000 §14.1: a server discards an Initial in a datagram under 1200 bytes, the
        // first (checked by the endpoint) and every later one.
        if self.side.is_server() && space == SpaceId::Initial && self.rx_datagram_len < 1200 {
            self.drop_packet(Some(kind), size, DropReason::DatagramTooSmall);
            return PacketResult::default();
        }
        let is_0rtt = pd.ty() == PacketType::Long(LongType::ZeroRtt);
        if is_0rtt && self.side.is_client() {
            self.drop_packet(Some(kind), size, DropReason::UnexpectedVersion);
            return PacketResult::default();
        }
        if is_0rtt {
            // The client tried 0-RTT, whether or not its keys are here (rejected early data
            // still counts as an attempt in the statistics).
            self.stats.zero_rtt_attempted = true;
        }
        // Header protection key.
        let si = space.index();
        let hp = match (space, is_0rtt) {
            (SpaceId::Data, true) => self.zero_rtt_keys.as_ref().map(|k| k.header.as_ref()),
            (SpaceId::Data, false) => self.one_rtt.as_ref().map(|k| k.header.remote.as_ref()),
            (SpaceId::Initial, _) if original_version_initial => self
                .original_initial_keys
                .as_ref()
                .map(|k| k.remote.header.as_ref()),
            _ => self.spaces[si]
                .keys
                .as_ref()
                .map(|k| k.remote.header.as_ref()),
        };
        // RFC 9001 §5.7: a server must not process 1-RTT packets before the handshake is
        // complete (the client's Finished verified); hold them until it is.
        let early_1rtt =
            space == SpaceId::Data && !is_0rtt && self.side.is_server() && !self.handshake_complete;
        // A server whose TLS has read the ClientHello installed 0-RTT keys then or never (no
        // early data, or it was refused): a 0-RTT packet without them is not waiting for
        // anything.
        let no_0rtt_coming =
            is_0rtt && self.side.is_server() && (self.tls.is_some() || self.handshake_complete);
        let Some(hp) = hp.filter(|_| !early_1rtt) else {
            if self.spaces[si].discarded || no_0rtt_coming {
                self.drop_packet(Some(kind), size, DropReason::KeyUnavailable);
            } else {
                self.buffer_undecryptable(now, remote, ecn, pd);
            }
            return PacketResult::default();
        };
        let largest = self.spaces[si].ack.largest.map(|(pn, _)| pn);
        let up = match pd.unprotect(hp, largest) {
            Ok(up) => up,
            Err(_) => {
                self.drop_packet(Some(kind), size, DropReason::HeaderParseError);
                return PacketResult::default();
            }
        };
        let pn = up.pn();
        // RFC 9000 §12.3: packet numbers stop at 2^62 - 1. One past it (a peer that counted
        // that far) could not be acknowledged: the ACK's varint would not hold it.
        if pn >= 1 << 62 {
            self.drop_packet(Some(kind), size, DropReason::HeaderParseError);
            return PacketResult::default();
        }
        // Payload key (key phase for 1-RTT, RFC 9001 §6.3).
        let mut key_update = false;
        // Opened with the previous phase's key (sent before the peer saw our update).
        let mut previous_phase = false;
        let decrypted = match (space, is_0rtt) {
            (SpaceId::Data, true) => {
                let k = self
                    .zero_rtt_keys
                    .as_ref()
                    .expect("hp key implies packet key");
                up.decrypt(k.packet.as_ref())
            }
            (SpaceId::Data, false) => {
                let keys = self.one_rtt.as_mut().expect("hp key implies packet keys");
                keys.prepare_next();
                let keys = &*keys;
                if up.key_phase() == keys.phase {
                    up.decrypt(keys.current.remote.as_ref())
                } else if keys.prev_remote.is_some()
                    // Before the peer's first packet in the new phase (an update we began)
                    // the other phase is the old one: what it sent before it saw ours
                    // (RFC 9001 §6.1, §6.5). Such packets were opened with the key after
                    // next, failed and were dropped, about a round trip of them.
                    && self.key_update.remote_phase_start.is_none_or(|s| pn < s)
                {
                    previous_phase = true;
                    up.decrypt(keys.prev_remote.as_ref().expect("checked").as_ref())
                } else {
                    key_update = true;
                    up.decrypt(keys.next_remote().expect("prepared"))
                }
            }
            (SpaceId::Initial, _) if original_version_initial => {
                let k = self.original_initial_keys.as_ref().expect("checked");
                up.decrypt(k.remote.packet.as_ref())
            }
            _ => {
                let k = self.spaces[si].keys.as_ref().expect("checked");
                up.decrypt(k.remote.packet.as_ref())
            }
        };
        let pkt = match decrypted {
            Ok(p) => p,
            Err(_) => {
                self.key_update.auth_failures += 1;
                self.drop_packet(Some(kind), size, DropReason::DecryptionFailure);
                // RFC 9001 §6.6: past the AEAD's integrity limit (2^52 forgeries for
                // AES-GCM, 2^36 for ChaCha20-Poly1305), across all keys, the connection ends.
                let limit = self
                    .one_rtt
                    .as_ref()
                    .map_or(u64::MAX, |k| k.current.remote.integrity_limit());
                if self.key_update.auth_failures > limit {
                    self.close_with_error(
                        now,
                        TransportError::AEAD_LIMIT_REACHED(
                            "more packets failed authentication than the AEAD's integrity limit",
                        ),
                    );
                }
                return PacketResult::default();
            }
        };
        if pkt.reserved_bits_nonzero() {
            self.close_with_error(
                now,
                TransportError::PROTOCOL_VIOLATION("reserved header bits set"),
            );
            return PacketResult::default();
        }
        let prev_largest = self.spaces[si].ack.largest.map(|(l, _)| l);
        if !self.spaces[si].ack.on_packet(pn, now) {
            self.drop_packet(Some(kind), size, DropReason::Duplicate);
            return PacketResult::default();
        }
        let is_largest = self.spaces[si].ack.largest.is_some_and(|(l, _)| l == pn);
        self.path.count_received_for_loss_rate(pn, prev_largest);
        if key_update {
            // A server's handshake is confirmed when it completes (RFC 9001 §4.1.2), so it
            // may update keys before the client, waiting for HANDSHAKE_DONE, has confirmed
            // its own: nothing to refuse here (it closed with KEY_UPDATE_ERROR).
            self.update_keys(true);
            self.key_update.remote_phase_start = Some(pn);
        } else if space == SpaceId::Data
            && !is_0rtt
            && !previous_phase
            && self.key_update.remote_phase_start.is_none()
        {
            // The peer's first packet in the current phase.
            self.key_update.remote_phase_start = Some(pn);
        }
        self.stats.packets_received += 1;
        if let Some(e) = ecn {
            let c = &mut self.spaces[si].ack;
            c.ecn_seen = true;
            match e {
                EcnCodepoint::Ect0 => c.ecn.ect0 += 1,
                EcnCodepoint::Ect1 => c.ecn.ect1 += 1,
                EcnCodepoint::Ce => {
                    c.ecn.ce += 1;
                    // RFC 9000 §13.2.1: report CE promptly.
                    c.immediate = true;
                }
            }
        }
        // Handshake-level bookkeeping.
        match space {
            SpaceId::Initial if self.side.is_client() => {
                // The server's chosen CID replaces our random initial DCID (RFC 9000 §7.2).
                if let Some(scid) = pkt.src_cid()
                    && self.stats.packets_received == 1
                {
                    self.remote_cids.set_initial(scid);
                }
            }
            SpaceId::Handshake if self.side.is_server() => {
                // RFC 9000 §8.1: a Handshake packet proves the client's address, the address
                // it came from, which must be the path's (found by fuzzing: one relayed from
                // elsewhere let the server send without limit to an address that had sent
                // one Initial). The server discards Initial keys (RFC 9001 §4.9.1).
                if self.on_active_path(remote, local_ip) {
                    self.path.validated = true;
                }
                self.discard_space(SpaceId::Initial, now);
            }
            SpaceId::Data if !is_0rtt && self.side.is_server() && self.zero_rtt_keys.is_some() => {
                // 1-RTT from the client: 0-RTT keys can go (RFC 9001 §4.9.3, simplified).
                self.zero_rtt_keys = None;
            }
            _ => {}
        }
        if space == SpaceId::Data && !is_0rtt && is_largest {
            // Spin bit (RFC 9000 §17.4): the server echoes, the client inverts.
            self.spin = if self.side.is_server() {
                pkt.spin()
            } else {
                !pkt.spin()
            };
        }
        let mut res = PacketResult {
            processed: true,
            space: Some(space),
            largest: is_largest,
            dcid: Some(pkt_dcid),
            ..Default::default()
        };
        match self.process_frames(now, (remote, local_ip), space, is_0rtt, &pkt) {
            Ok((non_probing, eliciting)) => {
                res.non_probing = non_probing;
                // The packet may have completed the handshake and discarded its own space
                // (RFC 9001 §4.9.2): then nothing is owed an acknowledgment there.
                if eliciting && !self.spaces[si].discarded {
                    self.on_eliciting_received(now, space, pn, prev_largest);
                }
            }
            Err(e) => {
                self.close_with_error(now, e);
                return res;
            }
        }
        if self.trace_packets {
            // Only when tracing: name the frames (the packet was valid, so they decode).
            let mut names: Vec<&'static str> = FrameIter::new(pkt.payload.clone())
                .filter_map(|f| f.ok().map(|f| f.ty().name()))
                .collect();
            names.dedup();
            self.trace(TraceEvent::PacketReceived {
                kind,
                pn,
                size,
                frames: &names,
            });
        }
        res
    }

    fn drop_packet(&mut self, kind: Option<PacketKind>, size: usize, reason: DropReason) {
        self.stats.packets_dropped += 1;
        self.trace(TraceEvent::PacketDropped { kind, size, reason });
    }

    fn buffer_undecryptable(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        ecn: Option<EcnCodepoint>,
        pd: PartialDecode,
    ) {
        let held: usize = self.undecryptable.iter().map(|u| u.3.len()).sum();
        if self.undecryptable.len() >= MAX_UNDECRYPTABLE
            || held + pd.len() > MAX_UNDECRYPTABLE_BYTES
        {
            self.drop_packet(None, pd.len(), DropReason::KeyUnavailable);
            return;
        }
        self.undecryptable
            .push((now, remote, ecn, BytesMut::from(pd.data())));
    }

    /// Keys arrived: try the buffered packets again.
    pub(super) fn retry_undecryptable(&mut self, now: Instant) {
        if self.undecryptable.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.undecryptable);
        // Called in the middle of a datagram: the packets after this one in it are still to
        // be judged by that datagram's size.
        let outer_len = self.rx_datagram_len;
        for (_, remote, ecn, data) in pending {
            self.process_datagram(now, remote, None, ecn, data, false);
        }
        self.rx_datagram_len = outer_len;
    }

    /// An ack-eliciting packet arrived: decide when to acknowledge (RFC 9000 §13.2.1).
    fn on_eliciting_received(
        &mut self,
        now: Instant,
        space: SpaceId,
        pn: u64,
        prev_largest: Option<u64>,
    ) {
        let policy = self.ack_policy;
        let a = &mut self.spaces[space.index()].ack;
        a.eliciting_since_ack += 1;
        if space != SpaceId::Data {
            a.immediate = true;
            return;
        }
        // RFC 9000 §13.2.1: acknowledge at once a packet that arrives out of order, either
        // below the largest received or above it with a gap. With ACK_FREQUENCY the gap must
        // reach the peer's reordering threshold (0 turns this off).
        let k = policy.reorder_threshold;
        let out_of_order =
            k > 0 && prev_largest.is_some_and(|l| pn < l || (pn > l + 1 && pn >= l + k));
        if a.eliciting_since_ack >= policy.threshold
            || self.immediate_ack_pending
            || out_of_order
            || !self.handshake_complete
        {
            a.immediate = true;
        } else if a.deadline.is_none() {
            a.deadline = Some(now + policy.max_delay);
        }
        self.immediate_ack_pending = false;
    }

    /// Processes the frames of a packet. Returns (non-probing, ack-eliciting).
    fn process_frames(
        &mut self,
        now: Instant,
        path: (SocketAddr, Option<IpAddr>),
        space: SpaceId,
        is_0rtt: bool,
        pkt: &DecryptedPacket,
    ) -> Result<(bool, bool), TransportError> {
        let mut non_probing = false;
        let mut eliciting = false;
        let mut any = false;
        self.rx_0rtt = is_0rtt;
        for frame in FrameIter::new(pkt.payload.clone()) {
            let frame = frame?;
            any = true;
            let ty = frame.ty();
            if space != SpaceId::Data && !ty.allowed_in_handshake_spaces() {
                return Err(TransportError::PROTOCOL_VIOLATION(
                    "frame not allowed in Initial or Handshake packets",
                )
                .with_frame(ty));
            }
            if is_0rtt && !ty.allowed_in_0rtt() {
                return Err(
                    TransportError::PROTOCOL_VIOLATION("frame not allowed in 0-RTT").with_frame(ty),
                );
            }
            eliciting |= ty.is_ack_eliciting();
            if !matches!(
                frame,
                Frame::Padding(_)
                    | Frame::PathChallenge(_)
                    | Frame::PathResponse(_)
                    | Frame::NewConnectionId(_)
            ) {
                non_probing = true;
            }
            self.process_frame(now, path, space, pkt, frame)?;
            if self.is_closed() {
                break;
            }
        }
        if !any {
            // RFC 9000 §12.4: a packet without frames is a protocol violation.
            return Err(TransportError::PROTOCOL_VIOLATION("packet with no frames"));
        }
        Ok((non_probing, eliciting))
    }

    fn process_frame(
        &mut self,
        now: Instant,
        (remote, local_ip): (SocketAddr, Option<IpAddr>),
        space: SpaceId,
        pkt: &DecryptedPacket,
        frame: Frame,
    ) -> Result<(), TransportError> {
        let ty = frame.ty();
        let server_only = |side: Side, what: &'static str| {
            if side.is_server() {
                Err(TransportError::PROTOCOL_VIOLATION(what).with_frame(ty))
            } else {
                Ok(())
            }
        };
        match frame {
            Frame::Padding(_) | Frame::Ping => {}
            Frame::Ack(ack) => self.on_ack_frame(now, space, &ack)?,
            Frame::Crypto { offset, data } => self.on_crypto(now, space, offset, data)?,
            Frame::NewToken { token } => {
                server_only(self.side, "client sent NEW_TOKEN")?;
                self.events
                    .push_back(Event::NewToken(Bytes::copy_from_slice(&token)));
            }
            Frame::Stream(s) => {
                self.stall_probe_armed = true;
                self.stall_probe_at = None;
                self.streams.on_stream_frame(
                    s.id,
                    s.offset,
                    s.data,
                    s.fin,
                    self.rx_datagram_len,
                    self.rx_0rtt,
                )?
            }
            Frame::ResetStream {
                id,
                error_code,
                final_size,
            } => self.streams.on_reset_stream(id, error_code, final_size)?,
            Frame::StopSending { id, error_code } => {
                self.streams.on_stop_sending(id, error_code)?
            }
            Frame::MaxData(v) => self.streams.on_max_data(v),
            Frame::MaxStreamData { id, max } => self.streams.on_max_stream_data(id, max)?,
            Frame::MaxStreams { dir, count } => self.streams.on_max_streams(dir, count),
            Frame::DataBlocked(_) => self.streams.on_data_blocked(),
            Frame::StreamDataBlocked { id, .. } => self.streams.on_stream_data_blocked(id)?,
            Frame::StreamsBlocked { dir, limit } => self.streams.on_streams_blocked(dir, limit)?,
            Frame::NewConnectionId(n) => {
                if self.remote_cids.active().cid.is_empty() {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "NEW_CONNECTION_ID while using a zero-length CID",
                    )
                    .with_frame(ty));
                }
                self.remote_cids.on_new(&n)?;
            }
            Frame::RetireConnectionId { seq } => {
                if let Some(cid) = self.local_cids.on_retire(seq, &pkt.dst_cid())? {
                    self.endpoint_events
                        .push_back(super::EndpointEvent::RetireCid(cid));
                    let want = self
                        .cid_target()
                        .saturating_sub(self.local_cids.active_count());
                    if want > 0 {
                        self.endpoint_events
                            .push_back(super::EndpointEvent::NeedCids(want));
                    }
                }
            }
            Frame::PathChallenge(data) => {
                // RFC 9000 §8.2.2: one PATH_RESPONSE per challenge at most; answering only
                // the latest from each address is allowed and bounds what a burst of
                // challenges can make us send.
                if self.on_active_path(remote, local_ip) {
                    self.path_response = Some(data);
                } else {
                    self.off_path_mut(remote, local_ip).challenge = Some(data);
                }
            }
            Frame::PathResponse(data) => self.on_path_response(now, remote, data),
            Frame::Close(c) => {
                let err = if c.is_application() {
                    ConnectionError::ApplicationClosed {
                        code: c.error_code,
                        reason: c.reason,
                    }
                } else {
                    let mut e = TransportError::new(
                        crate::error::TransportErrorCode(c.error_code),
                        String::from_utf8_lossy(&c.reason).into_owned(),
                    );
                    if let Some(ft) = c.frame_type.filter(|&f| f != 0) {
                        e = e.with_frame(FrameType(ft));
                    }
                    ConnectionError::PeerTransportError(e)
                };
                self.enter_draining(now, err);
            }
            Frame::HandshakeDone => {
                server_only(self.side, "client sent HANDSHAKE_DONE")?;
                self.on_handshake_confirmed(now);
            }
            Frame::Datagram(d) => {
                let Some(max) = self.config.max_datagram_frame_size else {
                    return Err(
                        TransportError::PROTOCOL_VIOLATION("DATAGRAM not negotiated")
                            .with_frame(ty),
                    );
                };
                // The limit covers the whole frame (RFC 9221 §3); without knowing whether it
                // carried a length, count the type byte only.
                if 1 + d.len() as u64 > max {
                    return Err(
                        TransportError::PROTOCOL_VIOLATION("DATAGRAM larger than allowed")
                            .with_frame(ty),
                    );
                }
                // Unread datagrams are dropped oldest first past the configured count or
                // DATAGRAM_RECEIVE_BYTES (RFC 9221 §5: they are unreliable).
                while !self.datagrams_in.is_empty()
                    && (self.datagrams_in.len() >= self.config.datagram_receive_buffer
                        || self.datagrams_in_bytes + d.len() > super::DATAGRAM_RECEIVE_BYTES)
                {
                    if let Some(old) = self.datagrams_in.pop_front() {
                        self.datagrams_in_bytes -= old.len();
                    }
                }
                self.datagrams_in_bytes += d.len();
                self.datagrams_in
                    .push_back(crate::stream::to_keep(d, self.rx_datagram_len));
                self.events.push_back(Event::DatagramReceived);
            }
            Frame::AckFrequency(af) => {
                if !self.config.ack_frequency {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "ACK_FREQUENCY without min_ack_delay",
                    )
                    .with_frame(ty));
                }
                let min = super::local_min_ack_delay_us(&self.config);
                if af.request_max_ack_delay < min {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "requested max ack delay below min_ack_delay",
                    )
                    .with_frame(ty));
                }
                // §4: 2^14 ms or more is invalid, as for max_ack_delay (RFC 9000 §18.2).
                if af.request_max_ack_delay >= (1 << 14) * 1000 {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "requested max ack delay of 2^14 ms or more",
                    )
                    .with_frame(ty));
                }
                if self.ack_policy.last_seq.is_none_or(|s| af.seq > s) {
                    self.ack_policy.last_seq = Some(af.seq);
                    self.ack_policy.threshold = af.ack_eliciting_threshold.saturating_add(1).max(1);
                    self.ack_policy.max_delay =
                        std::time::Duration::from_micros(af.request_max_ack_delay);
                    self.ack_policy.reorder_threshold = af.reordering_threshold;
                }
            }
            Frame::ImmediateAck => {
                // Not offered (no min_ack_delay): as for ACK_FREQUENCY above.
                if !self.config.ack_frequency {
                    return Err(TransportError::PROTOCOL_VIOLATION(
                        "IMMEDIATE_ACK without min_ack_delay",
                    )
                    .with_frame(ty));
                }
                self.spaces[space.index()].ack.immediate = true;
                self.immediate_ack_pending = true;
            }
        }
        Ok(())
    }

    fn on_crypto(
        &mut self,
        now: Instant,
        space: SpaceId,
        offset: u64,
        data: Bytes,
    ) -> Result<(), TransportError> {
        let si = space.index();
        let end = offset + data.len() as u64;
        // Server: the client sent its ClientHello again, so it has not received our Initial
        // flight; resend it now rather than at our PTO (RFC 9002 §6.2.3 allows this). With
        // it goes what of our Handshake flight is unacknowledged: the client has none of it
        // either (it could not read it without our Initial), and it fits in the datagram the
        // Initial is padded to (RFC 9000 §14.1) instead of a datagram of its own a PTO later,
        // which costs a round trip and, before the address is validated, a third of the
        // bytes this ClientHello allows (RFC 9000 §8.1).
        if self.side.is_server()
            && space == SpaceId::Initial
            && self.tls.is_some()
            && end <= self.spaces[si].crypto_recv.read_offset()
            && self.spaces[si].sent.has_ack_eliciting_in_flight()
            && self.spaces[si].probes == 0
        {
            self.spaces[si].probes = 1;
            self.queue_probe_data(space);
            let hi = SpaceId::Handshake.index();
            if self.spaces[hi].sent.has_ack_eliciting_in_flight() && self.spaces[hi].probes == 0 {
                self.spaces[hi].probes = 1;
                self.queue_probe_data(SpaceId::Handshake);
            }
        }
        // RFC 9001 §4.1.3: CRYPTO data at an encryption level older than the one TLS now
        // reads may only repeat what was received there; past its end it is a
        // PROTOCOL_VIOLATION. What repeats is not given to TLS again: TLS takes no level
        // with its input, so a late byte would read as the next level's message.
        if space < self.tls_read_space() {
            if end > self.spaces[si].crypto_recv.received_end() {
                return Err(TransportError::PROTOCOL_VIOLATION(
                    "CRYPTO data past the end of an encryption level TLS has left",
                )
                .with_frame(FrameType::CRYPTO));
            }
            return Ok(());
        }
        let recv = &mut self.spaces[si].crypto_recv;
        // Server, before TLS starts: what was read is gathered in `client_hello`, so the
        // limit counts from the start of the stream (RFC 9000 §7.5).
        let base = if self.tls.is_none() && !self.tls_released {
            0
        } else {
            recv.read_offset()
        };
        if end > base + super::spaces::MAX_CRYPTO_BUFFER {
            return Err(
                TransportError::CRYPTO_BUFFER_EXCEEDED("too much CRYPTO data buffered")
                    .with_frame(FrameType::CRYPTO),
            );
        }
        recv.insert(offset, data, self.rx_datagram_len);
        // Tiny fragments between gaps cost more memory than their bytes: bounded too; more
        // tightly before a server has the whole ClientHello, when the peer is not known
        // at all (its address perhaps spoofed) and the state is multiplied by every
        // half-open handshake. A ClientHello is a few kilobytes, its pieces a handful.
        let most = if self.tls.is_none() && self.side == Side::Server {
            super::spaces::MAX_CRYPTO_CHARGE_BEFORE_HELLO
        } else {
            2 * super::spaces::MAX_CRYPTO_BUFFER
        };
        if recv.charge() as u64 > most {
            return Err(TransportError::CRYPTO_BUFFER_EXCEEDED(
                "CRYPTO data too fragmented to buffer",
            )
            .with_frame(FrameType::CRYPTO));
        }
        if self.tls_released {
            // RFC 9001 §4.1.3: a client sends no TLS message after its Finished in QUIC
            // (no KeyUpdate, no post-handshake authentication).
            return Err(TransportError::PROTOCOL_VIOLATION(
                "CRYPTO data from the client after the handshake",
            )
            .with_frame(FrameType::CRYPTO));
        }
        if self.tls.is_none() {
            // Server: gather the ClientHello first to choose the version (RFC 9368).
            while let Some(chunk) = self.spaces[si].crypto_recv.read(usize::MAX) {
                self.client_hello.extend_from_slice(&chunk);
            }
            if let Some(len) = client_hello_len(&self.client_hello) {
                if len as u64 > super::spaces::MAX_CRYPTO_BUFFER {
                    return Err(TransportError::CRYPTO_BUFFER_EXCEEDED(
                        "ClientHello larger than the CRYPTO buffer",
                    )
                    .with_frame(FrameType::CRYPTO));
                }
                if self.client_hello.len() >= len {
                    self.start_server_tls(now)?;
                }
            }
            return Ok(());
        }
        while let Some(chunk) = self.spaces[si].crypto_recv.read(usize::MAX) {
            let tls = self.tls.as_mut().expect("checked");
            tls.read(&chunk)?;
            if space == SpaceId::Data && self.side.is_client() {
                // RFC 9001 §4.1.3: after the handshake a server's TLS messages can only be
                // NewSessionTickets; tell the application when one is complete.
                let events = &mut self.events;
                self.post_handshake_messages.feed(&chunk, |ty| {
                    if ty == TLS_NEW_SESSION_TICKET {
                        events.push_back(Event::SessionTicket);
                    }
                });
            }
        }
        self.process_tls(now)
    }

    /// The encryption level whose CRYPTO data TLS reads next: Initial until the Handshake
    /// keys, Handshake until the handshake completes, then 1-RTT (a server's TLS sends
    /// 1-RTT before it reads the client's Finished at Handshake level). A HelloRetryRequest
    /// keeps both sides at Initial for the second ClientHello.
    fn tls_read_space(&self) -> SpaceId {
        if self.handshake_complete {
            SpaceId::Data
        } else if self.spaces[SpaceId::Handshake.index()].keys.is_some() {
            SpaceId::Handshake
        } else {
            SpaceId::Initial
        }
    }

    /// Server: the ClientHello is complete; choose the version and start TLS.
    fn start_server_tls(&mut self, now: Instant) -> Result<(), TransportError> {
        let cfg = self.server_config.clone().expect("server has config");
        let ch = std::mem::take(&mut self.client_hello);
        let client_tp = parse_client_hello_tp(&ch);
        self.early_data_identity = client_hello_early_data_identity(&ch).map(Box::from);
        // Compatible version negotiation (RFC 9368 §4): the first of our versions that the
        // client lists and that is compatible with the one it used.
        if let Some(vi) = client_tp
            .as_ref()
            .and_then(|raw| {
                crate::transport_params::TransportParameters::decode(Side::Client, raw).ok()
            })
            .and_then(|tp| tp.version_information)
        {
            if vi.chosen != self.version.wire() {
                return Err(TransportError::VERSION_NEGOTIATION_ERROR(
                    "client's chosen version differs from its Initial's version",
                ));
            }
            if let Some(v) = cfg
                .versions
                .iter()
                .copied()
                .find(|v| vi.available.contains(&v.wire()))
                && v != self.version
            {
                self.switch_version(v);
            }
        }
        let version = self.version;
        let lp = self.local_params.as_mut().ok_or_else(|| {
            TransportError::INTERNAL_ERROR("transport parameters already released")
        })?;
        lp.version_information = Some(crate::transport_params::VersionInformation {
            chosen: version.wire(),
            available: cfg.versions.iter().map(|v| v.wire()).collect(),
        });
        let mut tp = Vec::new();
        lp.encode_with_rng(&mut tp, &mut self.rng.draw());
        self.trace_local_params();
        let mut tls = super::Tls::server(cfg.tls.clone(), self.version, tp)
            .map_err(|e| TransportError::INTERNAL_ERROR(format!("TLS setup: {e}")))?;
        self.tls_version = self.version;
        // RFC 9000 §7.4.1: a server that accepts 0-RTT must not lower the limits the client
        // remembers; one made under memory pressure advertises smaller windows, so it takes
        // no early data (the client sends its requests again in 1-RTT, where it learned the
        // new limits).
        if !cfg.accept_0rtt || self.params_shrunk {
            tls.reject_early_data();
        }
        tls.read(&ch)?;
        self.tls = Some(Box::new(tls));
        // Anything after the ClientHello in the Initial CRYPTO stream.
        while let Some(chunk) = self.spaces[SpaceId::Initial.index()]
            .crypto_recv
            .read(usize::MAX)
        {
            self.tls.as_mut().expect("set").read(&chunk)?;
        }
        self.process_tls(now)
    }

    /// Switches to another version (compatible version negotiation, RFC 9368).
    fn switch_version(&mut self, v: Version) {
        let old = self.version;
        self.version = v;
        self.stats.version = Some(v);
        let initial_dcid = match self.side {
            Side::Client => self.original_dcid,
            Side::Server => self
                .local_params
                .as_ref()
                .and_then(|p| p.retry_source_connection_id)
                .unwrap_or(self.original_dcid),
        };
        let keys = super::crypto::initial_keys(v, &initial_dcid, self.side);
        let old_keys = self.spaces[SpaceId::Initial.index()]
            .keys
            .replace(Box::new(keys));
        if self.side.is_server() && old == self.original_version {
            self.original_initial_keys = old_keys;
        }
        self.trace(TraceEvent::VersionChosen { version: v });
    }

    /// The entry of an address other than the active path's that sent a challenge; a new
    /// address replaces the oldest when [`super::paths::MAX_OFF_PATHS`] are tracked.
    fn off_path_mut(
        &mut self,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
    ) -> &mut super::paths::OffPath {
        let i = match self
            .off_paths
            .iter()
            .position(|o| o.matches(remote, local_ip))
        {
            Some(i) => i,
            None => {
                if self.off_paths.len() >= super::paths::MAX_OFF_PATHS {
                    self.off_paths.remove(0);
                }
                self.off_paths
                    .push(super::paths::OffPath::new(remote, local_ip));
                self.off_paths.len() - 1
            }
        };
        &mut self.off_paths[i]
    }

    fn on_path_response(&mut self, now: Instant, remote: SocketAddr, data: [u8; 8]) {
        if self
            .preferred
            .as_ref()
            .and_then(|p| p.challenge.as_ref())
            .is_some_and(|c| c.data == data)
        {
            self.migrate_to_preferred(now);
            return;
        }
        let Some(ch) = self.path.challenge.as_ref() else {
            return;
        };
        if ch.data != data {
            return;
        }
        // RFC 9000 §8.2.3: the response validates the path it was sent on, wherever it came
        // from.
        let _ = remote;
        let small = ch.small;
        self.path.challenge = None;
        self.path.validated = true;
        if small {
            // RFC 9000 §8.2.1: the challenge went in a datagram under 1200 bytes (the
            // amplification limit allowed no more), so the path's MTU is not validated: a
            // second challenge, padded to 1200 now that the address is.
            self.start_challenge(now);
            return;
        }
        self.events
            .push_back(Event::PathValidated(self.path.remote));
        self.trace(TraceEvent::PathUpdated {
            path: self.path.id,
            remote: self.path.remote,
            event: "validated",
        });
        // The old path is no longer needed once the new one is validated.
        self.prev_path = None;
        self.set_loss_timer(now);
    }

    /// A non-probing packet with the largest packet number came from a new address: the peer
    /// migrated or its NAT rebound (RFC 9000 §9.3).
    fn on_peer_address_change(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
        datagram_len: u64,
        dcid: Option<ConnectionId>,
    ) {
        if self.side.is_client() || !self.handshake_confirmed {
            // Clients only accept the server's address; servers ignore changes before the
            // handshake is confirmed (RFC 9000 §9).
            return;
        }
        let from = self.path.remote;
        let same_host = from.ip() == remote.ip();
        let back = self
            .prev_path
            .as_ref()
            .is_some_and(|p| p.remote == remote && (local_ip.is_none() || p.local_ip == local_ip));
        // The last validated path stays unless the peer went back to it: a second spurious
        // address change (a spoofed one, say) must not make us forget it.
        let mut new = if back {
            // Back to the previous path (e.g. a spurious rebinding).
            let mut p = *self.prev_path.take().expect("checked");
            // Validated already: a challenge sent as the peer left it is moot.
            p.challenge = None;
            p
        } else {
            let mut p = self.new_path(remote, local_ip, now, false);
            if same_host {
                // Only the port changed: most likely a NAT rebinding, same host and
                // network path, so keep the RTT estimate (RFC 9000 §9.4 allows it).
                p.rtt = self.path.rtt.clone();
            }
            p.amp_received = datagram_len;
            p
        };
        // What the address sent and was sent while it probed counts toward its 3x budget,
        // and a challenge it sent is now answered on the active path.
        let probe = self
            .off_paths
            .iter()
            .position(|o| o.matches(remote, local_ip))
            .map(|i| self.off_paths.swap_remove(i));
        if !new.validated {
            new.amp_received = new.amp_received.max(datagram_len);
            if let Some(o) = &probe {
                new.amp_received = new.amp_received.max(o.amp_received);
                new.amp_sent = new.amp_sent.max(o.amp_sent);
            }
        }
        self.path_response = probe.and_then(|o| o.challenge);
        // RFC 9000 §9.5: a peer that moved with a new connection ID (a migration, not a
        // NAT rebinding, which keeps it) gets a new one from us too on its new address, or
        // an observer could link the two paths by ours. With none to spare, ours stays.
        if !back && dcid.is_some() && self.peer_dcid.is_some() && dcid != self.peer_dcid {
            let _ = self.remote_cids.rotate();
        }
        if dcid.is_some() {
            self.peer_dcid = dcid;
        }
        let mut old = std::mem::replace(&mut self.path, new);
        self.retire_path_packets(&old);
        if old.validated {
            // RFC 9000 §9.3.3: an apparent migration makes us challenge the old path too.
            // The peer, if it is still there (an attacker relayed a copy of its packet from
            // elsewhere, and it arrived first), answers with a non-probing packet and the
            // connection comes back to it.
            if !back {
                let mut data = [0u8; 8];
                rand::Rng::fill(&mut self.rng.draw(), &mut data);
                old.challenge = Some(super::paths::Challenge {
                    data,
                    resend_at: now,
                    deadline: now + old.rtt.pto_base() * 3,
                    sent: false,
                    small: false,
                });
            }
            self.prev_path = Some(Box::new(old));
        }
        self.stats.migrations += 1;
        self.events
            .push_back(Event::PathMigrated { from, to: remote });
        self.trace(TraceEvent::PathUpdated {
            path: self.path.id,
            remote,
            event: "peer_migration",
        });
        if !self.path.validated {
            self.start_challenge(now);
        }
        self.timers.set(Timer::PathChallenge, Some(now));
    }

    fn on_version_negotiation(&mut self, now: Instant, pd: &PartialDecode) {
        // RFC 9000 §6.2: only before anything else arrived (a Retry included), and only if
        // it does not list the version we used.
        if self.side.is_server()
            || self.stats.packets_received > 0
            || self.retry_scid.is_some()
            || pd.dst_cid() != self.handshake_cid
            || pd.src_cid() != Some(self.original_dcid)
        {
            return;
        }
        let offered: Vec<u32> = pd.supported_versions().collect();
        if offered.contains(&self.version.wire()) {
            return;
        }
        // RFC 9368 §2.1: start again with the first of our versions the server offers.
        // A VN packet is unauthenticated; the server's version_information, checked after
        // the new handshake, would expose a forged one (RFC 9368 §4).
        if !self.vn_restarted
            && let Some(v) = self
                .versions()
                .iter()
                .copied()
                .find(|v| offered.contains(&v.wire()))
            && self.restart_with_version(now, v).is_ok()
        {
            return;
        }
        let err = ConnectionError::VersionMismatch;
        self.error = Some(err.clone());
        self.events.push_back(Event::ConnectionLost(err));
        self.set_drained();
    }

    /// Client: a new connection attempt in version `v` after Version Negotiation.
    fn restart_with_version(&mut self, now: Instant, v: Version) -> Result<(), TransportError> {
        let cfg = self
            .client_config
            .clone()
            .ok_or_else(|| TransportError::INTERNAL_ERROR("no client config"))?;
        let name = self
            .server_name
            .clone()
            .and_then(|n| rustls::pki_types::ServerName::try_from(n).ok())
            .ok_or_else(|| TransportError::INTERNAL_ERROR("no server name"))?;
        self.vn_restarted = true;
        if self.zero_rtt == ZeroRtt::Attempting {
            // 0-RTT data of the first attempt is gone with it: the application resends.
            self.on_0rtt_rejected();
        }
        self.version = v;
        self.original_version = v;
        self.tls_version = v;
        self.stats.version = Some(v);
        let available = self.versions().iter().map(|x| x.wire()).collect();
        let lp = self.local_params.as_mut().ok_or_else(|| {
            TransportError::INTERNAL_ERROR("transport parameters already released")
        })?;
        lp.version_information = Some(crate::transport_params::VersionInformation {
            chosen: v.wire(),
            available,
        });
        let mut tp = Vec::new();
        lp.encode_with_rng(&mut tp, &mut self.rng.draw());
        self.trace_local_params();
        let tls = super::Tls::client(cfg.tls.clone(), v, name, tp)
            .map_err(|e| TransportError::INTERNAL_ERROR(format!("TLS: {e}")))?;
        // Everything of the first attempt goes: packets, handshake data, path state.
        self.spaces = super::Spaces::new();
        self.spaces[SpaceId::Initial.index()].keys = Some(Box::new(super::crypto::initial_keys(
            v,
            &self.original_dcid,
            Side::Client,
        )));
        let remote = self.path.remote;
        let local_ip = self.path.local_ip;
        self.path = self.new_path(remote, local_ip, now, true);
        self.client_random = None;
        self.zero_rtt = ZeroRtt::None;
        self.zero_rtt_keys = None;
        self.pto_count = 0;
        self.tls = Some(Box::new(tls));
        self.process_tls(now)?;
        self.start_0rtt();
        self.trace(TraceEvent::VersionChosen { version: v });
        self.set_loss_timer(now);
        Ok(())
    }

    fn on_retry(&mut self, now: Instant, pd: &PartialDecode) {
        // RFC 9000 §17.2.5.2: one Retry, before any other server packet, with a valid tag and
        // a non-empty token, whose SCID differs from our DCID.
        if self.side.is_server()
            || self.retry_scid.is_some()
            || self.stats.packets_received > 0
            || pd.token().is_empty()
            || pd.version() != Some(self.version.wire())
        {
            return;
        }
        let Some(scid) = pd.src_cid() else { return };
        if scid == self.original_dcid
            || !packet::retry_integrity_ok(self.version, &self.original_dcid, pd.data())
        {
            return;
        }
        self.stats.retry_received = true;
        self.retry_scid = Some(scid);
        self.token = Bytes::copy_from_slice(pd.token());
        self.remote_cids.set_initial(scid);
        self.spaces[SpaceId::Initial.index()].keys = Some(Box::new(super::crypto::initial_keys(
            self.version,
            &scid,
            Side::Client,
        )));
        // Everything sent in Initial packets goes again; those packets are no longer in
        // flight (RFC 9002 §6.3: not counted as lost).
        let sp = &mut self.spaces[SpaceId::Initial.index()];
        let drained: Vec<_> = sp.sent.drain().collect();
        sp.time_of_last_ack_eliciting = None;
        sp.loss_time = None;
        for (_, p) in drained {
            if p.in_flight {
                self.path.bytes_in_flight =
                    self.path.bytes_in_flight.saturating_sub(u64::from(p.size));
            }
            for f in &p.frames {
                if let crate::recovery::SentFrame::Crypto { offset, len } = *f {
                    self.spaces[SpaceId::Initial.index()]
                        .crypto_send
                        .lost(offset..offset + u64::from(len));
                }
            }
        }
        // The Retry gives an RTT sample of sorts; keep it simple and restart the PTO.
        self.pto_count = 0;
        self.set_loss_timer(now);
    }

    /// Whether the 0-RTT state lets a server read early data.
    #[allow(dead_code)]
    fn zero_rtt_open(&self) -> bool {
        self.zero_rtt == ZeroRtt::Attempting
    }
}

fn packet_kind(ty: PacketType) -> PacketKind {
    match ty {
        PacketType::Long(LongType::Initial) => PacketKind::Initial,
        PacketType::Long(LongType::Handshake) => PacketKind::Handshake,
        PacketType::Long(LongType::ZeroRtt) => PacketKind::ZeroRtt,
        PacketType::Long(LongType::Retry) => PacketKind::Retry,
        PacketType::Short => PacketKind::OneRtt,
        PacketType::VersionNegotiation | PacketType::UnsupportedVersion => {
            PacketKind::VersionNegotiation
        }
    }
}

/// Length of the TLS handshake message at the start of `data` (4-byte header included).
fn client_hello_len(data: &[u8]) -> Option<usize> {
    if data.len() < 4 {
        return None;
    }
    let len = (usize::from(data[1]) << 16) | (usize::from(data[2]) << 8) | usize::from(data[3]);
    Some(4 + len)
}

/// Extracts the quic_transport_parameters extension (0x39) from a ClientHello.
fn parse_client_hello_tp(ch: &[u8]) -> Option<&[u8]> {
    client_hello_extension(ch, 0x39)
}

/// The first PSK identity of a ClientHello that asks for 0-RTT: its `early_data` extension
/// (42) is there, and the identity its `pre_shared_key` extension (41) lists first, the one
/// the early data is encrypted with (RFC 8446 §4.2.10, §4.2.11).
fn client_hello_early_data_identity(ch: &[u8]) -> Option<&[u8]> {
    use crate::coding::BufExt;
    client_hello_extension(ch, 42)?;
    let mut psk = client_hello_extension(ch, 41)?;
    let _identities_len = psk.get_u16_checked().ok()?;
    let len = psk.get_u16_checked().ok()? as usize;
    psk.get(..len).filter(|id| !id.is_empty())
}

/// Extension `wanted` of a ClientHello, without trusting any length (RFC 8446 §4.1.2).
fn client_hello_extension(ch: &[u8], wanted: u16) -> Option<&[u8]> {
    use crate::coding::BufExt;
    let mut b = ch;
    if b.get_u8_checked().ok()? != 1 {
        return None;
    }
    let _len = [
        b.get_u8_checked().ok()?,
        b.get_u8_checked().ok()?,
        b.get_u8_checked().ok()?,
    ];
    b.skip(2 + 32).ok()?; // legacy_version, random
    let sid = b.get_u8_checked().ok()? as usize;
    b.skip(sid).ok()?;
    let cs = b.get_u16_checked().ok()? as usize;
    b.skip(cs).ok()?;
    let comp = b.get_u8_checked().ok()? as usize;
    b.skip(comp).ok()?;
    let ext_len = b.get_u16_checked().ok()? as usize;
    if b.len() < ext_len {
        return None;
    }
    let mut ext = &b[..ext_len];
    while !ext.is_empty() {
        let ty = ext.get_u16_checked().ok()?;
        let len = ext.get_u16_checked().ok()? as usize;
        if ext.len() < len {
            return None;
        }
        if ty == wanted {
            return Some(&ext[..len]);
        }
        ext = &ext[len..];
    }
    None
}

#[allow(dead_code)]
fn _unused(_: PacketDecodeError) {}

/// TLS handshake message type of NewSessionTicket (RFC 8446 §4).
const TLS_NEW_SESSION_TICKET: u8 = 4;

/// Finds where TLS handshake messages end in a byte stream: a type byte and a 24-bit length
/// (RFC 8446 §4), then the body.
#[derive(Debug, Default)]
pub(super) struct TlsMessageScan {
    header: [u8; 4],
    header_len: u8,
    /// Body bytes of the current message still to come.
    remaining: u32,
}

impl TlsMessageScan {
    /// Consumes `data`, calling `done` with the type of each message that completes in it.
    pub(super) fn feed(&mut self, mut data: &[u8], mut done: impl FnMut(u8)) {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = data.len().min(self.remaining as usize);
                self.remaining -= n as u32;
                data = &data[n..];
                if self.remaining == 0 {
                    done(self.header[0]);
                }
                continue;
            }
            self.header[usize::from(self.header_len)] = data[0];
            self.header_len += 1;
            data = &data[1..];
            if self.header_len == 4 {
                self.header_len = 0;
                self.remaining =
                    u32::from_be_bytes([0, self.header[1], self.header[2], self.header[3]]);
                if self.remaining == 0 {
                    done(self.header[0]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tls_scan_tests {
    use super::*;

    #[test]
    fn finds_message_ends_across_chunks() {
        // Two tickets (type 4, bodies of 3 and 0 bytes) and a type-20 message of 1 byte.
        let stream = [4u8, 0, 0, 3, 9, 9, 9, 4, 0, 0, 0, 20, 0, 0, 1, 7];
        for split in 0..stream.len() {
            let mut scan = TlsMessageScan::default();
            let mut seen = Vec::new();
            scan.feed(&stream[..split], |t| seen.push(t));
            scan.feed(&stream[split..], |t| seen.push(t));
            assert_eq!(seen, [4, 4, 20], "split at {split}");
        }
        let mut scan = TlsMessageScan::default();
        let mut seen = Vec::new();
        for b in stream {
            scan.feed(&[b], |t| seen.push(t));
        }
        assert_eq!(seen, [4, 4, 20]);
    }
}
