"""Process group, torchtitan ``ParallelDims`` and Qwen3 parallelisation, on CPU (gloo) or GPU (NCCL).

    init_trainer_distributed(device_type)            -> (rank, world_size); reads torchrun/Monarch env
    build_parallel_dims(dp_shard=, tp=, ...)         -> ParallelDims with its meshes built
    prepare_config_for_parallelism(model_config, pd) -> fills torchtitan's sharding configs (before build)
    parallelize_model(model, pd, param_dtype=)       -> torchtitan's parallelize_qwen3 (TP, then FSDP)

The three CPU workarounds (measured on torchtitan 0.3, see shared/notes/cpu-stack.md):
  1. ``torchtitan.distributed.parallel_dims.device_type`` is fixed to the accelerator at import;
     it is set to ``"cpu"`` so the meshes are CPU meshes.
  2. ``spmd_backend="partial_dtensor"`` (the default ``spmd_types`` backend is not usable on CPU).
  3. gloo has no PREMUL_SUM: every FSDP module reduces with plain SUM
     (``set_force_sum_reduction_for_comms``). Gradient division is switched off too
     (``gradient_divide_factor=1``): the loss is already normalised by the global token count, so
     summing gradients over data-parallel ranks gives the gradient of the global loss.

Sequence parallelism is off: activations stay replicated over TP ranks (fewer collectives; the
logits are all-gathered over the vocab before the loss).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as parallel_dims_module
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

logger = logging.getLogger(__name__)

SPMD_BACKEND = "partial_dtensor"

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def init_trainer_distributed(device_type: str) -> tuple[int, int]:
    """Join the process group described by the environment (torchrun or
    ``monarch.spmd.setup_torch_elastic_env``); a lone process (no WORLD_SIZE or WORLD_SIZE=1 and
    no group yet) stays without one. Returns (rank, world_size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def build_parallel_dims(
    *, dp_shard: int, tp: int, world_size: int, device_type: str
) -> ParallelDims:
    """torchtitan ``ParallelDims`` (dp_shard x tp = world_size) with meshes built on device_type."""
    parallel_dims_module.device_type = device_type  # workaround 1
    dist_utils.set_spmd_backend(SPMD_BACKEND)  # workaround 2
    if dp_shard != -1 and dp_shard * tp != world_size:
        raise ValueError(
            f"data_parallel_shard_degree * tensor_parallel_degree must equal the trainer world "
            f"size {world_size}, got {dp_shard} * {tp}"
        )
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
        world_size=world_size, spmd_backend=SPMD_BACKEND,
    )
    parallel_dims.build_mesh()
    return parallel_dims


def _parallelism_config(parallel_dims: ParallelDims) -> ParallelismConfig:
    return ParallelismConfig(
        data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=parallel_dims.tp,
        enable_sequence_parallel=False,
        spmd_backend=SPMD_BACKEND,
    )


@dataclasses.dataclass
class _ParallelismHolder:
    # update_from_config only reads ``.parallelism`` from configs that are not a Trainer.Config.
    parallelism: ParallelismConfig


def prepare_config_for_parallelism(
    model_config: Qwen3Model.Config, parallel_dims: ParallelDims
) -> None:
    """Fill the TP sharding configs torchtitan keeps on the model config; call before building
    the model (sharding configs are copied onto modules at build)."""
    model_config.update_from_config(config=_ParallelismHolder(_parallelism_config(parallel_dims)))


def parallelize_model(
    model: Qwen3Model, parallel_dims: ParallelDims, *, param_dtype: torch.dtype
) -> Qwen3Model:
    """Apply torchtitan's Qwen3 parallelisation (TP, then FSDP over dp_shard) in place."""
    dtype_name = _TORCH_DTYPE_NAMES[param_dtype]
    training = TrainingConfig(
        mixed_precision_param=dtype_name, mixed_precision_reduce="float32"
    )
    parallelize_qwen3(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=_parallelism_config(parallel_dims),
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="",
    )
    _sum_fsdp_gradients(model)
    return model


def _sum_fsdp_gradients(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # workaround 3
            module.set_gradient_divide_factor(1.0)


def resolve_device_type(device: str) -> str:
    """``device`` ("auto", "cpu", "cuda") as the device type this process trains on."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch.cuda.is_available() is False")
    return device
