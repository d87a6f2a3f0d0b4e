"""The worker as a real Ray actor (``start_workers``): the default model token-identical to HF greedy,
one ``next_outputs()`` call per step at most (not per token), and errors that leave it serving (the
disaggregated entry through real actors and transports is in tests/prefill_worker/test_prefill_actors.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.decode_worker.messages import WorkerRequest
from pdserve.decode_worker.worker import start_workers
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams


def req(rid: str, prompt: list[int], max_tokens: int) -> WorkerRequest:
    return WorkerRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.time())


def drain(ray, actor, ids, timeout: float = 120.0):
    """Poll ``next_outputs`` until every id has its final delta; return tokens, finals and the
    non-empty answers (checking that nothing comes for a request after its final delta)."""
    tokens: dict[str, list[int]] = {}
    finals: dict = {}
    answers: list[list] = []
    deadline = time.time() + timeout
    while not all(i in finals for i in ids):
        assert time.time() < deadline, f"timed out; finished: {sorted(finals)}"
        deltas = ray.get(actor.next_outputs.remote(1.0))
        if deltas:
            answers.append(deltas)
        for d in deltas:
            assert d.request_id not in finals, f"delta for {d.request_id} after its final one"
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                finals[d.request_id] = d
    return tokens, finals, answers


@pytest.fixture(scope="module")
def tiny_actor(ray_cluster, tiny):
    (actor,) = start_workers(
        EngineConfig(model=str(tiny.path), block_size=4, num_blocks=64, threads=1, show_progress=False),
        num_workers=1, num_cpus=1, name_prefix="test-tiny-actor",
    )
    yield actor
    ray_cluster.kill(actor)
    deadline = time.time() + 30
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.05)


def test_default_model_through_an_actor_matches_hf_greedy(ray_cluster, actors, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Once upon a time, in a small village by the sea, there lived"]
    prompts = [tok(t)["input_ids"] for t in texts]
    max_tokens = [10, 7, 9]
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    expected = []
    with torch.inference_mode():
        for p, n in zip(prompts, max_tokens):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            expected.append(out[0, len(p):].tolist())
    del hf

    (actor,) = start_workers(EngineConfig(model="default", block_size=16, num_blocks=32, threads=1,
                                          show_progress=False),
                             num_workers=1, num_cpus=1, name_prefix="test-default-actor")
    actors.append(actor)
    info = ray_cluster.get(actor.model_info.remote())
    assert info["vocab_size"] == 49152 and info["num_blocks"] == 32
    # the first request runs alone for a while; the other two join its batch mid-stream
    ray_cluster.get(actor.add_request.remote(req("0", prompts[0], max_tokens[0])))
    first = ray_cluster.get(actor.next_outputs.remote(30.0))
    # one delta per step: all of them, if the actor ran more than one step before the call returned
    assert first and {d.request_id for d in first} == {"0"}
    done = [d for d in first if d.finish_reason is not None]
    ray_cluster.get([actor.add_request.remote(req(str(i), prompts[i], max_tokens[i])) for i in (1, 2)])
    tokens, finals, _ = drain(ray_cluster, actor, ["1", "2"] if done else ["0", "1", "2"])
    tokens["0"] = [t for d in first for t in d.token_ids] + tokens.get("0", [])
    finals.update({"0": done[0]} if done else {})
    for i in range(3):
        assert tokens[str(i)] == expected[i], f"prompt {texts[i]!r}: {tok.decode(tokens[str(i)])!r}"
        assert finals[str(i)].finish_reason == "length"
    st = ray_cluster.get(actor.stats.remote())
    assert st.free_blocks == st.total_blocks == 32


def test_one_next_outputs_call_carries_the_tokens_of_many_requests(ray_cluster, tiny_actor, tiny):
    prompts = tiny.prompts([4, 9, 13, 20, 27, 33, 6, 15], seed=20)
    n = 16
    steps_before = ray_cluster.get(tiny_actor.counters.remote()).num_steps
    ray_cluster.get([tiny_actor.add_request.remote(req(f"m{i}", p, n)) for i, p in enumerate(prompts)])
    ids = [f"m{i}" for i in range(len(prompts))]
    tokens, finals, answers = drain(ray_cluster, tiny_actor, ids)
    steps = ray_cluster.get(tiny_actor.counters.remote()).num_steps - steps_before

    total_tokens = sum(len(t) for t in tokens.values())
    assert total_tokens == n * len(prompts)
    # at most one answer per step, each carrying every request that advanced in that step
    assert len(answers) <= steps < total_tokens
    assert max(len({d.request_id for d in a}) for a in answers) >= 4
    for i, p in enumerate(prompts):
        assert tokens[f"m{i}"] == tiny.greedy(p, n)
        assert finals[f"m{i}"].num_output_tokens == n


def test_an_actor_rejects_a_request_bigger_than_its_pool_and_keeps_serving(ray_cluster, tiny_actor, tiny):
    big, ok = tiny.prompts([200, 11], seed=21)
    with pytest.raises(ValueError, match="blocks"):
        ray_cluster.get(tiny_actor.add_request.remote(req("big", big, 100)))  # 300 tokens > 64 * 4
    ray_cluster.get(tiny_actor.add_request.remote(req("ok", ok, 8)))
    tokens, finals, _ = drain(ray_cluster, tiny_actor, ["ok"])
    assert tokens["ok"] == tiny.greedy(ok, 8)
    assert "big" not in finals
