#!/usr/bin/env python3
"""Tables the simulator against real engines (scripts/calibration/fidelity.sh).

Usage: fidelity.py [--profile FILE] [--limit 0.15] OUT_DIR

OUT_DIR/real/RUN/ and OUT_DIR/sim/RUN/ hold one run each (kvc-replay drive's and sim's
summary.json and metrics.jsonl), RUN being TOPOLOGY-POLICY. Per run: TTFT and latency p50 and
p90, simulated and real, and sim / real; the execution-mode shares and the direct-to-D share,
with the difference in points; the paired requests (the same trace line in both) and the
median relative error of their TTFT and latency. A figure outside the limit (15% for times,
3 points for shares) is marked with `!`. Exits 1 when a run's records are missing.
"""
import argparse
import json
import os
import statistics
import sys

RUNS = ["1p1d-kvc", "1p1d-cache-aware", "2x-kvc", "2x-cache-aware"]
TIMES = [("ttft_s", "p50", "TTFT p50"), ("ttft_s", "p90", "TTFT p90"),
         ("latency_s", "p50", "latency p50"), ("latency_s", "p90", "latency p90")]
SHARE_LIMIT = 0.03


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"fidelity.py: {path}: {e}")


def records(path):
    out = {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    out[r["index"]] = r
                except (ValueError, KeyError) as e:
                    sys.exit(f"fidelity.py: {path} line {n}: not a request record ({e})")
    except OSError as e:
        sys.exit(f"fidelity.py: {path}: {e}")
    return out


def mode_shares(recs):
    modes = {}
    for r in recs.values():
        m = r.get("mode") or "unknown"
        modes[m] = modes.get(m, 0) + 1
    return {m: c / len(recs) for m, c in modes.items()} if recs else {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="")
    ap.add_argument("--limit", type=float, default=0.15)
    ap.add_argument("out")
    a = ap.parse_args()
    rows = []
    worst = 0.0
    for run in RUNS:
        rd, sd = (os.path.join(a.out, k, run) for k in ("real", "sim"))
        if not (os.path.isdir(rd) and os.path.isdir(sd)):
            sys.exit(f"fidelity.py: run {run} missing under {a.out}/real or {a.out}/sim")
        real_s, sim_s = load_json(os.path.join(rd, "summary.json")), load_json(os.path.join(sd, "summary.json"))
        real_r, sim_r = records(os.path.join(rd, "metrics.jsonl")), records(os.path.join(sd, "metrics.jsonl"))
        cells = []
        for key, stat, _ in TIMES:
            r, s = real_s[key][stat], sim_s[key][stat]
            ratio = s / r if r > 0 else float("inf")
            worst = max(worst, abs(ratio - 1.0))
            mark = "!" if abs(ratio - 1.0) > a.limit else ""
            cells.append(f"{s:.3f} / {r:.3f} = {ratio:.2f}{mark}")
        rm, sm = mode_shares(real_r), mode_shares(sim_r)
        modes = []
        for m in sorted(set(rm) | set(sm)):
            d = sm.get(m, 0.0) - rm.get(m, 0.0)
            modes.append(f"{m} {sm.get(m, 0.0):.2f}/{rm.get(m, 0.0):.2f}{'!' if abs(d) > SHARE_LIMIT else ''}")
        dr, ds = real_s.get("direct_to_d_rate", 0.0), sim_s.get("direct_to_d_rate", 0.0)
        direct = f"{ds:.2f} / {dr:.2f}{'!' if abs(ds - dr) > SHARE_LIMIT else ''}"
        paired = sorted(set(real_r) & set(sim_r))
        errs = {}
        for key in ("ttft_s", "latency_s"):
            rel = []
            for i in paired:
                r, s = real_r[i].get(key), sim_r[i].get(key)
                if r and s is not None and r > 0:
                    rel.append(abs(s - r) / r)
            errs[key] = statistics.median(rel) if rel else float("nan")
        rows.append([run] + cells + ["; ".join(modes), direct,
                                     f"{len(paired)}/{len(real_r)}",
                                     f"{errs['ttft_s']:.2f}", f"{errs['latency_s']:.2f}"])
    head = (["run"] + [f"{t} sim / real (s)" for _, _, t in TIMES]
            + ["modes sim/real", "direct-to-D sim / real", "paired",
               "median \\|err\\| TTFT", "median \\|err\\| latency"])
    if a.profile:
        print(f"Simulator (profiles {a.profile}) against real vLLM (CPU build) "
              f"behind kvc-router, the same trace; `!` marks a figure beyond "
              f"{a.limit:.0%} (times) or {SHARE_LIMIT * 100:.0f} points (shares).\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\nLargest gap of a time figure, |sim / real - 1|: {worst:.0%}")


if __name__ == "__main__":
    main()
