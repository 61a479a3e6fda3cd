#!/usr/bin/env python3
"""aioquic as an interop endpoint (MISSION.md section 7).

Configured by environment variables: ROLE=client|server|prepare, TESTCASE, ALPN (h3, the
default, or hq-interop), LISTEN, WWW, CERTS (cert.pem, priv.key) for the server; SERVER,
REQUESTS, DOWNLOADS for the client; SSLKEYLOGFILE and QLOGDIR for both. With h3 the endpoint
speaks HTTP/3 through aioquic's H3Connection (GET requests, the server answers 200 with the
file or 404); with hq-interop HTTP/0.9 over QUIC: one bidirectional stream per request,
"GET /path\\r\\n", the server answers with the file.

Exit codes: 0 success, 1 failure, 127 test case not supported.
aioquic sends one QUIC datagram per sendto() call, so there is no GSO batching to disable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import sys
import time
from urllib.parse import urlsplit

from aioquic.asyncio import QuicConnectionProtocol, connect, serve
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StreamDataReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicProtocolVersion
from aioquic.tls import CipherSuite, SessionTicket

ALPN_HQ = "hq-interop"
ALPN_H3 = "h3"
ALPN = ALPN_H3  # this run's ALPN, set by main() from the ALPN variable
EXIT_UNSUPPORTED = 127
H3_NO_ERROR = 0x100

# The test names quic-interop-runner passes in TESTCASE (its testname() per side): several
# cases share "transfer", "handshake" or "multiconnect"; keyupdate is "keyupdate" for the
# client and "transfer" for the server; connectionmigration is "connectionmigration" for the
# server (which must offer a preferred address: aioquic's server cannot) and "transfer" for the
# client (aioquic's client moves to a preferred address by itself).
# aioquic neither marks outgoing packets with ECN nor reads ECN marks: "ecn" is unsupported.
COMMON_CASES = {
    "versionnegotiation", "handshake", "transfer", "chacha20", "retry", "resumption",
    "zerortt", "http3", "multiconnect", "v2",
}
SERVER_CASES = COMMON_CASES
CLIENT_CASES = COMMON_CASES | {"keyupdate"}
# versionnegotiation: the client's first Initial is in this reserved version (RFC 9000 15,
# 0x?a?a?a?a); the server answers with Version Negotiation and aioquic starts again in v1.
RESERVED_VERSION = 0x1A2A3A4A

log = logging.getLogger("aioquic-endpoint")


def env(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v else default


def base_configuration(case: str, is_client: bool) -> QuicConfiguration:
    conf = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        idle_timeout=30.0,
        max_data=16 * 1024 * 1024,
        max_stream_data=4 * 1024 * 1024,
    )
    keylog = env("SSLKEYLOGFILE")
    if keylog:
        conf.secrets_log_file = open(keylog, "a", buffering=1)
    qlogdir = env("QLOGDIR")
    if qlogdir:
        from aioquic.quic.logger import QuicFileLogger

        os.makedirs(qlogdir, exist_ok=True)
        conf.quic_logger = QuicFileLogger(qlogdir)
    if case == "chacha20":
        conf.cipher_suites = [CipherSuite.CHACHA20_POLY1305_SHA256]
    if case == "v2":
        v1, v2 = QuicProtocolVersion.VERSION_1, QuicProtocolVersion.VERSION_2
        if is_client:
            # Start in v1, announce v2 (preferred) for compatible version negotiation.
            conf.original_version = v1
            conf.supported_versions = [v2, v1]
        else:
            # aioquic's server follows the client's preference order among compatible
            # versions; offering v2 first here and v1 as well.
            conf.supported_versions = [v2, v1]
    else:
        conf.supported_versions = [QuicProtocolVersion.VERSION_1]
    if case == "versionnegotiation" and is_client:
        # aioquic derives Initial keys for each version it lists: list the reserved one last,
        # so that v1 is the one chosen from the server's Version Negotiation packet.
        conf.original_version = RESERVED_VERSION
        conf.supported_versions = [QuicProtocolVersion.VERSION_1, RESERVED_VERSION]
    return conf


def describe(quic) -> str:
    """Negotiated version, cipher suite and resumption state of a connection (for the logs)."""
    tls = quic.tls
    suite = getattr(tls, "key_schedule", None)
    suite = getattr(suite, "cipher_suite", None)
    return "version 0x%08x, cipher %s, resumed %s, 0-RTT accepted %s" % (
        quic._version,
        getattr(suite, "name", suite),
        getattr(tls, "session_resumed", None),
        getattr(tls, "early_data_accepted", None),
    )


# ---------------------------------------------------------------------------------------------
# Server


class ServerProtocol(QuicConnectionProtocol):
    www = "/www"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._requests: dict[int, bytearray] = {}
        self._h3: H3Connection | None = None
        if ALPN == ALPN_H3:
            self._h3 = H3Connection(self._quic)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            log.info("handshake completed: %s", describe(self._quic))
        elif self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event(h3_event)
            if isinstance(event, ConnectionTerminated):
                log.info(
                    "connection terminated: error 0x%x %s", event.error_code, event.reason_phrase
                )
            self.transmit()
        elif isinstance(event, StreamDataReceived):
            buf = self._requests.setdefault(event.stream_id, bytearray())
            buf += event.data
            if len(buf) > 8192:
                self._quic.reset_stream(event.stream_id, 1)
                self._requests.pop(event.stream_id, None)
            elif event.end_stream:
                self._answer(event.stream_id, bytes(self._requests.pop(event.stream_id)))
            self.transmit()
        elif isinstance(event, StreamReset):
            self._requests.pop(event.stream_id, None)
        elif isinstance(event, ConnectionTerminated):
            log.info(
                "connection terminated: error 0x%x %s", event.error_code, event.reason_phrase
            )

    def _h3_event(self, event: H3Event) -> None:
        if not isinstance(event, HeadersReceived):
            return  # request bodies (DataReceived) are ignored: only GET and HEAD are served
        headers = dict(event.headers)
        method = headers.get(b":method", b"").decode("latin-1")
        path = headers.get(b":path", b"/").decode("latin-1")
        log.info("h3 %s %s on stream %d", method, path, event.stream_id)
        if method not in ("GET", "HEAD"):
            self._h3_respond(event.stream_id, 405, b"method not allowed\n")
            return
        clean = posixpath.normpath("/" + urlsplit(path).path).lstrip("/")
        try:
            with open(os.path.join(self.www, clean), "rb") as f:
                data = f.read()
        except OSError as e:
            log.warning("stream %d: %s: %s", event.stream_id, path, e)
            self._h3_respond(event.stream_id, 404, b"not found\n")
            return
        self._h3_respond(event.stream_id, 200, b"" if method == "HEAD" else data, len(data))

    def _h3_respond(self, stream_id: int, status: int, body: bytes, length: int | None = None):
        assert self._h3 is not None
        headers = [
            (b":status", str(status).encode()),
            (b"server", b"aioquic-interop"),
            (b"content-length", str(len(body) if length is None else length).encode()),
        ]
        self._h3.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self._h3.send_data(stream_id, body, end_stream=True)

    def _answer(self, stream_id: int, request: bytes) -> None:
        line = request.decode("latin-1").strip()
        if not line.startswith("GET "):
            log.warning("stream %d: bad request %r", stream_id, line)
            self._quic.reset_stream(stream_id, 1)
            return
        target = line[4:].strip()
        path = urlsplit(target).path or "/"
        clean = posixpath.normpath("/" + path).lstrip("/")
        file = os.path.join(self.www, clean)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as e:
            log.warning("stream %d: %s: %s", stream_id, path, e)
            self._quic.reset_stream(stream_id, 2)
            return
        self._quic.send_stream_data(stream_id, data, end_stream=True)


async def run_server(case: str) -> int:
    listen = env("LISTEN", "[::]:443")
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "::"
    certs = env("CERTS", "/certs")
    ServerProtocol.www = env("WWW", "/www")
    conf = base_configuration(case, is_client=False)
    conf.load_cert_chain(os.path.join(certs, "cert.pem"), os.path.join(certs, "priv.key"))

    tickets: dict[bytes, SessionTicket] = {}
    await serve(
        host,
        int(port),
        configuration=conf,
        create_protocol=ServerProtocol,
        session_ticket_fetcher=tickets.pop,
        session_ticket_handler=lambda t: tickets.__setitem__(t.ticket, t),
        retry=(case == "retry"),
    )
    log.info("server listening on %s, test case %s, serving %s", listen, case, ServerProtocol.www)
    await asyncio.Future()  # until killed
    return 0


# ---------------------------------------------------------------------------------------------
# Client


class ClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._downloads: dict[int, tuple[object, asyncio.Future]] = {}
        self.key_update_on_handshake = False
        self._h3: H3Connection | None = None
        if ALPN == ALPN_H3:
            self._h3 = H3Connection(self._quic)

    def get(self, url: str, out_path: str) -> asyncio.Future:
        parts = urlsplit(url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        stream_id = self._quic.get_next_available_stream_id()
        fut = self._loop.create_future()
        self._downloads[stream_id] = (open(out_path, "wb"), fut)
        if self._h3 is not None:
            self._h3.send_headers(
                stream_id,
                [
                    (b":method", b"GET"),
                    (b":scheme", b"https"),
                    (b":authority", parts.netloc.encode()),
                    (b":path", path.encode()),
                    (b"user-agent", b"aioquic-interop"),
                ],
                end_stream=True,
            )
        else:
            self._quic.send_stream_data(stream_id, b"GET " + path.encode() + b"\r\n", end_stream=True)
        self.transmit()
        return fut

    def _h3_event(self, event: H3Event) -> None:
        entry = self._downloads.get(event.stream_id)
        if entry is None:
            return
        f, fut = entry
        if isinstance(event, HeadersReceived):
            status = dict(event.headers).get(b":status", b"")
            if status != b"200" and not status.startswith(b"1"):
                f.close()
                del self._downloads[event.stream_id]
                if not fut.done():
                    fut.set_exception(RuntimeError("stream %d: status %s" % (event.stream_id, status.decode())))
                return
        elif isinstance(event, DataReceived):
            f.write(event.data)
        else:
            return
        if event.stream_ended:
            f.close()
            del self._downloads[event.stream_id]
            if not fut.done():
                fut.set_result(None)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            log.info("handshake completed: %s", describe(self._quic))
            if self.key_update_on_handshake:
                # aioquic defers the update until the handshake is confirmed.
                self._quic.request_key_update()
        if isinstance(event, StreamDataReceived):
            if self._h3 is not None:
                for h3_event in self._h3.handle_event(event):
                    self._h3_event(h3_event)
                return
            entry = self._downloads.get(event.stream_id)
            if entry is None:
                return
            f, fut = entry
            f.write(event.data)
            if event.end_stream:
                f.close()
                del self._downloads[event.stream_id]
                if not fut.done():
                    fut.set_result(None)
        elif isinstance(event, StreamReset):
            entry = self._downloads.pop(event.stream_id, None)
            if entry:
                entry[0].close()
                if not entry[1].done():
                    entry[1].set_exception(
                        RuntimeError("stream %d reset by the server (error %d)"
                                     % (event.stream_id, event.error_code))
                    )
        elif isinstance(event, ConnectionTerminated):
            for f, fut in self._downloads.values():
                f.close()
                if not fut.done():
                    fut.set_exception(
                        RuntimeError("connection closed: error 0x%x %s"
                                     % (event.error_code, event.reason_phrase))
                    )
            self._downloads.clear()


async def session(case, host, port, server_name, urls, downloads, ticket_box, early, key_update):
    """One connection that downloads `urls` in parallel; returns when all are saved."""
    conf = base_configuration(case, is_client=True)
    conf.server_name = server_name
    conf.verify_mode = 0  # ssl.CERT_NONE: interop servers use throwaway certificates
    if ticket_box.get("ticket") is not None:
        conf.session_ticket = ticket_box["ticket"]

    def on_ticket(t: SessionTicket) -> None:
        ticket_box["ticket"] = t

    async with connect(
        host,
        port,
        configuration=conf,
        create_protocol=ClientProtocol,
        session_ticket_handler=on_ticket,
        wait_connected=not early,
    ) as proto:
        if key_update:
            proto.key_update_on_handshake = True
            if proto._connected:
                proto.request_key_update()
        futs = []
        for u in urls:
            name = posixpath.basename(urlsplit(u).path) or "index.html"
            futs.append(proto.get(u, os.path.join(downloads, name)))
        await asyncio.gather(*futs)
        log.info("downloads done: %s", describe(proto._quic))
        if early and not getattr(proto._quic.tls, "early_data_accepted", False):
            log.warning("0-RTT was not accepted")
        if ticket_box.get("ticket") is None and not early:
            # Give a session ticket sent right after the handshake time to arrive.
            await asyncio.sleep(0.1)
        proto.close(error_code=H3_NO_ERROR if ALPN == ALPN_H3 else 0)
        await proto.wait_closed()


async def run_client(case: str) -> int:
    urls = (env("REQUESTS") or "").split()
    if not urls:
        log.error("REQUESTS is empty")
        return 1
    downloads = env("DOWNLOADS", "/downloads")
    first = urlsplit(urls[0])
    server = env("SERVER") or first.netloc
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    port = int(port)
    server_name = first.hostname
    box: dict = {}

    async def work():
        if case == "multiconnect":
            for u in urls:
                await session(case, host, port, server_name, [u], downloads, {}, False, False)
        elif case in ("resumption", "zerortt"):
            await session(case, host, port, server_name, urls[:1], downloads, box, False, False)
            if box.get("ticket") is None:
                raise RuntimeError("no session ticket received on the first connection")
            await session(
                case, host, port, server_name, urls[1:], downloads, box, case == "zerortt", False
            )
        else:
            await session(
                case, host, port, server_name, urls, downloads, box, False, case == "keyupdate"
            )

    await asyncio.wait_for(work(), timeout=170)
    return 0


def main() -> int:
    logging.basicConfig(
        level=logging.INFO if not env("VERBOSE") else logging.DEBUG,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    role = env("ROLE", "")
    case = env("TESTCASE", "")
    alpn = env("ALPN", ALPN_H3)
    if role == "prepare":
        return 0
    if alpn not in (ALPN_H3, ALPN_HQ):
        log.error("ALPN %s not supported (only %s and %s)", alpn, ALPN_H3, ALPN_HQ)
        return EXIT_UNSUPPORTED
    if case == "http3" and alpn != ALPN_H3:
        log.error("test case http3 needs ALPN h3, not %s", alpn)
        return EXIT_UNSUPPORTED
    global ALPN
    ALPN = alpn
    if role == "server":
        if case not in SERVER_CASES:
            why = {"connectionmigration": ": aioquic's server cannot offer a preferred address",
                   "ecn": ": aioquic does not use ECN"}.get(case, "")
            log.error("test case %r not supported as server%s", case, why)
            return EXIT_UNSUPPORTED
        runner = run_server
    elif role == "client":
        if case not in CLIENT_CASES:
            why = {"ecn": ": aioquic does not use ECN"}.get(case, "")
            log.error("test case %r not supported as client%s", case, why)
            return EXIT_UNSUPPORTED
        runner = run_client
    else:
        log.error("ROLE must be client, server or prepare")
        return 1
    start = time.monotonic()
    try:
        return asyncio.run(runner(case))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - any failure is exit 1
        log.error("%s %s failed after %.1fs: %r", role, case, time.monotonic() - start, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
