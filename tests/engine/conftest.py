"""Tiny randomly initialised models of every supported architecture, built from configs here.

``tiny_model(kind, **overrides)`` saves a model once per session (safetensors) and returns its
directory and the Hugging Face model itself (float32, eval), which is the parity reference.
The weights are drawn with a large ``initializer_range`` so that logits are peaked: with the
default 0.02 a tiny model's logits are nearly flat and float rounding alone can flip an argmax.
Biases and norm weights (zeros and ones after HF's init) are perturbed too, so a forward that
drops a bias or a norm weight cannot pass a parity test by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 256
EOS = 2
INIT_RANGE = 0.3

_LLAMA_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per KV head
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=0,
)

# Mistral's window is smaller than the longer test prompts, so the window is exercised.
MISTRAL_WINDOW = 16


def tiny_config(kind: str, **overrides):
    """The config of one tiny test model; ``kind`` names the architecture variant and
    ``overrides`` replace its constructor arguments (so derived fields are derived again)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if kind == "gpt2":
        cls, kwargs = GPT2Config, dict(
            vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
            initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=EOS,
        )
    elif kind == "llama":
        cls, kwargs = LlamaConfig, dict(_LLAMA_COMMON)
    elif kind == "llama_untied_linear_rope":
        cls, kwargs = LlamaConfig, dict(
            _LLAMA_COMMON,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    elif kind == "mistral":
        cls, kwargs = MistralConfig, dict(_LLAMA_COMMON, sliding_window=MISTRAL_WINDOW)
    elif kind == "qwen2":
        cls, kwargs = Qwen2Config, dict(_LLAMA_COMMON)  # q/k/v projections carry biases
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    return cls(**{**kwargs, **overrides})


def build_tiny_model(config, seed: int = 0):
    """A float32 HF model with random weights, biases and norm weights (deterministic per seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:  # norm weights (ones) and biases (zeros) after HF's init
                p.add_(torch.randn_like(p) * 0.1)
    return model


@dataclass
class TinyModel:
    path: Path
    hf: object  # transformers PreTrainedModel

    def runner(self, num_blocks: int = 256, block_size: int = 4, **kw):
        """A float32 CPU ``ModelRunner`` over this model, with a small block size so that every
        test sequence spans several blocks."""
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.model_runner import ModelRunner

        return ModelRunner(EngineConfig(model=str(self.path), num_blocks=num_blocks,
                                        block_size=block_size, show_progress=False, **kw))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: ``tiny_model(kind, **config_overrides) -> TinyModel``, cached per session."""
    cache: dict[tuple, TinyModel] = {}

    def make(kind: str, **overrides) -> TinyModel:
        key = (kind, repr(sorted(overrides.items())))
        if key not in cache:
            model = build_tiny_model(tiny_config(kind, **overrides))
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(path)  # safetensors by default
            cache[key] = TinyModel(path, model)
        return cache[key]

    return make


def _random_prompts(lengths, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def random_prompts():
    """Function: ``random_prompts(lengths, seed=0)``: random token ids avoiding the special ids
    0..2 (pad, bos, eos)."""
    return _random_prompts


@pytest.fixture(autouse=True)
def _one_thread():
    """Engine tests run torch on one thread. Their tiny matrices gain nothing from a second one,
    and on a busy two-core machine two OpenMP threads spend most of their time waiting at
    barriers: measured here with another process running, the tiny parity tests took 50 s on two
    threads and 1.5 s on one, and HF generate() of 64 tokens of the default model 13-36 s on two
    threads and 6.5-7.8 s on one. One thread keeps the suite's time bounded whatever else runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
