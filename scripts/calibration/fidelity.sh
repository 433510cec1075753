#!/usr/bin/env bash
# How far `kvc-replay sim` is from real engines: the scaled agentic trace of
# scripts/side-by-side/real.sh through real vLLM engines (the CPU build of scripts/real-vllm/)
# behind kvc-router, and through `kvc-replay sim` with an engine profile fitted to those
# engines, four runs each: 1P1D and 2 colocated engines, policies kvc and cache-aware. The
# per-request records are paired by trace line; the table (also OUT/fidelity.md) gives each
# run's TTFT and latency p50/p90, sim against real with their ratio, the execution-mode and
# direct-to-D shares, and the median relative error of the paired requests.
#
# Usage: scripts/calibration/fidelity.sh [--profile FILE] [--pd-profile FILE] [--sessions 4]
#          [--turns 6] [--factor 4] [--seed 7] [--topology both|2x|1p1d] [--out DIR]
#          [--sim-only]
# The profile is measured on this machine first, as a user with GPUs would measure theirs:
# `kvc-replay profile` against one of the two colocated engines while the other idles
# (OUT/measured.toml, about 20 s; the facts and the factors it does not measure from
# profiles/tiny-llama-cpu.toml). A profile measured on another machine is off by that
# machine's speed: one measured on an earlier 2-core host decoded 2.3x slower than a later
# host's engines.
# --profile: run the simulator with this profile instead of measuring one; --pd-profile: the
#   one for the 1P1D pair (default: the colocated engines' profile). --topology: the real
#   runs of one topology only. --sim-only: the real runs (and OUT/measured.toml) are taken
#   from OUT as a previous run left them, and only the simulator runs again (seconds).
# Needs python3 (with venv) and PyPI the first time (vLLM CPU). Each topology's engines are
# started once (about 2 minutes) and stopped when its runs are done; a run takes 1-3 minutes.
# Everything listens on 127.0.0.1 only.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
facts="$root/profiles/tiny-llama-cpu.toml"
profile=""
pd_profile=""
topologies="2x 1p1d"
sessions=4
turns=6
factor=4
seed=7
out="$root/target/calibration-real"
sim_only=0

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --pd-profile) pd_profile="$2"; shift 2 ;;
    --sessions) sessions="$2"; shift 2 ;;
    --turns) turns="$2"; shift 2 ;;
    --factor) factor="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --topology)
      case "$2" in
        both) topologies="2x 1p1d" ;;
        2x|1p1d) topologies="$2" ;;
        *) echo "fidelity: --topology is both, 2x or 1p1d, got $2" >&2; exit 2 ;;
      esac
      shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --sim-only) sim_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fidelity: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
for n in "$sessions" "$turns" "$factor"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "fidelity: expected a positive count, got $n" >&2; exit 2; }
done
for f in "$profile" "$pd_profile"; do
  [ -z "$f" ] || [ -f "$f" ] || { echo "fidelity: no engine profile at $f" >&2; exit 2; }
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
measured="$out/measured.toml"
tag=fidelity
# shellcheck source=scripts/side-by-side/lib.sh
. "$root/scripts/side-by-side/lib.sh"

build_release
# The trace: real.sh's, generated the same way.
scaled_trace "$out" "$seed" "$sessions" "$factor" "$turns"

runs="2x:kvc 2x:cache-aware 1p1d:kvc 1p1d:cache-aware"
engines=""
router_pid=""
cleanup() {
  if [ -n "$router_pid" ]; then kill "$router_pid" 2>/dev/null || true; fi
  if [ -n "$engines" ]; then "$root/scripts/real-vllm/down.sh" "$engines" || true; fi
}
trap cleanup EXIT

ready() { # ready KEY: a top-level field of the engines' ready.json
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$engines/ready.json" "$1"
}

real_run() { # real_run TOPOLOGY POLICY
  local topology="$1" policy="$2" dir url u
  dir="$out/real/$topology-$policy"
  rm -rf "$dir"; mkdir -p "$dir"
  for u in $(python3 -c 'import json,sys; [print(e["http-url"]) for e in json.load(open(sys.argv[1]))["engines"]]' "$engines/ready.json"); do
    curl -fsS --max-time 60 -X POST "$u/reset_prefix_cache" >/dev/null \
      || { log "$u did not empty its prefix cache"; exit 1; }
  done
  sed "s/^policy = .*/policy = \"$policy\"/" "$engines/kvc-router.toml" >"$dir/kvc-router.toml"
  grep -q "^policy = \"$policy\"" "$dir/kvc-router.toml" || { log "no policy line in $engines/kvc-router.toml"; exit 1; }
  url="$(ready router-http)"
  "$kvc_router" --config "$dir/kvc-router.toml" --log warn >"$dir/router.log" 2>&1 &
  router_pid=$!
  local t=0
  until curl -fsS -o /dev/null --max-time 5 "$url/health" 2>/dev/null; do
    kill -0 "$router_pid" 2>/dev/null || { log "kvc-router exited; see $dir/router.log"; exit 1; }
    t=$((t + 1))
    [ "$t" -lt 180 ] || { log "kvc-router not healthy within 180 s; see $dir/router.log"; exit 1; }
    sleep 1
  done
  log "real $topology $policy: kvc-router on $url"
  if ! "$replay" drive --url "$url" --model "$(ready served-model-name)" --trace "$out/trace.jsonl" \
      --block-size "$block" --tokenizer "$(ready tokenizer)" --label "$topology-$policy" \
      --topology "$topology" --unlabelled-mode unknown --connect-timeout-s 180 \
      --out "$dir" >"$dir/drive.out" 2>"$dir/drive.log"; then
    log "real $topology $policy failed; see $dir/drive.log and $dir/router.log"
    tail -5 "$dir/drive.log" >&2
    exit 1
  fi
  grep -E '^answered' "$dir/drive.out" >&2 || true
  kill "$router_pid" 2>/dev/null || true
  wait "$router_pid" 2>/dev/null || true
  router_pid=""
}

measure() { # measure: the profile of the first colocated engine, the other one idle
  local url
  url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["engines"][0]["http-url"])' "$engines/ready.json")"
  log "measuring $url with kvc-replay profile (the other engine idle)"
  curl -fsS --max-time 60 -X POST "$url/reset_prefix_cache" >/dev/null \
    || { log "$url did not empty its prefix cache"; exit 1; }
  # --peak-flops: every core of this machine at 1.6e11 FLOP/s each: vLLM's CPU attention can
  # run on more threads than the engine's OMP_NUM_THREADS, and on one host attention
  # measured above one core's peak.
  "$replay" profile --url "$url" --facts "$facts" --chunk-tokens "$(ready max-num-batched-tokens)" \
    --peak-flops "$(python3 -c 'import os; print(float(os.cpu_count() * 1.6e11))')" \
    --repeats 5 --seed "$seed" --name tiny-llama-cpu-measured --out "$measured" --quiet \
    2>"$out/profile.log" || { log "kvc-replay profile failed; see $out/profile.log"; exit 1; }
  grep -E 'residuals|warning' "$out/profile.log" >&2 || true
}

if [ "$sim_only" = 0 ]; then
  for topology in $topologies; do
    engines="$out/engines-$topology"
    "$root/scripts/real-vllm/down.sh" "$engines" 2>/dev/null || true
    log "starting real vLLM engines: $topology"
    "$root/scripts/real-vllm/up.sh" "$topology" "$engines" >/dev/null
    if [ "$topology" = 2x ] && [ -z "$profile" ]; then measure; fi
    for run in $runs; do
      [ "${run%%:*}" = "$topology" ] && real_run "$topology" "${run#*:}"
    done
    "$root/scripts/real-vllm/down.sh" "$engines"
    engines=""
  done
fi

if [ -z "$profile" ]; then
  [ -f "$measured" ] || { log "no measured profile at $measured (run with --topology 2x or both, or give --profile)"; exit 1; }
  profile="$measured"
fi
pd_profile="${pd_profile:-$profile}"

# The simulator on the same trace: 1P1D with each engine kept to its role (kvc-router's
# serve-alone = false on these engines), and two colocated engines.
for run in $runs; do
  topology="${run%%:*}" policy="${run#*:}"
  [ -f "$out/real/$topology-$policy/metrics.jsonl" ] \
    || { log "no real run $topology-$policy under $out/real (run without --sim-only first)"; exit 1; }
  case "$topology" in
    1p1d) shape=(--topology 1p1d --local-prefill off --profile "$pd_profile") ;;
    2x) shape=(--topology 2dp --profile "$profile") ;;
  esac
  "$replay" sim --trace "$out/trace.jsonl" --block-size "$block" "${shape[@]}" --policy "$policy" \
    --out "$out/sim/$topology-$policy" --quiet >/dev/null
done

python3 "$root/scripts/calibration/fidelity.py" --profile "$(basename "$profile"), $(basename "$pd_profile") (1P1D)" "$out" | tee "$out/fidelity.md"
log "wrote $out/fidelity.md"
