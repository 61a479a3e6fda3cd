#!/usr/bin/env bash
# Measures kuai netsim's own overhead: the RTT it adds with no impairment, its timing error
# under a configured delay, and how fast it forwards. Needs root, ping (iputils-ping) and
# iperf3; uses the kuai binary given as $KUAI (default: target/release/kuai).
# Every step is bounded in time; the namespaces it makes are removed on exit.
set -euo pipefail
KUAI="${KUAI:-target/release/kuai}"
for tool in ping iperf3 "$KUAI"; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done
NS=nsbench
cleanup() { ip netns del "$NS-a" 2>/dev/null || true; ip netns del "$NS-b" 2>/dev/null || true; }
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
netsim() { timeout 120 "$KUAI" netsim --name "$NS" --seed 1 "$@"; }

step "baseline: ping over a kernel veth pair between two namespaces"
cleanup
ip netns add "$NS-a"; ip netns add "$NS-b"
ip link add "$NS-x" type veth peer name "$NS-y"
ip link set "$NS-x" netns "$NS-a"; ip link set "$NS-y" netns "$NS-b"
ip -n "$NS-a" addr add 10.78.0.1/24 dev "$NS-x"; ip -n "$NS-a" link set "$NS-x" up
ip -n "$NS-b" addr add 10.78.0.2/24 dev "$NS-y"; ip -n "$NS-b" link set "$NS-y" up
timeout 60 ip netns exec "$NS-b" ping -q -c 500 -i 0.005 10.78.0.1 | tail -1
cleanup

step "netsim, no impairment: ping"
netsim -- -- ping -q -c 500 -i 0.005 10.77.0.1 2>&1 | grep -E 'rtt|lateness'

step "netsim, --delay 10ms (expect 20 ms RTT): ping"
netsim --delay 10ms -- -- ping -q -c 200 -i 0.02 10.77.0.1 2>&1 | grep -E 'rtt|lateness'

step "netsim, no impairment: TCP bulk (iperf3, 5 s, server to client)"
netsim --wait-port 5201 -- iperf3 -s -1 -B 10.77.0.1 -- iperf3 -c 10.77.0.1 -R -t 5 -f m 2>&1 \
  | grep -E 'receiver|sender|netsim: (up|down) *:.*packets in'

step "netsim, no impairment: UDP at 1 Gbit/s offered (iperf3, 1400-byte datagrams, 5 s)"
netsim --wait-port 5201 -- iperf3 -s -1 -B 10.77.0.1 -- iperf3 -c 10.77.0.1 -u -b 1G -l 1400 -t 5 -f m 2>&1 \
  | grep -E 'receiver|netsim: up *:'

step "netsim, --rate 100mbit --delay 10ms: UDP at 95 Mbit/s (timing accuracy at 100 Mbit/s)"
netsim --rate 100mbit --delay 10ms --wait-port 5201 -- iperf3 -s -1 -B 10.77.0.1 -- \
  iperf3 -c 10.77.0.1 -u -b 95M -l 1400 -t 5 -f m 2>&1 | grep -E 'receiver|netsim: up'

step "netsim, --rate 100mbit --delay 10ms --queue 100: TCP bulk"
netsim --rate 100mbit --delay 10ms --queue 100 --wait-port 5201 -- iperf3 -s -1 -B 10.77.0.1 -- \
  iperf3 -c 10.77.0.1 -t 5 -f m 2>&1 | grep -E 'receiver|netsim: up'
