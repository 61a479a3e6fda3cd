//! Parsers for the command line's values: durations, shares, rates, queue sizes, the
//! Gilbert-Elliott parameters and blackhole schedules.

use std::time::Duration;

use crate::model::{Blackhole, GilbertElliott, QueueLimit};

/// `20ms`, `1.5s`, `250us` (or `µs`), `2min`, `0`. A unit is required except for zero.
pub fn duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (like 20ms, 1.5s, 500us)"))?;
    let scale = match unit.trim() {
        "" if value == 0.0 => 0.0,
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "min" => 60.0,
        _ => return Err(format!("`{s}`: give a unit: ns, us, ms, s or min")),
    };
    let secs = value * scale;
    if !secs.is_finite() || secs > 1e9 {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A probability: `5%`, `0.5%` or a fraction such as `0.05`.
pub fn share(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = if let Some(p) = t.strip_suffix('%') {
        p.trim()
            .parse::<f64>()
            .map_err(|_| format!("`{s}` is not a percentage"))?
            / 100.0
    } else {
        let v: f64 = t
            .parse()
            .map_err(|_| format!("`{s}` is not a share (like 5% or 0.05)"))?;
        if v > 1.0 {
            return Err(format!("`{s}`: a share above 1; did you mean {s}%?"));
        }
        v
    };
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("`{s}`: a share must be within 0% and 100%"));
    }
    Ok(v)
}

/// A rate in bits per second: `10mbit`, `2.5Mbit/s`, `500kbit`, `1gbit`, or a bare number of
/// bit/s. `k`, `m`, `g` are powers of 1000. Byte units (tc's `mbps`) are refused on purpose.
pub fn rate(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    if t.ends_with("bps") {
        return Err(format!(
            "`{s}`: write the rate in bits, like 10mbit (`bps` is ambiguous)"
        ));
    }
    let t = t.strip_suffix("/s").unwrap_or(&t);
    let body = t.strip_suffix("bit").unwrap_or(t);
    if body.is_empty() {
        return Err(format!("`{s}` is not a rate (like 10mbit, 500kbit, 1gbit)"));
    }
    let (num, mult) = match body.as_bytes()[body.len() - 1] {
        b'k' => (&body[..body.len() - 1], 1e3),
        b'm' => (&body[..body.len() - 1], 1e6),
        b'g' => (&body[..body.len() - 1], 1e9),
        _ => (body, 1.0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a rate (like 10mbit, 500kbit, 1gbit)"))?;
    let bits = v * mult;
    if !(1.0..=1e12).contains(&bits) {
        return Err(format!(
            "`{s}`: a rate must be within 1 bit/s and 1000 Gbit/s"
        ));
    }
    Ok(bits.round() as u64)
}

/// A queue limit: `25` or `25p` (packets), `64kb`, `30000b`, `1mb` (bytes; k and m are powers
/// of 1000, `kib` and `mib` of 1024).
pub fn queue(s: &str) -> Result<QueueLimit, String> {
    let t = s.trim().to_ascii_lowercase();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("`{s}` is not a queue size (like 25, 25p or 64kb)"))?;
    let bytes = |unit: usize| {
        n.checked_mul(unit)
            .map(QueueLimit::Bytes)
            .ok_or_else(|| format!("`{s}`: too large a queue"))
    };
    let limit = match unit.trim() {
        "" | "p" | "pkt" | "pkts" | "packets" => QueueLimit::Packets(n),
        "b" | "bytes" => QueueLimit::Bytes(n),
        "kb" => bytes(1000)?,
        "kib" => bytes(1024)?,
        "mb" => bytes(1_000_000)?,
        "mib" => bytes(1024 * 1024)?,
        _ => {
            return Err(format!(
                "`{s}`: a queue is counted in packets (25p) or bytes (64kb)"
            ));
        }
    };
    match limit {
        QueueLimit::Packets(0) | QueueLimit::Bytes(0) => Err("a queue must hold something".into()),
        QueueLimit::Bytes(b) if b < 1500 => Err(format!(
            "`{s}`: a byte queue must hold at least one 1500-byte packet"
        )),
        // The packets a queue holds are in memory: as many as the link holds in flight
        // (`DEFAULT_PIPE_LIMIT`), or their bytes at 1500 each, at most.
        QueueLimit::Packets(n) if n > crate::model::DEFAULT_PIPE_LIMIT => Err(format!(
            "`{s}`: at most {} packets",
            crate::model::DEFAULT_PIPE_LIMIT
        )),
        QueueLimit::Bytes(b) if b > crate::model::DEFAULT_PIPE_LIMIT * 1500 => Err(format!(
            "`{s}`: at most {} bytes",
            crate::model::DEFAULT_PIPE_LIMIT * 1500
        )),
        l => Ok(l),
    }
}

/// Gilbert-Elliott parameters: `p,r[,loss_bad[,loss_good]]`, each a share (`1%,30%` is a
/// Gilbert model with lossless good state and all-loss bad state).
pub fn gilbert(s: &str) -> Result<GilbertElliott, String> {
    let parts: Vec<&str> = s.split(',').collect();
    if !(2..=4).contains(&parts.len()) {
        return Err(format!(
            "`{s}`: give p,r[,loss_bad[,loss_good]], like 1%,30% or 1%,30%,80%,0.1%"
        ));
    }
    let p = share(parts[0])?;
    let r = share(parts[1])?;
    if r == 0.0 {
        return Err("Gilbert-Elliott: r (bad to good) must be above 0".into());
    }
    let loss_bad = parts.get(2).map(|v| share(v)).transpose()?.unwrap_or(1.0);
    let loss_good = parts.get(3).map(|v| share(v)).transpose()?.unwrap_or(0.0);
    Ok(GilbertElliott {
        p,
        r,
        loss_bad,
        loss_good,
    })
}

/// A blackhole schedule `UP/DOWN`: the link works for UP, then drops everything for DOWN, and
/// so on from the start (`5s/2s`).
pub fn blackhole(s: &str) -> Result<Blackhole, String> {
    let (up, down) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}`: give UP/DOWN, like 5s/2s"))?;
    let up = duration(up)?;
    let down = duration(down)?;
    if up.is_zero() || down.is_zero() {
        return Err(format!("`{s}`: both periods must be above zero"));
    }
    Ok(Blackhole { up, down })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration("20ms").unwrap(), Duration::from_millis(20));
        assert_eq!(duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(duration("250µs").unwrap(), Duration::from_micros(250));
        assert_eq!(duration("0").unwrap(), Duration::ZERO);
        assert_eq!(duration("2min").unwrap(), Duration::from_secs(120));
        assert!(duration("20").is_err());
        assert!(duration("ms").is_err());
        assert!(duration("20 parsecs").is_err());
    }

    #[test]
    fn shares() {
        assert_eq!(share("5%").unwrap(), 0.05);
        assert_eq!(share("0.05").unwrap(), 0.05);
        assert_eq!(share("0").unwrap(), 0.0);
        assert_eq!(share("100%").unwrap(), 1.0);
        assert!(share("5").is_err());
        assert!(share("101%").is_err());
        assert!(share("-1%").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(rate("10mbit").unwrap(), 10_000_000);
        assert_eq!(rate("10Mbit/s").unwrap(), 10_000_000);
        assert_eq!(rate("2.5mbit").unwrap(), 2_500_000);
        assert_eq!(rate("500kbit").unwrap(), 500_000);
        assert_eq!(rate("1gbit").unwrap(), 1_000_000_000);
        assert_eq!(rate("64000").unwrap(), 64_000);
        assert_eq!(rate("10m").unwrap(), 10_000_000);
        assert!(rate("10mbps").is_err());
        assert!(rate("fast").is_err());
        assert!(rate("0").is_err());
    }

    #[test]
    fn queues() {
        assert_eq!(queue("25").unwrap(), QueueLimit::Packets(25));
        assert_eq!(queue("25p").unwrap(), QueueLimit::Packets(25));
        assert_eq!(queue("64kb").unwrap(), QueueLimit::Bytes(64_000));
        assert_eq!(queue("64KiB").unwrap(), QueueLimit::Bytes(65_536));
        assert_eq!(queue("30000b").unwrap(), QueueLimit::Bytes(30_000));
        assert!(queue("0").is_err());
        assert!(queue("100b").is_err());
        assert!(queue("25 furlongs").is_err());
        // A count that overflows once multiplied by its unit (found by fuzzing).
        assert!(queue("6477777777777777777KiB").is_err());
        // Held in memory: bounded like the link's packets in flight.
        assert_eq!(queue("200000").unwrap(), QueueLimit::Packets(200_000));
        assert!(queue("200001").is_err());
        assert_eq!(queue("300mb").unwrap(), QueueLimit::Bytes(300_000_000));
        assert!(queue("301mb").is_err());
        assert!(queue(&format!("{}mb", usize::MAX / 1000)).is_err());
    }

    #[test]
    fn gilbert_elliott() {
        let g = gilbert("1%,30%").unwrap();
        assert_eq!((g.p, g.r, g.loss_bad, g.loss_good), (0.01, 0.3, 1.0, 0.0));
        let g = gilbert("1%,30%,80%,0.1%").unwrap();
        assert_eq!((g.loss_bad, g.loss_good), (0.8, 0.001));
        assert!(gilbert("1%").is_err());
        assert!(gilbert("1%,0").is_err());
    }

    #[test]
    fn blackholes() {
        let b = blackhole("5s/2s").unwrap();
        assert_eq!(
            (b.up, b.down),
            (Duration::from_secs(5), Duration::from_secs(2))
        );
        assert!(blackhole("5s").is_err());
        assert!(blackhole("0/2s").is_err());
    }
}
