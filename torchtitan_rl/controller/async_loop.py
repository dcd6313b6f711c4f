"""The fully asynchronous loop: rollout workers keep generating while the trainer trains.

    producer:  gate.admit() -> group id g (policy version v) -> task: Rollouter.run_group_rollouts
               -> gate.finish(g, samples)           (as many groups as the staleness capacity allows)
    trainer:   gate.take_step_groups(step) -> P finished groups (due ones first, then earliest
               deadline; finished groups overtake stragglers) -> RunContext.train_and_publish
               -> generators pull version step + 1 -> gate.publish_version (capacity grows by P)

The bound (see staleness.py): a group admitted at version v is trained at a step <= v + S. With
S = 0 the producer admits exactly one step's groups and waits, and the very same training tail
runs: the synchronous loop, step for step.

Resume: groups finished but untrained at the checkpoint come back with their samples; groups in
flight restart from their prompts (same group id -> same prompt and request seeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
from typing import Any, Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.controller.run_context import RunContext, StepRecord
from torchtitan_rl.controller.run_state import FinishedGroup
from torchtitan_rl.controller.staleness import StalenessGate
from torchtitan_rl.controller.supervision import RunFailedError
from torchtitan_rl.faults import maybe_kill
from torchtitan_rl.rollout import rollout_group_to_training_samples, rollout_metrics
from torchtitan_rl.rollout.types import RolloutGroup

logger = logging.getLogger(__name__)


def resolve_trainer_config(job_config: Any) -> Any:
    """The trainer config a run uses: in async mode, TIS on by default (see Config)."""
    trainer = job_config.trainer
    async_cfg = job_config.async_loop
    if (job_config.loop.mode == "async" and async_cfg.off_policy_correction == "tis"
            and trainer.loss.tis_cap is None):
        loss = dataclasses.replace(trainer.loss, tis_cap=async_cfg.tis_cap)
        trainer = dataclasses.replace(trainer, loss=loss)
    return trainer


@dataclasses.dataclass(kw_only=True, slots=True)
class _GroupResult:
    finished: FinishedGroup
    group: RolloutGroup | None
    """The live group (None for groups restored from a checkpoint)."""


class AsyncLoop(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        staleness: StalenessGate.Config = dataclasses.field(default_factory=StalenessGate.Config)
        off_policy_correction: Literal["tis", "none"] = "tis"
        """tis: truncated importance sampling at token level (``trainer.loss.tis_cap`` set to
        ``tis_cap`` when the loss has none of its own): stale tokens are weighted by
        min(pi_trainer / pi_generator, cap). none: the loss exactly as configured."""
        tis_cap: float = 2.0
        """The cap used by ``off_policy_correction = "tis"``. >= 1."""

        def __post_init__(self) -> None:
            if self.tis_cap < 1:
                raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")

    def __init__(self, config: Config, *, ctx: RunContext) -> None:
        self.config = config
        self.ctx = ctx
        loop_cfg = ctx.config.loop
        self.groups_per_step = loop_cfg.prompts_per_step
        self.total_groups = loop_cfg.num_steps * loop_cfg.prompts_per_step
        self.gate: StalenessGate[_GroupResult] = config.staleness.build(
            groups_per_step=self.groups_per_step, version=ctx.state.step,
            first_group_id=ctx.state.next_group_id,
        )
        self.num_admitted = 0
        self.num_finished = 0
        self.num_dropped = 0
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        ctx.on_weights_published = self.gate.publish_version
        ctx.extra_checkpoint_state = self._checkpoint_state

    async def run(self) -> None:
        await self._restore()
        producer = asyncio.create_task(self._produce(), name="rollout-producer")
        try:
            await self._train()
        finally:
            producer.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(producer, *self._tasks, return_exceptions=True)

    # ---- producer --------------------------------------------------------------------------------
    async def _produce(self) -> None:
        while self.gate.next_group_id < self.total_groups:
            group_id, version = await self.gate.admit()
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
        ctx, cfg = self.ctx, self.ctx.config.loop
        group = await ctx.rollouter.run_group_rollouts(
            ctx.generate_fn, ctx.train_prompt(group_id), group_id, ctx.config.rollouter.group_size,
            ctx.sampling,
        )
        self.num_finished += 1
        self.num_dropped += group.dropped
        finished = FinishedGroup(
            group_id=group_id, admit_version=admit_version,
            samples=rollout_group_to_training_samples(group), rewards=group.rewards,
            dropped=group.dropped,
        )
        await self.gate.finish(group_id, _GroupResult(finished=finished, group=group))
        maybe_kill("kill_controller_after_groups", self.num_finished)

    # ---- trainer ---------------------------------------------------------------------------------
    async def _train(self) -> None:
        ctx = self.ctx
        while ctx.state.step < ctx.config.loop.num_steps:
            step = ctx.state.step
            start = time.perf_counter()
            taken = await self._take(step)
            waited_s = time.perf_counter() - start
            results = [result for _, _, result in taken]
            groups = [r.group for r in results if r.group is not None]
            samples = [s for r in results for s in r.finished.samples]
            metrics = rollout_metrics(groups) if groups else {}
            if len(groups) < len(results):  # restored groups: rewards are all we kept
                rewards = [x for r in results for x in r.finished.rewards]
                metrics["rollout_reward/mean"] = statistics.fmean(rewards) if rewards else 0.0
            metrics.update(self._staleness_metrics(step, taken, samples))
            await ctx.train_and_publish(
                StepRecord(
                    step=step, group_ids=[g for g, _, _ in taken], samples=samples,
                    metrics=metrics, generate_s=waited_s, started_at=start,
                    num_generated_tokens=sum(r.num_output_tokens for g in groups
                                             for r in g.rollouts),
                ),
                groups=groups,
            )

    async def _take(self, step: int) -> list:
        """take_step_groups, but a failed rollout task (a dead generator) fails the run."""
        take = asyncio.create_task(self.gate.take_step_groups(step))
        while True:
            if self._failure is not None:
                take.cancel()
                raise RunFailedError(f"a rollout group failed: {self._failure}") from self._failure
            pending = {take, *self._tasks}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if take.done():
                return take.result()

    def _staleness_metrics(self, step: int, taken: list, samples: list) -> dict[str, float]:
        ages = [step - s.oldest_policy_version for s in samples
                if s.oldest_policy_version is not None]
        admit_ages = [step - v for _, v, _ in taken]
        metrics = {
            "async/groups_admitted": float(self.num_admitted),
            "async/groups_finished": float(self.num_finished),
            "async/groups_trained": float(self.gate.num_consumed),
            "async/groups_dropped": float(self.num_dropped),
            "async/groups_in_flight": float(self.gate.num_running),
            "async/admit_age_max": float(max(admit_ages)),
        }
        if ages:
            metrics.update({
                "async/policy_age_min": float(min(ages)),
                "async/policy_age_mean": statistics.fmean(ages),
                "async/policy_age_max": float(max(ages)),
            })
        return metrics

    # ---- checkpoint / resume ---------------------------------------------------------------------
    def _checkpoint_state(self) -> dict:
        finished = [r.finished for r in self.gate.finished_results().values()]
        finished_ids = {f.group_id for f in finished}
        return {
            "next_group_id": self.gate.next_group_id,
            "finished": finished,
            "in_flight": [(g, v) for g, v in self.gate.in_flight() if g not in finished_ids],
        }

    async def _restore(self) -> None:
        state = self.ctx.state
        for finished in state.finished:
            await self.gate.readmit(finished.group_id, finished.admit_version)
            await self.gate.finish(finished.group_id, _GroupResult(finished=finished, group=None))
        for group_id, version in state.in_flight:
            await self.gate.readmit(group_id, version)
            self._launch(group_id, version)
        if state.finished or state.in_flight:
            logger.info("resumed %d finished and %d in-flight groups", len(state.finished),
                        len(state.in_flight))
        known = set(state.trained_group_ids) | {f.group_id for f in state.finished} | {
            g for g, _ in state.in_flight}
        missing = sorted(set(range(state.next_group_id)) - known)
        assert not missing, f"checkpoint lost track of groups {missing[:10]}"
