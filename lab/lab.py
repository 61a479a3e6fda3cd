#!/usr/bin/env python3
"""The weak-network lab: kuai's HTTP/3 against TCP + TLS (HTTP/2, HTTP/1.1) on an emulated link.

    lab/lab.py exp1|exp2|exp3|exp4|exp5|exp6|exp7|all [--quick] [--runs N] [--out DIR]

Every experiment runs `kuai server` in the server namespace of `kuai netsim` and `kuai get`
in the client namespace (the same program on both sides, for every protocol), reads the JSON
line `kuai get --repeat` prints per run, prints a Markdown table and writes a PNG plot and
the raw results (JSON) to lab/results/ (or --out). Needs root (network namespaces) and a
release build of kuai (built when missing); matplotlib for the plots.

The experiments (see LAB.md for the results beside the seeds' figures):
  exp1  10 KB responses, loss 0/5/15/30 %, RTT 40 ms, warm and new connections (and new with
        0-RTT for kuai): CDF of the completion time, share within 200 ms (seed 001). kuai
        with no flags against TCP + TLS with Linux CUBIC and BBR, through kuai get and curl.
  exp2  16 images of 20-200 KB on three mobile links x loss 0-30 %: total time (seed 003).
  exp3  a page (HTML + 12 resources, and + 60) on a 4G-like link: load time with HTTP/3,
        HTTP/2 and HTTP/1.1 (seed 000).
  exp4  5 % loss, 20 +- 5 ms delay, 10 % reordering: handshake and 1 MB transfer times over
        1,000 connections (seed 004).
  exp5  handshake latency at 50, 200 and 500 ms RTT: TCP + TLS 1.3, QUIC 1-RTT, QUIC 0-RTT.
  exp6  goodput of 10 MiB over 10 Mbit/s, 30 ms RTT, a 25-packet queue; recovery across
        5 s on / 2 s off outages.
  exp7  fairness: one kuai flow against one TCP flow (Linux CUBIC, then BBR) or a second kuai
        flow, sharing 10 Mbit/s, 30 ms RTT and a one-BDP drop-tail queue, at 0 and 2 % loss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVER_IP = "10.77.0.1"
# The namespaces' name; LAB_NAME lets two experiments run at once (each link is its own pair
# of namespaces, so the addresses do not clash).
NETSIM_NAME = os.environ.get("LAB_NAME", "kuailab")
PORT = 4433


def kuai_bin() -> Path:
    if os.environ.get("KUAI_BIN"):  # a fixed binary: a long run survives rebuilds
        return Path(os.environ["KUAI_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    b = target / "release" / "kuai"
    if not b.exists():
        print("lab: building kuai (cargo build --release -p kuai-cli)", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-p", "kuai-cli"], cwd=ROOT, check=True)
    return b


# ---------------------------------------------------------------------------------------------
# The site: files with fixed sizes, made once per run of the lab.

def make_site(d: Path) -> dict:
    """Writes the lab's files; returns the URL paths per workload."""
    rng = random.Random(2026)
    d.mkdir(parents=True, exist_ok=True)

    def put(name: str, size: int) -> str:
        p = d / name
        if not p.exists() or p.stat().st_size != size:
            p.write_bytes(rng.randbytes(size))
        return "/" + name

    site = {"10k": [put("10k.bin", 10 * 1024)], "1m": [put("1m.bin", 1 << 20)],
            "10m": [put("10m.bin", 10 << 20)], "30m": [put("30m.bin", 30 << 20)],
            "64m": [put("64m.bin", 64 << 20)]}
    # Seed 003: 16 images between 20 and 200 KB.
    sizes = [20, 32, 45, 58, 70, 84, 96, 110, 122, 135, 148, 160, 172, 185, 193, 200]
    site["images"] = [put(f"img{i:02d}.jpg", s * 1024) for i, s in enumerate(sizes)]
    # Seed 000: a page shaped like the HTTP Archive median (an HTML document, then its
    # resources: scripts, stylesheets, images and fonts of typical sizes).
    page = [put("page.html", 30 * 1024)]
    kinds = [("js", 25), ("css", 12), ("jpg", 40), ("png", 18), ("woff2", 22), ("js", 60)]
    res = [put(f"r{i:02d}.{kinds[i % len(kinds)][0]}",
               int(kinds[i % len(kinds)][1] * 1024 * (0.5 + rng.random())))
           for i in range(60)]
    site["page12"] = page + res[:12]
    site["page60"] = page + res
    return site


# ---------------------------------------------------------------------------------------------
# Running a condition

def link_args(link: dict) -> list[str]:
    """kuai netsim options for a link: one-way delay, jitter, loss, rate and queue per
    direction; keys prefixed up_/down_ apply to one direction only."""
    a = ["--seed", str(link.get("seed", 1))]
    for key, flag in [("delay", "delay"), ("jitter", "jitter"), ("loss", "loss"),
                      ("rate", "rate"), ("queue", "queue"), ("reorder", "reorder"),
                      ("blackhole", "blackhole")]:
        for prefix in ("", "up_", "down_"):
            v = link.get(prefix + key)
            if v is not None:
                a += [f"--{prefix.replace('_', '-')}{flag}", str(v)]
    if link.get("netem"):
        a.append("--netem")
    return a


# Every run's JSON line is also appended here as it comes in (with its link), so that a long
# experiment cut short keeps what it measured.
RAW_LOG: Path | None = None


def run_condition(kuai: Path, site_dir: Path, link: dict, client_cmds: list[list[str]],
                  limit: float, server_args: list[str] | None = None, *, parallel=False,
                  tcp_cc: str | None = None, tag: str | None = None) -> list[dict]:
    """Starts the link, the server and each client command in turn (all at once with
    `parallel`; one shell in the client namespace); returns every JSON line the clients
    printed. `tcp_cc` sets the server namespace's TCP congestion control (the sender's)."""
    server = [str(kuai), "server", "--listen", f"{SERVER_IP}:{PORT}", "--root", str(site_dir),
              *(server_args or []), *shlex.split(os.environ.get("LAB_SERVER_ARGS", ""))]
    if tcp_cc:
        server = ["sh", "-c", f"sysctl -qw net.ipv4.tcp_congestion_control={tcp_cc} && exec "
                  + " ".join(shlex.quote(x) for x in server)]
    quoted = [" ".join(shlex.quote(x) for x in c) for c in client_cmds]
    script = " & ".join(quoted) + " & wait" if parallel else " ; ".join(quoted)
    client = ["sh", "-c", script]
    cmd = [str(kuai), "netsim", "--name", NETSIM_NAME, "--quiet", "--wait-port", str(PORT), *link_args(link), "--",
           *server, "--", *client]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        out = p.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"lab: condition {link} hit the {limit:.0f} s limit", file=sys.stderr)
    rows = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{") and '"run"' in line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    if RAW_LOG is not None:
        with RAW_LOG.open("a") as f:
            for r in rows:
                f.write(json.dumps({"link": link, "cmd": client_cmds[0][2:6], "cell": tag,
                                    **r}) + "\n")
    return rows


def get_cmd(kuai: Path, proto: str, paths: list[str], repeat: int, *, reuse=False, zero_rtt=False,
            page=False, max_time=None) -> list[str]:
    c = [str(kuai), "get", "--insecure", f"--{proto}", "--repeat", str(repeat),
         "--connect-timeout", "30"]
    if reuse:
        c.append("--reuse")
    # kuai get sends idempotent requests in 0-RTT by default; the 1-RTT rows turn it off.
    c.append("--0rtt" if zero_rtt else "--no-0rtt")
    if page:
        c.append("--page")
    if max_time:
        c += ["--max-time", str(max_time)]
    return c + [f"https://{SERVER_IP}:{PORT}{p}" for p in paths]


# ---------------------------------------------------------------------------------------------
# Statistics and output

def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


def fmt(x: float, unit: str = "") -> str:
    return "—" if x != x else f"{x:.0f}{unit}" if x >= 100 else f"{x:.1f}{unit}"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def save(out: Path, name: str, data, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(md + "\n")
    print(md)


def plot(out: Path, name: str, draw) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("lab: matplotlib missing (pip install matplotlib): no plot", file=sys.stderr)
        return
    fig = draw(plt)
    fig.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {out / (name + '.png')}")


# The rows of experiments 2-6: kuai with no flags on either side, and TCP + TLS with the
# server namespace's Linux congestion control set to CUBIC and to BBR (the sender's choice).
# Each is (the protocol kuai get speaks, the TCP congestion control or None).
VARIANTS = {"http3": ("http3", None),
            "http2-cubic": ("http2", "cubic"), "http2-bbr": ("http2", "bbr"),
            "http1.1-cubic": ("http1.1", "cubic"), "http1.1-bbr": ("http1.1", "bbr")}
PROTO_LABEL = {"http3": "kuai HTTP/3", "http2-cubic": "HTTP/2, TCP CUBIC",
               "http2-bbr": "HTTP/2, TCP BBR", "http1.1-cubic": "HTTP/1.1, TCP CUBIC",
               "http1.1-bbr": "HTTP/1.1, TCP BBR"}


def times(rows: list[dict], n: int, limit_ms: float) -> list[float]:
    """Completion times in ms; failed or missing runs count as `limit_ms` (not done)."""
    t = [r["total_ms"] if r.get("ok") else limit_ms for r in rows]
    return t + [limit_ms] * max(0, n - len(t))


# ---------------------------------------------------------------------------------------------
# Experiments

EXP2_PROTOS = ("http3", "http2-cubic", "http2-bbr")
EXP3_PROTOS = ("http3", "http2-cubic", "http2-bbr", "http1.1-cubic", "http1.1-bbr")
EXP4_PROTOS = ("http3", "http2-cubic", "http2-bbr")
EXP6_PROTOS = ("http3", "http2-cubic", "http2-bbr")

# Seed 001's shares within 200 ms (QUIC, TCP) at 5, 15 and 30 % loss.
SEED001 = {5: (95, 78), 15: (90, 50), 30: (62, 22)}


def curl_cmd(url: str, n: int, *, warm: bool, max_time: float) -> list[str]:
    """curl (Debian's, HTTP/2 over TCP + TLS 1.3) fetching `url` n times: one invocation with
    n URLs, so the connection is reused (warm), or one invocation per run (new). Prints one
    JSON line per transfer, which `curl_rows` turns into `kuai get`'s shape."""
    fmt_ = '{"run":0,"curl":true,"code":"%{http_code}","connects":%{num_connects},' \
           '"connect_s":%{time_appconnect},"first_byte_s":%{time_starttransfer},' \
           '"total_s":%{time_total}}\\n'
    base = ["curl", "-sk", "--http2", "--max-time", str(max_time), "-w", fmt_]
    if warm:
        args = []
        for _ in range(n):
            args += [url, "-o", "/dev/null"]
        return base + args
    one = " ".join(shlex.quote(x) for x in base + ["-o", "/dev/null", url])
    return ["sh", "-c", f"for i in $(seq {n}); do {one}; done"]


def curl_rows(rows: list[dict]) -> list[dict]:
    """curl's lines in kuai get's shape: TLS done (`time_appconnect`) as connect_ms, and
    `time_starttransfer` as first_byte_ms."""
    return [dict(r, ok=r.get("code") == "200", total_ms=1000 * r.get("total_s", 0),
                 connect_ms=1000 * r["connect_s"] if r.get("connect_s") else None,
                 first_byte_ms=1000 * r["first_byte_s"] if r.get("first_byte_s") else None,
                 new_connection=r.get("connects", 1) > 0) for r in rows]


def exp1(a, kuai, site_dir, site, out):
    runs = a.runs or (100 if a.quick else 1000)
    losses = a.losses or [0, 5, 15, 30]
    limit_ms = 5000.0
    allow_tcp_cc(["cubic", "bbr"])
    url = f"https://{SERVER_IP}:{PORT}{site['10k'][0]}"
    # (label, mode, tcp_cc, command for n runs): kuai with no flags, then TCP + TLS with
    # Linux CUBIC and BBR, each through kuai get and through curl.
    cells = [("kuai HTTP/3", "warm", None,
              lambda n: get_cmd(kuai, "http3", site["10k"], n, reuse=True, max_time=5)),
             ("kuai HTTP/3", "new", None,
              lambda n: get_cmd(kuai, "http3", site["10k"], n, max_time=5)),
             ("kuai HTTP/3", "new, 0-RTT", None,
              lambda n: get_cmd(kuai, "http3", site["10k"], n, zero_rtt=True, max_time=5))]
    for cc in ("cubic", "bbr"):
        for mode, warm in (("warm", True), ("new", False)):
            cells.append((f"kuai get HTTP/2, TCP {cc.upper()}", mode, cc,
                          lambda n, w=warm: get_cmd(kuai, "http2", site["10k"], n, reuse=w,
                                                    max_time=5)))
            cells.append((f"curl HTTP/2, TCP {cc.upper()}", mode, cc,
                          lambda n, w=warm: curl_cmd(url, n, warm=w, max_time=5)))
    if a.cells:
        cells = [c for c in cells if re.search(a.cells, f"{c[0]}/{c[1]}")]
    data = {}
    for loss in losses:
        link = {"delay": "20ms", "loss": f"{loss}%", "seed": 1 + loss}
        for label, mode, cc, cmd in cells:
            warm = mode == "warm"
            zero = "0-RTT" in mode
            # Warm: the first run (the handshake) is left out of the statistics; 0-RTT: the
            # first run too (it has no ticket yet; the "new" row measures such connections).
            n = runs + 1 if warm or zero else runs
            rows = run_condition(kuai, site_dir, link, [cmd(n)], limit=runs * 6 + 120,
                                 tcp_cc=cc, tag=f"{label}/{mode}")
            if label.startswith("curl"):
                rows = curl_rows(rows)
            if warm:
                rows = rows[1:] if label.startswith("curl") else \
                    [r for r in rows if not r.get("new_connection")]
            elif zero:
                rows = [r for r in rows if r.get("run") != 0]
            data[f"{loss}/{label}/{mode}"] = times(rows, runs, limit_ms)
            print(f"exp1 loss {loss}% {label} {mode}: {len(rows)} runs", file=sys.stderr)
    hdr = ["loss", "connection", "protocol", "within 200 ms", "seed 001", "median ms", "p90 ms",
           "p99 ms"]
    rows = []
    for loss in losses:
        for mode in ("warm", "new", "new, 0-RTT"):
            for label, m, _, _ in cells:
                t = data.get(f"{loss}/{label}/{mode}")
                if m != mode or t is None:
                    continue
                share = 100 * sum(1 for x in t if x <= 200) / len(t)
                seed = SEED001.get(loss)
                seed_s = "—" if seed is None else (f"QUIC {seed[0]} %" if "HTTP/3" in label
                                                   else f"TCP {seed[1]} %")
                rows.append([f"{loss} %", mode, label, f"{share:.1f} %", seed_s,
                             fmt(pct(t, 50)), fmt(pct(t, 90)), fmt(pct(t, 99))])
    md = (f"### Experiment 1: 10 KB responses, RTT 40 ms, {runs} runs per cell\n\n"
          + table(hdr, rows))
    save(out, "exp1", data, md)

    def draw(plt):
        fig, axes = plt.subplots(2, len(losses), figsize=(4 * len(losses), 7), sharey=True,
                                 squeeze=False)
        for j, loss in enumerate(losses):
            for i, group in enumerate((("warm",), ("new", "new, 0-RTT"))):
                ax = axes[i][j]
                mode = group[0]
                for label, m, _, _ in cells:
                    if m not in group or f"{loss}/{label}/{m}" not in data:
                        continue
                    t = sorted(data[f"{loss}/{label}/{m}"])
                    ax.plot(t, [(k + 1) / len(t) for k in range(len(t))],
                            label=f"{label} ({m})")
                ax.axvline(200, color="grey", ls=":")
                ax.set_xscale("log")
                ax.set_title(f"loss {loss} %, {mode} connection")
                ax.set_xlabel("completion time (ms)")
                ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("CDF")
        axes[1][0].set_ylabel("CDF")
        axes[0][0].legend()
        return fig

    plot(out, "exp1", draw)


def exp2(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    runs = a.runs or (2 if a.quick else 5)
    links = [("5.7 Mbit/s, 466 ms", "5.7mbit", 233), ("2.3 Mbit/s, 68 ms", "2.3mbit", 34),
             ("6.3 Mbit/s, 123 ms", "6.3mbit", 61)]
    losses = [0, 5, 10, 15, 20, 30] if not a.quick else [0, 10, 30]
    limit_s = 120
    data = {}
    for name, rate, owd in links:
        for loss in losses:
            for proto in EXP2_PROTOS:
                link = {"delay": f"{owd}ms", "rate": rate, "queue": "100",
                        "loss": f"{loss}%", "seed": 3 + loss}
                cmd = get_cmd(kuai, VARIANTS[proto][0], site["images"], runs, max_time=limit_s)
                rows = run_condition(kuai, site_dir, link, [cmd], limit=runs * (limit_s + 30) + 60,
                                     tcp_cc=VARIANTS[proto][1], tag=f"{name}/{loss}/{proto}")
                data[f"{name}/{loss}/{proto}"] = times(rows, runs, float("inf"))
                print(f"exp2 {name} loss {loss}% {proto}: {len(rows)} runs", file=sys.stderr)
    hdr = ["link", "loss"] + [f"{PROTO_LABEL[p]} median s (done)" for p in EXP2_PROTOS]
    rows = []
    for name, _, _ in links:
        for loss in losses:
            r = [name, f"{loss} %"]
            for proto in EXP2_PROTOS:
                t = data[f"{name}/{loss}/{proto}"]
                done = [x for x in t if x != float("inf")]
                med = pct(done, 50) / 1000 if len(done) * 2 > len(t) else float("nan")
                r.append(f"{fmt(med)} ({len(done)}/{len(t)})")
            rows.append(r)
    md = (f"### Experiment 2: 16 images (20–200 KB, 1.9 MB), {runs} runs per cell, "
          f"limit {limit_s} s\n\n" + table(hdr, rows))
    save(out, "exp2", {k: [x if x != float("inf") else None for x in v] for k, v in data.items()},
         md)

    def draw(plt):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (name, _, _) in zip(axes, links):
            for proto in EXP2_PROTOS:
                ys = []
                for loss in losses:
                    done = [x for x in data[f"{name}/{loss}/{proto}"] if x != float("inf")]
                    ys.append(pct(done, 50) / 1000 if done else float("nan"))
                ax.plot(losses, ys, marker="o", label=PROTO_LABEL[proto])
            ax.set_title(name)
            ax.set_xlabel("loss (%)")
            ax.set_ylabel("total time (s), median")
            ax.grid(alpha=0.3)
        axes[0].legend()
        return fig

    plot(out, "exp2", draw)


def exp3(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    runs = a.runs or (3 if a.quick else 20)
    # A 4G-like link: 12 Mbit/s down, 4 Mbit/s up, 70 ms RTT (jitter 5 ms), 0.5 % loss.
    link = {"delay": "35ms", "jitter": "5ms", "down_rate": "12mbit", "up_rate": "4mbit",
            "queue": "100", "loss": "0.5%", "seed": 30}
    data = {}
    for page in ("page12", "page60"):
        for proto in EXP3_PROTOS:
            cmd = get_cmd(kuai, VARIANTS[proto][0], site[page], runs, page=True, max_time=60)
            rows = run_condition(kuai, site_dir, link, [cmd], limit=runs * 70 + 60,
                                 tcp_cc=VARIANTS[proto][1], tag=f"{page}/{proto}")
            data[f"{page}/{proto}"] = [r["total_ms"] for r in rows if r.get("ok")]
            print(f"exp3 {page} {proto}: {len(rows)} runs", file=sys.stderr)
    hdr = ["page", "protocol", "median ms", "mean ms", "p90 ms", "vs kuai HTTP/3"]
    rows = []
    for page in ("page12", "page60"):
        h3 = statistics.median(data[f"{page}/http3"]) if data[f"{page}/http3"] else float("nan")
        for proto in EXP3_PROTOS:
            t = data[f"{page}/{proto}"]
            med = statistics.median(t) if t else float("nan")
            rows.append([f"HTML + {page[4:]}", PROTO_LABEL[proto], fmt(med),
                         fmt(statistics.mean(t) if t else float("nan")), fmt(pct(t, 90)),
                         f"{(med / h3 - 1) * 100:+.0f} %" if proto != "http3" else "—"])
    md = (f"### Experiment 3: page loads on a 4G-like link (12/4 Mbit/s, 70 ms RTT, "
          f"0.5 % loss), new connection per load, {runs} loads per cell\n\n" + table(hdr, rows))
    save(out, "exp3", data, md)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = []
        for k, page in enumerate(("page12", "page60")):
            for i, proto in enumerate(EXP3_PROTOS):
                t = data[f"{page}/{proto}"]
                ax.bar(k * 5 + i, statistics.median(t) if t else 0,
                       color=f"C{i}", label=PROTO_LABEL[proto] if k == 0 else None)
            labels.append((k * 5 + 1.5, f"HTML + {page[4:]}"))
        ax.set_xticks([x for x, _ in labels], [l for _, l in labels])
        ax.set_ylabel("page load time (ms), median")
        ax.legend()
        return fig

    plot(out, "exp3", draw)


def exp4(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    conns = a.runs or (100 if a.quick else 1000)
    concurrency = 10
    # Seed 004's impairment on the server's egress (`netem delay 20ms 5ms reorder 10% loss
    # 5%`). By default in kuai netsim's order-keeping form: the jitter does not reorder, and
    # the 10 % are held back 10 ms. With --netem as Linux netem does it: each packet's own
    # 20 +- 5 ms (packets 50 us apart overtake one another by up to 10 ms), and the 10 % are
    # sent without the delay, which gives RTT samples of a tenth of a millisecond (LAB.md).
    link = {"down_delay": "20ms", "down_jitter": "5ms", "down_loss": "5%",
            "down_reorder": "10%", "netem": a.netem, "seed": 4}
    data = {}
    protos = [p for p in EXP4_PROTOS if not a.cells or re.search(a.cells, p)]
    for proto in protos:
        per = conns // concurrency
        cmd = get_cmd(kuai, VARIANTS[proto][0], site["1m"], per, max_time=30)
        shell = " & ".join(" ".join(shlex.quote(x) for x in cmd) for _ in range(concurrency))
        rows = run_condition(kuai, site_dir, link, [["sh", "-c", shell + " & wait"]],
                             limit=per * 40 + 120, tcp_cc=VARIANTS[proto][1], tag=proto)
        data[proto] = rows
        print(f"exp4 {proto}: {len(rows)} connections", file=sys.stderr)
    hdr = ["protocol", "connections (ok)", "handshake mean ms", "handshake p99 ms",
           "1 MB transfer mean ms", "1 MB transfer p99 ms"]
    rows = []
    for proto in protos:
        ok = [r for r in data[proto] if r.get("ok")]
        hs = [r["connect_ms"] for r in ok if r.get("connect_ms") is not None]
        tr = [r["total_ms"] - r["connect_ms"] for r in ok if r.get("connect_ms") is not None]
        rows.append([PROTO_LABEL[proto], f"{len(data[proto])} ({len(ok)})",
                     fmt(statistics.mean(hs) if hs else float("nan")), fmt(pct(hs, 99)),
                     fmt(statistics.mean(tr) if tr else float("nan")), fmt(pct(tr, 99))])
    md = (f"### Experiment 4: 5 % loss, 20 ± 5 ms delay, 10 % reordering (server to client), "
          f"{conns} connections, {concurrency} at a time\n\n" + table(hdr, rows))
    save(out, "exp4", data, md)

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for proto in protos:
            ok = [r for r in data[proto] if r.get("ok") and r.get("connect_ms") is not None]
            for ax, vals in zip(axes, ([r["connect_ms"] for r in ok],
                                       [r["total_ms"] - r["connect_ms"] for r in ok])):
                v = sorted(vals)
                ax.plot(v, [(k + 1) / len(v) for k in range(len(v))], label=PROTO_LABEL[proto])
        axes[0].set_xlabel("handshake (ms)")
        axes[1].set_xlabel("1 MB transfer (ms)")
        for ax in axes:
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
        axes[0].legend()
        return fig

    plot(out, "exp4", draw)


def exp5(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    runs = a.runs or (5 if a.quick else 30)
    data = {}
    url = f"https://{SERVER_IP}:{PORT}{site['10k'][0]}"
    # (row, tcp_cc, command for n runs, curl): TCP + TLS 1.3 through kuai get and through
    # curl, with Linux CUBIC and BBR (the handshake itself does not depend on it), then QUIC.
    cells = []
    for cc in ("cubic", "bbr"):
        cells.append((f"TCP + TLS 1.3, {cc.upper()} (kuai get)", cc,
                      lambda n: get_cmd(kuai, "http2", site["10k"], n, max_time=20), False))
        cells.append((f"TCP + TLS 1.3, {cc.upper()} (curl)", cc,
                      lambda n: curl_cmd(url, n, warm=False, max_time=20), True))
    cells.append(("QUIC 1-RTT", None,
                  lambda n: get_cmd(kuai, "http3", site["10k"], n, max_time=20), False))
    cells.append(("QUIC 0-RTT", None,
                  lambda n: get_cmd(kuai, "http3", site["10k"], n, zero_rtt=True, max_time=20),
                  False))
    names = [c[0] for c in cells]
    for rtt in (50, 200, 500):
        link = {"delay": f"{rtt // 2}ms", "seed": rtt}
        for name, cc, cmd, curl in cells:
            # One extra run first: it fetches the session ticket 0-RTT needs.
            rows = run_condition(kuai, site_dir, link, [cmd(runs + 1)],
                                 limit=(runs + 1) * 25 + 60, tcp_cc=cc, tag=f"{rtt}/{name}")
            rows = (curl_rows(rows) if curl else rows)[1:]
            data[f"{rtt}/{name}"] = rows
            print(f"exp5 rtt {rtt} {name}: {len(rows)} runs", file=sys.stderr)
    hdr = ["RTT", "handshake", "connected ms (median)", "first byte ms (median)",
           "first byte in RTTs", "0-RTT accepted"]
    rows = []
    for rtt in (50, 200, 500):
        for name in names:
            ok = [r for r in data[f"{rtt}/{name}"] if r.get("ok")]
            c = [r["connect_ms"] for r in ok if r.get("connect_ms") is not None]
            fb = [r["first_byte_ms"] for r in ok if r.get("first_byte_ms") is not None]
            acc = sum(1 for r in ok if r.get("zero_rtt") == "accepted")
            mfb = statistics.median(fb) if fb else float("nan")
            rows.append([f"{rtt} ms", name, fmt(statistics.median(c) if c else float("nan")),
                         fmt(mfb), f"{mfb / rtt:.2f}",
                         f"{acc}/{len(ok)}" if "0-RTT" in name else "—"])
    md = f"### Experiment 5: handshake latency, {runs} connections per cell\n\n" + table(hdr, rows)
    save(out, "exp5", data, md)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, name in enumerate(names):
            ys = []
            for rtt in (50, 200, 500):
                fb = [r["first_byte_ms"] for r in data[f"{rtt}/{name}"]
                      if r.get("ok") and r.get("first_byte_ms") is not None]
                ys.append(statistics.median(fb) if fb else 0)
            ax.bar([k * 7 + i for k in range(3)], ys, label=name, color=f"C{i}")
        ax.set_xticks([2.5, 9.5, 16.5], ["50 ms", "200 ms", "500 ms"])
        ax.set_xlabel("RTT")
        ax.set_ylabel("time to first byte of a 10 KB response (ms)")
        ax.legend()
        return fig

    plot(out, "exp5", draw)


def exp6(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    runs = a.runs or (1 if a.quick else 3)
    data = {}
    base = {"delay": "15ms", "rate": "10mbit", "queue": "25", "seed": 6}
    outage = dict(base, blackhole="5s/2s")
    protos = [p for p in EXP6_PROTOS if not a.cells or re.search(a.cells, p)]
    for name, link, paths in (("steady", base, site["10m"]), ("outages", outage, site["30m"])):
        for proto in protos:
            cmd = get_cmd(kuai, VARIANTS[proto][0], paths, runs, max_time=180)
            rows = run_condition(kuai, site_dir, link, [cmd], limit=runs * 200 + 60,
                                 tcp_cc=VARIANTS[proto][1], tag=f"{name}/{proto}")
            data[f"{name}/{proto}"] = rows
            print(f"exp6 {name} {proto}: {len(rows)} runs", file=sys.stderr)
    hdr = ["link", "protocol", "runs ok", "time s (median)", "goodput Mbit/s (median)"]
    rows = []
    for name in ("steady", "outages"):
        for proto in protos:
            ok = [r for r in data[f"{name}/{proto}"] if r.get("ok")]
            t = [r["total_ms"] / 1000 for r in ok]
            g = [r["bytes"] * 8 / 1e6 / (r["total_ms"] / 1000) for r in ok]
            rows.append([name, PROTO_LABEL[proto], f"{len(ok)}/{runs}",
                         fmt(statistics.median(t) if t else float("nan")),
                         f"{statistics.median(g):.2f}" if g else "—"])
    md = ("### Experiment 6: 10 MiB over 10 Mbit/s, 30 ms RTT, 25-packet queue; 30 MiB across "
          "5 s on / 2 s off outages\n\n" + table(hdr, rows))
    save(out, "exp6", data, md)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, proto in enumerate(protos):
            ys = []
            for name in ("steady", "outages"):
                ok = [r for r in data[f"{name}/{proto}"] if r.get("ok")]
                g = [r["bytes"] * 8 / 1e6 / (r["total_ms"] / 1000) for r in ok]
                ys.append(statistics.median(g) if g else 0)
            ax.bar([i, 4 + i], ys, label=PROTO_LABEL[proto], color=f"C{i}")
        ax.set_xticks([1, 5], ["10 Mbit/s steady", "5 s on / 2 s off"])
        ax.set_ylabel("goodput (Mbit/s)")
        ax.axhline(10, color="grey", ls=":")
        ax.legend()
        return fig

    plot(out, "exp6", draw)


def allow_tcp_cc(names: list[str]) -> None:
    """A network namespace may only pick a TCP congestion control the host allows: adds
    `names` to net.ipv4.tcp_allowed_congestion_control (the host's default stays)."""
    key = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    allowed = key.read_text().split()
    missing = [n for n in names if n not in allowed]
    if missing:
        key.write_text(" ".join(allowed + missing))


def exp7(a, kuai, site_dir, site, out):
    allow_tcp_cc(["cubic", "bbr"])
    runs = a.runs or (1 if a.quick else 3)
    secs = 15 if a.quick else 30
    # 10 Mbit/s x 30 ms = 37.5 kB: a queue of 25 full-size packets is one BDP.
    base = {"delay": "15ms", "rate": "10mbit", "queue": "25", "seed": 7}
    url = site["64m"]
    kuai_flow = get_cmd(kuai, "http3", url, 1, max_time=secs)
    tcp_flow = get_cmd(kuai, "http2", url, 1, max_time=secs)
    # (kuai's congestion control, its server flags, the loss rates): the defaults, and BBRv3's
    # own loss response for comparison.
    kuais = [("defaults", [], (0, 2)), ("BBRv3 (--cc bbr)", ["--cc", "bbr"], (0,))]
    against = [("TCP CUBIC", "cubic", tcp_flow), ("TCP BBR", "bbr", tcp_flow),
               ("kuai (same)", "bbr", kuai_flow)]
    data = {}
    rows = []
    for kname, kargs, losses in kuais:
        for loss in losses:
            link = dict(base, loss=f"{loss}%") if loss else base
            for oname, cc, other in against:
                key = f"{kname}/{loss}/{oname}"
                if a.cells and not re.search(a.cells, key):
                    continue
                cell = []
                for r in range(runs):
                    got = run_condition(kuai, site_dir, dict(link, seed=7 + r),
                                        [kuai_flow, other], limit=secs + 60, server_args=kargs,
                                        parallel=True, tcp_cc=cc)
                    rate = [g["bytes"] * 8 / 1e6 / (g["total_ms"] / 1000) for g in got
                            if g.get("total_ms")]
                    protos = [g.get("protocol") for g in got]
                    if len(rate) != 2:
                        print(f"exp7 {key} run {r}: {len(rate)} flows reported", file=sys.stderr)
                        continue
                    if oname.startswith("TCP"):
                        k = rate[protos.index("h3")] if "h3" in protos else float("nan")
                        o = rate[protos.index("h2")] if "h2" in protos else float("nan")
                    else:
                        k, o = max(rate), min(rate)
                    cell.append({"kuai": k, "other": o, "runs": got})
                data[key] = cell
                ratios = [c["kuai"] / c["other"] for c in cell if c["other"] > 0]
                ks = [c["kuai"] for c in cell]
                os_ = [c["other"] for c in cell]
                rows.append([kname, f"{loss} %", oname, f"{len(cell)}/{runs}",
                             f"{statistics.median(ks):.2f}" if ks else "—",
                             f"{statistics.median(os_):.2f}" if os_ else "—",
                             (f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–"
                              f"{max(ratios):.2f}]") if ratios else "—"])
                print(f"exp7 {key}: {rows[-1]}", file=sys.stderr)
    hdr = ["kuai", "loss", "against", "runs", "kuai Mbit/s (median)", "other Mbit/s (median)",
           "kuai / other, median [min–max]"]
    md = (f"### Experiment 7: one kuai flow against one other flow for {secs} s, 10 Mbit/s, "
          "30 ms RTT, 25-packet (one-BDP) drop-tail queue\n\n" + table(hdr, rows)
          + "\n\nAgainst kuai itself the ratio is the faster flow over the slower one.")
    save(out, "exp7", data, md)


EXPERIMENTS = {"exp1": exp1, "exp2": exp2, "exp3": exp3, "exp4": exp4, "exp5": exp5,
               "exp6": exp6, "exp7": exp7}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--quick", action="store_true", help="fewer runs and conditions")
    ap.add_argument("--netem", action="store_true",
                    help="exp4: jitter and reordering as Linux netem does them (kuai netsim --netem)")
    ap.add_argument("--runs", type=int, default=0, help="runs per cell (default per experiment)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--cells", default="",
                    help="exp1: only the cells whose 'label/mode' matches this regular expression "
                         "(like 'kuai HTTP/3' or '^curl.*/new$'); exp4: only the protocols it "
                         "matches (http3, http2-cubic, http2-bbr), exp6 too; exp7: only the cells whose "
                         "'kuai/loss/against' matches (like '^defaults/2/')")
    ap.add_argument("--losses", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="exp1: only these loss percentages (like '15,30'), so that loss levels "
                         "can run side by side under different LAB_NAMEs")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("lab: network namespaces need root", file=sys.stderr)
        return 1
    kuai = kuai_bin()
    site_dir = Path(os.environ.get("LAB_SITE", "/tmp/kuai-lab-site"))
    site = make_site(site_dir)
    todo = list(EXPERIMENTS) if a.experiment == "all" else [a.experiment]
    global RAW_LOG
    a.out.mkdir(parents=True, exist_ok=True)
    for name in todo:
        RAW_LOG = a.out / f"{name}.runs.jsonl"
        RAW_LOG.unlink(missing_ok=True)
        t0 = time.monotonic()
        EXPERIMENTS[name](a, kuai, site_dir, site, a.out)
        print(f"lab: {name} took {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
