"""The router end to end over gRPC: a real server on a real port, real Ray actors behind it.

The actors here are ``EchoWorker``s, a stand-in for ``DecodeWorker`` that exists only in this
file: it speaks the worker actor interface (add_request, abort, next_outputs, stats,
model_info) and "generates" by echoing the prompt tokens back, one per step, so the expected
output of every request is known without a model. What the router does with the stream
(detokenization, stop strings, cancellation, errors) is what these tests check.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
import ray

from pdserve.client import AsyncClient, Client, RequestError
from pdserve.decode_worker.messages import RequestDelta, WorkerRequest, WorkerStats
from pdserve.router.server import RouterConfig, start_in_thread

MAX_MODEL_LEN = 2048
VOCAB = 49152
EOS = 2


@ray.remote(num_cpus=0)
class EchoWorker:
    """Test stand-in for a worker actor: output token k is prompt token k (cyclically).

    Finishes with "stop" on EOS (unless ignore_eos) or a stop token id, with "length" at
    max_tokens. Every step (``step_s``) emits one token for every running request, and
    ``next_outputs`` returns all deltas since the previous call, like the real worker.
    """

    def __init__(self, name: str, step_s: float = 0.004, total_blocks: int = 1024):
        self.name = name
        self.step_s = step_s
        self.total_blocks = total_blocks
        self.running: dict[str, dict] = {}
        self.received: list[WorkerRequest] = []
        self.aborted: list[str] = []
        self.outbox: list[RequestDelta] = []
        self.ready = asyncio.Event()
        self.loop_task = None

    async def add_request(self, req: WorkerRequest) -> None:
        self.received.append(req)
        self.running[req.request_id] = {"req": req, "n": 0, "t0": time.monotonic()}
        if self.loop_task is None:
            self.loop_task = asyncio.get_running_loop().create_task(self._steps())

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if self.running.pop(request_id, None) is not None:
            self._emit(RequestDelta(request_id, [], finish_reason="abort"))

    async def next_outputs(self) -> list[RequestDelta]:
        await self.ready.wait()
        self.ready.clear()
        out, self.outbox = self.outbox, []
        return out

    async def stats(self) -> WorkerStats:
        used = sum(1 for _ in self.running)
        return WorkerStats(self.name, "colocated", len(self.running), 0, 0,
                           self.total_blocks - used, self.total_blocks, 16)

    async def model_info(self) -> dict:
        return {"model": "echo", "max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB,
                "eos_token_ids": [EOS]}

    async def log(self) -> tuple[list[WorkerRequest], list[str]]:
        return self.received, self.aborted

    def _emit(self, delta: RequestDelta) -> None:
        self.outbox.append(delta)
        self.ready.set()

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for rid, st in list(self.running.items()):
                req: WorkerRequest = st["req"]
                p = req.params
                token = req.prompt_token_ids[st["n"] % len(req.prompt_token_ids)]
                st["n"] += 1
                finish = None
                if token in p.stop_token_ids or (token == EOS and not p.ignore_eos):
                    finish = "stop"
                elif st["n"] >= p.max_tokens:
                    finish = "length"
                delta = RequestDelta(rid, [token], logprobs=[-0.5] if p.logprobs else None,
                                     finish_reason=finish)
                if finish:
                    del self.running[rid]
                    delta.num_prompt_tokens = len(req.prompt_token_ids)
                    delta.num_output_tokens = st["n"]
                    delta.timings = {"queued": 0.001, "prefill": 0.002,
                                     "decode": time.monotonic() - st["t0"]}
                self._emit(delta)


def wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def received(worker) -> list[WorkerRequest]:
    return ray.get(worker.log.remote())[0]


def aborted(worker) -> list[str]:
    return ray.get(worker.log.remote())[1]


def request_for(workers, prompt_ids: list[int]) -> tuple[object, WorkerRequest]:
    for w in workers:
        for r in received(w):
            if r.prompt_token_ids == prompt_ids:
                return w, r
    raise AssertionError("no worker received that prompt")


@pytest.fixture(scope="module")
def workers(ray_session):
    ws = [EchoWorker.remote("echo-0"), EchoWorker.remote("echo-1")]
    yield ws
    for w in ws:
        ray.kill(w)


@pytest.fixture(scope="module")
def server(workers, tokenizer):
    srv = start_in_thread(workers, tokenizer, RouterConfig(host="127.0.0.1", port=0, model="echo"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=30) as c:
        yield c


# ---- the happy paths -------------------------------------------------------------------------


def test_server_info(client):
    info = client.server_info()
    assert (info.model, info.max_model_len, info.mode, info.vocab_size) == ("echo", MAX_MODEL_LEN, "colocated", VOCAB)
    assert (info.num_prefill_workers, info.num_decode_workers, info.transport) == (0, 2, "none")


def test_streaming_text_and_tokens(client, tokenizer):
    text = "Streaming 👋🏽 works, 你好世界!"
    ids = tokenizer.encode(text)
    chunks = list(client.generate(text, max_tokens=len(ids), request_id="mine"))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == text
    assert [t for c in chunks for t in c.token_ids] == ids
    assert all(c.request_id == "mine" for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert (last.prompt_tokens, last.completion_tokens) == (len(ids), len(ids))
    t = last.timings
    assert t.e2e_s >= t.ttft_s > 0 and t.queued_s > 0 and t.prefill_s == pytest.approx(0.002)
    assert t.decode_s > 0 and t.transfer_s == 0


def test_unary_complete(client, tokenizer):
    text = "One answer, all at once. 🎉"
    ids = tokenizer.encode(text)
    out = client.complete(text, max_tokens=len(ids) + 3, logprobs=True)
    assert out.text == text + tokenizer.decode(ids[:3])
    assert out.token_ids == ids + ids[:3]
    assert out.logprobs == [-0.5] * len(out.token_ids)
    assert out.finish_reason == "length" and out.completion_tokens == len(ids) + 3
    assert out.request_id  # generated by the server when the client sends none


def test_chat_messages_are_rendered_with_the_template(client, workers, tokenizer):
    msgs = [{"role": "user", "content": "Chat test: ping?"}]
    expected = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    out = client.complete(messages=msgs, max_tokens=3, temperature=0)
    _, req = request_for(workers, expected)
    assert out.token_ids == expected[:3]
    assert req.params.temperature == 0


def test_token_id_input(client, workers, tokenizer):
    ids = [tokenizer.encode("token ids in")[0], 1234, 4321, 77]
    out = client.complete(token_ids=ids, max_tokens=4)
    assert out.token_ids == ids and out.prompt_tokens == 4


def test_sampling_parameters_reach_the_worker(client, workers):
    ids = [900, 901, 902]
    client.complete(token_ids=ids, max_tokens=2, temperature=0.7, top_p=0.8, top_k=20, seed=99,
                    stop_token_ids=[5], ignore_eos=True, logprobs=True)
    _, req = request_for(workers, ids)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (2, 0.7, 0.8, 20, 99)
    assert (p.stop_token_ids, p.ignore_eos, p.logprobs) == ([5], True, True)
    assert req.arrival_time > 0


def test_defaults_when_unset(client, workers):
    ids = [903, 904]
    client.complete(token_ids=ids)
    _, req = request_for(workers, ids)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (256, 1.0, 1.0, 0, None)


def test_eos_from_the_worker_finishes_with_stop(client, tokenizer):
    ids = tokenizer.encode("ends here") + [EOS, 42]
    out = client.complete(token_ids=ids, max_tokens=50)
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:-1] and out.text == "ends here"


def test_a_stop_token_id_is_returned_but_not_its_text(client, tokenizer):
    ids = tokenizer.encode("first second third")
    out = client.complete(token_ids=ids, max_tokens=10, stop_token_ids=[ids[1]])
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:2] and out.text == tokenizer.decode(ids[:1])
    assert out.completion_tokens == 2


def test_stop_string_truncates_and_aborts_on_the_worker(client, workers, tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta")
    chunks = list(client.generate(token_ids=ids, max_tokens=len(ids), stop=["STOP"]))
    assert "".join(c.text for c in chunks) == "alpha beta "
    assert chunks[-1].finish_reason == "stop"
    emitted = [t for c in chunks for t in c.token_ids]
    assert tokenizer.decode(emitted).endswith("STOP") and len(emitted) < len(ids)
    assert chunks[-1].completion_tokens == len(emitted)
    worker, req = request_for(workers, ids)
    wait_until(lambda: req.request_id in aborted(worker))


def test_sixteen_concurrent_async_clients(server, workers, tokenizer):
    texts = [f"Client {i} says héllo 世界 {'🙂' * (i % 3)}" for i in range(16)]

    async def one(c: AsyncClient, text: str) -> str:
        pieces = []
        async for chunk in c.generate(text, max_tokens=len(tokenizer.encode(text))):
            pieces.append(chunk.text)
        return "".join(pieces)

    async def main():
        async with AsyncClient(server.address, timeout=30) as c:
            return await asyncio.gather(*(one(c, t) for t in texts))

    assert asyncio.run(main()) == texts
    # Placement spread them over both workers.
    for w in workers:
        assert any(tokenizer.decode(r.prompt_token_ids).startswith("Client") for r in received(w))


# ---- errors ----------------------------------------------------------------------------------

INVALID = [
    (dict(prompt=""), "prompt must not be empty"),
    (dict(messages=[]), "messages must hold at least one message"),
    (dict(messages=[{"role": "", "content": "x"}]), "messages[0].role must not be empty"),
    (dict(token_ids=[]), "token_ids must not be empty"),
    (dict(token_ids=[VOCAB]), f"token_ids[0] is {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    (dict(prompt="x", max_tokens=0), "sampling.max_tokens must be an integer >= 1, got 0"),
    (dict(prompt="x", temperature=-1.0), "sampling.temperature must be >= 0"),
    (dict(prompt="x", temperature=math.nan), "sampling.temperature must be >= 0"),
    (dict(prompt="x", top_p=0.0), "sampling.top_p must be in (0, 1]"),
    (dict(prompt="x", top_k=-3), "sampling.top_k must be an integer >= 0"),
    (dict(prompt="x", seed=-1), "sampling.seed must be in [0, 2^63)"),
    (dict(prompt="x", stop=[""]), "sampling.stop[0] must not be empty"),
    (dict(prompt="x", stop_token_ids=[-2]), "sampling.stop_token_ids must hold token ids in [0, 49152)"),
    (dict(prompt="x", request_id="r" * 257), "request_id must be at most 256 characters"),
    (dict(token_ids=[7] * MAX_MODEL_LEN), f"the prompt is {MAX_MODEL_LEN} tokens but the model's context"),
    (dict(token_ids=[7] * 48, max_tokens=2001),
     "sampling.max_tokens is 2001 but the prompt is 48 tokens and the model's context "
     f"(max_model_len) is {MAX_MODEL_LEN} tokens: max_tokens must be in [1, 2000]"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m[:40] for _, m in INVALID])
def test_invalid_input_is_rejected_on_both_calls(client, kwargs, message):
    with pytest.raises(RequestError) as err:
        list(client.generate(**kwargs))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message
    with pytest.raises(RequestError) as err:
        client.complete(**kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message


def test_missing_input_is_rejected(server):
    from pdserve.v1 import generation_pb2 as pb
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GenerationStub(ch).Complete(pb.GenerateRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one of prompt, messages or token_ids must be set" in err.value.details()


# ---- cancellation and deadlines --------------------------------------------------------------


def test_client_cancel_aborts_the_request_on_the_worker(client, workers):
    ids = [1000, 1001, 1002]
    stream = client.generate(token_ids=ids, max_tokens=1500)
    it = iter(stream)
    first = next(it)
    assert first.token_ids
    stream.cancel()
    with pytest.raises(RequestError) as err:
        list(it)
    assert err.value.code == grpc.StatusCode.CANCELLED
    worker, req = request_for(workers, ids)
    wait_until(lambda: req.request_id in aborted(worker))


def test_breaking_out_of_the_loop_cancels_too(client, workers):
    ids = [1003, 1004]
    for chunk in client.generate(token_ids=ids, max_tokens=1500):
        break
    worker, req = request_for(workers, ids)
    wait_until(lambda: req.request_id in aborted(worker))


def test_deadline_aborts_the_request_on_the_worker(client, workers):
    ids = [1005, 1006]
    with pytest.raises(RequestError) as err:
        list(client.generate(token_ids=ids, max_tokens=1500, timeout=0.5))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    worker, req = request_for(workers, ids)
    wait_until(lambda: req.request_id in aborted(worker))


def test_async_cancel_aborts_too(server, workers):
    ids = [1007, 1008]

    async def main():
        async with AsyncClient(server.address) as c:
            async with c.generate(token_ids=ids, max_tokens=1500) as stream:
                async for chunk in stream:
                    break

    asyncio.run(main())
    worker, req = request_for(workers, ids)
    wait_until(lambda: req.request_id in aborted(worker))


# ---- health and reflection -------------------------------------------------------------------


def test_health_check_serving(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pdserve.v1.Generation"):
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(server):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Generation"),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(reqs), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names
    fd = descriptor_pb2.FileDescriptorProto.FromString(described.file_descriptor_response.file_descriptor_proto[0])
    assert fd.package == "pdserve.v1"
    assert {m.name for m in fd.service[0].method} == {"Generate", "Complete", "GetServerInfo"}


# ---- overload and worker failure (servers of their own) --------------------------------------


def test_overload_waits_within_the_limit_then_gives_resource_exhausted(ray_session, tokenizer):
    worker = EchoWorker.remote("slow", step_s=0.01)
    srv = start_in_thread([worker], tokenizer, RouterConfig(
        port=0, max_inflight_per_worker=1, queue_timeout_s=0.5))
    try:
        with Client(srv.address, timeout=30) as c:
            # A short request waits for the one in flight, then runs.
            busy = iter(c.generate(token_ids=[11, 12], max_tokens=10))
            next(busy)
            t0 = time.monotonic()
            assert c.complete(token_ids=[13], max_tokens=2).token_ids == [13, 13]
            assert time.monotonic() - t0 > 0.02
            list(busy)
            # A request that cannot get room in time is refused, not left hanging.
            hog = iter(c.generate(token_ids=[14], max_tokens=1500))
            next(hog)
            t0 = time.monotonic()
            with pytest.raises(RequestError) as err:
                c.complete(token_ids=[15], max_tokens=2)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 1 requests" in err.value.message
            assert 0.4 < time.monotonic() - t0 < 5
            # A client deadline shorter than the server's limit is honoured the same way.
            with pytest.raises(RequestError) as err:
                c.complete(token_ids=[15], max_tokens=2, timeout=0.3)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        srv.stop()
        ray.kill(worker)


def test_a_request_too_big_for_any_kv_cache_is_refused(ray_session, tokenizer):
    worker = EchoWorker.remote("tiny", total_blocks=4)
    srv = start_in_thread([worker], tokenizer, RouterConfig(port=0))
    try:
        with Client(srv.address, timeout=30) as c:
            with pytest.raises(RequestError) as err:
                c.complete(token_ids=[5] * 60, max_tokens=10)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "70 tokens" in err.value.message and "holds 64 tokens" in err.value.message
    finally:
        srv.stop()
        ray.kill(worker)


def test_worker_death_fails_its_requests_with_unavailable(ray_session, tokenizer):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    worker = EchoWorker.remote("doomed", step_s=0.01)
    srv = start_in_thread([worker], tokenizer, RouterConfig(port=0))
    try:
        with Client(srv.address, timeout=30) as c:
            stream = iter(c.generate(token_ids=[20, 21], max_tokens=1500))
            next(stream)
            ray.kill(worker)
            with pytest.raises(RequestError) as err:
                list(stream)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "worker doomed died" in err.value.message
            with pytest.raises(RequestError) as err:
                c.complete(token_ids=[22], max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(srv.address) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop()


# ---- the CLI's generate command --------------------------------------------------------------


def test_cli_generate_streams_plain_text(server, tokenizer, capsys):
    from pdserve import cli

    text = "CLI plain 🌍 text"
    n = len(tokenizer.encode(text))
    assert cli.main(["generate", "--target", server.address, "--max-tokens", str(n), text]) == 0
    captured = capsys.readouterr()
    assert captured.out == text + "\n"
    assert f"[length: {n} prompt + {n} completion tokens" in captured.err


def test_cli_generate_json_lines(server, tokenizer, capsys):
    import json

    from pdserve import cli

    text = "CLI json 你好"
    ids = tokenizer.encode(text)
    assert cli.main(["generate", "--target", server.address, "--json", "--max-tokens", str(len(ids)),
                     "--temperature", "0", text]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "".join(x["text"] for x in lines) == text
    assert [t for x in lines for t in x["token_ids"]] == ids
    assert all(set(x) == {"token_ids", "text"} for x in lines[:-1])
    last = lines[-1]
    assert last["finish_reason"] == "length"
    assert (last["prompt_tokens"], last["completion_tokens"]) == (len(ids), len(ids))
    assert set(last["timings"]) == {"queued_s", "prefill_s", "transfer_s", "ttft_s", "decode_s", "e2e_s"}


def test_cli_generate_chat_and_errors(server, tokenizer, capsys):
    from pdserve import cli

    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    assert cli.main(["generate", "--target", server.address, "--chat", "--max-tokens", "3", "Hi"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(chat[:3], skip_special_tokens=True) + "\n"
    assert cli.main(["generate", "--target", server.address, "--top-p", "2", "Hi"]) == 1
    assert "INVALID_ARGUMENT: sampling.top_p must be in (0, 1], got 2.0" in capsys.readouterr().err
