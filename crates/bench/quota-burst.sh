#!/usr/bin/env bash
# Per-client quota under a burst (BENCHMARKS.md, "Quota"): one coordinator and one agent on
# loopback; client alice starts N concurrent `sleep 5` calls on the host, then client bob times
# three calls of an `echo` tool. Prints how many of alice's calls ran and were refused, and bob's
# latencies.
#
#   crates/bench/quota-burst.sh            # N=160
#   BURST=40 crates/bench/quota-burst.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cargo build --quiet --manifest-path "$root/Cargo.toml" --bins
bin="${CARGO_TARGET_DIR:-$root/target}/debug"
burst="${BURST:-160}"
work=$(mktemp -d /tmp/toolsrv-quota.XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
"$bin/toolsrv" pki init pki --agents a --clients alice,bob >/dev/null
mkdir tools
echo '{"description": "sleeps", "cmd": "sleep 5"}' > tools/slow.meta
echo '{"description": "echoes", "cmd": "echo hi"}' > tools/echo.meta
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin/toolsrv" coordinator --listen "127.0.0.1:$port" --tools tools --ca pki/ca.pem \
    --cert pki/coordinator.pem --key pki/coordinator-key.pem 2>coordinator.log &
pids+=($!)
sleep 1
"$bin/toolsrv" agent --coordinator "https://127.0.0.1:$port" --host-id a --ca pki/ca.pem \
    --cert pki/agent-a.pem --key pki/agent-a-key.pem --state-dir state 2>agent.log &
pids+=($!)
export TOOLSRV_ADDR="https://127.0.0.1:$port" TOOLSRV_CA=pki/ca.pem
as() { TOOLSRV_CERT="pki/client-$1.pem" TOOLSRV_KEY="pki/client-$1-key.pem" "$bin/toolctl" "${@:2}"; }
for _ in $(seq 50); do as bob call a echo >/dev/null 2>&1 && break; sleep 0.2; done
for _ in $(seq "$burst"); do (code=0; as alice call a slow >/dev/null 2>&1 || code=$?; echo "$code" >> codes) & done
sleep 1.5
for _ in 1 2 3; do
    start=$(date +%s%N)
    as bob call a echo >/dev/null
    echo "bob's echo: $(( ($(date +%s%N) - start) / 1000000 )) ms"
done
wait_for_burst() { while [ "$(cat codes 2>/dev/null | wc -l)" -lt "$burst" ]; do sleep 0.2; done; }
wait_for_burst
echo "alice's $burst calls: $(grep -c '^0$' codes) ran, $(grep -c '^75$' codes) refused (exit 75)"
