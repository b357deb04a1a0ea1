"""Speed measurement on a prompt set, in one process and one run, so ratios are fair on a noisy machine.

Methods (greedy, batch 1, the same weights and the same stopping rule: EOS or max_new_tokens):
  hf        transformers `generate` (the baseline every ratio is taken against)
  native    aerie's target with no draft (plain decoding)
  eagle     aerie EAGLE-2 in process (the auto budget unless --tree-* fixes the shape)
  sam       retrieval drafts only (suffix index over prompt + output), verified by the target
  eagle+sam EAGLE trees with retrieved chains joined when the cost model says they pay
  pipeline  aerie through the distributed services (when a coordinator address is given)

Per method and per category: tokens/s (generated tokens over wall time, prefill included), speed-up
over hf, tau (tokens per target forward after the prefill), mean round latency split into draft /
verify / other, and the share of prompts whose tokens equal hf's (exact in fp32; the bf16 share is
reported, not asserted). Next to the end-to-end numbers, the decode-only ones (the prefill excluded:
speculation cannot speed the prefill up, and on long prompts it is much of the wall time):
  vs_plain         end-to-end tokens/s over aerie plain decoding's (method `native`) in the same run
  decode_tokens_per_s   tokens after the first / (wall time - prefill), prefill = the engine's own
                   prefill time (round 0's verify_s; hf's generate exposes none: None)
  decode_vs_plain  that rate over plain decoding's; prefill_share = prefill / wall time
and per round what the budget chose: retrieved chain tokens proposed / accepted, the shares of rounds
with a retrieved chain, with a draft-head tree, and with neither (plain steps).
It does not print or plot: `report.py` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.engine import Engine, GenerationRequest, RoundOutput
from services.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Prompt:
    question_id: str
    category: str
    ids: tuple[int, ...]


@dataclass(slots=True)
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    rounds: int = 0  # target forwards after the prefill
    round_s: float = 0.0  # wall time of those rounds (draft + verify + other)
    draft_s: float = 0.0
    verify_s: float = 0.0
    tree_nodes: int = 0  # nodes verified over all rounds (0 for plain rounds)
    pred_tokens: float = 0.0  # the budget's predictions summed over the rounds that had one
    pred_s: float = 0.0
    pred_rounds_s: float = 0.0  # measured wall time of those rounds
    pred_rounds_tokens: int = 0  # and their committed tokens
    prefill_s: float = 0.0  # the engine's prefill (0 = not measured: hf)
    chain_proposed: int = 0  # retrieved chain tokens verified over all rounds
    chain_accepted: int = 0  # and accepted
    chain_rounds: int = 0  # rounds that verified a retrieved chain
    eagle_rounds: int = 0  # rounds that verified a draft-head tree
    drafted_rounds: int = 0  # rounds that verified either (the rest were plain steps)
    drafted_tokens: int = 0  # tokens those rounds gave the stream (as tau counts them)
    ahead_rounds: int = 0  # rounds that drafted the next tree ahead (overlapping their verify)
    ahead_hits: int = 0  # rounds whose tree was drafted ahead (the previous round's guess hit)
    saved_s: float = 0.0  # draft seconds the hit rounds did not wait for
    ahead_wait_s: float = 0.0  # seconds rounds waited for an ahead draft after the verifier answered


@dataclass(slots=True)
class Summary:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    round_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    tree_nodes: int = 0
    pred_tokens: float = 0.0
    pred_s: float = 0.0
    pred_rounds_s: float = 0.0
    pred_rounds_tokens: int = 0
    prefill_s: float = 0.0
    chain_proposed: int = 0
    chain_accepted: int = 0
    chain_rounds: int = 0
    eagle_rounds: int = 0
    drafted_rounds: int = 0
    drafted_tokens: int = 0
    ahead_rounds: int = 0
    ahead_hits: int = 0
    saved_s: float = 0.0
    ahead_wait_s: float = 0.0
    exact: int = 0
    per_prompt_tps: list[float] = field(default_factory=list)

    def add(self, run: Run, exact: bool) -> None:
        self.prompts += 1
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.rounds += run.rounds
        self.round_s += run.round_s
        self.draft_s += run.draft_s
        self.verify_s += run.verify_s
        self.tree_nodes += run.tree_nodes
        self.pred_tokens += run.pred_tokens
        self.pred_s += run.pred_s
        self.pred_rounds_s += run.pred_rounds_s
        self.pred_rounds_tokens += run.pred_rounds_tokens
        self.prefill_s += run.prefill_s
        self.chain_proposed += run.chain_proposed
        self.chain_accepted += run.chain_accepted
        self.chain_rounds += run.chain_rounds
        self.eagle_rounds += run.eagle_rounds
        self.drafted_rounds += run.drafted_rounds
        self.drafted_tokens += run.drafted_tokens
        self.ahead_rounds += run.ahead_rounds
        self.ahead_hits += run.ahead_hits
        self.saved_s += run.saved_s
        self.ahead_wait_s += run.ahead_wait_s
        self.exact += int(exact)
        self.per_prompt_tps.append(len(run.tokens) / run.seconds if run.seconds > 0 else 0.0)

    def decode_rate(self) -> float | None:
        """Tokens after the first per second of wall time after the prefill (None: prefill not measured)."""
        decode_s = self.seconds - self.prefill_s
        if self.prefill_s <= 0 or decode_s <= 0:
            return None
        return (self.tokens - self.prompts) / decode_s

    def row(self, baseline: "Summary | None", plain: "Summary | None" = None) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        base = baseline.tokens / baseline.seconds if baseline and baseline.seconds else None
        plain_tps = plain.tokens / plain.seconds if plain and plain.seconds else None
        dec, plain_dec = self.decode_rate(), plain.decode_rate() if plain else None
        per_rd = (lambda x: round(x / self.rounds, 3)) if self.rounds and self.prefill_s > 0 else (lambda x: None)
        # tau: tokens per target forward after the prefill (the prefill makes the first token)
        tau = (self.tokens - self.prompts) / self.rounds if self.rounds else None
        # a time that sums to exactly 0 s was not measured: transformers' generate exposes no rounds (hf),
        # plain decoding drafts nothing (native): None, which the table prints as "-"
        per_round = (lambda x: round(1000 * x / self.rounds, 3) if x > 0 else None) if self.rounds \
            else (lambda x: None)
        return {
            "prompts": self.prompts, "tokens": self.tokens, "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tps, 3),
            "speedup": round(tps / base, 4) if base else None,
            "tau": round(tau, 4) if tau is not None else None,
            # tau over the rounds that verified a draft (the others commit exactly one token)
            "tau_drafted": round(self.drafted_tokens / self.drafted_rounds, 4) if self.drafted_rounds else None,
            "round_ms": per_round(self.round_s), "draft_ms": per_round(self.draft_s),
            "verify_ms": per_round(self.verify_s),
            "other_ms": per_round(self.round_s - self.draft_s - self.verify_s) if self.round_s > 0 else None,
            "exact_match": round(self.exact / self.prompts, 4) if self.prompts else None,
            "mean_tree": round(self.tree_nodes / self.rounds, 2) if self.rounds else None,
            # the cost model's prediction for the rounds it planned, next to their measured rate
            "predicted_tokens_per_s": round(self.pred_tokens / self.pred_s, 3) if self.pred_s else None,
            "measured_round_tokens_per_s":
                round(self.pred_rounds_tokens / self.pred_rounds_s, 3) if self.pred_rounds_s else None,
            # end to end over aerie plain decoding, then the decode-only rate (prefill excluded)
            "vs_plain": round(tps / plain_tps, 4) if plain_tps else None,
            "prefill_share": round(self.prefill_s / self.seconds, 4) if self.prefill_s > 0 and self.seconds else None,
            "decode_tokens_per_s": round(dec, 3) if dec is not None else None,
            "decode_vs_plain": round(dec / plain_dec, 4) if dec is not None and plain_dec else None,
            # what the budget chose, per round after the prefill
            "chain_per_round": per_rd(self.chain_proposed),
            "chain_accepted_per_round": per_rd(self.chain_accepted),
            "chain_round_share": per_rd(self.chain_rounds),
            "eagle_round_share": per_rd(self.eagle_rounds),
            "plain_round_share": per_rd(self.rounds - self.drafted_rounds),
            # drafting ahead: the share of rounds that drafted the next tree ahead; of those, the
            # guesses that hit; and the share of the round time the hits saved (their draft seconds)
            "ahead_share": per_rd(self.ahead_rounds) if self.ahead_rounds else None,
            "guess_hit_rate": round(self.ahead_hits / self.ahead_rounds, 4) if self.ahead_rounds else None,
            "saved_share": round(self.saved_s / (self.round_s + self.saved_s), 4)
            if self.ahead_rounds and self.round_s > 0 else None,
        }


def load_prompts(path: str | Path, tokenizer, limit: int = 0, per_category: int = 0,
                 categories: Sequence[str] = ()) -> list[Prompt]:
    """Spec-Bench JSONL: question_id, category, turns (first turn, chat template applied).
    `per_category` keeps the first N of each category (the file is ordered by category);
    `categories` (empty = all) keeps only those categories, each of which must occur in the file."""
    from services.train.data import chat_ids, read_jsonl

    out = []
    seen: set[str] = set()
    for i, row in read_jsonl(path):
        try:
            text = row["turns"][0]
        except (KeyError, IndexError, TypeError):
            raise InvalidRequest(f"{path}:{i} is not a Spec-Bench row (question_id, category, turns)") from None
        category = str(row.get("category", "all"))
        seen.add(category)
        if categories and category not in categories:
            continue
        if per_category and sum(p.category == category for p in out) >= per_category:
            continue
        out.append(Prompt(str(row.get("question_id", i)), category, tuple(chat_ids(tokenizer, text))))
        if limit and len(out) >= limit:
            break
    missing = sorted(set(categories) - seen) if not limit or len(out) < limit else []
    if missing:
        raise InvalidRequest(f"prompt file {path} has no category {', '.join(map(repr, missing))}; "
                             f"it has {', '.join(sorted(seen))}")
    if not out:
        raise InvalidRequest(f"prompt file {path} has no prompts")
    return out


def run_engine(engine: Engine, prompt: Prompt, max_new_tokens: int) -> Run:
    return run_steps(lambda: engine.generate(GenerationRequest(prompt.ids, max_new_tokens)))


def run_steps(start: Callable[[], Iterator[RoundOutput]]) -> Run:
    """Time a stream of StepOutputs: total wall time, and per round the draft / verify split."""
    run = Run(tokens=[], seconds=0.0)
    t0 = time.perf_counter()
    last = t0
    for step in start():
        now = time.perf_counter()
        run.tokens += step.tokens
        if step.stats.round_index == 0:
            run.prefill_s = step.stats.verify_s
        if step.stats.round_index > 0:
            run.chain_proposed += step.stats.chain
            run.chain_accepted += step.stats.chain_accepted
            run.chain_rounds += int(step.stats.chain > 0)
            run.eagle_rounds += int(step.stats.eagle_nodes > 0)
            drafted = step.stats.chain > 0 or step.stats.eagle_nodes > 0
            run.drafted_rounds += int(drafted)
            run.drafted_tokens += len(step.tokens) if drafted else 0
            run.rounds += 1
            run.round_s += now - last
            if step.stats.round_index == 1:
                # round 1's tree was drafted inside the prefill step: count it in round 1
                run.round_s += step.stats.draft_s
            run.draft_s += step.stats.draft_s
            run.verify_s += step.stats.verify_s
            run.tree_nodes += step.stats.tree_size
            run.ahead_rounds += int(step.stats.ahead)
            run.ahead_hits += int(step.stats.ahead_hit)
            run.saved_s += step.stats.saved_s
            run.ahead_wait_s += step.stats.ahead_wait_s
            if step.stats.predicted_s > 0:
                run.pred_tokens += step.stats.predicted_tokens
                run.pred_s += step.stats.predicted_s
                run.pred_rounds_s += now - last + (step.stats.draft_s if step.stats.round_index == 1 else 0.0)
                run.pred_rounds_tokens += step.stats.accept_length
        last = now
    run.seconds = time.perf_counter() - t0
    return run


class HFBaseline:
    """transformers generate on the same converted weights, same dtype, same EOS ids."""

    def __init__(self, model_dir: str, dtype: torch.dtype, eos_ids: tuple[int, ...], device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.eos = list(eos_ids)

    @torch.no_grad()
    def run(self, prompt: Prompt, max_new_tokens: int) -> Run:
        ids = torch.tensor([prompt.ids], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=self.eos or None,
                                  pad_token_id=self.eos[0] if self.eos else 0)
        seconds = time.perf_counter() - t0
        tokens = out[0, len(prompt.ids):].tolist()
        for j, t in enumerate(tokens):  # generate pads after EOS; keep up to and including it
            if t in self.eos:
                tokens = tokens[: j + 1]
                break
        return Run(tokens=tokens, seconds=seconds, rounds=max(len(tokens) - 1, 0))


def summarize(runs: dict[str, list[Run]], prompts: list[Prompt], baseline: str = "hf", plain: str = "native"
              ) -> dict:
    """{"methods": {m: row}, "categories": {cat: {m: row}}} with exact match and `speedup` against
    `baseline`, and `vs_plain` / `decode_vs_plain` against `plain` (None when it did not run)."""
    methods: dict[str, Summary] = {m: Summary() for m in runs}
    cats: dict[str, dict[str, Summary]] = {}
    for i, prompt in enumerate(prompts):
        ref = runs[baseline][i].tokens
        for m, rs in runs.items():
            exact = rs[i].tokens == ref
            methods[m].add(rs[i], exact)
            cats.setdefault(prompt.category, {}).setdefault(m, Summary()).add(rs[i], exact)
    return {
        "methods": {m: s.row(methods[baseline], methods.get(plain)) for m, s in methods.items()},
        "categories": {c: {m: s.row(ms[baseline], ms.get(plain)) for m, s in ms.items()}
                       for c, ms in sorted(cats.items())},
    }

