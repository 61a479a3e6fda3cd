#!/usr/bin/env bash
# Installs what interop/run.sh needs on a fresh machine, idempotently, from the package
# registries only (Go modules, PyPI, Debian):
#   - the quic-go endpoint: Go module download + build into interop/quic-go/quic-go-endpoint;
#   - the quinn endpoint: its crates (quinn, h3, h3-quinn, rustls, tokio) and a release build
#     into its own target directory, interop/quinn/target (--no-quinn skips it);
#   - aioquic (pip);
#   - optional, a failure is only a warning: Debian's ngtcp2-client/ngtcp2-server, chromium
#     (with websocket-client from pip, which drives it over DevTools), and tshark (with
#     dumpcap) for the wire checks; openssl if missing.
# kuai itself is built by run.sh (cargo build --release -p kuai-cli) when its binary is missing.
#
#   interop/install.sh [--no-apt] [--no-chromium] [--no-quinn]
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
use_apt=1
chromium=1
quinn=1
for arg in "$@"; do
    case "$arg" in
        --no-apt) use_apt=0 ;;
        --no-chromium) chromium=0 ;;
        --no-quinn) quinn=0 ;;
        *) echo "install.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done
status=0

say() { echo "install.sh: $*" >&2; }

# --- quic-go ------------------------------------------------------------------------------------
if command -v go >/dev/null; then
    if (cd "$HERE/quic-go" && go mod download && go build -o quic-go-endpoint .); then
        say "quic-go endpoint built: $HERE/quic-go/quic-go-endpoint"
    else
        say "ERROR: building the quic-go endpoint failed"
        status=1
    fi
else
    say "ERROR: go is not installed (the quic-go endpoint needs Go >= 1.26)"
    status=1
fi

# --- quinn -------------------------------------------------------------------------------------
if [ "$quinn" = 1 ]; then
    if ! command -v cargo >/dev/null; then
        say "ERROR: cargo is not installed (the quinn endpoint is a Rust program)"
        status=1
    elif cargo build --release --locked -q --manifest-path "$HERE/quinn/Cargo.toml" \
            --target-dir "$HERE/quinn/target"; then
        say "quinn endpoint built: $HERE/quinn/target/release/quinn-interop-endpoint"
    else
        say "ERROR: building the quinn endpoint failed"
        status=1
    fi
fi

# --- aioquic ------------------------------------------------------------------------------------
if python3 -c 'import aioquic' 2>/dev/null; then
    say "aioquic $(python3 -c 'import aioquic; print(aioquic.__version__)') already installed"
elif python3 -m pip install --quiet 'aioquic>=1.2'; then
    say "aioquic installed"
else
    say "ERROR: pip install aioquic failed"
    status=1
fi

# --- websocket-client (drives Chromium through DevTools; optional) -----------------------------
if ! python3 -c 'import websocket' 2>/dev/null; then
    python3 -m pip install --quiet websocket-client && say "websocket-client installed" ||
        say "WARNING: pip install websocket-client failed (the chromium client needs it)"
fi

# --- Debian packages (optional) -----------------------------------------------------------------
apt_missing=()
command -v ngtcp2-client >/dev/null 2>&1 || dpkg -s ngtcp2-client >/dev/null 2>&1 || apt_missing+=(ngtcp2-client)
dpkg -s ngtcp2-server >/dev/null 2>&1 || apt_missing+=(ngtcp2-server)
command -v tshark >/dev/null 2>&1 || apt_missing+=(tshark)
[ "$chromium" = 1 ] && ! command -v chromium >/dev/null 2>&1 && apt_missing+=(chromium)
command -v openssl >/dev/null 2>&1 || apt_missing+=(openssl)

if [ ${#apt_missing[@]} -eq 0 ]; then
    say "Debian packages present (ngtcp2, chromium, tshark, openssl)"
elif [ "$use_apt" = 0 ]; then
    say "skipping apt (--no-apt); missing: ${apt_missing[*]}"
elif ! command -v apt-get >/dev/null 2>&1; then
    say "WARNING: no apt-get; missing: ${apt_missing[*]}"
else
    SUDO=""
    [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    # tshark asks whether non-root users may capture; answer no without a prompt.
    echo "wireshark-common wireshark-common/install-setuid boolean false" | $SUDO debconf-set-selections 2>/dev/null
    if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${apt_missing[@]}" >/dev/null; then
        say "installed: ${apt_missing[*]}"
    else
        # One by one, so that one unavailable package does not block the others.
        for p in "${apt_missing[@]}"; do
            $SUDO apt-get install -y -qq "$p" >/dev/null 2>&1 && say "installed $p" || say "WARNING: could not install $p (optional)"
        done
    fi
fi
command -v openssl >/dev/null 2>&1 || { say "ERROR: openssl is needed to make test certificates"; status=1; }

exit $status
