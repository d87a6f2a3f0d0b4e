"""Fixtures of the decode worker tests: a tiny Llama, its HF greedy reference, engine loops, Ray.

The tiny model is a random Llama built and saved here (float32 safetensors), with a large
``initializer_range`` so that its logits are peaked and greedy argmax does not flip on float
rounding; Hugging Face ``generate()`` of each prompt alone is the reference for every output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

VOCAB = 384
EOS = 2


@dataclass
class TinyLlama:
    path: Path
    hf: object  # transformers LlamaForCausalLM, float32, eval
    _greedy: dict = field(default_factory=dict)

    @staticmethod
    def prompts(lengths, seed: int = 0) -> list[list[int]]:
        """Random token ids avoiding the special ids 0..2 (pad, bos, eos)."""
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """HF greedy continuation of ``prompt`` alone (batch of one), ``n`` tokens, never stopping
        at EOS (EOS is off in the generation config, like ``ignore_eos`` on our side)."""
        key = tuple(prompt)
        have = self._greedy.get(key, [])
        if len(have) < n:
            cfg = self.hf.generation_config
            saved = cfg.eos_token_id
            cfg.eos_token_id = None
            try:
                ids = torch.tensor([prompt])
                with torch.inference_mode():
                    out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=n, pad_token_id=0)
            finally:
                cfg.eos_token_id = saved
            have = out[0, len(prompt):].tolist()
            self._greedy[key] = have
        return have[:n]


def build_tiny_llama(path: Path, seed: int = 0) -> TinyLlama:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norm weights are ones after init: perturb them so they matter
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return TinyLlama(path, model)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyLlama:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def make_loop(tiny, one_thread):
    """Factory: ``make_loop(num_blocks=..., max_num_batched_tokens=..., max_num_seqs=..., kv_lease_s=..., kv_reserve_timeout_s=...)``
    -> a started ``EngineLoop`` over the tiny model (block size 4), stopped after the test."""
    from pdserve.decode_worker.scheduler import SchedulerConfig
    from pdserve.decode_worker.worker import EngineLoop, WorkerConfig
    from pdserve.engine.config import EngineConfig

    loops = []

    def make(num_blocks: int = 256, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
             kv_lease_s: float = 30.0, kv_reserve_timeout_s: float = 300.0):
        config = WorkerConfig(
            engine=EngineConfig(model=str(tiny.path), block_size=4, num_blocks=num_blocks, show_progress=False),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            kv_lease_s=kv_lease_s, kv_reserve_timeout_s=kv_reserve_timeout_s,
        )
        loop = EngineLoop(config)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()


class Collector:
    """Drains an ``EngineLoop``'s outputs and checks the delta protocol as it goes: no delta for a
    request after its final one."""

    def __init__(self, take):
        self.take = take  # () -> list[RequestDelta]
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, object] = {}  # request id -> its final RequestDelta
        self.num_finals: dict[str, int] = {}
        self.batches: list[list] = []  # every non-empty answer of take(), in order

    def poll(self) -> list:
        deltas = self.take()
        if deltas:
            self.batches.append(deltas)
        for d in deltas:
            assert d.request_id not in self.final, f"delta for {d.request_id} after its final delta"
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                self.final[d.request_id] = d
                self.num_finals[d.request_id] = self.num_finals.get(d.request_id, 0) + 1
        return deltas

    def wait_for(self, cond, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, "timed out waiting for the worker"
            self.poll()

    def wait_all(self, ids, timeout: float = 60.0) -> None:
        self.wait_for(lambda: all(i in self.final for i in ids), timeout)


@pytest.fixture
def collect():
    """``collect(loop)`` -> a ``Collector`` over ``loop.take_outputs`` (0.2 s long poll)."""
    return lambda loop: Collector(lambda: loop.take_outputs(0.2))


@pytest.fixture
def actors(ray_cluster):
    """Collects the actors a test starts and kills them afterwards, so their CPUs are free again."""
    handles: list = []
    before = ray_cluster.available_resources().get("CPU", 0)
    yield handles
    for h in handles:
        ray_cluster.kill(h)
    # ray.kill is asynchronous: wait until the CPUs are back before the next test places actors.
    deadline = time.time() + 30
    while ray_cluster.available_resources().get("CPU", 0) < before and time.time() < deadline:
        time.sleep(0.05)
