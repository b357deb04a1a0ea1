"""Verify latency at TP=1 and TP=N on this machine (`aerie bench --tp-verify N`).

    tp_verify_latency(target, "fp32", "cpu", world=2) -> {"rows": [...], "tp1_ms": [...], "tp2_ms": [...]}

The same measurement both ways (services/dist/proxy.py `calibrate_runner`: a tree-attention forward
over `rows` chain nodes after a 128-token prefix, the best of `repeats`): TP=1 on a local
ModelRunner, TP=N through a local group's proxy, so the broadcast of each call and the all-reduces
are in the number, as they are in every served round. On CPU cores shared by the ranks this shows
the cost of the communication, not a GPU's gain (docs/benchmarks.md "Tensor parallelism on a CPU").
"""

from __future__ import annotations

from services.dist.launch import GroupSpec, LocalExecutor
from services.dist.proxy import calibrate_runner

ROWS = (1, 4, 16, 32)


def tp_verify_latency(target: str, dtype: str, device: str, world: int, rows=ROWS, repeats: int = 5) -> dict:
    from services.engine.local import DTYPES
    from services.model.loading import load_target
    from services.model.runner import ModelRunner

    model = load_target(target, DTYPES[dtype], device).model
    tp1 = calibrate_runner(ModelRunner(model), model.config.vocab_size, rows, repeats=repeats)
    del model
    proxy = LocalExecutor().start(GroupSpec(world, target, dtype, "cuda" if device.startswith("cuda") else device))
    try:
        tpn = calibrate_runner(proxy, proxy.target.config.vocab_size, rows, repeats=repeats)
    finally:
        proxy.close()
    return {"rows": list(rows), "tp1_ms": [round(s * 1e3, 3) for s in tp1.seconds],
            f"tp{world}_ms": [round(s * 1e3, 3) for s in tpn.seconds], "world": world,
            "ratio": [round(b / a, 3) for a, b in zip(tp1.seconds, tpn.seconds)]}


def tp_table(r: dict) -> str:
    w = r["world"]
    lines = [f"verify latency, TP=1 vs TP={w} (ms, best of repeats; ratio = TP{w}/TP1)",
             f"{'rows':>6} {'TP=1':>10} {f'TP={w}':>10} {'ratio':>7}"]
    for n, a, b, q in zip(r["rows"], r["tp1_ms"], r[f"tp{w}_ms"], r["ratio"]):
        lines.append(f"{n:>6} {a:>10.2f} {b:>10.2f} {q:>7.2f}")
    return "\n".join(lines)
