"""The objects a run's loop works with, built in one place (controller/spawn.py `build_parts`).

    task ------------- episodes (train / validation) and environments
    cursor ----------- group id -> training prompt index (resume needs one integer)
    rollouter -------- episode -> scored RolloutGroup, through generate_fn
    generate_fn ------ the router over the generators (ResumingGenerateFn?(router): partial
                       rollouts); the router keeps the generators' busy clock
    generators ------- GeneratorPool: the vLLM meshes, their router, weight pushes, replacement
    workers ---------- RolloutWorkerPool (rollouter.num_workers > 0): training groups run in
                       worker processes beside the generators; None: in this process through
                       rollouter + generate_fn (validation always is)
    trainer ---------- TrainerClient: train_step, push_weights(generator), checkpoints, HF export
    hosts ------------ RunHosts: the placement's host meshes (closed last)
    validator -------- held-out reward
    checkpointer ----- trainer DCP + controller state; resume
    metrics, recorder  TensorBoard + metrics.jsonl; rollouts.jsonl
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from torchtitan_rl.controller.checkpointer import Checkpointer
from torchtitan_rl.controller.data_cursor import DataCursor
from torchtitan_rl.controller.generator_pool import GeneratorPool
from torchtitan_rl.controller.placement import RunHosts
from torchtitan_rl.controller.validation import Validator
from torchtitan_rl.controller.worker_pool import RolloutWorkerPool
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.task import Task
from torchtitan_rl.trainer.trainer import TrainerClient
from torchtitan_rl.types import GenerateFn, Sampling

if TYPE_CHECKING:  # transformers is heavy to import; only its type is named here
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class RunParts:
    task: Task
    tokenizer: PreTrainedTokenizerBase
    """The model's HF tokenizer (decoding rollouts for the recorder)."""
    cursor: DataCursor
    rollouter: Rollouter
    group_size: int
    sampling: Sampling
    """Training rollouts' sampling (its seed is the base of every request seed)."""
    generate_fn: GenerateFn
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
                             _logged_close(self.trainer.close))
        await _logged_close(self.hosts.close)


async def _logged_close(close: Callable[[], Awaitable[None]] | None) -> None:
    if close is None:
        return
    try:
        await close()
    except Exception as e:
        logger.warning("shutdown: %r", e)
