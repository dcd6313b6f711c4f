"""Held-out validation: the mean reward (with its standard error) on the validation split.

Runs through the same Rollouter and GenerateFn as training, so it measures exactly what the policy
does in the loop; greedy by default. Validation group ids start at `VALIDATION_GROUP_OFFSET` so
their request ids never collide with training groups.

The standard error is clustered by episode: the samples of one episode are not independent (they
share its question), so the unit is the episode's mean reward, SE = stdev(episode means) / sqrt(E).
More samples per episode sharpen each episode's mean; they do not multiply the count. The rise of
a run (last validation minus first) is paired by episode: d_e = after_e - before_e over the same
episodes, SE = stdev(d) / sqrt(E), z = mean(d) / SE (`rise`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.generator import GeneratorLostError
from torchtitan_rl.rollout.metrics import per_turn_reward_parts
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.types import RolloutGroup, RolloutStatus
from torchtitan_rl.types import GenerateFn, Sampling

logger = logging.getLogger(__name__)

VALIDATION_GROUP_OFFSET = 1 << 40
GREEDY_REFERENCE_GROUP_OFFSET = VALIDATION_GROUP_OFFSET + (1 << 39)


@dataclasses.dataclass(kw_only=True, slots=True)
class ValidationResult:
    reward_mean: float
    reward_stderr: float
    num_rollouts: int
    per_turn: dict[str, float] = dataclasses.field(default_factory=dict)
    """Mean of each per-turn reward part over the rollouts that reached the turn, keyed
    ``turn_{t}/{part}`` (t from 1), e.g. AlphabetSort's ``turn_2/turn_score``."""
    episode_means: list[float] = dataclasses.field(default_factory=list)
    """Each episode's mean reward over its samples, in the split's order (the clusters)."""
    task_errors: list[str] = dataclasses.field(default_factory=list)
    """``Rollout.error`` of every rollout the task's code failed (ERROR_ENV)."""
    groups: list[RolloutGroup] = dataclasses.field(default_factory=list, repr=False)
    """The validation's groups, in the split's order (the rollout recorder keeps them)."""
    constant_answer_reward: float | None = None
    """What the same episodes score with the task's most frequent answer (constant_answer.py);
    None where the task gives no such baseline."""
    greedy_reward: float | None = None
    """The same episodes' mean reward with greedy answers (`greedy_reference`); None when not
    measured."""

    def metrics(self, prefix: str = "validation") -> dict[str, float]:
        metrics = {f"{prefix}/reward_mean": self.reward_mean,
                   f"{prefix}/reward_stderr": self.reward_stderr,
                   **{f"{prefix}/{key}": value for key, value in self.per_turn.items()}}
        if self.constant_answer_reward is not None:
            metrics[f"{prefix}/constant_answer_reward"] = self.constant_answer_reward
        if self.greedy_reward is not None:
            metrics[f"{prefix}/greedy_reward"] = self.greedy_reward
        return metrics


class Validator(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        num_prompts: int = 64
        """Validation episodes per pass (the first of the task's validation split); 0 disables
        validation. More than the split holds is an error naming both numbers."""
        samples_per_prompt: int = 1
        """Rollouts per episode (more than 1 only makes sense with temperature > 0)."""
        temperature: float = 0.0
        """0 = greedy."""
        every_steps: int = 0
        """Also validate every this many steps; 0 = only before the first and after the last."""
        greedy_reference: bool = False
        """At the first validation, also score the same episodes with greedy answers (temperature
        0, one per episode): the level sampled validation approaches as GRPO sharpens the policy
        it starts from (docs/main_job.md), logged as ``validation/greedy_reward``, kept in
        summary.json and drawn as a reference line in reward_curve.png."""

        def __post_init__(self) -> None:
            for name in ("num_prompts", "every_steps"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
            if self.samples_per_prompt < 1:
                raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")

    def __init__(self, config: Config, *, rollouter: Rollouter, dataset: Sequence[Any]) -> None:
        if config.num_prompts > len(dataset):
            raise ConfigError(
                f"validation.num_prompts={config.num_prompts}: the task's validation split has "
                f"only {len(dataset)} episodes (ask for at most {len(dataset)}, or make the split "
                f"larger in [task])")
        self.config = config
        self.rollouter = rollouter
        self.dataset = dataset

    @property
    def enabled(self) -> bool:
        return self.config.num_prompts > 0

    def due(self, step: int) -> bool:
        return self.enabled and self.config.every_steps > 0 and step % self.config.every_steps == 0

    async def run(self, generate_fn: GenerateFn, sampling: Sampling, *,
                  greedy_reference: bool = False) -> ValidationResult:
        """Validate; with ``greedy_reference`` (and `Config.greedy_reference`) also measure the
        greedy reward of the same episodes."""
        cfg = self.config
        groups = await self._run_groups(
            generate_fn, dataclasses.replace(sampling, temperature=cfg.temperature),
            cfg.samples_per_prompt, VALIDATION_GROUP_OFFSET)
        greedy_reward = None
        if greedy_reference and cfg.greedy_reference:
            greedy = await self._run_groups(generate_fn, dataclasses.replace(
                sampling, temperature=0.0), 1, GREEDY_REFERENCE_GROUP_OFFSET)
            greedy_reward = statistics.fmean(r for g in greedy for r in g.rewards)
        rewards = [r for g in groups for r in g.rewards]
        mean = statistics.fmean(rewards) if rewards else float("nan")
        episode_means = [statistics.fmean(g.rewards) if g.rewards else float("nan")
                         for g in groups]
        per_turn = {f"turn_{turn}/{name}": statistics.fmean(values)
                    for (turn, name), values in per_turn_reward_parts(groups).items()}
        return ValidationResult(reward_mean=mean, reward_stderr=clustered_stderr(episode_means),
                                num_rollouts=len(rewards), per_turn=per_turn,
                                episode_means=episode_means, task_errors=task_errors(groups),
                                groups=groups, greedy_reward=greedy_reward)

    async def _run_groups(self, generate_fn: GenerateFn, sampling: Sampling,
                          samples_per_prompt: int, group_offset: int) -> list[RolloutGroup]:
        async def run_group(i: int) -> RolloutGroup:
            for attempt in itertools.count():
                try:
                    return await self.rollouter.run_group_rollouts(
                        generate_fn, self.dataset[i], group_offset + i, samples_per_prompt,
                        sampling, attempt=attempt,
                    )
                except GeneratorLostError as e:  # restarted whole, as training groups are
                    logger.warning("validation group %d restarts: %s", i, e)
            raise AssertionError("unreachable")

        try:
            async with asyncio.TaskGroup() as tasks:  # one failing group stops its siblings
                running = [tasks.create_task(run_group(i)) for i in range(self.config.num_prompts)]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None  # the cause, not a wrapper
        return [task.result() for task in running]


def task_errors(groups: list[RolloutGroup]) -> list[str]:
    """The errors of the rollouts that the task's code failed (ERROR_ENV)."""
    return [r.error or "?" for g in groups for r in g.rollouts
            if r.status is RolloutStatus.ERROR_ENV]


def clustered_stderr(episode_means: list[float]) -> float:
    """The standard error of the mean reward with the episodes as clusters (0 with one)."""
    values = [v for v in episode_means if math.isfinite(v)]
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclasses.dataclass(kw_only=True, slots=True)
class Rise:
    """The last validation minus the first, paired by episode."""

    rise: float
    stderr: float
    z: float | None
    """rise / stderr; None when the stderr is 0 (every episode moved alike, within 1e-12)."""


def rise(before: list[float], after: list[float]) -> Rise | None:
    """The rise from ``before`` to ``after`` (episode means of the same episodes, in order); None
    when they are not the same episodes (a count that differs)."""
    if not before or len(before) != len(after):
        return None
    differences = [a - b for a, b in zip(after, before) if math.isfinite(a - b)]
    if not differences:
        return None
    mean = statistics.fmean(differences)
    stderr = clustered_stderr(differences)
    # Below float noise the episodes moved alike: no spread to measure the rise against.
    return Rise(rise=mean, stderr=stderr, z=mean / stderr if stderr > 1e-12 else None)
