"""Fixtures of the benchmark tests: a tiny random Llama and a local Ray.

The benchmarks run here in their quick modes, as smoke tests of the commands themselves, not as
measurements. The tiny model's large ``initializer_range`` makes its logits peaked, so that greedy
argmax does not flip on float rounding (the offline benchmark compares outputs with HF's).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, make_sharp_llama) -> Path:
    """A 2-layer random Llama (2 KV heads of 16, vocabulary 384) saved as a Hugging Face directory."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = make_sharp_llama(config)
    path = tmp_path_factory.mktemp("bench-tiny-llama")
    model.save_pretrained(path)
    return path


