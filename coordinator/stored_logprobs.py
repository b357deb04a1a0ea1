"""Log-probabilities as the sequence store keeps them: one JSON entry per committed token, so that
Resume (any coordinator, after a break) streams the same log-probabilities the Generate stream did.

    rows = to_rows(lp)                  # TokenLogprobs of n tokens -> n strings '[lp, [ids], [lps]]'
    lp = from_rows(tokens, rows)        # back, for the tokens they belong to

Only sequences that asked for log-probabilities store them (up to 1 + 2 x 20 numbers per token).
"""

from __future__ import annotations

import json

import torch

from services.spec.logprobs import TokenLogprobs


def to_rows(lp: TokenLogprobs) -> list[str]:
    """One entry per token: [logprob, [top ids], [top logprobs]] (the token id is the tokens list's)."""
    return [json.dumps([float(lp.logprobs[i]), lp.top_ids[i].tolist(), lp.top_logprobs[i].tolist()],
                       separators=(",", ":")) for i in range(len(lp))]


def from_rows(tokens: list[int], rows: list[str]) -> TokenLogprobs:
    """The TokenLogprobs of `tokens` from their entries (len(rows) == len(tokens); k may be 0)."""
    parsed = [json.loads(r) for r in rows]
    k = len(parsed[0][1]) if parsed else 0
    return TokenLogprobs(torch.tensor(tokens, dtype=torch.long),
                         torch.tensor([p[0] for p in parsed], dtype=torch.float32),
                         torch.tensor([p[1] for p in parsed], dtype=torch.long).reshape(len(parsed), k),
                         torch.tensor([p[2] for p in parsed], dtype=torch.float32).reshape(len(parsed), k))
