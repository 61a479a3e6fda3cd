//! The QPACK decoder (RFC 9204 §2.2): the dynamic table driven by the peer's encoder stream,
//! field section decoding, blocked streams, and the decoder stream it writes.

use std::collections::VecDeque;

use bytes::Bytes;

use super::instructions::{
    DecoderInstruction, EncoderInstruction, FieldLine, decode_required_insert_count,
};
use super::prefix::{self, decode_int};
use super::{
    ENTRY_OVERHEAD, H3_MESSAGE_ERROR, QPACK_DECOMPRESSION_FAILED, QPACK_ENCODER_STREAM_ERROR,
    QpackError, static_table,
};

/// The result of [`Decoder::decode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// The field lines, in order.
    Fields(Vec<(Bytes, Bytes)>),
    /// The section references entries not received yet: keep the block and decode it again
    /// when [`Decoder::unblocked`] names the stream.
    Blocked,
}

/// The decoder's copy of the dynamic table.
#[derive(Debug, Default)]
struct Table {
    entries: VecDeque<(Bytes, Bytes)>,
    /// Absolute index of `entries[0]`: the number of entries evicted so far.
    dropped: u64,
    size: u64,
    capacity: u64,
}

impl Table {
    fn insert_count(&self) -> u64 {
        self.dropped + self.entries.len() as u64
    }

    fn get(&self, absolute: u64) -> Option<&(Bytes, Bytes)> {
        let i = absolute.checked_sub(self.dropped)?;
        self.entries.get(usize::try_from(i).ok()?)
    }

    fn evict_to(&mut self, target: u64) {
        while self.size > target {
            let Some((n, v)) = self.entries.pop_front() else {
                break;
            };
            self.size -= n.len() as u64 + v.len() as u64 + ENTRY_OVERHEAD;
            self.dropped += 1;
        }
    }

    fn set_capacity(&mut self, capacity: u64) {
        self.capacity = capacity;
        self.evict_to(capacity);
    }

    /// Inserts, evicting as needed; `false` when the entry is larger than the capacity.
    fn insert(&mut self, name: Bytes, value: Bytes) -> bool {
        let size = name.len() as u64 + value.len() as u64 + ENTRY_OVERHEAD;
        if size > self.capacity {
            return false;
        }
        self.evict_to(self.capacity - size);
        self.size += size;
        self.entries.push_back((name, value));
        true
    }
}

/// A QPACK decoder for one connection.
#[derive(Debug)]
pub struct Decoder {
    max_table_capacity: u64,
    max_blocked_streams: u64,
    max_field_section_size: u64,
    max_entries: u64,
    table: Table,
    /// Inserts acknowledged to the encoder (Insert Count Increment or Section Acknowledgment).
    known_received: u64,
    /// An incomplete encoder instruction.
    enc_buf: Vec<u8>,
    /// `enc_buf` cannot parse before it holds this many bytes.
    enc_need: usize,
    /// Blocked streams and their Required Insert Count.
    blocked: Vec<(u64, u64)>,
    unblocked: Vec<u64>,
    /// A connection error on the encoder stream: every later call fails with it.
    error: Option<QpackError>,
}

fn decompression_failed(reason: &'static str) -> QpackError {
    QpackError {
        code: QPACK_DECOMPRESSION_FAILED,
        reason,
    }
}

fn encoder_stream_error(reason: &'static str) -> QpackError {
    QpackError {
        code: QPACK_ENCODER_STREAM_ERROR,
        reason,
    }
}

impl Decoder {
    /// A decoder with our SETTINGS values: SETTINGS_QPACK_MAX_TABLE_CAPACITY,
    /// SETTINGS_QPACK_BLOCKED_STREAMS and SETTINGS_MAX_FIELD_SECTION_SIZE (use `u64::MAX` for
    /// "unlimited").
    pub fn new(
        max_table_capacity: u64,
        max_blocked_streams: u64,
        max_field_section_size: u64,
    ) -> Self {
        Decoder {
            max_table_capacity,
            max_blocked_streams,
            max_field_section_size,
            max_entries: max_table_capacity / 32,
            table: Table::default(),
            known_received: 0,
            enc_buf: Vec::new(),
            enc_need: 0,
            blocked: Vec::new(),
            unblocked: Vec::new(),
            error: None,
        }
    }

    /// Entries inserted so far (the Insert Count).
    pub fn insert_count(&self) -> u64 {
        self.table.insert_count()
    }

    /// The size of the dynamic table (RFC 9204 §3.2.1).
    pub fn table_size(&self) -> u64 {
        self.table.size
    }

    /// The dynamic table capacity the encoder set.
    pub fn table_capacity(&self) -> u64 {
        self.table.capacity
    }

    /// The number of streams currently blocked.
    pub fn blocked_streams(&self) -> usize {
        self.blocked.len()
    }

    /// Bytes of an incomplete encoder instruction held until the rest arrives.
    pub fn buffered(&self) -> usize {
        self.enc_buf.len()
    }

    /// Feeds bytes received on the peer's encoder stream (any split, partial instructions are
    /// kept). Writes Insert Count Increment to `decoder_stream` for the new entries. Errors are
    /// connection errors of type QPACK_ENCODER_STREAM_ERROR and stick: later calls repeat them.
    pub fn on_encoder_stream(
        &mut self,
        data: &[u8],
        decoder_stream: &mut Vec<u8>,
    ) -> Result<(), QpackError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if let Err(e) = self.read_encoder_stream(data) {
            self.error = Some(e);
            self.enc_buf = Vec::new();
            return Err(e);
        }
        let inserts = self.table.insert_count();
        if inserts > self.known_received {
            DecoderInstruction::InsertCountIncrement(inserts - self.known_received)
                .encode(decoder_stream);
            self.known_received = inserts;
        }
        if !self.blocked.is_empty() {
            let unblocked = &mut self.unblocked;
            self.blocked.retain(|&(stream, ric)| {
                if ric <= inserts {
                    unblocked.push(stream);
                    false
                } else {
                    true
                }
            });
        }
        Ok(())
    }

    /// The most bytes one encoder instruction may take on the wire: two strings whose decoded
    /// length fits the table, each at most 30/8 of that when Huffman-coded, and integers.
    fn max_instruction_len(&self) -> usize {
        let cap = usize::try_from(self.max_table_capacity).unwrap_or(usize::MAX);
        cap.saturating_mul(8).saturating_add(64)
    }

    fn read_encoder_stream(&mut self, data: &[u8]) -> Result<(), QpackError> {
        let mut buf = std::mem::take(&mut self.enc_buf);
        let from_buf = !buf.is_empty();
        if from_buf {
            buf.extend_from_slice(data);
            if buf.len() < self.enc_need {
                self.enc_buf = buf;
                return Ok(());
            }
        }
        let input: &[u8] = if from_buf { &buf } else { data };
        let mut pos = 0;
        let mut need = 0;
        while pos < input.len() {
            let max_string = usize::try_from(self.table.capacity.saturating_sub(ENTRY_OVERHEAD))
                .unwrap_or(usize::MAX);
            match EncoderInstruction::parse(&input[pos..], max_string) {
                Ok((instruction, len)) => {
                    self.apply(instruction)?;
                    pos += len;
                }
                Err(prefix::Error::Incomplete(n)) => {
                    need = n.unwrap_or(input.len() - pos + 1);
                    break;
                }
                Err(prefix::Error::Invalid(reason)) => {
                    return Err(encoder_stream_error(if reason == "string too long" {
                        "entry larger than the table capacity"
                    } else {
                        reason
                    }));
                }
            }
        }
        let rest = input.len() - pos;
        if rest > self.max_instruction_len() {
            return Err(encoder_stream_error("encoder instruction too long"));
        }
        if from_buf {
            buf.drain(..pos);
            self.enc_buf = buf;
        } else {
            self.enc_buf = input[pos..].to_vec();
        }
        self.enc_need = need;
        Ok(())
    }

    fn apply(&mut self, instruction: EncoderInstruction) -> Result<(), QpackError> {
        match instruction {
            EncoderInstruction::SetCapacity(capacity) => {
                if capacity > self.max_table_capacity {
                    return Err(encoder_stream_error(
                        "table capacity above SETTINGS_QPACK_MAX_TABLE_CAPACITY",
                    ));
                }
                self.table.set_capacity(capacity);
            }
            EncoderInstruction::InsertWithNameRef {
                is_static,
                index,
                value,
            } => {
                let name = if is_static {
                    let (name, _) = static_table::get(index)
                        .ok_or(encoder_stream_error("invalid static table index"))?;
                    Bytes::from_static(name)
                } else {
                    self.relative_entry(index)?.0.clone()
                };
                self.insert(name, value)?;
            }
            EncoderInstruction::InsertWithLiteralName { name, value } => {
                self.insert(name, value)?
            }
            EncoderInstruction::Duplicate(index) => {
                let (name, value) = self.relative_entry(index)?.clone();
                self.insert(name, value)?;
            }
        }
        Ok(())
    }

    /// The entry at an encoder-stream relative index.
    fn relative_entry(&self, index: u64) -> Result<&(Bytes, Bytes), QpackError> {
        let count = self.table.insert_count();
        if index >= count {
            return Err(encoder_stream_error("reference to an entry not inserted"));
        }
        self.table
            .get(count - 1 - index)
            .ok_or(encoder_stream_error("reference to an evicted entry"))
    }

    fn insert(&mut self, name: Bytes, value: Bytes) -> Result<(), QpackError> {
        if self.table.insert(name, value) {
            Ok(())
        } else {
            Err(encoder_stream_error("entry larger than the table capacity"))
        }
    }

    /// Decodes an encoded field section received on `stream_id`. Writes a Section
    /// Acknowledgment to `decoder_stream` when the section referenced the dynamic table.
    ///
    /// Errors are connection errors of type QPACK_DECOMPRESSION_FAILED, except a section larger
    /// than SETTINGS_MAX_FIELD_SECTION_SIZE, which is H3_MESSAGE_ERROR for the stream (the
    /// section is acknowledged first, so the table state stays in step).
    pub fn decode(
        &mut self,
        stream_id: u64,
        block: &[u8],
        decoder_stream: &mut Vec<u8>,
    ) -> Result<Decoded, QpackError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let truncated = |_| decompression_failed("truncated field section prefix");
        let mut pos = 0;
        let encoded_ric = decode_int(block, &mut pos, 8).map_err(truncated)?;
        let inserts = self.table.insert_count();
        let ric = decode_required_insert_count(encoded_ric, self.max_entries, inserts)
            .ok_or(decompression_failed("invalid Required Insert Count"))?;
        let sign = block
            .get(pos)
            .map(|b| b & 0x80 != 0)
            .ok_or(decompression_failed("truncated field section prefix"))?;
        let delta = decode_int(block, &mut pos, 7).map_err(truncated)?;
        let base = if sign {
            if delta >= ric {
                return Err(decompression_failed("negative Base"));
            }
            ric - delta - 1
        } else {
            ric + delta // both below 2^62
        };

        if ric > inserts {
            if !self.blocked.iter().any(|&(s, _)| s == stream_id) {
                if self.blocked.len() as u64 >= self.max_blocked_streams {
                    return Err(decompression_failed("too many blocked streams"));
                }
                self.blocked.push((stream_id, ric));
            }
            return Ok(Decoded::Blocked);
        }
        self.forget_stream(stream_id);

        // Most sections hold fewer than 16 fields: one allocation, no regrowth.
        let mut fields = Vec::with_capacity(16);
        // The section's literal strings share one buffer, made at the first of them.
        let mut arena = bytes::BytesMut::new();
        let mut budget = self.max_field_section_size;
        let mut largest: Option<u64> = None;
        while pos < block.len() {
            let max_string =
                usize::try_from(budget.saturating_sub(ENTRY_OVERHEAD)).unwrap_or(usize::MAX);
            let line = match FieldLine::parse(block, &mut pos, max_string, &mut arena) {
                Ok(line) => line,
                Err(prefix::Error::Invalid("string too long")) => {
                    return Err(self.too_large(stream_id, ric, decoder_stream));
                }
                Err(prefix::Error::Invalid(reason)) => return Err(decompression_failed(reason)),
                Err(prefix::Error::Incomplete(_)) => {
                    return Err(decompression_failed("truncated field line"));
                }
            };
            let (name, value) = self.resolve(line, base, ric, &mut largest)?;
            let size = name.len() as u64 + value.len() as u64 + ENTRY_OVERHEAD;
            if size > budget {
                return Err(self.too_large(stream_id, ric, decoder_stream));
            }
            budget -= size;
            fields.push((name, value));
        }
        if ric > 0 {
            if largest.map(|l| l + 1) != Some(ric) {
                return Err(decompression_failed(
                    "Required Insert Count above the largest reference",
                ));
            }
            self.acknowledge(stream_id, ric, decoder_stream);
        }
        Ok(Decoded::Fields(fields))
    }

    fn acknowledge(&mut self, stream_id: u64, ric: u64, decoder_stream: &mut Vec<u8>) {
        DecoderInstruction::SectionAck(stream_id).encode(decoder_stream);
        self.known_received = self.known_received.max(ric);
    }

    fn too_large(&mut self, stream_id: u64, ric: u64, decoder_stream: &mut Vec<u8>) -> QpackError {
        if ric > 0 {
            self.acknowledge(stream_id, ric, decoder_stream);
        }
        QpackError {
            code: H3_MESSAGE_ERROR,
            reason: "field section larger than SETTINGS_MAX_FIELD_SECTION_SIZE",
        }
    }

    /// The field line a representation stands for.
    fn resolve(
        &self,
        line: FieldLine,
        base: u64,
        ric: u64,
        largest: &mut Option<u64>,
    ) -> Result<(Bytes, Bytes), QpackError> {
        let dynamic = |absolute: Option<u64>, largest: &mut Option<u64>| {
            let absolute = absolute.ok_or(decompression_failed("dynamic index below zero"))?;
            if absolute >= ric {
                return Err(decompression_failed(
                    "reference at or above the Required Insert Count",
                ));
            }
            let entry = self
                .table
                .get(absolute)
                .ok_or(decompression_failed("reference to an evicted entry"))?;
            *largest = Some(largest.map_or(absolute, |l| l.max(absolute)));
            Ok(entry)
        };
        let relative = |index: u64| base.checked_sub(index).and_then(|b| b.checked_sub(1));
        let post_base = |index: u64| base.checked_add(index);
        let static_entry = |index: u64| {
            static_table::get(index).ok_or(decompression_failed("invalid static table index"))
        };
        Ok(match line {
            FieldLine::IndexedStatic(index) => {
                let (n, v) = static_entry(index)?;
                (Bytes::from_static(n), Bytes::from_static(v))
            }
            FieldLine::IndexedDynamic(index) => dynamic(relative(index), largest)?.clone(),
            FieldLine::IndexedPostBase(index) => dynamic(post_base(index), largest)?.clone(),
            FieldLine::LiteralStaticName { index, value, .. } => {
                (Bytes::from_static(static_entry(index)?.0), value)
            }
            FieldLine::LiteralDynamicName { index, value, .. } => {
                (dynamic(relative(index), largest)?.0.clone(), value)
            }
            FieldLine::LiteralPostBaseName { index, value, .. } => {
                (dynamic(post_base(index), largest)?.0.clone(), value)
            }
            FieldLine::LiteralName { name, value, .. } => (name, value),
        })
    }

    fn forget_stream(&mut self, stream_id: u64) {
        self.blocked.retain(|&(s, _)| s != stream_id);
        self.unblocked.retain(|&s| s != stream_id);
    }

    /// Streams whose blocked section can now be decoded (each named once).
    pub fn unblocked(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.unblocked)
    }

    /// A request stream was reset or abandoned: forgets its blocked section and writes a
    /// Stream Cancellation (omitted when our maximum table capacity is zero, RFC 9204 §4.4.2).
    pub fn cancel_stream(&mut self, stream_id: u64, decoder_stream: &mut Vec<u8>) {
        self.forget_stream(stream_id);
        if self.max_table_capacity > 0 {
            DecoderInstruction::StreamCancel(stream_id).encode(decoder_stream);
        }
    }
}
