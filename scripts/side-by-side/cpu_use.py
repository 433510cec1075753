#!/usr/bin/env python3
"""Where the machine's CPU goes while a leg runs: every process's CPU seconds over the leg and
how many of its threads were runnable on average (sampled every INTERVAL seconds), written as
JSON to OUT when the sampler is stopped (SIGTERM or SIGINT).

A process is named by its role where it has one: the vLLM API server and engine-core processes
by the port in their command line or their parent's (`vllm:18210 api`, `vllm:18210 core`), the
routers and the driver by their program; everything else by its command name.

Usage: cpu_use.py OUT [INTERVAL]
"""

import json
import os
import re
import signal
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def stat(pid):
    """(comm, state, ppid, utime + stime in ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    comm = s[s.index("(") + 1 : s.rindex(")")]
    rest = s[s.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[1]), int(rest[11]) + int(rest[12])


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def runnable_threads(pid):
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        if s[s.rindex(")") + 2] == "R":
            n += 1
    return n


def name_of(pid, comm, ppid, names):
    cmd = cmdline(pid)
    port = re.search(r"--port[ =](\d+)", cmd)
    if "vllm.entrypoints" in cmd or "dynamo.vllm" in cmd:
        return f"vllm:{port.group(1) if port else pid} api"
    if comm.startswith("VLLM::") or "EngineCore" in comm or comm.startswith("VLLM"):
        parent = names.get(ppid, "")
        base = parent.rsplit(" ", 1)[0] if parent.startswith("vllm:") else "vllm:?"
        return f"{base} {comm.replace('VLLM::', '').lower()}"
    for prog in ("kvc-router", "kvc-replay", "vllm-router", "smg", "dynamo.frontend"):
        if prog in cmd.split(" ", 2)[0] or f" {prog}" in cmd[:200] or f"-m {prog}" in cmd:
            return prog
    return comm


def main():
    out = sys.argv[1]
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    start = {}
    names = {}
    runnable = {}
    samples = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    last = {}
    t0 = time.time()
    while True:
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        for pid in pids:
            st = stat(pid)
            if st is None:
                continue
            comm, _, ppid, ticks = st
            if pid not in names:
                names[pid] = name_of(pid, comm, ppid, names)
                start.setdefault(pid, ticks if samples == 0 else 0)
            last[pid] = ticks
            r = runnable_threads(pid)
            if r:
                runnable[pid] = runnable.get(pid, 0) + r
        samples += 1
        if stop:
            break
        for _ in range(int(interval * 10)):
            if stop:
                break
            time.sleep(0.1)
    wall = time.time() - t0
    by_name = {}
    for pid, ticks in last.items():
        name = names[pid]
        e = by_name.setdefault(name, {"cpu_s": 0.0, "runnable_mean": 0.0, "processes": 0})
        e["cpu_s"] += (ticks - start.get(pid, 0)) / HZ
        e["runnable_mean"] += runnable.get(pid, 0) / samples
        e["processes"] += 1
    rows = sorted(
        ({"name": k, **{f: round(v, 3) if isinstance(v, float) else v for f, v in e.items()}}
         for k, e in by_name.items() if e["cpu_s"] > 0.05 or e["runnable_mean"] > 0.05),
        key=lambda r: -r["cpu_s"],
    )
    with open(out, "w") as f:
        json.dump({"wall_s": round(wall, 1), "samples": samples, "processes": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
