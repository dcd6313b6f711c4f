"""Rollout metrics over a batch of groups, as a flat {"area/name": float} dict.

Per rollout: turns, branches, reward, output tokens (all completion tokens of the rollout).
Counts: groups, rollouts, dropped groups by reason, drift events, special tokens sampled inside
replies (a pad or <|im_start|> token mid-reply is a symptom worth seeing, see
RolloutTurn.num_special_tokens); fractions per status; the share of prompt tokens the generator
took from its prefix cache (what multi-turn rollouts save by not prefilling earlier turns again).
"""

from __future__ import annotations

import statistics

from torchtitan_rl.rollout.packing import split_branches
from torchtitan_rl.rollout.types import RolloutGroup, RolloutStatus


def _summary(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}mean": statistics.fmean(values),
        f"{prefix}std": statistics.pstdev(values),
        f"{prefix}max": max(values),
    }


def per_turn_reward_parts(groups: list[RolloutGroup]) -> dict[tuple[int, str], list[float]]:
    """Every reward part the environment reported, by (1-based turn, part name), over the rollouts
    that reached that turn (e.g. AlphabetSort's ``(2, "turn_score")``: turn 2's scores)."""
    parts: dict[tuple[int, str], list[float]] = {}
    for group in groups:
        for rollout in group.rollouts:
            for turn in rollout.turns:
                for name, value in turn.reward_parts.items():
                    parts.setdefault((turn.turn_index + 1, name), []).append(float(value))
    return dict(sorted(parts.items()))


def rollout_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Metrics of every rollout in ``groups`` (dropped groups included: they were generated)."""
    rollouts = [r for g in groups for r in g.rollouts]
    metrics: dict[str, float] = {
        "rollout/num_groups": float(len(groups)),
        "rollout/num_rollouts": float(len(rollouts)),
        "rollout/num_groups_dropped_zero_std": float(
            sum(g.drop_reason == "zero_std" for g in groups)),
        "rollout/num_groups_dropped_all_errored": float(
            sum(g.drop_reason == "all_errored" for g in groups)),
        "rollout/num_drift_events": float(sum(r.num_drift_events for r in rollouts)),
        "rollout/num_special_tokens_in_replies": float(
            sum(r.num_special_tokens for r in rollouts)),
    }
    if not rollouts:
        return metrics
    metrics["rollout/num_turns"] = statistics.fmean(len(r.turns) for r in rollouts)
    metrics["rollout/branches_per_rollout"] = statistics.fmean(
        len(split_branches(r.turns)) for r in rollouts)
    metrics.update(_summary("rollout_reward/", [r.reward for r in rollouts]))
    for (turn, name), values in per_turn_reward_parts(groups).items():
        metrics[f"rollout_reward/turn_{turn}/{name}"] = statistics.fmean(values)
    turns = [t for r in rollouts for t in r.turns]
    if num_prompt_tokens := sum(len(t.prompt_token_ids) for t in turns):
        metrics["rollout/prefix_cache_hit_ratio"] = (
            sum(t.num_cached_prompt_tokens for t in turns) / num_prompt_tokens)
    metrics.update(_summary("rollout/output_tokens_",
                            [float(r.num_output_tokens) for r in rollouts]))
    for status in RolloutStatus:
        metrics[f"rollout/status/{status.value}"] = (
            sum(r.status is status for r in rollouts) / len(rollouts))
    return metrics
