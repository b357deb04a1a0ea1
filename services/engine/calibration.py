"""Calibration: the cost curves of services/spec/cost.py measured on this device, cached on disk
(json under $AERIE_COST_DIR, else $AERIE_CACHE_DIR/costs), and a head's report.json (its measured
acceptance, the budget's prior).

    verify = target_costs(target, model_id)        # CostCurve t_verify(rows), measured once per key
    head, logits = head_costs(head, model_id)      # t_head(rows), t_logits(rows)
    report = load_report(head_dir)                 # dict | None

The cache key names what changes a curve: the role, the model (and its weight layout), the device,
the dtype and the thread count. AERIE_RECALIBRATE=1 measures again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from services.spec.cost import CostCurve

COST_VERSION = 2
VERIFY_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
HEAD_ROWS = (1, 2, 4, 8, 16)


def time_calls(fn: Callable[[int], None], rows: Sequence[int], repeats: int = 5) -> CostCurve:
    """The fastest of `repeats` timed calls of `fn(rows)` for each row count (one untimed warm-up
    call each): on a shared machine the minimum is the least disturbed, so the ratios between row
    counts (what the chooser compares) stay stable; made non-decreasing in rows. The repeats are
    interleaved (pass 1 times every row count, then pass 2, ...): a burst of load from another
    process then slows one pass of every row count rather than all repeats of one (which used to
    leave a step in the curve, e.g. 2 rows at 1.8x one row, that made every draft look too dear)."""
    for r in rows:
        fn(r)
    ts: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            fn(r)
            ts[r].append(time.perf_counter() - t0)
    out = [min(ts[r]) for r in rows]
    return CostCurve(tuple(rows), tuple(itertools.accumulate(out, max)))


@torch.no_grad()
def calibrate_target(target, rows: Sequence[int] = VERIFY_ROWS, prefix: int = 128, repeats: int = 5
                     ) -> CostCurve:
    """t_verify: the target's tree-attention forward over `rows` chain nodes after `prefix` tokens."""
    device = target.device
    vocab = target.config.vocab_size
    cache = target.new_cache(prefix + max(rows))
    g = torch.Generator().manual_seed(0)
    target(torch.randint(0, vocab, (prefix,), generator=g).to(device), cache, logits_for="last")

    def run(r: int) -> None:
        ids = torch.randint(0, vocab, (r,), generator=g).to(device)
        mask = torch.ones(r, r, dtype=torch.bool, device=device).tril()
        target(ids, cache, positions=prefix + torch.arange(r, device=device), tree_mask=mask)
        cache.truncate(prefix)

    return time_calls(run, rows, repeats)


@torch.no_grad()
def calibrate_head(head, rows: Sequence[int] = HEAD_ROWS, prefix: int = 128, repeats: int = 5
                   ) -> tuple[CostCurve, CostCurve]:
    """(t_head, t_logits): the head's layer over `rows` rows after `prefix` rows, and its
    projection + log-softmax over `rows` rows."""
    device = head.device
    f, v = head.config.feature_size, head.config.vocab_size
    cache = head.new_cache(prefix + max(rows))
    g = torch.Generator().manual_seed(0)
    head(torch.randn(prefix, f, generator=g).to(device, head.dtype),
         torch.randint(0, v, (prefix,), generator=g).to(device), cache)
    outs = {}

    def layer(r: int) -> None:
        outs[r] = head(torch.randn(r, f, generator=g).to(device, head.dtype),
                       torch.randint(0, v, (r,), generator=g).to(device), cache)
        cache.truncate(prefix)

    def project(r: int) -> None:
        head.log_probs(outs[r])

    return time_calls(layer, rows, repeats), time_calls(project, rows, repeats)


def device_name(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cpus)"


def cost_key(role: str, model_id: str, device: torch.device | str, dtype: torch.dtype) -> str:
    return (f"v{COST_VERSION}|{role}|{model_id}|{device_name(device)}|{dtype}|"
            f"threads={torch.get_num_threads()}")


def cache_dir() -> Path:
    """$AERIE_COST_DIR, else $AERIE_CACHE_DIR/costs (default ~/.cache/aerie/costs)."""
    if os.environ.get("AERIE_COST_DIR"):
        return Path(os.environ["AERIE_COST_DIR"]).expanduser()
    return Path(os.environ.get("AERIE_CACHE_DIR") or "~/.cache/aerie").expanduser() / "costs"


def cached(key: str, measure: Callable[[], dict], recalibrate: bool = False) -> dict:
    """The calibration stored for `key`, or `measure()` stored now. `recalibrate` (or
    AERIE_RECALIBRATE=1) measures again."""
    path = cache_dir() / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    recalibrate = recalibrate or os.environ.get("AERIE_RECALIBRATE", "") not in ("", "0")
    if not recalibrate:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return data["costs"]
        except (OSError, ValueError, KeyError):
            pass
    costs = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "costs": costs}, indent=1))
    tmp.replace(path)
    return costs


def target_costs(target, model_id: str, recalibrate: bool = False) -> CostCurve:
    # the weight layout changes the rows -> time curve (README "Cheaper rounds")
    key = cost_key("verify", model_id, target.device, target.dtype) + f"|layout={getattr(target, 'layout', '')}"
    return CostCurve.from_dict(cached(key, lambda: calibrate_target(target).to_dict(), recalibrate))


def head_costs(head, model_id: str, recalibrate: bool = False) -> tuple[CostCurve, CostCurve]:
    key = cost_key("draft", model_id, head.device, head.dtype)

    def measure() -> dict:
        layer, proj = calibrate_head(head)
        return {"head": layer.to_dict(), "logits": proj.to_dict()}

    d = cached(key, measure, recalibrate)
    return CostCurve.from_dict(d["head"]), CostCurve.from_dict(d["logits"])


def load_report(head_dir: str | Path | None) -> dict | None:
    """The head's report.json (services/train writes it: `top1_agreement`, ...), or None when there
    is no head directory or no readable report."""
    if head_dir is None:
        return None
    path = Path(head_dir) / "report.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
