"""The torchrun launch: the torchrun processes are the trainer ranks; rank 0 also the controller.

    torchrun --nproc_per_node=N -m torchtitan_rl.train --config ... --num_trainer_ranks N

    every rank   train.cli -> torchrun_rank() is set -> run_rank0 / run_follower
                 check_torchrun_config: num_trainer_ranks == WORLD_SIZE, else one ConfigError line
                 TrainerRank.join: the process group torchrun describes + a gloo command group
    rank 0       run_job(config, trainer_factory=...)    the Monarch launch's controller, unchanged
                 (generator meshes are still spawned with Monarch, from this process)
                   spawn_actors -> factory(model_dir): send build(trainer config, model_dir)
                   train_step:    pack the batch; send forward_backward(batch); send optim_step()
                   push_weights:  per generator (router syncing flag, abort_on_pull as under
                                  Monarch): send full_model_state_dict() (every rank gathers);
                                  rank 0 -> handle.pull_model_state_dict(version, state dict)
                   save_checkpoint / load_checkpoint / export_hf: send the core's method
                   close(), and the finally of run_rank0 when the run fails: send stop
    ranks > 0    TrainerRank.follow(): receive a command, run it on this rank's
                 PolicyTrainerCore, repeat until stop; then exit 0 and print nothing
                 (also on a config error: the job's exit code is rank 0's)

"send" = rank 0 broadcasts the Command (method name, args) on the command group, then runs the
same PolicyTrainerCore method itself. The core's methods run collectives, so every rank runs them
in the same order, exactly as the PolicyTrainer actor's endpoints do under Monarch
(trainer/trainer.py). On rank 0 every send runs in one worker thread, so the controller's event
loop (rollouts, the async loop) keeps going while the trainer computes.

While rank 0's controller runs, the torch elastic variables (RANK, WORLD_SIZE, MASTER_PORT, ...)
are taken out of its environment: procs that Monarch spawns inherit it, and the generators must
not believe they are rank 0 of the trainer's group. All ranks read ``model_dir`` from the same
file system (one host, or a shared one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch.distributed as dist

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.runner import run_job
from torchtitan_rl.controller.setup import (
    ControllerTrainerClient,
    TrainerFactory,
    trainer_config_of,
)
from torchtitan_rl.generator import GeneratorHandle
from torchtitan_rl.trainer.batcher import TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore, _device_type
from torchtitan_rl.trainer.parallel import init_trainer_distributed
from torchtitan_rl.trainer.weight_handoff import WeightHandoff

logger = logging.getLogger(__name__)

COMMAND_WAIT = datetime.timedelta(hours=24)
"""How long a follower waits for rank 0's next command (generation and validation run between
two commands; the gloo default of 30 minutes would end long runs)."""

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")

Method = Literal["build", "forward_backward", "optim_step", "full_model_state_dict",
                 "save_checkpoint", "load_checkpoint", "export_hf", "stop"]


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another torch elastic launcher) started it, else
    None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ
                                               and "WORLD_SIZE" in os.environ):
        return int(os.environ.get("RANK", "0"))
    return None


def check_torchrun_config(config: Any) -> None:
    """What every rank checks before joining the group; raises one ConfigError line."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if config.num_trainer_ranks != world_size:
        raise ConfigError(
            f"num_trainer_ranks={config.num_trainer_ranks} must equal the torchrun world size "
            f"WORLD_SIZE={world_size} (set --num_trainer_ranks {world_size}, or torchrun "
            f"--nproc_per_node {config.num_trainer_ranks})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    method: Method
    args: tuple[Any, ...] = ()


class TrainerRank:
    """This process's trainer rank: its PolicyTrainerCore (once ``build`` ran) and the command
    group rank 0 broadcasts on (None when WORLD_SIZE is 1)."""

    def __init__(self, *, rank: int, world_size: int, group: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.core: PolicyTrainerCore | None = None
        self.stopped = False

    @classmethod
    def join(cls, device: str) -> TrainerRank:
        """Join the process group torchrun describes (gloo on CPU, NCCL on GPU), then create
        the gloo command group (a collective: every rank calls this once, first)."""
        rank, world_size = init_trainer_distributed(_device_type(device))
        group = dist.new_group(backend="gloo", timeout=COMMAND_WAIT) if world_size > 1 else None
        logger.info("torchrun trainer rank %d/%d joined", rank, world_size)
        return cls(rank=rank, world_size=world_size, group=group)

    def send(self, command: Command) -> Any:
        """Rank 0: broadcast ``command`` to the followers, then run it here."""
        if self.stopped:
            raise RuntimeError(f"trainer ranks already stopped; cannot run {command.method}")
        if self.group is not None:
            dist.broadcast_object_list([command], src=0, group=self.group)
        if command.method == "stop":
            self.stopped = True
            return None
        return self._execute(command)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it sends stop."""
        logger.info("trainer rank %d: following rank 0's commands", self.rank)
        while True:
            received: list[Any] = [None]
            dist.broadcast_object_list(received, src=0, group=self.group)
            command: Command = received[0]
            if command.method == "stop":
                self.stopped = True
                logger.info("trainer rank %d: stop", self.rank)
                return
            self._execute(command)

    def stop(self) -> None:
        """Rank 0: let the followers leave their loop (once; a broken group is only logged)."""
        if self.stopped:
            return
        try:
            self.send(Command("stop"))
        except Exception as e:  # a follower died: torchrun ends the others
            self.stopped = True
            logger.warning("could not send stop to the trainer ranks: %r", e)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _execute(self, command: Command) -> Any:
        if command.method == "build":
            trainer_config, model_dir = command.args
            self.core = PolicyTrainerCore(trainer_config, model_dir=model_dir)
            return None
        if self.core is None:
            raise RuntimeError(f"{command.method} before build")
        return getattr(self.core, command.method)(*command.args)


class SpmdTrainerClient(ControllerTrainerClient):
    """The controller's `TrainerClient` over the torchrun trainer ranks (rank 0 only)."""

    def __init__(self, *, trainer: TrainerRank, executor: concurrent.futures.Executor,
                 weight_transport: str, **common: Any) -> None:
        super().__init__(**common)
        self.trainer = trainer
        self.executor = executor
        self.weight_transport = weight_transport
        self._handoff: WeightHandoff | None = None

    async def send(self, method: Method, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.trainer.send, Command(method, args))

    async def _train_batch(self, batch: TrainingBatch) -> dict[str, float]:
        metrics = dict(await self.send("forward_backward", batch))
        metrics.update(await self.send("optim_step"))
        return metrics

    async def _push_to(self, generator: GeneratorHandle, version: int) -> dict[str, float]:
        start = time.perf_counter()
        state_dict = await self.send("full_model_state_dict")
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self._handoff is None:
            assert self.trainer.core is not None
            self._handoff = WeightHandoff(model_config=self.trainer.core.model_config)

        async def read_back() -> list[dict[str, Any]]:
            per_rank = await generator.actors.read_hf_weights.call()
            return [weights for _, weights in per_rank.items()]

        metrics.update(await self._handoff.push(
            version, state_dict, transport=self.weight_transport,
            pull=generator.pull_model_state_dict,
            read_back=read_back if self.verify_push else None,
        ))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed weights v%d in %.3fs", version, metrics["weight_sync/total_s"])
        return metrics

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        await self.send("save_checkpoint", str(directory), None)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        await self.send("load_checkpoint", str(directory))

    async def export_hf(self, directory: pathlib.Path) -> None:
        await self.send("export_hf", str(directory), "")

    async def dp_size(self) -> int:
        assert self.trainer.core is not None
        return self.trainer.core.dp_size

    async def close(self) -> None:
        if not self.trainer.stopped:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.trainer.stop)
        if self._handoff is not None:
            self._handoff.close()


def spmd_trainer_factory(trainer: TrainerRank, trainer_config: Any,
                         executor: concurrent.futures.Executor) -> TrainerFactory:
    """spawn_actors' trainer_factory: every rank builds its PolicyTrainerCore from
    ``trainer_config`` and the run's model directory."""

    async def build(model_dir: pathlib.Path, **common: Any) -> ControllerTrainerClient:
        client = SpmdTrainerClient(trainer=trainer, executor=executor,
                                   weight_transport=trainer_config.weight_transport, **common)
        await client.send("build", trainer_config, str(model_dir))
        return client

    return build


def run_rank0(config: Any) -> dict[str, Any]:
    """Rank 0: join, run the job with the torchrun ranks as its trainer; followers are stopped
    whatever happens. Returns the run's summary."""
    check_torchrun_config(config)
    trainer = TrainerRank.join(config.trainer.device)
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer_rank0")
    factory = spmd_trainer_factory(trainer, trainer_config_of(config), executor)
    try:
        with _without_launcher_env():
            return asyncio.run(run_job(config, trainer_factory=factory))
    finally:
        executor.shutdown(wait=True)
        trainer.stop()
        trainer.leave()


def run_follower(config: Any) -> int:
    """Ranks > 0: run rank 0's trainer commands until stop. Returns the exit code: 0, also on a
    config error, which rank 0 reports with code 2 (a follower failing first would get rank 0
    killed by torchrun before it could print the error)."""
    try:
        check_torchrun_config(config)
    except ConfigError:
        return 0
    trainer = TrainerRank.join(config.trainer.device)
    trainer.follow()
    trainer.leave()
    return 0


@contextlib.contextmanager
def _without_launcher_env() -> Iterator[None]:
    names = [n for n in os.environ if n in _LAUNCHER_ENV or n.startswith("TORCHELASTIC_")]
    saved = {n: os.environ.pop(n) for n in names}
    try:
        yield
    finally:
        os.environ.update(saved)
