pub mod quic;
pub mod sim;
