#!/usr/bin/env python3
"""The simulator against the real side-by-side legs it can model (scripts/side-by-side/real.sh).

Usage: real_sim.py [--limit 0.10] OUT_DIR

OUT_DIR/runs/LEG/repN/ hold the real legs (as real_table.py reads them) and OUT_DIR/sim/POLICY/
the simulator's runs of the same trace on two colocated engines with the profile measured on
the spot (`kvc-replay sim --topology 2dp`, written by real.sh). The legs it can model, and the
simulated policy standing for each:

  kvc-2x          kvc          (the same policy code, in process)
  smg-2x          cache-aware  (SMG's cache_aware: the longest cached prefix, load-balanced)
  round-robin-2x  round-robin

Per leg: the share of the trace's prompt tokens computed, real (the engines' own
vllm:prompt_tokens_by_source_total{source="local_compute"}, mean over the repetitions) and
simulated (uncached_tokens over input_tokens of sim's records), their relative difference,
marked `!` past the limit; TTFT mean and p50 real and simulated. Then the order of the legs by
computed share, real and simulated, and whether they agree. Exits 1 when a run is missing.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_table import rep_figures  # noqa: E402  (the real table's own reading of a leg)

LEGS = [("kvc-2x", "kvc"), ("smg-2x", "cache-aware"), ("round-robin-2x", "round-robin")]


def sim_figures(d):
    computed = total = 0
    with open(os.path.join(d, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            total += rec["input_tokens"]
            computed += rec["uncached_tokens"]
    with open(os.path.join(d, "summary.json")) as f:
        s = json.load(f)
    return {"computed share": computed / total if total else 0.0,
            "ttft_s mean": s["ttft_s"]["mean"], "ttft_s p50": s["ttft_s"]["p50"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=0.10)
    ap.add_argument("out")
    a = ap.parse_args()
    rows = []
    for leg, policy in LEGS:
        d = os.path.join(a.out, "runs", leg)
        reps = sorted(r for r in os.listdir(d) if r.startswith("rep")) if os.path.isdir(d) else []
        reps = [r for r in reps if os.path.exists(os.path.join(d, r, "drive.json"))]
        sd = os.path.join(a.out, "sim", policy)
        if not reps or not os.path.exists(os.path.join(sd, "metrics.jsonl")):
            sys.exit(f"real_sim.py: missing {d}/repN or {sd}/metrics.jsonl")
        figs = [rep_figures(os.path.join(d, r)) for r in reps]
        real = {k: sum(f[k] for f in figs) / len(figs)
                for k in ("computed share", "ttft_s mean", "ttft_s p50")}
        rows.append((leg, policy, real, sim_figures(sd)))

    print("| leg (simulated policy) | computed, real | computed, sim | sim / real "
          "| TTFT mean real / sim (s) | TTFT p50 real / sim (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for leg, policy, real, sim in rows:
        rel = sim["computed share"] / real["computed share"] - 1 if real["computed share"] else 0.0
        worst = max(worst, abs(rel))
        mark = " !" if abs(rel) > a.limit else ""
        print(f"| {leg} ({policy}) | {real['computed share']:.3f} | {sim['computed share']:.3f} "
              f"| {1 + rel:.2f}{mark} | {real['ttft_s mean']:.2f} / {sim['ttft_s mean']:.2f} "
              f"| {real['ttft_s p50']:.2f} / {sim['ttft_s p50']:.2f} |")
    order_real = [leg for leg, _, r, _ in sorted(rows, key=lambda x: x[2]["computed share"])]
    order_sim = [leg for leg, _, _, s in sorted(rows, key=lambda x: x[3]["computed share"])]
    print(f"\nFewest prompt tokens computed first: real {' < '.join(order_real)}; "
          f"simulated {' < '.join(order_sim)}: "
          f"{'the same order' if order_real == order_sim else 'NOT the same order'}; "
          f"largest difference of a computed share {100 * worst:.1f}% "
          f"({'within' if worst <= a.limit else 'past'} the {100 * a.limit:.0f}% limit).")


if __name__ == "__main__":
    main()
