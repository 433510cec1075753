"""A pyzmq publisher with vLLM's framing, for tests/python.rs.

Binds a PUB socket and a replay ROUTER socket on 127.0.0.1 (free ports), prints
`pub=ENDPOINT replay=ENDPOINT`, waits for `go` on stdin, then publishes N batches ten
milliseconds apart as `[topic, seq (8-byte big-endian), payload]`, leaving the sequence
numbers in DROP off the PUB socket (they stay in the replay buffer). Replay requests
`["", start]` are answered like vLLM's publisher: `["", seq, payload]` for every buffered
batch from `start`, then `["", -1, ""]`. Every payload is also appended to PAYLOADS
(4-byte big-endian length, then the bytes). Serves replays until stdin closes or 60 s pass.

The batches mirror `engine_batches` of tests/common/mod.rs: four sessions extending
chains of two-block stores, a new chain every few batches, every fifth batch evicting two
blocks.

Usage: python live_publisher.py PAYLOADS N DROP TOPIC   (DROP: comma-separated, may be empty)
"""

import select
import sys
import time

import msgspec
import zmq

from fixtures import MapBatch, MapRemoved, MapStored

BS = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def engine_batches(n):
    chains = [[] for _ in range(4)]
    generation = [0] * 4
    next_hash = 1000
    out = []
    for i in range(n):
        s = i % 4
        if i % 7 == s:
            chains[s].clear()
            generation[s] += 1
        parent = chains[s][-1] if chains[s] else None
        hashes = [next_hash, next_hash + 1]
        next_hash += 2
        tokens = [h * 31 + t for h in hashes for t in range(BS)]
        events = [
            MapStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                session_id=f"session-{s}-{generation[s]}",
            )
        ]
        chains[s].extend(hashes)
        if i % 5 == 4:
            victim = chains[(i // 5) % 4]
            if len(victim) > 2:
                gone = victim[:2]
                del victim[:2]
                events.append(MapRemoved(block_hashes=gone, medium="GPU"))
        out.append(MapBatch(ts=float(i), events=events, data_parallel_rank=0))
    return out


def serve_replay(router, buffer):
    while router.poll(0):
        frames = router.recv_multipart()
        if len(frames) != 3:
            continue
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= start:
                router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", END_SEQ, b""))


def stdin_line(timeout):
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready:
        return None
    return sys.stdin.readline()


def main():
    payload_path, n, drop, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    drop = {int(x) for x in drop.split(",") if x}
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    print(f"pub=tcp://127.0.0.1:{pub_port} replay=tcp://127.0.0.1:{replay_port}", flush=True)
    if (stdin_line(60) or "").strip() != "go":
        return
    enc = msgspec.msgpack.Encoder()
    buffer = []
    with open(payload_path, "wb") as out:
        for seq, batch in enumerate(engine_batches(n)):
            payload = enc.encode(batch)
            out.write(len(payload).to_bytes(4, "big") + payload)
            if seq not in drop:
                pub.send_multipart((topic.encode(), seq.to_bytes(8, "big"), payload))
            buffer.append((seq, payload))
            deadline = time.monotonic() + 0.01
            while time.monotonic() < deadline:
                if router.poll(1):
                    serve_replay(router, buffer)
    stop = time.monotonic() + 60
    while time.monotonic() < stop:
        if router.poll(20):
            serve_replay(router, buffer)
        line = stdin_line(0)
        if line is not None and line in ("", "stop\n"):
            break
    pub.close(linger=0)
    router.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
