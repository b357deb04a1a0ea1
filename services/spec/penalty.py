"""The repetition penalty (transformers' RepetitionPenaltyLogitsProcessor, vLLM's `repetition_penalty`),
applied to the target's logits of every row a verifier forward scores, each row with its own context.

    seen = SeenTokens(vocab_size, device); seen.add(prompt)   # the tokens of the sequence's context
    rows = seen.tree_rows(tree.tokens, tree.mask)              # [N, V]: context of each tree node
    logits = penalize(logits, rows, params.repetition_penalty) # then process_logits / acceptance
    seen.add(accepted tokens)                                  # after the round

A token already in the context has its logit divided by the penalty when positive and multiplied by
it when negative (penalty > 1 discourages repeats). The context of tree node n is the sequence's
committed tokens (prompt included, as transformers and vLLM count it) plus the root-to-n path, n
included: the tokens the target has seen when its logits at n predict the next token. Penalising each
node with exactly the context plain decoding would have keeps speculative sampling lossless: the
acceptance rule compares draft tokens against this penalised target distribution. This module does
not temper or filter (services/spec/sampling.py does, after it).
"""

from __future__ import annotations

import torch


class SeenTokens:
    """The token ids in a sequence's committed context, as a mask [V] bool on the logits' device."""

    def __init__(self, vocab_size: int, device: str | torch.device) -> None:
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]

    def add(self, tokens: torch.Tensor | list[int]) -> None:
        """tokens [n] long: now part of the committed context."""
        self.mask[torch.as_tensor(tokens, dtype=torch.long, device=self.mask.device)] = True

    def tree_rows(self, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """tokens [N] long, ancestors [N, N] bool (row i: node i and its ancestors) -> [N, V] bool:
        the context of each node. Example: tokens [7, 3, 9], parents [-1, 0, 0] -> row 2 adds {7, 9}.
        One scatter on the mask's device, no host sync: row i, column tokens[j] takes the max of
        itself and ancestors[i, j]."""
        n = tokens.shape[0]
        rows = self.mask.to(torch.uint8)[None].repeat(n, 1)  # [N, V]
        index = tokens.to(self.mask.device)[None].expand(n, -1)  # [N, N]: column tokens[j] in every row
        rows.scatter_reduce_(1, index, ancestors.to(self.mask.device, torch.uint8), reduce="amax")
        return rows.bool()


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [N, V], seen [N, V] bool -> penalised logits [N, V] fp32 (a new tensor)."""
    x = logits.float()
    if penalty == 1.0:
        return x
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
