//! `kuai get`'s URL parser (`crates/kuai-cli/src/url.rs`, included as it is: kuai-cli is a
//! binary crate).
//!
//! The input, as UTF-8 (lossily), is parsed with `Url::parse`. Checks beyond "no panic", for
//! every URL that parses:
//!
//! - the host is not empty and has no `/`, `[` or `]`; the path starts with `/`; the URL has
//!   no ASCII spaces or control characters;
//! - it re-serialises: `Url::parse(&url.to_string())` gives the same URL;
//! - `file_name()` is a non-empty name without `/`, `?` or `#`: `index.html` or the path's
//!   last segment (before the query).

#![no_main]

#[allow(dead_code)]
#[path = "../../crates/kuai-cli/src/url.rs"]
mod url;

use libfuzzer_sys::fuzz_target;
use url::Url;

fuzz_target!(|data: &[u8]| {
    kuai_fuzz::alloc::reset_peak();
    let s = String::from_utf8_lossy(data);
    let Ok(u) = Url::parse(&s) else {
        return;
    };
    assert!(!u.host.is_empty(), "{s:?} parsed with an empty host: {u:?}");
    assert!(
        !u.host.contains(['/', '[', ']']),
        "{s:?} parsed with a host of `/`, `[` or `]`: {u:?}"
    );
    assert!(u.path.starts_with('/'), "{s:?}: path {:?}", u.path);
    assert!(
        !s.contains(|c: char| c.is_ascii_whitespace() || c.is_ascii_control()),
        "{s:?} has spaces or control characters and parsed: {u:?}"
    );

    let text = u.to_string();
    assert_eq!(
        Url::parse(&text).as_ref(),
        Ok(&u),
        "{s:?} parsed to {u:?}, written as {text:?}, which parses differently"
    );

    let name = u.file_name();
    assert!(
        !name.is_empty() && !name.contains(['/', '?', '#']),
        "{s:?}: file name {name:?}"
    );
    let before_query = u.path.split(['?', '#']).next().unwrap_or("");
    assert!(
        name == "index.html" || before_query.ends_with(&format!("/{name}")),
        "{s:?}: file name {name:?} is not the end of the path {before_query:?}"
    );
});
