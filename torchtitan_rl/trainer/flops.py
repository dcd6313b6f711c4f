"""Model FLOPs utilization on any device: torchtitan's FLOPs per token over a peak measured here.

    flops_per_token = model_config.get_nparams_and_flops(model, seq_len)   torchtitan's formula:
                      6 x params (forward + backward, embeddings excluded) + attention
    peak_flops      = measure_peak_flops(...)   once at start: the best of a few matmuls of the
                      model's own shapes (hidden x intermediate) in the training dtype
    trainer/mfu     = flops_per_token x real (non-padding) tokens / step seconds / peak_flops

torchtitan reports MFU against a GPU's datasheet peak; a CPU has none worth trusting (it depends
on the cores, the threads torch was given and the matrix shapes), so the peak is measured on the
machine, with the shapes this model multiplies. Padding tokens are computed but not counted:
MFU falls when batches are padded, which is what it should show.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


def flops_per_token(model_config: object, model: torch.nn.Module, seq_len: int) -> int:
    """torchtitan's training FLOPs per token of ``model`` at sequence length ``seq_len``."""
    _, flops = model_config.get_nparams_and_flops(model, seq_len)  # type: ignore[attr-defined]
    return int(flops)


def measure_peak_flops(*, hidden: int, intermediate: int, rows: int, dtype: torch.dtype,
                       device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` [rows, hidden] x [hidden, intermediate] matmuls."""
    # A generator of its own: the measurement must not move the trainer's global RNG.
    rng = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(rows, hidden, generator=rng, device=device).to(dtype)
    b = torch.randn(hidden, intermediate, generator=rng, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: thread pool, allocator, kernels
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    peak = 2.0 * rows * hidden * intermediate / max(best, 1e-12)
    logger.info("measured peak: %.1f GFLOP/s (%s %dx%dx%d matmul on %s)", peak / 1e9, dtype,
                rows, hidden, intermediate, device)
    return peak
