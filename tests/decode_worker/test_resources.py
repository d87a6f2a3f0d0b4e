"""Worker actors declare their resources, so Ray places them (and refuses to over-place them)."""

from __future__ import annotations

from pdserve.decode_worker.worker import DecodeWorker, WorkerConfig, start_workers
from pdserve.engine.config import EngineConfig


def test_workers_declare_their_cpus(ray_cluster, actors, tiny):
    ray = ray_cluster
    assert ray.cluster_resources().get("CPU") == 2
    assert ray.available_resources().get("CPU", 0) == 2, "an earlier test left an actor behind"
    config = EngineConfig(model=str(tiny.path), block_size=4, num_blocks=16, threads=1, show_progress=False)
    handles = start_workers(config, num_workers=2, num_cpus=1, name_prefix="test-resources")
    actors.extend(handles)
    assert ray.get([h.ready.remote() for h in handles]) == ["test-resources-0", "test-resources-1"]
    # both hold their CPU: nothing is left for a third worker declaring one
    assert ray.available_resources().get("CPU", 0) == 0
    # A third one (placed by hand: start_workers would wait for it) stays pending instead of
    # overcommitting the node; it is killed first, before a CPU could come free for it.
    third = ray.remote(DecodeWorker).options(num_cpus=1, name="test-resources-2").remote(
        WorkerConfig(engine=config), "test-resources-2")
    actors.insert(0, third)
    ready, not_ready = ray.wait([third.ready.remote()], timeout=1.0)
    assert not ready and not_ready
