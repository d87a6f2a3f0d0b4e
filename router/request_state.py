"""The states of a request in the router's pool, and the one table of moves between them.

A request is placed (``WAITING``), then, in disaggregated mode, its KV blocks are reserved on a
decode worker (``RESERVED``), a prefill worker computes the prompt (``PREFILLING``), token #1 is
out while the KV cache travels (``PUSHING``), and the decode worker generates (``DECODING``). In
colocated mode a request goes from ``WAITING`` straight to ``DECODING`` (its worker does both
phases). It ends ``DONE`` (the worker sent its last token), ``ABORTED`` (the router ended it
first: the client went away, or a stop string matched) or ``FAILED``.

A request whose worker dies, or whose KV transfer fails after token #1, is ``MIGRATING``: it
continues on a healthy worker from the tokens already streamed (its prompt and those tokens are
prefilled again), back through ``RESERVED`` (disaggregated) or ``DECODING`` (colocated).

Invariant: a request in an end state holds nothing on any worker. Whoever moves it there has
freed (or asked the workers to free) what it held, so closing an ended request does nothing more.
"""

from __future__ import annotations

import enum


class RequestState(enum.Enum):
    WAITING = "waiting"  # looking for a (decode or colocated) worker with room
    RESERVED = "reserved"  # a decode worker holds blocks for its KV cache; no prefill worker yet
    PREFILLING = "prefilling"  # a prefill worker computes the prompt and pushes its KV cache
    PUSHING = "pushing"  # token #1 is out; the KV cache has not all reached the decode worker
    DECODING = "decoding"  # its decode (or colocated) worker generates
    MIGRATING = "migrating"  # its worker failed it: it moves to a healthy one, from the tokens streamed
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in ENDED


S = RequestState
ENDED = frozenset({S.DONE, S.ABORTED, S.FAILED})

# Every move a request may make; anything else is a bug (``InvalidTransition``).
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({
        S.RESERVED,  # disaggregated: the decode worker reserved the prompt's blocks
        S.DECODING,  # colocated: handed to a worker
        S.FAILED, S.ABORTED,
    }),
    S.RESERVED: frozenset({S.PREFILLING, S.MIGRATING, S.FAILED, S.ABORTED}),
    S.PREFILLING: frozenset({
        S.PUSHING,  # the prefill worker answered with token #1
        S.DECODING,  # the decode worker's first token overtook that answer
        S.DONE,  # ... or its end, for a one-token request
        S.WAITING,  # the prefill worker died before token #1: reserve and prefill again
        S.MIGRATING,  # the decode worker died
        S.FAILED, S.ABORTED,
    }),
    S.PUSHING: frozenset({S.DECODING, S.DONE, S.MIGRATING, S.FAILED, S.ABORTED}),
    S.DECODING: frozenset({
        S.DONE,
        S.WAITING,  # colocated: the worker died before it took the request; place it again
        S.MIGRATING,
        S.FAILED, S.ABORTED,
    }),
    S.MIGRATING: frozenset({
        S.RESERVED,  # disaggregated: a decode worker reserved blocks for prompt + tokens so far
        S.DECODING,  # colocated: handed to a healthy worker
        S.DONE,  # every token was out already: only the end was missing
        S.FAILED, S.ABORTED,
    }),
    S.DONE: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A move the table does not allow: a bug in the router."""


def check_transition(old: RequestState, new: RequestState) -> None:
    """Raise ``InvalidTransition`` unless ``TRANSITIONS`` allows ``old`` -> ``new``."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"a request cannot go from {old.value} to {new.value}")
