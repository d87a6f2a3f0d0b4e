"""Admission: requests that find every worker full wait here, in a bounded queue, until room frees.

Placement (``placement.choose_worker``) says whether a worker has room now; when none has, the
request waits on ``Admission.wait`` until a request finishes somewhere (``notify``), a worker
joins, or its deadline passes. At most ``max_waiting`` requests wait at once; past that, and past
a request's deadline, it is refused with ``Overloaded`` (RESOURCE_EXHAUSTED: retry later).
"""

from __future__ import annotations

import asyncio
import time

from pdserve.router.errors import Overloaded


class Admission:
    """The router's wait queue for capacity. ``max_inflight_per_worker`` only words its errors."""

    def __init__(self, max_waiting: int, max_inflight_per_worker: int):
        self.max_waiting = max_waiting
        self.max_inflight_per_worker = max_inflight_per_worker
        self.num_waiting = 0  # requests waiting now
        self._capacity = asyncio.Condition()

    async def wait(self, deadline: float | None, timeout_message: str, poll_s: float | None = None) -> None:
        """Wait until capacity may have freed (``notify``) or ``poll_s`` passes, then return so the
        caller looks again. ``Overloaded`` when the wait queue is full or ``deadline`` (monotonic
        time; ``None``: no limit) has passed, with ``timeout_message`` in the latter case."""
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(
                f"every worker is at its limit of {self.max_inflight_per_worker} requests and "
                f"{self.num_waiting} requests are already waiting; retry later"
            )
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise Overloaded(timeout_message)
        if poll_s is not None:
            remaining = poll_s if remaining is None else min(remaining, poll_s)
        self.num_waiting += 1
        try:
            async with self._capacity:
                await asyncio.wait_for(self._capacity.wait(), remaining)
        except asyncio.TimeoutError:
            pass  # the caller looks again; past the deadline the check above raises
        finally:
            self.num_waiting -= 1

    async def notify(self) -> None:
        """Capacity may have freed (a request ended, a worker joined or left): wake every waiter."""
        async with self._capacity:
            self._capacity.notify_all()
