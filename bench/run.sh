#!/usr/bin/env bash
# Side-by-side benchmarks of kuai against quinn, quic-go, ngtcp2 and a TCP + TLS 1.3 baseline
# (issue 6). Builds everything, runs every workload as same-implementation server + client pairs
# on 127.0.0.1, alternating A B C ... for --rounds rounds, and prints a Markdown table.
#
#   bench/run.sh [--write] [--no-build] [--files | --files-only] [--quick] [--rounds N] [--idle-connections N]
#                [--seconds S] [--bulk-bytes N] [--only bulk-1,bulk-8,requests,hs-1,hs-64,idle]
#                [--impls kuai,quinn,quic-go,ngtcp2,tcp] [--port P] [--cross]
#
#   --write     also put the table into BENCHMARKS.md (between the bench:begin / bench:end
#               markers) and every run's JSON into bench/results/latest.jsonl
#   --no-build  use the binaries already built
#   --quick     smoke run: 100 MiB bulk, 2 s rate workloads, 1,000 idle connections, 1 round
#   --cross     add bulk-1-cross: kuai's server with quinn's and quic-go's clients and back
#               (which side of a pair limits it)
#   --files     also serve a 1 GiB file: kuai server (HTTP/3, HTTP/2) beside kuai bench and
#               nginx (bench/files.sh, which needs nginx); --files-only runs just that
#
# Needs: cargo, Go (PATH or /usr/local/go/bin), python3, and for the ngtcp2 rows Debian's
# ngtcp2-server and ngtcp2-client packages (gtlsserver, gtlsclient) plus openssl.
# Binaries go to $CARGO_TARGET_DIR (default: target/ at the repository root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
export CARGO_TARGET_DIR="$TARGET"
export PATH="$PATH:/usr/local/go/bin"

write=0
build=1
files=0
args=()
for a in "$@"; do
    case "$a" in
        --write) write=1 ;;
        --no-build) build=0 ;;
        --files) files=1 ;;
        --files-only) files=2 ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) args+=("$a") ;;
    esac
done

log() { echo "run.sh: $*" >&2; }

if [ "$files" = 2 ]; then
    if [ "$build" = 1 ]; then
        (cd "$ROOT" && timeout 3600 cargo build --release --locked -q -p kuai-cli)
    fi
    exec "$ROOT/bench/files.sh" --kuai "$TARGET/release/kuai"
fi

if [ "$build" = 1 ]; then
    log "building kuai (release)"
    (cd "$ROOT" && timeout 3600 cargo build --release --locked -q -p kuai-cli)
    log "building quinn-perf (release)"
    timeout 3600 cargo build --release --locked -q --manifest-path "$ROOT/bench/quinn-perf/Cargo.toml"
    log "building quic-go-perf"
    (cd "$ROOT/bench/quic-go-perf" && timeout 1800 go build -o "$TARGET/quic-go-perf" .)
fi
for b in "$TARGET/release/kuai" "$TARGET/release/quinn-perf" "$TARGET/quic-go-perf"; do
    [ -x "$b" ] || { log "missing $b (run without --no-build)"; exit 1; }
done
if ! command -v gtlsserver >/dev/null || ! command -v gtlsclient >/dev/null; then
    log "gtlsserver/gtlsclient not found (apt-get install ngtcp2-server ngtcp2-client): the ngtcp2 rows will fail"
fi

# Leave nothing running: the runner stops its servers itself; this catches the rest.
tmp="$(mktemp -d)"
# The files gtlsserver serves (up to the bulk size, in memory): removed at exit.
NGTCP2_PERF_WWW="$(mktemp -d -p /dev/shm kuai-bench-www.XXXXXX 2>/dev/null || mktemp -d)"
export NGTCP2_PERF_WWW
cleanup() {
    if [ -n "${runner_pid:-}" ]; then kill "$runner_pid" 2>/dev/null || true; wait "$runner_pid" 2>/dev/null || true; fi
    rm -rf "$tmp" "$NGTCP2_PERF_WWW"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

kuai_rev="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "${KUAI_REV:-unknown}")"
if git -C "$ROOT" rev-parse >/dev/null 2>&1 && [ -n "$(git -C "$ROOT" status --porcelain -- crates 2>/dev/null)" ]; then
    kuai_rev="$kuai_rev + uncommitted changes in crates/"
fi
quinn_v="$(grep -A1 '^name = "quinn"$' "$ROOT/bench/quinn-perf/Cargo.lock" | sed -n 's/version = "\(.*\)"/\1/p')"
quicgo_v="$(sed -n 's#^require github.com/quic-go/quic-go \(.*\)#\1#p' "$ROOT/bench/quic-go-perf/go.mod")"
ngtcp2_v="$(dpkg-query -W -f '${Version}' ngtcp2-client 2>/dev/null || echo '?')"
rustc_v="$(rustc --version 2>/dev/null | cut -d' ' -f2)"
go_v="$(go version 2>/dev/null | cut -d' ' -f3)"
versions="kuai $kuai_rev, quinn $quinn_v (rustls, ring), quic-go $quicgo_v, ngtcp2 $ngtcp2_v (Debian, GnuTLS), rustc $rustc_v, $go_v"

# kuai's provider lists AES-128-GCM first since it sorts it so; ring's own order starts with AES-256.
if grep -q 'TLS13_AES_128_GCM_SHA256 => 0' "$ROOT/crates/kuai/src/lib.rs" 2>/dev/null; then
    kuai_cipher=TLS_AES_128_GCM_SHA256
else
    kuai_cipher=TLS_AES_256_GCM_SHA384
fi

raw="$tmp/raw.jsonl"
python3 "$ROOT/bench/runner.py" \
    --bin "kuai=$TARGET/release/kuai" --bin "quinn=$TARGET/release/quinn-perf" \
    --bin "quic-go=$TARGET/quic-go-perf" --bin "ngtcp2=$ROOT/bench/ngtcp2-perf" \
    --versions "$versions" --kuai-cipher "$kuai_cipher" --raw "$raw" "${args[@]}" --argv "$@" >"$tmp/table.md" &
runner_pid=$!
wait "$runner_pid"
runner_pid=

cat "$tmp/table.md"

if [ "$files" = 1 ]; then
    echo
    "$ROOT/bench/files.sh" --kuai "$TARGET/release/kuai"
fi

if [ "$write" = 1 ]; then
    mkdir -p "$ROOT/bench/results"
    cp "$raw" "$ROOT/bench/results/latest.jsonl"
    python3 - "$ROOT/BENCHMARKS.md" "$tmp/table.md" <<'EOF'
import sys
path, table = sys.argv[1], open(sys.argv[2]).read().rstrip("\n")
begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
try:
    doc = open(path).read()
except FileNotFoundError:
    doc = f"# Benchmarks\n\n{begin}\n{end}\n"
if begin not in doc or end not in doc:
    doc = doc.rstrip("\n") + f"\n\n{begin}\n{end}\n"
head, rest = doc.split(begin, 1)
_, tail = rest.split(end, 1)
open(path, "w").write(f"{head}{begin}\n{table}\n{end}{tail}")
EOF
    log "table written to BENCHMARKS.md, runs to bench/results/latest.jsonl"
fi
