"""The admission queue: requests past the coordinator's --max-sequences wait for a slot instead of being
refused at once (vLLM and SGLang queue them too), in arrival order per client and in turns across
clients.

    queue = AdmissionQueue(sequences.try_reserve, max_queued=1024, timeout_s=600)
    await queue.enter(client)    # a slot is reserved for this request, or CapacityExceeded
    sequences.admit(..., reserved=True)   # the reservation becomes the sequence's slot
    queue.wake()                 # on the event loop, after any slot was freed (Sequences.on_free)

A request that finds no one waiting and a free slot passes at once. Otherwise it waits. Each freed
slot goes to the oldest waiter of the next client in turn (round robin over the clients that have
waiters, in the order each began waiting; `client` is the per-client key: the API identity, else the
peer host): a client that queued 100 requests does not make the one request of another client wait
behind them all, and two clients that both keep the queue full get slots one for one. Bounds: at most `max_queued`
wait at once (one more is refused at once: CapacityExceeded, HTTP 503 with Retry-After), and each
waits at most `timeout_s` (then the same). `max_queued` 0 restores the old behaviour: refused at once
when every slot is taken. A waiter whose client goes away leaves the queue; a slot granted to it just
before is handed back. While it waits, a request counts in aerie:num_requests_waiting (its
RequestMetrics is created at arrival and moves to running when admitted).

It lives on the event loop (one asyncio future per waiter): waiting costs no thread. Slots are freed on
the sequences' threads, which call `wake` through loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable

from services.errors import CapacityExceeded


class AdmissionQueue:
    def __init__(self, try_reserve: Callable[[], bool], release: Callable[[], None], max_queued: int,
                 timeout_s: float, capacity: int) -> None:
        """`try_reserve`: take a free slot now -> True, or False when none is free (it may raise:
        draining, then every waiter gets that error); `release`: give back a reserved slot that no
        sequence took; `capacity`: the slots in all (for messages)."""
        self._try_reserve = try_reserve
        self._release = release
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.capacity = capacity
        # client -> its waiters (oldest first); the first client is the next in turn
        self._waiters: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        return sum(1 for q in self._waiters.values() for f in q if not f.done())

    async def enter(self, client: str = "") -> None:
        """Reserve a slot for this request: at once when none waits and one is free, else in `client`'s
        turn (module docstring). CapacityExceeded when the queue is full or the wait timed out."""
        self._loop = asyncio.get_running_loop()
        if not self.waiting and self._try_reserve():
            return
        if self.waiting >= self.max_queued:
            raise CapacityExceeded(f"the coordinator runs its maximum of {self.capacity} sequences and "
                                   f"{self.waiting} requests wait for one, its queue's limit "
                                   f"(AERIE_MAX_QUEUED_REQUESTS={self.max_queued}); retry later")
        granted: asyncio.Future[None] = self._loop.create_future()
        self._waiters.setdefault(client, deque()).append(granted)
        timer = self._loop.call_later(self.timeout_s, self._time_out, granted)
        try:
            await granted
        except asyncio.CancelledError:  # the client went away while waiting
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self._release()  # granted, never used: the next waiter gets it
            raise
        finally:
            timer.cancel()
            self._forget_done()

    def _time_out(self, granted: asyncio.Future[None]) -> None:
        if not granted.done():
            granted.set_exception(CapacityExceeded(
                f"waited {self.timeout_s:g} s for one of the coordinator's {self.capacity} sequence slots "
                f"(AERIE_QUEUE_TIMEOUT_S); retry later"))

    def wake(self) -> None:
        """Grant free slots to the waiters, one per client in turn (call on the event loop)."""
        self._forget_done()
        while self._waiters:
            try:
                if not self._try_reserve():
                    return
            except Exception as e:  # noqa: BLE001 - draining: every waiter gets the refusal
                for q in self._waiters.values():
                    for f in q:
                        if not f.done():
                            f.set_exception(e)
                self._waiters.clear()
                return
            client, q = next(iter(self._waiters.items()))
            q.popleft().set_result(None)
            self._waiters.move_to_end(client)  # its next waiter comes after every other client's
            self._forget_done()

    def wake_threadsafe(self) -> None:
        """`wake` from any thread (a run's exit frees its slot on the run's thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.wake)

    def _forget_done(self) -> None:
        for client in list(self._waiters):
            q = self._waiters[client]
            while q and q[0].done():
                q.popleft()
            if not q:
                del self._waiters[client]
