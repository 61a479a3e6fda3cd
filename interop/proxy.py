#!/usr/bin/env python3
"""A UDP relay between the interop client and server that impairs the path, for the cases
that need it (longrtt, handshakeloss, transferloss, handshakecorruption, transfercorruption,
blackhole, rebind-port, rebind-addr) and for amplificationlimit, after quic-interop-runner's
network scenarios for them (this kernel has no netem, so it is done in userspace).

    proxy.py --listen 127.0.0.1:PORT --server 127.0.0.1:PORT --mode MODE [--seed N]

The client sends to --listen; like a NAT, the relay gives every client address (ip:port) its
own upstream socket, sends the client's datagrams to --server from it and relays what comes
back to that client. Modes:
  none          relay only
  longrtt       delay every datagram by 750 ms in each direction (a 1.5 s round trip, longer
                than any initial probe timeout: the client has to send its ClientHello again)
  handshakeloss drop 30 % of the datagrams in each direction
  transferloss  drop 2 % of the datagrams in each direction
  handshakecorruption
                corrupt 30 % of the datagrams in each direction: one byte at a random offset
                is XORed with a random non-zero value
  transfercorruption
                corrupt 2 % of the datagrams in each direction
  blackhole     after 1 MB has gone to the client, drop everything both ways for 2 s, then
                relay again (transfers on loopback are too fast for time-based phases)
  rebind-port   NAT rebinding: after every 300 datagrams from the server, the client's next
                datagram leaves from a new source port and the old mapping is gone (the server's
                packets to it are lost), as when a NAT expires a mapping and makes a new one
  rebind-addr   the same, moving to a new source address in 127.0.0.0/8 (and a new port)
  amplificationlimit
                let the client's first datagram through and drop its 2nd to 7th (the runner's
                "droplist --drops_to_server=2,3,4,5,6,7"): the server has only the first one,
                the ClientHello, to count on, so it must stop at three times its size
  lose-client-finished
                drop the first client datagram that carries a Handshake packet (the client's
                Finished), for reproducing handshake-completion bugs; not a matrix case
Events are logged on stderr; the relay runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import socket
import sys
import time

LOSS = {"handshakeloss": 0.30, "transferloss": 0.02}
CORRUPT = {"handshakecorruption": 0.30, "transfercorruption": 0.02}
DELAY = {"longrtt": 0.75}  # seconds each way
DROP_FROM_CLIENT = {"amplificationlimit": range(2, 8)}  # 1-based client datagram numbers
BLACKHOLE_AFTER = 1_000_000  # bytes towards the client before the black hole
BLACKHOLE_FOR = 2.0  # seconds
REBIND_EVERY = 300  # server datagrams between rebinds
MAX_DATAGRAM = 65535


def addr(s: str) -> tuple[str, int]:
    h, _, p = s.rpartition(":")
    return h.strip("[]"), int(p)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} proxy: {msg}", file=sys.stderr, flush=True)


def varint(b: bytes, i: int) -> tuple[int, int]:
    n = 1 << (b[i] >> 6)
    v = b[i] & 0x3F
    for k in range(1, n):
        v = (v << 8) | b[i + k]
    return v, i + n


def long_header_types(d: bytes) -> list[str]:
    """The types of the long header packets coalesced at the start of a datagram."""
    out = []
    i = 0
    try:
        while i < len(d) and d[i] & 0x80:
            version = int.from_bytes(d[i + 1:i + 5], "big")
            if version == 0:
                out.append("vn")
                break
            t = (d[i] >> 4) & 3
            if version == 0x6B3343CF:
                kind = {1: "initial", 2: "0rtt", 3: "handshake", 0: "retry"}[t]
            else:
                kind = {0: "initial", 1: "0rtt", 2: "handshake", 3: "retry"}[t]
            out.append(kind)
            if kind == "retry":
                break
            j = i + 5
            j += 1 + d[j]  # DCID
            j += 1 + d[j]  # SCID
            if kind == "initial":
                tl, j = varint(d, j)
                j += tl
            length, j = varint(d, j)
            i = j + length
    except (IndexError, KeyError):
        pass
    return out


class Relay:
    def __init__(self, loop, listen, server, mode, rng):
        self.loop, self.server, self.mode, self.rng = loop, server, mode, rng
        self.loss = LOSS.get(mode, 0.0)
        self.corrupt = CORRUPT.get(mode, 0.0)
        self.delay = DELAY.get(mode, 0.0)
        self.drop_from_client = DROP_FROM_CLIENT.get(mode, ())
        self.from_client_count = 0
        self.front = self.open_socket(listen, self.on_front)
        self.up: dict[tuple, socket.socket] = {}  # client address -> upstream socket
        self.down: dict[int, tuple] = {}  # upstream socket fd -> client address
        self.next_host = 1  # 127.0.0.<n> of the next upstream socket (rebind-addr moves it)
        self.to_client_bytes = 0
        self.from_server = 0
        self.black_until: float | None = None
        self.black_done = False
        self.rebind_pending = False
        self.last_client: tuple | None = None
        self.finished_lost = False
        self.stats = {"c2s": 0, "s2c": 0, "dropped": 0, "corrupted": 0, "mappings": 0}
        log(f"relaying {listen[0]}:{listen[1]} -> {server[0]}:{server[1]}, mode {mode}")

    def open_socket(self, local, handler) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.bind(local)
        s.setblocking(False)
        self.loop.add_reader(s.fileno(), handler, s)
        return s

    def close_socket(self, s: socket.socket) -> None:
        self.loop.remove_reader(s.fileno())
        self.down.pop(s.fileno(), None)
        s.close()

    def new_upstream(self, client: tuple) -> socket.socket:
        s = self.open_socket((f"127.0.0.{self.next_host}", 0), self.on_upstream)
        self.up[client] = s
        self.down[s.fileno()] = client
        self.stats["mappings"] += 1
        name = s.getsockname()
        log(f"client {client[0]}:{client[1]} now leaves from {name[0]}:{name[1]}")
        return s

    # --- impairments ---------------------------------------------------------------------

    def blackholed(self) -> bool:
        if self.black_until is None:
            return False
        if time.monotonic() < self.black_until:
            return True
        log("black hole over")
        self.black_until = None
        self.black_done = True
        return False

    def drop(self) -> bool:
        if self.blackholed() or (self.loss and self.rng.random() < self.loss):
            self.stats["dropped"] += 1
            return True
        return False

    def mangle(self, data: bytes) -> bytes:
        """Corrupts one byte of some datagrams (the corruption modes)."""
        if not self.corrupt or not data or self.rng.random() >= self.corrupt:
            return data
        b = bytearray(data)
        b[self.rng.randrange(len(b))] ^= self.rng.randrange(1, 256)
        self.stats["corrupted"] += 1
        return bytes(b)

    def later(self, fn, *args) -> None:
        """Runs fn now, or after the mode's one-way delay."""
        if self.delay:
            self.loop.call_later(self.delay, fn, *args)
        else:
            fn(*args)

    # --- client -> server ----------------------------------------------------------------

    def on_front(self, sock: socket.socket) -> None:
        while True:
            try:
                data, src = sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            self.from_client(data, src)

    def from_client(self, data: bytes, src: tuple) -> None:
        self.last_client = src
        self.from_client_count += 1
        if self.from_client_count in self.drop_from_client:
            self.stats["dropped"] += 1
            log(f"dropped client datagram {self.from_client_count} ({len(data)} bytes)")
            return
        if self.drop():
            return
        if (self.mode == "lose-client-finished" and not self.finished_lost
                and "handshake" in long_header_types(data)):
            self.finished_lost = True
            self.stats["dropped"] += 1
            log(f"dropped the client's first Handshake datagram ({len(data)} bytes)")
            return
        up = self.up.get(src)
        if up is not None and self.rebind_pending:
            # NAT rebinding: the old mapping is gone, this datagram makes a new one.
            self.rebind_pending = False
            self.close_socket(up)
            if self.mode == "rebind-addr":
                self.next_host = 2 if self.next_host >= 250 else self.next_host + 1
            up = None
        if up is None:
            up = self.new_upstream(src)
        self.stats["c2s"] += 1
        self.later(self.send, up, self.mangle(data), self.server)

    @staticmethod
    def send(sock: socket.socket, data: bytes, to: tuple) -> None:
        try:
            sock.sendto(data, to)
        except OSError:
            pass  # a closed mapping (rebinding) or a full buffer: the datagram is lost

    # --- server -> client ----------------------------------------------------------------

    def on_upstream(self, sock: socket.socket) -> None:
        client = self.down.get(sock.fileno())
        while True:
            try:
                data, _ = sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            if client is not None:
                self.to_client(data, client)

    def to_client(self, data: bytes, client: tuple) -> None:
        if self.drop():
            return
        self.stats["s2c"] += 1
        self.later(self.send, self.front, self.mangle(data), client)
        self.to_client_bytes += len(data)
        self.from_server += 1
        if (self.mode == "blackhole" and not self.black_done and self.black_until is None
                and self.to_client_bytes >= BLACKHOLE_AFTER):
            log(f"black hole for {BLACKHOLE_FOR}s after {self.to_client_bytes} bytes")
            self.black_until = time.monotonic() + BLACKHOLE_FOR
        if (self.mode in ("rebind-port", "rebind-addr")
                and self.from_server % REBIND_EVERY == 0):
            self.rebind_pending = True


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--mode", default="none")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    loop = asyncio.get_running_loop()
    relay = Relay(loop, addr(a.listen), addr(a.server), a.mode, random.Random(a.seed))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log(f"stats {relay.stats}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
