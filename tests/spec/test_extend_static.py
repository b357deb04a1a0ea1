"""The static extension (services/spec/tree_static.py `extend_static`, in one graph with the expansion
through `DraftGraphs.draft`), run eagerly on the CPU: round after round, the candidates, the last row's
head output and the draft K/V of `extend` + `expand` on a contiguous cache, over scattered pages,
padded rows writing only to the trash page. The CUDA graph replaying it is checked in tests/gpu."""

import copy

import pytest
import torch

from services.engine.draft_graphs import EXTEND_WIDTHS, DraftGraphs
from services.engine.drafter import DraftCall
from services.model.eagle_head import HeadConfig, build_head
from services.model.linear import Linear
from services.model.paged_kv import PagedKVPool
from services.spec.tree import TreeParams, expand, extend
from services.spec.tree_static import draft_batch, draft_static
from tests.helpers import VOCAB
from tests.spec.test_tree_static import static_drafter

ROUNDS = (8, 1, 3, 16, 5, 2, 1, 12)  # newly committed rows per round: padded to W = 8, 1, 4, 16, 8, 2, 1, 16
PAGE = 4


def head_of(name, request):
    """EAGLE-2 (full vocabulary), EAGLE-3 (its 96-token draft vocabulary) or EAGLE-2 restricted to a
    32-token draft vocabulary of shuffled ids (a non-trivial d2t)."""
    if name == "reduced":
        head = copy.deepcopy(request.getfixturevalue("llama_pair")[2])
        head.restrict_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)), 32)
        return head
    return request.getfixturevalue(name)[2]


def scattered_pool(head, rows: int = 256):
    """A paged pool whose sequence slot's pages are not contiguous: (pool, its cache), the cache
    holding `rows` rows on pages around two other slots' pages."""
    c = head.config
    pool = PagedKVPool(1, c.num_kv_heads, c.head_dim, 4096, head.dtype, head.device, page_size=PAGE)
    pool.allocate(6)  # pages 1-2
    slot = pool.allocate(9)  # pages 3-5
    pool.allocate(3)  # page 6
    pool.grow(slot, rows - 9)  # then pages 7...
    return pool, pool.paged(slot)


def round_inputs(head, seed: int):
    g = torch.Generator().manual_seed(seed)
    for n in ROUNDS:
        feats = torch.randn(n, head.config.feature_size, generator=g).to(head.device)
        yield feats, torch.randint(0, head.config.vocab_size, (n,), generator=g).to(head.device)


def static_rounds(head, params: TreeParams, graphs: bool, seed: int = 0):
    """Every round through DraftGraphs.draft over a scattered paged cache -> (outputs, pool, cache):
    outputs[i] = (candidates, last [H], arena rows the round changed (bool [rows]))."""
    pool, cache = scattered_pool(head)
    dg = DraftGraphs(head, pool, graphs=graphs, max_keys=2048)
    outs = []
    for feats, toks in round_inputs(head, seed):
        before = pool.k.clone()
        w = dg.width_for(len(toks))
        cand, last = dg.draft(cache, feats, toks, params, w, dg.keys_for(cache, params, w))
        outs.append((cand, last, (pool.k != before).any(-1).any(1).any(0).cpu()))
    assert dg.extensions == dg.expansions == len(ROUNDS)
    return outs, pool, cache, dg


def eager_rounds(head, params: TreeParams, seed: int = 0):
    """The same rounds through `extend` + `expand` on a contiguous cache -> (outputs, cache)."""
    cache = head.new_cache(256)
    outs = []
    for feats, toks in round_inputs(head, seed):
        last = extend(head, cache, feats, toks)
        outs.append((expand(head, cache, last, params), last))
    return outs, cache


def assert_same_draft(a, b, atol: float = 1e-5) -> None:
    """Candidates and last rows of two runs: tokens and parents exactly, scores and `last` to fp32
    rounding (the GEMMs run over padded shapes)."""
    for k, ((ca, la, *_), (cb, lb, *_)) in enumerate(zip(a, b, strict=True)):
        assert ca.tokens.tolist() == cb.tokens.tolist() and ca.parents.tolist() == cb.parents.tolist(), k
        torch.testing.assert_close(ca.scores.cpu(), cb.scores.cpu(), atol=atol, rtol=1e-5)
        torch.testing.assert_close(la.cpu(), lb.cpu(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("shape", [TreeParams(4, 3, 16), TreeParams(10, 5, 60)], ids=["16/3/4", "60/5/10"])
@pytest.mark.parametrize("name", ["llama_pair", "eagle3_pair", "reduced"])
def test_static_extension_gives_extend_and_expand(name, shape, request):
    head = head_of(name, request)
    static, pool, cache, _ = static_rounds(head, shape, graphs=False)
    eager, flat = eager_rounds(head, shape)
    assert_same_draft(static, eager)
    assert cache.length == flat.length == sum(ROUNDS)
    rows = torch.from_numpy(cache.rows_host[:cache.length])
    assert not torch.equal(rows, torch.arange(rows[0], rows[0] + len(rows)))  # scattered pages
    torch.testing.assert_close(pool.k[:, :, rows], flat.k[:, :, :flat.length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.v[:, :, rows], flat.v[:, :, :flat.length], atol=1e-5, rtol=1e-5)


def test_padded_rows_write_only_the_trash_page(llama_pair):
    """Each round changes only its own new rows, its tree rows and (padded rounds only) the trash page."""
    head = llama_pair[2]
    shape = TreeParams(4, 3, 16)
    static, _, cache, _ = static_rounds(head, shape, graphs=False)
    stable = 0
    for n, (_, _, changed) in zip(ROUNDS, static, strict=True):
        own = cache.rows_host[stable:stable + n + shape.draft_rows].tolist()
        touched = set(changed.nonzero().flatten().tolist())
        assert touched - set(own) <= set(range(PAGE)), n  # page 0 is the trash page
        assert set(own) <= touched
        w = DraftGraphs.width_for(n)
        assert bool(changed[:PAGE].any()) == (w > n), (n, w)  # padding went to the trash page, and only it
        stable += n


def test_width_buckets():
    assert [DraftGraphs.width_for(n) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, None]
    assert EXTEND_WIDTHS[-1] == 16


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_drafter_keeps_the_static_last_row_for_draft_ahead(pair, request):
    """Through the drafter: trees of `draft` rounds (n <= 16: the combined static draft; 20: the eager
    extension, then the static expansion), then `draft_ahead` from the kept last row, == the eager
    drafter's."""
    from services.engine.drafter import Drafter

    head = request.getfixturevalue(pair)[2]
    tree = TreeParams(4, 3, 16)
    g = torch.Generator().manual_seed(1)
    rounds = [20, 3, 1, 6]
    calls = [(torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, head.config.feature_size, generator=g))
             for n in rounds]
    out = {}
    for name, d in (("eager", Drafter(head, tree)), ("static", static_drafter(head, tree))):
        d.start("s", 128, sampling=False)
        trees = [d.draft("s", toks, feats) for toks, feats in calls]
        trees.append(d.draft_ahead("s", torch.zeros(0, dtype=torch.long),
                                   torch.zeros(0, head.config.feature_size), [5, 9]))
        out[name] = (trees, d._last["s"])
        if name == "static":
            assert (d.graphs.expansions, d.graphs.extensions) == (4, 3)
    for a, b in zip(out["eager"][0], out["static"][0], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    torch.testing.assert_close(out["eager"][1], out["static"][1], atol=1e-5, rtol=1e-5)


def test_static_draft_reads_no_device_value_on_the_host():
    """On the meta device a tensor has no values (`.item()`, `int(t)` raise): the extension and the
    expansion run through, alone and for a batch, so a graph of them never synchronises with the GPU."""
    with pytest.raises((RuntimeError, NotImplementedError)):  # the detector works
        int(torch.zeros(3, device="meta").max())
    for kind in ("eagle", "eagle3"):
        cfg = HeadConfig(kind, 32, 64, 4, 2, 1e-6, VOCAB, draft_vocab_size=48 if kind == "eagle3" else None)
        with torch.device("meta"):
            head = build_head(cfg, Linear(32, VOCAB, bias=False) if kind == "eagle" else None)
        pool = PagedKVPool(1, 2, 8, 512, device="meta", page_size=8)
        s, w = 256, 4
        key_rows, write_rows = torch.zeros(s, dtype=torch.long, device="meta"), torch.zeros(w, dtype=torch.long,
                                                                                             device="meta")
        stable, count = torch.zeros(1, dtype=torch.long, device="meta"), torch.ones(1, dtype=torch.long, device="meta")
        feats = torch.zeros(w, cfg.feature_size, device="meta")
        toks = torch.zeros(w, dtype=torch.long, device="meta")
        cand, last = draft_static(head, pool, key_rows, write_rows, stable, count, feats, toks, 4, 3)
        assert cand.tokens.shape == (4 + 3 * 16,) and cand.parents.shape == (1 + 3 * 4,) and last.shape == (32,)
        b = 3  # a batch of sequences (draft_batch)
        cand, last = draft_batch(head, pool, key_rows.repeat(b, 1), write_rows.repeat(b, 1), stable.repeat(b),
                                 count.repeat(b), feats.repeat(b, 1, 1), toks.repeat(b, 1), 4, 3)
        assert cand.tokens.shape == (b, 4 + 3 * 16) and cand.parents.shape == (b, 1 + 3 * 4) and last.shape == (b, 32)


@pytest.mark.parametrize("pair", ["llama_pair"])
def test_a_failing_combined_graph_falls_back_to_the_eager_extension(pair, request, monkeypatch, caplog):
    """A device error in the combined draft (its graph's capture or replay, after it wrote rows) is
    logged once; the drafter rolls the cache back, drafts this round with the eager extension and the
    expansion's static code, and never tries the combined graph again: the trees stay the eager ones."""
    from services.engine.drafter import Drafter

    head = request.getfixturevalue(pair)[2]
    tree = TreeParams(4, 3, 16)
    g = torch.Generator().manual_seed(2)
    calls = [(torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, head.config.feature_size, generator=g))
             for n in (5, 2, 3)]
    eager, static = Drafter(head, tree), static_drafter(head, tree)
    real_draft, tries = static.graphs.draft, []

    def broken(cache, *args):
        tries.append(cache.length)
        real_draft(cache, *args)  # writes and advances the cache, then the device fails
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(static.graphs, "draft", broken)
    for d in (eager, static):
        d.start("s", 128, sampling=False)
    with caplog.at_level("ERROR", logger="services.engine.drafter"):
        for toks, feats in calls:
            a, b = eager.draft("s", toks, feats), static.draft("s", toks, feats)
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert tries == [0] and not static.extend_in_graph
    assert static._caches["s"].length == eager._caches["s"].length == 10
    assert sum("extends eagerly from now on" in r.getMessage() for r in caplog.records) == 1


def test_draft_graphs_stop_capturing_at_their_cap(llama_pair, monkeypatch, caplog):
    """Past `max_graphs` captured shapes (the adaptive budget's (top_k, depth) times the width and key
    buckets), new shapes run the static code eagerly, with one warning; captured ones still replay.
    (Capture itself needs CUDA: it is stood in for here.)"""
    head = llama_pair[2]
    pool, _ = scattered_pool(head)
    dg = DraftGraphs(head, pool, graphs=False, max_keys=2048, max_graphs=2)
    dg.graphs_on = True
    captured = []

    def capture(width, k, d, keys, batch=1):
        captured.append((width, k, d, keys))
        dg._graphs[(width, k, d, keys, 1)] = g = object()
        return g

    monkeypatch.setattr(dg, "_capture", capture)
    a = dg._graph(4, 10, 5, 256)
    b = dg._graph(0, 4, 3, 256)
    with caplog.at_level("WARNING", logger="services.engine.draft_graphs"):
        assert dg._graph(8, 10, 5, 256) is None and dg._graph(1, 1, 7, 512) is None
    assert dg._graph(4, 10, 5, 256) is a and dg._graph(0, 4, 3, 256) is b
    assert captured == [(4, 10, 5, 256), (0, 4, 3, 256)]
    assert sum("2 draft graphs captured: further draft shapes run eagerly" in r.getMessage()
               for r in caplog.records) == 1


def test_start_up_warm_up_runs_each_width_once_and_writes_only_the_trash_page(llama_pair):
    """DraftGraphs.warm_up (graphs off here: each shape run once eagerly, as a capture's warm-up does):
    the drafter's tree at W = 0 (the expansion alone) and every extension width, only the trash page
    written, nothing twice; later rounds draft as without it. The drafter runs it only where it has
    graphs (CUDA): on the CPU `Drafter.warm_up` and the start-up hook do nothing."""
    from services.engine.drafter import Drafter
    from services.model.runner import warm_up_at_start

    head = llama_pair[2]
    shape = TreeParams(4, 3, 16)
    pool, cache = scattered_pool(head)
    dg = DraftGraphs(head, pool, graphs=False, max_keys=2048)
    before = (pool.k.clone(), pool.v.clone())
    done = dg.warm_up(shape)
    assert (done.shapes, done.graphs, done.memory_bytes) == (1 + len(EXTEND_WIDTHS), False, 0)
    for arena, old in zip((pool.k, pool.v), before, strict=True):
        changed = (arena != old).any(-1).any(1).any(0).nonzero().flatten().tolist()
        assert changed and set(changed) <= set(range(PAGE))  # the trash page only
    assert dg.warm_up(shape).shapes == 0 and dg.warm_up(TreeParams(2, 2, 6)).shapes == 1 + len(EXTEND_WIDTHS)
    warmed = []
    for feats, toks in round_inputs(head, 0):  # the warmed drafter's rounds == a cold one's
        w = dg.width_for(len(toks))
        warmed.append(dg.draft(cache, feats, toks, shape, w, dg.keys_for(cache, shape, w)))
    assert_same_draft(warmed, static_rounds(head, shape, graphs=False)[0], atol=0)
    drafter = Drafter(head, shape)
    assert drafter.graphs is None and drafter.warm_up() is None and warm_up_at_start(drafter, 8) is None
    static = static_drafter(head, shape)
    assert static.warm_up().shapes == 1 + len(EXTEND_WIDTHS)


class ReplayedFn:
    """A CUDA graph's stand-in on the CPU: `replay()` runs the captured function again and copies its
    outputs into the first run's tensors (a graph's static outputs), so the buffers a DraftGraphs
    fills before a replay and reads after it are the ones a graph would use."""

    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(), strict=True):
            out.copy_(new)


def replayed_graphs(drafter, monkeypatch):
    """Turn `drafter`'s draft graphs on with ReplayedFn for CUDA graphs (the graph path's plumbing on the CPU)."""
    import services.engine.draft_graphs as draft_graphs

    def capture(fn, device, mempool):
        outputs = fn()
        return ReplayedFn(fn, outputs), outputs

    monkeypatch.setattr(draft_graphs, "capture_graph", capture)
    drafter.graphs.graphs_on = True


def test_start_up_warm_up_prepares_the_batched_drafts_too(llama_pair, monkeypatch):
    """Where the start-up hook allows batches (max_sequences > 1) the warm-up also prepares the batched
    drafts of the drafter's tree (DraftGraphs.draft_batch) for every batch bucket up to the one that
    holds max_sequences, at every extension width: graphs off, each run once eagerly, only the trash
    page written, nothing twice; with graphs (a capture stood in for: ReplayedFn) captured then, so
    that a later batch of that shape captures nothing, and its trees are those of a drafter that
    captured on first use."""
    head = llama_pair[2]
    shape = TreeParams(4, 3, 16)
    pool, _ = scattered_pool(head)
    dg = DraftGraphs(head, pool, graphs=False, max_keys=2048)
    before = (pool.k.clone(), pool.v.clone())
    assert dg.warm_up(shape, max_batch=3).shapes == 1 + len(EXTEND_WIDTHS) + 2 * len(EXTEND_WIDTHS)  # B 2, 4
    for arena, old in zip((pool.k, pool.v), before, strict=True):
        changed = (arena != old).any(-1).any(1).any(0).nonzero().flatten().tolist()
        assert changed and set(changed) <= set(range(PAGE))  # the trash page only
    assert dg.warm_up(shape, max_batch=4).shapes == 0
    assert dg.warm_up(shape, max_batch=64).shapes == 2 * len(EXTEND_WIDTHS)  # B 8 and 16
    warmed, cold = static_drafter(head, shape), static_drafter(head, shape)
    for d in (warmed, cold):
        replayed_graphs(d, monkeypatch)
    assert warmed.warm_up(8).shapes == 1 + len(EXTEND_WIDTHS) + 3 * len(EXTEND_WIDTHS)
    captured = warmed.graphs.captures
    draft_three_together(warmed, cold, shape)
    assert warmed.graphs.captures == captured and cold.graphs.captures > 0  # the warm-up's graphs replayed


def draft_three_together(warmed, cold, shape: TreeParams) -> None:
    """Three sequences drafted together (one batch a round, 1-4 new rows each: batch bucket 4) by a
    warmed-up drafter and a cold one, three rounds: the same trees (the CUDA test runs this too,
    tests/gpu/test_cuda.py)."""
    g = torch.Generator().manual_seed(6)
    f = warmed.head.config.feature_size
    for d in (warmed, cold):
        for i in range(3):
            d.start(f"s{i}", 64, sampling=False)
    for r in range(3):
        calls = [DraftCall(f"s{i}", torch.randint(0, VOCAB, (1 + (i + r) % 4,), generator=g),
                           torch.randn(1 + (i + r) % 4, f, generator=g).to(warmed.head.dtype), shape)
                 for i in range(3)]  # (on the host, as the drafter service decodes them)
        got, want = warmed.draft_many(calls), cold.draft_many(copy.deepcopy(calls))
        for a, b in zip(got, want, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert warmed.graphs.batched == cold.graphs.batched == 9


@pytest.mark.parametrize("graphs", ["static", "replayed"])
@pytest.mark.parametrize("name", ["llama_pair", "eagle3_pair"])
def test_a_batch_of_sequences_drafts_each_one_s_own_draft(name, graphs, request, monkeypatch):
    """Drafter.draft_many over several paged sequences drafts those of one top_k and depth together
    (DraftGraphs.draft_batch: one head step a level for the batch, padded to a batch bucket with idle
    rows, each sequence attending only to its own keys; a shape alone in the batch: its own graph;
    more than 16 new rows: the eager batch): round after round, every tree (tokens, parents, depths;
    each its own size and stop) and every sequence's draft K/V equal those of drafting each sequence
    alone, and no other slot's rows change."""
    head = head_of(name, request)
    shapes = [TreeParams(4, 3, 16), TreeParams(4, 3, 10), TreeParams(4, 3, 16, stop_logprob=-3.0),
              TreeParams(4, 3, 12), TreeParams(4, 3, 16), TreeParams(2, 2, 6), TreeParams(2, 2, 7)]
    together, alone = static_drafter(head, TreeParams(4, 3, 16)), static_drafter(head, TreeParams(4, 3, 16))
    if graphs == "replayed":  # the graph path's buffers (a CUDA graph's replay stood in for: ReplayedFn)
        replayed_graphs(together, monkeypatch)
    bystander = together.pool.allocate(40)  # another slot's rows: never written by the batch
    together.pool.k[:, :, together.pool.cache(bystander).rows_host[:40]] = 7.0
    ids = [f"s{i}" for i in range(len(shapes))]
    for d in (together, alone):
        for i, seq in enumerate(ids):
            d.start(seq, 256, sampling=i == 1)
    g = torch.Generator().manual_seed(4)
    f = head.config.feature_size
    for r in range(6):
        calls = []
        for i, seq in enumerate(ids):
            n = int(torch.randint(1, 17, (1,), generator=g)) if r == 0 else 1 + (i + r) % 4
            n = 20 if (r, i) == (3, 1) else n  # past the widest extension: eager
            calls.append(DraftCall(seq, torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, f, generator=g),
                                   shapes[i]))
        # 2 to 5 sequences of 4/3 (batch buckets 2, 4 and 8: idle rows padded), then the 2/2 ones: two
        # together, one alone, or none
        batch = calls[: 2 + r % 4] + calls[5: 5 + r % 3]
        got = together.draft_many(batch)
        want = [alone.draft(c.seq_id, c.tokens, c.features, c.params) for c in batch]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), (r, i)
            assert a.depths.tolist() == b.depths.tolist(), (r, i)
    # batched: every 4/3 call but the eager one (round 3's second), and the 2/2 pairs (rounds 2 and 5)
    assert together.graphs.batched == sum(2 + r % 4 for r in range(6)) - 1 + 2 * 2 and alone.graphs.batched == 0
    for seq in ids:
        ca, cb = together._caches[seq], alone._caches[seq]
        assert ca.length == cb.length
        ra, rb = torch.from_numpy(ca.rows_host[:ca.length]), torch.from_numpy(cb.rows_host[:cb.length])
        torch.testing.assert_close(together.pool.k[:, :, ra], alone.pool.k[:, :, rb], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together.pool.v[:, :, ra], alone.pool.v[:, :, rb], atol=1e-5, rtol=1e-5)
    assert (together.pool.k[:, :, together.pool.cache(bystander).rows_host[:40]] == 7.0).all()
    batch_graphs = [key for key in together.graphs._graphs if key[4] > 1]  # (W, top_k, depth, S, B)
    assert bool(batch_graphs) == (graphs == "replayed") and together.graphs.captures == len(together.graphs._graphs)


def test_a_failing_batched_draft_graph_falls_back_to_the_eager_batch(llama_pair, monkeypatch, caplog):
    """A device error in the batched draft (after it wrote rows and advanced the caches) is logged
    once; the drafter rolls the caches back, drafts that batch eagerly, and drafts batches eagerly
    from then on (one sequence alone keeps its graph): the trees stay each sequence's own."""
    head = llama_pair[2]
    tree = TreeParams(4, 3, 16)
    together, alone = static_drafter(head, tree), static_drafter(head, tree)
    real, tries = together.graphs.draft_batch, []

    def broken(caches, *args):
        tries.append([c.length for c in caches])
        real(caches, *args)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(together.graphs, "draft_batch", broken)
    ids = ["a", "b", "c"]
    for d in (together, alone):
        for seq in ids:
            d.start(seq, 128, sampling=False)
    g = torch.Generator().manual_seed(6)
    f = head.config.feature_size
    with caplog.at_level("ERROR", logger="services.engine.drafter"):
        for n in (5, 2, 3):
            calls = [DraftCall(seq, torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, f, generator=g), tree)
                     for seq in ids]
            got = together.draft_many(calls)
            want = [alone.draft(c.seq_id, c.tokens, c.features, c.params) for c in calls]
            for a, b in zip(got, want, strict=True):
                assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), n
    assert tries == [[0, 0, 0]] and not together.batch_in_graph and together.extend_in_graph
    assert [together._caches[s].length for s in ids] == [alone._caches[s].length for s in ids] == [10] * 3
    assert sum("drafts batches eagerly from now on" in r.getMessage() for r in caplog.records) == 1
