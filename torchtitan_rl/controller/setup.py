"""Spawning the run's actor meshes and the controller-side clients that drive them.

    spawn_actors(config, model_dir, trainer_factory=None)
        generator meshes: num_generators x spawn_generator(generator config)   (TP procs each)
        trainer mesh:    this_host().spawn_procs(num_trainer_ranks) -> PolicyTrainer per proc
                         (or trainer_factory(model_dir, ...): the torchrun ranks, see spmd.py)
    -> TrainerMeshClient (train_step / push_weights / checkpoints)  +  router (the GenerateFn)

Both trainer clients share ControllerTrainerClient: packing samples into a batch (an empty step
keeps the weights) and pushing weights to one generator at a time (router syncing flag, abort of
running requests when partial rollouts are on).

Everything here is plumbing; the loops (sync_loop.py, async_loop.py) never touch Monarch.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import pathlib
from typing import Any, Protocol

from torchtitan_rl.controller.async_loop import resolve_trainer_config
from torchtitan_rl.controller.router import GeneratorRouter
from torchtitan_rl.generator import GeneratorHandle, spawn_generator
from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.trainer.client import push_weights, rank0_value, train_step
from torchtitan_rl.types import TrainingSample

logger = logging.getLogger(__name__)


class ControllerTrainerClient(abc.ABC):
    """What every controller-side `TrainerClient` shares; subclasses run one batch
    (``_train_batch``), hand the weights to one generator (``_push_to``) and forward the rest."""

    def __init__(self, *, batcher: Batcher, generators: list[GeneratorHandle],
                 router: GeneratorRouter, abort_on_pull: bool, verify_push: bool) -> None:
        self.batcher = batcher
        self.generators = generators
        self.router = router
        self.abort_on_pull = abort_on_pull
        self.verify_push = verify_push

    async def train_step(self, samples: list[TrainingSample], step: int) -> dict[str, float]:
        if not samples:
            # Every group of the step was dropped (zero reward spread): an optimizer step on no
            # tokens would still move AdamW state, so the step keeps the weights instead.
            logger.warning("step %d: no training samples (all groups dropped); weights unchanged",
                           step)
            return {"trainer/skipped_empty_step": 1.0}
        batch = self.batcher.pack(samples)
        metrics = await self._train_batch(batch)
        metrics.update({k: float(v) for k, v in batch.metrics.items()})
        return metrics

    async def push_weights(self, version: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for index, generator in enumerate(self.generators):
            self.router.set_syncing(index, True)
            try:
                metrics = await self._push_to(generator, version)
            finally:
                self.router.set_syncing(index, False)
            if self.abort_on_pull:
                # Partial rollouts: running requests return their tokens so far and are resumed
                # (prompt + partial) entirely on the new weights by ResumingGenerateFn.
                num = await generator.abort(None)
                metrics["generator/num_aborted_at_pull"] = float(num)
        return metrics

    @abc.abstractmethod
    async def _train_batch(self, batch: TrainingBatch) -> dict[str, float]: ...

    @abc.abstractmethod
    async def _push_to(self, generator: GeneratorHandle, version: int) -> dict[str, float]: ...

    @abc.abstractmethod
    async def save_checkpoint(self, directory: pathlib.Path) -> None: ...

    @abc.abstractmethod
    async def load_checkpoint(self, directory: pathlib.Path) -> None: ...

    @abc.abstractmethod
    async def export_hf(self, directory: pathlib.Path) -> None: ...

    @abc.abstractmethod
    async def dp_size(self) -> int:
        """Data-parallel size of the trainer (the batcher's ``dp_size``)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class TrainerMeshClient(ControllerTrainerClient):
    """The controller's `TrainerClient` over a PolicyTrainer actor mesh."""

    def __init__(self, *, procs: Any, actors: Any, **common: Any) -> None:
        super().__init__(**common)
        self.procs = procs
        self.actors = actors

    async def _train_batch(self, batch: TrainingBatch) -> dict[str, float]:
        return await train_step(self.actors, batch)

    async def _push_to(self, generator: GeneratorHandle, version: int) -> dict[str, float]:
        return await push_weights(self.actors, generator.actors, version, verify=self.verify_push)

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        await self.actors.save_checkpoint.call(str(directory), None)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        await self.actors.load_checkpoint.call(str(directory))

    async def export_hf(self, directory: pathlib.Path) -> None:
        await self.actors.export_hf.call(str(directory), "")

    async def dp_size(self) -> int:
        return int(rank0_value(await self.actors.dp_size.call()))

    async def close(self) -> None:
        await self.procs.stop()


def trainer_config_of(config: Any) -> Any:
    """The PolicyTrainer.Config every trainer rank of ``config`` (an RLJob.Config) is built with."""
    return dataclasses.replace(resolve_trainer_config(config), seed=config.seed)


class TrainerFactory(Protocol):
    """Builds the run's trainer client in place of the trainer mesh (spmd.py: the torchrun
    ranks); gets the model directory and ControllerTrainerClient's keyword arguments."""

    async def __call__(self, model_dir: pathlib.Path, *, batcher: Batcher,
                       generators: list[GeneratorHandle], router: GeneratorRouter,
                       abort_on_pull: bool, verify_push: bool) -> ControllerTrainerClient: ...


@dataclasses.dataclass(kw_only=True)
class SpawnedActors:
    trainer: ControllerTrainerClient
    generators: list[GeneratorHandle]
    router: GeneratorRouter

    async def close(self) -> None:
        results = await asyncio.gather(
            *(g.close() for g in self.generators), self.trainer.close(), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("shutdown: %r", result)


async def spawn_actors(config: Any, model_dir: pathlib.Path, *,
                       trainer_factory: TrainerFactory | None = None) -> SpawnedActors:
    """Spawn the generator meshes of ``config`` (an RLJob.Config) and the trainer mesh, or, with
    ``trainer_factory``, the trainer client it builds."""
    from monarch.actor import this_host

    from torchtitan_rl.trainer.trainer import spawn_policy_trainer

    generator_config = dataclasses.replace(
        config.generator, model_dir=str(model_dir), seed=config.seed,
    )
    generators: list[GeneratorHandle] = []
    trainer_procs = None
    try:
        for index in range(config.num_generators):
            generators.append(await spawn_generator(generator_config, name=f"generator_{index}"))
        router = config.router.build(generators=generators)
        common: dict[str, Any] = dict(
            batcher=Batcher.Config().build(), generators=generators, router=router,
            abort_on_pull=config.loop.partial_rollout == "abort",
            verify_push=config.verify_weight_push,
        )
        trainer: ControllerTrainerClient
        if trainer_factory is not None:
            trainer = await trainer_factory(model_dir, **common)
        else:
            trainer_procs = this_host().spawn_procs(per_host={"procs": config.num_trainer_ranks})
            actors = await spawn_policy_trainer(trainer_procs, trainer_config_of(config),
                                                model_dir=model_dir)
            trainer = TrainerMeshClient(procs=trainer_procs, actors=actors, **common)
        trainer.batcher = config.batcher.build(dp_size=await trainer.dp_size())
    except BaseException:
        await asyncio.gather(*(g.close() for g in generators), return_exceptions=True)
        if trainer_procs is not None:
            await trainer_procs.stop()
        raise
    return SpawnedActors(trainer=trainer, generators=generators, router=router)
