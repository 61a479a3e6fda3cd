//! `kuai netsim`'s parsers: Mahimahi delivery traces (`crates/kuai-netsim/src/trace.rs`) and
//! the command line's values (`parse.rs`: durations, shares, rates, queue sizes,
//! Gilbert-Elliott parameters, blackhole schedules), and the trace bottleneck of the link model
//! a parsed trace drives.
//!
//! Byte 0 picks what the rest (as lossy UTF-8) is: even, a trace; odd, a value for the parser
//! `byte0 / 2 % 6`. Checks beyond "no panic":
//!
//! - `Trace::parse` never has more than `16 x input + 4 KiB` of heap live at once (it keeps
//!   one `u64` per line of at least two bytes, plus an error message quoting a line);
//! - it agrees with a model: `Ok` exactly when every line that is not blank or a `#` comment is
//!   a `u64`, they do not decrease, and the last one is above 0 and at most a day, and then
//!   it equals
//!   `Trace::new` of those numbers; a parsed trace has a period above zero and a finite,
//!   positive mean rate;
//! - packets offered to an `Impairment` with the trace as its bottleneck (200 of them, at
//!   times and sizes from byte 1 and 2, with one long idle gap) leave at or after they arrive,
//!   in order;
//! - the command-line parsers return values inside their documented ranges.

#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kuai_fuzz::alloc;
use kuai_netsim::model::{Impairment, LinkConfig, QueueLimit, Verdict};
use kuai_netsim::{Trace, parse};
use libfuzzer_sys::fuzz_target;

fn start() -> Instant {
    static S: OnceLock<Instant> = OnceLock::new();
    *S.get_or_init(Instant::now)
}

/// What `Trace::parse` should make of `text`.
fn model(text: &str) -> Option<Vec<u64>> {
    let mut ms = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let v: u64 = line.parse().ok()?;
        if ms.last().is_some_and(|&l| v < l) {
            return None;
        }
        ms.push(v);
    }
    // The period is above zero and at most a day.
    (ms.last().is_some_and(|&l| l > 0 && l <= 86_400_000)).then_some(ms)
}

fn trace(params: [u8; 2], text: &str) {
    let base = alloc::reset_peak();
    let parsed = Trace::parse(text);
    let grown = alloc::grown_since(base);
    let bound = 16 * text.len() + 4096;
    assert!(
        grown <= bound,
        "Trace::parse of {} bytes had {grown} bytes of heap live at once (bound {bound})",
        text.len()
    );
    let expected = model(text);
    match (&parsed, expected) {
        (Ok(t), Some(ms)) => assert_eq!(Ok(t), Trace::new(ms).as_ref(), "{text:?}"),
        (Err(_), None) => {}
        (p, m) => panic!("Trace::parse({text:?}) = {p:?}, the model says {m:?}"),
    }
    let Ok(t) = parsed else { return };
    assert!(!t.is_empty() && !t.period().is_zero());
    let rate = t.mean_rate_bps();
    assert!(rate.is_finite() && rate > 0.0, "mean rate {rate}");

    let cfg = LinkConfig {
        trace: Some(Arc::new(t)),
        queue: if params[0] & 1 == 0 {
            QueueLimit::Packets(usize::from(params[0] >> 1) + 1)
        } else {
            QueueLimit::Bytes(1500 * (usize::from(params[0] >> 1) + 1))
        },
        ..LinkConfig::default()
    };
    let start = start();
    let mut model = Impairment::new(cfg, u64::from(params[1]), start);
    let step = Duration::from_micros(u64::from(params[1]) * 37);
    let mut now = start;
    let mut last_out: Option<Instant> = None;
    for i in 0..200u64 {
        now += step;
        if i == 100 {
            // A long idle spell: the trace must be caught up, not replayed.
            now += Duration::from_secs(u64::from(params[0]) * 86_400 + 1);
        }
        let len = 1 + (i as usize * 7919 + usize::from(params[0])) % 1600;
        if let Verdict::Deliver { at, .. } = model.offer(now, len) {
            assert!(at >= now, "packet {i} leaves before it arrives");
            assert!(
                last_out.is_none_or(|l| at >= l),
                "packet {i} overtakes the one before it"
            );
            last_out = Some(at);
        }
    }
}

fn value(which: u8, s: &str) {
    match which % 6 {
        0 => {
            if let Ok(d) = parse::duration(s) {
                assert!(d <= Duration::from_secs(1_000_000_000), "{s:?} -> {d:?}");
            }
        }
        1 => {
            if let Ok(v) = parse::share(s) {
                assert!((0.0..=1.0).contains(&v), "{s:?} -> {v}");
            }
        }
        2 => {
            if let Ok(v) = parse::rate(s) {
                assert!((1..=1_000_000_000_000).contains(&v), "{s:?} -> {v}");
            }
        }
        3 => match parse::queue(s) {
            Ok(QueueLimit::Packets(n)) => assert!(n >= 1, "{s:?}"),
            Ok(QueueLimit::Bytes(n)) => assert!(n >= 1500, "{s:?}"),
            Err(_) => {}
        },
        4 => {
            if let Ok(g) = parse::gilbert(s) {
                for v in [g.p, g.r, g.loss_bad, g.loss_good] {
                    assert!((0.0..=1.0).contains(&v), "{s:?} -> {g:?}");
                }
                assert!(g.r > 0.0, "{s:?} -> {g:?}");
            }
        }
        _ => {
            if let Ok(b) = parse::blackhole(s) {
                assert!(!b.up.is_zero() && !b.down.is_zero(), "{s:?} -> {b:?}");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let (params, text) = match rest {
            [a, b, text @ ..] => ([*a, *b], text),
            _ => ([0, 0], rest),
        };
        trace(params, &String::from_utf8_lossy(text));
    } else {
        value(mode >> 1, &String::from_utf8_lossy(rest));
    }
});
