"""Per-client shares of a verifier's KV budget: one client identity cannot take the whole budget while
others want KV.

    shares = KVShares(budget_rows=1000, share=0.5)
    shares.claim("s1", "alice")              # a Prefill of alice's arrives (before it is admitted)
    shares.check("alice", 300, {})           # on admission: raises KVShareExceeded when over her share
    shares.hold("s1", 300)                   # admitted: alice holds 300 rows
    shares.wait("bob"); shares.done_waiting("bob")   # bob's Prefill waits for KV meanwhile
    shares.release("s1")                     # the sequence is gone

Rule: a client identity may hold at most `share` x `budget_rows` KV rows (the rows its sequences'
slots hold now: `hold` again as a slot grows, services/engine/kv_growth.py) while another identity
holds KV or waits for it; alone it may use the whole budget (nothing is left idle). When the budget
is full and a second identity arrives, the first one's new Prefills are over its share (the second
one waits), so the rows released next go to the second: that is the fair queue across identities.
A share never evicts a sequence (only a preemption under the budget does, services/engine/kv_growth.py).

Counts rows, not sequences: a client with many short sequences and one with a few long ones get the
same rows. Thread-safe (the event loop claims and waits, the model thread checks, holds and releases).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from services.errors import KVBudgetExceeded

ANONYMOUS = "anonymous"  # a Prefill that names no client


class KVShareExceeded(KVBudgetExceeded):
    """A client's Prefill would take it past its share of the KV budget while other clients want KV
    (worth waiting for: theirs or its own sequences may be released)."""


class KVShares:
    def __init__(self, budget_rows: int | None, share: float) -> None:
        """`budget_rows`: the KV pool's budget (None = unbounded: no shares); `share` in (0, 1]."""
        self.budget_rows = budget_rows
        self.share = share
        self._lock = threading.Lock()
        self._client: dict[str, str] = {}  # sequence id -> client (claimed at arrival)
        self._rows: dict[str, int] = {}  # sequence id -> KV rows it holds (admitted ones)
        self._waiting: dict[str, int] = {}  # client -> its Prefills waiting for KV

    @property
    def limit(self) -> int | None:
        """Rows one client may hold while others want KV (None: no budget)."""
        return None if self.budget_rows is None else max(1, int(self.share * self.budget_rows))

    def claim(self, seq_id: str, client: str) -> None:
        """A Prefill of `client` for `seq_id` arrives (a sequence keeps its first client)."""
        with self._lock:
            self._client.setdefault(seq_id, client)

    def unclaim(self, seq_id: str) -> None:
        """Its Prefill was not admitted."""
        with self._lock:
            if seq_id not in self._rows:
                self._client.pop(seq_id, None)

    def client_of(self, seq_id: str) -> str:
        with self._lock:
            return self._client.get(seq_id, ANONYMOUS)

    def wait(self, client: str) -> None:
        with self._lock:
            self._waiting[client] = self._waiting.get(client, 0) + 1

    def done_waiting(self, client: str) -> None:
        with self._lock:
            n = self._waiting.get(client, 0) - 1
            if n > 0:
                self._waiting[client] = n
            else:
                self._waiting.pop(client, None)

    def held(self, client: str) -> int:
        with self._lock:
            return sum(r for s, r in self._rows.items() if self._client.get(s) == client)

    def check(self, client: str, rows: int, pending: Mapping[str, int]) -> None:
        """Raise KVShareExceeded when `client` taking `rows` more would pass its share while another
        client holds or waits for KV. `pending`: client -> rows already granted in the same batch."""
        limit = self.limit
        if limit is None:
            return
        with self._lock:
            holders = {self._client.get(s, ANONYMOUS) for s in self._rows}
            others = (holders | {c for c in self._waiting} | {c for c, r in pending.items() if r}) - {client}
            if not others:
                return
            held = sum(r for s, r in self._rows.items() if self._client.get(s) == client) + pending.get(client, 0)
        if held + rows > limit:
            raise KVShareExceeded(
                f"client {client!r} holds {held} KV rows; {rows} more would pass its share of {limit} rows "
                f"({self.share:g} of the {self.budget_rows}-row KV budget, AERIE_KV_CLIENT_SHARE) while "
                f"{len(others)} other client(s) hold or wait for KV")

    def hold(self, seq_id: str, rows: int) -> None:
        """`seq_id` holds `rows` KV rows (admitted, or its slot grew)."""
        with self._lock:
            self._rows[seq_id] = rows

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._rows.pop(seq_id, None)
            self._client.pop(seq_id, None)
