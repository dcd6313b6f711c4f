"""What every part of a run is built with: derived once from the user's RLJob.Config, checked,
before anything is spawned (`RLJob.resolve`, controller/job.py).

    RLJob.Config (what the user wrote)  --RLJob.resolve()-->  ResolvedJob  --check()-->  parts

Derived here and nowhere else: the model directory (the made model, warm-started when enabled),
every part's seed (the job's), the generators' model directory, the trainer's truncated
importance-sampling cap (on by default when training off-policy), the sampling seed.
``--print-resolved`` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import ClassVar

from torchtitan_rl.assets.warm_start import WarmStart
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
from torchtitan_rl.controller.hosts.placement import Placement
from torchtitan_rl.controller.loop.loop import TrainingLoop
from torchtitan_rl.controller.loop.validation import Validator
from torchtitan_rl.generator import Generator
from torchtitan_rl.generator.engine_limits import check_engine_values
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.rollout.agent_task import AgentTask
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.task import TaskConfig
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import PolicyTrainer
from torchtitan_rl.types import Sampling


@dataclasses.dataclass(kw_only=True, slots=True)
class ResolvedJob:
    toml_comments: ClassVar[dict[str, str]] = {
        "sampling": "What every request of the job samples with (the rollouts'; validation's "
                    "with\nvalidation.temperature). Each request's seed derives from this seed; "
                    "its max_tokens is clipped\nto the room left in "
                    "rollouter.max_rollout_tokens.",
        "generators.sampling": "Unused: every request of the job carries [sampling] above. "
                               "The generator's default for requests\nwithout one (a job "
                               "refuses any other value: set sampling.* instead).",
    }
    """``--print-resolved`` prints these above the tables (config_to_toml): which sampling
    applies."""

    run_dir: str
    seed: int
    base_model_dir: str
    """The model before the warm start (the made or given HF directory)."""
    model_dir: str
    """The model every part starts from: base_model_dir, or its warm start (cached)."""
    warm_start: WarmStart.Config | None
    """None: no warm start."""
    warm_start_fingerprint: str
    """The task settings the warm start's data depends on (part of its cache key)."""
    task: TaskConfig
    rollouter: Rollouter.Config
    sampling: Sampling
    generators: list[Generator.Config]
    """One per generator mesh."""
    placement: Placement.Config
    router: GeneratorRouter.Config
    trainer: PolicyTrainer.Config
    num_trainer_ranks: int
    verify_weight_push: bool
    batcher: Batcher.Config
    loop: TrainingLoop.Config
    validation: Validator.Config
    checkpoint: Checkpointer.Config
    metrics: MetricsLogger.Config
    recorder: RolloutRecorder.Config

    def check(self) -> None:
        """Cross-field checks; each raises one ConfigError line naming the keys."""
        if self.task.__class__ is TaskConfig:
            raise ConfigError(
                "task.type: name the task class, e.g. [task] type = "
                "\"examples.alphabet_sort:AlphabetSortTask\" (any class whose Config subclasses "
                "torchtitan_rl.task.TaskConfig)"
            )
        owner = getattr(type(self.task), "_owner", None)
        if self.warm_start is not None and not hasattr(owner, "solved_conversation"):
            raise ConfigError(
                f"warm_start.enabled needs a task that solves its episodes "
                f"(solved_conversation(episode)); {owner.__qualname__} has none"
            )
        hf = json.loads((pathlib.Path(self.base_model_dir) / "config.json").read_text())
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads", heads)
        generator = self.generators[0]
        tp = self.trainer.tensor_parallel_degree
        if heads % tp or kv_heads % tp:
            raise ConfigError(
                f"trainer.tensor_parallel_degree={tp} must divide the model's attention heads "
                f"({heads}) and kv heads ({kv_heads}) of {self.base_model_dir}"
            )
        for tp in sorted({g.tensor_parallel_degree for g in self.generators}):
            # vLLM shards the kv heads, or replicates them when there are fewer than ranks.
            if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
                raise ConfigError(
                    f"generator.tensor_parallel_degree={tp} must divide the model's attention "
                    f"heads ({heads}) and either divide its kv heads ({kv_heads}) or be a "
                    f"multiple of them, for {self.base_model_dir}"
                )
        dp = self.trainer.data_parallel_shard_degree
        ranks = self.num_trainer_ranks
        tp = self.trainer.tensor_parallel_degree
        if ranks % tp or (dp != -1 and dp * tp != ranks):
            raise ConfigError(
                f"num_trainer_ranks={ranks} must equal trainer.data_parallel_shard_degree ({dp}) "
                f"x trainer.tensor_parallel_degree ({tp})"
            )
        budget = self.rollouter.max_rollout_tokens
        if budget > generator.max_model_len:
            raise ConfigError(
                f"rollouter.max_rollout_tokens={budget} exceeds generator.max_model_len="
                f"{generator.max_model_len}"
            )
        if self.batcher.seq_len < budget:
            raise ConfigError(
                f"batcher.seq_len={self.batcher.seq_len} is shorter than a rollout can be "
                f"(rollouter.max_rollout_tokens={budget}): raise seq_len or lower the budget"
            )
        if self.sampling.max_tokens >= budget:
            raise ConfigError(
                f"sampling.max_tokens={self.sampling.max_tokens} leaves no room for the prompt "
                f"in rollouter.max_rollout_tokens={budget}"
            )
        if self.loop.partial_rollout != "none" and self.loop.staleness.max_staleness == 0:
            raise ConfigError(
                "loop.partial_rollout='abort' needs loop.staleness.max_staleness >= 1 (at "
                "staleness 0 no request runs while weights are pushed)"
            )
        if self.loop.partial_rollout == "abort" and generator.weight_sync.mode != "hot_swap":
            raise ConfigError(
                "loop.partial_rollout='abort' needs generator.weight_sync.mode='hot_swap', got "
                f"{generator.weight_sync.mode!r}"
            )
        if self.trainer.num_minibatches > self.loop.groups_per_step:
            raise ConfigError(
                f"trainer.num_minibatches={self.trainer.num_minibatches} is more mini-batches "
                f"than a step has groups (loop.groups_per_step={self.loop.groups_per_step})"
            )
        degrees = [g.tensor_parallel_degree for g in self.generators]
        if self.verify_weight_push and set(degrees) != {1}:
            raise ConfigError(
                "verify_weight_push needs generator.tensor_parallel_degree=1 (TP ranks hold "
                f"shards), got {degrees}"
            )
        if (self.rollouter.num_workers and getattr(type(self.task), "_owner", None) is AgentTask
                and getattr(self.task, "port", 0) != 0):
            raise ConfigError(
                f"rollouter.num_workers={self.rollouter.num_workers}: each rollout worker serves "
                f"its own agent endpoint, on a free port: task.port must be 0, got "
                f"{self.task.port}"
            )
        self.placement.check(num_generators=len(self.generators),
                             num_trainer_ranks=self.num_trainer_ranks)
        check_engine_values(self)  # what vLLM would refuse only once the generators start
