"""Device rounds: the tree rounds of a VerifyRun on a verifier that drafts too, kept on its device as
the in-process engine keeps them (services/engine/engine.py, "Verdict drafts").

Without them each round of a colocated run (verifier_svc/servicer.py `_local_run`) waits on the host
twice: for the verdict, then, after drafting from it, for the next tree's candidates, which are
encoded and decoded again before the next round is queued: the device idles through the draft's
host work. With them, for a greedy sequence without a penalty or logprobs on a paged local runner
whose head drafts from the static code (a GPU; the CPU with AERIE_PAGED_KV=1 runs the same eagerly):

    round k queued (its tree a TreeOnDevice)
      -> on_forward: the verdict walked on the device (next_rows_on_device), the next tree queued from
         it behind the verify (DrafterServicer.queue_from_verdict -> Drafter.draft_from_verdict)
      -> the host reads the verdict (its argmax copied ahead of the draft); when its rows are the
         queued draft's, the draft KV keeps them (commit_verdict) and the answer is a QueuedVerify
      -> RunChain queues round k + 1 with the queued tree, still on the device, before anything waits
         for the draft; round k + 1's hook, once its forward and next draft are queued, reads and
         encodes round k's next tree (`settle`) while the device computes: the thread that streams
         answers waits for it instead of doing it beside the model thread (the last round of a run's
         answer: that thread builds it)

so the device runs verify, draft, verify, ... while the host does each round's bookkeeping. A verdict
the host reads otherwise (rows kept from Decode calls, a draft that does not fit the static code)
drops the queued draft; the round then drafts on the host as before. The Draft call the queued tree
stands for is answered with it when repeated (the drafter's idempotency), and a Verify repeating the
round gets the same answer (RunAnswers). AERIE_DEVICE_ROUND=0 turns device rounds off here too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TypeVar

import torch

from drafter_svc.servicer import DrafterServicer, QueuedDraft
from services import metrics
from services.engine.drafter import VerdictDraft
from services.engine.verifier import Verifier, VerifyCall, VerifyResult
from services.errors import AerieError
from services.rpc import codec
from services.rpc.stubs import verifier as vpb
from services.spec.tree import StaticTree, TreeOnDevice, TreeParams, tree_on_device
from services.spec.verify import next_rows_on_device
from verifier_svc.plain_run import QueuedAnswer

log = logging.getLogger("aerie.verifier")
SERVICE = "verifier"
# the longest the thread reading a device round's answer waits for the model thread to build it (a
# safety net: the model thread builds it within the next round's forward, or lets go at once)
TURN_TIMEOUT_S = 5.0
Round = TypeVar("Round", bound=VerifyCall)


class QueuedVerify(QueuedAnswer):
    """A device round's answer: `verdict` (the VerifyResponse without its next tree yet) and `tree`,
    the next round's tree on the device; `response()` adds the next tree once its candidates are on
    the host (QueuedAnswer: any thread, once). When the run queued the round after it, the model
    thread builds it while that round's forward runs (DeviceRounds' hook: nothing else competes with
    it for the interpreter then), and the thread that reads answers waits for that (`wait_turn`)."""

    def __init__(self, verdict: vpb.VerifyResponse, draft: QueuedDraft, seconds: float, busy: float) -> None:
        super().__init__()
        self.verdict = verdict
        self.tree: TreeOnDevice = draft.tree
        self._draft = draft
        self._seconds = seconds
        self._busy = busy
        self._turn = threading.Event()  # set: the model thread built the response, or leaves it to others

    def followed(self, queued: bool) -> None:
        if not queued:
            self._turn.set()

    def wait_turn(self) -> None:
        self._turn.wait(TURN_TIMEOUT_S)

    def built(self) -> None:
        """On the model thread: build the response now, and let the reader have it (a failure is the
        reader's to meet: its `response()` tries again and the run's stream gets the error; the model
        thread goes on with its round)."""
        try:
            self.response()
        except Exception:  # noqa: BLE001 (logged here, raised to the reader)
            log.exception("building a device round's answer failed; its reader tries again")
        finally:
            self._turn.set()

    def release(self) -> None:
        """The model thread will not build it (its next round ended before its hook): the reader does."""
        self._turn.set()

    def _resolve(self) -> vpb.VerifyResponse:
        self.verdict.next_tree.CopyFrom(self._draft.response().tree)
        self.verdict.next_draft_seconds = self._seconds
        self.verdict.drafter_busy = self._busy
        return self.verdict


class DeviceRounds:
    """The device rounds of one verifier that drafts too (module doc). Used on its model thread only."""

    def __init__(self, drafter: DrafterServicer, verifier: Verifier) -> None:
        self.drafter = drafter
        self.verifier = verifier
        self.device: torch.device = drafter.drafter.head.device
        self.on = True  # off after queuing a draft failed once (an optimisation only: logged)
        self._queued: dict[str, tuple[VerdictDraft, float]] = {}  # seq id -> its round's queued draft, seconds
        self._answered: dict[str, QueuedVerify] = {}  # seq id -> its latest device round's answer, not built yet

    def takes(self, seq_id: str) -> bool:
        """Whether `seq_id`'s run can keep its rounds on the device (module doc)."""
        return (self.on and self.drafter.drafter.graphs is not None and self.verifier.queues_runs(seq_id)
                and self.verifier.takes_device_trees(self.device))

    def first(self, call: Round) -> Round:
        """A run's first round: its tree (from the caller, on the host) copied to the device."""
        assert not isinstance(call.tree, TreeOnDevice)
        return replace(call, tree=tree_on_device(call.tree, self.device))

    def hooked(self, call: Round, params: TreeParams | None, next_round: int) -> Round:
        """`call` with the on_forward that queues its next draft (shape `params`, None: the head's
        largest; the Draft call `next_round` it stands for) from the verdict on the device."""
        assert isinstance(call.tree, TreeOnDevice)
        static, seq_id = call.tree.static, call.seq_id
        shape = params if params is not None else self.drafter.drafter.tree
        self._queued.pop(seq_id, None)

        def hook(argmax: torch.Tensor, features: torch.Tensor) -> None:
            try:
                self._queue(seq_id, static, argmax, features, shape, next_round)
            finally:  # the round before's answer, while this round's forward runs
                self.settle(seq_id)

        return replace(call, on_forward=hook)

    def _queue(self, seq_id: str, static: StaticTree, argmax: torch.Tensor, features: torch.Tensor,
               shape: TreeParams, next_round: int) -> None:
        if not self.on:
            return
        t0 = time.perf_counter()
        try:
            width = self.drafter.drafter.next_width(shape)
            if width is None:
                return
            rows = next_rows_on_device(static, argmax, width)
            queued = self.drafter.queue_from_verdict(seq_id, rows, features[rows.nodes], shape, next_round)
        except AerieError as e:  # the sequence's draft KV is gone (released, reaped): this round drafts
            log.info("sequence %s: no draft queued from its verdict (%s)", seq_id, e)  # after its verdict
            return
        except Exception:  # the round goes on, and drafts after its verdict
            log.exception("queuing the next draft from the verdict failed; this verifier drafts after verdicts now")
            self.on = False
            return
        if queued is not None:
            self._queued[seq_id] = (queued, time.perf_counter() - t0)

    def settle(self, seq_id: str) -> None:
        """Build `seq_id`'s latest device round's answer (its next tree: the tree of the round now
        running, whose candidates the host has by now) on this thread, if still owed; called by the
        next round's hook once its draft is queued, and after that round (its hook may not have run)."""
        answered = self._answered.pop(seq_id, None)
        if answered is not None:
            answered.built()

    def answer(self, seq_id: str, next_round: int, out: VerifyResult, response: vpb.VerifyResponse
               ) -> QueuedVerify | None:
        """The round's answer with the draft queued from its verdict, when the host read the same
        verdict (the draft KV then keeps its rows); None: none was queued, or it is dropped (its rows
        are not the verdict's) and the round drafts on the host."""
        queued = self._queued.pop(seq_id, None)
        if queued is None:
            return None
        verdict, seconds = queued
        tokens = out.acceptance.new_tokens
        if out.features.shape[0] != len(tokens) or not verdict.matches(tokens):
            metrics.DEVICE_ROUNDS.labels(SERVICE, "dropped").inc()
            return None
        draft = self.drafter.commit_verdict(seq_id, verdict, len(tokens), next_round)
        response.features.CopyFrom(codec.encode_tensor(out.features[:0]))  # the head took them here
        metrics.DEVICE_ROUNDS.labels(SERVICE, "kept").inc()
        answered = QueuedVerify(response, draft, seconds, self.drafter.busy(seq_id))
        self._answered[seq_id] = answered
        return answered

    def forget(self, seq_id: str) -> None:
        self._queued.pop(seq_id, None)
        answered = self._answered.pop(seq_id, None)
        if answered is not None:
            answered.release()
