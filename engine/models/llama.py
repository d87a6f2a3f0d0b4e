"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a flat batch and a paged KV cache.

Each decoder layer: RMSNorm -> fused QKV projection -> RoPE -> paged attention -> output
projection -> residual; RMSNorm -> fused gate/up projection -> act(gate) * up -> down -> residual.
Grouped-query attention, optional q/k/v biases (Qwen2), tied or untied embeddings, RoPE with the
config's theta and static scaling types, and Mistral's sliding window are handled here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.linear import linear, packing_available, prepare


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as transformers' LlamaRMSNorm, so float32 results match bit for bit.
    dtype = x.dtype
    if dtype == torch.float32:  # the same ops without the two no-op casts (a decode step is per-op bound)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(dtype)


def rope_tables(config, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position ``[max_positions, head_dim]``, computed as transformers does."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    elif rope_type in ("dynamic", "longrope"):
        raise ValueError(f"RoPE scaling {rope_type!r} depends on the sequence length and is not supported")
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise ValueError(f"unknown RoPE type {rope_type!r}")
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype=dtype, device=device), (emb.sin() * scaling).to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, D]``, cos/sin ``[T, 1, D]``; rotate-half form, as in transformers."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer:
    __slots__ = ("ln_in", "ln_post", "wqkv", "bqkv", "wo", "bo", "wgu", "wdown", "bgu", "bdown")


class LlamaModel:
    """Weights as plain tensors and a functional forward: no ``nn.Module`` overhead per call."""

    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype, device, max_positions: int):
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act]
        sw = getattr(config, "sliding_window", None)
        if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
            sw = None
        self.sliding_window = sw if sw and sw < max_positions else None
        layer_types = getattr(config, "layer_types", None)
        if self.sliding_window and layer_types and len(set(layer_types)) > 1:
            # transformers windows only the layers marked "sliding_attention"; one window for all
            # layers would silently differ from the reference, so refuse instead.
            raise ValueError("models that mix sliding-window and full-attention layers "
                             f"(layer_types {sorted(set(layer_types))}) are not supported yet")
        self.vocab_size = config.vocab_size

        def w(name: str) -> torch.Tensor:
            return state[name].to(dtype=dtype, device=device).contiguous()

        def wt(name: str) -> torch.Tensor:
            # Projection weights are kept as [in, out]: x @ W streams the weight once per step
            # about twice as fast as F.linear's [out, in] for single-token decode on CPU (MKL).
            return state[name].to(dtype=dtype, device=device).t().contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in state else None

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in state and not config.tie_word_embeddings else "model.embed_tokens.weight"
        pack = packing_available(device, dtype)
        self.lm_head = prepare(wt(head), pack)
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            L = LlamaLayer()
            L.ln_in = w(p + "input_layernorm.weight")
            L.ln_post = w(p + "post_attention_layernorm.weight")
            L.wqkv = prepare(torch.cat([wt(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 1), pack)
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            L.bqkv = torch.cat(biases).contiguous() if biases[0] is not None else None
            L.wo = prepare(wt(p + "self_attn.o_proj.weight"), pack)
            L.bo = opt(p + "self_attn.o_proj.bias")
            L.wgu = prepare(torch.cat([wt(p + "mlp.gate_proj.weight"), wt(p + "mlp.up_proj.weight")], 1), pack)
            gb, ub = opt(p + "mlp.gate_proj.bias"), opt(p + "mlp.up_proj.bias")
            L.bgu = torch.cat([gb, ub]).contiguous() if gb is not None else None
            L.wdown = prepare(wt(p + "mlp.down_proj.weight"), pack)
            L.bdown = opt(p + "mlp.down_proj.bias")
            self.layers.append(L)
        self.cos, self.sin = rope_tables(config, max_positions, dtype, device)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.inter = config.intermediate_size

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
                layer_hook=None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the last layer (before the final norm)."""
        x = F.embedding(token_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        T = token_ids.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.ln_in, self.eps)
            qkv = linear(h, L.wqkv, L.bqkv)
            # RoPE on q and k together: one set of elementwise ops over [T, H + KVH, D].
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(T, H + KVH, D), cos, sin)
            v = qkv[:, self.q_size + self.kv_size :]
            kc, vc = kv.layer_slots(i)
            a = paged_attention(qk[:, :H], qk[:, H:], v.view(T, KVH, D), kc, vc, meta)
            x = x + linear(a.reshape(T, H * D), L.wo, L.bo)
            h = rms_norm(x, L.ln_post, self.eps)
            gu = linear(h, L.wgu, L.bgu)
            x = x + linear(self.act(gu[:, : self.inter]) * gu[:, self.inter :], L.wdown, L.bdown)
            if layer_hook is not None:
                layer_hook(i)  # layer i's KV is in the cache: a prefill actor can ship it now
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(hidden, self.norm, self.eps), self.lm_head)
