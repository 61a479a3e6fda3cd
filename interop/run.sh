#!/usr/bin/env bash
# The interop matrix runner: kuai against independent QUIC implementations, each wrapped as a
# MISSION.md §7 endpoint (env ROLE, TESTCASE, LISTEN, WWW, CERTS, SERVER, REQUESTS, DOWNLOADS...).
#
#   interop/run.sh [--cases a,b,...] [--servers kuai,quic-go,aioquic,ngtcp2,quinn]
#                  [--clients kuai,quic-go,aioquic,ngtcp2,quinn,chromium] [--alpn h3|hq-interop|both]
#                  [--timeout SECONDS] [--results DIR] [--no-wire] [--all-pairs]
#                  [--with-impairments] [--qlog]
#
# Every server x client x case with kuai on at least one side (--all-pairs: every pair) runs on
# loopback: fresh files and a fresh certificate, the server on 127.0.0.1:<free port> ([::1] for
# ipv6), the client fetching every file, then a byte-for-byte comparison. Each endpoint gets
# in TESTCASE the quic-interop-runner's test name for its side (testname() in the runner's
# testcases_quic.py), not the case's name: see testname below. With tshark installed each run is also
# captured and checked on the wire (decrypted with the endpoints' SSLKEYLOGFILE): the negotiated
# version, ALPN, cipher suite, Retry, resumption, 0-RTT, key phase, ECN marks, amplification limit.
#
# The ALPN is h3 (HTTP/3) unless --alpn says hq-interop (HTTP/0.9 over QUIC); --alpn both runs
# the whole matrix twice and prints one set of tables per ALPN. The http3 case is HTTP/3 by
# definition: it is left out of the hq-interop tables. chromium is a client only.
#
# --qlog sets QLOGDIR for both endpoints (<cell>/qlog-server, <cell>/qlog-client).
#
# The default cases need no impairment. --with-impairments adds longrtt, handshakeloss,
# transferloss, handshakecorruption, transfercorruption, blackhole, rebind-port and rebind-addr,
# run through interop/proxy.py between client and server (or name them in --cases).
#
# Cell results: ✓ pass, ✗ fail (logs kept under the results directory; ✗† when known-issues.txt
# lists it as the peer's fault), — unsupported (an endpoint exited 127).
# Results go to interop/results/<date-time>/ unless --results says otherwise. The matrix is
# printed as Markdown and written to <results>/matrix.md. Exit status: 0 when every failed cell
# is a known fault of the peer (✗†), 1 otherwise.
set -u
set -o pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

ALL_IMPLS="kuai quic-go aioquic ngtcp2 quinn chromium"
SERVER_IMPLS="kuai quic-go aioquic ngtcp2 quinn"  # chromium is a client only
DEFAULT_CASES="versionnegotiation handshake transfer multiplexing chacha20 retry resumption zerortt http3 keyupdate v2 ecn amplificationlimit ipv6 connectionmigration goodput"
# Cases that need an impairment (delay, loss, corruption, black hole, rebinding) between client
# and server.
IMPAIRED_CASES="longrtt handshakeloss transferloss handshakecorruption transfercorruption blackhole rebind-port rebind-addr"

cases=$DEFAULT_CASES
servers=$SERVER_IMPLS
clients=$ALL_IMPLS
alpn_arg=h3
run_timeout=60
results=""
wire=auto
all_pairs=0
qlog=0

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cases) cases=${2//,/ }; shift 2 ;;
        --servers) servers=${2//,/ }; shift 2 ;;
        --clients) clients=${2//,/ }; shift 2 ;;
        --alpn) alpn_arg=$2; shift 2 ;;
        --timeout) run_timeout=$2; shift 2 ;;
        --results) results=$2; shift 2 ;;
        --no-wire) wire=off; shift ;;
        --all-pairs) all_pairs=1; shift ;;
        --with-impairments) cases="$cases $IMPAIRED_CASES"; shift ;;
        --qlog) qlog=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

for impl in $servers $clients; do
    case " $ALL_IMPLS " in *" $impl "*) ;; *) echo "run.sh: unknown implementation $impl" >&2; exit 2 ;; esac
done
for impl in $servers; do
    case " $SERVER_IMPLS " in *" $impl "*) ;; *) echo "run.sh: $impl is a client only" >&2; exit 2 ;; esac
done
case "$alpn_arg" in
    h3|hq-interop) alpns=$alpn_arg ;;
    both) alpns="h3 hq-interop" ;;
    *) echo "run.sh: --alpn must be h3, hq-interop or both" >&2; exit 2 ;;
esac

if [ -z "$results" ]; then
    results="$HERE/results/$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$results"
results=$(cd "$results" && pwd)

if [ "$wire" = auto ]; then
    if command -v tshark >/dev/null && command -v dumpcap >/dev/null; then wire=on; else
        echo "run.sh: tshark/dumpcap not installed: no wire checks (interop/install.sh installs them)" >&2
        wire=off
    fi
fi

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------------------------------------
# Endpoints

KUAI_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/kuai"
QUICGO_BIN="$HERE/quic-go/quic-go-endpoint"
AIOQUIC_PY="$HERE/aioquic/endpoint.py"
NGTCP2_PY="$HERE/ngtcp2/endpoint.py"
CHROMIUM_PY="$HERE/chromium/endpoint.py"
QUINN_BIN="$HERE/quinn/target/release/quinn-interop-endpoint"

prepare_impl() {
    case "$1" in
        kuai)
            if [ ! -x "$KUAI_BIN" ]; then
                log "building kuai (cargo build --release -p kuai-cli)"
                (cd "$ROOT" && cargo build --release -p kuai-cli) >&2 || { echo "run.sh: kuai build failed" >&2; exit 1; }
            fi ;;
        quic-go)
            if [ ! -x "$QUICGO_BIN" ]; then
                log "building the quic-go endpoint"
                (cd "$HERE/quic-go" && go build -o quic-go-endpoint .) >&2 || { echo "run.sh: quic-go build failed (run interop/install.sh)" >&2; exit 1; }
            fi ;;
        aioquic)
            python3 -c 'import aioquic' 2>/dev/null || { echo "run.sh: aioquic missing (run interop/install.sh)" >&2; exit 1; } ;;
        ngtcp2)
            { command -v gtlsclient && command -v gtlsserver; } >/dev/null 2>&1 ||
                { echo "run.sh: gtlsclient/gtlsserver missing (apt-get install ngtcp2-client ngtcp2-server)" >&2; exit 1; } ;;
        quinn)
            if [ ! -x "$QUINN_BIN" ]; then
                log "building the quinn endpoint"
                cargo build --release --locked -q --manifest-path "$HERE/quinn/Cargo.toml" \
                    --target-dir "$HERE/quinn/target" >&2 ||
                    { echo "run.sh: quinn endpoint build failed (run interop/install.sh)" >&2; exit 1; }
            fi ;;
        chromium)
            ROLE=prepare python3 "$CHROMIUM_PY" >&2 ||
                { echo "run.sh: chromium or websocket-client missing (run interop/install.sh)" >&2; exit 1; } ;;
    esac
}

# endpoint_cmd IMPL: the command line of an implementation's §7 endpoint.
endpoint_cmd() {
    case "$1" in
        kuai) echo "$KUAI_BIN interop" ;;
        quic-go) echo "$QUICGO_BIN" ;;
        aioquic) echo "python3 $AIOQUIC_PY" ;;
        ngtcp2) echo "python3 $NGTCP2_PY" ;;
        quinn) echo "$QUINN_BIN" ;;
        chromium) echo "python3 $CHROMIUM_PY" ;;
    esac
}

# testname CASE ROLE: the TESTCASE an endpoint gets, as quic-interop-runner's testname() gives
# it per perspective (testcases_quic.py): several cases share a test name, and two give the
# client and the server different ones.
testname() {
    case "$1/$2" in
        handshakeloss/*|handshakecorruption/*) echo multiconnect ;;
        multiplexing/*|transferloss/*|transfercorruption/*|blackhole/*|rebind-port/*|rebind-addr/*) echo transfer ;;
        amplificationlimit/*|ipv6/*|goodput/*) echo transfer ;;
        longrtt/*) echo handshake ;;
        keyupdate/server) echo transfer ;;
        connectionmigration/client) echo transfer ;;
        *) echo "$1" ;;
    esac
}

# server_host CASE: the address the server listens on (ipv6: IPv6 loopback only).
server_host() { if [ "$1" = ipv6 ]; then echo "::1"; else echo "127.0.0.1"; fi; }
# hostport HOST PORT: host:port, bracketing an IPv6 address.
hostport() { case "$1" in *:*) echo "[$1]:$2" ;; *) echo "$1:$2" ;; esac; }

free_port() {
    python3 -c 'import socket, sys
h = sys.argv[1]
s = socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET, socket.SOCK_DGRAM)
s.bind((h, 0)); print(s.getsockname()[1])' "${1:-127.0.0.1}"
}

# case_timeout CASE: seconds a client gets (handshakeloss makes many connections through 30 % loss).
case_timeout() {
    case "$1" in
        handshakeloss|handshakecorruption) echo $((run_timeout * 3)) ;;
        transferloss|transfercorruption|blackhole|longrtt) echo $((run_timeout * 2)) ;;
        *) echo "$run_timeout" ;;
    esac
}

# make_files CASE DIR: random files served by the server; prints their names.
make_files() {
    local case=$1 dir=$2 n i size
    mkdir -p "$dir"
    case "$case" in
        transfer) set -- 2097152 1048576 1048576 524288 ;;
        goodput) set -- 5242880 ;;
        keyupdate) set -- 2097152 ;;  # enough packets for quic-go's automatic first key update
        transferloss|transfercorruption) set -- 2097152 1048576 ;;
        longrtt|versionnegotiation) set -- 1024 ;;
        ipv6) set -- 5120 10240 ;;
        blackhole) set -- 5242880 ;;  # the proxy blacks out after 1 MB
        rebind-port|rebind-addr) set -- 3145728 ;;  # the proxy rebinds every 300 datagrams
        connectionmigration) set -- 3145728 1048576 ;;  # long enough to move mid-transfer
        multiplexing|handshakeloss|handshakecorruption)
            n=200; [ "$case" = multiplexing ] || n=50
            for i in $(seq 1 "$n"); do
                size=$((1024 + RANDOM % 3072))
                head -c "$size" /dev/urandom > "$dir/m$i.bin"
                echo "m$i.bin"
            done
            return ;;
        resumption|zerortt) set -- 102400 65536 65536 32768 ;;
        http3) set -- 5120 10240 524288 ;;
        *) set -- 102400 98304 ;;
    esac
    i=0
    for size in "$@"; do
        i=$((i + 1))
        head -c "$size" /dev/urandom > "$dir/f$i.bin"
        echo "f$i.bin"
    done
}

# make_certs CASE DIR: cert.pem (leaf first, then intermediates) and priv.key for localhost,
# 127.0.0.1 and ::1. amplificationlimit gets a chain made as quic-interop-runner's certs.sh
# makes it for that case: nine ECDSA P-256 certificates under a root that is not sent (eight
# intermediates with the runner's CA extensions, and a leaf carrying twenty 250-character DNS
# names besides ours), about 9 KB, so that the server's first flight exceeds 3x the client's
# Initial and the server has to wait for the client's address validation.
make_certs() {
    local case=$1 dir=$2 chain=1 i
    mkdir -p "$dir"
    [ "$case" = amplificationlimit ] && chain=9
    (
        cd "$dir" || exit 1
        local san="DNS:localhost,IP:127.0.0.1,IP:::1"
        if [ "$chain" = 1 ]; then
            openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
                -keyout priv.key -out cert.pem -days 2 -subj /CN=localhost \
                -addext "subjectAltName=$san" 2>/dev/null
            exit $?
        fi
        printf '%s\n' "keyUsage=critical,keyCertSign" "subjectKeyIdentifier=hash" \
            "authorityKeyIdentifier=keyid:always,issuer:always" \
            "basicConstraints=critical,CA:TRUE,pathlen:100" > ca.ext
        for i in $(seq 1 20); do
            san="$san,DNS:$(LC_ALL=C tr -dc '[:alnum:]' < /dev/urandom | head -c 250)"
        done
        printf 'subjectAltName=%s\n' "$san" > leaf.ext
        openssl ecparam -name prime256v1 -genkey -noout -out ca0.key 2>/dev/null || exit 1
        openssl req -x509 -sha256 -new -key ca0.key -out ca0.pem -days 2 \
            -subj "/O=kuai interop root/" -addext basicConstraints=critical,CA:TRUE 2>/dev/null || exit 1
        for i in $(seq 1 "$chain"); do
            openssl ecparam -name prime256v1 -genkey -noout -out "ca$i.key" 2>/dev/null || exit 1
            local subj="/O=kuai interop intermediate $i/" ext=ca.ext
            [ "$i" = "$chain" ] && subj="/O=kuai interop leaf/CN=localhost" ext=leaf.ext
            openssl req -new -key "ca$i.key" -out "ca$i.csr" -subj "$subj" 2>/dev/null || exit 1
            openssl x509 -req -sha256 -in "ca$i.csr" -CA "ca$((i - 1)).pem" -CAkey "ca$((i - 1)).key" \
                -CAcreateserial -days 2 -extfile "$ext" -out "ca$i.pem" 2>/dev/null || exit 1
        done
        openssl pkcs8 -topk8 -nocrypt -in "ca$chain.key" -out priv.key || exit 1
        : > cert.pem
        for i in $(seq "$chain" -1 1); do cat "ca$i.pem" >> cert.pem; done
        rm -f ./*.csr ./*.ext ./*.srl ./ca[1-9]*.key ./ca[1-9]*.pem
    )
}

# ---------------------------------------------------------------------------------------------
# The path between client and server.
#
# path_start CASE SERVER_PORT DIR sets PATH_TARGET, the address the client sends to. Cases without
# impairment talk to the server directly; the impaired ones go through proxy.py (delay, loss,
# corruption, black hole, NAT rebinding), which listens on a fresh port and forwards to the
# server. The capture
# filters on the server's port, so it shows the path as the server sees it.
PATH_PID=""
# amplificationlimit goes through it too: as the runner's scenario for that case, it lets the
# client's first datagram through and drops its 2nd to 7th, so that the server has only the
# first one to count on and has to stop at the limit.
path_needs_proxy() { case " $IMPAIRED_CASES amplificationlimit " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
path_start() {
    local case=$1 port=$2 dir=$3 pport
    PATH_TARGET="$(hostport "$(server_host "$case")" "$port")"
    PATH_PID=""
    # INTEROP_PROXY_MODE=<proxy.py mode> forces the proxy onto every case (for diagnosis).
    [ -n "${INTEROP_PROXY_MODE:-}" ] || path_needs_proxy "$case" || return 0
    pport=$(free_port)
    python3 "$HERE/proxy.py" --listen "127.0.0.1:$pport" --server "127.0.0.1:$port" \
        --mode "${INTEROP_PROXY_MODE:-$case}" \
        > "$dir/proxy.log" 2>&1 &
    PATH_PID=$!
    wait_udp_bound "$pport" "$PATH_PID" || return 1
    PATH_TARGET="127.0.0.1:$pport"
}
path_stop() {
    if [ -n "$PATH_PID" ]; then kill "$PATH_PID" 2>/dev/null; wait "$PATH_PID" 2>/dev/null; fi
    PATH_PID=""
}

# ---------------------------------------------------------------------------------------------
# One run

# stop_group PID: end a process group this script started (setsid), politely then firmly.
stop_group() {
    local pid=$1 i
    kill -TERM -- "-$pid" 2>/dev/null || return 0
    for i in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

# wait_udp_bound PORT PID: wait until something listens on the UDP port (or the server died).
wait_udp_bound() {
    local port=$1 pid=$2 i
    for i in $(seq 1 100); do
        # Local addresses in /proc/net/udp* are HEXIP:HEXPORT.
        if awk -v p="$(printf ':%04X' "$port")" 'NR > 1 && substr($2, length($2) - 4) == p { found = 1 } END { exit !found }' \
            /proc/net/udp /proc/net/udp6 2>/dev/null; then return 0; fi
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}

# spki_sha256 CERT: base64 of the SHA-256 of the certificate's SubjectPublicKeyInfo (the pin
# Chromium's --ignore-certificate-errors-spki-list takes), as CERT_SPKI_SHA256 for the clients.
spki_sha256() {
    openssl x509 -in "$1" -pubkey -noout | openssl pkey -pubin -outform der |
        openssl dgst -sha256 -binary | base64
}

# last_words LOG: the last non-empty line of an endpoint's log, for the reason of a cell.
last_words() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-300; }

# run_cell SERVER CLIENT CASE: runs one cell with ALPN $alpn; echoes pass|fail|unsupported.
run_cell() {
    local server=$1 client=$2 case=$3
    local dir="$results/$alpn/$case/$server--$client"
    rm -rf "$dir"
    mkdir -p "$dir/downloads"
    local files port cap_pid="" srv_pid srv_rc cli_rc reason="" host
    files=$(make_files "$case" "$dir/www")
    host=$(server_host "$case")
    if ! make_certs "$case" "$dir/certs"; then
        echo "cannot make certificates" > "$dir/reason"
        echo fail
        return
    fi
    local spki
    spki=$(spki_sha256 "$dir/certs/cert.pem")
    port=$(free_port "$host")

    if [ "$wire" = on ]; then
        # A 64 MiB capture buffer: at the default 2 MiB a loaded machine dropped a third of a
        # 2 MiB transfer's packets, and a capture with holes fails the wire checks.
        dumpcap -q -B 64 -i lo -f "udp port $port" -w "$dir/trace.pcapng" 2> "$dir/dumpcap.log" &
        cap_pid=$!
        # dumpcap prints "Capturing on" before it opens the interface, and "File:" once the
        # interface is open with its filter and the output file's header is written: only then
        # is every packet captured. A cold machine took over 0.1 s between the two, long enough
        # for a whole handshake to go by unseen.
        local i
        for i in $(seq 1 200); do
            grep -q "^File:" "$dir/dumpcap.log" 2>/dev/null && [ -s "$dir/trace.pcapng" ] && break
            sleep 0.1
        done
    fi

    # Server
    (
        cd "$dir" || exit 1
        [ "$qlog" = 1 ] && export QLOGDIR="$dir/qlog-server"
        exec env ROLE=server TESTCASE="$(testname "$case" server)" ALPN="$alpn" LISTEN="$(hostport "$host" "$port")" \
            WWW="$dir/www" CERTS="$dir/certs" SSLKEYLOGFILE="$dir/keys-server.log" \
            RUST_LOG="${RUST_LOG:-info}" \
            setsid $(endpoint_cmd "$server")
    ) > "$dir/server.log" 2>&1 &
    srv_pid=$!
    if ! wait_udp_bound "$port" "$srv_pid"; then
        wait "$srv_pid" 2>/dev/null
        srv_rc=$?
        [ -n "$cap_pid" ] && { kill "$cap_pid" 2>/dev/null; wait "$cap_pid" 2>/dev/null; }
        if [ "$srv_rc" = 127 ]; then
            echo "server: $(last_words "$dir/server.log")" > "$dir/reason"
            echo unsupported
        else
            echo "server did not start (exit $srv_rc)" > "$dir/reason"
            echo fail
        fi
        return
    fi

    if ! path_start "$case" "$port" "$dir"; then
        stop_group "$srv_pid"
        [ -n "$cap_pid" ] && { kill "$cap_pid" 2>/dev/null; wait "$cap_pid" 2>/dev/null; }
        echo "the impairment proxy did not start" > "$dir/reason"
        echo fail
        return
    fi

    # Client
    local requests="" f
    for f in $files; do requests="$requests https://localhost:$port/$f"; done
    local t0 t1
    t0=$(date +%s.%N)
    (
        cd "$dir" || exit 1
        [ "$qlog" = 1 ] && export QLOGDIR="$dir/qlog-client"
        exec env ROLE=client TESTCASE="$(testname "$case" client)" ALPN="$alpn" SERVER="$PATH_TARGET" \
            REQUESTS="${requests# }" DOWNLOADS="$dir/downloads" SSLKEYLOGFILE="$dir/keys-client.log" \
            CERT_SPKI_SHA256="$spki" \
            RUST_LOG="${RUST_LOG:-info}" \
            timeout -k 5 "$(case_timeout "$case")" $(endpoint_cmd "$client")
    ) > "$dir/client.log" 2>&1
    cli_rc=$?
    t1=$(date +%s.%N)
    echo "$cli_rc" > "$dir/client.rc"
    python3 -c "import sys; print('%.2f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$t0" "$t1" > "$dir/client.seconds"

    path_stop
    # Let the last packets (CONNECTION_CLOSE) reach the capture, then stop the server.
    sleep 0.2
    if kill -0 "$srv_pid" 2>/dev/null; then
        stop_group "$srv_pid"
        srv_rc=running
    else
        wait "$srv_pid" 2>/dev/null
        srv_rc=$?
    fi
    echo "$srv_rc" > "$dir/server.rc"
    if [ -n "$cap_pid" ]; then
        kill "$cap_pid" 2>/dev/null
        wait "$cap_pid" 2>/dev/null
    fi
    cat "$dir"/keys-*.log > "$dir/keys.log" 2>/dev/null

    if [ "$cli_rc" = 127 ] || [ "$srv_rc" = 127 ]; then
        if [ "$cli_rc" = 127 ]; then
            echo "client: $(last_words "$dir/client.log")" > "$dir/reason"
        else
            echo "server: $(last_words "$dir/server.log")" > "$dir/reason"
        fi
        echo unsupported
        return
    fi
    if [ "$srv_rc" = 143 ] || [ "$srv_rc" = 137 ]; then
        reason="server killed by signal $((srv_rc - 128)) from outside this script (client exit $cli_rc)"
    elif [ "$cli_rc" = 143 ]; then
        reason="client killed by SIGTERM from outside this script"
    elif [ "$srv_rc" != running ]; then
        reason="server exited early (exit $srv_rc)"
    elif [ "$cli_rc" = 124 ] || [ "$cli_rc" = 137 ]; then
        reason="client timed out after $(case_timeout "$case")s"
    elif [ "$cli_rc" != 0 ]; then
        reason="client exited $cli_rc"
    else
        local bad=0 missing=0
        for f in $files; do
            # versionnegotiation: the runner's client gives up after the Version Negotiation
            # packet; one that goes on in a version the server offered must bring the file.
            if [ ! -f "$dir/downloads/$f" ]; then
                [ "$case" = versionnegotiation ] || missing=$((missing + 1))
            elif ! cmp -s "$dir/www/$f" "$dir/downloads/$f"; then bad=$((bad + 1)); fi
        done
        if [ "$missing" != 0 ] || [ "$bad" != 0 ]; then
            reason="$missing file(s) missing, $bad file(s) differ"
        fi
    fi
    if [ -z "$reason" ] && [ "$wire" = on ]; then
        if ! python3 "$HERE/wirecheck.py" --case "$case" --port "$port" --pcap "$dir/trace.pcapng" \
            --keylog "$dir/keys.log" --files "$(echo $files | wc -w)" --alpn "$alpn" \
            > "$dir/wirecheck.log" 2>&1; then
            reason="wire check: $(tail -n 1 "$dir/wirecheck.log")"
            # "Packets received/dropped on interface 'Loopback: lo': 1634/530 (...)"
            local dropped
            dropped=$(sed -n "s|.*received/dropped on interface.*': *[0-9]*/\([0-9]*\).*|\1|p" \
                "$dir/dumpcap.log" | head -n 1)
            # A client that brought its files talked to the server: a capture that holds
            # none of its packets did not run, it says nothing about the endpoints.
            local captured
            captured=$(sed -n 's|^Packets captured: *\([0-9]*\).*|\1|p' "$dir/dumpcap.log" | head -n 1)
            if [ "${dropped:-0}" != 0 ]; then
                reason="capture incomplete (dumpcap dropped $dropped packets), $reason"
            elif [ "${captured:-}" = 0 ]; then
                reason="capture incomplete (dumpcap captured no packets), $reason"
            fi
        fi
    fi
    # Goodput: bytes served / client run time.
    if [ -z "$reason" ] && [ "$case" = goodput ]; then
        local bytes
        bytes=$(cat "$dir/www"/* | wc -c)
        python3 -c "import sys; b,t0,t1=int(sys.argv[1]),float(sys.argv[2]),float(sys.argv[3]); print('%.1f Mbit/s' % (b*8/(t1-t0)/1e6))" \
            "$bytes" "$t0" "$t1" > "$dir/goodput"
    fi
    if [ -n "$reason" ]; then
        echo "$reason" > "$dir/reason"
        echo fail
    else
        rm -rf "$dir/www" "$dir/downloads"  # keep the logs and the capture, not the payload
        echo pass
    fi
}

# ---------------------------------------------------------------------------------------------
# The matrix

for impl in $(echo "$servers $clients" | tr ' ' '\n' | sort -u); do prepare_impl "$impl"; done

# Known peer faults (known-issues.txt): "CASE SERVER CLIENT [ALPN] | explanation"; without an
# ALPN the line holds for both.
declare -A known
if [ -f "$HERE/known-issues.txt" ]; then
    while IFS= read -r line; do
        case "$line" in ''|'#'*) continue ;; esac
        read -r k_case k_server k_client k_alpn <<< "${line%%|*}"
        for a in ${k_alpn:-h3 hq-interop}; do
            note=${line#*|}
            note=${note#"${note%%[![:space:]]*}"}  # trim leading blanks (quotes are text)
            known["$a/$k_case/$k_server/$k_client"]=$note
        done
    done < "$HERE/known-issues.txt"
fi

# alpn_cases ALPN: the cases run with that ALPN (http3 only with h3).
alpn_cases() {
    local c
    for c in $cases; do
        [ "$c" = http3 ] && [ "$1" != h3 ] && continue
        echo "$c"
    done
}

declare -A cell
failures=()
unsupported=()
npass=0; nfail=0; nunsup=0; nknown=0
log "results in $results (ALPN: $alpns; wire checks: $wire)"
for alpn in $alpns; do
    for case in $(alpn_cases "$alpn"); do
        for server in $servers; do
            for client in $clients; do
                if [ "$all_pairs" = 0 ] && [ "$server" != kuai ] && [ "$client" != kuai ]; then continue; fi
                d="$results/$alpn/$case/$server--$client"
                r=$(run_cell "$server" "$client" "$case")
                # A wire check that failed on a capture with holes says nothing about the
                # endpoints: run the cell again (twice at most), and say so.
                for again in 1 2; do
                    [ "$r" = fail ] && grep -q '^capture incomplete' "$d/reason" 2>/dev/null || break
                    log "$alpn $case: server $server, client $client: $(cat "$d/reason"); running it again"
                    r=$(run_cell "$server" "$client" "$case")
                done
                k="$alpn/$case/$server/$client"
                cell["$k"]=$r
                extra=""
                [ -f "$d/reason" ] && extra=" ($(cat "$d/reason"))"
                [ -f "$d/goodput" ] && extra=" ($(cat "$d/goodput"))"
                [ -f "$d/client.seconds" ] && extra="$extra [client ran $(cat "$d/client.seconds") s]"
                log "$alpn $case: server $server, client $client: $r$extra"
                case "$r" in
                    pass) npass=$((npass + 1)) ;;
                    fail)
                        nfail=$((nfail + 1))
                        note=""
                        if [ -n "${known[$k]:-}" ]; then
                            note=" [known peer issue: ${known[$k]}]"
                            nknown=$((nknown + 1))
                        fi
                        failures+=("$alpn $case: server $server, client $client: $(cat "$d/reason" 2>/dev/null)$note — logs in $d") ;;
                    unsupported)
                        nunsup=$((nunsup + 1))
                        unsupported+=("$alpn $case: server $server, client $client: $(cat "$d/reason" 2>/dev/null)") ;;
                esac
            done
        done
    done
done

symbol() {
    case "$1" in
        pass) printf '✓' ;; fail) printf '✗' ;; unsupported) printf "—" ;; *) printf ' ' ;;
    esac
}

{
    echo "# kuai interop matrix"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), ALPN $alpns, kuai $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet HEAD -- crates 2>/dev/null || echo '+dirty') (binary of $(date -u -r "$KUAI_BIN" '+%Y-%m-%d %H:%M UTC' 2>/dev/null)), wire checks $wire."
    echo "✓ pass, ✗ fail (✗† a known fault of the peer, see interop/known-issues.txt), — unsupported (exit 127)."
    echo "Rows: server; columns: client."
    for alpn in $alpns; do
        echo
        echo "## ALPN $alpn"
        for case in $(alpn_cases "$alpn"); do
            echo
            echo "### $case ($alpn)"
            echo
            printf '| server \\ client |'
            for client in $clients; do printf ' %s |' "$client"; done
            echo
            printf '|---|'
            for client in $clients; do printf ':-:|'; done
            echo
            for server in $servers; do
                printf '| %s |' "$server"
                for client in $clients; do
                    k="$alpn/$case/$server/$client"
                    if [ -n "${cell[$k]:-}" ]; then
                        s=$(symbol "${cell[$k]}")
                        [ "${cell[$k]}" = fail ] && [ -n "${known[$k]:-}" ] && s="$s†"
                        g="$results/$alpn/$case/$server--$client/goodput"
                        [ "${cell[$k]}" = pass ] && [ -f "$g" ] && s="$s $(cat "$g")"
                        printf ' %s |' "$s"
                    else
                        printf '   |'
                    fi
                done
                echo
            done
        done
    done
    echo
    echo "$npass passed, $nfail failed, $nunsup unsupported"
    if [ ${#failures[@]} -gt 0 ]; then
        echo
        echo "Failures:"
        for f in "${failures[@]}"; do echo "- $f"; done
    fi
    if [ ${#unsupported[@]} -gt 0 ]; then
        echo
        echo "Unsupported:"
        for f in "${unsupported[@]}"; do echo "- $f"; done
    fi
} | tee "$results/matrix.md"
echo
echo "matrix written to $results/matrix.md"
# A peer's known fault is reported, not held against kuai.
[ "$nfail" = "$nknown" ]
