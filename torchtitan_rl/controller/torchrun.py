"""The torchrun launch: the torchrun processes are the trainer ranks; rank 0 also the controller.

    torchrun --nproc_per_node=N -m torchtitan_rl.train --config ... --num_trainer_ranks N

    every rank   train.cli -> torchrun_rank() is set -> run_rank0 / run_follower
                 check_torchrun_config: num_trainer_ranks == WORLD_SIZE, else one ConfigError line
                 TrainerRank.join: the process group torchrun describes + a gloo command group
    rank 0       RLJob(config).run_async(spawn_trainer_ranks=...): the Monarch launch's controller,
                 unchanged (generator meshes are still spawned with Monarch, from this process),
                 with TorchrunTrainerRanks behind the one TrainerClient (trainer_client.py):
                   spawn:         send build(resolved trainer config, model_dir)
                   call(method):  send the PolicyTrainerCore method (forward_backward, ...)
                   push_weights:  send full_model_state_dict() (every rank gathers); rank 0
                                  pushes it with WeightPusher (weight_sync/push.py)
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
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.spawn import SpawnTrainerRanks
from torchtitan_rl.generator import GeneratorHandle
from torchtitan_rl.trainer.core import PolicyTrainerCore, _device_type
from torchtitan_rl.trainer.parallel import init_trainer_distributed
from torchtitan_rl.weight_sync.push import WeightPusher, WeightTransport
from torchtitan_rl.weight_sync.shared_memory import machine_id

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
    if config.placement.kind != "local":
        raise ConfigError(
            f"placement.kind={config.placement.kind!r}: a torchrun launch places the trainer "
            "itself (its ranks are the torchrun processes); use placement.kind = \"local\", or "
            "launch with python -m torchtitan_rl.train to let the placement spawn the trainer"
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


class TorchrunTrainerRanks:
    """`TrainerRanks` over the torchrun processes (rank 0 only): every call is a Command."""

    def __init__(self, *, trainer: TrainerRank, executor: concurrent.futures.Executor) -> None:
        self.trainer = trainer
        self.executor = executor
        self.dp_size = 0
        self.machine_id = machine_id()  # rank 0 is this process
        self._pusher: WeightPusher | None = None

    async def call(self, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        command = Command(method, args)  # type: ignore[arg-type]
        return await loop.run_in_executor(self.executor, self.trainer.send, command)

    async def push_weights(self, generator: GeneratorHandle, version: int, *,
                           verify: bool, transport: WeightTransport) -> dict[str, float]:
        start = time.perf_counter()
        state_dict = await self.call("full_model_state_dict")
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self._pusher is None:
            assert self.trainer.core is not None
            self._pusher = WeightPusher(model_config=self.trainer.core.model_config)
        metrics.update(await self._pusher.push(
            version, state_dict, generator, transport=transport, verify=verify))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed weights v%d in %.3fs", version, metrics["weight_sync/total_s"])
        return metrics

    async def close(self) -> None:
        if not self.trainer.stopped:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.trainer.stop)
        if self._pusher is not None:
            self._pusher.close()


def torchrun_trainer_ranks(trainer: TrainerRank,
                           executor: concurrent.futures.Executor) -> SpawnTrainerRanks:
    """build_parts' ``spawn_trainer_ranks``: every rank builds its PolicyTrainerCore from the
    resolved trainer config and the run's model directory."""

    async def build(trainer_config: Any, model_dir: pathlib.Path) -> TorchrunTrainerRanks:
        ranks = TorchrunTrainerRanks(trainer=trainer, executor=executor)
        await ranks.call("build", trainer_config, str(model_dir))
        assert trainer.core is not None
        ranks.dp_size = trainer.core.dp_size
        return ranks

    return build


def run_rank0(config: Any) -> dict[str, Any]:
    """Rank 0: join, run the job with the torchrun ranks as its trainer; followers are stopped
    whatever happens. Returns the run's summary."""
    check_torchrun_config(config)
    trainer = TrainerRank.join(config.trainer.device)
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer_rank0")
    ranks = torchrun_trainer_ranks(trainer, executor)
    try:
        with _without_launcher_env():
            job = RLJob(config)
            return asyncio.run(job.run_async(spawn_trainer_ranks=ranks))
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
