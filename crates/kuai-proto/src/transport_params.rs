//! QUIC transport parameters (RFC 9000 §7.4, §18) and the extensions kuai speaks: DATAGRAM
//! (RFC 9221 §3), greasing the QUIC bit (RFC 9287 §3), compatible version negotiation
//! (RFC 9368 §3) and acknowledgment frequency (draft-ietf-quic-ack-frequency §3).
//!
//! The encoding is a sequence of `(id: varint, length: varint, value: length bytes)` triples
//! carried in the `quic_transport_parameters` TLS extension. [`TransportParameters::decode`]
//! enforces every rule the RFCs attach to the individual values, so a connection can use the
//! result without further range checks; the cross-checks that need connection state (RFC 9000
//! §7.3 connection-ID authentication, §7.4.1 0-RTT limits) are separate helpers.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use bytes::BufMut;
use rand::Rng;

use crate::cid::{ConnectionId, MAX_CID_SIZE};
use crate::coding::{BufExt, BufMutExt};
use crate::error::TransportError;
use crate::types::Side;
use crate::varint::VarInt;

// Transport parameter IDs.
const ORIGINAL_DESTINATION_CONNECTION_ID: u64 = 0x00;
const MAX_IDLE_TIMEOUT: u64 = 0x01;
const STATELESS_RESET_TOKEN: u64 = 0x02;
const MAX_UDP_PAYLOAD_SIZE: u64 = 0x03;
const INITIAL_MAX_DATA: u64 = 0x04;
const INITIAL_MAX_STREAM_DATA_BIDI_LOCAL: u64 = 0x05;
const INITIAL_MAX_STREAM_DATA_BIDI_REMOTE: u64 = 0x06;
const INITIAL_MAX_STREAM_DATA_UNI: u64 = 0x07;
const INITIAL_MAX_STREAMS_BIDI: u64 = 0x08;
const INITIAL_MAX_STREAMS_UNI: u64 = 0x09;
const ACK_DELAY_EXPONENT: u64 = 0x0a;
const MAX_ACK_DELAY: u64 = 0x0b;
const DISABLE_ACTIVE_MIGRATION: u64 = 0x0c;
const PREFERRED_ADDRESS: u64 = 0x0d;
const ACTIVE_CONNECTION_ID_LIMIT: u64 = 0x0e;
const INITIAL_SOURCE_CONNECTION_ID: u64 = 0x0f;
const RETRY_SOURCE_CONNECTION_ID: u64 = 0x10;
const VERSION_INFORMATION: u64 = 0x11;
const MAX_DATAGRAM_FRAME_SIZE: u64 = 0x20;
const GREASE_QUIC_BIT: u64 = 0x2ab2;
const MIN_ACK_DELAY: u64 = 0xff04_de1b;

/// Parameters only a server may send (RFC 9000 §18.2).
const SERVER_ONLY: [u64; 4] = [
    ORIGINAL_DESTINATION_CONNECTION_ID,
    STATELESS_RESET_TOKEN,
    PREFERRED_ADDRESS,
    RETRY_SOURCE_CONNECTION_ID,
];

/// The smallest permitted max_udp_payload_size (RFC 9000 §18.2).
const MIN_UDP_PAYLOAD_SIZE: u64 = 1200;
/// Default and largest meaningful max_udp_payload_size.
const DEFAULT_MAX_UDP_PAYLOAD_SIZE: u64 = 65527;
/// Stream counts above 2^60 could not be expressed as stream IDs (RFC 9000 §4.6).
const MAX_STREAM_COUNT: u64 = 1 << 60;
const DEFAULT_ACK_DELAY_EXPONENT: u64 = 3;
const MAX_ACK_DELAY_EXPONENT: u64 = 20;
const DEFAULT_MAX_ACK_DELAY: u64 = 25;
/// max_ack_delay must be below this many milliseconds (RFC 9000 §18.2).
const MAX_ACK_DELAY_LIMIT: u64 = 1 << 14;
const DEFAULT_ACTIVE_CONNECTION_ID_LIMIT: u64 = 2;
const RESET_TOKEN_SIZE: usize = 16;
/// The transport parameters travel in a TLS extension, whose length is a 16-bit field.
const MAX_ENCODED_LEN: usize = u16::MAX as usize;
/// Largest value length of the reserved parameter [`TransportParameters::encode`] adds.
const MAX_GREASE_VALUE_LEN: usize = 16;

/// The transport parameters one endpoint announces to the other (RFC 9000 §18.2).
///
/// Fields hold the values as they appear on the wire (milliseconds, microseconds, raw
/// exponents); the `*_duration` helpers convert the time-valued ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportParameters {
    /// 0x00: the Destination Connection ID of the client's first Initial packet (server only).
    pub original_destination_connection_id: Option<ConnectionId>,
    /// 0x01: idle timeout in milliseconds; 0 means the sender has none.
    pub max_idle_timeout: u64,
    /// 0x02: stateless reset token for the server's handshake connection ID (server only).
    pub stateless_reset_token: Option<[u8; 16]>,
    /// 0x03: the largest UDP payload the sender will accept; at least 1200, default 65527.
    pub max_udp_payload_size: u64,
    /// 0x04: initial connection-level flow control limit.
    pub initial_max_data: u64,
    /// 0x05: initial limit for bidirectional streams the sender opens.
    pub initial_max_stream_data_bidi_local: u64,
    /// 0x06: initial limit for bidirectional streams the receiver opens.
    pub initial_max_stream_data_bidi_remote: u64,
    /// 0x07: initial limit for unidirectional streams the receiver opens.
    pub initial_max_stream_data_uni: u64,
    /// 0x08: how many bidirectional streams the receiver may open; at most 2^60.
    pub initial_max_streams_bidi: u64,
    /// 0x09: how many unidirectional streams the receiver may open; at most 2^60.
    pub initial_max_streams_uni: u64,
    /// 0x0a: exponent for the ACK Delay field; at most 20, default 3.
    pub ack_delay_exponent: u64,
    /// 0x0b: the most the sender delays acknowledgments, in milliseconds; below 2^14, default 25.
    pub max_ack_delay: u64,
    /// 0x0c: the sender does not support active connection migration.
    pub disable_active_migration: bool,
    /// 0x0d: an address the server would rather the client migrate to (server only).
    pub preferred_address: Option<PreferredAddress>,
    /// 0x0e: how many connection IDs from the peer the sender will store; at least 2.
    pub active_connection_id_limit: u64,
    /// 0x0f: the Source Connection ID of the sender's first Initial packet.
    pub initial_source_connection_id: Option<ConnectionId>,
    /// 0x10: the Source Connection ID of the server's Retry packet (server only).
    pub retry_source_connection_id: Option<ConnectionId>,
    /// 0x11: version information for compatible version negotiation (RFC 9368).
    pub version_information: Option<VersionInformation>,
    /// 0x20: the largest DATAGRAM frame the sender accepts (RFC 9221); absent means none.
    pub max_datagram_frame_size: Option<u64>,
    /// 0x2ab2: the sender accepts packets with the QUIC bit cleared (RFC 9287).
    pub grease_quic_bit: bool,
    /// 0xff04de1b: the least the sender can delay an acknowledgment, in microseconds
    /// (ack-frequency draft); at most `max_ack_delay * 1000`.
    pub min_ack_delay: Option<u64>,
}

/// The server's preferred address (RFC 9000 §18.2, §9.6). A family the server does not offer is
/// sent as an all-zero address and port, and decoded as `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreferredAddress {
    pub v4: Option<SocketAddrV4>,
    /// Flow info and scope ID are not carried on the wire and decode as 0.
    pub v6: Option<SocketAddrV6>,
    /// A connection ID for the new path; never empty.
    pub cid: ConnectionId,
    pub reset_token: [u8; 16],
}

/// Version information for compatible version negotiation (RFC 9368 §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInformation {
    /// The version the sender uses for this connection; never 0.
    pub chosen: u32,
    /// From a client, the versions its first flight is compatible with, in order of preference
    /// (including `chosen`); from a server, its fully deployed versions. Never contains 0.
    pub available: Vec<u32>,
}

impl TransportParameters {
    /// The parameters by their qlog names (`quic:parameters_set`), those present only.
    pub(crate) fn qlog_params(&self) -> Vec<(&'static str, crate::trace::ParamValue)> {
        use crate::trace::ParamValue::{Flag, Hex, Number};
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut v = vec![
            ("max_idle_timeout", Number(self.max_idle_timeout)),
            ("max_udp_payload_size", Number(self.max_udp_payload_size)),
            ("ack_delay_exponent", Number(self.ack_delay_exponent)),
            ("max_ack_delay", Number(self.max_ack_delay)),
            ("active_connection_id_limit", Number(self.active_connection_id_limit)),
            ("initial_max_data", Number(self.initial_max_data)),
            (
                "initial_max_stream_data_bidi_local",
                Number(self.initial_max_stream_data_bidi_local),
            ),
            (
                "initial_max_stream_data_bidi_remote",
                Number(self.initial_max_stream_data_bidi_remote),
            ),
            (
                "initial_max_stream_data_uni",
                Number(self.initial_max_stream_data_uni),
            ),
            ("initial_max_streams_bidi", Number(self.initial_max_streams_bidi)),
            ("initial_max_streams_uni", Number(self.initial_max_streams_uni)),
            ("disable_active_migration", Flag(self.disable_active_migration)),
            ("grease_quic_bit", Flag(self.grease_quic_bit)),
        ];
        if let Some(c) = &self.original_destination_connection_id {
            v.push(("original_destination_connection_id", Hex(hex(c))));
        }
        if let Some(c) = &self.initial_source_connection_id {
            v.push(("initial_source_connection_id", Hex(hex(c))));
        }
        if let Some(c) = &self.retry_source_connection_id {
            v.push(("retry_source_connection_id", Hex(hex(c))));
        }
        if let Some(t) = &self.stateless_reset_token {
            v.push(("stateless_reset_token", Hex(hex(t))));
        }
        if let Some(n) = self.max_datagram_frame_size {
            v.push(("max_datagram_frame_size", Number(n)));
        }
        if let Some(n) = self.min_ack_delay {
            v.push(("min_ack_delay", Number(n)));
        }
        v
    }
}

impl Default for TransportParameters {
    fn default() -> Self {
        Self {
            original_destination_connection_id: None,
            max_idle_timeout: 0,
            stateless_reset_token: None,
            max_udp_payload_size: DEFAULT_MAX_UDP_PAYLOAD_SIZE,
            initial_max_data: 0,
            initial_max_stream_data_bidi_local: 0,
            initial_max_stream_data_bidi_remote: 0,
            initial_max_stream_data_uni: 0,
            initial_max_streams_bidi: 0,
            initial_max_streams_uni: 0,
            ack_delay_exponent: DEFAULT_ACK_DELAY_EXPONENT,
            max_ack_delay: DEFAULT_MAX_ACK_DELAY,
            disable_active_migration: false,
            preferred_address: None,
            active_connection_id_limit: DEFAULT_ACTIVE_CONNECTION_ID_LIMIT,
            initial_source_connection_id: None,
            retry_source_connection_id: None,
            version_information: None,
            max_datagram_frame_size: None,
            grease_quic_bit: false,
            min_ack_delay: None,
        }
    }
}

impl TransportParameters {
    /// Appends the encoding of every non-default parameter, followed by one reserved parameter
    /// with a random ID of the form `31 * N + 27` and a short random value (RFC 9000 §18.1), so
    /// that peers keep ignoring unknown parameters.
    ///
    /// # Panics
    /// If a numeric value exceeds 2^62 - 1 (it could not be sent as a varint). Values that
    /// came out of [`decode`](Self::decode) are always in range.
    pub fn encode(&self, buf: &mut Vec<u8>) {
        self.encode_with_rng(buf, &mut rand::rng());
    }

    /// [`encode`](Self::encode) with the reserved parameter drawn from `rng`.
    pub fn encode_with_rng<R: Rng + ?Sized>(&self, buf: &mut Vec<u8>, rng: &mut R) {
        self.encode_without_grease(buf);
        put_grease(buf, rng);
    }

    /// Parameters in ascending ID order, non-default values only, no reserved parameter.
    fn encode_without_grease(&self, buf: &mut Vec<u8>) {
        let d = Self::default();
        if let Some(cid) = &self.original_destination_connection_id {
            put_param(buf, ORIGINAL_DESTINATION_CONNECTION_ID, cid);
        }
        put_var_if(
            buf,
            MAX_IDLE_TIMEOUT,
            self.max_idle_timeout,
            d.max_idle_timeout,
        );
        if let Some(token) = &self.stateless_reset_token {
            put_param(buf, STATELESS_RESET_TOKEN, token);
        }
        put_var_if(
            buf,
            MAX_UDP_PAYLOAD_SIZE,
            self.max_udp_payload_size,
            d.max_udp_payload_size,
        );
        put_var_if(buf, INITIAL_MAX_DATA, self.initial_max_data, 0);
        put_var_if(
            buf,
            INITIAL_MAX_STREAM_DATA_BIDI_LOCAL,
            self.initial_max_stream_data_bidi_local,
            0,
        );
        put_var_if(
            buf,
            INITIAL_MAX_STREAM_DATA_BIDI_REMOTE,
            self.initial_max_stream_data_bidi_remote,
            0,
        );
        put_var_if(
            buf,
            INITIAL_MAX_STREAM_DATA_UNI,
            self.initial_max_stream_data_uni,
            0,
        );
        put_var_if(
            buf,
            INITIAL_MAX_STREAMS_BIDI,
            self.initial_max_streams_bidi,
            0,
        );
        put_var_if(
            buf,
            INITIAL_MAX_STREAMS_UNI,
            self.initial_max_streams_uni,
            0,
        );
        put_var_if(
            buf,
            ACK_DELAY_EXPONENT,
            self.ack_delay_exponent,
            d.ack_delay_exponent,
        );
        put_var_if(buf, MAX_ACK_DELAY, self.max_ack_delay, d.max_ack_delay);
        if self.disable_active_migration {
            put_param(buf, DISABLE_ACTIVE_MIGRATION, &[]);
        }
        if let Some(pa) = &self.preferred_address {
            let mut value = Vec::with_capacity(41 + pa.cid.len());
            pa.encode(&mut value);
            put_param(buf, PREFERRED_ADDRESS, &value);
        }
        put_var_if(
            buf,
            ACTIVE_CONNECTION_ID_LIMIT,
            self.active_connection_id_limit,
            d.active_connection_id_limit,
        );
        if let Some(cid) = &self.initial_source_connection_id {
            put_param(buf, INITIAL_SOURCE_CONNECTION_ID, cid);
        }
        if let Some(cid) = &self.retry_source_connection_id {
            put_param(buf, RETRY_SOURCE_CONNECTION_ID, cid);
        }
        if let Some(vi) = &self.version_information {
            buf.put_var(VERSION_INFORMATION);
            buf.put_var(4 * (1 + vi.available.len() as u64));
            buf.put_u32(vi.chosen);
            for &v in &vi.available {
                buf.put_u32(v);
            }
        }
        if let Some(v) = self.max_datagram_frame_size {
            put_var_param(buf, MAX_DATAGRAM_FRAME_SIZE, v);
        }
        if self.grease_quic_bit {
            put_param(buf, GREASE_QUIC_BIT, &[]);
        }
        if let Some(v) = self.min_ack_delay {
            put_var_param(buf, MIN_ACK_DELAY, v);
        }
    }

    /// Decodes the parameters `sender` announced, enforcing RFC 9000 §7.4 and §18 and the
    /// extension specifications: unknown parameters are skipped, while a repeated parameter, a
    /// server-only parameter from a client, a value whose length does not match its content, or
    /// an out-of-range value is a `TRANSPORT_PARAMETER_ERROR` whose reason names the parameter.
    ///
    /// Never panics, and allocates no more than `data.len()` bytes in total.
    pub fn decode(sender: Side, data: &[u8]) -> Result<Self, TransportError> {
        if data.len() > MAX_ENCODED_LEN {
            return Err(TransportError::TRANSPORT_PARAMETER_ERROR(format!(
                "transport parameters are {} bytes, more than a TLS extension can carry",
                data.len()
            )));
        }
        let mut params = Self::default();
        let mut seen = 0u32;
        let mut unknown = 0usize;
        for param in Params::new(data) {
            let Param { id, value, .. } = param?;
            let Some(bit) = known_index(id) else {
                unknown += 1;
                continue;
            };
            if seen & (1 << bit) != 0 {
                return Err(param_error(id, "appears more than once"));
            }
            seen |= 1 << bit;
            if sender.is_client() && SERVER_ONLY.contains(&id) {
                return Err(param_error(id, "only a server may send it"));
            }
            params.decode_value(sender, id, value)?;
        }
        if unknown > 1 {
            check_unknown_duplicates(data, unknown)?;
        }
        if let Some(min) = params.min_ack_delay {
            // max_ack_delay < 2^14 after decoding, so this cannot overflow.
            let max_us = params.max_ack_delay * 1000;
            if min > max_us {
                return Err(param_error(
                    MIN_ACK_DELAY,
                    format!(
                        "{min} µs exceeds max_ack_delay ({} ms)",
                        params.max_ack_delay
                    ),
                ));
            }
        }
        Ok(params)
    }

    /// Decodes one known parameter's value into `self`.
    fn decode_value(&mut self, sender: Side, id: u64, value: &[u8]) -> Result<(), TransportError> {
        match id {
            ORIGINAL_DESTINATION_CONNECTION_ID => {
                self.original_destination_connection_id = Some(decode_cid(id, value)?);
            }
            MAX_IDLE_TIMEOUT => self.max_idle_timeout = decode_var(id, value)?,
            STATELESS_RESET_TOKEN => {
                self.stateless_reset_token = Some(decode_token(id, value)?);
            }
            MAX_UDP_PAYLOAD_SIZE => {
                let v = decode_var(id, value)?;
                if v < MIN_UDP_PAYLOAD_SIZE {
                    return Err(param_error(
                        id,
                        format!("{v} is below the minimum of {MIN_UDP_PAYLOAD_SIZE}"),
                    ));
                }
                self.max_udp_payload_size = v;
            }
            INITIAL_MAX_DATA => self.initial_max_data = decode_var(id, value)?,
            INITIAL_MAX_STREAM_DATA_BIDI_LOCAL => {
                self.initial_max_stream_data_bidi_local = decode_var(id, value)?;
            }
            INITIAL_MAX_STREAM_DATA_BIDI_REMOTE => {
                self.initial_max_stream_data_bidi_remote = decode_var(id, value)?;
            }
            INITIAL_MAX_STREAM_DATA_UNI => {
                self.initial_max_stream_data_uni = decode_var(id, value)?;
            }
            INITIAL_MAX_STREAMS_BIDI => {
                self.initial_max_streams_bidi = decode_stream_count(id, value)?;
            }
            INITIAL_MAX_STREAMS_UNI => {
                self.initial_max_streams_uni = decode_stream_count(id, value)?;
            }
            ACK_DELAY_EXPONENT => {
                let v = decode_var(id, value)?;
                if v > MAX_ACK_DELAY_EXPONENT {
                    return Err(param_error(
                        id,
                        format!("{v} exceeds the maximum of {MAX_ACK_DELAY_EXPONENT}"),
                    ));
                }
                self.ack_delay_exponent = v;
            }
            MAX_ACK_DELAY => {
                let v = decode_var(id, value)?;
                if v >= MAX_ACK_DELAY_LIMIT {
                    return Err(param_error(id, format!("{v} ms is not below 2^14 ms")));
                }
                self.max_ack_delay = v;
            }
            DISABLE_ACTIVE_MIGRATION => {
                decode_flag(id, value)?;
                self.disable_active_migration = true;
            }
            PREFERRED_ADDRESS => {
                self.preferred_address = Some(PreferredAddress::decode(value)?);
            }
            ACTIVE_CONNECTION_ID_LIMIT => {
                let v = decode_var(id, value)?;
                if v < DEFAULT_ACTIVE_CONNECTION_ID_LIMIT {
                    return Err(param_error(id, format!("{v} is below the minimum of 2")));
                }
                self.active_connection_id_limit = v;
            }
            INITIAL_SOURCE_CONNECTION_ID => {
                self.initial_source_connection_id = Some(decode_cid(id, value)?);
            }
            RETRY_SOURCE_CONNECTION_ID => {
                self.retry_source_connection_id = Some(decode_cid(id, value)?);
            }
            VERSION_INFORMATION => {
                self.version_information = Some(VersionInformation::decode(sender, value)?);
            }
            MAX_DATAGRAM_FRAME_SIZE => {
                self.max_datagram_frame_size = Some(decode_var(id, value)?);
            }
            GREASE_QUIC_BIT => {
                decode_flag(id, value)?;
                self.grease_quic_bit = true;
            }
            MIN_ACK_DELAY => self.min_ack_delay = Some(decode_var(id, value)?),
            // `known_index` admits only the IDs above.
            _ => {}
        }
        Ok(())
    }

    /// Whether a server's new parameters (`self`) honour the limits a client used for 0-RTT
    /// (`remembered`, from [`remembered_for_0rtt`](Self::remembered_for_0rtt)): none of the
    /// limits in RFC 9000 §7.4.1, nor max_datagram_frame_size (RFC 9221 §3), may shrink.
    pub fn validate_for_0rtt(&self, remembered: &Self) -> bool {
        self.active_connection_id_limit >= remembered.active_connection_id_limit
            && self.initial_max_data >= remembered.initial_max_data
            && self.initial_max_stream_data_bidi_local
                >= remembered.initial_max_stream_data_bidi_local
            && self.initial_max_stream_data_bidi_remote
                >= remembered.initial_max_stream_data_bidi_remote
            && self.initial_max_stream_data_uni >= remembered.initial_max_stream_data_uni
            && self.initial_max_streams_bidi >= remembered.initial_max_streams_bidi
            && self.initial_max_streams_uni >= remembered.initial_max_streams_uni
            && self.max_datagram_frame_size.unwrap_or(0)
                >= remembered.max_datagram_frame_size.unwrap_or(0)
    }

    /// The server parameters a client stores with a session ticket for 0-RTT: everything
    /// except what RFC 9000 §7.4.1 forbids remembering (ack_delay_exponent, max_ack_delay,
    /// the connection IDs, preferred_address, stateless_reset_token), min_ack_delay (which the
    /// ack-frequency draft forbids remembering) and version_information (which describes one
    /// connection's negotiation). Those are left at their defaults.
    pub fn remembered_for_0rtt(&self) -> Self {
        Self {
            max_idle_timeout: self.max_idle_timeout,
            max_udp_payload_size: self.max_udp_payload_size,
            initial_max_data: self.initial_max_data,
            initial_max_stream_data_bidi_local: self.initial_max_stream_data_bidi_local,
            initial_max_stream_data_bidi_remote: self.initial_max_stream_data_bidi_remote,
            initial_max_stream_data_uni: self.initial_max_stream_data_uni,
            initial_max_streams_bidi: self.initial_max_streams_bidi,
            initial_max_streams_uni: self.initial_max_streams_uni,
            disable_active_migration: self.disable_active_migration,
            active_connection_id_limit: self.active_connection_id_limit,
            max_datagram_frame_size: self.max_datagram_frame_size,
            grease_quic_bit: self.grease_quic_bit,
            ..Self::default()
        }
    }

    /// Checks the connection IDs in a client's parameters (RFC 9000 §7.3):
    /// initial_source_connection_id must be present and equal the Source Connection ID of the
    /// client's first Initial packet.
    pub fn validate_client_cids(
        &self,
        client_initial_scid: &ConnectionId,
    ) -> Result<(), TransportError> {
        check_cid(
            INITIAL_SOURCE_CONNECTION_ID,
            self.initial_source_connection_id.as_ref(),
            Some(client_initial_scid),
        )
    }

    /// Checks the connection IDs in a server's parameters (RFC 9000 §7.3):
    /// initial_source_connection_id must equal the Source Connection ID of the server's first
    /// Initial packet, original_destination_connection_id the Destination Connection ID of the
    /// client's first Initial packet, and retry_source_connection_id must be present, and equal
    /// the Retry packet's Source Connection ID, exactly when the client received a Retry
    /// (`retry_scid`).
    pub fn validate_server_cids(
        &self,
        server_initial_scid: &ConnectionId,
        original_dcid: &ConnectionId,
        retry_scid: Option<&ConnectionId>,
    ) -> Result<(), TransportError> {
        check_cid(
            INITIAL_SOURCE_CONNECTION_ID,
            self.initial_source_connection_id.as_ref(),
            Some(server_initial_scid),
        )?;
        check_cid(
            ORIGINAL_DESTINATION_CONNECTION_ID,
            self.original_destination_connection_id.as_ref(),
            Some(original_dcid),
        )?;
        check_cid(
            RETRY_SOURCE_CONNECTION_ID,
            self.retry_source_connection_id.as_ref(),
            retry_scid,
        )
    }

    /// max_idle_timeout as a duration; `None` if the sender has no idle timeout.
    pub fn max_idle_timeout_duration(&self) -> Option<Duration> {
        (self.max_idle_timeout != 0).then(|| Duration::from_millis(self.max_idle_timeout))
    }

    /// max_ack_delay as a duration.
    pub fn max_ack_delay_duration(&self) -> Duration {
        Duration::from_millis(self.max_ack_delay)
    }

    /// min_ack_delay as a duration, if the sender supports the ack-frequency extension.
    pub fn min_ack_delay_duration(&self) -> Option<Duration> {
        self.min_ack_delay.map(Duration::from_micros)
    }
}

impl PreferredAddress {
    /// Size of the value without the connection ID.
    const FIXED_LEN: usize = 4 + 2 + 16 + 2 + 1 + RESET_TOKEN_SIZE;

    fn encode(&self, buf: &mut Vec<u8>) {
        let v4 = self
            .v4
            .unwrap_or_else(|| SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
        buf.put_slice(&v4.ip().octets());
        buf.put_u16(v4.port());
        let v6 = self
            .v6
            .unwrap_or_else(|| SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0));
        buf.put_slice(&v6.ip().octets());
        buf.put_u16(v6.port());
        buf.put_u8(self.cid.len() as u8);
        buf.put_slice(&self.cid);
        buf.put_slice(&self.reset_token);
    }

    fn decode(value: &[u8]) -> Result<Self, TransportError> {
        let err = |msg: String| param_error(PREFERRED_ADDRESS, msg);
        if value.len() < Self::FIXED_LEN {
            return Err(err(format!(
                "{} bytes is shorter than the minimum of {}",
                value.len(),
                Self::FIXED_LEN
            )));
        }
        let truncated = |_| err("truncated".into());
        let mut r = value;
        let mut ip4 = [0u8; 4];
        r.copy_to_checked(&mut ip4).map_err(truncated)?;
        let port4 = r.get_u16_checked().map_err(truncated)?;
        let mut ip6 = [0u8; 16];
        r.copy_to_checked(&mut ip6).map_err(truncated)?;
        let port6 = r.get_u16_checked().map_err(truncated)?;
        let cid_len = usize::from(r.get_u8_checked().map_err(truncated)?);
        if cid_len == 0 {
            return Err(err("zero-length connection ID".into()));
        }
        if cid_len > MAX_CID_SIZE {
            return Err(err(format!(
                "connection ID length {cid_len} exceeds {MAX_CID_SIZE}"
            )));
        }
        if r.len() != cid_len + RESET_TOKEN_SIZE {
            return Err(err(format!(
                "length {} does not match a {cid_len}-byte connection ID",
                value.len()
            )));
        }
        let (cid, token) = r.split_at(cid_len);
        let cid =
            ConnectionId::try_from_slice(cid).ok_or_else(|| err("bad connection ID".into()))?;
        let mut reset_token = [0u8; RESET_TOKEN_SIZE];
        reset_token.copy_from_slice(token);
        let ip4 = Ipv4Addr::from(ip4);
        let ip6 = Ipv6Addr::from(ip6);
        Ok(Self {
            v4: (!(ip4.is_unspecified() && port4 == 0)).then(|| SocketAddrV4::new(ip4, port4)),
            v6: (!(ip6.is_unspecified() && port6 == 0))
                .then(|| SocketAddrV6::new(ip6, port6, 0, 0)),
            cid,
            reset_token,
        })
    }
}

impl VersionInformation {
    fn decode(sender: Side, value: &[u8]) -> Result<Self, TransportError> {
        let err = |msg: String| param_error(VERSION_INFORMATION, msg);
        if value.len() < 4 || !value.len().is_multiple_of(4) {
            return Err(err(format!(
                "length {} is not a positive multiple of 4",
                value.len()
            )));
        }
        let mut words = value
            .chunks_exact(4)
            .map(|w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
        let chosen = words.next().unwrap_or(0);
        if chosen == 0 {
            return Err(err("chosen version is 0".into()));
        }
        // Exact-size iterator: one allocation of `value.len() - 4` bytes.
        let available: Vec<u32> = words.collect();
        if available.contains(&0) {
            return Err(err("available versions include 0".into()));
        }
        // RFC 9368 §4: a client's chosen version must be among its available versions.
        if sender.is_client() && !available.contains(&chosen) {
            return Err(err(format!(
                "chosen version {chosen:#010x} is not among the client's available versions"
            )));
        }
        Ok(Self { chosen, available })
    }
}

/// One `(id, length, value)` triple; `offset` is where the ID starts in the input.
struct Param<'a> {
    offset: usize,
    id: u64,
    value: &'a [u8],
}

/// Splits an encoding into parameters, checking only the framing.
struct Params<'a> {
    data: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Params<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, rest: data }
    }
}

impl<'a> Iterator for Params<'a> {
    type Item = Result<Param<'a>, TransportError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let offset = self.data.len() - self.rest.len();
        let result = (|| {
            let mut r = self.rest;
            let id = r.get_var().map_err(|_| {
                TransportError::TRANSPORT_PARAMETER_ERROR("truncated transport parameter ID")
            })?;
            let len = r
                .get_var()
                .map_err(|_| param_error(id, "truncated length"))?;
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= r.len())
                .ok_or_else(|| {
                    param_error(
                        id,
                        format!("length {len} exceeds the {} bytes left", r.len()),
                    )
                })?;
            let (value, rest) = r.split_at(len);
            Ok((Param { offset, id, value }, rest))
        })();
        match result {
            Ok((param, rest)) => {
                self.rest = rest;
                Some(Ok(param))
            }
            Err(e) => {
                // Stop after the first framing error.
                self.rest = &[];
                Some(Err(e))
            }
        }
    }
}

/// Rejects a repeated unknown parameter (RFC 9000 §7.4). `data` has already been framed
/// successfully and holds `count` unknown parameters. Their offsets fit in a `u16` because the
/// input is at most 65535 bytes, and each parameter takes at least 2 bytes, so the offset list
/// is no larger than the input.
fn check_unknown_duplicates(data: &[u8], count: usize) -> Result<(), TransportError> {
    let mut offsets: Vec<u16> = Vec::with_capacity(count);
    for param in Params::new(data) {
        let param = param?;
        if known_index(param.id).is_none() {
            let offset = u16::try_from(param.offset).map_err(|_| {
                TransportError::TRANSPORT_PARAMETER_ERROR("transport parameters too long")
            })?;
            offsets.push(offset);
        }
    }
    let id_at = |offset: u16| {
        let mut r = data.get(usize::from(offset)..).unwrap_or_default();
        r.get_var().unwrap_or(u64::MAX)
    };
    offsets.sort_unstable_by_key(|&o| id_at(o));
    match offsets.windows(2).find(|w| id_at(w[0]) == id_at(w[1])) {
        Some(w) => Err(param_error(id_at(w[0]), "appears more than once")),
        None => Ok(()),
    }
}

/// Bit position of a known parameter in the duplicate mask.
fn known_index(id: u64) -> Option<u32> {
    match id {
        ORIGINAL_DESTINATION_CONNECTION_ID..=VERSION_INFORMATION => Some(id as u32),
        MAX_DATAGRAM_FRAME_SIZE => Some(18),
        GREASE_QUIC_BIT => Some(19),
        MIN_ACK_DELAY => Some(20),
        _ => None,
    }
}

fn param_name(id: u64) -> Option<&'static str> {
    Some(match id {
        ORIGINAL_DESTINATION_CONNECTION_ID => "original_destination_connection_id",
        MAX_IDLE_TIMEOUT => "max_idle_timeout",
        STATELESS_RESET_TOKEN => "stateless_reset_token",
        MAX_UDP_PAYLOAD_SIZE => "max_udp_payload_size",
        INITIAL_MAX_DATA => "initial_max_data",
        INITIAL_MAX_STREAM_DATA_BIDI_LOCAL => "initial_max_stream_data_bidi_local",
        INITIAL_MAX_STREAM_DATA_BIDI_REMOTE => "initial_max_stream_data_bidi_remote",
        INITIAL_MAX_STREAM_DATA_UNI => "initial_max_stream_data_uni",
        INITIAL_MAX_STREAMS_BIDI => "initial_max_streams_bidi",
        INITIAL_MAX_STREAMS_UNI => "initial_max_streams_uni",
        ACK_DELAY_EXPONENT => "ack_delay_exponent",
        MAX_ACK_DELAY => "max_ack_delay",
        DISABLE_ACTIVE_MIGRATION => "disable_active_migration",
        PREFERRED_ADDRESS => "preferred_address",
        ACTIVE_CONNECTION_ID_LIMIT => "active_connection_id_limit",
        INITIAL_SOURCE_CONNECTION_ID => "initial_source_connection_id",
        RETRY_SOURCE_CONNECTION_ID => "retry_source_connection_id",
        VERSION_INFORMATION => "version_information",
        MAX_DATAGRAM_FRAME_SIZE => "max_datagram_frame_size",
        GREASE_QUIC_BIT => "grease_quic_bit",
        MIN_ACK_DELAY => "min_ack_delay",
        _ => return None,
    })
}

/// Names a parameter in error reasons, e.g. `max_ack_delay (0xb)`.
struct Describe(u64);

impl fmt::Display for Describe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match param_name(self.0) {
            Some(name) => write!(f, "{name} ({:#x})", self.0),
            None => write!(f, "transport parameter {:#x}", self.0),
        }
    }
}

fn param_error(id: u64, msg: impl fmt::Display) -> TransportError {
    TransportError::TRANSPORT_PARAMETER_ERROR(format!("{}: {msg}", Describe(id)))
}

/// A value that must be exactly one varint.
fn decode_var(id: u64, value: &[u8]) -> Result<u64, TransportError> {
    let mut r = value;
    let v = r
        .get_var()
        .map_err(|_| param_error(id, "value is not a complete varint"))?;
    if !r.is_empty() {
        return Err(param_error(
            id,
            format!("{} trailing bytes after the varint", r.len()),
        ));
    }
    Ok(v)
}

fn decode_stream_count(id: u64, value: &[u8]) -> Result<u64, TransportError> {
    let v = decode_var(id, value)?;
    if v > MAX_STREAM_COUNT {
        return Err(param_error(id, format!("{v} exceeds 2^60")));
    }
    Ok(v)
}

fn decode_cid(id: u64, value: &[u8]) -> Result<ConnectionId, TransportError> {
    ConnectionId::try_from_slice(value).ok_or_else(|| {
        param_error(
            id,
            format!(
                "connection ID length {} exceeds {MAX_CID_SIZE}",
                value.len()
            ),
        )
    })
}

fn decode_token(id: u64, value: &[u8]) -> Result<[u8; 16], TransportError> {
    <[u8; RESET_TOKEN_SIZE]>::try_from(value).map_err(|_| {
        param_error(
            id,
            format!("length {} is not {RESET_TOKEN_SIZE}", value.len()),
        )
    })
}

/// A parameter whose presence is the whole message.
fn decode_flag(id: u64, value: &[u8]) -> Result<(), TransportError> {
    if !value.is_empty() {
        return Err(param_error(
            id,
            format!("value must be empty, got {} bytes", value.len()),
        ));
    }
    Ok(())
}

fn check_cid(
    id: u64,
    got: Option<&ConnectionId>,
    expected: Option<&ConnectionId>,
) -> Result<(), TransportError> {
    match (got, expected) {
        (None, None) => Ok(()),
        (Some(g), Some(e)) if g == e => Ok(()),
        (Some(g), Some(e)) => Err(param_error(id, format!("{g} does not match {e}"))),
        (None, Some(_)) => Err(param_error(id, "missing")),
        (Some(_), None) => Err(param_error(id, "present although no Retry happened")),
    }
}

fn put_param(buf: &mut Vec<u8>, id: u64, value: &[u8]) {
    buf.put_var(id);
    buf.put_var(value.len() as u64);
    buf.put_slice(value);
}

fn put_var_param(buf: &mut Vec<u8>, id: u64, v: u64) {
    buf.put_var(id);
    buf.put_var(VarInt::size_of(v) as u64);
    buf.put_var(v);
}

fn put_var_if(buf: &mut Vec<u8>, id: u64, v: u64, default: u64) {
    if v != default {
        put_var_param(buf, id, v);
    }
}

/// Appends a reserved parameter (RFC 9000 §18.1) of a random encoded size.
fn put_grease<R: Rng + ?Sized>(buf: &mut Vec<u8>, rng: &mut R) {
    const LIMITS: [u64; 4] = [(1 << 6) - 1, (1 << 14) - 1, (1 << 30) - 1, (1 << 62) - 1];
    let limit = LIMITS[rng.random_range(0..LIMITS.len())];
    let id = loop {
        let id = 31 * rng.random_range(0..=(limit - 27) / 31) + 27;
        if known_index(id).is_none() {
            break id;
        }
    };
    let mut value = [0u8; MAX_GREASE_VALUE_LEN];
    let len = rng.random_range(0..=MAX_GREASE_VALUE_LEN);
    rng.fill_bytes(&mut value[..len]);
    put_param(buf, id, &value[..len]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{RngCore, SeedableRng};

    fn full() -> TransportParameters {
        TransportParameters {
            original_destination_connection_id: Some(ConnectionId::new(&[1, 2, 3, 4, 5, 6, 7, 8])),
            max_idle_timeout: 30_000,
            stateless_reset_token: Some([0xab; 16]),
            max_udp_payload_size: 1472,
            initial_max_data: 1 << 40,
            initial_max_stream_data_bidi_local: 1 << 20,
            initial_max_stream_data_bidi_remote: (1 << 20) + 1,
            initial_max_stream_data_uni: 100_000,
            initial_max_streams_bidi: 1 << 60,
            initial_max_streams_uni: 3,
            ack_delay_exponent: 20,
            max_ack_delay: (1 << 14) - 1,
            disable_active_migration: true,
            preferred_address: Some(PreferredAddress {
                v4: Some(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 4433)),
                v6: Some(SocketAddrV6::new(
                    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
                    4434,
                    0,
                    0,
                )),
                cid: ConnectionId::new(&[9; 20]),
                reset_token: [0xcd; 16],
            }),
            active_connection_id_limit: 8,
            initial_source_connection_id: Some(ConnectionId::EMPTY),
            retry_source_connection_id: Some(ConnectionId::new(&[7; 4])),
            version_information: Some(VersionInformation {
                chosen: 0x6b33_43cf,
                available: vec![0x6b33_43cf, 1, 0x0a1a_2a3a],
            }),
            max_datagram_frame_size: Some(65535),
            grease_quic_bit: true,
            min_ack_delay: Some(1000),
        }
    }

    fn encode_seeded(p: &TransportParameters, seed: u64) -> Vec<u8> {
        let mut buf = Vec::new();
        p.encode_with_rng(&mut buf, &mut StdRng::seed_from_u64(seed));
        buf
    }

    /// Builds one `(id, len, value)` triple.
    fn tp(id: u64, value: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        put_param(&mut buf, id, value);
        buf
    }

    fn var(v: u64) -> Vec<u8> {
        let mut buf = Vec::new();
        buf.put_var(v);
        buf
    }

    fn expect_error(sender: Side, data: &[u8], needle: &str) {
        match TransportParameters::decode(sender, data) {
            Ok(p) => panic!("accepted {data:02x?} as {p:?}; expected an error about {needle}"),
            Err(e) => {
                assert_eq!(
                    e.code,
                    crate::error::TransportErrorCode::TRANSPORT_PARAMETER_ERROR,
                    "{e:?}"
                );
                assert!(
                    e.reason.contains(needle),
                    "reason {:?} does not mention {needle:?}",
                    e.reason
                );
            }
        }
    }

    fn expect_ok(sender: Side, data: &[u8]) -> TransportParameters {
        TransportParameters::decode(sender, data).unwrap_or_else(|e| panic!("{data:02x?}: {e}"))
    }

    #[test]
    fn full_round_trip() {
        let p = full();
        for seed in 0..32 {
            let buf = encode_seeded(&p, seed);
            assert_eq!(expect_ok(Side::Server, &buf), p);
        }
        // The OS-seeded path as well.
        let mut buf = Vec::new();
        p.encode(&mut buf);
        assert_eq!(expect_ok(Side::Server, &buf), p);
    }

    #[test]
    fn client_round_trip() {
        let p = TransportParameters {
            original_destination_connection_id: None,
            stateless_reset_token: None,
            preferred_address: None,
            retry_source_connection_id: None,
            version_information: Some(VersionInformation {
                chosen: 1,
                available: vec![1, 0x6b33_43cf],
            }),
            ..full()
        };
        assert_eq!(expect_ok(Side::Client, &encode_seeded(&p, 7)), p);
    }

    #[test]
    fn preferred_address_single_family() {
        for (v4, v6) in [
            (
                Some(SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 7), 443)),
                None,
            ),
            (
                None,
                Some(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 443, 0, 0)),
            ),
        ] {
            let p = TransportParameters {
                preferred_address: Some(PreferredAddress {
                    v4,
                    v6,
                    cid: ConnectionId::new(&[1]),
                    reset_token: [2; 16],
                }),
                ..TransportParameters::default()
            };
            assert_eq!(expect_ok(Side::Server, &encode_seeded(&p, 1)), p);
        }
    }

    #[test]
    fn defaults_encode_to_grease_only() {
        let d = TransportParameters::default();
        let mut plain = Vec::new();
        d.encode_without_grease(&mut plain);
        assert!(plain.is_empty(), "{plain:02x?}");

        let mut sizes = [false; 4];
        for seed in 0..200 {
            let buf = encode_seeded(&d, seed);
            let mut r = &buf[..];
            let id = r.get_var().unwrap();
            let len = r.get_var().unwrap() as usize;
            assert_eq!(id % 31, 27, "grease ID {id:#x}");
            assert!(len <= MAX_GREASE_VALUE_LEN);
            assert_eq!(r.len(), len, "exactly one parameter");
            sizes[VarInt::size_of(id).trailing_zeros() as usize] = true;
            assert_eq!(expect_ok(Side::Client, &buf), d);
            assert_eq!(expect_ok(Side::Server, &buf), d);
        }
        assert_eq!(sizes, [true; 4], "grease IDs of every varint size");
        assert_eq!(expect_ok(Side::Client, &[]), d);
    }

    #[test]
    fn defaults() {
        let d = TransportParameters::default();
        assert_eq!(d.max_udp_payload_size, 65527);
        assert_eq!(d.ack_delay_exponent, 3);
        assert_eq!(d.max_ack_delay, 25);
        assert_eq!(d.active_connection_id_limit, 2);
        assert_eq!(d.max_idle_timeout_duration(), None);
        assert_eq!(d.max_ack_delay_duration(), Duration::from_millis(25));
        assert_eq!(d.min_ack_delay_duration(), None);
        let p = TransportParameters {
            max_idle_timeout: 1500,
            min_ack_delay: Some(250),
            ..d
        };
        assert_eq!(
            p.max_idle_timeout_duration(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(p.min_ack_delay_duration(), Some(Duration::from_micros(250)));
    }

    #[test]
    fn byte_exact_decode() {
        #[rustfmt::skip]
        let data: &[u8] = &[
            0x01, 0x02, 0x67, 0x10,             // max_idle_timeout = 10000
            0x04, 0x04, 0x80, 0x10, 0x00, 0x00, // initial_max_data = 1 MiB
            0x08, 0x02, 0x40, 0x25,             // initial_max_streams_bidi = 37, non-minimal
            0x0b, 0x01, 0x0a,                   // max_ack_delay = 10
            0x0c, 0x00,                         // disable_active_migration
            0x1b, 0x03, 0xaa, 0xbb, 0xcc,       // reserved parameter 27, ignored
            0x0f, 0x04, 0xde, 0xad, 0xbe, 0xef, // initial_source_connection_id
            0x11, 0x08, 0x00, 0x00, 0x00, 0x01,
                        0x00, 0x00, 0x00, 0x01, // version_information v1 [v1]
            0x20, 0x02, 0x44, 0xb0,             // max_datagram_frame_size = 1200
            0x40, 0x00, 0x00,                   // original_destination_connection_id, 2-byte ID, empty
        ];
        // The last triple is server-only; a client's parameters stop before it.
        let client_data = &data[..data.len() - 3];
        let p = expect_ok(Side::Client, client_data);
        assert_eq!(
            p,
            TransportParameters {
                max_idle_timeout: 10_000,
                initial_max_data: 1 << 20,
                initial_max_streams_bidi: 37,
                max_ack_delay: 10,
                disable_active_migration: true,
                initial_source_connection_id: Some(ConnectionId::new(&[0xde, 0xad, 0xbe, 0xef])),
                version_information: Some(VersionInformation {
                    chosen: 1,
                    available: vec![1],
                }),
                max_datagram_frame_size: Some(1200),
                ..TransportParameters::default()
            }
        );
        expect_error(Side::Client, data, "original_destination_connection_id");
        let s = expect_ok(Side::Server, data);
        assert_eq!(
            s,
            TransportParameters {
                original_destination_connection_id: Some(ConnectionId::EMPTY),
                ..p.clone()
            }
        );

        // And the encoder writes the canonical form: ascending IDs, minimal varints.
        let mut out = Vec::new();
        p.encode_without_grease(&mut out);
        #[rustfmt::skip]
        let expected: &[u8] = &[
            0x01, 0x02, 0x67, 0x10,
            0x04, 0x04, 0x80, 0x10, 0x00, 0x00,
            0x08, 0x01, 0x25,
            0x0b, 0x01, 0x0a,
            0x0c, 0x00,
            0x0f, 0x04, 0xde, 0xad, 0xbe, 0xef,
            0x11, 0x08, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01,
            0x20, 0x02, 0x44, 0xb0,
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn byte_exact_preferred_address_and_extensions() {
        let mut data = Vec::new();
        data.extend_from_slice(&[0x0d, 0x2c]); // preferred_address, 44 bytes
        data.extend_from_slice(&[10, 0, 0, 1, 0x01, 0xbb]); // 10.0.0.1:443
        data.extend_from_slice(&[0; 18]); // no IPv6
        data.extend_from_slice(&[3, 0xc1, 0xc2, 0xc3]); // CID
        data.extend_from_slice(&[0x77; 16]); // token
        data.extend_from_slice(&[0x6a, 0xb2, 0x00]); // grease_quic_bit
        data.extend_from_slice(&[0xc0, 0, 0, 0, 0xff, 0x04, 0xde, 0x1b, 0x02, 0x43, 0xe8]); // min_ack_delay 1000
        let p = expect_ok(Side::Server, &data);
        assert_eq!(
            p,
            TransportParameters {
                preferred_address: Some(PreferredAddress {
                    v4: Some(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 443)),
                    v6: None,
                    cid: ConnectionId::new(&[0xc1, 0xc2, 0xc3]),
                    reset_token: [0x77; 16],
                }),
                grease_quic_bit: true,
                min_ack_delay: Some(1000),
                ..TransportParameters::default()
            }
        );
        let mut out = Vec::new();
        p.encode_without_grease(&mut out);
        assert_eq!(out, data);
    }

    #[test]
    fn rejects_duplicates() {
        let mut data = tp(INITIAL_MAX_DATA, &var(10));
        data.extend(tp(INITIAL_MAX_STREAMS_UNI, &var(1)));
        data.extend(tp(INITIAL_MAX_DATA, &var(10)));
        expect_error(
            Side::Client,
            &data,
            "initial_max_data (0x4): appears more than once",
        );

        let mut data = tp(GREASE_QUIC_BIT, &[]);
        data.extend(tp(GREASE_QUIC_BIT, &[]));
        expect_error(Side::Server, &data, "grease_quic_bit");

        // Unknown parameters, even reserved ones, may not repeat either.
        let mut data = tp(27, &[1]);
        data.extend(tp(0x1234, &[]));
        data.extend(tp(58, &[]));
        expect_ok(Side::Client, &data);
        data.extend(tp(0x1234, &[5, 6]));
        expect_error(
            Side::Client,
            &data,
            "transport parameter 0x1234: appears more than once",
        );
        // The same ID in a different varint width is still the same ID.
        let mut data = tp(27, &[]);
        data.extend_from_slice(&[0x40, 27, 0]);
        expect_error(Side::Client, &data, "transport parameter 0x1b");
    }

    #[test]
    fn rejects_server_only_from_client() {
        let cases = [
            (ORIGINAL_DESTINATION_CONNECTION_ID, vec![1, 2, 3, 4]),
            (STATELESS_RESET_TOKEN, vec![0; 16]),
            (
                PREFERRED_ADDRESS,
                [&[0u8; 24][..], &[1, 9], &[0; 16]].concat(),
            ),
            (RETRY_SOURCE_CONNECTION_ID, vec![1]),
        ];
        for (id, value) in cases {
            let data = tp(id, &value);
            expect_ok(Side::Server, &data);
            expect_error(
                Side::Client,
                &data,
                &format!(
                    "{} ({id:#x}): only a server may send it",
                    param_name(id).unwrap()
                ),
            );
        }
    }

    #[test]
    fn rejects_bad_varint_lengths() {
        for id in [
            MAX_IDLE_TIMEOUT,
            MAX_UDP_PAYLOAD_SIZE,
            INITIAL_MAX_DATA,
            INITIAL_MAX_STREAM_DATA_BIDI_LOCAL,
            INITIAL_MAX_STREAM_DATA_BIDI_REMOTE,
            INITIAL_MAX_STREAM_DATA_UNI,
            INITIAL_MAX_STREAMS_BIDI,
            INITIAL_MAX_STREAMS_UNI,
            ACK_DELAY_EXPONENT,
            MAX_ACK_DELAY,
            ACTIVE_CONNECTION_ID_LIMIT,
            MAX_DATAGRAM_FRAME_SIZE,
            MIN_ACK_DELAY,
        ] {
            let name = param_name(id).unwrap();
            // 1200 is valid for all of them but ack_delay_exponent.
            let good = var(1200);
            let mut trailing = good.clone();
            trailing.push(0);
            expect_error(Side::Client, &tp(id, &trailing), name);
            expect_error(Side::Client, &tp(id, &trailing), "trailing");
            // Varint announces 2 bytes but the value has 1.
            expect_error(Side::Client, &tp(id, &good[..1]), name);
            expect_error(Side::Client, &tp(id, &[]), "not a complete varint");
            if id != ACK_DELAY_EXPONENT {
                expect_ok(Side::Client, &tp(id, &good));
            }
        }
    }

    #[test]
    fn rejects_bad_framing() {
        // Truncated ID.
        expect_error(Side::Client, &[0x40], "truncated transport parameter ID");
        // Truncated length.
        expect_error(
            Side::Client,
            &[0x04, 0x40],
            "initial_max_data (0x4): truncated length",
        );
        // Length beyond the end.
        expect_error(
            Side::Client,
            &[0x04, 0x05, 0x01],
            "initial_max_data (0x4): length 5",
        );
        expect_error(
            Side::Client,
            &[0x71, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            "transport parameter 0x3100: length",
        );
        // Trailing garbage after a valid parameter.
        expect_error(Side::Client, &[0x0c, 0x00, 0x0f], "truncated length");
        // Input no TLS extension could carry.
        let mut big = Vec::new();
        while big.len() <= MAX_ENCODED_LEN {
            big.extend(tp(0x3fff, &[0; 200]));
        }
        expect_error(Side::Client, &big, "more than a TLS extension can carry");
    }

    #[test]
    fn rejects_out_of_range_values() {
        let cases: &[(u64, u64, u64, &str)] = &[
            // (id, largest/smallest accepted, rejected, message)
            (
                MAX_UDP_PAYLOAD_SIZE,
                1200,
                1199,
                "below the minimum of 1200",
            ),
            (
                INITIAL_MAX_STREAMS_BIDI,
                1 << 60,
                (1 << 60) + 1,
                "exceeds 2^60",
            ),
            (
                INITIAL_MAX_STREAMS_UNI,
                1 << 60,
                (1 << 60) + 1,
                "exceeds 2^60",
            ),
            (ACK_DELAY_EXPONENT, 20, 21, "exceeds the maximum of 20"),
            (MAX_ACK_DELAY, (1 << 14) - 1, 1 << 14, "not below 2^14"),
            (ACTIVE_CONNECTION_ID_LIMIT, 2, 1, "below the minimum of 2"),
        ];
        for &(id, good, bad, msg) in cases {
            let name = param_name(id).unwrap();
            expect_ok(Side::Client, &tp(id, &var(good)));
            expect_error(
                Side::Client,
                &tp(id, &var(bad)),
                &format!("{name} ({id:#x}): {bad}"),
            );
            expect_error(Side::Client, &tp(id, &var(bad)), msg);
        }
        expect_error(
            Side::Client,
            &tp(ACTIVE_CONNECTION_ID_LIMIT, &var(0)),
            "active_connection_id_limit",
        );
        expect_error(
            Side::Client,
            &tp(ACK_DELAY_EXPONENT, &var(VarInt::MAX.into_inner())),
            "ack_delay_exponent",
        );
    }

    #[test]
    fn rejects_non_empty_flags() {
        for id in [DISABLE_ACTIVE_MIGRATION, GREASE_QUIC_BIT] {
            let name = param_name(id).unwrap();
            expect_error(Side::Client, &tp(id, &[0]), name);
            expect_error(Side::Server, &tp(id, &[1, 2]), "value must be empty");
        }
    }

    #[test]
    fn rejects_bad_tokens_and_cids() {
        for len in [0, 1, 15, 17, 32] {
            expect_error(
                Side::Server,
                &tp(STATELESS_RESET_TOKEN, &vec![0; len]),
                &format!("stateless_reset_token (0x2): length {len} is not 16"),
            );
        }
        for id in [
            ORIGINAL_DESTINATION_CONNECTION_ID,
            INITIAL_SOURCE_CONNECTION_ID,
            RETRY_SOURCE_CONNECTION_ID,
        ] {
            let name = param_name(id).unwrap();
            expect_ok(Side::Server, &tp(id, &[0; 20]));
            expect_error(Side::Server, &tp(id, &[0; 21]), name);
            expect_error(Side::Server, &tp(id, &[0; 21]), "length 21 exceeds 20");
        }
    }

    fn preferred(cid_len: u8, cid: &[u8], extra: &[u8]) -> Vec<u8> {
        let value = [
            &[192, 0, 2, 1, 0x11, 0x51][..],
            &[0; 18],
            &[cid_len],
            cid,
            &[0x55; 16],
            extra,
        ]
        .concat();
        tp(PREFERRED_ADDRESS, &value)
    }

    #[test]
    fn rejects_bad_preferred_address() {
        expect_ok(Side::Server, &preferred(2, &[1, 2], &[]));
        expect_error(
            Side::Server,
            &preferred(0, &[], &[]),
            "preferred_address (0xd): zero-length connection ID",
        );
        expect_error(
            Side::Server,
            &preferred(21, &[0; 21], &[]),
            "preferred_address (0xd): connection ID length 21 exceeds 20",
        );
        // CID length disagrees with the parameter length, either way.
        expect_error(Side::Server, &preferred(2, &[1, 2], &[0]), "does not match");
        expect_error(Side::Server, &preferred(3, &[1, 2], &[]), "does not match");
        // Shorter than the fixed part.
        expect_error(
            Side::Server,
            &tp(PREFERRED_ADDRESS, &[0; 40]),
            "preferred_address (0xd): 40 bytes is shorter",
        );
        expect_error(
            Side::Server,
            &tp(PREFERRED_ADDRESS, &[]),
            "preferred_address",
        );
    }

    #[test]
    fn rejects_bad_version_information() {
        let vi = |words: &[u32]| {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_be_bytes()).collect();
            tp(VERSION_INFORMATION, &bytes)
        };
        for len in [0usize, 1, 3, 5, 6, 7, 9] {
            expect_error(
                Side::Server,
                &tp(VERSION_INFORMATION, &vec![1; len]),
                &format!(
                    "version_information (0x11): length {len} is not a positive multiple of 4"
                ),
            );
        }
        expect_error(
            Side::Server,
            &vi(&[0]),
            "version_information (0x11): chosen version is 0",
        );
        expect_error(Side::Client, &vi(&[0, 0]), "chosen version is 0");
        expect_error(
            Side::Server,
            &vi(&[1, 2, 0]),
            "available versions include 0",
        );
        // A client's chosen version must be among its available versions; a server's need not.
        expect_error(
            Side::Client,
            &vi(&[1, 2]),
            "not among the client's available versions",
        );
        expect_error(Side::Client, &vi(&[1]), "not among");
        let p = expect_ok(Side::Server, &vi(&[1]));
        assert_eq!(
            p.version_information,
            Some(VersionInformation {
                chosen: 1,
                available: vec![]
            })
        );
        expect_ok(Side::Server, &vi(&[1, 0x6b33_43cf]));
        expect_ok(Side::Client, &vi(&[1, 0x6b33_43cf, 1]));
    }

    #[test]
    fn rejects_min_ack_delay_above_max_ack_delay() {
        // Default max_ack_delay of 25 ms.
        expect_ok(Side::Client, &tp(MIN_ACK_DELAY, &var(25_000)));
        expect_error(
            Side::Client,
            &tp(MIN_ACK_DELAY, &var(25_001)),
            "min_ack_delay (0xff04de1b): 25001 µs exceeds max_ack_delay (25 ms)",
        );
        // An explicit max_ack_delay, whichever comes first.
        let min = tp(MIN_ACK_DELAY, &var(5_000));
        let max_ok = tp(MAX_ACK_DELAY, &var(5));
        let max_low = tp(MAX_ACK_DELAY, &var(4));
        expect_ok(Side::Client, &[min.clone(), max_ok.clone()].concat());
        expect_ok(Side::Client, &[max_ok, min.clone()].concat());
        expect_error(
            Side::Client,
            &[min.clone(), max_low.clone()].concat(),
            "min_ack_delay",
        );
        expect_error(Side::Client, &[max_low, min].concat(), "min_ack_delay");
        // 0 is fine even with max_ack_delay 0.
        let zero = [tp(MAX_ACK_DELAY, &var(0)), tp(MIN_ACK_DELAY, &var(0))].concat();
        assert_eq!(expect_ok(Side::Server, &zero).min_ack_delay, Some(0));
    }

    #[test]
    fn zero_rtt_limits() {
        let server = full();
        let remembered = server.remembered_for_0rtt();
        assert_eq!(
            remembered,
            TransportParameters {
                max_idle_timeout: 30_000,
                max_udp_payload_size: 1472,
                initial_max_data: 1 << 40,
                initial_max_stream_data_bidi_local: 1 << 20,
                initial_max_stream_data_bidi_remote: (1 << 20) + 1,
                initial_max_stream_data_uni: 100_000,
                initial_max_streams_bidi: 1 << 60,
                initial_max_streams_uni: 3,
                disable_active_migration: true,
                active_connection_id_limit: 8,
                max_datagram_frame_size: Some(65535),
                grease_quic_bit: true,
                ..TransportParameters::default()
            }
        );
        // The remembered set survives storage as an encoding, decoded as the server's.
        let stored = encode_seeded(&remembered, 3);
        assert_eq!(expect_ok(Side::Server, &stored), remembered);
        // Nor would a client send it in a way a server rejects.
        assert_eq!(expect_ok(Side::Client, &stored), remembered);

        assert!(server.validate_for_0rtt(&remembered));
        assert!(server.validate_for_0rtt(&TransportParameters::default()));
        let raised = TransportParameters {
            initial_max_data: (1 << 40) + 1,
            max_ack_delay: 1,
            ack_delay_exponent: 0,
            max_idle_timeout: 1,
            ..server.clone()
        };
        assert!(raised.validate_for_0rtt(&remembered));

        type Lower = fn(&mut TransportParameters);
        let lowerings: [(&str, Lower); 8] = [
            ("active_connection_id_limit", |p| {
                p.active_connection_id_limit -= 1
            }),
            ("initial_max_data", |p| p.initial_max_data -= 1),
            ("bidi_local", |p| p.initial_max_stream_data_bidi_local -= 1),
            ("bidi_remote", |p| {
                p.initial_max_stream_data_bidi_remote -= 1
            }),
            ("uni", |p| p.initial_max_stream_data_uni -= 1),
            ("streams_bidi", |p| p.initial_max_streams_bidi -= 1),
            ("streams_uni", |p| p.initial_max_streams_uni -= 1),
            ("datagram", |p| p.max_datagram_frame_size = Some(65534)),
        ];
        for (what, lower) in lowerings {
            let mut p = server.clone();
            lower(&mut p);
            assert!(!p.validate_for_0rtt(&remembered), "{what} lowered");
        }
        let no_datagrams = TransportParameters {
            max_datagram_frame_size: None,
            ..server.clone()
        };
        assert!(!no_datagrams.validate_for_0rtt(&remembered));
        let remembered_none = TransportParameters {
            max_datagram_frame_size: None,
            ..remembered.clone()
        };
        assert!(no_datagrams.validate_for_0rtt(&remembered_none));
    }

    #[test]
    fn connection_id_checks() {
        let scid = ConnectionId::new(&[1; 8]);
        let odcid = ConnectionId::new(&[2; 8]);
        let retry = ConnectionId::new(&[3; 8]);
        let other = ConnectionId::new(&[4; 8]);

        let client = TransportParameters {
            initial_source_connection_id: Some(scid),
            ..TransportParameters::default()
        };
        assert!(client.validate_client_cids(&scid).is_ok());
        let e = client.validate_client_cids(&other).unwrap_err();
        assert!(e.reason.contains("initial_source_connection_id"), "{e}");
        let e = TransportParameters::default()
            .validate_client_cids(&scid)
            .unwrap_err();
        assert!(
            e.reason
                .contains("initial_source_connection_id (0xf): missing"),
            "{e}"
        );

        let server = TransportParameters {
            initial_source_connection_id: Some(scid),
            original_destination_connection_id: Some(odcid),
            ..TransportParameters::default()
        };
        assert!(server.validate_server_cids(&scid, &odcid, None).is_ok());
        let e = server
            .validate_server_cids(&scid, &other, None)
            .unwrap_err();
        assert!(
            e.reason.contains("original_destination_connection_id"),
            "{e}"
        );
        let e = server
            .validate_server_cids(&scid, &odcid, Some(&retry))
            .unwrap_err();
        assert!(
            e.reason
                .contains("retry_source_connection_id (0x10): missing"),
            "{e}"
        );
        let after_retry = TransportParameters {
            retry_source_connection_id: Some(retry),
            ..server.clone()
        };
        assert!(
            after_retry
                .validate_server_cids(&scid, &odcid, Some(&retry))
                .is_ok()
        );
        assert!(
            after_retry
                .validate_server_cids(&scid, &odcid, Some(&other))
                .is_err()
        );
        let e = after_retry
            .validate_server_cids(&scid, &odcid, None)
            .unwrap_err();
        assert!(e.reason.contains("retry_source_connection_id"), "{e}");
        for e in [
            TransportParameters::default().validate_server_cids(&scid, &odcid, None),
            TransportParameters {
                original_destination_connection_id: None,
                ..server.clone()
            }
            .validate_server_cids(&scid, &odcid, None),
        ] {
            assert_eq!(
                e.unwrap_err().code,
                crate::error::TransportErrorCode::TRANSPORT_PARAMETER_ERROR
            );
        }
    }

    /// Decoding is total, and whatever decodes re-encodes to the same value.
    fn check_decode_total(data: &[u8]) {
        for side in [Side::Client, Side::Server] {
            if let Ok(p) = TransportParameters::decode(side, data) {
                let mut again = Vec::new();
                p.encode(&mut again);
                assert_eq!(
                    TransportParameters::decode(side, &again).as_ref(),
                    Ok(&p),
                    "{data:02x?}"
                );
            }
        }
    }

    #[test]
    fn random_input_never_panics() {
        let mut rng = StdRng::seed_from_u64(0x6b75_6169);
        let mut data = Vec::new();
        for _ in 0..4000 {
            data.clear();
            let len = rng.random_range(0..128);
            data.resize(len, 0);
            rng.fill_bytes(&mut data);
            check_decode_total(&data);
        }
        // Pure noise rarely frames correctly; also mutate valid encodings.
        let base = encode_seeded(&full(), 11);
        for _ in 0..4000 {
            data.clear();
            data.extend_from_slice(&base);
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..data.len());
                match rng.random_range(0..3) {
                    0 => data[i] = rng.random(),
                    1 => data.truncate(i),
                    _ => data[i] ^= 1 << rng.random_range(0..8),
                }
                if data.is_empty() {
                    break;
                }
            }
            check_decode_total(&data);
        }
        // Streams of well-framed parameters with random known IDs and random short values.
        let ids = [
            0u64, 1, 2, 3, 4, 8, 0xa, 0xb, 0xc, 0xd, 0xe, 0xf, 0x10, 0x11, 0x20, 0x2ab2,
            0xff04de1b, 27,
        ];
        for _ in 0..4000 {
            data.clear();
            for _ in 0..rng.random_range(1..4) {
                let id = ids[rng.random_range(0..ids.len())];
                let mut value = vec![0u8; rng.random_range(0..48)];
                rng.fill_bytes(&mut value);
                data.extend(tp(id, &value));
            }
            check_decode_total(&data);
        }
    }
}
