"""Device rounds (verifier_svc/device_round.py): a verifier that drafts too keeps its runs' tree rounds
on the device, each next tree queued from the verdict before the host reads it and the next round
queued with it before anything waits for the draft (as the in-process engine's verdict drafts). Here on
the CPU with the GPU's paths run eagerly (paged KV and the static-shape forward, the head's static
draft code: AERIE_PAGED_KV=1 at the verifier's load, tests/pipeline.py), over real gRPC and a real
Redis: the tokens are the target's and every round (tree, acceptance) is the host rounds' (the same verifier made without them), a
verdict the host reads otherwise drops the queued draft, a repeated Verify or Draft gets a device
round's answer again, and AERIE_DEVICE_ROUND=0 turns them off. Nothing here depends on timing."""

import pytest
import torch

from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.verify import NextRows
from tests.coordinator.test_colocated import DRAFT_DTYPE, N, PROMPT, generate, rounds, verify_run_request
from tests.helpers import VOCAB, hf_greedy
from tests.pipeline import TREE, start_pipeline


@pytest.fixture(scope="module")
def target_greedy(llama_pair):
    hf, _, _ = llama_pair
    return hf_greedy(hf, list(PROMPT), N)


def device_rounds(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("aerie_device_rounds_total", {"service": "verifier", "outcome": outcome}) or 0.0


def shape(messages) -> list[tuple[int, int]]:
    """Each EAGLE round's (tree size, accepted tokens)."""
    return [(s.tree_size, s.accept_length) for s in rounds(messages)]


@pytest.fixture(scope="module")
def host_rounds(model_dirs, redis_url):
    """The same paged verifier with device rounds off (AERIE_DEVICE_ROUND=0 at its start)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AERIE_DEVICE_ROUND", "0")
    try:
        p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True, paged=True)
    finally:
        mp.undo()
    assert p.verifier.device_rounds is None
    yield p
    p.close()


@pytest.fixture(scope="module")
def on_device(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True, paged=True)
    assert p.verifier.device_rounds is not None and p.verifier.device_rounds.takes("any") is False  # (unknown)
    yield p
    p.close()


def test_device_rounds_give_the_target_s_tokens_and_the_host_rounds(on_device, host_rounds, target_greedy):
    """Through the coordinator (runs of tree rounds): transformers' greedy tokens, and each round's tree
    size and accepted tokens those of the same verifier with device rounds off; none dropped."""
    kept, dropped = device_rounds("kept"), device_rounds("dropped")
    tokens, messages = generate(on_device)
    assert tokens == target_greedy[:N]
    made = device_rounds("kept") - kept
    # the rounds of runs were device rounds (the last few of a request are single calls: not in a run)
    assert made >= len(rounds(messages)) // 2 and device_rounds("dropped") == dropped
    host_kept = device_rounds("kept")
    host_tokens, host_messages = generate(host_rounds)
    assert device_rounds("kept") == host_kept  # (off there)
    assert host_tokens == tokens and shape(host_messages) == shape(messages)
    assert all(size == TREE.size for size, _ in shape(messages)[:-3])
    assert not on_device.verifier.device_rounds._queued  # nothing left queued after the sequence


def test_a_verdict_read_otherwise_drops_the_queued_draft(on_device, target_greedy, monkeypatch):
    """Sabotaged device rows: the queued draft is never kept; each round drafts after the host's verdict
    (the round's answer as before) and the tokens stay the target's."""
    import verifier_svc.device_round as device_round
    from services.spec.verify import next_rows_on_device

    def wrong(tree, argmax, width):
        rows = next_rows_on_device(tree, argmax, width)
        return NextRows((rows.tokens + 1) % VOCAB, rows.nodes, rows.count)

    monkeypatch.setattr(device_round, "next_rows_on_device", wrong)
    kept, dropped = device_rounds("kept"), device_rounds("dropped")
    tokens, messages = generate(on_device)
    assert tokens == target_greedy[:N]
    assert device_rounds("kept") == kept and device_rounds("dropped") - dropped >= len(rounds(messages)) // 2


def test_a_draft_kv_gone_drafts_after_the_verdict_and_keeps_device_rounds_on(on_device, target_greedy, monkeypatch):
    """The drafter has lost the sequence when a round's hook queues its draft (released or reaped
    meanwhile; here: refused twice as SequenceNotFound): those rounds draft after their verdict (the
    host path, which refills or fails as before), device rounds stay on for the next rounds and the
    other sequences, and the tokens are the target's."""
    from drafter_svc.servicer import DrafterServicer
    from services.errors import SequenceNotFound

    queue = DrafterServicer.queue_from_verdict
    refused = [0]

    def lost(self, seq_id, *args):
        if refused[0] < 2:
            refused[0] += 1
            raise SequenceNotFound(f"sequence {seq_id!r} is not on this drafter")
        return queue(self, seq_id, *args)

    monkeypatch.setattr(DrafterServicer, "queue_from_verdict", lost)
    kept = device_rounds("kept")
    tokens, messages = generate(on_device)
    assert tokens == target_greedy[:N] and refused[0] == 2
    assert on_device.verifier.device_rounds.on and device_rounds("kept") - kept >= len(rounds(messages)) // 2 - 2


def test_a_repeated_verify_or_draft_gets_a_device_round_s_answer(on_device, monkeypatch):
    """A VerifyRun of device rounds called directly: each round verifies the tree the round before
    queued, every answer carries its next tree, built on the model thread while the next round's
    forward runs (the last by the thread that reads it: no round follows); a Verify repeating the last
    round and the Draft call its next tree stands for get the same tree again (never drafted twice)."""
    import threading

    from verifier_svc.device_round import QueuedVerify

    built_on: list[str] = []
    resolve = QueuedVerify._resolve

    def recorded(self):
        built_on.append(threading.current_thread().name)
        return resolve(self)

    monkeypatch.setattr(QueuedVerify, "_resolve", recorded)
    stub = on_device.verifier_stub()
    request, features = verify_run_request(on_device, "d", 6, 64)
    kept = device_rounds("kept")
    answers = list(stub.VerifyRun(request, timeout=60))
    assert [a.round_index for a in answers] == list(range(1, 7)) and device_rounds("kept") - kept == 6
    assert built_on[:5] == ["verifier-batcher"] * 5 and len(built_on) == 6 and built_on[5] != "verifier-batcher"
    for a, b in zip(answers, answers[1:]):  # each round verified the tree the round before queued
        assert b.tokens[0] == a.bonus and codec.decode_tree(a.next_tree, VOCAB).tokens[0] == a.bonus
        assert codec.decode_tree(a.next_tree, VOCAB).size == TREE.size and not a.features.data
    again = vpb.VerifyRequest(sequence_id="d", round_index=6, tree=answers[-2].next_tree)
    assert stub.Verify(again, timeout=60) == answers[-1]
    draft = on_device.drafter_stub().Draft(  # (the head serves on the verifier's port)
        dpb.DraftRequest(sequence_id="d", round_index=7, tokens=[5],
                         features=codec.encode_tensor(torch.zeros(1, features.shape[1]))), timeout=60)
    assert draft.tree == answers[-1].next_tree
    stub.Release(pb.ReleaseRequest(sequence_id="d"), timeout=60)
    on_device.drafter.drafter.release("d")
