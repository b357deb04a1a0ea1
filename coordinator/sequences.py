"""Admission and the in-flight registry of one coordinator.

`admit` validates a request against the placed verifier's model (vocabulary, context), picks a
drafter and a verifier (sticky for the sequence's life), writes the sequence to Redis and starts its
`SequenceRun`. `cancel` reaches a sequence through Redis (so any coordinator can cancel any
sequence) and, when it runs here, directly. `hand_over_all` (SIGTERM) refuses new sequences, lets
running ones finish for up to AERIE_DRAIN_S and hands the rest to other coordinators (their leases
go at once); `drain` stops every run after its round in flight.
It does not speak gRPC to clients (servicer.py) or hold tokens (Redis does).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from services import metrics
from services.engine.engine import Engine, GenerationRequest, Guesser
from services.spec.load_board import LoadBoard
from services.spec.overlap import AheadPolicy
from services.spec.sampling import SamplingParams
from services.errors import CapacityExceeded
from services.rpc.clients import DrafterClient, VerifierClient
from services.rpc.errors import DownstreamError, SequenceExists
from services.rpc import codec
from services.rpc.stubs import coordinator as cpb
from coordinator.config import CoordinatorConfig
from coordinator.placement import Pool
from coordinator.round_spans import RoundSpans
from coordinator.sequence_placement import SequencePlacement, UnreachedDrafters
from coordinator.sequence_run import Committed, SequenceRun
from coordinator.sequence_store import SequenceParams, SequenceRecord, SequenceStore, Status

log = logging.getLogger("aerie.coordinator")


@dataclass(frozen=True, slots=True)
class Admitted:
    run: SequenceRun
    info: cpb.SequenceInfo  # placement and models, sent with the first message


class Sequences:
    def __init__(self, config: CoordinatorConfig, store: SequenceStore, verifiers: Pool[VerifierClient],
                 drafters: Pool[DrafterClient] | None) -> None:
        self.config = config
        self.store = store
        self.verifiers = verifiers
        self.drafters = drafters
        self._runs: dict[str, SequenceRun] = {}
        self._reserved = 0  # slots the admission queue granted that admit has not yet taken (coordinator/admission.py)
        self.on_free: Callable[[], None] | None = None  # called (on any thread) after a slot was freed
        self._lock = threading.Lock()
        self.owner = secrets.token_hex(8)  # this coordinator process, as the holder of sequence leases
        # continuous batching: the sequences this coordinator runs on one verifier share its forwards;
        # their budgets size each tree for that batch (services/spec/load_board.py LoadBoard)
        self._boards: dict[str, LoadBoard] = {}
        self.draining = threading.Event()  # SIGTERM: no new sequences, no take-overs
        # a taken-over sequence's text (stop strings): (stored params, tokens committed before) ->
        # a wrapper for its engine or None; set by the servicer, which holds the tokenizer
        # drafting ahead (AERIE_OVERLAP): each sequence's engine gets a copy of this policy; `guesser`
        # (None: the tree's top path) is the engine's seam for tests that fix the guess
        self.ahead: AheadPolicy | None = {"off": None, "on": AheadPolicy(),
                                          "always": AheadPolicy(contention=0.0, learn_cost=False)}[config.overlap]
        self.guesser: Guesser | None = None
        # --direct-drafts: the drafters this coordinator's verifiers could not reach lately (None: off)
        self.unreached = UnreachedDrafters() if config.direct_drafts else None
        self.text_engine: Callable[[SequenceParams, tuple[int, ...]], Callable[[Engine], Any] | None] | None = None

    def __len__(self) -> int:
        return len(self._runs)

    def _full(self) -> bool:  # under self._lock
        return len(self._runs) + self._reserved >= self.config.max_sequences

    def try_reserve(self) -> bool:
        """Reserve a slot for a request that will call admit(reserved=True): True when one was free.
        Raises (UNAVAILABLE) while draining: no new sequence starts here."""
        self._refuse_if_draining()
        with self._lock:
            if self._full():
                return False
            self._reserved += 1
            return True

    def release_reserved(self) -> None:
        """Give back a slot try_reserve granted that no sequence took."""
        with self._lock:
            self._reserved -= 1
        self._freed()

    def _freed(self) -> None:
        if self.on_free is not None:
            self.on_free()

    def _refuse_if_draining(self) -> None:
        if self.draining.is_set():
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE,
                                  "this coordinator is draining (shutting down): send the request to another coordinator")

    def admit(self, request: GenerationRequest, seq_id: str | None,
              emit: Callable[[Committed | BaseException], None], request_span: Any = None,
              wrap_engine: Callable[[Engine], Any] | None = None, text: dict | None = None,
              client: str = "anonymous", kv_client: str = "", reserved: bool = False,
              fit_context: bool = False) -> Admitted:
        """Blocking (placement may call GetInfo, creation writes Redis): run it off the event loop.
        `wrap_engine` (coordinator/text.py: stop strings) wraps the sequence's engine; `text` (stop
        strings, skip_special_tokens) is stored with the sequence for a take-over and Resume. `client`
        is the caller's identity (services/rpc/security.py), stored as the sequence's creator; `kv_client`
        who its verifier KV counts against (the per-client key: identity, else peer host; "" = `client`).
        `reserved`: a slot try_reserve granted (the admission queue) is this sequence's; else one must
        be free now (CapacityExceeded). `fit_context`: max_new_tokens is the default, not asked for:
        cut it to what the context leaves after the prompt (a prompt of 1990 tokens under a 2048
        context gets 58 new tokens, not a refusal)."""
        # 128 random bits: the id is the capability to read, resume or cancel the sequence
        seq_id = seq_id or secrets.token_hex(16)
        try:
            self._refuse_if_draining()
            with self._lock:
                if not reserved and self._full():
                    raise CapacityExceeded(f"coordinator runs its maximum of {self.config.max_sequences} sequences "
                                           f"(AERIE_MAX_SEQUENCES)")
                if seq_id in self._runs:
                    raise SequenceExists(f"sequence {seq_id!r} already exists")
                self._reserved -= int(reserved)
                self._runs[seq_id] = None  # type: ignore[assignment]  # reserved while admitting
        except BaseException:
            if reserved:
                self.release_reserved()
            raise
        placement = None
        try:
            spans = RoundSpans(seq_id, request_span)
            placement = SequencePlacement(
                seq_id, self.verifiers, self.drafters, spans, self.config.verifier_wait_s,
                on_move=lambda drafter, verifier: self.store.set_placement(seq_id, drafter, verifier),
                prefill_tries=self.config.prefill_tries, kv_client=kv_client or f"identity {client}",
                direct_drafts=self.unreached)
            vinfo, engine = self._engine(placement)
            left = engine.max_context - len(request.prompt_ids)
            if fit_context and 1 <= left < request.max_new_tokens:
                request = replace(request, max_new_tokens=left)
            engine.validate(request)
            if wrap_engine is not None:
                engine = wrap_engine(engine)
            s = request.sampling
            drafter_address, verifier_address = placement.addresses()
            self.store.create(SequenceRecord(
                sequence_id=seq_id, prompt_ids=request.prompt_ids, seed=s.seed,
                params=SequenceParams(request.max_new_tokens, s.temperature, s.top_p, s.top_k,
                                      tuple(request.stop_token_ids), request.ignore_eos, **(text or {}),
                                      min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                                      logprobs=s.logprobs),
                drafter=drafter_address, verifier=verifier_address, owner=self.owner, client=client))
        except BaseException:
            with self._lock:
                self._runs.pop(seq_id, None)
            if placement is not None:
                placement.close()
            self._freed()
            raise
        info = cpb.SequenceInfo(placement=cpb.Placement(drafter=drafter_address, verifier=verifier_address),
                                target=vinfo.target)
        if placement.drafter_client is not None:
            info.draft = placement.drafter_client.info().draft
            info.tree.CopyFrom(codec.encode_tree_params(placement.tree))

        run = SequenceRun(seq_id, request, engine, self.store, spans, emit, self._on_exit(placement),
                          owner=self.owner, on_lease_lost=placement.abandon)
        self._start(run, placement)
        return Admitted(run, info)

    def _on_exit(self, placement: SequencePlacement) -> Callable[[SequenceRun], None]:
        """A run's exit: it leaves the table, then its placement closes (after the engine's own
        release: frees nothing twice)."""
        def on_exit(run: SequenceRun) -> None:
            with self._lock:
                self._runs.pop(run.seq_id, None)
                metrics.SEQUENCES_IN_FLIGHT.labels("coordinator").set(len(self._runs))
            placement.close()
            self._freed()

        return on_exit

    def _start(self, run: SequenceRun, placement: SequencePlacement) -> None:
        """Register and start a run; a cancel or hand-over stops its prefill within one chunk."""
        placement.stop = run.check_stop
        with self._lock:
            self._runs[run.seq_id] = run
            metrics.SEQUENCES_IN_FLIGHT.labels("coordinator").set(len(self._runs))
        run.start()

    def _engine(self, placement: SequencePlacement) -> tuple[Any, Engine]:
        """The round loop over a sequence's placement, with the draft budget built from the cost
        curves its verifier and drafter report (GetInfo) -> (the verifier's info, the engine)."""
        vinfo = placement.verifier_client.info()
        retrieval = self.config.retrieval
        dclient = placement.drafter_client
        budget = codec.decode_budget(vinfo, dclient.info() if dclient else None, retrieval)
        if budget is not None and budget.fixed is None:
            with self._lock:
                address = placement.verifier_client.address
                board = self._boards.setdefault(address, LoadBoard(name=address))
            budget = replace(budget, load=board)
        ahead = self.ahead if placement.drafter is not None else None
        return vinfo, Engine(placement.verifier, placement.drafter, int(vinfo.max_context), int(vinfo.vocab_size),
                             tuple(int(t) for t in vinfo.eos_token_ids), budget, retrieval, ahead, self.guesser,
                             plain_run=self.config.plain_run)

    def adopt(self, seq_id: str) -> bool:
        """Take over a running sequence whose coordinator is gone (its lease expired): rebuild it on
        this coordinator's replicas from Redis (prompt + committed tokens) and continue at the next
        round. Clients follow it with Resume. False when another coordinator claimed it first."""
        with self._lock:
            if seq_id in self._runs or self._full() or self.draining.is_set():
                return False
            self._runs[seq_id] = None  # type: ignore[assignment]
        placement = None
        try:
            if not self.store.claim(seq_id, self.owner):
                with self._lock:
                    self._runs.pop(seq_id, None)
                self._freed()
                return False
            state = self.store.get(seq_id)
            p = state.params
            resumed = bool(state.tokens)  # else it died before its prefill was committed: start over
            request = GenerationRequest(
                tuple(state.prompt_ids) + tuple(state.tokens[:-1]), p.max_new_tokens - max(len(state.tokens) - 1, 0),
                SamplingParams(p.temperature, p.top_p, p.top_k, state.seed, p.min_p, p.repetition_penalty, p.logprobs),
                p.stop_token_ids, p.ignore_eos)
            spans = RoundSpans(seq_id, None)
            placement = SequencePlacement(
                seq_id, self.verifiers, self.drafters, spans, self.config.verifier_wait_s,
                on_move=lambda drafter, verifier: self.store.set_placement(seq_id, drafter, verifier),
                prefill_tries=self.config.prefill_tries, kv_client=f"identity {self.store.client_of(seq_id)}",
                direct_drafts=self.unreached)
            if resumed:
                placement.resume_from(state.prompt_ids, state.tokens)
                placement.release_elsewhere(state.drafter, state.verifier)
            else:
                placement.restart(state.drafter, state.verifier)
            _, engine = self._engine(placement)
            if self.text_engine is not None and p.stop:  # its stop strings apply here too
                wrap = self.text_engine(p, tuple(state.tokens[:-1]) if resumed else ())
                engine = wrap(engine) if wrap is not None else engine
            self.store.set_placement(seq_id, *placement.addresses())
        except Exception as e:  # noqa: BLE001 - another coordinator may try again after the lease
            log.warning("cannot take over sequence %s: %s", seq_id, e)
            with self._lock:
                self._runs.pop(seq_id, None)
            if placement is not None:
                placement.close()
            self._freed()
            return False
        log.warning("took over sequence %s from coordinator %s at round %d (%d tokens committed)", seq_id,
                    state.owner or "?", state.round_index, len(state.tokens))
        metrics.FAILOVERS.labels("coordinator", "coordinator", "takeover").inc()

        run = SequenceRun(seq_id, request, engine, self.store, spans, lambda item: None, self._on_exit(placement),
                          owner=self.owner, round_base=state.round_index if resumed else None,
                          on_lease_lost=placement.abandon)
        self._start(run, placement)
        return True

    def keep_leases(self) -> None:
        """Renew the lease of every sequence running here (a long round must not look like a dead
        coordinator) and stop those another coordinator took over; then adopt expired ones."""
        with self._lock:
            runs = [r for r in self._runs.values() if r is not None]
        for run in runs:
            if run.handing_over.is_set():
                continue  # its lease is being let go (SIGTERM)
            try:
                self.store.renew(run.seq_id, self.owner)  # lost: the run's next commit stops it (fenced)
            except Exception as e:  # noqa: BLE001 - Redis down: the commit path reports it
                log.warning("cannot renew the lease of %s: %s", run.seq_id, e)
        if self.draining.is_set():
            return  # a draining coordinator hands sequences over, it takes none
        try:
            expired = self.store.expired_leases()
        except Exception as e:  # noqa: BLE001
            log.warning("cannot list expired leases: %s", e)
            return
        for seq_id in expired:
            self.adopt(seq_id)

    def cancel(self, seq_id: str) -> Status:
        """Request cancellation; returns the sequence's status (raises SequenceNotFound)."""
        status = self.store.request_cancel(seq_id)
        with self._lock:
            run = self._runs.get(seq_id)
        if run is not None:
            run.cancel()
        return status

    def runs(self) -> list[SequenceRun]:
        with self._lock:
            return [r for r in self._runs.values() if r is not None]

    def hand_over_all(self, drain_s: float, round_s: float) -> int:
        """SIGTERM: refuse new sequences and take-overs; let running sequences finish for up to
        `drain_s`; then hand every one still running to the other coordinators after its round in
        flight (committed and streamed, KV released, lease let go), waiting up to `round_s` for that
        round. A run whose round outlasts `round_s` has its lease let go anyway: its late commit is
        then fenced off. Returns the number of sequences handed over."""
        self.draining.set()
        self._freed()  # the admission queue refuses its waiters (UNAVAILABLE): no new sequence starts here
        deadline = time.monotonic() + drain_s
        while self.runs() and time.monotonic() < deadline:
            time.sleep(0.05)
        runs = self.runs()
        for run in runs:
            run.hand_over()
        deadline = time.monotonic() + round_s
        for run in runs:
            run.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        handed = 0
        for run in runs:
            if run.thread.is_alive():
                try:
                    run.handed_over = self.store.hand_over(run.seq_id, self.owner)
                except Exception as e:  # noqa: BLE001 - its lease then expires after AERIE_LEASE_TTL_S
                    log.warning("cannot let the lease of %s go: %s", run.seq_id, e)
            if run.handed_over:
                handed += 1
                metrics.FAILOVERS.labels("coordinator", "coordinator", "drain").inc()
        if runs:
            log.info("drain: %d of %d running sequences handed over to other coordinators", handed, len(runs))
        return handed

    def drain(self, timeout_s: float) -> None:
        """Cancel every run and wait (up to `timeout_s`) for each to finish its round and release."""
        with self._lock:
            runs = [r for r in self._runs.values() if r is not None]
        for run in runs:
            run.cancel()
        for run in runs:
            run.thread.join(timeout=timeout_s)
