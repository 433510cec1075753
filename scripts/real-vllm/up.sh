#!/usr/bin/env bash
# Stands up real vLLM engines (the CPU build, the harness's tiny model) on loopback and writes
# what a router needs to reach them.
#
#   scripts/real-vllm/up.sh TOPOLOGY OUT_DIR
#
# TOPOLOGY: 1p1d (a prefill and a decode engine, NixlConnector P/D), 1p2d, 2x (two colocated
# engines, no connector), 1x (one plain engine). Every engine has prefix caching, KV-cache
# events with a replay socket, prompt-token details (`usage.prompt_tokens_details.cached_tokens`),
# tool calling (`--enable-auto-tool-choice --tool-call-parser pythonic`: agents send tools) and
# `/reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1). Waits until every engine answers /health and
# (P/D) every prefill/decode pair, and every two decode engines both ways, have completed one
# KV transfer (warm_transfer.py: the NIXL handshake done before the first real request, or the
# first session that moves between decode engines with its KV), then writes:
#   OUT_DIR/NAME.start        the command that starts engine NAME (restart.sh runs it again)
#   OUT_DIR/ready.json        the model directory and, per engine: name, role, http-url,
#                             metrics-url, event endpoints and topic, block size, pid, log;
#                             max-num-batched-tokens (the chunked-prefill budget)
#   OUT_DIR/kvc-router.toml   a kvc-router configuration for these engines: HTTP front on
#                             127.0.0.1:$KVC_REAL_VLLM_ROUTER_PORT (default 18080), /metrics
#                             on the next port, gRPC on the one after; capacity and block
#                             size left to the engines' /metrics
# Stop them with scripts/real-vllm/down.sh OUT_DIR.
#
# Event sockets are ipc:// endpoints under OUT_DIR: vLLM binds an ipc endpoint (as it binds
# tcp://*:PORT; a tcp://HOST:PORT endpoint makes the engine connect instead), and an ipc
# socket is reachable from this machine only.
#
# Environment: KVC_REAL_VLLM_PORT_BASE (default 18200; engine i uses BASE+10i .. BASE+10i+3),
# KVC_REAL_VLLM_KV_GIB (KV pool per engine, GiB, default 1), KVC_REAL_VLLM_THREADS (compute
# threads per engine, default the cores divided among the engines), KVC_REAL_VLLM_MAX_MODEL_LEN
# (default 16384), KVC_REAL_VLLM_KV_LEASE_S (a P/D pair's KV lease: how long P keeps a
# prefilled request's KV for D to read without D's heartbeat, vLLM's kv_lease_duration,
# default vLLM's 30 s), KVC_REAL_VLLM_CHUNK_TOKENS (the chunked-prefill budget, vLLM's
# --max-num-batched-tokens: a prompt longer than it is prefilled over several steps; default
# 2048, vLLM's own default for its CPU build's API server), KVC_REAL_VLLM_DEFAULT_MAX_TOKENS (the output limit of a request that sets
# none, as coding agents' requests do: default 64, where the engine would otherwise decode up
# to its context), KVC_REAL_VLLM_START_TIMEOUT (seconds per engine, default 420), KVC_REAL_VLLM_CACHE
# (see install.sh), KVC_REAL_VLLM_GPU_BLOCKS (the KV pool of every engine in blocks of 32
# tokens, vLLM's --num-gpu-blocks-override: how KV pressure is made on a small machine; unset,
# the pool is what KVC_REAL_VLLM_KV_GIB holds), KVC_REAL_VLLM_GPU_BLOCKS_PREFILL,
# KVC_REAL_VLLM_GPU_BLOCKS_DECODE, KVC_REAL_VLLM_GPU_BLOCKS_COLOCATED (the same for the engines
# of one role, over KVC_REAL_VLLM_GPU_BLOCKS). Each engine's pool as the engine reports it
# (vllm:cache_config_info's num_gpu_blocks) is recorded in ready.json as "gpu-blocks", with
# "gpu-blocks-override" (null when not cut). KVC_REAL_VLLM_PIN: on, off or auto (the default:
# on for two colocated engines, 2x): each engine's compute process
# (VLLM::Worker, all its threads) pinned to a core of its own (engine i on core i modulo the
# cores) once it is ready, as each engine of a GPU cluster computes on a GPU of its own. The
# engines' API servers and engine-core loops, and any router in front, still run on every
# core. Unpinned, two busy engines on two cores take compute from each other: on the
# pressure workload (scripts/side-by-side/real.sh --pressure) a short turn's first token took
# 0.06 s while the other engine idled and 0.11-0.27 s while it computed, so a router that
# sent 83% of the requests to one engine led on latency while computing half again as many
# prompt tokens. P/D pairs stay unpinned: a NixlConnector engine's UCX progress thread spins
# on a core, and pinned beside it an engine's compute starves. A lone engine (1x) stays
# unpinned too: pinned to core 0, `kvc-replay profile` measured its decode step at 110-121 ms
# at every batch size (against 1-6 ms unpinned), its own engine-core loop and API server
# taking turns with it on that core. The core is recorded in
# ready.json ("core", null when unpinned). KVC_REAL_VLLM_NIXL_DELAY_US (default 200): NIXL's
# progress thread pauses this long between polls (nixl/sitecustomize.py, on the engines'
# PYTHONPATH; 0 leaves NIXL's own setting, no pause). NIXL's Python agent sets no pause, and
# each P/D engine then spins a core on it even when idle: on two cores, a third of the machine
# per engine, taken from the engines' compute and from whatever runs beside them (measured on
# an idle 1p1d pair: 95% of a core per engine without the pause, 4% with 200 us; the pair
# test's first turns through P took 0.4-2.6 s with it, 0.7-29 s without). Recorded in
# ready.json ("nixl-progress-delay-us"). Exit 3: python3 missing (callers skip); any other
# failure prints the failing engine's log tail.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { echo "usage: $0 1p1d|1p2d|2x|1x OUT_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
topology="$1"
mkdir -p "$2"
out="$(cd "$2" && pwd)"
case "$topology" in
  1p1d) roles=(prefill decode) ;;
  1p2d) roles=(prefill decode decode) ;;
  2x) roles=(colocated colocated) ;;
  1x) roles=(colocated) ;;
  *) usage ;;
esac
base="${KVC_REAL_VLLM_PORT_BASE:-18200}"
pin="${KVC_REAL_VLLM_PIN:-auto}"
case "$pin" in
  on|off) ;;
  auto) case "$topology" in 2x) pin=on ;; *) pin=off ;; esac ;;
  *) echo "real-vllm: KVC_REAL_VLLM_PIN must be on, off or auto, got $pin" >&2; exit 2 ;;
esac
kv_gib="${KVC_REAL_VLLM_KV_GIB:-1}"
max_len="${KVC_REAL_VLLM_MAX_MODEL_LEN:-16384}"
chunk="${KVC_REAL_VLLM_CHUNK_TOKENS:-2048}"
[[ "$chunk" =~ ^[1-9][0-9]*$ ]] || { echo "real-vllm: KVC_REAL_VLLM_CHUNK_TOKENS must be a positive count, got $chunk" >&2; exit 2; }
start_timeout="${KVC_REAL_VLLM_START_TIMEOUT:-420}"
lease="${KVC_REAL_VLLM_KV_LEASE_S:-}"
lease_extra=""
if [ -n "$lease" ]; then
  [[ "$lease" =~ ^[1-9][0-9]*$ ]] || { echo "real-vllm: KVC_REAL_VLLM_KV_LEASE_S must be a positive number of seconds, got $lease" >&2; exit 2; }
  lease_extra=",\"kv_connector_extra_config\":{\"kv_lease_duration\":$lease}"
fi
nixl_delay="${KVC_REAL_VLLM_NIXL_DELAY_US:-200}"
[[ "$nixl_delay" =~ ^[0-9]+$ ]] || { echo "real-vllm: KVC_REAL_VLLM_NIXL_DELAY_US must be a count of microseconds, got $nixl_delay" >&2; exit 2; }
router_port="${KVC_REAL_VLLM_ROUTER_PORT:-18080}"
cache="${KVC_REAL_VLLM_CACHE:-$HOME/.cache/kvc/real-vllm}"
block_size=32 # the CPU attention backend needs a multiple of 32
cores="$(nproc 2>/dev/null || echo 2)"
threads="${KVC_REAL_VLLM_THREADS:-$(( cores / ${#roles[@]} > 0 ? cores / ${#roles[@]} : 1 ))}"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || { echo "real-vllm: KVC_REAL_VLLM_THREADS must be a positive count, got $threads" >&2; exit 2; }
served="kvc-tiny"

# gpu_blocks ROLE: the pool override of ROLE's engines in blocks ("" when not cut).
gpu_blocks() {
  local var="KVC_REAL_VLLM_GPU_BLOCKS_${1^^}" v
  v="${!var:-${KVC_REAL_VLLM_GPU_BLOCKS:-}}"
  if [ -n "$v" ] && ! [[ "$v" =~ ^[1-9][0-9]*$ ]]; then
    echo "real-vllm: $var / KVC_REAL_VLLM_GPU_BLOCKS must be a positive count of blocks, got $v" >&2
    exit 2
  fi
  if [ -n "$v" ] && [ $(((v - 1) * block_size)) -lt "$max_len" ]; then
    # vLLM refuses to start an engine whose pool (less the one block it holds back) cannot
    # hold one request of max-model-len.
    echo "real-vllm: a pool of $v blocks holds $(((v - 1) * block_size)) tokens, less than one request of" \
      "KVC_REAL_VLLM_MAX_MODEL_LEN=$max_len; lower the model length or raise the pool" >&2
    exit 2
  fi
  echo "$v"
}
for role in "${roles[@]}"; do gpu_blocks "$role" >/dev/null; done

if [ -f "$out/ready.json" ]; then
  echo "real-vllm: $out already has engines (ready.json); run down.sh $out first" >&2
  exit 1
fi
python="$("$here/install.sh" | tail -n 1)" || exit $?
model="$("$python" "$here/build_model.py" "$cache/model" | tail -n 1)"

names=()
declare -A count=()
for role in "${roles[@]}"; do
  case "$role" in prefill) p=p ;; decode) p=d ;; *) p=x ;; esac
  n="${count[$p]:-0}"
  names+=("$p$n")
  count[$p]=$((n + 1))
done

pids=()
start_engine() { # index name role
  local i="$1" name="$2" role="$3"
  local port=$((base + 10 * i)) side=$((base + 10 * i + 3))
  local events="ipc://$out/$name-events.sock" replay="ipc://$out/$name-replay.sock"
  local topic="kv@$name@$served"
  local kv_events
  kv_events=$(printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"%s","replay_endpoint":"%s","topic":"%s"}' "$events" "$replay" "$topic")
  local args=(
    -m vllm.entrypoints.openai.api_server
    --model "$model" --served-model-name "$served"
    --host 127.0.0.1 --port "$port"
    --dtype float32 --block-size "$block_size" --max-model-len "$max_len"
    --max-num-batched-tokens "$chunk"
    --enable-prefix-caching --enable-prompt-tokens-details
    --enable-auto-tool-choice --tool-call-parser pythonic
    --enforce-eager
    --kv-events-config "$kv_events"
    --override-generation-config "{\"max_new_tokens\": ${KVC_REAL_VLLM_DEFAULT_MAX_TOKENS:-64}}"
  )
  local override
  override="$(gpu_blocks "$role")"
  [ -z "$override" ] || args+=(--num-gpu-blocks-override "$override")
  case "$role" in
    prefill) args+=(--kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\",\"kv_buffer_device\":\"cpu\"$lease_extra}") ;;
    decode) args+=(--kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\",\"kv_buffer_device\":\"cpu\"$lease_extra}") ;;
  esac
  # VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM otherwise pins each engine's threads to the same
  # cores (0, 1, ...), and an idle NixlConnector engine keeps two threads spinning there (its
  # UCX progress thread and its worker loop): a second engine pinned beside them starved and
  # never finished starting. Unpinned, the kernel shares the cores among the engines.
  # OMP_NUM_THREADS: the machine's cores divided among the engines (at least one each), as
  # each engine of a GPU cluster has its own GPU. With more compute threads than cores, two
  # engines busy at once spin in each other's OpenMP barriers: on 2 cores with 2 threads per
  # engine, the side-by-side legs decoded 3-5x slower whenever both engines were busy, and
  # the more evenly a router spread the sessions the slower it was.
  # The command is kept as OUT_DIR/NAME.start, so restart.sh can start the engine again.
  {
    echo "#!/usr/bin/env bash"
    echo "# Starts engine $name as scripts/real-vllm/up.sh did."
    printf 'exec env'
    printf ' %q' PYTHONPATH="$here/nixl" KVC_NIXL_PROGRESS_DELAY_US="$nixl_delay" \
      VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS="$threads" \
      VLLM_CPU_KVCACHE_SPACE="$kv_gib" VLLM_SERVER_DEV_MODE=1 VLLM_HOST_IP=127.0.0.1 \
      VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side" \
      UCX_TLS=tcp,self,sm UCX_NET_DEVICES=lo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$python" "${args[@]}"
    echo
  } >"$out/$name.start"
  # setsid: the engine and its worker processes form one group, stopped together by down.sh.
  setsid bash "$out/$name.start" >"$out/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$out/$name.pid"
  pids+=("$pid")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$role" "$port" "$events" "$replay" "$topic" "$pid" "$override" >>"$out/engines.tsv"
  echo "real-vllm: $name ($role) starting on http://127.0.0.1:$port (pid $pid, log $out/$name.log)" >&2
}

: >"$out/engines.tsv"

fail() {
  echo "real-vllm: $1" >&2
  if [ -n "${2:-}" ]; then
    echo "---- last lines of $out/$2.log ----" >&2
    tail -n 30 "$out/$2.log" >&2 || true
  fi
  "$here/down.sh" "$out" >&2 || true
  exit 1
}

# One engine at a time: each start is CPU-bound (model load, warm-up), and starts one after
# the other finish sooner on two cores than side by side.
for i in "${!roles[@]}"; do
  name="${names[$i]}"
  port=$((base + 10 * i))
  deadline=$((SECONDS + start_timeout))
  start_engine "$i" "$name" "${roles[$i]}"
  until curl -fsS -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null; do
    kill -0 "${pids[$i]}" 2>/dev/null || fail "$name exited before it was ready" "$name"
    [ "$SECONDS" -lt "$deadline" ] || fail "$name not ready within ${start_timeout}s" "$name"
    sleep 1
  done
  echo "real-vllm: $name ready after ${SECONDS}s" >&2
  if [ "$pin" = on ]; then
    core=$((i % cores))
    workers="$(pgrep -s "${pids[$i]}" -x 'VLLM::Worker' || true)"
    [ -n "$workers" ] || fail "$name: no VLLM::Worker process in its session to pin" "$name"
    for w in $workers; do
      taskset -a -p -c "$core" "$w" >/dev/null || fail "$name: could not pin its worker $w to core $core" "$name"
    done
    echo "$core" >"$out/$name.core"
    echo "real-vllm: $name computes on core $core (pid $workers)" >&2
  fi
done

"$python" - "$out" "$model" "$block_size" "$router_port" "$served" "$max_len" "$chunk" "$nixl_delay" <<'PY'
import json, os, re, sys, urllib.request
out, model, block_size, router_port, served, max_len, chunk, nixl_delay = sys.argv[1:]


def pool_blocks(url):
    """The engine's KV pool in blocks, as its /metrics reports it (vllm:cache_config_info)."""
    text = urllib.request.urlopen(url, timeout=60).read().decode()
    m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
    if not m:
        sys.exit(f"real-vllm: {url} reports no vllm:cache_config_info num_gpu_blocks")
    return int(m.group(1))

engines = []
with open(f"{out}/engines.tsv") as f:
    for line in f:
        name, role, port, events, replay, topic, pid, override = line.rstrip("\n").split("\t")
        engines.append({
            "name": name, "role": role,
            "http-url": f"http://127.0.0.1:{port}",
            "metrics-url": f"http://127.0.0.1:{port}/metrics",
            "kv-events": events, "kv-events-replay": replay, "kv-events-topic": topic,
            "block-size": int(block_size), "pid": int(pid), "log": f"{out}/{name}.log",
            "gpu-blocks-override": int(override) if override else None,
            "gpu-blocks": pool_blocks(f"http://127.0.0.1:{port}/metrics"),
            "core": int(open(f"{out}/{name}.core").read()) if os.path.exists(f"{out}/{name}.core") else None,
        })
ready = {"model": model, "served-model-name": served, "max-model-len": int(max_len),
         "max-num-batched-tokens": int(chunk),
         "nixl-progress-delay-us": int(nixl_delay),
         "tokenizer": f"{model}/tokenizer.json", "engines": engines,
         "router-http": f"http://127.0.0.1:{router_port}"}
with open(f"{out}/ready.json.tmp", "w") as f:
    json.dump(ready, f, indent=2)
    f.write("\n")

toml = [
    "# kvc-router in front of the real vLLM engines of scripts/real-vllm/up.sh.",
    "# Capacity and block size come from each engine's /metrics (vllm:cache_config_info).",
    f'http-listen = "127.0.0.1:{router_port}"',
    f'metrics-listen = "127.0.0.1:{int(router_port) + 1}"',
    f'listen = "127.0.0.1:{int(router_port) + 2}"',
    "",
    "[http]",
    f'tokenizer = "{model}/tokenizer.json"',
    "# A CPU engine prefills a long prompt in seconds, and answers /health late meanwhile.",
    "request-timeout-ms = 600000",
    "health-check-timeout-ms = 10000",
    "",
    "",
    "# A CPU engine answers /metrics late while it prefills (its API server waits), and a",
    "# NixlConnector pair on two cores can stall 30-50 s around a KV transfer: keep the last",
    "# scrape for longer before calling the engine stale (a stale engine takes no turns).",
    "# A whole /metrics answer costs a vLLM API server about 12 ms of its event loop (58 KB",
    "# of text); kvc-router asks for the five families it reads alone (1.7 KB, about 3 ms).",
    "# Scraped every 100 ms (the default) that is still a few percent of the server on a CPU",
    "# machine, in the way of the streams it serves; once a second, a fraction of 1%.",
    "[engine-signals]",
    "scrape-interval-ms = 1000",
    "scrape-timeout-ms = 5000",
    "stale-after-ms = 120000",
    "",
    "[policy]",
    'policy = "kvc"',
]
disaggregated = any(e["role"] != "colocated" for e in engines)
if disaggregated:
    toml += [
        "",
        "# serve-alone = false keeps each engine to its role: a turn is direct-to-D or goes",
        "# P -> D. Without it, a vLLM engine of either role may also serve a turn alone",
        "# (local-prefill), as kvc's `kvc` policy plans where that is cheaper.",
    ]
for i, e in enumerate(engines):
    toml += [
        "",
        "[[workers]]",
        f"id = {i}",
        f'name = "{e["name"]}"',
        f'role = "{e["role"]}"',
        'engine = "vllm"',
    ] + (["serve-alone = false"] if disaggregated else []) + [
        f'http-url = "{e["http-url"]}"',
        f'metrics-url = "{e["metrics-url"]}"',
        f'kv-events = "{e["kv-events"]}"',
        f'kv-events-replay = "{e["kv-events-replay"]}"',
        f'kv-events-topic = "{e["kv-events-topic"]}"',
    ]
with open(f"{out}/kvc-router.toml", "w") as f:
    f.write("\n".join(toml) + "\n")
PY
"$python" "$here/warm_transfer.py" "$out/ready.json.tmp" || fail "a P->D (or D->D) transfer path never completes" d0
mv "$out/ready.json.tmp" "$out/ready.json"
echo "real-vllm: ${#roles[@]} engine(s) ready: $out/ready.json, $out/kvc-router.toml" >&2
echo "$out/ready.json"
