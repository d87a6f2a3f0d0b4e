"""Stop strings end the text before the first match and never leak text past it."""

from __future__ import annotations

from pdserve.router.stop import StopStringMatcher


def run(stop: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopStringMatcher(stop)
    out = []
    for p in pieces:
        visible, stopped = m.feed(p)
        out.append(visible)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stop_strings_pass_text_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_inside_one_piece_truncates_before_it():
    out, stopped = run(["END"], ["hello END world"])
    assert stopped and "".join(out) == "hello "


def test_stop_split_across_pieces_is_held_back_then_dropped():
    out, stopped = run(["</answer>"], ["42</", "ans", "wer> trailing"])
    assert stopped
    assert out == ["42", "", ""]


def test_a_partial_match_that_fails_is_released():
    out, stopped = run(["</answer>"], ["a</an", "d b"])
    assert not stopped
    assert out == ["a", "</and b", ""]
    assert "".join(out) == "a</and b"


def test_held_prefix_is_flushed_when_the_request_ends_otherwise():
    out, stopped = run(["STOP"], ["go ST"])
    assert not stopped and out == ["go ", "ST"]


def test_earliest_of_several_stop_strings_wins():
    out, stopped = run(["world", "lo"], ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_stop_at_the_very_start_gives_no_text():
    out, stopped = run(["\n"], ["\nrest"])
    assert stopped and out == [""]


def test_multibyte_stop_strings():
    out, stopped = run(["。"], ["你好", "。再见"])
    assert stopped and "".join(out) == "你好"


def test_feed_after_stop_returns_nothing():
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""
    assert m.matched == "x"
