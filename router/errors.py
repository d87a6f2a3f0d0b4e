"""Why the router's pool could not place or finish a request; ``service`` maps each to a gRPC status."""

from __future__ import annotations


class NoWorkers(RuntimeError):
    """No live worker of a role the request needs is left in the pool (UNAVAILABLE)."""


class Overloaded(RuntimeError):
    """No worker could take the request within the time allowed, or none ever can (RESOURCE_EXHAUSTED)."""


class WorkerDied(RuntimeError):
    """A worker serving the request died (or was scaled away) before the request finished (UNAVAILABLE)."""


class WorkerRejected(RuntimeError):
    """The worker raised on being given the request: a bug or a check the router does not know (INTERNAL)."""


class PrefillFailed(RuntimeError):
    """The prefill worker raised on the request; it is alive, but the request cannot go on (INTERNAL)."""


def actor_reason(exc: BaseException) -> str:
    """The message of an exception raised in an actor, without Ray's traceback around it."""
    return str(getattr(exc, "cause", None) or exc)


class TooLarge(RuntimeError):
    """The request can never fit: prompt + max_tokens exceed every worker's KV cache, however long
    it waits (INVALID_ARGUMENT: not worth a retry as sent)."""
