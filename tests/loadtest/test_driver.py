"""The asyncio driver against a scripted gRPC server on a real socket: it times the first
token and every gap (a response with several tokens splits its gap), records the server's
timings, keeps one failed request from touching the others, and sends on schedule."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import numpy as np
import pytest

from pdserve.client import AsyncClient
from pdserve.loadtest.driver import RunOptions, run_load
from pdserve.loadtest.workload import RequestSpec
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc


class ScriptedServer(pb_grpc.GenerationServicer):
    """Answers by max_tokens: 3 -> one token after 50 ms, two more in one response 100 ms later;
    1 -> one token at once; 99 -> INVALID_ARGUMENT. Records what it received."""

    def __init__(self):
        self.requests = []

    async def Generate(self, request, context):
        self.requests.append(request)
        n = request.sampling.max_tokens
        if n == 99:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens is silly")
        if n == 3:
            await asyncio.sleep(0.05)
            yield pb.GenerateResponse(token_ids=[7], text="a")
            await asyncio.sleep(0.1)
            yield pb.GenerateResponse(token_ids=[8, 9], text="bc")
        else:
            yield pb.GenerateResponse(token_ids=[7], text="a")
        yield pb.GenerateResponse(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n),
            timings=pb.Timings(queued_s=0.01, prefill_s=0.02, ttft_s=0.05, decode_s=0.1, e2e_s=0.15))


async def with_server(body):
    server = grpc.aio.server()
    servicer = ScriptedServer()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            return await body(client), servicer
    finally:
        await server.stop(None)


def test_driver_times_tokens_and_records_failures():
    specs = [RequestSpec(0, 3, prompt_tokens=5, label="x"), RequestSpec(1, 99, prompt_tokens=5),
             RequestSpec(2, 1, prompt_tokens=12)]
    done = []

    async def body(client):
        return await run_load(client, specs, [0.0, 0.0, 0.02], vocab_size=100,
                              options=RunOptions(warmup=0), rate=2.0, on_done=done.append)

    run, servicer = asyncio.run(with_server(body))
    assert len(done) == 3 and run.rate == 2.0
    a, b, c = run.results
    assert a.ok and a.output_tokens == 3 and a.finish_reason == "length" and a.label == "x"
    assert a.ttft_s >= 0.05
    assert len(a.itl_s) == 2 and a.itl_s[0] == a.itl_s[1] and sum(a.itl_s) >= 0.1  # one gap, two tokens
    assert a.e2e_s >= a.ttft_s + sum(a.itl_s) - 1e-9
    assert a.tpot_s == pytest.approx((a.e2e_s - a.ttft_s) / 2)
    assert a.server["prefill_s"] == pytest.approx(0.02) and a.prompt_tokens == 5
    assert not b.ok and b.error == "INVALID_ARGUMENT: max_tokens is silly" and b.ttft_s is None
    assert c.ok and c.output_tokens == 1 and c.itl_s == [] and c.prompt_tokens == 12
    assert c.sent_s >= 0.02 and c.sent_s - c.scheduled_s < 0.5  # on schedule
    assert run.duration_s >= a.e2e_s
    # What went over the wire: the spec's token ids, output length, greedy, run to the length.
    sent = {len(r.token_ids.ids): r for r in servicer.requests}
    assert list(sent[12].token_ids.ids) == specs[2].inputs(100)["token_ids"]
    assert sent[12].sampling.temperature == 0 and sent[12].sampling.ignore_eos
    lag = run.client
    assert lag.send_lag_max_s >= lag.send_lag_p50_s >= 0 and 0 <= lag.cpu_share


def test_warm_up_requests_are_not_measured():
    async def body(client):
        return await run_load(client, [RequestSpec(0, 1, prompt_tokens=3)], [0.0], vocab_size=10,
                              options=RunOptions(warmup=2))

    run, servicer = asyncio.run(with_server(body))
    assert len(servicer.requests) == 3 and len(run.results) == 1


def test_many_requests_at_once_keep_the_client_on_time():
    specs = [RequestSpec(i, 3, prompt_tokens=4) for i in range(200)]
    times = np.linspace(0, 0.5, 200)

    async def body(client):
        return await run_load(client, specs, times, vocab_size=10, options=RunOptions(warmup=0))

    run, _ = asyncio.run(with_server(body))
    assert all(r.ok for r in run.results)
    assert run.client.send_lag_p50_s < 0.05  # lenient: the CI machine is shared
