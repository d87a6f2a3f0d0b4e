"""Fixtures of the prefill worker tests: a tiny Llama and its HF greedy reference, a decode
``EngineLoop`` with its KV receiver, a ``PrefillEngine``, and a local Ray for the actor test.

The tiny model is a random Llama saved here (float32 safetensors) with a large
``initializer_range``, so that logits are peaked and greedy argmax does not flip on float rounding;
Hugging Face ``generate()`` of each prompt alone is the reference for every output.
"""

from __future__ import annotations

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
        """HF greedy continuation of ``prompt`` alone, ``n`` tokens, never stopping at EOS."""
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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, make_sharp_llama) -> TinyLlama:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
    )
    model = make_sharp_llama(config)
    path = tmp_path_factory.mktemp("tiny-llama-prefill")
    model.save_pretrained(path)
    return TinyLlama(path, model)


@dataclass
class Disaggregated:
    """A decode ``EngineLoop`` (role decode) with its KV receiver, and a ``PrefillEngine`` in process."""

    decode: object  # EngineLoop
    receiver: object  # KVReceiver
    prefill: object  # PrefillEngine


@pytest.fixture
def make_pd(tiny, one_thread):
    """Factory: ``make_pd(max_num_batched_tokens=64, transport="grpc", kv_lease_s=30, kv_reserve_timeout_s=300, frame_bytes=..., sink=None, kv_push="layer")``
    -> ``Disaggregated``; everything is stopped after the test. ``sink(loop)`` may wrap the decode
    loop in what the receiver lands pieces into."""
    from pdserve.decode_worker.worker import EngineLoop, WorkerConfig
    from pdserve.kv_transfer import start_receiver
    from pdserve.prefill_worker.worker import PrefillConfig, PrefillEngine

    from pd_suite import CLUSTER_SECRET, engine_config

    made: list[Disaggregated] = []

    def make(max_num_batched_tokens: int = 64, transport: str = "grpc", kv_lease_s: float = 30.0,
             kv_reserve_timeout_s: float = 300.0, frame_bytes: int = 2 << 20, max_num_seqs: int = 16, sink=None, sender=None,
             prefill_blocks: int = 256, decode_blocks: int = 256, kv_push: str = "layer") -> Disaggregated:
        decode = EngineLoop(WorkerConfig(engine=engine_config(tiny, decode_blocks), role="decode", transport=transport,
                                         kv_lease_s=kv_lease_s, kv_reserve_timeout_s=kv_reserve_timeout_s),
                            name="decode-0")
        receiver = start_receiver(sink(decode) if sink else decode, transport, decode.runner.device, kv_lease_s,
                                  secret=CLUSTER_SECRET)
        prefill = PrefillEngine(PrefillConfig(engine=engine_config(tiny, prefill_blocks), cluster_secret=CLUSTER_SECRET,
                                              max_num_batched_tokens=max_num_batched_tokens,
                                              max_num_seqs=max_num_seqs, transport=transport,
                                              transfer_timeout_s=20.0, frame_bytes=frame_bytes,
                                              kv_push=kv_push),
                                sender=sender)
        pd = Disaggregated(decode, receiver, prefill)
        made.append(pd)
        return pd

    yield make
    for pd in made:
        pd.prefill.stop()
        pd.receiver.stop()
        pd.decode.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with four CPUs (reused when another fixture of the session started one)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()
