//! kuai-fleet against a real `redis-server` (Debian's) on loopback: a password, TLS with a
//! private CA, the first use of a ticket recorded once, sessions replicated between two
//! members, a wrong password refused.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use kuai::kuai_proto::TokenKey;
use kuai_fleet::{Fleet, FleetOptions};
use rustls::server::{ProducesTickets, StoresServerSessions};

struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn installed() -> bool {
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

fn start(args: &[&str], port: u16) -> Redis {
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Redis(child)
}

/// A member whose first-use records last `window` (and whose 0-RTT pauses that long after a
/// Redis restart).
fn with_replay_window(url: &str, window: Duration) -> Fleet {
    Fleet::start(
        url,
        FleetOptions {
            replay_window: window,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Two members of one fleet: the same keys, a session one issues is the other's replica,
/// its first use is recorded once.
async fn two_members(url: &str, ca: Option<Vec<u8>>) {
    two_members_with(
        url,
        FleetOptions {
            ca_pem: ca,
            ..Default::default()
        },
    )
    .await
}

async fn two_members_with(url: &str, options: FleetOptions) {
    let a = Fleet::start(url, options.clone()).unwrap();
    let b = Fleet::start(url, options).unwrap();
    assert_eq!(a.reset_key().await.unwrap(), b.reset_key().await.unwrap());
    // Token keys and ticket keys rotate together (every hour): what one seals the other
    // opens.
    let hour = Duration::from_secs(3600);
    let (ta, tb) = (Arc::new(TokenKey::random()), Arc::new(TokenKey::random()));
    let _ra = a.rotate_token_keys(ta.clone(), hour).await;
    let _rb = b.rotate_token_keys(tb.clone(), hour).await;
    assert!(tb.open(&ta.seal(b"token".to_vec())).is_some());
    let ((xa, _rxa), (xb, _rxb)) = (a.ticketer(hour).await, b.ticketer(hour).await);
    let ticket = xa.encrypt(b"session").unwrap();
    assert_eq!(xb.decrypt(&ticket).as_deref(), Some(&b"session"[..]));
    assert!(tb.open(&ticket).is_none(), "ticket keys are not token keys");
    a.sessions().put(b"ticket-1".to_vec(), b"session".to_vec());
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.sessions().get(b"ticket-1").is_none() {
        assert!(Instant::now() < deadline, "the session did not reach b");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.is_redis_up() && b.is_redis_up());
    // Used at b: a's copy goes too.
    assert_eq!(b.sessions().take(b"ticket-1"), Some(b"session".to_vec()));
    while a.sessions().get(b"ticket-1").is_some() {
        assert!(Instant::now() < deadline, "a kept a used session");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.anti_replay().first_use(b"ticket-2").await.unwrap());
    assert!(!b.anti_replay().first_use(b"ticket-2").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_share_through_redis_with_a_password() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _r = start(
        &["--port", &port.to_string(), "--requirepass", "s3cret"],
        port,
    );
    two_members(&format!("redis://:s3cret@127.0.0.1:{port}"), None).await;
    let wrong = Fleet::start(
        &format!("redis://:wrong@127.0.0.1:{port}"),
        Default::default(),
    )
    .unwrap();
    let e = wrong.reset_key().await.unwrap_err();
    println!("wrong password: {e}");
    assert!(!wrong.is_redis_up());
}

/// With a fleet secret the members share as before, and Redis holds none of the keys nor
/// any session in clear (the reset key's value is not its hex, a session's bytes are not in
/// the stream); a member with another secret takes nothing from them: not their keys, not
/// their sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_fleet_secret_redis_holds_only_sealed_values() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _r = start(&["--port", &port.to_string()], port);
    let url = format!("redis://127.0.0.1:{port}");
    let sealed = FleetOptions {
        secret: Some([9; 32]),
        ..Default::default()
    };
    two_members_with(&url, sealed.clone()).await;
    let a = Fleet::start(&url, sealed).unwrap();
    let key = a.reset_key().await.unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let stored: Vec<u8> = redis::cmd("GET")
        .arg("kuai:keys:stateless-reset")
        .query_async(&mut c)
        .await
        .unwrap();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    assert!(stored.starts_with(b"k1:"), "sealed");
    assert!(!stored.windows(8).any(|w| key.windows(8).any(|k| k == w)));
    assert!(!String::from_utf8_lossy(&stored).contains(&hex[..16]));
    let stream: redis::Value = redis::cmd("XRANGE")
        .arg("kuai:sessions")
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await
        .unwrap();
    let dump = format!("{stream:?}");
    assert!(
        dump.contains("ticket-1"),
        "the stream has the session's entry"
    );
    assert!(!dump.contains("\"session\""), "a session in clear: {dump}");
    // Another secret: nothing of theirs is taken.
    let other = Fleet::start(
        &url,
        FleetOptions {
            secret: Some([10; 32]),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(other.reset_key().await.is_err(), "their key taken");
    a.sessions()
        .put(b"ticket-3".to_vec(), b"session 3".to_vec());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(other.sessions().get(b"ticket-1"), None);
    assert_eq!(other.sessions().get(b"ticket-3"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_share_through_redis_over_tls() {
    if !installed() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kuai-fleet-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    let port = free_port();
    let (c, k) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let _r = start(
        &[
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            c,
            "--tls-key-file",
            k,
            "--tls-ca-cert-file",
            c,
            "--tls-auth-clients",
            "no",
            "--requirepass",
            "s3cret",
        ],
        port,
    );
    two_members(
        &format!("rediss://:s3cret@127.0.0.1:{port}"),
        Some(ck.cert.pem().into_bytes()),
    )
    .await;
    // Without the CA, the server's certificate is not trusted.
    let untrusted = Fleet::start(
        &format!("rediss://:s3cret@127.0.0.1:{port}"),
        Default::default(),
    )
    .unwrap();
    assert!(untrusted.reset_key().await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// With Redis away no session resumes, this server's own no more than a replica (the
/// others hold replicas of it and might record a replay's use as the first); it stays for
/// when Redis is back. The ticket's first use cannot be recorded: an error, which the guard
/// counts as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_away_no_session_resumes() {
    if !installed() {
        return;
    }
    let port = free_port();
    let r = start(&["--port", &port.to_string()], port);
    let url = format!("redis://127.0.0.1:{port}");
    // Longer than the session reader may take to find Redis back (it reads every 2 s).
    let window = Duration::from_secs(5);
    let a = with_replay_window(&url, window);
    a.sessions().put(b"own-1".to_vec(), b"session".to_vec());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !a.is_redis_up() {
        assert!(Instant::now() < deadline, "redis did not come up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(r);
    assert!(a.anti_replay().first_use(b"own-1").await.is_err());
    assert!(!a.is_redis_up());
    assert_eq!(a.sessions().take(b"own-1"), None, "resumed with redis away");
    let _r = start(&["--port", &port.to_string()], port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.is_redis_up() {
        assert!(Instant::now() < deadline, "redis did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A restarted Redis: no resumption for a replay window (see the test below), then the
    // session is there.
    let back = Instant::now();
    assert_eq!(
        a.sessions().take(b"own-1"),
        None,
        "resumed just after a restart"
    );
    let e = a.anti_replay().first_use(b"own-2").await.unwrap_err();
    assert!(
        matches!(e, kuai_fleet::FleetError::ReplayRecordsLost { .. }),
        "{e}"
    );
    tokio::time::sleep(window.saturating_sub(back.elapsed()) + Duration::from_millis(100)).await;
    assert_eq!(a.sessions().take(b"own-1"), Some(b"session".to_vec()));
    assert!(a.anti_replay().first_use(b"own-1").await.unwrap());
}

/// A NEW_TOKEN token used at one member validates no address at another: the members
/// share their token logs through the stream (RFC 9000 §8.1.4: a token once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_token_used_at_one_member_is_used_at_all() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _r = start(&["--port", &port.to_string()], port);
    let url = format!("redis://127.0.0.1:{port}");
    let a = Fleet::start(&url, Default::default()).unwrap();
    let b = Fleet::start(&url, Default::default()).unwrap();
    let day = Duration::from_secs(86_400);
    let (la, lb) = (
        Arc::new(kuai::kuai_proto::TokenLog::new()),
        Arc::new(kuai::kuai_proto::TokenLog::new()),
    );
    a.share_token_log(la.clone(), day);
    b.share_token_log(lb.clone(), day);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let id = [7u8; 12];
    assert!(la.first_use(&id, now - 1000, now, day), "first use at a");
    // The note goes through the stream (b's reader wakes as it arrives).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !lb.first_use(&id, now - 1000, now, day),
        "the token validated at b after its use at a"
    );
    // A token never used still validates at b.
    assert!(lb.first_use(&[8u8; 12], now - 1000, now, day));
    // A member started later reads the stream from its start as soon as it starts, before
    // its server shares its token log: those uses are kept for the log (they were read and
    // dropped, and a restarted server took every token used in the fleet once more).
    let c = Fleet::start(&url, Default::default()).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lc = Arc::new(kuai::kuai_proto::TokenLog::new());
    c.share_token_log(lc.clone(), day);
    assert!(
        !lc.first_use(&id, now - 1000, now, day),
        "the token validated at a member started after its use"
    );
}

/// A session issued by a server whose clock runs ahead of Redis's by more than the allowed
/// skew is not taken as a replica (rustls judges a ticket's age by its issuer's clock: it
/// would stay 0-RTT-fresh elsewhere for that much longer); one issued on time is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_from_an_issuer_whose_clock_runs_ahead_are_not_taken() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _r = start(&["--port", &port.to_string()], port);
    let url = format!("redis://127.0.0.1:{port}");
    let b = Fleet::start(&url, Default::default()).unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (id, at) in [("ahead", now + 600_000), ("on-time", now)] {
        let _: String = redis::cmd("XADD")
            .arg("kuai:sessions")
            .arg("*")
            .arg("k")
            .arg("i")
            .arg("o")
            .arg(&[9u8; 8][..])
            .arg("i")
            .arg(id)
            .arg("v")
            .arg("session")
            .arg("t")
            .arg(at)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.sessions().get(b"on-time").is_none() {
        assert!(
            Instant::now() < deadline,
            "the session on time did not arrive"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(b.sessions().get(b"ahead").is_none());
}

/// A Redis that answers reads but refuses writes (out of memory with `noeviction`, or a user
/// who may read and not write) counts as away: no session resumes, since its first use
/// could not be recorded (the session reader's successful reads made it count as up, and
/// every resumption's 0-RTT was then refused as a replay, its ticket used up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_writes_counts_as_away() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _r = start(
        &[
            "--port",
            &port.to_string(),
            "--maxmemory",
            "1",
            "--maxmemory-policy",
            "noeviction",
        ],
        port,
    );
    let url = format!("redis://127.0.0.1:{port}");
    let a = Fleet::start(&url, Default::default()).unwrap();
    a.sessions().put(b"own-1".to_vec(), b"session".to_vec());
    // The session reader reads the stream (a read returns every 2 s) twice over meanwhile.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        assert!(
            !a.is_redis_up(),
            "redis counted as up after {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        a.sessions().take(b"own-1"),
        None,
        "resumed without a record"
    );
}

/// A Redis that accepts connections and never answers (a hung server, a black-holed
/// route): a burst of first-use checks all fail within the timeout (1 s) from their start,
/// not one connection attempt after another (the last of 32 would wait 32 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_redis_fails_a_burst_of_checks_within_the_timeout() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let a = Fleet::start(&url, Default::default()).unwrap();
    let t = Instant::now();
    let checks: Vec<_> = (0..32u8)
        .map(|i| {
            let guard = a.anti_replay();
            tokio::spawn(async move { guard.first_use(&[i]).await })
        })
        .collect();
    for c in checks {
        assert!(c.await.unwrap().is_err());
    }
    let took = t.elapsed();
    println!("32 checks against a silent redis failed in {took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    drop(silent);
}

/// A server whose clock is further from Redis's than `max_clock_skew` accepts no 0-RTT
/// (every first use reads Redis's `TIME`): here no difference at all is allowed, and the
/// microseconds of the round trip are already too many. The use is still recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_too_far_from_redis_refuses_0rtt() {
    if !installed() {
        return;
    }
    let port = free_port();
    let _redis = start(&["--port", &port.to_string()], port);
    let url = format!("redis://127.0.0.1:{port}");
    let strict = Fleet::start(
        &url,
        FleetOptions {
            max_clock_skew: Duration::ZERO,
            ..Default::default()
        },
    )
    .unwrap();
    let usual = Fleet::start(&url, Default::default()).unwrap();
    let e = strict
        .anti_replay()
        .first_use(b"ticket-1")
        .await
        .unwrap_err();
    assert!(
        matches!(e, kuai_fleet::FleetError::ClockSkew { ahead_ms } if ahead_ms.abs() < 1000),
        "{e}"
    );
    assert!(strict.is_redis_up(), "a clock difference is not Redis away");
    // Recorded all the same; a server within the default 30 s goes on as usual.
    assert!(!usual.anti_replay().first_use(b"ticket-1").await.unwrap());
    assert!(usual.anti_replay().first_use(b"ticket-2").await.unwrap());
}

/// A Redis restarted empty has lost the first uses it recorded: a replay of a flight a
/// server accepted just before would be taken as a first use. Each server finds the restart
/// by Redis's `run_id` when it connects again and refuses 0-RTT for a replay window; a
/// connection that merely dropped (the same Redis) changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_refuses_0rtt_for_a_replay_window() {
    if !installed() {
        return;
    }
    let port = free_port();
    let args = ["--port".to_string(), port.to_string()];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = start(&args, port);
    let url = format!("redis://127.0.0.1:{port}");
    let window = Duration::from_secs(3);
    let a = with_replay_window(&url, window);
    let guard = a.anti_replay();
    assert!(guard.first_use(b"ticket-1").await.unwrap());
    // Every client connection dropped by Redis: a new one to the same Redis.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: redis::Value = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"][..])
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(!guard.first_use(b"ticket-1").await.unwrap());
    assert!(guard.first_use(b"ticket-2").await.unwrap());

    drop(redis);
    let _redis = start(&args, port);
    let t = Instant::now();
    let e = guard.first_use(b"ticket-1").await.unwrap_err();
    assert!(
        matches!(e, kuai_fleet::FleetError::ReplayRecordsLost { .. }),
        "{e}"
    );
    let e = guard.first_use(b"ticket-3").await.unwrap_err();
    assert!(matches!(
        e,
        kuai_fleet::FleetError::ReplayRecordsLost { .. }
    ));
    assert!(a.is_redis_up(), "a restart is not Redis away");
    tokio::time::sleep(window.saturating_sub(t.elapsed() + Duration::from_millis(500))).await;
    assert!(guard.first_use(b"ticket-4").await.is_err());
    tokio::time::sleep(window.saturating_sub(t.elapsed()) + Duration::from_millis(100)).await;
    // A use meanwhile was recorded (ticket-4, 0.6 s ago; the records last a window); new
    // ones are first uses again.
    assert!(!guard.first_use(b"ticket-4").await.unwrap());
    assert!(guard.first_use(b"ticket-5").await.unwrap());
}
