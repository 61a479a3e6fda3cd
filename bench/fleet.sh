#!/usr/bin/env bash
# What joining a fleet costs a server (issue 20): two `kuai server`s on one machine, one on
# its own and one with `--redis` (sessions replicated through a Redis stream, each 0-RTT
# ticket's first use recorded with SET NX), each serving a small file to `kuai get --repeat
# N` (a new connection per run, resuming in 0-RTT), in rounds A B A B. Prints the server's
# CPU milliseconds per connection (utime + stime from /proc/PID/stat), Redis's, the share of
# runs in 0-RTT and the median time to the first byte.
#
#   bench/fleet.sh [--rounds N] [--runs N] [--kuai BIN]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=4
runs=500
kuai="${CARGO_TARGET_DIR:-$ROOT/target}/release/kuai"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --kuai) kuai="$2"; shift 2 ;;
        *) echo "fleet.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$kuai" ] || { echo "fleet.sh: no $kuai (cargo build --release -p kuai-cli)" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "fleet.sh: redis-server is not installed" >&2; exit 1; }
tmp="$(mktemp -d -p /dev/shm kuai-fleet.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
echo "fleet" > "$tmp/x.txt"
redis-server --port 4819 --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
rp=$!; pids+=("$rp")
sleep 0.5
RUST_LOG=warn "$kuai" server --listen 127.0.0.1:4811 --no-tcp --root "$tmp" >/dev/null 2>&1 &
ap=$!; pids+=("$ap")
RUST_LOG=warn "$kuai" server --listen 127.0.0.1:4812 --no-tcp --root "$tmp" \
    --redis redis://127.0.0.1:4819 >/dev/null 2>&1 &
bp=$!; pids+=("$bp")
sleep 1
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
raw="$tmp/raw"
for r in $(seq 1 "$rounds"); do
    for m in alone fleet; do
        port=4811; sp=$ap; [ "$m" = fleet ] && { port=4812; sp=$bp; }
        s0=$(cpu "$sp"); r0=$(cpu "$rp")
        "$kuai" get --insecure --http3 --state-file none --repeat "$runs" \
            "https://127.0.0.1:$port/x.txt" > "$tmp/$m.$r.json" 2>/dev/null
        s1=$(cpu "$sp"); r1=$(cpu "$rp")
        echo "$m $r $s0 $s1 $r0 $r1" >> "$raw"
    done
done
python3 - "$raw" "$tmp" "$(getconf CLK_TCK)" "$rounds" "$runs" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" <<'PY'
import collections, json, statistics, sys
raw, tmp, hz, rounds, runs, rev = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(raw):
    m, r, s0, s1, r0, r1 = line.split()
    d[m]["server"].append((float(s1) - float(s0)) / hz * 1000 / runs)
    d[m]["redis"].append((float(r1) - float(r0)) / hz * 1000 / runs)
    lines = [json.loads(l) for l in open(f"{tmp}/{m}.{r}.json") if l.startswith("{")]
    later = lines[1:]
    d[m]["0rtt"].append(100 * sum(l["zero_rtt"] == "accepted" for l in later) / len(later))
    d[m]["fb"].append(statistics.median(l["first_byte_ms"] for l in later if l["first_byte_ms"] is not None))
f = lambda x, p=3: f"{statistics.median(x):.{p}f} [{min(x):.{p}f}–{max(x):.{p}f}]"
print(f"kuai {rev}, {runs} connections per round over HTTP/3 on loopback, {rounds} rounds A B; medians [min–max]\n")
print("| server | server CPU ms / connection | redis CPU ms / connection | 0-RTT % | first byte ms |")
print("| --- | --- | --- | --- | --- |")
for m in ["alone", "fleet"]:
    print(f"| {m} | {f(d[m]['server'])} | {f(d[m]['redis'])} | {f(d[m]['0rtt'], 1)} | {f(d[m]['fb'])} |")
PY
