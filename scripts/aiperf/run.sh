#!/usr/bin/env bash
# aiperf (NVIDIA's LLM benchmark client, from PyPI) against kvc-router in front of standalone
# simulated vLLM workers (kvc-replay workers): multi-turn chat conversations, streamed, through
# /v1/chat/completions. Prints aiperf's own report (TTFT, ITL, throughput, errors) and fails
# when any request failed.
#
# Usage: scripts/aiperf/run.sh [--conversations N] [--turns T] [--isl TOKENS] [--osl TOKENS]
#                              [--concurrency C] [--speedup X] [--topology 1pNd] [--out DIR]
#                              [--real-vllm ENGINES_DIR]
# --real-vllm: real vLLM engines started by scripts/real-vllm/up.sh ENGINES_DIR instead of
#   simulated workers: kvc-router runs with the ENGINES_DIR/kvc-router.toml written there, and
#   aiperf counts tokens with the engines' own tokenizer.
# Needs python3 (with venv) and PyPI the first time (aiperf 0.13.0 goes into DIR/venv). No
# other network: aiperf's tokenizer is built locally (scripts/aiperf/tokenizer.py). Everything
# listens on 127.0.0.1 only; the run is bounded by N × T requests and 15 minutes.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
conversations=32
turns=5
isl=600
osl=64
concurrency=8
speedup=1
topology=1p3d
out="$root/target/aiperf"
aiperf_version=0.13.0
limit_s=900
real=""
request_timeout_s=120

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --conversations) conversations="$2"; shift 2 ;;
    --turns) turns="$2"; shift 2 ;;
    --isl) isl="$2"; shift 2 ;;
    --osl) osl="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --speedup) speedup="$2"; shift 2 ;;
    --topology) topology="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --real-vllm) real="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "aiperf: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

mkdir -p "$out"
log() { echo "aiperf run: $*" >&2; }

# 1. aiperf from PyPI, in its own virtual environment.
venv="$out/venv"
if ! "$venv/bin/aiperf" --version >/dev/null 2>&1 \
   || [ "$("$venv/bin/pip" show aiperf 2>/dev/null | sed -n 's/^Version: //p')" != "$aiperf_version" ]; then
  log "installing aiperf==$aiperf_version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "aiperf==$aiperf_version"
fi

# 2. A tokenizer for aiperf without the Hugging Face hub: one token per word of aiperf's own
#    prompt corpus, as kvc-router's default tokenizer and the simulated workers count.
corpus="$("$venv/bin/python" -c 'import aiperf, os; print(os.path.join(os.path.dirname(aiperf.__file__), "dataset", "generator", "assets", "shakespeare.txt"))')"
tokenizer="$out/tokenizer"
if [ -n "$real" ]; then
  request_timeout_s=600 # a CPU engine prefills a long prompt in seconds, and stalls on P->D transfers
  [ -s "$real/ready.json" ] || { log "no engines in $real (run scripts/real-vllm/up.sh first)"; exit 1; }
  tokenizer="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model"])' "$real/ready.json")"
else
  "$venv/bin/python" "$root/scripts/aiperf/tokenizer.py" "$corpus" "$tokenizer"
fi

# 3. Our binaries.
log "building kvc-replay and kvc-router (release)"
(cd "$root" && cargo build --release --locked --quiet -p kvc-replay -p kvc-router)
target="${CARGO_TARGET_DIR:-$root/target}"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
router_port="$(free_port)"
metrics_port="$(free_port)"

workers_pid=""
router_pid=""
cleanup() {
  [ -n "$router_pid" ] && kill "$router_pid" 2>/dev/null || true
  [ -n "$workers_pid" ] && kill "$workers_pid" 2>/dev/null || true
}
trap cleanup EXIT

# 4. Standalone simulated workers (or the real engines) and kvc-router in front of them.
run="$out/run"
rm -rf "$run"; mkdir -p "$run"
if [ -n "$real" ]; then
  router_port="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router-http"].rsplit(":", 1)[1])' "$real/ready.json")"
  metrics_port=$((router_port + 1))
  cp "$real/kvc-router.toml" "$run/kvc-router.toml"
else
  "$target/release/kvc-replay" workers --topology "$topology" --speedup "$speedup" \
    --snapshot-dir "$run/snapshots" --ready-file "$run/ready.json" \
    --write-router-config "$run/kvc-router.toml" --router-http-listen "127.0.0.1:$router_port" \
    --router-listen 127.0.0.1:0 --router-metrics-listen "127.0.0.1:$metrics_port" \
    --duration-s "$limit_s" >"$run/workers.out" 2>"$run/workers.log" &
  workers_pid=$!
  for _ in $(seq 1 300); do
    [ -s "$run/ready.json" ] && break
    kill -0 "$workers_pid" 2>/dev/null || { log "the workers stopped; see $run/workers.log"; exit 1; }
    sleep 0.1
  done
  [ -s "$run/ready.json" ] || { log "the workers never came up"; exit 1; }
  cat "$run/workers.out" >&2
fi
"$target/release/kvc-router" --config "$run/kvc-router.toml" --log warn >"$run/router.log" 2>&1 &
router_pid=$!
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$router_port/health" >/dev/null 2>&1 && break
  kill -0 "$router_pid" 2>/dev/null || { log "kvc-router stopped; see $run/router.log"; exit 1; }
  sleep 0.2
done
# The name the engines serve, as kvc-router's /v1/models relays it from them.
model="$(curl -sf "http://127.0.0.1:$router_port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
  || { log "kvc-router's /v1/models named no model; see $run/router.log"; exit 1; }
log "kvc-router on 127.0.0.1:$router_port (model $model); $conversations conversations × $turns turns, concurrency $concurrency"

# 5. aiperf: multi-turn synthetic conversations, streamed, each conversation's id in the
#    session header kvc-router reads (x-session-id). Its report goes to stdout.
"$venv/bin/aiperf" profile --model "$model" --url "http://127.0.0.1:$router_port" \
  --endpoint-type chat --streaming --tokenizer "$tokenizer" \
  --conversation-num "$conversations" --conversation-turn-mean "$turns" --conversation-turn-stddev 0 \
  --isl "$isl" --isl-stddev 0 --osl "$osl" --osl-stddev 0 --concurrency "$concurrency" \
  --session-header x-session-id --random-seed 7 --request-timeout-seconds "$request_timeout_s" \
  --benchmark-duration "$limit_s" --ui-type none --artifact-dir "$run/aiperf" 2>"$run/aiperf.log" \
  | tee "$run/aiperf.out"

# 6. Zero errors, or fail.
python3 - "$run/aiperf" "$run/router.log" <<'PY'
import glob, json, sys
files = glob.glob(sys.argv[1] + "/**/profile_export_aiperf.json", recursive=True)
if not files:
    sys.exit("aiperf run: no profile_export_aiperf.json written")
data = json.load(open(files[0]))
def value(name):
    m = data.get(name) or {}
    return m.get("avg", m.get("value")) if isinstance(m, dict) else m
ok = value("request_count") or 0
errors = value("error_request_count") or 0
print(f"aiperf run: {ok:.0f} requests completed, {errors:.0f} errors ({files[0]})", file=sys.stderr)
if errors or not ok:
    sys.exit(1)
PY
# 7. How kvc-router carried the turns (its decisions with a non-zero count).
curl -sf "http://127.0.0.1:$metrics_port/metrics" | grep -E '^kvc_router_decisions_total' \
  | grep -v ' 0$' | tee "$run/router-decisions.txt" >&2 || true
