"""Load a model into a worker, own its KV pool, and run one forward over a flat batch."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine import paged_decode
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.block_allocator import BlockAllocator, slot_ids
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import load_config, load_state_dict, resolve_model_dir
from pdserve.engine.models import build_model, named_parts

logger = logging.getLogger(__name__)


@dataclass
class BatchItem:
    """One sequence's share of a step.

    ``token_ids`` are fed at positions ``start_pos, start_pos + 1, ...``; ``block_table`` must
    already have room for them. With ``sample`` the logits after the last of them are returned.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True


def eos_token_ids(model_dir, config) -> set[int]:
    """The ids that end generation: generation_config's EOS (as HF generate uses), else config's."""
    ids = None
    try:
        from transformers import GenerationConfig

        ids = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except (OSError, ValueError):
        pass
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


class ModelRunner:
    """The mechanism that executes steps; it never decides what runs (schedulers do)."""

    def __init__(self, config: EngineConfig, model_dir=None, hf_config=None) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        self.dtype = config.torch_dtype()
        start = time.time()
        self.model_dir = model_dir if model_dir is not None else resolve_model_dir(config.model)
        self.hf_config = hf_config if hf_config is not None else load_config(self.model_dir)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or getattr(self.hf_config, "n_positions", 2048)
        self.max_model_len = min(config.max_model_len or limit, limit)
        state = load_state_dict(self.model_dir, show_progress=config.show_progress)
        self.model = build_model(self.hf_config, state, self.dtype, self.device, self.max_model_len)
        del state
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config)
        m = self.model
        per_block = KVCache.bytes_per_block(m.num_layers, config.block_size, m.num_kv_heads, m.head_dim, self.dtype)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // per_block)
        self.kv = KVCache(m.num_layers, num_blocks, config.block_size, m.num_kv_heads, m.head_dim, self.dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = config.block_size
        # Decode attention reads the pool in place where it can (CPU float32); see paged_decode.
        self.paged_decode = paged_decode.available(self.device, self.dtype)
        if self.paged_decode:
            paged_decode.set_threads(torch.get_num_threads())
        logger.info("model %s loaded in %.1f s; %d KV blocks of %d tokens (%.0f MiB); %s",
                    self.model_dir, time.time() - start, num_blocks, config.block_size,
                    num_blocks * per_block / 2**20, self.kernels())

    def kernels(self) -> str:
        """Which of the engine's CPU code paths this worker runs (for its start-up log line)."""
        from pdserve.engine import linear, prefill_attention, quantized

        if self.device.type != "cpu" or self.dtype != torch.float32:
            return f"torch ops on {self.device.type} ({str(self.dtype).removeprefix('torch.')})"
        found = [w for _, w in named_parts(self.model) if isinstance(w, linear.PackedWeight)]
        weights = list({id(w): w for w in found}.values())
        gemm = weights[0].backend if weights else "torch.matmul"
        quant = sum(w.quant is not None for w in weights)
        parts = [f"GEMM {gemm}",
                 f"quantized decode weights {quant}/{len(weights)}" if quant else
                 f"no quantized weights ({quantized.unavailable_reason() or 'not GGUF groups'})",
                 "prefill attention kernel" if prefill_attention.kernel() is not None else
                 f"prefill attention SDPA ({prefill_attention.unavailable_reason()})",
                 "paged decode kernel" if self.paged_decode else "decode attention SDPA"]
        return "CPU paths: " + ", ".join(parts)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.inference_mode()
    def execute(self, items: list[BatchItem], layer_hook=None) -> torch.Tensor:
        """Run one forward; return float32 logits ``[n, vocab]`` for the items with ``sample``, in order.

        ``layer_hook(i)``, when given, is called as soon as layer ``i``'s KV is in the cache."""
        if not items:
            return torch.empty(0, self.vocab_size)
        bs = self.block_size
        # Decode-first layout: single-token sampled items go in one batched attention call.
        order = sorted(range(len(items)), key=lambda i: 0 if len(items[i].token_ids) == 1 else 1)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_ctx: list[list[int]] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_runs: list[tuple[int, int, int, list[int]]] = []
        last_index: dict[int, int] = {}
        # A single decoding sequence gathers its (unpadded) context and uses SDPA, which beats the
        # kernel at batch 1; from two sequences on the kernel wins (bench engine, BENCHMARKS.md).
        use_kernel = self.paged_decode and sum(len(it.token_ids) == 1 for it in items) > 1
        for i in order:
            it = items[i]
            n = len(it.token_ids)
            end_pos = it.start_pos + n
            if end_pos > self.max_model_len:
                raise ValueError(f"position {end_pos - 1} is past the model's context of {self.max_model_len}")
            if -(-end_pos // bs) > len(it.block_table):
                raise ValueError(f"block table of {len(it.block_table)} blocks cannot hold {end_pos} tokens")
            bt = it.block_table
            start = len(tokens)
            tokens.extend(it.token_ids)
            positions.extend(range(it.start_pos, end_pos))
            if n == 1 and use_kernel:
                # The kernel takes the block table as it is: no per-token slot list to build.
                slots.extend(slot_ids(bt, bs, it.start_pos, end_pos))
                decode_tables.append(bt)
                decode_lens.append(end_pos)
            else:
                ctx = slot_ids(bt, bs, 0, end_pos)
                slots.extend(ctx[it.start_pos:])
                if n == 1:
                    decode_ctx.append(ctx)
                else:
                    prefill_runs.append((start, start + n, it.start_pos, ctx))
            last_index[i] = start + n - 1
        meta = AttentionMetadata.build(slots, decode_ctx, prefill_runs, self.device, self.model.sliding_window,
                                       decode_tables, decode_lens, bs)
        dev = self.device
        hidden = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            meta,
            layer_hook,
        )
        want = [last_index[i] for i in range(len(items)) if items[i].sample]
        if not want:
            return torch.empty(0, self.vocab_size)
        logits = self.model.logits(hidden[torch.tensor(want, dtype=torch.long, device=dev)])
        return logits.float()
