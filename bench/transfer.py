"""`pdserve bench transfer`: KV transfer throughput and the TTFT cost of disaggregation, in one run.

Two measurements, on this machine, between Ray actors (so between processes, as in serving):

1. KV push throughput. A sender actor pushes whole requests' KV, ``open`` / ``send`` (layers
   grouped into pieces of about ``frame_bytes``, as the prefill worker does) / ``finish``, to a
   receiver actor whose sink lands every piece in the reserved blocks of a real ``KVCache`` of the
   model's KV geometry (by default SmolLM2-135M: 30 layers x 3 KV heads x 64, blocks of 16 tokens,
   float32), for a 512- and a 2048-token prompt, ``--rounds`` times each after at least
   ``warmup_s`` (1 s) of untimed pushes; reported: the median MB/s (1 MB = 10^6 bytes) of each transport
   in ``kv_transfer.TRANSPORTS``, against a plain TCP socket copy (``sendall`` / ``recv_into``) of the same
   bytes between the same two actors (warmed up alike), and their ratio. Beside each transport,
   one more row per size is the ceiling of the library under it. ``bare-grpcio``: a grpcio
   client stream of the same bytes in as many messages as the transport's frames, built before
   the clock starts, with the transport's channel options, into a receiver that drops each
   message. ``bare-gloo``: a plain two-rank gloo group sending the same bytes in as many sends as
   the collective transport (the keys and the values of each piece), into receives posted
   beforehand, until a one-byte acknowledgement. Neither has a header, a checksum or a landing
   copy: the gap between a transport's row and its ceiling is what the transport's own work
   (control messages, checksums, landing into the reserved blocks, threads) costs.
2. Time to first token under light load, one request at a time, the same prompts both ways:
   colocated (``add_request`` on a colocated worker, until its first delta arrives through
   ``next_outputs``) and disaggregated (``reserve_kv`` on a decode actor, then ``prefill`` on a
   prefill actor, which returns token #1). Both use the same chunk budget (512 tokens per step).
   Reported: medians over ``--rounds`` prompts per length, the overhead in percent of those
   medians, the median of the per-prompt overheads (``paired``: each prompt's two runs are back to
   back, so it cancels the machine's slow drift between prompts), and the decode side's
   ``kv_stream_s`` (from the stream's opening to its last frame: it spans the prefill
   itself, since KV is pushed as layers are computed). The runs alternate (colocated,
   disaggregated, colocated, ...) so that machine noise hits both alike.

The measurements run on a fresh local Ray started here (never an existing cluster), with every
actor on this machine: they measure the transports and the actors' overhead, not a network.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import socket
import statistics
import struct
import threading
import time

import torch

from pdserve.bench.common import Table, local_ray, machine, max_positions, now
from pdserve.engine.memory import describe_peak
from pdserve.kv_transfer import TRANSPORTS, make_sender, new_cluster_secret, start_receiver
from pdserve.kv_transfer.base import DEFAULT_FRAME_BYTES

# The transports measured, in order, are ``kv_transfer.TRANSPORTS``: both ends are built by name
# (``make_sender``, ``start_receiver``).

FULL = dict(prompt_tokens=(512, 2048), rounds=9, warmup_s=1.0)
# ``warmup_s``: untimed pushes before the timed ones, per transport and size, for at least this
# long. The first second or so of a fresh pair of actors is slower for every transport (Ray is
# still settling, the connections' flow-control windows grow): with a single warm-up push the
# ratio measured start-up, not the transport (BENCHMARKS.md, the measurements behind the defaults).
QUICK = dict(prompt_tokens=(32, 64), rounds=2, warmup_s=0.1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (__doc__ or "").split("\n\n")[0]
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each engine actor (default 2)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help=f"pushes per prompt size, and TTFT prompts per length (default {FULL['rounds']}; "
                        f"{QUICK['rounds']} with --quick)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=None, metavar="N",
                   help="prompt lengths (default 512 2048; 32 64 with --quick)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), metavar="NAMES",
                   help=f"comma-separated transports to measure (default {','.join(TRANSPORTS)})")
    p.add_argument("--frame-bytes", type=int, default=DEFAULT_FRAME_BYTES, metavar="BYTES",
                   help="pieces group layers up to about this size, as the prefill worker does "
                        f"(default {DEFAULT_FRAME_BYTES >> 20} MiB, the prefill worker's)")
    p.add_argument("--kv-push", choices=["layer", "chunk"], default=None,
                   help="when the prefill worker of the TTFT part pushes a chunk's KV: as its layers are "
                        "computed, or once the chunk is (default: the prefill worker's)")
    p.add_argument("--no-ttft", action="store_true", help="measure the transfer only")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: a smoke test of the benchmark itself, not a measurement")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.transports.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown:
        print(f"pdserve: error: unknown transport(s) {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
        return 2
    result = run_bench(model=args.model, threads=args.threads, rounds=args.rounds, prompt_tokens=args.prompt_tokens,
                       transports=names, frame_bytes=args.frame_bytes, ttft=not args.no_ttft, quick=args.quick,
                       kv_push=args.kv_push)
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0


# ---- KV geometry ---------------------------------------------------------------------------------


def kv_geometry(hf_config, block_size: int = 16, dtype: torch.dtype = torch.float32) -> dict:
    """Layers, KV heads and head size of a Hugging Face config (Llama family or GPT-2)."""
    c = hf_config
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
            "dtype": str(dtype).removeprefix("torch.")}


def bytes_per_token(geo: dict) -> int:
    return 2 * geo["num_layers"] * geo["num_kv_heads"] * geo["head_dim"] * torch.finfo(getattr(torch, geo["dtype"])).bits // 8


# ---- the two transfer actors ---------------------------------------------------------------------


class BenchSink:
    """A ``KVSink`` over a real ``KVCache``: writes land in reserved blocks, completion checks that
    every (layer, block) arrived, and then frees the blocks for the next round."""

    def __init__(self, geo: dict, num_blocks: int) -> None:
        from pdserve.engine.block_allocator import BlockAllocator
        from pdserve.engine.kv_cache import KVCache

        self.kv = KVCache(geo["num_layers"], num_blocks, geo["block_size"], geo["num_kv_heads"], geo["head_dim"],
                          getattr(torch, geo["dtype"]))
        self.allocator = BlockAllocator(num_blocks)
        self.reserved: dict[str, list[int]] = {}
        self.pieces: dict[str, int] = {}
        self.done: dict[str, str | None] = {}  # request id -> None (complete) or the error
        self.lock = threading.Lock()

    def reserve(self, request_id: str, num_blocks: int) -> list[int]:
        with self.lock:
            ids = self.allocator.allocate(num_blocks)
            self.reserved[request_id] = ids
            self.pieces[request_id] = 0
            return ids

    def write_kv(self, request_id: str, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        owned = self.reserved[request_id]  # KeyError: unknown request
        if not set(block_ids) <= set(owned):
            raise ValueError(f"blocks not reserved for {request_id}")
        self.kv.import_blocks(block_ids, layers, data)
        with self.lock:
            self.pieces[request_id] += len(layers) * len(block_ids)

    def _end(self, request_id: str, error: str | None) -> None:
        with self.lock:
            ids = self.reserved.pop(request_id, None)
            if ids is not None:
                self.allocator.free(ids)
            self.done[request_id] = error

    def complete_kv(self, request_id: str, first_token: int, first_logprob, transfer_s: float) -> None:
        want = self.kv.num_layers * len(self.reserved[request_id])
        if self.pieces[request_id] != want:
            raise ValueError(f"incomplete KV for {request_id}: {self.pieces[request_id]} of {want}")
        self._end(request_id, None)

    def fail_kv(self, request_id: str, error: str) -> None:
        self._end(request_id, error)


class TransferReceiver:
    """Receiver actor: one receiver per transport into one ``BenchSink``, and a raw TCP server that
    reads length-prefixed messages into a preallocated buffer and acknowledges each with one byte."""

    def __init__(self, geo: dict, num_blocks: int, transports: list[str], max_bytes: int, secret: bytes) -> None:
        torch.set_num_threads(1)
        self.sink = BenchSink(geo, num_blocks)
        host = "127.0.0.1"
        self.receivers = {}
        for name in transports:
            self.receivers[name] = start_receiver(self.sink, name, host=host, secret=secret)
        self._buf = bytearray(max_bytes)
        self._server = socket.create_server((host, 0))
        threading.Thread(target=self._serve_tcp, daemon=True).start()
        self._bare = _bare_grpc_server(host)

    def addresses(self) -> dict:
        return {"tcp": "%s:%d" % self._server.getsockname()[:2], BARE_GRPC: self._bare[1],
                **{name: r.address for name, r in self.receivers.items()}}

    def bare_gloo_open(self) -> str:
        """Host a rendezvous store for a plain two-rank gloo group (this actor rank 0) and start
        joining it; returns the store's address for the sender."""
        import torch.distributed as dist

        host = self._server.getsockname()[0]
        self._gloo_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=60))
        self._gloo: dict = {}

        def join() -> None:
            self._gloo["pg"] = dist.ProcessGroupGloo(self._gloo_store, 0, 2, datetime.timedelta(seconds=60))

        self._gloo_join = threading.Thread(target=join, daemon=True)
        self._gloo_join.start()
        return f"{host}:{self._gloo_store.port}"

    def bare_gloo_arm(self, sizes: list[int]) -> None:
        """Post one receive per size (tags 0, 1, ...) into a preallocated buffer, and a thread that
        answers with a one-byte send (tag ``len(sizes)``) once all of them completed."""
        self._gloo_join.join(60)
        pg = self._gloo["pg"]
        if self._gloo.get("buf") is None or self._gloo["buf"].numel() < sum(sizes):
            self._gloo["buf"] = torch.empty(sum(sizes), dtype=torch.uint8)
        buf, at, works = self._gloo["buf"], 0, []
        for tag, n in enumerate(sizes):
            works.append(pg.recv([buf[at:at + n]], 1, tag))
            at += n

        def ack() -> None:
            for w in works:
                w.wait(datetime.timedelta(seconds=60))
            pg.send([torch.ones(1, dtype=torch.uint8)], 1, len(sizes)).wait(datetime.timedelta(seconds=60))

        threading.Thread(target=ack, daemon=True).start()

    def reserve(self, request_id: str, num_blocks: int) -> list[int]:
        return self.sink.reserve(request_id, num_blocks)

    def outcome(self, request_id: str):
        """``(finished, error)`` of a request's transfer."""
        with self.sink.lock:
            return request_id in self.sink.done, self.sink.done.get(request_id)

    def _serve_tcp(self) -> None:
        while True:
            conn, _ = self._server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read_tcp, args=(conn,), daemon=True).start()

    def _read_tcp(self, conn: socket.socket) -> None:
        view = memoryview(self._buf)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                (n,) = struct.unpack("!Q", head)
                got = 0
                while got < n:
                    k = conn.recv_into(view[got:n])
                    if k == 0:
                        return
                    got += k
                conn.sendall(b"k")


BARE_GRPC = "bare-grpcio"  # the library's ceiling row (not a transport: nothing is checked or landed)
BARE_GLOO = "bare-gloo"  # the same for the collective transport on CPU: torch's gloo alone
# The ceiling row measured beside each transport (only when that transport is measured).
CEILINGS = {"grpc": BARE_GRPC, "collective": BARE_GLOO}
_BARE_METHOD = "/pdserve.bench.Bare/Push"


def _bare_grpc_server(host: str):
    """A grpcio server whose one method takes a client stream of raw-bytes messages, drops each,
    and answers with the number of bytes it took (as text)."""
    from concurrent import futures

    import grpc

    from pdserve.kv_transfer.grpc_transport import CHANNEL_OPTIONS

    def push(request_iterator, context):
        return str(sum(len(m) for m in request_iterator)).encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.bench.Bare", {"Push": handler}),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"


def _timed(once, rounds: int, warmup_s: float) -> tuple[list[float], int]:
    """Call ``once()`` (it returns the seconds it measured) until ``rounds`` calls are timed: the
    first calls, at least one and for at least ``warmup_s``, are not. Returns the timed seconds and
    how many calls warmed up."""
    warm_until = time.perf_counter() + warmup_s
    seconds: list[float] = []
    calls = 0
    while len(seconds) < rounds:
        elapsed = once()
        calls += 1
        if calls > 1 and time.perf_counter() >= warm_until:
            seconds.append(elapsed)
    return seconds, calls - rounds


def _pieces(num_layers: int, per_layer: int, frame_bytes: int) -> list[range]:
    """Layer ranges of about ``frame_bytes`` each (at least one layer), as the prefill worker groups them."""
    group = max(1, min(num_layers, frame_bytes // per_layer))
    return [range(lo, min(num_layers, lo + group)) for lo in range(0, num_layers, group)]


class TransferSender:
    """Sender actor: pushes whole requests' KV over a transport, or the same bytes over TCP."""

    def __init__(self, geo: dict, secret: bytes) -> None:
        torch.set_num_threads(1)
        self.geo = geo
        self.secret = secret
        self.senders: dict = {}

    def _data(self, num_blocks: int) -> torch.Tensor:
        g = self.geo
        shape = (2, g["num_layers"], num_blocks, g["block_size"], g["num_kv_heads"], g["head_dim"])
        return torch.randn(shape, generator=torch.Generator().manual_seed(num_blocks)).to(getattr(torch, g["dtype"]))

    def push(self, transport: str, address: str, receiver, num_blocks: int, rounds: int, frame_bytes: int,
             warmup_s: float) -> dict:
        """Time ``rounds`` whole-request pushes (after ``warmup_s`` of untimed ones); every one must succeed."""
        import ray

        if transport not in self.senders:
            self.senders[transport] = make_sender(transport, secret=self.secret)
        sender = self.senders[transport]
        data = self._data(num_blocks)
        num_layers = data.shape[1]
        pieces = _pieces(num_layers, data[:, :1].numel() * data.element_size(), frame_bytes)
        nbytes = 0

        def once() -> float:
            nonlocal nbytes
            rid = f"bench-{transport}-{num_blocks}-{time.monotonic_ns()}"
            blocks = ray.get(receiver.reserve.remote(rid, num_blocks))
            start = time.perf_counter()
            t = sender.open(rid, address, num_layers, num_blocks, timeout_s=120)
            for layers in pieces:
                t.send(layers, blocks, data[:, layers.start:layers.stop])
            nbytes = t.finish(0)
            elapsed = time.perf_counter() - start
            done, error = ray.get(receiver.outcome.remote(rid))
            if not done or error:
                raise RuntimeError(f"transfer {rid} was not verified by the receiver: {error}")
            return elapsed

        seconds, warmup = _timed(once, rounds, warmup_s)
        return {"bytes": nbytes, "pieces": len(pieces), "seconds": seconds, "warmup_pushes": warmup}

    def tcp(self, address: str, num_blocks: int, rounds: int, warmup_s: float) -> dict:
        """Time ``rounds`` copies of the same bytes over one TCP connection (after ``warmup_s`` of untimed ones)."""
        data = self._data(num_blocks)
        raw = memoryview(data.view(torch.uint8).numpy()).cast("B")
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def once() -> float:
                start = time.perf_counter()
                s.sendall(struct.pack("!Q", len(raw)))
                s.sendall(raw)
                if s.recv(1) != b"k":
                    raise RuntimeError("the TCP receiver went away")
                return time.perf_counter() - start

            seconds, _ = _timed(once, rounds, warmup_s)
        return {"bytes": len(raw), "seconds": seconds}

    def bare_grpc(self, address: str, num_blocks: int, frame_bytes: int, rounds: int, warmup_s: float) -> dict:
        """Time ``rounds`` grpcio client streams of the same bytes, in as many messages as the
        transport's pieces, built beforehand, over a channel with the gRPC transport's options."""
        import grpc

        from pdserve.kv_transfer.grpc_transport import CHANNEL_OPTIONS, SENDER_OPTIONS
        from pdserve.kv_transfer.wire import tensor_to_bytes

        data = self._data(num_blocks)
        messages = [tensor_to_bytes(data[:, layers.start:layers.stop])
                    for layers in _pieces(data.shape[1], data[:, :1].numel() * data.element_size(), frame_bytes)]
        total = sum(len(m) for m in messages)
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS + SENDER_OPTIONS) as channel:
            call = channel.stream_unary(_BARE_METHOD, request_serializer=None, response_deserializer=None)

            def once() -> float:
                start = time.perf_counter()
                got = int(call(iter(messages), timeout=120))
                elapsed = time.perf_counter() - start
                if got != total:
                    raise RuntimeError(f"the bare gRPC receiver took {got} of {total} bytes")
                return elapsed

            seconds, warmup = _timed(once, rounds, warmup_s)
        return {"bytes": total, "pieces": len(messages), "seconds": seconds, "warmup_pushes": warmup}

    def bare_gloo(self, store: str, receiver, num_blocks: int, frame_bytes: int, rounds: int, warmup_s: float) -> dict:
        """Time ``rounds`` pushes of the same bytes over a plain two-rank gloo group, in as many
        sends as the collective transport makes (the keys and the values of each piece), straight
        from the data, into receives posted beforehand (untimed, by a Ray call), until the
        receiver's one-byte acknowledgement arrives: no header, checksum or landing."""
        import ray
        import torch.distributed as dist

        if getattr(self, "_gloo_pg", None) is None:  # one group for every size: the receiver joins it once
            host, port = store.rsplit(":", 1)
            tcp_store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
            self._gloo_pg = dist.ProcessGroupGloo(tcp_store, 1, 2, datetime.timedelta(seconds=60))
        pg = self._gloo_pg
        data = self._data(num_blocks)
        halves = [data[k, layers.start:layers.stop]
                  for layers in _pieces(data.shape[1], data[:, :1].numel() * data.element_size(), frame_bytes)
                  for k in (0, 1)]
        sizes = [h.numel() * h.element_size() for h in halves]
        ack = torch.zeros(1, dtype=torch.uint8)
        timeout = datetime.timedelta(seconds=60)

        def once() -> float:
            ray.get(receiver.bare_gloo_arm.remote(sizes))
            start = time.perf_counter()
            works = [pg.send([h.reshape(-1).view(torch.uint8)], 0, tag) for tag, h in enumerate(halves)]
            done = pg.recv([ack], 0, len(halves))
            for w in works:
                w.wait(timeout)
            done.wait(timeout)
            return time.perf_counter() - start

        seconds, warmup = _timed(once, rounds, warmup_s)
        return {"bytes": sum(sizes), "pieces": len(halves) // 2, "seconds": seconds, "warmup_pushes": warmup}

    def close(self) -> None:
        for s in self.senders.values():
            s.close()


def measure_transfer(ray, geo: dict, prompt_tokens: list[int], transports: list[str], rounds: int,
                     frame_bytes: int, warmup_s: float) -> list[dict]:
    bs = geo["block_size"]
    max_blocks = max(-(-n // bs) for n in prompt_tokens)
    max_bytes = max_blocks * bs * bytes_per_token(geo)
    secret = new_cluster_secret()  # both ends sign and check every stream and frame, as in serving
    receiver = ray.remote(TransferReceiver).options(num_cpus=0, max_concurrency=8).remote(
        geo, 2 * max_blocks + 4, transports, max_bytes, secret)
    sender = ray.remote(TransferSender).options(num_cpus=0).remote(geo, secret)
    rows = []
    gloo_store = None  # the bare-gloo group's store, set up at its first row
    try:
        addresses = ray.get(receiver.addresses.remote())
        for n in prompt_tokens:
            nb = -(-n // bs)
            tcp = ray.get(sender.tcp.remote(addresses["tcp"], nb, rounds, warmup_s))
            tcp_rate = tcp["bytes"] / statistics.median(tcp["seconds"]) / 1e6
            # A ceiling row (the transport's library alone) is measured only beside its transport.
            for name in transports + [CEILINGS[t] for t in transports if t in CEILINGS]:
                if name == BARE_GRPC:
                    r = ray.get(sender.bare_grpc.remote(addresses[name], nb, frame_bytes, rounds, warmup_s))
                elif name == BARE_GLOO:
                    if gloo_store is None:
                        gloo_store = ray.get(receiver.bare_gloo_open.remote())
                    r = ray.get(sender.bare_gloo.remote(gloo_store, receiver, nb, frame_bytes, rounds, warmup_s))
                else:
                    r = ray.get(sender.push.remote(name, addresses[name], receiver, nb, rounds, frame_bytes, warmup_s))
                assert r["bytes"] == tcp["bytes"]
                rate = r["bytes"] / statistics.median(r["seconds"]) / 1e6
                rows.append({"transport": name, "prompt_tokens": n, "bytes": r["bytes"], "pieces": r["pieces"],
                             "median_s": round(statistics.median(r["seconds"]), 6), "mb_per_s": round(rate, 1),
                             "raw_tcp_mb_per_s": round(tcp_rate, 1), "ratio_to_raw_tcp": round(rate / tcp_rate, 3),
                             "warmup_pushes": r["warmup_pushes"]})
        ray.get(sender.close.remote())
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    return rows


# ---- time to first token -------------------------------------------------------------------------


def measure_ttft(ray, model: str, threads: int, geo: dict, prompt_tokens: list[int], rounds: int,
                 vocab_size: int, peaks: dict | None = None, kv_push: str | None = None) -> list[dict]:
    """TTFT rows; ``peaks`` (if given) gets each worker actor's peak memory (``WorkerStats``)."""
    from pdserve.decode_worker.messages import WorkerRequest
    from pdserve.decode_worker.worker import WorkerConfig, start_workers
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.prefill_worker.worker import KVDestination, PrefillConfig, start_prefill_workers

    bs = geo["block_size"]
    num_blocks = 2 * -(-max(prompt_tokens) // bs) + 8

    def engine() -> EngineConfig:
        return EngineConfig(model=model, threads=threads, block_size=bs, num_blocks=num_blocks, show_progress=False)

    tag = f"pdserve-bench-transfer-{os.getpid()}"
    secret = new_cluster_secret()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # loading the model is most of a start
        starts = [
            pool.submit(start_workers, WorkerConfig(engine=engine()), 1, num_cpus=0, name_prefix=f"{tag}-colocated"),
            pool.submit(start_workers, WorkerConfig(engine=engine(), cluster_secret=secret), 1, num_cpus=0,
                        role="decode", name_prefix=f"{tag}-decode"),
            pool.submit(start_prefill_workers, PrefillConfig(engine=engine(), cluster_secret=secret,
                                                             **({"kv_push": kv_push} if kv_push else {})),
                        1, num_cpus=0,
                        name_prefix=f"{tag}-prefill"),
        ]
        (colocated,), (decode,), (prefill,) = [f.result() for f in starts]
    address = ray.get(decode.kv_address.remote())
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def final_of(actor, rid: str):
        deadline = time.time() + 300
        while time.time() < deadline:
            for d in ray.get(actor.next_outputs.remote(1.0)):
                if d.request_id == rid and d.finish_reason is not None:
                    if d.error:
                        raise RuntimeError(f"request {rid} failed: {d.error}")
                    return d
        raise RuntimeError(f"request {rid} did not finish")

    def ttft_colocated(rid: str, prompt: list[int]) -> float:
        start = time.perf_counter()
        ray.get(colocated.add_request.remote(WorkerRequest(rid, prompt, params, time.time())))
        final_of(colocated, rid)  # max_tokens=1: the first delta is the final one
        return time.perf_counter() - start

    def ttft_disaggregated(rid: str, prompt: list[int]) -> tuple[float, float]:
        """Seconds to token #1, and the decode side's KV stream seconds."""
        req = WorkerRequest(rid, prompt, params, time.time())
        start = time.perf_counter()
        blocks = ray.get(decode.reserve_kv.remote(req))
        ray.get(prefill.prefill.remote(req, KVDestination(address, blocks)))
        elapsed = time.perf_counter() - start
        final = final_of(decode, rid)  # the KV arrived and the decode side finished (out of the timing)
        return elapsed, final.timings.get("transfer", 0.0)

    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        low = min(100, vocab_size // 4)
        warm = torch.randint(low, vocab_size, (min(prompt_tokens),), generator=g).tolist()
        ttft_colocated("warmup-c", warm)
        ttft_disaggregated("warmup-d", warm)
        for n in prompt_tokens:
            coloc, disagg, stream = [], [], []
            for r in range(rounds):
                prompt = torch.randint(low, vocab_size, (n,), generator=g).tolist()
                coloc.append(ttft_colocated(f"c-{n}-{r}", prompt))
                t, x = ttft_disaggregated(f"d-{n}-{r}", prompt)
                disagg.append(t)
                stream.append(x)
            c, d = statistics.median(coloc), statistics.median(disagg)
            paired = statistics.median((y - x) / x for x, y in zip(coloc, disagg))
            rows.append({"prompt_tokens": n, "prompts": rounds, "colocated_s": round(c, 6),
                         "disaggregated_s": round(d, 6), "overhead_pct": round(100 * (d - c) / c, 1),
                         "paired_overhead_pct": round(100 * paired, 1),
                         "colocated_each_s": [round(x, 6) for x in coloc], "disaggregated_each_s": [round(x, 6) for x in disagg],
                         "kv_stream_s": round(statistics.median(stream), 6)})
        if peaks is not None:
            for role, a in (("colocated", colocated), ("decode", decode), ("prefill", prefill)):
                s = ray.get(a.stats.remote())
                peaks[role] = {"device": s.device, "bytes": s.peak_memory_bytes}
    finally:
        for a in (colocated, decode, prefill):
            ray.kill(a)
    return rows


# ---- the run -------------------------------------------------------------------------------------


def run_bench(model: str = "default", threads: int = 2, rounds: int | None = None,
              prompt_tokens: list[int] | None = None, transports: list[str] | None = None,
              frame_bytes: int = DEFAULT_FRAME_BYTES, ttft: bool = True, quick: bool = False,
              kv_push: str | None = None) -> dict:
    """Measure the transfer (and, with ``ttft``, the TTFT) on a fresh local Ray, or on the one this
    process runs; return every figure."""
    from pdserve.engine.model_loader import load_config, resolve_model_dir

    shape = QUICK if quick else FULL
    rounds = rounds or shape["rounds"]
    prompt_tokens = list(prompt_tokens or shape["prompt_tokens"])
    transports = list(transports or TRANSPORTS)
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    geo = kv_geometry(cfg)
    limit = max_positions(cfg)
    if limit and max(prompt_tokens) + 1 > limit:
        raise SystemExit(f"pdserve: error: a {max(prompt_tokens)}-token prompt does not fit the model's {limit} positions")

    with local_ray(num_cpus=max(2, os.cpu_count() or 2)) as ray:
        transfer_rows = measure_transfer(ray, geo, prompt_tokens, transports, rounds, frame_bytes, shape["warmup_s"])
        peaks: dict = {}
        ttft_rows = (measure_ttft(ray, str(model_dir), threads, geo, prompt_tokens, rounds, cfg.vocab_size, peaks,
                                  kv_push) if ttft else [])
    return {
        "bench": "transfer",
        "date": now(),
        "machine": machine(),
        "model": model_dir.name,
        "threads": threads,
        "rounds": rounds,
        "quick": quick,
        "kv_geometry": {**geo, "bytes_per_token": bytes_per_token(geo)},
        "frame_bytes": frame_bytes,
        "warmup_s": shape["warmup_s"],
        "transfer": transfer_rows,
        "ttft": ttft_rows,
        "kv_push": (kv_push or _default_kv_push()) if ttft else None,
        "peak_memory": peaks,  # per worker actor of the TTFT runs
    }


def _default_kv_push() -> str:
    from pdserve.prefill_worker.worker import PrefillConfig

    return PrefillConfig.kv_push


def format_table(r: dict) -> str:
    g = r["kv_geometry"]
    push = Table([30, 8, 9, 8, 10, 14, 8])
    lines = [
        f"pdserve bench transfer: model {r['model']} ({g['num_layers']} layers x {g['num_kv_heads']} KV heads x "
        f"{g['head_dim']}, {g['dtype']}, {g['bytes_per_token']} KV bytes per token), median of {r['rounds']} rounds",
        f"{r['date']}, {r['machine']}",
        "",
        push.row("KV push between two actors", "prompt", "MB", "pieces", "MB/s", "raw TCP MB/s", "ratio"),
    ]
    for row in r["transfer"]:
        lines.append(push.row(row["transport"], str(row["prompt_tokens"]), f"{row['bytes'] / 1e6:.1f}",
                              str(row["pieces"]), f"{row['mb_per_s']:.1f}", f"{row['raw_tcp_mb_per_s']:.1f}",
                              f"{row['ratio_to_raw_tcp']:.3f}"))
    if any(row["transport"] == BARE_GRPC for row in r["transfer"]):
        lines.append(f"({BARE_GRPC}: grpcio alone, the same bytes in as many messages, built beforehand and dropped on "
                     "arrival: no checksum, no landing; the ceiling of the grpc transport)")
    if any(row["transport"] == BARE_GLOO for row in r["transfer"]):
        lines.append(f"({BARE_GLOO}: torch's gloo alone, the same bytes in as many sends, into receives posted "
                     "beforehand, until a one-byte acknowledgement: no header, checksum or landing; the ceiling "
                     "of the collective transport on CPU)")
    if r["ttft"]:
        ttft = Table([30, 8, 13, 11, 10, 9, 13])
        lines += ["", f"TTFT, one request at a time (the prefill worker pushes KV by {r['kv_push']})",
                  ttft.row("", "prompt", "colocated s", "disagg. s", "overhead", "paired", "KV stream s")]
        for row in r["ttft"]:
            lines.append(ttft.row(f"median of {row['prompts']} prompts", str(row["prompt_tokens"]),
                                  f"{row['colocated_s']:.4f}", f"{row['disaggregated_s']:.4f}",
                                  f"{row['overhead_pct']:.1f}%", f"{row['paired_overhead_pct']:.1f}%",
                                  f"{row['kv_stream_s']:.4f}"))
    if r.get("peak_memory"):
        lines.append("peak memory per actor: " + ", ".join(
            f"{role} {describe_peak(m['bytes'], m['device'])}" for role, m in r["peak_memory"].items()))
    return "\n".join(lines)
