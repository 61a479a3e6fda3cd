//! HTTP/3 frames (RFC 9114 §7) and settings, with an incremental reader for stream data.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kuai_proto::VarInt;
use kuai_proto::coding::{BufExt, BufMutExt};

use crate::error::{Code, H3Error};

/// Frame type DATA (RFC 9114 §7.2.1).
pub const DATA: u64 = 0x00;
/// Frame type HEADERS (RFC 9114 §7.2.2).
pub const HEADERS: u64 = 0x01;
/// Frame type CANCEL_PUSH (RFC 9114 §7.2.3).
pub const CANCEL_PUSH: u64 = 0x03;
/// Frame type SETTINGS (RFC 9114 §7.2.4).
pub const SETTINGS: u64 = 0x04;
/// Frame type PUSH_PROMISE (RFC 9114 §7.2.5).
pub const PUSH_PROMISE: u64 = 0x05;
/// Frame type GOAWAY (RFC 9114 §7.2.6).
pub const GOAWAY: u64 = 0x07;
/// Frame type MAX_PUSH_ID (RFC 9114 §7.2.7).
pub const MAX_PUSH_ID: u64 = 0x0d;

/// Most settings one SETTINGS frame may carry. kuai sends 6, browsers fewer than 10; past
/// this a SETTINGS frame is only work for us (RFC 9114 §10.5), H3_EXCESSIVE_LOAD. It also
/// bounds the duplicate check below to 256 × 255 / 2 comparisons.
pub const MAX_SETTINGS: usize = 256;

/// Frame types HTTP/2 had and HTTP/3 forbids (RFC 9114 §7.2.8).
fn is_http2_frame(ty: u64) -> bool {
    matches!(ty, 0x02 | 0x06 | 0x08 | 0x09)
}

/// Whether a type is reserved for greasing (0x1f * N + 0x21).
pub fn is_grease(v: u64) -> bool {
    v >= 0x21 && (v - 0x21).is_multiple_of(0x1f)
}

/// A grease value picked from `seed`.
pub fn grease_value(seed: u64) -> u64 {
    0x1f * (seed % 0x1_0000) + 0x21
}

/// Setting identifiers (RFC 9114 §7.2.4.1, RFC 9204 §5).
pub mod settings_id {
    /// SETTINGS_QPACK_MAX_TABLE_CAPACITY (RFC 9204 §5).
    pub const QPACK_MAX_TABLE_CAPACITY: u64 = 0x01;
    /// SETTINGS_MAX_FIELD_SECTION_SIZE (RFC 9114 §7.2.4.1).
    pub const MAX_FIELD_SECTION_SIZE: u64 = 0x06;
    /// SETTINGS_QPACK_BLOCKED_STREAMS (RFC 9204 §5).
    pub const QPACK_BLOCKED_STREAMS: u64 = 0x07;
    /// RFC 9220 / RFC 8441.
    pub const ENABLE_CONNECT_PROTOCOL: u64 = 0x08;
    /// RFC 9297.
    pub const H3_DATAGRAM: u64 = 0x33;
}

/// The settings an endpoint sends (RFC 9114 §7.2.4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// The dynamic table capacity the encoder may use.
    pub qpack_max_table_capacity: u64,
    /// Streams that may wait for encoder instructions at once.
    pub qpack_blocked_streams: u64,
    /// `None`: unlimited (the setting is absent).
    pub max_field_section_size: Option<u64>,
    /// Extended CONNECT is accepted (RFC 9220).
    pub enable_connect_protocol: bool,
    /// HTTP datagrams are accepted (RFC 9297).
    pub h3_datagram: bool,
}

impl Default for Settings {
    /// The values assumed for a peer until its SETTINGS arrive.
    fn default() -> Self {
        Self {
            qpack_max_table_capacity: 0,
            qpack_blocked_streams: 0,
            max_field_section_size: None,
            enable_connect_protocol: false,
            h3_datagram: false,
        }
    }
}

impl Settings {
    /// Writes a SETTINGS frame, with one grease setting (RFC 9114 §7.2.4.1).
    pub fn encode(&self, grease_seed: u64, out: &mut Vec<u8>) {
        let mut payload = Vec::new();
        let mut put = |id: u64, v: u64| {
            payload.put_var(id);
            payload.put_var(v);
        };
        put(
            settings_id::QPACK_MAX_TABLE_CAPACITY,
            self.qpack_max_table_capacity,
        );
        put(
            settings_id::QPACK_BLOCKED_STREAMS,
            self.qpack_blocked_streams,
        );
        if let Some(m) = self.max_field_section_size {
            put(settings_id::MAX_FIELD_SECTION_SIZE, m);
        }
        if self.enable_connect_protocol {
            put(settings_id::ENABLE_CONNECT_PROTOCOL, 1);
        }
        if self.h3_datagram {
            put(settings_id::H3_DATAGRAM, 1);
        }
        put(grease_value(grease_seed), grease_seed & 0xff);
        out.put_var(SETTINGS);
        out.put_var(payload.len() as u64);
        out.extend_from_slice(&payload);
    }

    /// Parses a SETTINGS payload.
    pub fn decode(mut p: &[u8]) -> Result<Self, H3Error> {
        let mut s = Self::default();
        let mut seen: Vec<u64> = Vec::with_capacity(16);
        let err = |r| H3Error::new(Code::SETTINGS_ERROR, r);
        while !p.is_empty() {
            let id = p
                .get_var()
                .map_err(|_| H3Error::new(Code::FRAME_ERROR, "truncated setting"))?;
            let v = p
                .get_var()
                .map_err(|_| H3Error::new(Code::FRAME_ERROR, "truncated setting"))?;
            if seen.len() == MAX_SETTINGS {
                return Err(H3Error::new(
                    Code::EXCESSIVE_LOAD,
                    "more than 256 settings in one SETTINGS frame",
                ));
            }
            // RFC 9114 §7.2.4: a repeated identifier is H3_SETTINGS_ERROR.
            if seen.contains(&id) {
                return Err(err("setting repeated"));
            }
            seen.push(id);
            match id {
                settings_id::QPACK_MAX_TABLE_CAPACITY => s.qpack_max_table_capacity = v,
                settings_id::QPACK_BLOCKED_STREAMS => s.qpack_blocked_streams = v,
                settings_id::MAX_FIELD_SECTION_SIZE => s.max_field_section_size = Some(v),
                settings_id::ENABLE_CONNECT_PROTOCOL => match v {
                    0 => {}
                    1 => s.enable_connect_protocol = true,
                    _ => return Err(err("ENABLE_CONNECT_PROTOCOL not 0 or 1")),
                },
                settings_id::H3_DATAGRAM => match v {
                    0 => {}
                    1 => s.h3_datagram = true,
                    _ => return Err(H3Error::new(Code::SETTINGS_ERROR, "H3_DATAGRAM not 0 or 1")),
                },
                // HTTP/2 settings without an HTTP/3 meaning (RFC 9114 §7.2.4.1).
                0x00 | 0x02 | 0x03 | 0x04 | 0x05 => return Err(err("HTTP/2 setting in HTTP/3")),
                _ => {} // unknown or grease: ignored
            }
        }
        Ok(s)
    }
}

/// Writes a frame header.
pub fn write_header(ty: u64, len: u64, out: &mut impl BufMut) {
    out.put_var(ty);
    out.put_var(len);
}

/// Length of a frame header.
pub fn header_len(ty: u64, len: u64) -> usize {
    VarInt::size_of(ty) + VarInt::size_of(len)
}

/// A frame as the reader yields it. DATA payloads come as they arrive, in pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Frame {
    /// A piece of a DATA frame's payload.
    Data(Bytes),
    /// A HEADERS frame's encoded field section.
    Headers(Bytes),
    /// A SETTINGS frame's payload.
    Settings(Bytes),
    /// GOAWAY with its stream (or push) ID.
    Goaway(u64),
    /// CANCEL_PUSH with its push ID.
    CancelPush(u64),
    /// MAX_PUSH_ID with its push ID.
    MaxPushId(u64),
    /// A PUSH_PROMISE (skipped: kuai never asks for pushes).
    PushPromise,
    /// An unknown or reserved frame type, skipped (RFC 9114 §9).
    Unknown(u64),
    /// A HEADERS frame longer than the reader takes, with its length: skipped, not
    /// buffered. On a request stream it is a problem of that request only (RFC 9114
    /// §4.2.2); elsewhere HEADERS is not allowed anyway.
    HeadersTooLarge(u64),
}

/// Reads frames from a stream's bytes as they arrive.
#[derive(Debug)]
pub struct FrameReader {
    /// Bytes that must be contiguous to be parsed: a frame header or a non-DATA frame cut
    /// across chunks. They come before `chunk`.
    buf: BytesMut,
    /// The rest of the chunk last pushed with [`push_bytes`](Self::push_bytes), not copied:
    /// DATA payloads are sliced from it.
    chunk: Bytes,
    /// Inside a DATA frame: payload bytes still to come.
    data_left: u64,
    /// Inside an unknown frame: bytes still to skip.
    skip_left: u64,
    /// Largest non-DATA frame accepted (HEADERS, SETTINGS, ...).
    max_frame: u64,
}

impl FrameReader {
    /// A reader that refuses non-DATA frames longer than `max_frame` bytes.
    pub fn new(max_frame: u64) -> Self {
        Self {
            buf: BytesMut::new(),
            chunk: Bytes::new(),
            data_left: 0,
            skip_left: 0,
            max_frame,
        }
    }

    /// Bytes held: an incomplete frame header or non-DATA frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() + self.chunk.len()
    }

    /// Adds bytes that arrived, copying them.
    pub fn push(&mut self, data: &[u8]) {
        self.spill();
        self.buf.extend_from_slice(data);
    }

    /// Adds a chunk that arrived without copying it: the DATA payloads in it come back as
    /// slices of it. Only frame headers and non-DATA frames cut across chunks are copied.
    pub fn push_bytes(&mut self, data: Bytes) {
        if self.buf.is_empty() && self.chunk.is_empty() {
            self.chunk = data;
        } else {
            self.push(&data);
        }
    }

    /// Moves the unread rest of `chunk` behind `buf`, which must hold it contiguously.
    fn spill(&mut self) {
        if !self.chunk.is_empty() {
            self.buf.extend_from_slice(&self.chunk);
            self.chunk = Bytes::new();
        }
    }

    /// Whether a frame was cut off (bytes left inside a frame).
    pub fn is_mid_frame(&self) -> bool {
        self.buffered() > 0 || self.data_left > 0 || self.skip_left > 0
    }

    /// The next frame, if complete (or a piece of DATA).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, H3Error> {
        loop {
            if self.data_left > 0 {
                let from = if self.buf.is_empty() {
                    if self.chunk.is_empty() {
                        return Ok(None);
                    }
                    let n = (self.data_left as usize).min(self.chunk.len());
                    self.chunk.split_to(n)
                } else {
                    let n = (self.data_left as usize).min(self.buf.len());
                    self.buf.split_to(n).freeze()
                };
                self.data_left -= from.len() as u64;
                return Ok(Some(Frame::Data(from)));
            }
            if self.skip_left > 0 {
                let n = (self.skip_left as usize).min(self.buf.len());
                self.buf.advance(n);
                self.skip_left -= n as u64;
                let n = (self.skip_left as usize).min(self.chunk.len());
                self.chunk.advance(n);
                self.skip_left -= n as u64;
                if self.skip_left > 0 {
                    return Ok(None);
                }
                continue;
            }
            if self.buf.is_empty() && !self.chunk.is_empty() {
                // A DATA frame's header whole in the chunk: step over it, and its payload
                // is sliced from the chunk above.
                let mut peek = &self.chunk[..];
                match (peek.get_var(), peek.get_var()) {
                    (Ok(DATA), Ok(len)) => {
                        let hdr = self.chunk.len() - peek.len();
                        self.chunk.advance(hdr);
                        self.data_left = len;
                        if len == 0 {
                            return Ok(Some(Frame::Data(Bytes::new())));
                        }
                        continue;
                    }
                    // A HEADERS frame whole in the chunk (a request's head, mostly): its
                    // payload is sliced from the chunk, not copied into the buffer.
                    (Ok(HEADERS), Ok(len))
                        if len <= self.max_frame && (peek.len() as u64) >= len =>
                    {
                        let hdr = self.chunk.len() - peek.len();
                        self.chunk.advance(hdr);
                        return Ok(Some(Frame::Headers(self.chunk.split_to(len as usize))));
                    }
                    _ => {}
                }
            }
            self.spill();
            let mut peek = &self.buf[..];
            let Ok(ty) = peek.get_var() else {
                return Ok(None);
            };
            let Ok(len) = peek.get_var() else {
                return Ok(None);
            };
            let hdr = self.buf.len() - peek.len();
            if is_http2_frame(ty) {
                return Err(H3Error::new(Code::FRAME_UNEXPECTED, "HTTP/2 frame type"));
            }
            match ty {
                DATA => {
                    self.buf.advance(hdr);
                    self.data_left = len;
                    if len == 0 {
                        return Ok(Some(Frame::Data(Bytes::new())));
                    }
                    continue;
                }
                HEADERS | SETTINGS | GOAWAY | CANCEL_PUSH | MAX_PUSH_ID | PUSH_PROMISE => {}
                _ => {
                    // Unknown frames are skipped without buffering them.
                    self.buf.advance(hdr);
                    self.skip_left = len;
                    return Ok(Some(Frame::Unknown(ty)));
                }
            }
            // GOAWAY, CANCEL_PUSH and MAX_PUSH_ID hold one varint: a longer one is malformed
            // from its header on (RFC 9114 §7.1: H3_FRAME_ERROR), not buffered first.
            if matches!(ty, GOAWAY | CANCEL_PUSH | MAX_PUSH_ID) && len > 8 {
                return Err(H3Error::new(Code::FRAME_ERROR, "trailing bytes in frame"));
            }
            if len > self.max_frame && ty == HEADERS {
                self.buf.advance(hdr);
                self.skip_left = len;
                return Ok(Some(Frame::HeadersTooLarge(len)));
            }
            if len > self.max_frame {
                return Err(H3Error::new(
                    Code::EXCESSIVE_LOAD,
                    "frame larger than accepted",
                ));
            }
            if (peek.len() as u64) < len {
                return Ok(None);
            }
            self.buf.advance(hdr);
            let payload = self.buf.split_to(len as usize).freeze();
            let id_frame = |p: &Bytes| -> Result<u64, H3Error> {
                let mut b = &p[..];
                let v = b
                    .get_var()
                    .map_err(|_| H3Error::new(Code::FRAME_ERROR, "truncated frame"))?;
                if !b.is_empty() {
                    return Err(H3Error::new(Code::FRAME_ERROR, "trailing bytes in frame"));
                }
                Ok(v)
            };
            return Ok(Some(match ty {
                HEADERS => Frame::Headers(payload),
                SETTINGS => Frame::Settings(payload),
                GOAWAY => Frame::Goaway(id_frame(&payload)?),
                CANCEL_PUSH => Frame::CancelPush(id_frame(&payload)?),
                MAX_PUSH_ID => Frame::MaxPushId(id_frame(&payload)?),
                _ => Frame::PushPromise,
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8], chunk: usize) -> Result<Vec<Frame>, H3Error> {
        let mut r = FrameReader::new(1 << 16);
        let mut out = Vec::new();
        for c in input.chunks(chunk.max(1)) {
            r.push(c);
            while let Some(f) = r.next_frame()? {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// As `frames`, with the chunks handed over without a copy.
    fn frames_zero_copy(input: &[u8], chunk: usize) -> Result<Vec<Frame>, H3Error> {
        let mut r = FrameReader::new(1 << 16);
        let mut out = Vec::new();
        for c in input.chunks(chunk.max(1)) {
            r.push_bytes(Bytes::copy_from_slice(c));
            while let Some(f) = r.next_frame()? {
                out.push(f);
            }
        }
        assert!(!r.is_mid_frame(), "all of the input was read");
        Ok(out)
    }

    /// DATA payloads as one byte string, the other frames as they are.
    fn normalized(frames: Vec<Frame>) -> (Vec<u8>, Vec<Frame>) {
        let mut data = Vec::new();
        let mut other = Vec::new();
        for f in frames {
            match f {
                Frame::Data(d) => data.extend_from_slice(&d),
                f => other.push(f),
            }
        }
        (data, other)
    }

    /// The zero-copy hand-over reads the same frames as the copying one, whatever the
    /// chunking, and a DATA payload within one chunk comes back as a slice of it.
    #[test]
    fn chunks_handed_over_without_a_copy_read_the_same() {
        let mut buf = Vec::new();
        write_header(HEADERS, 3, &mut buf);
        buf.extend_from_slice(b"abc");
        write_header(DATA, 300, &mut buf);
        buf.extend((0..300).map(|i| i as u8));
        write_header(0x21 + 0x1f * 3, 70, &mut buf);
        buf.extend_from_slice(&[7; 70]);
        write_header(DATA, 0, &mut buf);
        write_header(DATA, 70_000, &mut buf);
        buf.extend((0..70_000).map(|i| (i % 251) as u8));
        write_header(HEADERS, 2, &mut buf);
        buf.extend_from_slice(b"tr");
        for chunk in [1, 2, 3, 5, 64, 1000, 65_536, 1 << 20] {
            let copied = normalized(frames(&buf, chunk).unwrap());
            let zero = normalized(frames_zero_copy(&buf, chunk).unwrap());
            assert_eq!(copied, zero, "chunks of {chunk}");
        }
        let mut one = Vec::new();
        write_header(DATA, 5000, &mut one);
        one.extend_from_slice(&[9; 5000]);
        let chunk = Bytes::from(one);
        let mut r = FrameReader::new(1 << 16);
        r.push_bytes(chunk.clone());
        let Some(Frame::Data(d)) = r.next_frame().unwrap() else {
            panic!("DATA expected")
        };
        assert_eq!(d.len(), 5000);
        assert_eq!(
            d.as_ptr(),
            chunk[chunk.len() - 5000..].as_ptr(),
            "not copied"
        );
    }

    #[test]
    fn every_frame_round_trips_in_any_chunking() {
        let mut buf = Vec::new();
        Settings {
            qpack_max_table_capacity: 4096,
            qpack_blocked_streams: 16,
            max_field_section_size: Some(65536),
            enable_connect_protocol: true,
            h3_datagram: true,
        }
        .encode(7, &mut buf);
        write_header(HEADERS, 3, &mut buf);
        buf.extend_from_slice(b"abc");
        write_header(DATA, 5, &mut buf);
        buf.extend_from_slice(b"hello");
        write_header(0x21 + 0x1f * 3, 2, &mut buf);
        buf.extend_from_slice(b"zz");
        write_header(GOAWAY, 1, &mut buf);
        buf.push(8);
        write_header(DATA, 0, &mut buf);
        for chunk in [1, 2, 3, 7, 1000] {
            let f = frames(&buf, chunk).unwrap();
            let data: Vec<u8> = f
                .iter()
                .filter_map(|x| {
                    if let Frame::Data(d) = x {
                        Some(d.to_vec())
                    } else {
                        None
                    }
                })
                .flatten()
                .collect();
            assert_eq!(data, b"hello");
            let s = f
                .iter()
                .find_map(|x| {
                    if let Frame::Settings(p) = x {
                        Some(p.clone())
                    } else {
                        None
                    }
                })
                .unwrap();
            let s = Settings::decode(&s).unwrap();
            assert_eq!(s.qpack_max_table_capacity, 4096);
            assert!(s.enable_connect_protocol && s.h3_datagram);
            assert!(f.contains(&Frame::Headers(Bytes::from_static(b"abc"))));
            assert!(f.contains(&Frame::Goaway(8)));
            assert!(f.iter().any(|x| matches!(x, Frame::Unknown(_))));
        }
    }

    #[test]
    fn bad_frames_are_errors() {
        // HTTP/2 PRIORITY frame type.
        assert_eq!(
            frames(&[0x02, 0x00], 10).unwrap_err().code,
            Code::FRAME_UNEXPECTED
        );
        // GOAWAY with trailing bytes.
        assert_eq!(
            frames(&[0x07, 0x02, 0x01, 0x01], 10).unwrap_err().code,
            Code::FRAME_ERROR
        );
        // A GOAWAY announced at 60 KiB is an error from its header on, nothing buffered.
        let mut r = FrameReader::new(1 << 16);
        let mut b = Vec::new();
        write_header(GOAWAY, 60_000, &mut b);
        b.push(0x00);
        r.push(&b);
        assert_eq!(r.next_frame().unwrap_err().code, Code::FRAME_ERROR);
        // Oversized SETTINGS.
        let mut r = FrameReader::new(100);
        let mut b = Vec::new();
        write_header(SETTINGS, 1000, &mut b);
        r.push(&b);
        assert_eq!(r.next_frame().unwrap_err().code, Code::EXCESSIVE_LOAD);
        // Repeated and HTTP/2 settings.
        assert_eq!(
            Settings::decode(&[0x01, 0x00, 0x01, 0x00])
                .unwrap_err()
                .code,
            Code::SETTINGS_ERROR
        );
        assert_eq!(
            Settings::decode(&[0x02, 0x00]).unwrap_err().code,
            Code::SETTINGS_ERROR
        );
        // Unknown settings are ignored.
        assert!(Settings::decode(&[0x21, 0x05]).is_ok());
    }

    fn settings_payload(ids: impl IntoIterator<Item = u64>) -> Vec<u8> {
        let mut p = Vec::new();
        for id in ids {
            p.put_var(id);
            p.put_var(0);
        }
        p
    }

    /// RFC 9114 §10.5: a SETTINGS frame of thousands of settings is work the peer makes us
    /// do for nothing; past [`MAX_SETTINGS`] it is H3_EXCESSIVE_LOAD, whatever the ids.
    #[test]
    fn settings_count_is_bounded() {
        // 0x21 + 0x1f * n: grease ids, distinct, each ignored on its own.
        let many = settings_payload((0..2000u64).map(|n| 0x21 + 0x1f * n));
        assert!(many.len() < 64 * 1024, "fits one control-stream frame");
        assert_eq!(
            Settings::decode(&many).unwrap_err().code,
            Code::EXCESSIVE_LOAD
        );
        let at_cap = settings_payload((0..MAX_SETTINGS as u64).map(|n| 0x21 + 0x1f * n));
        assert!(Settings::decode(&at_cap).is_ok());
        // A repeat is still a SETTINGS_ERROR, wherever it is in the frame.
        let mut ids: Vec<u64> = (0..MAX_SETTINGS as u64 - 1)
            .map(|n| 0x21 + 0x1f * n)
            .collect();
        ids.push(0x21);
        assert_eq!(
            Settings::decode(&settings_payload(ids)).unwrap_err().code,
            Code::SETTINGS_ERROR
        );
    }

    /// A reserved frame type declaring a huge length is skipped as its bytes arrive: nothing
    /// of it is held (RFC 9114 §9).
    #[test]
    fn unknown_frames_are_skipped_without_buffering() {
        let mut r = FrameReader::new(1 << 16);
        let mut b = Vec::new();
        write_header(0x21 + 0x1f * 7, (1 << 62) - 1, &mut b);
        r.push(&b);
        assert!(matches!(r.next_frame(), Ok(Some(Frame::Unknown(_)))));
        let chunk = vec![0u8; 64 * 1024];
        for _ in 0..64 {
            r.push(&chunk);
            assert_eq!(r.next_frame(), Ok(None));
            assert_eq!(r.buffered(), 0, "skipped bytes are not kept");
        }
        // A HEADERS frame declaring more than accepted is reported before its payload
        // comes, and its payload is skipped, not kept; the frame after it is read.
        let mut r = FrameReader::new(1 << 16);
        let mut b = Vec::new();
        write_header(HEADERS, 200_000, &mut b);
        r.push(&b);
        assert_eq!(r.next_frame(), Ok(Some(Frame::HeadersTooLarge(200_000))));
        for _ in 0..3 {
            r.push(&[0u8; 60_000]);
            assert_eq!(r.next_frame(), Ok(None));
            assert_eq!(r.buffered(), 0, "skipped bytes are not kept");
        }
        let mut rest = vec![0u8; 20_000];
        write_header(HEADERS, 3, &mut rest);
        rest.extend_from_slice(b"abc");
        r.push(&rest);
        assert_eq!(
            r.next_frame(),
            Ok(Some(Frame::Headers(Bytes::from_static(b"abc"))))
        );
    }

    #[test]
    fn grease_values() {
        for s in 0..100 {
            assert!(is_grease(grease_value(s)));
        }
        assert!(!is_grease(0x20));
    }
}
