"""The root of a run's config tree, and the single controller that runs it.

``RLJob.Config`` has one field per part of a run (each that part's own Config: ``trainer`` is a
``PolicyTrainer.Config``, ``loop`` a ``TrainingLoop.Config``, ...) plus the job-wide choices
(name, seed, how many generators and trainer ranks); ``--help`` lists them all.

    RLJob(config).run_async():
        resolve()                      -> ResolvedJob: every part's config derived and checked,
                                          nothing spawned (--print-resolved stops here)
        _open_run_folder               -> the newest complete checkpoint, or step 0
        _make_model                    -> the model directory (made offline; warm start cached)
        build_parts (spawn.py)         -> RunParts: the meshes and every part
        _train_restarting_the_trainer  -> continue_from (resume.py) a checkpoint, TrainingLoop.run
                                          (loop/loop.py), HF export, reward curve; a lost trainer:
                                          restart_trainer (trainer_restart.py), then again
        parts.close(); _write_summary  -> summary.json, ``reward_before=... reward_after=...``
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import pathlib
import statistics
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from torchtitan_rl.assets.model_source import ModelSource
from torchtitan_rl.assets.warm_start import WarmStart, warm_start_metrics
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.convert import to_data
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.run_name import check_run_name
from torchtitan_rl.console import short_report
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer, ControllerState
from torchtitan_rl.controller.checkpoint.resume_config import flat_config
from torchtitan_rl.controller.hosts.placement import Placement
from torchtitan_rl.controller.hosts.reaper import run_stoppable
from torchtitan_rl.controller.loop.loop import RunParts, TrainingLoop
from torchtitan_rl.controller.loop.validation import Rise, Validator, rise
from torchtitan_rl.controller.resolved_job import ResolvedJob
from torchtitan_rl.controller.resume import continue_from
from torchtitan_rl.controller.spawn import SpawnTrainer, build_parts
from torchtitan_rl.controller.supervision import MeshFailureWatch, RunFailedError
from torchtitan_rl.controller.trainer_restart import (
    SUPERVISION_REPORT_WAIT_S,
    lost_the_trainer,
    restart_trainer,
)
from torchtitan_rl.generator import Generator
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.metrics import step_breakdown
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.monarch_failures import is_supervision_error
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.token_env import chat_template_kwargs
from torchtitan_rl.task import SupervisedTask, TaskConfig
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import MonarchTrainerClient, PolicyTrainer
from torchtitan_rl.types import Sampling

logger = logging.getLogger(__name__)

SMOOTHING_STEPS = 10
"""The training reward's moving-average window in reward_curve.png."""

def _default_rollouter() -> Rollouter.Config:
    return Rollouter.Config(group_size=8)


class RLJob(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        moved_keys = {"async_loop": "moved into [loop]: loop.staleness.max_staleness (and the "
                                    "off-policy correction into trainer.loss.off_policy)"}
        toml_comments = {"generator.sampling": "Unused in a job: every request carries "
                                               "[sampling] (a job refuses other values here)."}

        name: str = "run"
        """Run name; the run folder is `<output_dir>/<name>`. One folder name: no '/', '\\', '.',
        '..', leading '-' or surrounding spaces, not empty."""
        output_dir: str = "runs"
        """Where run folders go (any path)."""
        seed: int = 0
        """The run's one seed: data order, request sampling seeds, the engines and the trainer
        (each part's own `seed` field is set from it)."""
        model: ModelSource.Config = dataclasses.field(default_factory=ModelSource.Config)
        warm_start: WarmStart.Config = dataclasses.field(default_factory=WarmStart.Config)
        task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
        """The task: `type` names its class (`package.module:Class`), the rest are its settings."""
        rollouter: Rollouter.Config = dataclasses.field(default_factory=_default_rollouter)
        sampling: Sampling = dataclasses.field(default_factory=Sampling)
        generator: Generator.Config = dataclasses.field(default_factory=Generator.Config)
        placement: Placement.Config = dataclasses.field(default_factory=Placement.Config)
        """Which hosts the trainer and the generators run on (default: this machine)."""
        num_generators: int = 1
        """Generator meshes (each `generator.tensor_parallel_degree` procs)."""
        generator_tensor_parallel_degrees: list[int] = dataclasses.field(default_factory=list)
        """One per generator, in place of generator.tensor_parallel_degree: a mixed pool, e.g.
        [1, 2] (empty: every generator takes generator.tensor_parallel_degree)."""
        router: GeneratorRouter.Config = dataclasses.field(default_factory=GeneratorRouter.Config)
        trainer: PolicyTrainer.Config = dataclasses.field(default_factory=PolicyTrainer.Config)
        num_trainer_ranks: int = 1
        """Trainer procs (= data_parallel_shard_degree x tensor_parallel_degree)."""
        verify_weight_push: bool = False
        """After each push, read the generators' weights back and compare bitwise (slow)."""
        batcher: Batcher.Config = dataclasses.field(default_factory=Batcher.Config)
        loop: TrainingLoop.Config = dataclasses.field(default_factory=TrainingLoop.Config)
        validation: Validator.Config = dataclasses.field(default_factory=Validator.Config)
        checkpoint: Checkpointer.Config = dataclasses.field(default_factory=Checkpointer.Config)
        metrics: MetricsLogger.Config = dataclasses.field(default_factory=MetricsLogger.Config)
        recorder: RolloutRecorder.Config = dataclasses.field(default_factory=RolloutRecorder.Config)

        def __post_init__(self) -> None:
            check_run_name("name", self.name)
            if self.num_generators < 1:
                raise ValueError(f"num_generators must be >= 1, got {self.num_generators}")
            if self.num_trainer_ranks < 1:
                raise ValueError(f"num_trainer_ranks must be >= 1, got {self.num_trainer_ranks}")
            if (self.rollouter.advantage == "gae") != self.trainer.critic.enabled:
                raise ValueError("rollouter.advantage = 'gae' and trainer.critic.enabled go "
                                 "together (GAE needs the critic's values; the critic trains "
                                 f"for GAE): got {self.rollouter.advantage!r} and "
                                 f"{self.trainer.critic.enabled}")
            if self.trainer.weight_transport == "shared_memory" and self.placement.kind == "process":
                raise ValueError("trainer.weight_transport='shared_memory' cannot reach the "
                                 "generators of placement.kind='process' (each simulated host is "
                                 "a machine of its own); use 'auto' or 'message'")

        @property
        def run_dir(self) -> pathlib.Path:
            return pathlib.Path(self.output_dir) / self.name

    def __init__(self, config: Config) -> None:
        self.config = config

    # ---- the one place where the user's config becomes what each part gets ----------------------
    def resolve(self) -> ResolvedJob:
        """Every part's config, derived and checked (makes a missing offline model; never trains)."""
        c = self.config
        for key, part in (("generator", c.generator), ("trainer", c.trainer),
                          ("rollouter", c.rollouter)):
            if part.seed != type(part)().seed:
                raise ConfigError(f"{key}.seed: a job's parts take the job's seed; set seed "
                                  f"instead (got {key}.seed={part.seed})")
        if c.generator.model_dir is not None:
            raise ConfigError("generator.model_dir: set the model once, with model.path")
        base = c.model.build().resolve(c.task)
        fingerprint = _warm_start_fingerprint(c.task, c.rollouter.enable_thinking)
        model_dir = base
        if c.warm_start.enabled:
            model_dir = c.warm_start.build().output_dir(base, fingerprint, c.seed)
        generator = dataclasses.replace(c.generator, model_dir=str(model_dir), seed=c.seed)
        lora = c.trainer.lora
        if lora.enabled and lora.push == "adapter":  # the engines serve the pushed adapters
            try:
                generator = dataclasses.replace(generator, lora_rank=lora.rank,
                                                lora_alpha=lora.alpha)
            except ValueError as e:
                raise ConfigError(f"trainer.lora.push = 'adapter': {e}; or use "
                                  "trainer.lora.push = 'merged'") from None
        degrees = c.generator_tensor_parallel_degrees
        if degrees and len(degrees) != c.num_generators:
            raise ConfigError(f"generator_tensor_parallel_degrees has {len(degrees)} entries for "
                              f"num_generators={c.num_generators}: give one per generator")
        try:
            generators = [dataclasses.replace(generator, tensor_parallel_degree=tp)
                          for tp in degrees] or [generator] * c.num_generators
        except ValueError as e:
            raise ConfigError(f"generator_tensor_parallel_degrees={degrees}: {e}") from None
        trainer = dataclasses.replace(c.trainer, seed=c.seed,
                                      loss=c.loop.resolved_loss(c.trainer.loss))
        sampling = c.sampling if c.sampling.seed is not None else dataclasses.replace(
            c.sampling, seed=c.seed)
        plan = ResolvedJob(
            run_dir=str(c.run_dir), seed=c.seed, base_model_dir=str(base),
            model_dir=str(model_dir), warm_start=c.warm_start if c.warm_start.enabled else None,
            warm_start_fingerprint=fingerprint, task=c.task,
            rollouter=dataclasses.replace(c.rollouter, seed=c.seed), sampling=sampling,
            generators=generators, placement=c.placement, router=c.router, trainer=trainer,
            num_trainer_ranks=c.num_trainer_ranks, verify_weight_push=c.verify_weight_push,
            batcher=c.batcher, loop=c.loop, validation=c.validation, checkpoint=c.checkpoint,
            metrics=c.metrics, recorder=c.recorder,
        )
        plan.check()
        return plan

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The run; SIGTERM and Ctrl-C close it as an error does, then raise RunStopped."""
        return run_stoppable(self.run_async())

    async def run_async(self, *,
                        spawn_trainer: SpawnTrainer | None = None) -> dict[str, Any]:
        """Resolve, open the run folder, make the model, spawn the parts, train (a lost trainer
        restarted), close, summarise. ``spawn_trainer``: the torchrun ranks in place of a trainer
        mesh (torchrun.py)."""
        wall_start = time.perf_counter()
        self._loops: list[TrainingLoop] = []
        self._wall_s = dict.fromkeys(("model", "warm_start", "start_up", "export", "shutdown"),
                                     0.0)
        """Where the run's wall time went, beside its loops' own (summary.json)."""
        # In a thread: SIGTERM or Ctrl-C while a missing model is made stops the run at once
        # (the model is finished, never left half-written; nothing is spawned).
        plan = await asyncio.to_thread(self.resolve)
        checkpointer, resume_dir, state, resumed = self._open_run_folder(plan)
        mark = self._lap("model", wall_start)
        await _make_model(plan)
        mark = self._lap("warm_start", mark)
        _dump_tasks_on_sigusr1()
        with MeshFailureWatch() as watch:
            parts = await build_parts(
                plan, checkpointer=checkpointer, spawn_trainer=spawn_trainer,
                on_fatal=watch.fail, resume_step=state.step if resume_dir is not None else None)
            self._lap("start_up", mark)
            watch.attach(parts.generators, parts.workers)
            if isinstance(parts.trainer, MonarchTrainerClient) and plan.trainer.max_restarts:
                watch.watch_trainer(parts.trainer.mesh_name)  # torchrun owns its ranks: not here
            async with _mesh_failures_in_one_line(watch):
                # The start-up heap (torch, transformers, Monarch) lives as long as the run:
                # frozen, garbage collections scan only what the run makes (vLLM's engine does
                # the same); unfrozen after, for callers that go on.
                gc.freeze()
                try:
                    state, restored_from = await self._train_restarting_the_trainer(
                        plan, parts, watch, resume_dir, state)
                finally:
                    mark = time.perf_counter()
                    await parts.close()
                    self._lap("shutdown", mark)
                    gc.unfreeze()
        return _write_summary(plan, state, resumed, restored_from, wall_start,
                              self._run_report(plan, state))

    def _lap(self, part: str, since: float) -> float:
        """Add the time from ``since`` to now to ``part`` of the wall-time breakdown; now."""
        now = time.perf_counter()
        self._wall_s[part] += now - since
        return now

    def _run_report(self, plan: ResolvedJob, state: ControllerState) -> dict[str, Any]:
        """What the summary says beside the rewards: how many steps trained, collapsed answers,
        the constant-answer baseline, and where the wall time went (model: resolving the config
        and making a missing base model; warm start; start-up: spawning the parts; the loops'
        validation, steps and checkpoints; export; shutdown)."""
        loops = self._loops
        wall = {part: self._wall_s[part] for part in ("model", "warm_start", "start_up")}
        for part in ("validation", "steps", "checkpoints"):
            wall[part] = sum(loop.wall_s[part] for loop in loops)
        wall.update(export=self._wall_s["export"], shutdown=self._wall_s["shutdown"])
        collapse = next((loop.health.collapse for loop in loops if loop.health.collapse), None)
        baseline = next((loop.constant_answer for loop in loops if loop.constant_answer), None)
        return {
            "trained_steps": state.step - len(state.untrained_steps),
            "untrained_steps": len(state.untrained_steps),
            "answer_collapse": collapse.to_data() if collapse is not None else None,
            "constant_answer_reward": baseline.reward if baseline is not None else None,
            "wall_s_breakdown": {part: round(seconds, 2) for part, seconds in wall.items()},
        }

    def _open_run_folder(self, plan: ResolvedJob) -> tuple[
            Checkpointer, pathlib.Path | None, ControllerState, dict[str, Any]]:
        """The checkpointer over the run folder, and where the run starts: the newest complete
        checkpoint (its directory and state; the step logs past it dropped) or step 0."""
        run_dir = pathlib.Path(plan.run_dir)
        checkpointer = plan.checkpoint.build(
            run_dir=run_dir, num_steps=plan.loop.num_steps,
            step_logs=[run_dir / "metrics.jsonl", run_dir / plan.recorder.path],
            job_config=flat_config(self.config))  # saved with each checkpoint, checked on resume
        found = checkpointer.prepare_run_dir()
        logger.info("run folder: %s", run_dir.resolve())
        if found is None:
            return checkpointer, None, ControllerState(step=0, next_group_id=0), {
                "resumed_from_step": None}
        resume_dir, state = found
        checkpointer.forget_steps_from(state.step)
        return checkpointer, resume_dir, state, {
            "resumed_from_step": state.step, "resumed_finished_groups": len(state.finished),
            "resumed_in_flight_groups": len(state.in_flight)}

    async def _train_restarting_the_trainer(
            self, plan: ResolvedJob, parts: RunParts, watch: MeshFailureWatch,
            resume_dir: pathlib.Path | None, state: ControllerState,
    ) -> tuple[ControllerState, list[int]]:
        """Train; a lost trainer is replaced and the run goes on from the newest checkpoint, at
        most trainer.max_restarts times. Returns the final state and the step each restart went
        back to (0: the run's start)."""
        restored_from: list[int] = []
        while True:
            try:
                await watch.run_until_failure(self._train(plan, parts, resume_dir, state))
                return state, restored_from
            except Exception as e:
                if not await lost_the_trainer(watch, e):
                    raise
                if len(restored_from) == plan.trainer.max_restarts:
                    raise RunFailedError(
                        f"the trainer was lost {len(restored_from) + 1} times "
                        f"(trainer.max_restarts={plan.trainer.max_restarts}): "
                        f"{short_report(watch.trainer_lost or '')}; a rerun resumes from the "
                        f"newest checkpoint") from e
            state = await restart_trainer(plan, parts, watch, restart=len(restored_from) + 1)
            resume_dir = None  # restored already
            restored_from.append(state.step)

    async def _train(self, plan: ResolvedJob, parts: RunParts, resume_dir: pathlib.Path | None,
                     state: ControllerState) -> None:
        """Everything between spawning the meshes and closing them; updates ``state``."""
        from torchtitan_rl.console import progress_bar

        if resume_dir is not None:
            await continue_from(parts, resume_dir, state)
        elif state.step == 0 and not self._loops:  # a fresh run: its model's warm-start loss
            if warm := warm_start_metrics(pathlib.Path(plan.model_dir)):
                parts.metrics.log(0, warm)
        with progress_bar(total=plan.loop.num_steps, initial=state.step,
                          desc="GRPO steps") as progress:
            loop = plan.loop.build(parts=parts, state=state, progress=progress)
            self._loops.append(loop)
            await loop.run()
        run_dir = pathlib.Path(plan.run_dir)
        if plan.checkpoint.export_hf:
            mark = time.perf_counter()
            await parts.trainer.export_hf(run_dir / "hf")
            self._lap("export", mark)
        _plot(state, run_dir)
        step_breakdown.plot(run_dir)
        parts.recorder.write_viewer()


@contextlib.asynccontextmanager
async def _mesh_failures_in_one_line(watch: MeshFailureWatch) -> AsyncIterator[None]:
    """A run ended by failed meshes raises one RunFailedError naming them (summarised after the
    parts are closed: every failure is in by then). The run's own error passes unchanged, not
    masked by failures of the meshes it stopped."""
    try:
        yield
    except RunFailedError as e:
        if watch.failures:
            raise RunFailedError(watch.summary()) from e
        raise
    except Exception as e:
        if is_supervision_error(e):  # a call to a dead actor: say which, in one line
            # The call's error names the proc's first actor (often Monarch's own); the
            # supervision report that follows names ours.
            await watch.wait_for_failure(timeout_s=SUPERVISION_REPORT_WAIT_S)
            raise RunFailedError(watch.summary() if watch.failures else
                                 "actor mesh failure: " + " ".join(str(e).split())) from e
        raise


def _write_summary(plan: ResolvedJob, state: ControllerState, resumed: dict[str, Any],
                   restored_from: list[int], wall_start: float,
                   report: dict[str, Any]) -> dict[str, Any]:
    """summary.json in the run folder: the rewards before and after, the rise between them
    paired by episode (validation.py), steps, wall time, resume and restarts, and ``report``
    (`RLJob._run_report`: trained steps, collapse, the constant-answer baseline, the wall time's
    breakdown)."""
    history = state.validation_history
    change = _run_rise(state)
    summary = {
        "reward_before": history[0][1] if history else None,
        "reward_after": history[-1][1] if history else None,
        "rise": change.rise if change else None,
        "rise_stderr": change.stderr if change else None,
        "rise_z": change.z if change else None,
        "reward_after_per_turn": state.validation_per_turn,
        "greedy_reward_before": state.greedy_reward,
        "steps": state.step,
        "wall_s": round(time.perf_counter() - wall_start, 1),
        **report,
        "run_dir": plan.run_dir,
        **resumed,
        "trainer_restarts": len(restored_from),
        "trainer_restored_from_steps": restored_from,
    }
    (pathlib.Path(plan.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("run folder: %s", pathlib.Path(plan.run_dir).resolve())
    return summary


def _dump_tasks_on_sigusr1() -> None:
    """``kill -USR1 <controller pid>`` logs where every task of the run waits (a stuck run)."""
    import signal

    from torchtitan_rl.controller.supervision import task_stacks

    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: logger.warning("where the run waits:\n%s", task_stacks()))


def _warm_start_fingerprint(task: TaskConfig, enable_thinking: bool | None = None) -> str:
    """The task settings the warm start's training conversations depend on, and the chat
    template's thinking mode they are rendered in (`rollouter.enable_thinking`; when None the key
    is the task's settings alone)."""
    task = task.warm_start_config()
    data = to_data(task)
    independent = type(task).warm_start_independent_fields
    unknown = [key for key in independent if key not in data]
    if unknown:  # a typo here would keep a stale warm start without a word
        raise ConfigError(f"{type(task).__qualname__}.warm_start_independent_fields names "
                          f"{unknown}, which are not fields of the task's Config")
    for key in independent:
        data.pop(key)
    if enable_thinking is not None:
        data = {"task": data, "rollouter.enable_thinking": enable_thinking}
    return json.dumps(data, sort_keys=True)


async def _make_model(plan: ResolvedJob) -> None:
    """Train the warm start into ``plan.model_dir`` unless it is cached there. It trains in a
    worker thread, so the event loop stays free for SIGTERM and Ctrl-C (hosts/reaper.py
    run_stoppable): cancelled, the warm start stops between two of its steps, writing nothing."""
    if plan.warm_start is None:
        return
    task = plan.task.build()
    assert isinstance(task, SupervisedTask)  # ResolvedJob.check
    train = task.dataset("train")
    stop = threading.Event()
    training = asyncio.ensure_future(asyncio.to_thread(
        plan.warm_start.build().run,
        base_model_dir=pathlib.Path(plan.base_model_dir), out=pathlib.Path(plan.model_dir),
        solved_conversation=lambda i: task.solved_conversation(train[i % len(train)]),
        seed=plan.seed, chat_template_kwargs=chat_template_kwargs(plan.rollouter.enable_thinking),
        stop=stop))
    try:
        await asyncio.shield(training)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait([training])  # the thread ends at its next step
        if not training.cancelled():
            training.exception()  # WarmStartStopped: retrieved, the run's stop is the news
        raise


def _run_rise(state: ControllerState) -> Rise | None:
    """The first validation to the last, paired by episode (None before a second validation)."""
    if len(state.validation_history) < 2:
        return None
    return rise(state.first_validation_episode_means, state.last_validation_episode_means)


def _plot(state: ControllerState, run_dir: pathlib.Path) -> None:
    """reward_curve.png: each step's training reward (faint) and its moving average over
    `SMOOTHING_STEPS` steps, every validation with its standard error (clustered by episode), and
    the start's greedy reward as a reference line (`validation.greedy_reference`); the title gives
    the rise from the first validation to the last, paired by episode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if state.reward_history:
        steps, rewards = zip(*state.reward_history)
        ax.plot(steps, rewards, color="tab:blue", alpha=0.3, linewidth=1,
                label="train reward (each step)")
        smoothed = [statistics.fmean(rewards[max(0, i - SMOOTHING_STEPS + 1):i + 1])
                    for i in range(len(rewards))]
        ax.plot(steps, smoothed, color="tab:blue", linewidth=2,
                label=f"train reward ({SMOOTHING_STEPS}-step mean)")
    if state.validation_history:
        steps, means, errs = zip(*state.validation_history)
        ax.errorbar(steps, means, yerr=errs, color="tab:orange", marker="o", capsize=4,
                    linewidth=2, label="validation reward (+- standard error)")
    if state.greedy_reward is not None:
        ax.axhline(state.greedy_reward, color="tab:gray", linestyle="--", linewidth=1.5,
                   label="the start's greedy answers (where sharpening leads)")
    history = state.validation_history
    change = _run_rise(state)
    if change is not None:
        z = f", {change.z:.1f} standard errors" if change.z is not None else ""
        ax.set_title(f"validation {history[0][1]:.3f} -> {history[-1][1]:.3f}: "
                     f"{change.rise:+.3f}{z} (paired by episode)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "reward_curve.png", dpi=100)
    plt.close(fig)
