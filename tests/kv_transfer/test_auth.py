"""The KV plane accepts only members of the cluster: every stream's opening and every frame carry
a MAC under the cluster secret (``kv_transfer.auth``), checked in the landing code that both
transports share.

Each test runs once per transport (the ``transport`` fixture). The forger here is anyone who can
reach a decode actor's KV port and speaks the wire format: it opens ``Push`` streams of its own
with whatever metadata and frames it likes. What it may know: the wrong secret, or everything a
member sent on the network (a captured stream opening, a captured frame), replayed elsewhere.
Every forgery is refused with a precise status (``UNAUTHENTICATED``: no MAC, or one that does not
verify; ``PERMISSION_DENIED``: a valid opening played again), writes nothing and releases nothing,
while a legitimate transfer running at the same time arrives bit-exact.
"""

from __future__ import annotations

import argparse
import struct
import threading
import time

import grpc
import pytest
import torch

from kv_suite import SECRET, RecordingSink, bounded, random_kv
from pdserve.internal import kv_transfer_pb2 as pb
from pdserve.kv_transfer import auth as kv_auth
from pdserve.kv_transfer.auth import MAC_KEY, NONCE_KEY, KVAuth
from pdserve.kv_transfer.grpc_transport import CHANNEL_OPTIONS, PUSH_METHOD
from pdserve.kv_transfer.landing import REQUEST_ID_KEY
from pdserve.kv_transfer.wire import FrameHeader, encode_piece, frame_message

NUM_LAYERS = 4
WRONG = KVAuth(bytes.fromhex("badd" * 16))  # a secret that is not the cluster's
MEMBER = KVAuth(SECRET)  # what a member of the cluster signs with
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


class Forger:
    """Opens raw ``Push`` streams to a receiver's control port, as anyone on the network can."""

    def __init__(self, address: str, data_in_frames: bool) -> None:
        self.data_in_frames = data_in_frames
        self.channel = grpc.insecure_channel(address.split("|")[0], options=CHANNEL_OPTIONS)
        self.push = self.channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                              response_deserializer=pb.PushAck.FromString)

    def send(self, messages: list[bytes], metadata=()) -> grpc.StatusCode:
        """The status the stream ends with (``OK`` for an acknowledgement, whatever it says)."""
        try:
            self.push(iter(messages), metadata=tuple(metadata), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def cancelled(self, messages: list[bytes], metadata=()) -> None:
        """A stream that opens, sends ``messages`` and is cancelled: how a sender releases."""
        gate = threading.Event()

        def requests():
            yield from messages
            gate.wait(5)

        fut = self.push.future(requests(), metadata=tuple(metadata), timeout=10)
        time.sleep(0.2)
        fut.cancel()
        gate.set()

    def frame(self, auth: KVAuth, nonce: bytes, rid: str, i: int, blocks: list[int], data: torch.Tensor,
              layers: range = range(0, 1), /, **change) -> bytes:
        """A data frame as a sender signs it, then (``change``) fields altered after signing."""
        header, parts = encode_piece(rid, i, layers, blocks, data)
        if not self.data_in_frames:  # the collective transport: a bare header, data over the group
            header.group, header.tag, parts = "g", 0, []
        auth.sign(header, nonce)
        for k, v in change.items():
            setattr(header, k, v)
        return frame_message(header, parts) if parts else header.pack()

    def close(self) -> None:
        self.channel.close()


def opening(auth: KVAuth, rid: str | None, nonce: bytes | None = None) -> tuple:
    """A stream's metadata: the request id and the opening's nonce and MAC under ``auth``."""
    nonce = nonce or auth.new_nonce()
    return (((REQUEST_ID_KEY, rid),) if rid is not None else ()) + auth.open_metadata(rid or "", nonce)


def join_frame(auth: KVAuth, nonce: bytes, group: str = "intruder-0") -> bytes:
    h = FrameHeader("", 0, join=True, group=group, store=group)
    auth.sign(h, nonce)
    return h.pack()


@pytest.fixture
def captured(monkeypatch):
    """Every stream opening a member's sender makes, as a wiretap sees it: ``(rid, metadata)``."""
    seen: list[tuple[str, tuple]] = []
    original = KVAuth.open_metadata

    def open_metadata(self, request_id, nonce):
        md = original(self, request_id, nonce)
        seen.append((request_id, (((REQUEST_ID_KEY, request_id),) if request_id else ()) + md))
        return md

    monkeypatch.setattr(KVAuth, "open_metadata", open_metadata)
    return seen


def nonce_of(metadata) -> bytes:
    return bytes.fromhex(dict(metadata)[NONCE_KEY])


def test_forgeries_from_outside_the_cluster_are_refused_while_a_legit_transfer_lands_bit_exact(
        transport, captured):
    sink = RecordingSink()
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("legit", 6)
    victim = sink.reserve("victim", 2)  # reserved, its transfer not opened yet
    data = random_kv(NUM_LAYERS, 6, seed=3)
    t = transport.sender.open("legit", receiver.address, NUM_LAYERS, 6, timeout_s=10)
    t.send(range(0, 1), dest, data[:, 0:1].clone())  # the legit stream is open and landing
    legit_md = next(md for rid, md in captured if rid == "legit")
    joins = [md for rid, md in captured if rid == ""]  # the collective's join, if any

    forger = Forger(receiver.address, transport.spec.data_in_frames)
    piece = random_kv(1, 2, seed=9)
    nonce = WRONG.new_nonce()
    results: dict[str, grpc.StatusCode] = {}

    def forge() -> None:
        # a first frame for the legit request's blocks, signed with the wrong secret
        results["wrong secret"] = forger.send([forger.frame(WRONG, nonce, "legit", 0, dest[:2], piece)],
                                              opening(WRONG, "legit", nonce))
        # the same into the victim's blocks
        n = WRONG.new_nonce()
        results["wrong secret, victim"] = forger.send([forger.frame(WRONG, n, "victim", 0, victim, piece)],
                                                      opening(WRONG, "victim", n))
        # no MAC at all
        results["no MAC"] = forger.send([forger.frame(WRONG, nonce, "legit", 0, dest[:2], piece)],
                                        ((REQUEST_ID_KEY, "legit"),))
        # a release: a stream for the request that ends, or is cancelled, before its last frame
        results["forged release"] = forger.send([], opening(WRONG, "victim"))
        forger.cancelled([], opening(WRONG, "legit"))
        forger.cancelled([], ((REQUEST_ID_KEY, "victim"), (NONCE_KEY, "00" * 24), (MAC_KEY, "00" * 32)))
        # the legit stream's captured opening, played again: with a frame it could have carried,
        # and as a bare release
        replay = forger.frame(MEMBER, nonce_of(legit_md), "legit", 0, dest[:2], piece)
        results["replayed opening"] = forger.send([replay], legit_md)
        results["replayed release"] = forger.send([], legit_md)
        # the captured opening relabelled for another request
        relabelled = tuple((k, "victim" if k == REQUEST_ID_KEY else v) for k, v in legit_md)
        results["opening for another request"] = forger.send([], relabelled)
        # a process-group join: wrong secret, no MAC, and a member's join played again
        n = WRONG.new_nonce()
        results["forged join"] = forger.send([join_frame(WRONG, n)], opening(WRONG, None, n))
        results["join without MAC"] = forger.send([join_frame(WRONG, n)])
        for k, md in enumerate(joins):
            results[f"replayed join {k}"] = forger.send([join_frame(MEMBER, nonce_of(md), "x")], md)

    groups_before = set(getattr(receiver, "_groups", {}))
    thread = threading.Thread(target=forge)
    thread.start()
    for layer in range(1, NUM_LAYERS):  # the legit transfer goes on meanwhile
        time.sleep(0.05)
        t.send(range(layer, layer + 1), dest, data[:, layer:layer + 1].clone())
    thread.join(30)
    assert not thread.is_alive()
    assert bounded(lambda: t.finish(11)) == data.numel() * data.element_size()
    forger.close()

    assert results.pop("replayed opening") == DENIED
    assert results.pop("replayed release") == DENIED
    for k in [k for k in results if k.startswith("replayed join")]:
        assert results.pop(k) == DENIED, k
    assert results == {k: UNAUTH for k in results}, results
    assert sink.completed["legit"] == (11, None)
    assert sink.kv.export_blocks(dest).equal(data)  # bit-exact
    assert not sink.failed  # nothing was released, for the legit request or the victim
    assert sink.blocks_in_use("victim") and not sink.kv.export_blocks(victim).any()
    assert {rid for rid, _, _ in sink.writes} == {"legit"}
    assert set(getattr(receiver, "_groups", {})) == groups_before  # no group joined or dropped


@pytest.mark.parametrize("change", ["another request", "other blocks", "another index", "another stream"])
def test_a_frame_with_a_valid_mac_replayed_elsewhere_is_refused(transport, captured, change):
    """A frame a member signed, moved into another place of a stream that did authenticate (as a
    man in the middle of a member's stream would): its MAC binds the request, the blocks, the index
    and the stream's nonce, so it is refused before it is written. That stream's own transfer fails
    (its blocks go back); another transfer running meanwhile is untouched."""
    sink = RecordingSink()
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("legit", 4)
    target = sink.reserve("target", 2)
    data = random_kv(NUM_LAYERS, 4, seed=5)
    t = transport.sender.open("legit", receiver.address, NUM_LAYERS, 4, timeout_s=10)
    t.send(range(0, 2), dest, data[:, 0:2].clone())

    forger = Forger(receiver.address, transport.spec.data_in_frames)
    piece = random_kv(1, 2, seed=9)
    legit_nonce = nonce_of(next(md for rid, md in captured if rid == "legit"))
    nonce = MEMBER.new_nonce()  # the target stream's own (fresh, authenticated) opening
    frame = {
        # the legit request's frame 0, signed for it, relabelled as the target's
        "another request": forger.frame(MEMBER, nonce, "legit", 0, target, piece, rid="target"),
        # a frame signed for the target's blocks, pointed at the legit request's blocks
        "other blocks": forger.frame(MEMBER, nonce, "target", 0, target, piece, blocks=dest[:2]),
        # the target's frame 1 presented as its frame 0
        "another index": forger.frame(MEMBER, nonce, "target", 1, target, piece, i=0),
        # a frame of the legit stream (its nonce), replayed into the target's stream
        "another stream": forger.frame(MEMBER, legit_nonce, "target", 0, target, piece),
    }[change]
    assert forger.send([frame], opening(MEMBER, "target", nonce)) == UNAUTH
    t.send(range(2, NUM_LAYERS), dest, data[:, 2:].clone())
    bounded(lambda: t.finish(5))
    forger.close()

    assert "MAC does not verify" in sink.failed["target"]
    assert not sink.blocks_in_use("target") and not sink.kv.export_blocks(target).any()
    assert {rid for rid, _, _ in sink.writes} == {"legit"}
    assert sink.completed["legit"] == (5, None) and sink.kv.export_blocks(dest).equal(data)


def test_senders_of_another_cluster_are_refused_at_open_with_a_clear_error(transport):
    """A prefill actor holding another secret (another cluster, a stale config) fails at once."""
    sink = RecordingSink()
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("r", 2)
    kwargs = dict(transport.spec.sender_kwargs, secret=bytes.fromhex("badd" * 16))
    other = getattr(transport.module, transport.spec.sender)(**kwargs)
    try:
        from pdserve.kv_transfer.base import TransferError

        with pytest.raises(TransferError, match="UNAUTHENTICATED|MAC does not verify"):
            t = other.open("r", receiver.address, NUM_LAYERS, 2, timeout_s=10)
            t.send(range(0, NUM_LAYERS), dest, random_kv(NUM_LAYERS, 2))
            bounded(lambda: t.finish(1))
    finally:
        other.close()
    assert not sink.failed and sink.blocks_in_use("r") and not sink.writes


# ---- the secret itself ---------------------------------------------------------------------------


def test_a_stale_opening_is_refused_even_when_never_seen():
    """Nonces are remembered for a bounded time only; older openings are refused by their clock."""
    sent_ns = time.time_ns() - int(2 * kv_auth.REPLAY_WINDOW_S * 1e9)
    md = dict(opening(MEMBER, "r", struct.pack(">Q16s", sent_ns, b"\x01" * 16)))
    with pytest.raises(kv_auth.KVAuthError, match="replay window") as err:
        KVAuth(SECRET).check_open("r", md)
    assert err.value.code == DENIED


def test_secrets_from_a_file_or_the_environment_and_bad_ones(tmp_path):
    hexfile = tmp_path / "hex"
    hexfile.write_text(SECRET.hex() + "\n")
    assert kv_auth.load_cluster_secret(str(hexfile), {}) == (SECRET, f"file {hexfile}")
    raw = tmp_path / "raw"
    raw.write_bytes(b"\xff" * 40)
    assert kv_auth.load_cluster_secret(str(raw), {})[0] == b"\xff" * 40
    assert kv_auth.load_cluster_secret(None, {kv_auth.SECRET_ENV: SECRET.hex()})[0] == SECRET
    generated, where = kv_auth.load_cluster_secret(None, {})
    assert len(generated) == 32 and where == "generated"
    with pytest.raises(ValueError, match="at least 16") as err:
        kv_auth.load_cluster_secret(None, {kv_auth.SECRET_ENV: "abcd"})
    assert "abcd" not in str(err.value)
    with pytest.raises(ValueError, match="cluster secret"):
        KVAuth(None)


def test_the_secret_stays_out_of_reprs_and_serve_loads_it_once(tmp_path, monkeypatch):
    from pdserve import serve
    from pdserve.decode_worker.worker import WorkerConfig
    from pdserve.prefill_worker.worker import PrefillConfig

    for obj in (WorkerConfig(cluster_secret=SECRET), PrefillConfig(cluster_secret=SECRET), KVAuth(SECRET)):
        assert SECRET.hex() not in repr(obj) and repr(SECRET) not in repr(obj)
    monkeypatch.delenv(kv_auth.SECRET_ENV, raising=False)
    args = argparse.Namespace(cluster_secret_file=None)
    first = serve.cluster_secret(args)
    assert serve.cluster_secret(args) == first and len(first) == 32  # one per server
    path = tmp_path / "secret"
    path.write_text(SECRET.hex())
    assert serve.cluster_secret(argparse.Namespace(cluster_secret_file=str(path))) == SECRET


def test_a_transport_without_the_secret_does_not_start():
    from pdserve.kv_transfer import make_sender, start_receiver

    with pytest.raises(ValueError, match="cluster_secret in WorkerConfig"):
        start_receiver(RecordingSink(), "grpc", secret=None)
    with pytest.raises(ValueError, match="cluster secret"):
        make_sender("grpc", secret=b"short")
