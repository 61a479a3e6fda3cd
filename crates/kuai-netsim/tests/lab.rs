//! End-to-end tests across a real lab: namespaces, TUN devices, the forwarding threads.
//! They need root, /dev/net/tun and `ip netns`; without them each test says why and passes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kuai_netsim::lab::{self, CLIENT_ADDR, SERVER_ADDR};
use kuai_netsim::{Lab, LabConfig, LinkConfig, QueueLimit};

fn skip(test: &str) -> bool {
    match lab::unavailable() {
        Some(why) => {
            eprintln!("{test}: skipped: {why}");
            true
        }
        None => false,
    }
}

fn gone(ns: &str) -> bool {
    !std::path::Path::new("/run/netns").join(ns).exists()
}

#[test]
fn udp_echo_rtt_with_50ms_delay() {
    if skip("udp_echo_rtt_with_50ms_delay") {
        return;
    }
    let delay = Duration::from_millis(50);
    let link = LinkConfig {
        delay,
        ..Default::default()
    };
    let lab = Lab::start(LabConfig {
        name: "nstest-echo".into(),
        up: link.clone(),
        down: link,
        seed: 1,
    })
    .unwrap();
    // Sockets belong to the namespace they were made in, whichever thread uses them later.
    let server = lab::within(lab.server_netns(), || UdpSocket::bind((SERVER_ADDR, 7007))).unwrap();
    let client = lab::within(lab.client_netns(), || UdpSocket::bind((CLIENT_ADDR, 0))).unwrap();
    server
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let echo = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [0u8; 2048];
        let mut echoed = 0;
        while Instant::now() < deadline && echoed < 10 {
            if let Ok((n, from)) = server.recv_from(&mut buf) {
                server.send_to(&buf[..n], from).unwrap();
                echoed += 1;
            }
        }
        echoed
    });
    let mut rtts = Vec::new();
    let mut buf = [0u8; 2048];
    for i in 0..10u8 {
        let payload = [i; 200];
        let sent = Instant::now();
        client.send_to(&payload, (SERVER_ADDR, 7007)).unwrap();
        // A signal (the emulator's children) may interrupt the wait: wait again.
        let (n, _) = loop {
            match client.recv_from(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.expect("echo within a second"),
            }
        };
        rtts.push(sent.elapsed());
        assert_eq!(&buf[..n], &payload);
    }
    assert_eq!(echo.join().unwrap(), 10);
    let (server_ns, client_ns) = (lab.server_netns().to_owned(), lab.client_netns().to_owned());
    let report = lab.stop();
    rtts.sort();
    eprintln!("RTTs: {rtts:?}");
    assert!(rtts[0] >= 2 * delay, "{rtts:?}");
    assert!(rtts[5] < 2 * delay + Duration::from_millis(15), "{rtts:?}");
    assert_eq!(report.up.stats.delivered, 10);
    assert_eq!(report.down.stats.delivered, 10);
    assert_eq!(report.up.stats.delay.min(), delay);
    assert!(report.up.error.is_none() && report.down.error.is_none());
    assert!(gone(&server_ns) && gone(&client_ns));
}

#[test]
fn tcp_transfer_through_rate_limit_and_loss() {
    if skip("tcp_transfer_through_rate_limit_and_loss") {
        return;
    }
    let down = LinkConfig {
        delay: Duration::from_millis(5),
        loss: 0.01,
        rate: Some(20_000_000),
        queue: QueueLimit::Packets(50),
        ..Default::default()
    };
    let up = LinkConfig {
        delay: Duration::from_millis(5),
        ..Default::default()
    };
    let lab = Lab::start(LabConfig {
        name: "nstest-tcp".into(),
        up,
        down,
        seed: 2,
    })
    .unwrap();
    let listener = lab::within(lab.server_netns(), || {
        TcpListener::bind((SERVER_ADDR, 8008))
    })
    .unwrap();
    let size = 1_000_000;
    let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    let sent = data.clone();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&sent).unwrap();
    });
    let mut stream = lab::within(lab.client_netns(), || {
        let s = TcpStream::connect_timeout(&(SERVER_ADDR, 8008).into(), Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(8)))?;
        Ok(s)
    })
    .unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    stream.read_to_end(&mut got).unwrap();
    let secs = start.elapsed().as_secs_f64();
    server.join().unwrap();
    assert!(got == data, "the bytes arrived intact");
    let report = lab.stop();
    let goodput = size as f64 * 8.0 / secs;
    eprintln!("1 MB in {secs:.3} s: {:.1} Mbit/s", goodput / 1e6);
    assert!(goodput < 20e6, "faster than the rate limit: {goodput}");
    assert!(report.down.stats.dropped_loss > 0);
    assert_eq!(report.up.stats.dropped(), 0);
}

#[test]
fn command_line_runs_both_commands_and_cleans_up() {
    if skip("command_line_runs_both_commands_and_cleans_up") {
        return;
    }
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: kuai_netsim::cli::Args,
    }
    let dir = std::env::temp_dir().join(format!("nstest-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pid_file = dir.join("server.pid");
    let server = format!("echo $$ > {}; exec sleep 30", pid_file.display());
    // The client waits for the server, checks its address and the link, and exits with 3.
    let client = format!(
        "while [ ! -s {} ]; do sleep 0.05; done; ip -4 addr show netsim0 | grep -q 10.77.0.2/24 && exit 3",
        pid_file.display()
    );
    let args = Cli::try_parse_from([
        "netsim",
        "--name",
        "nstest-cli",
        "--delay",
        "1ms",
        "--quiet",
        "--timeout",
        "8s",
        "--",
        "sh",
        "-c",
        &server,
        "--",
        "sh",
        "-c",
        &client,
    ])
    .unwrap()
    .args;
    let started = Instant::now();
    assert_eq!(kuai_netsim::cli::run(args), ExitCode::from(3));
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(gone("nstest-cli-server") && gone("nstest-cli-client"));
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the server command was killed"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn leftovers_of_a_crashed_run_are_removed() {
    if skip("leftovers_of_a_crashed_run_are_removed") {
        return;
    }
    let (server_ns, client_ns) = lab::namespaces("nstest-left");
    let ip = |args: &[&str]| {
        assert!(
            std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap()
                .success()
        );
    };
    if gone(&server_ns) {
        ip(&["netns", "add", &server_ns]);
    }
    // A process left running inside the old namespace.
    let mut orphan = std::process::Command::new("ip")
        .args(["netns", "exec", &server_ns, "sleep", "20"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let lab = Lab::start(LabConfig {
        name: "nstest-left".into(),
        up: LinkConfig::default(),
        down: LinkConfig::default(),
        seed: 3,
    })
    .unwrap();
    let status = orphan.wait().unwrap();
    assert!(!status.success(), "the orphan was killed");
    assert!(!gone(lab.server_netns()));
    drop(lab);
    assert!(gone(&server_ns) && gone(&client_ns));
}
