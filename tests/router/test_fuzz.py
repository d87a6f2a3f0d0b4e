"""Fuzz: a few thousand malformed and edge-case requests against a live server, beside a victim.

A real router (real gRPC) in front of a real colocated worker actor (Ray) running the tiny
servable Llama. The fuzzer sends generated requests from several threads: out-of-range and
non-finite sampling parameters, tiny and huge temperatures, invalid UTF-8 in every string field
(raw bytes on a generic channel: no Python client can send them), empty and oversized inputs,
huge stop lists, out-of-vocabulary token ids, malformed chat messages, bytes that are no request
at all, and streams cancelled midway. Meanwhile a victim client sends greedy requests whose
answers must stay identical to a quiet run. Afterwards:

- every reply had a precise status (OK, INVALID_ARGUMENT, FAILED_PRECONDITION, or the CANCELLED
  the fuzzer caused), never UNKNOWN, INTERNAL or UNAVAILABLE;
- the victim's answers never changed and none failed;
- the server still serves, and every KV block of the worker is free.

Everything is drawn from ``random.Random(0)``, so the set of requests is the same every run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import random
import threading
import time

import grpc
import pytest
import ray

from pdserve.client import Client, build_request
from pdserve.engine.sampling_params import SAMPLING_EPS
from pdserve.router.preprocess import MAX_MESSAGES, MAX_STOP_STRING_LEN, MAX_STOP_TOKEN_IDS, MIN_PROMPT_BYTES
from pdserve.v1 import generation_pb2 as pb

NUM_CASES = 3000
FUZZ_THREADS = 6
VOCAB = 49152
CONTEXT = 512  # tiny_servable_model's max_model_len
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
VICTIM_QUESTIONS = [[1000, 2000, 3000, 4000], [17, 29, 31, 37, 41, 43], [7] * 12]
VICTIM = dict(max_tokens=12, temperature=0, ignore_eos=True)
PLACEHOLDER = b"PLACEHOLDER"


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_servable_model):
    from pdserve.decode_worker.worker import start_workers
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_loader import load_tokenizer
    from pdserve.router.server import RouterConfig, start_in_thread

    engine = EngineConfig(model=str(tiny_servable_model), threads=1, kv_cache_bytes=32 << 20, show_progress=False)
    [worker] = start_workers(engine, num_workers=1, num_cpus=0.5, name_prefix="fuzz-decode")
    router = start_in_thread([worker], load_tokenizer(str(tiny_servable_model)), RouterConfig(port=0))
    yield router, worker
    router.stop()
    ray.kill(worker)


# ---- the generated requests -------------------------------------------------------------------


def _float(rng: random.Random, edges: list[float], lo: float, hi: float) -> float:
    return rng.choice(edges) if rng.random() < 0.7 else rng.uniform(lo, hi)


TEMPERATURES = [0.0, -0.0, 1e-38, 5e-324, 1e-300, 9.99e-6, 1e-5, 2e-5, 1e-3, 0.7, 1.0, 50.0, 1e30, 1e300,
                math.inf, -math.inf, math.nan, -1e-9, -1.0]
TOP_PS = [1.0, 0.5, 1e-9, 5e-324, 0.0, -0.0, 1.0000001, 1.5, -1.0, math.inf, -math.inf, math.nan]
TOP_KS = [0, 1, 2, 50, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, -1, -(2**31)]
MAX_TOKENS = [1, 2, 4, 8, 0, -1, -(2**31), CONTEXT, CONTEXT + 1, 2**31 - 1]
SEEDS = [0, 1, 2**63 - 1, -1, -(2**63)]
TEXTS = ["hello", "", " ", "\x00", "\x00\x01\x02", "é" * 50, "🌍🔥" * 20, "\u202e\u200b\ufeff", "<|im_start|>",
         "<|endoftext|>", "a\r\nb", "\ud7ff\ue000", "x" * 3000]


def _sampling(rng: random.Random, req: pb.GenerateRequest) -> None:
    s = req.sampling
    if rng.random() < 0.8:
        s.temperature = _float(rng, TEMPERATURES, 0.0, 3.0)
    if rng.random() < 0.4:
        s.top_p = _float(rng, TOP_PS, 0.0, 1.0)
    if rng.random() < 0.3:
        s.top_k = rng.choice(TOP_KS)
    # Mostly short answers: the fuzz is about requests, not about generating.
    s.max_tokens = rng.choice(MAX_TOKENS) if rng.random() < 0.3 else rng.randint(1, 6)
    if rng.random() < 0.3:
        s.seed = rng.choice(SEEDS)
    if rng.random() < 0.2:
        s.stop_token_ids.extend(rng.choice([[2], [0, VOCAB - 1], [VOCAB], [-1], [2**31 - 1],
                                            list(range(MAX_STOP_TOKEN_IDS + 1))]))
    if rng.random() < 0.2:
        s.stop.extend(rng.choice([["\n"], [""], ["a"] * 17, ["s" * (MAX_STOP_STRING_LEN + 1)], ["é", "🌍"],
                                  ["x" * MAX_STOP_STRING_LEN], [" the", "\x00"]]))
    s.ignore_eos = rng.random() < 0.3
    s.logprobs = rng.random() < 0.3


def _input(rng: random.Random, req: pb.GenerateRequest) -> None:
    kind = rng.random()
    if kind < 0.35:
        req.prompt = rng.choice(TEXTS) + (" " + rng.choice(TEXTS) if rng.random() < 0.3 else "")
    elif kind < 0.65:
        ids = rng.choice([
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
            [], [-1], [VOCAB], [VOCAB - 1], [2**31 - 1], [-(2**31)], [5] * (CONTEXT - 1), [5] * CONTEXT,
            [5] * 4000,
        ])
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(ids)
    elif kind < 0.95:
        req.messages.SetInParent()
        shape = rng.random()
        if shape < 0.1:
            return  # no message at all
        if shape < 0.15:
            for _ in range(MAX_MESSAGES + 1):
                req.messages.messages.add(role="user", content="x")
            return
        roles = ["user", "assistant", "system", "tool", "", "x" * 300, "USER", "\x00"]
        for _ in range(rng.randint(1, 5)):
            req.messages.messages.add(role=rng.choice(roles) if rng.random() < 0.4 else "user",
                                      content=rng.choice(TEXTS))
    # else: no input at all


def _bad_utf8(rng: random.Random) -> tuple[str, bytes]:
    """A request with invalid UTF-8 in one string field."""
    field = rng.choice(["prompt", "content", "role", "stop", "request_id"])
    kwargs: dict = {"max_tokens": 2}
    if field == "prompt":
        kwargs["prompt"] = PLACEHOLDER.decode()
    elif field in ("content", "role"):
        msg = {"role": "user", "content": "hi"}
        msg[field] = PLACEHOLDER.decode()
        kwargs["messages"] = [{"role": "system", "content": "be brief"}, msg]
    else:
        kwargs["prompt"] = "hi"
        kwargs["stop" if field == "stop" else "request_id"] = [PLACEHOLDER.decode()] if field == "stop" \
            else PLACEHOLDER.decode()
    data = build_request(**kwargs).SerializeToString()
    bad = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
    i = rng.randrange(len(PLACEHOLDER) - len(bad) + 1)
    return "utf8", data.replace(PLACEHOLDER, PLACEHOLDER[:i] + bad + PLACEHOLDER[i + len(bad):])


def make_case(rng: random.Random) -> tuple[str, bytes, str, int]:
    """(kind, serialized request, method, responses to read before cancelling; 0: read all)."""
    r = rng.random()
    method = "Generate" if rng.random() < 0.5 else "Complete"
    cancel_after = rng.randint(1, 3) if method == "Generate" and rng.random() < 0.1 else 0
    if r < 0.15:
        kind, data = _bad_utf8(rng)
    elif r < 0.2:
        valid = build_request(prompt="hello there", max_tokens=3).SerializeToString()
        kind, data = "garbage", rng.choice([
            bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
            valid[: rng.randrange(1, len(valid))],  # truncated
            b"\xff" * 10,
        ])
    elif r < 0.21:
        kind, data = "huge", build_request(prompt="z" * (MIN_PROMPT_BYTES + 1), max_tokens=1).SerializeToString()
    else:
        req = pb.GenerateRequest()
        _input(rng, req)
        _sampling(rng, req)
        if rng.random() < 0.1:
            req.request_id = rng.choice(["r" * 257, "id-é🌍", "\x00", "r" * 256])
        kind, data = "fields", req.SerializeToString()
        if req.sampling.max_tokens > 16 and method == "Generate" and rng.random() < 0.7:
            cancel_after = cancel_after or rng.randint(1, 4)
    return kind, data, method, cancel_after


# ---- sending them -----------------------------------------------------------------------------


def send(channel: grpc.Channel, case: tuple[str, bytes, str, int]) -> grpc.StatusCode:
    kind, data, method, cancel_after = case
    path = f"/pdserve.v1.Generation/{method}"
    try:
        if method == "Complete":
            channel.unary_unary(path)(data, timeout=60)
            return grpc.StatusCode.OK
        stream = channel.unary_stream(path)(data, timeout=60)
        for i, _ in enumerate(stream):
            if cancel_after and i + 1 >= cancel_after:
                stream.cancel()
                return grpc.StatusCode.CANCELLED
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        if exc.code() not in ALLOWED and exc.code() != grpc.StatusCode.CANCELLED:
            details = exc.details()
            raise AssertionError(f"{kind} request ({method}) got {exc.code().name}: {details}") from None
        return exc.code()


def victim_answers(address: str) -> list[list[int]]:
    with Client(address, timeout=60) as c:
        return [c.complete(token_ids=q, **VICTIM).token_ids for q in VICTIM_QUESTIONS]


def test_fuzzed_requests_get_precise_statuses_and_harm_no_one(server, wait_until):
    router, worker = server
    quiet = victim_answers(router.address)
    assert all(len(a) == VICTIM["max_tokens"] for a in quiet)

    rng = random.Random(0)
    cases = [make_case(rng) for _ in range(NUM_CASES)]
    stop = threading.Event()
    victim_runs: list[tuple[int, list[int] | str]] = []

    def victim() -> None:
        with Client(router.address, timeout=60) as c:
            i = 0
            while not stop.is_set():
                q = i % len(VICTIM_QUESTIONS)
                try:
                    victim_runs.append((q, c.complete(token_ids=VICTIM_QUESTIONS[q], **VICTIM).token_ids))
                except Exception as exc:  # the assertion below reports it
                    victim_runs.append((q, repr(exc)))
                i += 1

    statuses: collections.Counter = collections.Counter()
    served_tiny_t = 0  # requests served with 0 < temperature < SAMPLING_EPS: the step-killers of issue 21
    t0 = time.monotonic()
    victim_thread = threading.Thread(target=victim)
    victim_thread.start()
    try:
        with grpc.insecure_channel(router.address) as channel:
            with concurrent.futures.ThreadPoolExecutor(FUZZ_THREADS) as pool:
                for (kind, data, _, _), code in zip(cases, pool.map(lambda c: send(channel, c), cases)):
                    statuses[(kind, code.name)] += 1
                    if kind == "fields" and code == grpc.StatusCode.OK:
                        served_tiny_t += 0 < pb.GenerateRequest.FromString(data).sampling.temperature < SAMPLING_EPS
    finally:
        stop.set()
        victim_thread.join(timeout=60)
    elapsed = time.monotonic() - t0

    by_code = collections.Counter()
    for (_, code), n in statuses.items():
        by_code[code] += n
    assert sum(by_code.values()) == NUM_CASES
    # The mix means something: plenty of each outcome and of each kind of request.
    assert by_code["OK"] > 200 and by_code["INVALID_ARGUMENT"] > 1000, (by_code, elapsed)
    assert statuses[("utf8", "INVALID_ARGUMENT")] == sum(n for (k, _), n in statuses.items() if k == "utf8")
    assert statuses[("huge", "INVALID_ARGUMENT")] > 0
    assert served_tiny_t >= 10, served_tiny_t

    failed = [r for r in victim_runs if not isinstance(r[1], list)]
    assert not failed, failed[:3]
    changed = [(q, got) for q, got in victim_runs if got != quiet[q]]
    assert not changed, changed[:3]
    assert len(victim_runs) >= 5, f"the victim ran {len(victim_runs)} requests in {elapsed:.0f} s"

    # The server survived, and nothing is left holding KV blocks.
    assert victim_answers(router.address) == quiet

    def idle() -> bool:
        st = ray.get(worker.stats.remote())
        return st.free_blocks == st.total_blocks and st.num_running == 0 and st.num_waiting == 0

    wait_until(idle, timeout=30, what="every KV block free and no request left on the worker")
