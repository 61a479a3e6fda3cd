//! The UDP layer: a tokio socket with Linux offloads through `quinn-udp` (GSO on send, GRO and
//! `recvmmsg` on receive, ECN and destination-address control messages), and `sendmmsg` batches
//! where GSO is absent or off. Features the kernel lacks are probed once and fall back cleanly.

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use quinn_udp::{RecvMeta, UdpSockRef, UdpSocketState};
use tokio::io::Interest;

/// Socket buffer size kuai asks for; the kernel may cap it (see `net.core.rmem_max`).
pub const SOCKET_BUFFER: usize = 8 << 20;

/// Whether the capped-buffer warning was given.
static BUFFER_WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
#[non_exhaustive]
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

impl std::ops::AddAssign for UdpStatsSnapshot {
    fn add_assign(&mut self, o: Self) {
        self.send_calls += o.send_calls;
        self.sent_datagrams += o.sent_datagrams;
        self.sent_bytes += o.sent_bytes;
        self.recv_calls += o.recv_calls;
        self.recv_datagrams += o.recv_datagrams;
        self.recv_bytes += o.recv_bytes;
        self.send_errors += o.send_errors;
    }
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
    /// Datagrams per send call: GSO segments, or a `sendmmsg` batch without GSO.
    max_segments: usize,
    /// Cleared for good when the kernel refuses a GSO send (see [`UdpSocket::send_gso`]).
    gso: AtomicBool,
    gro_segments: usize,
    local: SocketAddr,
}

/// Datagrams per `sendmmsg` call when GSO is not available.
#[cfg(target_os = "linux")]
pub const MMSG_BATCH: usize = 32;

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

    /// Binds `workers` sockets on `addr`'s port, sharing it with SO_REUSEPORT. With
    /// `steer_cid_len`, attaches a classic BPF program to the group that hands each datagram
    /// to socket [`worker_of`]`(datagram, workers, cid_len)`: the i-th socket returned is
    /// worker i. A connection's packets all carry a destination CID its worker made, so they
    /// reach that worker whatever the client's address (migration, NAT rebinding). Without,
    /// the kernel spreads datagrams by their addresses and ports. With one worker this is
    /// [`bind`](Self::bind).
    pub fn bind_workers(
        addr: SocketAddr,
        opts: SocketOptions,
        workers: usize,
        steer_cid_len: Option<usize>,
    ) -> io::Result<Vec<Self>> {
        if workers <= 1 {
            return Ok(vec![Self::bind(addr, opts)?]);
        }
        let Some(cid_len) = steer_cid_len else {
            let opts = SocketOptions {
                reuse_port: true,
                ..opts
            };
            let first = Self::bind(addr, opts)?;
            let shared = first.local_addr();
            let mut all = vec![first];
            for _ in 1..workers {
                all.push(Self::bind(shared, opts)?);
            }
            return Ok(all);
        };
        if !(1..=u8::MAX as usize).contains(&cid_len) || workers > u8::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{workers} workers need connection IDs of 1 to 255 bytes (have {cid_len}) and at most 255 workers"
                ),
            ));
        }
        let opts = SocketOptions {
            reuse_port: true,
            ..opts
        };
        let first = Self::bind(addr, opts)?;
        let shared = first.local_addr();
        #[cfg(target_os = "linux")]
        steer::attach(&first.io, workers as u32, cid_len as u32)?;
        #[cfg(not(target_os = "linux"))]
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "several workers on one port need Linux (SO_ATTACH_REUSEPORT_CBPF)",
        ));
        let mut all = vec![first];
        for _ in 1..workers {
            all.push(Self::bind(shared, opts)?);
        }
        Ok(all)
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
                // Linux reports double the effective size. Said once per process: a
                // balancer opens a socket per flow.
                Ok(n) if n < SOCKET_BUFFER && !BUFFER_WARNED.swap(true, Ordering::Relaxed) => {
                    tracing::warn!(
                        "UDP {what} buffer capped at {n} bytes (asked {SOCKET_BUFFER}); raise \
                     net.core.{}mem_max for high throughput",
                        if what == "send" { "w" } else { "r" }
                    )
                }
                _ => {}
            }
        }
        let gso_segments = if opts.gso {
            state.max_gso_segments().max(1)
        } else {
            1
        };
        let gso = gso_segments > 1;
        #[cfg(target_os = "linux")]
        let max_segments = if gso { gso_segments } else { MMSG_BATCH };
        #[cfg(not(target_os = "linux"))]
        let max_segments = gso_segments;
        let gro_segments = if opts.gro {
            state.gro_segments().max(1)
        } else {
            // quinn-udp turned the kernel's GRO on: off again, or the kernel would hand
            // coalesced batches of up to 64 KiB to receive slots of one datagram, and cut
            // them short without a word.
            #[cfg(target_os = "linux")]
            if state.gro_segments() > 1 {
                disable_gro(&sock)?;
            }
            1
        };
        let local = sock.local_addr()?;
        let io = tokio::net::UdpSocket::from_std(sock)?;
        Ok(Self {
            io,
            state,
            max_segments,
            gso: AtomicBool::new(gso),
            gro_segments,
            local,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Datagrams one send call may carry (GSO segments, or a `sendmmsg` batch).
    pub fn max_segments(&self) -> usize {
        self.max_segments
    }

    /// Whether sends use GSO (false from the first GSO send the kernel refused).
    pub fn gso(&self) -> bool {
        self.gso.load(Ordering::Relaxed)
    }

    /// Datagrams the kernel may coalesce into one received buffer (1 without GRO).
    pub fn gro_segments(&self) -> usize {
        self.gro_segments
    }

    /// Sends `contents`: one datagram, or `segment_size`-sized datagrams (the last may be
    /// shorter) with GSO or `sendmmsg`. Returns how many bytes went out — whole datagrams; the
    /// rest is for a later call — or `WouldBlock` when none did. Other errors are counted and
    /// swallowed (UDP is lossy anyway, and the transport will retransmit).
    pub fn try_send(
        &self,
        stats: &UdpStats,
        destination: SocketAddr,
        ecn: Option<u8>,
        src_ip: Option<IpAddr>,
        contents: &[u8],
        segment_size: Option<usize>,
    ) -> io::Result<usize> {
        let ecn_cp = ecn.and_then(quinn_udp::EcnCodepoint::from_bits);
        let seg = segment_size.filter(|&s| s > 0 && s < contents.len());
        if let Some(seg) = seg {
            if self.gso() {
                let t = quinn_udp::Transmit {
                    destination,
                    ecn: ecn_cp,
                    contents,
                    segment_size: Some(seg),
                    src_ip,
                };
                if self.send_gso(stats, &t, contents.len().div_ceil(seg))? {
                    return Ok(contents.len());
                }
                // Refused: the same datagrams go out without GSO, below.
            }
            #[cfg(target_os = "linux")]
            return self.send_mmsg(stats, destination, ecn, src_ip, contents, seg);
        }
        // One call per datagram.
        let seg = seg.unwrap_or(contents.len());
        let mut sent = 0;
        for chunk in contents.chunks(seg) {
            let t = quinn_udp::Transmit {
                destination,
                ecn: ecn_cp,
                contents: chunk,
                segment_size: None,
                src_ip,
            };
            match self.send_one(stats, &t, 1) {
                Ok(()) => sent += chunk.len(),
                Err(e) if sent == 0 => return Err(e),
                Err(_) => break,
            }
        }
        Ok(sent)
    }

    /// Sends each `seg`-sized piece of `contents` as its own datagram, up to [`MMSG_BATCH`]
    /// per `sendmmsg(2)` call.
    #[cfg(target_os = "linux")]
    fn send_mmsg(
        &self,
        stats: &UdpStats,
        destination: SocketAddr,
        ecn: Option<u8>,
        src_ip: Option<IpAddr>,
        contents: &[u8],
        seg: usize,
    ) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        // A dual-stack IPv6 socket reaches IPv4 peers through mapped addresses.
        let destination = match destination {
            SocketAddr::V4(a) if self.local.is_ipv6() => {
                SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port())
            }
            d => d,
        };
        let dst = socket2::SockAddr::from(destination);
        let ipv4 = match destination.ip() {
            IpAddr::V4(_) => true,
            IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some(),
        };
        let mut ctrl = mmsg::Control::default();
        let ctrl_len = ctrl.encode(ipv4, ecn.unwrap_or(0), src_ip);
        let fd = self.io.as_raw_fd();
        let mut sent = 0;
        while sent < contents.len() {
            let r = self.io.try_io(Interest::WRITABLE, || {
                mmsg::send(fd, &dst, &mut ctrl, ctrl_len, &contents[sent..], seg)
            });
            match r {
                Ok((datagrams, bytes)) => {
                    stats.send_calls.fetch_add(1, Ordering::Relaxed);
                    stats
                        .sent_datagrams
                        .fetch_add(datagrams as u64, Ordering::Relaxed);
                    stats.sent_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                    sent += bytes;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if sent == 0 { Err(e) } else { Ok(sent) };
                }
                Err(e) => {
                    // As in send_one: the transport sees the loss and recovers.
                    stats.send_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, dst = %destination, "UDP sendmmsg failed");
                    return Ok(contents.len());
                }
            }
        }
        Ok(sent)
    }

    /// [`send_one`](Self::send_one) for a GSO transmit; `Ok(false)` when the kernel refused
    /// GSO itself, which then stays off on this socket. Linux gives no way to ask whether a
    /// route can take GSO: a device without checksum offload answers EIO, an IPsec (xfrm)
    /// route or a segment above the route's MTU EINVAL (`udp_send_skb`). quinn-udp lowers its
    /// segment count on the same errors but leaves the transmit to its caller.
    fn send_gso(
        &self,
        stats: &UdpStats,
        t: &quinn_udp::Transmit<'_>,
        datagrams: usize,
    ) -> io::Result<bool> {
        let r = self.io.try_io(Interest::WRITABLE, || {
            self.state.try_send(UdpSockRef::from(&self.io), t)
        });
        match r {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EIO | libc::EINVAL)) => {
                stats.send_errors.fetch_add(1, Ordering::Relaxed);
                if self.gso.swap(false, Ordering::Relaxed) {
                    tracing::info!(
                        error = %e,
                        dst = %t.destination,
                        "UDP segmentation offload refused; sending without it on {}",
                        self.local
                    );
                }
                Ok(false)
            }
            r => self.sent(stats, t, datagrams, r).map(|()| true),
        }
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
        self.sent(stats, t, datagrams, r)
    }

    /// Counts a send's outcome: `WouldBlock` is returned, other errors counted and swallowed.
    fn sent(
        &self,
        stats: &UdpStats,
        t: &quinn_udp::Transmit<'_>,
        datagrams: usize,
        r: io::Result<()>,
    ) -> io::Result<()> {
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

pub(crate) use recv_pool::RecvPool;

/// Buffers received datagrams live in until the transport and the application are done with
/// them. The unsafe code: a receive lands directly in a buffer's spare capacity.
#[allow(unsafe_code)]
mod recv_pool {
    use std::collections::VecDeque;

    use bytes::BytesMut;

    /// Size of one pool buffer.
    const POOL_BUF: usize = 256 * 1024;
    /// Pool buffers a worker has at most (16 MiB): filled ones still holding datagrams the
    /// transport or the application keep, and free ones waiting for reuse. A peer that makes
    /// us keep a few bytes of every buffer could otherwise pin buffers without end: past this
    /// many, datagrams are copied into allocations of their own, which the transport's limits
    /// on what it keeps then bound (see `kuai_proto::Assembler`).
    const MAX_BUFFERS: usize = 64;
    /// Free buffers kept for reuse; more are given back.
    const FREE_KEPT: usize = 12;

    /// Datagrams are cut from shared 256 KiB buffers: one allocation per buffer rather than
    /// per datagram. A filled buffer is kept and taken back once every datagram cut from it is
    /// dropped, so a steady stream of data reuses warm pages instead of faulting in new ones.
    ///
    /// Invariant: every buffer was zeroed over its whole capacity when allocated, and
    /// `try_reclaim` only ever hands back that same allocation, so a buffer's spare capacity
    /// is always initialized memory.
    pub(crate) struct RecvPool {
        /// The buffer datagrams are cut from; `None` while [`MAX_BUFFERS`] are in use.
        current: Option<BytesMut>,
        /// Buffers handed out before `current`, oldest first: each handle is empty but keeps
        /// its allocation, and is free again once everything cut from it is dropped.
        filled: VecDeque<BytesMut>,
        /// Where receives land while no pool buffer is available.
        scratch: Vec<u8>,
        /// Bytes `recv_area` last handed out.
        area: usize,
    }

    impl RecvPool {
        pub(crate) fn new() -> Self {
            Self {
                current: Some(zeroed(POOL_BUF)),
                filled: VecDeque::new(),
                scratch: Vec::new(),
                area: 0,
            }
        }

        /// Room for one receive of up to `len` bytes; [`commit`](Self::commit) then takes
        /// what was written.
        pub(crate) fn recv_area(&mut self, len: usize) -> &mut [u8] {
            self.area = len;
            if self.room() < len {
                self.refill(len);
            }
            match self.current.as_mut() {
                Some(current) => {
                    let spare = current.spare_capacity_mut();
                    // SAFETY: `spare` has at least `len` elements (refilled above: a current
                    // buffer always has room for `len`), and they are initialized: the pool's
                    // buffers are zeroed when allocated (see the invariant).
                    unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<u8>(), len) }
                }
                None => {
                    if self.scratch.len() < len {
                        self.scratch.resize(len, 0);
                    }
                    &mut self.scratch[..len]
                }
            }
        }

        /// The first `n` bytes of the last [`recv_area`](Self::recv_area), as datagrams of
        /// `stride` bytes (the last may be shorter) handed to `push`: cut from the pool
        /// buffer, or each copied to a buffer of its own when the receive went to scratch.
        pub(crate) fn commit(&mut self, n: usize, stride: usize, mut push: impl FnMut(BytesMut)) {
            assert!(n <= self.area, "more bytes than the receive area held");
            self.area = 0;
            let stride = stride.max(1);
            let Some(current) = self.current.as_mut() else {
                for seg in self.scratch[..n].chunks(stride) {
                    push(BytesMut::from(seg));
                }
                return;
            };
            let len = current.len() + n;
            // SAFETY: `len` is within the capacity (`n` fit in the area handed out, which
            // was spare capacity) and those bytes are initialized: written by the receive, or
            // zeroed at allocation (see the invariant).
            unsafe { current.set_len(len) };
            let mut first = current.split();
            while first.len() > stride {
                push(first.split_to(stride));
            }
            // An empty datagram carries nothing.
            if !first.is_empty() {
                push(first);
            }
        }

        /// `datagram` copied into pool memory (or into a buffer of its own while no pool
        /// buffer is available).
        pub(crate) fn copy(&mut self, datagram: &[u8]) -> BytesMut {
            if self.room() < datagram.len() {
                self.refill(datagram.len());
            }
            match self.current.as_mut() {
                Some(current) => {
                    current.extend_from_slice(datagram);
                    current.split()
                }
                None => BytesMut::from(datagram),
            }
        }

        fn room(&self) -> usize {
            self.current.as_ref().map_or(0, |c| c.capacity() - c.len())
        }

        /// Makes `current` a buffer with room for `need` bytes: the same one taken back, a
        /// free one, or a new one; none while [`MAX_BUFFERS`] are in use.
        fn refill(&mut self, need: usize) {
            let size = POOL_BUF.max(need);
            if let Some(c) = self.current.as_mut()
                && c.try_reclaim(size)
            {
                return;
            }
            if let Some(filled) = self.current.take() {
                self.filled.push_back(filled);
            }
            // The oldest free buffer is reused; free ones beyond FREE_KEPT are given back.
            let mut free = 0;
            let mut i = 0;
            while i < self.filled.len() {
                if self.filled[i].try_reclaim(size) {
                    if self.current.is_none() {
                        self.current = self.filled.remove(i);
                        continue;
                    }
                    free += 1;
                    if free > FREE_KEPT {
                        self.filled.remove(i);
                        continue;
                    }
                }
                i += 1;
            }
            if self.current.is_none() && self.filled.len() < MAX_BUFFERS {
                self.current = Some(zeroed(size));
            }
            if self.current.is_none() {
                tracing::debug!(
                    buffers = self.filled.len(),
                    "receive pool full of retained data: copying datagrams"
                );
            }
        }

        /// Bytes of pool buffers allocated.
        #[cfg(test)]
        fn pooled_bytes(&self) -> usize {
            self.filled
                .iter()
                .chain(self.current.as_ref())
                .map(|b| b.capacity() + b.len())
                .sum()
        }
    }

    /// An empty buffer whose whole capacity is zeroed.
    fn zeroed(size: usize) -> BytesMut {
        let mut b = BytesMut::zeroed(size);
        b.clear();
        b
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn commit_one(pool: &mut RecvPool, n: usize) -> BytesMut {
            let mut out = None;
            pool.commit(n, usize::MAX, |b| out = Some(b));
            out.unwrap_or_default()
        }

        #[test]
        fn receives_in_place_and_reuses_freed_buffers() {
            let mut pool = RecvPool::new();
            let area = pool.recv_area(64 * 1024);
            area[..5].copy_from_slice(b"hello");
            let a = commit_one(&mut pool, 5);
            assert_eq!(&a[..], b"hello");
            let b = pool.copy(b"world");
            assert_eq!(&b[..], b"world");
            let first = a.as_ptr();
            drop((a, b));
            // Fill the rest of the buffer: the next receive takes the first one back.
            while pool.room() >= 64 * 1024 {
                let n = pool.recv_area(64 * 1024).len();
                drop(commit_one(&mut pool, n));
            }
            let area = pool.recv_area(64 * 1024);
            assert_eq!(area.as_ptr(), first, "the freed buffer is reused");
            // A buffer still in use is not.
            let held = commit_one(&mut pool, 100);
            while pool.room() >= 64 * 1024 {
                let n = pool.recv_area(64 * 1024).len();
                drop(commit_one(&mut pool, n));
            }
            assert_ne!(pool.recv_area(64 * 1024).as_ptr(), held.as_ptr());
        }

        #[test]
        fn commit_cuts_segments() {
            let mut pool = RecvPool::new();
            let area = pool.recv_area(10);
            area.copy_from_slice(b"0123456789");
            let mut got = Vec::new();
            pool.commit(10, 4, |b| got.push(b));
            assert_eq!(got, [&b"0123"[..], b"4567", b"89"]);
        }

        /// A datagram kept from every buffer (a peer whose few bytes the transport keeps)
        /// pins at most MAX_BUFFERS buffers; later datagrams get allocations of their own,
        /// and the pool is back in use once the kept ones go.
        #[test]
        fn kept_datagrams_pin_a_bounded_number_of_buffers() {
            let mut pool = RecvPool::new();
            let mut kept = Vec::new();
            for i in 0..(MAX_BUFFERS * 4) {
                let area = pool.recv_area(1200);
                area[0] = i as u8;
                kept.push(commit_one(&mut pool, 1200));
                // The rest of the buffer's worth of datagrams is dropped at once.
                for _ in 0..(POOL_BUF / 1200) {
                    drop(pool.copy(&[0u8; 1200]));
                }
            }
            assert!(
                pool.pooled_bytes() <= MAX_BUFFERS * POOL_BUF,
                "{} bytes pooled",
                pool.pooled_bytes()
            );
            assert!(kept.iter().enumerate().all(|(i, b)| b[0] == i as u8));
            drop(kept);
            let n = pool.recv_area(1200).len();
            let _ = commit_one(&mut pool, n);
            assert!(pool.current.is_some(), "the pool is used again");
            assert!(
                pool.filled.len() <= FREE_KEPT + 1,
                "{} buffers kept",
                pool.filled.len()
            );
        }
    }
}

/// `sendmmsg(2)` with one destination and one set of control messages for the whole batch.
/// Unsafe code of the UDP layer (with `recv_pool`, `disable_gro` and `steer`): the system
/// call and its C structures.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod mmsg {
    use std::io;
    use std::net::IpAddr;
    use std::os::fd::RawFd;

    use super::MMSG_BATCH;

    /// Room for IP_TOS/IPV6_TCLASS and an IP_PKTINFO/IPV6_PKTINFO, aligned as `cmsghdr`
    /// needs.
    #[repr(C, align(8))]
    pub struct Control([u8; 96]);

    impl Default for Control {
        fn default() -> Self {
            Control([0; 96])
        }
    }

    impl Control {
        /// Writes the ECN codepoint and source-address control messages; returns their length.
        pub fn encode(&mut self, ipv4: bool, ecn: u8, src_ip: Option<IpAddr>) -> usize {
            let buf = &mut self.0;
            let mut at = 0;
            let tos = libc::c_int::from(ecn);
            if ipv4 {
                at += put(
                    &mut buf[at..],
                    libc::IPPROTO_IP,
                    libc::IP_TOS,
                    &tos.to_ne_bytes(),
                );
            } else {
                at += put(
                    &mut buf[at..],
                    libc::IPPROTO_IPV6,
                    libc::IPV6_TCLASS,
                    &tos.to_ne_bytes(),
                );
            }
            match src_ip {
                Some(IpAddr::V4(v4)) => {
                    // struct in_pktinfo { int ifindex; in_addr spec_dst; in_addr addr; }
                    let mut info = [0u8; 12];
                    info[4..8].copy_from_slice(&v4.octets());
                    at += put(&mut buf[at..], libc::IPPROTO_IP, libc::IP_PKTINFO, &info);
                }
                Some(IpAddr::V6(v6)) => {
                    // struct in6_pktinfo { in6_addr addr; unsigned int ifindex; }
                    let mut info = [0u8; 20];
                    info[..16].copy_from_slice(&v6.octets());
                    at += put(
                        &mut buf[at..],
                        libc::IPPROTO_IPV6,
                        libc::IPV6_PKTINFO,
                        &info,
                    );
                }
                None => {}
            }
            at
        }
    }

    /// Writes one control message (header, data, padding) at the start of `buf`; returns
    /// the space it takes (CMSG_SPACE).
    fn put(buf: &mut [u8], level: libc::c_int, ty: libc::c_int, data: &[u8]) -> usize {
        let hdr = std::mem::size_of::<libc::cmsghdr>();
        let align = std::mem::size_of::<usize>();
        let len = hdr + data.len();
        let space = hdr + data.len().div_ceil(align) * align;
        assert!(buf.len() >= space, "control buffer too small");
        let h = libc::cmsghdr {
            cmsg_len: len as _,
            cmsg_level: level,
            cmsg_type: ty,
        };
        // SAFETY: `buf` has room for `space` >= size_of::<cmsghdr>() bytes (checked above);
        // write_unaligned has no alignment requirement.
        unsafe { std::ptr::write_unaligned(buf.as_mut_ptr().cast::<libc::cmsghdr>(), h) };
        buf[hdr..len].copy_from_slice(data);
        buf[len..space].fill(0);
        space
    }

    /// One `sendmmsg` call for up to MMSG_BATCH `seg`-sized datagrams from `contents`;
    /// returns (datagrams, bytes) sent.
    pub fn send(
        fd: RawFd,
        dst: &socket2::SockAddr,
        ctrl: &mut Control,
        ctrl_len: usize,
        contents: &[u8],
        seg: usize,
    ) -> io::Result<(usize, usize)> {
        // SAFETY: iovec and mmsghdr are plain C structs for which all-zero bytes are valid.
        let mut iov: [libc::iovec; MMSG_BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut msgs: [libc::mmsghdr; MMSG_BATCH] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        for (i, chunk) in contents.chunks(seg).take(MMSG_BATCH).enumerate() {
            iov[i].iov_base = chunk.as_ptr() as *mut libc::c_void;
            iov[i].iov_len = chunk.len();
            let h = &mut msgs[i].msg_hdr;
            // sendmmsg only reads the name, the iovecs and the control data.
            h.msg_name = dst.as_ptr() as *mut libc::c_void;
            h.msg_namelen = dst.len();
            h.msg_iov = &mut iov[i];
            h.msg_iovlen = 1;
            if ctrl_len > 0 {
                h.msg_control = ctrl.0.as_mut_ptr().cast::<libc::c_void>();
                h.msg_controllen = ctrl_len as _;
            }
            n += 1;
        }
        // SAFETY: `msgs[..n]` point at `iov`, `dst` and `ctrl`, all alive for the call;
        // every iovec covers a slice of `contents`; `n` <= MMSG_BATCH entries are passed.
        let r = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), n as libc::c_uint, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let done = r as usize;
        let bytes = contents.chunks(seg).take(done).map(<[u8]>::len).sum();
        Ok((done, bytes))
    }
}

/// The worker a datagram belongs to on an endpoint with `workers` sockets whose connection IDs
/// are `cid_len` bytes long: the last byte of its destination CID, modulo `workers`, and 0 for
/// a datagram too short to have one. The kernel program of [`UdpSocket::bind_workers`]
/// computes the same; a worker passes on what the kernel could not steer right (GRO can merge
/// datagrams of two connections that share a client address).
pub fn worker_of(datagram: &[u8], workers: usize, cid_len: usize) -> usize {
    if workers <= 1 {
        return 0;
    }
    let last = match datagram.first() {
        // Long header (RFC 8999 §5.1): the DCID length is byte 5, the DCID follows it.
        Some(b) if b & 0x80 != 0 => datagram
            .get(5)
            .and_then(|&len| datagram.get(5 + len as usize)),
        // Short header: our CID, of our fixed length, from byte 1.
        Some(_) => datagram.get(cid_len),
        None => None,
    };
    last.map_or(0, |&b| b as usize % workers)
}

/// Turns the kernel's UDP GRO off on `sock` (Linux 5.0's `UDP_GRO` option).
#[cfg(target_os = "linux")]
fn disable_gro(sock: &std::net::UdpSocket) -> io::Result<()> {
    set_int_option(sock, libc::SOL_UDP, libc::UDP_GRO, 0)
}

/// Sets an integer socket option: unsafe code of the UDP layer.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_int_option(
    sock: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `sock` is an open socket for the duration of the call; the option value
    // points at `value`, which outlives the call, and its size is given exactly.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&raw const value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The steering program (`SO_ATTACH_REUSEPORT_CBPF`); the socket option and its C structure
/// are unsafe code of the UDP layer.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod steer {
    use std::io;
    use std::os::fd::AsRawFd;

    // Classic BPF opcodes (linux/filter.h, linux/bpf_common.h): class | size | mode.
    const LD: u16 = 0x00;
    const B: u16 = 0x10;
    const LD_B_ABS: u16 = LD | B | 0x20;
    const LD_B_IND: u16 = LD | B | 0x40;
    const JMP_JSET_K: u16 = 0x05 | 0x40;
    const JMP_JA: u16 = 0x05;
    const MISC_TAX: u16 = 0x07;
    const ALU_MOD_K: u16 = 0x04 | 0x90;
    const RET_A: u16 = 0x06 | 0x10;

    fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
        libc::sock_filter { code, jt, jf, k }
    }

    /// The program [`super::worker_of`] describes. The data it sees starts at the UDP
    /// payload; a load past the end ends it with 0 (worker 0).
    pub fn program(workers: u32, cid_len: u32) -> [libc::sock_filter; 9] {
        [
            op(LD_B_ABS, 0, 0, 0),        // 0: A = first byte
            op(JMP_JSET_K, 0, 4, 0x80),   // 1: long header? 2 : 6
            op(LD_B_ABS, 0, 0, 5),        // 2: A = DCID length
            op(MISC_TAX, 0, 0, 0),        // 3: X = A
            op(LD_B_IND, 0, 0, 5),        // 4: A = byte 5 + length: the DCID's last
            op(JMP_JA, 0, 0, 1),          // 5: to 7
            op(LD_B_ABS, 0, 0, cid_len),  // 6: A = byte cid_len: the short DCID's last
            op(ALU_MOD_K, 0, 0, workers), // 7: A %= workers
            op(RET_A, 0, 0, 0),           // 8: the socket's index in the group
        ]
    }

    pub fn attach(sock: &impl AsRawFd, workers: u32, cid_len: u32) -> io::Result<()> {
        let mut filter = program(workers, cid_len);
        let prog = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_mut_ptr(),
        };
        // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies the
        // program and reads `size_of::<sock_fprog>()` bytes of `prog`.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_REUSEPORT_CBPF,
                (&raw const prog).cast::<libc::c_void>(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Which of `socks` received one datagram (waiting up to a second).
    async fn receiver(socks: &[UdpSocket]) -> usize {
        let stats = UdpStats::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            for (i, s) in socks.iter().enumerate() {
                let mut buf = [0u8; 2048];
                let mut slices = [IoSliceMut::new(&mut buf)];
                let mut meta = [RecvMeta::default()];
                if let Ok(1) = s.try_recv(&stats, &mut slices, &mut meta) {
                    return i;
                }
            }
            assert!(std::time::Instant::now() < deadline, "nothing arrived");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn the_kernel_steers_each_datagram_to_the_worker_its_cid_names() {
        let cid_len = 8;
        for workers in [2, 3] {
            let opts = SocketOptions {
                gro: false,
                ..SocketOptions::default()
            };
            let socks = UdpSocket::bind_workers(
                "127.0.0.1:0".parse().unwrap(),
                opts,
                workers,
                Some(cid_len),
            )
            .unwrap();
            assert_eq!(socks.len(), workers);
            let to = socks[0].local_addr();
            assert!(socks.iter().all(|s| s.local_addr() == to));
            let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut cases: Vec<Vec<u8>> = Vec::new();
            for last in [0u8, 1, 2, 5, 254, 255] {
                // Short header with an 8-byte DCID ending in `last`.
                let mut short = vec![0x41, 9, 9, 9, 9, 9, 9, 9, last];
                short.extend_from_slice(&[0xaa; 30]);
                cases.push(short);
                // Long headers with DCIDs of 8 and 20 bytes ending in `last`.
                for len in [8usize, 20] {
                    let mut long = vec![0xc3, 0, 0, 0, 1, len as u8];
                    long.extend(std::iter::repeat_n(7, len - 1));
                    long.push(last);
                    long.extend_from_slice(&[0; 40]);
                    cases.push(long);
                }
            }
            // Too short to name a worker: worker 0.
            cases.push(vec![0x40, 1, 2]);
            cases.push(vec![0xc0, 0, 0, 0, 1, 30, 1]);
            for d in &cases {
                peer.send_to(d, to).unwrap();
                assert_eq!(
                    receiver(&socks).await,
                    worker_of(d, workers, cid_len),
                    "{workers} workers, datagram {d:02x?}"
                );
            }
        }
    }

    /// A socket whose GSO sends the kernel refuses: with `SO_NO_CHECK` (no UDP checksum)
    /// `udp_send_skb` answers every segmented send EINVAL, as it does on an IPsec route.
    fn refuse_gso(sock: &UdpSocket) {
        set_int_option(&sock.io, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1).unwrap();
    }

    #[tokio::test]
    async fn a_refused_gso_send_goes_out_without_gso() {
        let sock =
            UdpSocket::bind("127.0.0.1:0".parse().unwrap(), SocketOptions::default()).unwrap();
        if !sock.gso() {
            eprintln!("no GSO on this kernel: nothing to fall back from");
            return;
        }
        refuse_gso(&sock);
        let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        peer.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let stats = UdpStats::default();
        let contents: Vec<u8> = (0..10 * 1200 + 300).map(|i| i as u8).collect();
        let dst = peer.local_addr().unwrap();
        let sent = loop {
            match sock.try_send(&stats, dst, None, None, &contents, Some(1200)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => sock.writable().await.unwrap(),
                r => break r.unwrap(),
            }
        };
        assert_eq!(sent, contents.len());
        assert!(!sock.gso(), "GSO stays off after the kernel refused it");
        let mut got = Vec::new();
        let mut buf = [0u8; 2048];
        while got.len() < contents.len() {
            let n = peer
                .recv(&mut buf)
                .expect("every datagram of the refused send arrives");
            assert!(n == 1200 || n == 300, "datagram of {n} bytes");
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, contents);
        let snap = stats.snapshot();
        assert_eq!(snap.sent_datagrams, 11);
        assert_eq!(snap.send_errors, 1);
        // The next send goes without GSO at once.
        sock.try_send(&stats, dst, None, None, &contents[..2400], Some(1200))
            .unwrap();
        assert_eq!(stats.snapshot().send_errors, 1);
        assert_eq!(peer.recv(&mut buf).unwrap(), 1200);
        assert_eq!(peer.recv(&mut buf).unwrap(), 1200);
    }

    #[test]
    fn worker_of_reads_the_last_byte_of_the_destination_cid() {
        assert_eq!(worker_of(&[0x40, 0, 0, 7], 4, 3), 3);
        assert_eq!(worker_of(&[0xc0, 0, 0, 0, 1, 2, 9, 6], 4, 3), 2);
        assert_eq!(worker_of(&[0xc0, 0, 0, 0, 1, 0], 4, 3), 0);
        assert_eq!(worker_of(&[], 4, 3), 0);
        assert_eq!(worker_of(&[0x40, 0, 0, 7], 1, 3), 0);
    }
}
