"""In-process plain runs (services/engine/plain_run.py): each step queued before the previous token is
read. Token-exact with one Decode a round and with transformers; a stop undoes the queued step; a
failing step raises at its own turn; sequences that cannot run ahead decode step by step."""

import pytest
import torch

from services.engine.engine import Engine, GenerationRequest
from services.engine.plain_run import LocalPlainRun, StepwiseRun
from services.engine.verifier import Verifier
from services.errors import CapacityExceeded
from services.model.paged_kv import PagedKVPool
from services.model.runner import ModelRunner
from services.spec.sampling import SamplingParams
from tests.helpers import hf_greedy, tiny_hf, to_native

PROMPT = [3, 17, 5, 9, 11, 2]


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf()
    return hf, to_native(hf)


def paged_verifier(target, kind="hidden") -> Verifier:
    """The static-shape path (what CUDA replays from graphs), run eagerly on the CPU."""
    return Verifier(None, kind, runner=ModelRunner(target, PagedKVPool.for_model(target, 1024), graphs=False))


def tokens(engine: Engine, n: int, **kw) -> list[int]:
    return [t for out in engine.generate(GenerationRequest(tuple(PROMPT), n, **kw)) for t in out.tokens]


def test_engine_in_plain_runs_equals_one_decode_a_round_and_transformers(pair):
    hf, target = pair
    c = target.config
    runs = Engine(paged_verifier(target), None, c.max_context, c.vocab_size, plain_run=4)
    single = Engine(paged_verifier(target), None, c.max_context, c.vocab_size)
    assert runs.plain_run == 4 and single.plain_run == 0
    want = hf_greedy(hf, PROMPT, 11)
    assert tokens(runs, 11) == tokens(single, 11) == want  # 11 = 1 (prefill) + runs of 4, 4, 2
    # the plain baseline of an engine that runs (`aerie bench`'s "native" on a GPU) runs too
    assert runs.plain().plain_run == 4 and tokens(runs.plain(), 11) == want


def test_a_stop_inside_a_run_gives_the_same_tokens(pair):
    hf, target = pair
    c = target.config
    want = hf_greedy(hf, PROMPT, 12)
    stop = want[6]
    runs = Engine(paged_verifier(target), None, c.max_context, c.vocab_size, plain_run=8)
    assert tokens(runs, 12, stop_token_ids=(stop,)) == want[:want.index(stop) + 1]
    assert runs.verifier.num_sequences == 0  # released after the run was closed


def test_close_undoes_the_step_queued_past_the_last_token_read(pair):
    _, target = pair
    v, ref = paged_verifier(target), paged_verifier(target)
    for ver in (v, ref):
        first = ver.prefill("s", torch.tensor(PROMPT), SamplingParams(), 64).first_token
    want, tok = [], first
    for r in range(1, 6):
        tok = ref.decode("s", tok, r)
        want.append(tok)
    run = v.decode_run("s", first, 1, 5)
    assert isinstance(run, LocalPlainRun)
    got = [next(run), next(run), next(run)]
    assert v.length("s") == len(PROMPT) + 4  # three steps read, the fourth queued
    run.close()
    assert v.length("s") == len(PROMPT) + 3 and run.left == 0
    with pytest.raises(StopIteration):
        next(run)
    got += [v.decode("s", got[-1], 4), v.decode("s", want[3], 5)]  # the next steps overwrite the dropped row
    assert got == want


def test_kept_features_of_an_undone_step_are_dropped(pair):
    _, target = pair
    v = paged_verifier(target)
    first = v.prefill("s", torch.tensor(PROMPT), SamplingParams(), 64).first_token
    run = v.decode_run("s", first, 1, 4, keep_features=True)
    next(run), next(run)
    assert len(v._seqs["s"].kept) == 3  # two read, one queued
    run.close()
    assert len(v._seqs["s"].kept) == 2 and all(f.shape == (1, target.config.hidden_size) for f in v._seqs["s"].kept)


def test_a_failing_step_raises_at_its_own_turn(pair):
    _, target = pair
    v = paged_verifier(target)
    first = v.prefill("s", torch.tensor(PROMPT), SamplingParams(), len(PROMPT) + 2).first_token
    run = v.decode_run("s", first, 1, 4)
    a, b = next(run), next(run)  # the third step did not fit: queued as an error, raised at its turn
    with pytest.raises(CapacityExceeded, match="may use 8 KV rows; 8 used, 1 more requested"):
        next(run)
    assert run.left == 0 and v.length("s") == len(PROMPT) + 2
    run.close()  # nothing to undo
    assert v.length("s") == len(PROMPT) + 2 and isinstance(a, int) and isinstance(b, int)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, seed=3), SamplingParams(repetition_penalty=1.3),
                                      SamplingParams(logprobs=2)], ids=["sampled", "penalty", "logprobs"])
def test_sequences_that_cannot_run_ahead_decode_step_by_step(pair, sampling):
    _, target = pair
    v, ref = paged_verifier(target), paged_verifier(target)
    for ver in (v, ref):
        first = ver.prefill("s", torch.tensor(PROMPT), sampling, 64).first_token
    run = v.decode_run("s", first, 1, 3)
    assert isinstance(run, StepwiseRun)
    want, tok = [], first
    for r in range(1, 4):
        tok = ref.decode("s", tok, r)
        want.append(tok)
    assert list(run) == want and v.length("s") == len(PROMPT) + 3


def test_a_sampled_sequence_never_keeps_its_token_on_the_device(pair):
    _, target = pair
    v = paged_verifier(target)
    first = v.prefill("s", torch.tensor(PROMPT), SamplingParams(temperature=0.8), 64).first_token
    with pytest.raises(Exception, match="samples: its next token cannot stay on the device"):
        v.decode_on_device("s", first, 1)
