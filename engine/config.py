"""Engine configuration: one dataclass, every field a knob a user can set."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Where and how a worker runs its model.

    ``dtype="auto"`` is float32 on CPU and bfloat16 on CUDA. The KV pool is sized from
    ``kv_cache_bytes`` unless ``num_blocks`` is given. ``max_model_len`` defaults to the model's
    ``max_position_embeddings``.
    """

    model: str = "default"
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    num_blocks: int | None = None
    max_model_len: int | None = None
    show_progress: bool = True

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        return _DTYPES[self.dtype]
