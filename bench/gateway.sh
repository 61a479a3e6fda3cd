#!/usr/bin/env bash
# The gateway (issue 19): `kuai server --upstream` against Debian's nginx as an HTTP/2 +
# TLS 1.3 reverse proxy, both in front of the same upstream (nginx serving files from tmpfs
# over HTTP/1.1, one process), one process each:
#
#   kuai-h3    kuai server --upstream, HTTP/3 in   (load: kuai bench http --protocol http3)
#   kuai-h2    kuai server --upstream, HTTP/2 in   (load: h2load -c 1 -m 64)
#   nginx-h2   nginx proxy_pass, HTTP/2 in         (load: h2load -c 1 -m 64)
#
# Workloads: 1 KB and 100 KB responses with 64 requests in flight on one connection
# (requests per second, and the gateway's CPU microseconds per request), and one 1 GiB
# response (the gateway's CPU seconds per GiB; kuai get -o /dev/null). Rounds alternate the
# gateways (A B C A B C ...); medians [min-max]. The gateway's CPU is its utime + stime from
# /proc/PID/stat around each run.
#
# nginx keeps its defaults except: HTTP/1.1 with keep-alive to the upstream (keepalive 64,
# as kuai pools), and proxy_max_temp_file_size 0 so a large response streams through memory
# as kuai's does instead of going to a temporary file. One worker each: nginx
# worker_processes 1, kuai TOKIO_WORKER_THREADS=1. Access logs off on both (nginx
# access_log off, kuai RUST_LOG=warn).
#
#   bench/gateway.sh [--rounds N] [--requests N] [--kuai BIN]
#
# Needs nginx (nginx-light), h2load (nghttp2-client), openssl.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=3
requests=20000
kuai="${CARGO_TARGET_DIR:-$ROOT/target}/release/kuai"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --requests) requests="$2"; shift 2 ;;
        --kuai) kuai="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gateway.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$kuai" ] || { echo "gateway.sh: no $kuai (cargo build --release -p kuai-cli)" >&2; exit 1; }
for t in nginx h2load openssl; do
    command -v "$t" >/dev/null || { echo "gateway.sh: $t not installed" >&2; exit 1; }
done

up_port=4601
gw_port=4602
tmp="$(mktemp -d -p /dev/shm kuai-gw.XXXXXX)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$tmp/www" "$tmp/up" "$tmp/front"
head -c 1000 /dev/urandom > "$tmp/www/1k.bin"
head -c 100000 /dev/urandom > "$tmp/www/100k.bin"
head -c $((1 << 30)) /dev/urandom > "$tmp/www/1g.bin"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
    -keyout "$tmp/front/key.pem" -out "$tmp/front/cert.pem" 2>/dev/null

temp_paths() {
    for k in client_body proxy fastcgi uwsgi scgi; do echo "    ${k}_temp_path $1;"; done
}
cat > "$tmp/up/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $tmp/up/nginx.pid;
error_log $tmp/up/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
$(temp_paths "$tmp/up")
    server {
        listen 127.0.0.1:$up_port;
        root $tmp/www;
    }
}
EOF
cat > "$tmp/front/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $tmp/front/nginx.pid;
error_log $tmp/front/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
$(temp_paths "$tmp/front")
    upstream up {
        server 127.0.0.1:$up_port;
        keepalive 64;
    }
    server {
        listen 127.0.0.1:$gw_port ssl http2;
        ssl_certificate $tmp/front/cert.pem;
        ssl_certificate_key $tmp/front/key.pem;
        ssl_protocols TLSv1.3;
        http2_max_concurrent_streams 128;
        keepalive_requests 1000000;
        location / {
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_max_temp_file_size 0;
        }
    }
}
EOF

wait_port() {
    for _ in $(seq 1 100); do
        if ss -Htln "sport = :$1" | grep -q .; then return 0; fi
        sleep 0.05
    done
    echo "gateway.sh: nothing listens on $1" >&2
    exit 1
}

nginx -c "$tmp/up/nginx.conf" -p "$tmp/up" >/dev/null 2>&1 &
pids+=($!)
wait_port "$up_port"

hz="$(getconf CLK_TCK)"
cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat"; }
gw_pid=

start_gateway() {
    case "$1" in
        nginx-h2) nginx -c "$tmp/front/nginx.conf" -p "$tmp/front" >/dev/null 2>&1 & ;;
        *) RUST_LOG=warn TOKIO_WORKER_THREADS=1 "$kuai" server --listen "127.0.0.1:$gw_port" \
               --upstream "http://127.0.0.1:$up_port" >/dev/null 2>&1 & ;;
    esac
    gw_pid=$!
    wait_port "$gw_port"
    sleep 0.3
}

stop_gateway() {
    kill "$gw_pid" 2>/dev/null || true
    wait "$gw_pid" 2>/dev/null || true
    gw_pid=
}

# load GATEWAY FILE: the requests, printing "<seconds> <failed>".
load() {
    local url="https://127.0.0.1:$gw_port/$2"
    if [ "$2" = 1g.bin ]; then
        local proto=--http2
        [ "$1" = kuai-h3 ] && proto=--http3
        local t0 t1
        t0="$(date +%s.%N)"
        if "$kuai" get -k --state-file none "$proto" -o /dev/null "$url"; then f=0; else f=1; fi
        t1="$(date +%s.%N)"
        echo "$(echo "$t1 - $t0" | bc) $f"
    elif [ "$1" = kuai-h3 ]; then
        "$kuai" bench http -k --protocol http3 --requests "$requests" --concurrency 64 "$url" |
            python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); print(j["seconds"], j["failed"])'
    else
        h2load -n "$requests" -c 1 -m 64 "$url" |
            python3 -c '
import re,sys
t=sys.stdin.read()
secs=float(re.search(r"finished in ([0-9.]+)(m?s)", t).group(1)) / (1000 if re.search(r"finished in [0-9.]+ms", t) else 1)
ok=int(re.search(r"(\d+) succeeded", t).group(1))
print(secs, int(sys.argv[1]) - ok)' "$requests"
    fi
}

raw="$tmp/raw.txt"
: > "$raw"
gateways=(kuai-h3 kuai-h2 nginx-h2)
for r in $(seq 1 "$rounds"); do
    for f in 1k.bin 100k.bin 1g.bin; do
        for g in "${gateways[@]}"; do
            start_gateway "$g"
            # One warm-up request opens the upstream connections' pool.
            curl -sk -o /dev/null "https://127.0.0.1:$gw_port/1k.bin" || true
            s0="$(cpu_of "$gw_pid")"
            read -r secs failed < <(load "$g" "$f")
            s1="$(cpu_of "$gw_pid")"
            stop_gateway
            echo "$g $f $s0 $s1 $secs $failed" >> "$raw"
            echo "gateway.sh: round $r $f $g: ${secs}s, $failed failed" >&2
        done
    done
done

python3 - "$raw" "$hz" "$requests" "$rounds" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "$(nginx -v 2>&1 | sed 's/.*nginx\///')" <<'EOF'
import collections, statistics, sys
raw, hz, n, rounds, rev, nginx_v = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
d = collections.defaultdict(lambda: collections.defaultdict(list))
failed = collections.Counter()
for line in open(raw):
    g, f, s0, s1, secs, bad = line.split()
    cpu = (float(s1) - float(s0)) / hz
    failed[(g, f)] += int(bad)
    if f == "1g.bin":
        d[(g, f)]["cpu"].append(cpu)  # per GiB
        d[(g, f)]["rate"].append((1 << 30) * 8 / float(secs) / 1e9)
    else:
        d[(g, f)]["cpu"].append(cpu / n * 1e6)  # microseconds per request
        d[(g, f)]["rate"].append(n / float(secs))
def m(x, fmt):
    return f"{fmt.format(statistics.median(x))} [{fmt.format(min(x))}–{fmt.format(max(x))}]"
names = {"kuai-h3": "kuai gateway, HTTP/3 in", "kuai-h2": "kuai gateway, HTTP/2 in",
         "nginx-h2": f"nginx {nginx_v} proxy, HTTP/2 in"}
print(f"kuai {rev}; upstream: nginx {nginx_v} over HTTP/1.1 keep-alive, files in tmpfs; one process each; "
      f"{rounds} rounds A B C; medians [min–max]\n")
print("| gateway | 1 KB: req/s | 1 KB: CPU µs / req | 100 KB: req/s | 100 KB: CPU µs / req | 1 GiB: Gbit/s | 1 GiB: CPU s / GiB |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for g in ["kuai-h3", "kuai-h2", "nginx-h2"]:
    row = [names[g]]
    for f in ["1k.bin", "100k.bin"]:
        row += [m(d[(g, f)]["rate"], "{:.0f}"), m(d[(g, f)]["cpu"], "{:.1f}")]
    row += [m(d[(g, "1g.bin")]["rate"], "{:.2f}"), m(d[(g, "1g.bin")]["cpu"], "{:.2f}")]
    print("| " + " | ".join(row) + " |")
print()
for f, unit in [("1k.bin", "CPU per request, 1 KB"), ("100k.bin", "CPU per request, 100 KB"), ("1g.bin", "CPU per GiB")]:
    ng = statistics.median(d[("nginx-h2", f)]["cpu"])
    print(f"{unit}: kuai HTTP/3 / nginx {statistics.median(d[('kuai-h3', f)]['cpu']) / ng:.2f}, "
          f"kuai HTTP/2 / nginx {statistics.median(d[('kuai-h2', f)]['cpu']) / ng:.2f}")
bad = {k: v for k, v in failed.items() if v}
if bad:
    print(f"\nfailed requests: {bad}")
EOF
