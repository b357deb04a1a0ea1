"""The coordinator's text: prompts from text or chat messages, stop strings, and the text deltas of a
stream, all with the target's tokenizer (never its weights: services/text.py).

    text = Text.load(source)                        # source: --tokenizer, else the verifier's target
    ids = text.prompt_ids(request)                  # GenerateRequest -> prompt token ids
    engine = text.stop_engine(engine, request)      # cuts the sequence where a stop string completes
    stream = text.stream(request)                   # per Generate call: tokens -> text deltas
    delta, stop_at = stream.push(tokens); tail = stream.finish()

Stop strings are matched twice over the same tokens with the same `TextStream`: once on the run's
thread before each round is committed (`StopStringEngine`, so Redis keeps only the tokens up to and
including the one that completes the stop string) and once in the Generate stream for the text
deltas. Both are deterministic, so they agree on where the text ends.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from collections.abc import Iterator
from typing import Any

import grpc

from services.engine.engine import GenerationRequest, RoundOutput
from services.errors import CheckpointError, InvalidRequest
from services.rpc.errors import DownstreamError
from services.rpc.codec import encode_logprobs
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.spec.logprobs import TokenLogprobs
from services.stop_strings import StopMatcher, check_stops
from services.text import IncrementalDetokenizer, load_tokenizer

log = logging.getLogger("aerie.coordinator")


def served_name(target: str) -> str:
    """'/models/SmolLM2-135M-Instruct.Q8_0.gguf' -> 'SmolLM2-135M-Instruct.Q8_0' (the rule the
    verifier's metrics label shares: services/metrics.py `model_label`)."""
    from services.metrics import model_label

    return model_label(target)


class TextStream:
    """Tokens -> text deltas (cut before the first stop string). One per sequence."""

    def __init__(self, tokenizer: Any | None, stops: tuple[str, ...], skip_special_tokens: bool) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.matcher = StopMatcher(stops)

    def push(self, tokens: list[int]) -> tuple[str, int | None]:
        """(text released by these tokens, index of the token that completed a stop string or None)."""
        if self.detok is None:
            return "", None
        out = []
        for i, t in enumerate(tokens):  # token by token: the stop's position is a token index
            text, hit = self.matcher.push(self.detok.push([t]))
            out.append(text)
            if hit:
                return "".join(out), i
        return "".join(out), None

    def finish(self) -> str:
        """The held-back text once the sequence has ended."""
        if self.detok is None:
            return ""
        text, _hit = self.matcher.push(self.detok.flush())
        return text + self.matcher.flush()


class StopStringEngine:
    """An Engine whose `generate` ends the sequence at the token that completes a stop string: that
    round's tokens are cut after it and its finish_reason is "stop"; the inner generation is closed
    (which releases the KV on both services). Everything else is the wrapped engine's."""

    def __init__(self, engine: Any, make_stream, primer: tuple[int, ...] = ()) -> None:
        """`primer`: tokens committed before this engine's first round (a take-over: every committed
        token but the last, which its rebuilt round 0 yields), pushed first so that a stop string that
        spans them and the new ones still completes."""
        self._engine = engine
        self._make_stream = make_stream
        self._primer = primer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, req: GenerationRequest, seq_id: str | None = None, round_base: int = 0
                 ) -> Iterator[RoundOutput]:
        stream = self._make_stream()
        stream.push(list(self._primer))  # already checked by the coordinator that committed them
        rounds = self._engine.generate(req, seq_id, round_base)
        try:
            for out in rounds:
                _text, cut = stream.push(out.tokens)
                if cut is not None:
                    yield replace(out, tokens=out.tokens[:cut + 1], finish_reason="stop",
                                  logprobs=out.logprobs.head(cut + 1) if out.logprobs is not None else None)
                    return
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            rounds.close()


class Text:
    def __init__(self, tokenizer: Any | None, source: str, unavailable: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.unavailable = unavailable  # why the tokenizer cannot be loaded yet (no verifier answers)

    @classmethod
    def load(cls, source: str | None) -> Text:
        """The tokenizer of `source` (a directory or .gguf); 'none' or no tokenizer = token ids only."""
        if not source or source == "none":
            return cls(None, source or "none")
        try:
            tok = load_tokenizer(source)
        except (OSError, ValueError, CheckpointError) as e:
            log.warning("no tokenizer from %s (%s): token ids only", source, e)
            tok = None
        if tok is None:
            log.warning("%s has no tokenizer: the coordinator accepts token ids only", source)
        return cls(tok, source)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def _need_tokenizer(self, field: str) -> Any:
        if self.unavailable is not None:
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE, f"{field} needs the tokenizer: {self.unavailable}")
        if self.tokenizer is None:
            raise InvalidRequest(f"{field} needs a tokenizer and this coordinator has none (from {self.source!r}; "
                                 f"set --tokenizer / AERIE_TOKENIZER) : send prompt_ids")
        return self.tokenizer

    def prompt_ids(self, msg: cpb.GenerateRequest) -> list[int]:
        """The prompt's token ids from exactly one of prompt_ids, prompt and messages."""
        given = [name for name, present in (("prompt_ids", len(msg.prompt_ids) > 0),
                                            ("prompt", msg.HasField("prompt")),
                                            ("messages", len(msg.messages) > 0)) if present]
        if len(given) > 1:
            raise InvalidRequest(f"give exactly one of prompt_ids, prompt and messages; got {' and '.join(given)}")
        if not given or given[0] == "prompt_ids":
            return list(msg.prompt_ids)  # empty: the engine's validate names it
        tok = self._need_tokenizer(given[0])
        if given[0] == "prompt":
            if not msg.prompt:
                raise InvalidRequest("prompt is an empty string: give at least one character")
            return list(tok.encode(msg.prompt))
        for i, m in enumerate(msg.messages):
            if not m.role:
                raise InvalidRequest(f"messages[{i}].role is empty")
        if msg.skip_chat_template:
            text = "".join(m.content for m in msg.messages)
            if not text:
                raise InvalidRequest("messages have no content (skip_chat_template joins their contents)")
            return list(tok.encode(text))
        if not self.has_chat_template:
            raise InvalidRequest(f"the tokenizer of {self.source!r} has no chat template: send prompt, "
                                 f"or messages with skip_chat_template")
        chat = [{"role": m.role, "content": m.content} for m in msg.messages]
        try:
            text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception: the template refused the roles
            raise InvalidRequest(f"the chat template refused the messages: {e}") from None
        return list(tok.encode(text, add_special_tokens=False))

    def tokenize(self, msg: cpb.TokenizeRequest) -> cpb.TokenizeResponse:
        """A prompt or chat messages -> the token ids Generate would run (and each token's string)."""
        if msg.HasField("add_special_tokens") and msg.messages:
            raise InvalidRequest("add_special_tokens applies to prompt only (messages use the chat template)")
        if not msg.HasField("prompt") and not msg.messages:
            raise InvalidRequest("give prompt or messages")
        request = cpb.GenerateRequest(messages=msg.messages, skip_chat_template=msg.skip_chat_template)
        if msg.HasField("prompt"):
            request.prompt = msg.prompt
        tok = self._need_tokenizer("messages" if msg.messages else "prompt")
        if msg.HasField("add_special_tokens") and not msg.add_special_tokens:
            ids = list(tok.encode(msg.prompt, add_special_tokens=False))
        else:
            ids = self.prompt_ids(request)  # (the checks of Generate: one of prompt and messages, ...)
        return cpb.TokenizeResponse(tokens=ids, token_strs=[str(s) for s in tok.convert_ids_to_tokens(ids)])

    def detokenize(self, msg: cpb.DetokenizeRequest, vocab_size: int) -> cpb.DetokenizeResponse:
        tok = self._need_tokenizer("detokenize")
        for i, t in enumerate(msg.tokens):
            if not 0 <= t < vocab_size:
                raise InvalidRequest(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else False
        return cpb.DetokenizeResponse(text=tok.decode(list(msg.tokens), skip_special_tokens=skip))

    def logprobs(self, lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
        """A step's log-probabilities on the wire, each token also decoded alone (with a tokenizer)."""
        msg = encode_logprobs(lp)
        if msg is not None and self.tokenizer is not None:
            msg.token_texts.extend(self.tokenizer.decode([t]) for t in msg.token_ids)
            msg.top_texts.extend(self.tokenizer.decode([t]) for t in msg.top_ids)
        return msg

    def stops(self, msg: cpb.GenerateRequest) -> tuple[str, ...]:
        stops = check_stops(list(msg.stop))
        if stops:
            self._need_tokenizer("stop")
        return stops

    def params(self, msg: cpb.GenerateRequest) -> dict:
        """What the text path of a sequence needs after the request is gone, stored with it in Redis
        (a take-over re-applies the stop strings; Resume streams the same text deltas): the
        SequenceParams fields `stop` and `skip_special_tokens`, as keyword arguments. The prompt
        itself is stored as token ids."""
        skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        return {"stop": self.stops(msg), "skip_special_tokens": skip}

    def stream(self, msg: cpb.GenerateRequest) -> TextStream:
        return self.stream_for(**self.params(msg))

    def stream_for(self, stop: tuple[str, ...], skip_special_tokens: bool) -> TextStream:
        """The text deltas of a sequence (from its stored SequenceParams on Resume)."""
        return TextStream(self.tokenizer, tuple(stop), skip_special_tokens)

    def stop_engine(self, msg: cpb.GenerateRequest):
        """A wrapper for the sequence's Engine when the request has stop strings, else None."""
        return self.stop_engine_for(**self.params(msg))

    def stop_engine_for(self, stop: tuple[str, ...], skip_special_tokens: bool, primer: tuple[int, ...] = ()):
        """`stop_engine` from stored SequenceParams fields (a take-over, primed with the tokens
        committed before)."""
        if not stop:
            return None
        if self.tokenizer is None:
            self._need_tokenizer("stop")
        return lambda engine: StopStringEngine(engine, lambda: self.stream_for(stop, skip_special_tokens), primer)
