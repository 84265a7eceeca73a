from __future__ import annotations

import pytest
import torch

from mm_engine.core.sampler import Sampler
from mm_engine.sampling_params import SamplingParams

# A known distribution over 6 tokens, deliberately not in sorted order.
PROBS = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
LOGITS = PROBS.log()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw_many(params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """n draws for one request, made as one batch of n identical rows sharing one generator."""
    g = gen(1234)
    out = Sampler().sample(logits.expand(n, -1).clone(), [params] * n, [g] * n)
    return torch.tensor(out)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=gen(0))
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1.0  # a tie: lowest index wins, like torch.argmax
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    assert out == logits.argmax(dim=-1).tolist()
    assert out[3] == 7


def test_other_dtypes_are_computed_in_float32() -> None:
    logits = torch.randn(4, 30, generator=gen(1)).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out == logits.float().argmax(dim=-1).tolist()
    out = Sampler().sample(logits, [SamplingParams(seed=0)] * 4, [gen(0)] * 4)
    assert all(0 <= t < 30 for t in out)


def test_frequencies_follow_softmax() -> None:
    freq = frequencies(draw_many(SamplingParams(temperature=1.0)), 6)
    # 4000 draws: the standard error is at most 0.008, so 0.04 is a five-sigma bound.
    assert torch.allclose(freq, PROBS, atol=0.04)


def test_temperature_sharpens_and_flattens() -> None:
    sharp = frequencies(draw_many(SamplingParams(temperature=0.5)), 6)
    flat = frequencies(draw_many(SamplingParams(temperature=2.0)), 6)
    assert torch.allclose(sharp, torch.softmax(LOGITS / 0.5, -1), atol=0.04)
    assert torch.allclose(flat, torch.softmax(LOGITS / 2.0, -1), atol=0.04)
    assert sharp[1] > PROBS[1] + 0.1 > flat[1] + 0.1


def test_top_k_keeps_only_the_k_best() -> None:
    tokens = draw_many(SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {1, 3}
    freq = frequencies(tokens, 6)
    assert abs(freq[1] - 0.40 / 0.65) < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Sorted: 0.40, 0.25, 0.15, ... -> cumulative 0.40, 0.65, 0.80: top_p=0.6 keeps {1, 3},
    # top_p=0.7 keeps {1, 3, 4}, a tiny top_p keeps the best token alone.
    assert set(draw_many(SamplingParams(top_p=0.6)).tolist()) == {1, 3}
    tokens = draw_many(SamplingParams(top_p=0.7))
    assert set(tokens.tolist()) == {1, 3, 4}
    assert torch.allclose(frequencies(tokens, 6)[[1, 3, 4]], torch.tensor([0.5, 0.3125, 0.1875]), atol=0.04)
    assert set(draw_many(SamplingParams(top_p=0.01), n=500).tolist()) == {1}


def test_top_k_then_top_p_renormalises() -> None:
    # After top_k=3 the kept mass is 0.80: {1, 3} hold 0.8125 of it, so top_p=0.8 keeps just them.
    assert set(draw_many(SamplingParams(top_k=3, top_p=0.8)).tolist()) == {1, 3}


def test_per_row_settings_in_one_batch() -> None:
    rows = [SamplingParams(top_k=1), SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams()]
    n = 400
    torch.manual_seed(5)
    out = Sampler().sample(LOGITS.expand(4 * n, -1).clone(), rows * n, [None] * (4 * n))
    seen = [set(out[i::4]) for i in range(4)]
    assert seen == [{1}, {1, 3}, {1, 3, 4}, set(range(6))]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 100
    target = torch.randn(vocab, generator=gen(7))
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=42)
    sampler = Sampler()

    def run(batch: int, position: int, other: SamplingParams, steps: int = 10) -> list[int]:
        g = gen(42)
        others = torch.randn(steps, batch, vocab, generator=gen(batch))
        tokens = []
        for step in range(steps):
            logits = others[step].clone()
            logits[position] = target
            row_params = [other] * batch
            row_params[position] = params
            row_gens: list[torch.Generator | None] = [None] * batch
            row_gens[position] = g
            tokens.append(sampler.sample(logits, row_params, row_gens)[position])
        return tokens

    alone = run(1, 0, params)
    assert len(set(alone)) > 1  # it really samples
    assert run(5, 3, SamplingParams(temperature=0.0)) == alone
    assert run(8, 0, SamplingParams(temperature=1.3, top_p=0.5)) == alone
    assert run(3, 2, SamplingParams(top_k=5)) == alone
    assert run(1, 0, params) == alone


def test_mixed_greedy_and_random_batch() -> None:
    logits = torch.randn(6, 40, generator=gen(3)).repeat(20, 1)
    rows = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)] * 20
    gens = [gen(i) if i % 3 == 0 else None for i in range(120)]
    out = Sampler().sample(logits, rows, gens)
    greedy = logits.argmax(dim=-1).tolist()
    assert out[0::2] == greedy[0::2]
    assert len(set(out[1::2])) > 5  # the random rows really sample


def test_unseeded_rows_use_global_rng() -> None:
    logits = torch.zeros(2, 1000)
    torch.manual_seed(0)
    first = Sampler().sample(logits, [SamplingParams()] * 2, [None, None])
    torch.manual_seed(0)
    assert Sampler().sample(logits, [SamplingParams()] * 2, [None, None]) == first


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None])


def test_extreme_temperature_and_top_p_stay_finite():
    """A temperature that overflows the division is greedy; a top_p that underflows float32 still
    keeps the best token (both gave token 0 from NaN probabilities before)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    sampler = Sampler()
    tiny_t = SamplingParams(temperature=1e-300, max_tokens=1)
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=1)
    for params in (tiny_t, tiny_p):
        assert sampler.sample(logits, [params], [torch.Generator().manual_seed(0)]) == [1]
