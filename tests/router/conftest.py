"""Fixtures shared by the router tests: one Ray for the session, the default tokenizer, and the
default model in Hugging Face ``transformers`` (float32), the reference for greedy output."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with two CPUs, started once (or reused when another fixture started it)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct), as the router loads it."""
    from pdserve.engine.model_loader import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """The default model as ``transformers`` runs it, float32, for ``generate()`` references."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_chat_greedy(tokenizer, hf_model):
    """``answer(question, max_new_tokens)``: Hugging Face ``generate()``'s greedy output ids for
    one user message (chat template), float32. Answers are cached and shared: a shorter answer is
    a prefix of a longer one (greedy decoding stops only at EOS)."""
    import torch

    cache: dict[str, tuple[int, list[int]]] = {}

    def answer(question: str, max_new_tokens: int) -> list[int]:
        if question not in cache or cache[question][0] < max_new_tokens:
            msgs = [{"role": "user", "content": question}]
            ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
            with torch.no_grad():
                gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
            cache[question] = (max_new_tokens, gen[0, len(ids):].tolist())
        return cache[question][1][:max_new_tokens]

    return answer
