"""Fixtures shared by every test folder: two torch threads (as in CI) and the default model."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # CI has two cores; more threads than cores only adds contention. Fixed here so that timings
    # and float reduction orders are the same in every test process.
    import torch

    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory, converted once."""
    from pdserve.engine.model_loader import resolve_model_dir

    return resolve_model_dir("default")
