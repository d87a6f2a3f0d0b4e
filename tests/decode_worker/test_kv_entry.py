"""The disaggregated entry of the decode worker, as a KV transport drives it: ``reserve_kv`` ->
``write_kv`` per piece -> ``complete_kv(first_token)``, with the prompt's KV computed by another ``ModelRunner`` (as a
prefill actor does), and the lease that returns reserved blocks nobody filled.
"""

from __future__ import annotations

import time

import pytest

from pdserve.decode_worker.messages import WorkerRequest
from pdserve.engine.block_allocator import OutOfBlocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.sampling_params import SamplingParams


def req(rid: str, prompt: list[int], max_tokens: int) -> WorkerRequest:
    return WorkerRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture
def prefill_runner(tiny, one_thread):
    """A second runner over the same model, with its own pool: the prefill side."""
    return ModelRunner(EngineConfig(model=str(tiny.path), block_size=4, num_blocks=64, show_progress=False))


def prefill(runner: ModelRunner, prompt: list[int]) -> tuple[list[int], int]:
    """Compute ``prompt``'s KV into fresh blocks of ``runner``; return the blocks and token #1."""
    # Skip past any ids the decode side can hold: there the running colocated request takes at
    # most ceil((9 + 30) / 4) = 10 blocks, so the reservation lies below id 16 and ours above 20.
    runner.allocator.allocate(20)
    blocks = runner.allocator.allocate(-(-len(prompt) // runner.block_size))
    logits = runner.execute([BatchItem(prompt, 0, blocks, sample=True)])
    return blocks, int(logits[0].argmax())


def test_kv_from_another_runner_continues_exactly_like_hf(tiny, make_loop, collect, prefill_runner):
    loop = make_loop(num_blocks=64)
    out = collect(loop)
    prompt, other = tiny.prompts([23, 9], seed=10)
    n = 12
    # a colocated request already running, which the imported one joins
    loop.add_request(req("colocated", other, 30))
    out.wait_for(lambda: len(out.tokens.get("colocated", [])) >= 2)

    block_ids = loop.reserve_kv(req("d", prompt, n))
    assert len(block_ids) == 6  # ceil(23 / 4)
    pblocks, first = prefill(prefill_runner, prompt)
    assert pblocks != block_ids
    half = prefill_runner.model.num_layers // 2
    for layers in (range(0, half), range(half, prefill_runner.model.num_layers)):
        loop.write_kv("d", layers, block_ids, prefill_runner.kv.export_blocks(pblocks, layers))
    # the KV landed in exactly the reserved blocks, and nothing else was allocated for it
    assert loop.call(lambda: loop.reserved["d"].seq.block_table.blocks) == block_ids
    for layer in range(prefill_runner.model.num_layers):
        r = range(layer, layer + 1)
        assert loop.runner.kv.export_blocks(block_ids, r).equal(prefill_runner.kv.export_blocks(pblocks, r))
    loop.complete_kv("d", first, None, 0.01)
    out.wait_all(["d", "colocated"])

    # token #1 went to the client from the prefill side: the decode side streams #2 onwards
    assert [first] + out.tokens["d"] == tiny.greedy(prompt, n)
    final = out.final["d"]
    assert final.finish_reason == "length" and final.num_output_tokens == n
    assert final.num_prompt_tokens == len(prompt)
    assert out.tokens["colocated"] == tiny.greedy(other, 30)
    st = loop.get_stats()
    assert st.free_blocks == st.total_blocks


def test_complete_needs_every_layer_and_writes_need_a_reservation(tiny, make_loop, collect, prefill_runner):
    loop = make_loop(num_blocks=32)
    out = collect(loop)
    prompt = tiny.prompts([10], seed=11)[0]
    with pytest.raises(KeyError):
        loop.write_kv("unknown", range(0, 1), [0, 1, 2], prefill_runner.kv.export_blocks([0, 1, 2], range(0, 1)))
    with pytest.raises(KeyError):
        loop.complete_kv("unknown", 5, None, 0.0)

    block_ids = loop.reserve_kv(req("d", prompt, 4))
    with pytest.raises(ValueError, match="already in use"):
        loop.reserve_kv(req("d", prompt, 4))
    pblocks, first = prefill(prefill_runner, prompt)
    with pytest.raises(ValueError, match="shape"):  # one block short
        loop.write_kv("d", range(0, 1), block_ids, prefill_runner.kv.export_blocks(pblocks[:-1], range(0, 1)))
    with pytest.raises(ValueError, match="not reserved"):
        loop.write_kv("d", range(0, 1), [b + 1 for b in block_ids],
                      prefill_runner.kv.export_blocks(pblocks, range(0, 1)))
    loop.write_kv("d", range(0, 1), block_ids, prefill_runner.kv.export_blocks(pblocks, range(0, 1)))
    with pytest.raises(ValueError, match="incomplete"):
        loop.complete_kv("d", first, None, 0.0)
    loop.write_kv("d", range(1, 2), block_ids, prefill_runner.kv.export_blocks(pblocks, range(1, 2)))
    loop.complete_kv("d", first, None, 0.01)
    out.wait_all(["d"])
    assert [first] + out.tokens["d"] == tiny.greedy(prompt, 4)
    assert out.final["d"].timings["transfer"] == 0.01


def test_an_expired_lease_frees_the_blocks(tiny, make_loop, collect, prefill_runner):
    loop = make_loop(num_blocks=32, kv_reserve_timeout_s=0.2)
    out = collect(loop)
    prompt = tiny.prompts([30], seed=12)[0]
    block_ids = loop.reserve_kv(req("slow", prompt, 4))
    assert loop.get_stats().free_blocks == 32 - 8
    out.wait_all(["slow"], timeout=10)
    final = out.final["slow"]
    assert final.finish_reason == "error" and "lease" in final.error
    st = loop.get_stats()
    assert st.free_blocks == st.total_blocks
    pblocks, first = prefill(prefill_runner, prompt)
    with pytest.raises(KeyError):  # too late: the blocks may belong to someone else now
        loop.write_kv("slow", range(0, 1), block_ids, prefill_runner.kv.export_blocks(pblocks, range(0, 1)))
    with pytest.raises(KeyError):
        loop.complete_kv("slow", first, None, 0.0)
    assert loop.take_outputs(0.1) == []  # exactly one final delta


def test_abort_and_shortage_of_reservations(tiny, make_loop, collect):
    loop = make_loop(num_blocks=16)
    out = collect(loop)
    a, b = tiny.prompts([40, 30], seed=13)
    loop.reserve_kv(req("a", a, 4))  # 10 blocks
    with pytest.raises(OutOfBlocks):
        loop.reserve_kv(req("b", b, 4))  # 8 more: only 6 free, and nothing half-reserved
    assert loop.get_stats().free_blocks == 6
    loop.abort("a")
    out.wait_all(["a"])
    assert out.final["a"].finish_reason == "abort"
    assert loop.get_stats().free_blocks == 16
    loop.reserve_kv(req("b", b, 4))  # the id is free again, and so are the blocks
    loop.abort("b")
    out.wait_all(["b"])
    assert loop.get_stats().free_blocks == 16


def test_blocks_held_by_reservations_make_requests_wait_not_fail(tiny, make_loop, collect):
    """A request that fits the pool but not beside reserved blocks waits for them (they come back
    when the transfer starts decoding, is aborted or expires); it must not fail as if it could never
    fit, nor be dropped after a preemption."""
    loop = make_loop(num_blocks=20)
    out = collect(loop)
    held, prompt = tiny.prompts([48, 30], seed=14)
    loop.reserve_kv(req("held", held, 4))  # 12 of the 20 blocks
    loop.add_request(req("x", prompt, 10))  # 40 tokens = 10 blocks: its 8-block prompt fits now
    out.wait_for(lambda: len(out.tokens.get("x", [])) >= 2)
    time.sleep(0.5)  # by now it needed a 9th block, and had to give its blocks back
    out.poll()
    assert "x" not in out.final, f"x failed: {out.final.get('x')}"
    loop.abort("held")
    out.wait_all(["x", "held"])
    assert out.final["x"].finish_reason == "length", out.final["x"].error
    assert out.tokens["x"] == tiny.greedy(prompt, 10)
    assert loop.get_counters().num_preemptions >= 1
    st = loop.get_stats()
    assert st.free_blocks == st.total_blocks
