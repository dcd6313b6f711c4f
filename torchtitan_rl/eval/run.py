"""Evaluate a model directory on a config's held-out validation episodes, exactly as a job's
validation does, without training.

    plan = RLJob(config with model.path = <model>, no warm start).resolve()   # the job's derivation
    one generator mesh (spawn_generator(plan.generators[0])): the configured engine, the job's seed
    Validator(plan.validation, rollouter=<the job's Rollouter, recording its groups>)
        .run(generator, plan.sampling)     # the job's code path: same episodes, request seeds,
                                           # sampling (validation temperature), reward and stats
    -> summarize(groups): reward +- stderr, per-turn rewards, pass@k           (report.py)

The Validator is used as is: the Rollouter it calls is wrapped to keep the groups it returns
(`RecordingRollouter`), so the mean and standard error printed are the Validator's own.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

from torchtitan_rl.assets.tokenizer import load_tokenizer
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.eval.report import DEFAULT_PASS_THRESHOLD, EvalReport, summarize
from torchtitan_rl.rollout.types import RolloutGroup

logger = logging.getLogger(__name__)


class RecordingRollouter:
    """A Rollouter that also keeps every group it returns (by group id)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.config = inner.config
        self.groups: dict[int, RolloutGroup] = {}

    async def run_group_rollouts(self, generate_fn: Any, episode: Any, group_id: int,
                                 group_size: int | None = None, sampling: Any = None, *,
                                 attempt: int = 0) -> RolloutGroup:
        group = await self.inner.run_group_rollouts(generate_fn, episode, group_id, group_size,
                                                    sampling, attempt=attempt)
        self.groups[group_id] = group
        return group


def eval_plan(config: Any, model_dir: pathlib.Path) -> Any:
    """The job's resolved plan with ``model_dir`` as the model and no warm start."""
    from torchtitan_rl.assets.model_source import ModelSource
    from torchtitan_rl.controller.job import RLJob

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model: {model_dir} is not an HF model directory (no config.json)")
    config = dataclasses.replace(
        config, model=ModelSource.Config(path=str(model_dir)),
        warm_start=dataclasses.replace(config.warm_start, enabled=False))
    plan = RLJob(config).resolve()
    if plan.validation.num_prompts == 0:
        raise ConfigError("validation.num_prompts is 0: no episodes to evaluate")
    return plan


async def evaluate(config: Any, model_dir: pathlib.Path | str, *,
                   pass_threshold: float = DEFAULT_PASS_THRESHOLD) -> EvalReport:
    """Run ``config``'s validation episodes on ``model_dir`` with one generator mesh."""
    from torchtitan_rl.generator import spawn_generator

    plan = eval_plan(config, pathlib.Path(model_dir))
    task = plan.task.build()
    tokenizer = load_tokenizer(plan.model_dir)
    rollouter = RecordingRollouter(plan.rollouter.build(tokenizer=tokenizer,
                                                        make_env=task.make_env))
    validator = plan.validation.build(rollouter=rollouter, dataset=task.dataset("validation"))
    generator = await spawn_generator(plan.generators[0], name="eval_generator")
    try:
        result = await validator.run(generator, plan.sampling)
    finally:
        await generator.close()
    groups = [rollouter.groups[g] for g in sorted(rollouter.groups)]
    logger.info("evaluated %s: reward %.4f +- %.4f (%d rollouts)", model_dir, result.reward_mean,
                result.reward_stderr, result.num_rollouts)
    return summarize(groups, reward_mean=result.reward_mean, reward_stderr=result.reward_stderr,
                     pass_threshold=pass_threshold)
