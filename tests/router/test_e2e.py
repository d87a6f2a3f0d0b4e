"""The colocated service end to end: real worker actors with the default model, real gRPC.

Greedy output must be token-identical to Hugging Face ``generate()`` on the same model in
float32, with 16 clients at once; cancelling or stopping a request must give its KV blocks back.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import ray

from pdserve.client import AsyncClient, Client, RequestError
from pdserve.router.server import RouterConfig, start_in_thread

NEW_TOKENS = 8
# Eight questions of different lengths, each asked by two of the sixteen clients: the batch mixes
# prompt lengths and repeats, and the Hugging Face reference (one stream at a time) stays cheap.
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.",
    "How many legs does a spider have? Answer with a number.", "Say hello in Spanish.",
    "What is 2 + 2?", "Give me a synonym for happy, and explain why it is one.",
    "Which planet is the largest in our solar system?", "Who wrote Romeo and Juliet?",
]
CLIENTS = QUESTIONS * 2


@pytest.fixture(scope="module")
def worker(ray_session):
    from pdserve.decode_worker.worker import start_workers
    from pdserve.engine.config import EngineConfig

    config = EngineConfig(model="default", kv_cache_bytes=64 << 20, show_progress=False)
    handles = start_workers(config, num_workers=1, name_prefix="e2e-decode")
    yield handles[0]
    ray.kill(handles[0])


@pytest.fixture(scope="module")
def server(worker, tokenizer):
    srv = start_in_thread([worker], tokenizer, RouterConfig(port=0, model="default"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def chat_ids(tokenizer, question: str) -> list[int]:
    msgs = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.fixture(scope="module")
def hf_greedy(hf_chat_greedy):
    """What Hugging Face generate() answers to every question, greedy, float32."""
    return {q: hf_chat_greedy(q, NEW_TOKENS) for q in QUESTIONS}


def wait_for_idle(worker, timeout: float = 20.0) -> None:
    """Until the worker runs nothing and every KV block is free again."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = ray.get(worker.stats.remote())
        if s.num_running == 0 and s.num_waiting == 0 and s.free_blocks == s.total_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker still holds work or blocks: {s}")


def test_sixteen_concurrent_clients_match_hf_greedy(server, worker, tokenizer, hf_greedy):
    async def one(c: AsyncClient, q: str) -> tuple[list[int], str, str]:
        ids, text, finish = [], "", None
        async for chunk in c.generate(messages=[{"role": "user", "content": q}],
                                      max_tokens=NEW_TOKENS, temperature=0):
            ids += chunk.token_ids
            text += chunk.text
            finish = chunk.finish_reason or finish
        return ids, text, finish

    async def main():
        async with AsyncClient(server.address, timeout=120) as c:
            return await asyncio.gather(*(one(c, q) for q in CLIENTS))

    results = asyncio.run(main())
    assert len(results) == 16
    for q, (ids, text, finish) in zip(CLIENTS, results):
        assert ids == hf_greedy[q], q
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert finish == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
    wait_for_idle(worker)


def test_unary_and_token_ids_agree_with_streaming(client, tokenizer, hf_greedy):
    q = QUESTIONS[0]
    by_ids = client.complete(token_ids=chat_ids(tokenizer, q), max_tokens=NEW_TOKENS, temperature=0)
    by_chat = client.complete(messages=[{"role": "user", "content": q}], max_tokens=NEW_TOKENS, temperature=0,
                              logprobs=True)
    assert by_ids.token_ids == by_chat.token_ids == hf_greedy[q]
    assert by_ids.logprobs is None
    assert len(by_chat.logprobs) == len(by_chat.token_ids) and all(lp <= 0 for lp in by_chat.logprobs)
    assert by_chat.prompt_tokens == len(chat_ids(tokenizer, q))
    t = by_chat.timings
    assert t.e2e_s >= t.ttft_s >= t.queued_s > 0 and t.prefill_s > 0 and t.decode_s > 0


def test_seeded_sampling_is_reproducible_under_load(server, tokenizer):
    prompt = "Once upon a time"

    async def main():
        async with AsyncClient(server.address, timeout=120) as c:
            seeded = [c.complete(prompt, max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
                      for _ in range(2)]
            noise = [c.complete(f"Noise {i}", max_tokens=10, temperature=1.0) for i in range(3)]
            return await asyncio.gather(*seeded, *noise)

    a, b, *_ = asyncio.run(main())
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10


def test_stop_string_ends_the_text_and_frees_blocks(client, worker, tokenizer, hf_greedy):
    q = QUESTIONS[0]
    full = tokenizer.decode(hf_greedy[q], skip_special_tokens=True)
    word = full.split()[3]  # a word from the middle of the greedy answer
    out = client.complete(messages=[{"role": "user", "content": q}], max_tokens=NEW_TOKENS,
                          temperature=0, stop=[word])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(word)]
    wait_for_idle(worker)


def test_cancel_frees_the_requests_blocks(client, worker):
    stream = client.generate("Count from one to a thousand:", max_tokens=500, ignore_eos=True, temperature=0)
    it = iter(stream)
    next(it)
    s = ray.get(worker.stats.remote())
    assert s.num_running == 1 and s.free_blocks < s.total_blocks
    stream.cancel()
    with pytest.raises(RequestError) as err:
        list(it)
    assert err.value.code == grpc.StatusCode.CANCELLED
    wait_for_idle(worker)


def test_prompt_over_the_context_is_refused_precisely(client):
    info = client.server_info()
    with pytest.raises(RequestError) as err:
        client.complete(token_ids=[42] * info.max_model_len)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt is {info.max_model_len} tokens" in err.value.message
