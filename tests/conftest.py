"""Fixtures shared by every test folder: two torch threads (as in CI) and the default model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # CI has two cores; more threads than cores only adds contention. Fixed here so that timings
    # and float reduction orders are the same in every test process.
    import torch

    torch.set_num_threads(2)


@pytest.fixture
def one_thread():
    """Tiny models run on one torch thread: their matrices gain nothing from a second, and two
    threads on a busy two-core machine mostly wait at barriers."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with two CPUs for the whole session (reused when another fixture started one;
    tests/kv_transfer has its own, with four)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory, converted once."""
    from pdserve.engine.model_loader import resolve_model_dir

    return resolve_model_dir("default")


def sharp_llama(config):
    """A random Llama for ``config`` (a ``LlamaConfig`` with a large ``initializer_range``) whose
    norm weights are perturbed too (they are ones after init): peaked logits, so greedy argmaxes
    are far from ties and the same whatever order a kernel sums in. Seeded: always the same."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="session")
def make_sharp_llama():
    """``sharp_llama``, for the folders' own tiny models."""
    return sharp_llama


def save_servable_llama(path: Path, tokenizer_dir: Path, max_position_embeddings: int = 512,
                        sharp: bool = False) -> Path:
    """Save a 2-layer random Llama with ``tokenizer_dir``'s tokenizer files (and so its
    vocabulary) at ``path``: `pdserve serve` loads it in a moment and a token takes a millisecond.
    ``sharp``: larger random weights (and norms that matter), so greedy argmaxes are far from
    ties and the same whatever order a kernel sums in."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                         **({"initializer_range": 0.3} if sharp else {}))
    if sharp:
        model = sharp_llama(config)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def make_servable_llama():
    """``save_servable_llama``, for a test module that needs another context length."""
    return save_servable_llama


@pytest.fixture(scope="session")
def tiny_servable_model(tmp_path_factory, default_model_dir) -> Path:
    """``save_servable_llama`` with a 512-token context, made once per session."""
    return save_servable_llama(tmp_path_factory.mktemp("deploy-tiny-llama"), default_model_dir)


def poll_until(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "the condition"):
    """Return ``condition()``'s first truthy value, polling it until ``timeout`` seconds pass
    (then ``AssertionError`` naming ``what``). Tests wait on a condition, never on a guess."""
    import time

    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)


@pytest.fixture
def wait_until():
    """``wait_until(condition, timeout=10, what=...)``: see ``poll_until``."""
    return poll_until
