"""Advantage estimators by name (``rollouter.advantage``): a group's rewards -> one advantage per
rollout (and, with per-turn credit, per turn: the estimator sees each turn index's returns as a
group). Let G be the number of rollouts that count and r the mean of their rewards r_i:

    "grpo"                   A_i = (r_i - r) / d   GRPO (Shao et al. 2024, DeepSeekMath); d by
                                                   ``advantage_std``: "sample" (Bessel, + eps, as
                                                   verl and TRL), "population" (n, + eps), "none"
                                                   (d = 1: Dr. GRPO, Liu et al. 2025)
    "rloo"                   A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - r)
                                                   REINFORCE leave-one-out (Ahmadian et al. 2024)
    "reinforce_pp"           A_i = r_i, then whitened over the step's batch
                                                   REINFORCE++ (Hu et al. 2025)
    "reinforce_pp_baseline"  A_i = r_i - r, then whitened over the step's batch
                                                   REINFORCE++ with a group baseline
    "opo"                    A_i = r_i - b,  b = sum_j l_j r_j / sum_j l_j
                                                   OPO (Hao et al. 2025, "On-Policy RL with
                                                   Optimal Reward Baseline"): the length-weighted
                                                   baseline, l_j rollout j's generated tokens
                                                   (verl's "opo")
    "grpo_passk"             the best rollout (the first of the largest reward) gets
                                                   A = (r_max - r_second) / d, every other 0:
                                                   pass@k training (arXiv 2503.19595, as
                                                   verl's "grpo_passk"); d as "grpo"'s
    "gdpo"                   A_i = sum_k w_k (r_ik - mean_k) / (std_k + eps), then whitened
                                                   over the step's batch: GDPO (NVIDIA 2026,
                                                   arXiv 2601.05242; verl's "gdpo"): each reward
                                                   part k (``MessageEnv`` reward_parts, summed
                                                   over the rollout's turns) normalised in the
                                                   group on its own, std as "grpo"'s, so one
                                                   part's scale does not drown another's
    "gae"                    per token, from a learned critic's values in the trainer (PPO:
                                                   trainer/critic.py); the group's A_i = r_i here
                                                   only decides whether the group has a signal

"Whitened over the step's batch" (``step_advantages``, which the loop applies to the samples a
step trains on): every trained token's advantage minus the mean over the step's trained tokens,
divided by their std (Bessel) + eps, as verl's ``masked_whiten``.

Only the rollouts that count (``counted[i]``) enter the baseline; the others get None (no training).
A group whose counted rewards have zero spread carries no learning signal ("zero_std"), and a group
where nothing counts has none either ("all_errored"); ``rollouter.drop_zero_std_groups`` drops
such groups for every estimator (DAPO's dynamic-sampling filter). A group with one counted reward
has zero spread.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Literal

from torchtitan_rl.types import TrainingSample

AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo",
                             "grpo_passk", "gdpo", "gae"]
AdvantageStd = Literal["sample", "population", "none"]

STD_EPS = 1e-6
"""Added to the group std before dividing, so a near-constant group does not blow up."""

WHITEN_EPS = 1e-8
"""Added to the batch variance before its square root (verl's masked_whiten)."""


def group_std(values: list[float], kind: AdvantageStd) -> float:
    """The spread ``kind`` names; "none" still measures the population std (for zero_std)."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) if kind == "sample" else statistics.pstdev(values)


def grpo(values: list[float], advantage_std: AdvantageStd,
         lengths: list[int] | None = None) -> list[float]:
    mean = sum(values) / len(values)
    denom = _denominator(values, advantage_std)
    return [(r - mean) / denom for r in values]


def rloo(values: list[float], advantage_std: AdvantageStd,
         lengths: list[int] | None = None) -> list[float]:
    n = len(values)
    if n < 2:
        return [0.0] * n
    total = sum(values)
    return [r - (total - r) / (n - 1) for r in values]


def reinforce_pp(values: list[float], advantage_std: AdvantageStd,
                 lengths: list[int] | None = None) -> list[float]:
    return list(values)


def reinforce_pp_baseline(values: list[float], advantage_std: AdvantageStd,
                          lengths: list[int] | None = None) -> list[float]:
    mean = sum(values) / len(values)
    return [r - mean for r in values]


def opo(values: list[float], advantage_std: AdvantageStd,
        lengths: list[int] | None = None) -> list[float]:
    if lengths is None or len(lengths) != len(values):
        raise ValueError("advantage 'opo' needs each rollout's generated length")
    total_length = sum(lengths)
    if total_length == 0:  # nothing generated: the plain mean
        return reinforce_pp_baseline(values, advantage_std)
    baseline = math.fsum(n * r for n, r in zip(lengths, values)) / total_length
    return [r - baseline for r in values]


def grpo_passk(values: list[float], advantage_std: AdvantageStd,
               lengths: list[int] | None = None) -> list[float]:
    advantages = [0.0] * len(values)
    if len(values) < 2:
        return advantages
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    best, second = order[0], order[1]
    advantages[best] = (values[best] - values[second]) / _denominator(values, advantage_std)
    return advantages


def gdpo(components: list[list[float]], advantage_std: AdvantageStd,
         weights: list[float] | None = None) -> list[float]:
    """sum_k w_k * grpo(components[k]) per rollout: ``components[k]`` is reward part k of every
    rollout (w_k = 1 when ``weights`` is None)."""
    weights = weights if weights is not None else [1.0] * len(components)
    total = [0.0] * len(components[0])
    for weight, values in zip(weights, components, strict=True):
        for i, advantage in enumerate(grpo(values, advantage_std)):
            total[i] += weight * advantage
    return total


def _denominator(values: list[float], advantage_std: AdvantageStd) -> float:
    return group_std(values, advantage_std) + STD_EPS if advantage_std != "none" else 1.0


Estimator = Callable[[list[float], AdvantageStd, list[int] | None], list[float]]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "opo": opo,
    "grpo_passk": grpo_passk,
    "gdpo": reinforce_pp,  # group_advantages calls gdpo() with the reward parts
    "gae": reinforce_pp,  # the trainer replaces it with the critic's GAE
}

BATCH_WHITENED = frozenset({"reinforce_pp", "reinforce_pp_baseline", "gdpo"})
"""Estimators whose group advantages the loop whitens over each step's batch."""


def group_advantages(
    rewards: list[float], counted: list[bool], *, advantage_std: AdvantageStd,
    estimator: AdvantageEstimator = "grpo", lengths: list[int] | None = None,
    components: list[list[float]] | None = None, component_weights: list[float] | None = None,
) -> tuple[list[float | None], str | None]:
    """(advantage per rollout, reason the group has no learning signal or None). ``lengths``:
    each rollout's generated tokens (read by "opo"). ``components``: per reward part, its value
    for every rollout, and ``component_weights`` theirs (read by "gdpo"; None: the reward is the
    one part); "gdpo"'s group has no signal when no part has any spread.

    Example: rewards [1, 0, 0.5, 0.2], counted [T, T, T, F], grpo with advantage_std "none"
    -> mean 0.5 -> advantages [0.5, -0.5, 0.0, None], reason None. With "sample" the same group
    divides by stdev([1, 0, 0.5]) = 0.5 (+1e-6): [~1.0, ~-1.0, 0.0, None]. rloo: [0.75, -0.75,
    0.0, None].
    """
    if advantage_std not in ("sample", "population", "none"):
        raise ValueError(f"advantage_std must be 'sample', 'population' or 'none', got "
                         f"{advantage_std!r}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got "
                         f"{estimator!r}")
    if len(rewards) != len(counted):
        raise ValueError(f"{len(rewards)} rewards but {len(counted)} counted flags")
    if lengths is not None and len(lengths) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(lengths)} lengths")
    values = [r for r, c in zip(rewards, counted) if c]
    if not values:
        return [None] * len(rewards), "all_errored"
    counted_lengths = ([n for n, c in zip(lengths, counted) if c] if lengths is not None
                       else None)
    if estimator == "gdpo":
        parts = [[v for v, c in zip(part, counted) if c] for part in (components or [rewards])]
        computed = iter(gdpo(parts, advantage_std, component_weights if components else None))
        spread = any(group_std(part, "population") > 0.0 for part in parts)
        return [next(computed) if c else None for c in counted], (None if spread else "zero_std")
    computed = iter(ADVANTAGE_ESTIMATORS[estimator](values, advantage_std, counted_lengths))
    advantages = [next(computed) if c else None for c in counted]
    return advantages, ("zero_std" if group_std(values, "population") == 0.0 else None)


def turn_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1} of every turn (G after the last turn 0): per-turn credit's
    returns, which the estimator compares across the group's rollouts turn by turn."""
    to_go, returns = 0.0, []
    for reward in reversed(rewards):
        to_go = reward + gamma * to_go
        returns.append(to_go)
    return returns[::-1]


def step_advantages(samples: Sequence[TrainingSample], estimator: AdvantageEstimator
                    ) -> list[TrainingSample]:
    """The step's samples with the advantages they train on: whitened over the step for the
    estimators in ``BATCH_WHITENED``, as the rollouter gave them otherwise ("gae": the trainer's
    critic replaces them, trainer/critic.py)."""
    if estimator in BATCH_WHITENED:
        return whiten_advantages(samples)
    return list(samples)


def whiten_advantages(samples: Sequence[TrainingSample]) -> list[TrainingSample]:
    """Copies of ``samples`` whose trained tokens' advantages are whitened over all of them:
    (A - mean) / sqrt(var + eps), var with Bessel's correction; untrained tokens keep 0."""
    values = [a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    if len(values) < 2:
        return list(samples)
    mean = math.fsum(values) / len(values)
    var = math.fsum((a - mean) ** 2 for a in values) / (len(values) - 1)
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [dataclasses.replace(s, advantages=[(a - mean) * scale if m else a
                                               for a, m in zip(s.advantages, s.loss_mask)])
            for s in samples]
