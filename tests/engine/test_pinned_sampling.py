"""Seeded sampling is reproducible across releases: the same model, prompt, parameters and seed give
these exact tokens. The tokens are pinned literals (recorded with this release); a change here means
users' seeded outputs change, which needs a release note. The speculative one also pins the tree
search and the rejection sampler's use of the random stream; re-pin it only for a deliberate change
of either (say so in the commit)."""

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams

REQUEST = GenerationRequest((5, 17, 99, 3, 42, 8), 24, SamplingParams(0.8, 0.95, 0, 1234))
PLAIN = [97, 22, 60, 23, 13, 17, 3, 101, 84, 33, 69, 26, 93, 100, 96, 110, 119, 45, 124, 0, 99, 26, 93, 59]
# Re-pinned when the fused q/k/v and gate/up linears landed (issue 9): the fixture's head is distilled in
# the test, so new kernel numerics train a (slightly) different head whose trees differ; plain sampling
# above did not change.
SPECULATIVE = [97, 81, 80, 32, 9, 25, 40, 58, 57, 41, 72, 81, 17, 2, 82, 43, 114, 53, 120, 51, 43, 54, 112, 17]


def tokens(engine: Engine) -> list[int]:
    return [t for step in engine.generate(REQUEST) for t in step.tokens]


def test_pinned_plain_sampling(llama_pair):
    _, target, _ = llama_pair
    cfg = target.config
    assert tokens(Engine(Verifier(target, "none"), None, cfg.max_context, cfg.vocab_size, ())) == PLAIN


def test_pinned_speculative_sampling(llama_pair):
    _, target, head = llama_pair
    cfg = target.config
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(4, 3, 16)), cfg.max_context,
                    cfg.vocab_size, ())
    assert tokens(engine) == SPECULATIVE
