"""Text on the Coordinator API: prompts as text or chat messages (template applied on the
coordinator), stop strings matched on the detokenized text across rounds (text cut before the stop,
Redis holding the tokens through the one that completes it), text deltas next to the token ids, and
GetInfo. Real services on loopback, the tiny word-level tokenizer (tests/pipeline.py)."""

import grpc
import pytest
from transformers import AutoTokenizer

from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from tests.pipeline import start_pipeline, text_model_dirs, wait_until  # noqa: F401 - fixture

GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def pipeline(text_model_dirs, redis_url):
    p = start_pipeline(text_model_dirs, redis_url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def tok(text_model_dirs):
    return AutoTokenizer.from_pretrained(str(text_model_dirs.target))


def run(p, **kw):
    kw.setdefault("max_new_tokens", 24)
    kw.setdefault("sampling", GREEDY)
    msgs = list(p.coordinator_stub().Generate(cpb.GenerateRequest(**kw), timeout=60))
    tokens = [t for m in msgs for t in m.tokens]
    return msgs, tokens, "".join(m.text for m in msgs)


def test_text_prompt_equals_token_ids(pipeline, tok):
    msgs, tokens, text = run(pipeline, prompt="t5 t17 t9")
    _, by_ids, _ = run(pipeline, prompt_ids=[5, 17, 9])
    assert tokens == by_ids and len(tokens) == 24
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert msgs[0].info.prompt_tokens == 3
    assert msgs[-1].finish_reason == "length"


def test_chat_messages_use_the_template(pipeline, tok):
    messages = [cpb.ChatMessage(role="system", content="t7"), cpb.ChatMessage(role="user", content="t5 t6")]
    msgs, tokens, _ = run(pipeline, messages=messages)
    _, expected, _ = run(pipeline, prompt_ids=[3, 7, 3, 5, 6, 4])  # TINY_CHAT_TEMPLATE by hand
    assert tokens == expected and msgs[0].info.prompt_tokens == 6
    _, raw, _ = run(pipeline, messages=messages, skip_chat_template=True)
    _, joined, _ = run(pipeline, prompt="t7t5 t6")  # contents concatenated, no template
    assert raw == joined


def first_completion(tok, tokens, stop):
    """Oracle: the first k whose full decode of tokens[:k+1] contains `stop` (None if none)."""
    for k in range(len(tokens)):
        if stop in tok.decode(tokens[:k + 1], skip_special_tokens=True):
            return k
    return None


@pytest.mark.parametrize("pick", ["spanning", "mid_token", "very_start"])
def test_stop_strings(pipeline, tok, pick):
    _, ref_tokens, ref_text = run(pipeline, prompt="t5 t17 t9", max_new_tokens=40)
    words = ref_text.split(" ")
    if pick == "spanning":  # the end of word 3, the space, the start of word 4: spans two tokens
        stop = words[3][-1:] + " " + words[4][:2]
    elif pick == "mid_token":  # ends inside a token: "t1" of "t17"
        stop = next(w[:2] for w in words[2:] if len(w) == 3)
    else:
        stop = ref_text[0]
    k = first_completion(tok, ref_tokens, stop)
    assert k is not None
    msgs, tokens, text = run(pipeline, prompt="t5 t17 t9", max_new_tokens=40, stop=["never", stop])
    assert text == ref_text[:ref_text.index(stop)]  # cut before the stop string
    assert tokens == ref_tokens[:k + 1]  # through the token that completes it
    assert msgs[-1].finish_reason == "stop"
    state = pipeline.coordinator.store.get(msgs[0].sequence_id)
    assert (state.tokens, state.status, state.finish_reason) == (tokens, "finished", "stop")
    wait_until(lambda: pipeline.verifier.num_sequences == 0)


def test_text_deltas_skip_special_tokens_flag(pipeline, tok):
    _, tokens, text = run(pipeline, prompt="t5 t17 t9", skip_special_tokens=False)
    assert text == tok.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize("kw, message", [
    (dict(prompt="t5", prompt_ids=[5]), "give exactly one of prompt_ids, prompt and messages; got prompt_ids and prompt"),
    (dict(prompt=""), "prompt is an empty string"),
    (dict(prompt="t5", stop=["ok", ""]), "stop[1] is an empty string"),
    (dict(messages=[cpb.ChatMessage(role="", content="t5")]), "messages[0].role is empty"),
])
def test_bad_text_fields(pipeline, kw, message):
    with pytest.raises(grpc.RpcError) as e:
        run(pipeline, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_get_info(pipeline, text_model_dirs):
    info = pipeline.coordinator_stub().GetInfo(pb.InfoRequest(), timeout=30)
    assert info.model == "target" and info.target == text_model_dirs.target.name  # no path leaves the coordinator
    assert info.max_context == 512 and info.vocab_size == 128
    assert info.draft == text_model_dirs.head.name
    assert info.text and info.chat_template
    assert (info.verifiers_ready, info.drafters_ready, info.drafters_configured) == (1, 1, 1)


def test_a_text_sequence_survives_a_take_over(pipeline, tok):
    """Stop strings and skip_special_tokens are stored with the sequence: a coordinator that takes it
    over (here: its first coordinator died after round 2, leaving its lease let go) cuts it at the
    same stop string, which spans the tokens committed before and after the take-over, and Resume
    streams the same text deltas as the undisturbed stream."""
    from coordinator.sequence_store import SequenceRecord

    ref_msgs, ref_tokens, _ = run(pipeline, prompt="t5 t17 t9", max_new_tokens=40)
    rounds = [list(m.tokens) for m in ref_msgs]
    c = len(rounds[0]) + len(rounds[1]) + len(rounds[2])  # committed by the dead coordinator
    before, upto = tok.decode(ref_tokens[:c], skip_special_tokens=True), tok.decode(ref_tokens[:c + 1], skip_special_tokens=True)
    stop = next(s for n in range(2, 12) if first_completion(tok, ref_tokens, s := before[-n:] + upto[len(before):len(before) + 2]) == c)
    msgs, expected, expected_text = run(pipeline, prompt="t5 t17 t9", max_new_tokens=40, stop=[stop])
    assert msgs[-1].finish_reason == "stop" and len(expected) == c + 1  # the stop completes just after the cut
    store = pipeline.coordinator.store
    params = store.get(msgs[0].sequence_id).params
    assert params.stop == (stop,) and params.skip_special_tokens is True
    seq_id = "text-dead-coordinator"
    store.create(SequenceRecord(seq_id, (5, 17, 9), params, 0, "gone:1", "gone:2", owner="dead-coordinator"))
    for m in ref_msgs[:3]:
        store.commit(seq_id, m.stats.round_index, list(m.tokens), None, owner="dead-coordinator")
    store.hand_over(seq_id, "dead-coordinator")  # its lease goes at once (as a draining coordinator's)
    seen = len(rounds[0])  # the client had received round 0 only (tokens and text)
    resumed = list(pipeline.coordinator_stub().Resume(cpb.ResumeRequest(sequence_id=seq_id, from_token_index=seen),
                                                      timeout=60))
    assert list(ref_tokens[:seen]) + [t for m in resumed for t in m.tokens] == expected
    assert msgs[0].text + "".join(m.text for m in resumed) == expected_text
    assert resumed[-1].finish_reason == "stop"
    assert store.get(seq_id).owner == pipeline.coordinator.sequences.owner
