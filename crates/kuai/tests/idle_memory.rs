//! Heap a server holds for each idle connection, transport and async endpoint together, on
//! real loopback sockets (the target is 10 KB of server memory per idle connection,
//! measured as resident memory by `kuai bench`).
//!
//! The server runs on a thread of its own, and a counting allocator counts only what that
//! thread allocates and frees, so the client's connections in the same process are not
//! counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use kuai::{ClientConfig, Endpoint, ServerConfig};

const ALPN: &[u8] = b"kuai-test";

struct ServerThreadOnly;

static LIVE: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn count(delta: isize) {
    // `try_with`: thread-local storage may already be gone while a thread exits.
    if COUNTED.try_with(Cell::get).unwrap_or(false) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to the system allocator with the caller's layout unchanged.
unsafe impl GlobalAlloc for ServerThreadOnly {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: ServerThreadOnly = ServerThreadOnly;

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Starts a server on its own thread, the way `kuai bench server` runs one: a task per
/// connection waiting for streams. Returns its address and certificate.
fn start_server() -> (SocketAddr, rustls::pki_types::CertificateDer<'static>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        COUNTED.with(|c| c.set(true));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (cfg, cert) = ServerConfig::self_signed(&["localhost"], &[ALPN]).unwrap();
            let server = Endpoint::server(cfg, localhost()).unwrap();
            tx.send((server.local_addr().unwrap(), cert)).unwrap();
            while let Some(connecting) = server.accept().await {
                tokio::spawn(async move {
                    let Ok(conn) = connecting.await else { return };
                    while let Ok((_send, _recv)) = conn.accept_bi().await {}
                });
            }
        });
    });
    rx.recv().unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn an_idle_connection_costs_the_server_little_heap() {
    // With the first connection, 256: the connection table's slots are all used.
    const N: usize = 255;
    let (addr, cert) = start_server();
    let client = Endpoint::client(localhost()).unwrap();
    let cfg = ClientConfig::with_root(cert, &[ALPN]).unwrap();
    let mut conns = Vec::with_capacity(N + 1);
    // A first connection, so that lazily built state is in the baseline.
    conns.push(
        client
            .connect_with(cfg.clone(), addr, "localhost")
            .unwrap()
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base = LIVE.load(Ordering::Relaxed);
    for _ in 0..N {
        let c = client.connect_with(cfg.clone(), addr, "localhost").unwrap();
        conns.push(c.await.unwrap());
    }
    // Past the ACK delay and the last flights' acknowledgments.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let per_conn = (LIVE.load(Ordering::Relaxed) - base) as f64 / N as f64;
    eprintln!("server heap per idle connection: {per_conn:.0} bytes");
    // About 8.9 KB today: 8.1 KB with NewReno, 384 bytes more for the default controller's
    // (BBR's) boxed state, and about 350 bytes for the two session tickets the server keeps
    // per client (kuai::session::SessionCache; they outlive the connection, for resumption
    // and 0-RTT). Allocator overhead and fragmentation come on top in resident memory
    // (`kuai bench`'s idle workload).
    assert!(
        per_conn < 9_200.0,
        "{per_conn:.0} bytes of server heap per idle connection"
    );
    drop(conns);
}
