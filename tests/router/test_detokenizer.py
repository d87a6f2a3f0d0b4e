"""Incremental detokenization gives the same text as decoding the whole output at once."""

from __future__ import annotations

import pytest

from pdserve.router.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Emoji split across tokens: 👋🏽 🤖🤖 🎉 and a family 👨‍👩‍👧",
    "中文：你好，世界。日本語のテキスト、한국어 텍스트",
    "  leading spaces\n\nnew lines\t tabs and café naïve façade",
    "🤖",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Repeat after me:")
    ids = tokenizer.encode(text)
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_no_piece_holds_a_broken_character(tokenizer, text):
    ids = tokenizer.encode(text)
    # The texts are chosen so that some characters really do span several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    pieces = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert all("\ufffd" not in p for p in pieces)


def test_a_character_appears_with_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🤖"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done.") + [eos]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("<|im_start|>assistant\n"))
    assert "".join(stream(detok, ids)) == "Done."
    assert detok.num_output_tokens == len(ids)


def test_unfinished_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("a🤖")
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.add(t) for t in ids[:-1])
    assert text == "a"
    assert detok.flush() == tokenizer.decode(ids[:-1])[1:]
    assert "\ufffd" in tokenizer.decode(ids[:-1])


def test_a_prompt_that_ends_mid_character_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("🤖")[:-1]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(stream(detok, tokenizer.encode("Hi"))) == "Hi"
