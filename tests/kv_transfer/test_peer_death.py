"""A peer process that dies in the middle of a transfer, either way round.

- The decode process dies: the prefill side learns it from the broken connection, fails that
  transfer with a clear ``TransferError`` well before its deadline, and its next transfer, to a
  new decode process, arrives exact (the collective transport builds a new process group for it).
- The prefill process dies: the decode side ends the request and frees its blocks at once (not
  when the lease runs out), and goes on taking transfers.

Unlike the rest of the suite, the peer runs in a process of its own that is killed with SIGKILL,
so its sockets close the way a crashed actor's do. Each test runs once per transport.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from kv_suite import RecordingSink, bounded, random_kv
from pdserve.kv_transfer.base import TransferError, TransferState

NUM_LAYERS = 4
DEADLINE_S = 20.0  # the transfers' own deadline: a dead peer must be noticed well before it


class _StallingSink(RecordingSink):
    """Lands the first piece of a request, then holds every later one until the process dies: the
    transfer is mid-flight, with data on its way, when the test kills the process."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = threading.Event()

    def write_kv(self, request_id, layers, block_ids, data) -> None:
        if self.landed.is_set():
            threading.Event().wait()  # until the process is killed
        super().write_kv(request_id, layers, block_ids, data)
        self.landed.set()


def _serve(module: str, receiver_class: str, receiver_kwargs: dict, stall: bool, conn) -> None:
    """The decode process: a ``module.receiver_class`` receiver over a sink; answers the test's
    requests (``reserve``, ``landed``, ``outcome``) over ``conn``."""
    sink = _StallingSink() if stall else RecordingSink()
    receiver = getattr(importlib.import_module(module), receiver_class)(sink, **receiver_kwargs)
    conn.send(receiver.address)
    while True:
        op, *args = conn.recv()
        if op == "reserve":
            conn.send(sink.reserve(*args))
        elif op == "landed":
            conn.send(sink.wait(lambda: bool(sink.writes), timeout=args[0]))
        elif op == "outcome":
            rid, timeout = args
            sink.wait(lambda: rid in sink.completed or rid in sink.failed, timeout=timeout)
            with sink.lock:
                conn.send((sink.completed.get(rid), sink.failed.get(rid), sink.kv.export_blocks(
                    sink.reserved.get(rid, []), range(NUM_LAYERS)) if rid in sink.completed else None))


class _DecodeProcess:
    def __init__(self, spec, stall: bool) -> None:
        ctx = mp.get_context("spawn")  # a clean process: no copy of this one's threads or groups
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(spec.module, spec.receiver, spec.receiver_kwargs, stall, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the decode process did not start")
        self.address = self.conn.recv()

    def ask(self, *msg, timeout: float = 60.0):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the decode process did not answer {msg[0]!r}")
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.kill()


@pytest.fixture
def decode_process(transport):
    made: list[_DecodeProcess] = []

    def make(stall: bool = False) -> _DecodeProcess:
        made.append(_DecodeProcess(transport.spec, stall))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_decode_process_killed_mid_transfer_fails_it_fast_and_the_next_one_goes_through(transport, decode_process):
    doomed = decode_process(stall=True)
    dest = doomed.ask("reserve", "doomed", 6)
    data = random_kv(NUM_LAYERS, 6)
    t = transport.sender.open("doomed", doomed.address, NUM_LAYERS, 6, timeout_s=DEADLINE_S)
    for layer in range(NUM_LAYERS):  # the first piece lands, the rest are in flight or queued
        t.send(range(layer, layer + 1), dest, data[:, layer:layer + 1].clone())
    assert doomed.ask("landed", 10.0), "the first piece never landed"

    t0 = time.monotonic()
    doomed.kill()
    with pytest.raises(TransferError) as info:
        bounded(lambda: t.finish(7), DEADLINE_S + 10)
    elapsed = time.monotonic() - t0
    assert t.state is TransferState.FAILED
    assert "doomed" in str(info.value)
    assert elapsed < DEADLINE_S / 2, f"the dead peer was noticed only after {elapsed:.1f} s"

    # The same sender goes on: a new decode process gets the next request's KV exactly.
    fresh = decode_process()
    dest = fresh.ask("reserve", "next", 3)
    data = random_kv(NUM_LAYERS, 3, seed=1)
    t = transport.sender.open("next", fresh.address, NUM_LAYERS, 3, timeout_s=DEADLINE_S)
    t.send(range(0, NUM_LAYERS), dest, data.clone())
    bounded(lambda: t.finish(5), DEADLINE_S + 10)
    completed, failed, landed = fresh.ask("outcome", "next", 10.0)
    assert failed is None and completed == (5, None)
    assert torch.equal(landed, data)


def _push_then_hang(module: str, sender_class: str, sender_kwargs: dict, address: str, dest: list[int],
                    pieces: int, conn) -> None:
    """The prefill process: opens a transfer, sends ``pieces`` one-layer pieces, says so over
    ``conn``, and never finishes (until it is killed)."""
    sender = getattr(importlib.import_module(module), sender_class)(**sender_kwargs)
    data = random_kv(NUM_LAYERS, len(dest))
    t = sender.open("orphaned", address, NUM_LAYERS, len(dest), timeout_s=DEADLINE_S)
    for layer in range(pieces):
        t.send(range(layer, layer + 1), dest, data[:, layer:layer + 1].clone())
    conn.send("sent")
    threading.Event().wait()


def test_a_prefill_process_killed_mid_transfer_frees_the_blocks_at_once_and_the_next_one_goes_through(transport):
    sink = RecordingSink()
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("orphaned", 6)
    spec = transport.spec
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_push_then_hang, daemon=True,
                       args=(spec.module, spec.sender, spec.sender_kwargs, receiver.address, dest, 2, child))
    proc.start()
    try:
        assert conn.poll(120) and conn.recv() == "sent"
        assert sink.wait(lambda: len(sink.writes) >= 1, timeout=10), "no piece landed before the kill"
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert sink.wait(lambda: "orphaned" in sink.failed, timeout=DEADLINE_S), "the decode side never noticed"
        elapsed = time.monotonic() - t0
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert not sink.blocks_in_use("orphaned")
    assert elapsed < DEADLINE_S / 2, f"the dead peer was noticed only after {elapsed:.1f} s"

    # The receiver goes on: this process's sender gets the next request's KV through exactly.
    dest = sink.reserve("next", 3)
    data = random_kv(NUM_LAYERS, 3, seed=2)
    t = transport.sender.open("next", receiver.address, NUM_LAYERS, 3, timeout_s=DEADLINE_S)
    t.send(range(0, NUM_LAYERS), dest, data.clone())
    bounded(lambda: t.finish(9), DEADLINE_S + 10)
    assert sink.completed["next"] == (9, None)
    assert torch.equal(sink.kv.export_blocks(dest, range(NUM_LAYERS)), data)
