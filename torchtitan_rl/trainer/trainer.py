"""The trainer mesh: `PolicyTrainer`, its Monarch actor (one per rank, around PolicyTrainerCore),
and `TrainerClient`, the controller's one view of the trainer however its ranks were launched.

    loop -train_step(samples, step)-> TrainerClient -forward_backward(samples, batcher config)->
      every rank: batcher.pack(samples) -> TrainingBatch (the same on every rank), FSDP/TP
      fwd+bwd of its column (gloo/NCCL) -metrics-> controller
      -optim_step()-> every rank: clip, AdamW, policy_version += 1 -metrics-> controller
    generator pool -push_weights(generator, version)-> TrainerClient (shared memory: a
        generator on this machine) -> every rank: all-gather full tensors; rank 0:
        WeightPusher.push (weight_sync/push.py) -pull_model_state_dict(policy_version,
        shared-memory references that unpickle as tensors)-> every generator rank
    generator pool -relay_weights(chain, version, attempt)-> every rank: no gather; its own
        shards in chunks -receive_chunk-> chain[0] rank 0, which relays (weight_sync/relay.py)
    verify: -verify_weights(generators, version)-> every rank gathers; rank 0 -read_hf_weights()->
        each generator, compares bitwise, raises on a difference
    checkpointer / job -save_checkpoint / load_checkpoint / export_hf-> every rank
    tests -compute_logprobs(batch)-> every rank -> [mb, dp, rows, seq_len] logprobs

Two launches implement TrainerClient: `MonarchTrainerClient` (this actor mesh; each call goes to
every rank and returns rank 0's value) and `TorchrunTrainerClient` (rank 0 broadcasts each call
to the torchrun processes, controller/torchrun.py). Both run the same PolicyTrainerCore methods in
the same order on every rank.

Endpoints are concurrent (async) but run their compute inline, without awaiting: one message at
a time, in call order, since the controller awaits each call before the next. The exception is
a push to a generator that dies mid-push: its await may never end (monarch#3435); the controller
gives up on it (the generator is replaced) and the trainer serves the next calls meanwhile.

Invariants: every endpoint is called on the whole mesh (``.call``), since each runs collectives;
every rank returns the same metrics (reduced over data-parallel ranks). The controller sends the
same samples to every rank; each packs the same TrainingBatch and runs its own
[microbatch][dp_rank] column.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
from monarch.actor import Actor, concurrent_endpoint

from torchtitan_rl import faults
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import configure_process_logging
from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.timeline import TimelineEvent
from torchtitan_rl.types import TrainingSample
from torchtitan_rl.weight_sync.push import WeightPusher, WeightTransport
from torchtitan_rl.weight_sync.relay import LinkPacer, relay_chunks, send_chunks
from torchtitan_rl.weight_sync.shared_memory import machine_id

if TYPE_CHECKING:  # the trainer never imports the generator; the controller hands it over
    from torchtitan_rl.generator import GeneratorHandle

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 600.0
"""The most one push may take before the trainer gives up on it (its generator died)."""


class PolicyTrainer(Actor, Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(PolicyTrainerCore.Config):
        """PolicyTrainerCore's config (model, dtype, optimizer, warm-up, clipping, parallelism,
        loss) plus the weight push, so ``trainer.optimizer.lr`` etc. sit at the top."""

        weight_transport: Literal["auto", "message", "shared_memory"] = "auto"
        """How weights reach each generator: ``shared_memory``: rank 0 copies them once into a
        POSIX shared segment and sends references (same machine only, see
        weight_sync/shared_memory.py); ``message``: the relay (any host): every rank sends its
        own shards in Monarch messages down a chain of the generators (weight_sync/relay.py);
        ``auto`` picks shared memory for a generator on the trainer's machine and the relay
        elsewhere (decided per generator at spawn, logged once)."""
        relay_chunk_bytes: int = 4 << 20
        """Message pushes (generators on other machines) relay the weights down a chain of
        generators in chunks of about this many bytes (weight_sync/relay.py): a push takes about
        (chunks + generators - 1) chunk times. Smaller: more overlap between the links, more
        messages. 4 MiB: one chunk for the tiny test models, ~150 for a 600 MB model."""
        max_restarts: int = 3
        """In a job: how often a lost trainer (a rank's process died) is restarted inside the
        run: a new trainer mesh on the same hosts, restored from the newest complete checkpoint
        (or the run's start), the steps after it trained again. Once more fails the run (a rerun
        resumes). 0: a lost trainer fails the run. A torchrun launch never restarts (torchrun
        owns those processes)."""

        def __post_init__(self) -> None:
            PolicyTrainerCore.Config.__post_init__(self)
            if self.max_restarts < 0:
                raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
            if self.relay_chunk_bytes < 1:
                raise ValueError(
                    f"trainer.relay_chunk_bytes must be >= 1, got {self.relay_chunk_bytes}")

    def __init__(self, config: Config, *, model_dir: str | None = None,
                 restart: int = 0) -> None:
        """``restart``: how many trainers of this run were lost before this one (fault
        injection kills only the first)."""
        configure_process_logging()  # this proc's log lines to the run's log file
        self.core = PolicyTrainerCore(config, model_dir=model_dir)
        self.restart = restart
        self.weight_transport = config.weight_transport
        self.relay_chunk_bytes = config.relay_chunk_bytes
        self.link = LinkPacer.from_env()
        self.pusher = WeightPusher(model_config=self.core.model_config,
                                   lora_scaling=self.core.pushed_lora_scaling)

    @concurrent_endpoint
    async def get_dp_size(self) -> int:
        """Data-parallel size: the batcher's ``dp_size``."""
        return self.core.dp_size

    @concurrent_endpoint
    async def get_machine_id(self) -> str:
        """This rank's machine (hostname/boot id): whether a push can use shared memory."""
        return machine_id()

    @concurrent_endpoint
    async def get_pid(self) -> int:
        """This rank's process id (logged at start: fault tests and bench/chaos.py kill it)."""
        return os.getpid()

    @concurrent_endpoint
    async def forward_backward(self, samples: list[TrainingSample],
                               batcher: Batcher.Config) -> dict[str, float]:
        return self.core.forward_backward_samples(samples, batcher)

    @concurrent_endpoint
    async def optim_step(self) -> dict[str, float]:
        with self.core.timeline.span("optimizer"):
            metrics = self.core.optim_step()
        # key: a restored trainer trains the killed step again, and is spared
        faults.point("trainer.optimizer_step_done", self.core.policy_version, key=self.restart)
        return metrics

    @concurrent_endpoint
    async def take_timeline(self) -> list[TimelineEvent]:
        """Every rank: its forward, backward and optimizer spans since the last call
        (trainer/timeline.py)."""
        return self.core.timeline.take()

    @concurrent_endpoint
    async def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.core.compute_logprobs(batch)

    @concurrent_endpoint
    async def push_weights(
        self,
        generators: Any,
        policy_version: int,
        verify: bool = False,
        transport: WeightTransport | None = None,
    ) -> dict[str, float]:
        """Push the weights to ``generators`` (a generator actor mesh, e.g.
        ``GeneratorHandle.actors``) as ``policy_version``; every rank gathers, rank 0 pushes.
        ``transport``: the controller's choice for this generator (None: the configured
        ``weight_transport``, the message when that is "auto")."""
        start = time.perf_counter()
        state_dict = self.core.pushed_state_dict()
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self.core.rank != 0:
            return metrics
        # Bounded: a generator that dies mid-push may never answer (monarch#3435); the
        # controller replaces it and pushes again.
        metrics.update(await asyncio.wait_for(self.pusher.push(
            policy_version, state_dict, generators,
            transport=transport or _fixed_transport(self.weight_transport), verify=verify,
        ), PUSH_TIMEOUT_S))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed policy version %d in %.3fs", policy_version,
                    metrics["weight_sync/total_s"])
        return metrics

    @concurrent_endpoint
    async def relay_weights(self, chain: list[Any], policy_version: int, attempt: int
                           ) -> dict[str, float]:
        """Every rank: send the pieces of the weights this rank owns (no gather) to the head of
        ``chain`` (generator actor meshes) as push ``(policy_version, attempt)``; they relay it
        (weight_sync/relay.py). Returns this rank's ``sent_bytes`` and the ``model_bytes``."""
        start = time.perf_counter()
        chunks, model_bytes = relay_chunks(
            self.core.model_state_dict(), policy_version=policy_version, attempt=attempt,
            rank=self.core.rank, chunk_bytes=self.relay_chunk_bytes)
        sent = await send_chunks(chunks, chain, self.link)
        return {"sent_bytes": float(sent), "model_bytes": float(model_bytes),
                "send_s": time.perf_counter() - start}

    @concurrent_endpoint
    async def verify_weights(self, generators: list[Any], policy_version: int) -> int:
        """Every rank gathers the full weights (debug mode); rank 0 reads each generator's back
        and compares bit for bit: raises on a difference, else returns 0 mismatches."""
        state_dict = self.core.pushed_state_dict()
        if self.core.rank == 0:
            for mesh in generators:
                await self.pusher.verify(policy_version, state_dict, mesh)
        return 0

    def _handle_undeliverable_message(self, message: Any) -> bool:
        # A push to a generator that just died bounces; Monarch's default would fail this actor
        # (the trainer) for it. The controller replaces the generator instead.
        logger.warning("undeliverable message (a lost generator?): %s", message.error_msg())
        return True

    @concurrent_endpoint
    async def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        self.core.save_checkpoint(path, extra)

    @concurrent_endpoint
    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.core.load_checkpoint(path)

    @concurrent_endpoint
    async def export_hf(self, path: str, dtype: str = "") -> None:
        self.core.export_hf(path, dtype)


def rank0_value(values: Any) -> Any:
    """The value rank 0 returned, from the Monarch ValueMesh of a ``.call()`` on the trainer mesh
    (every rank returns the same reduced metrics; only rank 0's push metrics are complete)."""
    items = list(values.items())
    if not items:
        raise RuntimeError("empty ValueMesh: the trainer mesh has no ranks")
    return min(items, key=lambda item: item[0].rank)[1]


def sender_totals(per_sender: list[dict[str, float]]) -> dict[str, float]:
    """The trainer's side of a relayed push from each sending rank's ``relay_weights`` result."""
    return {"model_bytes": max(v["model_bytes"] for v in per_sender),
            "busiest_sender_bytes": max(v["sent_bytes"] for v in per_sender),
            "sent_bytes": sum(v["sent_bytes"] for v in per_sender),
            "send_s": max(v["send_s"] for v in per_sender)}


def _fixed_transport(setting: str) -> WeightTransport:
    return "message" if setting == "auto" else setting  # type: ignore[return-value]


async def spawn_policy_trainer(
    procs: Any,
    config: PolicyTrainer.Config,
    *,
    model_dir: str | os.PathLike | None,
    name: str = "policy_trainer",
    restart: int = 0,
) -> Any:
    """Spawn one PolicyTrainer per proc of ``procs`` (a Monarch ProcMesh) and return the actor
    mesh; sets the torch elastic env (RANK, WORLD_SIZE, MASTER_*) on the procs first."""
    from monarch.spmd import setup_torch_elastic_env_async

    await setup_torch_elastic_env_async(procs)
    model_dir_arg = str(model_dir) if model_dir is not None else None
    return procs.spawn(name, PolicyTrainer, config, model_dir=model_dir_arg, restart=restart)


# ---- the controller's side ----------------------------------------------------------------------
class TrainerClient(abc.ABC):
    """Every trainer rank, reached from the controller."""

    def __init__(self, *, dp_size: int, machine_id: str, batcher: Batcher.Config,
                 verify_push: bool) -> None:
        self.dp_size = dp_size
        """Data-parallel size (the batcher's ``dp_size``)."""
        self.machine_id = machine_id
        """Rank 0's machine (hostname/boot id): generators there can take pushes by shared memory."""
        self.batcher = batcher
        """How the trainer ranks pack each step's samples."""
        self.verify_push = verify_push
        """Read every push back from the generator and compare it bit for bit."""
        self.weights_lock = asyncio.Lock()
        """Held while the weights must not change: a training step; a replacement generator's
        push and its read-back, two calls that a step must not come between."""

    async def train_step(self, samples: list[TrainingSample], step: int) -> dict[str, float]:
        """One optimizer step on ``samples``: packed into rows, forward/backward, AdamW."""
        if not samples:
            # Every group of the step was dropped (zero reward spread): an optimizer step on no
            # tokens would still move AdamW state, so the step keeps the weights instead. The
            # loop counts such steps and warns once, at the run's end (run_health.py).
            logger.info("step %d: no training samples (all groups dropped); weights unchanged",
                        step)
            return {"trainer/skipped_empty_step": 1.0}
        async with self.weights_lock:
            metrics = dict(await self.forward_backward(samples))
            metrics.update(await self.optim_step())
        return metrics

    async def take_timeline(self) -> dict[int, list[TimelineEvent]]:
        """Every rank's forward, backward and optimizer spans since the last call, by rank
        (trainer/timeline.py); none where the ranks keep no timeline."""
        return {}

    @abc.abstractmethod
    async def forward_backward(self, samples: list[TrainingSample]) -> dict[str, float]:
        """Every rank packs ``samples`` (``self.batcher``) and runs its column of the batch;
        gradients accumulate; the metrics include the batch's ``batcher/*``."""

    @abc.abstractmethod
    async def optim_step(self) -> dict[str, float]:
        """Every rank clips, steps AdamW and advances its policy version."""

    @abc.abstractmethod
    async def push_weights(self, generator: GeneratorHandle, policy_version: int
                           ) -> dict[str, float]:
        """The trainer's weights into every rank of ``generator`` as ``policy_version``, over the
        generator's ``weight_transport`` (read back and compared bit for bit when
        ``verify_push``): every rank gathers, rank 0 pushes."""

    @abc.abstractmethod
    async def relay_weights(self, chain: list[GeneratorHandle], policy_version: int,
                            attempt: int) -> dict[str, float]:
        """Send the weights as push ``(policy_version, attempt)`` to the head of ``chain``, which
        relays them (weight_sync/relay.py); returns once sent: ``model_bytes``,
        ``busiest_sender_bytes`` and ``sent_bytes`` (summed) over the trainer's senders."""

    @abc.abstractmethod
    async def verify_weights(self, generators: list[GeneratorHandle], policy_version: int
                             ) -> None:
        """Read each generator's weights back and compare them bit for bit with the trainer's
        (a gather: debug mode); raises on a difference."""

    @abc.abstractmethod
    async def save_checkpoint(self, directory: pathlib.Path) -> None: ...

    @abc.abstractmethod
    async def load_checkpoint(self, directory: pathlib.Path) -> None: ...

    @abc.abstractmethod
    async def export_hf(self, directory: pathlib.Path) -> None:
        """The current weights as an HF model directory (config, safetensors, tokenizer)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class MonarchTrainerClient(TrainerClient):
    """A PolicyTrainer actor mesh (one actor per trainer proc); each call goes to every rank and
    returns rank 0's value."""

    def __init__(self, *, procs: Any, actors: Any, mesh_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.procs = procs
        self.actors = actors
        self.mesh_name = mesh_name
        """The actor mesh's spawn name (Monarch's failure reports name ``<mesh_name>-<id>``)."""

    @classmethod
    async def spawn(cls, procs: Any, config: Any, *, model_dir: pathlib.Path,
                    batcher: Batcher.Config, verify_push: bool,
                    restart: int = 0) -> MonarchTrainerClient:
        """``restart`` > 0: the trainer that replaces a lost one (a new mesh name, so late
        events of the lost mesh cannot match it)."""
        name = f"policy_trainer_r{restart}" if restart else "policy_trainer"
        actors = await spawn_policy_trainer(procs, config, model_dir=model_dir, name=name,
                                            restart=restart)
        dp_size = int(rank0_value(await actors.get_dp_size.call()))
        machine = str(rank0_value(await actors.get_machine_id.call()))
        pids = [pid for _, pid in sorted((point.rank, pid) for point, pid in
                                         (await actors.get_pid.call()).items())]
        logger.info("trainer %s started (pids %s on %s)", name, ",".join(map(str, pids)),
                    machine)
        return cls(procs=procs, actors=actors, mesh_name=name, dp_size=dp_size,
                   machine_id=machine, batcher=batcher, verify_push=verify_push)

    async def forward_backward(self, samples: list[TrainingSample]) -> dict[str, float]:
        return rank0_value(await self.actors.forward_backward.call(samples, self.batcher))

    async def optim_step(self) -> dict[str, float]:
        return rank0_value(await self.actors.optim_step.call())

    async def take_timeline(self) -> dict[int, list[TimelineEvent]]:
        return {point.rank: events
                for point, events in (await self.actors.take_timeline.call()).items()}

    async def push_weights(self, generator: GeneratorHandle, policy_version: int
                           ) -> dict[str, float]:
        assert generator.weight_transport is not None, "the pool picks each generator's transport"
        return rank0_value(await self.actors.push_weights.call(
            generator.actors, policy_version, self.verify_push, generator.weight_transport))

    async def relay_weights(self, chain: list[GeneratorHandle], policy_version: int,
                            attempt: int) -> dict[str, float]:
        values = await self.actors.relay_weights.call([h.actors for h in chain], policy_version,
                                                     attempt)
        return sender_totals([value for _, value in values.items()])

    async def verify_weights(self, generators: list[GeneratorHandle], policy_version: int
                             ) -> None:
        await self.actors.verify_weights.call([h.actors for h in generators], policy_version)

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        await self.actors.save_checkpoint.call(str(directory), None)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        await self.actors.load_checkpoint.call(str(directory))

    async def export_hf(self, directory: pathlib.Path) -> None:
        await self.actors.export_hf.call(str(directory), "")

    async def close(self) -> None:
        await self.procs.stop()

