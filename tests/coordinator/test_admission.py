"""The admission queue (coordinator/admission.py) over a counted set of slots: requests past the limit
wait in arrival order, each freed slot goes to the oldest, and the queue's bounds (length, wait)
refuse with CapacityExceeded. Driven step by step on one event loop: no sleeps."""

import asyncio

import pytest

from coordinator.admission import AdmissionQueue
from services.errors import CapacityExceeded


class Slots:
    def __init__(self, n: int) -> None:
        self.free = n
        self.draining: BaseException | None = None

    def take(self) -> bool:
        if self.draining is not None:
            raise self.draining
        if self.free == 0:
            return False
        self.free -= 1
        return True

    def give(self) -> None:
        self.free += 1


def queue(slots: Slots, max_queued: int = 8, timeout_s: float = 3600.0) -> AdmissionQueue:
    return AdmissionQueue(slots.take, slots.give, max_queued, timeout_s, capacity=1)


async def settle() -> None:
    for _ in range(5):  # let every ready task run up to its next wait
        await asyncio.sleep(0)


def test_waiters_get_freed_slots_in_arrival_order():
    async def main():
        slots = Slots(1)
        q = queue(slots)
        await q.enter()  # the free slot, at once
        order: list[str] = []

        async def request(name: str) -> None:
            await q.enter()
            order.append(name)

        tasks = [asyncio.create_task(request(n)) for n in ("a", "b", "c")]
        await settle()
        assert order == [] and q.waiting == 3
        for expected in (["a"], ["a", "b"], ["a", "b", "c"]):
            slots.give()  # a sequence ended
            q.wake()
            await settle()
            assert order == expected and slots.free == 0
        await asyncio.gather(*tasks)
        assert q.waiting == 0

    asyncio.run(main())


def test_a_newcomer_does_not_pass_a_waiter():
    async def main():
        slots = Slots(1)
        q = queue(slots)
        await q.enter()
        first = asyncio.create_task(q.enter())
        await settle()
        slots.give()  # freed, but wake has not run yet: the newcomer must queue behind `first`
        second = asyncio.create_task(q.enter())
        await settle()
        assert not second.done() and q.waiting == 2
        q.wake()
        await settle()
        assert first.done() and not second.done()
        second.cancel()

    asyncio.run(main())


def test_a_full_queue_refuses_at_once():
    async def main():
        slots = Slots(0)
        q = queue(slots, max_queued=2)
        waiting = [asyncio.create_task(q.enter()) for _ in range(2)]
        await settle()
        with pytest.raises(CapacityExceeded, match=r"2 requests wait for one, its queue's limit "
                                                   r"\(AERIE_MAX_QUEUED_REQUESTS=2\)"):
            await q.enter()
        with pytest.raises(CapacityExceeded):
            await queue(Slots(0), max_queued=0).enter()  # 0: the old behaviour, no queue
        for t in waiting:
            t.cancel()

    asyncio.run(main())


def test_a_wait_past_the_timeout_is_refused():
    async def main():
        q = queue(Slots(0), timeout_s=0)
        with pytest.raises(CapacityExceeded, match=r"waited 0 s for one of the coordinator's 1 sequence slots"):
            await q.enter()
        assert q.waiting == 0

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_and_a_slot_granted_to_it_goes_back():
    async def main():
        slots = Slots(0)
        q = queue(slots)
        gone = asyncio.create_task(q.enter())
        stays = asyncio.create_task(q.enter())
        await settle()
        gone.cancel()  # its client went away while waiting
        await settle()
        assert q.waiting == 1
        slots.give()
        q.wake()
        await settle()
        assert stays.done() and slots.free == 0
        # granted and cancelled in the same step: the slot is given back, not lost
        late = asyncio.create_task(q.enter())
        await settle()
        slots.give()
        q.wake()  # grants `late` ...
        late.cancel()  # ... whose client leaves before it runs
        await settle()
        assert late.cancelled() and slots.free == 1

    asyncio.run(main())


def test_draining_refuses_every_waiter():
    async def main():
        slots = Slots(0)
        q = queue(slots)
        waiting = [asyncio.create_task(q.enter()) for _ in range(2)]
        await settle()
        slots.draining = RuntimeError("draining")
        q.wake()
        for t in waiting:
            with pytest.raises(RuntimeError, match="draining"):
                await t

    asyncio.run(main())


def test_clients_take_turns_and_each_keeps_its_own_order():
    """A client that queued many requests does not make another client's request wait behind them
    all: freed slots go round robin over the clients with waiters, oldest first within a client."""
    async def main():
        slots = Slots(1)
        q = queue(slots)
        await q.enter("peer a")
        order: list[str] = []

        async def request(client: str, name: str) -> None:
            await q.enter(client)
            order.append(name)

        tasks = [asyncio.create_task(request("peer a", f"a{i}")) for i in range(4)]
        await settle()
        tasks += [asyncio.create_task(request("identity b", f"b{i}")) for i in range(2)]
        await settle()
        tasks.append(asyncio.create_task(request("identity c", "c0")))
        await settle()
        assert q.waiting == 7
        for _ in range(7):
            slots.give()
            q.wake()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
        assert q.waiting == 0 and slots.free == 0

    asyncio.run(main())


def test_a_client_whose_waiters_left_loses_its_turn_to_the_others():
    async def main():
        slots = Slots(0)
        q = queue(slots)
        order: list[str] = []

        async def request(client: str, name: str) -> None:
            await q.enter(client)
            order.append(name)

        gone = asyncio.create_task(request("a", "a0"))
        await settle()
        stays = asyncio.create_task(request("b", "b0"))
        await settle()
        gone.cancel()  # a's client went away while waiting
        await settle()
        slots.give()
        q.wake()
        await settle()
        await stays
        assert order == ["b0"] and q.waiting == 0 and gone.cancelled()

    asyncio.run(main())
