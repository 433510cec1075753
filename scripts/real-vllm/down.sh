#!/usr/bin/env bash
# Stops the engines scripts/real-vllm/up.sh started in OUT_DIR (each engine's whole process
# group: the API server and its engine-core and worker processes), waits for them to exit
# (SIGKILL after 20 s), and removes OUT_DIR/ready.json. Engines already gone are fine.
#
#   scripts/real-vllm/down.sh OUT_DIR
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out="$1"
[ -d "$out" ] || { echo "real-vllm: no directory $out" >&2; exit 0; }
shopt -s nullglob
pids=()
for f in "$out"/*.pid; do
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    pids+=("$pid")
  fi
done
for _ in $(seq 1 40); do
  alive=0
  for pid in "${pids[@]}"; do
    kill -0 -- "-$pid" 2>/dev/null && alive=1
  done
  [ "$alive" -eq 0 ] && break
  sleep 0.5
done
for pid in "${pids[@]}"; do
  kill -KILL -- "-$pid" 2>/dev/null || true
done
rm -f "$out"/*.pid "$out"/*.core "$out/ready.json" "$out/engines.tsv" "$out"/*.sock
echo "real-vllm: stopped ${#pids[@]} engine(s) in $out" >&2
