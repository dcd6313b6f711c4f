"""The root of a run's config tree, and the single controller that runs it.

    RLJob.Config
    ├── model         ModelSource        local HF dir, or one of our offline sizes
    ├── warm_start    WarmStart          supervised warm start on solved training episodes (cached)
    ├── task          AlphabetSortTask   datasets (train / validation) and the env factory
    ├── rollouter     Rollouter          group size, turn cap, token budget, advantages
    ├── sampling      Sampling           rollout sampling
    ├── generator     Generator          vLLM actor (x num_generators meshes, TP procs each)
    ├── router        GeneratorRouter    request routing over the generators
    ├── trainer       PolicyTrainer      torchtitan Qwen3, optimizer, GRPO loss (x num_trainer_ranks)
    ├── batcher       Batcher            samples -> [microbatch][dp] rows of seq_len
    ├── loop          sync | async, steps, prompts per step, partial rollouts
    ├── async_loop    AsyncLoop          staleness bound
    ├── validation    Validator
    ├── checkpoint    every K steps, resume
    ├── metrics       MetricsLogger      TensorBoard + JSONL
    └── recorder      RolloutRecorder    rollout JSONL

Flow of `RLJob.run()`: resolve model (+ warm start) -> cross-field checks -> spawn meshes -> load
checkpoint or validate "before" -> sync or async loop -> validate "after" -> HF export, reward
curve PNG -> summary line ``reward_before=... reward_after=... steps=... wall_s=...``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any, Literal

from examples.alphabet_sort.task import AlphabetSortTask
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.async_loop import AsyncLoop
from torchtitan_rl.controller.model_source import ModelSource
from torchtitan_rl.controller.router import GeneratorRouter
from torchtitan_rl.controller.validation import Validator
from torchtitan_rl.controller.warm_start import WarmStart
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import PolicyTrainer
from torchtitan_rl.types import Sampling

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class LoopConfig:
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, then train, every step. async: generation never waits for training, within
    the staleness bound of `async_loop.staleness.max_staleness`."""
    num_steps: int = 10
    """Optimizer steps to run."""
    prompts_per_step: int = 8
    """Prompt groups consumed by one training step (each `rollouter.group_size` rollouts)."""
    partial_rollout: Literal["none", "abort"] = "none"
    """abort: at each weight push, running requests are aborted and resumed as prompt + partial
    tokens on the new weights (per-token logprobs and versions kept)."""

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0
    """Write a checkpoint every this many steps (and at the last); 0 disables."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the run folder."""
    export_hf: bool = True
    """Export the final weights as an HF model directory `<run_dir>/hf`."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {self.every_steps}")


def _default_rollouter() -> Rollouter.Config:
    return Rollouter.Config(group_size=8)


class RLJob(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        name: str = "run"
        """Run name; the run folder is `<output_dir>/<name>`."""
        output_dir: str = "runs"
        seed: int = 0
        """Seeds data order, request sampling seeds, the engines and the trainer."""
        model: ModelSource.Config = dataclasses.field(default_factory=ModelSource.Config)
        warm_start: WarmStart.Config = dataclasses.field(default_factory=WarmStart.Config)
        task: AlphabetSortTask.Config = dataclasses.field(default_factory=AlphabetSortTask.Config)
        rollouter: Rollouter.Config = dataclasses.field(default_factory=_default_rollouter)
        sampling: Sampling = dataclasses.field(default_factory=Sampling)
        generator: Generator.Config = dataclasses.field(default_factory=Generator.Config)
        num_generators: int = 1
        """Generator meshes (each `generator.tensor_parallel_degree` procs)."""
        router: GeneratorRouter.Config = dataclasses.field(default_factory=GeneratorRouter.Config)
        trainer: PolicyTrainer.Config = dataclasses.field(default_factory=PolicyTrainer.Config)
        num_trainer_ranks: int = 1
        """Trainer procs (= data_parallel_shard_degree x tensor_parallel_degree)."""
        verify_weight_push: bool = False
        """After each push, read the generators' weights back and compare bitwise (slow)."""
        batcher: Batcher.Config = dataclasses.field(default_factory=Batcher.Config)
        loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
        async_loop: AsyncLoop.Config = dataclasses.field(default_factory=AsyncLoop.Config)
        validation: Validator.Config = dataclasses.field(default_factory=Validator.Config)
        checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
        metrics: MetricsLogger.Config = dataclasses.field(default_factory=MetricsLogger.Config)
        recorder: RolloutRecorder.Config = dataclasses.field(default_factory=RolloutRecorder.Config)

        def __post_init__(self) -> None:
            if self.num_generators < 1:
                raise ValueError(f"num_generators must be >= 1, got {self.num_generators}")
            if self.num_trainer_ranks < 1:
                raise ValueError(f"num_trainer_ranks must be >= 1, got {self.num_trainer_ranks}")
            if self.rollouter.group_size < 2:
                raise ValueError(
                    "rollouter.group_size must be >= 2 (GRPO compares siblings), got "
                    f"{self.rollouter.group_size}"
                )

        @property
        def run_dir(self) -> pathlib.Path:
            return pathlib.Path(self.output_dir) / self.name

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self) -> dict[str, Any]:
        import asyncio

        from torchtitan_rl.controller.runner import run_job

        return asyncio.run(run_job(self.config))


def check_job(config: RLJob.Config, model_dir: pathlib.Path) -> None:
    """Cross-field checks that need the model's shape; each raises one ConfigError line."""
    hf = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    for key, tp in (("generator.tensor_parallel_degree", config.generator.tensor_parallel_degree),
                    ("trainer.tensor_parallel_degree", config.trainer.tensor_parallel_degree)):
        if heads % tp or kv_heads % tp:
            raise ConfigError(
                f"{key}={tp} must divide the model's attention heads ({heads}) and kv heads "
                f"({kv_heads}) of {model_dir}"
            )
    dp = config.trainer.data_parallel_shard_degree
    ranks = config.num_trainer_ranks
    tp = config.trainer.tensor_parallel_degree
    if ranks % tp or (dp != -1 and dp * tp != ranks):
        raise ConfigError(
            f"num_trainer_ranks={ranks} must equal trainer.data_parallel_shard_degree ({dp}) x "
            f"trainer.tensor_parallel_degree ({tp})"
        )
    budget = config.rollouter.max_rollout_tokens
    if budget > config.generator.max_model_len:
        raise ConfigError(
            f"rollouter.max_rollout_tokens={budget} exceeds generator.max_model_len="
            f"{config.generator.max_model_len}"
        )
    if config.batcher.seq_len < budget:
        raise ConfigError(
            f"batcher.seq_len={config.batcher.seq_len} is shorter than a rollout can be "
            f"(rollouter.max_rollout_tokens={budget}): raise seq_len or lower the budget"
        )
    if config.sampling.max_tokens >= budget:
        raise ConfigError(
            f"sampling.max_tokens={config.sampling.max_tokens} leaves no room for the prompt in "
            f"rollouter.max_rollout_tokens={budget}"
        )
    if config.loop.mode == "sync" and config.loop.partial_rollout != "none":
        raise ConfigError(
            "loop.partial_rollout='abort' needs loop.mode='async' (the sync loop never pushes "
            "weights while requests run)"
        )
    if config.loop.partial_rollout == "abort" and config.generator.weight_sync.mode != "hot_swap":
        raise ConfigError(
            "loop.partial_rollout='abort' needs generator.weight_sync.mode='hot_swap', got "
            f"{config.generator.weight_sync.mode!r}"
        )
    if config.verify_weight_push and config.generator.tensor_parallel_degree != 1:
        raise ConfigError(
            "verify_weight_push needs generator.tensor_parallel_degree=1 (TP ranks hold shards), "
            f"got {config.generator.tensor_parallel_degree}"
        )
    if config.generator.model_dir is not None and config.model.path:
        raise ConfigError("set the model once: model.path, not generator.model_dir")

