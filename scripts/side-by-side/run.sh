#!/usr/bin/env bash
# Side by side: the SGLang router (P/D mode, cache-aware) and kvc-router, each in front of the
# same simulated P/D workers (kvc-replay's engine model speaking SGLang's HTTP API), on the same
# generated SWE-agent trace at the same speed-up. Prints one table.
#
# Usage: scripts/side-by-side/run.sh [--sessions N] [--seed S] [--speedup X] [--topology 1pNd]
#                                    [--policy NAME] [--out DIR] [--sglang-router-version V]
# Needs python3 (with venv) and network access to PyPI the first time (sglang-router is
# installed into DIR/venv). Everything listens on 127.0.0.1 only.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
sessions=16
seed=7
speedup=10
topology=1p3d
policy=kvc
out="$root/target/side-by-side"
sglang_version=0.3.2

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --sessions) sessions="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --speedup) speedup="$2"; shift 2 ;;
    --topology) topology="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --sglang-router-version) sglang_version="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "side-by-side: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$topology" in
  1p*d) ;;
  *) echo "side-by-side: --topology must be 1p<N>d (one prefill worker), got $topology" >&2; exit 2 ;;
esac

mkdir -p "$out"
log() { echo "side-by-side: $*" >&2; }

# 1. The SGLang router, from PyPI, in a local virtual environment.
venv="$out/venv"
if ! "$venv/bin/sglang-router" --help >/dev/null 2>&1 \
   || [ "$("$venv/bin/pip" show sglang-router 2>/dev/null | sed -n 's/^Version: //p')" != "$sglang_version" ]; then
  log "installing sglang-router==$sglang_version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "sglang-router==$sglang_version"
fi

# 2. Our binaries.
log "building kvc-replay and kvc-router (release)"
(cd "$root" && cargo build --release --locked --quiet -p kvc-replay -p kvc-router)
target="${CARGO_TARGET_DIR:-$root/target}"
replay="$target/release/kvc-replay"
kvc_router="$target/release/kvc-router"

# 3. The trace.
trace="$out/trace.jsonl"
"$replay" gen swe --seed "$seed" --sessions "$sessions" --out "$trace" --quiet
"$replay" stats "$trace" 2>/dev/null | sed -n '1,3p;/span/p' >&2

router_pid=""
replay_pid=""
cleanup() {
  [ -n "$router_pid" ] && kill "$router_pid" 2>/dev/null || true
  [ -n "$replay_pid" ] && kill "$replay_pid" 2>/dev/null || true
}
trap cleanup EXIT

wait_for_file() {
  for _ in $(seq 1 300); do
    [ -s "$1" ] && return 0
    if ! kill -0 "$replay_pid" 2>/dev/null; then
      log "the replay stopped before its workers were up; see $2"; exit 1
    fi
    sleep 0.1
  done
  log "timed out waiting for $1"; exit 1
}

port_busy() {
  python3 -c 'import socket,sys; s=socket.socket(); sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$1"
}

# run NAME ROUTER_PORT METRICS_PORT WORKER_PORT BOOTSTRAP_PORT: starts the replay's workers,
# then the router NAME in front of them, and waits for the replay to finish.
run() {
  local name="$1" rport="$2" mport="$3" wport="$4" bport="$5"
  local dir="$out/$name"
  rm -rf "$dir"; mkdir -p "$dir"
  for port in "$rport" "$mport"; do
    if port_busy "$port"; then
      log "127.0.0.1:$port is already in use (a router left running?); stop it or pick other ports"
      exit 1
    fi
  done
  log "run $name: workers on 127.0.0.1:$wport+, router on 127.0.0.1:$rport"
  "$replay" live --trace "$trace" --topology "$topology" --policy "$policy" \
    --http-router "http://127.0.0.1:$rport" --router-label "$name" \
    --speedup "$speedup" --http-base-port "$wport" --bootstrap-base-port "$bport" \
    --snapshot-dir "$dir/snapshots" --ready-file "$dir/ready.json" \
    --http-router-config "$dir/kvc-router.toml" --connect-timeout-s 120 \
    --out "$dir/run" >"$dir/replay.out" 2>"$dir/replay.log" &
  replay_pid=$!
  wait_for_file "$dir/ready.json" "$dir/replay.log"
  if [ "$name" = sglang-router ]; then
    # shellcheck disable=SC2046
    "$venv/bin/sglang-router" launch --pd-disaggregation --policy cache_aware \
      --host 127.0.0.1 --port "$rport" --log-level warn \
      --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
      $(python3 - "$dir/ready.json" <<'PY'
import json, sys
for w in json.load(open(sys.argv[1]))["workers"]:
    if w["role"] == "prefill":
        print("--prefill", w["url"], w["bootstrap_port"])
    elif w["role"] == "decode":
        print("--decode", w["url"])
PY
) >"$dir/router.log" 2>&1 &
  else
    "$kvc_router" --config "$dir/kvc-router.toml" --http-listen "127.0.0.1:$rport" \
      --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$mport" --policy "$policy" --log warn \
      >"$dir/router.log" 2>&1 &
  fi
  router_pid=$!
  # A router that dies at start (a port in use, a bad flag) must not leave the replay waiting.
  while kill -0 "$replay_pid" 2>/dev/null; do
    if ! kill -0 "$router_pid" 2>/dev/null; then
      log "router $name exited; see $dir/router.log"
      tail -5 "$dir/router.log" >&2
      exit 1
    fi
    sleep 1
  done
  if ! wait "$replay_pid"; then
    replay_pid=""
    log "run $name failed; see $dir/replay.log and $dir/router.log"
    tail -5 "$dir/replay.log" >&2
    exit 1
  fi
  replay_pid=""
  kill "$router_pid" 2>/dev/null || true
  wait "$router_pid" 2>/dev/null || true
  router_pid=""
}

run sglang-router 18000 18100 31000 32000
run kvc-router 18001 18101 33000 34000

python3 "$root/scripts/side-by-side/table.py" \
  --speedup "$speedup" --topology "$topology" --trace "$trace" \
  "sglang-router (cache_aware)=$out/sglang-router/run" \
  "kvc-router ($policy)=$out/kvc-router/run" | tee "$out/table.md"
log "wrote $out/table.md"
