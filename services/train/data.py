"""Training data for draft heads: the target's own responses to prompts (self-distillation) and/or
plain text, turned into `Sample`s (tokens, target features, target argmax) by one target forward each.

Responses are generated with transformers' batched `generate` on the same weights (left padding,
greedy): data preparation only, where batching matters more than the serving path. Features come
from aerie's own TargetModel in the serving dtype, so the head trains on what it will see.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from services.errors import InvalidRequest
from services.model.target import TargetModel
from services.train.distill import Sample


def load_prompts(path: str | Path) -> list[str]:
    """A .jsonl file (fields `prompt`, `text`, or Spec-Bench `turns`, first turn) or a .txt file
    with one prompt per line."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequest(f"prompt file {p} does not exist")
    out = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"{p}:{i + 1} is not valid JSON: {e}") from None
            text = row.get("prompt") or row.get("text") or (row.get("turns") or [None])[0]
            if not text:
                raise InvalidRequest(f"{p}:{i + 1} has no prompt, text or turns field")
            out.append(text)
        else:
            out.append(line.strip())
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
def generate_responses(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
                       eos_ids: tuple[int, ...], batch_size: int = 16,
                       dtype: torch.dtype = torch.bfloat16) -> list[list[int]]:
    """Greedy responses (EOS included when reached) for each tokenized prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = eos_ids[0] if eos_ids else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths per batch
    out: list[list[int]] = [[] for _ in prompts]
    for start in tqdm(range(0, len(order), batch_size), desc="generating responses", unit="batch"):
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=list(eos_ids) or None, pad_token_id=pad)
        for r, i in enumerate(idx):
            resp = gen[r, width:].tolist()
            for j, tok in enumerate(resp):
                if tok in eos_ids:
                    resp = resp[: j + 1]
                    break
            out[i] = resp
    return out


@torch.no_grad()
def make_sample(target: TargetModel, prompt: list[int], response: list[int], want_taps: bool) -> Sample:
    """One target forward over prompt + response; the loss covers the response tokens."""
    tokens = torch.tensor(prompt + response)
    out = target(tokens, target.new_cache(len(tokens)), want_taps=want_taps)
    feats = out.taps if want_taps else out.hidden
    mask = torch.zeros(len(tokens))
    mask[max(len(prompt) - 1, 0):] = 1.0
    return Sample(tokens, feats.to(torch.bfloat16), out.hidden.to(torch.bfloat16),
                  out.logits.argmax(-1), mask)


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
