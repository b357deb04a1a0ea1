"""Continuous batching is lossless: any batch composition gives each sequence the tokens it gets at
batch 1 (fp32; greedy and seeded sampling), with sequences joining and leaving mid-batch, different
prompt lengths, tree shapes (plain decoding included) and sampling parameters. Real tiny models, real
threads; the batches really hold several sequences (asserted)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.engine.batched import BatchedDrafter, BatchedVerifier
from services.engine.batcher import BatchLimits
from services.engine.drafter import DraftCall, Drafter
from services.engine.engine import Engine, GenerationRequest, fixed_budget
from services.engine.verifier import DecodeCall, PrefillCall, Verifier, VerifyCall
from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.kv_pool import KVPool
from services.model.runner import ModelRunner
from services.spec.acceptance import prior_stats
from services.spec.budget import Budget
from services.spec.cost import CostCurve, CostModel
from services.spec.load_board import LoadBoard
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from dataclasses import replace
from tests.spec.test_tree_static import static_drafter
from tests.helpers import VOCAB

LARGEST = TreeParams(6, 4, 24)
# None = plain decoding; "auto" = the load-adaptive budget (a load board shared by its sequences)
SHAPES = [LARGEST, TreeParams(3, 2, 8), TreeParams(1, 5, 6), None, "auto"]
ROWS = (1, 2, 4, 8, 16, 32, 64)
# synthetic costs: a forward's fixed cost plus a per-row cost, so the load changes the choice
COSTS = CostModel(CostCurve(ROWS, tuple(1 + 0.08 * (r - 1) for r in ROWS)), CostCurve((1, 16), (0.02, 0.05)),
                  CostCurve((1, 16), (0.03, 0.2)))
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(),
             SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3)]


def engines(verifier, drafter, board: LoadBoard | None = None) -> list[Engine]:
    """One Engine per tree shape over the same verifier and drafter (None: plain decoding)."""
    out = []
    for shape in SHAPES:
        if shape is None:
            out.append(Engine(verifier, None, 512, VOCAB))
        elif shape == "auto":
            out.append(Engine(verifier, drafter, 512, VOCAB, budget=Budget(
                COSTS, prior_stats({"top1_agreement": 0.5}), largest=LARGEST, probe_every=3, load=board)))
        else:
            out.append(Engine(verifier, drafter, 512, VOCAB,
                              budget=replace(fixed_budget(drafter), largest=LARGEST, fixed=shape)))
    return out


def workload(n: int) -> list[tuple[int, GenerationRequest]]:
    """(engine index, request): prompt lengths 2..14, lengths 6..40 (sequences leave at different
    rounds), every shape with greedy and sampling."""
    g = torch.Generator().manual_seed(42)
    jobs = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (2 + (5 * i) % 13,), generator=g).tolist()
        jobs.append((i % len(SHAPES), GenerationRequest(tuple(prompt), 6 + (11 * i) % 35,
                                                        SAMPLINGS[(i // len(SHAPES)) % len(SAMPLINGS)])))
    return jobs


def generate(engine: Engine, req: GenerationRequest) -> list[int]:
    return [t for step in engine.generate(req) for t in step.tokens]


@pytest.mark.parametrize("drafts", ["eager", "static"])
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_any_batch_composition_gives_the_batch1_tokens(pair, drafts, request) -> None:
    """Concurrent sequences of every shape, greedy and sampling, through batched verifier and drafter
    calls give each sequence's batch-1 tokens; `static`: the drafter's paged arena and static draft
    (the GPU's), whose batches of one shape draft together (DraftGraphs.draft_batch; whether a batch
    holds two of one shape depends on the threads: tests/spec/test_extend_static.py forces it)."""
    _, target, head = request.getfixturevalue(pair)
    jobs = workload(15)
    solo = engines(Verifier(target, head.feature_kind), Drafter(head, LARGEST), LoadBoard())
    expected = [generate(solo[e], req) for e, req in jobs]

    sizes: list[int] = []
    verifier = Verifier(target, head.feature_kind)
    run_alone, held = verifier.run, threading.Event()

    def run_first_held(calls):
        """The first forward waits until 3 other sequences' calls queue behind it, so the next
        forward serves at least 3 sequences however the threads are scheduled."""
        if not held.is_set():
            held.set()
            deadline = time.monotonic() + 60
            while bv.batcher.waiting < 3:
                assert time.monotonic() < deadline, "3 sequences never queued behind the first forward"
                time.sleep(0.001)
        return run_alone(calls)

    verifier.run = run_first_held
    bv = BatchedVerifier(verifier, BatchLimits(max_batch=8, max_rows=200), on_batch=lambda s: sizes.append(s.size))
    drafter = static_drafter(head, LARGEST) if drafts == "static" else Drafter(head, LARGEST)
    bd = BatchedDrafter(drafter, BatchLimits(max_batch=8))
    board = LoadBoard()
    batched = engines(bv, bd, board)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        time.sleep(0.01 * (i % 5))  # join at different moments (mid-batch); nothing asserted depends on it
        try:
            e, req = jobs[i]
            got[i] = generate(batched[e], req)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bv.close()
    bd.close()
    assert not errors, errors
    for i, (e, req) in enumerate(jobs):
        assert got[i] == expected[i], f"job {i} (shape {SHAPES[e]}, {req.sampling})"
    assert max(sizes) >= 3, sizes  # forwards really served several sequences (made so by the held first forward)
    assert bv.num_sequences == 0 and bd.num_sequences == 0  # every sequence left
    assert board.rows() == {}


def test_one_verifier_run_serves_mixed_calls_and_bad_ones_fail_alone(llama_pair) -> None:
    """A prefill, a decode, a tree and four bad calls in one run: the good ones get what they get
    alone; each bad one gets its own precise error; the pool admits nothing partially."""
    _, target, head = llama_pair
    pool = KVPool.for_model(target, max_rows=100)
    v = Verifier(target, "hidden", runner=ModelRunner(target, pool))
    ref = Verifier(target, "hidden")
    drafter, ref_drafter = Drafter(head, LARGEST), Drafter(head, LARGEST)
    p1, p2, p3 = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10]), torch.tensor([11, 12, 13])
    for ver in (v, ref):
        ver.prefill("a", p1, SamplingParams(), 40)
        ver.prefill("b", p2, SamplingParams(temperature=0.9, seed=1), 40)
    v.prefill("x", p2, SamplingParams(), 5)
    first = ref.prefill("tmp", p1, SamplingParams(), 40)  # "a"'s first token and features
    drafter.start("a", 40, False)
    tree = drafter.draft("a", torch.cat([p1[1:], torch.tensor([first.first_token])]), first.features)

    calls = [VerifyCall("a", tree, 1), PrefillCall("c", p3, SamplingParams(), 15),
             DecodeCall("nope", 3, 1), PrefillCall("d", p3, SamplingParams(), 500),  # KV budget
             DecodeCall("b", 4, 1), PrefillCall("x", p3, SamplingParams(), 10),  # exists
             VerifyCall("b", tree, 2)]  # "b" twice in one batch
    out = v.run(calls)
    want_a = ref.verify("a", tree, 1)
    assert out[0].acceptance.new_tokens == want_a.acceptance.new_tokens
    torch.testing.assert_close(out[0].features, want_a.features, rtol=1e-5, atol=1e-5)
    assert out[1].first_token == ref.prefill("c", p3, SamplingParams(), 15).first_token
    assert isinstance(out[2], SequenceNotFound) and "'nope'" in str(out[2])
    assert isinstance(out[3], CapacityExceeded) and "KV budget of 100 rows" in str(out[3])
    assert out[4] == ref.decode("b", 4, 1)
    assert isinstance(out[5], InvalidRequest) and "already exists" in str(out[5])
    assert isinstance(out[6], InvalidRequest) and "two calls in one batch" in str(out[6])
    assert pool.rows_allocated == 40 + 40 + 5 + 15 and v.num_sequences == 4
    del ref_drafter


def test_draft_many_grows_each_tree_as_alone(eagle3_pair) -> None:
    """One head step per level for several sequences with different shapes, committed lengths and
    path orders gives each the tree it gets alone (same tokens, parents, order)."""
    _, target, head = eagle3_pair
    g = torch.Generator().manual_seed(3)
    shapes = [TreeParams(6, 4, 24), TreeParams(2, 1, 3), TreeParams(4, 3, 16), TreeParams(1, 4, 5)]
    calls, solo = [], Drafter(head, LARGEST)
    batch = Drafter(head, LARGEST)
    for i, shape in enumerate(shapes):
        n = 3 + 4 * i
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        feats = target(ids, target.new_cache(n), want_taps=True).taps
        for d in (solo, batch):
            d.start(f"s{i}", 64, sampling=i % 2 == 1)
        calls.append(DraftCall(f"s{i}", ids, feats, shape))
    calls.append(DraftCall("missing", calls[0].tokens, calls[0].features, None))
    batch.start("tiny", 2, sampling=False)  # its draft KV cannot take 3 rows and a tree
    calls.append(DraftCall("tiny", calls[0].tokens, calls[0].features, None))
    trees = batch.draft_many(calls)
    assert isinstance(trees[-1], CapacityExceeded) and "'tiny'" in str(trees[-1])
    trees = trees[:-1]
    for call, tree in zip(calls[:-2], trees):
        alone = solo.draft(call.seq_id, call.tokens, call.features, call.params)
        assert tree.tokens.tolist() == alone.tokens.tolist()
        assert tree.parents.tolist() == alone.parents.tolist()
        assert torch.equal(tree.paths, alone.paths)
    assert isinstance(trees[-1], SequenceNotFound)


def test_chunked_prefill_in_the_verifier(llama_pair) -> None:
    """PrefillCall(more=True) + PrefillMoreCalls give the first token and features of one forward;
    a decode of a sequence still being prefilled fails alone; chunks share forwards with others."""
    from services.engine.verifier import PrefillMoreCall

    _, target, _ = llama_pair
    prompt = torch.tensor([7, 3, 99, 12, 5, 5, 61, 2, 9, 40, 17])
    whole = Verifier(target, "hidden").prefill("w", prompt, SamplingParams(temperature=0.7, seed=3), 30)
    v = Verifier(target, "hidden")
    other = v.prefill("o", torch.tensor([1, 2]), SamplingParams(), 10).first_token
    out = v.run([PrefillCall("c", prompt[:4], SamplingParams(temperature=0.7, seed=3), 30, more=True),
                 DecodeCall("o", other, 1)])
    assert out[0].first_token == -1 and isinstance(out[1], int)
    mid = v.run([PrefillMoreCall("c", prompt[4:8], last=False)])
    bad = v.run([DecodeCall("c", 5, 1), DecodeCall("o", out[1], 2)])
    assert isinstance(bad[0], InvalidRequest) and "still being prefilled" in str(bad[0])
    assert isinstance(bad[1], int)
    last = v.run([PrefillMoreCall("c", prompt[8:], last=True)])[0]
    assert last.first_token == whole.first_token
    torch.testing.assert_close(torch.cat([out[0].features, mid[0].features, last.features]), whole.features,
                               rtol=1e-5, atol=1e-5)
    assert isinstance(v.run([PrefillMoreCall("c", prompt[:1], last=True)])[0], InvalidRequest)
