"""Placement policy: which worker takes the next request. Plain data in, a choice out.

The router calls ``choose_worker`` (a colocated or decode worker) and, in disaggregated mode,
``choose_prefill_worker`` with a ``WorkerLoad`` per live worker: the load the worker last
reported (``WorkerStats``) plus what the router sent it since that report. The policy never
talks to a worker; the pool acts on its answer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerLoad:
    """What the policy knows about one worker right now."""

    name: str
    queued_prompt_tokens: int  # prompt tokens waiting to be prefilled on the worker
    num_running: int
    free_blocks: int
    total_blocks: int
    block_size: int
    inflight: int  # requests the router has on this worker and not yet seen finish
    max_inflight: int  # the router's cap on `inflight` for one worker


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def fits_at_all(load: WorkerLoad, num_tokens: int) -> bool:
    """Whether a request of ``num_tokens`` (prompt + max output) could ever run on the worker."""
    return blocks_needed(num_tokens, load.block_size) <= load.total_blocks


def choose_worker(loads: list[WorkerLoad], num_tokens: int) -> str | None:
    """Pick the least loaded worker that can take a request of ``num_tokens`` tokens.

    Least loaded means fewest queued prompt tokens (the wait before this request's prefill),
    then most free KV blocks (room to run it without preemption), then fewest running
    requests; the name breaks ties so the choice is deterministic. Workers at their in-flight
    cap, or too small to ever hold the request, are skipped. ``None`` means nobody can take it
    now: the caller waits for capacity or rejects the request.
    """
    candidates = [l for l in loads if l.inflight < l.max_inflight and fits_at_all(l, num_tokens)]
    if not candidates:
        return None
    best = min(
        candidates,
        key=lambda l: (l.queued_prompt_tokens, -l.free_blocks, l.num_running, l.name),
    )
    return best.name


def choose_prefill_worker(loads: list[WorkerLoad], num_prompt_tokens: int) -> str | None:
    """Pick the prefill worker that will start on a prompt of ``num_prompt_tokens`` soonest.

    Soonest means fewest queued prompt tokens (what it must prefill first), then fewest requests
    in flight from the router, then the name (deterministic). A prefill worker holds a prompt's KV
    only until it has been pushed to the decode worker, so free blocks do not rank it; workers
    whose pool is too small for the prompt are skipped. There is no in-flight cap: the decode
    worker's reservation already bounds how many requests the router admits. ``None``: no
    prefill worker can take the prompt.
    """
    candidates = [l for l in loads if fits_at_all(l, num_prompt_tokens)]
    if not candidates:
        return None
    return min(candidates, key=lambda l: (l.queued_prompt_tokens, l.inflight, l.name)).name
