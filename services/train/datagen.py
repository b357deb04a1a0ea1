"""Self-distillation data at scale: the target's greedy answers AND its features, in one pass.

    python -m services.train.datagen --out /work/data/head-data [--max-tokens 1000000] [--batch 32]

Each batch of prompts is generated with transformers (batched, left padding, a DynamicCache, greedy)
while forward hooks record, for every token fed to the model (prompt and answer):

    hidden  [T, H]   the post-final-norm last hidden state (EAGLE-1/2 feature; lm_head input)
    taps    [T, 3H]  the residual stream entering layers 2, N//2, N-3 (EAGLE-3 feature)

so both head kinds train from one data set and no second feature pass is needed. A batch becomes one
shard, `shard-000123.safetensors`, written atomically (tmp + rename):

    tokens      int32 [S]      prompt + answer[:-1] of every sample, concatenated
    next        int32 [S]      the target's greedy next token on answer rows (from the last prompt
                               token on), -1 on the other prompt rows
    hidden      bf16  [S, H]
    taps        bf16  [S, 3H]
    offsets     int64 [n + 1]  sample i is rows offsets[i]:offsets[i+1]
    prompt_lens int32 [n]
    metadata    {"prompts": JSON [{"text", "source", "id"}], "derived": JSON [PromptSpec dicts]}

Resumable and deduplicated by prompt identity: a restart reads every shard's metadata, skips the
prompts already done and re-queues the self-instruct follow-ups they produced. A crash mid-batch
loses only that batch. Held-out samples are chosen by a hash of the prompt (see `is_heldout`).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.train.prompt_source import PromptSpec, base_prompts, clean_followup

SHARD_GLOB = "shard-*.safetensors"


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def is_heldout(pid: str, every: int = 50) -> bool:
    """1 prompt in `every` (by hash) is held out from training."""
    return int(pid, 16) % every == 0


@dataclass(frozen=True, slots=True)
class Generated:
    prompt: list[int]
    answer: list[int]  # greedy tokens, EOS included when reached
    hidden: torch.Tensor  # [len(prompt) + len(answer) - 1, H]
    taps: torch.Tensor  # [same, 3H]


class FeatureHooks:
    """Forward hooks on a transformers Llama-style model capturing the final-norm output and the
    inputs of the EAGLE-3 tap layers, for the current forward call."""

    def __init__(self, model) -> None:
        inner = model.model
        n = len(inner.layers)
        self.tap_layers = (2, n // 2, n - 3)
        self.taps: dict[int, torch.Tensor] = {}
        self.hidden: torch.Tensor | None = None
        self._handles = [inner.norm.register_forward_hook(self._on_norm)]
        for i in self.tap_layers:
            self._handles.append(inner.layers[i].register_forward_pre_hook(
                self._on_layer(i), with_kwargs=True))

    def _on_norm(self, module, args, output) -> None:
        self.hidden = output.detach()

    def _on_layer(self, i: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.taps[i] = x.detach()
        return hook

    def taps_cat(self) -> torch.Tensor:
        return torch.cat([self.taps[i] for i in self.tap_layers], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def generate_batch(model, hooks: FeatureHooks, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: set[int], pad_id: int, feat_dtype: torch.dtype = torch.bfloat16,
                   on_step=None) -> list[Generated]:
    """Greedy-generate every prompt (left padded) and keep the features of every fed token.
    Finished sequences leave the batch (their cache rows are dropped), so a long answer does not
    keep paying for the short ones."""
    from transformers import DynamicCache

    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    dev = model.device
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    # transformers >= 5.x names the argument `cache` (`past_key_values` is deprecated, to go in 5.40)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{cache_arg: cache})
    hid = hooks.hidden.to("cpu", feat_dtype)  # [B, width, H]
    tap = hooks.taps_cat().to("cpu", feat_dtype)
    feats_h = [[hid[i, width - len(p):]] for i, p in enumerate(prompts)]
    feats_t = [[tap[i, width - len(p):]] for i, p in enumerate(prompts)]
    answers: list[list[int]] = [[] for _ in range(b)]
    alive = list(range(b))  # sample index of each cache row
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)  # [b_alive]
        nxt_cpu = nxt.cpu().tolist()
        keep = []
        for row, i in enumerate(alive):
            answers[i].append(nxt_cpu[row])
            if nxt_cpu[row] not in eos_ids:
                keep.append(row)
        if on_step:
            on_step(len(alive))
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            sel = torch.tensor(keep, device=dev)
            cache.batch_select_indices(sel)
            mask, last_pos, nxt = mask[sel], last_pos[sel], nxt[sel]
            alive = [alive[r] for r in keep]
        mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=torch.long, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        hid = hooks.hidden.to("cpu", feat_dtype)  # [b_alive, 1, H]
        tap = hooks.taps_cat().to("cpu", feat_dtype)
        for row, i in enumerate(alive):
            feats_h[i].append(hid[row])
            feats_t[i].append(tap[row])
    result = []
    for i, p in enumerate(prompts):
        n = len(p) + len(answers[i]) - 1  # features of prompt + answer[:-1]
        result.append(Generated(p, answers[i], torch.cat(feats_h[i])[:n], torch.cat(feats_t[i])[:n]))
    return result


def write_shard(path: Path, gens: list[Generated], specs: list[PromptSpec],
                derived: list[PromptSpec]) -> int:
    """One shard (atomically) of the samples with >= 2 answer tokens (the others are listed in the
    metadata with written=false). Returns the number of answer tokens written."""
    from safetensors.torch import save_file

    written = [len(g.answer) >= 2 for g in gens]
    tokens, nxt, offsets, plens, hidden, taps = [], [], [0], [], [], []
    for g in [g for g, w in zip(gens, written) if w]:
        seq = g.prompt + g.answer[:-1]
        tokens += seq
        nxt += [-1] * (len(g.prompt) - 1) + g.answer
        offsets.append(offsets[-1] + len(seq))
        plens.append(len(g.prompt))
        hidden.append(g.hidden)
        taps.append(g.taps)
    meta = {"prompts": json.dumps([{"text": s.text, "source": s.source, "id": prompt_id(s.text),
                                    "written": w} for s, w in zip(specs, written)]),
            "derived": json.dumps([asdict(d) for d in derived]),
            "answer_tokens": str(sum(len(g.answer) for g, w in zip(gens, written) if w))}
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32), "next": torch.tensor(nxt, dtype=torch.int32),
               "offsets": torch.tensor(offsets, dtype=torch.int64),
               "prompt_lens": torch.tensor(plens, dtype=torch.int32),
               "hidden": torch.cat(hidden).contiguous(), "taps": torch.cat(taps).contiguous()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return int(meta["answer_tokens"])


def read_metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def scan(out: Path) -> tuple[set[str], list[PromptSpec], int, int]:
    """(done prompt ids, derived prompts, answer tokens so far, next shard index) of a data dir."""
    done, derived, tokens, last = set(), [], 0, -1
    for p in sorted(out.glob(SHARD_GLOB)):
        meta = read_metadata(p)
        done |= {d["id"] for d in json.loads(meta["prompts"])}
        derived += [PromptSpec(**d) for d in json.loads(meta["derived"])]
        tokens += int(meta["answer_tokens"])
        last = max(last, int(p.stem.split("-")[1]))
    return done, derived, tokens, last + 1


def pending_prompts(base: list[PromptSpec], derived: list[PromptSpec], done: set[str]) -> list[PromptSpec]:
    """Derived (self-instruct follow-up) prompts first, then the base list; done and duplicates
    dropped."""
    seen = set(done)
    out = []
    for s in derived + base:
        pid = prompt_id(s.text)
        if pid not in seen:
            seen.add(pid)
            out.append(s)
    return out


def load_hf_target(model_dir: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(transformers model, tokenizer, model dir) for a HF directory or the default model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None or model_dir.endswith(".gguf"):
        from services.model.loading import converted_gguf_dir, find_default_gguf

        model_dir = str(converted_gguf_dir(Path(model_dir or find_default_gguf())))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, tok, model_dir


def run(out: Path, specs: list[PromptSpec], model, tok, max_tokens: int, batch: int,
        max_new_tokens: int, max_prompt_tokens: int, log=sys.stderr) -> int:
    """Generate until `max_tokens` answer tokens are on disk or prompts run out. Returns the total."""
    from tqdm import tqdm

    from services.train.data import chat_ids

    out.mkdir(parents=True, exist_ok=True)
    done, derived, total, shard_idx = scan(out)
    eos = {int(tok.eos_token_id)} | set(_as_list(model.generation_config.eos_token_id))
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    hooks = FeatureHooks(model)
    bar = tqdm(total=max_tokens, initial=min(total, max_tokens), unit="tok", desc="answer tokens",
               file=log, mininterval=10, smoothing=0.05, dynamic_ncols=False, ncols=110)
    try:
        while total < max_tokens:
            pending = pending_prompts(specs, derived, done)
            if not pending:
                print("no prompts left", file=log)
                break
            window = []
            for s in pending:
                ids = chat_ids(tok, s.text)
                if len(ids) <= max_prompt_tokens:
                    window.append((s, ids))
                else:
                    done.add(prompt_id(s.text))  # too long: skipped for good (not written)
                if len(window) >= 4 * batch:
                    break
            window.sort(key=lambda x: len(x[1]))
            for k in range(0, len(window), batch):
                chunk = window[k:k + batch]
                t0 = time.perf_counter()
                gens = generate_batch(model, hooks, [c[1] for c in chunk], max_new_tokens, eos, pad,
                                      on_step=bar.update)
                new = []
                for (s, _), g in zip(chunk, gens):
                    if s.followup and g.answer:
                        text = clean_followup(tok.decode(g.answer, skip_special_tokens=True))
                        if text:
                            new.append(PromptSpec(s.followup.replace("{out}", text), "derived"))
                n = write_shard(out / f"shard-{shard_idx:06d}.safetensors", gens, [c[0] for c in chunk], new)
                dt = time.perf_counter() - t0
                shard_idx += 1
                total += n
                done |= {prompt_id(c[0].text) for c in chunk}
                derived += new
                print(f"\nshard {shard_idx - 1}: {len(chunk)} prompts, {n} answer tokens, {dt:.0f} s, "
                      f"{n / dt:.1f} tok/s, total {total}", file=log, flush=True)
                if total >= max_tokens:
                    break
    finally:
        bar.close()
        hooks.remove()
    return total


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.train.datagen", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="shard directory (resumes if it has shards)")
    p.add_argument("--target", default=None, help="HF model dir or .gguf (default: the default model)")
    p.add_argument("--prompts", default=None,
                   help="a .jsonl/.txt prompt file instead of the built-in sources (e.g. dev prompts for evaluation)")
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="stop after this many answer tokens")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if os.environ.get("AERIE_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    model, tok, model_dir = load_hf_target(args.target, device=args.device)
    if args.prompts:
        from services.train.data import load_prompts

        specs = [PromptSpec(t, "file") for t in load_prompts(args.prompts)]
    else:
        specs = base_prompts(args.seed)
    print(f"{model_dir}: {len(specs)} base prompts, writing to {args.out}", file=sys.stderr, flush=True)
    total = run(Path(args.out), specs, model, tok, args.max_tokens, args.batch, args.max_new_tokens,
                args.max_prompt_tokens)
    print(f"done: {total} answer tokens in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
