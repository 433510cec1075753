#!/usr/bin/env python3
"""Tables the side-by-side runs on real vLLM (scripts/side-by-side/real.sh).

Usage: real_table.py [--trace FILE] RUNS_DIR

RUNS_DIR/LEG/repN/ holds one repetition of a leg: kvc-replay drive's summary.json, drive.json
and metrics.jsonl, and every engine's /metrics before and after it (engineI.before.prom,
engineI.after.prom). Each cell is the mean over the repetitions, with the lowest and highest
in brackets when there are several. Seconds are wall seconds on the real engines.

- prompt tokens computed: the engines' own count of prompt tokens they computed
  (vllm:prompt_tokens_by_source_total{source="local_compute"}, summed over the engines, the
  leg's increase), as a share of the trace's prompt tokens; a P/D request's tokens computed
  on P count once, D's pulled KV not at all.
- cached share (answers): usage.prompt_tokens_details.cached_tokens over prompt_tokens, as the
  answers report it (a P/D decode engine counts the KV it pulled as cached).
- router and API (ms/request): the clients' latency minus the engines' own request time
  (vllm:e2e_request_latency_seconds, summed over the engines), per request: the router, the
  engines' HTTP servers and loopback.
- engine TTFT mean (s): the engines' own time to first token (vllm:time_to_first_token_seconds,
  sum over count, the leg's increase, all engines): what the TTFT mean is before the router,
  the engine's HTTP server and loopback (on 1P1D, P's calls count among the requests).
- router CPU (ms/request): the router process's CPU time (user and system, with its child
  processes) over the replay, per request (router-cpu-s, written by real.sh).
- engines' CPU (ms/request): the CPU time of the engines' processes (API servers, engine
  cores, workers) over the leg, per request (cpu-use.json, written by real.sh): the same work
  costing more in one leg than another says the engines ran slower there.
- machine load (mean, max): the machine's 1-minute load average sampled every 5 s while the
  leg ran (loadavg.txt, written by real.sh): the engines, the router and the client are about
  2-4 on two cores; more says something else ran beside the leg.
- preemptions: requests the engines preempted for want of KV room (vllm:num_preemptions_total,
  the leg's increase, all engines).
- blocks evicted: KV blocks the engines removed from their pools while the leg ran, from their
  own KV events (BlockRemoved, medium GPU; kv-events.json, written by kv_count.py).
- later turns mostly recomputed: the share of turns after a session's first whose answer
  reports less than half of its prompt cached.
The engines' pools (blocks of 32 tokens, as each engine reported them) head the table when the
runs recorded them (engines.json). Then, per repetition and per topology, kvc-router against
the best peer leg on the same engines on each headline figure (TTFT mean, p50, p90; latency
mean, p50), as kvc / peer, and when both topologies ran, kvc-router's better configuration
against the best peer overall.
"""
import argparse
import json
import os
import re
import sys

LEGS = [
    ("kvc-1p1d", "kvc-router (kvc, 1P1D)"),
    ("kvc-2x", "kvc-router (kvc, 2 colocated)"),
    ("vllm-router-1p1d", "vllm-router 0.1.17 (P/D kv_aware)"),
    ("vllm-router-2x", "vllm-router 0.1.17 (kv_aware, 2 colocated)"),
    ("smg-2x", "smg 1.13.0 (cache_aware sticky, 2 colocated)"),
    ("round-robin-2x", "round-robin (2 colocated)"),
    ("dynamo-2x", "Dynamo 1.6.1 KV router (2 colocated, vLLM 0.31)"),
]
OURS = ("kvc-1p1d", "kvc-2x")
HEADLINE = [("ttft_s", "mean"), ("ttft_s", "p50"), ("ttft_s", "p90"),
            ("latency_s", "mean"), ("latency_s", "p50")]
PROM = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"real_table.py: {path}: {e}")


def prom(path):
    """name -> {labels: value} of one /metrics scrape."""
    out = {}
    with open(path) as f:
        for line in f:
            m = PROM.match(line)
            if m:
                out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def engine_delta(d, name, label=None):
    """The increase of metric NAME (the series whose labels hold LABEL), summed over engines."""
    total = 0.0
    for f in sorted(os.listdir(d)):
        if not f.endswith(".before.prom"):
            continue
        before = prom(os.path.join(d, f))
        after = prom(os.path.join(d, f.replace(".before.", ".after.")))
        for labels, v in after.get(name, {}).items():
            if label is None or label in labels:
                total += v - before.get(name, {}).get(labels, 0.0)
    return total


def rep_figures(d):
    s = load(os.path.join(d, "summary.json"))
    r = load(os.path.join(d, "drive.json"))
    latencies = []
    with open(os.path.join(d, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("latency_s") is not None:
                latencies.append(rec["latency_s"])
    fig = {f"{k} {stat}": s[k][stat] for k in ("ttft_s", "latency_s")
           for stat in ("mean", "p50", "p90", "p99")}
    computed = engine_delta(d, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
    fig["computed share"] = computed / r["trace_prompt_tokens"] if r["trace_prompt_tokens"] else 0.0
    fig["cached share"] = r["reported_cached_share"]
    fig["direct"] = s["direct_to_d_rate"]
    engine_s = engine_delta(d, "vllm:e2e_request_latency_seconds_sum")
    fig["overhead ms"] = 1000.0 * (sum(latencies) - engine_s) / len(latencies) if latencies else 0.0
    ttft_n = engine_delta(d, "vllm:time_to_first_token_seconds_count")
    if ttft_n:
        fig["engine ttft"] = engine_delta(d, "vllm:time_to_first_token_seconds_sum") / ttft_n
    cpu = os.path.join(d, "router-cpu-s")
    if os.path.exists(cpu) and latencies:
        with open(cpu) as f:
            fig["router cpu ms"] = 1000.0 * float(f.read()) / len(latencies)
    la = os.path.join(d, "loadavg.txt")
    if os.path.exists(la):
        with open(la) as f:
            loads = [float(line.split()[1]) for line in f if len(line.split()) == 2]
        if loads:
            fig["load mean"] = sum(loads) / len(loads)
            fig["load max"] = max(loads)
    use = os.path.join(d, "cpu-use.json")
    if os.path.exists(use) and latencies:
        procs = load(use)["processes"]
        engines = sum(p["cpu_s"] for p in procs if p["name"].startswith("vllm:"))
        fig["engines cpu ms"] = 1000.0 * engines / len(latencies)
    fig["preemptions"] = engine_delta(d, "vllm:num_preemptions_total")
    kv = os.path.join(d, "kv-events.json")
    if os.path.exists(kv):
        counts = load(kv)
        fig["evicted"] = sum(c["removed"].get("GPU", 0) for c in counts.values())
    later = mostly = 0
    with open(os.path.join(d, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("turn", 1) > 1 and rec.get("input_tokens"):
                later += 1
                mostly += rec.get("cached_tokens", 0) * 2 < rec["input_tokens"]
    if later:
        fig["mostly recomputed"] = mostly / later
    fig["mechanism errors"] = s["mechanism_errors"]
    fig["errors"] = sum(r["errors"].values())
    fig["answered"] = r["answered"]
    fig["requests"] = r["requests"]
    fig["error kinds"] = r["errors"]
    fig["mismatches"] = r["token_count_mismatches"]
    return fig


def cell(values, fmt):
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def kvc_pd_label(name, configs):
    """kvc-router's 1P1D label, saying whether its engines were kept to their roles (every
    worker `serve-alone = false`) or could serve turns alone, as its configurations say."""
    kept = set()
    for path in configs:
        try:
            with open(path) as f:
                kept.add("serve-alone = false" in f.read().splitlines())
        except OSError:
            return name
    if kept == {True}:
        return "kvc-router (kvc, 1P1D, roles kept)"
    if kept == {False}:
        return "kvc-router (kvc, 1P1D, P or D may serve alone)"
    return "kvc-router (kvc, 1P1D, mixed configurations)"


def gate_label(name, configs):
    """`name` with kvc-router's prefill gate (`prefills-per-worker` in its [http] table), when
    its configurations set one."""
    gates = set()
    for path in configs:
        try:
            with open(path) as f:
                lines = [l.strip() for l in f.read().splitlines()]
        except OSError:
            return name
        found = [l.split("=", 1)[1].strip() for l in lines if l.startswith("prefills-per-worker")]
        gates.add(found[0] if found else "0")
    if gates == {"0"}:
        return name
    said = "/".join(sorted(gates))
    return name[:-1] + f", prefill gate {said})" if name.endswith(")") else f"{name} (prefill gate {said})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace")
    ap.add_argument("runs")
    a = ap.parse_args()
    legs = []
    for key, name in LEGS:
        d = os.path.join(a.runs, key)
        if not os.path.isdir(d):
            continue
        reps = sorted((r for r in os.listdir(d) if r.startswith("rep")
                       and os.path.exists(os.path.join(d, r, "drive.json"))),
                      key=lambda r: int(r[3:]))
        if reps:
            configs = [os.path.join(d, r, "kvc-router.toml") for r in reps]
            if key == "kvc-1p1d":
                name = kvc_pd_label(name, configs)
            if key.startswith("kvc-"):
                name = gate_label(name, configs)
            legs.append((key, name, [rep_figures(os.path.join(d, r)) for r in reps]))
    if not legs:
        sys.exit(f"real_table.py: no leg with results under {a.runs}")

    rows = []
    for k, label in (("ttft_s", "TTFT"), ("latency_s", "latency")):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (s)", f"{k} {stat}", "{:.2f}"))
    rows += [("prompt tokens computed", "computed share", "{:.3f}"),
             ("cached share (answers)", "cached share", "{:.3f}"),
             ("direct-to-D share", "direct", "{:.3f}"),
             ("engine TTFT mean (s)", "engine ttft", "{:.3f}"),
             ("router and API (ms/request)", "overhead ms", "{:.0f}"),
             ("router CPU (ms/request)", "router cpu ms", "{:.1f}"),
             ("engines' CPU (ms/request)", "engines cpu ms", "{:.0f}"),
             ("machine load, mean", "load mean", "{:.1f}"),
             ("machine load, max", "load max", "{:.1f}"),
             ("preemptions", "preemptions", "{:.0f}"),
             ("blocks evicted (KV events)", "evicted", "{:.0f}"),
             ("later turns mostly recomputed", "mostly recomputed", "{:.3f}")]
    table = []
    for title, key, fmt in rows:
        table.append((title, [cell([f[key] for f in figs if key in f], fmt) if any(key in f for f in figs)
                              else "n/a" for _, _, figs in legs]))
    table.append(("mechanism errors", [str(sum(f["mechanism errors"] for f in figs)) for _, _, figs in legs]))
    table.append(("errors (all kinds)", [
        str(sum(f["errors"] for f in figs)) + (" " + ",".join(sorted({k for f in figs for k in f["error kinds"]})) if any(f["errors"] for f in figs) else "")
        for _, _, figs in legs]))
    table.append(("answered", [f"{sum(f['answered'] for f in figs)}/{sum(f['requests'] for f in figs)}" for _, _, figs in legs]))
    table.append(("repetitions", [str(len(figs)) for _, _, figs in legs]))

    if a.trace:
        print(f"Real vLLM (CPU build), two engines per leg; trace {os.path.basename(a.trace)}, "
              "the same prompts for every leg, prefix caches emptied before each.")
        held = {}
        for line in pools(a.runs, legs, held):
            print(line)
        peak, mean = live_context(a.trace)
        print(f"Live context by the trace's clock (each started session's latest prompt and "
              f"answer, until its last turn), blocks of 32 tokens: peak {peak:,}, mean {mean:,.0f}"
              + "".join(f"; {g}: {n:,} pooled where sessions live, peak {peak / n:.1f}x, "
                        f"mean {mean / n:.1f}x" for g, n in sorted(held.items()) if n)
              + ".")
        print("Mean over the repetitions (lowest–highest).\n")
    width = max(len(t) for t, _ in table)
    cols = [max(len(n), max(len(v[i]) for _, v in table)) for i, (_, n, _) in enumerate(legs)]
    print("| " + "metric".ljust(width) + " | " + " | ".join(n.rjust(c) for (_, n, _), c in zip(legs, cols)) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * (c + 1) + ":" for c in cols) + "|")
    for title, vals in table:
        print("| " + title.ljust(width) + " | " + " | ".join(v.rjust(c) for v, c in zip(vals, cols)) + " |")

    for topology in ("1p1d", "2x"):
        ratios(f"kvc-router / the best peer on the same engines ({topology}), per repetition "
               "(below 1: kvc ahead)", [l for l in legs if l[0].endswith("-" + topology)])
    if {l[0].rsplit("-", 1)[1] for l in legs} == {"1p1d", "2x"}:
        ratios("kvc-router's better configuration / the best peer, per repetition "
               "(below 1: kvc ahead)", legs)


def live_context(trace, block=32):
    """(peak, time-weighted mean) of the blocks the trace's live sessions hold by its own
    clock: a session holds its latest request's prompt and answer from its first request to
    its last."""
    rows = [json.loads(line) for line in open(trace) if line.strip()]
    last = {}
    for r in rows:
        last[r["session_id"]] = max(last.get(r["session_id"], 0), r["timestamp"])
    events = sorted([(r["timestamp"], r["session_id"],
                      -(-(r["input_length"] + r["output_length"]) // block)) for r in rows]
                    + [(t + 1, sid, 0) for sid, t in last.items()])
    held, peak, area, prev = {}, 0, 0, events[0][0] if events else 0
    for t, sid, blocks in events:
        area += sum(held.values()) * (t - prev)
        prev = t
        held[sid] = blocks
        peak = max(peak, sum(held.values()))
    span = prev - (events[0][0] if events else 0)
    return peak, (area / span if span else 0)


def pools(runs, legs, held=None):
    """One line per group of engines: each engine's role and KV pool, from engines.json.
    `held`, when given, gets each group's blocks where sessions live (every engine but a
    prefill-only one)."""
    seen = {}
    for key, _, _ in legs:
        group = "2x (Dynamo's workers)" if key.startswith("dynamo-") else key.rsplit("-", 1)[1]
        d = os.path.join(runs, key)
        for rep in sorted(os.listdir(d)):
            path = os.path.join(d, rep, "engines.json")
            if group in seen or not os.path.exists(path):
                continue
            r = load(path)
            if "workers" in r:  # Dynamo's workers (scripts/dynamo/up.sh)
                seen[group] = ", ".join(f"{w['name']} {w['kv-blocks']:,} blocks"
                                        + (" (cut)" if r.get("gpu-blocks-override") else "")
                                        for w in r["workers"])
                if held is not None:
                    held[group] = sum(w["kv-blocks"] for w in r["workers"])
            else:
                if held is not None:
                    held[group] = sum(e["gpu-blocks"] for e in r["engines"]
                                      if e.get("gpu-blocks") is not None and e.get("role") != "prefill")
                seen[group] = ", ".join(
                    f"{e['name']} ({e['role']}) {e['gpu-blocks']:,} blocks"
                    + (" (cut)" if e.get("gpu-blocks-override") else "")
                    + (f", computing on core {e['core']}" if e.get("core") is not None else "")
                    for e in r["engines"] if e.get("gpu-blocks") is not None)
    return [f"KV pools, blocks of 32 tokens, {g}: {v}." for g, v in sorted(seen.items()) if v]


def ratios(title, legs):
    ours = [l for l in legs if l[0] in OURS]
    peers = [l for l in legs if l[0] not in OURS]
    if not ours or not peers:
        return
    n = min(len(figs) for _, _, figs in legs)
    print(f"\n{title}:\n")
    print("| figure | " + " | ".join(f"rep {i + 1}" for i in range(n)) + " |")
    print("|---|" + "---:|" * n)
    for k, stat in HEADLINE:
        key = f"{k} {stat}"
        cells = []
        for i in range(n):
            best_ours = min(ours, key=lambda l: l[2][i][key])
            best_peer = min(peers, key=lambda l: l[2][i][key])
            ratio = best_ours[2][i][key] / best_peer[2][i][key] if best_peer[2][i][key] else float("inf")
            cells.append(f"{ratio:.2f} ({best_ours[0]} vs {best_peer[0]})")
        label = "TTFT" if k == "ttft_s" else "latency"
        print(f"| {label} {stat} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
