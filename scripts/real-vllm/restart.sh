#!/usr/bin/env bash
# Starts one engine of scripts/real-vllm/up.sh again (stopping it first if it still runs),
# with the command up.sh kept in OUT_DIR/NAME.start, and waits until it answers /health. The
# new pid goes to OUT_DIR/NAME.pid and ready.json; the log is appended to OUT_DIR/NAME.log.
#
#   scripts/real-vllm/restart.sh OUT_DIR NAME
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OUT_DIR NAME" >&2; exit 2; }
out="$1"
name="$2"
start="$out/$name.start"
[ -f "$start" ] || { echo "real-vllm: no engine $name in $out (no $start)" >&2; exit 1; }
[ -f "$out/ready.json" ] || { echo "real-vllm: $out has no ready.json (run up.sh)" >&2; exit 1; }
timeout="${KVC_REAL_VLLM_START_TIMEOUT:-420}"
if [ -f "$out/$name.pid" ]; then
  old="$(cat "$out/$name.pid")"
  kill -TERM -- "-$old" 2>/dev/null || true
  for _ in $(seq 1 40); do
    kill -0 -- "-$old" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$old" 2>/dev/null || true
fi
url="$(python3 -c 'import json,sys; e=[e for e in json.load(open(sys.argv[1]))["engines"] if e["name"]==sys.argv[2]][0]; print(e["http-url"])' "$out/ready.json" "$name")"
echo "---- restarted by restart.sh ----" >>"$out/$name.log"
setsid bash "$start" >>"$out/$name.log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$out/$name.pid"
python3 - "$out/ready.json" "$name" "$pid" <<'PY'
import json, sys
path, name, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
ready = json.load(open(path))
for e in ready["engines"]:
    if e["name"] == name:
        e["pid"] = pid
with open(path + ".tmp", "w") as f:
    json.dump(ready, f, indent=2)
    f.write("\n")
PY
mv "$out/ready.json.tmp" "$out/ready.json"
deadline=$((SECONDS + timeout))
until curl -fsS -o /dev/null "$url/health" 2>/dev/null; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "real-vllm: $name exited before it was ready; last lines of $out/$name.log:" >&2
    tail -n 30 "$out/$name.log" >&2
    exit 1
  fi
  [ "$SECONDS" -lt "$deadline" ] || { echo "real-vllm: $name not ready within ${timeout}s" >&2; exit 1; }
  sleep 1
done
echo "real-vllm: $name restarted (pid $pid) in ${SECONDS}s" >&2
# Pinned by up.sh (KVC_REAL_VLLM_PIN): its new compute process goes back to its core.
if [ -f "$out/$name.core" ]; then
  core="$(cat "$out/$name.core")"
  for w in $(pgrep -s "$pid" -x 'VLLM::Worker' || true); do
    taskset -a -p -c "$core" "$w" >/dev/null || { echo "real-vllm: could not pin $name's worker $w to core $core" >&2; exit 1; }
  done
fi
# An engine of a P/D pair starts with its NIXL transfer path closed: the first P->D request
# after a start pays for the handshake, or fails with vLLM's 500 when P answers too late (seen
# after a restart of P). As up.sh does, one exchange per pair opens it, once every engine
# answers /health; with an engine still down it is left to the next restart.
pairs="$(python3 - "$out/ready.json" <<'PY'
import json, sys, urllib.request
engines = json.load(open(sys.argv[1]))["engines"]
if not {"prefill", "decode"} <= {e["role"] for e in engines}:
    print("none")
    sys.exit()
for e in engines:
    try:
        urllib.request.urlopen(e["http-url"] + "/health", timeout=5)
    except Exception:
        print("down " + e["name"])
        sys.exit()
print("up")
PY
)"
case "$pairs" in
  up) python3 "$(dirname "$0")/warm_transfer.py" "$out/ready.json" \
        || { echo "real-vllm: $name restarted, but no P->D transfer completes" >&2; exit 1; } ;;
  down*) echo "real-vllm: transfer path not opened yet: engine ${pairs#down } is down" >&2 ;;
esac
