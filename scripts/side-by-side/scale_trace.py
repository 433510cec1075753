"""Scales a kvc-replay SWE trace down to what a CPU engine serves in minutes.

Every token count is divided by FACTOR (rounded up) and each block id then stands for
BLOCK/FACTOR tokens, so which blocks repeat, and where, is the trace's own: the shared system
prompt, contexts growing turn by turn, the large appends. Only each session's first TURNS turns
are kept; timestamps (and so the seconds between turns) are unchanged. Outputs are capped at
MAX_OUTPUT tokens after scaling.

Usage: python3 scale_trace.py IN OUT [--factor 4] [--block 512] [--turns 8] [--max-output 64]
Prints the scaled trace's block size (replay it with --block-size that many tokens).
"""

import argparse
import json
import math
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--block", type=int, default=512, help="tokens per block id of the input")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=64)
    a = ap.parse_args()
    if a.factor < 1 or a.block % a.factor:
        sys.exit(f"scale_trace: --factor {a.factor} must divide --block {a.block}")
    block = a.block // a.factor
    kept = 0
    with open(a.input) as src, open(a.output, "w") as dst:
        for n, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                turn, length, ids = r["turn_id"], r["input_length"], r["hash_ids"]
            except (ValueError, KeyError) as e:
                sys.exit(f"scale_trace: {a.input} line {n}: not a trace record with turn_id, "
                         f"input_length and hash_ids ({e})")
            if turn > a.turns:
                continue
            r["input_length"] = math.ceil(length / a.factor)
            r["output_length"] = max(1, min(a.max_output, math.ceil(r["output_length"] / a.factor)))
            if math.ceil(r["input_length"] / block) != len(ids):
                sys.exit(f"scale_trace: {a.input} line {n}: {len(ids)} block ids for "
                         f"{length} tokens in blocks of {a.block}")
            dst.write(json.dumps(r, separators=(",", ":")) + "\n")
            kept += 1
    print(f"scale_trace: {kept} requests, blocks of {block} tokens", file=sys.stderr)
    print(block)


if __name__ == "__main__":
    main()
