#!/usr/bin/env python3
"""Side-by-side runner behind bench/run.sh (which builds the programs and calls this).

For each workload it runs every implementation as a server + client pair of the same
implementation on 127.0.0.1, alternating A B C ... A B C for --rounds rounds, a fresh server for
every run and every process bounded by a timeout, then prints a Markdown report: per workload
and implementation the median and min–max, CPU seconds per GB on each side for bulk, server
memory per idle connection, and the ratio kuai / peer. Raw JSON lines go to --raw.

Server CPU and memory come from the status line every server prints to stderr each second
({"server_cpu_s":..,"server_rss":..,...}): the line before the client starts against the last
line after it ended (bulk CPU), or the last line printed while the client still held its idle
connections (memory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

GB = 1e9

# name -> (label, server argv, client argv prefix, extra client args)
def implementations(bins: dict[str, str]) -> dict[str, dict]:
    impls = same_pairs(bins)
    # Mixed pairs (--cross): "S>C" is S's server with C's client.
    for peer in ("quinn", "quic-go"):
        for srv, cli in (("kuai", peer), (peer, "kuai")):
            impls[f"{srv}>{cli}"] = {
                "label": f"{impls[srv]['label']} server, {impls[cli]['label']} client",
                "server": impls[srv]["server"], "client": impls[cli]["client"]}
    return impls


def same_pairs(bins: dict[str, str]) -> dict[str, dict]:
    k = bins["kuai"]
    return {
        "kuai": {"label": "kuai", "server": [k, "bench", "server"], "client": [k, "bench", "client"]},
        "quinn": {"label": "quinn", "server": [bins["quinn"], "server"], "client": [bins["quinn"], "client"]},
        "quic-go": {"label": "quic-go", "server": [bins["quic-go"], "server"], "client": [bins["quic-go"], "client"]},
        # gtlsclient says nothing with -q, so the first run of each bulk workload is preceded
        # by an unmeasured one that downloads to tmpfs and checks every size.
        "ngtcp2": {"label": "ngtcp2 (HTTP/3)", "server": [bins["ngtcp2"], "server"],
                   "client": [bins["ngtcp2"], "client"], "verify": ["--verify"]},
        "tcp": {"label": "TCP + TLS 1.3 (kuai bench, rustls)",
                "server": [k, "bench", "server", "--transport", "tcp"],
                "client": [k, "bench", "client", "--transport", "tcp"]},
    }


def workloads(a: argparse.Namespace) -> list[dict]:
    bulk = a.bulk_bytes
    secs = a.seconds
    return [
        {"id": "bulk-1", "title": f"bulk {human(bulk)}, 1 stream", "kind": "bulk",
         "args": ["--workload", "bulk", "--bytes", str(bulk), "--streams", "1"],
         "impls": ["kuai", "quinn", "quic-go", "ngtcp2", "tcp"], "timeout": 300},
        {"id": "bulk-8", "title": f"bulk {human(bulk)}, 8 streams", "kind": "bulk",
         "args": ["--workload", "bulk", "--bytes", str(bulk), "--streams", "8"],
         "impls": ["kuai", "quinn", "quic-go", "ngtcp2"], "timeout": 300,
         "na": {"tcp": "one TCP connection has no streams"}},
        {"id": "requests", "title": f"requests: 1 KB responses, 8 connections x 32 streams in flight, {secs} s",
         "kind": "rate", "metric": "requests_s", "unit": "req/s",
         "args": ["--workload", "requests", "--connections", "8", "--response", "1000",
                  "--seconds", str(secs)],
         "impls": ["kuai", "quinn", "quic-go", "tcp"], "timeout": secs + 120,
         "na": {"ngtcp2": "gtlsclient: one connection per process"}},
        {"id": "hs-1", "title": f"handshakes, sequential, {secs} s", "kind": "rate",
         "metric": "handshakes_s", "unit": "hs/s",
         "args": ["--workload", "handshakes", "--connections", "1", "--seconds", str(secs)],
         "impls": ["kuai", "quinn", "quic-go", "tcp"], "timeout": secs + 120,
         "na": {"ngtcp2": "gtlsclient: one connection per process"}},
        {"id": "hs-64", "title": f"handshakes, 64 in flight, {secs} s", "kind": "rate",
         "metric": "handshakes_s", "unit": "hs/s",
         "args": ["--workload", "handshakes", "--connections", "64", "--seconds", str(secs)],
         "impls": ["kuai", "quinn", "quic-go", "tcp"], "timeout": secs + 120,
         "na": {"ngtcp2": "gtlsclient: one connection per process"}},
        {"id": "idle", "title": f"idle: {a.idle_connections} connections held by one server",
         "kind": "idle",
         "args": ["--workload", "idle", "--connections", str(a.idle_connections),
                  "--seconds", str(a.idle_hold)],
         "impls": ["kuai", "quinn", "quic-go", "tcp"], "timeout": 600,
         "na": {"ngtcp2": "gtlsclient: one connection per process"}},
    ] + ([
        {"id": "bulk-1-cross", "title": f"bulk {human(bulk)}, 1 stream, mixed pairs",
         "kind": "bulk", "cross": True,
         "args": ["--workload", "bulk", "--bytes", str(bulk), "--streams", "1"],
         "impls": ["kuai", "kuai>quinn", "quinn>kuai", "quinn", "kuai>quic-go", "quic-go>kuai",
                   "quic-go"], "timeout": 300},
    ] if a.cross else [])


def human(n: int) -> str:
    if n % (1 << 30) == 0:
        return f"{n >> 30} GiB"
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n} bytes"


class Server:
    """A server process whose stderr status lines are collected with their arrival times."""

    def __init__(self, argv: list[str], log):
        self.lines: list[tuple[float, dict]] = []
        self.other: list[str] = []
        self.cond = threading.Condition()
        self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  start_new_session=True)
        self.log = log
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for raw in self.p.stderr:
            line = raw.decode(errors="replace").strip()
            now = time.monotonic()
            st = None
            if line.startswith("{"):
                try:
                    st = json.loads(line)
                except ValueError:
                    st = None
            with self.cond:
                if st is not None and "server_cpu_s" in st:
                    self.lines.append((now, st))
                elif line and len(self.other) < 50:
                    self.other.append(line)
                self.cond.notify_all()

    def wait_status(self, after: float, timeout: float) -> tuple[float, dict] | None:
        """The first status line that arrived after `after` (monotonic)."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, st in self.lines:
                    if t > after:
                        return t, st
                left = end - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    return None
                self.cond.wait(min(left, 0.2))

    def last_before(self, when: float) -> tuple[float, dict] | None:
        with self.cond:
            c = [x for x in self.lines if x[0] <= when]
        return c[-1] if c else None

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(timeout=5)
        self.t.join(timeout=2)


LIVE: list[Server] = []
LOADS: list[float] = []


def run_one(impl: dict, wl: dict, port: int, log, verify: bool = False) -> dict:
    addr = f"127.0.0.1:{port}"
    srv = Server(impl["server"] + ["--listen", addr], log)
    LIVE.append(srv)
    rec: dict = {"ok": False}
    try:
        # The server is up and idle once its first status line is out (about 1 s).
        first = srv.wait_status(0, 10)
        if first is None:
            rec["error"] = "server did not start: " + " | ".join(srv.other[-3:])
            return rec
        t0, before = first
        argv = impl["client"] + ["--server", addr] + wl["args"]
        if verify and "verify" in impl and wl["kind"] == "bulk":
            try:
                v = subprocess.run(argv + impl["verify"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, timeout=wl["timeout"],
                                   start_new_session=True)
            except subprocess.TimeoutExpired:
                rec["error"] = "verification run timed out"
                return rec
            if v.returncode != 0:
                rec["error"] = "verification run failed: " + v.stderr.decode(errors="replace")[-200:]
                return rec
            rec["verified"] = True
            nxt = srv.wait_status(time.monotonic(), 5)
            if nxt is None:
                rec["error"] = "no server status line after the verification run"
                return rec
            t0, before = nxt
        start = time.monotonic()
        try:
            c = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=wl["timeout"], start_new_session=True)
        except subprocess.TimeoutExpired:
            rec["error"] = f"client timed out after {wl['timeout']} s"
            return rec
        end = time.monotonic()
        err = c.stderr.decode(errors="replace").strip()
        rec["client_stderr"] = err[-300:]
        out = [l for l in c.stdout.decode(errors="replace").splitlines() if l.startswith("{")]
        if c.returncode != 0 or not out:
            rec["error"] = f"client exited {c.returncode}: {err[-200:]}"
            return rec
        res = json.loads(out[-1])
        rec.update(res)
        rec["wall_s"] = round(end - start, 3)
        if wl["kind"] == "bulk":
            after = srv.wait_status(end + 0.05, 5)
            if after is None:
                rec["error"] = "no server status line after the run"
                return rec
            rec["server_cpu_delta_s"] = round(after[1]["server_cpu_s"] - before["server_cpu_s"], 3)
        if wl["kind"] == "idle":
            want = int(wl["args"][wl["args"].index("--connections") + 1])
            if res.get("connections") != want:
                rec["error"] = f"held {res.get('connections')} of {want} connections"
                return rec
            held = srv.last_before(end)
            if held is None or held[0] <= t0:
                rec["error"] = "no server status line while the connections were held"
                return rec
            rec["server_rss_before"] = before["server_rss"]
            rec["server_rss_held"] = held[1]["server_rss"]
            rec["server_bytes_per_conn"] = (held[1]["server_rss"] - before["server_rss"]) / want
        if res.get("failed"):
            rec["note"] = f"{res['failed']} failed"
        rec["ok"] = True
        return rec
    finally:
        srv.stop()
        LIVE.remove(srv)


def med_range(vals: list[float]) -> tuple[float, float, float]:
    return statistics.median(vals), min(vals), max(vals)


def fmt(v: float, unit: str = "") -> str:
    if v is None:
        return "–"
    if abs(v) >= 1000:
        s = f"{v:,.0f}"
    elif abs(v) >= 100:
        s = f"{v:.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return s + (f" {unit}" if unit else "")


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=20).stdout.decode(errors="replace").strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def sysctl(name: str) -> str:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return "?"


def udp_offload() -> str:
    """Whether the kernel accepts UDP GSO and GRO on a loopback socket."""
    res = []
    for name, opt, setv in (("GSO (UDP_SEGMENT)", 103, 1200), ("GRO (UDP_GRO)", 104, 1)):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.IPPROTO_UDP, opt, setv)
            res.append(f"{name} available")
        except OSError as e:
            res.append(f"{name} not available ({e.strerror})")
        finally:
            s.close()
    return ", ".join(res)


def machine_notes(a: argparse.Namespace, ciphers: set[str]) -> list[str]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    notes = [
        f"kernel {platform.release()}, CPU {cpu}, {os.cpu_count()} cores, memory {mem}",
        f"1-minute load average at start {a.load_start}, at end {os.getloadavg()[0]:.2f}, "
        + (f"{min(LOADS):.2f}–{max(LOADS):.2f} at the starts of the runs " if LOADS else "")
        + "(the machine is shared: other work may have run alongside; each run's is in the raw "
        "JSON as load_1m)",
        f"UDP offload in this kernel: {udp_offload()}; kuai uses GSO and GRO (quinn-udp), quinn "
        "GSO and GRO (quinn-udp), quic-go GSO only (it has no GRO), ngtcp2 0.12's gtlsserver "
        "GSO, its gtlsclient neither",
        f"socket buffers: net.core.rmem_max {sysctl('net.core.rmem_max')}, wmem_max "
        f"{sysctl('net.core.wmem_max')}, rmem_default {sysctl('net.core.rmem_default')}, "
        f"wmem_default {sysctl('net.core.wmem_default')}; kuai and quinn-perf ask 8 MB, quic-go 7 MB "
        "(each capped at the max), ngtcp2 keeps the default",
        f"cipher: kuai and the TCP baseline negotiate {a.kuai_cipher} (the first suite of "
        "kuai's rustls provider; rustls servers follow the client's order), quinn-perf puts "
        "TLS_AES_128_GCM_SHA256 first likewise; quic-go's client reported "
        + (", ".join(sorted(ciphers)) if ciphers else "nothing (no quic-go bulk run)")
        + "; ngtcp2 (GnuTLS) negotiates AES-128-GCM by its default priority. Certificates: "
        "ECDSA P-256, self-signed; clients check the handshake signature, not the chain",
        f"versions: {a.versions}",
        f"command: bench/run.sh {' '.join(a.argv)}; {a.rounds} round(s), servers and clients on "
        "127.0.0.1, a fresh server per run",
    ]
    return notes


def report(a: argparse.Namespace, wls: list[dict], impls: dict, results: dict,
           ciphers: set[str]) -> str:
    out: list[str] = []
    out.append(f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    out.append("")
    out.append("Machine:")
    out.append("")
    for n in machine_notes(a, ciphers):
        out.append(f"- {n}")
    out.append("")
    out.append("Median of the runs, min–max in brackets; kuai / peer is the ratio of the "
               "medians (above 1 is kuai ahead for rates, below 1 is kuai ahead for CPU and "
               "memory).")
    out.append("")
    out.append("| workload | implementation | result | CPU s/GB client | CPU s/GB server | runs ok | kuai / this |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for wl in wls:
        kuai_med: dict[str, float] = {}
        rows = []
        for name in wl["impls"]:
            label = impls[name]["label"]
            recs = results.get((wl["id"], name), [])
            ok = [r for r in recs if r["ok"]]
            fails = [r for r in recs if not r["ok"]]
            runs = f"{len(ok)}/{len(recs)}"
            if not ok:
                why = fails[0].get("error", "?") if fails else "not run"
                why = re.sub(r"\s+", " ", why)[:160].replace("|", "/")
                rows.append((name, f"| {wl['title']} | {label} | FAILED: {why} | | | {runs} | |"))
                continue
            cells = {}
            if wl["kind"] == "bulk":
                m = med_range([r["mbit_s"] for r in ok])
                c = med_range([r["client_cpu_s"] / (r["bytes"] / GB) for r in ok])
                s = med_range([r["server_cpu_delta_s"] / (r["bytes"] / GB) for r in ok])
                cells = {"main": m, "cpu_c": c, "cpu_s": s}
                text = (f"{fmt(m[0])} Mbit/s [{fmt(m[1])}–{fmt(m[2])}]",
                        f"{fmt(c[0])} [{fmt(c[1])}–{fmt(c[2])}]",
                        f"{fmt(s[0])} [{fmt(s[1])}–{fmt(s[2])}]")
            elif wl["kind"] == "rate":
                m = med_range([r[wl["metric"]] for r in ok])
                cells = {"main": m}
                failed = sum(r.get("failed", 0) for r in ok)
                extra = f", {failed} failed handshakes in all" if failed else ""
                text = (f"{fmt(m[0])} {wl['unit']} [{fmt(m[1])}–{fmt(m[2])}]{extra}", "", "")
            else:
                m = med_range([r["server_bytes_per_conn"] / 1000 for r in ok])
                setup = med_range([r["setup_seconds"] for r in ok])
                cells = {"main": m}
                text = (f"{fmt(m[0])} KB/conn server memory [{fmt(m[1])}–{fmt(m[2])}] "
                        f"(setup {fmt(setup[0])} s)", "", "")
            if fails:
                runs += " (" + "; ".join(sorted({re.sub(r'\s+', ' ', f.get('error', '?'))[:80].replace('|', '/') for f in fails})) + ")"
            if name == "kuai":
                kuai_med = {k: v[0] for k, v in cells.items()}
            rows.append((name, cells, text, runs, label))
        for row in rows:
            if isinstance(row[1], str):
                out.append(row[1])
                continue
            name, cells, text, runs, label = row
            if name == "kuai" or wl.get("cross"):
                ratio = ""
            elif not kuai_med:
                ratio = "– (kuai failed)"
            else:
                parts = []
                for key, tag in (("main", ""), ("cpu_c", "client CPU "), ("cpu_s", "server CPU ")):
                    if key in cells and key in kuai_med and cells[key][0]:
                        parts.append(f"{tag}{kuai_med[key] / cells[key][0]:.2f}")
                ratio = ", ".join(parts)
            out.append(f"| {wl['title']} | {label} | {text[0]} | {text[1]} | {text[2]} | {runs} | {ratio} |")
    out.append("")
    na = [f"{wl['title']}: {impls[n]['label']} ({why})" for wl in wls
          for n, why in wl.get("na", {}).items()]
    if na:
        out.append("Not measured: " + "; ".join(na) + ".")
        out.append("")
    out.append("The TCP + TLS baseline pipelines its requests (32 in flight per connection, "
               "answered in order: TCP has no streams). ngtcp2 is timed over the whole "
               "gtlsclient process (start, handshake, HTTP/3 request), its client memory is the "
               "process's peak.")
    out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle-connections", type=int, default=10000)
    ap.add_argument("--idle-hold", type=int, default=4, help="seconds the idle client holds")
    ap.add_argument("--bulk-bytes", type=int, default=1 << 30)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--port", type=int, default=14443, help="first of 32 ports used in turn")
    ap.add_argument("--only", default="", help="comma-separated workload ids")
    ap.add_argument("--cross", action="store_true",
                    help="also bulk with kuai's server against the peers' clients and back")
    ap.add_argument("--impls", default="", help="comma-separated implementations")
    ap.add_argument("--raw", default="", help="append every run's JSON here")
    ap.add_argument("--bin", action="append", default=[], help="NAME=PATH")
    ap.add_argument("--versions", default="?")
    ap.add_argument("--kuai-cipher", default="?")
    ap.add_argument("--argv", nargs=argparse.REMAINDER, default=[])
    a = ap.parse_args()
    if a.quick:
        a.rounds = 1
        a.bulk_bytes = 100 << 20
        a.seconds = 2
        a.idle_connections = min(a.idle_connections, 1000)
        a.idle_hold = 2
    a.load_start = f"{os.getloadavg()[0]:.2f}"
    bins = dict(b.split("=", 1) for b in a.bin)
    impls = implementations(bins)
    wls = workloads(a)
    if a.only:
        keep = set(a.only.split(","))
        wls = [w for w in wls if w["id"] in keep]
    if a.impls:
        keep = set(a.impls.split(","))
        for w in wls:
            w["impls"] = [i for i in w["impls"] if set(i.split(">")) <= keep]
            w["na"] = {k: v for k, v in w.get("na", {}).items() if k in keep}
    # Every client holds its connections on one UDP socket, but leave room anyway.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, min(hard, a.idle_connections + 4096))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    log = sys.stderr

    def on_signal(signum, _frame):
        for s in list(LIVE):
            s.stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    results: dict[tuple[str, str], list[dict]] = {}
    ciphers: set[str] = set()
    raw = open(a.raw, "a") if a.raw else None
    n = 0
    for wl in wls:
        for rnd in range(a.rounds):
            for name in wl["impls"]:
                impl = impls[name]
                port = a.port + n % 32
                n += 1
                t = time.monotonic()
                load = os.getloadavg()[0]
                rec = run_one(impl, wl, port, log, verify=rnd == 0)
                rec.update({"workload_id": wl["id"], "impl_name": name, "round": rnd + 1,
                            "load_1m": round(load, 2)})
                LOADS.append(load)
                m = re.search(r"quic-go-perf: cipher (\S+)", rec.get("client_stderr", ""))
                if m:
                    ciphers.add(m.group(1))
                results.setdefault((wl["id"], name), []).append(rec)
                short = {k: rec.get(k) for k in ("mbit_s", "requests_s", "handshakes_s",
                                                  "server_bytes_per_conn", "client_cpu_s",
                                                  "server_cpu_delta_s", "error") if k in rec}
                print(f"[{wl['id']} round {rnd + 1}/{a.rounds} {name}] {time.monotonic() - t:.1f} s "
                      f"{json.dumps(short)}", file=log, flush=True)
                if raw:
                    raw.write(json.dumps(rec) + "\n")
                    raw.flush()
    if raw:
        raw.close()
    print(report(a, wls, impls, results, ciphers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
