"""Disaggregated serving through real Ray actors: one decode actor (``start_workers(role="decode")``)
and two prefill actors with different chunk budgets (``start_prefill_workers``), driven as the
router drives them: ``reserve_kv`` on the decode actor, ``prefill`` on a prefill actor (which
returns token #1), then the decode actor's ``next_outputs``.

One test, in phases, because starting actors is the expensive part: a concurrent mixed batch
identical to HF greedy and to the colocated path; token #1 sampled before the decode side had the
KV; aborts at seeded random moments leave no block in use on any actor; a prefill actor killed
mid-transfer makes the decode actor release the reserved blocks (within the lease) and end those
requests with an error.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

from pd_suite import colocated_outputs, engine_config
from pdserve.decode_worker.messages import WorkerRequest
from pdserve.decode_worker.worker import WorkerConfig, start_workers
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import new_cluster_secret
from pdserve.prefill_worker.worker import KVDestination, PrefillConfig, start_prefill_workers

LEASE_S = 5.0
NEW_TOKENS = 8


class DecodeOutputs:
    """Accumulates the decode actor's deltas (one ``next_outputs`` long poll at a time)."""

    def __init__(self, ray, actor) -> None:
        self.ray, self.actor = ray, actor
        self.tokens: dict[str, list[int]] = {}
        self.final: dict = {}

    def poll(self) -> None:
        for d in self.ray.get(self.actor.next_outputs.remote(0.2), timeout=30):
            assert d.request_id not in self.final, f"delta for {d.request_id} after its final one"
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                self.final[d.request_id] = d

    def wait_final(self, ids, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not all(i in self.final for i in ids):
            assert time.time() < deadline, f"no final delta for {sorted(set(ids) - set(self.final))}"
            self.poll()


def wait_all_free(ray, actors, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while True:
        stats = ray.get([a.stats.remote() for a in actors], timeout=30)
        busy = {s.name: s.total_blocks - s.free_blocks for s in stats if s.free_blocks != s.total_blocks}
        if not busy:
            return
        assert time.time() < deadline, f"blocks still in use after {timeout} s: {busy}"
        time.sleep(0.1)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_disaggregated_actors_match_hf_free_every_block_and_survive_a_dead_prefill(ray_cluster, tiny):
    ray = ray_cluster
    # A request queued on the prefill actor that gets killed never opens its transfer (no router
    # here to abort it): the reservation's timeout frees it.
    secret = new_cluster_secret()  # handed to every actor, as `pdserve serve` does
    decode_config = WorkerConfig(engine=engine_config(tiny, 1024), kv_lease_s=LEASE_S, kv_reserve_timeout_s=LEASE_S,
                                 cluster_secret=secret)

    def prefill_config(budget: int) -> PrefillConfig:
        return PrefillConfig(engine=engine_config(tiny, 512), max_num_batched_tokens=budget, transfer_timeout_s=20,
                             cluster_secret=secret)

    # Start the three actors at once: loading the model is most of their start-up.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        d = pool.submit(start_workers, decode_config, 1, 0.25, role="decode", name_prefix="test-pd-decode")
        p16 = pool.submit(start_prefill_workers, prefill_config(16), 1, 0.25, name_prefix="test-pd-prefill16")
        p128 = pool.submit(start_prefill_workers, prefill_config(128), 1, 0.25, name_prefix="test-pd-prefill128")
        (decode,), (small,), (large,) = d.result(), p16.result(), p128.result()
    actors = [decode, small, large]
    try:
        address = ray.get(decode.kv_address.remote())
        assert address and ray.get(decode.stats.remote()).role == "decode"
        out = DecodeOutputs(ray, decode)

        def start(rid: str, prompt: list[int], prefill_actor, params=None):
            """Reserve on the decode actor, then ask the prefill actor; returns the FirstToken ref."""
            req = WorkerRequest(rid, prompt, params or greedy(), arrival_time=time.time())
            blocks = ray.get(decode.reserve_kv.remote(req), timeout=30)
            return req, prefill_actor.prefill.remote(req, KVDestination(address, blocks))

        # ---- a concurrent mixed batch: identical to HF and to the colocated path -------------
        prompts = tiny.prompts([3, 4, 5, 9, 17, 33, 64, 100, 128, 150, 199, 200], seed=11)
        started = [start(f"m{i}", p, small if i % 2 else large) for i, p in enumerate(prompts)]
        firsts = ray.get([ref for _, ref in started], timeout=60)
        out.wait_final([req.request_id for req, _ in started])
        colocated = colocated_outputs(tiny, prompts, greedy())
        for (req, _), first, p, coloc in zip(started, firsts, prompts, colocated):
            tokens = [first.token_id] + out.tokens[req.request_id]
            assert tokens == tiny.greedy(p, NEW_TOKENS), f"prompt of {len(p)} tokens differs from HF"
            assert tokens == coloc, f"prompt of {len(p)} tokens differs from colocated"
            final = out.final[req.request_id]
            assert final.finish_reason == "length" and final.num_output_tokens == NEW_TOKENS
            # Token #1 was sampled (and returned) before the decode side had the whole KV: the
            # decode actor started the request only once the last frame, sent after sampling, came.
            sampled_at = req.arrival_time + first.timings["queued"] + first.timings["prefill"]
            decode_started_at = req.arrival_time + final.timings["queued"]
            assert sampled_at <= decode_started_at + 0.005, (sampled_at, decode_started_at)
            assert final.timings["transfer"] > 0
        wait_all_free(ray, actors)

        # ---- aborts at seeded random moments: no block stays in use anywhere ---------------------
        rng = random.Random(99)
        moments, refs = {}, {}
        prompts = tiny.prompts([rng.randint(3, 200) for _ in range(16)], seed=12)
        for i, p in enumerate(prompts):
            rid = f"a{i}"
            moments[rid] = moment = rng.choice(["before", "during", "after"])
            target = small if i % 2 else large
            if moment == "before":  # cancelled between the reservation and the prefill call
                ray.get(decode.reserve_kv.remote(WorkerRequest(rid, p, greedy(32))), timeout=30)
                decode.abort.remote(rid)
                target.abort.remote(rid)
                continue
            _, refs[rid] = start(rid, p, target, greedy(32))
            if moment == "during":
                time.sleep(rng.uniform(0, 0.03))
            else:  # after token #1: the transfer is finishing, or decoding has begun
                ray.get(refs[rid], timeout=30)
                time.sleep(rng.uniform(0, 0.03))
            target.abort.remote(rid)
            decode.abort.remote(rid)
        out.wait_final(list(moments))
        for rid, moment in moments.items():
            assert out.final[rid].finish_reason in ("abort", "error", "length"), (rid, out.final[rid])
        assert any(out.final[r].finish_reason == "abort" for r in moments)
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=30)  # aborted prefills raise: fine
        wait_all_free(ray, actors)

        # ---- a prefill actor killed mid-transfer ---------------------------------------------------
        prompts = tiny.prompts([200] * 6, seed=13)
        started = [start(f"k{i}", p, small) for i, p in enumerate(prompts)]
        ready, _ = ray.wait([ref for _, ref in started], num_returns=1, timeout=60)
        assert ready, "no token #1 from the prefill actor"
        killed_at = time.time()
        ray.kill(small)
        actors.remove(small)
        ids = [req.request_id for req, _ in started]
        out.wait_final(ids, timeout=LEASE_S + 15)
        reasons = {rid: out.final[rid].finish_reason for rid in ids}
        assert set(reasons.values()) <= {"length", "error"}, reasons
        errors = [out.final[rid] for rid in ids if reasons[rid] == "error"]
        assert errors, f"the kill came after every transfer had finished: {reasons}"
        assert all(e.error for e in errors)
        wait_all_free(ray, [decode, large], timeout=LEASE_S + 5)
        assert time.time() - killed_at < LEASE_S + 10
    finally:
        for a in actors:
            ray.kill(a)
