"""The engine thread (``EngineLoop``, no Ray) over a tiny Llama: continuous batching is invisible in
the outputs (token-identical to HF greedy whatever the arrival order, batch composition, chunking
or preemption), aborts and errors leave nothing behind, and a newcomer's prefill does not stall
the requests already decoding.
"""

from __future__ import annotations

import random
import time

import pytest

from pdserve.decode_worker.messages import WorkerRequest
from pdserve.engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [3, 5, 8, 11, 17, 23, 31, 40, 52, 60]
MAX_TOKENS = [12, 5, 20, 9, 16, 3, 14, 7, 18, 10]


def req(rid: str, prompt: list[int], max_tokens: int) -> WorkerRequest:
    return WorkerRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def assert_idle(loop) -> None:
    st = loop.get_stats()
    assert st.free_blocks == st.total_blocks, f"{st.total_blocks - st.free_blocks} blocks still in use"
    assert st.num_running == 0 and st.num_waiting == 0
    assert not loop.call(lambda: loop.seqs or loop.reserved)


SCENARIOS = {
    # name: (arrival order, arrival, max_num_batched_tokens, max_num_seqs)
    "together": ("fifo", "together", 512, 64),
    "reversed_chunked_3_seqs": ("reversed", "together", 7, 3),
    "shuffled_staggered": ("shuffled", "staggered", 16, 64),
    "one_at_a_time": ("fifo", "together", 512, 1),
    "token_by_token_prefill": ("shuffled", "staggered", 4, 5),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_outputs_match_hf_greedy_whatever_the_arrival_and_batch(scenario, tiny, make_loop, collect):
    order, arrival, budget, max_seqs = SCENARIOS[scenario]
    prompts = tiny.prompts(PROMPT_LENGTHS, seed=1)
    expected = {str(i): tiny.greedy(p, n) for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))}
    rng = random.Random(scenario)
    ids = [str(i) for i in range(len(prompts))]
    if order == "reversed":
        ids.reverse()
    elif order == "shuffled":
        rng.shuffle(ids)

    loop = make_loop(num_blocks=256, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    out = collect(loop)
    added = []
    for rid in ids:
        loop.add_request(req(rid, prompts[int(rid)], MAX_TOKENS[int(rid)]))
        added.append(rid)
        if arrival == "staggered":  # the next one joins a running batch, a few tokens later
            seen = sum(len(t) for t in out.tokens.values())
            wait = rng.randint(1, 4)
            out.wait_for(lambda: sum(len(t) for t in out.tokens.values()) >= seen + wait
                         or all(r in out.final for r in added))
    out.wait_all(ids)

    for rid in ids:
        assert out.tokens[rid] == expected[rid], f"request {rid} ({len(prompts[int(rid)])} prompt tokens)"
        final = out.final[rid]
        assert final.finish_reason == "length" and final.error is None
        assert final.num_output_tokens == MAX_TOKENS[int(rid)]
        assert final.num_prompt_tokens == len(prompts[int(rid)])
        assert out.num_finals[rid] == 1
    if max_seqs > 1:  # one step's outputs reach the caller together: several requests per poll
        assert max(len({d.request_id for d in b}) for b in out.batches) > 1
    assert_idle(loop)


@pytest.mark.parametrize("budget", [512, 6])
def test_preemption_by_recompute_keeps_outputs_identical(budget, tiny, make_loop, collect):
    # 20 blocks of 4 tokens: each request fits alone (at most 13 blocks), all four together need 46.
    prompts = tiny.prompts([10, 14, 18, 22], seed=2)
    max_tokens = 30
    expected = [tiny.greedy(p, max_tokens) for p in prompts]
    loop = make_loop(num_blocks=20, max_num_batched_tokens=budget)
    out = collect(loop)
    for i, p in enumerate(prompts):
        loop.add_request(req(str(i), p, max_tokens))
    out.wait_all([str(i) for i in range(len(prompts))])

    counters = loop.get_counters()
    assert counters.num_preemptions > 0
    for i in range(len(prompts)):
        assert out.tokens[str(i)] == expected[i], f"request {i}"
        assert out.final[str(i)].finish_reason == "length"
    # recomputation shows up as prefill work beyond the prompts
    assert counters.prefill_tokens > sum(len(p) for p in prompts)
    assert_idle(loop)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aborts_at_random_moments_free_everything(seed, tiny, make_loop, collect):
    rng = random.Random(seed)
    lengths = [rng.randint(2, 40) for _ in range(16)]
    prompts = tiny.prompts(lengths, seed=seed)
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    ids = [f"r{i}" for i in range(len(prompts))]
    # a small pool (and a small budget) so that aborts also hit waiting, prefilling and preempted ones
    loop = make_loop(num_blocks=40, max_num_batched_tokens=rng.choice([8, 32, 512]), max_num_seqs=8)
    out = collect(loop)
    out.take = lambda: loop.take_outputs(0.01)
    aborted: set[str] = set()
    pending = list(zip(ids, prompts, max_tokens))
    while pending or len(out.final) < len(ids):
        if pending and rng.random() < 0.5:
            rid, p, n = pending.pop(0)
            loop.add_request(req(rid, p, n))
        if rng.random() < 0.3:
            added = [r for r in ids[: len(ids) - len(pending)] if r not in aborted]
            if added:
                victim = rng.choice(added)  # maybe waiting, running, or already finished
                loop.abort(victim)
                aborted.add(victim)
        if rng.random() < 0.1:
            loop.abort("no-such-request")  # a no-op
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.01)
        out.poll()
    assert aborted, "the seed aborted nothing"

    for rid, p, n in zip(ids, prompts, max_tokens):
        assert out.num_finals[rid] == 1
        final = out.final[rid]
        got = out.tokens.get(rid, [])
        if rid in aborted:
            assert final.finish_reason in ("abort", "length")
            assert got == tiny.greedy(p, n)[: len(got)]
        else:
            assert final.finish_reason == "length"
            assert got == tiny.greedy(p, n)
    assert any(out.final[r].finish_reason == "abort" for r in aborted)
    # aborting a finished request later sends nothing
    loop.abort(ids[0])
    assert loop.take_outputs(0.2) == []
    assert_idle(loop)


def test_a_new_request_prefills_in_chunks_while_others_keep_decoding(tiny, make_loop, collect):
    budget = 8
    first, second = tiny.prompts([5, 100], seed=3)
    loop = make_loop(max_num_batched_tokens=budget)
    out = collect(loop)
    loop.add_request(req("first", first, 200))
    out.wait_for(lambda: len(out.tokens.get("first", [])) >= 3)

    plans = []  # per step: what ran, and how many tokens "first" had produced before it

    def spy():
        orig = loop.scheduler.schedule

        def schedule():
            o = orig()
            by_id = {x.seq.request_id: x for x in o.scheduled}
            made = by_id["first"].seq.num_output_tokens if "first" in by_id else None
            plans.append(({r: x.num_tokens for r, x in by_id.items()}, made))
            return o

        loop.scheduler.schedule = schedule

    loop.call(spy)  # installed between two steps, on the engine thread
    mark = sum(len(b) for b in out.batches)
    loop.add_request(req("second", second, 5))
    out.wait_all(["first", "second"])

    # its 100 prompt tokens went in chunks of (budget - 1), next to one decode token of "first"
    chunked = [(p, made) for p, made in plans if p.get("second", 0) > 1]
    assert len(chunked) >= 100 // (budget - 1)
    for p, made in chunked:
        assert p["first"] == 1 and p["second"] <= budget - 1
    # ... and "first" produced a token in every one of those steps
    mades = [made for _, made in chunked]
    assert mades == list(range(mades[0], mades[0] + len(mades)))
    # on the caller's side, "first" kept streaming before "second"'s first token came out
    after = [d for b in out.batches for d in b][mark:]
    first_of_second = next(i for i, d in enumerate(after) if d.request_id == "second")
    assert sum(1 for d in after[:first_of_second] if d.request_id == "first") >= len(chunked) - 2
    assert out.tokens["first"] == tiny.greedy(first, 200)
    assert out.tokens["second"] == tiny.greedy(second, 5)
    assert_idle(loop)


def test_a_request_bigger_than_the_pool_is_rejected_and_others_keep_going(tiny, make_loop, collect):
    loop = make_loop(num_blocks=16)  # 64 token slots
    out = collect(loop)
    ok_prompt, big_prompt = tiny.prompts([12, 40], seed=4)
    loop.add_request(req("ok", ok_prompt, 30))
    with pytest.raises(ValueError, match="blocks"):
        loop.add_request(req("big", big_prompt, 40))  # 80 tokens > 64
    with pytest.raises(ValueError, match="already in use"):
        loop.add_request(req("ok", ok_prompt, 3))
    loop.add_request(req("after", big_prompt, 20))  # 60 tokens: fits once "ok" is done
    out.wait_all(["ok", "after"])
    assert "big" not in out.tokens and "big" not in out.final
    assert out.tokens["ok"] == tiny.greedy(ok_prompt, 30)
    assert out.tokens["after"] == tiny.greedy(big_prompt, 20)
    assert_idle(loop)


def test_counters_split_prefill_and_decode_work(tiny, make_loop, collect):
    prompts = tiny.prompts([9, 20], seed=5)
    loop = make_loop(max_num_batched_tokens=512)
    out = collect(loop)
    for i, p in enumerate(prompts):
        loop.add_request(req(str(i), p, 6))
    out.wait_all(["0", "1"])
    c = loop.get_counters()
    assert c.prefill_tokens == 29
    assert c.decode_tokens == 2 * 5  # the first token of each comes from its prefill
    assert c.num_steps >= 6
    assert c.prefill_step_s > 0 and c.decode_step_s > 0
    assert c.num_preemptions == 0


def test_a_sequence_whose_sampling_fails_ends_alone(tiny, make_loop, collect):
    """A sampling failure (here a NaN temperature that skipped validation) ends its own request
    with "error"; its batch-mates in the same steps go on, token-identical to HF greedy."""
    prompts = tiny.prompts([9, 14, 6], seed=6)
    loop = make_loop()
    out = collect(loop)
    bad = SamplingParams(max_tokens=10, temperature=float("nan"), seed=3, ignore_eos=True)
    loop.call(lambda: [loop._add(req("a", prompts[0], 12)), loop._add(WorkerRequest("bad", prompts[1], bad)),
                       loop._add(req("c", prompts[2], 8))])  # one call: the three share their steps
    out.wait_all(["a", "bad", "c"])
    assert out.final["bad"].finish_reason == "error" and "sampling failed" in out.final["bad"].error
    assert out.tokens["bad"] == []
    assert out.tokens["a"] == tiny.greedy(prompts[0], 12)
    assert out.tokens["c"] == tiny.greedy(prompts[2], 8)
    assert_idle(loop)


def test_an_abort_that_overtakes_its_request_leaves_no_orphan(tiny, make_loop, collect):
    """The actor runs calls on several threads, so ``abort(id)`` can arrive before the
    ``add_request``/``reserve_kv`` sent just before it. The request that turns up later never runs
    and holds nothing."""
    from pdserve.decode_worker.worker import RequestAborted

    prompt = tiny.prompts([10], seed=7)[0]
    loop = make_loop()
    out = collect(loop)
    loop.abort("late")
    loop.add_request(req("late", prompt, 50))
    loop.abort("late-kv")
    with pytest.raises(RequestAborted, match="aborted before its reservation arrived"):
        loop.reserve_kv(req("late-kv", prompt, 50))
    loop.add_request(req("normal", prompt, 5))  # an id aborted early is dropped once, not blocked forever
    out.wait_all(["late", "normal"])
    assert out.final["late"].finish_reason == "abort" and out.tokens["late"] == []
    assert out.tokens["normal"] == tiny.greedy(prompt, 5)
    assert_idle(loop)
    assert len(loop.early_aborts) == 0


def test_early_aborts_are_bounded_and_expire():
    from pdserve.decode_worker.aborts import EarlyAborts

    ids = EarlyAborts(ttl_s=10.0, max_ids=3)
    for i in range(5):
        ids.remember(f"r{i}", now=float(i))
    assert len(ids) == 3  # the oldest two went
    assert not ids.take("r0", now=5.0) and ids.take("r2", now=5.0) and not ids.take("r2", now=5.0)
    assert not ids.take("r3", now=13.5)  # expired at 13
    assert ids.take("r4", now=13.5)
    assert len(ids) == 0
