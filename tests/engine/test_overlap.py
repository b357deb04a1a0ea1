"""Drafting ahead (services/engine/engine.py, services/spec/ahead.py): lossless with overlap on and
off, guesses that always hit or always miss give the target's tokens and the right counters, and a
seeded sampling run replays. Every decision here is count-based (contention fixed, learn_cost off):
nothing depends on timing."""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.overlap import AheadPolicy
from services.spec.sampling import SamplingParams
from services.spec.ahead import use_ahead
from services.spec.tree import TreeParams, expand, rerank
from tests.helpers import VOCAB, hf_greedy, oracle

SHAPE = TreeParams(4, 3, 16)
PROMPTS = [[3, 17, 40, 9, 88], [101, 5, 5, 61, 2, 33, 7, 12]]
N = 40


def policy() -> AheadPolicy:
    return AheadPolicy(contention=0.0, learn_cost=False)  # drafts ahead whenever a guess can hit


def run(engine: Engine, prompt: list[int], n: int, **kw):
    tokens, stats = [], []
    for step in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += step.tokens
        if step.stats.round_index > 0:
            stats.append(step.stats)
    return tokens, stats


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_greedy_with_overlap_equals_the_target(pair, request):
    hf, target, head = request.getfixturevalue(pair)
    on = Engine(Verifier(target, head.feature_kind), Drafter(head, SHAPE), 512, VOCAB, ahead=policy())
    off = Engine(Verifier(target, head.feature_kind), Drafter(head, SHAPE), 512, VOCAB)
    ahead = hits = 0
    for prompt in PROMPTS:
        ref = hf_greedy(hf, prompt, N)
        tokens, stats = run(on, prompt, N)
        assert tokens == ref, prompt
        assert run(off, prompt, N)[0] == ref
        ahead += sum(s.ahead for s in stats)
        hits += sum(s.ahead_hit for s in stats)
        # a hit verifies the fresh-sized subtree of its branch: as many nodes as a drafted tree
        assert all(s.tree_size == SHAPE.size for s in stats if s.ahead_hit)
    # the top-path guess drafts ahead every round and hits in some
    assert ahead > 0 and 0 < hits <= ahead


@pytest.mark.parametrize("hit", [True, False], ids=["always-hits", "always-misses"])
def test_injected_guess_gives_target_tokens_and_counters(llama_pair, hit):
    hf, target, head = llama_pair
    prompt = PROMPTS[0]
    ref = hf_greedy(hf, prompt, N + 20)
    engine = Engine(Verifier(target), Drafter(head, SHAPE), 512, VOCAB, ahead=policy(), guesser=oracle(ref, hit))
    tokens, stats = run(engine, prompt, N)
    assert tokens == ref[:N]
    rounds = len(stats)  # every round verifies a tree (fixed budget)
    assert all(s.tree_size > 1 for s in stats)
    assert sum(s.ahead for s in stats) == rounds  # every round drafts the next tree ahead
    if hit:
        assert [s.ahead_hit for s in stats] == [False] + [True] * (rounds - 1)
        assert all(s.saved_s > 0 for s in stats[1:])
    else:
        assert not any(s.ahead_hit for s in stats) and all(s.saved_s == 0 for s in stats)


def test_overlap_off_by_policy_never_drafts_ahead(llama_pair):
    hf, target, head = llama_pair
    engine = Engine(Verifier(target), Drafter(head, SHAPE), 512, VOCAB, ahead=AheadPolicy(enabled=False))
    tokens, stats = run(engine, PROMPTS[1], 24)
    assert tokens == hf_greedy(hf, PROMPTS[1], 24)
    assert not any(s.ahead or s.ahead_hit for s in stats)


def test_seeded_sampling_with_overlap_replays(llama_pair):
    _, target, head = llama_pair
    sampling = SamplingParams(0.9, top_p=0.95, seed=11)
    outs = []
    for _ in range(2):
        engine = Engine(Verifier(target), Drafter(head, SHAPE), 512, VOCAB, ahead=AheadPolicy())
        tokens, stats = run(engine, PROMPTS[0], 32, sampling=sampling)
        assert all(0 <= t < VOCAB for t in tokens) and len(tokens) == 32
        outs.append((tokens, [(s.ahead, s.ahead_hit) for s in stats]))
    assert outs[0] == outs[1]
    assert any(a for a, _ in outs[0][1])


def test_engine_refuses_overlap_without_a_drafter(llama_pair):
    _, target, _ = llama_pair
    from services.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="draft ahead"):
        Engine(Verifier(target), None, 512, VOCAB, ahead=AheadPolicy())


def test_draft_ahead_leaves_only_committed_rows(llama_pair):
    _, _, head = llama_pair
    d = Drafter(head, SHAPE, ahead_branches=2)
    d.start("s", 64, sampling=False)
    f = head.config.feature_size
    d.draft("s", torch.tensor([4, 9, 21]), torch.randn(3, f), SHAPE)
    length = d._caches["s"].length
    tree = d.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), [30, 31], SHAPE, branches=0)
    assert tree is not None and int(tree.tokens[0]) == 31 and tree.size == SHAPE.size
    tree = d.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), [30, 31], SHAPE)
    assert tree is not None and tree.size == 1 + 2 * SHAPE.size  # two branches, a fresh-sized subtree each
    assert d._caches["s"].length == length
    tree2 = d.draft_ahead("s", torch.tensor([30]), torch.randn(1, f), [31], SHAPE)
    assert tree2 is not None and d._caches["s"].length == length + 1  # the committed row stays


def _deepest_path(tree) -> list[int]:
    """The tokens of a deepest root-to-leaf path of `tree` (without the root)."""
    parents, depth = tree.parents.tolist(), [0] * tree.size
    for i in range(1, tree.size):
        depth[i] = depth[parents[i]] + 1
    node, path = max(range(tree.size), key=lambda i: depth[i]), []
    while node:
        path.append(int(tree.tokens[node]))
        node = parents[node]
    return path[::-1]


def test_an_ahead_draft_feeds_its_rows_the_tree_in_flights_recorded_features(llama_pair):
    """The guess and the chain are a path of the tree in flight: the drafter recorded the head outputs
    along it when it expanded that tree, so their rows go in one head step (each fed the recorded
    output of the path before it) instead of one step a row, and grow the same ahead tree as the rows
    run one by one (the same inputs; fp32 up to the GEMM's rounding). After a hit (the verdict's rows
    pending, ending at a branch of the ahead tree) the next ahead draft finds its path in the ahead
    tree's own record. A path the record lacks runs row by row."""
    from services.spec.ahead import chain_past

    _, _, head = llama_pair
    f = head.config.feature_size
    torch.manual_seed(5)
    feats = torch.randn(3, f)
    steps = [0]
    forward = head.forward

    def counted(*a, **kw):
        steps[0] += 1
        return forward(*a, **kw)

    trees = {}
    for reuse in (True, False):
        d = Drafter(head, SHAPE, ahead_branches=2)
        d.reuse_flight = reuse
        d.start("s", 96, sampling=False)
        flight = d.draft("s", torch.tensor([4, 9, 21]), feats, TreeParams(1, 3, 5))  # a chain: a deep path
        path = _deepest_path(flight)
        assert len(path) == 4
        guess = path[:1]
        chain, exclude = chain_past(flight, guess, path)
        head.forward, steps[0] = counted, 0
        try:
            trees[reuse] = d.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), guess, SHAPE,
                                         exclude=exclude, chain=chain)
        finally:
            del head.forward
        trees[reuse, "steps"] = steps[0]
        assert d._caches["s"].length == 3
        if reuse:
            kept = d
    on, off = trees[True], trees[False]
    assert on.tokens.tolist() == off.tokens.tolist() and on.parents.tolist() == off.parents.tolist()
    assert torch.allclose(on.scores, off.scores, atol=1e-4)
    assert trees[False, "steps"] - trees[True, "steps"] == len(path) - 1  # one step for the path's rows
    # a hit at a branch of the root: the verdict's rows pending, the next guess a path below the bonus
    parents = on.parents.tolist()
    branch = next(i for i in range(2, on.size) if parents[i] == 0)
    verdict = guess + [int(on.tokens[branch])]
    nxt = use_ahead(on, guess, verdict, False)
    assert nxt is not None
    path = _deepest_path(nxt)
    assert len(path) >= 2
    chain, exclude = chain_past(nxt, path[:1], path)
    head.forward, steps[0] = counted, 0
    try:
        tree = kept.draft_ahead("s", torch.tensor(verdict), torch.randn(len(verdict), f), path[:1], SHAPE,
                                exclude=exclude, chain=chain)
    finally:
        del head.forward
    assert tree is not None and int(tree.tokens[0]) == path[0] and kept._caches["s"].length == 3 + len(verdict)
    walked = steps[0]
    kept.reuse_flight = False  # the same call with the path's rows one by one: len(path) - 1 steps more
    kept._caches["s"].truncate(3)
    kept.draft("s", torch.tensor(verdict), torch.randn(len(verdict), f), SHAPE)  # (a flight without the path)
    head.forward, steps[0] = counted, 0
    try:
        kept.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), path[:1], SHAPE,
                         exclude=exclude, chain=chain)
    finally:
        del head.forward
    assert steps[0] - walked == len(path) - 1 - 1  # (the extension of the verdict's rows: one step less here)


def test_a_hit_reroots_to_the_fresh_tree_of_its_branch(llama_pair):
    """The ahead tree (two branches at the root and at the one chain node, the in-flight children
    excluded) rerooted at any branch is the tree a fresh draft from that branch grows when its rows
    get the head's predicted features: same tokens, parents, depth and node count as the round's
    shape (the old single-beam ahead tree: fewer)."""
    _, _, head = llama_pair
    f = head.config.feature_size
    torch.manual_seed(3)
    feats = torch.randn(3, f)
    d = Drafter(head, SHAPE, ahead_branches=2)
    d.start("s", 64, sampling=False)
    d.draft("s", torch.tensor([4, 9, 21]), feats, SHAPE)
    guess = [30, 31]
    plain = d.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), guess, SHAPE, branches=0)
    skip = int(plain.tokens[1])  # pretend the tree in flight holds the root's best child...
    chain = [int(plain.tokens[plain.parents.tolist().index(1)])]  # ...and its best child: the chain
    ahead = d.draft_ahead("s", torch.zeros(0, dtype=torch.long), torch.zeros(0), guess, SHAPE,
                          exclude=((skip,), ()), chain=tuple(chain))
    assert d._caches["s"].length == 3  # only the committed rows stay
    parents = ahead.parents.tolist()
    assert int(ahead.tokens[1]) == chain[0] and parents[1] == 0  # the chain hangs from the root
    attach = {0: [], 1: []}  # attach point -> its branch nodes
    for i in range(2, ahead.size):
        if parents[i] in attach:
            attach[parents[i]].append(i)
    assert len(attach[0]) == 2 and len(attach[1]) == 2
    assert skip not in [int(ahead.tokens[i]) for i in attach[0]]
    assert ahead.size == 2 + 4 * SHAPE.size
    ref = Drafter(head, SHAPE)  # the same committed rows, then the bet's and the branch's rows
    ref.start("r", 64, sampling=False)
    ref.draft("r", torch.tensor([4, 9, 21]), feats, SHAPE)
    cache = ref._caches["r"]
    for point, nodes in attach.items():
        for b in nodes:
            bonus = int(ahead.tokens[b])
            verdict = guess + chain[:point] + [bonus]
            sub = use_ahead(ahead, guess, verdict, False)  # a hit at this bonus
            stable, last = cache.length, ref._last["r"]
            for tok in verdict:
                last = head(last[None], torch.tensor([tok]), cache)[0]
            fresh = rerank(expand(head, cache, last, SHAPE), bonus, SHAPE, False)
            cache.truncate(stable)
            assert sub.size == fresh.size == SHAPE.size and sub.max_depth == fresh.max_depth
            assert sub.tokens.tolist() == fresh.tokens.tolist() and sub.parents.tolist() == fresh.parents.tolist()
            assert torch.allclose(sub.scores, fresh.scores, atol=1e-4)
    # the single-beam ahead tree's subtree under its best child: smaller
    old = use_ahead(plain, guess, guess + [skip], False)
    assert old is None or old.size < SHAPE.size


def test_chain_and_exclusions_follow_the_top_path():
    from services.spec.ahead import chain_past as _chain
    from services.spec.tree import build_tree
    t = build_tree(torch.tensor([7, 5, 8, 3, 4]), torch.tensor([-1, 0, 0, 1, 1]), torch.zeros(5), False)
    assert _chain(t, [5], [5, 3]) == ((3,), ((3, 4), ()))
    assert _chain(t, [5, 3], [5, 3]) == ((), ((),))  # the guess is the whole path: the bonus follows it
    assert _chain(t, [8], [5, 3]) == ((), ())  # not the top path (an injected guess): nothing



def test_overlap_with_retrieved_chains_deeper_than_the_head(llama_pair):
    """eagle+sam: a merged retrieved chain makes the tree deeper than the head's trees, so its top
    path is longer than a guess plus a chain the drafter takes (depth + 2 and depth + 1 tokens; the
    round failed with InvalidRequest before). The engine caps both; greedy output stays the target's."""
    hf, target, head = llama_pair
    shape = TreeParams(2, 1, 3)  # depth 1: a guess of <= 3 tokens, a chain of <= 2
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, shape), 512, VOCAB,
                    retrieval=True, ahead=policy())
    g = torch.Generator().manual_seed(7)
    deep = 0
    for _ in range(2):
        part = torch.randint(0, VOCAB, (12,), generator=g).tolist()
        prompt = part * 3  # repeats: retrieval proposes long chains
        tokens, stats = run(engine, prompt, 48)
        assert tokens == hf_greedy(hf, prompt, 48), prompt
        deep += sum(s.tree_max_depth > shape.depth + 2 and s.ahead for s in stats)
    assert deep > 0, "no round drafted ahead from a tree deeper than the head's guess limit"
