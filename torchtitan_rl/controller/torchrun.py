"""The torchrun launch: the torchrun processes are the trainer ranks; rank 0 also the controller.

    torchrun --nproc_per_node=N -m torchtitan_rl.train --config ... --num_trainer_ranks N

    every rank   train.cli -> torchrun_rank() is set -> run_rank0 / run_follower
                 check_torchrun_config: num_trainer_ranks == WORLD_SIZE, else one ConfigError line
                 TrainerRank.join: the process group torchrun describes + a gloo command group
    rank 0       RLJob(config).run_async(spawn_trainer=...): the Monarch launch's controller,
                 unchanged (generator meshes are still spawned with Monarch, from this process),
                 with a TorchrunTrainerClient as its TrainerClient (trainer/trainer.py):
                   spawn:         send PolicyTrainerCore(resolved trainer config, model_dir)
                   each call:     send the PolicyTrainerCore method (forward_backward, ...)
                   push_weights:  send full_model_state_dict (every rank gathers); rank 0
                                  pushes it with WeightPusher (weight_sync/push.py)
                   relay_weights: the same gather, then rank 0 alone sends the chunks to the
                                  relay chain (the followers are no Monarch actors)
                   close(), and the finally of run_rank0 when the run fails: send stop
    ranks > 0    TrainerRank.follow(): receive a command, run it on this rank's
                 PolicyTrainerCore, repeat until stop; then exit 0 and print nothing
                 (also on a config error: the job's exit code is rank 0's)

"send" = rank 0 broadcasts the Command (a PolicyTrainerCore method, pickled by its qualified name,
and its args) on the command group, then runs the same method itself. The core's methods run collectives, so every rank runs them
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
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.hosts.reaper import run_stoppable
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.spawn import SpawnTrainer
from torchtitan_rl.generator import GeneratorHandle
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.trainer import TrainerClient, sender_totals
from torchtitan_rl.types import TrainingSample
from torchtitan_rl.weight_sync.push import WeightPusher
from torchtitan_rl.weight_sync.relay import LinkPacer, relay_chunks, send_chunks
from torchtitan_rl.weight_sync.shared_memory import machine_id

logger = logging.getLogger(__name__)

COMMAND_WAIT = datetime.timedelta(hours=24)
"""How long a follower waits for rank 0's next command (generation and validation run between
two commands; the gloo default of 30 minutes would end long runs)."""

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")

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
    """What every rank runs next: ``PolicyTrainerCore`` itself (build this rank's core from
    ``args``), one of its methods (run on this rank's core), or None (stop following)."""

    method: Callable[..., Any] | None
    args: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return "stop" if self.method is None else self.method.__name__


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
        # Here, not at the top: every `torchtitan_rl.train` imports this module to ask
        # torchrun_rank(), and torchtitan's parallelism costs seconds to import.
        from torchtitan_rl.trainer.parallel import init_trainer_distributed, resolve_device_type

        rank, world_size = init_trainer_distributed(resolve_device_type(device))
        group = dist.new_group(backend="gloo", timeout=COMMAND_WAIT) if world_size > 1 else None
        logger.info("torchrun trainer rank %d/%d joined", rank, world_size)
        return cls(rank=rank, world_size=world_size, group=group)

    def send(self, command: Command) -> Any:
        """Rank 0: broadcast ``command`` to the followers, then run it here."""
        if self.stopped:
            raise RuntimeError(f"trainer ranks already stopped; cannot run {command.name}")
        if self.group is not None:
            dist.broadcast_object_list([command], src=0, group=self.group)
        if command.method is None:
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
            if command.method is None:
                self.stopped = True
                logger.info("trainer rank %d: stop", self.rank)
                return
            self._execute(command)

    def stop(self) -> None:
        """Rank 0: let the followers leave their loop (once; a broken group is only logged)."""
        if self.stopped:
            return
        try:
            self.send(Command(None))
        except Exception as e:  # a follower died: torchrun ends the others
            self.stopped = True
            logger.warning("could not send stop to the trainer ranks: %r", e)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _execute(self, command: Command) -> Any:
        assert command.method is not None
        if command.method is PolicyTrainerCore:
            trainer_config, model_dir = command.args
            self.core = PolicyTrainerCore(trainer_config, model_dir=model_dir)
            return None
        if self.core is None:
            raise RuntimeError(f"{command.name} before the trainer core was built")
        return command.method(self.core, *command.args)


class TorchrunTrainerClient(TrainerClient):
    """The torchrun processes as the `TrainerClient` (rank 0 only): every call is a Command,
    sent from one worker thread so that the controller's event loop keeps going."""

    def __init__(self, *, trainer: TrainerRank, executor: concurrent.futures.Executor,
                 relay_chunk_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trainer = trainer
        self.executor = executor
        self.relay_chunk_bytes = relay_chunk_bytes
        self._pusher: WeightPusher | None = None
        self._link = LinkPacer.from_env()

    async def _send(self, method: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.trainer.send, Command(method, args))

    async def forward_backward(self, samples: list[TrainingSample]) -> dict[str, float]:
        return await self._send(PolicyTrainerCore.forward_backward_samples, samples, self.batcher)

    async def optim_step(self) -> dict[str, float]:
        return await self._send(PolicyTrainerCore.optim_step)

    async def push_weights(self, generator: GeneratorHandle, policy_version: int
                           ) -> dict[str, float]:
        assert generator.weight_transport is not None, "the pool picks each generator's transport"
        start = time.perf_counter()
        state_dict = await self._send(PolicyTrainerCore.pushed_state_dict)
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self._pusher is None:
            assert self.trainer.core is not None
            self._pusher = WeightPusher(model_config=self.trainer.core.model_config,
                                        lora_scaling=self.trainer.core.pushed_lora_scaling)
        metrics.update(await self._pusher.push(
            policy_version, state_dict, generator.actors, transport=generator.weight_transport,
            verify=self.verify_push))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed weights v%d in %.3fs", policy_version,
                    metrics["weight_sync/total_s"])
        return metrics

    async def relay_weights(self, chain: list[GeneratorHandle], policy_version: int,
                            attempt: int) -> dict[str, float]:
        start = time.perf_counter()
        state_dict = await self._send(PolicyTrainerCore.pushed_state_dict)
        chunks, model_bytes = relay_chunks(state_dict, policy_version=policy_version,
                                           attempt=attempt,
                                           rank=0, chunk_bytes=self.relay_chunk_bytes)
        sent = await send_chunks(chunks, [h.actors for h in chain], self._link)
        return sender_totals([{"sent_bytes": float(sent), "model_bytes": float(model_bytes),
                               "send_s": time.perf_counter() - start}])

    async def verify_weights(self, generators: list[GeneratorHandle], policy_version: int
                             ) -> None:
        state_dict = await self._send(PolicyTrainerCore.pushed_state_dict)
        for generator in generators:
            await self._pusher_for_verify().verify(policy_version, state_dict, generator.actors)

    def _pusher_for_verify(self) -> WeightPusher:
        if self._pusher is None:
            assert self.trainer.core is not None
            self._pusher = WeightPusher(model_config=self.trainer.core.model_config,
                                        lora_scaling=self.trainer.core.pushed_lora_scaling)
        return self._pusher

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        await self._send(PolicyTrainerCore.save_checkpoint, str(directory), None)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        await self._send(PolicyTrainerCore.load_checkpoint, str(directory))

    async def export_hf(self, directory: pathlib.Path) -> None:
        await self._send(PolicyTrainerCore.export_hf, str(directory), "")

    async def close(self) -> None:
        if not self.trainer.stopped:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.trainer.stop)
        if self._pusher is not None:
            self._pusher.close()


def torchrun_trainer(trainer: TrainerRank, executor: concurrent.futures.Executor) -> SpawnTrainer:
    """build_parts' ``spawn_trainer``: every rank builds its PolicyTrainerCore from the resolved
    trainer config and the run's model directory."""

    async def build(trainer_config: Any, model_dir: pathlib.Path, *, batcher: Batcher.Config,
                    verify_push: bool) -> TorchrunTrainerClient:
        loop = asyncio.get_running_loop()
        command = Command(PolicyTrainerCore, (trainer_config, str(model_dir)))
        await loop.run_in_executor(executor, trainer.send, command)
        assert trainer.core is not None
        return TorchrunTrainerClient(trainer=trainer, executor=executor,
                                     relay_chunk_bytes=trainer_config.relay_chunk_bytes,
                                     dp_size=trainer.core.dp_size, machine_id=machine_id(),
                                     batcher=batcher, verify_push=verify_push)

    return build


def run_rank0(config: Any) -> dict[str, Any]:
    """Rank 0: join, run the job with the torchrun ranks as its trainer; followers are stopped
    whatever happens. Returns the run's summary."""
    check_torchrun_config(config)
    trainer = TrainerRank.join(config.trainer.device)
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer_rank0")
    spawn_trainer = torchrun_trainer(trainer, executor)
    try:
        with _without_launcher_env():
            job = RLJob(config)
            return run_stoppable(job.run_async(spawn_trainer=spawn_trainer))
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
