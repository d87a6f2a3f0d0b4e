"""The placement policy picks the least loaded worker that can take the request; in disaggregated
mode, the prefill worker that will start on the prompt soonest."""

from __future__ import annotations

from pdserve.router.placement import WorkerLoad, blocks_needed, choose_prefill_worker, choose_worker


def load(name, queued=0, running=0, free=100, total=100, inflight=0, max_inflight=8, block_size=16):
    return WorkerLoad(name, queued, running, free, total, block_size, inflight, max_inflight)


def test_fewest_queued_tokens_wins():
    assert choose_worker([load("a", queued=500), load("b", queued=20)], 32) == "b"


def test_ties_on_queue_go_to_the_most_free_blocks():
    assert choose_worker([load("a", free=10), load("b", free=90)], 32) == "b"


def test_then_to_the_fewest_running():
    assert choose_worker([load("a", running=5), load("b", running=1)], 32) == "b"


def test_full_ties_break_by_name():
    assert choose_worker([load("b"), load("a")], 32) == "a"


def test_workers_at_their_inflight_cap_are_skipped():
    loads = [load("a", inflight=8), load("b", queued=1000, inflight=3)]
    assert choose_worker(loads, 32) == "b"


def test_nobody_with_room_means_none():
    assert choose_worker([load("a", inflight=8), load("b", inflight=8)], 32) is None


def test_a_request_larger_than_a_worker_kv_cache_skips_it():
    small, big = load("small", total=4), load("big", total=64, queued=9999)
    assert choose_worker([small, big], 10 * 16) == "big"
    assert choose_worker([small], 10 * 16) is None


def test_blocks_needed_rounds_up():
    assert blocks_needed(1, 16) == 1
    assert blocks_needed(16, 16) == 1
    assert blocks_needed(17, 16) == 2


# ---- prefill workers ---------------------------------------------------------------------------


def test_prefill_goes_to_the_fewest_queued_prompt_tokens():
    assert choose_prefill_worker([load("p0", queued=900), load("p1", queued=100)], 50) == "p1"


def test_prefill_ignores_free_blocks_and_running():
    # A prefill worker holds KV only until it is pushed: the queue is what delays the next prompt.
    busy_but_short = load("p0", queued=10, free=1, running=9)
    idle_but_long = load("p1", queued=20, free=100, running=0)
    assert choose_prefill_worker([busy_but_short, idle_but_long], 50) == "p0"


def test_prefill_ties_go_to_fewer_inflight_then_the_name():
    assert choose_prefill_worker([load("p0", inflight=3), load("p1", inflight=1)], 50) == "p1"
    assert choose_prefill_worker([load("p1"), load("p0")], 50) == "p0"


def test_prefill_has_no_inflight_cap():
    assert choose_prefill_worker([load("p0", inflight=8, max_inflight=8)], 50) == "p0"


def test_prefill_skips_workers_too_small_for_the_prompt():
    small, big = load("small", total=2), load("big", total=64, queued=5000)
    assert choose_prefill_worker([small, big], 3 * 16) == "big"
    assert choose_prefill_worker([small], 3 * 16) is None
    assert choose_prefill_worker([], 1) is None
