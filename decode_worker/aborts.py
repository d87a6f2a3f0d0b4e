"""Aborts that arrived before their request: remembered for a while, so the request is dropped.

A worker actor runs calls on several threads, so the router's ``abort(id)`` can overtake the
``add_request`` (or ``reserve_kv``, ``prefill``) it sent for the same id just before. A worker that
only aborted what it knew would then run the request to its end with nobody waiting for it, its
blocks held. Instead it remembers the unknown id, and the request that turns up later is refused.
Memory is bounded: at most ``max_ids`` ids, each kept ``ttl_s`` seconds (a reordered call arrives
within milliseconds; request ids are unique, so an id never comes back legitimately).
"""

from __future__ import annotations

import time
from collections import OrderedDict


class EarlyAborts:
    """Ids aborted before their request arrived. Not thread-safe: one engine thread owns it."""

    def __init__(self, ttl_s: float = 60.0, max_ids: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()  # id -> when it expires, oldest first

    def remember(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._ids.pop(request_id, None)
        self._ids[request_id] = now + self.ttl_s
        self._expire(now)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def take(self, request_id: str, now: float | None = None) -> bool:
        """Whether ``request_id`` was aborted before it arrived (and not too long ago); forgets it."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        return self._ids.pop(request_id, None) is not None

    def __len__(self) -> int:
        return len(self._ids)

    def _expire(self, now: float) -> None:
        while self._ids and next(iter(self._ids.values())) <= now:
            self._ids.popitem(last=False)
