"""Self-distillation of an EAGLE head on a target's own continuations (training-time test).

    collect(target, prompts)  -> [Sample]     the target's greedy continuations and their features
    head_loss(head, sample)   -> (loss, acc)  unrolled over `steps` draft steps, as inference runs them

Step 0 is the ordinary EAGLE objective: row t pairs token t+1 with the target feature of token t and
predicts token t+2 (cross-entropy through the head's logits) and, for EAGLE-1/2, the feature of token
t+1 (SmoothL1, weight 1; cross-entropy weight 0.1 as the reference). Step s >= 1 feeds the head's own
step s-1 output back at the same row, one position further, attending to the committed rows <= t and
to its own earlier steps: exactly the keys a depth-s tree node sees at inference (eagle.md 6.2).
Step s is weighted 0.8**s. It does not batch, schedule or checkpoint; the CLI trainer does that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.eagle_head import DraftHead
from services.model.target import TargetModel


@dataclass(frozen=True, slots=True)
class Sample:
    tokens: torch.Tensor  # [T] prompt + continuation
    features: torch.Tensor  # [T, F] target features (post-norm hidden or EAGLE-3 taps)
    hidden: torch.Tensor  # [T, H] post-norm hidden (EAGLE-1/2 regression target)
    next_tokens: torch.Tensor  # [T] the target's argmax after each token
    loss_mask: torch.Tensor  # [T] 1 where the next token is a target-generated one


@torch.no_grad()
def collect(target: TargetModel, prompt: list[int], max_new_tokens: int, want_taps: bool) -> Sample:
    """Greedy-continue `prompt` with the target and record features of the whole sequence."""
    cache = target.new_cache(len(prompt) + max_new_tokens + 1)
    ids = torch.tensor(prompt)
    out = target(ids, cache, logits_for="last")
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(out.logits[-1].argmax()))
        out = target(torch.tensor(seq[-1:]), cache, logits_for="last")
    tokens = torch.tensor(seq)
    full = target(tokens, target.new_cache(len(seq)), want_taps=want_taps)
    mask = torch.zeros(len(seq))
    mask[len(prompt) - 1:] = 1.0
    feats = full.taps if want_taps else full.hidden
    return Sample(tokens, feats.float(), full.hidden.float(), full.logits.argmax(-1), mask)


@dataclass(frozen=True, slots=True)
class VocabSubset:
    """A reduced draft vocabulary for the loss: `used` [K] ascending target ids (draft_vocab.select)
    and `index` [V] long, the draft id of each target id or -1. For an EAGLE-1/2 head the logits are
    the target lm_head rows `used`; for an EAGLE-3 head the head's own K-row lm_head (its d2t)."""
    used: torch.Tensor  # [K]
    index: torch.Tensor  # [V]

    @staticmethod
    def of(used: torch.Tensor, vocab_size: int) -> "VocabSubset":
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[used] = torch.arange(used.shape[0])
        return VocabSubset(used.long(), index)


@dataclass(frozen=True, slots=True)
class StepStats:
    """Per unrolled step (draft position s + 1): [steps] counts over the trained rows."""
    rows: torch.Tensor  # rows scored
    top1: torch.Tensor  # rows whose top-1 draft equals the target's token
    topk: torch.Tensor  # rows whose target token is in the draft's top-k


def head_loss(head: DraftHead, s: Sample, steps: int = 3, noise_std: float = 0.0,
              vloss_weight: float = 1.0, ploss_weight: float = 0.1, vocab: VocabSubset | None = None,
              topk: int = 4, step_decay: float = 0.8, stats: list | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrolled training loss over rows 0..T-2; returns (loss, step-0 top-1 agreement).

    `vocab` restricts the cross-entropy to a reduced vocabulary (rows whose target token is outside
    it keep only the feature regression); None = the head's own vocabulary (d2t for EAGLE-3).
    `stats`, if a list, receives one StepStats (top-1 / top-k hits per step)."""
    t = s.tokens.shape[0] - 1  # rows: (token r+1, feature r)
    ids = s.tokens[1:].long()  # [t]
    feats = s.features[:t].float()
    if noise_std > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * noise_std
    cache = head.new_cache(t * steps)
    eye = torch.eye(t, dtype=torch.bool)
    mask_blocks = [torch.ones(t, t, dtype=torch.bool).tril()]
    x, pos = feats, torch.arange(t)
    total = torch.zeros(())
    acc = torch.zeros(())
    is_eagle2 = head.feature_kind == "hidden"
    if vocab is not None and not is_eagle2 and getattr(head, "d2t", None) is None:
        raise ValueError("a reduced vocabulary for an EAGLE-3 head comes from its d2t")
    weight = head._target_head[0].weight if (is_eagle2 and vocab is not None) else None
    w_sub = weight[vocab.used].float() if weight is not None else None
    rows_n, hit1, hitk = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    for step in range(steps):
        n = t - step  # rows whose step-`step` input token exists
        if n < 2:
            break
        tree_mask = torch.cat(mask_blocks, dim=1)
        out = head(x, ids_shift(ids, step), cache, pos + step, tree_mask)  # [t, H]
        target_tok = s.next_tokens[1 + step: 1 + step + n].long().clamp(min=0)  # token after ids[r + step]
        if w_sub is not None:
            draft_target = vocab.index[target_tok]
        else:
            draft_target = _draft_ids(head, target_tok)
        trained = s.loss_mask[1 + step: 1 + step + n] > 0
        rows = torch.nonzero(trained & (draft_target >= 0)).flatten()
        step_loss = torch.zeros(())
        if rows.numel():
            picked = out[rows]  # only trained rows go through the vocabulary projection
            logits = picked.float() @ w_sub.T if w_sub is not None else head.logits(picked).float()
            labels = draft_target[rows]
            step_loss = F.cross_entropy(logits, labels)
            with torch.no_grad():
                top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices
                hit1[step] = (top[:, 0] == labels).sum()
                hitk[step] = (top == labels[:, None]).any(-1).sum()
            if step == 0:
                acc = (top[:, 0] == labels).float().mean()
        all_rows = torch.nonzero(trained).flatten()
        rows_n[step] = all_rows.numel()  # out-of-vocabulary targets count as misses
        if is_eagle2 and all_rows.numel():
            reg = F.smooth_l1_loss(out[all_rows].float(), s.hidden[1 + step + all_rows].float())
            step_loss = ploss_weight * step_loss + vloss_weight * reg
        total = total + (step_decay ** step) * step_loss
        x = out  # the next step consumes the head's own output at the same row
        mask_blocks.append(eye)
    if stats is not None:
        stats.append(StepStats(rows_n, hit1, hitk))
    return total, acc.detach()


def ids_shift(ids: torch.Tensor, step: int) -> torch.Tensor:
    """Tokens fed at step s: row r gets ids[r + s] (padded with the last token past the end)."""
    if step == 0:
        return ids
    return torch.cat([ids[step:], ids[-1:].expand(step)])


def _draft_ids(head: DraftHead, target_ids: torch.Tensor) -> torch.Tensor:
    """Map target ids to the columns of `head.logits` (-1 where a token has no draft id): the
    head's own d2t (EAGLE-3) or the reduced vocabulary it drafts from (`restrict_vocab`)."""
    if getattr(head, "d2t", None) is None and head.vocab_d2t is None:
        return target_ids
    cols = head.to_target(torch.arange(head.draft_vocab_size, device=target_ids.device))
    lookup = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    lookup[cols.cpu()] = torch.arange(cols.shape[0])
    return lookup[target_ids]
