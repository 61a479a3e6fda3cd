//! What the fuzz targets share: a counting global allocator (linked into every target) and the
//! QUIC harness of the `connection` and `handshake` targets.

pub mod alloc;
pub mod quic;
