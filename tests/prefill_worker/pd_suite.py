"""Helpers of the prefill worker tests: engine configs, draining decode outputs, bounded waits."""

from __future__ import annotations

import time

BLOCK_SIZE = 4  # tokens per KV block in every engine of these tests
CLUSTER_SECRET = bytes.fromhex("c1" * 32)  # what both ends of every KV transfer here hold (kv_transfer.auth)


def engine_config(tiny, num_blocks: int = 256):
    from pdserve.engine.config import EngineConfig

    return EngineConfig(model=str(tiny.path), block_size=BLOCK_SIZE, num_blocks=num_blocks, threads=1,
                        show_progress=False)


def drain(take, want_final: set[str], timeout: float = 60.0) -> dict[str, list]:
    """Collect ``RequestDelta``s from ``take()`` until every id in ``want_final`` has its final one.
    Returns request id -> its deltas in order. Fails the test after ``timeout``."""
    out: dict[str, list] = {}
    deadline = time.time() + timeout
    done: set[str] = set()
    while not want_final <= done:
        assert time.time() < deadline, f"no final delta for {sorted(want_final - done)} within {timeout} s"
        for d in take():
            assert d.request_id not in done, f"delta for {d.request_id} after its final one"
            out.setdefault(d.request_id, []).append(d)
            if d.finish_reason is not None:
                done.add(d.request_id)
    return out


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def colocated_outputs(tiny, prompts: list[list[int]], params, timeout: float = 60.0) -> list[list[int]]:
    """Every prompt through one colocated ``EngineLoop`` (chunked prefill mixed into decode steps)."""
    from pdserve.decode_worker.messages import WorkerRequest
    from pdserve.decode_worker.worker import EngineLoop, WorkerConfig

    loop = EngineLoop(WorkerConfig(engine=engine_config(tiny, 1024), role="colocated"), name="colocated-0")
    try:
        for i, p in enumerate(prompts):
            loop.add_request(WorkerRequest(f"c{i}", p, params))
        deltas = drain(lambda: loop.take_outputs(0.2), {f"c{i}" for i in range(len(prompts))}, timeout)
        return [[t for d in deltas[f"c{i}"] for t in d.token_ids] for i in range(len(prompts))]
    finally:
        loop.stop()
