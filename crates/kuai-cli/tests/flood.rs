//! `kuai server` with its defaults under a flood of client Initials that never complete
//! (`kuai bench flood`, on loopback): real clients are still served, and the flood costs
//! bounded memory. A scaled-down run of the measurement in SECURITY.md.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KUAI: &str = env!("CARGO_BIN_EXE_kuai");

#[test]
fn real_clients_are_served_during_a_handshake_flood() {
    let mut server = Command::new(KUAI)
        .args(["server", "--listen", "127.0.0.1:0", "--no-tcp"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut port = 0u16;
    while port == 0 && Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        if let Some(addr) = line.strip_prefix("kuai server listening on udp ") {
            let addr = addr.split_whitespace().next().unwrap();
            port = addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    }
    std::thread::spawn(move || for _ in lines {});
    assert!(port != 0, "server did not start");

    // 3,000 Initials in 2 s from 32 ports: more than the server's half-open limit (512),
    // so most are answered with a Retry.
    let out = Command::new(KUAI)
        .args(["bench", "flood", "--server"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["--initials", "3000", "--seconds", "2", "--ports", "32"])
        .args(["--probes", "4", "--probe-timeout", "10"])
        .arg("--server-pid")
        .arg(server.id().to_string())
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "kuai bench flood: {report}");
    let field = |name: &str| -> f64 {
        let key = format!("\"{name}\":");
        let rest = &report[report
            .find(&key)
            .unwrap_or_else(|| panic!("{name} in {report}"))
            + key.len()..];
        rest[..rest.find([',', '}']).unwrap()].parse().unwrap()
    };
    assert_eq!(field("probes_ok"), 4.0, "real clients failed: {report}");
    // Debug builds are slow: the bound here is loose; SECURITY.md has the release figures.
    assert!(field("probe_ms_max") < 5000.0, "{report}");
    let growth = field("rss_peak_mib") - field("rss_before_mib");
    assert!(growth < 64.0, "the flood cost {growth:.1} MiB: {report}");
}
