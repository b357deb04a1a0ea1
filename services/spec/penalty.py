"""The repetition penalty (transformers' RepetitionPenaltyLogitsProcessor, vLLM's `repetition_penalty`),
applied to the target's logits of every row a verifier forward scores, each row with its own context.

    seen = SeenTokens(vocab_size, device); seen.add(prompt)    # the tokens of the sequence's context
    logits = seen.penalize(logits, params.repetition_penalty,    # each tree node with its own context,
                           tree.tokens, tree.mask)               # then process_logits / acceptance
    seen.add(accepted tokens)                                   # after the round

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
    """The distinct token ids in a sequence's committed context, on the logits' device: as a mask
    [V] bool and as a list [C] long (C distinct ids), kept in step with a host set."""

    def __init__(self, vocab_size: int, device: str | torch.device) -> None:
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        self.ids = torch.zeros(0, dtype=torch.long, device=device)  # [C]
        self._host: set[int] = set()

    def add(self, tokens: torch.Tensor | list[int]) -> None:
        """tokens [n] long on the host (a prompt, committed tokens): now part of the context."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        new = [t for t in dict.fromkeys(ids) if t not in self._host]
        if new:
            self._host.update(new)
            fresh = torch.tensor(new, dtype=torch.long, device=self.mask.device)
            self.ids = torch.cat([self.ids, fresh])
            self.mask[fresh] = True

    def penalize(self, logits: torch.Tensor, penalty: float, tokens: torch.Tensor | None = None,
                 ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, V] -> penalised logits [R, V] fp32 (a new tensor). Without `tokens` every row
        has the committed context (prefill and decode rows). With a tree, tokens [N] long and
        ancestors [N, N] bool (row i: node i and its ancestors): row i's context also holds the
        tokens of its root-to-i path. Example: context {1}, tokens [7, 3, 9], parents [-1, 0, 0]:
        row 2 penalises {1, 7, 9}. Cost O(R * C + N^2) on the device and no host sync: the context's
        columns in every row, then each row's path tokens (gathered, penalised unless already in the
        context, scattered back; a token twice on a path writes the same value twice)."""
        x = logits.float().clone()
        if self.ids.numel():
            x[:, self.ids] = _penalized(x[:, self.ids], penalty)
        if tokens is not None:
            assert ancestors is not None, "a tree's tokens need its ancestors mask"
            tokens = tokens.to(self.mask.device)
            n = tokens.shape[0]
            index = tokens[None].expand(n, -1)  # [N, N]: column tokens[j] in every row
            same = (tokens[:, None] == tokens[None, :]).float()  # [N, N]: nodes k and j hold one token
            on_path = (ancestors.to(self.mask.device).float() @ same) > 0  # [N, N]: tokens[j] on i's path
            apply = on_path & ~self.mask[tokens][None]  # not penalised twice
            values = x.gather(1, index)
            x.scatter_(1, index, torch.where(apply, _penalized(values, penalty), values))
        return x


def _penalized(x: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' rule for a token in the context: logit / penalty when positive, * penalty when not."""
    return torch.where(x < 0, x * penalty, x / penalty)
