"""Trees left on the device between draft and verify (services/spec/tree.py TreeOnDevice, tree_static
.rerank_static, Engine.device_trees): the device re-rank is `rerank` node for node (ties and dynamic
depth included), and through the engine, on the CPU's paged arenas (the static code a CUDA graph
replays, run eagerly), the tokens, trees and acceptance equal those of host trees and of plain
decoding; the engine leaves a tree on the device only where nothing changes it before the verify.
(The GPU test of the same path without a host synchronisation is in tests/gpu/test_cuda.py.)"""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.model.paged_kv import PagedKVPool
from services.model.runner import ModelRunner
from services.spec.sampling import SamplingParams
from services.spec.tree import Candidates, DraftTree, TreeOnDevice, TreeParams, rerank
from services.spec.tree_static import rerank_static
from tests.helpers import VOCAB
from tests.spec.test_extend_static import replayed_graphs
from tests.spec.test_tree_static import SHAPES, static_drafter


def candidates(k: int, d: int, g: torch.Generator, ties: bool) -> Candidates:
    """Candidates of a K/D expansion in the reference's flat order (each level's K survivors the best
    K of the K x K children): cumulative scores fall along every branch; `ties`: equal score steps
    (many exactly tied scores, a first level at exactly 0)."""
    prev = [0.0] * k if ties else (-torch.rand(k, generator=g)).tolist()
    scores, parents, block_start, total = list(prev), [0], 0, k
    sel = list(range(k))
    for _ in range(d):
        parents += [1 + block_start + s for s in sel]
        step = [0.5] * (k * k) if ties else torch.rand(k * k, generator=g).tolist()
        cu = [prev[j // k] - step[j] for j in range(k * k)]
        scores += cu
        sel = sorted(range(k * k), key=lambda t: -cu[t])[:k]
        prev = [cu[t] for t in sel]
        block_start, total = total, total + k * k
    return Candidates(torch.tensor(scores), torch.randint(0, 50, (len(scores),), generator=g), torch.tensor(parents))


def test_rerank_static_is_rerank_node_for_node():
    """Over random shapes, sizes (up to more than the candidates), tied scores and stops: the device
    tree's first host-size nodes are rerank's tokens, depths and mask; the rest only pad it (they
    see no node of the real tree but the root); its size is fixed by the shape alone."""
    g = torch.Generator().manual_seed(0)
    padded = 0
    for trial in range(300):
        k, d = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        c = k + d * k * k
        size = int(torch.randint(2, c + 2, (1,), generator=g))
        stop = -float(torch.rand(1, generator=g)) * 4 if trial % 2 else float("-inf")
        params = TreeParams(k, d, size, stop_logprob=stop)
        cand = candidates(k, d, g, ties=trial % 3 == 0)
        host = rerank(cand, 7, params, False)
        st = rerank_static(cand, 7, params)
        tokens, depths, mask = st.tokens, st.depths, st.mask
        n = host.size
        assert tokens.shape[0] == min(size - 1, c) + 1, trial
        assert tokens[:n].tolist() == host.tokens.tolist(), trial
        assert depths[:n].tolist() == host.depths.tolist(), trial
        assert torch.equal(mask[:n, :n], host.mask) and not mask[:n, n:].any(), trial
        assert (mask[n:, 1:n].sum() == 0) and bool(mask[n:, 0].all()), trial  # padding: the root and itself
        assert st.real.tolist() == [True] * n + [False] * (tokens.shape[0] - n), trial
        assert st.parents[1:n].tolist() == host.parents[1:].tolist() and int(st.parents[0]) == 0, trial
        padded += tokens.shape[0] > n
    assert padded > 20  # the stop cut trees short, and the padding was checked


def test_rerank_static_small_example():
    """A K=2, D=2, size-6 draft worked by hand: rerank's nodes (its root's parent -1 is 0 here)."""
    cand = Candidates(scores=torch.tensor([-0.1, -0.5, -0.3, -0.9, -0.6, -1.2, -0.7, -1.0, -1.5, -2.0]),
                      tokens=torch.tensor([18, 0, 24, 16, 3, 9, 24, 5, 7, 8]), parents=torch.tensor([0, 1, 2, 3, 5]))
    host = rerank(cand, 16, TreeParams(2, 2, 6), False)
    st = rerank_static(cand, 16, TreeParams(2, 2, 6))
    # the best 5 by flat index: 0 (18, -0.1), 1 (0, -0.5), 2 (24 under 18, -0.3), 4 (3 under 0, -0.6),
    # 6 (24 under flat 2, -0.7)
    assert st.tokens.tolist() == host.tokens.tolist() == [16, 18, 0, 24, 3, 24]
    assert st.depths.tolist() == host.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert st.parents.tolist() == [0, 0, 0, 1, 2, 3] == [0, *host.parents.tolist()[1:]]
    assert torch.equal(st.mask, host.mask)


def paged_verifier(target, kind: str) -> Verifier:
    """A verifier whose KV is paged and whose steps run the static-shape forward (eagerly): what the
    GPU runs from graphs, so that it takes trees on the device."""
    return Verifier(None, kind, runner=ModelRunner(target, PagedKVPool.for_model(target, 4096), graphs=False))


def counting(drafter: Drafter) -> dict[str, int]:
    """Count the trees `drafter` returns on the device ("device": TreeOnDevice), on the host, queued
    from verdicts ("verdict") and the verdicts' rows kept ("commit")."""
    n = {"device": 0, "host": 0, "verdict": 0, "commit": 0}

    def wrap(name):
        original = getattr(drafter, name)

        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            if name == "draft_from_verdict":
                n["verdict"] += out is not None
            elif name == "commit":
                n["commit"] += 1
            else:
                n["device" if isinstance(out, TreeOnDevice) else "host"] += 1
            return out

        setattr(drafter, name, wrapped)

    for name in ("draft_on_device", "draft", "draft_from_verdict", "commit"):
        wrap(name)
    return n


def run(engine, prompt, n, **kw):
    tokens, stats = [], []
    for out in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += out.tokens
        stats.append((out.stats.accept_length, out.stats.tree_size, out.stats.tree_max_depth, out.stats.eagle_nodes))
    return tokens, stats


@pytest.mark.parametrize("graphs", ["static", "replayed"])
@pytest.mark.parametrize("shape", ["60/5/10", "16/3/4", "chain 8/7/1", "60/5/10 stop -3"])
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_device_trees_give_the_host_trees_tokens_and_rounds(pair, shape, graphs, request, monkeypatch):
    """Greedy through the engine: trees on the device, with and without drafts queued from verdicts
    == host trees (tokens, every round's accept length, tree size and depth) == plain decoding; each
    path really served the rounds (a fixed tree: every round after the first from a verdict).
    `replayed`: the draft graphs' buffers as a graph uses them (ReplayedFn)."""
    _, target, head = request.getfixturevalue(pair)
    base = shape.split(" stop ")[0]
    params = SHAPES[base] if "stop" not in shape else TreeParams(
        SHAPES[base].top_k, SHAPES[base].depth, SHAPES[base].size, stop_logprob=float(shape.split(" stop ")[1]))
    prompt = [5, 17, 99, 3, 42, 8]
    out = {}
    for mode in ("verdicts", "device", "host"):
        drafter = static_drafter(head, params)
        if graphs == "replayed":
            replayed_graphs(drafter, monkeypatch)
        used = counting(drafter)
        engine = Engine(paged_verifier(target, head.feature_kind), drafter, 512, VOCAB,
                        device_trees=mode != "host", verdict_drafts=mode == "verdicts")
        assert (engine.device_trees, engine.verdict_drafts) == (mode != "host", mode == "verdicts")
        out[mode] = run(engine, prompt, 40)
        rounds = len(out[mode][1]) - 1  # (the prefill's output is not a round)
        if mode == "verdicts":  # the prefill's draft on the device, then from each verdict but the last
            assert used["device"] == 1 and used["verdict"] >= rounds - 1 and used["commit"] == rounds - 1, used
        elif mode == "device":
            assert used["device"] == rounds and used["verdict"] == used["host"] == 0, used
        else:
            assert used["host"] == rounds and used["device"] == used["verdict"] == 0, used
    plain = Engine(paged_verifier(target, "none"), None, 512, VOCAB)
    assert out["verdicts"] == out["device"] == out["host"]
    assert out["host"][0] == run(plain, prompt, 40)[0]
    assert max(s[0] for s in out["host"][1]) > 1  # drafts were accepted (the head drafts well)


def test_device_trees_sample_the_same_seeded_tokens_and_penalise_alike(llama_pair):
    """Seeded sampling (the same trees, draws and acceptance) and a repetition penalty give the same
    tokens with trees on the device and on the host."""
    _, target, head = llama_pair
    prompt = [9, 4, 77, 31]
    for sampling in (SamplingParams(temperature=0.8, seed=3), SamplingParams(repetition_penalty=1.3),
                     SamplingParams(temperature=1.0, top_p=0.9, seed=11, repetition_penalty=1.2)):
        got = []
        for on in (True, False):
            engine = Engine(paged_verifier(target, head.feature_kind), static_drafter(head, SHAPES["16/3/4"]),
                            512, VOCAB, device_trees=on)
            got.append(run(engine, prompt, 30, sampling=sampling))
        assert got[0] == got[1], sampling


def test_the_engine_leaves_trees_on_the_device_only_where_both_roles_can(llama_pair):
    """device_trees: on by default for a static drafter and a paged verifier on one device; off for a
    contiguous verifier, an eager drafter, or when asked; a retrieved chain merged into the tree (host
    work before the verify) keeps that round's tree on the host, with the same tokens."""
    _, target, head = llama_pair
    tree = SHAPES["16/3/4"]
    assert Engine(paged_verifier(target, "hidden"), static_drafter(head, tree), 512, VOCAB).device_trees
    assert not Engine(Verifier(target, "hidden"), static_drafter(head, tree), 512, VOCAB).device_trees
    assert not Engine(paged_verifier(target, "hidden"), Drafter(head, tree), 512, VOCAB).device_trees
    assert not Engine(paged_verifier(target, "hidden"), static_drafter(head, tree), 512, VOCAB,
                      device_trees=False).device_trees
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # repeats: retrieval proposes chains
    got = []
    for on in (True, False):
        drafter = static_drafter(head, tree)
        used = counting(drafter)
        engine = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB, retrieval=True, device_trees=on)
        got.append(run(engine, prompt, 30))
        if on:  # rounds with a chain drafted on the host, the others on the device
            assert used["host"] > 0 and used["device"] > 0, used
    assert got[0] == got[1]


def test_a_device_tree_resolves_its_host_tree_once(llama_pair):
    """TreeOnDevice.host(): the drafter's host tree, computed once; its size may be below the device
    size (dynamic depth) and never above."""
    _, _, head = llama_pair
    params = TreeParams(10, 5, 60, stop_logprob=-1.0)
    drafter = static_drafter(head, params)
    drafter.start("s", 128, sampling=False)
    g = torch.Generator().manual_seed(2)
    tree = drafter.draft_on_device("s", torch.randint(0, VOCAB, (6,), generator=g),
                                   torch.randn(6, head.config.feature_size, generator=g))
    assert isinstance(tree, TreeOnDevice) and tree.size == 60
    host = tree.host()
    assert isinstance(host, DraftTree) and host is tree.host() and 2 <= host.size <= tree.size
    assert tree.tokens[:host.size].tolist() == host.tokens.tolist()


def test_next_rows_on_device_are_the_host_walk_s_verdict():
    """Greedy acceptance on the device (next_rows_on_device) == accept_greedy_argmax on the host tree:
    the rows are the accepted tokens then the bonus, the nodes the accepted path, over random trees
    (dynamic depth's padding too) and argmaxes that follow the tree for a while."""
    from services.spec.verify import accept_greedy_argmax, next_rows_on_device

    g = torch.Generator().manual_seed(5)
    lengths = set()
    for trial in range(200):
        k, d = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        size = int(torch.randint(2, k + d * k * k + 2, (1,), generator=g))
        stop = -float(torch.rand(1, generator=g)) * 3 if trial % 2 else float("-inf")
        params = TreeParams(k, d, size, stop_logprob=stop)
        cand = candidates(k, d, g, ties=False)
        cand = Candidates(cand.scores, torch.randperm(cand.tokens.numel(), generator=g) % 60, cand.parents)
        host = rerank(cand, 7, params, False)
        if len(set(zip(host.parents.tolist(), host.tokens.tolist()))) < host.size:
            continue  # (siblings with one token: never from a top-k; the random tokens made one)
        st = rerank_static(cand, 7, params)
        argmax = torch.randint(0, 60, (st.tokens.shape[0],), generator=g)
        follow = int(torch.randint(0, d + 2, (1,), generator=g))  # make the target agree along a path
        node = 0
        for _ in range(follow):
            kids = [i for i in range(host.size) if int(host.parents[i]) == node and i]
            if not kids:
                break
            nxt = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            argmax[node] = host.tokens[nxt]
            node = nxt
        width = d + 2
        acc = accept_greedy_argmax(host, argmax)
        rows = next_rows_on_device(st, argmax, width)
        n = int(rows.count)
        assert n == acc.accepted + 1 and rows.tokens[:n].tolist() == acc.new_tokens, trial
        assert rows.nodes[:n].tolist() == acc.nodes.tolist() and not rows.tokens[n:].any(), trial
        lengths.add(n)
    assert len(lengths) >= 4  # short and long accepts alike


def test_a_verdict_read_otherwise_on_the_host_is_dropped(llama_pair, monkeypatch):
    """A draft queued from a wrong device verdict (sabotaged rows) is never committed: the next tree is
    drafted after the host's verdict, and tokens and rounds equal the host trees'."""
    import services.engine.engine as engine_module
    from services.spec.verify import NextRows, next_rows_on_device

    def wrong(tree, argmax, width):
        rows = next_rows_on_device(tree, argmax, width)
        return NextRows((rows.tokens + 1) % VOCAB, rows.nodes, rows.count)

    _, target, head = llama_pair
    prompt = [3, 1, 4, 1, 5]
    want = run(Engine(paged_verifier(target, "hidden"), static_drafter(head, SHAPES["16/3/4"]), 512, VOCAB,
                      device_trees=False), prompt, 30)
    monkeypatch.setattr(engine_module, "next_rows_on_device", wrong)
    drafter = static_drafter(head, SHAPES["16/3/4"])
    used = counting(drafter)
    engine = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB)
    assert engine.verdict_drafts
    assert run(engine, prompt, 30) == want
    assert used["verdict"] > 5 and used["commit"] == 0 and used["device"] == len(want[1]) - 1
    assert not engine._verdicts  # nothing left queued after the sequence


def test_sampling_and_penalised_sequences_draft_after_the_verdict(llama_pair):
    """Verdict drafts are greedy-only (the device walk is the greedy rule): a sampling or penalised
    sequence drafts after each verdict (still on the device), with the tokens of host trees."""
    _, target, head = llama_pair
    for sampling in (SamplingParams(temperature=0.8, seed=3), SamplingParams(repetition_penalty=1.3)):
        drafter = static_drafter(head, SHAPES["16/3/4"])
        used = counting(drafter)
        engine = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB)
        got = run(engine, [9, 4, 77], 24, sampling=sampling)
        assert used["verdict"] == 0 and used["device"] == len(got[1]) - 1
        host = Engine(paged_verifier(target, "hidden"), static_drafter(head, SHAPES["16/3/4"]), 512, VOCAB,
                      device_trees=False)
        assert got == run(host, [9, 4, 77], 24, sampling=sampling)


@pytest.mark.parametrize("graphs", ["static", "replayed"])
def test_the_adaptive_budget_drafts_from_verdicts_with_the_same_rounds(llama_pair, graphs, monkeypatch):
    """The adaptive budget (a GPU-like cost model: a 64-row verify costs 2.3 one-row steps) plans
    after each verdict: with verdict drafts its rounds (every round's accept length, tree size and
    depth) and tokens equal those of trees drafted after the verdict, on the device and on the host,
    and plain decoding's tokens; the queued drafts served rounds, and none was read otherwise.
    `replayed`: the draft graphs' buffers as a graph uses them (tests/spec/test_extend_static.py ReplayedFn)."""
    from services.spec.acceptance import prior_stats
    from services.spec.budget import AUTO_LARGEST, Budget
    from services.spec.cost import CostCurve, CostModel

    _, target, head = llama_pair
    rows = (1, 2, 4, 8, 16, 32, 64)
    costs = CostModel(CostCurve(rows, tuple(1 + 0.02 * (r - 1) for r in rows)), CostCurve((1, 16), (0.05, 0.06)),
                      CostCurve((1, 16), (0.05, 0.07)))
    budget = Budget(costs, prior_stats({"top1_agreement": 0.6}), largest=AUTO_LARGEST)
    prompt = [5, 17, 99, 3, 42, 8]
    out, engines = {}, {}
    for mode in ("verdicts", "device", "host"):
        drafter = static_drafter(head, AUTO_LARGEST)
        if graphs == "replayed":
            replayed_graphs(drafter, monkeypatch)
        used = counting(drafter)
        engine = engines[mode] = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB, budget=budget,
                                        device_trees=mode != "host", verdict_drafts=mode == "verdicts")
        assert (engine.device_trees, engine.verdict_drafts) == (mode != "host", mode == "verdicts")
        out[mode] = run(engine, prompt, 48)
        if mode == "verdicts":
            counts = engine.verdict_counts
            assert used["verdict"] > 5 and used["commit"] == sum(counts.values()) and not counts["dropped"], counts
            assert counts["kept"] + counts["reranked"] + counts["expanded"] > 5, counts
    assert out["verdicts"] == out["device"] == out["host"]
    assert out["host"][0] == run(Engine(paged_verifier(target, "none"), None, 512, VOCAB), prompt, 48)[0]
    assert max(s[0] for s in out["host"][1]) > 2  # the budget drafted, and drafts were accepted


def test_a_plan_of_another_shape_re_ranks_or_expands_the_verdict_s_draft(llama_pair, monkeypatch):
    """Plans scripted through every case after a verdict draft (the same shape, another size, another
    stop, another top_k and depth, a plain round, detached): each case is served as planned
    (Drafter.redraft: a re-rank of the same candidates, or an expansion alone; with `verdict_ranks`,
    as a fixed tree's, the queued tree kept where the plan is its shape), with the rounds and tokens
    of trees drafted after the verdict and plain decoding's tokens."""
    from services.spec.budget import AUTO_LARGEST, RoundPlan

    _, target, head = llama_pair
    a, b = TreeParams(4, 3, 16), TreeParams(2, 4, 12)
    script = [a, a, TreeParams(4, 3, 10), b, None, a, TreeParams(4, 3, 16, stop_logprob=-2.0), b, b, a]

    def scripted(plans):
        it = iter(plans * 10)

        def plan(self, seq_id, seq, chain):
            tree = next(it)
            return RoundPlan(tree, 0, 2.0 if tree else 1.0, 1.0)
        return plan

    prompt = [2, 71, 14, 9, 30]
    out = {}
    for mode in ("verdicts", "ranked", "device"):
        monkeypatch.setattr(Engine, "_plan", scripted(script))
        drafter = static_drafter(head, AUTO_LARGEST)
        engine = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB, budget=adaptive_budget(AUTO_LARGEST),
                        verdict_drafts=mode != "device", verdict_ranks=mode == "ranked")
        out[mode] = run(engine, prompt, 60)
        counts = engine.verdict_counts
        if mode == "verdicts":  # (the budget's default: the queued candidates wait for the plan's re-rank)
            assert all(counts[c] > 0 for c in ("reranked", "expanded", "plain")), counts
            assert not counts["dropped"] and not counts["kept"], counts
        elif mode == "ranked":  # re-ranked as queued: kept where the plan is the same shape (a after a)
            assert all(counts[c] > 0 for c in ("kept", "reranked", "expanded", "plain")), counts
    monkeypatch.undo()
    assert out["verdicts"] == out["ranked"] == out["device"]
    assert out["device"][0] == run(Engine(paged_verifier(target, "none"), None, 512, VOCAB), prompt, 60)[0]
    assert {s[1] for s in out["device"][1][1:]} >= {0, 10, 12, 16}  # the scripted sizes and plain rounds ran


def adaptive_budget(largest: TreeParams):
    """An adaptive budget (no fixed shape) bounded by `largest`; its plans are scripted in the test."""
    from services.spec.budget import NOMINAL_COSTS, Budget

    return Budget(NOMINAL_COSTS, largest=largest)


def test_aerie_device_round_turns_the_round_on_the_device_off(monkeypatch, llama_pair):
    """AERIE_DEVICE_ROUND=0 (the in-process engine's switch, services/engine/local.py): device_trees
    False, so no verdict drafts either; unset or 1: wherever possible; anything else is refused."""
    from services.engine.local import device_round
    from services.errors import CheckpointError

    _, target, head = llama_pair
    for value, want in (("0", False), ("1", True), (None, True)):
        if value is None:
            monkeypatch.delenv("AERIE_DEVICE_ROUND", raising=False)
        else:
            monkeypatch.setenv("AERIE_DEVICE_ROUND", value)
        engine = Engine(paged_verifier(target, "hidden"), static_drafter(head, SHAPES["16/3/4"]), 512, VOCAB,
                        device_trees=device_round())
        assert engine.device_trees is want and engine.verdict_drafts is want
    monkeypatch.setenv("AERIE_DEVICE_ROUND", "yes")
    with pytest.raises(CheckpointError, match="AERIE_DEVICE_ROUND must be 0 or 1; got 'yes'"):
        device_round()


def test_the_device_re_rank_and_walk_read_no_value_on_the_host():
    """On the meta device a tensor has no values (indexing with a 0-dim tensor, `.item()`, `int(t)`
    raise): rerank_static and next_rows_on_device run through, with and without a stop, so on a GPU
    they never wait for the device (the first GPU version indexed with 0-dim tensors: three waits)."""
    from services.spec.verify import next_rows_on_device

    with pytest.raises(RuntimeError):  # the detector works
        torch.zeros(5, device="meta")[torch.zeros((), dtype=torch.long, device="meta")]
    k, d = 4, 3
    c = k + d * k * k

    def meta(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device="meta")

    cand = Candidates(meta(c), meta(c, dtype=torch.long), meta(1 + d * k, dtype=torch.long))
    for stop in (float("-inf"), -2.0):
        for root in (5, meta(1, dtype=torch.long)):
            st = rerank_static(cand, root, TreeParams(k, d, 16, stop_logprob=stop))
            assert st.tokens.shape == st.real.shape == (16,) and st.mask.shape == (16, 16)
            rows = next_rows_on_device(st, meta(16, dtype=torch.long), 8)
            assert rows.tokens.shape == rows.nodes.shape == (8,) and rows.count.shape == (1,)


def test_the_last_round_queues_no_draft(llama_pair):
    """A round with one token left ends the request whatever it accepts: no draft is queued from its
    verdict (max_new_tokens 2: the prefill's token, then one round)."""
    _, target, head = llama_pair
    for n, queued in ((2, 0), (12, None)):
        drafter = static_drafter(head, SHAPES["16/3/4"])
        used = counting(drafter)
        engine = Engine(paged_verifier(target, "hidden"), drafter, 512, VOCAB)
        tokens, stats = run(engine, [7, 8, 9], n)
        assert len(tokens) == n
        before = [sum(s[0] for s in stats[:r]) for r in range(1, len(stats))]  # tokens before each round
        if queued is not None:
            assert used["verdict"] == queued and before == [1]
        else:  # every round with more than one token left
            assert used["verdict"] == sum(n - b > 1 for b in before) >= len(before) - 1 > 2
