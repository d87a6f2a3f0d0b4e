"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client over real ports.

Greedy answers through it are token-identical to the gRPC API's and to Hugging Face's on the
default model; every error reaches ``openai`` as its own exception with the documented status;
the API key guards both front ends; TLS works end to end; a stream the client cuts frees its
blocks. The error, key and TLS tests use ``EchoWorker`` (no model); the parity test the real one.
"""

from __future__ import annotations

import json
import re
import ssl

import grpc
import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import ray

from pdserve.client import Client, RequestError
from pdserve.router.admin import scale
from pdserve.router.server import RouterConfig, start_in_thread

from echo_worker import REJECT_TOKEN, EchoWorker

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish."]
NEW_TOKENS = 8


def api(router, key: str = "none", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key=key, max_retries=0,
                         timeout=60, **kwargs)


def metric(router, name: str, **kwargs) -> float:
    """One sample of ``name`` from the API port's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", **kwargs).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"no {name} in /metrics"
    return sum(values)


# ---- the default model: the same answers through every door ---------------------------------


@pytest.fixture(scope="module")
def model_router(ray_session, tokenizer):
    from pdserve.decode_worker.worker import start_workers
    from pdserve.engine.config import EngineConfig

    config = EngineConfig(model="default", kv_cache_bytes=64 << 20, show_progress=False)
    [worker] = start_workers(config, num_workers=1, name_prefix="http-decode")
    router = start_in_thread([worker], tokenizer, RouterConfig(port=0, http_port=0, model="default"))
    yield router
    router.stop()
    ray.kill(worker)


def test_openai_client_gets_the_grpc_and_hf_answers(model_router, tokenizer, hf_chat_greedy):
    client = api(model_router)
    assert [m.id for m in client.models.list().data] == ["default"]
    greedy = dict(model="default", max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    with Client(model_router.address, timeout=120) as grpc_client:
        for q in QUESTIONS:
            want = hf_chat_greedy(q, NEW_TOKENS)
            messages = [{"role": "user", "content": q}]
            via_grpc = grpc_client.complete(messages=messages, max_tokens=NEW_TOKENS, temperature=0)
            assert via_grpc.token_ids == want, q

            chat = client.chat.completions.create(messages=messages, **greedy)
            assert chat.choices[0].token_ids == want and chat.choices[0].message.content == via_grpc.text
            assert chat.usage.completion_tokens == len(want) and chat.choices[0].finish_reason == via_grpc.finish_reason

            chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **greedy))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == via_grpc.text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
            timings = chunks[-1].pdserve_timings  # the documented extension, on the last chunk
            assert 0 < timings["ttft_s"] <= timings["e2e_s"]

            # /v1/completions on the chat template's token ids: the same tokens, unary and streamed.
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
            done = client.completions.create(prompt=ids, **greedy)
            assert done.choices[0].token_ids == want and done.choices[0].text == via_grpc.text
            streamed = list(client.completions.create(prompt=ids, stream=True, **greedy))
            assert [t for c in streamed for t in c.choices[0].token_ids] == want


def test_a_text_prompt_and_logprobs_agree_with_grpc(model_router):
    client = api(model_router)
    prompt = "The three primary colors are"
    with Client(model_router.address, timeout=120) as grpc_client:
        via_grpc = grpc_client.complete(prompt=prompt, max_tokens=6, temperature=0, logprobs=True)
    out = client.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    choice = out.choices[0]
    assert choice.text == via_grpc.text
    assert choice.logprobs.token_logprobs == pytest.approx(via_grpc.logprobs, abs=1e-5)
    assert "".join(choice.logprobs.tokens) == via_grpc.text


# ---- errors, keys and TLS on a stand-in worker ---------------------------------------------


@pytest.fixture
def echo_router(ray_session, tokenizer):
    made = []

    def start(step_s: float = 0.004, **config):
        worker = EchoWorker.remote("echo-http", step_s=step_s)
        router = start_in_thread([worker], tokenizer, RouterConfig(port=0, http_port=0, model="echo", **config))
        made.append((router, worker))
        return router, worker

    yield start
    for router, worker in made:
        router.stop()
        ray.kill(worker)


def test_bad_requests_get_400_in_openai_shape(echo_router):
    router, _ = echo_router()
    client = api(router)
    cases = [
        (dict(prompt="hi", n=2), "n"),
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt="hi", extra_body={"min_tokens": 3}), "min_tokens"),
        (dict(prompt="hi", logprobs=2), "logprobs"),
        (dict(prompt=["one", "two"]), "prompt"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", stop=["x"] * 17), "stop"),
        (dict(prompt=[1, 2, 10**9]), "vocabulary"),
    ]
    for kwargs, word in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="echo", **kwargs)
        assert err.value.status_code == 400 and word in err.value.message, (kwargs, err.value.message)
        assert err.value.body["type"] == "invalid_request_error"
    for kwargs, word in [(dict(messages=[]), "messages"),
                         (dict(messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
                         (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=3, logprobs=True),
                          "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="echo", **kwargs)
        assert word in err.value.message
    base = f"http://127.0.0.1:{router.http_port}"
    r = httpx.post(f"{base}/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # Invalid UTF-8 in the body, and JSON's escape of a lone surrogate (which no UTF-8 text holds).
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "a\xffb"}')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert "utf-8" in r.json()["error"]["message"]
    for body, where in [(b'{"prompt": "a\\ud800b"}', "prompt"), (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]"),
                        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content")]:
        r = httpx.post(f"{base}/v1/{'chat/' if b'messages' in body else ''}completions", content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{where} is not valid Unicode text"), r.text
    # The server took none of them, and still answers.
    assert client.completions.create(model="echo", prompt=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3


def test_unknown_models_and_routes_get_404_and_a_huge_body_413(echo_router):
    router, _ = echo_router()
    client = api(router)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert err.value.body["code"] == "model_not_found" and "'echo'" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    card = client.models.retrieve("echo")
    assert card.id == card.root == "echo" and card.max_model_len == 2048  # vLLM's fields too
    base = f"http://127.0.0.1:{router.http_port}"
    r = httpx.get(f"{base}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{base}/v1/completions", content=json.dumps({"prompt": "x" * (17 << 20)}))
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]


def test_overload_is_429_a_rejecting_worker_500_and_no_worker_503(echo_router, wait_until):
    router, worker = echo_router(step_s=0.05, max_inflight_per_worker=1, max_queued_requests=0)
    client = api(router)
    hog = client.completions.create(model="echo", prompt=[5, 6], max_tokens=400, stream=True)
    next(iter(hog))  # it holds the worker's one slot
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="echo", prompt="hi", max_tokens=2)
    assert err.value.status_code == 429 and "retry later" in err.value.message
    hog.close()

    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt=[REJECT_TOKEN, 5], max_tokens=2)
    assert err.value.status_code == 500 and "rejected the request" in err.value.message

    ray.kill(worker)
    base = f"http://127.0.0.1:{router.http_port}"
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 503, what="/health turning 503")
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and "no worker" in err.value.message


def test_a_stream_cut_by_the_client_frees_its_blocks(echo_router, wait_until):
    router, worker = echo_router(step_s=0.02)
    total = metric(router, "pdserve_kv_blocks_free")
    base = f"http://127.0.0.1:{router.http_port}"
    body = {"model": "echo", "prompt": [5, 6, 7], "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metric(router, "pdserve_kv_blocks_free") == total - 1  # the request holds one
    wait_until(lambda: metric(router, "pdserve_kv_blocks_free") == total, what="the cut stream's blocks freed")
    assert metric(router, "pdserve_requests_total") >= 1
    assert len(ray.get(worker.log.remote())[1]) == 1  # aborted on the worker


def test_the_api_key_guards_both_front_ends(echo_router):
    router, _ = echo_router(api_key="s3cret")
    base = f"http://127.0.0.1:{router.http_port}"
    with pytest.raises(openai.AuthenticationError) as err:
        api(router, key="wrong").completions.create(model="echo", prompt="hi", max_tokens=2)
    assert err.value.status_code == 401
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200  # open: for load balancers
    assert api(router, key="s3cret").completions.create(model="echo", prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2

    with Client(router.address, timeout=30, api_key="wrong") as c, pytest.raises(RequestError) as err:
        c.complete(token_ids=[5, 6], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.message
    with Client(router.address, timeout=30, api_key="s3cret") as c:
        assert c.complete(token_ids=[5, 6], max_tokens=2).token_ids == [5, 6]
    with pytest.raises(grpc.RpcError) as err:  # the admin service too
        scale(router.address, decode=1, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:  # with the key it gets through to the scaler
        scale(router.address, decode=1, timeout=30, api_key="s3cret")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(router.address) as ch:  # health stays open
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_tls_end_to_end(echo_router, tmp_path):
    trustme = pytest.importorskip("trustme")  # a dev dependency (pyproject.toml)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    router, _ = echo_router(tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"))
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))))
    assert client.completions.create(model="echo", prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on a TLS port
        httpx.get(f"http://127.0.0.1:{router.http_port}/health", timeout=5)
    with Client(router.address, timeout=30, tls_ca=str(tmp_path / "ca.pem")) as c:
        assert c.complete(token_ids=[5, 6], max_tokens=2).token_ids == [5, 6]
    with Client(router.address, timeout=5) as c, pytest.raises(RequestError) as err:  # no plaintext gRPC
        c.complete(token_ids=[5, 6], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
