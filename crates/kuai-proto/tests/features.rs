//! Feature scenarios (work in progress).
mod common;

#[test]
fn placeholder() {}
