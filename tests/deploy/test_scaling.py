"""Runtime scaling on one host: `pdserve scale` and the Admin.Scale RPC against a real router
with real actors (a tiny random Llama, local Ray).

Workers added under load join placement and serve; removed ones drain first, so no request is
lost and greedy answers do not change. Bad requests get a precise gRPC status and change
nothing: prefill workers for a colocated server, zero workers, resources no node has. The
two-host version (disaggregated, roles pinned to hosts) is tests/deploy/test_multihost.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve import cli
from pdserve.client import Client, RequestError
from pdserve.router.admin import scale
from pdserve.router.resources import RoleResources

QUESTIONS = ["Name a primary color.", "What is 2 + 2?", "Say hello in Spanish."]
GREEDY = dict(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir, make_servable_llama):
    """The tiny servable Llama with an 8192-token context, so that a request of ``LONG`` tokens
    runs for seconds: long enough to be caught running by a scale-down, whatever the machine's
    load."""
    return make_servable_llama(tmp_path_factory.mktemp("scaling-llama"), default_model_dir, 8192)


@pytest.fixture(scope="module")
def server(local_ray, model):
    import ray

    from pdserve.decode_worker.worker import WorkerConfig
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_loader import load_tokenizer
    from pdserve.router.scaling import ActorFactory
    from pdserve.router.server import RouterConfig, start_in_thread

    engine = EngineConfig(model=str(model), threads=1, kv_cache_bytes=32 << 20, show_progress=False)
    factory = ActorFactory({"colocated": WorkerConfig(engine=engine)}, {"colocated": RoleResources(0.25, 0.0)},
                           name=f"scaletest{id(engine) % 10000}")
    workers, _ = factory.start("colocated", 1)
    router = start_in_thread(workers, load_tokenizer(str(model)), RouterConfig(port=0),
                             actor_factory=factory)
    yield router, factory
    router.stop()
    for actor in factory.started:
        ray.kill(actor)


def test_bad_scale_requests_are_refused_and_change_nothing(server):
    router, factory = server
    cases = [
        (dict(prefill=1), grpc.StatusCode.INVALID_ARGUMENT, "colocated mode"),
        (dict(decode=0), grpc.StatusCode.INVALID_ARGUMENT, "at least 1"),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "set prefill and/or decode"),
        (dict(decode=1, drain_timeout_s=-1), grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s"),
    ]
    for kwargs, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            scale(router.address, timeout=30, **kwargs)
        assert err.value.code() == code and text in err.value.details(), (kwargs, err.value.details())

    # A worker no node can hold: refused at once, naming the resource.
    saved = factory.resources["colocated"]
    factory.resources["colocated"] = RoleResources(0.25, 0.0, {"no_such_node": 1})
    try:
        with pytest.raises(grpc.RpcError) as err:
            scale(router.address, decode=2, timeout=30)
    finally:
        factory.resources["colocated"] = saved
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no node of the Ray cluster has no_such_node" in err.value.details()
    with Client(router.address, timeout=30) as c:
        assert c.server_info().num_decode_workers == 1


def test_scale_up_and_down_under_load_loses_nothing(server, capsys):
    router, factory = server
    with Client(router.address, timeout=60) as c:
        reference = [c.complete(messages=[{"role": "user", "content": q}], **GREEDY).token_ids for q in QUESTIONS]

    results: list = []
    stop = threading.Event()

    def load(k: int) -> None:
        with Client(router.address, timeout=60) as c:
            i = k
            while not stop.is_set():
                q = i % len(QUESTIONS)
                try:
                    r = c.complete(messages=[{"role": "user", "content": QUESTIONS[q]}], **GREEDY)
                    results.append((q, r.token_ids, r.finish_reason))
                except RequestError as exc:
                    results.append((q, None, f"{exc.code.name}: {exc.message}"))
                i += 2

    threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        assert cli.main(["scale", "--decode", "2", "--address", router.address]) == 0
        assert "1 prefill" not in capsys.readouterr().out  # colocated: 0 prefill workers
        with Client(router.address, timeout=30) as c:
            assert c.server_info().num_decode_workers == 2
        new = f"{factory.name}-decode-s1-0"
        assert new in router.server.pool.worker_names()
        n_before = len(results)
        end = time.monotonic() + 30
        while len(results) < n_before + 6 and time.monotonic() < end:
            time.sleep(0.1)
        reply = scale(router.address, decode=1, timeout=120)
        assert (reply.num_decode_workers, len(reply.removed), reply.num_requests_cut) == (1, 1, 0)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert len(router.server.pool.worker_names()) == 1
    errors = [r for r in results if r[1] is None]
    assert not errors, errors[:3]
    assert len(results) >= 8
    assert all(tokens == reference[q] for q, tokens, _ in results)


LONG = dict(max_tokens=8000, temperature=0, ignore_eos=True)


def start_long_requests(address: str, n: int) -> tuple[list, list[threading.Thread]]:
    out: list = []

    def one() -> None:
        with Client(address, timeout=120) as c:
            try:
                r = c.complete(prompt="Count: one, two, three,", **LONG)
                out.append((r.finish_reason, r.completion_tokens))
            except RequestError as exc:
                out.append((exc.code.name, exc.message))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return out, threads


def wait_until_every_worker_is_busy(router, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        loads = router.server.pool.loads()
        if len(loads) == 2 and all(l.inflight > 0 for l in loads):
            return
        time.sleep(0.02)
    raise AssertionError(f"the two requests did not spread over the two workers: {router.server.pool.loads()}")


@pytest.mark.parametrize("drain_timeout,cut", [(120.0, 0), (0.0, 1)], ids=["drains", "drain-timeout-cuts"])
def test_scale_down_waits_for_running_requests_up_to_the_drain_timeout(server, drain_timeout, cut):
    router, _ = server
    assert scale(router.address, decode=2, timeout=120).num_decode_workers == 2
    out, threads = start_long_requests(router.address, 2)
    try:
        wait_until_every_worker_is_busy(router)  # so the worker removed has a request running
        reply = scale(router.address, decode=1, drain_timeout_s=drain_timeout, timeout=180)
        assert (reply.num_decode_workers, len(reply.removed), reply.num_requests_cut) == (1, 1, cut)
    finally:
        for t in threads:
            t.join(timeout=120)
    finished = [o for o in out if o == ("length", LONG["max_tokens"])]
    failed = [o for o in out if o[0] == "UNAVAILABLE"]
    assert (len(finished), len(failed)) == (2 - cut, cut), out
    assert all("was scaled away before this request finished" in msg for _, msg in failed)
    assert len(router.server.pool.worker_names()) == 1
