"""The model runner: one Step (one forward) over many sequences' prefills, decodes and trees gives
each entry what its own forward alone gives; the KV pool's slots are deterministic and bounded."""

from __future__ import annotations

import pickle

import pytest
import torch

from services.errors import CapacityExceeded
from services.model.kv_pool import KVPool
from services.model.runner import ModelRunner
from services.model.step import Step, StepEntry
from tests.helpers import tiny_hf, to_native

PARENTS = [-1, 0, 0, 1, 2]


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for node in range(n):
        a = node
        while a >= 0:
            mask[node, a] = True
            a = parents[a]
        depth[node] = int(mask[node].sum()) - 1
    return mask, depth


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return to_native(tiny_hf(layers=2, seed=3))


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_one_step_for_many_sequences_equals_each_alone(target) -> None:
    """Three sequences with different prompt lengths: prefills in one step, then one step holding a
    plain decode, a tree and a second prefill; every entry's logits/hidden/taps equal its batch-1
    forward (fp32), and the KV compaction of the tree gives the same next step."""
    prompts = [ids(5, 1), ids(9, 2), ids(3, 3)]
    mask, depth = tree(PARENTS)
    tree_ids, dec = ids(len(PARENTS), 4), ids(1, 5)

    solo = ModelRunner(target)
    batch = ModelRunner(target)
    s_slots = [solo.allocate(32) for _ in prompts]
    b_slots = [batch.allocate(32) for _ in prompts]
    assert s_slots == b_slots == [0, 1, 2]  # deterministic
    # step 1: prefill sequences 0 and 1 together
    b1 = batch.execute(Step((StepEntry(0, prompts[0], logits="last"), StepEntry(1, prompts[1], logits="all")),
                            want_taps=True))
    s0 = solo.execute(Step((StepEntry(0, prompts[0], logits="last"),), want_taps=True))
    s1 = solo.execute(Step((StepEntry(1, prompts[1], logits="all"),), want_taps=True))
    assert b1.offsets == (0, 5, 14)
    assert b1.logits[0].shape == (1, 128) and b1.logits[1].shape == (9, 128)
    torch.testing.assert_close(b1.logits[0], s0.logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b1.logits[1], s1.logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b1.hidden_of(1), s1.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b1.taps_of(0), s0.taps, rtol=1e-5, atol=1e-5)
    # step 2: a decode for 0, a tree for 1, the prefill of 2 (joining mid-batch)
    entries = (StepEntry(0, dec, logits="last"),
               StepEntry(1, tree_ids, 9 + depth, mask),
               StepEntry(2, prompts[2], logits="last"))
    b2 = batch.execute(Step(entries))
    for i, e in enumerate(entries):
        s = solo.execute(Step((e,)))
        torch.testing.assert_close(b2.logits[i], s.logits[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(b2.logits[i].argmax(-1), s.logits[0].argmax(-1))
    # accept nodes 0, 2, 4 of the tree, then decode once more: equal again
    for r in (solo, batch):
        r.keep(1, 9, 9 + torch.tensor([0, 2, 4]))
        assert r.pool.length(1) == 12
    after = (StepEntry(1, ids(1, 6), logits="last"), StepEntry(0, ids(1, 7), logits="last"))
    b3 = batch.execute(Step(after))
    for i, e in enumerate(after):
        torch.testing.assert_close(b3.logits[i], solo.execute(Step((e,))).logits[0], rtol=1e-5, atol=1e-5)


def test_pool_budget_refuses_whole_sequences_and_reuses_slots(target) -> None:
    pool = KVPool.for_model(target, max_rows=100)
    assert pool.bytes_per_row == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32
    runner = ModelRunner(target, pool)
    a, b = runner.allocate(60), runner.allocate(40)
    with pytest.raises(CapacityExceeded, match="KV budget of 100 rows"):
        runner.allocate(1)
    assert pool.num_slots == 2 and pool.rows_allocated == 100  # nothing partially admitted
    runner.release(a)
    assert runner.allocate(10) == a  # lowest free id
    assert runner.allocate(50) == 2
    with pytest.raises(ValueError):
        KVPool.for_model(target, max_rows=0)
    del b


def test_step_errors_before_writing(target) -> None:
    runner = ModelRunner(target)
    slot = runner.allocate(4)
    runner.execute(Step((StepEntry(slot, ids(3, 1)),)))
    with pytest.raises(CapacityExceeded, match="holds 4 rows; 3 used, 2 more"):
        runner.execute(Step((StepEntry(slot, ids(2, 2)),)))
    assert runner.pool.length(slot) == 3
    other = runner.allocate(4)
    with pytest.raises(ValueError, match="slot twice"):
        runner.execute(Step((StepEntry(other, ids(1, 1)), StepEntry(other, ids(1, 2)))))


def test_step_is_picklable() -> None:
    """A tensor-parallel proxy sends Steps to other ranks."""
    mask, depth = tree(PARENTS)
    step = Step((StepEntry(3, ids(5, 1), depth + 7, mask),), want_taps=True)
    again = pickle.loads(pickle.dumps(step))
    assert again.entries[0].slot == 3 and torch.equal(again.entries[0].tree_mask, mask) and again.rows == 5


def test_aerie_paged_kv_runs_the_gpu_s_paged_paths_on_the_cpu(target, llama_pair, monkeypatch) -> None:
    """AERIE_PAGED_KV=1: on the CPU the runner's pool is paged (its short steps take the static-shape
    forward, so it takes trees on the device) and a drafter drafts from the static code, as on CUDA;
    unset or 0: neither; anything else is refused naming the value."""
    from services.engine.drafter import Drafter
    from services.errors import InvalidRequest
    from services.model.paged_kv import PagedKVPool
    from services.model.runner import paged_default, pool_for
    from services.spec.tree import TreeParams

    head = llama_pair[2]
    cpu = torch.device("cpu")
    for value, paged in ((None, False), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv("AERIE_PAGED_KV", raising=False)
        else:
            monkeypatch.setenv("AERIE_PAGED_KV", value)
        assert paged_default(cpu) is paged
        runner = ModelRunner(target, pool_for(target, 4096))
        assert isinstance(runner.pool, PagedKVPool) is paged and (runner.uniform is not None) is paged
        assert runner.uniform is None or not runner.uniform.graphs_on  # (never CUDA graphs on the CPU)
        assert (Drafter(head, TreeParams(4, 3, 16)).graphs is not None) is paged, value
    monkeypatch.setenv("AERIE_PAGED_KV", "yes")
    with pytest.raises(InvalidRequest, match="AERIE_PAGED_KV must be 0 or 1; got 'yes'"):
        paged_default(cpu)
