"""The trainer's logic without Monarch: one instance per trainer rank (torchrun, Monarch, or alone).

    core = PolicyTrainerCore.Config(...).build(model_dir=hf_dir)   # every rank, same config
    for each step:
        core.forward_backward_samples(samples, batcher)  # every rank packs the same grid, runs
                                       # its column (forward_backward(batch)); grads accumulate;
                                       # k mini-batches x e epochs: all updates but the last
                                       # (minibatches.py)
        core.optim_step()              # clip, AdamW, policy_version += 1
    core.pushed_state_dict()           # collective: plain full tensors a push sends (the
                                       # weights; with LoRA's adapter push, the adapters)
    core.save_checkpoint(dir, extra) / core.load_checkpoint(dir) / core.export_hf(dir)

Where each concern lives: the loss (loss.py), the critic and GAE (critic.py), the KL's reference
model (reference.py), the mini-batch split and its metrics (minibatches.py), the state dicts of
pushes, relays and exports (weights.py), checkpoints (checkpoint.py); this class builds them and
runs the step.

Collectives: forward_backward and optim_step run FSDP/TP collectives and all-reduce metrics over
the data-parallel ranks; full_model_state_dict, save/load and export are collectives too. Every
rank must call them in the same order. A lone process (WORLD_SIZE unset or 1) runs unparallelised.

Determinism: nothing in a step draws random numbers; the learning rate is a pure function of the
step; a checkpoint holds model, AdamW state and ``policy_version`` (the step), so a resumed run
repeats the uninterrupted one bit for bit on the same hardware and thread count.

torchtitan's model and parallelism, DTensor and DCP are imported where a trainer uses them: the
controller imports this module for its ``Config`` and would pay seconds for them at every start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from torchtitan_rl import faults
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.trainer.batch_log import BatchLog
from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.trainer.critic import CriticTargets, ValueCritic
from torchtitan_rl.trainer.flops import UtilizationMeter
from torchtitan_rl.trainer.lora import LoRA
from torchtitan_rl.trainer.loss import (
    MAX_KEYS,
    SUM_KEYS,
    PolicyLoss,
    finalize_loss_metrics,
    token_logprobs_and_entropy,
)
from torchtitan_rl.trainer.minibatches import combine_update_metrics, split_groups
from torchtitan_rl.trainer.reference import ReferencePolicy
from torchtitan_rl.trainer.timeline import RankTimeline
from torchtitan_rl.trainer.weights import PolicyWeights
from torchtitan_rl.types import TrainingSample

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The trainer's AdamW (torch.optim.AdamW, foreach)."""

    lr: float = 1e-5
    """AdamW peak learning rate (after warm-up). > 0."""
    beta1: float = 0.9
    """AdamW's first-moment (momentum) decay, in [0, 1)."""
    beta2: float = 0.999
    """AdamW's second-moment decay, in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (multiplied by lr each step); 0 disables it. >= 0."""
    eps: float = 1e-8
    """Added to the denominator's square root for numerical stability. > 0."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")


class PolicyTrainerCore(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        flavor: str = ""
        """torchtitan Qwen3 flavor (e.g. ``debugmodel``) initialised from ``seed``; empty: load the
        HF model directory given to build(model_dir=...)."""
        dtype: Literal["float32", "bfloat16"] = "float32"
        """Compute dtype. Parameters and optimizer state stay float32; bfloat16 computes through
        FSDP mixed precision (several ranks) or autocast (one rank)."""
        attn_backend: Literal["sdpa_packed", "flex", "varlen"] = "sdpa_packed"
        """Inner attention: ``sdpa_packed`` works on CPU; flex/varlen need a GPU."""
        device: Literal["auto", "cpu", "cuda"] = "auto"
        """auto: cuda when available, else cpu."""
        optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
        lr_warmup_steps: int = 0
        """Linear warm-up: step s (0-based) uses lr * min(1, (s + 1) / lr_warmup_steps). >= 0."""
        max_grad_norm: float | None = 1.0
        """Clip the global gradient norm to this; None: no clipping (the norm is still logged)."""
        data_parallel_shard_degree: int = -1
        """FSDP degree; -1: world size / tensor_parallel_degree."""
        tensor_parallel_degree: int = 1
        """TP degree; must divide the model's heads and kv heads."""
        seed: int = 0
        """Seeds torch (only a flavor's random init draws from it)."""
        num_threads: int | None = None
        """torch intra-op threads of this rank; None leaves torch's default. On a small CPU box
        give each rank cores / ranks (spinning OpenMP threads on shared cores stall training)."""
        loss: PolicyLoss.Config = dataclasses.field(default_factory=PolicyLoss.Config)
        critic: ValueCritic.Config = dataclasses.field(default_factory=ValueCritic.Config)
        """PPO's value model and GAE advantages (trainer/critic.py); off by default."""
        lora: LoRA.Config = dataclasses.field(default_factory=LoRA.Config)
        """Low-rank adapters on a frozen base (trainer/lora.py); off by default."""
        num_minibatches: int = 1
        """k: a step's groups split into this many mini-batches of whole groups, each its own
        optimizer update (verl's ppo_mini_batch_size = groups per step / k; SkyRL's
        policy_mini_batch_size); at most loop.groups_per_step. >= 1 (trainer/minibatches.py)."""
        ppo_epochs: int = 1
        """e: passes over the step's mini-batches (verl's ppo_epochs, TRL's num_iterations,
        SkyRL's update_epochs_per_batch); k * e updates a step, one policy version. With k * e > 1
        the old policy's logprobs are recomputed before the first update. >= 1."""
        debug_batch_log: str = ""
        """Debugging and tests ("" = off): a JSONL file, one line per microbatch each rank trains
        on: input_ids, positions, document_ids, loss_mask, advantages (trainer/batch_log.py)."""

        def __post_init__(self) -> None:
            for name in ("num_minibatches", "ppo_epochs"):
                if getattr(self, name) < 1:
                    raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
            if self.lr_warmup_steps < 0:
                raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
            if self.max_grad_norm is not None and self.max_grad_norm <= 0:
                raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
            if self.num_threads is not None and self.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
            if self.loss.kl_placement == "reward" and not (self.critic.enabled
                                                            and self.loss.kl_coef > 0):
                raise ValueError("loss.kl_placement = 'reward' needs loss.kl_coef > 0 and "
                                 "critic.enabled (the penalty enters the rewards GAE reads)")
            if self.lora.enabled and self.critic.enabled:
                raise ValueError("trainer.lora.enabled with trainer.critic.enabled: the value "
                                 "model would be a frozen copy; use one of them")
            if self.critic.enabled and self.tensor_parallel_degree != 1:
                raise ValueError("critic.enabled needs tensor_parallel_degree 1 (the value head "
                                 "is not sharded)")
            if self.tensor_parallel_degree < 1:
                raise ValueError(
                    f"tensor_parallel_degree must be >= 1, got {self.tensor_parallel_degree}"
                )
            if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
                raise ValueError(
                    "data_parallel_shard_degree must be -1 or >= 1, got "
                    f"{self.data_parallel_shard_degree}"
                )

        @property
        def num_updates(self) -> int:
            """Optimizer updates a step: num_minibatches * ppo_epochs."""
            return self.num_minibatches * self.ppo_epochs

    def __init__(self, config: Config, *, model_dir: str | os.PathLike | None = None) -> None:
        if not config.flavor and model_dir is None:
            raise ValueError("PolicyTrainerCore needs build(model_dir=...) or config.flavor")
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = str(model_dir) if model_dir is not None else None
        from torchtitan_rl.models.qwen3 import qwen3_flavor_config, torchtitan_qwen3_config
        from torchtitan_rl.trainer.parallel import (
            build_parallel_dims,
            init_trainer_distributed,
            prepare_config_for_parallelism,
            resolve_device_type,
        )

        self.device_type = resolve_device_type(config.device)
        self.rank, self.world_size = init_trainer_distributed(self.device_type)
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if self.device_type == "cuda" else "cpu"
        )
        self.compute_dtype = _DTYPES[config.dtype]
        torch.manual_seed(config.seed)

        backend = config.attn_backend
        self.model_config = (
            qwen3_flavor_config(config.flavor, attn_backend=backend)
            if config.flavor
            else torchtitan_qwen3_config(model_dir, attn_backend=backend)
        )
        self.lora = config.lora.build() if config.lora.enabled else None
        if self.lora is not None:
            self.model_config = self.lora.convert(self.model_config)
        self.parallel_dims = None
        if self.world_size > 1:
            self.parallel_dims = build_parallel_dims(
                dp_shard=config.data_parallel_shard_degree,
                tp=config.tensor_parallel_degree,
                world_size=self.world_size,
                device_type=self.device_type,
            )
            prepare_config_for_parallelism(self.model_config, self.parallel_dims)
        elif config.tensor_parallel_degree != 1 or config.data_parallel_shard_degree not in (-1, 1):
            raise ValueError(
                "a single trainer process needs tensor_parallel_degree=1 and "
                f"data_parallel_shard_degree in (-1, 1), got {config.tensor_parallel_degree} and "
                f"{config.data_parallel_shard_degree}"
            )
        self.model = self._build_model()
        self.weights = PolicyWeights(
            model=self.model, lora=self.lora, model_config=self.model_config,
            model_dir=self.model_dir, flavor=config.flavor, seed=config.seed, rank=self.rank)
        """The policy's weights as pushes, relays, exports and checkpoints read them."""
        self.reference: ReferencePolicy | None = None
        """The starting policy, frozen, for a KL term (``loss.kl_coef > 0``; reference.py)."""
        if config.loss.uses_reference_model:
            torch.manual_seed(config.seed)  # a flavor's reference is its policy's initialisation
            self.reference = ReferencePolicy(self._build_model(), forward=self._forward,
                                             loss=config.loss)
        self.critic: ValueCritic | None = None
        """PPO's value model and GAE (critic.py)."""
        if config.critic.enabled:
            self.critic = config.critic.build(model=self._build_model(value_head=True),
                                              forward=self._forward)
        self.loss_fn = config.loss.build()
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            LoRA.trainable_parameters(self.model), lr=self._lr_at(0), betas=(opt.beta1, opt.beta2),
            eps=opt.eps, weight_decay=opt.weight_decay, foreach=True,
        )
        self.policy_version = 0
        """Optimizer steps taken (restored from checkpoints): the version of the current weights."""
        self._earlier_updates: tuple[int, int] | None = None
        """With several updates a step: (updates before the last, how many were skipped), for
        optim_step's ``trainer/skipped_step`` (1 only when no update of the step applied)."""
        self.timeline = RankTimeline()
        """This rank's forward, backward and optimizer spans for the run's trace (timeline.py)."""
        self.utilization = UtilizationMeter(
            model_config=self.model_config, model=self.model, dtype=self.compute_dtype,
            device=self.device, tensor_parallel_degree=config.tensor_parallel_degree)
        """trainer/mfu of each step (see flops.py)."""
        batch_mesh = self._mesh("batch")
        self.dp_size = batch_mesh.size() if batch_mesh is not None else 1
        self.dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        logger.info(
            "trainer rank %d/%d ready: dp %d x tp %d, %s on %s",
            self.rank, self.world_size, self.dp_size, config.tensor_parallel_degree,
            config.dtype, self.device,
        )
        self.batch_log = (BatchLog(config.debug_batch_log, self.rank)
                          if config.debug_batch_log else None)

    # ---- training -------------------------------------------------------------------------

    def forward_backward_samples(self, samples: list[TrainingSample],
                                 batcher: Batcher.Config) -> dict[str, float]:
        """Pack ``samples`` into the batch every rank packs alike (first-fit decreasing is
        deterministic) and run this rank's column of it: the controller sends samples, not a
        padded grid, and does no per-token work. With several updates a step, every update but
        the last is stepped here (minibatches.py); ``optim_step`` takes the last."""
        packer = batcher.build(dp_size=self.dp_size)
        if self.config.num_updates == 1:
            return self.forward_backward(packer.pack(samples))
        return combine_update_metrics(self.minibatch_updates(samples, packer),
                                      num_minibatches=self.config.num_minibatches)

    def minibatch_updates(self, samples: list[TrainingSample], packer: Batcher
                          ) -> list[dict[str, float]]:
        """The step's k * e updates (trainer/minibatches.py), each update's metrics; the last
        update's gradients are left for ``optim_step``."""
        self.utilization.start()
        start = time.perf_counter()
        minibatches = [packer.pack(part)
                       for part in split_groups(samples, self.config.num_minibatches)]
        for batch in minibatches:
            if batch.dp_size != self.dp_size:
                raise ValueError(f"batch has dp_size {batch.dp_size}, the trainer has "
                                 f"{self.dp_size}")
        old_logprobs = ([self._old_logprobs(batch) for batch in minibatches]
                        if self._ratio_against_old_policy else [None] * len(minibatches))
        critic_targets: list[list[CriticTargets] | None] = [None] * len(minibatches)
        if self.critic is not None:  # GAE once, from the values before the first update
            flat = self._critic_targets(minibatches)
            for i, batch in enumerate(minibatches):
                critic_targets[i], flat = (flat[:batch.num_microbatches],
                                           flat[batch.num_microbatches:])
        prepare_s = time.perf_counter() - start
        updates: list[dict[str, float]] = []
        skipped = 0
        for _ in range(self.config.ppo_epochs):
            for batch, old, targets in zip(minibatches, old_logprobs, critic_targets):
                if updates:  # the previous update's AdamW step
                    applied = self._apply_gradients(self._lr_at(self.policy_version))
                    skipped += int(applied["trainer/skipped_step"])
                updates.append(self.forward_backward(batch, old_logprobs=old,
                                                     critic_targets=targets, starts_step=False))
        updates[0]["trainer/old_logprobs_s"] = prepare_s
        self._earlier_updates = (len(updates) - 1, skipped)
        return updates

    def forward_backward(self, batch: TrainingBatch, *,
                         old_logprobs: list[torch.Tensor] | None = None,
                         critic_targets: list[CriticTargets] | None = None,
                         starts_step: bool = True) -> dict[str, float]:
        """One update: run this rank's microbatches of ``batch``, accumulate gradients; return
        its metrics (reduced over data-parallel ranks). ``old_logprobs`` (the old policy's, per
        microbatch) and ``critic_targets``: computed before the step's first update, or here
        (one update a step). ``starts_step``: the step's only update, which checks the batch's
        data-parallel size and starts the step's utilization meter (``minibatch_updates`` did
        both already for its updates)."""
        if starts_step:
            if batch.dp_size != self.dp_size:
                raise ValueError(f"batch has dp_size {batch.dp_size}, the trainer has "
                                 f"{self.dp_size}")
            self.utilization.start()
        start = time.perf_counter()
        self.model.train()
        sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        maxima = torch.zeros(len(MAX_KEYS), dtype=torch.float64)
        if self.critic is not None and critic_targets is None:
            critic_targets = self._critic_targets([batch])
        for index, data in enumerate(self._microbatches(batch)):
            if critic_targets is not None:
                data["advantages"] = critic_targets[index].advantages
            if old_logprobs is not None:
                data["old_logprobs"] = old_logprobs[index]
            self.utilization.count(data["document_ids"])
            if self.batch_log is not None:
                self.batch_log.write(policy_version=self.policy_version, dp_rank=self.dp_rank,
                                     microbatch=index, data=data)
            with self.timeline.span("forward", microbatch=index):
                loss, mb_sums, mb_max = self._policy_loss(data, batch)
            if faults.point("trainer.loss", self.policy_version):  # a NaN loss (tests)
                loss = loss * float("nan")
            if critic_targets is not None:
                loss = loss + self.critic.value_loss(data, critic_targets[index],
                                                     batch.num_valid_tokens)
            with self.timeline.span("backward", microbatch=index):
                loss.backward()
            sums += torch.stack([mb_sums[k].double().cpu() for k in SUM_KEYS])
            maxima = torch.maximum(maxima, torch.stack([mb_max[k].double().cpu() for k in MAX_KEYS]))
        sums, maxima = self._reduce_over_dp(sums, maxima)
        metrics = finalize_loss_metrics(
            dict(zip(SUM_KEYS, sums.tolist())), dict(zip(MAX_KEYS, maxima.tolist()))
        )
        metrics.update(batch.metrics)
        if self.critic is not None:
            metrics.update(self.critic.step_metrics(
                batch.num_valid_tokens, reduce_sums=self._reduce_sums,
                reward_kl=self.config.loss.kl_placement == "reward"))
        metrics["trainer/forward_backward_s"] = time.perf_counter() - start
        return metrics

    def _policy_loss(self, data: dict[str, torch.Tensor], batch: TrainingBatch
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One microbatch's policy loss (with grad), its metric sums and maxima."""
        logprobs, entropy = token_logprobs_and_entropy(self._forward(self.model, data),
                                                       data["labels"])
        reference_logprobs = (self.reference.logprobs(data) if self.reference is not None
                              else None)
        return self.loss_fn(
            logprobs,
            generator_logprobs=data["generator_logprobs"],
            advantages=data["advantages"],
            loss_mask=data["loss_mask"],
            num_global_valid_tokens=batch.num_valid_tokens,
            num_global_valid_sequences=batch.num_valid_sequences,
            document_ids=data["document_ids"],
            sequence_valid_tokens=data["sequence_valid_tokens"],
            entropy=entropy,
            reference_logprobs=reference_logprobs,
            policy_versions=data["policy_versions"],
            policy_version=self.policy_version,
            positions=data["positions"],
            old_logprobs=data.get("old_logprobs"),
        )

    @property
    def _ratio_against_old_policy(self) -> bool:
        """Whether the PPO ratio is the trainer's own (against the old policy, recomputed when a
        step has several updates) rather than the generator's logprobs (minibatches.py)."""
        loss = self.config.loss
        return loss.ratio_reference == "trainer" or loss.off_policy.active

    @torch.no_grad()
    def _old_logprobs(self, batch: TrainingBatch) -> list[torch.Tensor]:
        """The current weights' logprob of every label of this rank's microbatches (float32, on
        the device): the old policy of the step's updates."""
        self.model.eval()
        result = []
        for data in self._microbatches(batch):
            logprobs, _ = token_logprobs_and_entropy(self._forward(self.model, data),
                                                     data["labels"])
            result.append(logprobs.float())
        self.model.train()
        return result

    def _critic_targets(self, batches: list[TrainingBatch]) -> list[CriticTargets]:
        """GAE advantages and returns of this rank's microbatches of ``batches`` (in order),
        before any update, whitened over all of them."""
        assert self.critic is not None
        penalised_rewards = None
        if self.config.loss.kl_placement == "reward":
            assert self.reference is not None
            reference = self.reference

            def penalised_rewards(data: dict[str, torch.Tensor]
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
                logprobs, _ = token_logprobs_and_entropy(self._forward(self.model, data),
                                                         data["labels"])
                return reference.penalised_rewards(data, logprobs)

        microbatches = (data for batch in batches for data in self._microbatches(batch))
        return self.critic.step_targets(microbatches, reduce_sums=self._reduce_sums,
                                        penalised_rewards=penalised_rewards)

    def optim_step(self) -> dict[str, float]:
        """Clip gradients, AdamW step at the warm-up learning rate, zero grads, bump the version.

        A non-finite gradient norm (a NaN/Inf loss, or NaN logprobs in the batch) skips the AdamW
        step: the weights and the optimizer state stay as they were (``trainer/skipped_step`` 1).
        The norm is reduced over every rank, so every rank takes the same decision."""
        start = time.perf_counter()
        lr = self._lr_at(self.policy_version)
        metrics = self._apply_gradients(lr)
        if self._earlier_updates is not None:  # several updates: skipped only if all were
            count, skipped = self._earlier_updates
            skipped += int(metrics["trainer/skipped_step"])
            metrics["trainer/num_skipped_updates"] = float(skipped)
            metrics["trainer/skipped_step"] = 1.0 if skipped == count + 1 else 0.0
            self._earlier_updates = None
        self.policy_version += 1
        return {
            **self.utilization.finish(),
            **metrics,
            "trainer/lr": lr,
            "trainer/policy_version": float(self.policy_version),
            "trainer/optim_step_s": time.perf_counter() - start,
        }

    def _apply_gradients(self, lr: float) -> dict[str, float]:
        """Clip, AdamW (and the critic's) at ``lr`` unless a gradient norm is non-finite, zero
        the gradients; the norms and whether the step was skipped."""
        from torchtitan.distributed import utils as dist_utils

        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.config.max_grad_norm
        grad_norm = dist_utils.clip_grad_norm_(
            list(self.model.parameters()), max_norm if max_norm is not None else float("inf"),
            foreach=True,
        )
        finite = bool(torch.isfinite(grad_norm))
        metrics: dict[str, float] = {}
        if self.critic is not None:
            critic_norm = self.critic.clip_gradients()
            finite = finite and bool(torch.isfinite(critic_norm))
            self.critic.step(finite)
            metrics["critic/grad_norm"] = float(critic_norm)
        if finite:
            self.optimizer.step()
        else:
            logger.warning("policy version %d: non-finite grad norm %s: optimizer step skipped",
                           self.policy_version, float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        metrics["trainer/grad_norm"] = float(grad_norm)
        metrics["trainer/skipped_step"] = 0.0 if finite else 1.0
        return metrics

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """Logprob of every label in the grid under the current weights: float32
        [num_microbatches, dp_size, rows, seq_len] (0 where there is no target), on CPU, the
        same on every rank (gathered over data-parallel ranks)."""
        out = torch.zeros(batch.labels.shape, dtype=torch.float32)
        for index, logprobs in enumerate(self._old_logprobs(batch)):
            has_target = batch.document_ids[index, self.dp_rank].to(self.device) >= 0
            out[index, self.dp_rank] = torch.where(has_target, logprobs, 0.0).cpu()
        batch_mesh = self._mesh("batch")
        if batch_mesh is not None and self.dp_size > 1:
            # Each rank filled only its own column; the others are zero, so a sum gathers.
            out = out.to(self.device)
            dist.all_reduce(out, group=batch_mesh.get_group())
            out = out.cpu()
        return out

    # ---- weights and checkpoints (the command surface of both launches; weights.py) --------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """What this rank sends of a relayed push (PolicyWeights.relayed_state_dict)."""
        return self.weights.relayed_state_dict()

    def pushed_state_dict(self) -> dict[str, torch.Tensor]:
        """What a push sends and a verify expects (PolicyWeights.pushed_state_dict)."""
        return self.weights.pushed_state_dict()

    @property
    def pushed_lora_scaling(self) -> float | None:
        return self.weights.pushed_lora_scaling

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """torchtitan-named plain full tensors, LoRA merged (PolicyWeights.full_state_dict)."""
        return self.weights.full_state_dict()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named plain full tensors (collective); no lm_head when embeddings are tied."""
        return self.weights.hf_state_dict()

    def export_hf(self, path: str | os.PathLike, dtype: str = "") -> None:
        """An HF model dir, or a PEFT adapter dir (PolicyWeights.export_hf)."""
        self.weights.export_hf(path, _DTYPES[dtype] if dtype else None)

    def save_checkpoint(self, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """DCP checkpoint of model, AdamW state, policy_version and ``extra`` (JSON-able); the
        critic's model and AdamW state in ``critic/``."""
        from torchtitan_rl.trainer import checkpoint as ckpt

        ckpt.save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, step=self.policy_version,
            extra=extra or {}, base_digest=self.weights.base_digest(),
        )
        if self.critic is not None:
            ckpt.save_checkpoint(os.path.join(path, "critic"), model=self.critic.model,
                                 optimizer=self.critic.optimizer, step=self.policy_version,
                                 extra={})

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore what save_checkpoint wrote (weights_only); returns its ``extra``."""
        from torchtitan_rl.trainer import checkpoint as ckpt

        step, extra = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                           base_digest=self.weights.base_digest())
        if self.critic is not None:
            critic_path = os.path.join(path, "critic")
            if not os.path.isfile(os.path.join(critic_path, ".metadata")):
                raise FileNotFoundError(f"{path} holds no critic (trainer.critic.enabled is on; "
                                        "the checkpoint was written without it)")
            ckpt.load_checkpoint(critic_path, model=self.critic.model,
                                 optimizer=self.critic.optimizer)
        self.policy_version = step
        return extra

    # ---- helpers ----------------------------------------------------------------------------

    def _build_model(self, value_head: bool = False) -> torch.nn.Module:
        from torchtitan_rl.models.qwen3 import build_qwen3_from_hf
        from torchtitan_rl.trainer.parallel import parallelize_model

        if self.config.flavor:
            with torch.device(self.device):
                model = self.model_config.build()
            with torch.no_grad():
                model.init_states(buffer_device=self.device)
        else:
            model = build_qwen3_from_hf(
                self.model_dir, device=self.device, model_config=self.model_config
            )
        if self.lora is not None:
            self.lora.init_adapters(model, self.config.seed)
        if value_head:  # the critic: V = 0 until it learns (a tied embedding keeps its weight)
            model.lm_head = torch.nn.Linear(self.model_config.dim, 1, bias=False,
                                            device=self.device)
            torch.nn.init.zeros_(model.lm_head.weight)
        if self.parallel_dims is not None:
            parallelize_model(model, self.parallel_dims, param_dtype=self.compute_dtype)
        return model

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                model: torch.nn.Module | None = None) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        from torchtitan_rl.models.qwen3 import model_attention_masks

        model = self.model if model is None else model
        masks = model_attention_masks(model, positions)
        logits = model(input_ids, positions, masks)
        if isinstance(logits, DTensor):  # TP: vocab-sharded logits, gathered for the loss
            logits = logits.full_tensor()
        return logits

    def _forward(self, model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """``model``'s logits (or values) at every position of a microbatch, in the compute
        dtype (autocast on one rank; FSDP's mixed precision on several)."""
        with self._autocast():
            return self._logits(data["input_ids"], data["positions"], model=model)

    def _microbatches(self, batch: TrainingBatch) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's microbatches of ``batch``, in order, on the device."""
        for index in range(batch.num_microbatches):
            yield {k: v.to(self.device) for k, v in batch.microbatch(index, self.dp_rank).items()}

    def _autocast(self) -> Any:
        # Several ranks: FSDP's mixed-precision policy already casts; one rank: autocast.
        enabled = self.compute_dtype != torch.float32 and self.parallel_dims is None
        return torch.autocast(self.device_type, dtype=self.compute_dtype, enabled=enabled)

    def _lr_at(self, step: int) -> float:
        warmup = self.config.lr_warmup_steps
        scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        lr = self.config.optimizer.lr
        return (self.lora.learning_rate(lr) if self.lora is not None else lr) * scale

    def _mesh(self, name: str) -> Any:
        if self.parallel_dims is None:
            return None
        return self.parallel_dims.get_optional_mesh(name)

    def _reduce_over_dp(
        self, sums: torch.Tensor, maxima: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_mesh = self._mesh("loss")
        if loss_mesh is None or loss_mesh.size() == 1:
            return sums, maxima
        group = loss_mesh.get_group()
        sums, maxima = sums.to(self.device), maxima.to(self.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        return sums.cpu(), maxima.cpu()

    def _reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        return self._reduce_over_dp(sums, torch.zeros(1, dtype=torch.float64))[0]
