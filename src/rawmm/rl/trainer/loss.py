"""The clipped importance-ratio policy-gradient loss (GRPO / PPO-clip style) over the loss mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossParts:
    """`loss` is a sum over masked tokens divided by the step's token count, so micro-batch (and
    data-parallel rank) losses add up to the step's mean loss and their gradients add up likewise.

    Every part is a 0-dim tensor on the loss's device: reading one makes the host wait for the device, so a
    trainer adds up `summary()` over its micro-batches and reads the sum once per step."""

    loss: torch.Tensor
    clipped_tokens: torch.Tensor
    tokens: torch.Tensor
    # Sum over loss tokens of |new - old| logprob: near 0 on-policy unless the trainer and the engine
    # disagree (other pixels, other numerics) — the first thing to look at when training goes wrong.
    abs_logprob_diff: torch.Tensor
    # Sum over loss tokens of exp(d) - 1 - d, d = new - old: the "k3" estimator of KL(old || new), unbiased on
    # the sampled tokens and never negative; on-policy it measures the engine-trainer mismatch.
    kl_estimate: torch.Tensor

    def summary(self) -> torch.Tensor:
        """[loss, clipped tokens, |logprob diff| sum, KL estimate sum]: float64, detached, on the device."""
        parts = (self.loss.detach(), self.clipped_tokens, self.abs_logprob_diff, self.kl_estimate)
        return torch.stack([part.to(torch.float64) for part in parts])


def policy_gradient_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    step_tokens: int,
) -> LossParts:
    """`-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)` summed over `loss_mask`, divided by
    `step_tokens` (the number of loss tokens in the whole step, across micro-batches and ranks).

    `r = exp(new - old)` is the ratio of the trained policy to the one that sampled the tokens.
    """
    mask = loss_mask.bool()
    ratio = torch.exp(new_logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    loss = per_token.masked_fill(~mask, 0.0).sum() / max(step_tokens, 1)
    clipped = ((ratio * advantages) > (clipped_ratio * advantages)) & mask
    diff = (new_logprobs - old_logprobs).detach().masked_fill(~mask, 0.0)
    return LossParts(
        loss=loss,
        clipped_tokens=clipped.sum(),
        tokens=mask.sum(),
        abs_logprob_diff=diff.abs().sum(),
        # in float64 with expm1: on-policy d is ~1e-7, where float32 exp(d) - 1 cancels to rounding noise
        kl_estimate=(torch.expm1(diff.double()) - diff.double()).sum(),
    )
