"""Fixtures of the transport suite: the transports under test, a recording KV sink, fault injection.

``TRANSPORTS`` is the parametrization: every test that takes the ``transport`` fixture runs once
per entry. Adding a transport is one line there (see ``TransportSpec``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import pytest
import torch

from kv_suite import SECRET, Faults, RecordingSink
from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink


@dataclass(frozen=True)
class TransportSpec:
    """How to build one transport's two ends: ``module.<sender>(**sender_kwargs)`` is its
    ``KVSender`` and ``module.<receiver>(sink, **receiver_kwargs)`` its ``KVReceiver``.

    Frame headers must be signed with ``auth.KVAuth.sign`` (``faults`` renumbers them there to
    drop or reorder frames). Both ends get the suite's cluster secret (``kv_suite.SECRET``). With ``data_in_frames`` the tensor bytes travel inside the frames,
    built by ``wire.encode_piece`` looked up in ``module``'s globals, where ``faults`` flips a byte
    after the CRC; otherwise ``faults`` corrupts the checksum in the header.
    """

    module: str
    sender: str
    receiver: str
    sender_kwargs: dict = field(default_factory=dict)
    receiver_kwargs: dict = field(default_factory=dict)
    data_in_frames: bool = True


# Every transport passes the same suite: one line each.
TRANSPORTS: dict[str, TransportSpec] = {
    "grpc": TransportSpec("pdserve.kv_transfer.grpc_transport", "GrpcKVSender", "GrpcKVReceiver",
                          {"secret": SECRET}, {"secret": SECRET}),
    "collective": TransportSpec("pdserve.kv_transfer.collective_transport", "CollectiveKVSender", "CollectiveKVReceiver",
                                {"timeout_s": 10.0, "secret": SECRET}, {"timeout_s": 10.0, "secret": SECRET},
                                data_in_frames=False),
}


class TransportPair(NamedTuple):
    """What the ``transport`` fixture yields: a sender, and a factory of receivers for a sink.

    Receivers made by ``make_receiver`` are stopped after the test; the sender is closed."""

    sender: KVSender
    make_receiver: Callable[[KVSink], KVReceiver]
    name: str
    module: object
    spec: TransportSpec


@pytest.fixture(params=list(TRANSPORTS))
def transport(request):
    spec = TRANSPORTS[request.param]
    module = importlib.import_module(spec.module)
    receivers: list[KVReceiver] = []

    def make_receiver(sink: KVSink) -> KVReceiver:
        r = getattr(module, spec.receiver)(sink, **spec.receiver_kwargs)
        receivers.append(r)
        return r

    sender = getattr(module, spec.sender)(**spec.sender_kwargs)
    yield TransportPair(sender, make_receiver, request.param, module, spec)
    sender.close()
    for r in receivers:
        r.stop()


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def faults(transport, monkeypatch) -> Faults:
    return Faults(transport.module, TRANSPORTS[transport.name].data_in_frames, monkeypatch)


# ---- the real decode side: an EngineLoop over a tiny random Llama ---------------------------------


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, 2 KV heads of 16) saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture
def decode_loop(tiny_llama_dir):
    """Factory: ``decode_loop(kv_lease_s=30.0, kv_reserve_timeout_s=300.0)`` -> a started decode-role ``EngineLoop`` (block
    size 4, 64 blocks), stopped after the test."""
    from pdserve.decode_worker.worker import EngineLoop, WorkerConfig
    from pdserve.engine.config import EngineConfig

    loops = []
    before = torch.get_num_threads()

    def make(kv_lease_s: float = 30.0, kv_reserve_timeout_s: float = 300.0) -> EngineLoop:
        engine = EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=64, threads=1, show_progress=False)
        loop = EngineLoop(WorkerConfig(engine=engine, role="decode", kv_lease_s=kv_lease_s,
                                         kv_reserve_timeout_s=kv_reserve_timeout_s))
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with four CPUs (reused when another fixture of the session started one)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()
