"""GRPO advantages against values worked out by hand: (r - mean) / (population std + eps). The eps (1e-6)
moves each value by about 1e-6 of itself, hence rel=1e-5."""

from __future__ import annotations

import math

import pytest

from rawmm.rl.orchestrator.advantages import group_advantages


def test_one_success_in_four() -> None:
    # mean 1/4, population std sqrt(3)/4: the success gets +sqrt(3), each failure -1/sqrt(3).
    third = 1 / math.sqrt(3)
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx(
        [math.sqrt(3), -third, -third, -third], rel=1e-5
    )


def test_divides_by_the_population_std_not_the_sample_std() -> None:
    # mean 3, population std 1 (the sample std would be sqrt(2)).
    assert group_advantages([2.0, 4.0]) == pytest.approx([-1.0, 1.0], rel=1e-5)


def test_scale_of_the_rewards_does_not_matter() -> None:
    assert group_advantages([0.0, 10.0, 20.0]) == pytest.approx(group_advantages([0.0, 1.0, 2.0]), rel=1e-5)
    assert group_advantages([0.0, 1.0, 2.0]) == pytest.approx(
        [-math.sqrt(1.5), 0.0, math.sqrt(1.5)], rel=1e-5
    )


def test_equal_rewards_and_single_rollouts_learn_nothing() -> None:
    assert group_advantages([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    assert group_advantages([5.0]) == [0.0]
    assert group_advantages([]) == []
