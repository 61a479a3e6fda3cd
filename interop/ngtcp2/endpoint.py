#!/usr/bin/env python3
"""ngtcp2 as an interop endpoint (MISSION.md section 7), around the example programs Debian
ships: gtlsclient (package ngtcp2-client) and gtlsserver (ngtcp2-server), ngtcp2 + nghttp3 +
GnuTLS.

Configured by environment variables: ROLE=client|server|prepare, TESTCASE, ALPN, LISTEN, WWW,
CERTS (cert.pem, priv.key) for the server; SERVER, REQUESTS, DOWNLOADS for the client;
SSLKEYLOGFILE (read by GnuTLS itself) and QLOGDIR for both. NGTCP2_VERBOSE=1 keeps the
programs' packet-level debug output in the logs.

What the Debian programs can do decides the cases (exit 127 for the others):
  - they speak HTTP/3 only: the HTTP/0.9 client and server of ngtcp2 (h09client, h09server)
    are not packaged, so ALPN hq-interop is unsupported;
  - ngtcp2 0.12 knows QUIC v1 and the v2 *draft* (0x709a50c4), not RFC 9369 v2 (0x6b3343cf):
    the v2 case is unsupported;
  - resumption and zerortt run the client twice, the second time with the session and the
    transport parameters the first run saved (--session-file, --tp-file); the requests of a
    resumed run go out in 0-RTT unless --disable-early-data (resumption);
  - keyupdate: the client updates its keys right after the handshake (--key-update);
  - chacha20: GnuTLS priority strings restrict both sides to CHACHA20-POLY1305 (--ciphers);
  - retry: the server validates addresses with Retry (-V);
  - multiconnect (handshakeloss, handshakecorruption): one client run per URL;
  - versionnegotiation: the client starts in the reserved version 0x1a2a3a4a (--version); on the
    server's Version Negotiation packet it starts again in v1 and fetches the URL; the wire
    check judges the case (the Version Negotiation packet), not the responses;
  - connectionmigration (the server's test name; the client's is transfer): the server offers
    127.0.0.2 (same port) as its preferred address (--preferred-ipv4-addr); the client moves
    to a server's preferred address by default;
  - the server sends one datagram per sendmsg (--max-gso-dgrams=1); the client does not use
    GSO.
gtlsclient exits 0 whatever happens to the requests, so this wrapper reads the response
status of every stream from its output and checks that every file arrived.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from urllib.parse import urlsplit

EXIT_UNSUPPORTED = 127
# The test names quic-interop-runner passes in TESTCASE (its testname() per side): several
# cases share "transfer", "handshake" or "multiconnect"; keyupdate is "keyupdate" for the
# client and "transfer" for the server, connectionmigration "connectionmigration" for the
# server and "transfer" for the client.
COMMON_CASES = {
    "versionnegotiation", "handshake", "transfer", "chacha20", "retry", "resumption",
    "zerortt", "http3", "multiconnect", "ecn",
}
SERVER_CASES = COMMON_CASES | {"connectionmigration"}
CLIENT_CASES = COMMON_CASES | {"keyupdate"}
UNSUPPORTED_WHY = {
    "v2": "ngtcp2 0.12 (Debian) implements only the QUIC v2 draft 0x709a50c4, not RFC 9369 v2",
}
CHACHA = "NORMAL:-VERS-ALL:+VERS-TLS1.3:-CIPHER-ALL:+CHACHA20-POLY1305"
# gtlsclient's chatter that is of no use in a log: per-packet lines and timers.
NOISE = re.compile(r"^(I\d{8} |Sent packet|Received packet|Set timer|Timer has already expired)")
STATUS = re.compile(r"^http: stream (0x[0-9a-f]+) \[:status: (\d+)\]")


def say(msg: str) -> None:
    print(f"ngtcp2-endpoint: {msg}", file=sys.stderr, flush=True)


def env(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v else default


def split_hostport(s: str) -> tuple[str, str]:
    host, _, port = s.rpartition(":")
    return host.strip("[]"), port


def verbose() -> bool:
    return env("NGTCP2_VERBOSE") == "1"


def server(case: str) -> int:
    host, port = split_hostport(env("LISTEN", "[::]:443"))
    certs = env("CERTS", "/certs")
    args = ["gtlsserver", "--max-gso-dgrams=1", "-d", env("WWW", "/www")]
    if not verbose():
        args.append("-q")
    if case == "chacha20":
        args.append("--ciphers=" + CHACHA)
    if case == "retry":
        args.append("-V")
    if case == "connectionmigration":
        # The listening port on another loopback IP (the capture filters on the port);
        # gtlsserver listens there too. The client moves there by itself.
        last = "3" if host == "127.0.0.2" else "2"
        args.append(f"--preferred-ipv4-addr=127.0.0.{last}:{port}")
    if env("QLOGDIR"):
        os.makedirs(env("QLOGDIR"), exist_ok=True)
        args.append("--qlog-dir=" + env("QLOGDIR"))
    args += [host if host not in ("", "::", "0.0.0.0") else "*", port,
             os.path.join(certs, "priv.key"), os.path.join(certs, "cert.pem")]
    say("running " + " ".join(args))
    proc = subprocess.Popen(args)

    def stop(signum, _frame):
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = proc.wait()
    # gtlsserver runs until killed; being stopped by the runner is not a failure.
    return 0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else 1


def run_client(case: str, server_addr: str, urls: list[str], downloads: str, extra: list[str],
               timeout: float) -> bool:
    """One gtlsclient run (one connection) fetching urls; True when every response was 200
    and every file arrived."""
    host, port = split_hostport(server_addr)
    sni = urlsplit(urls[0]).hostname or "localhost"
    args = ["gtlsclient", "--exit-on-all-streams-close", "--download", downloads, "--sni", sni]
    if verbose():
        args += ["--no-http-dump"]
    else:
        args += ["--no-quic-dump", "--no-http-dump"]
    if case == "chacha20":
        args.append("--ciphers=" + CHACHA)
    if env("QLOGDIR"):
        os.makedirs(env("QLOGDIR"), exist_ok=True)
        args.append("--qlog-dir=" + env("QLOGDIR"))
    args += extra + [host, port] + urls
    say("running " + " ".join(args[:12]) + (" ..." if len(args) > 12 else ""))
    statuses: dict[str, str] = {}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            m = STATUS.match(line)
            if m:
                statuses[m.group(1)] = m.group(2)
            if verbose() or not NOISE.match(line):
                sys.stderr.write(line)
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        say("gtlsclient timed out")
        return False
    ok = True
    bad = {s: st for s, st in statuses.items() if st != "200"}
    if rc != 0:
        say(f"gtlsclient exited {rc}")
        ok = False
    if bad:
        say(f"responses other than 200: {bad}")
        ok = False
    if len(statuses) < len(urls):
        say(f"{len(statuses)} responses for {len(urls)} requests")
        ok = False
    for u in urls:
        name = os.path.basename(urlsplit(u).path) or "index.html"
        if not os.path.exists(os.path.join(downloads, name)):
            say(f"{name} was not saved")
            ok = False
    return ok


def client(case: str) -> int:
    urls = (env("REQUESTS") or "").split()
    if not urls:
        say("REQUESTS is empty")
        return 1
    downloads = env("DOWNLOADS", "/downloads")
    server_addr = env("SERVER") or urlsplit(urls[0]).netloc
    timeout = 170.0
    extra: list[str] = []
    if case == "keyupdate":
        # Update as soon as possible once the handshake is done (ngtcp2 waits for it to be
        # confirmed); the download is long enough to carry packets in the new phase.
        extra.append("--key-update=1ms")
    if case == "versionnegotiation":
        # Whatever becomes of the request after the Version Negotiation packet, the run is
        # judged on the wire.
        run_client(case, server_addr, urls, downloads,
                   ["--version=0x1a2a3a4a", "--preferred-versions=0x1"], timeout)
        return 0
    if case == "multiconnect":
        # One connection per URL, one after another. The default initial RTT (333 ms) would
        # make 50 handshakes through 30 % loss take minutes; 100 ms as the other peers use.
        for u in urls:
            if not run_client(case, server_addr, [u], downloads,
                              ["--initial-rtt=100ms", "--handshake-timeout=30s"], timeout):
                return 1
        return 0
    if case in ("resumption", "zerortt"):
        state = tempfile.mkdtemp(prefix="ngtcp2-client-")
        try:
            files = ["--session-file=" + os.path.join(state, "session"),
                     "--tp-file=" + os.path.join(state, "tp")]
            if not run_client(case, server_addr, urls[:1], downloads, files, timeout):
                return 1
            if not os.path.exists(os.path.join(state, "session")):
                say("the first connection saved no session ticket")
                return 1
            second = files + ([] if case == "zerortt" else ["--disable-early-data"])
            return 0 if run_client(case, server_addr, urls[1:], downloads, second, timeout) else 1
        finally:
            shutil.rmtree(state, ignore_errors=True)
    return 0 if run_client(case, server_addr, urls, downloads, extra, timeout) else 1


def main() -> int:
    role = env("ROLE", "")
    case = env("TESTCASE", "")
    alpn = env("ALPN", "h3")
    if role == "prepare":
        return 0 if shutil.which("gtlsclient") and shutil.which("gtlsserver") else 1
    if alpn != "h3":
        say(f"ALPN {alpn} not supported: Debian ships ngtcp2's HTTP/3 programs only")
        return EXIT_UNSUPPORTED
    if case not in (SERVER_CASES if role == "server" else CLIENT_CASES):
        say(f"test case {case!r} not supported: {UNSUPPORTED_WHY.get(case, 'unknown case')}")
        return EXIT_UNSUPPORTED
    if role == "server":
        return server(case)
    if role == "client":
        return client(case)
    say("ROLE must be client, server or prepare")
    return 1


if __name__ == "__main__":
    sys.exit(main())
