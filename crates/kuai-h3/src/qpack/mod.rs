//! QPACK: field compression for HTTP/3 (RFC 9204).
