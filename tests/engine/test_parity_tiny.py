"""Greedy output is token-identical to Hugging Face ``generate()`` for every architecture.

Tiny random models (float32) of each supported architecture run a mixed batch of prompts of
different lengths through ``offline.generate`` with prefill chunks of 1 token, 7 tokens and the
whole prompt, over a paged cache of 4-token blocks; the reference is HF ``generate()`` of each
prompt alone (batch of one, no padding).

The reference runs HF's default attention (sdpa), which honours Mistral's sliding window: the
"is exercised" tests below show the window and the RoPE scaling change HF's output, so parity
checks them. Stability: with the peaked weights of conftest, a sweep of 3 weight seeds x 4
prompt seeds x 3 chunk sizes per architecture (1,800 sequences of 32 tokens) matched HF
everywhere.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.offline import generate
from pdserve.engine.sampling_params import SamplingParams

NEW_TOKENS = 16
PROMPT_LENGTHS = [3, 5, 8, 11, 17, 23, 31, 40, 52, 60]
MISTRAL_WINDOW = 16
KINDS = ["llama", "llama_untied_linear_rope", "mistral", "qwen2", "gpt2"]


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """HF greedy continuation of each prompt alone, never stopping at EOS.

    EOS is switched off in the generation config rather than with ``min_new_tokens``: that
    processor masks EOS out of the logits, whereas ``ignore_eos`` lets the engine pick EOS and
    go on, so only "no EOS at all" is the same decision rule on both sides.
    """
    cfg = hf_model.generation_config
    saved = cfg.eos_token_id
    cfg.eos_token_id = None
    try:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=new_tokens, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
        return outs
    finally:
        cfg.eos_token_id = saved


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf_generate(kind, tiny_model, random_prompts):
    tiny = tiny_model(kind)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    expected = hf_greedy(tiny.hf, prompts)
    assert all(len(e) == NEW_TOKENS for e in expected)
    runner = tiny.runner(num_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for chunk in (1, 7, None):
        seqs = generate(runner, prompts, params, prefill_chunk=chunk)
        got = [s.output_token_ids for s in seqs]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"{kind}, prefill_chunk={chunk}, prompt {i} ({len(prompts[i])} tokens)"
        assert all(s.finish_reason == "length" for s in seqs)
        assert runner.allocator.num_free == runner.allocator.num_blocks


def test_mistral_sliding_window_is_exercised(tiny_model, random_prompts):
    """The Mistral parity test means something only if the window changes the output: the same
    weights without a window continue the long prompts differently."""
    windowed = tiny_model("mistral")
    unwindowed = tiny_model("mistral", sliding_window=None)
    for a, b in zip(windowed.hf.state_dict().values(), unwindowed.hf.state_dict().values()):
        assert torch.equal(a, b)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    long = [p for p in prompts if len(p) > MISTRAL_WINDOW]
    assert hf_greedy(windowed.hf, long) != hf_greedy(unwindowed.hf, long)
    assert windowed.runner().model.sliding_window == MISTRAL_WINDOW


def test_rope_scaling_is_exercised(tiny_model, random_prompts):
    """Likewise linear RoPE scaling: dropping it changes HF's output, so parity above checks it."""
    scaled = tiny_model("llama_untied_linear_rope")
    plain = tiny_model("llama_untied_linear_rope",
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    for a, b in zip(scaled.hf.state_dict().values(), plain.hf.state_dict().values()):
        assert torch.equal(a, b)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    assert hf_greedy(scaled.hf, prompts) != hf_greedy(plain.hf, prompts)
    assert not torch.equal(scaled.hf.lm_head.weight, scaled.hf.model.embed_tokens.weight)


def test_qwen2_has_attention_biases(tiny_model):
    state = tiny_model("qwen2").hf.state_dict()
    for name in ("q_proj", "k_proj", "v_proj"):
        bias = state[f"model.layers.0.self_attn.{name}.bias"]
        assert bias.abs().sum() > 0  # perturbed, so a forward that drops it fails parity


@pytest.mark.parametrize("overrides", [
    dict(attention_bias=True, mlp_bias=True),  # o_proj and MLP biases (Llama options)
    dict(head_dim=32),  # head_dim != hidden_size / num_heads
    dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 64}),
], ids=["biases", "head_dim", "llama3_rope", "yarn_rope"])
def test_llama_config_variants_match_hf_generate(overrides, tiny_model, random_prompts):
    tiny = tiny_model("llama", **overrides)
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    expected = hf_greedy(tiny.hf, prompts)
    seqs = generate(tiny.runner(), prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), prefill_chunk=7)
    assert [s.output_token_ids for s in seqs] == expected


def test_qwen2_mixed_sliding_and_full_layers_are_refused(tiny_model):
    """transformers windows only the layers marked "sliding_attention"; the engine has one window
    for all layers, so such a model is refused with a clear error instead of differing silently."""
    with pytest.raises(ValueError, match="mix sliding-window and full-attention layers"):
        tiny = tiny_model("qwen2", use_sliding_window=True, sliding_window=MISTRAL_WINDOW, max_window_layers=1)
        assert tiny.hf.config.layer_types == ["full_attention", "sliding_attention"]
        tiny.runner()
