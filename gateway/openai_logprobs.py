"""The target's log-probabilities (pb.TokenLogprobs, from the coordinator) in OpenAI's two shapes.

    chat_logprobs(lps)                   # chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
    completion_logprobs(lps, offset)     # completions (legacy): tokens, token_logprobs, top_logprobs, text_offset
    echo_logprobs(prompt_lp, prompt_text, k)   # echo: the same arrays for the prompt (its first token's null)
    vllm_prompt_logprobs(prompt_lp, k)   # vLLM's prompt_logprobs: [None, {id: {logprob, rank, decoded_token}}, ...]

Each token is shown as the coordinator decoded it alone (`token_texts`); without a tokenizer as
"token_id:<id>" (vLLM's spelling). A token that is part of a multi-byte character decodes to U+FFFD
alone; `bytes` are the UTF-8 bytes of the shown text, as vLLM gives them. Values are the raw target
distribution's (services/spec/logprobs.py), never the draft's.
"""

from __future__ import annotations

from services.rpc.stubs import common as pb


def _texts(ids, texts) -> list[str]:
    return list(texts) if len(texts) == len(ids) else [f"token_id:{t}" for t in ids]


def _rows(lps: list[pb.TokenLogprobs], top: int | None = None):
    """(text, logprob, [(text, logprob)] * k) per token, in order; `top`: at most that many alternatives
    (a message computed with more for another view)."""
    for lp in lps:
        texts = _texts(lp.token_ids, lp.token_texts)
        top_texts = _texts(lp.top_ids, lp.top_texts)
        k = lp.top
        shown = k if top is None else min(k, top)
        for i, (text, value) in enumerate(zip(texts, lp.logprobs)):
            yield text, value, list(zip(top_texts[i * k:i * k + shown], lp.top_logprobs[i * k:i * k + shown]))


def _entry(text: str, value: float) -> dict:
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(lps: list[pb.TokenLogprobs]) -> dict:
    return {"content": [{**_entry(text, value), "top_logprobs": [_entry(t, v) for t, v in top]}
                        for text, value, top in _rows(lps)], "refusal": None}


def completion_logprobs(lps: list[pb.TokenLogprobs], offset: int = 0, top: int | None = None) -> dict:
    """`offset`: the text_offset of the first of these tokens. A token's text_offset is the summed
    length of the shown texts of the tokens before it (its position in the completion text when each
    token decodes alone to its piece of the text, as byte-level BPE tokens of whole characters do)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, value, alts in _rows(lps, top):
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(dict(alts))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echo_logprobs(lp: pb.TokenLogprobs, prompt_text: str, top: int) -> dict:
    """The legacy arrays for an echoed prompt: prompt tokens 1..L-1 come in `lp`; token 0 has no
    log-probability (null, top_logprobs null). Offsets are counted back from the end of `prompt_text`,
    so the prompt's last token ends where the completion's first starts (text_offset continuous), and
    token 0 shows the text in front of token 1."""
    rows = list(_rows([lp], top))
    starts, end = [], len(prompt_text)
    for text, _, _ in reversed(rows):
        end = max(0, end - len(text))
        starts.append(end)
    starts.reverse()
    first = prompt_text[:starts[0]] if starts else prompt_text
    return {"tokens": [first] + [text for text, _, _ in rows],
            "token_logprobs": [None] + [value for _, value, _ in rows],
            "top_logprobs": [None] + [dict(alts) for _, _, alts in rows],
            "text_offset": [0] + starts}


def vllm_prompt_logprobs(lp: pb.TokenLogprobs, top: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict token id ->
    {logprob, rank, decoded_token} holding the token itself and its `top` most likely alternatives
    (rank 1 = the most likely; the token's own rank counts the tokens more likely than it, plus 1)."""
    texts = _texts(lp.token_ids, lp.token_texts)
    top_texts = _texts(lp.top_ids, lp.top_texts)
    k, ranks = lp.top, list(lp.ranks)
    out: list = [None]
    for i, (token, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
        entry = {str(token): {"logprob": value, "rank": ranks[i] if ranks else None, "decoded_token": texts[i]}}
        for r in range(min(k, top)):
            entry.setdefault(str(lp.top_ids[i * k + r]), {"logprob": lp.top_logprobs[i * k + r], "rank": r + 1,
                                                           "decoded_token": top_texts[i * k + r]})
        out.append(entry)
    return out
