#!/usr/bin/env python3
"""Chromium as an interop client (MISSION.md section 7): a real browser fetching over HTTP/3.

    ROLE=client TESTCASE=... SERVER=127.0.0.1:PORT REQUESTS="https://localhost:PORT/a ..." \\
    DOWNLOADS=dir CERT_SPKI_SHA256=<base64> [SSLKEYLOGFILE=file] [QLOGDIR=dir] endpoint.py

Starts headless Chromium with QUIC forced on the origin of the requests
(--origin-to-force-quic-on), the name of the URLs mapped to SERVER (--host-resolver-rules, so
the impairment proxy can sit in between), and the server's throwaway certificate accepted by
its public key pin (--ignore-certificate-errors-spki-list=$CERT_SPKI_SHA256), then drives it
through the DevTools protocol:

  1. a tab is opened on the origin; the page itself is answered by DevTools (Fetch domain), so
     the server only sees the test's requests;
  2. the page fetch()es every URL at once (one HTTP/3 connection, concurrent streams), keeps
     each body, and the wrapper reads them back base64-encoded and saves the exact bytes;
  3. every response must come from the server (status 200) over HTTP/3: the Resource Timing
     entry of every URL must say nextHopProtocol "h3", or the run fails.

Server role, ALPN hq-interop and the cases a browser cannot be made to do exit 127:
Chromium picks its own cipher suites (chacha20), never updates keys on request (keyupdate),
cannot be told to close a connection and resume on a new one (resumption, zerortt), speaks QUIC
v1 only by default (v2), and reports the ECN marks it receives but does not mark its own packets
(ecn).
TESTCASE carries quic-interop-runner's test name for the client's side: "transfer" also for
multiplexing, the loss, corruption, black hole and rebinding cases, amplificationlimit, ipv6,
goodput and connectionmigration (Chromium moves to a server's preferred address by itself),
"handshake" also for longrtt, "multiconnect" for handshakeloss and handshakecorruption: one
connection per URL, made with a fresh browser context per URL (a context has its own network
stack, so its own connection). A browser cannot start a connection in a reserved QUIC version
(versionnegotiation).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

EXIT_UNSUPPORTED = 127
CASES = {"handshake", "transfer", "retry", "http3", "multiconnect"}
WHY = {
    "chacha20": "Chromium offers its own TLS 1.3 cipher suites; they cannot be restricted",
    "keyupdate": "Chromium cannot be made to initiate a key update",
    "resumption": "Chromium cannot be made to close a connection and open a resumed one",
    "zerortt": "Chromium cannot be made to close a connection and open a resumed one",
    "v2": "Chromium negotiates QUIC v1 only",
    "ecn": "Chromium reads ECN (it sends ACK_ECN) but never marks its own packets ECT",
    "versionnegotiation": "Chromium cannot be made to start in a QUIC version it does not speak",
}
PAGE = "/__kuai_interop_page"


def say(msg: str) -> None:
    print(f"chromium-endpoint: {msg}", file=sys.stderr, flush=True)


def debug(msg: str) -> None:
    if os.environ.get("CHROMIUM_DEBUG"):
        say(msg)


def env(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v else default


def chromium_binary() -> str | None:
    # The Debian launcher script only adds desktop defaults; run the browser itself.
    for c in ("/usr/lib/chromium/chromium", "chromium", "chromium-browser"):
        p = shutil.which(c) if not c.startswith("/") else (c if os.access(c, os.X_OK) else None)
        if p:
            return p
    return None


class DevTools:
    """A minimal DevTools protocol client over the browser's websocket (flattened sessions)."""

    def __init__(self, url: str):
        import websocket  # pip websocket-client

        self.ws = websocket.create_connection(url, timeout=180, max_size=None,
                                              suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self.next_id += 1
        msg: dict = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        return self.next_id

    def recv(self) -> dict:
        return json.loads(self.ws.recv())

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        i = self.send(method, params, session)
        while True:
            m = self.recv()
            if m.get("id") == i:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def wait_event(self, method: str, session: str | None, deadline: float) -> dict:
        while time.monotonic() < deadline:
            for k, m in enumerate(self.events):
                if m["method"] == method and (session is None or m.get("sessionId") == session):
                    return self.events.pop(k)
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            m = self.recv()
            if "method" in m:
                self.events.append(m)
        raise TimeoutError(f"no {method} event")

    def evaluate(self, session: str, expr: str):
        r = self.call("Runtime.evaluate", {"expression": expr, "awaitPromise": True,
                                           "returnByValue": True}, session)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise RuntimeError(d.get("exception", {}).get("description") or d.get("text"))
        return r["result"].get("value")


FETCH_ALL = """(async () => {
  performance.setResourceTimingBufferSize(100000);
  window.__bodies = {};
  const urls = %s;
  await Promise.all(urls.map(async (u) => {
    const r = await fetch(u, {cache: "no-store"});
    if (r.status !== 200) throw new Error(u + ": HTTP status " + r.status);
    window.__bodies[u] = await r.blob();
  }));
  return urls.length;
})()"""

READ_BODY = """(async () => {
  const b = window.__bodies[%s];
  const url = await new Promise((ok, fail) => {
    const fr = new FileReader();
    fr.onload = () => ok(fr.result);
    fr.onerror = () => fail(fr.error);
    fr.readAsDataURL(b);
  });
  delete window.__bodies[%s];
  return url.slice(url.indexOf(",") + 1);
})()"""

PROTOCOLS = """performance.getEntriesByType("resource").map(e => [e.name, e.nextHopProtocol])"""


def session(dt: DevTools, origin: str, urls: list[str], downloads: str, context: str | None,
            deadline: float) -> None:
    """Opens a tab on the origin (in browser context `context`), fetches urls in it, saves the
    bodies and checks that every response came over HTTP/3."""
    params = {"url": "about:blank"}
    if context:
        params["browserContextId"] = context
    target = dt.call("Target.createTarget", params)["targetId"]
    sid = dt.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        debug(f"tab {target} attached")
        dt.call("Page.enable", session=sid)
        dt.call("Fetch.enable", {"patterns": [{"urlPattern": origin + PAGE + "*",
                                               "requestStage": "Request"}]}, sid)
        dt.send("Page.navigate", {"url": origin + PAGE}, sid)
        paused = dt.wait_event("Fetch.requestPaused", sid, deadline)
        debug("page request intercepted")
        # An inline icon, or the browser would ask the server for /favicon.ico.
        html = b'<!doctype html><link rel="icon" href="data:,"><title>kuai interop</title>'
        dt.call("Fetch.fulfillRequest", {
            "requestId": paused["params"]["requestId"], "responseCode": 200,
            "responseHeaders": [{"name": "content-type", "value": "text/html"}],
            "body": base64.b64encode(html).decode()}, sid)
        dt.wait_event("Page.loadEventFired", sid, deadline)
        debug("page loaded; fetching " + " ".join(urls))
        dt.call("Fetch.disable", session=sid)

        t0 = time.monotonic()
        n = dt.evaluate(sid, FETCH_ALL % json.dumps(urls))
        say(f"fetched {n} URL(s) in {time.monotonic() - t0:.2f} s")
        protocols = dict(dt.evaluate(sid, PROTOCOLS) or [])
        not_h3 = {u: protocols.get(u) for u in urls if protocols.get(u) != "h3"}
        if not_h3:
            raise RuntimeError(f"not fetched over HTTP/3: {not_h3}")
        for u in urls:
            data = base64.b64decode(dt.evaluate(sid, READ_BODY % (json.dumps(u), json.dumps(u))))
            name = os.path.basename(urlsplit(u).path) or "index.html"
            with open(os.path.join(downloads, name), "wb") as f:
                f.write(data)
    finally:
        dt.call("Target.closeTarget", {"targetId": target})


def start_browser(binary: str, profile: str, origin_hostport: str, server: str, spki: str,
                  case: str, log) -> tuple[subprocess.Popen, str]:
    host, port = origin_hostport.rsplit(":", 1)
    args = [
        binary,
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-default-apps", "--disable-extensions", "--no-default-browser-check",
        "--user-data-dir=" + profile,
        "--remote-debugging-port=0", "--remote-allow-origins=*",
        "--enable-quic", "--origin-to-force-quic-on=" + origin_hostport,
        # The URL's name and port go to SERVER (the server, or the proxy in front of it).
        f"--host-resolver-rules=MAP {host}:{port} {server}, EXCLUDE 127.0.0.1",
        "--ignore-certificate-errors-spki-list=" + spki,
    ]
    if case == "multiconnect":
        # Chromium gives up a handshake after 4 s without progress ("No recent network
        # activity"), which 30 % loss each way reaches within 50 handshakes. Its QUIC field
        # trial parameters lengthen that, as the other clients' handshake timeouts are.
        args += ["--force-fieldtrials=QUIC/Enabled",
                 "--force-fieldtrial-params=QUIC.Enabled:"
                 "max_idle_time_before_crypto_handshake_seconds/30/"
                 "max_time_before_crypto_handshake_seconds/60"]
    if env("SSLKEYLOGFILE"):
        args.append("--ssl-key-log-file=" + env("SSLKEYLOGFILE"))
    if env("QLOGDIR"):
        # Chromium has no qlog; its NetLog holds the QUIC events.
        os.makedirs(env("QLOGDIR"), exist_ok=True)
        args += ["--log-net-log=" + os.path.join(env("QLOGDIR"), "chromium-netlog.json"),
                 "--net-log-capture-mode=Everything"]
    args.append("about:blank")
    say("starting " + " ".join(args))
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    # Chromium writes the DevTools port and browser path into the profile once it listens.
    active = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited {proc.returncode} at start")
        try:
            with open(active) as f:
                lines = f.read().split()
            if len(lines) >= 2:
                return proc, f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError("chromium did not open its DevTools port")


def stop_browser(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def client(case: str) -> int:
    urls = (env("REQUESTS") or "").split()
    if not urls:
        say("REQUESTS is empty")
        return 1
    spki = env("CERT_SPKI_SHA256")
    if not spki:
        say("CERT_SPKI_SHA256 is needed: Chromium accepts the test certificate by its pin")
        return 1
    first = urlsplit(urls[0])
    origin = f"{first.scheme}://{first.netloc}"
    if any(f"{urlsplit(u).scheme}://{urlsplit(u).netloc}" != origin for u in urls):
        say("all REQUESTS must share one origin")
        return 1
    hostport = first.netloc if first.port else f"{first.netloc}:443"
    server = env("SERVER") or hostport
    downloads = env("DOWNLOADS", "/downloads")
    binary = chromium_binary()
    if not binary:
        say("chromium is not installed")
        return 1
    profile = tempfile.mkdtemp(prefix="chromium-interop-")
    log_path = os.path.join(os.getcwd(), "chromium.log")
    deadline = time.monotonic() + 170
    proc = None
    try:
        with open(log_path, "ab") as log:
            proc, ws = start_browser(binary, profile, hostport, server, spki, case, log)
            dt = DevTools(ws)
            if case == "multiconnect":
                # A fresh browser context (its own network stack) per URL.
                for u in urls:
                    ctx = dt.call("Target.createBrowserContext", {"disposeOnDetach": True})
                    try:
                        session(dt, origin, [u], downloads, ctx["browserContextId"], deadline)
                    finally:
                        dt.call("Target.disposeBrowserContext",
                                {"browserContextId": ctx["browserContextId"]})
            else:
                session(dt, origin, urls, downloads, None, deadline)
        return 0
    except Exception as e:  # noqa: BLE001 - any failure is exit 1
        say(f"failed: {e!r} (browser log: {log_path})")
        return 1
    finally:
        if proc is not None:
            stop_browser(proc)
        shutil.rmtree(profile, ignore_errors=True)


def main() -> int:
    role = env("ROLE", "")
    case = env("TESTCASE", "")
    alpn = env("ALPN", "h3")
    if role == "prepare":
        try:
            import websocket  # noqa: F401
        except ImportError:
            say("the Python package websocket-client is missing (pip install websocket-client)")
            return 1
        if not chromium_binary():
            say("chromium is not installed (apt-get install chromium)")
            return 1
        return 0
    if role == "server":
        say("Chromium is a client only")
        return EXIT_UNSUPPORTED
    if role != "client":
        say("ROLE must be client, server or prepare")
        return 1
    # The runner's time limit sends SIGTERM: unwind, so that the browser is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if alpn != "h3":
        say(f"ALPN {alpn} not supported: a browser speaks HTTP/3 (h3) only")
        return EXIT_UNSUPPORTED
    if case not in CASES:
        say(f"test case {case!r} not supported: {WHY.get(case, 'unknown case')}")
        return EXIT_UNSUPPORTED
    return client(case)


if __name__ == "__main__":
    sys.exit(main())
