#!/usr/bin/env bash
# Stops the Dynamo stack scripts/dynamo/up.sh started in OUT_DIR: the frontend first (no new
# requests), then each worker's whole process group (the dynamo.vllm process and vLLM's
# engine-core and worker processes). SIGTERM first: a Dynamo process then unregisters from
# discovery and drains, which took about 10 s here; SIGKILL after 30 s. Waits until every group
# is gone, then removes OUT_DIR/ready.json, the pid files, the discovery directory and the
# KV-event sockets. Processes already gone are fine; logs and NAME.start files are kept.
#
#   scripts/dynamo/down.sh OUT_DIR
#
# Environment: none.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out="$1"
[ -d "$out" ] || { echo "dynamo: no directory $out" >&2; exit 0; }
shopt -s nullglob

group_alive() { kill -0 -- "-$1" 2>/dev/null || kill -0 "$1" 2>/dev/null; }

stop_groups() { # pid...
  local pid alive
  for pid in "$@"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 1 60); do
    alive=0
    for pid in "$@"; do
      group_alive "$pid" && alive=1
    done
    [ "$alive" -eq 0 ] && return 0
    sleep 0.5
  done
  for pid in "$@"; do
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
  sleep 0.5
}

stopped=0
# The frontend first, then the workers (all of them at once: each drains on its own).
for group in frontend workers; do
  pids=()
  for f in "$out"/*.pid; do
    name="$(basename "$f" .pid)"
    if [ "$group" = frontend ] && [ "$name" != frontend ]; then continue; fi
    if [ "$group" = workers ] && [ "$name" = frontend ]; then continue; fi
    pid="$(cat "$f")"
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    if group_alive "$pid"; then
      pids+=("$pid")
    fi
  done
  if [ "${#pids[@]}" -gt 0 ]; then
    stop_groups "${pids[@]}"
    stopped=$((stopped + ${#pids[@]}))
  fi
done
rm -rf "$out"/*.pid "$out/ready.json" "$out/ready.json.tmp" "$out/discovery" "$out"/*.sock \
  "$out/workers.tsv" "$out/workers.tsv.tmp" "$out/processes.tsv"
echo "dynamo: stopped $stopped process group(s) in $out" >&2
