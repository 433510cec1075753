"""Calls a running kvc-router through Python stubs generated from proto/kvc/v1 by grpcio-tools.

Usage: client.py GEN_DIR GRPC_ADDR METRICS_ADDR EXPECTED_WORKERS
Exits non-zero (with a message) if any check fails.
"""
import sys
import urllib.request

gen_dir, grpc_addr, metrics_addr, expected = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, gen_dir)

import grpc  # noqa: E402
from kvc.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def fail(msg):
    print(f"python client: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


with grpc.insecure_channel(grpc_addr) as channel:
    grpc.channel_ready_future(channel).result(timeout=20)
    stub = router_pb2_grpc.RouterStub(channel)

    workers = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
    if len(workers) != expected:
        fail(f"ListWorkers returned {len(workers)} workers, expected {expected}")
    roles = sorted(router_pb2.WorkerRole.Name(w.role) for w in workers)
    print("python client: ListWorkers:", ", ".join(f"{w.name}={router_pb2.WorkerRole.Name(w.role)}" for w in workers))
    if "WORKER_ROLE_DECODE" not in roles or "WORKER_ROLE_PREFILL" not in roles:
        fail(f"unexpected roles {roles}")

    req = router_pb2.RouteRequest(
        request_id=4_000_000_001,
        session_id=4_000_000_001,
        turn_id=1,
        input_length=3000,
        output_hint=50,
        hash_ids=[9_000_000_001, 9_000_000_002, 9_000_000_003, 9_000_000_004, 9_000_000_005, 9_000_000_006],
    )
    d = stub.Route(req, timeout=10)
    mode = router_pb2.ExecutionMode.Name(d.mode)
    print(f"python client: Route: decision {d.decision_id} mode {mode} prefill {d.prefill_worker} decode {d.decode_worker}")
    if mode != "EXECUTION_MODE_TURN1_SEED":
        fail(f"a first turn should be a turn1-seed, got {mode}")
    if not d.HasField("prefill_worker"):
        fail("a turn1-seed goes through a prefill worker")

    decode = next(w.id for w in workers if w.role == router_pb2.WORKER_ROLE_DECODE)
    c = stub.CommitEvict(router_pb2.CommitEvictRequest(worker=decode, need_tokens=1000), timeout=10)
    print(f"python client: CommitEvict on worker {decode}: admitted {c.admitted}, freed {c.freed_tokens}")
    if not c.admitted:
        fail("a 1,000-token commit_evict on a 92K pool should be admitted")

    try:
        stub.Route(router_pb2.RouteRequest(request_id=1, input_length=100_000, hash_ids=[]), timeout=10)
        fail("an input with no hash ids was accepted")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
            fail(f"bad input gave {e.code()}, expected INVALID_ARGUMENT")
        print("python client: bad input ->", e.code().name)

text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
families = {f.name: f for f in text_string_to_metric_families(text)}
print(f"python client: /metrics parsed: {len(families)} metric families")
decisions = [s for f in families.values() for s in f.samples if s.name.startswith("kvc_router_decisions")]
if not decisions:
    fail("no kvc_router_decisions samples in /metrics")
print("python client: OK")
