#!/usr/bin/env python3
"""Counts the KV-cache events real vLLM engines publish while a side-by-side leg runs.

Subscribes to each engine's event socket (a PUB socket takes any number of subscribers, so the
router's own subscription is untouched) and counts, per engine: batches, blocks stored and
blocks removed per medium (GPU, CPU, ...), AllBlocksCleared events, and gaps in the engine's
sequence numbers (events this counter missed). On SIGTERM or SIGINT it writes the counts as
JSON to OUT and exits; it writes OUT once at start too (all zero), so a reader can tell a
counter that ran and saw nothing from one that never started.

With --dump DIR, every batch is also written as one JSON line to DIR/NAME.events.jsonl: its
sequence number, timestamp and events (kind; block hashes, parent, medium, token count, block
size and session id of a store; hashes and medium of a removal), token ids left out — what a
reader needs to follow each block's chain and life.

Usage: kv_count.py [--dump DIR] OUT NAME=EVENTS_ENDPOINT [NAME=EVENTS_ENDPOINT ...]
e.g.   kv_count.py runs/kvc-2x/rep1/kv-events.json x0=ipc:///tmp/x0-events.sock
Needs vLLM's Python package (its event classes decode the batches) and pyzmq: run it with the
real-vLLM venv's python.
"""
import json
import os
import signal
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def write(path, counts):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(counts, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def as_json(seq, batch):
    """One batch as a dump line (token ids left out)."""
    events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append({"kind": "stored", "hashes": [str(h) for h in e.block_hashes],
                           "parent": None if e.parent_block_hash is None else str(e.parent_block_hash),
                           "medium": e.medium, "tokens": len(e.token_ids), "block_size": e.block_size,
                           "session": getattr(e, "session_id", None)})
        elif isinstance(e, BlockRemoved):
            events.append({"kind": "removed", "hashes": [str(h) for h in e.block_hashes],
                           "medium": e.medium})
        elif isinstance(e, AllBlocksCleared):
            events.append({"kind": "cleared"})
        else:
            events.append({"kind": type(e).__name__})
    return json.dumps({"seq": seq, "ts": batch.ts, "events": events})


def main():
    args = sys.argv[1:]
    dump = None
    if args[:1] == ["--dump"] and len(args) > 1:
        dump, args = args[1], args[2:]
        os.makedirs(dump, exist_ok=True)
    if len(args) < 2 or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = args[0]
    dumps = {}
    ctx = zmq.Context.instance()
    poller = zmq.Poller()
    sockets = {}
    counts = {}
    for spec in args[1:]:
        name, sep, endpoint = spec.partition("=")
        if not sep or not name or not endpoint:
            sys.exit(f"kv_count: expected NAME=EVENTS_ENDPOINT, got {spec!r}")
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
        sockets[s] = name
        if dump:
            dumps[name] = open(os.path.join(dump, f"{name}.events.jsonl"), "w")
        counts[name] = {"batches": 0, "stored": {}, "removed": {}, "cleared": 0,
                        "seq_gaps": 0, "undecodable": 0, "first_seq": None, "last_seq": None}
    write(out, counts)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("kv_count: listening", flush=True)
    while not stop:
        try:
            ready = dict(poller.poll(200))
        except zmq.ZMQError:
            continue  # interrupted by a signal
        for s in ready:
            c = counts[sockets[s]]
            while True:
                try:
                    parts = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) != 3:
                    c["undecodable"] += 1
                    continue
                seq = int.from_bytes(parts[1], "big")
                if c["last_seq"] is not None and seq > c["last_seq"] + 1:
                    c["seq_gaps"] += seq - c["last_seq"] - 1
                if c["first_seq"] is None:
                    c["first_seq"] = seq
                c["last_seq"] = seq
                try:
                    batch = decoder.decode(parts[2])
                except msgspec.DecodeError:
                    c["undecodable"] += 1
                    continue
                c["batches"] += 1
                if dump:
                    dumps[sockets[s]].write(as_json(seq, batch) + "\n")
                for e in batch.events:
                    if isinstance(e, BlockStored):
                        m = e.medium or "GPU"
                        c["stored"][m] = c["stored"].get(m, 0) + len(e.block_hashes)
                    elif isinstance(e, BlockRemoved):
                        m = e.medium or "GPU"
                        c["removed"][m] = c["removed"].get(m, 0) + len(e.block_hashes)
                    elif isinstance(e, AllBlocksCleared):
                        c["cleared"] += 1
    for f in dumps.values():
        f.close()
    write(out, counts)


if __name__ == "__main__":
    main()
