//! The QPACK encoder (RFC 9204 §2.1): chooses representations, maintains the dynamic table and
//! tracks what the decoder has acknowledged. The policy is documented on [`Encoder`].

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};

use bytes::Bytes;

use super::instructions::{
    DecoderInstruction, write_duplicate, write_indexed, write_indexed_post_base,
    write_insert_with_literal_name, write_insert_with_name_ref, write_literal_name,
    write_literal_name_ref, write_literal_post_base_name, write_section_prefix, write_set_capacity,
};
use super::{ENTRY_OVERHEAD, QPACK_DECODER_STREAM_ERROR, QpackError, prefix, static_table};

/// The largest dynamic table the encoder uses, whatever the peer allows: it bounds our memory.
pub const ENCODER_CAPACITY_LIMIT: u64 = 64 * 1024;

/// Counters of what the encoder did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderStats {
    /// Field sections encoded.
    pub sections: u64,
    /// Field lines encoded.
    pub fields: u64,
    /// Name and value octets of the field lines encoded (the uncompressed size).
    pub bytes_in: u64,
    /// Octets written to field sections.
    pub block_bytes: u64,
    /// Octets written to the encoder stream.
    pub encoder_stream_bytes: u64,
    /// Octets received on the decoder stream.
    pub decoder_stream_bytes: u64,
    /// Entries inserted (Insert With Name Reference / Literal Name).
    pub inserts: u64,
    /// Duplicate instructions.
    pub duplicates: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Field lines sent as static table references.
    pub static_refs: u64,
    /// Field lines sent as dynamic table references.
    pub dynamic_refs: u64,
    /// Literal field lines with a name reference (static or dynamic).
    pub name_refs: u64,
    /// Literal field lines with a literal name.
    pub literal_names: u64,
    /// Sections that reference unacknowledged entries (could block the decoder).
    pub blocking_sections: u64,
}

impl EncoderStats {
    /// (field section octets + encoder stream octets) / uncompressed name and value octets.
    pub fn ratio(&self) -> f64 {
        (self.block_bytes + self.encoder_stream_bytes) as f64 / self.bytes_in.max(1) as f64
    }
}

#[derive(Debug)]
struct Entry {
    name: Bytes,
    value: Bytes,
    /// [`hash_bytes`] of the name, and of the value chained to it.
    name_hash: u64,
    field_hash: u64,
    /// Unacknowledged sections (and the one being encoded) whose oldest reference is this
    /// entry. Entries leave the table from the oldest end and a referenced one is never
    /// evicted, so an entry is referenced at all exactly when it is some section's oldest
    /// reference by the time it is the oldest entry: counting only those suffices.
    refs: u32,
}

impl Entry {
    fn size(&self) -> u64 {
        self.name.len() as u64 + self.value.len() as u64 + ENTRY_OVERHEAD
    }
}

/// An encoded section not acknowledged yet.
#[derive(Debug, Clone, Copy)]
struct Section {
    required_insert_count: u64,
    /// The absolute index of the oldest entry it references.
    oldest_ref: u64,
}

/// A stream's unacknowledged sections, oldest first; the first without an allocation (a
/// stream seldom has more than its header section outstanding).
#[derive(Debug)]
struct StreamSections {
    first: Section,
    rest: VecDeque<Section>,
}

impl StreamSections {
    fn iter(&self) -> impl Iterator<Item = &Section> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }

    fn len(&self) -> usize {
        1 + self.rest.len()
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct NameStats {
    inserts: u32,
    hits: u32,
}

/// Slots of [`Encoder::literals`], by static table index.
const LITERAL_SLOTS: usize = 8;
/// Longer values are not kept there.
const MAX_CACHED_LITERAL: usize = 64;

/// The last literal field line written with one static name, encoded (the fields that are
/// never inserted repeat from one response to the next: `date` within its second, a file's
/// `etag` and `last-modified`); comparing the value costs less than Huffman-coding it again.
#[derive(Debug, Default)]
struct CachedLiteral {
    index: Option<usize>,
    value: Vec<u8>,
    line: Vec<u8>,
}

/// A keyed 64-bit hash of `data` (word-at-a-time multiply-rotate, then the MurmurHash3
/// finalizer). The encoder's lookup maps are keyed by it, so a lookup hashes the name and the
/// value once and clones nothing; a match is confirmed against the entry. The key is random per
/// encoder, and a map holds at most one entry per table entry (2048 for 64 KiB), so crafted
/// collisions can only make lookups miss or slow down boundedly.
fn hash_bytes(seed: u64, data: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(K).rotate_left(29);
    let mut h = seed ^ (data.len() as u64).wrapping_mul(K);
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        h = mix(
            h,
            u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
        );
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut word = 0u64;
        for &b in rest.iter().rev() {
            word = (word << 8) | b as u64;
        }
        h = mix(h, word);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// A hasher for keys that are already [`hash_bytes`] values.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type HashIndex<V> = HashMap<u64, V, BuildHasherDefault<PreHashed>>;

/// Names tracked for the "values rarely repeat" heuristic, at most.
const MAX_TRACKED_NAMES: usize = 512;

/// Never inserted: values that are unique per message or not worth the table space.
const NO_INDEX_NAMES: &[&[u8]] = &[
    b":path",
    b"content-length",
    b"content-range",
    b"date",
    b"etag",
    b"last-modified",
    b"expires",
    b"age",
    b"if-modified-since",
    b"if-none-match",
    b"if-range",
    b"location",
    b"range",
    b"set-cookie",
];

/// A QPACK encoder for one connection.
///
/// # Policy
///
/// For each field line, in order of preference:
///
/// 1. An exact match in the static table: Indexed Field Line (1 byte for indices below 63).
/// 2. An exact match in the dynamic table that may be referenced: Indexed Field Line (relative
///    or post-Base). "May be referenced" means: not in the draining zone (below), and either
///    acknowledged (absolute index below the Known Received Count) or blocking is allowed for
///    this section.
///    An exact match in the draining zone is refreshed with a Duplicate when the table has room,
///    and the duplicate referenced instead.
/// 3. A field worth inserting (below) is inserted (Insert With Name Reference when the static
///    or dynamic table has the name, else Insert With Literal Name) and referenced with a
///    post-Base index when blocking is allowed; otherwise the entry is there for later sections
///    once acknowledged, and this one gets a literal.
/// 4. A literal, with a name reference to the static table or to a referenceable dynamic entry
///    when there is one.
///
/// Worth inserting: not sensitive (`authorization`, `proxy-authorization`, short cookies are
/// sent as never-indexed literals), not a field whose values are unique per message (`:path`,
/// `content-length`, `date`, `etag`, ...), no larger than half the table, and not a name whose
/// inserts have rarely been reused (after 4 inserts, fewer hits than half the inserts: e.g. a
/// request ID).
///
/// Blocking: a section may reference unacknowledged entries only if its stream already could
/// block, or fewer than SETTINGS_QPACK_BLOCKED_STREAMS streams could; with a limit of 0 the
/// encoder only ever references acknowledged entries.
///
/// Draining (RFC 9204 §2.1.1.1): the oldest entries that would have to be evicted to keep 1/8 of
/// the capacity free are not referenced, so their references drain and they can be evicted; an
/// entry is never evicted while unacknowledged or referenced by an unacknowledged section (an
/// insert that would need that is not made).
///
/// The dynamic table capacity used is the peer's SETTINGS_QPACK_MAX_TABLE_CAPACITY, at most
/// [`ENCODER_CAPACITY_LIMIT`]; it is announced with the first insert.
#[derive(Debug)]
pub struct Encoder {
    max_blocked_streams: u64,
    max_entries: u64,
    /// The capacity we use.
    capacity: u64,
    capacity_sent: bool,
    huffman: bool,
    entries: VecDeque<Entry>,
    /// Absolute index of `entries[0]`.
    dropped: u64,
    size: u64,
    known_received: u64,
    /// Newest entry with this name and value / with this name, by hash.
    by_field: HashIndex<u64>,
    by_name: HashIndex<u64>,
    hash_seed: u64,
    /// Unacknowledged sections that reference the dynamic table, by stream, oldest first.
    outstanding: HashMap<u64, StreamSections>,
    /// The number of sections in `outstanding`.
    unacked: usize,
    /// The largest Required Insert Count of any section put in `outstanding`: once the
    /// decoder is known to have received that much, no stream can be blocking.
    ric_high: u64,
    /// By name hash.
    name_stats: HashIndex<NameStats>,
    /// Cached draining index (`None`: recompute).
    draining: Option<u64>,
    dec_buf: Vec<u8>,
    error: Option<QpackError>,
    stats: EncoderStats,
    scratch: Vec<u8>,
    /// Recent literal lines with a static name reference, by the name's index.
    literals: [CachedLiteral; LITERAL_SLOTS],
}

/// Sections referencing the dynamic table the encoder keeps waiting for acknowledgment; past
/// this it stops referencing the table until acknowledgments come (RFC 9204 §7.4).
pub const MAX_UNACKNOWLEDGED_SECTIONS: usize = 1024;

fn decoder_stream_error(reason: &'static str) -> QpackError {
    QpackError {
        code: QPACK_DECODER_STREAM_ERROR,
        reason,
    }
}

/// The state of one section being encoded.
struct SectionState {
    base: u64,
    /// The section may use the dynamic table at all (see [`MAX_UNACKNOWLEDGED_SECTIONS`]).
    dynamic: bool,
    blocking_ok: bool,
    /// The oldest and the newest entry referenced so far.
    oldest_ref: Option<u64>,
    newest_ref: Option<u64>,
}

impl Encoder {
    /// An encoder for a peer that sent these SETTINGS: SETTINGS_QPACK_MAX_TABLE_CAPACITY and
    /// SETTINGS_QPACK_BLOCKED_STREAMS.
    pub fn new(max_table_capacity: u64, max_blocked_streams: u64) -> Self {
        Encoder {
            max_blocked_streams,
            max_entries: max_table_capacity / 32,
            capacity: max_table_capacity.min(ENCODER_CAPACITY_LIMIT),
            capacity_sent: false,
            huffman: true,
            entries: VecDeque::new(),
            dropped: 0,
            size: 0,
            known_received: 0,
            by_field: HashIndex::default(),
            by_name: HashIndex::default(),
            hash_seed: RandomState::new().hash_one(0x51_u8),
            outstanding: HashMap::new(),
            unacked: 0,
            ric_high: 0,
            name_stats: HashIndex::default(),
            draining: None,
            dec_buf: Vec::new(),
            error: None,
            stats: EncoderStats::default(),
            scratch: Vec::new(),
            literals: Default::default(),
        }
    }

    /// Uses at most `cap` bytes of the table the decoder allows. MaxEntries, which the
    /// Required Insert Count is encoded modulo, stays the one from the decoder's
    /// SETTINGS_QPACK_MAX_TABLE_CAPACITY (RFC 9204 §4.5.1.1): derived from a smaller
    /// capacity of our choosing, the decoder would read a wrong count once the inserts
    /// pass twice our MaxEntries.
    pub fn limit_capacity(mut self, cap: u64) -> Self {
        self.capacity = self.capacity.min(cap);
        self
    }

    /// Takes the decoder's SETTINGS (SETTINGS_QPACK_MAX_TABLE_CAPACITY and
    /// SETTINGS_QPACK_BLOCKED_STREAMS) when they arrive after the encoder began without them
    /// (a table of 0 until then, RFC 9204 §3.2.3), using at most `cap` bytes of the table.
    /// What else the encoder holds stays: above all a decoder-stream instruction cut in two
    /// around the SETTINGS, whose first part is buffered.
    pub fn set_peer_settings(
        &mut self,
        max_table_capacity: u64,
        max_blocked_streams: u64,
        cap: u64,
    ) {
        if self.insert_count() > 0 {
            // Entries made under a capacity the decoder already had: keep it (never the
            // case here, where the capacity before SETTINGS is zero).
            return;
        }
        self.max_blocked_streams = max_blocked_streams;
        self.max_entries = max_table_capacity / 32;
        self.capacity = max_table_capacity.min(ENCODER_CAPACITY_LIMIT).min(cap);
        self.capacity_sent = false;
    }

    /// Uses the Huffman code for strings when it is shorter (the default), or never.
    pub fn set_huffman(&mut self, on: bool) {
        self.huffman = on;
        self.literals = Default::default();
    }

    /// Counters of what the encoder did.
    pub fn stats(&self) -> EncoderStats {
        self.stats
    }

    /// Entries inserted so far.
    pub fn insert_count(&self) -> u64 {
        self.dropped + self.entries.len() as u64
    }

    /// Inserts the decoder has acknowledged.
    pub fn known_received_count(&self) -> u64 {
        self.known_received
    }

    /// The size of the dynamic table.
    pub fn table_size(&self) -> u64 {
        self.size
    }

    /// The dynamic table capacity the encoder uses.
    pub fn table_capacity(&self) -> u64 {
        self.capacity
    }

    /// Encoded sections with dynamic table references the decoder has not acknowledged (nor
    /// cancelled) yet.
    pub fn unacknowledged_sections(&self) -> usize {
        self.unacked
    }

    /// Whether any entry is still referenced by an unacknowledged section.
    pub fn has_referenced_entries(&self) -> bool {
        self.entries.iter().any(|e| e.refs > 0)
    }

    /// Streams whose unacknowledged sections could block the decoder.
    pub fn blocking_streams(&self) -> u64 {
        let krc = self.known_received;
        // No scan of every stream when nothing outstanding can block (the usual case once
        // the decoder's acknowledgments have caught up).
        if self.ric_high <= krc {
            return 0;
        }
        self.outstanding
            .values()
            .filter(|q| q.iter().any(|s| s.required_insert_count > krc))
            .count() as u64
    }

    fn stream_is_blocking(&self, stream_id: u64) -> bool {
        if self.ric_high <= self.known_received {
            return false;
        }
        self.outstanding.get(&stream_id).is_some_and(|q| {
            q.iter()
                .any(|s| s.required_insert_count > self.known_received)
        })
    }

    /// Encodes a field section for `stream_id` into `block` (the HEADERS frame payload) and
    /// appends the encoder stream instructions it needs to `encoder_stream` (send those first,
    /// or at least not later). Fails only after a decoder stream error.
    pub fn encode(
        &mut self,
        stream_id: u64,
        fields: &[(Bytes, Bytes)],
        block: &mut Vec<u8>,
        encoder_stream: &mut Vec<u8>,
    ) -> Result<(), QpackError> {
        let fields = fields.iter().map(|(n, v)| (&n[..], &v[..]));
        self.encode_with(stream_id, fields, block, encoder_stream)
    }

    /// As [`encode`](Self::encode), from borrowed names and values (a header map's, say):
    /// nothing is copied but what the dynamic table keeps.
    pub fn encode_with<'a>(
        &mut self,
        stream_id: u64,
        fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        block: &mut Vec<u8>,
        encoder_stream: &mut Vec<u8>,
    ) -> Result<(), QpackError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let enc_start = encoder_stream.len();
        let block_start = block.len();
        let mut lines = std::mem::take(&mut self.scratch);
        lines.clear();
        let blocking_ok = self.max_blocked_streams > 0
            && (self.stream_is_blocking(stream_id)
                || self.blocking_streams() < self.max_blocked_streams);
        let mut st = SectionState {
            base: self.insert_count(),
            dynamic: self.unacked < MAX_UNACKNOWLEDGED_SECTIONS,
            blocking_ok,
            oldest_ref: None,
            newest_ref: None,
        };
        let mut count = 0u64;
        for (name, value) in fields {
            self.encode_field(&mut st, name, value, &mut lines, encoder_stream);
            self.stats.bytes_in += (name.len() + value.len()) as u64;
            count += 1;
        }
        let ric = st.newest_ref.map_or(0, |m| m + 1);
        write_section_prefix(block, ric, st.base, self.max_entries);
        block.extend_from_slice(&lines);
        self.scratch = lines;
        if ric > 0 {
            if ric > self.known_received {
                self.stats.blocking_sections += 1;
            }
            self.ric_high = self.ric_high.max(ric);
            let section = Section {
                required_insert_count: ric,
                oldest_ref: st.oldest_ref.unwrap_or(ric - 1),
            };
            match self.outstanding.entry(stream_id) {
                MapEntry::Occupied(mut o) => o.get_mut().rest.push_back(section),
                MapEntry::Vacant(v) => {
                    v.insert(StreamSections {
                        first: section,
                        rest: VecDeque::new(),
                    });
                }
            }
            self.unacked += 1;
        }
        self.stats.sections += 1;
        self.stats.fields += count;
        self.stats.block_bytes += (block.len() - block_start) as u64;
        self.stats.encoder_stream_bytes += (encoder_stream.len() - enc_start) as u64;
        Ok(())
    }

    fn encode_field(
        &mut self,
        st: &mut SectionState,
        name: &[u8],
        value: &[u8],
        lines: &mut Vec<u8>,
        enc: &mut Vec<u8>,
    ) {
        if let Some(index) = static_table::find_exact(name, value) {
            write_indexed(lines, true, index as u64);
            self.stats.static_refs += 1;
            return;
        }
        let never_index = is_sensitive(name, value);
        let name_hash = hash_bytes(self.hash_seed, name);
        if !never_index && self.capacity > 0 && st.dynamic {
            let size = name.len() as u64 + value.len() as u64 + ENTRY_OVERHEAD;
            let field_hash = hash_bytes(name_hash, value);
            if let Some(abs) = self.find_field(field_hash, name, value) {
                if self.can_reference(abs, st.blocking_ok) {
                    self.reference(st, abs, lines);
                    self.name_stat(name_hash, |s| s.hits += 1);
                    return;
                }
                if abs >= self.dropped && abs < self.draining_index() && self.make_room(size) {
                    // Refresh an entry about to be evicted (which may be the one that makes
                    // room: the decoder reads it before evicting, RFC 9204 §3.2.2).
                    write_duplicate(enc, self.insert_count() - 1 - abs);
                    self.stats.duplicates += 1;
                    let new = self.push_entry(name, value, name_hash, field_hash);
                    self.name_stat(name_hash, |s| s.hits += 1);
                    if st.blocking_ok {
                        self.reference(st, new, lines);
                        return;
                    }
                }
                // Otherwise the entry is waiting for its acknowledgment: a literal for now.
            } else if self.should_index(name, name_hash, size) && self.make_room(size) {
                self.send_capacity(enc);
                if let Some(index) = static_table::find_name(name) {
                    write_insert_with_name_ref(enc, true, index as u64, value, self.huffman);
                } else if let Some(abs) = self.find_name(name_hash, name) {
                    write_insert_with_name_ref(
                        enc,
                        false,
                        self.insert_count() - 1 - abs,
                        value,
                        self.huffman,
                    );
                } else {
                    write_insert_with_literal_name(enc, name, value, self.huffman);
                }
                self.stats.inserts += 1;
                let new = self.push_entry(name, value, name_hash, field_hash);
                self.name_stat(name_hash, |s| s.inserts += 1);
                if st.blocking_ok {
                    self.reference(st, new, lines);
                    return;
                }
            }
        }
        // A literal.
        if let Some(index) = static_table::find_name(name) {
            if never_index {
                write_literal_name_ref(lines, true, index as u64, value, true, self.huffman);
            } else {
                self.literal_with_static_name(index.into(), value, lines);
            }
            self.stats.name_refs += 1;
        } else if let Some(abs) = self
            .find_name(name_hash, name)
            .filter(|&a| st.dynamic && self.can_reference(a, st.blocking_ok))
        {
            self.note_ref(st, abs);
            if abs < st.base {
                write_literal_name_ref(
                    lines,
                    false,
                    st.base - 1 - abs,
                    value,
                    never_index,
                    self.huffman,
                );
            } else {
                write_literal_post_base_name(
                    lines,
                    abs - st.base,
                    value,
                    never_index,
                    self.huffman,
                );
            }
            self.stats.name_refs += 1;
        } else {
            write_literal_name(lines, name, value, never_index, self.huffman);
            self.stats.literal_names += 1;
        }
    }

    /// A Literal Field Line with a static name reference, from [`Encoder::literals`] when the
    /// same line was the last one written for that name.
    fn literal_with_static_name(&mut self, index: usize, value: &[u8], lines: &mut Vec<u8>) {
        let slot = &mut self.literals[index % LITERAL_SLOTS];
        if slot.index == Some(index) && slot.value == value {
            lines.extend_from_slice(&slot.line);
            return;
        }
        let at = lines.len();
        write_literal_name_ref(lines, true, index as u64, value, false, self.huffman);
        if value.len() <= MAX_CACHED_LITERAL {
            slot.index = Some(index);
            slot.value.clear();
            slot.value.extend_from_slice(value);
            slot.line.clear();
            slot.line.extend_from_slice(&lines[at..]);
        }
    }

    /// Writes an Indexed Field Line for dynamic entry `abs` and counts the reference.
    fn reference(&mut self, st: &mut SectionState, abs: u64, lines: &mut Vec<u8>) {
        if abs < st.base {
            write_indexed(lines, false, st.base - 1 - abs);
        } else {
            write_indexed_post_base(lines, abs - st.base);
        }
        self.note_ref(st, abs);
        self.stats.dynamic_refs += 1;
    }

    /// Counts a reference of the section being encoded to entry `abs` (see [`Entry::refs`]).
    fn note_ref(&mut self, st: &mut SectionState, abs: u64) {
        st.newest_ref = Some(st.newest_ref.map_or(abs, |n| n.max(abs)));
        if st.oldest_ref.is_some_and(|o| o <= abs) {
            return;
        }
        if let Some(o) = st.oldest_ref.replace(abs) {
            self.entries[(o - self.dropped) as usize].refs -= 1;
        }
        self.entries[(abs - self.dropped) as usize].refs += 1;
    }

    fn can_reference(&mut self, abs: u64, blocking_ok: bool) -> bool {
        abs >= self.dropped
            && abs >= self.draining_index()
            && (abs < self.known_received || blocking_ok)
    }

    fn entry(&self, abs: u64) -> Option<&Entry> {
        self.entries
            .get(usize::try_from(abs.checked_sub(self.dropped)?).ok()?)
    }

    /// The newest entry with this name and value.
    fn find_field(&self, field_hash: u64, name: &[u8], value: &[u8]) -> Option<u64> {
        let abs = *self.by_field.get(&field_hash)?;
        let e = self.entry(abs)?;
        (e.name == name && e.value == value).then_some(abs)
    }

    /// The newest entry with this name.
    fn find_name(&self, name_hash: u64, name: &[u8]) -> Option<u64> {
        let abs = *self.by_name.get(&name_hash)?;
        (self.entry(abs)?.name == name).then_some(abs)
    }

    fn name_stat(&mut self, name_hash: u64, f: impl FnOnce(&mut NameStats)) {
        if let Some(s) = self.name_stats.get_mut(&name_hash) {
            f(s);
        } else if self.name_stats.len() < MAX_TRACKED_NAMES {
            let mut s = NameStats::default();
            f(&mut s);
            self.name_stats.insert(name_hash, s);
        }
    }

    /// Whether a field line not in the table is worth inserting.
    fn should_index(&self, name: &[u8], name_hash: u64, size: u64) -> bool {
        if self.max_entries == 0 || size > self.capacity / 2 || NO_INDEX_NAMES.contains(&name) {
            return false;
        }
        match self.name_stats.get(&name_hash) {
            Some(s) => s.inserts < 4 || s.hits * 2 >= s.inserts,
            None => true,
        }
    }

    fn send_capacity(&mut self, enc: &mut Vec<u8>) {
        if !self.capacity_sent {
            write_set_capacity(enc, self.capacity);
            self.capacity_sent = true;
        }
    }

    /// The smallest absolute index the encoder still references: older entries are draining.
    fn draining_index(&mut self) -> u64 {
        if let Some(d) = self.draining {
            return d;
        }
        let target = self.capacity / 8;
        let mut free = self.capacity - self.size;
        let mut index = self.dropped;
        for e in &self.entries {
            if free >= target {
                break;
            }
            free += e.size();
            index += 1;
        }
        self.draining = Some(index);
        index
    }

    /// Evicts entries until `size` more fits; `false` (and nothing evicted) when that would
    /// evict an entry that is not evictable.
    fn make_room(&mut self, size: u64) -> bool {
        if size > self.capacity {
            return false;
        }
        let free = self.capacity - self.size;
        let mut reclaimed = 0;
        let mut count = 0;
        while free + reclaimed < size {
            let abs = self.dropped + count as u64;
            let Some(e) = self.entries.get(count) else {
                return false;
            };
            if abs >= self.known_received || e.refs > 0 {
                return false;
            }
            reclaimed += e.size();
            count += 1;
        }
        for _ in 0..count {
            self.evict();
        }
        true
    }

    fn evict(&mut self) {
        let Some(e) = self.entries.pop_front() else {
            return;
        };
        let abs = self.dropped;
        self.dropped += 1;
        self.size -= e.size();
        self.stats.evictions += 1;
        self.draining = None;
        if self.by_name.get(&e.name_hash) == Some(&abs) {
            self.by_name.remove(&e.name_hash);
        }
        if self.by_field.get(&e.field_hash) == Some(&abs) {
            self.by_field.remove(&e.field_hash);
        }
    }

    fn push_entry(&mut self, name: &[u8], value: &[u8], name_hash: u64, field_hash: u64) -> u64 {
        let abs = self.insert_count();
        let e = Entry {
            name: Bytes::copy_from_slice(name),
            value: Bytes::copy_from_slice(value),
            name_hash,
            field_hash,
            refs: 0,
        };
        self.size += e.size();
        self.by_name.insert(name_hash, abs);
        self.by_field.insert(field_hash, abs);
        self.entries.push_back(e);
        self.draining = None;
        abs
    }

    fn release(&mut self, section: Section) {
        // A referenced entry is never evicted, so it is always there.
        if let Some(e) = section
            .oldest_ref
            .checked_sub(self.dropped)
            .and_then(|i| self.entries.get_mut(i as usize))
        {
            e.refs = e.refs.saturating_sub(1);
        }
    }

    /// Feeds bytes received on the peer's decoder stream (any split). Errors are connection
    /// errors of type QPACK_DECODER_STREAM_ERROR and stick.
    pub fn on_decoder_stream(&mut self, data: &[u8]) -> Result<(), QpackError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.stats.decoder_stream_bytes += data.len() as u64;
        let mut buf = std::mem::take(&mut self.dec_buf);
        buf.extend_from_slice(data);
        let mut pos = 0;
        let result = loop {
            if pos == buf.len() {
                break Ok(());
            }
            match DecoderInstruction::parse(&buf[pos..]) {
                Ok((instruction, len)) => {
                    pos += len;
                    if let Err(e) = self.apply(instruction) {
                        break Err(e);
                    }
                }
                // An integer takes at most 10 octets, so this holds at most 9.
                Err(prefix::Error::Incomplete(_)) => break Ok(()),
                Err(prefix::Error::Invalid(reason)) => break Err(decoder_stream_error(reason)),
            }
        };
        if let Err(e) = result {
            self.error = Some(e);
            return Err(e);
        }
        buf.drain(..pos);
        self.dec_buf = buf;
        Ok(())
    }

    fn apply(&mut self, instruction: DecoderInstruction) -> Result<(), QpackError> {
        match instruction {
            DecoderInstruction::SectionAck(stream) => {
                let MapEntry::Occupied(mut queue) = self.outstanding.entry(stream) else {
                    return Err(decoder_stream_error(
                        "Section Acknowledgment without an unacknowledged section",
                    ));
                };
                let q = queue.get_mut();
                let section = q.first;
                match q.rest.pop_front() {
                    Some(next) => q.first = next,
                    None => {
                        queue.remove();
                    }
                }
                self.unacked -= 1;
                self.known_received = self.known_received.max(section.required_insert_count);
                self.release(section);
            }
            DecoderInstruction::StreamCancel(stream) => {
                if let Some(queue) = self.outstanding.remove(&stream) {
                    self.unacked -= queue.len();
                    self.release(queue.first);
                    for section in queue.rest {
                        self.release(section);
                    }
                }
            }
            DecoderInstruction::InsertCountIncrement(n) => {
                if n == 0 {
                    return Err(decoder_stream_error("Insert Count Increment of zero"));
                }
                if n > self.insert_count() - self.known_received {
                    return Err(decoder_stream_error(
                        "Insert Count Increment beyond the inserts sent",
                    ));
                }
                self.known_received += n;
            }
        }
        Ok(())
    }
}

/// Sent as never-indexed literals (RFC 9204 §7.1.3): credentials, and cookies short enough to
/// guess.
fn is_sensitive(name: &[u8], value: &[u8]) -> bool {
    name == b"authorization"
        || name == b"proxy-authorization"
        || (name == b"cookie" && value.len() < 20)
}
