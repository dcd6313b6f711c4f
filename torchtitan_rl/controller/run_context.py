"""What a running job holds, and the step tail that the sync and async loops share.

    loop (sync or async) --StepRecord(groups' samples, rollout metrics)--> train_and_publish:
        trainer.train_step(samples)            batch -> forward/backward -> optimizer  [train]
        trainer -> every generator: weights    policy version = step + 1              [sync]
        state.step += 1; metrics -> TensorBoard/JSONL/progress bar; rollout JSONL
        validation when due; checkpoint when due (trainer DCP, then controller.json)

Both loops end every step here, so "async with max_staleness 0" and the sync loop run the very same
training code on the very same samples.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from torchtitan_rl.controller.activity import IdleRatios
from torchtitan_rl.controller.data_cursor import DataCursor
from torchtitan_rl.controller.run_state import (
    ControllerState,
    capture_rng_state,
    step_dir,
    write_controller_state,
)
from torchtitan_rl.controller.validation import Validator
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.types import GenerateFn, RolloutGroup
from torchtitan_rl.types import Sampling, TrainingSample

logger = logging.getLogger(__name__)


class TrainerClient(Protocol):
    """The controller's view of the trainer mesh (see controller/setup.py)."""

    async def train_step(self, samples: list[TrainingSample], step: int) -> dict[str, float]: ...
    async def push_weights(self, version: int) -> dict[str, float]: ...
    async def save_checkpoint(self, directory: pathlib.Path) -> None: ...
    async def load_checkpoint(self, directory: pathlib.Path) -> None: ...
    async def export_hf(self, directory: pathlib.Path) -> None: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    group_ids: list[int]
    samples: list[TrainingSample]
    metrics: dict[str, float]
    """Rollout metrics of the step's groups (and loop-specific ones)."""
    num_generated_tokens: int
    generate_s: float
    """Wall time the loop waited for generation before this step could train."""
    started_at: float


@dataclasses.dataclass(kw_only=True)
class RunContext:
    config: Any
    """The RLJob.Config of this run."""
    state: ControllerState
    run_dir: pathlib.Path
    rollouter: Rollouter
    generate_fn: GenerateFn
    trainer: TrainerClient
    tokenizer: Any
    train_dataset: Any
    cursor: DataCursor
    sampling: Sampling
    metrics_logger: MetricsLogger
    recorder: RolloutRecorder
    validator: Validator
    on_weights_published: Callable[[int], Awaitable[None]] | None = None
    """The async loop's hook: the staleness gate learns the new version."""
    extra_checkpoint_state: Callable[[], dict[str, Any]] | None = None
    """The async loop's hook: groups in flight and finished-but-untrained, for the checkpoint."""
    progress: Any = None
    idle_ratios: IdleRatios | None = None
    metric_sources: list[Callable[[], dict[str, float]]] = dataclasses.field(default_factory=list)
    """Counters sampled at the end of every step (e.g. the router's requests per generator)."""
    """Generator / trainer idle ratio per step (see activity.py)."""

    def train_prompt(self, group_id: int) -> Any:
        return self.train_dataset[self.cursor.prompt_index(group_id)]

    @property
    def checkpoint_root(self) -> pathlib.Path:
        return self.run_dir / "checkpoints"

    async def train_and_publish(
        self, record: StepRecord, groups: list[RolloutGroup] | None = None
    ) -> dict[str, float]:
        train_start = time.perf_counter()
        train_metrics = await self.trainer.train_step(record.samples, record.step)
        sync_start = time.perf_counter()
        version = record.step + 1
        sync_metrics = await self.trainer.push_weights(version)
        if self.on_weights_published is not None:
            await self.on_weights_published(version)
        end = time.perf_counter()

        self.state.step = version
        self.state.trained_group_ids.extend(record.group_ids)
        self._log_trained(record)
        step_s = end - record.started_at
        metrics = {
            **record.metrics,
            **train_metrics,
            **sync_metrics,
            "time/generate_s": record.generate_s,
            "time/train_s": sync_start - train_start,
            "time/sync_s": end - sync_start,
            "time/step_s": step_s,
            "throughput/generated_tokens_per_s": record.num_generated_tokens / max(step_s, 1e-9),
            "throughput/num_training_samples": float(len(record.samples)),
        }
        if self.idle_ratios is not None:
            metrics.update(self.idle_ratios.end_step(trainer_busy_s=end - train_start))
        for source in self.metric_sources:
            metrics.update(source())
        if "rollout_reward/mean" in metrics:
            self.state.reward_history.append((record.step, metrics["rollout_reward/mean"]))
        self.metrics_logger.log(record.step, metrics)
        if groups is not None:
            self.recorder.maybe_record(record.step, groups, self.tokenizer)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(
                reward=f"{metrics.get('rollout_reward/mean', float('nan')):.3f}",
                tok_s=f"{metrics['throughput/generated_tokens_per_s']:.0f}",
            )
        if self.validator.due(version) and version < self.config.loop.num_steps:
            await self.validate(version)
        every = self.config.checkpoint.every_steps
        if every and (version % every == 0 or version == self.config.loop.num_steps):
            await self.save_checkpoint()
        return metrics

    @property
    def trained_log_path(self) -> pathlib.Path:
        return self.run_dir / "trained_samples.jsonl"

    def _log_trained(self, record: StepRecord) -> None:
        """One line per step: the groups it consumed and the sample ids it trained on."""
        with self.trained_log_path.open("a") as f:
            f.write(json.dumps({"step": record.step, "group_ids": record.group_ids,
                                "sample_ids": [s.sample_id for s in record.samples]}) + "\n")

    def truncate_trained_log(self) -> None:
        """On resume: forget steps at or after the checkpoint (their weights died with the
        process that trained them; they will be trained again)."""
        if not self.trained_log_path.exists():
            return
        lines = self.trained_log_path.read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["step"] < self.state.step]
        self.trained_log_path.write_text("".join(line + "\n" for line in kept))

    async def validate(self, step: int) -> tuple[float, float]:
        result = await self.validator.run(self.generate_fn, self.sampling)
        self.state.validation_history.append((step, result.reward_mean, result.reward_stderr))
        self.metrics_logger.log(step, result.metrics())
        logger.info("validation step=%d reward=%.4f +- %.4f (%d rollouts)", step,
                    result.reward_mean, result.reward_stderr, result.num_rollouts)
        return result.reward_mean, result.reward_stderr

    async def save_checkpoint(self) -> pathlib.Path:
        directory = step_dir(self.checkpoint_root, self.state.step)
        directory.mkdir(parents=True, exist_ok=True)
        await self.trainer.save_checkpoint(directory / "trainer")
        if self.extra_checkpoint_state is not None:
            for key, value in self.extra_checkpoint_state().items():
                setattr(self.state, key, value)
        self.state.rng_state = capture_rng_state()
        write_controller_state(directory, self.state)
        logger.info("checkpoint: %s", directory)
        return directory
