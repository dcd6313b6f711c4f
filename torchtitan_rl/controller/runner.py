"""`run_job`: the single controller's whole run, top to bottom (see job.py for the config tree).

    model dir (+ warm start) -> check_job -> spawn meshes -> resume or validate "before"
    -> sync or async loop (RunContext.train_and_publish ends every step) -> validate "after"
    -> HF export + reward curve -> summary
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import time
from typing import Any

from torchtitan_rl.config.convert import to_data
from torchtitan_rl.controller.activity import BusyGenerateFn, IdleRatios
from torchtitan_rl.controller.data_cursor import DataCursor
from torchtitan_rl.controller.job import RLJob, check_job
from torchtitan_rl.controller.partial_rollout import ResumingGenerateFn
from torchtitan_rl.controller.run_context import RunContext
from torchtitan_rl.controller.run_state import (
    ControllerState,
    latest_complete_checkpoint,
    read_controller_state,
    restore_rng_state,
)
from torchtitan_rl.controller.setup import SpawnedActors, TrainerFactory, spawn_actors
from torchtitan_rl.controller.supervision import MeshFailureWatch, RunFailedError
from torchtitan_rl.controller.sync_loop import run_sync_loop
from torchtitan_rl.metrics.logger import MetricsLogger

logger = logging.getLogger(__name__)

_FRESH_RUN_OUTPUTS = ("checkpoints", "tensorboard", "metrics.jsonl", "rollouts", "hf",
                      "reward_curve.png", "summary.json", "trained_samples.jsonl")


def resolve_model_dir(config: RLJob.Config, task: Any) -> pathlib.Path:
    """The model the run starts from: the configured one, warm-started when enabled."""
    base = config.model.build().resolve()
    if not config.warm_start.enabled:
        return base
    from examples.alphabet_sort.solutions import solved_conversation

    train = task.dataset("train")
    return config.warm_start.build().run(
        base_model_dir=base,
        solved_conversation=lambda i: solved_conversation(
            train[i % len(train)], config.task.system_prompt),
        task_fingerprint=json.dumps(_train_split_fields(config.task), sort_keys=True),
        seed=config.seed,
    )


def _train_split_fields(task_config: Any) -> dict[str, Any]:
    """The task settings the warm start's training conversations depend on (validation-only and
    reward-only settings do not invalidate the cached warm start)."""
    data = to_data(task_config)
    for key in ("validation_names", "num_validation_episodes", "similarity_power",
                "power_per_turn"):
        data.pop(key, None)
    return data


def _prepare_run_dir(config: RLJob.Config) -> tuple[pathlib.Path, pathlib.Path | None]:
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.checkpoint.resume:
        resume_dir = latest_complete_checkpoint(run_dir / "checkpoints")
        if resume_dir is not None:
            return run_dir, resume_dir
        logger.warning("--checkpoint.resume: no complete checkpoint in %s; starting fresh",
                       run_dir / "checkpoints")
    for name in _FRESH_RUN_OUTPUTS:  # a fresh run never mixes with an older run's outputs
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return run_dir, None


async def run_job(config: RLJob.Config, *,
                  trainer_factory: TrainerFactory | None = None) -> dict[str, Any]:
    """``trainer_factory``: build the trainer client instead of spawning the trainer mesh (the
    torchrun launch, see spmd.py)."""
    from transformers import AutoTokenizer

    wall_start = time.perf_counter()
    run_dir, resume_dir = _prepare_run_dir(config)
    logger.info("run folder: %s", run_dir.resolve())
    task = config.task.build()
    model_dir = resolve_model_dir(config, task)
    check_job(config, model_dir)
    state = (read_controller_state(resume_dir) if resume_dir is not None
             else ControllerState(step=0, next_group_id=0))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with MeshFailureWatch() as watch:
        actors = await spawn_actors(config, model_dir, trainer_factory=trainer_factory)
        metrics_logger = config.metrics.build(run_dir=run_dir)
        try:
            try:
                await watch.run_until_failure(_drive(
                    config, actors, metrics_logger, tokenizer, run_dir, resume_dir, task, state))
            finally:
                metrics_logger.close()
                await actors.close()
        except Exception as e:
            if watch.failures:  # summarised after the close: every failure is reported by now
                raise RunFailedError(watch.summary()) from e
            raise

    summary = {
        "reward_before": state.validation_history[0][1] if state.validation_history else None,
        "reward_after": state.validation_history[-1][1] if state.validation_history else None,
        "steps": state.step,
        "wall_s": round(time.perf_counter() - wall_start, 1),
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("run folder: %s", run_dir.resolve())
    return summary


async def _drive(config: RLJob.Config, actors: SpawnedActors, metrics_logger: MetricsLogger,
                 tokenizer: Any, run_dir: pathlib.Path, resume_dir: pathlib.Path | None,
                 task: Any, state: ControllerState) -> None:
    """Everything between spawning the meshes and closing them."""
    from tqdm import tqdm

    if resume_dir is not None:
        await actors.trainer.load_checkpoint(resume_dir / "trainer")
        restore_rng_state(state.rng_state)
        await actors.trainer.push_weights(state.step)
        logger.info("resumed from %s at step %d", resume_dir, state.step)
    generate_fn = actors.router
    if config.loop.partial_rollout == "abort":
        generate_fn = ResumingGenerateFn(actors.router)
    generate_fn = BusyGenerateFn(generate_fn)
    rollouter = config.rollouter.build(tokenizer=tokenizer, make_env=task.make_env)
    train = task.dataset("train")
    sampling = config.sampling
    if sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=config.seed)
    ctx = RunContext(
        config=config, state=state, run_dir=run_dir, rollouter=rollouter,
        generate_fn=generate_fn, trainer=actors.trainer, tokenizer=tokenizer,
        train_dataset=train, cursor=DataCursor(num_prompts=len(train), seed=config.seed),
        sampling=sampling, metrics_logger=metrics_logger,
        recorder=config.recorder.build(run_dir=run_dir),
        validator=config.validation.build(rollouter=rollouter,
                                          dataset=task.dataset("validation")),
        metric_sources=[actors.router.metrics],
    )
    if resume_dir is not None:
        ctx.truncate_trained_log()
    validator = ctx.validator
    if validator.enabled and not state.validation_history:
        await ctx.validate(0)
    with tqdm(total=config.loop.num_steps, initial=state.step, desc="steps",
              dynamic_ncols=True) as progress:
        ctx.progress = progress
        ctx.idle_ratios = IdleRatios(generate_fn.clock)
        if config.loop.mode == "async":
            await config.async_loop.build(ctx=ctx).run()
        else:
            await run_sync_loop(ctx)
    if validator.enabled and (not state.validation_history
                              or state.validation_history[-1][0] != state.step):
        await ctx.validate(state.step)
    if config.checkpoint.export_hf:
        await actors.trainer.export_hf(run_dir / "hf")
    _plot(state, run_dir)


def _plot(state: ControllerState, run_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if state.reward_history:
        ax.plot(*zip(*state.reward_history), marker=".", label="train reward (sampled)")
    if state.validation_history:
        steps, means, errs = zip(*state.validation_history)
        ax.errorbar(steps, means, yerr=errs, marker="o", capsize=3, label="validation reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "reward_curve.png", dpi=100)
    plt.close(fig)
