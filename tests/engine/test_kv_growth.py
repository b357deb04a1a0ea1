"""KV slots that grow (services/engine/kv_growth.py): a sequence reserves its prompt and an increment
and grows as it writes rows; the budget admits more sequences than worst-case reservation; when the
budget cannot hold a growth the youngest sequence is preempted and, prefilled again from its
committed tokens, still yields the target's greedy tokens (fp32, tiny real models, no timing)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest, fixed_budget
from services.engine.kv_growth import first_rows, grow_to, youngest
from services.engine.verifier import DecodeCall, PrefillCall, PrefillMoreCall, Verifier
from services.errors import KVBudgetExceeded, SequencePreempted
from services.model.kv_pool import KVPool
from services.model.paged_kv import PagedKVPool
from services.model.runner import ModelRunner
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB

TREE = TreeParams(top_k=4, depth=3, size=12)
GREEDY = SamplingParams()


def test_growth_arithmetic() -> None:
    assert first_rows(300, 4396, 256) == 556 and first_rows(300, 400, 256) == 400
    assert first_rows(300, 4396, 0) == 4396  # growth off: the worst case
    assert grow_to(550, 17, 556, 4396, 256) == 823 and grow_to(550, 5, 556, 4396, 256) == 556
    assert grow_to(4390, 6, 4392, 4396, 256) == 4396  # never past the capacity
    assert youngest({"a": 0, "b": 3, "c": 1}) == "b"


def pool_of(target, kind: str, max_rows: int | None) -> KVPool:
    if kind == "paged":  # the CUDA layout, run eagerly on the CPU (the static-shape forward included)
        return PagedKVPool.for_model(target, max_rows or 4096, page_size=4)
    return KVPool.for_model(target, max_rows)


def reference(target, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy tokens: plain decoding, KV reserved for the worst case."""
    engine = Engine(Verifier(target), None, 512, VOCAB)
    return [t for s in engine.generate(GenerationRequest(tuple(prompt), n, GREEDY)) for t in s.tokens]


def speculative(target, head, runner: ModelRunner | None = None, growth: int = 0, on_grow=None) -> Engine:
    verifier = Verifier(target, head.feature_kind, runner=runner, growth_rows=growth, on_grow=on_grow)
    drafter = Drafter(head, TREE)
    return Engine(verifier, drafter, 512, VOCAB, budget=replace(fixed_budget(drafter), fixed=TREE))


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=11)])
def test_a_slot_grows_across_many_rounds_and_the_output_is_unchanged(llama_pair, kind, sampling) -> None:
    _, target, head = llama_pair
    grown: list[tuple[str, int]] = []
    runner = ModelRunner(target, pool_of(target, kind, None), graphs=False)
    engine = speculative(target, head, runner, 5, lambda s, rows: grown.append((s, rows)))
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    req = GenerationRequest(tuple(prompt), 80, sampling)
    out = [t for s in engine.generate(req, seq_id="g") for t in s.tokens]
    # greedy: the target's own tokens; sampling: what the same seed gives with worst-case KV
    expected = (reference(target, prompt, 80) if sampling.greedy
                else [t for s in speculative(target, head).generate(req) for t in s.tokens])
    assert out == expected
    rows = [r for _, r in grown]
    assert len(rows) >= 8 and rows == sorted(rows)  # grown round after round, never past what it needed
    assert rows[0] <= 7 + TREE.size + 5  # the first Verify: prompt + its tree + one increment, not the worst case
    assert runner.pool.rows_allocated == 0  # released at the end


def test_the_budget_admits_more_sequences_than_worst_case_reservation(llama_pair) -> None:
    _, target, _ = llama_pair
    capacity = 4 + 200 + 1  # prompt + max_new_tokens + one decode row

    def admitted(growth: int) -> int:
        v = Verifier(None, "none", runner=ModelRunner(target, KVPool.for_model(target, max_rows=1000)),
                     growth_rows=growth)
        n = 0
        while True:
            try:
                v.prefill(f"s{n}", torch.tensor([1, 2, 3, 4]), GREEDY, capacity)
            except KVBudgetExceeded:
                return n
            n += 1

    assert admitted(0) == 1000 // capacity == 4
    assert admitted(16) == 1000 // (4 + 16) == 50


def test_a_capacity_larger_than_the_budget_is_refused_at_once(llama_pair) -> None:
    """Growth must never admit a sequence that could not finish alone (no deadlock)."""
    _, target, _ = llama_pair
    v = Verifier(None, "none", runner=ModelRunner(target, KVPool.for_model(target, max_rows=100)), growth_rows=8)
    with pytest.raises(KVBudgetExceeded) as e:
        v.prefill("big", torch.tensor([1, 2, 3]), GREEDY, 101)
    assert not e.value.fits_empty and "100 rows" in str(e.value)


class Driver:
    """Plain greedy decoding of several sequences, one Verifier.run per step, with what a coordinator
    does on a preemption: prefill prompt + committed[:-1] again (when the budget admits it) and go on
    from committed[-1]."""

    def __init__(self, verifier: Verifier, prompts: dict[str, list[int]], n: int) -> None:
        self.v, self.prompts, self.n = verifier, prompts, n
        self.committed: dict[str, list[int]] = {}
        self.preempted: list[str] = []
        self.capacity = {s: len(p) + n + 1 for s, p in prompts.items()}

    def admit(self, seq_id: str) -> bool:
        rows = self.prompts[seq_id] + self.committed.get(seq_id, [None])[:-1]
        try:
            first = self.v.prefill(seq_id, torch.tensor(rows), GREEDY, self.capacity[seq_id]).first_token
        except KVBudgetExceeded:
            return False
        self.committed.setdefault(seq_id, [first])  # a rebuild's token is committed already
        return True

    def step(self, seq_ids: list[str]) -> None:
        """One forward: a Decode for each admitted sequence still running (a rebuild first)."""
        for s in seq_ids:
            running = len(self.committed.get(s, [])) < self.n
            if running and not self.v.has(s) and (s in self.preempted or s not in self.committed):
                self.admit(s)
        live = [s for s in seq_ids if self.v.has(s) and len(self.committed[s]) < self.n]
        calls = [DecodeCall(s, self.committed[s][-1], len(self.committed[s])) for s in live]
        for s, out in zip(live, self.v.run(calls)):
            if isinstance(out, SequencePreempted):
                self.preempted.append(s)
                assert "was preempted" in str(out) and "committed tokens" in str(out)
            else:
                assert not isinstance(out, BaseException), out
                self.committed[s].append(out)
        for s in live:
            if len(self.committed[s]) >= self.n and self.v.has(s):
                self.v.release(s)

    def done(self) -> bool:
        return all(len(self.committed.get(s, [])) >= self.n for s in self.prompts)


@pytest.mark.parametrize("kind,budget", [("contiguous", 100), ("paged", 100), ("contiguous", 60)])
def test_the_youngest_sequence_is_preempted_and_still_yields_the_targets_tokens(llama_pair, kind, budget) -> None:
    _, target, _ = llama_pair
    n = 40
    g = torch.Generator().manual_seed(5)
    prompts = {s: torch.randint(0, VOCAB, (5,), generator=g).tolist() for s in ("old", "mid", "young")}
    # each sequence needs up to 46 rows: 100 hold two of them to the end, 60 only one
    runner = ModelRunner(target, pool_of(target, kind, budget), graphs=False)
    preempted: list[str] = []
    v = Verifier(None, "none", runner=runner, growth_rows=4, on_preempt=preempted.append)
    d = Driver(v, prompts, n)
    for s in prompts:  # admitted in this order: "old" is the oldest
        assert d.admit(s)
    steps = 0
    while not d.done():
        d.step(list(prompts))
        assert runner.pool.rows_allocated <= budget
        steps += 1
        assert steps < 10 * n, "no progress"
    if budget == 100:
        assert preempted == ["young"]  # the youngest; "old" and "mid" fit together (2 x 46 rows) and go on
    else:
        assert len(preempted) >= 2 and "old" not in preempted  # the oldest is never preempted while others hold KV
    assert preempted == d.preempted and v.growth.preemptions == len(preempted)
    for s, p in prompts.items():
        assert d.committed[s][:n] == reference(target, p, n), s


def test_a_growth_preempts_before_new_prefills_of_the_same_step(llama_pair) -> None:
    """Running sequences grow first: a Prefill in the same step gets only what is left."""
    _, target, _ = llama_pair
    v = Verifier(None, "none", runner=ModelRunner(target, KVPool.for_model(target, max_rows=20)), growth_rows=2)
    v.prefill("a", torch.tensor([1, 2, 3]), GREEDY, 12)  # reserves 5
    tok = v.decode("a", 7, 1)
    tok = v.decode("a", tok, 2)  # length 5 = reserved
    out = v.run([PrefillCall("b", torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]), GREEDY, 14),
                 DecodeCall("a", tok, 3)])
    assert isinstance(out[0], KVBudgetExceeded)  # 13 + 1 rows do not fit next to a's 8
    assert isinstance(out[1], int) and v.reserved("a") == 8


def test_a_chunked_prompt_is_reserved_whole_at_its_first_chunk(llama_pair) -> None:
    """A prompt is never admitted in part: its first chunk reserves every prompt row (+ one increment)."""
    _, target, _ = llama_pair
    grown: list[int] = []
    v = Verifier(None, "none", runner=ModelRunner(target, KVPool.for_model(target, max_rows=30)), growth_rows=4,
                 on_grow=lambda s, rows: grown.append(rows))
    prompt = torch.arange(1, 11)
    v.run([PrefillCall("c", prompt[:4], GREEDY, 25, more=True, prompt_rows=10)])
    assert v.reserved("c") == 14 and v.runner.pool.rows_allocated == 14
    last = v.run([PrefillMoreCall("c", prompt[4:], last=True)])[0]
    assert not grown and v.reserved("c") == 14
    assert last.first_token == Verifier(target).prefill("w", prompt, GREEDY, 25).first_token


def test_the_growth_bench_counts_its_grows() -> None:
    """services/bench/kv_growth.py (what its timings are of): 306 -> 4161 rows by 256 is 15 grows."""
    from services.bench.kv_growth import measure

    grows, _, _, rows = measure(256, layers=1, kv_heads=1, head_dim=2)
    assert (grows, rows) == (15, 4161)
    assert measure(0, layers=1, kv_heads=1, head_dim=2)[0] == 0  # growth off: the worst case, no grow


def test_pools_grow_slots_in_place_and_refuse_past_the_budget() -> None:
    """Contiguous: reallocation keeps the rows in use. Paged: the last page's free rows first, then
    the lowest free pages; the rows in use keep their arena rows; a refusal changes nothing."""
    pool = KVPool(1, 1, 2, max_rows=10)
    slot = pool.allocate(4)
    cache = pool.cache(slot)
    cache.write(0, torch.arange(6.0).view(1, 3, 2), -torch.arange(6.0).view(1, 3, 2))
    cache.advance(3)
    pool.grow(slot, 5)
    assert pool.capacity(slot) == 9 and pool.rows_allocated == 9 and pool.length(slot) == 3
    assert torch.equal(pool.cache(slot).k[0, 0, :3], torch.arange(6.0).view(3, 2))
    with pytest.raises(KVBudgetExceeded):
        pool.grow(slot, 2)
    assert pool.capacity(slot) == 9 and pool.rows_allocated == 9

    paged = PagedKVPool(1, 1, 2, max_rows=16, page_size=4)  # pages 1..4 (0 is the trash page)
    a, b = paged.allocate(3), paged.allocate(4)  # a: page 1 (3 of its 4 rows), b: page 2
    paged.grow(a, 1)  # the free row of page 1: no new page
    assert paged.rows_of(a).tolist() == [4, 5, 6, 7]
    paged.grow(a, 3)  # page 3, the lowest free one
    assert paged.rows_of(a).tolist() == [4, 5, 6, 7, 12, 13, 14]
    with pytest.raises(KVBudgetExceeded):
        paged.grow(b, 6)  # 7 + 4 + 6 rows > 16
    assert paged.rows_of(b).tolist() == [8, 9, 10, 11] and paged.rows_allocated == 11
    paged.release(a)
    paged.grow(b, 5)  # pages 1 and 3 are free again: the lowest first
    assert paged.rows_of(b).tolist() == [8, 9, 10, 11, 4, 5, 6, 7, 12]
