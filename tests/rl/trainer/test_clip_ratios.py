"""The trainer clips the importance ratio at 1 - clip_ratio_low and 1 + clip_ratio_high: with asymmetric
bounds (0.2 and 0.28), ratios between them tell the two apart."""

from __future__ import annotations

import math

import msgspec

from rawmm.rl.samples import Sample
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.loop import Trainer


def off_policy(sample: Sample, ratio: float) -> Sample:
    """`sample` as if the engine's policy gave its completion `1 / ratio` times the model's probability."""
    shift = math.log(ratio)
    logprobs = [lp - shift if on else lp for lp, on in zip(sample.logprobs, sample.loss_mask, strict=True)]
    return msgspec.structs.replace(sample, logprobs=logprobs)


def test_each_bound_clips_only_its_side(rollouts) -> None:  # noqa: ANN001
    config = rollouts.config.trainer
    assert (config.clip_ratio_low, config.clip_ratio_high) == (0.2, 0.28)
    # Ratio 1.25 is inside 1 + 0.28 (not clipped) but would be past 1 + 0.2; ratio 0.78 is past 1 - 0.2
    # (clipped) but would be inside 1 - 0.28. Each ratio goes where its advantage's sign makes it count:
    # above 1 a positive advantage is clipped, below 1 a negative one.
    samples = [off_policy(s, 1.25 if s.advantages[-1] > 0 else 0.78) for s in rollouts.standard_batch()]
    rollouts.write(1, samples)
    [result] = Trainer(rollouts.config, init_distributed()).run(1, batch_timeout=5)

    def tokens(positive: bool) -> int:
        return sum(sum(s.loss_mask) for s in samples if (s.advantages[-1] > 0) == positive)

    assert tokens(True) != tokens(False)  # swapped bounds would clip the other side's count
    assert result.clipped_fraction == tokens(False) / (tokens(True) + tokens(False))
