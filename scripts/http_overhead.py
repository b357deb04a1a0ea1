#!/usr/bin/env python
"""The HTTP API's overhead against calling the coordinator's gRPC directly: tiny random models (an
untrained head, so about one token per round), 32 greedy tokens per request, the three kinds of
request interleaved, medians of N (default 30). Everything runs in one process, the servers on one
event-loop thread (tests/pipeline.py), so the absolute numbers include that contention.

    AERIE_TORCH_THREADS=1 .venv/bin/python scripts/http_overhead.py [N]
"""
import pathlib, statistics, sys, tempfile, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import httpx
from coordinator.redis_server import start_redis, stop_process
from gateway.server import start_http
from services.rpc.stubs import common as pb, coordinator as cpb
from tests.clients.test_node_client import save_tiny_models
from tests.pipeline import HOST, ModelDirs, start_pipeline

root = pathlib.Path(tempfile.mkdtemp())
target, head = save_tiny_models(root)
proc, url = start_redis(root / "redis")
p = start_pipeline(ModelDirs(target, head), url)
http = p.loop.run(start_http(p.addresses["coordinator"], HOST, 0))
stub = p.coordinator_stub()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
req = cpb.GenerateRequest(prompt_ids=[1, 2, 3, 4], max_new_tokens=32, ignore_eos=True,
                          sampling=pb.SamplingParams(temperature=0))
body = {"model": "target", "prompt": [1, 2, 3, 4], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
client = httpx.Client(timeout=60)
g, h, s = [], [], []
for i in range(N + 3):
    t = time.perf_counter(); n = sum(len(m.tokens) for m in stub.Generate(req)); dg = time.perf_counter() - t
    t = time.perf_counter(); r = client.post(f"http://{HOST}:{http.port}/v1/completions", json=body); dh = time.perf_counter() - t
    t = time.perf_counter()
    with client.stream("POST", f"http://{HOST}:{http.port}/v1/completions", json={**body, "stream": True}) as rs:
        events = [l for l in rs.iter_lines() if l.startswith("data: ")]
    ds = time.perf_counter() - t
    assert n == 32 and r.json()["usage"]["completion_tokens"] == 32 and events[-1] == "data: [DONE]"
    if i >= 3:
        g.append(dg); h.append(dh); s.append(ds)
mg, mh, ms = (statistics.median(x) * 1000 for x in (g, h, s))
print(f"requests: {N} each, 32 tokens, tiny model, one process")
print(f"gRPC Generate        median {mg:.1f} ms")
print(f"HTTP non-streaming   median {mh:.1f} ms  (+{mh - mg:.1f} ms, x{mh / mg:.3f})")
print(f"HTTP streaming (SSE) median {ms:.1f} ms  (+{ms - mg:.1f} ms, x{ms / mg:.3f})")
p.loop.run(http.stop()); p.close(); stop_process(proc)
