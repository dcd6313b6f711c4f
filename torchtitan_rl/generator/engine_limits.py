"""Values the engines would refuse only once they run, refused with the rest of the config instead.

    RLJob.resolve() -> ResolvedJob.check() -> check_engine_values(plan)    nothing spawned yet

A generator's vLLM engine checks its block size, its model length and its KV cache when it
starts, in its own process, ~20 s into a run; a sampling value vLLM refuses fails the first
request that carries it; a trainer attention torch cannot run on CPU fails at the first training
step. Each rule here is the engine's own (the versions this project pins: vLLM 0.32, torch
2.13), checked before anything is spawned and reported as one ``ConfigError`` line naming the
dotted key, the value and the allowed range. A rule whose answer depends on what vLLM sees on the
generators' hosts (the attention backend) uses this machine's platform when the generators run
here (``placement.kind`` local or process) and the rule every vLLM backend shares elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from torchtitan_rl.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan_rl.generator import Generator
    from torchtitan_rl.types import Sampling

Platform = Literal["cpu", "gpu"]


class EnginePlan(Protocol):
    """What the checks read of a job's resolved plan (a `ResolvedJob`)."""

    base_model_dir: str
    generators: list[Generator.Config]
    sampling: Sampling
    placement: Any
    trainer: Any
    validation: Any

CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention backend runs block sizes that are multiples of 32
(``CPUAttentionBackend.get_supported_kernel_block_sizes()``: ``[MultipleOf(32)]``; a test holds
the two to agreement). Read here, not imported: importing vLLM's attention backends logs to
stdout, which ``--print-resolved`` writes."""

GPU_BLOCK_MULTIPLE = 16
"""Every vLLM GPU attention backend (FlashAttention, Triton, FlexAttention, FlashInfer) runs
block sizes that are multiples of 16 (vllm/v1/attention/backends/*.py)."""

DEFAULT_BLOCK_SIZE = {"cpu": 128, "gpu": 16}
"""vLLM's block size when none is given (vllm/platforms/cpu.py; CacheConfig's default)."""

_GPU_ONLY_ATTENTION = {
    "flex": "torch's FlexAttention has no backward on CPU",
    "varlen": "varlen attention runs flash attention kernels, which CPU torch lacks",
}
"""Measured: each fails at the trainer's first forward_backward on CPU (torch 2.13)."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}

_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")
"""The config.json keys vLLM derives a model's maximum length from (the smallest wins;
vllm/transformers_utils/model_arch_config_convertor.py)."""


def check_engine_values(plan: EnginePlan, *, platform: Platform | None | str = "detect") -> None:
    """Raise ConfigError for the first value of ``plan`` an engine would refuse. ``platform``:
    where the generators run ("cpu", "gpu", None for unknown); "detect": this machine's vLLM
    platform when the placement keeps the generators here, else unknown."""
    if platform == "detect":
        platform = local_platform() if plan.placement.kind in ("local", "process") else None
    model_dir = pathlib.Path(plan.base_model_dir)
    hf = _read_json(model_dir / "config.json")
    tokenizer = _read_json(model_dir / "tokenizer_config.json")
    for generator in _distinct(plan.generators):
        check_generator(generator, hf=hf, tokenizer_config=tokenizer, platform=platform,
                        where=str(model_dir))
    check_sampling(plan.sampling, "sampling")
    default = type(plan.sampling)()
    for generator in plan.generators:
        if generator.sampling != default:
            changed = [f"{f.name}={getattr(generator.sampling, f.name)!r}"
                       for f in dataclasses.fields(default)
                       if getattr(generator.sampling, f.name) != getattr(default, f.name)]
            raise ConfigError(
                f"generator.sampling: unused in a job, whose every request carries the job's "
                f"[sampling] (got {', '.join(changed)}): set sampling.* instead")
    if plan.validation.temperature < 0:
        raise ConfigError(f"validation.temperature={plan.validation.temperature}: must be >= 0 "
                          f"(0 = greedy)")
    trainer_here = plan.placement.kind in ("local", "process")
    if plan.trainer.device == "cuda" and trainer_here and not _cuda_here():
        raise ConfigError("trainer.device='cuda': this machine has no CUDA device and the "
                          "placement (local/process) runs the trainer here; use 'auto' or 'cpu'")
    on_cpu = plan.trainer.device == "cpu" or (
        plan.trainer.device == "auto" and trainer_here and not _cuda_here())
    if on_cpu and plan.trainer.attn_backend in _GPU_ONLY_ATTENTION:
        raise ConfigError(
            f"trainer.attn_backend={plan.trainer.attn_backend!r}: "
            f"{_GPU_ONLY_ATTENTION[plan.trainer.attn_backend]}, and the trainer runs on CPU "
            f"(trainer.device={plan.trainer.device!r}); use 'sdpa_packed'")


def check_generator(generator: Generator.Config, *, hf: dict[str, Any],
                    tokenizer_config: dict[str, Any] | None = None,
                    platform: Platform | None | str = None, where: str = "the model") -> None:
    """The engine settings of one generator against vLLM's rules for ``hf`` (the model's
    config.json) on ``platform``."""
    block = generator.block_size
    if block is not None:
        if platform == "cpu":
            if block % CPU_BLOCK_MULTIPLE:
                raise ConfigError(
                    f"generator.block_size={block}: vLLM's CPU attention runs multiples of "
                    f"{CPU_BLOCK_MULTIPLE} (e.g. 32, 64, 128); none: vLLM's default "
                    f"({DEFAULT_BLOCK_SIZE['cpu']} on CPU)")
        elif block % GPU_BLOCK_MULTIPLE:
            raise ConfigError(
                f"generator.block_size={block}: vLLM's attention backends need a multiple of "
                f"{GPU_BLOCK_MULTIPLE} (e.g. 16, 32, 64); none: vLLM's default")
    limit, key = model_max_len(hf, tokenizer_config)
    if limit is not None and generator.max_model_len > limit \
            and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise ConfigError(
            f"generator.max_model_len={generator.max_model_len}: at most {limit}, the model's "
            f"{key} ({where})")
    need = kv_cache_bytes_needed(generator, hf, platform)
    if need is not None and generator.kv_cache_bytes < need.total:
        raise ConfigError(
            f"generator.kv_cache_bytes={generator.kv_cache_bytes}: at least {need.total} to hold "
            f"one request of generator.max_model_len={generator.max_model_len} tokens "
            f"({need.blocks} blocks of {need.block_size} tokens x {need.block_bytes} bytes, "
            f"tensor_parallel_degree {generator.tensor_parallel_degree}): raise it or lower "
            f"max_model_len")


def check_sampling(sampling: Sampling, key: str) -> None:
    """What vLLM's SamplingParams refuses that `Sampling` does not check itself."""
    if sampling.top_k < -1:
        raise ConfigError(f"{key}.top_k={sampling.top_k}: must be -1 or 0 (disabled) or >= 1")


def model_max_len(hf: dict[str, Any],
                  tokenizer_config: dict[str, Any] | None = None) -> tuple[int | None, str]:
    """The longest max_model_len vLLM accepts for this config.json (and key that says so), or
    None where RoPE scaling may stretch it (vLLM's rule then depends on the scaling type)."""
    text = hf.get("text_config") or hf
    if text.get("rope_scaling") or hf.get("rope_scaling"):
        return None, ""
    found = [(text[k], k) for k in _MAX_LEN_KEYS if isinstance(text.get(k), (int, float))]
    if not found:
        return None, ""
    limit, key = min(found)
    if isinstance(text.get("model_max_length"), (int, float)):
        limit, key = text["model_max_length"], "model_max_length"
    tokenizer_max = (tokenizer_config or {}).get("model_max_length")
    if isinstance(tokenizer_max, (int, float)) and tokenizer_max < limit:
        limit, key = tokenizer_max, "tokenizer_config.json model_max_length"
    else:
        key = f"config.json {key}"
    return int(limit), key


class KVNeed:
    """The KV cache one request of max_model_len tokens takes on one rank, in vLLM's blocks."""

    def __init__(self, *, blocks: int, block_size: int, block_bytes: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.total = blocks * block_bytes


def kv_cache_bytes_needed(generator: Generator.Config, hf: dict[str, Any],
                          platform: Platform | None | str) -> KVNeed | None:
    """vLLM's own minimum (vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory): the
    blocks of one max_model_len request plus the null block the pool keeps, each block holding K
    and V of every layer. None where the model is not plain full attention (sliding windows,
    MLA, mixed layer types), which vLLM sizes differently. An unknown platform or dtype takes
    the smallest block and element, so the bound never refuses what vLLM would run."""
    text = hf.get("text_config") or hf
    layer_types = set(text.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} or text.get("kv_lora_rank") or (
            text.get("sliding_window") and text.get("use_sliding_window", True)):
        return None
    try:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    element = _DTYPE_BYTES.get(generator.dtype, 2)  # "auto": vLLM's pick, at least 2 bytes
    block = generator.block_size or DEFAULT_BLOCK_SIZE["cpu" if platform == "cpu" else "gpu"]
    kv_per_rank = max(1, kv_heads // generator.tensor_parallel_degree)
    block_bytes = 2 * block * kv_per_rank * head_dim * element * layers
    return KVNeed(blocks=math.ceil(generator.max_model_len / block) + 1, block_size=block,
                  block_bytes=block_bytes)


def local_platform() -> Platform:
    """The platform vLLM picks on this machine: a CUDA device when there is one, else its CPU
    build (asked of torch: importing vLLM in the controller would configure its logging)."""
    return "gpu" if _cuda_here() else "cpu"


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _distinct(generators: Sequence[Generator.Config]) -> list[Generator.Config]:
    out: list[Generator.Config] = []
    for g in generators:
        if g not in out:
            out.append(g)
    return out


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
