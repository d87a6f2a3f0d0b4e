"""One file per architecture; ``build_model`` picks the class from the config's architecture."""

from __future__ import annotations

from pdserve.engine.models.gpt2 import GPT2Model
from pdserve.engine.models.llama import LlamaModel

# model_type (from config.json) -> implementation
MODEL_CLASSES = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "gpt2": GPT2Model,
}


def build_model(config, state, dtype, device, max_positions: int):
    """Instantiate our forward pass for ``config``; a clear error for unsupported architectures."""
    model_type = getattr(config, "model_type", None)
    cls = MODEL_CLASSES.get(model_type)
    if cls is None:
        archs = getattr(config, "architectures", None) or [model_type]
        raise ValueError(
            f"unsupported architecture {archs} (model_type {model_type!r}); pdserve supports "
            f"model types: {', '.join(sorted(MODEL_CLASSES))} (Llama family incl. SmolLM2, Mistral, Qwen2; GPT-2)"
        )
    return cls(config, state, dtype, device, max_positions)


def named_parts(model) -> list[tuple[str, object]]:
    """``(name, value)`` of every attribute of ``model`` and of each of its layers (their slots):
    the weights in whatever form they are held, with the rest alongside."""
    parts = list(vars(model).items())
    parts += [(slot, getattr(layer, slot)) for layer in model.layers for slot in layer.__slots__]
    return parts
