"""Workloads: lengths in their ranges with the right moments, the same seed gives the same
requests, the mixed workload's share of long prompts, and trace replay (parsing and errors)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.loadtest.workload import (
    CHAT_QUESTIONS, LengthRange, RequestSpec, WorkloadConfig, WorkloadError, build_workload, load_trace,
)


def test_length_range_parse():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("64:512") == LengthRange(64, 512)
    assert str(LengthRange(64, 512)) == "64:512" and LengthRange(7, 7).is_fixed
    for bad in ("", "a", "1:2:3", "0", "9:3", "-4:8"):
        with pytest.raises(WorkloadError):
            LengthRange.parse(bad)


def test_uniform_lengths_cover_the_range_with_the_uniform_mean():
    specs = build_workload(WorkloadConfig("uniform", 20000, LengthRange(10, 30), LengthRange(1, 5), seed=3))
    prompts = np.array([s.prompt_tokens for s in specs])
    outputs = np.array([s.output_tokens for s in specs])
    assert prompts.min() == 10 and prompts.max() == 30  # both ends included
    assert outputs.min() == 1 and outputs.max() == 5
    assert abs(prompts.mean() - 20) < 0.2  # sd of the mean: 6.06 / sqrt(20000) = 0.04
    assert abs(prompts.var() - (21**2 - 1) / 12) < 2.0  # discrete uniform variance: 36.7
    assert abs(outputs.mean() - 3) < 0.05


def test_fixed_lengths_and_its_error_for_ranges():
    specs = build_workload(WorkloadConfig("fixed", 5, LengthRange(100, 100), LengthRange(20, 20)))
    assert [(s.prompt_tokens, s.output_tokens) for s in specs] == [(100, 20)] * 5
    with pytest.raises(WorkloadError, match="--workload uniform"):
        build_workload(WorkloadConfig("fixed", 5, LengthRange(10, 100), LengthRange(20, 20)))


def test_same_seed_same_requests_other_seed_other_requests():
    def key(seed):
        specs = build_workload(WorkloadConfig("mixed", 50, seed=seed))
        return [(s.prompt_tokens, s.output_tokens, s.label) for s in specs], [s.inputs(1000) for s in specs[:3]]

    assert key(7) == key(7)
    assert key(7) != key(8)


def test_mixed_has_the_exact_share_of_long_prompts():
    config = WorkloadConfig("mixed", 40, LengthRange(16, 64), LengthRange(8, 8), LengthRange(1000, 1200),
                            long_share=0.25, seed=1)
    specs = build_workload(config)
    long = [s for s in specs if s.label == "long"]
    short = [s for s in specs if s.label == "short"]
    assert len(long) == 10 and len(short) == 30
    assert all(1000 <= s.prompt_tokens <= 1200 for s in long)
    assert all(16 <= s.prompt_tokens <= 64 for s in short)
    assert {s.index for s in long} != set(range(10))  # spread, not bunched at the start
    with pytest.raises(WorkloadError, match=r"\[0, 1\]"):
        build_workload(WorkloadConfig("mixed", 10, long_share=1.5))


def test_synthetic_prompts_are_seeded_token_ids_in_the_vocabulary():
    spec = build_workload(WorkloadConfig("fixed", 2, LengthRange(300, 300), LengthRange(4, 4), seed=5))
    ids = spec[0].inputs(50)["token_ids"]
    assert len(ids) == 300 and min(ids) >= 0 and max(ids) < 50
    assert spec[0].inputs(50) == spec[0].inputs(50)
    assert spec[0].inputs(50) != spec[1].inputs(50)  # every request its own prompt


def test_chat_workload_sends_messages():
    specs = build_workload(WorkloadConfig("chat", 30, output_tokens=LengthRange(5, 9), seed=2))
    for s in specs:
        (msg,) = s.inputs(100)["messages"]
        assert msg["role"] == "user" and msg["content"] in CHAT_QUESTIONS and 5 <= s.output_tokens <= 9
    assert len({s.messages[0]["content"] for s in specs}) > 5


def test_unknown_workload_and_bad_count():
    with pytest.raises(WorkloadError, match="choose from"):
        build_workload(WorkloadConfig("zipf"))
    with pytest.raises(WorkloadError, match=">= 1"):
        build_workload(WorkloadConfig("uniform", 0))
    with pytest.raises(WorkloadError, match="--trace"):
        build_workload(WorkloadConfig("trace"))


def write_trace(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_trace_replay_parses_sorts_and_keeps_inputs(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"arrival_s": 2.5, "prompt": "Hello there", "output_tokens": 4},
        "",
        {"arrival_s": 0, "prompt_tokens": 128, "output_tokens": 16, "label": "long"},
        {"arrival_s": 1.0, "messages": [{"role": "user", "content": "Hi"}], "output_tokens": 8},
    ])
    specs = load_trace(path)
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.5]
    assert [s.index for s in specs] == [0, 1, 2]
    assert specs[0].prompt_tokens == 128 and specs[0].label == "long"
    assert specs[1].inputs(10) == {"messages": [{"role": "user", "content": "Hi"}]}
    assert specs[2].inputs(10) == {"prompt": "Hello there"} and specs[2].output_tokens == 4
    assert build_workload(WorkloadConfig("trace", trace=str(path)))[2].prompt == "Hello there"


@pytest.mark.parametrize("line, message", [
    ("{not json", r"t\.jsonl:2: not JSON"),
    ("[1, 2]", r":2: expected a JSON object"),
    ({"arrival_s": -1, "prompt_tokens": 4, "output_tokens": 1}, ":2: arrival_s must be"),
    ({"arrival_s": "0", "prompt_tokens": 4, "output_tokens": 1}, ":2: arrival_s must be"),
    ({"arrival_s": 0, "prompt_tokens": 4}, ":2: output_tokens must be"),
    ({"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 0}, ":2: output_tokens must be"),
    ({"arrival_s": 0, "output_tokens": 3}, "exactly one of prompt_tokens, prompt or messages"),
    ({"arrival_s": 0, "prompt": "x", "prompt_tokens": 3, "output_tokens": 3}, "exactly one of"),
    ({"arrival_s": 0, "prompt_tokens": 2.5, "output_tokens": 3}, "prompt_tokens must be an integer"),
    ({"arrival_s": 0, "prompt": "", "output_tokens": 3}, "prompt must be a non-empty string"),
    ({"arrival_s": 0, "messages": [{"role": "user"}], "output_tokens": 3}, "messages must be"),
    ({"arrival_s": 0, "prompt": "x", "output_tokens": 3, "temperature": 1}, "unknown field.*temperature"),
])
def test_trace_errors_name_the_line_and_the_problem(tmp_path, line, message):
    path = write_trace(tmp_path / "t.jsonl", [{"arrival_s": 0, "prompt": "ok", "output_tokens": 1}, line])
    with pytest.raises(WorkloadError, match=message):
        load_trace(path)


def test_trace_missing_or_empty_file(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_request_spec_json_names_its_input():
    assert RequestSpec(3, 8, prompt_tokens=40, label="short").to_json() == {
        "index": 3, "label": "short", "output_tokens": 8, "prompt_tokens": 40}
