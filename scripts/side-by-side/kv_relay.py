#!/usr/bin/env python3
"""Relays vLLM KV-cache events from ipc:// sockets to tcp://127.0.0.1 ones.

vllm-router reads KV events only from tcp://HOST:PORT endpoints, and a vLLM engine binds only
a wildcard (tcp://*:PORT, every interface) or an ipc:// endpoint. This relay keeps every
socket on this machine: for each engine it subscribes to the engine's ipc:// event socket and
republishes on tcp://127.0.0.1:PORT, and forwards replay requests from tcp://127.0.0.1:PORT+1
to the engine's ipc:// replay socket. Runs until killed.

Usage: kv_relay.py EVENTS=IPC_EVENTS,IPC_REPLAY=TCP_PORT [...]
e.g.   kv_relay.py ipc:///tmp/x0-events.sock,ipc:///tmp/x0-replay.sock=19300
Needs pyzmq (the vLLM venv has it). Prints one line per engine: IPC_EVENTS tcp://127.0.0.1:PORT
tcp://127.0.0.1:PORT+1.
"""
import sys
import threading

import zmq


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ctx = zmq.Context.instance()
    threads = []
    for spec in sys.argv[1:]:
        try:
            ipc, port = spec.rsplit("=", 1)
            events, replay = ipc.split(",")
            port = int(port)
        except ValueError:
            sys.exit(f"kv_relay: expected IPC_EVENTS,IPC_REPLAY=TCP_PORT, got {spec!r}")
        sub = ctx.socket(zmq.XSUB)
        sub.connect(events)
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        front = ctx.socket(zmq.ROUTER)
        front.bind(f"tcp://127.0.0.1:{port + 1}")
        back = ctx.socket(zmq.DEALER)
        back.connect(replay)
        for a, b in ((pub, sub), (front, back)):
            t = threading.Thread(target=zmq.proxy, args=(a, b), daemon=True)
            t.start()
            threads.append(t)
        print(f"{events} tcp://127.0.0.1:{port} tcp://127.0.0.1:{port + 1}", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
