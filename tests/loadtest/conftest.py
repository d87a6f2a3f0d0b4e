"""Fixtures of the load-test tests: a tiny random Llama that `pdserve serve` can load.

The server needs a tokenizer, so the tiny model borrows the default model's (SmolLM2) files and
matches its vocabulary; everything else is small, so a server starts in seconds and a request
takes milliseconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def servable_tiny_model(tmp_path_factory, default_model_dir) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-servable-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path
