"""Validation and tokenization: every bad field is named with its allowed range."""

from __future__ import annotations

import math

import pytest

from pdserve.client import build_request
from pdserve.router.preprocess import (
    DEFAULT_MAX_TOKENS,
    MAX_MESSAGES,
    MAX_STOP_STRING_LEN,
    MAX_STOP_TOKEN_IDS,
    MIN_PROMPT_BYTES,
    InvalidRequest,
    Preprocessor,
    max_prompt_bytes,
)

VOCAB = 49152


@pytest.fixture(scope="module")
def pre(tokenizer):
    return Preprocessor(tokenizer, max_model_len=300, vocab_size=VOCAB)


def test_plain_prompt_is_tokenized_with_vllm_defaults(pre, tokenizer):
    p = pre.prepare(build_request("Hello there"))
    assert p.prompt_token_ids == tokenizer.encode("Hello there")
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.seed) == (1.0, 1.0, 0, None)
    assert p.params.max_tokens == DEFAULT_MAX_TOKENS
    assert p.stop == [] and p.client_request_id == ""


def test_unset_max_tokens_shrinks_to_the_room_left(tokenizer):
    pre = Preprocessor(tokenizer, max_model_len=100, vocab_size=VOCAB)
    p = pre.prepare(build_request(token_ids=[5] * 40))
    assert p.params.max_tokens == 60


def test_explicit_parameters_reach_the_engine_params(pre):
    p = pre.prepare(
        build_request(
            "x", max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=1234,
            stop=["\n"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=True, request_id="r-1",
        )
    )
    s = p.params
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.5, 0.9, 40, 1234)
    assert s.stop_token_ids == [2, 7] and s.ignore_eos and s.logprobs
    assert p.stop == ["\n"] and p.client_request_id == "r-1"


def test_zero_temperature_is_greedy(pre):
    assert pre.prepare(build_request("x", temperature=0)).params.greedy


def test_chat_messages_use_the_chat_template(pre, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    p = pre.prepare(build_request(messages=msgs))
    expected = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert p.prompt_token_ids == list(expected)
    assert tokenizer.decode(p.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_token_ids_pass_through(pre):
    assert pre.prepare(build_request(token_ids=[1, 2, 3, VOCAB - 1])).prompt_token_ids == [1, 2, 3, VOCAB - 1]


BAD = [
    (dict(), "one of prompt, messages or token_ids must be set"),
    (dict(prompt=""), "prompt must not be empty"),
    (dict(messages=[]), "messages must hold at least one message"),
    (dict(messages=[{"role": "", "content": "x"}]), "messages[0].role must not be empty"),
    (dict(token_ids=[]), "token_ids must not be empty"),
    (dict(token_ids=[1, VOCAB]), f"token_ids[1] is {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    (dict(token_ids=[-1]), f"token_ids[0] is -1, outside the vocabulary [0, {VOCAB})"),
    (dict(prompt="x", max_tokens=0), "sampling.max_tokens must be an integer >= 1, got 0"),
    (dict(prompt="x", max_tokens=-5), "sampling.max_tokens must be an integer >= 1, got -5"),
    (dict(prompt="x", temperature=-0.1), "sampling.temperature must be >= 0"),
    (dict(prompt="x", temperature=math.nan), "sampling.temperature must be >= 0"),
    (dict(prompt="x", top_p=0.0), "sampling.top_p must be in (0, 1], got 0.0"),
    (dict(prompt="x", top_p=1.5), "sampling.top_p must be in (0, 1], got 1.5"),
    (dict(prompt="x", top_k=-1), "sampling.top_k must be an integer >= 0"),
    (dict(prompt="x", seed=-1), "sampling.seed must be in [0, 2^63), got -1"),
    (dict(prompt="x", stop=["ok", ""]), "sampling.stop[1] must not be empty"),
    (dict(prompt="x", stop=["s"] * 17), "at most 16 are allowed"),
    (dict(prompt="x", stop_token_ids=[VOCAB]), f"sampling.stop_token_ids must hold token ids in [0, {VOCAB})"),
    (dict(prompt="x", request_id="r" * 300), "request_id must be at most 256 characters, got 300"),
    (dict(token_ids=[5] * 300), "the prompt is 300 tokens but the model's context (max_model_len) is 300"),
    (dict(prompt="x", temperature=math.inf), "sampling.temperature must be >= 0 and finite"),
    (dict(prompt="x", temperature=-math.inf), "sampling.temperature must be >= 0 and finite"),
    (dict(prompt="x", top_p=math.inf), "sampling.top_p must be in (0, 1], got inf"),
    (dict(prompt="x", stop=["ok", "s" * (MAX_STOP_STRING_LEN + 1)]),
     f"sampling.stop[1] is {MAX_STOP_STRING_LEN + 1} characters; each stop string may be at most "
     f"{MAX_STOP_STRING_LEN} (MAX_STOP_STRING_LEN)"),
    (dict(prompt="x", stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)),
     f"sampling.stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"),
    (dict(messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)),
     f"messages holds {MAX_MESSAGES + 1} messages; at most {MAX_MESSAGES} are allowed (MAX_MESSAGES)"),
    (dict(prompt="é" * (MIN_PROMPT_BYTES // 2 + 1)),
     f"prompt is {MIN_PROMPT_BYTES + 2} bytes of UTF-8; at most {MIN_PROMPT_BYTES} are allowed"),
    (dict(messages=[{"role": "user", "content": "x" * (MIN_PROMPT_BYTES // 2)}] * 2),
     f"messages is {MIN_PROMPT_BYTES + 8} bytes of UTF-8; at most {MIN_PROMPT_BYTES} are allowed"),
    (dict(token_ids=[VOCAB] * 10_000), "the prompt is 10000 tokens but the model's context (max_model_len) is 300"),
    (dict(token_ids=[5] * 100, max_tokens=201),
     "sampling.max_tokens is 201 but the prompt is 100 tokens and the model's context "
     "(max_model_len) is 300 tokens: max_tokens must be in [1, 200] for this prompt"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:40] for _, m in BAD])
def test_invalid_fields_are_named(pre, kwargs, message):
    from pdserve.v1 import generation_pb2 as pb

    req = build_request(**kwargs) if kwargs else pb.GenerateRequest()
    with pytest.raises(InvalidRequest) as err:
        pre.prepare(req)
    assert message in str(err.value)
    assert err.value.code == "INVALID_ARGUMENT"


def test_max_tokens_exactly_filling_the_context_is_fine(pre):
    assert pre.prepare(build_request(token_ids=[5] * 100, max_tokens=200)).params.max_tokens == 200


def test_a_model_without_chat_template_says_so(tokenizer):
    class NoTemplate:
        chat_template = None

    pre = Preprocessor(NoTemplate(), max_model_len=100, vocab_size=VOCAB)
    with pytest.raises(InvalidRequest) as err:
        pre.prepare(build_request(messages=[{"role": "user", "content": "hi"}]))
    assert err.value.code == "FAILED_PRECONDITION"
    assert "no chat template" in str(err.value)


def test_the_text_cap_grows_with_the_context_and_sits_above_what_can_fit(tokenizer):
    assert max_prompt_bytes(300) == MIN_PROMPT_BYTES
    assert max_prompt_bytes(1 << 17) == 128 << 17
    # Text just under the cap is tokenized and refused for its length in tokens, not bytes:
    # no token of the vocabulary covers 128 bytes.
    longest = max(len(tokenizer.convert_tokens_to_string([t]).encode()) for t in tokenizer.get_vocab())
    assert longest < 128
    pre = Preprocessor(tokenizer, max_model_len=8192, vocab_size=VOCAB)
    with pytest.raises(InvalidRequest, match="tokens but the model's context"):
        pre.prepare(build_request(prompt=" " * MIN_PROMPT_BYTES))
