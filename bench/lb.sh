#!/usr/bin/env bash
# The QUIC-LB balancer's cost (issue 20): one `kuai server --server-id 01 --quic-lb-key K`
# serving a 1 GiB file from tmpfs, downloaded over HTTP/3 with `kuai get -o /dev/null`
# directly and through `kuai lb` (a full proxy), in rounds A B A B. Prints the balancer's
# CPU seconds per GiB (utime + stime from /proc/PID/stat), the datagrams it forwards per CPU
# second (estimated: 1 GiB in 1,440-byte payloads plus a tenth more for the client's ACKs),
# and the server's CPU and the rate both ways.
#
#   bench/lb.sh [--rounds N] [--kuai BIN]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=4
kuai="${CARGO_TARGET_DIR:-$ROOT/target}/release/kuai"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --kuai) kuai="$2"; shift 2 ;;
        *) echo "lb.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$kuai" ] || { echo "lb.sh: no $kuai (cargo build --release -p kuai-cli)" >&2; exit 1; }
tmp="$(mktemp -d -p /dev/shm kuai-lb.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
head -c $((1 << 30)) /dev/urandom > "$tmp/1g.bin"
key=00112233445566778899aabbccddeeff
RUST_LOG=warn "$kuai" server --listen 127.0.0.1:4801 --no-tcp --root "$tmp" \
    --server-id 01 --quic-lb-key "$key" >/dev/null 2>&1 &
sp=$!; pids+=("$sp")
RUST_LOG=warn "$kuai" lb --listen 127.0.0.1:4800 --backend 01=127.0.0.1:4801 \
    --quic-lb-key "$key" >/dev/null 2>&1 &
lp=$!; pids+=("$lp")
sleep 1
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
raw="$tmp/raw"
for r in $(seq 1 "$rounds"); do
    for m in direct lb; do
        port=4801; [ "$m" = lb ] && port=4800
        s0=$(cpu "$sp"); l0=$(cpu "$lp"); t0=$(date +%s.%N)
        "$kuai" get --insecure --http3 --state-file none -o /dev/null \
            "https://127.0.0.1:$port/1g.bin" 2>/dev/null
        t1=$(date +%s.%N); s1=$(cpu "$sp"); l1=$(cpu "$lp")
        echo "$m $s0 $s1 $l0 $l1 $t0 $t1" >> "$raw"
    done
done
python3 - "$raw" "$(getconf CLK_TCK)" "$rounds" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" <<'PY'
import collections, statistics, sys
raw, hz, rounds, rev = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(raw):
    m, s0, s1, l0, l1, t0, t1 = line.split()
    d[m]["server"].append((float(s1) - float(s0)) / hz)
    d[m]["lb"].append((float(l1) - float(l0)) / hz)
    d[m]["rate"].append((1 << 30) * 8 / (float(t1) - float(t0)) / 1e9)
f = lambda x: f"{statistics.median(x):.2f} [{min(x):.2f}–{max(x):.2f}]"
print(f"kuai {rev}, 1 GiB over HTTP/3 on loopback, {rounds} rounds A B; medians [min–max]\n")
print("| path | balancer CPU s / GiB | server CPU s / GiB | Gbit/s |")
print("| --- | --- | --- | --- |")
for m in ["direct", "lb"]:
    print(f"| {'direct' if m == 'direct' else 'through kuai lb'} | {f(d[m]['lb'])} | {f(d[m]['server'])} | {f(d[m]['rate'])} |")
dgrams = (1 << 30) / 1440 * 1.1
print(f"\nabout {dgrams / statistics.median(d['lb']['lb']) / 1e6:.2f} M datagrams forwarded per balancer CPU second (estimated from the size)")
PY
