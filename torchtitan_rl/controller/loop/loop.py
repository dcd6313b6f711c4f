"""The training loop: groups are generated and trained within a staleness bound (S = 0: sync).

    producer:  gate.admit() -> group g at policy version v -> task: rollouter.run_group_rollouts(
               task.dataset("train")[cursor.prompt_index(g)]) in this process, or in a rollout
               worker (rollouter.num_workers > 0: workers.run_group(g, prompt index) -> the
               group and its packed samples) -> gate.finish(g, samples)
               (a group that lost its generator restarts whole from its prompt)
    trainer:   gate.take_step_groups(step) -> P finished groups -> trainer.train_step(samples)
               -> generators.push_weights(step + 1) -> gate.publish_policy_version(step + 1)
               -> metrics, trained_samples.jsonl, rollouts JSONL -> validation / checkpoint when due

The bound (staleness.py): a group admitted at version v is trained at a step <= v + S. S = 0 is
synchronous training: the producer admits exactly one step's groups and waits, so every step
generates with the newest weights, then trains. S >= 1 overlaps generation and training.

Validation always runs in this process (parts.generate_fn), workers or not. Each step logs
rollout/controller_cpu_ms_per_turn: this process's CPU time (every thread, Monarch's too) while
it waits for the step's groups (from the end of the previous step to taking them), per turn
trained; rollout work that overlaps training, the push, metrics or validation is not counted.

Resume: groups finished but untrained at the checkpoint come back with their samples; groups in
flight restart from their prompts (same group id -> same prompt and request seeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from torchtitan_rl import faults
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import CONSOLE
from torchtitan_rl.controller.checkpoint.checkpointer import (
    Checkpointer,
    ControllerState,
    FinishedGroup,
)
from torchtitan_rl.controller.fleet.generator_pool import GeneratorPool
from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.controller.loop.constant_answer import ConstantAnswer, constant_answer_baseline
from torchtitan_rl.controller.loop.data_cursor import DataCursor
from torchtitan_rl.controller.loop.idle_ratios import IdleRatios
from torchtitan_rl.controller.loop.run_health import RunHealth
from torchtitan_rl.controller.loop.staleness import StalenessGate
from torchtitan_rl.controller.loop.validation import Validator, task_errors
from torchtitan_rl.controller.rollout_workers.pool import RolloutWorkerLostError, RolloutWorkerPool
from torchtitan_rl.controller.supervision import RunFailedError
from torchtitan_rl.generator import GeneratorLostError
from torchtitan_rl.generator.engine_stats import engine_metrics, trace_engine_steps
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.metrics.step_breakdown import BREAKDOWN_PREFIX
from torchtitan_rl.rollout import rollout_group_to_training_samples, rollout_metrics
from torchtitan_rl.rollout.advantage import step_advantages
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.task_errors import summarise_task_errors
from torchtitan_rl.rollout.types import RolloutGroup
from torchtitan_rl.task import Task
from torchtitan_rl.trainer.loss import PolicyLoss
from torchtitan_rl.trainer.off_policy import OffPolicyCorrection, token_tis
from torchtitan_rl.trainer.timeline import trace_trainer_ranks
from torchtitan_rl.trainer.trainer import TrainerClient
from torchtitan_rl.types import GenerateFn, Sampling, TrainingSample

if TYPE_CHECKING:  # transformers is heavy to import; only its type is named here
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_MODE_REMOVED = ("the loop is one loop now: set loop.staleness.max_staleness = 0 for synchronous "
                 "training (what mode = 'sync' was) or >= 1 for asynchronous")


def _default_staleness() -> StalenessGate.Config:
    return StalenessGate.Config(max_staleness=0)


@dataclasses.dataclass(kw_only=True, slots=True)
class RunParts:
    """What the loop works with, spawned and built by controller/spawn.py."""

    task: Task
    tokenizer: PreTrainedTokenizerBase
    """The model's HF tokenizer (decoding rollouts for the recorder)."""
    cursor: DataCursor
    rollouter: Rollouter
    group_size: int
    sampling: Sampling
    """Training rollouts' sampling (its seed is the base of every request seed)."""
    generate_fn: GenerateFn
    """The generators' router (generator/router.py), wrapped to resume aborted requests
    (generator/partial_rollout.py) when loop.partial_rollout = "abort"."""
    generators: GeneratorPool
    trainer: TrainerClient
    hosts: RunHosts
    validator: Validator
    checkpointer: Checkpointer
    metrics: MetricsLogger
    recorder: RolloutRecorder
    workers: RolloutWorkerPool | None = None
    """Rollout workers (rollouter.num_workers > 0); None: rollouts run in this process."""

    async def close(self) -> None:
        """Close the meshes (rollout workers first: they borrow the generators; then the
        generators and the trainer together: the generators' close cancels a replacement in
        progress, which pushes from the trainer, before it awaits anything; the hosts last) and
        the metrics files; a failure to close one is logged, not raised."""
        self.metrics.close()
        await _logged_close(getattr(self.task, "aclose", None))  # a task's server (AgentTask's)
        await _logged_close(self.workers.close if self.workers is not None else None)
        await asyncio.gather(_logged_close(self.generators.close),
                             # a gone host's procs cannot answer a close: the job's end ends them
                             _logged_close(None if self.hosts.trainer_host_lost
                                           else self.trainer.close))
        await _logged_close(self.hosts.close)


async def _logged_close(close: Callable[[], Awaitable[None]] | None) -> None:
    if close is None:
        return
    try:
        await close()
    except Exception as e:
        logger.warning("shutdown: %r", e)


@dataclasses.dataclass(kw_only=True, slots=True)
class _GroupResult:
    finished: FinishedGroup
    group: RolloutGroup | None
    """The live group (None for groups restored from a checkpoint)."""


class TrainingLoop(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        moved_keys = {"mode": _MODE_REMOVED, "prompts_per_step": "renamed loop.groups_per_step"}

        num_steps: int = 10
        """Optimizer steps to run."""
        groups_per_step: int = 8
        """Rollout groups (one prompt each, `rollouter.group_size` rollouts) a step trains on."""
        staleness: StalenessGate.Config = dataclasses.field(default_factory=_default_staleness)
        """max_staleness S: 0 = synchronous, 1 = one-step-off, ... (see staleness.py)."""
        partial_rollout: Literal["none", "abort"] = "none"
        """none: requests run to their end on the weights they started with (hot swap and
        weight_sync settings decide what happens at a pull). abort: at each weight push,
        running requests are aborted and resumed as prompt + partial tokens on the new weights
        (per-token logprobs and versions kept). Needs S >= 1."""
        off_policy_correction: Literal["auto", "tis", "none"] | None = None
        """Deprecated (None: not set; the correction is set in one place,
        ``trainer.loss.off_policy``): loads with a warning as token-level truncated IS at
        ``tis_cap`` (default 2.0), no masks, with trainer.loss.off_policy.enabled = "auto" /
        "on" / "off" for "auto" / "tis" / "none"."""
        tis_cap: float | None = None
        """Deprecated (None: not set): see ``off_policy_correction``. >= 1."""
        replace_dropped_groups: int = 0
        """Dynamic sampling (DAPO): up to this many groups a step, dropped for carrying no signal
        (``rollouter.drop_zero_std_groups``), are replaced by new groups, so a step trains on
        ``groups_per_step`` groups that all carry one; past it a dropped group counts toward its
        step (trains nothing). 0: off, a step trains on the groups it got. Counted in
        ``async/groups_replaced``; the replaced ids are in trained_samples.jsonl."""
        max_task_error_fraction: float = 0.5
        """A step (or a validation) where more than this share of the rollouts failed in the
        task's own code (its env, scorer or agent raised, or returned a reward that is not a
        number: ERROR_ENV) stops the run with one line naming the task, the error and where it
        was raised, exit 1, before anything is trained on them. Below it the failures are
        counted (rollout/status/error_env) and summarised in one warning line per step. In
        [0, 1]; 1 never stops."""
        max_skipped_steps_in_row: int = 3
        """A step whose loss or gradient norm is not finite keeps the weights (no optimizer step,
        no push; counted in trainer/num_skipped_steps); this many in a row fail the run."""

        def __post_init__(self) -> None:
            if self.num_steps < 0:
                raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
            if self.groups_per_step < 1:
                raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
            if self.tis_cap is not None and self.tis_cap < 1:
                raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")
            if self.replace_dropped_groups < 0:
                raise ValueError(f"replace_dropped_groups must be >= 0, got "
                                 f"{self.replace_dropped_groups}")
            if not 0 <= self.max_task_error_fraction <= 1:
                raise ValueError(f"max_task_error_fraction must be in [0, 1], got "
                                 f"{self.max_task_error_fraction}")
            if self.max_skipped_steps_in_row < 1:
                raise ValueError(f"max_skipped_steps_in_row must be >= 1, got "
                                 f"{self.max_skipped_steps_in_row}")

        def resolved_loss(self, loss: PolicyLoss.Config) -> PolicyLoss.Config:
            """``loss`` with its off-policy correction decided for this loop: "auto" is on when
            tokens can be off-policy (max_staleness >= 1; partial rollouts need it), else off
            (the loss exactly as configured). The deprecated keys ``off_policy_correction`` and
            ``tis_cap`` are read here, with a warning, unless the loss sets its own correction."""
            correction = loss.off_policy
            if self.off_policy_correction is not None or self.tis_cap is not None:
                logger.warning("loop.off_policy_correction and loop.tis_cap are deprecated: set "
                               "trainer.loss.off_policy (enabled, is_cap, masks) instead")
                if correction == OffPolicyCorrection.Config():
                    enabled = {"auto": "auto", "tis": "on", "none": "off"}[
                        self.off_policy_correction or "auto"]
                    correction = dataclasses.replace(
                        token_tis(self.tis_cap if self.tis_cap is not None else 2.0),
                        enabled=enabled)
            if correction.enabled == "auto":
                correction = dataclasses.replace(
                    correction, enabled="on" if self.staleness.max_staleness >= 1 else "off")
            return dataclasses.replace(loss, off_policy=correction)

    def __init__(self, config: Config, *, parts: RunParts, state: ControllerState,
                 progress: Any = None) -> None:
        self.config = config
        self.parts = parts
        self.state = state
        self.progress = progress
        """A tqdm bar (or None): one update per step."""
        self._postfix: dict[str, str] = (
            {"val": f"{state.validation_history[-1][1]:.3f}"} if state.validation_history else {})
        """What the bar shows after its count: the newest reward, validation, tokens/s, step."""
        self.gate: StalenessGate[_GroupResult] = config.staleness.build(
            groups_per_step=config.groups_per_step, policy_version=state.step,
            first_group_id=state.next_group_id,
            replacements_per_version=config.replace_dropped_groups,
        )
        self.train_episodes = parts.task.dataset("train")
        assert parts.generators.router is not None, "the pool spawned its generators"
        self.idle_ratios = IdleRatios(parts.generators.router.busy_clock)
        self.num_admitted = self.num_finished = self.num_dropped = 0
        self.num_skipped_steps = self.num_skipped_in_row = self.num_checkpoints = 0
        self.num_validations = 0
        self.num_groups_restarted = 0
        self.health = RunHealth(state.untrained_steps)
        """Steps that trained nothing, collapsed answers (run_health.py)."""
        self.constant_answer: ConstantAnswer | None = None
        """The validation episodes' constant-answer baseline (computed at the first validation)."""
        self._constant_answer_done = False
        self.wall_s = {"validation": 0.0, "steps": 0.0, "checkpoints": 0.0}
        """Where this loop's wall time went (summary.json's breakdown)."""
        self._step_mark = time.perf_counter()
        """Where the next step's wall time starts: the end of the previous step's push."""
        self._tail_s = {"validate": 0.0, "checkpoint": 0.0}
        """Validation and checkpoint seconds since the last step's push (the next step's)."""
        self._cpu_mark = 0.0
        """The controller's CPU time (time.process_time) where the next step's window starts."""
        self._replaced_since_step: list[int] = []
        """Groups replaced (dynamic sampling) since the last step's log line."""
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        self._stopping = False

    async def run(self) -> None:
        """Validate before (unless resumed past it), train to num_steps, validate after."""
        validator = self.parts.validator
        self._step_mark = time.perf_counter()  # the first step's wall time holds validation 0
        if validator.enabled and not self.state.validation_history:
            await self.validate(self.state.step)
        await self._restore_groups()
        self.idle_ratios.restart()
        self._cpu_mark = time.process_time()
        producer = asyncio.create_task(self._produce(), name="rollout-producer")
        self._tasks.add(producer)  # a producer that fails fails the run, as a rollout does
        producer.add_done_callback(self._on_task_done)
        try:
            while self.state.step < self.config.num_steps:
                start = time.perf_counter()
                inside = self.wall_s["validation"] + self.wall_s["checkpoints"]
                await self._train_step(self.state.step)
                self.wall_s["steps"] += time.perf_counter() - start - (
                    self.wall_s["validation"] + self.wall_s["checkpoints"] - inside)
        finally:
            self._stopping = True
            for task in list(self._tasks):  # the producer is one of them
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        history = self.state.validation_history
        if validator.enabled and (not history or history[-1][0] != self.state.step):
            await self.validate(self.state.step)
        self.health.warn_if_hollow()

    # ---- producer --------------------------------------------------------------------------------
    async def _produce(self) -> None:
        # Until cancelled at the run's end: a group replaced late (dynamic sampling) frees a slot.
        total_groups = self.config.num_steps * self.config.groups_per_step
        trace = self.parts.metrics.trace
        while True:
            waited = trace.now()
            group_id, version = await self.gate.admit(limit=total_groups)
            trace.span("staleness gate", "admit", waited, trace.now(), group=group_id,
                       version=version)
            self._launch(group_id, version)

    def _launch(self, group_id: int, version: int) -> None:
        self.num_admitted += 1
        task = asyncio.create_task(self._rollout(group_id, version), name=f"group={group_id}")
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()

    async def _rollout(self, group_id: int, admit_version: int) -> None:
        attempt = 0
        while True:
            try:
                group, samples = await self._run_group(group_id, attempt)
                break
            except (GeneratorLostError, RolloutWorkerLostError) as e:
                # Whole, from its prompt, with the same group id (same request seeds), exactly
                # as a resumed run restarts its in-flight groups; unless the run is stopping: the
                # rollouts' TaskGroup may have consumed our CancelledError while it failed with
                # the generator's error (Task.cancelling() cannot tell: a TaskGroup that fails
                # leaves it raised).
                if self._stopping:
                    raise asyncio.CancelledError from e
                self.num_groups_restarted += 1
                attempt += 1
                logger.warning("group %d restarts from its prompt: %s", group_id, e)
        self.num_finished += 1
        self.num_dropped += group.dropped
        finished = FinishedGroup(group_id=group_id, admit_version=admit_version, samples=samples,
                                 rewards=group.rewards, dropped=group.dropped)
        if await self.gate.finish(group_id, _GroupResult(finished=finished, group=group),
                                  replaceable=group.dropped):
            self.state.replaced_group_ids.append(group_id)
            self._replaced_since_step.append(group_id)
        faults.point("controller.group_finished", self.num_finished)

    async def _run_group(self, group_id: int,
                         attempt: int) -> tuple[RolloutGroup, list[TrainingSample]]:
        """The group and its packed samples, from a rollout worker or from this process."""
        parts = self.parts
        prompt_index = parts.cursor.prompt_index(group_id)
        if parts.workers is not None:
            outcome = await parts.workers.run_group(group_id, prompt_index, parts.group_size,
                                                    parts.sampling, attempt=attempt)
            assert outcome.group is not None
            return outcome.group, outcome.samples
        group = await parts.rollouter.run_group_rollouts(
            parts.generate_fn, self.train_episodes[prompt_index], group_id, parts.group_size,
            parts.sampling, attempt=attempt)
        return group, rollout_group_to_training_samples(group)

    # ---- trainer ---------------------------------------------------------------------------------
    async def _train_step(self, step: int) -> None:
        parts, state = self.parts, self.state
        start = time.perf_counter()
        taken = await self._take(step)
        train_start, rollout_cpu_s = time.perf_counter(), time.process_time() - self._cpu_mark
        results = [result for _, _, result in taken]
        groups = [r.group for r in results if r.group is not None]
        self._check_task_errors(f"step {step}", task_errors(groups),
                                sum(len(g.rollouts) for g in groups))
        samples = [s for r in results for s in r.finished.samples]
        samples = step_advantages(samples, parts.rollouter.config.advantage)
        group_ids = [g for g, _, _ in taken]

        train_metrics = await parts.trainer.train_step(samples, step)
        push_start = time.perf_counter()
        version = step + 1
        push_metrics: dict[str, float] = {}
        skipped = self._count_skipped(step, train_metrics)
        if not skipped:  # else: the weights did not change
            push_metrics = await parts.generators.push_weights(version)
        # vLLM's own numbers, read before the next step's groups can start (with S = 0 a step's
        # window then holds its own generation, and the validation before it)
        engine_reports = await parts.generators.take_engine_stats()
        await self.gate.publish_policy_version(version)
        end = time.perf_counter()

        state.step = version
        state.trained_group_ids.extend(group_ids)
        self._log_trained(step, group_ids, samples)
        step_s = end - start
        num_tokens = sum(r.num_output_tokens for g in groups for r in g.rollouts)
        metrics = {
            **self._rollout_metrics(groups, results),
            **self._staleness_metrics(step, taken, samples),
            **train_metrics,
            **push_metrics,
            "time/generate_s": train_start - start,
            "time/train_s": push_start - train_start,
            "time/push_s": end - push_start,
            "time/step_s": step_s,
            **self._breakdown(start, train_start, push_start, end),
            "throughput/generated_tokens_per_s": num_tokens / max(step_s, 1e-9),
            "throughput/num_training_samples": float(len(samples)),
            **self.idle_ratios.end_step(trainer_busy_s=end - train_start),
            **parts.generators.metrics(),
            **engine_metrics(engine_reports),
            **self._worker_metrics(),
            "generator/groups_restarted_after_loss": float(self.num_groups_restarted),
            # the controller's Python heap in pymalloc blocks (cheap; a long run's leak shows)
            "controller/python_allocated_blocks": float(sys.getallocatedblocks()),
        }
        metrics.update(self.health.end_step(step, groups, num_samples=len(samples),
                                            skipped=skipped))
        num_turns = sum(len(r.turns) for g in groups for r in g.rollouts)
        if num_turns:
            metrics["rollout/controller_cpu_ms_per_turn"] = 1e3 * rollout_cpu_s / num_turns
        if "rollout_reward/mean" in metrics:
            state.reward_history.append((step, metrics["rollout_reward/mean"]))
        parts.metrics.log(step, metrics)
        trace = parts.metrics.trace
        trace.span("steps", "wait for batch", start, train_start, step=step, groups=len(taken))
        trace.span("steps", "train", train_start, push_start, step=step, samples=len(samples))
        trace.span("steps", "push", push_start, end, step=step, version=version)
        trace_engine_steps(trace, engine_reports)
        if trace.enabled:  # each trainer rank's spans; read after the step's metrics are taken
            trace_trainer_ranks(trace, await parts.trainer.take_timeline())
        parts.recorder.maybe_record(step, groups, parts.tokenizer)
        if self.progress is not None:
            self._postfix = {
                "reward": f"{metrics.get('rollout_reward/mean', float('nan')):.3f}",
                "val": self._postfix.get("val", "n/a"),
                "tok_s": f"{metrics['throughput/generated_tokens_per_s']:.0f}",
                "step_s": f"{step_s:.1f}",
            }
            self.progress.update(1)
            self.progress.set_postfix(self._postfix)
        if parts.validator.due(version) and version < self.config.num_steps:
            await self.validate(version)
        if parts.checkpointer.due(version):
            checkpoint_start = time.perf_counter()
            self._capture_groups()
            await parts.checkpointer.save(parts.trainer, state)
            self.num_checkpoints += 1
            self.wall_s["checkpoints"] += time.perf_counter() - checkpoint_start
            self._tail_s["checkpoint"] += time.perf_counter() - checkpoint_start
            parts.metrics.trace.span("steps", "checkpoint", checkpoint_start,
                                     time.perf_counter(), step=version)
            faults.point("controller.checkpoint_written", self.num_checkpoints)
        self._cpu_mark = time.process_time()  # metrics, validation, checkpoints: not rollouts

    def _breakdown(self, start: float, train_start: float, push_start: float,
                   end: float) -> dict[str, float]:
        """Where the step's wall time went (metrics/step_breakdown.py): from the previous step's
        push to this one's, the validation and checkpoint between them, the wait for the batch,
        training, the push, and the rest (the previous step's records); the parts sum to
        ``time/step_wall_s``."""
        parts = {"validate": self._tail_s["validate"], "checkpoint": self._tail_s["checkpoint"],
                 "wait_for_batch": train_start - start, "train": push_start - train_start,
                 "push": end - push_start}
        step_wall_s = end - self._step_mark
        parts["bookkeeping"] = step_wall_s - sum(parts.values())
        self._step_mark, self._tail_s = end, {"validate": 0.0, "checkpoint": 0.0}
        return {"time/step_wall_s": step_wall_s,
                **{f"{BREAKDOWN_PREFIX}{part}_s": seconds for part, seconds in parts.items()}}

    def _worker_metrics(self) -> dict[str, float]:
        """The rollout workers' share of the router and resume counts (they route themselves)."""
        workers, pool = self.parts.workers, self.parts.generators
        if workers is None or pool.router is None:
            return {}
        return workers.metrics(pool.router.num_routed,
                               pool.resuming.num_resumed if pool.resuming is not None else None)

    def _count_skipped(self, step: int, train_metrics: dict[str, float]) -> bool:
        """Whether the trainer skipped this step's update (non-finite loss or gradient norm);
        fails the run after ``max_skipped_steps_in_row`` in a row."""
        skipped = train_metrics.get("trainer/skipped_step", 0.0) == 1.0
        self.num_skipped_steps += skipped
        self.num_skipped_in_row = self.num_skipped_in_row + 1 if skipped else 0
        train_metrics["trainer/num_skipped_steps"] = float(self.num_skipped_steps)
        if self.num_skipped_in_row >= self.config.max_skipped_steps_in_row:
            raise RunFailedError(
                f"step {step}: {self.num_skipped_in_row} steps in a row had a non-finite loss or "
                f"gradient norm (trainer/grad_norm={train_metrics.get('trainer/grad_norm')}); "
                f"the weights were kept, the run stops (loop.max_skipped_steps_in_row)"
            )
        return skipped

    async def _take(self, step: int) -> list[tuple[int, int, _GroupResult]]:
        """The gate's groups for ``step``; a failed rollout task (a dead generator) fails the run."""
        take = asyncio.create_task(self.gate.take_step_groups(step))
        try:
            while True:
                if self._failure is not None:
                    raise RunFailedError("a rollout group failed: " + " ".join(
                        str(self._failure).split())) from self._failure
                await asyncio.wait({take, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
                if take.done():
                    return take.result()
        finally:
            take.cancel()

    @staticmethod
    def _rollout_metrics(groups: list[RolloutGroup],
                         results: list[_GroupResult]) -> dict[str, float]:
        metrics = rollout_metrics(groups) if groups else {}
        if len(groups) < len(results):  # restored groups: rewards are all a checkpoint keeps
            rewards = [x for r in results for x in r.finished.rewards]
            metrics["rollout_reward/mean"] = statistics.fmean(rewards) if rewards else 0.0
        return metrics

    def _staleness_metrics(self, step: int, taken: list, samples: list) -> dict[str, float]:
        oldest = (s.oldest_policy_version for s in samples)  # O(tokens) each: once a sample
        ages = [step - v for v in oldest if v is not None]
        metrics = {
            "async/groups_admitted": float(self.num_admitted),
            "async/groups_finished": float(self.num_finished),
            "async/groups_trained": float(self.gate.num_consumed),
            "async/groups_dropped": float(self.num_dropped),
            "async/groups_replaced": float(self.gate.num_replaced),
            "async/groups_in_flight": float(self.gate.num_running),
            "async/admit_age_max": float(max(step - v for _, v, _ in taken)),
        }
        if ages:
            metrics.update({
                "async/policy_age_min": float(min(ages)),
                "async/policy_age_mean": statistics.fmean(ages),
                "async/policy_age_max": float(max(ages)),
            })
        return metrics

    async def validate(self, step: int) -> None:
        parts = self.parts
        self.num_validations += 1
        await faults.point_async("controller.validation_started", self.num_validations)
        start = time.perf_counter()
        result = await parts.validator.run(parts.generate_fn, parts.sampling,
                                           greedy_reference=not self.state.validation_history)
        self._check_task_errors(f"validation at step {step}", result.task_errors,
                                result.num_rollouts)
        if not self._constant_answer_done:
            self._constant_answer_done = True
            self.constant_answer = await constant_answer_baseline(
                parts.task, parts.validator.dataset[:parts.validator.config.num_prompts])
        if self.constant_answer is not None:
            result.constant_answer_reward = self.constant_answer.reward
        parts.recorder.record_validation(step, result.groups, parts.tokenizer)
        if not self.state.validation_history:
            self.state.first_validation_episode_means = result.episode_means
            self.state.greedy_reward = result.greedy_reward
        self.state.validation_history.append((step, result.reward_mean, result.reward_stderr))
        self.state.validation_per_turn = result.per_turn
        self.state.last_validation_episode_means = result.episode_means
        parts.metrics.log(step, result.metrics())
        if self.progress is not None:  # the final validation too: it runs after the last step
            self._postfix["val"] = f"{result.reward_mean:.3f}"
            self.progress.set_postfix(self._postfix)
        per_turn = "".join(f", {key} {value:.4f}" for key, value in result.per_turn.items()
                           ) if len(result.per_turn) > 1 else ""
        if self.constant_answer is not None:
            per_turn += f"; {self.constant_answer.describe()}"
        if result.greedy_reward is not None:
            per_turn += f"; greedy answers {result.greedy_reward:.4f}"
        logger.info("validation step=%d reward=%.4f +- %.4f (%d rollouts%s)", step,
                    result.reward_mean, result.reward_stderr, result.num_rollouts, per_turn,
                    extra=CONSOLE)
        self.wall_s["validation"] += time.perf_counter() - start
        self._tail_s["validate"] += time.perf_counter() - start
        parts.metrics.trace.span("steps", "validation", start, time.perf_counter(), step=step,
                                 reward=result.reward_mean)

    def _check_task_errors(self, where: str, errors: list[str], num_rollouts: int) -> None:
        """Stop the run when too many rollouts failed in the task's code; else one warning."""
        if not errors:
            return
        line = f"{where}: {summarise_task_errors(errors, num_rollouts)}"
        limit = self.config.max_task_error_fraction
        if len(errors) > limit * num_rollouts:
            task = type(self.parts.task)
            raise RunFailedError(f"task {task.__module__}:{task.__qualname__}: {line} (more than "
                                 f"loop.max_task_error_fraction = {limit}); the run stops")
        logger.warning("%s (the run goes on: loop.max_task_error_fraction = %s)", line, limit)

    # ---- the trained-samples log: which groups and samples every step trained on -----------------
    def _log_trained(self, step: int, group_ids: list[int], samples: list) -> None:
        record: dict[str, Any] = {"step": step, "group_ids": group_ids,
                                  "sample_ids": [s.sample_id for s in samples]}
        if self.config.replace_dropped_groups:
            record["replaced_group_ids"], self._replaced_since_step = self._replaced_since_step, []
        with self.parts.checkpointer.trained_log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- checkpoint / resume ---------------------------------------------------------------------
    def _capture_groups(self) -> None:
        """Record the gate's groups in the state a checkpoint writes."""
        finished = [r.finished for r in self.gate.finished_results().values()]
        finished_ids = {f.group_id for f in finished}
        self.state.next_group_id = self.gate.next_group_id
        self.state.finished = finished
        self.state.in_flight = [(g, v) for g, v in self.gate.in_flight() if g not in finished_ids]

    async def _restore_groups(self) -> None:
        state = self.state
        for finished in state.finished:
            await self.gate.readmit(finished.group_id, finished.admit_version)
            await self.gate.finish(finished.group_id, _GroupResult(finished=finished, group=None))
        for group_id, version in state.in_flight:
            await self.gate.readmit(group_id, version)
            self._launch(group_id, version)
        if state.finished or state.in_flight:
            logger.info("resumed %d finished and %d in-flight groups", len(state.finished),
                        len(state.in_flight))
        known = (set(state.trained_group_ids) | set(state.replaced_group_ids)
                 | {f.group_id for f in state.finished} | {g for g, _ in state.in_flight})
        missing = sorted(set(range(state.next_group_id)) - known)
        assert not missing, f"checkpoint lost track of groups {missing[:10]}"
