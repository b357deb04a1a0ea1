"""A run of plain steps in process, each step queued on the device before the previous token is read.

    run = verifier.decode_run(seq_id, token, round_index, steps, keep_features)  # a PlainRun
    tok = next(run)   # the token of round `round_index` (its step has run or is running)
    run.close()       # a stop: the step queued past the last token read is undone (its KV row dropped)

Greedy plain decoding needs no host read between steps: step k+1's input is step k's argmax, still on
the device. So step k+1 is queued (its host work done, its graph replay launched) before step k's
token is read, and the host's per-token work (the engine's commit, stop checks, streaming) runs
while the device computes the next step: on a GPU the device does not wait for the host between the
run's steps (SGLang's overlap scheduler does this for its batches). A token is read through one
non-blocking copy into pinned memory and an event recorded after it, so the read waits for its own
step, not for the one queued behind it.

Lossless: every step is the forward one Decode call would run, on the same input. A stop inside the
run leaves one queued step whose row lies past the committed length: `close` drops it (and the
features it kept). A step that fails (KV full, preempted) raises at its own turn, after the tokens
before it. Only greedy sequences without a repetition penalty or logprobs, on a local ModelRunner,
run this way (`Verifier.decode_run` decides); the others get `StepwiseRun`, one Decode call per
token behind the same interface. The verifier service has its own runs (verifier_svc/plain_run.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PlainSteps(Protocol):
    """What a run needs of the verifier (services/engine/verifier.py Verifier)."""

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int: ...

    def decode_on_device(self, seq_id: str, token: int | torch.Tensor, round_index: int,
                         keep_features: bool = False) -> torch.Tensor: ...

    def undo_decode(self, seq_id: str, keep_features: bool) -> None: ...


@dataclass
class _Queued:
    """A step queued on the device: its argmax and the pinned host copy the read waits for."""
    token: torch.Tensor | None  # [1] long on the model's device (None: the step failed)
    host: torch.Tensor | None  # [1] long, pinned on CUDA: filled by a non-blocking copy
    event: torch.cuda.Event | None  # recorded after that copy (CUDA only)
    error: Exception | None = None


class LocalPlainRun:
    """`steps` plain steps of one greedy sequence from round `round_index`, one queued ahead."""

    def __init__(self, verifier: PlainSteps, seq_id: str, token: int, round_index: int, steps: int,
                 keep_features: bool = False) -> None:
        self.verifier, self.seq_id, self.keep_features = verifier, seq_id, keep_features
        self.round_index = round_index  # the round of the step queued next
        self.left = steps  # tokens not read yet
        self._queued: _Queued | None = self._queue(token) if steps > 0 else None

    def _queue(self, token: int | torch.Tensor) -> _Queued:
        try:
            out = self.verifier.decode_on_device(self.seq_id, token, self.round_index, self.keep_features)
        except Exception as e:  # noqa: BLE001 (raised at this step's turn, after the tokens before it)
            return _Queued(None, None, None, e)
        finally:
            self.round_index += 1
        cuda = out.device.type == "cuda"
        host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
        host.copy_(out, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return _Queued(out, host, event)

    def __iter__(self) -> LocalPlainRun:
        return self

    def __next__(self) -> int:
        q = self._queued
        if self.left <= 0 or q is None:
            raise StopIteration
        self.left -= 1
        if q.error is not None:
            self._queued, self.left = None, 0
            raise q.error
        assert q.token is not None and q.host is not None
        self._queued = self._queue(q.token) if self.left else None  # before the read: the device goes on
        if q.event is not None:
            q.event.synchronize()
        return int(q.host[0])

    def close(self) -> None:
        """No more tokens are read: the step queued past the last one read is undone."""
        q, self._queued, self.left = self._queued, None, 0
        if q is not None and q.error is None:
            self.verifier.undo_decode(self.seq_id, self.keep_features)


class StepwiseRun:
    """The same interface over one Decode call per token (sampling, penalties, logprobs, a tensor-
    parallel runner): nothing is queued ahead, so nothing is undone."""

    def __init__(self, verifier: PlainSteps, seq_id: str, token: int, round_index: int, steps: int,
                 keep_features: bool = False) -> None:
        self.verifier, self.seq_id, self.keep_features = verifier, seq_id, keep_features
        self.token, self.round_index, self.left = token, round_index, steps

    def __iter__(self) -> StepwiseRun:
        return self

    def __next__(self) -> int:
        if self.left <= 0:
            raise StopIteration
        self.left -= 1
        try:
            self.token = self.verifier.decode(self.seq_id, self.token, self.round_index, self.keep_features)
        except Exception:
            self.left = 0
            raise
        self.round_index += 1
        return self.token

    def close(self) -> None:
        self.left = 0
