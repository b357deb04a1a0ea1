"""The target's log-probabilities (pb.TokenLogprobs, from the coordinator) in OpenAI's two shapes.

    chat_logprobs(lps)                   # chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
    completion_logprobs(lps, offset)     # completions (legacy): tokens, token_logprobs, top_logprobs, text_offset

Each token is shown as the coordinator decoded it alone (`token_texts`); without a tokenizer as
"token_id:<id>" (vLLM's spelling). A token that is part of a multi-byte character decodes to U+FFFD
alone; `bytes` are the UTF-8 bytes of the shown text, as vLLM gives them. Values are the raw target
distribution's (services/spec/logprobs.py), never the draft's.
"""

from __future__ import annotations

from services.rpc.stubs import common as pb


def _texts(ids, texts) -> list[str]:
    return list(texts) if len(texts) == len(ids) else [f"token_id:{t}" for t in ids]


def _rows(lps: list[pb.TokenLogprobs]):
    """(text, logprob, [(text, logprob)] * k) per token, in order."""
    for lp in lps:
        texts = _texts(lp.token_ids, lp.token_texts)
        top_texts = _texts(lp.top_ids, lp.top_texts)
        k = lp.top
        for i, (text, value) in enumerate(zip(texts, lp.logprobs)):
            yield text, value, list(zip(top_texts[i * k:(i + 1) * k], lp.top_logprobs[i * k:(i + 1) * k]))


def _entry(text: str, value: float) -> dict:
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(lps: list[pb.TokenLogprobs]) -> dict:
    return {"content": [{**_entry(text, value), "top_logprobs": [_entry(t, v) for t, v in top]}
                        for text, value, top in _rows(lps)], "refusal": None}


def completion_logprobs(lps: list[pb.TokenLogprobs], offset: int = 0) -> dict:
    """`offset`: the text_offset of the first of these tokens. A token's text_offset is the summed
    length of the shown texts of the tokens before it (its position in the completion text when each
    token decodes alone to its piece of the text, as byte-level BPE tokens of whole characters do)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, value, top in _rows(lps):
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(dict(top))
        out["text_offset"].append(offset)
        offset += len(text)
    return out
