#!/usr/bin/env bash
# Side by side: other routers and kvc-router, each in front of the same simulated P/D workers
# (kvc-replay's engine model), on the same generated SWE-agent trace at the same speed-up.
# Prints one table.
#
# --engine sglang (default): the SGLang router (P/D mode, cache_aware) and kvc-router, workers
#   speaking SGLang's HTTP API (bootstrap rooms).
# --engine vllm: workers speaking vLLM's OpenAI API with NixlConnector P/D and showing their
#   state as stock vLLM engines do (/metrics, KV events); vllm-router (P/D, kv_aware fed by
#   the prefill worker's KV events, decode session affinity), SMG (cache_aware, sticky
#   sessions by x-session-id; SMG 1.13 over HTTP does not ask P for do_remote_decode, so it
#   cannot drive NixlConnector P/D and runs on the SGLang dialect, said in the table) and
#   kvc-router.
#
# Usage: scripts/side-by-side/run.sh [--engine sglang|vllm] [--sessions N] [--seed S]
#          [--speedup X] [--topology 1pNd] [--policy NAME] [--out DIR]
#          [--sglang-router-version V] [--vllm-router-version V] [--smg-version V]
#          [--only NAME[,NAME...]]
# --only runs just the named legs (sglang-router, kvc-router; with --engine vllm: vllm-router,
#   smg, kvc-router-vllm, kvc-router) and tables the legs found in DIR, so that one leg can be
#   rerun beside the others' last results.
# Needs python3 (with venv) and network access to PyPI the first time (each peer is
# installed into its own venv under DIR). Everything listens on 127.0.0.1 only.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
sessions=16
seed=7
speedup=10
topology=1p3d
policy=kvc
out="$root/target/side-by-side"
sglang_version=0.3.2
vllm_router_version=0.1.17
smg_version=1.13.0
engine=sglang
only=""

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --sessions) sessions="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --speedup) speedup="$2"; shift 2 ;;
    --topology) topology="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --sglang-router-version) sglang_version="$2"; shift 2 ;;
    --vllm-router-version) vllm_router_version="$2"; shift 2 ;;
    --smg-version) smg_version="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --only) only=",$2,"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "side-by-side: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$engine" in
  sglang|vllm) ;;
  *) echo "side-by-side: --engine must be sglang or vllm, got $engine" >&2; exit 2 ;;
esac
case "$topology" in
  1p*d) ;;
  *) echo "side-by-side: --topology must be 1p<N>d (one prefill worker), got $topology" >&2; exit 2 ;;
esac

mkdir -p "$out"
tag=side-by-side
# shellcheck source=scripts/side-by-side/lib.sh
. "$root/scripts/side-by-side/lib.sh"

# 1. The peers, from PyPI, each in its own virtual environment.
venv="$out/venv"
if [ "$engine" = sglang ]; then
  install "$venv" sglang-router "$sglang_version" sglang-router
else
  install "$out/vllm-router-venv" vllm-router "$vllm_router_version" vllm-router
  install "$out/smg-venv" smg "$smg_version" smg
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

# run NAME ROUTER_PORT METRICS_PORT WORKER_PORT BOOTSTRAP_PORT DIALECT: starts the replay's
# workers (speaking DIALECT: sglang, or vllm with engine signals), then the router NAME in
# front of them, and waits for the replay to finish.
run() {
  local name="$1" rport="$2" mport="$3" wport="$4" bport="$5" dialect="${6:-sglang}"
  if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then
    log "skipping $name (--only); tabling its last run in $out/$name if there is one"
    return 0
  fi
  local dialect_args=()
  if [ "$dialect" = vllm ]; then
    dialect_args=(--engine vllm --router-state events)
  fi
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
    "${dialect_args[@]}" --out "$dir/run" >"$dir/replay.out" 2>"$dir/replay.log" &
  replay_pid=$!
  wait_for_file "$dir/ready.json" "$dir/replay.log"
  case "$name" in
  sglang-router)
    # shellcheck disable=SC2046
    "$venv/bin/sglang-router" launch --pd-disaggregation --policy cache_aware \
      --host 127.0.0.1 --port "$rport" --log-level warn \
      --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
      $(workers_args "$dir/ready.json" sglang) >"$dir/router.log" 2>&1 &
    ;;
  smg)
    # SMG 1.13: cache_aware with sticky sessions keyed by the x-session-id header.
    # shellcheck disable=SC2046
    "$out/smg-venv/bin/smg" launch --pd-disaggregation --policy cache_aware \
      --sticky-sessions --routing-key-headers x-session-id \
      --host 127.0.0.1 --port "$rport" --log-level warn \
      --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
      $(workers_args "$dir/ready.json" sglang) >"$dir/router.log" 2>&1 &
    ;;
  vllm-router)
    # vllm-router 0.1.17: NixlConnector P/D, kv_aware fed by the prefill worker's KV events
    # (its only event source in P/D mode; the model identity names the tokenizer it hashes
    # prompts with), and decode session affinity.
    # shellcheck disable=SC2046
    "$out/vllm-router-venv/bin/vllm-router" --vllm-pd-disaggregation --policy kv_aware \
      --kv-aware-session-affinity-ttl-secs 3600 --kv-event-model "$(tokenizer_dir)" \
      --host 127.0.0.1 --port "$rport" --log-level warning \
      --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
      $(workers_args "$dir/ready.json" vllm-router) >"$dir/router.log" 2>&1 &
    ;;
  *)
    "$kvc_router" --config "$dir/kvc-router.toml" --http-listen "127.0.0.1:$rport" \
      --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$mport" --policy "$policy" --log warn \
      >"$dir/router.log" 2>&1 &
    ;;
  esac
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

# workers_args READY_FILE STYLE: the peer's --prefill/--decode arguments for the workers in
# READY_FILE (STYLE sglang: prefill with its bootstrap port; vllm-router: also the prefill
# worker's KV events).
workers_args() {
  python3 - "$1" "$2" <<'PY'
import json, sys
style = sys.argv[2]
for w in json.load(open(sys.argv[1]))["workers"]:
    if w["role"] == "prefill":
        if style == "sglang":
            print("--prefill", w["url"], w["bootstrap_port"])
        else:
            print("--prefill", w["url"])
            if w.get("kv_events"):
                print("--pd-kv-events", w["url"] + "=" + w["kv_events"])
    elif w["role"] == "decode":
        print("--decode", w["url"])
PY
}

# A tokenizer for vllm-router's kv_aware without the Hugging Face hub: a word-level
# tokenizer.json (one token per word, as kvc-router's default tokenizer counts), written as
# plain JSON.
tokenizer_dir() {
  local dir="$out/tokenizer"
  if [ ! -s "$dir/tokenizer.json" ]; then
    python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
           "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "tok": 1}, "unk_token": "[UNK]"}},
          open(os.path.join(d, "tokenizer.json"), "w"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"},
          open(os.path.join(d, "tokenizer_config.json"), "w"))
PY
  fi
  echo "$dir"
}

if [ "$engine" = vllm ]; then
  tokenizer_dir >/dev/null
fi
if [ "$engine" = sglang ]; then
  run sglang-router 18000 18100 31000 32000
  run kvc-router 18001 18101 33000 34000
  python3 "$root/scripts/side-by-side/table.py" ${only:+--skip-missing} \
    --speedup "$speedup" --topology "$topology" --trace "$trace" \
    "sglang-router (cache_aware)=$out/sglang-router/run" \
    "kvc-router ($policy)=$out/kvc-router/run" | tee "$out/table.md"
  log "wrote $out/table.md"
else
  run vllm-router 18010 18110 35000 36000 vllm
  run smg 18011 18111 37000 38000 sglang
  run kvc-router-vllm 18012 18112 39000 40000 vllm
  # kvc-router also on SMG's dialect: the same workers as SMG's run, so that the routers'
  # added latency is compared over the same worker process.
  run kvc-router 18013 18113 41000 42000 sglang
  python3 "$root/scripts/side-by-side/table.py" ${only:+--skip-missing} \
    --speedup "$speedup" --topology "$topology" --trace "$trace" \
    "vllm-router $vllm_router_version (kv_aware, vllm)=$out/vllm-router/run" \
    "smg $smg_version (cache_aware, sglang)=$out/smg/run" \
    "kvc-router ($policy, vllm)=$out/kvc-router-vllm/run" \
    "kvc-router ($policy, sglang)=$out/kvc-router/run" | tee "$out/table-vllm.md"
  log "wrote $out/table-vllm.md"
fi
