"""The static-shape draft (services/spec/tree_static.py: the extension of up to 16 rows and the
expansion) over a paged draft KV, run eagerly on the CPU through the drafter: the trees of the eager expansion, round after round, and the EAGLE
reference's trees and acceptance (the CUDA graph replaying it is checked in tests/gpu)."""

import pytest
import torch

from services.engine.draft_graphs import DraftGraphs
from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.model.paged_kv import PagedKVPool
from services.spec.tree import TreeParams
from tests.helpers import VOCAB

SHAPES = {"60/5/10": TreeParams(10, 5, 60), "16/3/4": TreeParams(4, 3, 16), "chain 8/7/1": TreeParams(1, 7, 8)}


def static_drafter(head, tree: TreeParams) -> Drafter:
    """A drafter whose caches are paged and whose single-sequence expansions run `expand_static`
    (eagerly: what a CUDA graph replays)."""
    d = Drafter(head, tree)
    c = head.config
    d.pool = PagedKVPool(1, c.num_kv_heads, c.head_dim, 8192, head.dtype, head.device, page_size=8)
    d.graphs = DraftGraphs(head, d.pool, graphs=False, max_keys=2048)
    return d


def generate(engine, prompt, n, **kw):
    tokens, accepts = [], []
    for out in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += out.tokens
        accepts.append(out.stats.accept_length)
    return tokens, accepts


def record_trees(drafter, seen: list) -> None:
    """Append every tree `drafter` grows (through draft_many) to `seen`."""
    original = drafter.draft_many

    def record(calls):
        out = original(calls)
        seen.extend(out)
        return out

    drafter.draft_many = record


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_static_expansion_gives_the_eager_trees(pair, shape, request):
    _, target, head = request.getfixturevalue(pair)
    tree = SHAPES[shape]
    trees = {}
    for name, drafter in (("eager", Drafter(head, tree)), ("static", static_drafter(head, tree))):
        record_trees(drafter, trees.setdefault(name, []))
        static = drafter
        engine = Engine(Verifier(target, head.feature_kind), drafter, 512, VOCAB)
        g = torch.Generator().manual_seed(len(shape))
        for _ in range(2):
            prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            generate(engine, prompt, 40)
    assert static.graphs.expansions == len(trees["static"]) > 5  # every tree came from expand_static
    assert 0 < static.graphs.extensions <= static.graphs.expansions  # n <= 16: extend_static too
    assert len(trees["eager"]) == len(trees["static"])
    for a, b in zip(trees["eager"], trees["static"]):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert torch.equal(a.mask.cpu(), b.mask.cpu()) and torch.equal(a.paths.cpu(), b.paths.cpu())


def test_static_expansion_replays_the_reference():
    """The EAGLE reference's greedy rounds (tests/spec/golden) with the static expansion."""
    from tests.spec import test_reference_golden as ref

    target, head = ref.build_greedy_models()
    g = ref.GOLDEN["greedy"]
    for run in g["runs"]:
        total, depth, top_k = run["shape"]
        drafter = static_drafter(head, TreeParams(top_k, depth, total))
        engine = Engine(Verifier(target, head.feature_kind), drafter, target.config.max_context,
                        target.config.vocab_size, ())
        tokens, accepts = generate(engine, run["prompt"], g["case"]["max_new_tokens"], ignore_eos=True)
        assert accepts[1:] == run["accept_lengths"][: len(accepts) - 1]
        assert tokens == run["tokens"][: len(tokens)]
        assert drafter.pool.num_slots == 0 and drafter.graphs.expansions > 0  # released with the sequence


def test_an_extension_past_the_graphs_keys_expands_eagerly(llama_pair):
    """The graph path is chosen before the committed rows are appended; when they take the sequence
    past the graphs' largest key count (here a 250-token prompt against 256 keys), that expansion
    runs eagerly instead: the same trees as the eager drafter, no failed round."""
    _, target, head = llama_pair
    tree = SHAPES["16/3/4"]  # 12 draft rows: 250 + 12 > 256
    prompt = torch.randint(0, VOCAB, (250,), generator=torch.Generator().manual_seed(5)).tolist()
    trees = {}
    for name, drafter in (("eager", Drafter(head, tree)), ("static", static_drafter(head, tree))):
        if name == "static":
            drafter.graphs = DraftGraphs(head, drafter.pool, graphs=False, max_keys=256)
        record_trees(drafter, trees.setdefault(name, []))
        generate(Engine(Verifier(target, head.feature_kind), drafter, 512, VOCAB), prompt, 12)
        if name == "static":
            assert drafter.graphs.expansions == 0  # the prefill's fell back; later rounds never fit
    assert len(trees["eager"]) == len(trees["static"]) > 1
    for a, b in zip(trees["eager"], trees["static"], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_dynamic_depth_through_the_static_draft_gives_the_eager_beam_s_trees(pair, request):
    """A tree with dynamic depth (the budget's trees) through the static draft (every branch expanded
    to the full depth, the stop applied by `rerank`) == the eager beam that stops pruned branches:
    the same tokens, parents, masks and paths, round after round, for stops that prune nothing, some
    branches and all but one node; and the static path really served them."""
    head = request.getfixturevalue(pair)[2]
    g = torch.Generator().manual_seed(11)
    calls = [(torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, head.config.feature_size, generator=g))
             for n in (7, 3, 1, 5, 2, 4)]
    sizes = []
    for shape in ("60/5/10", "16/3/4", "chain 8/7/1"):
        for stop in (-0.5, -2.0, -4.0, -8.0, -30.0):
            tree = TreeParams(SHAPES[shape].top_k, SHAPES[shape].depth, SHAPES[shape].size, stop_logprob=stop)
            eager, static = Drafter(head, tree), static_drafter(head, tree)
            for d in (eager, static):
                d.start("s", 256, sampling=False)
            for toks, feats in calls:
                a, b = eager.draft("s", toks, feats), static.draft("s", toks, feats)
                label = f"{shape} stop {stop}"
                assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), label
                assert torch.equal(a.mask, b.mask) and torch.equal(a.paths, b.paths), label
                sizes.append(a.size)
            assert static.graphs.expansions == len(calls)
    assert min(sizes) == 2 and max(sizes) == SHAPES["60/5/10"].size  # all but one pruned .. nothing pruned
    assert len(set(sizes)) > 5


def test_the_adaptive_budget_s_trees_run_the_static_draft(llama_pair):
    """Through the engine with the adaptive budget (dynamic depth on): the static drafter grows the
    eager drafter's trees and the tokens of plain greedy decoding."""
    from services.spec.acceptance import prior_stats
    from services.spec.budget import Budget
    from services.spec.cost import CostCurve, CostModel

    _, target, head = llama_pair
    rows = (1, 2, 4, 8, 16, 32, 64)
    costs = CostModel(CostCurve(rows, tuple(1 + 0.02 * (r - 1) for r in rows)), CostCurve((1, 16), (0.05, 0.06)),
                      CostCurve((1, 16), (0.05, 0.07)))
    largest = SHAPES["60/5/10"]
    trees, tokens = {}, {}
    for name, drafter in (("eager", Drafter(head, largest)), ("static", static_drafter(head, largest))):
        record_trees(drafter, trees.setdefault(name, []))
        budget = Budget(costs, prior_stats({"top1_agreement": 0.6}), largest=largest)
        assert budget.stop_depth
        engine = Engine(Verifier(target, head.feature_kind), drafter, 512, VOCAB, budget=budget)
        tokens[name] = generate(engine, [5, 17, 99, 3, 42], 40)[0]
        if name == "static":  # (a one-token probe, depth 0, is the head's first level alone: eager)
            assert 3 < drafter.graphs.expansions <= len(trees["static"])
    plain = Engine(Verifier(target, "none"), None, 512, VOCAB)
    assert tokens["eager"] == tokens["static"] == generate(plain, [5, 17, 99, 3, 42], 40)[0]
    assert [t.size for t in trees["eager"]] == [t.size for t in trees["static"]]
    for a, b in zip(trees["eager"], trees["static"], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
