//! HTTP/3 (RFC 9114) and QPACK (RFC 9204) on kuai's QUIC streams.

pub mod qpack;
