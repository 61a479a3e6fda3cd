//! A fleet end to end: a real `redis-server` (Debian's) on a loopback port, three
//! `kuai server --redis --server-id --quic-lb-key` and one `kuai lb` in front of them.
//! Through the balancer: later connections resume in 0-RTT whichever server they land on;
//! a captured 0-RTT flight replayed to every server is served by none; a NAT rebinding and a
//! client migration mid-transfer keep the connection on its server; a stopped server's
//! share moves to the others; a Redis restart loses no key (0-RTT pauses for a replay
//! window: the first-use records are gone).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

const KUAI: &str = env!("CARGO_BIN_EXE_kuai");
const KEY: &str = "00112233445566778899aabbccddeeff";
const IDS: [&str; 3] = ["01", "02", "03"];

struct Proc {
    child: Child,
    port: u16,
    /// What it printed after starting.
    lines: mpsc::Receiver<String>,
    /// Its metrics port (servers).
    metrics: u16,
    /// What it printed until it was ready.
    seen: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Waits for a line starting with `prefix`.
    fn wait_line(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("no line starting with {prefix:?}"),
            }
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kuai-fleet-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Starts `cmd` with its stdout read line by line until `ready` printed; returns the port
/// parsed from the line starting with `port_after`.
fn spawn(mut cmd: Command, port_after: &str, ready: &str) -> Proc {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { return };
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let (mut port, mut metrics, mut seen) = (0, 0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = rx.recv_timeout(left).expect("did not start");
        seen.push(l.clone());
        if let Some(rest) = l.strip_prefix(port_after) {
            let addr = rest.split_whitespace().next().unwrap();
            port = addr.rsplit(':').next().unwrap().parse().unwrap();
        }
        if let Some(rest) = l.strip_prefix("metrics at http://") {
            let addr = rest.split('/').next().unwrap();
            metrics = addr.rsplit(':').next().unwrap().parse().unwrap();
        }
        if l.starts_with(ready) {
            break;
        }
    }
    Proc {
        child,
        port,
        lines: rx,
        metrics,
        seen,
    }
}

/// Whether Debian's redis-server is here (the test is skipped if not, unless
/// KUAI_REQUIRE_REDIS is set).
fn redis_installed() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("KUAI_REQUIRE_REDIS").is_none(),
            "redis-server is not installed and KUAI_REQUIRE_REDIS is set"
        );
        eprintln!("redis-server not installed: test skipped");
    }
    found
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn redis(port: u16) -> Proc {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Proc {
        child,
        port,
        lines: mpsc::channel().1,
        metrics: 0,
        seen: Vec::new(),
    }
}

/// A value from Redis (inline command, bulk string answer).
/// `GET key` as bytes (a sealed value is not text).
fn redis_get_bytes(port: u16, key: &str) -> Vec<u8> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {key}\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut head = String::new();
    r.read_line(&mut head).unwrap();
    let Some(len) = head
        .trim_end()
        .strip_prefix('$')
        .and_then(|n| n.parse::<usize>().ok())
    else {
        return Vec::new();
    };
    let mut v = vec![0; len];
    r.read_exact(&mut v).unwrap();
    v
}

fn redis_get(port: u16, key: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {key}\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut head = String::new();
    r.read_line(&mut head).unwrap();
    if head.starts_with("$-1") {
        return String::new();
    }
    let mut v = String::new();
    r.read_line(&mut v).unwrap();
    v.trim_end().to_string()
}

/// The sum of a metric's samples (all label sets) on the `/metrics` at `port`.
fn metric(port: u16, name: &str) -> f64 {
    metric_where(port, name, "")
}

/// The sum of a metric's samples whose line contains `filter`.
fn metric_where(port: u16, name: &str, filter: &str) -> f64 {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
                && l.contains(filter)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A directory for test `name` with a site (`www/x.txt`) and a self-signed certificate for
/// localhost: (the directory, the site's root, the certificate, its key).
fn site(name: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let root = dir.join("www");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("x.txt"), "fleet\n").unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    (dir, root, cert, key)
}

fn metrics(servers: &[Proc], name: &str) -> Vec<f64> {
    servers.iter().map(|s| metric(s.metrics, name)).collect()
}

fn server(root: &Path, cert: &Path, key: &Path, id: &str, redis_url: &str) -> Proc {
    server_with(root, cert, key, id, redis_url, &[])
}

fn server_with(
    root: &Path,
    cert: &Path,
    key: &Path,
    id: &str,
    redis_url: &str,
    extra: &[&str],
) -> Proc {
    let mut cmd = Command::new(KUAI);
    cmd.args(["server", "--listen", "127.0.0.1:0", "--no-tcp"])
        .arg("--root")
        .arg(root)
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .args(["--server-id", id, "--quic-lb-key", KEY])
        .args(["--redis", redis_url, "--metrics", "127.0.0.1:0"])
        .args(extra);
    spawn(
        cmd,
        "kuai server listening on udp ",
        "kuai server listening on udp",
    )
}

/// `kuai get --repeat runs` (a new connection each run, 20 ms apart) through `url`: the
/// runs that succeeded, and of those after the first, how many had 0-RTT accepted.
fn repeat(url: &str, runs: u32) -> (usize, usize, usize) {
    repeat_counting(url, runs, "\"zero_rtt\":\"accepted\"")
}

/// The same, counting the later runs whose line contains `mark`.
fn repeat_counting(url: &str, runs: u32, mark: &str) -> (usize, usize, usize) {
    let out = Command::new(KUAI)
        .args(["get", "--insecure", "--http3", "--state-file", "none"])
        .args(["--interval-ms", "20", "--repeat", &runs.to_string(), url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let ok = text.matches("\"ok\":true").count();
    let later: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("{\"run\":0,"))
        .collect();
    let accepted = later.iter().filter(|l| l.contains(mark)).count();
    for l in later.iter().filter(|l| !l.contains(mark)) {
        println!("without {mark}: {l}");
    }
    (ok, later.len(), accepted)
}

/// Relays datagrams between one client and `to`; records what the client sends while
/// `record` is on; `rebind` makes it send from a new port (a NAT rebinding).
struct Relay {
    addr: SocketAddr,
    record: Arc<AtomicBool>,
    recorded: Arc<Mutex<Vec<Vec<u8>>>>,
    back: Arc<Mutex<Arc<UdpSocket>>>,
    front: Arc<UdpSocket>,
    client: Arc<Mutex<Option<SocketAddr>>>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Self {
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let relay = Self {
            addr: front.local_addr().unwrap(),
            record: Arc::default(),
            recorded: Arc::default(),
            back: Arc::new(Mutex::new(Arc::new(
                UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            ))),
            front,
            client: Arc::default(),
        };
        let (f, back, rec, recorded, client) = (
            relay.front.clone(),
            relay.back.clone(),
            relay.record.clone(),
            relay.recorded.clone(),
            relay.client.clone(),
        );
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = f.recv_from(&mut buf).await {
                *client.lock().unwrap() = Some(from);
                if rec.load(Ordering::SeqCst) {
                    recorded.lock().unwrap().push(buf[..n].to_vec());
                }
                let b = back.lock().unwrap().clone();
                let _ = b.send_to(&buf[..n], to).await;
            }
        });
        relay.spawn_back();
        relay
    }

    fn spawn_back(&self) {
        let (b, f, client) = (
            self.back.lock().unwrap().clone(),
            self.front.clone(),
            self.client.clone(),
        );
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = b.recv(&mut buf).await {
                let to = *client.lock().unwrap();
                if let Some(to) = to {
                    let _ = f.send_to(&buf[..n], to).await;
                }
            }
        });
    }

    async fn rebind(&self) {
        let new = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        *self.back.lock().unwrap() = new;
        self.spawn_back();
    }
}

/// Downloads `url` over HTTP/3 on `quic`, calling `midway` once 2 MB arrived; the bytes.
async fn download_with(quic: kuai::Connection, url: &str, midway: impl AsyncFnOnce()) -> usize {
    let h3 = kuai_http::client::QuicConnection::http3(quic, None)
        .await
        .unwrap();
    let req = http::Request::get(url)
        .body(kuai_http::client::RequestBody::empty())
        .unwrap();
    let mut resp = h3.send(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let (mut got, mut midway) = (0, Some(midway));
    while let Some(c) = resp.chunk().await.unwrap() {
        got += c.len();
        if got >= 2 << 20
            && let Some(m) = midway.take()
        {
            m().await;
        }
    }
    got
}

fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_behind_the_balancer() {
    if !redis_installed() {
        return;
    }
    let dir = temp_dir("main");
    let root = dir.join("www");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("x.txt"), "fleet\n").unwrap();
    let big: Vec<u8> = (0..24u32 << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(root.join("big.bin"), &big).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();

    let rport = free_port();
    let mut redis_proc = Some(redis(rport));
    let url = format!("redis://127.0.0.1:{rport}");
    let servers: Vec<Proc> = IDS
        .iter()
        .map(|id| server(&root, &cert, &key, id, &url))
        .collect();
    let mut lb = Command::new(KUAI);
    lb.args(["lb", "--listen", "127.0.0.1:0", "--quic-lb-key", KEY]);
    lb.args(["--health-interval", "200"]);
    for (id, s) in IDS.iter().zip(&servers) {
        lb.args(["--backend", &format!("{id}=127.0.0.1:{}", s.port)]);
    }
    let lb = spawn(lb, "kuai lb listening on udp ", "backend 03 at");
    let lb_addr: SocketAddr = format!("127.0.0.1:{}", lb.port).parse().unwrap();
    let x_url = format!("https://localhost:{}/x.txt", lb.port);
    let reset_key = redis_get(rport, "kuai:keys:stateless-reset");
    assert_eq!(reset_key.len(), 64, "the fleet's keys are in redis");

    // 1. 0-RTT on later connections, whichever server they land on.
    let u = x_url.clone();
    let (ok, later, accepted) = blocking(move || repeat(&u, 201));
    let share = 100.0 * accepted as f64 / later as f64;
    println!(
        "0-RTT accepted on {accepted} of {later} resumed connections through the balancer ({share:.1} %)"
    );
    assert_eq!(ok, 201, "every run succeeded");
    assert!(share >= 99.0, "{share:.1} %");
    let per = metrics(&servers, "kuai_quic_zero_rtt_accepted_total");
    println!("0-RTT accepted per server: {per:?}");
    assert!(
        per.iter().all(|&n| n > 0.0),
        "a server accepted none: {per:?}"
    );

    // 2. A captured 0-RTT flight replayed to every server is served by none.
    let relay = Relay::start(lb_addr).await;
    let client = kuai_http::Client::builder()
        .mode(kuai_http::client::Mode::Http3)
        .danger_accept_invalid_certs(true)
        .resolve("localhost", lb.port, relay.addr)
        .build()
        .unwrap();
    let r = client.get(&x_url).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "fleet\n");
    client.await_session_tickets().await;
    client.close_connections();
    tokio::time::sleep(Duration::from_millis(100)).await;
    relay.record.store(true, Ordering::SeqCst);
    let r = client.get(&x_url).send().await.unwrap();
    assert_eq!(
        r.connection().early_data,
        Some(true),
        "the second went in 0-RTT"
    );
    assert_eq!(r.text().await.unwrap(), "fleet\n");
    relay.record.store(false, Ordering::SeqCst);
    client.close_connections();
    let flight = relay.recorded.lock().unwrap().clone();
    let requests = metrics(&servers, "kuai_http_requests_total");
    let unfinished = |servers: &[Proc]| -> Vec<f64> {
        servers
            .iter()
            .map(|s| {
                metric(s.metrics, "kuai_quic_handshakes_total")
                    - metric_where(s.metrics, "kuai_quic_handshakes_total", "\"ok\"")
            })
            .collect()
    };
    let failed = unfinished(&servers);
    let attacker = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for s in &servers {
        for d in &flight {
            attacker.send_to(d, ("127.0.0.1", s.port)).await.unwrap();
        }
    }
    // Each replay's handshake ends unfinished: refused (the ticket's first use is on
    // record) or, with 0-RTT rejected, timed out waiting for a Finished (10 s) that only the
    // real client could send.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut failed_after = unfinished(&servers);
    while !failed_after.iter().zip(&failed).all(|(a, b)| a > b) {
        assert!(
            Instant::now() < deadline,
            "the replay did not reach every server"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        failed_after = unfinished(&servers);
    }
    let requests_after = metrics(&servers, "kuai_http_requests_total");
    println!(
        "replayed flight ({} datagrams) to 3 servers: unfinished handshakes {failed:?} -> {failed_after:?}, requests {requests:?} -> {requests_after:?}",
        flight.len()
    );
    assert_eq!(requests_after, requests, "a replayed request was served");

    // 3. A NAT rebinding (the relay's new port) and a client migration (the client's new
    // socket) mid-transfer: the transfer completes on the server that holds it.
    let big_url = format!("https://localhost:{}/big.bin", lb.port);
    let conns = metrics(&servers, "kuai_quic_connections_total");
    let migrations = metrics(&servers, "kuai_quic_migrations_total");
    let ep = kuai::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let ccfg = kuai::ClientConfig::insecure(&[b"h3"]).unwrap();
    let quic = ep
        .connect_with(ccfg.clone(), relay.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let got = download_with(quic.clone(), &big_url, async || relay.rebind().await).await;
    assert_eq!(got, big.len(), "through a NAT rebinding");
    let quic = ep
        .connect_with(ccfg, lb_addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let got = download_with(quic.clone(), &big_url, async || {
        ep.rebind("127.0.0.1:0".parse().unwrap()).unwrap()
    })
    .await;
    assert_eq!(got, big.len(), "through a client migration");
    assert_eq!(quic.stats().migrations, 1);
    let new_conns: f64 = metrics(&servers, "kuai_quic_connections_total")
        .iter()
        .zip(&conns)
        .map(|(a, b)| a - b)
        .sum();
    let moved: f64 = metrics(&servers, "kuai_quic_migrations_total")
        .iter()
        .zip(&migrations)
        .map(|(a, b)| a - b)
        .sum();
    println!("two transfers: {new_conns} new connections, {moved} path migrations at the servers");
    assert_eq!(new_conns, 2.0, "each transfer stayed on one connection");
    assert!(moved >= 2.0, "{moved}");

    // 4. Redis restarts (empty): no key is lost; its first-use records are, so for a
    // replay window (120 s) no session resumes and no 0-RTT is taken.
    drop(redis_proc.take());
    let u = x_url.clone();
    let (ok, _, _) = blocking(move || repeat(&u, 5));
    assert_eq!(ok, 5, "the fleet serves while redis is away");
    redis_proc = Some(redis(rport));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let u = x_url.clone();
    let (ok, later, accepted) = blocking(move || repeat(&u, 41));
    assert_eq!(ok, 41);
    println!("after redis restarted: 0-RTT on {accepted} of {later}");
    assert_eq!(
        accepted, 0,
        "0-RTT taken while the replay records were gone"
    );
    assert_eq!(
        redis_get(rport, "kuai:keys:stateless-reset"),
        reset_key,
        "the servers put the fleet's keys back"
    );

    // 5. A stopped server: new connections go to the others.
    let mut servers = servers;
    drop(servers.pop());
    lb.wait_line("backend 03 down", Duration::from_secs(5));
    let u = x_url.clone();
    let (ok, _, _) = blocking(move || repeat(&u, 20));
    assert_eq!(ok, 20, "every new connection found a server");
    drop(redis_proc);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--session-tickets stateless`: two servers behind the balancer seal sessions into their
/// tickets under keys they share through Redis; a client resumes on either (in 1-RTT:
/// rustls allows no 0-RTT with stateless tickets).
#[test]
fn stateless_tickets_resume_across_the_fleet() {
    if !redis_installed() {
        return;
    }
    let (dir, root, cert, key) = site("stateless");
    let rport = free_port();
    let _redis = redis(rport);
    let url = format!("redis://127.0.0.1:{rport}");
    let extra = ["--session-tickets", "stateless"];
    let servers: Vec<Proc> = IDS[..2]
        .iter()
        .map(|id| server_with(&root, &cert, &key, id, &url, &extra))
        .collect();
    let mut lb = Command::new(KUAI);
    lb.args(["lb", "--listen", "127.0.0.1:0", "--quic-lb-key", KEY]);
    for (id, s) in IDS.iter().zip(&servers) {
        lb.args(["--backend", &format!("{id}=127.0.0.1:{}", s.port)]);
    }
    let lb = spawn(lb, "kuai lb listening on udp ", "backend 02 at");
    let x_url = format!("https://localhost:{}/x.txt", lb.port);
    let (ok, later, resumed) = repeat_counting(&x_url, 41, "\"resumed\":true");
    println!("stateless tickets: {resumed} of {later} later connections resumed");
    assert_eq!(ok, 41);
    assert_eq!(resumed, later);
    let per = metrics(&servers, "kuai_quic_resumptions_total");
    assert!(
        per.iter().all(|&n| n > 0.0),
        "a server resumed none: {per:?}"
    );
    assert_eq!(
        metric(servers[0].metrics, "kuai_quic_zero_rtt_accepted_total"),
        0.0
    );
    drop(lb);
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kuai lb --retry`: the balancer answers a new client address's first Initial with a
/// Retry of its own, sealed with the fleet's token keys from Redis, and the servers
/// (`--retry-offload`) take its tokens and send none themselves. `kuai get`, quic-go's and
/// aioquic's clients (when installed) all get through.
#[test]
fn the_balancer_retries_for_the_fleet() {
    if !redis_installed() {
        return;
    }
    let (dir, root, cert, key) = site("retry");
    let rport = free_port();
    let _redis = redis(rport);
    let url = format!("redis://127.0.0.1:{rport}");
    let servers: Vec<Proc> = IDS[..2]
        .iter()
        .map(|id| {
            server_with(
                &root,
                &cert,
                &key,
                id,
                &url,
                &["--retry-offload", "--proxy", "127.0.0.1"],
            )
        })
        .collect();
    let mut lb = Command::new(KUAI);
    lb.args(["lb", "--listen", "127.0.0.1:0", "--quic-lb-key", KEY]);
    lb.args(["--retry", "--redis", &url]);
    for (id, s) in IDS.iter().zip(&servers) {
        lb.args(["--backend", &format!("{id}=127.0.0.1:{}", s.port)]);
    }
    let lb = spawn(lb, "kuai lb listening on udp ", "backend 02 at");
    let x_url = format!("https://localhost:{}/x.txt", lb.port);
    let (ok, _, _) = repeat(&x_url, 5);
    assert_eq!(ok, 5, "kuai get through the balancer's Retry");
    // Two independent clients (the interop endpoints), each downloading through the
    // balancer's Retry: quic-go's (required where CI builds it) and aioquic's.
    let interop = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../interop");
    let quic_go = interop.join("quic-go/quic-go-endpoint");
    assert!(
        quic_go.exists() || std::env::var_os("KUAI_REQUIRE_QUICGO").is_none(),
        "{} not built (interop/install.sh) and KUAI_REQUIRE_QUICGO is set",
        quic_go.display()
    );
    let aioquic = Command::new("python3")
        .args(["-c", "import aioquic"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut clients: Vec<(&str, Command)> = Vec::new();
    if quic_go.exists() {
        clients.push(("quic-go", Command::new(&quic_go)));
    } else {
        eprintln!("quic-go endpoint not built: its part skipped");
    }
    if aioquic {
        let mut c = Command::new("python3");
        c.arg(interop.join("aioquic/endpoint.py"));
        clients.push(("aioquic", c));
    } else {
        eprintln!("aioquic not installed: its part skipped");
    }
    let mut handshakes = 5.0;
    for (name, mut cmd) in clients {
        let downloads = dir.join(format!("downloads-{name}"));
        std::fs::create_dir_all(&downloads).unwrap();
        let o = cmd
            .env("ROLE", "client")
            .env("TESTCASE", "http3")
            .env("SERVER", format!("127.0.0.1:{}", lb.port))
            .env("REQUESTS", &x_url)
            .env("DOWNLOADS", &downloads)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name} through the balancer's Retry: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(
            std::fs::read(downloads.join("x.txt")).unwrap(),
            b"fleet\n",
            "{name}"
        );
        handshakes += 1.0;
    }
    // A client Initial without a token gets the balancer's Retry.
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut initial = vec![0xc0u8, 0, 0, 0, 1, 8];
    initial.extend_from_slice(&[0x33; 8]);
    initial.extend_from_slice(&[4, 0x44, 0x44, 0x44, 0x44, 0]);
    initial.resize(1200, 0);
    raw.send_to(&initial, ("127.0.0.1", lb.port)).unwrap();
    let mut buf = [0u8; 1500];
    let n = raw.recv(&mut buf).expect("no Retry from the balancer");
    assert_eq!(buf[0] & 0xf0, 0xf0, "not a Retry: {:x?}", &buf[..n.min(8)]);
    // The servers sent no Retry and took every token.
    assert_eq!(metrics(&servers, "kuai_quic_retry_sent_total"), [0.0, 0.0]);
    assert_eq!(
        metrics(&servers, "kuai_quic_invalid_tokens_total"),
        [0.0, 0.0]
    );
    let done: f64 = servers
        .iter()
        .map(|s| metric_where(s.metrics, "kuai_quic_handshakes_total", "\"ok\""))
        .sum();
    assert_eq!(done, handshakes);
    drop(lb);
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kuai lb --backends-file`, read again on SIGHUP: a backend added takes new connections, a
/// drained one takes none, a removed one is gone.
#[test]
fn the_balancer_reloads_its_backends_on_sighup() {
    let dir = temp_dir("reload");
    let root = dir.join("www");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("x.txt"), "fleet\n").unwrap();
    let servers: Vec<Proc> = IDS[..2]
        .iter()
        .map(|id| {
            let mut cmd = Command::new(KUAI);
            cmd.args(["server", "--listen", "127.0.0.1:0", "--no-tcp"])
                .arg("--root")
                .arg(&root)
                .args(["--server-id", id, "--quic-lb-key", KEY])
                .args(["--metrics", "127.0.0.1:0"]);
            spawn(
                cmd,
                "kuai server listening on udp ",
                "kuai server listening on udp",
            )
        })
        .collect();
    let file = dir.join("backends");
    let line = |i: usize| format!("{}=127.0.0.1:{}", IDS[i], servers[i].port);
    std::fs::write(&file, format!("# the fleet\n{}\n", line(0))).unwrap();
    let mut lb = Command::new(KUAI);
    lb.args(["lb", "--listen", "127.0.0.1:0", "--quic-lb-key", KEY])
        .arg("--backends-file")
        .arg(&file);
    let lb = spawn(lb, "kuai lb listening on udp ", "backend 01 at");
    let url = format!("https://localhost:{}/x.txt", lb.port);
    let handshakes = || metrics(&servers, "kuai_quic_handshakes_total");
    let reload = |text: String| {
        std::fs::write(&file, text).unwrap();
        let pid = lb.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-HUP", &pid])
                .status()
                .unwrap()
                .success()
        );
        lb.wait_line("backends reloaded", Duration::from_secs(5));
    };
    let runs = |n: u32| {
        let before = handshakes();
        let (ok, _, _) = repeat(&url, n);
        assert_eq!(ok, n as usize);
        let after = handshakes();
        after
            .iter()
            .zip(&before)
            .map(|(a, b)| a - b)
            .collect::<Vec<f64>>()
    };
    assert_eq!(runs(4), [4.0, 0.0], "one backend");
    reload(format!("{} drain\n{}\n", line(0), line(1)));
    assert_eq!(runs(4), [0.0, 4.0], "01 drained, 02 added");
    reload(format!("{}\n", line(1)));
    assert_eq!(runs(3), [0.0, 3.0], "01 removed");
    reload(format!("{}\n{}\n", line(0), line(1)));
    let both = runs(12);
    assert!(both.iter().all(|&n| n > 0.0), "both back: {both:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Servers pointed at one Redis (with QUIC-LB server IDs) share the stateless-reset key and
/// the generation of their token keys; with Redis away a server still starts, with keys of
/// its own, and serves, and takes up the fleet's reset key once Redis answers. Without a
/// server ID a server shares the token keys but keeps a reset key of its own.
#[test]
fn servers_share_their_keys_through_redis() {
    if !redis_installed() {
        return;
    }
    let dir = temp_dir("keys");
    std::fs::write(dir.join("x.txt"), "shared\n").unwrap();
    let rport = free_port();
    let redis_proc = redis(rport);
    let url = format!("redis://127.0.0.1:{rport}");
    let secret = dir.join("fleet-secret");
    std::fs::write(&secret, format!("{}\n", "ab".repeat(32))).unwrap();
    // A server started against `url`, and the line it printed about the fleet's keys.
    let keys_line_of = |url: &str, id: Option<&str>| -> (Proc, String) {
        let mut cmd = Command::new(KUAI);
        cmd.args([
            "server",
            "--listen",
            "127.0.0.1:0",
            "--no-tcp",
            "--redis",
            url,
        ])
        .arg("--root")
        .arg(&dir);
        if let Some(id) = id {
            cmd.args(["--server-id", id, "--quic-lb-key", KEY]);
            cmd.arg("--fleet-secret-file").arg(&secret);
        }
        let p = spawn(
            cmd,
            "kuai server listening on udp ",
            "kuai server listening on udp",
        );
        let keys = p.seen.iter().find(|l| l.starts_with("fleet keys")).cloned();
        (p, keys.unwrap_or_default())
    };
    let keys_line = |url: &str, id: &str| keys_line_of(url, Some(id));
    let (a, ka) = keys_line(&url, "01");
    let (b, kb) = keys_line(&url, "02");
    assert!(ka.starts_with("fleet keys from redis: reset key "), "{ka}");
    assert_eq!(ka, kb, "the second server read the first one's keys");
    // Sealed with the fleet's secret in Redis, not the key's hex.
    assert!(
        redis_get_bytes(rport, "kuai:keys:stateless-reset").starts_with(b"k1:"),
        "the reset key is sealed"
    );
    let (lone, kl) = keys_line_of(&url, None);
    assert!(
        kl.contains("token keys of generation") && kl.contains("own reset key"),
        "{kl}"
    );
    drop(lone);
    drop(redis_proc);
    let (c, kc) = keys_line(&url, "03");
    assert!(kc.contains("redis unreachable"), "{kc}");
    let out = Command::new(KUAI)
        .args(["get", "--insecure", "--http3", "--state-file", "none"])
        .arg(format!("https://localhost:{}/x.txt", c.port))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "shared\n");
    // Redis back (empty): the server that started without it takes up the fleet's reset
    // key, the one a server started now reads.
    let redis_back = redis(rport);
    let deadline = Instant::now() + Duration::from_secs(10);
    let taken = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = c
            .lines
            .recv_timeout(left)
            .expect("no fleet reset key taken up");
        if let Some(id) = l.strip_prefix("fleet reset key from redis: ") {
            break id.split_whitespace().next().unwrap().to_owned();
        }
    };
    let (d, kd) = keys_line(&url, "04");
    assert!(
        kd.starts_with(&format!("fleet keys from redis: reset key {taken},")),
        "{kd} (taken up: {taken})"
    );
    drop((a, b, c, d, redis_back));
    let _ = std::fs::remove_dir_all(&dir);
}
