"""Opens the NixlConnector transfer path of every prefill/decode pair once, and of every two
decode engines both ways, so that the first real P->D request, or the first session that moves
from one decode engine to another with its KV, does not pay for (or fail on) the NIXL
handshake.

The decode engine's first transfer from a prefill engine starts with a handshake over P's
side channel, with a 5 s answer deadline; on a small CPU machine P can be too busy to answer
in time, and that request then fails with vLLM's 500. One small P->D exchange per pair, tried
again until it succeeds, leaves the handshake done (D keeps P's metadata). A decode engine
sends KV as well (NixlConnector serves a request's do_remote_decode whatever its kv_role), and
the pull of a session moved between two decode engines starts with the same handshake.

Usage: python warm_transfer.py READY_JSON   (exit 1 when a pair never completes an exchange)
"""

import json
import sys
import time
import urllib.error
import urllib.request

ATTEMPTS = 6


def post(url, body, timeout=120):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def exchange(model, p, d, attempt):
    prompt = f"warm the transfer path {attempt} " + "the file line code test " * 30
    first = post(f"{p}/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None},
    })
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RuntimeError(f"prefill answer without kv_transfer_params: {first}")
    post(f"{d}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                 "kv_transfer_params": params})


def open_path(model, p, d):
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            exchange(model, p["http-url"], d["http-url"], attempt)
        except (urllib.error.URLError, RuntimeError, OSError) as e:
            print(f"real-vllm: {p['name']} -> {d['name']} transfer attempt {attempt} "
                  f"failed ({e}); trying again", file=sys.stderr)
            continue
        print(f"real-vllm: {p['name']} -> {d['name']} transfer path open after "
              f"{time.monotonic() - started:.1f}s ({attempt} attempt(s))",
              file=sys.stderr)
        return
    sys.exit(f"real-vllm: no {p['name']} -> {d['name']} transfer in {ATTEMPTS} attempts")


def main():
    ready = json.load(open(sys.argv[1]))
    model = ready["served-model-name"]
    engines = ready["engines"]
    prefill = [e for e in engines if e["role"] == "prefill"]
    decode = [e for e in engines if e["role"] == "decode"]
    for p in prefill:
        for d in decode:
            open_path(model, p, d)
    for a in decode:
        for b in decode:
            if a is not b:
                open_path(model, a, b)


if __name__ == "__main__":
    main()
