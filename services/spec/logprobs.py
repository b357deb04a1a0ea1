"""The target's log-probabilities of the tokens a round commits (OpenAI's `logprobs` / `top_logprobs`).

    lp = token_logprobs(logits[rows], tokens, top)   # logits [n, V] of the rows that produced tokens [n]
    lp.logprobs[i], lp.top_ids[i], lp.top_logprobs[i]
    plp = prompt_logprobs(logits [c, V], tokens [c], top)   # a prefill chunk's rows, ROWS_PER_BLOCK at a time

The distribution is the target's own: log_softmax of its logits in fp32 before any sampling
processor (temperature, top-p/k, min-p, repetition penalty), as vLLM's default `raw_logprobs`, so the
numbers do not depend on the sampling settings and equal transformers' `log_softmax(model(x).logits)`.
Never the draft's: the verifier computes them from the target logits of the rows its acceptance read
(the root and the accepted nodes; the bonus comes from the last of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_ids: torch.Tensor  # [n] long: the committed tokens, in order
    logprobs: torch.Tensor  # [n] fp32: log p(token_ids[i] | its prefix)
    top_ids: torch.Tensor  # [n, k] long: the k most likely tokens at each position, most likely first
    top_logprobs: torch.Tensor  # [n, k] fp32: their log-probabilities
    ranks: torch.Tensor | None = None  # [n] long (prompt_logprobs only): 1 + the tokens more likely than token_ids[i]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def head(self, n: int) -> TokenLogprobs:
        """The first n positions (a round cut by a stop token or the token budget)."""
        return TokenLogprobs(self.token_ids[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n],
                             None if self.ranks is None else self.ranks[:n])

    @staticmethod
    def cat(parts: list[TokenLogprobs]) -> TokenLogprobs:
        ranked = [p.ranks for p in parts if len(p)] or [parts[0].ranks]  # (an empty part off the wire has none)
        ranks = torch.cat([r for r in ranked if r is not None]) if all(r is not None for r in ranked) else None
        return TokenLogprobs(torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]),
                             torch.cat([p.top_ids for p in parts]), torch.cat([p.top_logprobs for p in parts]), ranks)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor | list[int], top: int, ranks: bool = False
                   ) -> TokenLogprobs:
    """logits [n, V] (row i produced tokens[i]), tokens [n], top k >= 0 -> TokenLogprobs on the host
    (one copy); `ranks`: also each token's rank (1 = the most likely)."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = lp.gather(1, ids[:, None])[:, 0]  # [n]
    values, indices = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)  # [n, k]
    # [n]; an int32 sum of the comparison (a default sum promotes the [n, V] booleans to int64 first)
    rank = (lp > chosen[:, None]).sum(-1, dtype=torch.int32).add_(1).long().cpu() if ranks else None
    return TokenLogprobs(ids.cpu(), chosen.cpu(), indices.cpu(), values.cpu(), rank)


ROWS_PER_BLOCK = 256  # prompt rows per log_softmax: a [256, V] fp32 temporary, whatever the chunk's length


def prompt_logprobs(logits: torch.Tensor, tokens: torch.Tensor | list[int], top: int,
                    block: int = ROWS_PER_BLOCK) -> TokenLogprobs:
    """logits [n, V] of prompt rows (row i predicts tokens[i], i.e. the prompt token after the row's
    own), tokens [n], top k -> TokenLogprobs of the n tokens (with ranks) on the host, `block` rows at a
    time so a long prefill chunk never holds a second [n, V] fp32 tensor."""
    n = int(logits.shape[0])
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    return TokenLogprobs.cat([token_logprobs(logits[i:i + block], tokens[i:i + block], top, ranks=True)
                              for i in range(0, max(n, 1), block)])
