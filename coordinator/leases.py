"""Coordinator hand-over: every coordinator renews the leases of the sequences it runs and takes
over running sequences whose lease expired (their coordinator died), every `lease_ttl_s / 3`.

    aerie:seq:{id}   owner, lease_until (ms, Redis clock): set by create, renewed by every commit
                     (fenced: a commit under someone else's live lease fails) and by this keeper
    aerie:leases     sorted set id -> lease expiry: the index take-overs look in (a hint)

A take-over rebuilds the sequence from Redis on the new coordinator's replicas and continues at the
next round (Sequences.adopt); clients follow it with Resume on any coordinator.
"""

from __future__ import annotations

import logging
import threading

from coordinator.sequences import Sequences

log = logging.getLogger("aerie.coordinator")


class LeaseKeeper:
    def __init__(self, sequences: Sequences, lease_ttl_s: float) -> None:
        self.sequences = sequences
        self.interval_s = lease_ttl_s / 3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sequences.keep_leases()
            except Exception:  # noqa: BLE001 - keep renewing whatever one pass hit
                log.exception("lease keeper pass failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
