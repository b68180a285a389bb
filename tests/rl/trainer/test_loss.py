import math

import pytest
import torch

from rawmm.rl.trainer.loss import policy_gradient_loss


def loss_of(ratios, advantages, mask, step_tokens=None):  # noqa: ANN001, ANN201
    new = torch.tensor([math.log(r) for r in ratios], requires_grad=True)
    parts = policy_gradient_loss(
        new,
        torch.zeros(len(ratios)),
        torch.tensor(advantages),
        torch.tensor(mask),
        clip_low=0.2,
        clip_high=0.28,
        step_tokens=step_tokens if step_tokens is not None else sum(mask),
    )
    parts.loss.backward()
    return parts, new.grad


def test_ratio_is_clipped_only_in_the_direction_of_the_advantage():
    # ratio 1.5: A>0 is capped at 1.28 (no gradient), A<0 keeps the unclipped 1.5.
    # ratio 0.5: A>0 keeps 0.5, A<0 is capped at 0.8 (no gradient).
    parts, grad = loss_of([1.5, 1.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0], [True] * 4)
    assert parts.loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    # d(-r*A)/d(log r) = -r*A, divided by the 4 step tokens.
    assert grad.tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])
    assert (parts.clipped_tokens.item(), parts.tokens.item()) == (2, 4)
    assert parts.abs_logprob_diff.item() == pytest.approx(2 * math.log(1.5) + 2 * -math.log(0.5))
    # k3: r - 1 - log r per token, never negative
    assert parts.kl_estimate.item() == pytest.approx(2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5)))


def test_masked_tokens_contribute_nothing_and_step_tokens_normalize():
    parts, grad = loss_of([2.0, 1.0, 3.0], [5.0, 1.0, -7.0], [False, True, False], step_tokens=4)
    assert parts.loss.item() == pytest.approx(-1.0 / 4)
    assert grad.tolist() == pytest.approx([0.0, -1.0 / 4, 0.0])
    assert (parts.clipped_tokens.item(), parts.tokens.item()) == (0, 1)
    assert parts.abs_logprob_diff.item() == 0.0  # only the unmasked token counts, and its ratio is 1
    assert parts.kl_estimate.item() == 0.0


def test_the_kl_estimate_resolves_on_policy_numerics():
    # d = 3e-7 per token (engine and trainer numerics): k3 = d^2 / 2 = 4.5e-14, which float32 exp(d) - 1 - d
    # rounds to 0 or to noise of the order of 1e-8.
    new = torch.tensor([-1.0 + 3e-7] * 4, dtype=torch.float32)
    parts = policy_gradient_loss(
        new,
        torch.full((4,), -1.0),
        torch.ones(4),
        torch.ones(4, dtype=torch.bool),
        clip_low=0.2,
        clip_high=0.28,
        step_tokens=4,
    )
    d = float(new[0].double() + 1.0)
    assert parts.kl_estimate.item() == pytest.approx(4 * d * d / 2, rel=1e-3)


def test_on_policy_loss_is_the_negative_mean_advantage():
    parts, grad = loss_of([1.0, 1.0, 1.0], [1.0, 2.0, -0.5], [True] * 3)
    assert parts.loss.item() == pytest.approx(-(1.0 + 2.0 - 0.5) / 3)
    assert grad.tolist() == pytest.approx([-1 / 3, -2 / 3, 0.5 / 3])
