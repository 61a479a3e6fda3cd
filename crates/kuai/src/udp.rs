//! The UDP layer: a tokio socket with Linux offloads through `quinn-udp` (GSO on send, GRO and
//! `recvmmsg` on receive, ECN and destination-address control messages). Features the kernel
//! lacks are probed once and fall back cleanly.

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};

use quinn_udp::{RecvMeta, UdpSockRef, UdpSocketState};
use tokio::io::Interest;

/// Socket buffer size kuai asks for; the kernel may cap it (see `net.core.rmem_max`).
pub const SOCKET_BUFFER: usize = 8 << 20;

/// Counters of the UDP layer, to prove batching works (segments per syscall).
#[derive(Debug, Default)]
pub struct UdpStats {
    /// Send system calls made.
    pub send_calls: AtomicU64,
    /// Datagrams sent (a GSO call sends several).
    pub sent_datagrams: AtomicU64,
    /// Bytes sent.
    pub sent_bytes: AtomicU64,
    /// Receive system calls that returned data.
    pub recv_calls: AtomicU64,
    /// Datagrams received (a GRO buffer or `recvmmsg` call returns several).
    pub recv_datagrams: AtomicU64,
    /// Bytes received.
    pub recv_bytes: AtomicU64,
    /// Sends that failed other than by a full buffer (ICMP errors, EMSGSIZE).
    pub send_errors: AtomicU64,
}

/// A snapshot of [`UdpStats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UdpStatsSnapshot {
    /// Send system calls made.
    pub send_calls: u64,
    /// Datagrams sent (a GSO call sends several).
    pub sent_datagrams: u64,
    /// Bytes sent.
    pub sent_bytes: u64,
    /// Receive system calls that returned data.
    pub recv_calls: u64,
    /// Datagrams received (a GRO buffer or `recvmmsg` call returns several).
    pub recv_datagrams: u64,
    /// Bytes received.
    pub recv_bytes: u64,
    /// Sends that failed other than by a full buffer (ICMP errors, EMSGSIZE).
    pub send_errors: u64,
}

impl UdpStats {
    /// The current values.
    pub fn snapshot(&self) -> UdpStatsSnapshot {
        UdpStatsSnapshot {
            send_calls: self.send_calls.load(Ordering::Relaxed),
            sent_datagrams: self.sent_datagrams.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            recv_calls: self.recv_calls.load(Ordering::Relaxed),
            recv_datagrams: self.recv_datagrams.load(Ordering::Relaxed),
            recv_bytes: self.recv_bytes.load(Ordering::Relaxed),
            send_errors: self.send_errors.load(Ordering::Relaxed),
        }
    }
}

/// Options for binding a socket.
#[derive(Debug, Clone, Copy)]
pub struct SocketOptions {
    /// Allow several sockets on the same port (SO_REUSEPORT), for multi-worker servers.
    pub reuse_port: bool,
    /// Use GSO when the kernel supports it.
    pub gso: bool,
    /// Use GRO when the kernel supports it.
    pub gro: bool,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            reuse_port: false,
            gso: true,
            gro: true,
        }
    }
}

/// A bound UDP socket with its offload state.
#[derive(Debug)]
pub struct UdpSocket {
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    max_segments: usize,
    gro_segments: usize,
    local: SocketAddr,
}

impl UdpSocket {
    /// Binds `addr`. An IPv6 unspecified address is bound dual-stack.
    pub fn bind(addr: SocketAddr, opts: SocketOptions) -> io::Result<Self> {
        let domain = socket2::Domain::for_address(addr);
        let sock =
            socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
        if addr.is_ipv6() {
            // Dual-stack when bound to [::]; ignore failure on hosts without IPv4.
            let _ = sock.set_only_v6(false);
        }
        #[cfg(unix)]
        if opts.reuse_port {
            sock.set_reuse_port(true)?;
        }
        sock.bind(&addr.into())?;
        sock.set_nonblocking(true)?;
        let std_sock: std::net::UdpSocket = sock.into();
        Self::from_std(std_sock, opts)
    }

    /// Wraps an already bound socket.
    pub fn from_std(sock: std::net::UdpSocket, opts: SocketOptions) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        let state = UdpSocketState::new(UdpSockRef::from(&sock))?;
        for (what, set, get) in [
            (
                "send",
                UdpSocketState::set_send_buffer_size
                    as fn(&UdpSocketState, UdpSockRef<'_>, usize) -> io::Result<()>,
                UdpSocketState::send_buffer_size
                    as fn(&UdpSocketState, UdpSockRef<'_>) -> io::Result<usize>,
            ),
            (
                "receive",
                UdpSocketState::set_recv_buffer_size,
                UdpSocketState::recv_buffer_size,
            ),
        ] {
            let _ = set(&state, UdpSockRef::from(&sock), SOCKET_BUFFER);
            match get(&state, UdpSockRef::from(&sock)) {
                // Linux reports double the effective size.
                Ok(n) if n < SOCKET_BUFFER => tracing::warn!(
                    "UDP {what} buffer capped at {n} bytes (asked {SOCKET_BUFFER}); raise \
                     net.core.{}mem_max for high throughput",
                    if what == "send" { "w" } else { "r" }
                ),
                _ => {}
            }
        }
        let max_segments = if opts.gso {
            state.max_gso_segments().max(1)
        } else {
            1
        };
        let gro_segments = if opts.gro {
            state.gro_segments().max(1)
        } else {
            1
        };
        let local = sock.local_addr()?;
        let io = tokio::net::UdpSocket::from_std(sock)?;
        Ok(Self {
            io,
            state,
            max_segments,
            gro_segments,
            local,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Datagrams one send call may carry (1 without GSO).
    pub fn max_segments(&self) -> usize {
        self.max_segments
    }

    /// Datagrams the kernel may coalesce into one received buffer (1 without GRO).
    pub fn gro_segments(&self) -> usize {
        self.gro_segments
    }

    /// Sends `contents` (one datagram, or `segment_size`-sized datagrams via GSO). Returns
    /// `WouldBlock` when the socket buffer is full; other errors are counted and swallowed
    /// (UDP is lossy anyway, and the transport will retransmit).
    pub fn try_send(
        &self,
        stats: &UdpStats,
        destination: SocketAddr,
        ecn: Option<u8>,
        src_ip: Option<IpAddr>,
        contents: &[u8],
        segment_size: Option<usize>,
    ) -> io::Result<()> {
        let ecn = ecn.and_then(quinn_udp::EcnCodepoint::from_bits);
        let seg = segment_size.filter(|&s| s < contents.len());
        if seg.is_some() && self.max_segments > 1 {
            let t = quinn_udp::Transmit {
                destination,
                ecn,
                contents,
                segment_size: seg,
                src_ip,
            };
            return self.send_one(
                stats,
                &t,
                contents.len().div_ceil(seg.unwrap_or(contents.len())),
            );
        }
        // No GSO: one call per datagram.
        let seg = seg.unwrap_or(contents.len());
        for chunk in contents.chunks(seg) {
            let t = quinn_udp::Transmit {
                destination,
                ecn,
                contents: chunk,
                segment_size: None,
                src_ip,
            };
            self.send_one(stats, &t, 1)?;
        }
        Ok(())
    }

    fn send_one(
        &self,
        stats: &UdpStats,
        t: &quinn_udp::Transmit<'_>,
        datagrams: usize,
    ) -> io::Result<()> {
        let r = self.io.try_io(Interest::WRITABLE, || {
            self.state.try_send(UdpSockRef::from(&self.io), t)
        });
        match r {
            Ok(()) => {
                stats.send_calls.fetch_add(1, Ordering::Relaxed);
                stats
                    .sent_datagrams
                    .fetch_add(datagrams as u64, Ordering::Relaxed);
                stats
                    .sent_bytes
                    .fetch_add(t.contents.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(e),
            Err(e) => {
                // ICMP errors, EMSGSIZE from an MTU probe, unreachable hosts: the transport
                // sees the loss and recovers or times out.
                stats.send_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, dst = %t.destination, "UDP send failed");
                Ok(())
            }
        }
    }

    /// Waits until a send may succeed.
    pub async fn writable(&self) -> io::Result<()> {
        self.io.writable().await
    }

    /// Waits until a receive may succeed.
    pub async fn readable(&self) -> io::Result<()> {
        self.io.readable().await
    }

    /// Receives a batch without blocking (`WouldBlock` when empty).
    pub fn try_recv(
        &self,
        stats: &UdpStats,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> io::Result<usize> {
        let n = self.io.try_io(Interest::READABLE, || {
            self.state.recv(UdpSockRef::from(&self.io), bufs, meta)
        })?;
        stats.recv_calls.fetch_add(1, Ordering::Relaxed);
        for m in &meta[..n] {
            stats
                .recv_datagrams
                .fetch_add(m.len.div_ceil(m.stride.max(1)) as u64, Ordering::Relaxed);
            stats.recv_bytes.fetch_add(m.len as u64, Ordering::Relaxed);
        }
        Ok(n)
    }
}
