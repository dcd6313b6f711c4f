"""PolicyTrainer: the trainer mesh's Monarch actor, one per trainer rank, around PolicyTrainerCore.

    controller -forward_backward(batch)-> every rank: FSDP/TP fwd+bwd (gloo/NCCL) -metrics-> controller
    controller -optim_step()-> every rank: clip, AdamW, policy_version += 1 -metrics-> controller
    controller -push_weights(generators, policy_version, verify)-> every rank: all-gather full
        tensors; rank 0: WeightPusher.push (weight_sync/push.py) -pull_model_state_dict(
        policy_version, torchtitan-named tensors: in the message, or shared-memory references
        that unpickle as tensors)-> every generator rank;
        verify: rank 0 -read_hf_weights()-> generators, compares bitwise, raises on a difference
    controller -save_checkpoint(path, extra) / load_checkpoint(path) / export_hf(path)-> every rank
    controller -compute_logprobs(batch)-> every rank -> [mb, dp, rows, seq_len] logprobs

Endpoints are concurrent (async) but run their compute inline, without awaiting: one message at
a time, in call order, since the controller awaits each call before the next. The exception is
a push to a generator that dies mid-push: its await may never end (monarch#3435); the controller
gives up on it (the generator is replaced) and the trainer serves the next calls meanwhile.

Invariants: every endpoint is called on the whole mesh (``.call``), since each runs collectives;
every rank returns the same metrics (reduced over data-parallel ranks). The controller sends the
same TrainingBatch to every rank; a rank runs its own [microbatch][dp_rank] column.

Spawn with ``await spawn_policy_trainer(procs, config, model_dir=...)`` (sets the torch elastic env on
the procs first); drive it with the controller's TrainerClient (controller/trainer_client.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any, Literal

import torch
from monarch.actor import Actor, concurrent_endpoint

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import configure_process_logging
from torchtitan_rl.faults import maybe_kill
from torchtitan_rl.trainer.batcher import TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.weight_sync.push import ActorMeshTarget, WeightPusher, WeightTransport
from torchtitan_rl.weight_sync.shared_memory import machine_id

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 600.0
"""The most one push may take before the trainer gives up on it (its generator died)."""


class PolicyTrainer(Actor, Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(PolicyTrainerCore.Config):
        """PolicyTrainerCore's config (model, dtype, optimizer, warm-up, clipping, parallelism,
        loss) plus the weight push, so ``trainer.optimizer.lr`` etc. sit at the top."""

        weight_transport: Literal["auto", "message", "shared_memory"] = "auto"
        """How rank 0 pushes weights to each generator: ``shared_memory`` copies them once into
        a POSIX shared segment and sends references (same machine only, see
        weight_sync/shared_memory.py); ``message`` pickles the tensors into the Monarch message
        (any host); ``auto`` picks shared memory for a generator on the trainer's machine and
        the message elsewhere (decided per generator at spawn, logged once)."""

    def __init__(self, config: Config, *, model_dir: str | None = None) -> None:
        configure_process_logging()  # this proc's log lines to the run's log file
        self.core = PolicyTrainerCore(config, model_dir=model_dir)
        self.weight_transport = config.weight_transport
        self.pusher = WeightPusher(model_config=self.core.model_config)

    @concurrent_endpoint
    async def get_dp_size(self) -> int:
        """Data-parallel size: the batcher's ``dp_size``."""
        return self.core.dp_size

    @concurrent_endpoint
    async def get_machine_id(self) -> str:
        """This rank's machine (hostname/boot id): whether a push can use shared memory."""
        return machine_id()

    @concurrent_endpoint
    async def get_policy_version(self) -> int:
        """Optimizer steps taken: the policy version of the current weights."""
        return self.core.policy_version

    @concurrent_endpoint
    async def forward_backward(self, batch: TrainingBatch) -> dict[str, float]:
        return self.core.forward_backward(batch)

    @concurrent_endpoint
    async def optim_step(self) -> dict[str, float]:
        metrics = self.core.optim_step()
        maybe_kill("kill_trainer_after_steps", self.core.policy_version)
        return metrics

    @concurrent_endpoint
    async def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.core.compute_logprobs(batch)

    @concurrent_endpoint
    async def read_model_state_dict(self) -> dict[str, torch.Tensor]:
        """torchtitan-named plain full tensors (collective over the trainer ranks)."""
        return self.core.full_model_state_dict()

    @concurrent_endpoint
    async def push_weights(
        self,
        generators: Any,
        policy_version: int | None = None,
        verify: bool = False,
        transport: WeightTransport | None = None,
    ) -> dict[str, float]:
        """Push the weights to ``generators`` (a generator actor mesh, e.g.
        ``GeneratorHandle.actors``) as ``policy_version`` (None: this trainer's); every rank
        gathers, rank 0 pushes. ``transport``: the controller's choice for this generator (None:
        the configured ``weight_transport``, the message when that is "auto")."""
        if policy_version is None:
            policy_version = self.core.policy_version
        start = time.perf_counter()
        state_dict = self.core.full_model_state_dict()
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self.core.rank != 0:
            return metrics
        # Bounded: a generator that dies mid-push may never answer (monarch#3435); the
        # controller replaces it and pushes again.
        metrics.update(await asyncio.wait_for(self.pusher.push(
            policy_version, state_dict, ActorMeshTarget(generators),
            transport=transport or _fixed_transport(self.weight_transport), verify=verify,
        ), PUSH_TIMEOUT_S))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed policy version %d in %.3fs", policy_version,
                    metrics["weight_sync/total_s"])
        return metrics

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


def _fixed_transport(setting: str) -> WeightTransport:
    return "message" if setting == "auto" else setting  # type: ignore[return-value]


async def spawn_policy_trainer(
    procs: Any,
    config: PolicyTrainer.Config,
    *,
    model_dir: str | os.PathLike | None,
    name: str = "policy_trainer",
) -> Any:
    """Spawn one PolicyTrainer per proc of ``procs`` (a Monarch ProcMesh) and return the actor
    mesh; sets the torch elastic env (RANK, WORLD_SIZE, MASTER_*) on the procs first."""
    from monarch.spmd import setup_torch_elastic_env_async

    await setup_torch_elastic_env_async(procs)
    model_dir_arg = str(model_dir) if model_dir is not None else None
    return procs.spawn(name, PolicyTrainer, config, model_dir=model_dir_arg)
