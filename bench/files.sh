#!/usr/bin/env bash
# Serving a file, the path users run, beside the perf protocol and beside nginx (issue 21).
# A file of random bytes in tmpfs (1 GiB by default) is downloaded over loopback by:
#
#   bench        kuai bench server / kuai bench client --bytes N (the perf protocol, no file)
#   kuai-h3      kuai server --root DIR / kuai get --http3 -o /dev/null
#   kuai-h2      kuai server --root DIR / kuai get --http2 -o /dev/null
#   nginx-h2     Debian's nginx, HTTP/2 + TLS 1.3, sendfile on, one process / kuai get --http2
#   kuai-h3-file kuai server --root DIR / kuai get --http3 -o FILE (in tmpfs): the client's
#                cost of writing a download
#
# in rounds A B C D E A B C D E ..., and prints medians [min-max] of the server's and the
# client's CPU seconds per GiB (utime + stime: the server's from /proc/PID/stat around the
# download, the client's from time(1)) and the ratios the issue asks about.
#
#   bench/files.sh [--rounds N] [--bytes N] [--kuai BIN] [--port P] [--workloads "bench kuai-h3 ..."]
#
# Needs nginx (Debian's nginx or nginx-light), openssl and /usr/bin/time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=5
bytes=$((1 << 30))
kuai="${CARGO_TARGET_DIR:-$ROOT/target}/release/kuai"
port=4591
workloads=(bench kuai-h3 kuai-h2 nginx-h2 kuai-h3-file)
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --bytes) bytes="$2"; shift 2 ;;
        --kuai) kuai="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --workloads) read -r -a workloads <<< "$2"; shift 2 ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "files.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$kuai" ] || { echo "files.sh: no $kuai (cargo build --release -p kuai-cli)" >&2; exit 1; }
command -v nginx >/dev/null || { echo "files.sh: nginx not installed (apt-get install nginx-light)" >&2; exit 1; }

tmp="$(mktemp -d -p /dev/shm kuai-files.XXXXXX)"
server_pid=
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$tmp/www" "$tmp/nginx"
head -c "$bytes" /dev/urandom > "$tmp/www/file.bin"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
    -keyout "$tmp/nginx/key.pem" -out "$tmp/nginx/cert.pem" 2>/dev/null
cat > "$tmp/nginx/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $tmp/nginx/nginx.pid;
error_log $tmp/nginx/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path $tmp/nginx;
    proxy_temp_path $tmp/nginx;
    fastcgi_temp_path $tmp/nginx;
    uwsgi_temp_path $tmp/nginx;
    scgi_temp_path $tmp/nginx;
    server {
        listen 127.0.0.1:$port ssl http2;
        ssl_certificate $tmp/nginx/cert.pem;
        ssl_certificate_key $tmp/nginx/key.pem;
        ssl_protocols TLSv1.3;
        root $tmp/www;
    }
}
EOF

hz="$(getconf CLK_TCK)"
cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# start_server NAME: starts the server of a workload, sets server_pid, waits until it listens.
start_server() {
    case "$1" in
        bench) "$kuai" bench server --listen "127.0.0.1:$port" >/dev/null 2>&1 & ;;
        nginx-h2) nginx -c "$tmp/nginx/nginx.conf" -p "$tmp/nginx" >/dev/null 2>&1 & ;;
        *) "$kuai" server --root "$tmp/www" --listen "127.0.0.1:$port" >/dev/null 2>&1 & ;;
    esac
    server_pid=$!
    for _ in $(seq 1 100); do
        if [ "$1" = bench ] || ss -Htln "sport = :$port" | grep -q .; then break; fi
        sleep 0.05
    done
    sleep 0.5
}

# client NAME: the download.
client() {
    local url="https://127.0.0.1:$port/file.bin"
    case "$1" in
        bench) "$kuai" bench client --server "127.0.0.1:$port" --bytes "$bytes" >/dev/null ;;
        kuai-h3) "$kuai" get -k --state-file none --http3 -o /dev/null "$url" ;;
        kuai-h3-file) "$kuai" get -k --state-file none --http3 -o "$tmp/out.bin" "$url" ;;
        kuai-h2|nginx-h2) "$kuai" get -k --state-file none --http2 -o /dev/null "$url" ;;
    esac
}

raw="$tmp/raw.txt"
: > "$raw"
for r in $(seq 1 "$rounds"); do
    for w in "${workloads[@]}"; do
        start_server "$w"
        s0="$(cpu_of "$server_pid")"
        t0="$(date +%s.%N)"
        /usr/bin/time -f "%U %S" -o "$tmp/time" bash -c "$(declare -f client); kuai='$kuai' port='$port' bytes='$bytes' tmp='$tmp' client $w"
        t1="$(date +%s.%N)"
        s1="$(cpu_of "$server_pid")"
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=
        rm -f "$tmp/out.bin"
        read -r cu cs < "$tmp/time"
        echo "$w $s0 $s1 $cu $cs $t0 $t1" >> "$raw"
        echo "files.sh: round $r $w done" >&2
    done
done

# What the kernel charges for writing the file to tmpfs (kuai-h3-file's client pays it).
rm -f "$tmp/dd.bin"
/usr/bin/time -f "%U %S" -o "$tmp/dd.time" dd if=/dev/zero of="$tmp/dd.bin" bs=1M count=$((bytes >> 20)) 2>/dev/null
dd_cpu="$(cat "$tmp/dd.time")"
rm -f "$tmp/dd.bin"
# And for reading it in the file server's 256 KiB reads: the floor of any server that reads
# the file (rather than sending one block again and again, as the perf protocol does).
/usr/bin/time -f "%U %S" -o "$tmp/ddr.time" dd if="$tmp/www/file.bin" of=/dev/null bs=256K 2>/dev/null
ddr_cpu="$(cat "$tmp/ddr.time")"

python3 - "$raw" "$hz" "$bytes" "$rounds" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "$(nginx -v 2>&1 | sed 's/.*nginx\///')" "$dd_cpu" "$ddr_cpu" <<'EOF'
import collections, statistics, sys
raw, hz, nbytes, rounds, rev, nginx_v = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
dd = sum(float(x) for x in sys.argv[7].split()[:2])
ddr = sum(float(x) for x in sys.argv[8].split()[:2])
gib = nbytes / (1 << 30)
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(raw):
    w, s0, s1, cu, cs, t0, t1 = line.split()
    d[w]["server"].append((float(s1) - float(s0)) / hz / gib)
    d[w]["client"].append((float(cu) + float(cs)) / gib)
    d[w]["rate"].append(nbytes * 8 / (float(t1) - float(t0)) / 1e9)
def m(x):
    return f"{statistics.median(x):.2f} [{min(x):.2f}–{max(x):.2f}]"
names = {
    "bench": "`kuai bench` server / client (perf protocol)",
    "kuai-h3": "`kuai server` HTTP/3 / `kuai get --http3 -o /dev/null`",
    "kuai-h2": "`kuai server` HTTP/2 / `kuai get --http2 -o /dev/null`",
    "nginx-h2": f"nginx {nginx_v} HTTP/2 + TLS 1.3 (sendfile, one process) / `kuai get --http2 -o /dev/null`",
    "kuai-h3-file": "`kuai server` HTTP/3 / `kuai get --http3 -o FILE` (tmpfs)",
}
print(f"kuai {rev}, {gib:g} GiB file in tmpfs, loopback, {rounds} rounds A B C D E; CPU seconds per GiB, medians [min–max]\n")
print("| workload | server CPU s / GiB | client CPU s / GiB | Gbit/s |")
print("| --- | --- | --- | --- |")
for w in ["bench", "kuai-h3", "kuai-h2", "nginx-h2", "kuai-h3-file"]:
    if w in d:
        print(f"| {names[w]} | {m(d[w]['server'])} | {m(d[w]['client'])} | {m(d[w]['rate'])} |")
med = lambda w, k: statistics.median(d[w][k])
if "bench" in d and "kuai-h3" in d:
    print(f"\nkuai server HTTP/3 / bench server: {med('kuai-h3','server') / med('bench','server'):.2f} (asked: at most 1.15)")
    print(f"kuai server HTTP/3 - bench server: {med('kuai-h3','server') - med('bench','server'):.2f} s / GiB; "
          f"the kernel's own cost of reading the file (dd from tmpfs, 256 KiB reads): {ddr / gib:.2f} s / GiB")
if "nginx-h2" in d and "kuai-h3" in d:
    print(f"kuai server HTTP/3 / nginx HTTP/2: {med('kuai-h3','server') / med('nginx-h2','server'):.2f} (asked: below 1)")
if "bench" in d and "kuai-h3" in d:
    print(f"kuai get -o /dev/null / bench client: {med('kuai-h3','client') / med('bench','client'):.2f} (asked: at most 1.15)")
if "bench" in d and "kuai-h3-file" in d:
    print(f"kuai get -o FILE / bench client: {med('kuai-h3-file','client') / med('bench','client'):.2f}; "
          f"the kernel's own cost of writing the file (dd to tmpfs): {dd / gib:.2f} s / GiB")
EOF
