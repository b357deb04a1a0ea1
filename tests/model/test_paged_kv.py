"""The paged KV pool and the static-shape forward (services/model/paged_kv.py, uniform.py), run
eagerly on the CPU: the same tokens as the contiguous pool's per-entry forward, padding that never
leaks, page bookkeeping, and a forward that never reads a device value on the host."""

import numpy as np
import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import DecodeCall, Verifier
from services.errors import KVBudgetExceeded
from services.model.config import ModelConfig
from services.model.kv_pool import KVPool
from services.model.paged_kv import TRASH_ROW, PagedKVPool
from services.model.runner import ModelRunner
from services.model.step import Step, StepEntry
from services.model.target import TargetModel
from services.model.uniform import UniformRunner, UniformShape, forward_uniform
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB

SHAPES = {"60/5/10": TreeParams(10, 5, 60), "16/3/4": TreeParams(4, 3, 16), "chain 8/7/1": TreeParams(1, 7, 8)}


def paged_runner(target, rows: int = 4096, page_size: int = 16) -> ModelRunner:
    return ModelRunner(target, PagedKVPool.for_model(target, rows, page_size), graphs=False)


def generate(engine: Engine, prompt: list[int], n: int, **kw) -> tuple[list[int], list[int]]:
    tokens, accepts = [], []
    for step in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += step.tokens
        accepts.append(step.stats.accept_length)
    return tokens, accepts


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_paged_static_shape_engine_equals_contiguous(pair, shape, request):
    """EAGLE rounds through the paged pool and the padded static-shape forward give the tokens and
    acceptance of the contiguous pool's per-entry forward (fp32, greedy)."""
    _, target, head = request.getfixturevalue(pair)
    tree = SHAPES[shape]
    contiguous = Engine(Verifier(target, head.feature_kind), Drafter(head, tree), 512, VOCAB)
    paged = Engine(Verifier(None, head.feature_kind, runner=paged_runner(target, page_size=8)),
                   Drafter(head, tree), 512, VOCAB)
    for prompt in prompts(seed=len(shape)):
        expected = generate(contiguous, prompt, 40)
        assert generate(paged, prompt, 40) == expected, prompt
        assert max(expected[1]) > 1  # trees were accepted: the tree rows went through the pages


def test_paged_plain_and_sampling_equal_contiguous(llama_pair):
    _, target, head = llama_pair
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    for kw in ({}, {"sampling": sampling}):
        contiguous = Engine(Verifier(target, "hidden"), Drafter(head, SHAPES["16/3/4"]), 512, VOCAB)
        paged = Engine(Verifier(None, "hidden", runner=paged_runner(target)), Drafter(head, SHAPES["16/3/4"]),
                       512, VOCAB)
        for prompt in prompts(seed=11, count=2):
            assert generate(paged, prompt, 32, **kw) == generate(contiguous, prompt, 32, **kw)
    plain = Engine(Verifier(None, "hidden", runner=paged_runner(target)), None, 512, VOCAB)
    reference = Engine(Verifier(target, "hidden"), None, 512, VOCAB)
    for prompt in prompts(seed=12, count=2):
        assert generate(plain, prompt, 32) == generate(reference, prompt, 32)


def test_batched_decode_equals_alone(llama_pair):
    """Sequences of different lengths decoded in one padded step: each gets its tokens alone."""
    _, target, _ = llama_pair
    batch = Verifier(None, "hidden", runner=paged_runner(target))
    alone = Verifier(None, "hidden", runner=paged_runner(target))
    ps = prompts(seed=3, count=3)
    greedy = SamplingParams()
    last = {}
    for i, p in enumerate(ps):
        last[i] = batch.prefill(f"s{i}", torch.tensor(p), greedy, 200).first_token
        assert alone.prefill(f"s{i}", torch.tensor(p), greedy, 200).first_token == last[i]
    for r in range(1, 12):
        calls = [DecodeCall(f"s{i}", last[i], r) for i in range(3)]
        got = batch.run(calls)
        for i in range(3):
            assert alone.decode(f"s{i}", last[i], r) == got[i]
            last[i] = got[i]


def test_padding_writes_only_the_trash_page(llama_pair):
    """A step padded from 3 sequences x up-to-5 rows to 4 x 8: every arena row outside the three
    sequences' new rows is unchanged except in the trash page."""
    _, target, _ = llama_pair
    pool = PagedKVPool.for_model(target, 1024, page_size=8)
    runner = UniformRunner(target, pool)
    slots = [pool.allocate(40) for _ in range(3)]
    for s, n in zip(slots, (5, 9, 2)):
        pool.cache(s).advance(n)  # committed rows (contents do not matter here)
    entries = (StepEntry(slots[0], torch.tensor([1, 2, 3])),
               StepEntry(slots[1], torch.tensor([4, 5, 6, 7, 8]), tree_mask=torch.tensor(
                   [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()),
               StepEntry(slots[2], torch.tensor([9])))
    step = Step(entries)
    shape = runner.shape_for(step)
    assert shape == UniformShape(4, 8, 256, False)
    before = pool.k.clone()
    out = runner.execute(step, shape)
    written = np.concatenate([pool.rows_of(s)[p:p + e.rows] for s, p, e in zip(slots, (5, 9, 2), entries)])
    changed = (pool.k != before).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
    trash = set(range(TRASH_ROW, TRASH_ROW + pool.page_size))
    assert set(changed) - trash == set(written.tolist())
    assert [pool.length(s) for s in slots] == [8, 14, 3]
    assert [t.shape[0] for t in out.logits] == [3, 5, 1] and out.hidden.shape[0] == 9


def test_paged_pool_pages_and_budget():
    pool = PagedKVPool(2, 2, 4, max_rows=64, page_size=8)
    a = pool.allocate(20)  # 3 pages: 1, 2, 3 (page 0 is the trash page)
    b = pool.allocate(8)  # page 4
    assert pool.rows_of(a).tolist() == list(range(8, 28)) and pool.rows_of(b).tolist() == list(range(32, 40))
    pool.release(a)
    c = pool.allocate(9)  # the lowest free pages again: 1, 2
    assert c == a and pool.rows_of(c).tolist() == list(range(8, 17))
    with pytest.raises(KVBudgetExceeded, match="does not fit the KV budget of 64 rows"):
        pool.allocate(48)
    assert pool.rows_allocated == 17 and pool.num_slots == 2


def test_paged_keep_equals_contiguous_keep():
    """Compaction of an accepted path moves the same K/V rows as the contiguous cache's."""
    g = torch.Generator().manual_seed(0)
    paged, flat = PagedKVPool(2, 2, 4, max_rows=64, page_size=4), KVPool(2, 2, 4, max_rows=64)
    sp, sf = paged.allocate(30), flat.allocate(30)
    cp, cf = paged.cache(sp), flat.cache(sf)
    for layer in range(2):
        k, v = torch.randn(2, 19, 4, generator=g), torch.randn(2, 19, 4, generator=g)
        kp, vp = cp.write(layer, k, v)
        kf, vf = cf.write(layer, k, v)
        assert torch.equal(kp, kf) and torch.equal(vp, vf)
    cp.advance(19)
    cf.advance(19)
    keep = torch.tensor([7, 9, 10, 15])
    paged.keep(sp, 7, keep)
    flat.keep(sf, 7, keep)
    assert cp.length == cf.length == 11
    for layer in range(2):
        kp, vp = cp.write(layer, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4))
        assert torch.equal(kp, cf.k[layer, :, :11]) and torch.equal(vp, cf.v[layer, :, :11])


def test_uniform_forward_reads_no_device_value_on_the_host():
    """On the meta device a tensor has no values: `.item()`, `int(t)` or `bool(t)` raise. The
    static-shape forward runs through, so it never synchronises with the GPU."""
    with pytest.raises((RuntimeError, NotImplementedError)):  # the detector works
        int(torch.zeros(3, device="meta").max())
    cfg = ModelConfig("llama", VOCAB, 64, 128, 8, 4, 2, 16, 1e-6, 10000.0, 512)  # 8 layers: three distinct taps
    with torch.device("meta"):
        target = TargetModel(cfg)
    pool = PagedKVPool.for_model(target, 256, page_size=8)
    shape = UniformShape(2, 4, 256, True)
    inputs = torch.zeros(sum(shape.sizes()), dtype=torch.long, device="meta")
    with torch.no_grad():
        out = forward_uniform(target, pool, shape, inputs)
    assert out.logits.shape == (8, VOCAB) and out.taps.shape == (8, 3 * 64)


def test_prefill_chunks_longer_than_the_widest_shape_run_per_entry(llama_pair):
    """A 100-token prompt is wider than any captured shape: the per-entry forward runs it over the
    same pages, and decoding after it matches the contiguous pool."""
    _, target, _ = llama_pair
    prompt = prompts(seed=9, count=1)[0] * 4
    prompt = (prompt * 10)[:100]
    plain = Engine(Verifier(None, "hidden", runner=paged_runner(target)), None, 512, VOCAB)
    reference = Engine(Verifier(target, "hidden"), None, 512, VOCAB)
    assert generate(plain, prompt, 16) == generate(reference, prompt, 16)


def test_start_up_warm_up_runs_every_shape_once_and_writes_only_the_trash_page(llama_pair):
    """ModelRunner.warm_up (eager here: graphs are CUDA-only) prepares the decode shapes of 1, 2, 4, 8
    sequences and one sequence's trees of 2-64 rows, with and without taps, touching no arena row
    outside the trash page; a second warm-up has nothing left to do; serving afterwards gives the
    tokens of a runner that never warmed up."""
    _, target, _ = llama_pair
    runner, cold = paged_runner(target), paged_runner(target)
    pool = runner.pool
    slot = pool.allocate(64)
    pool.cache(slot).advance(7)  # a sequence already holding rows: the warm-up must not touch them
    before_k, before_v = pool.k.clone(), pool.v.clone()
    done = runner.warm_up(max_sequences=64)
    assert (done.shapes, done.graphs, done.memory_bytes) == (4 * 2 + 6 * 2, False, 0)
    assert "20 static-shape forwards run (CUDA graphs off) at start-up" in done.describe()
    trash = set(range(TRASH_ROW, TRASH_ROW + pool.page_size))
    for now, before in ((pool.k, before_k), (pool.v, before_v)):
        changed = set((now != before).any(dim=(0, 1, 3)).nonzero().flatten().tolist())
        assert changed and changed <= trash
    assert pool.cache(slot).length == 7
    assert runner.warm_up(max_sequences=64).shapes == 0
    assert paged_runner(target).warm_up(max_sequences=2).shapes == 2 * 2 + 6 * 2  # decodes of 1 and 2 only
    pool.release(slot)
    prompt = prompts(5, 1)[0]
    outs = [generate(Engine(Verifier(None, "hidden", runner=r), None, 512, VOCAB), prompt, 12)[0]
            for r in (runner, cold)]
    assert outs[0] == outs[1]


def test_warm_up_at_start_is_cuda_only_and_never_fails_the_start(llama_pair, monkeypatch, caplog):
    """warm_up_at_start: nothing on the CPU; on a device that warms up, a failure is logged and serving
    goes on (shapes then prepare on first use), a success is logged with its time and memory."""
    import services.model.runner as runner_module

    _, target, _ = llama_pair
    runner = paged_runner(target)
    assert runner_module.warm_up_at_start(runner, 8) is None and runner.uniform._warm == set()
    default = runner_module.warm_up_default
    assert default(torch.device("cuda")) and not default(torch.device("cpu"))
    monkeypatch.setattr(runner_module, "warm_up_default", lambda device: True)
    with caplog.at_level("INFO", logger="services.model.runner"):
        done = runner_module.warm_up_at_start(runner, 8)
        assert done is not None and done.shapes == 20
        monkeypatch.setattr(runner, "warm_up", lambda n: (_ for _ in ()).throw(RuntimeError("out of memory")))
        assert runner_module.warm_up_at_start(runner, 8) is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("20 static-shape forwards run" in m and "AERIE_GRAPH_WARMUP=0 skips this" in m for m in messages)
    assert any("start-up warm-up of the static shapes failed" in m for m in messages)
    monkeypatch.setenv("AERIE_GRAPH_WARMUP", "0")
    assert not default(torch.device("cuda"))
