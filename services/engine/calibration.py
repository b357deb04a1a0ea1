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

import contextlib
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


def time_calls(fn: Callable[[int], None], rows: Sequence[int], repeats: int = 5, what: str = "timed calls"
               ) -> CostCurve:
    """The fastest of `repeats` timed calls of `fn(rows)` for each row count (one untimed warm-up
    call each): on a shared machine the minimum is the least disturbed, so the ratios between row
    counts (what the chooser compares) stay stable; made non-decreasing in rows. The repeats are
    interleaved (pass 1 times every row count, then pass 2, ...): a burst of load from another
    process then slows one pass of every row count rather than all repeats of one (which used to
    leave a step in the curve, e.g. 2 rows at 1.8x one row, that made every draft look too dear)."""
    from services.progress import counter

    tick = counter(what, len(rows) * (repeats + 1))  # on a terminal: "what: i/n"
    for r in rows:
        fn(r)
        tick()
    ts: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            fn(r)
            ts[r].append(time.perf_counter() - t0)
            tick()
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

    return time_calls(run, rows, repeats, "target forwards")


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

    return (time_calls(layer, rows, repeats, "draft-head layer calls"),
            time_calls(project, rows, repeats, "draft-head projections"))


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


def _read_cached(path: Path, key: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data["costs"] if data.get("key") == key else None
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str):
    """Hold an exclusive flock on `lock_path`: one process measures a calibration at a time (`aerie
    up` starts a verifier and a drafter that both want the target's costs; measured side by side on
    the same cores, each would disturb the other's timings and both would pay for it)."""
    import fcntl

    from services.progress import note

    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note(f"waiting for another process measuring {what}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(key: str, measure: Callable[[], dict], recalibrate: bool = False, what: str = "costs") -> dict:
    """The calibration stored for `key`, or `measure()` stored now (announced on stderr as `what`,
    services/progress.py). `recalibrate` (or AERIE_RECALIBRATE=1) measures again. Processes that
    want the same key measure one at a time; one that waited reads the other's result."""
    path = cache_dir() / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    recalibrate = recalibrate or os.environ.get("AERIE_RECALIBRATE", "") not in ("", "0")
    if not recalibrate and (hit := _read_cached(path, key)) is not None:
        return hit
    from services.progress import phase

    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.with_suffix(".lock"), what):
        if not recalibrate and (hit := _read_cached(path, key)) is not None:  # measured while this one waited
            return hit
        with phase(f"measuring {what} once on this device for the draft budget (cached in {path.parent}; "
                   f"--recalibrate measures again)"):
            costs = measure()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "costs": costs}, indent=1))
        tmp.replace(path)
    return costs


def target_costs(target, model_id: str, recalibrate: bool = False) -> CostCurve:
    # the weight layout changes the rows -> time curve (docs/design.md "Cheaper rounds")
    key = cost_key("verify", model_id, target.device, target.dtype) + f"|layout={getattr(target, 'layout', '')}"
    what = (f"the target's verify cost: its forward over {VERIFY_ROWS[0]}..{VERIFY_ROWS[-1]} tree rows after a "
            f"128-token prefix, fastest of 5 per row count")
    return CostCurve.from_dict(cached(key, lambda: calibrate_target(target).to_dict(), recalibrate, what))


def head_costs(head, model_id: str, recalibrate: bool = False) -> tuple[CostCurve, CostCurve]:
    key = cost_key("draft", model_id, head.device, head.dtype)

    def measure() -> dict:
        layer, proj = calibrate_head(head)
        return {"head": layer.to_dict(), "logits": proj.to_dict()}

    what = (f"the draft head's cost: its layer and its vocabulary projection over {HEAD_ROWS[0]}..{HEAD_ROWS[-1]} "
            f"rows, fastest of 5 per row count")
    d = cached(key, measure, recalibrate, what)
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
