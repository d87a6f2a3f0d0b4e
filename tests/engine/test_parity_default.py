"""The default model (SmolLM2-135M-Instruct, float32): greedy chat completions are
token-identical to Hugging Face ``generate()``, batched and with chunked prefill."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.offline import generate
from pdserve.engine.sampling_params import SamplingParams

NEW_TOKENS = 64

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]

LONG_CHAT = [{"role": "user", "content": (
    "Here is a short story. A lighthouse keeper lived alone on a rocky island. Every night he "
    "climbed the spiral stairs, polished the great lens and lit the lamp, and every morning he "
    "wrote the weather in a thick book. One winter a storm broke the radio, and for weeks no "
    "boat came. He kept the light burning anyway. When the supply ship finally arrived, the "
    "captain told him that his light had guided a fishing boat home through the worst night of "
    "the storm. Summarise the story in one sentence and say what its lesson is."
)}]


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(EngineConfig(model="default", num_blocks=256, block_size=16, show_progress=False))


def hf_generate(hf_model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def test_runner_reads_the_default_model(runner, hf_model):
    assert runner.model.num_layers == 30 and runner.model.num_kv_heads == 3 and runner.vocab_size == 49152
    assert runner.eos_token_ids == {hf_model.generation_config.eos_token_id}


def test_batched_greedy_chat_matches_hf_generate(runner, hf_model, tokenizer):
    prompts = [chat_ids(tokenizer, c) for c in CHATS]
    assert len(set(map(len, prompts))) > 3  # different lengths in one batch
    seqs = generate(runner, prompts, SamplingParams(max_tokens=NEW_TOKENS))
    stopped = 0
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        expected = hf_generate(hf_model, prompt)
        assert seq.output_token_ids == expected, (
            f"chat {i}: ours {tokenizer.decode(seq.output_token_ids)!r}\n"
            f"          HF  {tokenizer.decode(expected)!r}")
        if seq.finish_reason == "stop":
            stopped += 1
            assert expected[-1] in runner.eos_token_ids
        else:
            assert seq.finish_reason == "length" and len(expected) == NEW_TOKENS
    assert stopped >= 1  # at least one reply ends on EOS within 64 tokens: EOS handling is checked
    assert runner.allocator.num_free == runner.allocator.num_blocks


def test_chunked_prefill_of_a_long_prompt_matches_hf_generate(runner, hf_model, tokenizer):
    prompt = chat_ids(tokenizer, LONG_CHAT)
    assert len(prompt) > 100
    (seq,) = generate(runner, [prompt], SamplingParams(max_tokens=NEW_TOKENS), prefill_chunk=16)
    assert seq.output_token_ids == hf_generate(hf_model, prompt)
