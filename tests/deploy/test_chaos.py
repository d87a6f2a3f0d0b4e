"""Chaos: worker actors killed under load lose no request (real router, real actors, real transports).

In each mode (colocated; disaggregated over gRPC and over the collective transport) several
streams (greedy, and seeded sampling) run while a worker is killed at a chosen point: a decode (or colocated) worker
mid-decode, the only prefill worker while it has prompts in hand (before token #1, or with KV on
the way), and a second decode worker while the first one's requests are migrating. Every stream
must end with exactly the no-fault answer; every killed worker is replaced (the router's actor
factory starts a new one); afterwards every worker's KV blocks are all free; and no call runs
into its deadline. The model is a small random Llama with sharp logits (no near-ties for float
rounding to flip) and a long context, so a stream runs for a second or more.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
import ray

from pdserve.client import AsyncClient

NUM_STREAMS = 6
PARAMS = dict(max_tokens=400, temperature=0, ignore_eos=True)


def params(i: int) -> dict:
    """Stream ``i``'s sampling: greedy for even ``i``, seeded sampling for odd ones (a migrated
    request draws each token from (seed, position), so it samples what it would have)."""
    return PARAMS if i % 2 == 0 else {**PARAMS, "temperature": 1.0, "seed": 1000 + i}
PROMPTS = [[100 + 7 * i + j for j in range(20 + 9 * i)] for i in range(NUM_STREAMS)]
MODES = {
    "colocated": dict(mode="colocated"),
    "disaggregated-grpc": dict(mode="disaggregated", transport="grpc"),
    "disaggregated-collective": dict(mode="disaggregated", transport="collective"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir, make_servable_llama):
    return make_servable_llama(tmp_path_factory.mktemp("chaos-llama"), default_model_dir, 4096, sharp=True)


class Server:
    """A router with its own actor factory: 2 decode (or colocated) workers and, disaggregated, 1
    prefill worker."""

    def __init__(self, model, mode: str, transport: str = "grpc", decode: int = 2, **prefill_config):
        from pdserve.decode_worker.worker import WorkerConfig
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.model_loader import load_tokenizer
        from pdserve.prefill_worker.worker import PrefillConfig
        from pdserve.router.resources import RoleResources
        from pdserve.router.scaling import ActorFactory
        from pdserve.router.server import RouterConfig, start_in_thread

        engine = EngineConfig(model=str(model), threads=1, kv_cache_bytes=16 << 20, show_progress=False)
        res = RoleResources(0.25, 0.0)
        name = f"chaos{secrets.token_hex(3)}"
        if mode == "disaggregated":
            secret = secrets.token_bytes(32)
            configs = {"decode": WorkerConfig(engine=engine, role="decode", transport=transport, cluster_secret=secret),
                       "prefill": PrefillConfig(engine=engine, transport=transport, cluster_secret=secret,
                                                **prefill_config)}
        else:
            configs = {"colocated": WorkerConfig(engine=engine)}
        self.factory = ActorFactory(configs, {role: res for role in configs}, name=name)
        polled = "decode" if mode == "disaggregated" else "colocated"
        workers, _ = self.factory.start(polled, decode)
        prefill = self.factory.start("prefill", 1)[0] if mode == "disaggregated" else None
        self.router = start_in_thread(workers, load_tokenizer(str(model)),
                                      RouterConfig(port=0, mode=mode, transport=transport, queue_timeout_s=60),
                                      prefill_workers=prefill, actor_factory=self.factory)
        self.pool = self.router.server.pool

    def workers(self, role: str) -> list:
        """Live ``(name, actor)`` of ``role`` ("prefill", or the polled role)."""
        ws = self.pool._prefill if role == "prefill" else self.pool._workers
        return [(w.name, w.actor) for w in ws if w.alive]

    def run(self, kill=None) -> list[list[int]]:
        """Every stream's tokens; ``kill(server, progress)`` (a coroutine) runs beside them, with
        ``progress[i]`` the tokens stream ``i`` has received so far."""
        progress: list[list[int]] = [[] for _ in PROMPTS]

        async def one(c: AsyncClient, i: int) -> list[int]:
            async for chunk in c.generate(token_ids=PROMPTS[i], **params(i)):
                progress[i] += chunk.token_ids
            return progress[i]

        async def main():
            async with AsyncClient(self.router.address, timeout=120) as c:
                streams = asyncio.gather(*(one(c, i) for i in range(NUM_STREAMS)))
                if kill is not None:
                    await kill(self, progress)
                return await streams

        return asyncio.run(main())

    def wait_recovered(self, roles: dict[str, int], timeout: float = 120) -> None:
        """Until every role has its number of live workers again and every block is free."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(len(self.workers(r)) == n for r, n in roles.items()):
                stats = ray.get([a.stats.remote() for r in roles for _, a in self.workers(r)])
                if all(s.free_blocks == s.total_blocks and s.num_running == 0 for s in stats):
                    return
            time.sleep(0.1)
        raise AssertionError(f"not recovered: {[(r, self.workers(r)) for r in roles]}")

    def stop(self) -> None:
        self.router.stop()
        for a in self.factory.started:
            try:
                ray.kill(a)
            except Exception:
                pass


async def until(condition, timeout: float = 60, what: str = "the condition") -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.005)


async def kill_decode_mid_decode(server: Server, progress) -> None:
    """Kill the decode (or colocated) worker with the most requests once every stream has tokens."""
    await until(lambda: all(len(p) >= 3 for p in progress), what="every stream decoding")
    name = max(server.pool.loads(), key=lambda l: l.inflight).name
    ray.kill(dict(server.workers(server.pool.polled_role))[name])


async def kill_prefill_busy(server: Server, progress) -> None:
    """Kill the only prefill worker while it has prompts in hand (some before their token #1)."""
    [(_, prefill)] = server.workers("prefill")
    await until(lambda: sum(1 for p in progress if p) >= 1, what="a first token")
    assert any(not p for p in progress), "every stream had its token #1 already: not a mid-prefill kill"
    ray.kill(prefill)


async def kill_both_decode_workers(server: Server, progress) -> None:
    """Kill one decode worker mid-decode, then the other once the first one's requests have
    started moving (some onto it): they move again, to the replacements."""
    first = {n for n, _ in server.workers(server.pool.polled_role)}
    await kill_decode_mid_decode(server, progress)
    await until(lambda: any(s.migrations for s in list(server.pool._streams.values())), timeout=30,
                what="a moved request placed again")
    for name, actor in server.workers(server.pool.polled_role):
        if name in first:
            ray.kill(actor)


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_workers_lose_no_request_and_are_replaced(local_ray, model, mode):
    server = Server(model, **MODES[mode])
    try:
        polled = server.pool.polled_role
        roles = {polled: 2, **({"prefill": 1} if polled == "decode" else {})}
        reference = server.run()
        assert all(len(r) == PARAMS["max_tokens"] for r in reference)
        kills = [kill_decode_mid_decode, kill_both_decode_workers]
        if polled == "decode":
            kills.insert(1, kill_prefill_busy)
        for kill in kills:
            got = server.run(kill)
            for i, (g, want) in enumerate(zip(got, reference)):
                assert g == want, f"{kill.__name__}: stream {i} differs from the no-fault run at token " \
                                  f"{next(k for k, (a, b) in enumerate(zip(g + [None], want)) if a != b)}"
            server.wait_recovered(roles)
    finally:
        server.stop()


@pytest.mark.parametrize("transport", ["grpc", "collective"])
def test_a_prompt_near_the_context_length_works_disaggregated(local_ray, model, transport):
    """A prompt that fills the context but for its answer, prefilled in many small chunks, so its
    transfer stays open far longer than the sender's timeout: progress (each piece) bounds a
    transfer, not a fixed time. The answer is Hugging Face's."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.client import Client

    timeout_s, new = 0.15, 8
    prompt = [3 + (17 * i) % 40000 for i in range(4096 - new)]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    server = Server(model, "disaggregated", transport, decode=1, transfer_timeout_s=timeout_s,
                    max_num_batched_tokens=16)
    try:
        with Client(server.router.address, timeout=300) as c:
            out = c.complete(token_ids=prompt, max_tokens=new, temperature=0, ignore_eos=True)
        assert out.token_ids == want
        assert out.timings.prefill_s > 2 * timeout_s, out.timings  # the case a fixed deadline cut
        server.wait_recovered({"decode": 1, "prefill": 1})
    finally:
        server.stop()
