#!/usr/bin/env python3
"""Prints the side-by-side table of HTTP replays (kvc-replay live --http-router ... --out DIR).

Usage: table.py [--speedup X] [--topology T] [--trace FILE] [--skip-missing] NAME=DIR [NAME=DIR ...]

Each DIR holds summary.json and http.json. TTFT and latency are in engine seconds (wall time
times the speed-up, as the replay reports them); the router's added latency is in wall
milliseconds. Direct cache misses: direct-to-D turns a decode worker served in full because the
session was no longer resident there (vLLM dialect).
"""
import argparse
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedup")
    ap.add_argument("--topology")
    ap.add_argument("--trace")
    ap.add_argument("--skip-missing", action="store_true",
                    help="leave out runs whose DIR has no results (a leg not run yet)")
    ap.add_argument("runs", nargs="+", metavar="NAME=DIR")
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        name, sep, d = spec.partition("=")
        if not sep:
            sys.exit(f"table.py: expected NAME=DIR, got {spec!r}")
        if args.skip_missing and not os.path.exists(os.path.join(d, "summary.json")):
            print(f"table.py: no results in {d}; {name} left out", file=sys.stderr)
            continue
        try:
            runs.append((name, load(os.path.join(d, "summary.json")), load(os.path.join(d, "http.json"))))
        except (OSError, ValueError) as e:
            sys.exit(f"table.py: {d}: {e}")
    if not runs:
        sys.exit("table.py: no results to table")

    rows = []
    for label, key in (("TTFT", "ttft_s"), ("latency", "latency_s")):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (s)", [f"{s[key][stat]:.3f}" for _, s, _ in runs]))
    rows.append(("mechanism errors", [str(s["mechanism_errors"]) for _, s, _ in runs]))
    rows.append(("requests (ok)", [f"{s['requests']} ({s['outcomes'].get('ok', 0)})" for _, s, _ in runs]))
    rows.append(("direct-to-D rate", [f"{s['direct_to_d_rate']:.3f}" for _, s, _ in runs]))
    rows.append(("direct cache misses", [str(h.get("direct_cache_misses", 0)) for _, _, h in runs]))
    for stat in ("mean", "p50", "p90", "p99"):
        rows.append((f"router added {stat} (ms)", [f"{h['router_added'][stat + '_ms']:.3f}" for _, _, h in runs]))

    what = []
    if args.trace:
        what.append(f"trace {os.path.basename(args.trace)}")
    if args.topology:
        what.append(f"topology {args.topology}")
    if args.speedup:
        what.append(f"speed-up {args.speedup}")
    if what:
        print("Same simulated workers and trace for every router: " + ", ".join(what) + ".")
        print("TTFT/latency in engine seconds; router added latency in wall milliseconds.\n")
    width = max(len(r[0]) for r in rows)
    cols = [max(len(n), 10) for n, _, _ in runs]
    print("| " + "metric".ljust(width) + " | " + " | ".join(n.rjust(c) for (n, _, _), c in zip(runs, cols)) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * (c + 1) + ":" for c in cols) + "|")
    for name, vals in rows:
        print("| " + name.ljust(width) + " | " + " | ".join(v.rjust(c) for v, c in zip(vals, cols)) + " |")


if __name__ == "__main__":
    main()
