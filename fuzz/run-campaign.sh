#!/usr/bin/env bash
# A fuzzing campaign: every target for SECONDS (default 1800), LANES targets at a time (default
# 2, one per core), each as its own niced libFuzzer process without a sanitizer (kuai's crates
# forbid unsafe code; overflow checks and debug assertions stay on).
#
#   fuzz/run-campaign.sh [SECONDS] [TARGET...]        LANES=1 fuzz/run-campaign.sh 600 frames
#
# TARGETs default to all (`cargo fuzz list`). Each run starts from fuzz/corpus/<target>/
# (gitignored, kept between campaigns) and fuzz/seeds/<target>/, writes new inputs to the
# corpus, a crash to fuzz/artifacts/<target>/ and its log to fuzz/campaign/<target>.log
# (gitignored). At the end, a table: seconds, executions, coverage (libFuzzer's cov and ft),
# corpus and peak RSS per target. Exits non-zero if a target crashed, hung (> 10 s on one
# input, 30 s for h3_control) or went past 2 GB.
#
# KUAI_FUZZ_SKIP as in fuzz/run-smoke.sh (default: every check on). Shrink the checked-in
# seeds afterwards with `cargo +nightly fuzz cmin -s none <target> <dir>` (fuzz/README.md).
# Honours CARGO_TARGET_DIR.
set -euo pipefail

secs="${1:-1800}"
shift || true
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
    echo "usage: $0 [SECONDS] [TARGET...]" >&2
    exit 2
fi
lanes="${LANES:-2}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
: "${KUAI_FUZZ_SKIP=}"
export KUAI_FUZZ_SKIP

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
nice -n 19 cargo +nightly fuzz build -s none
bin="${CARGO_TARGET_DIR:-$root/fuzz/target}/x86_64-unknown-linux-gnu/release"
mkdir -p fuzz/campaign

# One target: runs it, then appends its line to fuzz/campaign/summary.txt.
one() {
    set +e +o pipefail
    local t="$1" seeds="fuzz/seeds/$1" log="fuzz/campaign/$1.log" hang=10 status=ok
    local extra=()
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    [ -d "$seeds" ] || seeds=""
    case "$t" in
        # Long operation sequences from the start (see fuzz/README.md).
        connection | handshake) extra=(-len_control=0 -max_len=2048) ;;
        h3_control) hang=30 ;;
    esac
    local start
    start=$(date +%s)
    nice -n 19 "$bin/$t" "fuzz/corpus/$t" $seeds -max_total_time="$secs" -timeout="$hang" \
        -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/" \
        "${extra[@]}" >"$log" 2>&1 || status=FAILED
    local took=$(($(date +%s) - start))
    local execs line
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    rss=$(grep -o 'stat::peak_rss_mb: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    line=$(grep -E '^#[0-9]+' "$log" | grep 'cov:' | tail -1)
    cov=$(echo "$line" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*')
    ft=$(echo "$line" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*')
    corp=$(echo "$line" | grep -o 'corp: [0-9]*/[0-9a-zA-Z]*' | cut -d' ' -f2)
    grep -q 'deadly signal\|ERROR: libFuzzer\|==ERROR' "$log" && status=FAILED
    printf '%-16s %6ss execs=%-10s cov=%-6s ft=%-7s corpus=%-12s peak_rss=%sMB %s\n' "$t" "$took" \
        "${execs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "${rss:-?}" "$status" \
        | tee -a fuzz/campaign/summary.txt
}

echo "==> $(date -u +%FT%TZ) $(git rev-parse --short HEAD): ${targets[*]}, ${secs}s each, $lanes at a time" \
    | tee -a fuzz/campaign/summary.txt
pids=()
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$lanes" ]; do wait -n || true; done
    one "$t" &
    pids+=($!)
done
wait
! grep -q FAILED <(tail -n "${#targets[@]}" fuzz/campaign/summary.txt)
