//! The Huffman code of RFC 7541 Appendix B, used by QPACK string literals (RFC 9204 §4.1.2).
//!
//! [`encode`] writes the code MSB first and pads the last octet with the most significant bits of
//! EOS (all ones). [`decode`] is the fast decoder; [`decode_reference`] a deliberately simple
//! bit-by-bit tree walk kept as the test oracle and the benchmark baseline.
//!
//! # The fast decoder
//!
//! The code is *canonical*: within each length the codes are consecutive in symbol order, and a
//! longer code, left-aligned, is numerically larger than every shorter one (the table below is
//! checked against that in the unit tests, and every code is the one RFC 7541 prints). That gives
//! two cheap tools:
//!
//! * **A 12-bit lookup table** (`PRIMARY`, 4096 × `u32` = 16 KiB, built at compile time). The
//!   next 12 input bits index it; an entry holds the symbol whose code is a prefix of those bits
//!   (every code of 12 bits or less: all of printable ASCII except ``<\^`{}~$@[]``), and, when
//!   the remaining bits also hold a complete code, a *second* symbol. Header text is mostly
//!   5–7-bit codes (lower-case letters, digits, `/.-=`), so a typical lookup emits two octets.
//! * **Canonical decoding for the long codes** (13–30 bits, rare in headers): the length of the
//!   code is the smallest `L` whose left-aligned limit exceeds the 32-bit window, and the symbol is
//!   found by arithmetic from there (`decode_long`). The search starts at a length picked by the
//!   number of leading ones of the window, so it takes one to three steps.
//!
//! Bits are held left-aligned in a 64-bit accumulator refilled 7–8 octets at a time with one
//! unaligned load and no branches, so one lookup costs a shift, one L1 load and two stores. The
//! input is read as if followed by endless ones (what EOS padding looks like) while a counter
//! keeps the number of real bits left, so there is no separate slow path for the last octets:
//! the string ends where a code would run past the real bits, which is valid only for fewer
//! than 8 remaining bits that are all ones.
//!
//! Why this design rather than the alternatives:
//!
//! * A nibble state machine (256 states × 16 nibbles, the nghttp2 style) also fits in L1, but
//!   needs two dependent loads per input octet (≈ 1.5 per output symbol) and emits at most one
//!   symbol per step.
//! * A 16-bit table (XQUIC style) would emit up to three symbols per lookup, but 65536 entries of
//!   4+ bytes (256 KiB) do not fit in L1 or L2 on small cores, and header strings are short, so
//!   the table would mostly be cold; 12 bits keep the table in L1 while still decoding the common
//!   5–6-bit codes two at a time.
//!
//! Padding (RFC 7541 §5.2) is checked exactly: the bits left after the last complete symbol must
//! be fewer than 8 and all ones; a complete EOS code in the string is an error. Both decoders
//! agree on every input, valid or not (tested on random input against [`decode_reference`]).

/// Why a Huffman-coded string was rejected (RFC 7541 §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HuffmanError {
    /// The string contains the EOS symbol.
    Eos,
    /// The padding is longer than 7 bits or not a prefix of EOS (not all ones).
    Padding,
}

impl std::fmt::Display for HuffmanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HuffmanError::Eos => "EOS symbol in a Huffman-coded string",
            HuffmanError::Padding => "invalid padding of a Huffman-coded string",
        })
    }
}

impl std::error::Error for HuffmanError {}

/// RFC 7541 Appendix B: `(code, length in bits)` for symbols 0–255 and EOS (256); the code is
/// right-aligned ("code as hex" in the RFC).
#[rustfmt::skip]
pub(crate) const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13), // (  0) 
    (0x7fffd8, 23), // (  1) 
    (0xfffffe2, 28), // (  2) 
    (0xfffffe3, 28), // (  3) 
    (0xfffffe4, 28), // (  4) 
    (0xfffffe5, 28), // (  5) 
    (0xfffffe6, 28), // (  6) 
    (0xfffffe7, 28), // (  7) 
    (0xfffffe8, 28), // (  8) 
    (0xffffea, 24), // (  9) 
    (0x3ffffffc, 30), // ( 10) 
    (0xfffffe9, 28), // ( 11) 
    (0xfffffea, 28), // ( 12) 
    (0x3ffffffd, 30), // ( 13) 
    (0xfffffeb, 28), // ( 14) 
    (0xfffffec, 28), // ( 15) 
    (0xfffffed, 28), // ( 16) 
    (0xfffffee, 28), // ( 17) 
    (0xfffffef, 28), // ( 18) 
    (0xffffff0, 28), // ( 19) 
    (0xffffff1, 28), // ( 20) 
    (0xffffff2, 28), // ( 21) 
    (0x3ffffffe, 30), // ( 22) 
    (0xffffff3, 28), // ( 23) 
    (0xffffff4, 28), // ( 24) 
    (0xffffff5, 28), // ( 25) 
    (0xffffff6, 28), // ( 26) 
    (0xffffff7, 28), // ( 27) 
    (0xffffff8, 28), // ( 28) 
    (0xffffff9, 28), // ( 29) 
    (0xffffffa, 28), // ( 30) 
    (0xffffffb, 28), // ( 31) 
    (0x14, 6), // ( 32) ' '
    (0x3f8, 10), // ( 33) '!'
    (0x3f9, 10), // ( 34) '"'
    (0xffa, 12), // ( 35) '#'
    (0x1ff9, 13), // ( 36) '$'
    (0x15, 6), // ( 37) '%'
    (0xf8, 8), // ( 38) '&'
    (0x7fa, 11), // ( 39) "'"
    (0x3fa, 10), // ( 40) '('
    (0x3fb, 10), // ( 41) ')'
    (0xf9, 8), // ( 42) '*'
    (0x7fb, 11), // ( 43) '+'
    (0xfa, 8), // ( 44) ','
    (0x16, 6), // ( 45) '-'
    (0x17, 6), // ( 46) '.'
    (0x18, 6), // ( 47) '/'
    (0x0, 5), // ( 48) '0'
    (0x1, 5), // ( 49) '1'
    (0x2, 5), // ( 50) '2'
    (0x19, 6), // ( 51) '3'
    (0x1a, 6), // ( 52) '4'
    (0x1b, 6), // ( 53) '5'
    (0x1c, 6), // ( 54) '6'
    (0x1d, 6), // ( 55) '7'
    (0x1e, 6), // ( 56) '8'
    (0x1f, 6), // ( 57) '9'
    (0x5c, 7), // ( 58) ':'
    (0xfb, 8), // ( 59) ';'
    (0x7ffc, 15), // ( 60) '<'
    (0x20, 6), // ( 61) '='
    (0xffb, 12), // ( 62) '>'
    (0x3fc, 10), // ( 63) '?'
    (0x1ffa, 13), // ( 64) '@'
    (0x21, 6), // ( 65) 'A'
    (0x5d, 7), // ( 66) 'B'
    (0x5e, 7), // ( 67) 'C'
    (0x5f, 7), // ( 68) 'D'
    (0x60, 7), // ( 69) 'E'
    (0x61, 7), // ( 70) 'F'
    (0x62, 7), // ( 71) 'G'
    (0x63, 7), // ( 72) 'H'
    (0x64, 7), // ( 73) 'I'
    (0x65, 7), // ( 74) 'J'
    (0x66, 7), // ( 75) 'K'
    (0x67, 7), // ( 76) 'L'
    (0x68, 7), // ( 77) 'M'
    (0x69, 7), // ( 78) 'N'
    (0x6a, 7), // ( 79) 'O'
    (0x6b, 7), // ( 80) 'P'
    (0x6c, 7), // ( 81) 'Q'
    (0x6d, 7), // ( 82) 'R'
    (0x6e, 7), // ( 83) 'S'
    (0x6f, 7), // ( 84) 'T'
    (0x70, 7), // ( 85) 'U'
    (0x71, 7), // ( 86) 'V'
    (0x72, 7), // ( 87) 'W'
    (0xfc, 8), // ( 88) 'X'
    (0x73, 7), // ( 89) 'Y'
    (0xfd, 8), // ( 90) 'Z'
    (0x1ffb, 13), // ( 91) '['
    (0x7fff0, 19), // ( 92) '\\'
    (0x1ffc, 13), // ( 93) ']'
    (0x3ffc, 14), // ( 94) '^'
    (0x22, 6), // ( 95) '_'
    (0x7ffd, 15), // ( 96) '`'
    (0x3, 5), // ( 97) 'a'
    (0x23, 6), // ( 98) 'b'
    (0x4, 5), // ( 99) 'c'
    (0x24, 6), // (100) 'd'
    (0x5, 5), // (101) 'e'
    (0x25, 6), // (102) 'f'
    (0x26, 6), // (103) 'g'
    (0x27, 6), // (104) 'h'
    (0x6, 5), // (105) 'i'
    (0x74, 7), // (106) 'j'
    (0x75, 7), // (107) 'k'
    (0x28, 6), // (108) 'l'
    (0x29, 6), // (109) 'm'
    (0x2a, 6), // (110) 'n'
    (0x7, 5), // (111) 'o'
    (0x2b, 6), // (112) 'p'
    (0x76, 7), // (113) 'q'
    (0x2c, 6), // (114) 'r'
    (0x8, 5), // (115) 's'
    (0x9, 5), // (116) 't'
    (0x2d, 6), // (117) 'u'
    (0x77, 7), // (118) 'v'
    (0x78, 7), // (119) 'w'
    (0x79, 7), // (120) 'x'
    (0x7a, 7), // (121) 'y'
    (0x7b, 7), // (122) 'z'
    (0x7ffe, 15), // (123) '{'
    (0x7fc, 11), // (124) '|'
    (0x3ffd, 14), // (125) '}'
    (0x1ffd, 13), // (126) '~'
    (0xffffffc, 28), // (127) 
    (0xfffe6, 20), // (128) 
    (0x3fffd2, 22), // (129) 
    (0xfffe7, 20), // (130) 
    (0xfffe8, 20), // (131) 
    (0x3fffd3, 22), // (132) 
    (0x3fffd4, 22), // (133) 
    (0x3fffd5, 22), // (134) 
    (0x7fffd9, 23), // (135) 
    (0x3fffd6, 22), // (136) 
    (0x7fffda, 23), // (137) 
    (0x7fffdb, 23), // (138) 
    (0x7fffdc, 23), // (139) 
    (0x7fffdd, 23), // (140) 
    (0x7fffde, 23), // (141) 
    (0xffffeb, 24), // (142) 
    (0x7fffdf, 23), // (143) 
    (0xffffec, 24), // (144) 
    (0xffffed, 24), // (145) 
    (0x3fffd7, 22), // (146) 
    (0x7fffe0, 23), // (147) 
    (0xffffee, 24), // (148) 
    (0x7fffe1, 23), // (149) 
    (0x7fffe2, 23), // (150) 
    (0x7fffe3, 23), // (151) 
    (0x7fffe4, 23), // (152) 
    (0x1fffdc, 21), // (153) 
    (0x3fffd8, 22), // (154) 
    (0x7fffe5, 23), // (155) 
    (0x3fffd9, 22), // (156) 
    (0x7fffe6, 23), // (157) 
    (0x7fffe7, 23), // (158) 
    (0xffffef, 24), // (159) 
    (0x3fffda, 22), // (160) 
    (0x1fffdd, 21), // (161) 
    (0xfffe9, 20), // (162) 
    (0x3fffdb, 22), // (163) 
    (0x3fffdc, 22), // (164) 
    (0x7fffe8, 23), // (165) 
    (0x7fffe9, 23), // (166) 
    (0x1fffde, 21), // (167) 
    (0x7fffea, 23), // (168) 
    (0x3fffdd, 22), // (169) 
    (0x3fffde, 22), // (170) 
    (0xfffff0, 24), // (171) 
    (0x1fffdf, 21), // (172) 
    (0x3fffdf, 22), // (173) 
    (0x7fffeb, 23), // (174) 
    (0x7fffec, 23), // (175) 
    (0x1fffe0, 21), // (176) 
    (0x1fffe1, 21), // (177) 
    (0x3fffe0, 22), // (178) 
    (0x1fffe2, 21), // (179) 
    (0x7fffed, 23), // (180) 
    (0x3fffe1, 22), // (181) 
    (0x7fffee, 23), // (182) 
    (0x7fffef, 23), // (183) 
    (0xfffea, 20), // (184) 
    (0x3fffe2, 22), // (185) 
    (0x3fffe3, 22), // (186) 
    (0x3fffe4, 22), // (187) 
    (0x7ffff0, 23), // (188) 
    (0x3fffe5, 22), // (189) 
    (0x3fffe6, 22), // (190) 
    (0x7ffff1, 23), // (191) 
    (0x3ffffe0, 26), // (192) 
    (0x3ffffe1, 26), // (193) 
    (0xfffeb, 20), // (194) 
    (0x7fff1, 19), // (195) 
    (0x3fffe7, 22), // (196) 
    (0x7ffff2, 23), // (197) 
    (0x3fffe8, 22), // (198) 
    (0x1ffffec, 25), // (199) 
    (0x3ffffe2, 26), // (200) 
    (0x3ffffe3, 26), // (201) 
    (0x3ffffe4, 26), // (202) 
    (0x7ffffde, 27), // (203) 
    (0x7ffffdf, 27), // (204) 
    (0x3ffffe5, 26), // (205) 
    (0xfffff1, 24), // (206) 
    (0x1ffffed, 25), // (207) 
    (0x7fff2, 19), // (208) 
    (0x1fffe3, 21), // (209) 
    (0x3ffffe6, 26), // (210) 
    (0x7ffffe0, 27), // (211) 
    (0x7ffffe1, 27), // (212) 
    (0x3ffffe7, 26), // (213) 
    (0x7ffffe2, 27), // (214) 
    (0xfffff2, 24), // (215) 
    (0x1fffe4, 21), // (216) 
    (0x1fffe5, 21), // (217) 
    (0x3ffffe8, 26), // (218) 
    (0x3ffffe9, 26), // (219) 
    (0xffffffd, 28), // (220) 
    (0x7ffffe3, 27), // (221) 
    (0x7ffffe4, 27), // (222) 
    (0x7ffffe5, 27), // (223) 
    (0xfffec, 20), // (224) 
    (0xfffff3, 24), // (225) 
    (0xfffed, 20), // (226) 
    (0x1fffe6, 21), // (227) 
    (0x3fffe9, 22), // (228) 
    (0x1fffe7, 21), // (229) 
    (0x1fffe8, 21), // (230) 
    (0x7ffff3, 23), // (231) 
    (0x3fffea, 22), // (232) 
    (0x3fffeb, 22), // (233) 
    (0x1ffffee, 25), // (234) 
    (0x1ffffef, 25), // (235) 
    (0xfffff4, 24), // (236) 
    (0xfffff5, 24), // (237) 
    (0x3ffffea, 26), // (238) 
    (0x7ffff4, 23), // (239) 
    (0x3ffffeb, 26), // (240) 
    (0x7ffffe6, 27), // (241) 
    (0x3ffffec, 26), // (242) 
    (0x3ffffed, 26), // (243) 
    (0x7ffffe7, 27), // (244) 
    (0x7ffffe8, 27), // (245) 
    (0x7ffffe9, 27), // (246) 
    (0x7ffffea, 27), // (247) 
    (0x7ffffeb, 27), // (248) 
    (0xffffffe, 28), // (249) 
    (0x7ffffec, 27), // (250) 
    (0x7ffffed, 27), // (251) 
    (0x7ffffee, 27), // (252) 
    (0x7ffffef, 27), // (253) 
    (0x7fffff0, 27), // (254) 
    (0x3ffffee, 26), // (255) 
    (0x3fffffff, 30), // (256) EOS
];

const EOS: u16 = 256;

/// Appends the Huffman encoding of `src` to `out`, padded with ones to an octet boundary.
pub fn encode(src: &[u8], out: &mut Vec<u8>) {
    encode_with_len(src, encoded_len(src), out);
}

/// [`encode`] for a caller that already knows `len`, the [`encoded_len`] of `src`.
pub(crate) fn encode_with_len(src: &[u8], len: usize, out: &mut Vec<u8>) {
    out.reserve(len);
    // Codes are at most 30 bits: after a flush at most 31 bits are pending, so the newest 61
    // fit in 64, and four octets go out at a time (bits above the pending ones are stale and
    // never read).
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    for &b in src {
        let (code, n) = CODES[b as usize];
        acc = (acc << n) | u64::from(code);
        bits += u32::from(n);
        if bits >= 32 {
            bits -= 32;
            out.extend_from_slice(&((acc >> bits) as u32).to_be_bytes());
        }
    }
    while bits >= 8 {
        bits -= 8;
        out.push((acc >> bits) as u8);
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
}

/// The length in octets of the Huffman encoding of `src`.
pub fn encoded_len(src: &[u8]) -> usize {
    let bits: usize = src.iter().map(|&b| CODES[b as usize].1 as usize).sum();
    bits.div_ceil(8)
}

// ---------------------------------------------------------------------------------------------
// Canonical-code tables, computed at compile time from CODES.

/// For each length `L` (index), the left-aligned (in 32 bits) first code after the codes of
/// length `L`, as u64 (the limit for 30 bits is 2^32). Lengths without codes repeat the previous
/// limit, so "the smallest L with window < LIMIT[L]" is the length of the code in the window.
const LIMIT: [u64; 31] = build_canonical().0;
/// For each length, `first_code[L]` (right-aligned).
const FIRST: [u32; 31] = build_canonical().1;
/// For each length, the position in [`SORTED`] of the first symbol of that length.
const OFFSET: [u16; 31] = build_canonical().2;
/// Symbols sorted by (code length, symbol), i.e. by code.
const SORTED: [u16; 257] = build_canonical().3;

const fn build_canonical() -> ([u64; 31], [u32; 31], [u16; 31], [u16; 257]) {
    let mut count = [0u32; 31];
    let mut i = 0;
    while i < 257 {
        count[CODES[i].1 as usize] += 1;
        i += 1;
    }
    let mut sorted = [0u16; 257];
    let mut offset = [0u16; 31];
    let mut n = 0usize;
    let mut len = 1;
    while len <= 30 {
        offset[len] = n as u16;
        let mut s = 0;
        while s < 257 {
            if CODES[s].1 as usize == len {
                sorted[n] = s as u16;
                n += 1;
            }
            s += 1;
        }
        len += 1;
    }
    let mut first = [0u32; 31];
    let mut limit = [0u64; 31];
    let mut code: u32 = 0;
    let mut len = 1;
    while len <= 30 {
        first[len] = code;
        code += count[len];
        limit[len] = (code as u64) << (32 - len);
        code <<= 1;
        len += 1;
    }
    (limit, first, offset, sorted)
}

/// For each count `k` of leading ones in a window, the shortest code length worth trying: all
/// codes of shorter lengths are numerically below any window starting with `k` ones. Makes the
/// search below one to three steps (EOS, all ones: one).
const START: [u8; 33] = build_start();

const fn build_start() -> [u8; 33] {
    let mut start = [0u8; 33];
    let mut k = 0;
    while k <= 32 {
        // The smallest 32-bit window with k leading ones.
        let base: u64 = if k == 0 {
            0
        } else {
            (u32::MAX << (32 - k)) as u64
        };
        let mut len = 5;
        while len < 30 && LIMIT[len] <= base {
            len += 1;
        }
        start[k] = len as u8;
        k += 1;
    }
    start
}

/// Decodes the code at the top of the left-aligned 32-bit `window`: `(symbol, length)`. Every
/// 32-bit window starts with some code (the code is complete), so this always finds one.
#[inline]
fn decode_long(window: u32) -> (u16, u32) {
    let w = window as u64;
    let mut len = START[window.leading_ones() as usize] as usize;
    while len < 30 && w >= LIMIT[len] {
        len += 1;
    }
    let code = window >> (32 - len);
    let idx = OFFSET[len] as u32 + (code - FIRST[len]);
    (SORTED[idx as usize], len as u32)
}

const TABLE_BITS: u32 = 12;

/// Primary decode table, indexed by the next 12 bits. Entry layout: bits 0–5 total bits of
/// the symbols the entry emits (alone in the low 6 bits, so the entry itself is the shift
/// count), 8–15 first symbol, 16–23 second symbol, 24–25 number of symbols (0: the first code
/// is longer than 12 bits, use [`decode_long`]), 26–29 length of the first code.
pub(crate) static PRIMARY: [u32; 1 << TABLE_BITS] = build_primary();

const fn build_primary() -> [u32; 1 << TABLE_BITS] {
    // First pass: the (symbol, length) of the code that prefixes each 12-bit window, when that
    // code has at most 12 bits.
    let mut one = [0u32; 1 << TABLE_BITS]; // (len << 8) | sym, 0 when long
    let mut s = 0;
    while s < 256 {
        let (code, len) = CODES[s];
        let len = len as u32;
        if len <= TABLE_BITS {
            let start = code << (TABLE_BITS - len);
            let end = (code + 1) << (TABLE_BITS - len);
            let mut w = start;
            while w < end {
                one[w as usize] = (len << 8) | s as u32;
                w += 1;
            }
        }
        s += 1;
    }
    // Second pass: pair each first symbol with a second one when it fits in the rest.
    let mut table = [0u32; 1 << TABLE_BITS];
    let mut w = 0;
    while w < (1 << TABLE_BITS) {
        let e = one[w];
        if e != 0 {
            let len1 = e >> 8;
            let sym1 = e & 0xff;
            let rest = TABLE_BITS - len1;
            // The remaining bits, shifted to the top of a 12-bit window (zeros after them).
            let w2 = ((w as u32) << len1) & ((1 << TABLE_BITS) - 1);
            let e2 = one[w2 as usize];
            let len2 = e2 >> 8;
            if e2 != 0 && len2 <= rest {
                table[w] =
                    (len1 + len2) | (sym1 << 8) | ((e2 & 0xff) << 16) | (2 << 24) | (len1 << 26);
            } else {
                table[w] = len1 | (sym1 << 8) | (1 << 24) | (len1 << 26);
            }
        }
        w += 1;
    }
    table
}

/// As [`decode`], into the end of a `BytesMut` (a field section's strings share one buffer).
pub fn decode_bytes(src: &[u8], out: &mut bytes::BytesMut) -> Result<(), HuffmanError> {
    let start = out.len();
    out.resize(start + decoded_bound(src.len()), 0);
    let result = decode_into(src, &mut out[start..]);
    let written = match result {
        Ok(n) | Err((_, n)) => n,
    };
    out.truncate(start + written);
    result.map(|_| ()).map_err(|(e, _)| e)
}

/// Room `decode_into` needs for `n` encoded octets: each code has at least 5 bits, so the
/// output is at most 8/5 of the input, and one more octet of slack lets the table loop store
/// a second symbol unconditionally.
pub fn decoded_bound(n: usize) -> usize {
    n + n / 2 + n / 8 + 2
}

/// Decodes a Huffman-coded string, appending the octets to `out`. On error `out` may hold part
/// of the string.
pub fn decode(src: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let start = out.len();
    out.resize(start + decoded_bound(src.len()), 0);
    let buf = &mut out[start..];
    let result = decode_into(src, buf);
    let written = match result {
        Ok(n) | Err((_, n)) => n,
    };
    out.truncate(start + written);
    result.map(|_| ()).map_err(|(e, _)| e)
}

/// The decoder proper: writes into `buf` (large enough), returns the octets written.
///
/// The input is read as if followed by endless one bits (the padding EOS would give), and
/// `remaining` counts the real bits not decoded yet. Every lookup then sees at least 30 valid
/// bits, and the end of the string is simply a code running past `remaining`: that is fine
/// only for EOS, i.e. real bits that are all ones, and fewer than 8 of them.
#[inline]
fn decode_into(src: &[u8], buf: &mut [u8]) -> Result<usize, (HuffmanError, usize)> {
    // `bits` holds the unread input left-aligned: its top `n` bits are the next `n` bits. The
    // bits below those are zero or the input that follows (read ahead by the 8-octet refill,
    // and OR-ed in again, identically, by the next refill).
    let mut bits: u64 = 0;
    let mut n: u32 = 0;
    let mut i = 0;
    let mut o = 0;
    let mut remaining = src.len() * 8;
    loop {
        // Refill 7–8 octets at once, without branches on the bit count.
        let word = match src.get(i..i + 8) {
            Some(w) => u64::from_be_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]),
            None => padded_word(src, i),
        };
        bits |= word >> n;
        let k = (63 - n) / 8;
        i += k as usize;
        n += 8 * k; // now 56..=63
        while n >= 30 {
            let e = PRIMARY[(bits >> (64 - TABLE_BITS)) as usize];
            let total = e & 0x3f;
            if (e >> 24) & 3 != 0 && total as usize <= remaining {
                // One or two symbols, all within the real bits. The second store is harmless
                // when there is one symbol: the next one overwrites it (buf has slack).
                buf[o] = (e >> 8) as u8;
                buf[o + 1] = (e >> 16) as u8;
                o += ((e >> 24) & 3) as usize;
                bits <<= total;
                n -= total;
                remaining -= total as usize;
                continue;
            }
            // A code longer than 12 bits, or codes that run past the end.
            let (sym, len) = if (e >> 24) & 3 != 0 {
                (((e >> 8) & 0xff) as u16, e >> 26)
            } else {
                decode_long((bits >> 32) as u32)
            };
            if len as usize > remaining {
                // Only the padding is left. All ones read as EOS (the table holds no code of
                // 12 ones), so any other symbol means bits that are not all ones.
                return if sym == EOS && remaining <= 7 {
                    Ok(o)
                } else {
                    Err((HuffmanError::Padding, o))
                };
            }
            if sym == EOS {
                return Err((HuffmanError::Eos, o));
            }
            buf[o] = sym as u8;
            o += 1;
            bits <<= len;
            n -= len;
            remaining -= len as usize;
        }
    }
}

/// The 8 octets at `i`, ones past the end of `src` (which ends before `i + 8`).
#[inline]
fn padded_word(src: &[u8], i: usize) -> u64 {
    let past = (i + 8 - src.len()).min(8) as u32; // octets past the end: 1..=8
    if past == 8 {
        return u64::MAX;
    }
    // The last 8 octets of `src`, shifted so that octet `i` is on top, ones below.
    let last = match src.len().checked_sub(8).and_then(|s| src.get(s..)) {
        Some(w) => {
            u64::from_be_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]) << (8 * past)
        }
        None => {
            let mut w = 0u64;
            for &b in &src[i..] {
                w = (w << 8) | b as u64;
            }
            w << (8 * past)
        }
    };
    last | (u64::MAX >> (64 - 8 * past))
}

/// The reference decoder: walks a binary tree one bit at a time. Slow and simple, kept as the
/// oracle for [`decode`] in tests and as the baseline of the benchmark.
pub fn decode_reference(src: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let tree = reference_tree();
    let mut node = 0usize;
    let mut depth = 0u32; // bits since the last complete symbol
    let mut all_ones = true;
    for &byte in src {
        for k in (0..8).rev() {
            let bit = (byte >> k) & 1;
            all_ones &= bit == 1;
            depth += 1;
            match tree[node][bit as usize] {
                Node::Inner(next) => node = next,
                Node::Leaf(EOS) => return Err(HuffmanError::Eos),
                Node::Leaf(sym) => {
                    out.push(sym as u8);
                    node = 0;
                    depth = 0;
                    all_ones = true;
                }
                Node::Empty => unreachable!("the Huffman code is complete"),
            }
        }
    }
    if depth > 7 || !all_ones {
        return Err(HuffmanError::Padding);
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Node {
    Empty,
    Inner(usize),
    Leaf(u16),
}

fn reference_tree() -> &'static [[Node; 2]] {
    static TREE: std::sync::OnceLock<Vec<[Node; 2]>> = std::sync::OnceLock::new();
    TREE.get_or_init(|| {
        let mut tree = vec![[Node::Empty; 2]];
        for (sym, &(code, len)) in CODES.iter().enumerate() {
            let mut node = 0;
            for k in (0..len as u32).rev() {
                let bit = ((code >> k) & 1) as usize;
                if k == 0 {
                    tree[node][bit] = Node::Leaf(sym as u16);
                } else {
                    node = match tree[node][bit] {
                        Node::Inner(next) => next,
                        _ => {
                            tree.push([Node::Empty; 2]);
                            let next = tree.len() - 1;
                            tree[node][bit] = Node::Inner(next);
                            next
                        }
                    };
                }
            }
        }
        tree
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_is_canonical_and_complete() {
        // Kraft equality: a complete prefix code.
        let sum: u64 = CODES.iter().map(|&(_, len)| 1u64 << (30 - len)).sum();
        assert_eq!(sum, 1 << 30);
        // Canonical: sorted by (length, symbol), each code is the previous plus one, shifted
        // left by the growth in length.
        let mut order: Vec<usize> = (0..257).collect();
        order.sort_by_key(|&s| (CODES[s].1, s));
        let mut code = 0u32;
        let mut len = CODES[order[0]].1;
        for &s in &order {
            code <<= CODES[s].1 - len;
            len = CODES[s].1;
            assert_eq!(CODES[s].0, code, "symbol {s}");
            code += 1;
        }
        assert_eq!(CODES[256], (0x3fff_ffff, 30));
    }

    #[test]
    fn decode_long_finds_every_code() {
        for (sym, &(code, len)) in CODES.iter().enumerate() {
            // Followed by zeros and by ones.
            for tail in [0u32, u32::MAX] {
                let w = (code << (32 - len)) | if len < 32 { tail >> len } else { 0 };
                assert_eq!(decode_long(w), (sym as u16, len as u32));
            }
        }
    }

    #[test]
    fn decode_long_agrees_with_a_plain_search() {
        let plain = |w: u32| {
            let mut len = 5;
            while len < 30 && w as u64 >= LIMIT[len] {
                len += 1;
            }
            len as u32
        };
        let mut x: u32 = 0x1234_5678;
        for i in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Bias towards many leading ones, where the long codes are.
            let w = if i % 2 == 0 {
                x | (u32::MAX << (x % 32))
            } else {
                x
            };
            assert_eq!(decode_long(w).1, plain(w), "{w:08x}");
        }
    }

    #[test]
    fn every_symbol_alone() {
        for b in 0..=255u8 {
            let mut enc = Vec::new();
            encode(&[b], &mut enc);
            assert_eq!(enc.len(), encoded_len(&[b]));
            let mut dec = Vec::new();
            decode(&enc, &mut dec).unwrap();
            assert_eq!(dec, [b]);
        }
    }

    #[test]
    fn padding_and_eos() {
        let mut out = Vec::new();
        assert_eq!(decode(&[], &mut out), Ok(()));
        // 8 ones: padding too long.
        assert_eq!(decode(&[0xff], &mut out), Err(HuffmanError::Padding));
        // '0' (00000) then 3 zero bits: padding not all ones.
        assert_eq!(decode(&[0x00], &mut out), Err(HuffmanError::Padding));
        // '0' then 111: fine.
        out.clear();
        assert_eq!(decode(&[0x07], &mut out), Ok(()));
        assert_eq!(out, b"0");
        // EOS (30 ones) followed by 2 padding ones.
        assert_eq!(decode(&[0xff; 4], &mut out), Err(HuffmanError::Eos));
        assert_eq!(
            decode_reference(&[0xff; 4], &mut out),
            Err(HuffmanError::Eos)
        );
    }
}
