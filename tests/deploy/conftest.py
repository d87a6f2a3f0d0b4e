"""Fixtures of the deployment tests: a tiny random Llama that real actors load in a moment."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_servable_model(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random Llama with the default model's tokenizer files (and so its vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("deploy-tiny-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with two CPUs (or the one another fixture of the session started)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, namespace="pdserve")
        started = True
    yield ray
    if started:
        ray.shutdown()
