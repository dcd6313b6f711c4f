"""The controller's one view of the trainer, however its ranks were launched.

    loop -train_step(samples, step)-> TrainerClient: batcher.pack(samples)
        -> ranks.call("forward_backward", batch) -> ranks.call("optim_step")      [every rank]
    generator pool -push_to(generator, version)-> TrainerClient
        -> ranks.push_weights(generator, version, verify)     [every rank gathers; rank 0 pushes]
    checkpointer / job -save_checkpoint / load_checkpoint / export_hf-> ranks.call(...)

`TrainerRanks` is how calls reach every rank: `MonarchTrainerRanks` (a PolicyTrainer actor mesh,
trainer/trainer.py) or `TorchrunTrainerRanks` (rank 0 broadcasts commands to the torchrun
processes, controller/torchrun.py). Both run the same PolicyTrainerCore methods, in the same order
on every rank.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Protocol

from torchtitan_rl.generator import GeneratorHandle
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.types import TrainingSample
from torchtitan_rl.weight_sync import WeightTransport

logger = logging.getLogger(__name__)


class TrainerRanks(Protocol):
    """Every trainer rank, reached from the controller."""

    dp_size: int
    """Data-parallel size (the batcher's ``dp_size``)."""
    machine_id: str
    """Rank 0's machine (hostname/boot id): generators there can take pushes by shared memory."""

    async def call(self, method: str, *args: Any) -> Any:
        """Run the PolicyTrainerCore method on every rank; returns rank 0's result."""

    async def push_weights(self, generator: GeneratorHandle, version: int, *,
                           verify: bool, transport: WeightTransport) -> dict[str, float]:
        """Every rank gathers the full weights; rank 0 pushes them to ``generator``."""

    async def close(self) -> None: ...


class MonarchTrainerRanks:
    """A PolicyTrainer actor mesh (one actor per trainer proc)."""

    def __init__(self, *, procs: Any, actors: Any, dp_size: int, machine_id: str) -> None:
        self.procs = procs
        self.actors = actors
        self.dp_size = dp_size
        self.machine_id = machine_id

    @classmethod
    async def spawn(cls, procs: Any, config: Any, *, model_dir: pathlib.Path) -> MonarchTrainerRanks:
        from torchtitan_rl.trainer.trainer import rank0_value, spawn_policy_trainer

        actors = await spawn_policy_trainer(procs, config, model_dir=model_dir)
        dp_size = int(rank0_value(await actors.get_dp_size.call()))
        machine = str(rank0_value(await actors.get_machine_id.call()))
        return cls(procs=procs, actors=actors, dp_size=dp_size, machine_id=machine)

    async def call(self, method: str, *args: Any) -> Any:
        from torchtitan_rl.trainer.trainer import rank0_value

        return rank0_value(await getattr(self.actors, method).call(*args))

    async def push_weights(self, generator: GeneratorHandle, version: int, *,
                           verify: bool, transport: WeightTransport) -> dict[str, float]:
        return await self.call("push_weights", generator.actors, version, verify, transport)

    async def close(self) -> None:
        await self.procs.stop()


class TrainerClient:
    def __init__(self, ranks: TrainerRanks, *, batcher: Batcher.Config,
                 verify_push: bool) -> None:
        self.ranks = ranks
        self.batcher = batcher.build(dp_size=ranks.dp_size)
        self.verify_push = verify_push

    async def train_step(self, samples: list[TrainingSample], step: int) -> dict[str, float]:
        if not samples:
            # Every group of the step was dropped (zero reward spread): an optimizer step on no
            # tokens would still move AdamW state, so the step keeps the weights instead.
            logger.warning("step %d: no training samples (all groups dropped); weights unchanged",
                           step)
            return {"trainer/skipped_empty_step": 1.0}
        batch = self.batcher.pack(samples)
        metrics = dict(await self.ranks.call("forward_backward", batch))
        metrics.update(await self.ranks.call("optim_step"))
        metrics.update({k: float(v) for k, v in batch.metrics.items()})
        return metrics

    async def push_to(self, generator: GeneratorHandle, version: int) -> dict[str, float]:
        """The trainer's weights into ``generator``'s every rank, as policy ``version``, over the
        generator's transport (read back and compared bit for bit when ``verify_push``)."""
        assert generator.weight_transport is not None, "the pool picks each generator's transport"
        return await self.ranks.push_weights(generator, version, verify=self.verify_push,
                                             transport=generator.weight_transport)

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        await self.ranks.call("save_checkpoint", str(directory), None)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        await self.ranks.call("load_checkpoint", str(directory))

    async def export_hf(self, directory: pathlib.Path) -> None:
        await self.ranks.call("export_hf", str(directory), "")

    async def close(self) -> None:
        await self.ranks.close()
