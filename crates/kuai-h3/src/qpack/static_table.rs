//! The QPACK static table (RFC 9204 Appendix A) and its lookups for the encoder.
//!
//! Lookup is a compiled `match` on the name (the compiler turns it into a switch on the length
//! and a few comparisons), giving the table indices that carry the name; an exact match then
//! compares at most a handful of values. Nothing is built at run time.

/// The static table: `(name, value)` by index.
#[rustfmt::skip]
pub(crate) const STATIC_TABLE: [(&[u8], &[u8]); 99] = [
    (b":authority", b""), // 0
    (b":path", b"/"), // 1
    (b"age", b"0"), // 2
    (b"content-disposition", b""), // 3
    (b"content-length", b"0"), // 4
    (b"cookie", b""), // 5
    (b"date", b""), // 6
    (b"etag", b""), // 7
    (b"if-modified-since", b""), // 8
    (b"if-none-match", b""), // 9
    (b"last-modified", b""), // 10
    (b"link", b""), // 11
    (b"location", b""), // 12
    (b"referer", b""), // 13
    (b"set-cookie", b""), // 14
    (b":method", b"CONNECT"), // 15
    (b":method", b"DELETE"), // 16
    (b":method", b"GET"), // 17
    (b":method", b"HEAD"), // 18
    (b":method", b"OPTIONS"), // 19
    (b":method", b"POST"), // 20
    (b":method", b"PUT"), // 21
    (b":scheme", b"http"), // 22
    (b":scheme", b"https"), // 23
    (b":status", b"103"), // 24
    (b":status", b"200"), // 25
    (b":status", b"304"), // 26
    (b":status", b"404"), // 27
    (b":status", b"503"), // 28
    (b"accept", b"*/*"), // 29
    (b"accept", b"application/dns-message"), // 30
    (b"accept-encoding", b"gzip, deflate, br"), // 31
    (b"accept-ranges", b"bytes"), // 32
    (b"access-control-allow-headers", b"cache-control"), // 33
    (b"access-control-allow-headers", b"content-type"), // 34
    (b"access-control-allow-origin", b"*"), // 35
    (b"cache-control", b"max-age=0"), // 36
    (b"cache-control", b"max-age=2592000"), // 37
    (b"cache-control", b"max-age=604800"), // 38
    (b"cache-control", b"no-cache"), // 39
    (b"cache-control", b"no-store"), // 40
    (b"cache-control", b"public, max-age=31536000"), // 41
    (b"content-encoding", b"br"), // 42
    (b"content-encoding", b"gzip"), // 43
    (b"content-type", b"application/dns-message"), // 44
    (b"content-type", b"application/javascript"), // 45
    (b"content-type", b"application/json"), // 46
    (b"content-type", b"application/x-www-form-urlencoded"), // 47
    (b"content-type", b"image/gif"), // 48
    (b"content-type", b"image/jpeg"), // 49
    (b"content-type", b"image/png"), // 50
    (b"content-type", b"text/css"), // 51
    (b"content-type", b"text/html; charset=utf-8"), // 52
    (b"content-type", b"text/plain"), // 53
    (b"content-type", b"text/plain;charset=utf-8"), // 54
    (b"range", b"bytes=0-"), // 55
    (b"strict-transport-security", b"max-age=31536000"), // 56
    (b"strict-transport-security", b"max-age=31536000; includesubdomains"), // 57
    (b"strict-transport-security", b"max-age=31536000; includesubdomains; preload"), // 58
    (b"vary", b"accept-encoding"), // 59
    (b"vary", b"origin"), // 60
    (b"x-content-type-options", b"nosniff"), // 61
    (b"x-xss-protection", b"1; mode=block"), // 62
    (b":status", b"100"), // 63
    (b":status", b"204"), // 64
    (b":status", b"206"), // 65
    (b":status", b"302"), // 66
    (b":status", b"400"), // 67
    (b":status", b"403"), // 68
    (b":status", b"421"), // 69
    (b":status", b"425"), // 70
    (b":status", b"500"), // 71
    (b"accept-language", b""), // 72
    (b"access-control-allow-credentials", b"FALSE"), // 73
    (b"access-control-allow-credentials", b"TRUE"), // 74
    (b"access-control-allow-headers", b"*"), // 75
    (b"access-control-allow-methods", b"get"), // 76
    (b"access-control-allow-methods", b"get, post, options"), // 77
    (b"access-control-allow-methods", b"options"), // 78
    (b"access-control-expose-headers", b"content-length"), // 79
    (b"access-control-request-headers", b"content-type"), // 80
    (b"access-control-request-method", b"get"), // 81
    (b"access-control-request-method", b"post"), // 82
    (b"alt-svc", b"clear"), // 83
    (b"authorization", b""), // 84
    (b"content-security-policy", b"script-src 'none'; object-src 'none'; base-uri 'none'"), // 85
    (b"early-data", b"1"), // 86
    (b"expect-ct", b""), // 87
    (b"forwarded", b""), // 88
    (b"if-range", b""), // 89
    (b"origin", b""), // 90
    (b"purpose", b"prefetch"), // 91
    (b"server", b""), // 92
    (b"timing-allow-origin", b"*"), // 93
    (b"upgrade-insecure-requests", b"1"), // 94
    (b"user-agent", b""), // 95
    (b"x-forwarded-for", b""), // 96
    (b"x-frame-options", b"deny"), // 97
    (b"x-frame-options", b"sameorigin"), // 98
];

/// The static table indices whose name is `name`, in ascending order (the first is the
/// smallest index, the cheapest name reference).
pub(crate) fn indices_for_name(name: &[u8]) -> &'static [u8] {
    match name {
        b":authority" => &[0],
        b":path" => &[1],
        b"age" => &[2],
        b"content-disposition" => &[3],
        b"content-length" => &[4],
        b"cookie" => &[5],
        b"date" => &[6],
        b"etag" => &[7],
        b"if-modified-since" => &[8],
        b"if-none-match" => &[9],
        b"last-modified" => &[10],
        b"link" => &[11],
        b"location" => &[12],
        b"referer" => &[13],
        b"set-cookie" => &[14],
        b":method" => &[15, 16, 17, 18, 19, 20, 21],
        b":scheme" => &[22, 23],
        b":status" => &[24, 25, 26, 27, 28, 63, 64, 65, 66, 67, 68, 69, 70, 71],
        b"accept" => &[29, 30],
        b"accept-encoding" => &[31],
        b"accept-ranges" => &[32],
        b"access-control-allow-headers" => &[33, 34, 75],
        b"access-control-allow-origin" => &[35],
        b"cache-control" => &[36, 37, 38, 39, 40, 41],
        b"content-encoding" => &[42, 43],
        b"content-type" => &[44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54],
        b"range" => &[55],
        b"strict-transport-security" => &[56, 57, 58],
        b"vary" => &[59, 60],
        b"x-content-type-options" => &[61],
        b"x-xss-protection" => &[62],
        b"accept-language" => &[72],
        b"access-control-allow-credentials" => &[73, 74],
        b"access-control-allow-methods" => &[76, 77, 78],
        b"access-control-expose-headers" => &[79],
        b"access-control-request-headers" => &[80],
        b"access-control-request-method" => &[81, 82],
        b"alt-svc" => &[83],
        b"authorization" => &[84],
        b"content-security-policy" => &[85],
        b"early-data" => &[86],
        b"expect-ct" => &[87],
        b"forwarded" => &[88],
        b"if-range" => &[89],
        b"origin" => &[90],
        b"purpose" => &[91],
        b"server" => &[92],
        b"timing-allow-origin" => &[93],
        b"upgrade-insecure-requests" => &[94],
        b"user-agent" => &[95],
        b"x-forwarded-for" => &[96],
        b"x-frame-options" => &[97, 98],
        _ => &[],
    }
}

/// The entry at `index`, if there is one.
pub fn get(index: u64) -> Option<(&'static [u8], &'static [u8])> {
    STATIC_TABLE.get(usize::try_from(index).ok()?).copied()
}

/// The index of the entry with this name and value.
#[inline]
pub fn find_exact(name: &[u8], value: &[u8]) -> Option<u8> {
    indices_for_name(name)
        .iter()
        .copied()
        .find(|&i| STATIC_TABLE[i as usize].1 == value)
}

/// The smallest index of an entry with this name (the cheapest name reference).
#[inline]
pub fn find_name(name: &[u8]) -> Option<u8> {
    indices_for_name(name).first().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_agree_with_the_table() {
        for (i, (name, value)) in STATIC_TABLE.iter().enumerate() {
            assert_eq!(find_exact(name, value), Some(i as u8), "{i}");
            let first = STATIC_TABLE.iter().position(|(n, _)| n == name).unwrap();
            assert_eq!(find_name(name), Some(first as u8));
            // indices_for_name lists exactly the entries with that name.
            let all: Vec<u8> = (0..99u8)
                .filter(|&j| STATIC_TABLE[j as usize].0 == *name)
                .collect();
            assert_eq!(indices_for_name(name), &all[..]);
        }
        assert_eq!(find_name(b"x-custom"), None);
        assert_eq!(find_exact(b":method", b"PATCH"), None);
        assert_eq!(get(99), None);
        assert_eq!(get(17), Some((&b":method"[..], &b"GET"[..])));
    }
}
