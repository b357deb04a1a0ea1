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
