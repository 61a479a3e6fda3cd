//! HTTP for applications and servers built on kuai.
//!
//! This crate is where issue 21's library grows: one server for HTTP/3, HTTP/2 and HTTP/1.1
//! and a client that picks the fastest way. It starts with what every server of files needs:
//! [`fs::StaticDir`], which maps request paths to files below a root without ever leaving
//! it, and [`fs::FileChunks`], which reads a file in large chunks without stalling the
//! runtime.
#![warn(missing_docs)]

pub mod fs;
