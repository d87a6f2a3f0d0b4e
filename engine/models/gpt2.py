"""GPT-2 over a flat batch and a paged KV cache.

Learned position embeddings, pre-LayerNorm blocks, fused QKV (``c_attn``), the configured MLP
activation (``gelu_new``), tied output embeddings. transformers stores GPT-2's projections as
``Conv1D`` (``[in, out]``), the layout ``engine.linear`` takes, so they are used as they are
(packed for MKL on CPU float32); the output head is transposed once at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.linear import linear, packing_available, prepare


class GPT2Layer:
    __slots__ = ("ln1_w", "ln1_b", "wqkv", "bqkv", "wo", "bo", "ln2_w", "ln2_b", "wfc", "bfc", "wproj", "bproj")


class GPT2Model:
    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype, device, max_positions: int):
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        self.config = config
        self.num_layers = config.n_layer
        self.num_heads = self.num_kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.eps = config.layer_norm_epsilon
        self.act = ACT2FN[config.activation_function]
        self.sliding_window = None
        self.vocab_size = config.vocab_size
        self.scale = 1.0 / self.head_dim**0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        prefix = "transformer." if "transformer.wte.weight" in state else ""

        def w(name: str) -> torch.Tensor:
            return state[prefix + name].to(dtype=dtype, device=device).contiguous()

        pack = packing_available(device, dtype)

        self.wte = w("wte.weight")
        self.wpe = w("wpe.weight")
        self.lnf_w, self.lnf_b = w("ln_f.weight"), w("ln_f.bias")
        untied = "lm_head.weight" in state and not getattr(config, "tie_word_embeddings", True)
        head = state["lm_head.weight"].to(dtype=dtype, device=device) if untied else self.wte
        self.lm_head = prepare(head.t().contiguous(), pack)  # [in, out], as the projections
        self.layers = []
        for i in range(self.num_layers):
            p = f"h.{i}."
            L = GPT2Layer()
            L.ln1_w, L.ln1_b = w(p + "ln_1.weight"), w(p + "ln_1.bias")
            L.wqkv, L.bqkv = prepare(w(p + "attn.c_attn.weight"), pack), w(p + "attn.c_attn.bias")
            L.wo, L.bo = prepare(w(p + "attn.c_proj.weight"), pack), w(p + "attn.c_proj.bias")
            L.ln2_w, L.ln2_b = w(p + "ln_2.weight"), w(p + "ln_2.bias")
            L.wfc, L.bfc = prepare(w(p + "mlp.c_fc.weight"), pack), w(p + "mlp.c_fc.bias")
            L.wproj, L.bproj = prepare(w(p + "mlp.c_proj.weight"), pack), w(p + "mlp.c_proj.bias")
            self.layers.append(L)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
                layer_hook=None) -> torch.Tensor:
        x = F.embedding(token_ids, self.wte) + F.embedding(positions, self.wpe)
        T = token_ids.shape[0]
        H, D = self.num_heads, self.head_dim
        width = H * D
        for i, L in enumerate(self.layers):
            h = F.layer_norm(x, (width,), L.ln1_w, L.ln1_b, self.eps)
            qkv = linear(h, L.wqkv, L.bqkv)
            q, k, v = qkv.split(width, dim=-1)
            kc, vc = kv.layer_slots(i)
            a = paged_attention(q.view(T, H, D), k.view(T, H, D), v.view(T, H, D), kc, vc, meta, scale=self.scale)
            x = x + linear(a.reshape(T, width), L.wo, L.bo)
            h = F.layer_norm(x, (width,), L.ln2_w, L.ln2_b, self.eps)
            x = x + linear(self.act(linear(h, L.wfc, L.bfc)), L.wproj, L.bproj)
            if layer_hook is not None:
                layer_hook(i)  # layer i's KV is in the cache: a prefill actor can ship it now
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(hidden, (hidden.shape[-1],), self.lnf_w, self.lnf_b, self.eps)
        return linear(h, self.lm_head)
