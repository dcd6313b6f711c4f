"""Group-relative advantages: A_i = (r_i - mean(r)) / d, d = std(r) + eps or 1.

Only the rollouts that count (``counted[i]``) enter the baseline; the others get None (no training).
A group whose counted rewards have zero spread carries no learning signal ("zero_std"), and a group
where nothing counts has none either ("all_errored").
"""

from __future__ import annotations

import statistics

STD_EPS = 1e-6
"""Added to the group std before dividing, so a near-constant group does not blow up."""


def group_advantages(
    rewards: list[float], counted: list[bool], *, std_normalize: bool
) -> tuple[list[float | None], str | None]:
    """(advantage per rollout, reason the group has no learning signal or None).

    Example: rewards [1, 0, 0.5, 0.2], counted [T, T, T, F], no std normalisation
    -> mean 0.5 -> advantages [0.5, -0.5, 0.0, None], reason None.
    """
    if len(rewards) != len(counted):
        raise ValueError(f"{len(rewards)} rewards but {len(counted)} counted flags")
    values = [r for r, c in zip(rewards, counted) if c]
    if not values:
        return [None] * len(rewards), "all_errored"
    mean = sum(values) / len(values)
    std = statistics.pstdev(values)
    denom = std + STD_EPS if std_normalize else 1.0
    advantages = [(r - mean) / denom if c else None for r, c in zip(rewards, counted)]
    return advantages, ("zero_std" if std == 0.0 else None)
