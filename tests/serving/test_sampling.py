"""sample_token: greedy, temperature, top-p nucleus, seeded reproducibility, reported log-probabilities."""

from __future__ import annotations

import math

import torch

from rawmm.serving.sampling import nucleus_logprobs, sample_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])


def draw(seed: int, **kwargs: float) -> tuple[int, float]:
    return sample_token(LOGITS, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_greedy_takes_the_argmax_and_reports_its_plain_logprob() -> None:
    token, logprob = draw(0, temperature=0.0, top_p=0.3)
    assert token == 0
    assert math.isclose(logprob, float(torch.log_softmax(LOGITS, -1)[0]), rel_tol=1e-6)


def test_logprob_is_taken_under_the_temperature_scaled_distribution() -> None:
    for seed in range(20):
        token, logprob = draw(seed, temperature=0.7, top_p=1.0)
        assert math.isclose(logprob, float(torch.log_softmax(LOGITS / 0.7, -1)[token]), rel_tol=1e-5)


def test_the_same_seed_draws_the_same_tokens() -> None:
    assert [draw(s, temperature=1.5, top_p=1.0) for s in range(10)] == [
        draw(s, temperature=1.5, top_p=1.0) for s in range(10)
    ]
    assert len({draw(s, temperature=5.0, top_p=1.0)[0] for s in range(50)}) > 1


def test_top_p_keeps_the_smallest_nucleus_and_renormalizes() -> None:
    logprobs = torch.log_softmax(LOGITS, -1)
    probs = logprobs.exp()
    # The top token alone has < 0.8 of the mass, the top two have more: the nucleus is {0, 1}.
    assert probs[0] < 0.8 < probs[0] + probs[1]
    nucleus = nucleus_logprobs(logprobs, 0.8).exp()
    assert torch.all(nucleus[2:] == 0)
    assert math.isclose(float(nucleus[0]), float(probs[0] / (probs[0] + probs[1])), rel_tol=1e-5)
    tokens = {draw(seed, temperature=1.0, top_p=0.8)[0] for seed in range(200)}
    assert tokens == {0, 1}


def test_a_tiny_top_p_still_keeps_the_top_token() -> None:
    for top_p in (1e-9, 1e-46, 5e-324):  # the last two are 0 in float32
        assert {draw(seed, temperature=1.0, top_p=top_p) for seed in range(5)} == {(0, 0.0)}, top_p
