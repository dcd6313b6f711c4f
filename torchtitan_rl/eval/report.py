"""What an evaluation measured: mean reward with its standard error, per-turn rewards, pass@k.

Pure functions of the validation groups (one group per held-out episode, ``samples_per_prompt``
rollouts each), so they are tested without an engine.

- reward: the Validator's own mean and standard error (stdev / sqrt(rollouts)), the numbers the
  job logs as ``validation/reward_mean`` and ``summary.json`` ``reward_after``.
- per turn: the mean (and standard error) of each reward part the environment reported for turn
  t (``RolloutTurn.reward_parts``, e.g. AlphabetSort's ``turn_score``), over the rollouts that
  reached turn t (a rollout that ended earlier has no turn t; the episode reward scores it 0).
- pass@k, k = samples per episode: the share of episodes with at least one rollout whose reward
  is >= the threshold (default 1.0: a perfect answer on AlphabetSort). pass@1 is the unbiased
  estimate, the mean over episodes of (passing rollouts / k).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rollout package imports transformers: not for `eval --help`
    from torchtitan_rl.rollout.types import RolloutGroup

DEFAULT_PASS_THRESHOLD = 1.0


@dataclasses.dataclass(kw_only=True, slots=True)
class TurnReward:
    turn: int
    """1-based turn number."""
    part: str
    mean: float
    stderr: float
    num_rollouts: int


@dataclasses.dataclass(kw_only=True, slots=True)
class EvalReport:
    reward_mean: float
    reward_stderr: float
    num_rollouts: int
    num_episodes: int
    samples_per_episode: int
    pass_threshold: float
    pass_at_1: float
    pass_at_k: float
    per_turn: list[TurnReward]
    episode_rewards: list[float] = dataclasses.field(default_factory=list)
    """Each episode's mean reward over its samples, in the split's order: two models evaluated
    on the same config compare paired by episode (the difference's standard error is the
    stdev of the per-episode differences / sqrt(episodes))."""

    def lines(self) -> list[str]:
        """The human lines, then one ``key=value`` line (what a script reads)."""
        k = self.samples_per_episode
        out = [f"reward: {self.reward_mean:.4f} +- {self.reward_stderr:.4f} "
               f"({self.num_episodes} episodes x {k} samples = {self.num_rollouts} rollouts)"]
        for t in self.per_turn:
            out.append(f"turn {t.turn}: {t.part} {t.mean:.4f} +- {t.stderr:.4f} "
                       f"({t.num_rollouts} rollouts reached it)")
        out.append(f"pass@1: {self.pass_at_1:.4f}" + (
            f"  pass@{k}: {self.pass_at_k:.4f}" if k > 1 else "")
            + f"  (a rollout passes at reward >= {self.pass_threshold:g})")
        values = {"reward_mean": self.reward_mean, "reward_stderr": self.reward_stderr,
                  "pass@1": self.pass_at_1}
        if k > 1:
            values[f"pass@{k}"] = self.pass_at_k
        values.update({f"turn{t.turn}_{t.part}": t.mean for t in self.per_turn})
        out.append(" ".join(f"{key}={value:.4f}" for key, value in values.items())
                   + f" rollouts={self.num_rollouts}")
        return out


def summarize(groups: Sequence[RolloutGroup], *, reward_mean: float, reward_stderr: float,
              pass_threshold: float = DEFAULT_PASS_THRESHOLD) -> EvalReport:
    """The report of ``groups``; the mean and standard error are the Validator's (passed in, so
    the command prints exactly what a job's validation logs)."""
    if not groups:
        raise ValueError("no validation groups to summarize")
    k = len(groups[0].rollouts)
    passes = [sum(r.reward >= pass_threshold for r in g.rollouts) for g in groups]
    from torchtitan_rl.rollout.metrics import per_turn_reward_parts

    parts = per_turn_reward_parts(list(groups))
    per_turn = [TurnReward(turn=turn, part=name, mean=statistics.fmean(values),
                           stderr=_stderr(values), num_rollouts=len(values))
                for (turn, name), values in parts.items()]
    return EvalReport(
        reward_mean=reward_mean, reward_stderr=reward_stderr,
        num_rollouts=sum(len(g.rollouts) for g in groups), num_episodes=len(groups),
        samples_per_episode=k, pass_threshold=pass_threshold,
        pass_at_1=statistics.fmean(p / len(g.rollouts) for p, g in zip(passes, groups)),
        pass_at_k=statistics.fmean(p > 0 for p in passes), per_turn=per_turn,
        episode_rewards=[statistics.fmean(r.reward for r in g.rollouts) for g in groups],
    )


def _stderr(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
