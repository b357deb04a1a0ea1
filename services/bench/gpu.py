"""The model-free device benchmark: random weights of a real model's shape, built on the device.

    aerie bench --shape llama-3.1-8b --device cuda --json-out gpu.json

In one run, on one device (bf16 on a GPU unless --dtype), batch 1 and a `prompt`-token prompt:
  floor           weight bytes read per decode step / measured device copy bandwidth
  forward         one bare eager decode forward at KV length `prompt` (contiguous KV; the default
                  attention backend and the pre-issue one, SDPA's own choice = cuDNN on Hopper)
  kernels         device kernels (and copies) per decode forward, from torch.profiler
  plain           ms/token of plain decoding through the engine: the pre-issue path (contiguous
                  KV, SDPA), the paged static-shape path eagerly, and replayed from CUDA graphs
  rounds          EAGLE rounds of fixed trees (60/5/10, 16/3/4, 8/7/1) through the engine with a
                  random head of the matching shape: ms per round (draft + verify) in plain tokens;
                  60/5/10 and the chain again with an EAGLE-2 head restricted to a 32k draft
                  vocabulary and an EAGLE-3 head over its own 32k one (the published heads' size)
                  and each round's bandwidth floor (the target once, the head's layer and projection
                  1 + depth times) in plain floors; for 60/5/10, where its draft's time goes
                  (extension, expansion, host re-rank: `draft_parts`, timed in separate rounds)
  first_token     ms from a request to its first token (the prompt's prefill), plain engine
  batched         one decode step for N = 1, 8, 32 sequences: tokens/s and the ratio to N = 1
  batched_drafts  one draft call for 4 and 8 sequences (16/3/4): drafted together, one after another, and
                  in the eager batch (ms a call)
  hf              transformers' eager generate on the same shape: ms/token
  device_split    plain decoding and each round profiled (services/bench/device_time.py): the
                  device's busy and idle ms a round, its kernels by kind (CUDA only)
  paged_attention the same plain decoding (graphs), rounds and batched decode again with
  grouped_attention AERIE_ATTENTION forced to `paged` (the Triton kernel reading the paged KV in
                  place, trees too) and to `grouped` (keys gathered, decode too), next to the
                  default's per-shape choice above (on CUDA paged for decode and, since 2026-11-27, trees):
                  on CUDA when triton imports (`paged`: "auto"); "on" also tries it elsewhere (the
                  CPU needs TRITON_INTERPRET=1). Measured last, and a failure is recorded in the
                  JSON and the table, not raised.
Random weights accept nothing, so rounds here measure cost, never speed-up. Every timing is a median
of repeats after a warm-up, GPU work timed to its completion (synchronised).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from services.bench.device_time import device_split

SHAPES: dict[str, dict] = {
    # name: Hugging Face config fields (LlamaConfig names)
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         max_position_embeddings=8192, tie_word_embeddings=False),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    # tiny: 8 layers, so that EAGLE-3's three tap layers (2, N/2, N-3) are distinct
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=1024,
                 tie_word_embeddings=False),
}
TREES = {"60/5/10": (10, 5, 60), "16/3/4": (4, 3, 16), "chain 8/7/1": (1, 7, 8)}  # name: (top_k, depth, tokens)
HEAD_TREES = ("60/5/10", "chain 8/7/1")  # also run with a reduced draft vocabulary
DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' draft vocabulary (Llama-3.1-8B: 32000 of 128256)


def draft_vocab_for(vocab_size: int) -> int:
    """The reduced draft vocabulary of the bench's heads: DRAFT_VOCAB, or a quarter of a smaller vocabulary."""
    return min(DRAFT_VOCAB, max(1, vocab_size // 4))


@dataclass
class GpuBenchConfig:
    shape: str = "llama-3.1-8b"
    device: str = "cuda"
    dtype: str = "bf16"
    prompt: int = 512
    tokens: int = 64  # decode tokens per measured generation
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 20
    hf: bool = True
    legacy: bool = True  # also the pre-issue path (contiguous KV, SDPA's own kernel choice)
    paged: str = "auto"  # AERIE_ATTENTION=paged measured too: auto (CUDA with triton), on, off

    def __post_init__(self) -> None:
        if self.paged not in PAGED_MODES:
            raise ValueError(f"paged must be one of {', '.join(PAGED_MODES)}; got {self.paged!r}")


PAGED_MODES = ("auto", "on", "off")


PLAIN_RUN = 16  # plain steps per run in the `*_run` plain decoding (services/engine/local.py LOCAL_PLAIN_RUN)


def hf_config(shape: str):
    from transformers import LlamaConfig

    fields = dict(SHAPES[shape], rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaConfig(**fields)


def random_target(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    """aerie's TargetModel of `shape` with N(0, 0.02) weights (norms 1), built on `device`."""
    from services.model.config import ModelConfig
    from services.model.target import TargetModel

    cfg = ModelConfig.from_hf_dict(hf_config(shape).to_dict() | {"architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _fill(model, seed)
    return model.eval().requires_grad_(False)


def random_head(target, seed: int = 1, kind: str = "eagle", draft_vocab: int | None = None):
    """A head of the target's shape (one decoder layer) with random weights: EAGLE-2 ("eagle": the
    target's lm_head; `draft_vocab` restricts it to that many rows, as --draft-vocab does) or EAGLE-3
    ("eagle3": its own lm_head over `draft_vocab` rows, fed the target's three taps)."""
    from services.model.eagle_head import HeadConfig, build_head

    c = target.config
    cfg = HeadConfig(kind, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,  # type: ignore[arg-type]
                     c.rms_norm_eps, c.vocab_size, rope_theta=c.rope_theta,
                     draft_vocab_size=draft_vocab if kind == "eagle3" else None)
    with torch.device("meta"):
        head = build_head(cfg, target.lm_head)
    head = head.to_empty(device=target.device).to(target.dtype)  # the target's lm_head is held by reference
    _fill(head, seed)
    if kind == "eagle3" and getattr(head, "d2t", None) is not None:
        head.d2t.zero_()  # draft id i is target id i (buffers come uninitialised from to_empty)
        head.t2d.zero_()
        head.t2d[:draft_vocab] = True
    if kind == "eagle" and draft_vocab is not None:
        counts = torch.randint(0, 1 << 20, (c.vocab_size,), generator=torch.Generator().manual_seed(seed))
        head.restrict_vocab(counts, draft_vocab)
    return head.eval().requires_grad_(False)


def _fill(module: torch.nn.Module, seed: int, skip: tuple[str, ...] = ()) -> None:
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(name.startswith(s) for s in skip):
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    # rotary inv_freq is a non-persistent buffer computed at construction: on meta it has no values
    for m in module.modules():
        if type(m).__name__ == "Rotary":
            _recompute_inv_freq(m, module)


def _recompute_inv_freq(rotary, root) -> None:
    from services.model.config import rope_inv_freq

    cfg = getattr(root, "config", None)
    if cfg is None:
        return
    if hasattr(cfg, "rope_scaling") and hasattr(cfg, "head_dim"):
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    else:
        inv = rope_inv_freq(cfg.hidden_size // cfg.num_heads, cfg.rope_theta, cfg.rope_scaling)
    rotary.inv_freq = inv.float().to(rotary.inv_freq.device)
    rotary._tables = {}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device: str, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup`, each synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def attention_backend(name: str | None):
    return env("AERIE_ATTENTION", name)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), device, 10)
    return 2 * a.numel() * a.element_size() / s


def weight_bytes(target) -> int:
    """Bytes a decode step must read: every linear weight and the lm_head (not the embedding table,
    of which it reads one row)."""
    seen, total = set(), 0
    for name, p in target.named_parameters():
        if "embed_tokens" in name and not target.config.tie_word_embeddings:
            continue
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def head_bytes(head) -> tuple[int, int]:
    """(layer, projection): bytes one head step reads in its decoder layer (fc, attention, MLP; not
    the embedding table) and in its vocabulary projection (the target's lm_head, or the reduced one)."""
    proj = head._projection()[0]
    skip = {id(proj)} | {id(p) for n, p in head.named_parameters() if "embed_tokens" in n}
    layer = sum(p.numel() * p.element_size() for p in head.parameters() if id(p) not in skip)
    return layer, proj.numel() * proj.element_size()


def round_floor_bytes(target_bytes: int, head, depth: int) -> int:
    """Bytes a batch-1 EAGLE round of `depth` levels must read at least: the target once (the verify)
    and, for the draft, the head's layer and its projection 1 + depth times each (the extension of the
    committed rows and `depth` levels; the first level's scores and each level's children)."""
    layer, proj = head_bytes(head)
    return target_bytes + (1 + depth) * (layer + proj)


def count_kernels(fn, device: str) -> int:
    """Device activities (kernels, copies, sets) one call of fn() launches, by torch.profiler."""
    if not device.startswith("cuda"):
        return 0
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def random_prompt(vocab: int, n: int, seed: int) -> tuple[int, ...]:
    """`n` token ids drawn uniformly from the vocabulary (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())


def decode_ms(engine, prompt: tuple[int, ...], tokens: int) -> tuple[float, int]:
    """ms per round after the prefill (wall, synchronised by the engine's host reads); rounds."""
    from services.engine.engine import GenerationRequest

    req = GenerationRequest(prompt, tokens, ignore_eos=True)
    t_first, rounds = None, 0
    for out in engine.generate(req):
        if out.stats.round_index == 0:
            t_first = time.perf_counter()
        else:
            rounds += 1
    return (time.perf_counter() - t_first) * 1e3 / max(rounds, 1), rounds


def first_token_ms(engine, prompt: tuple[int, ...], repeats: int = 3) -> float:
    """Median ms from the request to its first token (the prompt's prefill and the first sample),
    after one warm-up request."""
    from services.engine.engine import GenerationRequest

    walls = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        gen = engine.generate(GenerationRequest(prompt, 2, ignore_eos=True))
        next(gen)
        walls.append(time.perf_counter() - t0)
        gen.close()
    return statistics.median(walls[1:]) * 1e3


def run_gpu_bench(cfg: GpuBenchConfig, log=print, checkpoint=lambda res: None) -> dict:
    """Every measurement of the module doc on `cfg`'s device -> the result dict (`table` prints it).
    `checkpoint(res)` is called after each group of measurements with the results so far (the CLI
    writes the JSON each time, so a run cut short by a timeout keeps what it measured; `complete` is
    set at the end)."""
    from services.engine.engine import Engine
    from services.engine.verifier import Verifier
    from services.model.kv_pool import KVPool
    from services.model.runner import ModelRunner

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
    dev = cfg.device
    t0 = time.perf_counter()
    target = random_target(cfg.shape, dev, dtype)
    c = target.config
    name = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu"
    res: dict = {"shape": cfg.shape, "device": name, "dtype": cfg.dtype, "prompt": cfg.prompt,
                 "torch": torch.__version__, "build_s": round(time.perf_counter() - t0, 2)}
    log(f"built {cfg.shape} ({sum(p.numel() for p in target.parameters()) / 1e9:.2f} B params) on {name} "
        f"in {res['build_s']} s")
    wb = weight_bytes(target)
    bw = copy_bandwidth(dev) if dev.startswith("cuda") else float("nan")
    res["weight_gb"] = wb / 1e9
    res["copy_tb_s"] = bw / 1e12
    res["floor_ms"] = wb / bw * 1e3
    prompt = random_prompt(c.vocab_size, cfg.prompt, 0)

    # bare eager decode forward at KV length `prompt` (contiguous KV)
    cache = target.new_cache(cfg.prompt + 8)
    target(torch.tensor(prompt, device=dev), cache)
    tok = torch.tensor([1], device=dev)

    def one():
        target(tok, cache, logits_for="last")
        cache.truncate(cfg.prompt)

    res["forward_ms"] = timed(one, dev, cfg.repeats) * 1e3
    res["kernels_forward"] = count_kernels(one, dev)
    if cfg.legacy:
        with attention_backend("sdpa"), env("AERIE_FUSE", "0"):
            res["forward_sdpa_ms"] = timed(one, dev, max(3, cfg.repeats // 4)) * 1e3
            res["kernels_forward_sdpa"] = count_kernels(one, dev)
    log(f"floor {res['floor_ms']:.2f} ms ({wb / 1e9:.1f} GB at {bw / 1e12:.2f} TB/s); bare forward "
        f"{res['forward_ms']:.2f} ms, {res['kernels_forward']} kernels")

    # plain decoding through the engine
    rows = max(cfg.batches) * (cfg.prompt + cfg.tokens + cfg.repeats + 80) + 4096
    runners = {"graphs": lambda: ModelRunner(target, _paged(target, rows), graphs=True),
               "paged_eager": lambda: ModelRunner(target, _paged(target, rows), graphs=False)}
    if not dev.startswith("cuda"):
        runners.pop("graphs")
    else:  # the same graphs over unfused stages (AERIE_FUSE=0 while they are captured)
        runners["graphs_unfused"] = lambda: ModelRunner(target, _paged(target, rows), graphs=True)
    plain: dict[str, float] = {}
    runner_objs = {}
    for label, make in runners.items():
        with env("AERIE_FUSE", "0" if label == "graphs_unfused" else None):
            runner = make()
            runner_objs[label] = runner
            eng = Engine(Verifier(None, "hidden", runner=runner), None, c.max_context, c.vocab_size)
            decode_ms(eng, prompt, 4)  # warm-up (graph capture)
            plain[label] = decode_ms(eng, prompt, cfg.tokens)[0]
        if label == "graphs_unfused":  # its arena is not needed again
            runner_objs.pop(label)
            del runner, eng
            torch.cuda.empty_cache()
        log(f"plain decoding ({label}): {plain[label]:.2f} ms/token")
    if cfg.legacy:
        with attention_backend("sdpa"), env("AERIE_FUSE", "0"):
            eng = Engine(Verifier(None, "hidden", runner=ModelRunner(target, KVPool.for_model(target))), None,
                         c.max_context, c.vocab_size)
            decode_ms(eng, prompt, 2)
            plain["legacy_sdpa"] = decode_ms(eng, prompt, max(8, cfg.tokens // 4))[0]
            log(f"plain decoding (legacy: contiguous KV, SDPA): {plain['legacy_sdpa']:.2f} ms/token")
    best_label = "graphs" if "graphs" in plain else "paged_eager"
    # the same runner in plain runs: each step queued before the previous token is read (what the
    # local engine does on a GPU, services/engine/plain_run.py)
    run_eng = Engine(Verifier(None, "hidden", runner=runner_objs[best_label]), None, c.max_context, c.vocab_size,
                     plain_run=PLAIN_RUN)
    decode_ms(run_eng, prompt, 4)
    plain[f"{best_label}_run"] = decode_ms(run_eng, prompt, cfg.tokens)[0]
    log(f"plain decoding ({best_label}, runs of {PLAIN_RUN}): {plain[f'{best_label}_run']:.2f} ms/token")
    res["plain_ms"] = plain
    best = min(plain[best_label], plain[f"{best_label}_run"])
    res["plain_vs_floor"] = best / res["floor_ms"] if bw == bw else None
    if best_label in runner_objs:
        eng = Engine(Verifier(None, "hidden", runner=runner_objs[best_label]), None, c.max_context, c.vocab_size)
        res["first_token_ms"] = first_token_ms(eng, prompt)
        log(f"time to first token ({cfg.prompt}-token prompt): {res['first_token_ms']:.2f} ms")
        res["plain_device_split"] = device_split(eng, prompt, 8, dev)
        res["plain_run_device_split"] = device_split(run_eng, prompt, 8, dev)
    kernel_runner = runner_objs.get("paged_eager")
    if kernel_runner is not None and dev.startswith("cuda"):
        res["kernels_uniform_decode"] = _uniform_kernels(kernel_runner, prompt)
    checkpoint(res)

    # EAGLE rounds of fixed trees: an EAGLE-2 head over the target's whole vocabulary, then (the large
    # trees) heads that read a reduced draft vocabulary, as the published EAGLE-3 heads do
    head = random_head(target)
    floor = functools.partial(_round_floor_ms, wb, bw, res["floor_ms"])
    res["rounds"] = _rounds(runner_objs[best_label], head, prompt, cfg, best, log, floor=floor)
    checkpoint(res)

    # batched decode
    runner = runner_objs[best_label]
    res["batched"] = _batched(runner, cfg, log)
    checkpoint(res)
    res["batched_drafts"] = _batched_drafts(head, cfg, log)
    if isinstance(runner.uniform, object) and getattr(runner, "uniform", None) is not None:
        res["graph_captures"] = runner.uniform.captures
        res["graph_capture_s"] = round(runner.uniform.capture_s, 2)
    if dev.startswith("cuda"):
        res["max_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9

    if cfg.hf:
        res["hf_ms"] = _hf_ms(cfg, dev, dtype, target, prompt)
        log(f"transformers eager generate: {res['hf_ms']:.2f} ms/token")
        res["vs_hf"] = res["hf_ms"] / best
    checkpoint(res)

    # the large trees with heads over a reduced draft vocabulary (a failure is the result, as below)
    dv = draft_vocab_for(c.vocab_size)
    res["draft_vocab"] = dv
    res["rounds_draft_vocab"] = {}
    try:
        for kind, label in (("eagle", "EAGLE-2"), ("eagle3", "EAGLE-3")):
            res["rounds_draft_vocab"] |= _rounds(runner, random_head(target, kind=kind, draft_vocab=dv), prompt, cfg,
                                                 best, log, trees=HEAD_TREES, suffix=f" {label} vocab {dv}", floor=floor)
    except Exception as e:  # the other measurements stand
        res["rounds_draft_vocab_error"] = f"{type(e).__name__}: {e}"
        log(f"rounds with a reduced draft vocabulary failed: {traceback.format_exc()[-4000:]}")
    checkpoint(res)

    res["paged_attention"] = _paged_attention(cfg, target, head, prompt, rows, log)
    checkpoint(res)
    res["grouped_attention"] = _forced_backend(cfg, "grouped", target, head, prompt, rows, log)
    res["complete"] = True
    checkpoint(res)
    return res


def _round_floor_ms(target_bytes: int, bandwidth: float, plain_floor_ms: float, head, depth: int) -> dict:
    """A round's bandwidth floor (round_floor_bytes) in ms and in plain floors."""
    ms = round_floor_bytes(target_bytes, head, depth) / bandwidth * 1e3
    return {"floor_ms": ms, "floor_plain_floors": ms / plain_floor_ms}


def _rounds(runner, head, prompt, cfg: GpuBenchConfig, plain_ms: float, log, trees=tuple(TREES), suffix: str = "",
            floor=None) -> dict:
    """EAGLE rounds of each fixed tree in `trees` (TREES names) through `runner` with `head` (its kind
    picks the verifier's features): ms per round (draft + verify) and in plain tokens of `plain_ms`;
    `floor(head, depth)` adds the round's bandwidth floor. Keys: tree name + `suffix`."""
    from services.engine.drafter import Drafter
    from services.engine.engine import Engine
    from services.engine.verifier import Verifier
    from services.spec.tree import TreeParams

    c = runner.target.config
    rounds = {}
    for tname in trees:
        k, d, n = TREES[tname]

        def engine(**flags) -> Engine:
            return Engine(Verifier(None, head.feature_kind, runner=runner), Drafter(head, TreeParams(k, d, n)),
                          c.max_context, c.vocab_size, **flags)

        eng = engine()
        decode_ms(eng, prompt, 4)
        ms, nr = _round_ms(eng, prompt, max(8, cfg.tokens // 2))
        r = {"round_ms": ms["round"], "draft_ms": ms["draft"], "verify_ms": ms["verify"],
             "plain_tokens": ms["round"] / plain_ms, "rounds": nr,
             "draft_graphs": getattr(eng.drafter.graphs, "captures", 0), **(floor(head, d) if floor else {})}
        r["device_trees"], r["verdict_drafts"] = eng.device_trees, eng.verdict_drafts
        r["verdict_counts"] = dict(eng.verdict_counts)  # what became of the drafts queued from verdicts
        if not suffix:  # the device's busy and idle time a round, kernels by kind (profiled rounds)
            r["device_split"] = device_split(eng, prompt, 8, cfg.device)
        if not suffix:  # the same rounds without each step of the on-device round, in this run
            r["without"] = {}
            for label, flags in WITHOUT.items():
                if not eng.device_trees or (label != "device trees" and not eng.verdict_drafts):
                    continue
                other = engine(**flags)
                decode_ms(other, prompt, 4)
                oms, _ = _round_ms(other, prompt, max(8, cfg.tokens // 2))
                r["without"][label] = {"round_ms": oms["round"], "draft_ms": oms["draft"],
                                       "verify_ms": oms["verify"], "plain_tokens": oms["round"] / plain_ms,
                                       "verdict_counts": dict(other.verdict_counts)}
                log(f"round {tname} without {label}: {oms['round']:.2f} ms (draft {oms['draft']:.2f} + verify "
                    f"{oms['verify']:.2f}) = {oms['round'] / plain_ms:.2f} plain tokens")
        if tname == "60/5/10" and not suffix:  # where the draft's time goes (timed apart: syncs added; host trees)
            r["draft_parts_ms"] = _draft_parts_ms(engine(device_trees=False), prompt, max(8, cfg.tokens // 4),
                                                  cfg.device)
        rounds[tname + suffix] = r
        log(f"round {tname + suffix}: {ms['round']:.2f} ms (draft {ms['draft']:.2f} + verify {ms['verify']:.2f}) = "
            f"{ms['round'] / plain_ms:.2f} plain tokens"
            + (f"; its bandwidth floor {r['floor_plain_floors']:.2f} plain floors" if floor else ""))
    return rounds


# the rounds measured again with a part of the on-device round turned off (Engine flags): the queued
# draft's re-rank in the verifier's hook (the host re-ranks after the verdict instead: the adaptive
# budget's rounds), drafts queued from the verdict (the tree still on the device), and trees on the
# device at all (read back before the verify)
WITHOUT = {"the re-rank in the hook (the adaptive budget's rounds)": {"verdict_ranks": False},
           "verdict drafts": {"verdict_drafts": False}, "device trees": {"device_trees": False}}


# sequences drafting at once (the drafter service's batches) for `_batched_drafts`, and its tree
DRAFT_BATCHES = (4, 8)
DRAFT_BATCH_TREE = "16/3/4"


def _batched_drafts(head, cfg: GpuBenchConfig, log) -> dict:
    """One draft call (`Drafter.draft_many`) for N = DRAFT_BATCHES sequences of the DRAFT_BATCH_TREE
    shape, 2 new rows each: ms per call drafting them together (one batched static draft: a graph
    per batch bucket on CUDA), each alone (one draft graph after another), and in the eager batch
    (every sequence's rows in each eager head step: what several sequences ran before the batched
    graph). {str(N): {"together_ms", "alone_ms", "eager_ms"}}."""
    from services.engine.drafter import DraftCall, Drafter
    from services.spec.tree import TreeParams

    params = TreeParams(*TREES[DRAFT_BATCH_TREE])
    f = head.config.feature_size
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in DRAFT_BATCHES:
        times = {}
        for way in ("together", "alone", "eager"):
            d = Drafter(head, params, max_sequences=n)
            d.batch_in_graph = way != "eager"  # eager: the older path (batches of 2+ drafted eagerly)
            ids = [f"d{i}" for i in range(n)]
            for seq in ids:
                d.start(seq, 512, sampling=False)
            for seq in ids:  # a history of 16 rows each
                d.draft(seq, torch.randint(0, head.config.vocab_size, (16,), generator=g),
                        torch.randn(16, f, generator=g).to(head.device, head.dtype), params)
            calls = [DraftCall(seq, torch.randint(0, head.config.vocab_size, (2,), generator=g),
                               torch.randn(2, f, generator=g).to(head.device, head.dtype), params) for seq in ids]

            def call(d=d, calls=calls, way=way):
                if way == "alone":
                    for c in calls:
                        d.draft(c.seq_id, c.tokens, c.features, c.params)
                else:
                    d.draft_many(calls)

            times[f"{way}_ms"] = timed(call, cfg.device, max(4, cfg.repeats // 4), warmup=2) * 1e3
            for seq in ids:
                d.release(seq)
        out[str(n)] = times
        log(f"drafts of {n} sequences ({DRAFT_BATCH_TREE}): together {times['together_ms']:.2f} ms, one after "
            f"another {times['alone_ms']:.2f} ms, eager batch {times['eager_ms']:.2f} ms")
    return out


def _batched(runner, cfg: GpuBenchConfig, log) -> dict:
    """One decode step of N = cfg.batches sequences through `runner`: {str(N): step_ms, tokens_per_s,
    vs_n1 (tokens/s over the first N's)}."""
    from services.engine.verifier import Verifier
    from services.spec.sampling import SamplingParams

    c = runner.target.config
    batched = {}
    for n in cfg.batches:
        v = Verifier(None, "hidden", runner=runner)
        ids = [f"b{n}-{i}" for i in range(n)]
        last = {}
        for i, s in enumerate(ids):
            last[s] = v.prefill(s, torch.tensor(random_prompt(c.vocab_size, cfg.prompt, i + 1)), SamplingParams(),
                                cfg.prompt + cfg.repeats + 16).first_token
        step_s = timed(functools.partial(_decode_step, v, ids, last, [1]), cfg.device, cfg.repeats // 2, warmup=2)
        for s in ids:
            v.release(s)
        batched[n] = {"step_ms": step_s * 1e3, "tokens_per_s": n / step_s}
        log(f"batched decode N={n}: {step_s * 1e3:.2f} ms/step, {n / step_s:.0f} tok/s")
    base = batched[cfg.batches[0]]["tokens_per_s"]
    for n in cfg.batches:
        batched[n]["vs_n1"] = batched[n]["tokens_per_s"] / base
    return {str(k): v for k, v in batched.items()}


def _paged_attention(cfg: GpuBenchConfig, target, head, prompt, rows: int, log) -> dict:
    """The measurements with AERIE_ATTENTION=paged (the Triton kernel for every static-shape block,
    trees too); see _forced_backend."""
    return _forced_backend(cfg, "paged", target, head, prompt, rows, log)


def _forced_backend(cfg: GpuBenchConfig, backend: str, target, head, prompt, rows: int, log) -> dict:
    """Plain decoding, rounds and batched decode with AERIE_ATTENTION=`backend` on a fresh paged runner
    (graphs on CUDA), to set beside the default's per-shape choice (services/model/attention.py):
    {"status": "ok" | "skipped: why" | "failed: error", "plain_ms", "rounds", "batched"}. Never raises
    (but KeyboardInterrupt): a failure is the result."""
    from services.engine.engine import Engine
    from services.engine.verifier import Verifier
    from services.model.runner import ModelRunner

    cuda = cfg.device.startswith("cuda")
    if cfg.paged == "off":
        return {"status": "skipped: --paged-attention off"}
    if cfg.paged == "auto" and not cuda:
        return {"status": "skipped: not a CUDA device (--paged-attention on tries it)"}
    out: dict = {"status": "failed: unfinished"}
    try:
        with attention_backend(backend):
            if backend == "paged":
                import services.model.paged_attention  # noqa: F401  (ImportError: no triton)

            runner = ModelRunner(target, _paged(target, rows), graphs=cuda)
            c = target.config
            eng = Engine(Verifier(None, "hidden", runner=runner), None, c.max_context, c.vocab_size)
            decode_ms(eng, prompt, 4)  # warm-up (graph capture, kernel compilation)
            plain = decode_ms(eng, prompt, cfg.tokens)[0]
            out["plain_ms"] = plain
            log(f"plain decoding ({backend} attention): {plain:.2f} ms/token")
            out["rounds"] = _rounds(runner, head, prompt, cfg, plain, log)
            out["batched"] = _batched(runner, cfg, log)
            out["status"] = "ok"
    except ImportError as e:
        out["status"] = f"skipped: triton does not import ({e})"
    except Exception as e:  # the other measurements stand; the failure is reported
        out["status"] = f"failed: {type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        log(out["traceback"])
    log(f"{backend} attention: {out['status']}")
    return out


def _decode_step(verifier, ids: list[str], last: dict[str, int], round_index: list[int]) -> None:
    """One batched decode step of every sequence in `ids` (round_index[0] advances)."""
    from services.engine.verifier import DecodeCall

    out = verifier.run([DecodeCall(s, last[s], round_index[0]) for s in ids])
    round_index[0] += 1
    for s, o in zip(ids, out, strict=True):
        last[s] = o


def _paged(target, rows: int):
    from services.model.paged_kv import PagedKVPool

    return PagedKVPool.for_model(target, rows)


def _uniform_kernels(runner, prompt) -> int:
    """Device activities of one eager static-shape decode step (batch 1) at KV length len(prompt)."""
    from services.model.step import Step, StepEntry

    slot = runner.allocate(len(prompt) + 64)
    runner.execute(Step((StepEntry(slot, torch.tensor(prompt), logits="last"),)))
    step = Step((StepEntry(slot, torch.tensor([1]), logits="last"),))
    cache = runner.pool.cache(slot)

    def one():
        runner.execute(step)
        cache.truncate(len(prompt))

    n = count_kernels(one, str(runner.device))
    runner.release(slot)
    return n


def _round_ms(engine, prompt, tokens) -> tuple[dict[str, float], int]:
    from services.engine.engine import GenerationRequest

    draft, verify, walls = [], [], []
    t_prev = None
    for out in engine.generate(GenerationRequest(prompt, tokens, ignore_eos=True)):
        now = time.perf_counter()
        if out.stats.round_index > 0:
            walls.append(now - t_prev)
            draft.append(out.stats.draft_s)
            verify.append(out.stats.verify_s)
        t_prev = now
    med = statistics.median
    return {"round": med(walls) * 1e3, "draft": med(draft) * 1e3, "verify": med(verify) * 1e3}, len(walls)


DRAFT_CALL = "drafter call (all of it)"
DRAFT_PARTS = {  # what the drafter calls (services/engine/drafter.py) -> the name of that part of a draft
    "graphs.draft": "draft graph: extension + expansion",
    "graphs.expand": "expansion graph (extension eager)",
    "extend_many": "extension, eager",
    "expand_many": "expansion, eager",
    "expand": "expansion, eager",
    "rerank": "re-rank and tree (host)",
}


@contextlib.contextmanager
def draft_parts(drafter, device: str):
    """Time each part of `drafter`'s drafts (DRAFT_PARTS), each call synchronised on both sides (so
    the timings add up; measure the round itself without this): yields {part: [seconds per call]}."""
    import services.engine.drafter as drafter_module

    times: dict[str, list[float]] = {}
    patched: list[tuple[object, str, object]] = []

    def wrap(owner, attr: str, part: str) -> None:
        fn = getattr(owner, attr)

        def timed_call(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                times.setdefault(part, []).append(time.perf_counter() - t0)

        patched.append((owner, attr, fn))
        setattr(owner, attr, timed_call)

    wrap(drafter, "draft_many", DRAFT_CALL)  # every draft: the parts' calls lie inside these
    for name, part in DRAFT_PARTS.items():
        owner, attr = (drafter.graphs, name.split(".")[1]) if name.startswith("graphs.") else (drafter_module, name)
        if owner is not None:
            wrap(owner, attr, part)
    try:
        yield times
    finally:
        for owner, attr, fn in reversed(patched):
            if owner is drafter_module:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)  # the instance attribute: the class's method again


def _draft_parts_ms(engine, prompt, tokens: int, device: str) -> dict[str, float]:
    """Mean ms per draft of each part of the drafts (draft_parts) over a generation of `tokens`, and
    DRAFT_CALL = the whole drafter call, timed the same way (the parts are inside it, so they sum
    to at most it)."""
    from services.engine.engine import GenerationRequest

    with draft_parts(engine.drafter, device) as times:
        for _ in engine.generate(GenerationRequest(prompt, tokens, ignore_eos=True)):
            pass
    calls = max(1, len(times.get(DRAFT_CALL, ())))
    return {part: sum(ts) / calls * 1e3 for part, ts in times.items()}  # a part may skip a draft


def _hf_ms(cfg: GpuBenchConfig, dev: str, dtype: torch.dtype, target, prompt) -> float:
    from transformers import LlamaForCausalLM

    hcfg = hf_config(cfg.shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(hcfg)
    model = model.to_empty(device=dev).to(dtype)
    state = {k: v for k, v in target.state_dict().items()}
    model.load_state_dict(state, strict=False, assign=False)
    rot = model.model.rotary_emb  # its inv_freq was built on meta: build it again on the device
    model.model.rotary_emb = type(rot)(hcfg).to(dev)
    model.eval()
    ids = torch.tensor([prompt], device=dev)
    n = max(8, cfg.tokens // 2)

    def gen(k):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, do_sample=False, pad_token_id=0)

    gen(2)
    one = timed(lambda: gen(1), dev, 2, warmup=0)
    full = timed(lambda: gen(n + 1), dev, 2, warmup=0)
    return (full - one) * 1e3 / n


def table(res: dict) -> str:
    """The benchmark's result as a text table."""
    f = lambda x: "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))  # noqa: E731
    plain = res["plain_ms"]
    rows = [("device", res["device"]), ("shape / dtype / prompt", f"{res['shape']} / {res['dtype']} / {res['prompt']}"),
            ("weights read per step (GB)", f(res["weight_gb"])), ("copy bandwidth (TB/s)", f(res["copy_tb_s"])),
            ("bandwidth floor (ms/token)", f(res["floor_ms"])),
            ("bare eager forward (ms)", f(res["forward_ms"])),
            ("bare eager forward, SDPA own kernel, unfused (ms)", f(res.get("forward_sdpa_ms"))),
            ("kernels per eager decode forward", f(res["kernels_forward"])),
            ("kernels per eager forward, SDPA own kernel, unfused", f(res.get("kernels_forward_sdpa"))),
            ("kernels per static-shape decode step", f(res.get("kernels_uniform_decode")))]
    rows += [(f"plain decoding, {k} (ms/token)", f(v)) for k, v in plain.items()]
    rows += [("plain / floor", f(res.get("plain_vs_floor"))),
             ("time to first token, the prompt's prefill (ms)", f(res.get("first_token_ms")))]
    rows += _split_rows(res.get("plain_device_split"))
    rows += _split_rows(res.get("plain_run_device_split"), "  in plain runs: ")
    if res.get("rounds_draft_vocab_error"):
        rows.append(("rounds with a reduced draft vocabulary", f"failed: {res['rounds_draft_vocab_error']}"))
    for name, r in {**res["rounds"], **res.get("rounds_draft_vocab", {})}.items():
        rows.append((f"round {name}: ms (draft + verify) = plain tokens [floor: plain floors]",
                     f"{r['round_ms']:.2f} ({r['draft_ms']:.2f} + {r['verify_ms']:.2f}) = {r['plain_tokens']:.2f} "
                     f"[{f(r.get('floor_plain_floors'))}]"))
        for label, h in r.get("without", {}).items():
            rows.append((f"  without {label}: ms (draft + verify) = plain tokens",
                         f"{h['round_ms']:.2f} ({h['draft_ms']:.2f} + {h['verify_ms']:.2f}) = {h['plain_tokens']:.2f}"))
        rows += _split_rows(r.get("device_split"))
        for part, ms in r.get("draft_parts_ms", {}).items():
            rows.append((f"  its draft: {part} (ms a draft)", f(ms)))
    for n, b in res["batched"].items():
        rows.append((f"batched decode N={n}: ms/step, tok/s, x N=1", f"{b['step_ms']:.2f}, {b['tokens_per_s']:.0f}, "
                                                                   f"{b['vs_n1']:.2f}x"))
    for n, b in res.get("batched_drafts", {}).items():
        rows.append((f"drafts of N={n} sequences: ms together, one after another, eager batch",
                     f"{b['together_ms']:.2f}, {b['alone_ms']:.2f}, {b['eager_ms']:.2f}"))
    rows += [("CUDA graphs captured (s)", f"{res.get('graph_captures', '-')} ({res.get('graph_capture_s', '-')})"),
             ("transformers eager generate (ms/token)", f(res.get("hf_ms"))),
             ("speed-up over transformers", f(res.get("vs_hf")))]
    for backend, what in (("paged", "Triton kernel"), ("grouped", "gathered keys")):
        rows += _forced_rows(res, backend, what)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def _forced_rows(res: dict, backend: str, what: str) -> list[tuple[str, str]]:
    """The table's rows of one forced backend's section, each beside the default's value."""
    plain = res["plain_ms"]
    sec = res.get(f"{backend}_attention", {})
    rows = [(f"AERIE_ATTENTION={backend} ({what})", sec.get("status", "-"))]
    if "plain_ms" in sec:
        base_ms = plain.get("graphs", plain.get("paged_eager"))
        rows += [(f"  plain decoding (ms/token): {backend} vs default", f"{sec['plain_ms']:.2f} vs {base_ms:.2f}")]
    for name, r in sec.get("rounds", {}).items():
        base = res["rounds"][name]
        rows.append((f"  round {name}: ms (draft + verify), verify vs default",
                     f"{r['round_ms']:.2f} ({r['draft_ms']:.2f} + {r['verify_ms']:.2f}), verify "
                     f"{r['verify_ms']:.2f} vs {base['verify_ms']:.2f}"))
    for n, b in sec.get("batched", {}).items():
        base = res["batched"][n]
        rows.append((f"  batched decode N={n}: ms/step, x N=1 (default)",
                     f"{b['step_ms']:.2f}, {b['vs_n1']:.2f}x ({base['step_ms']:.2f}, {base['vs_n1']:.2f}x)"))
    return rows


def _split_rows(split: dict | None, prefix: str = "  ") -> list[tuple[str, str]]:
    """A profiled round's device time (services/bench/device_time.py) as two table rows."""
    if not split:
        return []
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in split["by_kind_ms"].items())
    calls = ", ".join(f"{k} {v:.0f}" for k, v in list(split.get("host", {}).get("runtime_calls", {}).items())[:6])
    return [(f"{prefix}a round on the device: busy / wall ms (idle), kernels",
             f"{split['busy_ms']:.2f} / {split['wall_ms']:.2f} ({split['idle_ms']:.2f}), {split['kernels']:.0f}"),
            (f"{prefix}its kernels by kind (ms a round)", kinds),
            (f"{prefix}its CUDA runtime calls (a round)", calls or "-")]
