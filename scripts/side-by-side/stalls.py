#!/usr/bin/env python3
"""Which turns a kvc-router leg's stalls hit, from the router's own timeline.

Reads a leg's router.log written with `KVC_ROUTER_LOG=warn,kvc_router::http=debug,
kvc_router::worker_http=debug` (real.sh's variable: each request's "request received" line,
with its session and turn, and each worker call's "sent" / "answered" lines, by the
`X-Request-Id` both legs of a P→D turn carry) and the leg's metrics.jsonl (the driver's record
of each turn: its TTFT, mode, tokens). For every turn it splits the time to the first token in
two: the prefill worker's call (sent to answered; 0 for a turn that did not go through P) and
the rest (the decode worker's KV transfer, queue and first step, as the client saw it).

Prints each turn where either part is over THRESHOLD seconds (default 10), and how many turns
each part delayed. Exit status 2 when the log has no timeline (a leg run without the debug
filter) or names turns the records do not have.

Usage: stalls.py LEG_REP_DIR [THRESHOLD]
"""

import json
import re
import sys
from datetime import datetime

LINE = re.compile(r"^(\S+)\s+DEBUG\s+(\S+): (.*)$")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def fields(text):
    return {k: v.strip('"') for k, v in FIELD.findall(text)}


def when(stamp):
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    leg = sys.argv[1]
    threshold = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    turn_of = {}  # kvc request id -> (session key, turn)
    calls = {}  # kvc request id -> {(worker, event): time}
    with open(f"{leg}/router.log") as f:
        for n, line in enumerate(f, 1):
            m = LINE.match(line)
            if not m:
                continue
            stamp, _, rest = m.groups()
            f_ = fields(rest)
            if rest.startswith("request received"):
                turn_of[int(f_["request"])] = (f_["session"], int(f_["turn"]))
            elif rest.startswith("worker call "):
                event = rest.split()[2]
                rid = re.match(r"kvc-(\d+)-", f_.get("request_id", ""))
                if rid:
                    calls.setdefault(int(rid.group(1)), {})[(f_["worker"], event)] = when(stamp)
    if not turn_of:
        print(f"{leg}/router.log has no timeline: run the leg with "
              "KVC_ROUTER_LOG=warn,kvc_router::http=debug,kvc_router::worker_http=debug",
              file=sys.stderr)
        return 2
    records = {}
    with open(f"{leg}/metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            records[(f"s{r['session']}", r["turn"])] = r
    prefill_worker = None
    rows = []
    for rid, key in sorted(turn_of.items()):
        r = records.get(key)
        if r is None:
            print(f"request {rid} ({key[0]} turn {key[1]}) is not in {leg}/metrics.jsonl",
                  file=sys.stderr)
            return 2
        c = calls.get(rid, {})
        # A P→D turn's first call is P's: the worker called twice by the same request.
        sent = sorted((t, w) for (w, e), t in c.items() if e == "sent")
        p_s = 0.0
        if len(sent) >= 2:
            p = sent[0][1]
            prefill_worker = p
            if (p, "answered") in c:
                p_s = c[(p, "answered")] - c[(p, "sent")]
        rows.append((r["dispatch_s"], key, r, p_s, max(0.0, r["ttft_s"] - p_s)))
    rows.sort(key=lambda x: x[0])
    slow_p = sum(1 for *_, p, _ in rows if p > threshold)
    slow_d = sum(1 for *_, d in rows if d > threshold)
    print(f"{leg}: {len(rows)} turns; prefill worker {prefill_worker or 'none'}; "
          f"over {threshold:g} s: prefill call {slow_p}, after it {slow_d}")
    print(f"{'sent s':>7} {'session':>7} {'turn':>4} {'mode':<12} {'P call s':>8} "
          f"{'after s':>7} {'TTFT s':>7} {'prompt':>6} {'new':>5}")
    for dispatch, (s, t), r, p, d in rows:
        if p > threshold or d > threshold:
            print(f"{dispatch:7.1f} {s:>7} {t:4d} {r['mode']:<12} {p:8.1f} {d:7.1f} "
                  f"{r['ttft_s']:7.1f} {r['input_tokens']:6d} {r['uncached_tokens']:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
