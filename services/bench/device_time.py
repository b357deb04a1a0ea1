"""Where a round's time goes on the device: wall time, device-busy time and kernel time by kind.

    split = device_split(engine, prompt, rounds=8, device="cuda")
    # {"rounds": 8, "wall_ms": 12.9, "busy_ms": 10.1, "idle_ms": 2.8, "kernels": 1460.0,
    #  "by_kind_ms": {"gemm": 7.9, "attention": 0.6, "fused": 0.9, "copy": 0.3, "other": 0.4}}  (a round)

Profiles `rounds` rounds of `engine.generate` after its first two (prefill, one warm round) with
torch.profiler's device activities only (kernels replayed from CUDA graphs included), so the host's
own work shows as `idle_ms`: the device waiting for the host (launches, host re-rank, the per-round
copy of the verdict). `busy_ms` is the union of the kernels' and copies' intervals; `by_kind_ms` sums
their durations by the kind their name says (KINDS); `top_kernels` the kernels with the most time.
`host` (host_split, a second pass with host activities): the CUDA runtime calls a round makes
(launches, copies, synchronisations) and its host ops with the most self time. Per round means.
CUDA only (None elsewhere).
"""

from __future__ import annotations

import time

import torch

# a kernel's kind, by the first pattern its lower-cased name contains (cuBLAS/CUTLASS GEMMs, attention
# kernels, Triton/inductor fused stages, copies and sets); the rest is "other"
KINDS = (("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk")),
         ("attention", ("attention", "attn", "attend", "_merge_kernel", "softmax", "flash", "fmha")),
         ("fused", ("triton",)),
         ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat")))


TOP = 15  # names listed in top_kernels / top_host_ops / runtime_calls
NAME_CHARS = 90


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def device_split(engine, prompt: tuple[int, ...], rounds: int, device: str) -> dict | None:
    """Per-round wall, device-busy and idle ms and kernel ms by kind over `rounds` profiled rounds."""
    if not device.startswith("cuda"):
        return None
    return split(engine, prompt, rounds, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _profiled(engine, prompt: tuple[int, ...], rounds: int, device: str, host: bool):
    """`rounds` rounds of `engine.generate` after its first two (prefill, one warm round) under
    torch.profiler (device activities; host ones too with `host`, and off CUDA) -> (profile, rounds
    done, their wall seconds). The generator is closed: its sequence is released."""
    from torch.profiler import ProfilerActivity, profile

    from services.engine.engine import GenerationRequest

    cuda = device.startswith("cuda")
    activities = ([ProfilerActivity.CPU] if host or not cuda else []) + ([ProfilerActivity.CUDA] if cuda else [])
    gen = engine.generate(GenerationRequest(prompt, rounds + 4, ignore_eos=True))
    next(gen)  # the prefill and its first token
    next(gen)  # one round before the profiled ones
    _sync(device)
    prof = profile(activities=activities)
    prof.start()
    t0 = time.perf_counter()
    done = 0
    for _ in gen:
        done += 1
        if done == rounds:
            break
    _sync(device)
    wall = time.perf_counter() - t0
    prof.stop()
    gen.close()
    return prof, done, wall


def split(engine, prompt: tuple[int, ...], rounds: int, device: str) -> dict:
    """device_split on any device (off CUDA there are no kernels: busy 0, the host pass only)."""
    prof, done, wall = _profiled(engine, prompt, rounds, device, host=False)
    intervals, by_kind, n = [], {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}, 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        intervals.append((start, end))
        by_kind[kind_of(e.name)] += (end - start) / 1e3
        n += 1
    busy = busy_us(intervals) / 1e3
    per = max(done, 1)
    return {"rounds": done, "wall_ms": wall * 1e3 / per, "busy_ms": busy / per,
            "idle_ms": max(0.0, wall * 1e3 - busy) / per, "kernels": n / per,
            "by_kind_ms": {k: v / per for k, v in by_kind.items()},
            "top_kernels": _top(prof, torch.autograd.DeviceType.CUDA, per),
            "host": host_split(engine, prompt, rounds, device)}


def _top(prof, device_type, per: int, n: int = TOP) -> list[dict]:
    """The `n` names with the most time (self time on the host) a round: name (cut), calls, ms."""
    time_of, calls = {}, {}
    for e in prof.events():
        if e.device_type != device_type:
            continue
        us = e.time_range.elapsed_us() if device_type == torch.autograd.DeviceType.CUDA else e.self_cpu_time_total
        time_of[e.name] = time_of.get(e.name, 0.0) + us
        calls[e.name] = calls.get(e.name, 0) + 1
    best = sorted(time_of, key=lambda k: -time_of[k])[:n]
    return [{"name": k[:NAME_CHARS], "calls": calls[k] / per, "ms": time_of[k] / 1e3 / per} for k in best]


def host_split(engine, prompt: tuple[int, ...], rounds: int, device: str) -> dict:
    """A second profiled pass, host activities too: per round, the CUDA runtime calls the host makes
    (kernel and graph launches, copies, synchronisations) and the host ops with the most self time.
    The profiler's own cost inflates these; they say what the host does, not how fast."""
    prof, done, _ = _profiled(engine, prompt, rounds, device, host=True)
    per = max(done, 1)
    runtime: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
            runtime[e.name] = runtime.get(e.name, 0) + 1 / per
    return {"runtime_calls": dict(sorted(runtime.items(), key=lambda kv: -kv[1])[:TOP]),
            "top_host_ops": _top(prof, torch.autograd.DeviceType.CPU, per)}
