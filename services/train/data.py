"""Training data for draft heads: the target's own responses to prompts (self-distillation) and/or
plain text, turned into `Sample`s (tokens, target features, target argmax) by one target forward each.

Responses are the target's greedy continuations through aerie's own decoding path, and features
come from aerie's TargetModel in the serving dtype, so the head trains on what it will see.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from services.errors import InvalidRequest
from services.model.target import TargetModel
from services.train.distill import Sample


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-empty line of a JSONL file."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequest(f"prompt file {p} does not exist")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{p}:{i} is not valid JSON: {e}") from None
    return rows


def load_prompts(path: str | Path) -> list[str]:
    """A .jsonl file (fields `prompt`, `text`, or Spec-Bench `turns`, first turn) or a .txt file
    with one prompt per line."""
    p = Path(path)
    if p.suffix != ".jsonl":
        if not p.is_file():
            raise InvalidRequest(f"prompt file {p} does not exist")
        return [line.strip() for line in p.read_text().splitlines() if line.strip()]
    out = []
    for i, row in read_jsonl(p):
        text = row.get("prompt") or row.get("text") or (row.get("turns") or [None])[0]
        if not text:
            raise InvalidRequest(f"{p}:{i} has no prompt, text or turns field")
        out.append(text)
    return out


def chat_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return list(tokenizer.encode(prompt))


@torch.no_grad()
def generate_responses(target: TargetModel, prompts: list[list[int]], max_new_tokens: int,
                       eos_ids: tuple[int, ...]) -> list[list[int]]:
    """The target's greedy response (EOS included when reached) to each tokenized prompt, through
    aerie's own plain decoding path."""
    from services.engine.engine import Engine, GenerationRequest
    from services.engine.verifier import Verifier

    engine = Engine(Verifier(target), None, target.config.max_context, target.config.vocab_size, eos_ids)
    out = []
    for ids in tqdm(prompts, desc="generating responses", unit="prompt"):
        req = GenerationRequest(tuple(ids), max_new_tokens)
        out.append([t for step in engine.generate(req) for t in step.tokens])
    return out


@torch.no_grad()
def make_sample(target: TargetModel, prompt: list[int], response: list[int], want_taps: bool) -> Sample:
    """One target forward over prompt + response; the loss covers the response tokens."""
    tokens = torch.tensor(prompt + response)
    out = target(tokens.to(target.device), target.new_cache(len(tokens)), want_taps=want_taps)
    feats = out.taps if want_taps else out.hidden
    mask = torch.zeros(len(tokens))
    mask[max(len(prompt) - 1, 0):] = 1.0
    # samples live on the host (saved to data.pt, batched by the trainer) whatever the target's device
    return Sample(tokens, feats.to(torch.bfloat16).cpu(), out.hidden.to(torch.bfloat16).cpu(),
                  out.logits.argmax(-1).cpu(), mask)


def text_chunks(tokenizer, files: list[str], chunk_tokens: int) -> list[list[int]]:
    """Plain text files cut into token chunks (the loss then covers every token)."""
    chunks = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise InvalidRequest(f"text file {p} does not exist")
        ids = tokenizer.encode(p.read_text())
        chunks += [ids[i:i + chunk_tokens] for i in range(0, len(ids) - 16, chunk_tokens)]
    return chunks
