#!/usr/bin/env bash
# A Python gRPC client generated from proto/ by grpcio-tools calls a running kvc-router
# (ListWorkers, Route, CommitEvict through to a worker service, a bad request) and parses
# its /metrics as Prometheus text.
#
# The router fronts simulated workers: `kvc-replay live` publishes their snapshots.
# Installs grpcio-tools and prometheus-client into target/pyclient/venv (needs PyPI).
# Every process it starts is stopped on exit; every wait is bounded.
# KVC_BIN_DIR=DIR: kvc-router and kvc-replay as they are in DIR, nothing built (`cargo xtask
# test` passes the ones its `cargo test` just built, which a build here would compile again
# with other features); unset, the debug binaries are built first.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$root/target/pyclient"
mkdir -p "$work"
cargo="${CARGO:-cargo}"
# Nothing of the package a calling `cargo run` or `cargo test` names (CARGO_PKG_NAME, ...):
# build scripts take those variables for inputs (ring's), and a value other than the last
# build's would rebuild ring and everything above it.
unset OUT_DIR CARGO_CRATE_NAME CARGO_BIN_NAME CARGO_PRIMARY_PACKAGE CARGO_TARGET_TMPDIR \
  "${!CARGO_PKG_@}" "${!CARGO_MANIFEST_@}" "${!CARGO_CFG_@}" "${!CARGO_BIN_EXE_@}"
if [ -n "${KVC_BIN_DIR:-}" ]; then
  bins="$KVC_BIN_DIR"
  for b in kvc-router kvc-replay; do
    [ -x "$bins/$b" ] || { echo "check.sh: KVC_BIN_DIR=$bins has no executable $b" >&2; exit 2; }
  done
else
  "$cargo" build --quiet --locked -p kvc-router -p kvc-replay --manifest-path "$root/Cargo.toml"
  bins="${CARGO_TARGET_DIR:-$root/target}/debug"
fi

if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
fi
"$work/venv/bin/pip" install --quiet --disable-pip-version-check grpcio-tools==1.85.1 prometheus-client==0.26.0
rm -rf "$work/gen" && mkdir -p "$work/gen"
"$work/venv/bin/python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$work/gen" --grpc_python_out="$work/gen" "$root/proto/kvc/v1/router.proto"
touch "$work/gen/kvc/__init__.py" "$work/gen/kvc/v1/__init__.py"

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
grpc_addr="127.0.0.1:$(port)"
metrics_addr="127.0.0.1:$(port)"
snap="$work/snap"
rm -rf "$snap"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$bins/kvc-replay" gen swe --seed 2 --sessions 6 --quiet --out "$work/trace.jsonl"
worker_port="$(port)"
"$bins/kvc-replay" live --topology 1p2d --policy kvc-v2 --snapshot-dir "$snap" \
  --router-listen "$grpc_addr" --router-metrics-listen "$metrics_addr" \
  --worker-base-port "$worker_port" --write-router-config "$work/router.toml"
# The workers: a live replay publishing snapshots (and routing its own trace through the router).
"$bins/kvc-replay" live --quiet --topology 1p2d --policy kvc-v2 --speedup 20 \
  --connect-timeout-s 30 --router "http://$grpc_addr" --snapshot-dir "$snap" \
  --worker-base-port "$worker_port" \
  --trace "$work/trace.jsonl" --out "$work/live" > /dev/null &
pids+=($!)
for _ in $(seq 1 200); do [ -f "$snap/w2.snap" ] && break; sleep 0.05; done
"$bins/kvc-router" --config "$work/router.toml" --log warn > "$work/router.out" &
pids+=($!)
for _ in $(seq 1 200); do grep -q grpc= "$work/router.out" 2>/dev/null && break; sleep 0.05; done
timeout 60 "$work/venv/bin/python" "$root/scripts/python-client/client.py" \
  "$work/gen" "$grpc_addr" "$metrics_addr" 3
