"""The router's disaggregated request flow over gRPC, with stand-in actors and no model.

``FakeDecodeWorker`` and ``FakePrefillWorker`` exist only in this file. They speak the decode and
prefill actor interfaces (reserve_kv / prefill / abort / next_outputs / stats / model_info) and
"generate" by echoing the prompt: token k is prompt token k, token #1 from the prefill worker and
the rest from the decode worker. The prefill worker starts the decode side (the end of the "KV
transfer") *before* it answers the router, and answers late, so the decode worker's deltas always
overtake token #1: what the router does with that race, with a full KV pool, and with prefill
workers that fail, die or hang, is what these tests pin down.

The actors live for the whole module (a fake prefill worker imports the real prefill module, which
takes seconds); each test configures them and puts a router of its own in front.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import ray

from pdserve.client import Client, RequestError
from pdserve.decode_worker.messages import RequestDelta, WorkerRequest, WorkerStats
from pdserve.engine.block_allocator import OutOfBlocks
from pdserve.prefill_worker.worker import FirstToken, KVDestination
from pdserve.router.server import RouterConfig, start_in_thread

BLOCK = 16
EOS = 2
# The actor classes here reach Ray's workers pickled by value, but module-level functions (and
# static methods) would go by reference to this module, which the workers cannot import: keep the
# actors' code inside their methods.


@ray.remote(num_cpus=0)
class FakeDecodeWorker:
    """Reserves block ids from a pool of ``total_blocks``; after ``start`` (token #1 arrived with
    the KV) emits one echoed token per step for every running request."""

    def __init__(self, name: str):
        self.name = name
        self.ready = asyncio.Event()
        self.generation = 0
        self.loop_task = None
        self.reset()

    def reset(self, total_blocks: int = 64, step_s: float = 0.005) -> None:
        """Forget everything; long polls still waiting from an earlier router return empty."""
        if self.loop_task is not None:
            self.loop_task.cancel()
            self.loop_task = None
        self.total = total_blocks
        self.free = list(range(total_blocks))
        self.step_s = step_s
        self.reserved: dict[str, tuple[WorkerRequest, list[int]]] = {}
        self.running: dict[str, dict] = {}
        self.events: list[tuple[str, str]] = []
        self.outbox: list[RequestDelta] = []
        self.generation += 1
        self.ready.set()

    async def kv_address(self) -> str:
        return self.name  # the fake prefill worker finds this actor by name

    async def reserve_kv(self, req: WorkerRequest) -> list[int]:
        need = -(-(len(req.prompt_token_ids) + req.params.max_tokens) // BLOCK)
        if need > self.total:
            raise ValueError(f"request needs {need} blocks but this worker's pool holds {self.total} blocks")
        if need > len(self.free):
            raise OutOfBlocks(f"{need} blocks asked, {len(self.free)} free")
        blocks, self.free = self.free[:need], self.free[need:]
        self.reserved[req.request_id] = (req, blocks)
        self.events.append(("reserve", req.request_id))
        return blocks[: -(-len(req.prompt_token_ids) // BLOCK)]

    async def start(self, request_id: str, first_token: int) -> None:
        req, blocks = self.reserved.pop(request_id)  # KeyError once aborted
        self.events.append(("start", request_id))
        st = {"req": req, "blocks": blocks, "n": 1, "t0": time.monotonic()}
        p = req.params
        if first_token in p.stop_token_ids or (first_token == EOS and not p.ignore_eos):
            self._finish(request_id, st, "stop")
        elif p.max_tokens == 1:
            self._finish(request_id, st, "length")
        else:
            self.running[request_id] = st
            if self.loop_task is None:
                self.loop_task = asyncio.get_running_loop().create_task(self._steps())

    async def fail_transfer(self, request_id: str, delay_s: float) -> None:
        """The KV of a reserved request will not arrive: release it with an error, later."""
        async def later():
            await asyncio.sleep(delay_s)
            if request_id in self.reserved:
                _, blocks = self.reserved.pop(request_id)
                self.free += blocks
                self.events.append(("fail", request_id))
                self._emit(RequestDelta(request_id, [], finish_reason="error", error="KV transfer failed: peer gone"))

        asyncio.get_running_loop().create_task(later())

    async def abort(self, request_id: str) -> None:
        self.events.append(("abort", request_id))
        if request_id in self.reserved:
            _, blocks = self.reserved.pop(request_id)
            self.free += blocks
            self._emit(RequestDelta(request_id, [], finish_reason="abort"))
        elif request_id in self.running:
            self._finish(request_id, self.running.pop(request_id), "abort")

    async def next_outputs(self) -> list[RequestDelta]:
        generation = self.generation
        await self.ready.wait()
        self.ready.clear()
        if generation != self.generation:
            return []
        out, self.outbox = self.outbox, []
        return out

    async def stats(self) -> WorkerStats:
        return WorkerStats(self.name, "decode", len(self.running), 0, 0, len(self.free), self.total, BLOCK)

    async def model_info(self) -> dict:
        return {"model": "echo", "max_model_len": 2048, "vocab_size": 49152, "eos_token_ids": [EOS],
                "block_size": BLOCK}

    async def log(self) -> list[tuple[str, str]]:
        return self.events

    def _emit(self, delta: RequestDelta) -> None:
        self.outbox.append(delta)
        self.ready.set()

    def _finish(self, rid: str, st: dict, reason: str, delta: RequestDelta | None = None) -> None:
        self.free += st["blocks"]
        delta = delta or RequestDelta(rid, [])
        delta.finish_reason = reason
        delta.num_prompt_tokens = len(st["req"].prompt_token_ids)
        delta.num_output_tokens = st["n"]
        delta.timings = {"queued": 9.0, "prefill": 9.0, "transfer": 0.125, "decode": time.monotonic() - st["t0"]}
        self._emit(delta)

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for rid, st in list(self.running.items()):
                req: WorkerRequest = st["req"]
                # The original prompt, cyclically; a migrated request's prompt ends with the
                # num_generated tokens of earlier attempts, so it continues where they stopped.
                original = req.prompt_token_ids[:len(req.prompt_token_ids) - req.num_generated]
                token = original[(req.num_generated + st["n"]) % len(original)]
                st["n"] += 1
                delta = RequestDelta(rid, [token], [-0.5] if req.params.logprobs else None)
                if st["n"] >= req.params.max_tokens:
                    del self.running[rid]
                    self._finish(rid, st, "length", delta)
                else:
                    self._emit(delta)


@ray.remote(num_cpus=0)
class FakePrefillWorker:
    """Token #1 is the prompt's first token (a migrated request's: the next one). ``mode``: "ok" (start the decode side, then answer
    ``reply_delay_s`` later), "fail" (raise), "hang" (until aborted), "lose_kv" (answer, but the
    KV never reaches the decode side), "lose_kv_and_die" (the same, and the process exits)."""

    def __init__(self, name: str):
        self.name = name
        self.configure()

    def configure(self, mode: str = "ok", reply_delay_s: float = 0.2) -> None:
        self.mode = mode
        self.reply_delay_s = reply_delay_s
        self.received: list[str] = []
        self.aborted: list[str] = []
        self.abort_events: dict[str, asyncio.Event] = {}

    async def prefill(self, req: WorkerRequest, dest: KVDestination) -> FirstToken:
        self.received.append(req.request_id)
        assert len(dest.block_ids) == -(-len(req.prompt_token_ids) // BLOCK)
        if self.mode == "fail":
            raise RuntimeError("the prompt set the prefill worker on fire")
        if self.mode == "hang":
            ev = self.abort_events.setdefault(req.request_id, asyncio.Event())
            await ev.wait()
            raise RuntimeError(f"request {req.request_id} was aborted")
        original = req.prompt_token_ids[:len(req.prompt_token_ids) - req.num_generated]  # as the decode fake
        token = original[req.num_generated % len(original)]
        decode = ray.get_actor(dest.address)
        if self.mode.startswith("lose_kv"):
            await decode.fail_transfer.remote(req.request_id, 0.3)
            if self.mode == "lose_kv_and_die":
                import os

                asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        else:
            await decode.start.remote(req.request_id, token)
            await asyncio.sleep(self.reply_delay_s)  # the decode worker's deltas overtake this answer
        return FirstToken(req.request_id, token, -0.25 if req.params.logprobs else None,
                          len(req.prompt_token_ids), {"queued": 0.0125, "prefill": 0.025})

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_events.setdefault(request_id, asyncio.Event()).set()

    async def stats(self) -> WorkerStats:
        return WorkerStats(self.name, "prefill", 0, 0, 0, 1000, 1000, BLOCK)

    async def model_info(self) -> dict:
        return {"model": "echo", "max_model_len": 2048, "vocab_size": 49152, "eos_token_ids": [EOS],
                "block_size": BLOCK}

    async def ready(self) -> str:
        return self.name

    async def log(self) -> tuple[list[str], list[str]]:
        return self.received, self.aborted


@pytest.fixture(scope="module")
def actors(ray_session):
    """One fake decode worker, two healthy fake prefill workers ("x", "y") and three to kill ("a",
    "b", "c": they sort first, so placement picks them when the healthy ones are idle too)."""
    tag = uuid.uuid4().hex[:6]
    decode = FakeDecodeWorker.options(name=f"fake-decode-{tag}").remote(f"fake-decode-{tag}")
    prefill = {k: FakePrefillWorker.remote(f"fake-prefill-{k}") for k in "xyabc"}
    ray.get([decode.stats.remote()] + [p.ready.remote() for p in prefill.values()])
    yield decode, prefill
    for a in [decode, *prefill.values()]:
        ray.kill(a)


class Cluster:
    """The module's fake decode worker and some of its fake prefill workers behind a new router."""

    def __init__(self, actors, tokenizer, prefill: dict[str, str], total_blocks: int = 64,
                 step_s: float = 0.005, **router):
        self.decode, all_prefill = actors
        ray.get(self.decode.reset.remote(total_blocks, step_s))
        self.prefill = [all_prefill[k] for k in prefill]
        ray.get([p.configure.remote(mode) for p, mode in zip(self.prefill, prefill.values())])
        self.server = start_in_thread([self.decode], tokenizer, RouterConfig(port=0, mode="disaggregated", **router),
                                      prefill_workers=self.prefill)
        self.client = Client(self.server.address, timeout=30)

    def decode_events(self) -> list[tuple[str, str]]:
        return ray.get(self.decode.log.remote())

    def prefill_received(self, i: int) -> int:
        """How many requests the i-th prefill worker has received."""
        return len(ray.get(self.prefill[i].log.remote())[0])

    def wait_all_blocks_free(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = ray.get(self.decode.stats.remote())
            if s.free_blocks == s.total_blocks and s.num_running == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"decode worker still holds blocks: {s}")

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def cluster_factory(actors, tokenizer):
    made: list[Cluster] = []

    def make(prefill: dict[str, str] | None = None, **kwargs) -> Cluster:
        made.append(Cluster(actors, tokenizer, prefill or {"x": "ok"}, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_decode_deltas_are_held_until_token_one(cluster_factory):
    c = cluster_factory()
    ids = [500, 501, 502, 503, 504]
    chunks = list(c.client.generate(token_ids=ids, max_tokens=5, logprobs=True))
    assert chunks[0].token_ids == [500] and chunks[0].logprobs == [-0.25]
    assert [t for ch in chunks for t in ch.token_ids] == ids
    assert [lp for ch in chunks for lp in ch.logprobs] == [-0.25] + [-0.5] * 4
    last = chunks[-1]
    assert (last.finish_reason, last.completion_tokens) == ("length", 5)
    t = last.timings
    # queue and prefill from the prefill worker, transfer and decode from the decode worker
    assert t.prefill_s == pytest.approx(0.025) and t.transfer_s == pytest.approx(0.125)
    assert 0.0125 <= t.queued_s < 1 and t.decode_s > 0
    assert t.ttft_s >= 0.2  # token #1 is the prefill worker's late answer
    c.wait_all_blocks_free()


def test_one_token_request_ends_after_token_one(cluster_factory):
    c = cluster_factory()
    chunks = list(c.client.generate(token_ids=[600, 601], max_tokens=1))
    assert [ch.token_ids for ch in chunks] == [[600], []]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 1
    c.wait_all_blocks_free()


def test_a_stop_token_as_token_one_is_returned_without_its_text(cluster_factory, tokenizer):
    c = cluster_factory()
    ids = tokenizer.encode("Hello there")
    out = c.client.complete(token_ids=ids, max_tokens=8, stop_token_ids=[ids[0]])
    assert (out.token_ids, out.text, out.finish_reason, out.completion_tokens) == ([ids[0]], "", "stop", 1)


def test_reservation_waits_for_free_blocks(cluster_factory):
    c = cluster_factory(total_blocks=6, step_s=0.02, queue_timeout_s=10)
    hog = iter(c.client.generate(token_ids=[7] * 40, max_tokens=40))  # 5 of the 6 blocks, for 0.8 s
    next(hog)
    t0 = time.monotonic()
    out = c.client.complete(token_ids=[8] * 20, max_tokens=10)  # 2 blocks: waits for the hog
    assert out.token_ids == [8] * 10 and time.monotonic() - t0 > 0.1
    assert len(list(hog)) > 0
    c.wait_all_blocks_free()


def test_reservation_gives_up_at_the_queue_timeout(cluster_factory):
    c = cluster_factory(total_blocks=6, step_s=0.05, queue_timeout_s=0.5)
    hog = c.client.generate(token_ids=[7] * 40, max_tokens=40)  # 5 of the 6 blocks, for 2 s
    it = iter(hog)
    next(it)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as err:
        c.client.complete(token_ids=[8] * 20, max_tokens=10)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no decode worker had free KV blocks" in err.value.message
    assert 0.4 < time.monotonic() - t0 < 5
    hog.cancel()
    c.wait_all_blocks_free()


def test_a_request_larger_than_the_decode_pool_is_refused(cluster_factory):
    c = cluster_factory(total_blocks=4)
    with pytest.raises(RequestError) as err:
        c.client.complete(token_ids=[5] * 60, max_tokens=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT  # never fits: no use retrying
    assert "70 tokens" in err.value.message and "holds 64 tokens" in err.value.message


def test_a_failing_prefill_gives_internal_and_frees_the_reservation(cluster_factory):
    c = cluster_factory({"x": "fail"})
    with pytest.raises(RequestError) as err:
        c.client.complete(token_ids=[9, 10, 11], max_tokens=4)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert "prefill worker fake-prefill-x failed on this request: the prompt set the prefill worker on fire" \
        in err.value.message
    kinds = [k for k, _ in c.decode_events()]
    assert kinds == ["reserve", "abort"]
    c.wait_all_blocks_free()


def test_a_dead_prefill_worker_is_replaced_transparently(cluster_factory, wait_until):
    c = cluster_factory({"a": "hang", "x": "ok"})  # "a" is chosen first (ties break by name)
    stream = c.client.generate(token_ids=[30, 31, 32], max_tokens=3)
    it = iter(stream)
    wait_until(lambda: c.prefill_received(0) == 1, what="the hanging worker getting the request")
    ray.kill(c.prefill[0])
    chunks = list(it)
    assert [t for ch in chunks for t in ch.token_ids] == [30, 31, 32]
    assert chunks[-1].finish_reason == "length"
    events = c.decode_events()
    assert [k for k, _ in events] == ["reserve", "abort", "reserve", "start"]
    assert events[2][1] == events[0][1] + "~1"  # a new id: nothing of the first attempt leaks in
    assert c.client.server_info().num_prefill_workers == 1
    assert c.client.complete(token_ids=[40, 41], max_tokens=2).token_ids == [40, 41]
    c.wait_all_blocks_free()


def test_no_prefill_worker_left_gives_unavailable(cluster_factory, wait_until):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = cluster_factory({"b": "hang"})
    it = iter(c.client.generate(token_ids=[50, 51], max_tokens=3))
    wait_until(lambda: c.prefill_received(0) == 1, what="the hanging worker getting the request")
    ray.kill(c.prefill[0])
    with pytest.raises(RequestError) as err:
        list(it)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "prefill worker fake-prefill-b died" in err.value.message
    c.wait_all_blocks_free()
    with pytest.raises(RequestError) as err:
        c.client.complete(token_ids=[52], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "no prefill worker" in err.value.message
    with grpc.insecure_channel(c.server.address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_transfer_that_keeps_failing_after_token_one_is_moved_then_gives_unavailable(cluster_factory):
    """Every attempt's KV is lost after its token #1: the request moves to a fresh reservation
    and prefill (continuing after the tokens streamed) --migration-limit times, then fails with
    UNAVAILABLE naming the cause. The client saw each token once, in order."""
    c = cluster_factory({"x": "lose_kv"})
    chunks = []
    with pytest.raises(RequestError) as err:
        for chunk in c.client.generate(token_ids=[70, 71, 72, 73, 74], max_tokens=8):
            chunks.append(chunk)
    assert [t for ch in chunks for t in ch.token_ids] == [70, 71, 72, 73]  # token #1 of 4 attempts
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "the KV transfer failed: KV transfer failed: peer gone" in err.value.message
    assert "--migration-limit 3" in err.value.message
    reserved = [rid for kind, rid in c.decode_events() if kind == "reserve"]
    assert len(reserved) == 4 and reserved[1:] == [f"{reserved[0]}~m{i}" for i in (1, 2, 3)]
    c.wait_all_blocks_free()


def test_a_transfer_cut_by_a_dying_prefill_worker_moves_and_completes(cluster_factory, wait_until):
    """The prefill worker dies after token #1, while its KV is on the way: the request continues
    on the healthy prefill worker from the token streamed, and ends as if nothing happened."""
    c = cluster_factory({"c": "lose_kv_and_die", "x": "ok"})
    chunks = list(c.client.generate(token_ids=[80, 81, 82], max_tokens=5))
    assert [t for ch in chunks for t in ch.token_ids] == [80, 81, 82, 80, 81]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 5
    wait_until(lambda: c.client.server_info().num_prefill_workers == 1, what="the dead prefill worker leaving")
    assert c.client.complete(token_ids=[82, 83], max_tokens=2).token_ids == [82, 83]
    c.wait_all_blocks_free()


def test_cancel_during_prefill_aborts_on_both_workers(cluster_factory, wait_until):
    c = cluster_factory({"x": "hang"})
    stream = c.client.generate(token_ids=[60, 61], max_tokens=3)
    it = iter(stream)
    wait_until(lambda: c.prefill_received(0) == 1, what="the hanging worker getting the request")
    stream.cancel()
    with pytest.raises(RequestError) as err:
        list(it)
    assert err.value.code == grpc.StatusCode.CANCELLED
    c.wait_all_blocks_free()
    received, aborted = wait_until(lambda: (log := ray.get(c.prefill[0].log.remote()))[1] and log,
                                   what="the prefill worker's abort")
    assert aborted == received and len(received) == 1
    assert [k for k, _ in c.decode_events()] == ["reserve", "abort"]


def test_server_info_reports_the_mode(cluster_factory):
    c = cluster_factory({"x": "ok", "y": "ok"})
    info = c.client.server_info()
    assert (info.mode, info.num_prefill_workers, info.num_decode_workers, info.transport) == (
        "disaggregated", 2, 1, "grpc")
