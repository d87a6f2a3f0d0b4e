"""`pdserve bench faults`' arithmetic: token arrival times, throughput, time to recover."""

import numpy as np
import pytest

from pdserve.bench.faults import _parse_kill, recovery_s, throughput, token_times
from pdserve.loadtest.driver import RequestResult


def test_token_times_follow_ttft_and_gaps():
    done = RequestResult(0, "", 0.0, sent_s=1.0, output_tokens=3, ttft_s=0.5, itl_s=[0.1, 0.2], e2e_s=0.8,
                         finish_reason="length")
    failed = RequestResult(1, "", 0.0, sent_s=2.0, error="UNAVAILABLE")  # no token: not counted
    assert token_times([failed, done]) == pytest.approx([1.5, 1.6, 1.8])


def test_recovery_is_the_first_window_back_within_five_percent():
    # 10 tokens/s, nothing for 4 s after a kill at t=20, then 10 tokens/s again.
    times = np.concatenate([np.arange(0, 20, 0.1), np.arange(24, 60, 0.1)])
    assert throughput(times, 5, 20) == pytest.approx(10, rel=0.01)
    assert throughput(times, 20, 25) == pytest.approx(2, rel=0.05)
    rec = recovery_s(times, 20.0, 10.0, 5.0, 60.0)
    assert 8.5 <= rec <= 9.5  # the window [24, 29] is the first whole one after the gap
    assert recovery_s(np.arange(0, 20, 0.1), 20.0, 10.0, 5.0, 60.0) is None  # never came back


def test_kill_spec():
    assert _parse_kill("prefill@12.5") == ("prefill", 12.5)
    with pytest.raises(SystemExit):
        _parse_kill("router@3")
