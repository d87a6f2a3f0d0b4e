"""The prefill engine and a decode ``EngineLoop`` in one process, joined by a real KV transport.

The path is the disaggregated one without Ray: the decode loop reserves blocks
(``reserve_kv``), the prefill engine computes the prompt in chunks under its token budget, pushes
each layer's completed blocks while later layers and chunks are still being computed, returns
token #1 at once, and the decode loop continues from it when the whole KV has arrived. Greedy
output must be token-identical to Hugging Face ``generate()`` and to the colocated path.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest
import torch

from pd_suite import BLOCK_SIZE, CLUSTER_SECRET, colocated_outputs, drain, wait_until
from pdserve.decode_worker.messages import WorkerRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import KVSender, Transfer, make_sender
from pdserve.prefill_worker.worker import FirstToken, KVDestination

LENGTHS = [3, 4, 5, 9, 16, 17, 31, 64, 99, 128, 150, 200]
NEW_TOKENS = 8


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_disaggregated(pd, prompts: list[list[int]], params: SamplingParams, prefix: str = "r",
                      timeout: float = 60.0) -> tuple[dict[str, FirstToken], dict[str, list]]:
    """Submit every prompt at once (reserve on decode, then prefill); return the first tokens and the
    decode side's deltas per request id."""
    futures = {}
    for i, p in enumerate(prompts):
        req = WorkerRequest(f"{prefix}{i}", p, params, arrival_time=time.time())
        blocks = pd.decode.reserve_kv(req)
        futures[req.request_id] = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks))
    firsts = {rid: f.result(timeout=timeout) for rid, f in futures.items()}
    deltas = drain(lambda: pd.decode.take_outputs(0.2), set(futures), timeout)
    return firsts, deltas


def assert_all_blocks_free(pd, timeout: float = 10.0) -> None:
    def free() -> bool:
        d, p = pd.decode.get_stats(), pd.prefill.stats()
        return d.free_blocks == d.total_blocks and p.free_blocks == p.total_blocks

    wait_until(free, timeout, "every block back on both sides")


@pytest.fixture(scope="module")
def colocated_reference(tiny) -> list[list[int]]:
    """Outputs of the colocated path (one ``EngineLoop`` prefilling and decoding) for ``LENGTHS``."""
    before = torch.get_num_threads()
    try:
        return colocated_outputs(tiny, tiny.prompts(LENGTHS, seed=7), greedy())
    finally:
        torch.set_num_threads(before)  # the engine runs on one thread (engine_config)


@pytest.mark.parametrize("budget,transport,kv_push", [(16, "grpc", "layer"), (64, "grpc", "layer"), (512, "grpc", "layer"),
                                                      (64, "collective", "layer"), (16, "grpc", "chunk"),
                                                      (64, "collective", "chunk")])
def test_concurrent_mixed_batch_is_identical_to_hf_and_colocated(tiny, make_pd, colocated_reference, budget,
                                                                  transport, kv_push):
    """Prompts of 3..200 tokens prefilled together under a chunk budget of ``budget`` tokens per
    step (one budget is enough for the collective transport: the chunking does not depend on it),
    their KV pushed layer by layer or chunk by chunk."""
    pd = make_pd(max_num_batched_tokens=budget, transport=transport, kv_push=kv_push)
    prompts = tiny.prompts(LENGTHS, seed=7)
    firsts, deltas = run_disaggregated(pd, prompts, greedy())
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        decoded = [t for d in deltas[rid] for t in d.token_ids]
        tokens = [firsts[rid].token_id] + decoded  # token #1 reached the client from the prefill side
        assert tokens == tiny.greedy(p, NEW_TOKENS), f"prompt of {len(p)} tokens differs from HF"
        assert tokens == colocated_reference[i], f"prompt of {len(p)} tokens differs from colocated"
        final = deltas[rid][-1]
        assert final.finish_reason == "length" and final.error is None
        assert final.num_output_tokens == NEW_TOKENS and final.num_prompt_tokens == len(p)
        assert "transfer" in final.timings
        assert firsts[rid].num_prompt_tokens == len(p)
    assert_all_blocks_free(pd)
    assert pd.prefill.num_transfers == len(prompts)


class GatedSink:
    """The decode loop as a KV sink, except that ``complete_kv`` waits for ``gate``: the decode
    side cannot have the whole KV before the test opens the gate."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self.gate = threading.Event()
        self.completing = threading.Event()

    def __getattr__(self, name):  # runner, config, ...: the loop's
        return getattr(self.loop, name)

    def write_kv(self, *args) -> None:
        self.loop.write_kv(*args)

    def fail_kv(self, *args) -> None:
        self.loop.fail_kv(*args)

    def complete_kv(self, *args) -> None:
        self.completing.set()
        assert self.gate.wait(30), "gate never opened"
        self.loop.complete_kv(*args)


def test_token_one_is_returned_before_the_decode_side_has_the_kv(tiny, make_pd):
    gated = {}

    def sink(loop):
        gated["sink"] = GatedSink(loop)
        return gated["sink"]

    pd = make_pd(max_num_batched_tokens=32, sink=sink)
    gate = gated["sink"]
    prompt = tiny.prompts([90], seed=3)[0]
    req = WorkerRequest("early", prompt, greedy())
    blocks = pd.decode.reserve_kv(req)
    first = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks)).result(timeout=30)
    # token #1 is in hand, while the decode side still waits for the end of the transfer
    assert first.token_id == tiny.greedy(prompt, 1)[0]
    assert not gate.gate.is_set()
    assert pd.decode.call(lambda: "early" in pd.decode.reserved), "the decode side already started"
    assert pd.decode.take_outputs(0.1) == []
    gate.gate.set()
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {"early"})
    assert [first.token_id] + [t for d in deltas["early"] for t in d.token_ids] == tiny.greedy(prompt, NEW_TOKENS)
    assert_all_blocks_free(pd)


class RecordingSender(KVSender):
    """A real sender whose transfers also record each piece: ``(request, layers, block count,
    bytes, time)``."""

    name = "recording"

    def __init__(self, inner: KVSender) -> None:
        self.inner = inner
        self.pieces: list[tuple[str, range, int, int, float]] = []
        self.finished: dict[str, float] = {}

    def open(self, request_id, destination, num_layers, num_blocks, timeout_s) -> Transfer:
        t = self.inner.open(request_id, destination, num_layers, num_blocks, timeout_s)
        outer = self

        class Recording(Transfer):
            state = property(lambda self: t.state)

            def send(self, layers, block_ids, data):
                outer.pieces.append((request_id, layers, len(block_ids), data.numel() * data.element_size(),
                                     time.perf_counter()))
                t.send(layers, block_ids, data)

            def finish(self, first_token, first_logprob=None):
                outer.finished[request_id] = time.perf_counter()
                return t.finish(first_token, first_logprob)

            def abort(self, reason="aborted"):
                t.abort(reason)

        return Recording()

    def close(self) -> None:
        self.inner.close()


def test_kv_is_pushed_chunk_by_chunk_in_frames_of_about_frame_bytes(tiny, make_pd):
    """Layers are grouped into pieces of about ``frame_bytes``; a long prompt's first blocks leave
    while its later chunks are still to be computed; every (layer, block) is sent exactly once."""
    sender = RecordingSender(make_sender("grpc", secret=CLUSTER_SECRET))
    per_layer_block = 2 * BLOCK_SIZE * 2 * 16 * 4  # k and v, block of 4 tokens, 2 KV heads of 16, float32
    frame_bytes = 3 * per_layer_block * 2  # about two layers of three blocks
    pd = make_pd(max_num_batched_tokens=12, sender=sender, frame_bytes=frame_bytes)
    prompt = tiny.prompts([150], seed=4)[0]
    firsts, deltas = run_disaggregated(pd, [prompt], greedy(4))
    assert [firsts["r0"].token_id] + [t for d in deltas["r0"] for t in d.token_ids] == tiny.greedy(prompt, 4)
    pieces = [p for p in sender.pieces if p[0] == "r0"]
    num_blocks = -(-150 // BLOCK_SIZE)
    assert sum(len(layers) * n for _, layers, n, _, _ in pieces) == 2 * num_blocks
    for _, layers, n, nbytes, _ in pieces:
        assert nbytes == len(layers) * n * per_layer_block
        assert nbytes <= max(frame_bytes, n * per_layer_block)  # grouped up to frame_bytes, at least one layer
    # a chunk of 12 tokens completes 3 blocks: the push started long before the last chunk
    assert len(pieces) > 10
    assert pieces[0][4] < sender.finished["r0"] and pieces[0][2] <= 3
    assert_all_blocks_free(pd)



@pytest.mark.parametrize("kv_push", ["layer", "chunk"])
def test_kv_push_layer_sends_during_the_chunk_and_chunk_after_it(tiny, make_pd, kv_push):
    """Both push the same pieces. ``layer``: the last chunk's pieces leave while it is computed,
    before token #1 is sampled. ``chunk``: they leave once the chunk is computed, after token #1 is
    handed over (and earlier chunks' pieces before the last chunk starts)."""
    sender = RecordingSender(make_sender("grpc", secret=CLUSTER_SECRET))
    per_layer_block = 2 * BLOCK_SIZE * 2 * 16 * 4
    pd = make_pd(max_num_batched_tokens=64, sender=sender, frame_bytes=3 * per_layer_block * 2, kv_push=kv_push)
    prompt = tiny.prompts([150], seed=4)[0]  # three chunks: 64, 64, 22 tokens
    token_at: list[float] = []
    req = WorkerRequest("r0", prompt, greedy(4), arrival_time=time.time())
    blocks = pd.decode.reserve_kv(req)
    fut = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks))
    fut.add_done_callback(lambda f: token_at.append(time.perf_counter()))
    first = fut.result(timeout=60)
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {"r0"}, 60)
    assert [first.token_id] + [t for d in deltas["r0"] for t in d.token_ids] == tiny.greedy(prompt, 4)
    pieces = [p for p in sender.pieces if p[0] == "r0"]
    num_layers = pd.prefill.runner.model.num_layers
    # Every (layer, block) once, in pieces of at most two layers (frame_bytes) of one chunk's blocks.
    assert sum(len(layers) * n for _, layers, n, _, _ in pieces) == num_layers * -(-150 // BLOCK_SIZE)
    last_layer_pieces = [p for p in pieces if p[1].stop == num_layers]
    assert len(last_layer_pieces) == 3  # one per chunk
    final_chunk_piece = last_layer_pieces[-1][4]
    if kv_push == "layer":
        assert final_chunk_piece < token_at[0]
    else:
        assert final_chunk_piece > token_at[0]
    assert_all_blocks_free(pd)


def test_prefill_config_rejects_an_unknown_kv_push():
    from pdserve.prefill_worker.worker import PrefillConfig

    with pytest.raises(ValueError, match="kv_push"):
        PrefillConfig(kv_push="token")


def test_a_prompt_is_admitted_and_its_transfer_opened_only_when_the_budget_reaches_it(tiny, make_pd):
    """Admission fills the step's token budget, not more: a prompt waiting behind others holds no
    prefill blocks and no open transfer, so its transfer deadline does not run while it waits."""
    sender = RecordingSender(make_sender("grpc", secret=CLUSTER_SECRET))
    opened: list[str] = []
    inner_open = sender.open

    def open_(request_id, *args):
        opened.append(request_id)
        return inner_open(request_id, *args)

    sender.open = open_
    pd = make_pd(max_num_batched_tokens=16, sender=sender, decode_blocks=1024)
    prompts = tiny.prompts([200] * 8, seed=9)
    futures = []
    for i, p in enumerate(prompts):
        req = WorkerRequest(f"q{i}", p, greedy(2))
        futures.append(pd.prefill.submit(req, KVDestination(pd.receiver.address, pd.decode.reserve_kv(req))))
    futures[0].result(timeout=30)
    # 200-token prompts, 16 tokens per step: the second prompt joins the batch in the first prompt's
    # last step; the third only once the second is nearly done
    assert len(opened) <= 3, f"{len(opened)} transfers open after the first prompt's 13 steps"
    for f in futures:
        f.result(timeout=60)
    drain(lambda: pd.decode.take_outputs(0.2), {f"q{i}" for i in range(len(prompts))})
    assert_all_blocks_free(pd)


# ---- failures: blocks come back on both sides ----------------------------------------------------


def test_aborts_at_random_moments_leave_no_block_in_use(tiny, make_pd):
    """Seeded: each request is aborted (on both sides, as the router does) before its prefill,
    while it is being prefilled or pushed, or after token #1; the rest run to the end."""
    rng = random.Random(1234)
    pd = make_pd(max_num_batched_tokens=16, decode_blocks=1024)
    prompts = tiny.prompts([rng.randint(3, 200) for _ in range(24)], seed=5)
    futures, moments = {}, {}
    for i, p in enumerate(prompts):
        rid = f"a{i}"
        req = WorkerRequest(rid, p, greedy(16))
        blocks = pd.decode.reserve_kv(req)
        moments[rid] = rng.choice(["before", "during", "after", "never"])
        if moments[rid] == "before":
            pd.decode.abort(rid)
            pd.prefill.abort(rid)
            continue
        futures[rid] = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks))
    for rid, fut in futures.items():
        if moments[rid] == "during":
            time.sleep(rng.uniform(0, 0.02))
            pd.prefill.abort(rid)
            pd.decode.abort(rid)
    for rid, fut in futures.items():
        if moments[rid] == "after":
            fut.result(timeout=30)
            time.sleep(rng.uniform(0, 0.02))
            pd.prefill.abort(rid)
            pd.decode.abort(rid)
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {f"a{i}" for i in range(len(prompts))})
    for rid, moment in moments.items():
        final = deltas[rid][-1]
        if moment == "never":
            assert final.finish_reason == "length", (rid, final)
        elif moment == "before":
            assert final.finish_reason == "abort"
        else:  # aborted on the decode side, or its transfer failed first, or it had already finished
            assert final.finish_reason in ("abort", "error", "length"), (rid, final)
    assert {m for m in moments.values()} == {"before", "during", "after", "never"}
    assert_all_blocks_free(pd)


def test_a_reservation_released_by_the_decode_side_frees_the_prefill_blocks(tiny, make_pd):
    """The decode side gave the blocks back (lease, abort): the push fails, and the prefill side
    frees its copy too. Token #1 was already sampled, so the prefill still returns it."""
    pd = make_pd(max_num_batched_tokens=64)
    prompt = tiny.prompts([40], seed=6)[0]
    req = WorkerRequest("gone", prompt, greedy())
    blocks = pd.decode.reserve_kv(req)
    pd.decode.abort("gone")
    first = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks)).result(timeout=30)
    assert first.token_id == tiny.greedy(prompt, 1)[0]
    assert_all_blocks_free(pd)
    assert pd.prefill.num_transfers == 0


def test_an_unreachable_decode_actor_frees_the_prefill_blocks(tiny, make_pd):
    pd = make_pd(max_num_batched_tokens=64)
    prompt = tiny.prompts([30], seed=8)[0]
    address = pd.receiver.address
    pd.receiver.stop()
    fut = pd.prefill.submit(WorkerRequest("lost", prompt, greedy()), KVDestination(address, list(range(8))))
    try:
        fut.result(timeout=30)
    except RuntimeError as exc:  # a transport may refuse at open
        assert address.split("|")[0] in str(exc)
    wait_until(lambda: pd.prefill.stats().free_blocks == pd.prefill.stats().total_blocks, 10,
               "the prefill blocks back")
    assert pd.prefill.num_transfers == 0


def test_a_stalled_decode_side_is_released_by_the_lease(tiny, make_pd):
    """The prefill never comes (a lost router call): the decode lease gives the blocks back and
    ends the request with an error naming the lease."""
    pd = make_pd(kv_reserve_timeout_s=0.5)
    pd.decode.reserve_kv(WorkerRequest("orphan", tiny.prompts([20])[0], greedy()))
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {"orphan"}, timeout=10)
    final = deltas["orphan"][-1]
    assert final.finish_reason == "error" and "lease" in final.error
    assert_all_blocks_free(pd)


def test_bad_destinations_are_refused_at_once(tiny, make_pd):
    pd = make_pd()
    prompt = tiny.prompts([10])[0]  # 3 blocks of 4
    with pytest.raises(ValueError, match="block size"):
        pd.prefill.submit(WorkerRequest("x", prompt, greedy()),
                          KVDestination(pd.receiver.address, [1, 2])).result(timeout=10)
    blocks = pd.decode.reserve_kv(WorkerRequest("dup", prompt, greedy()))
    fut = pd.prefill.submit(WorkerRequest("dup", prompt, greedy()), KVDestination(pd.receiver.address, blocks))
    with pytest.raises(ValueError, match="already"):
        pd.prefill.submit(WorkerRequest("dup", prompt, greedy()),
                          KVDestination(pd.receiver.address, blocks)).result(timeout=10)
    fut.result(timeout=30)
    drain(lambda: pd.decode.take_outputs(0.2), {"dup"})
    assert_all_blocks_free(pd)


def test_a_prompt_whose_sampling_fails_fails_alone(tiny, make_pd):
    """Token #1 of one prompt cannot be sampled (a NaN temperature that skipped validation): that
    prefill fails, the prompts prefilled beside it get their token #1 and decode as usual."""
    pd = make_pd(max_num_batched_tokens=512)
    prompts = tiny.prompts([7, 12, 9], seed=12)
    bad = SamplingParams(max_tokens=NEW_TOKENS, temperature=float("nan"), seed=1, ignore_eos=True)
    futures = {}
    for i, p in enumerate(prompts):
        req = WorkerRequest(f"s{i}", p, bad if i == 1 else greedy(), arrival_time=time.time())
        blocks = pd.decode.reserve_kv(req)
        futures[req.request_id] = pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks))
    with pytest.raises(RuntimeError, match="sampling failed"):
        futures["s1"].result(timeout=30)
    pd.decode.abort("s1")  # what the router does when a prefill fails
    firsts = {rid: futures[rid].result(timeout=30) for rid in ("s0", "s2")}
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {"s0", "s2"})
    for i in (0, 2):
        rid = f"s{i}"
        got = [firsts[rid].token_id] + [t for d in deltas[rid] for t in d.token_ids]
        assert got == tiny.greedy(prompts[i], NEW_TOKENS)
    assert_all_blocks_free(pd)


def test_an_abort_that_overtakes_its_prefill_leaves_no_orphan(tiny, make_pd):
    pd = make_pd()
    prompt = tiny.prompts([20], seed=13)[0]
    pd.prefill.abort("late")  # before its prefill arrives
    req = WorkerRequest("late", prompt, greedy(), arrival_time=time.time())
    blocks = pd.decode.reserve_kv(req)
    with pytest.raises(concurrent.futures.CancelledError):
        pd.prefill.submit(req, KVDestination(pd.receiver.address, blocks)).result(timeout=30)
    pd.decode.abort("late")
    ok = WorkerRequest("ok", prompt, greedy(), arrival_time=time.time())
    first = pd.prefill.submit(ok, KVDestination(pd.receiver.address, pd.decode.reserve_kv(ok))).result(timeout=30)
    deltas = drain(lambda: pd.decode.take_outputs(0.2), {"ok"})
    assert [first.token_id] + [t for d in deltas["ok"] for t in d.token_ids] == tiny.greedy(prompt, NEW_TOKENS)
    assert pd.prefill.stats().num_running == 0 and pd.prefill.stats().num_waiting == 0
    assert_all_blocks_free(pd)
