"""PolicyTrainer: the trainer mesh's Monarch actor, one per trainer rank, around PolicyTrainerCore.

    controller -forward_backward(batch)-> every rank: FSDP/TP fwd+bwd (gloo/NCCL) -metrics-> controller
    controller -optim_step()-> every rank: clip, AdamW, policy_version += 1 -metrics-> controller
    controller -push_weights(generators, version, verify)-> every rank: all-gather full tensors;
        rank 0 -pull_model_state_dict(version, torchtitan-named tensors: in the message, or
        shared-memory references that unpickle as tensors)-> every generator;
        verify: rank 0 -read_hf_weights()-> generators, compares bitwise, raises on a difference
    controller -save_checkpoint(path, extra) / load_checkpoint(path) / export_hf(path)-> every rank
    controller -compute_logprobs(batch)-> every rank -> [mb, dp, rows, seq_len] logprobs

Endpoints are async (Monarch refuses to mix sync and async endpoints on one actor) but run their
compute inline: one message at a time, in call order.

Invariants: every endpoint is called on the whole mesh (``.call``), since each runs collectives;
every rank returns the same metrics (reduced over data-parallel ranks). The controller sends the
same TrainingBatch to every rank; a rank runs its own [microbatch][dp_rank] column.

Spawn with ``await spawn_policy_trainer(procs, config, model_dir=...)`` (sets the torch elastic env on
the procs first); drive it with ``trainer.client.train_step`` and ``trainer.client.push_weights``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Literal

import torch
from monarch.actor import Actor, endpoint

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.trainer.batcher import TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.weight_handoff import WeightHandoff

logger = logging.getLogger(__name__)


class PolicyTrainer(Actor, Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(PolicyTrainerCore.Config):
        """PolicyTrainerCore's config (model, dtype, optimizer, warm-up, clipping, parallelism,
        loss) plus the weight hand-off, so ``trainer.optimizer.lr`` etc. sit at the top."""

        weight_transport: Literal["message", "shared_memory"] = "message"
        """How rank 0 hands weights to generators: ``message`` pickles the tensors into the
        Monarch message (any host); ``shared_memory`` copies them once into a POSIX shared
        segment and sends references (same host only, see trainer/shm_transport.py)."""

    def __init__(self, config: Config, *, model_dir: str | None = None) -> None:
        self.core = PolicyTrainerCore(config, model_dir=model_dir)
        self.weight_transport = config.weight_transport
        self.handoff = WeightHandoff(model_config=self.core.model_config)

    @endpoint
    async def dp_size(self) -> int:
        """Data-parallel size: the batcher's ``dp_size``."""
        return self.core.dp_size

    @endpoint
    async def policy_version(self) -> int:
        return self.core.policy_version

    @endpoint
    async def forward_backward(self, batch: TrainingBatch) -> dict[str, float]:
        return self.core.forward_backward(batch)

    @endpoint
    async def optim_step(self) -> dict[str, float]:
        return self.core.optim_step()

    @endpoint
    async def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.core.compute_logprobs(batch)

    @endpoint
    async def model_state_dict(self) -> dict[str, torch.Tensor]:
        """torchtitan-named plain full tensors (collective over the trainer ranks)."""
        return self.core.full_model_state_dict()

    @endpoint
    async def push_weights(
        self,
        generators: Any,
        version: int | None = None,
        verify: bool = False,
        transport: str | None = None,
    ) -> dict[str, float]:
        """Hand the weights to ``generators`` (an actor mesh with ``pull_model_state_dict``);
        ``transport`` overrides the configured ``weight_transport`` for this push."""
        version = self.core.policy_version if version is None else version
        start = time.perf_counter()
        state_dict = self.core.full_model_state_dict()
        metrics = {"weight_sync/gather_s": time.perf_counter() - start}
        if self.core.rank != 0:
            return metrics

        async def read_back() -> list[dict[str, torch.Tensor]]:
            return [weights for _, weights in (await generators.read_hf_weights.call()).items()]

        metrics.update(await self.handoff.push(
            version, state_dict, transport=transport or self.weight_transport,
            pull=generators.pull_model_state_dict.call,
            read_back=read_back if verify else None,
        ))
        metrics["weight_sync/total_s"] = time.perf_counter() - start
        logger.info("pushed weights v%d in %.3fs", version, metrics["weight_sync/total_s"])
        return metrics

    @endpoint
    async def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        self.core.save_checkpoint(path, extra)

    @endpoint
    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.core.load_checkpoint(path)

    @endpoint
    async def export_hf(self, path: str, dtype: str = "") -> None:
        self.core.export_hf(path, dtype)


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
