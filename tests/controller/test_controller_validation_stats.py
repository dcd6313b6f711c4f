"""Validation statistics (controller/loop/validation.py): the standard error clustered by episode,
and the rise between two validations paired by episode. Pure logic."""

from __future__ import annotations

import math
import statistics

import pytest

from torchtitan_rl.controller.loop.validation import clustered_stderr, rise


def test_more_samples_per_episode_do_not_shrink_the_clustered_stderr() -> None:
    episode_means = [0.2, 0.6, 0.4, 0.9]
    expected = statistics.stdev(episode_means) / 2
    assert clustered_stderr(episode_means) == pytest.approx(expected)
    # 4 samples an episode, each equal to the episode's mean: 16 "independent rollouts" would
    # give a standard error half as large; the clusters are still 4
    rollouts = [m for m in episode_means for _ in range(4)]
    assert statistics.stdev(rollouts) / math.sqrt(16) < expected
    assert clustered_stderr([statistics.fmean([m] * 4) for m in episode_means]) == expected
    assert clustered_stderr([0.5]) == 0.0
    assert clustered_stderr([0.5, float("nan"), 0.7]) == pytest.approx(
        statistics.stdev([0.5, 0.7]) / math.sqrt(2))


def test_the_rise_is_paired_by_episode() -> None:
    before = [0.1, 0.5, 0.3]
    after = [0.2, 0.7, 0.3]
    change = rise(before, after)
    assert change is not None
    assert change.rise == pytest.approx(0.1)
    assert change.stderr == pytest.approx(statistics.stdev([0.1, 0.2, 0.0]) / math.sqrt(3))
    assert change.z == pytest.approx(0.1 / change.stderr)
    # every episode moved alike: no spread, no z
    assert rise([0.1, 0.2], [0.3, 0.4]).z is None  # type: ignore[union-attr]
    assert rise([0.1, 0.2], [0.3]) is None  # not the same episodes
    assert rise([], []) is None
