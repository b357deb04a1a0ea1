"""The paged attention kernel (services/model/paged_attention.py, AERIE_ATTENTION=paged) on the CPU in
Triton's interpreter: the kernel == `attend_gathered` over gathered keys (decode, trees, GQA and MHA,
scattered arena rows, with and without split-KV, slots past a sequence's need never read); the
static-shape forward and the engine give the default path's logits and tokens with it.

Triton reads TRITON_INTERPRET when it is imported (its own library functions are decorated then),
so this module sets it first and is skipped where that cannot hold: triton already imported without
it (only when something imports triton before pytest collects this file: the README's test command
does not), or a CUDA machine (the interpreter would take over every Triton kernel of the process;
tests/gpu/test_cuda.py runs the compiled kernel). Triton missing fails on Linux (the `test` extra
installs it) and skips elsewhere (no wheels): tests/helpers.py `require_triton`."""

import importlib
import os
import sys

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA machine: the compiled kernel is tested in tests/gpu/test_cuda.py", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
from tests.helpers import require_triton  # noqa: E402

require_triton()

import services.model.paged_attention as kernel  # noqa: E402
from services.engine.drafter import Drafter  # noqa: E402
from services.engine.engine import Engine, GenerationRequest  # noqa: E402
from services.engine.verifier import Verifier  # noqa: E402
from services.model.config import ModelConfig  # noqa: E402
from services.model.paged_kv import PagedKVPool  # noqa: E402
from services.model.runner import ModelRunner  # noqa: E402
from services.model.step import Step, StepEntry  # noqa: E402
from services.model.target import TargetModel  # noqa: E402
from services.model.uniform import UniformRunner  # noqa: E402
from services.spec.tree import TreeParams  # noqa: E402
from tests.helpers import VOCAB, gathered_attention, seeded_pair  # noqa: E402

if not kernel.INTERPRETED:  # imported earlier in this process, before the variable was set
    kernel = importlib.reload(kernel)


def random_tree(t: int, g: torch.Generator) -> torch.Tensor:
    """[t, t] int64 0/1: each row sees itself and a random subset of the earlier rows."""
    return ((torch.rand(t, t, generator=g) < 0.5).tril(-1) | torch.eye(t, dtype=torch.bool)).long()


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("t", [1, 4, 16], ids=["decode", "tree4", "tree16"])
def test_kernel_equals_gathered_attention(t, heads, splits):
    """B = 3 sequences with prefixes 0, 37, 150 over S = 256 slots whose arena rows are scattered
    (one random permutation of the arena, disjoint per sequence). The arena rows behind slots past
    a sequence's prefix + T are NaN: the kernel never reads them (a read would poison its sum)."""
    g = torch.Generator().manual_seed(t * 10 + heads[0] + splits)
    h, nkv = heads
    b, s, hd = 3, 256, 16
    rows = b * s + 40
    q = torch.randn(b, t, h, hd, generator=g)
    k, v = torch.randn(nkv, rows, hd, generator=g), torch.randn(nkv, rows, hd, generator=g)
    table = torch.randperm(rows, generator=g)[:b * s].view(b, s)
    prefix = torch.tensor([0, 37, 150])
    tree = torch.stack([random_tree(t, g) for _ in range(b)])
    expected = gathered_attention(q, k, v, table, prefix, tree)  # [B, T, H, hd]
    unread = torch.cat([table[j, int(prefix[j]) + t:] for j in range(b)])
    k[:, unread], v[:, unread] = float("nan"), float("nan")
    got = kernel.paged_attention(q, k, v, table, prefix, tree.bool() if t == 4 else tree, hd ** -0.5,
                                 splits=splits)
    assert got.shape == (b, t, h, hd) and got.dtype == q.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_in_half_precision(splits):
    """fp16 (p cast to V's dtype before the second dot, no IEEE dots): compared with the fp32 answer,
    the kernel's error is at most twice `attend_gathered`'s in fp16. (bf16 cannot be checked here:
    the interpreter's tl.dot on bf16 is wrong; tests/gpu/test_cuda.py checks bf16 on CUDA.)"""
    g = torch.Generator().manual_seed(splits)
    b, t, h, nkv, hd, s, rows = 2, 4, 8, 2, 32, 128, 512
    q = torch.randn(b, t, h, hd, generator=g)
    k, v = torch.randn(nkv, rows, hd, generator=g), torch.randn(nkv, rows, hd, generator=g)
    table = torch.randperm(rows, generator=g)[:b * s].view(b, s)
    prefix = torch.tensor([90, 3])
    tree = torch.stack([random_tree(t, g) for _ in range(b)])

    def gathered(q, k, v):
        return gathered_attention(q, k, v, table, prefix, tree)

    exact = gathered(q, k, v)
    half = [x.half() for x in (q, k, v)]
    got = kernel.paged_attention(*half, table, prefix, tree, hd ** -0.5, splits=splits)
    assert got.dtype == torch.float16
    err, err_gathered = ((y.float() - exact).abs().max().item() for y in (got, gathered(*half)))
    assert 0 < err <= 2 * err_gathered + 1e-3, (err, err_gathered)


def test_splits_come_from_shapes():
    assert kernel.splits_for(1, 8, 1, 768, 132) == 12  # batch-1 decode: one split per key block
    assert kernel.splits_for(1, 8, 1, 8192, 132) == 17  # enough programs for every SM
    assert kernel.splits_for(32, 8, 1, 768, 132) == 1  # 256 programs already
    assert kernel.block_m(32, 8, 1) == 16 and kernel.block_m(32, 8, 64) == 64


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    z = torch.zeros(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel.paged_attention(z, torch.zeros(1, 8, 16), torch.zeros(1, 8, 16), torch.zeros(1, 8, dtype=torch.long),
                               torch.zeros(1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.long), 0.25)


def tiny_target() -> TargetModel:
    torch.manual_seed(0)
    cfg = ModelConfig("llama", VOCAB, 64, 128, 2, 4, 2, 16, 1e-6, 10000.0, 512)
    return TargetModel(cfg).eval().requires_grad_(False)


def _uniform_logits(target, monkeypatch, backend: str) -> list[torch.Tensor]:
    """Logits of fixed steps on a fresh pool: prefills of 3 sequences (5, 30, 12 rows) in one
    padded step, two batched decodes, then trees on two of them."""
    monkeypatch.setenv("AERIE_ATTENTION", backend)
    pool = PagedKVPool.for_model(target, 2048, page_size=8)
    pool.allocate(24)  # the sequences' pages start past another's: rows are not 0..n
    runner = UniformRunner(target, pool)
    g = torch.Generator().manual_seed(5)
    slots = [pool.allocate(80) for _ in range(3)]
    steps = [Step(tuple(StepEntry(sl, torch.randint(0, VOCAB, (n,), generator=g), logits="all")
                        for sl, n in zip(slots, (5, 30, 12))))]
    steps += [Step(tuple(StepEntry(sl, torch.tensor([7 + i + r]), logits="last") for i, sl in enumerate(slots)))
              for r in range(2)]
    steps.append(Step((StepEntry(slots[0], torch.tensor([1, 2, 3, 4]), tree_mask=random_tree(4, g).bool()),
                       StepEntry(slots[2], torch.tensor([5, 6]), tree_mask=torch.tensor([[1, 0], [1, 1]]).bool()))))
    out = []
    for step in steps:
        shape = runner.shape_for(step)
        assert shape is not None
        out.append(torch.cat(runner.execute(step, shape).logits))
    return out


def test_forward_uniform_paged_equals_default(monkeypatch):
    target = tiny_target()
    expected = _uniform_logits(target, monkeypatch, "grouped")
    got = _uniform_logits(target, monkeypatch, "paged")
    for e, x in zip(expected, got, strict=True):
        torch.testing.assert_close(x, e, rtol=1e-5, atol=1e-5)


def _generate(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    tokens, accepts = [], []
    for out in engine.generate(GenerationRequest(tuple(prompt), n)):
        tokens += out.tokens
        accepts.append(out.stats.accept_length)
    return tokens, accepts


def test_engine_greedy_tokens_paged_equal_default(monkeypatch):
    """Plain decoding and EAGLE rounds (tree 16/3/4) through the paged pool's static-shape forward
    (ModelRunner on the CPU, eager): the same tokens and acceptance with the kernel as without it
    (gather + attend_gathered; the draft head runs SDPA in both)."""
    target, head = seeded_pair()
    prompt = np.random.default_rng(3).integers(0, VOCAB, 11).tolist()
    runs = {}
    for backend in ("default", "paged"):
        if backend == "paged":
            monkeypatch.setenv("AERIE_ATTENTION", backend)
        else:
            monkeypatch.delenv("AERIE_ATTENTION", raising=False)
        plain = Engine(Verifier(None, "hidden", runner=ModelRunner(target, PagedKVPool.for_model(target, 1024, 8),
                                                                    graphs=False)), None, 512, VOCAB)
        eagle = Engine(Verifier(None, head.feature_kind, runner=ModelRunner(
            target, PagedKVPool.for_model(target, 1024, 8), graphs=False)), Drafter(head, TreeParams(4, 3, 16)),
            512, VOCAB)
        runs[backend] = (_generate(plain, prompt, 12), _generate(eagle, prompt, 16))
    assert runs["paged"] == runs["default"]
    assert max(runs["default"][1][1]) > 1  # a tree was accepted: tree rows went through the kernel


def test_the_default_s_one_time_check_runs_the_real_kernel():
    """`paged_runs` (the CUDA default's check before first use) calls the kernel with arguments it
    accepts: in the interpreter it runs (fp32 and fp16, GQA and MHA heads)."""
    from services.model.attention import DecodeHeads, paged_runs

    for h in (DecodeHeads(torch.float32, 8, 2, 16), DecodeHeads(torch.float16, 4, 4, 32)):
        assert paged_runs(kernel.paged_attention, torch.device("cpu"), h), h
