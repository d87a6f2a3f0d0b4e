"""The request state machine: its one table of moves, and the stream that moves by it."""

import asyncio

import pytest

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.request_state import (
    ENDED,
    TRANSITIONS,
    InvalidTransition,
    RequestState as S,
    check_transition,
)
from pdserve.router.request_stream import RequestStream

# The lives a request can have, as the router drives them (docs/architecture.md).
LIVES = {
    "colocated": [S.WAITING, S.DECODING, S.DONE],
    "colocated, worker died before taking it": [S.WAITING, S.DECODING, S.WAITING, S.DECODING, S.DONE],
    "disaggregated": [S.WAITING, S.RESERVED, S.PREFILLING, S.PUSHING, S.DECODING, S.DONE],
    "decode overtakes token #1": [S.WAITING, S.RESERVED, S.PREFILLING, S.DECODING, S.DONE],
    "one token": [S.WAITING, S.RESERVED, S.PREFILLING, S.PUSHING, S.DONE],
    "prefill worker died, retried": [S.WAITING, S.RESERVED, S.PREFILLING, S.WAITING, S.RESERVED,
                                     S.PREFILLING, S.PUSHING, S.DECODING, S.DONE],
    "transfer failed": [S.WAITING, S.RESERVED, S.PREFILLING, S.PUSHING, S.FAILED],
    "client cancelled during prefill": [S.WAITING, S.RESERVED, S.PREFILLING, S.ABORTED],
    "stop string": [S.WAITING, S.DECODING, S.ABORTED],
    "decode worker died, migrated": [S.WAITING, S.RESERVED, S.PREFILLING, S.PUSHING, S.DECODING, S.MIGRATING,
                                     S.RESERVED, S.PREFILLING, S.PUSHING, S.DECODING, S.DONE],
    "colocated worker died, migrated twice": [S.WAITING, S.DECODING, S.MIGRATING, S.DECODING, S.MIGRATING,
                                              S.DECODING, S.DONE],
    "died after its last token": [S.WAITING, S.DECODING, S.MIGRATING, S.DONE],
    "no worker to move to": [S.WAITING, S.DECODING, S.MIGRATING, S.FAILED],
}


@pytest.mark.parametrize("life", LIVES.values(), ids=LIVES.keys())
def test_every_documented_life_is_allowed(life):
    for old, new in zip(life, life[1:]):
        check_transition(old, new)


def test_the_table_covers_every_state_and_ended_states_have_no_way_out():
    assert set(TRANSITIONS) == set(S)
    assert ENDED == {S.DONE, S.ABORTED, S.FAILED}
    for state in ENDED:
        assert state.ended and TRANSITIONS[state] == frozenset()
        for new in S:
            with pytest.raises(InvalidTransition):
                check_transition(state, new)


def test_every_live_state_can_fail_or_be_aborted():
    for state in set(S) - ENDED:
        assert not state.ended
        assert {S.FAILED, S.ABORTED} <= TRANSITIONS[state], state


@pytest.mark.parametrize("old,new", [
    (S.WAITING, S.PREFILLING),  # no prefill before the decode worker reserved the blocks
    (S.WAITING, S.DONE),  # nothing ends before a worker has it
    (S.RESERVED, S.DECODING),  # no decoding without a prefill
    (S.PUSHING, S.WAITING),  # token #1 is out: the request is not started over silently
    (S.PUSHING, S.PREFILLING),
    (S.DECODING, S.PUSHING),
    (S.RESERVED, S.WAITING),
    (S.WAITING, S.MIGRATING),  # nothing to move before a worker has it
    (S.MIGRATING, S.PREFILLING),  # a migration reserves first
    (S.MIGRATING, S.MIGRATING),
])
def test_moves_outside_the_table_raise(old, new):
    with pytest.raises(InvalidTransition, match=f"from {old.value} to {new.value}"):
        check_transition(old, new)


def _drain(stream: RequestStream) -> list:
    out = []
    while not stream._queue.empty():
        try:
            out.append(asyncio.run(stream.next()))
        except RuntimeError as exc:
            out.append(exc)
    return out


def request(rid: str) -> WorkerRequest:
    return WorkerRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8))


def delta(rid: str, tokens: list[int], finish: str | None = None) -> RequestDelta:
    return RequestDelta(rid, tokens, None, finish_reason=finish)


def test_decode_deltas_are_held_until_token_one_and_errors_are_not():
    closed = []
    s = RequestStream(closed.append, request("r"), disaggregated=True)
    s.push(delta("r", [2]))
    s.push(delta("r", [3], "length"))
    assert s._queue.empty()  # held: token #1 has not come
    s.deliver_first(delta("r", [1]), {"prefill": 0.5})
    assert s.delivered == [1, 2, 3]  # what a migration would continue after
    assert [d.token_ids for d in _drain(s)] == [[1], [2], [3]]
    assert s.prefill_timings == {"prefill": 0.5}
    s.push(delta("r", [4]))  # after token #1 nothing is held
    assert [d.token_ids for d in _drain(s)] == [[4]]
    assert s.delivered == [1, 2, 3, 4]
    s.close()
    assert closed == [s]


def test_a_restart_drops_what_the_old_attempt_sent_and_fail_ends_the_request():
    s = RequestStream(lambda _: None, request("r"), disaggregated=True)
    for state in (S.RESERVED, S.PREFILLING):
        s.advance(state)
    s.push(delta("r", [9], "error"))  # the old attempt's decode worker failed the transfer
    s.advance(S.WAITING)
    s.restart("r~1")
    assert s.request_id == "r~1" and s.request.request_id == "r"
    assert s.delivered == []  # held, never delivered: not counted as streamed
    s.fail(RuntimeError("boom"))  # errors are never held
    assert s.state is S.FAILED and s.ended
    [err] = _drain(s)
    assert isinstance(err, RuntimeError) and str(err) == "boom"
    s.fail(RuntimeError("again"))  # a second failure is queued, the state stays
    assert s.state is S.FAILED


def test_colocated_streams_hold_nothing():
    s = RequestStream(lambda _: None, request("r"))
    s.advance(S.DECODING)
    s.push(delta("r", [7]))
    assert [d.token_ids for d in _drain(s)] == [[7]]
    with pytest.raises(InvalidTransition):
        s.advance(S.PUSHING)
