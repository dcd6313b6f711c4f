"""A generator's config: `GeneratorConfig` (``Generator.Config``: engine, ranks, restarts) and its
`WeightSyncPolicy` (what a weight pull does to running requests). Plain dataclasses, without the
actor's imports (Monarch, vLLM), so config code and the engine loop can name them. The pull itself
is torchtitan_rl/weight_sync/pull.py."""

from __future__ import annotations

import dataclasses
from typing import Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.types import Sampling

WEIGHT_SYNC_MODES = ("hot_swap", "drain")
WEIGHT_LOADS = ("auto", "reload", "in_place")


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSyncPolicy:
    """What happens to running requests when a weight pull arrives, and how it writes into vLLM.

    ``hot_swap``: the pull is applied between two engine steps; running requests continue and every
    output token records the policy version that sampled it. ``drain``: admission stops, running
    requests finish, then the pull is applied and admission resumes.
    """

    mode: Literal["hot_swap", "drain"] = "hot_swap"
    """'hot_swap' (pull between steps, requests keep running) or 'drain' (finish them first)."""
    reset_prefix_cache: bool = True
    """At each pull no new request reuses KV computed by older weights: the prefix cache is
    dropped, or, under hot swap without ``reset_running_requests`` (vLLM resets its cache only
    when no request holds a block), every request's cache keys carry the policy version it was
    admitted under. Off (with ``reset_running_requests`` off too), the whole cache is kept: a
    block such as a shared system prompt's can outlive any number of pulls, so new requests may
    attend to KV of weights older than ``max_staleness`` (each token's recorded logprob is still
    what was sampled, which the off-policy correction weighs by)."""
    reset_running_requests: bool = True
    """At a hot-swap pull, preempt the running requests so their KV is recomputed with the new
    weights (tokens after the pull are then exactly what the new weights give for prompt + tokens
    so far). Off, running requests keep their KV over the pull, as PipelineRL's in-flight updates
    do (faster async: docs/async.md, ``bench/async_vs_sync.py --kv-at-pull``). Needs
    ``reset_prefix_cache``; no effect under ``drain`` (nothing runs at the pull)."""

    load: Literal["auto", "reload", "in_place"] = "auto"
    """How a pull writes into vLLM. 'reload': vLLM's ``reload_weights`` (any device, any
    tensor_parallel_degree; on CPU it repacks every linear, ~5 memcpys of the weights). 'in_place':
    the CPU linears are unpacked once at engine start and each pull is one ``copy_`` per tensor
    into the live parameters; CPU engines with tensor_parallel_degree 1 and enforce_eager only.
    'auto': in_place where it works, else reload (decided at engine start, logged)."""
    repack_cpu_linears: bool = True
    """With 'in_place': after each pull, rebuild vLLM's packed CPU GEMM kernel of every linear from
    its (just copied) plain weight. Off, the linears run as plain ``F.linear``: the push is one
    copy, but generation is slower (measured 12 % on ``demo``, 30 % on ``small``;
    docs/weight_sync.md)."""

    def __post_init__(self) -> None:
        if self.load not in WEIGHT_LOADS:
            raise ValueError(f"weight_sync.load must be one of {WEIGHT_LOADS}, got {self.load!r}")
        if self.mode not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync.mode must be one of {WEIGHT_SYNC_MODES}, got {self.mode!r}"
            )
        if self.reset_running_requests and not self.reset_prefix_cache:
            raise ValueError(
                "weight_sync.reset_running_requests=True needs weight_sync.reset_prefix_cache=True "
                "(vLLM resets running requests as part of a cache reset), got False"
            )

    @property
    def drain_before_pull(self) -> bool:
        return self.mode == "drain"

    @property
    def salts_prefix_cache_by_version(self) -> bool:
        """Whether requests' prefix-cache keys carry their admission's policy version instead of
        a reset at each pull: vLLM resets its cache only when no request holds a block, and
        running requests keep theirs over a hot-swap pull without ``reset_running_requests``."""
        return self.reset_prefix_cache and not self.reset_running_requests \
            and not self.drain_before_pull


@dataclasses.dataclass(kw_only=True, slots=True)
class GeneratorConfig(Configurable.Config):
    """`Generator.Config`: one generator mesh's engine, its ranks and its weight sync (the actor:
    generator.py). A job fills `model_dir` and `seed` from its own settings."""

    model_dir: str | None = None
    """HF model directory (config.json, safetensors, tokenizer). None: the controller fills it
    from the job's model source before spawning."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Engine dtype. float32: generator logprobs within ~1e-6 of the trainer's on CPU.
    bfloat16, float16: half the memory, logprobs further from the trainer's. auto: vLLM's
    choice from the model's config.json."""
    tensor_parallel_degree: int = 1
    """Ranks (processes) per generator; > 1 uses vLLM's external_launcher backend."""
    max_model_len: int = 2048
    """Most tokens (prompt + output) per request."""
    max_num_seqs: int = 256
    """Most requests vLLM schedules in one step."""
    kv_cache_bytes: int = 256 << 20
    """KV cache size per rank, in bytes."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile. False works on vLLM's CPU build too (a first compile, then
    cached), but the in-place weight pull needs eager modules."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (multi-turn sessions)."""
    block_size: int | None = 32
    """Tokens per KV cache block; the prefix cache reuses whole blocks only, so a next turn
    recomputes up to ``block_size - 1`` tokens of its history. None: vLLM's platform default
    (128 on CPU: histories shorter than that are never reused). vLLM's CPU attention needs a
    multiple of 32."""
    max_engine_steps_between_decisions: int = 16
    """Engine steps per burst before rank 0 decides again (admits new requests, pulls,
    aborts). Higher: fewer broadcasts and prefill interruptions; lower: faster admission."""
    weight_sync: WeightSyncPolicy = dataclasses.field(default_factory=WeightSyncPolicy)
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    """Sampling for generate() calls that pass none. Unused in a job: every request a job
    sends carries the job's `sampling` (validation with validation.temperature), so a job
    refuses values here other than the defaults."""
    seed: int = 0
    """Engine seed (requests without Sampling.seed draw from it)."""
    initial_policy_version: int = 0
    """Policy version of the weights in model_dir."""
    max_restarts: int = 3
    """In a job: how often this generator may be replaced after its process died (each
    replacement is a new mesh on the same host with the current weights); once more fails
    the run. 0: a lost generator fails the run."""
    engine: str = "vllm"
    """Which engine each rank builds. "vllm": vLLM's ``LLMEngine`` (vllm_engine.py).
    "stand_in": no model compute, replies of seeded random tokens at
    ``stand_in_tokens_per_s``, every pushed weight byte still loaded (stand_in_engine.py;
    scale benchmarks: bench/scale.py; tensor_parallel_degree 1, weight_sync.load reload).
    Or an import path "package.module:function" of a ``(Generator.Config) -> engine``
    builder with the same engine API."""
    stand_in_tokens_per_s: float = 2000.0
    """engine = "stand_in": output tokens per second of the whole engine (each step emits one
    token per running request and sleeps as long as this rate allows)."""
    lora_rank: int = 0
    """> 0: the trainer pushes LoRA adapters of this rank, not weights (``trainer.lora.push =
    "adapter"``); the engine serves them over its base model (weight_sync/lora_pull.py). The job
    fills it and ``lora_alpha`` from ``trainer.lora``."""
    lora_alpha: float = 0.0
    """The pushed adapters' alpha (their scale is alpha / lora_rank)."""
    torch_num_threads: int | None = None
    """torch threads per rank, set before the engine is built (vLLM's CPU worker forbids
    changing it afterwards). None: torch's default with one rank, 1 per rank when
    tensor_parallel_degree > 1 (the ranks share the cores)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_degree < 1:
            raise ValueError(
                f"tensor_parallel_degree must be >= 1, got {self.tensor_parallel_degree}"
            )
        for name in ("max_model_len", "max_num_seqs", "kv_cache_bytes",
                     "max_engine_steps_between_decisions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.torch_num_threads is not None and self.torch_num_threads < 1:
            raise ValueError(
                f"torch_num_threads must be >= 1 or None, got {self.torch_num_threads}"
            )
        if self.initial_policy_version < 0:
            raise ValueError(
                f"initial_policy_version must be >= 0, got {self.initial_policy_version}"
            )
        if self.engine not in ("vllm", "stand_in") and ":" not in self.engine:
            raise ValueError(f"engine must be 'vllm', 'stand_in' or 'package.module:function',"
                             f" got {self.engine!r}")
        if self.lora_rank < 0 or (self.lora_rank and self.lora_alpha <= 0):
            raise ValueError(f"lora_rank must be >= 0 and lora_alpha > 0 with it, got "
                             f"{self.lora_rank}, {self.lora_alpha}")
        if self.lora_rank and self.engine != "vllm":
            raise ValueError(f"an adapter push (lora_rank > 0) needs generator.engine 'vllm', "
                             f"got {self.engine!r}")
        if self.stand_in_tokens_per_s <= 0:
            raise ValueError(
                f"stand_in_tokens_per_s must be > 0, got {self.stand_in_tokens_per_s}")
        if self.engine != "vllm" and (self.tensor_parallel_degree, self.weight_sync.load) \
                not in ((1, "auto"), (1, "reload")):
            raise ValueError(f"engine={self.engine!r} needs tensor_parallel_degree=1, "
                             f"weight_sync.load 'auto' or 'reload', got "
                             f"{self.tensor_parallel_degree}, {self.weight_sync.load!r}")
        if self.weight_sync.load == "in_place" and (
                self.tensor_parallel_degree != 1 or not self.enforce_eager):
            # The CPU platform itself is checked at start (WeightPuller.setup).
            raise ValueError(
                "weight_sync.load='in_place' needs tensor_parallel_degree=1 and "
                "enforce_eager=True on a CPU engine, got tensor_parallel_degree="
                f"{self.tensor_parallel_degree} enforce_eager={self.enforce_eager}: use "
                "weight_sync.load='reload'"
            )
