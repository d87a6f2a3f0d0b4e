"""Sampling: greedy, temperature/top-k/top-p, per-request seeds, logprobs, stop and length.

The sampler itself is tested on synthetic logits; batch independence, stop tokens, EOS and
logprobs run end to end through ``offline.generate`` with a tiny Llama.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.offline import generate
from pdserve.engine.sampler import make_generator, sample
from pdserve.engine.sampling_params import SAMPLING_EPS, SamplingParams

VOCAB = 50


def random_logits(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draw(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """One draw per row, all rows with the same params and one generator (when seeded)."""
    tokens = []
    g = make_generator(params)
    for row in logits:
        (t,), _, failed = sample(row[None], [params], [g])
        assert not failed
        tokens.append(t)
    return tokens


# --- the sampler on synthetic logits --------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(64)
    tokens, logprobs, failed = sample(logits, [SamplingParams()] * 64, [None] * 64)
    assert not failed
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs is None  # nobody asked


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = random_logits(8)
    params = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams() for i in range(8)]
    tokens, _, _ = sample(logits, params, [make_generator(p) for p in params])
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in range(0, 8, 2)] == [argmax[i] for i in range(0, 8, 2)]


def test_top_k_1_equals_greedy():
    logits = random_logits(200, scale=0.5)  # flat enough that plain sampling would wander
    assert draw(logits, SamplingParams(temperature=1.0, top_k=1, seed=3)) == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(200, scale=0.5)
    assert draw(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=3)) == logits.argmax(-1).tolist()


def test_tiny_temperature_is_nearly_greedy():
    logits = random_logits(200)
    assert draw(logits, SamplingParams(temperature=1e-4, seed=3)) == logits.argmax(-1).tolist()


def test_plain_sampling_is_not_greedy():
    """The three tests above mean something only if unfiltered sampling does differ."""
    logits = random_logits(200, scale=0.5)
    assert draw(logits, SamplingParams(temperature=1.0, seed=3)) != logits.argmax(-1).tolist()


def test_top_k_draws_only_from_the_k_best():
    logits = random_logits(1, scale=0.3)[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    drawn = draw(logits.expand(500, VOCAB), SamplingParams(temperature=1.0, top_k=3, seed=0))
    assert set(drawn) == top3  # all three appear in 500 draws, nothing else does


@pytest.mark.parametrize("top_p, nucleus", [
    (0.45, {0}), (0.55, {0, 1}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (0.99, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, nucleus):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(400, 4)
    drawn = draw(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=0))
    assert set(drawn) == nucleus


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = random_logits(100, scale=0.5)
    a = draw(logits, SamplingParams(temperature=1.0, seed=42))
    b = draw(logits, SamplingParams(temperature=1.0, seed=42))
    c = draw(logits, SamplingParams(temperature=1.0, seed=43))
    assert a == b
    assert a != c


def test_logprobs_are_raw_log_softmax_at_the_chosen_token():
    logits = random_logits(6)
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=0.5, top_k=5, seed=1, logprobs=True),
              SamplingParams(temperature=2.0, top_p=0.7, seed=2)] * 2
    tokens, logprobs, _ = sample(logits, params, [make_generator(p) for p in params])
    expected = torch.log_softmax(logits, -1)[torch.arange(6), torch.tensor(tokens)]
    assert logprobs is not None and len(logprobs) == 6
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-6)
    # the raw distribution, not the tempered/filtered one the token was drawn from
    tempered = torch.log_softmax(logits[1] / 0.5, -1)[tokens[1]]
    assert not math.isclose(logprobs[1], float(tempered), abs_tol=1e-3)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 9.9e-6])
def test_temperatures_below_the_floor_are_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy and make_generator(params) is None
    logits = random_logits(20, scale=100.0)
    assert draw(logits, params) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 2e-5, 1e-3])
def test_tiny_temperatures_above_the_floor_do_not_overflow(temperature):
    """logits / T would overflow float32 for large logits; the sampler subtracts the max first."""
    logits = random_logits(50, scale=1e4)
    logits[:, 0] = 3e38  # near float32's largest: (logit / T) alone would be inf
    assert draw(logits, SamplingParams(temperature=temperature, seed=2)) == logits.argmax(-1).tolist()


def test_huge_temperature_samples_without_failing():
    logits = random_logits(300)
    drawn = draw(logits, SamplingParams(temperature=1e300, seed=4))
    assert len(set(drawn)) > VOCAB // 2  # about uniform


@pytest.mark.parametrize("poison", ["nan", "inf", "all_masked"])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_with_unusable_logits_fails_alone(poison, greedy):
    logits = random_logits(6)
    if poison == "nan":
        logits[2, 7] = float("nan")
    elif poison == "inf":
        logits[2, 7] = float("inf")
    else:
        logits[2] = float("-inf")
    params = [SamplingParams(temperature=0.0 if greedy else 0.8, seed=i, logprobs=True) for i in range(6)]
    alone = [sample(logits[i:i + 1], [params[i]], [make_generator(params[i])]).tokens[0] for i in range(6)]
    tokens, logprobs, failed = sample(logits, params, [make_generator(p) for p in params])
    assert list(failed) == [2] and "non-finite" in failed[2]
    assert [tokens[i] for i in range(6) if i != 2] == [alone[i] for i in range(6) if i != 2]
    assert all(math.isfinite(logprobs[i]) for i in range(6) if i != 2)


def test_a_row_whose_filters_leave_a_broken_distribution_fails_alone():
    """Parameters that slipped past validation (NaN temperature) fail their own row only."""
    logits = random_logits(3)
    params = [SamplingParams(), SamplingParams(temperature=float("nan"), seed=1), SamplingParams(temperature=1.0, seed=2)]
    tokens, _, failed = sample(logits, params, [make_generator(p) for p in params])
    assert list(failed) == [1] and "sampling failed" in failed[1]
    assert tokens[0] == int(logits[0].argmax())


def test_make_generator_only_for_seeded_random_requests():
    assert make_generator(SamplingParams()) is None
    assert make_generator(SamplingParams(seed=1)) is None  # greedy: the seed is irrelevant
    assert make_generator(SamplingParams(temperature=1.0)) is None  # unseeded: global RNG
    assert isinstance(make_generator(SamplingParams(temperature=1.0, seed=1)), torch.Generator)


# --- SamplingParams.validate -----------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", float("-inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")), ("top_p", float("inf")),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("seed", -1), ("seed", 2**63),
    ("stop_token_ids", [-1]), ("stop_token_ids", [5, "x"]), ("stop_token_ids", [VOCAB]),
])
def test_validate_rejects_bad_field_naming_it(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=VOCAB)


def test_validate_accepts_the_edges():
    SamplingParams().validate(VOCAB)
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                   stop_token_ids=[0, VOCAB - 1]).validate(VOCAB)
    SamplingParams(temperature=5.0, top_p=1e-9, top_k=VOCAB, seed=2**63 - 1).validate(VOCAB)
    SamplingParams(stop_token_ids=[10**6]).validate()  # no vocabulary known: any id >= 0


# --- end to end through offline.generate ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def runner(tiny):
    return tiny.runner(num_blocks=256, block_size=4)


def test_a_sequence_whose_sampling_fails_ends_alone_with_error(runner, random_prompts):
    prompts = random_prompts([9, 4, 13], seed=11)
    good = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [generate(runner, [p], good)[0].output_token_ids for p in prompts]
    bad = SamplingParams(max_tokens=6, temperature=float("nan"), seed=1, ignore_eos=True)  # past validation
    seqs = generate(runner, prompts, [good, bad, good])
    assert seqs[1].finish_reason == "error" and seqs[1].output_token_ids == []
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [alone[0], alone[2]]
    assert runner.allocator.num_free == runner.allocator.num_blocks


def test_seeded_request_is_independent_of_its_batch(runner, random_prompts):
    prompts = random_prompts([9, 4, 21, 13, 30], seed=5)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = generate(runner, [prompts[0]], seeded)[0].output_token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True),  # global RNG
              SamplingParams(max_tokens=30, ignore_eos=True),  # greedy, outlives the seeded one
              SamplingParams(max_tokens=5, temperature=0.7, seed=1234, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.3, top_k=20, seed=99, ignore_eos=True)]
    for chunk in (None, 5):
        batch = generate(runner, prompts, [seeded] + others, prefill_chunk=chunk)
        assert batch[0].output_token_ids == alone
    assert len(alone) == 24
    # and the seed matters: another seed draws another continuation
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True)
    assert generate(runner, [prompts[0]], other_seed)[0].output_token_ids != alone


def test_different_seeds_give_different_continuations(runner, random_prompts):
    prompt = random_prompts([10], seed=6)[0]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    outs = [tuple(s.output_token_ids) for s in generate(runner, [prompt] * 8, params)]
    assert len(set(outs)) == 8


def greedy_tokens(runner, prompt, n):
    return generate(runner, [prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].output_token_ids


def first_new_token_position(tokens: list[int], skip: int = 3) -> int:
    """An index whose token did not occur before it (so stopping on it stops exactly there)."""
    return next(i for i in range(skip, len(tokens)) if tokens[i] not in tokens[:i])


def test_max_tokens_finishes_with_length(runner, random_prompts):
    seq = generate(runner, random_prompts([7], seed=7), SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert seq.num_output_tokens == 9 and seq.finish_reason == "length"


def test_stop_token_ids_stop_with_reason_stop(runner, random_prompts):
    prompt = random_prompts([12], seed=8)[0]
    full = greedy_tokens(runner, prompt, 20)
    i = first_new_token_position(full)
    seq = generate(runner, [prompt], SamplingParams(max_tokens=20, stop_token_ids=[full[i]]))[0]
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == full[: i + 1]  # the stop token is the last output token
    assert runner.allocator.num_free == runner.allocator.num_blocks


def test_eos_from_the_model_stops_unless_ignore_eos(tiny_model, runner, random_prompts):
    prompt = random_prompts([12], seed=9)[0]
    full = greedy_tokens(runner, prompt, 20)
    i = first_new_token_position(full)
    # the same weights, saved with that token as EOS (config and generation_config)
    eos_model = tiny_model("llama", eos_token_id=full[i])
    eos_runner = eos_model.runner()
    assert eos_runner.eos_token_ids == {full[i]}
    stopped = generate(eos_runner, [prompt], SamplingParams(max_tokens=20))[0]
    assert stopped.finish_reason == "stop" and stopped.output_token_ids == full[: i + 1]
    kept = generate(eos_runner, [prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and kept.output_token_ids == full
    # ignore_eos does not ignore explicit stop tokens
    explicit = generate(eos_runner, [prompt], SamplingParams(max_tokens=20, ignore_eos=True,
                                                             stop_token_ids=[full[i]]))[0]
    assert explicit.finish_reason == "stop" and explicit.output_token_ids == full[: i + 1]


def test_logprobs_end_to_end_match_hf_log_softmax(tiny, runner, random_prompts):
    prompt = random_prompts([11], seed=10)[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, logprobs=True, ignore_eos=True)
    seq = generate(runner, [prompt], params)[0]
    assert len(seq.output_logprobs) == 8
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([seq.token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    expected = [lp[n - 1 + j, t].item() for j, t in enumerate(seq.output_token_ids)]
    assert seq.output_logprobs == pytest.approx(expected, abs=1e-4)
