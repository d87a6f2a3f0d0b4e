"""Fixtures of the deployment tests: a local Ray (the tiny servable model is in tests/conftest.py)."""

from __future__ import annotations


import pytest


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with two CPUs (or the one another fixture of the session started)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, namespace="pdserve")
        started = True
    yield ray
    if started:
        ray.shutdown()
