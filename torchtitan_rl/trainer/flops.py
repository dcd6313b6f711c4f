"""Model FLOPs utilization on any device: torchtitan's FLOPs per token over a peak measured here.

    flops_per_token = model_config.get_nparams_and_flops(model, seq_len)   torchtitan's formula:
                      6 x params (forward + backward, embeddings excluded) + attention, the
                      latter 12 x layers x heads x head_dim x seq_len
    peak_flops      = measure_peak_flops(...)   once, when the trainer is built (before the
                      controller spawns any generator, so nothing else computes on the machine):
                      the best of a few matmuls of the model's own shapes (PEAK_ROWS x hidden x
                      intermediate) in the training dtype
    step FLOPs      = sum over the step's samples of flops_per_token(seq_len = the sample's
                      length) x its length (padding counted nowhere)
    trainer/mfu     = step FLOPs / step seconds / peak_flops
    UtilizationMeter: the trainer's per-step bookkeeping of the above (start, count, finish)

torchtitan reports MFU against a GPU's datasheet peak; a CPU has none worth trusting (it depends
on the cores, the threads torch was given and the matrix shapes), so the peak is measured on the
machine, with the shapes this model multiplies. Padding tokens are computed but not counted:
MFU falls when batches are padded, which is what it should show. Attention is counted per sample,
as if each sample were its own sequence (what the trainer computes since packed rows attend per
sample): torchtitan's formula at the row length credited every token with the whole row, so the
same samples counted more FLOPs in longer rows (on the async bench's 576-token rows, half of a
step's counted FLOPs were attention at the row's length).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

PEAK_ROWS = 8192
"""Rows of the peak's matmul: a training microbatch's tokens (rows x seq_len) are in the thousands;
this many keeps the matmul long enough to time and its shape like the step's."""


def flops_per_token(model_config: object, model: torch.nn.Module, seq_len: int) -> int:
    """torchtitan's training FLOPs per token of ``model`` at sequence length ``seq_len``."""
    _, flops = model_config.get_nparams_and_flops(model, seq_len)  # type: ignore[attr-defined]
    return int(flops)


def measure_peak_flops(*, hidden: int, intermediate: int, rows: int, dtype: torch.dtype,
                       device: torch.device, repeats: int = 10) -> float:
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


class UtilizationMeter:
    """One trainer rank's step: ``start`` (forward_backward begins), ``count`` (each microbatch's
    real tokens and their FLOPs), ``finish`` (after the optimizer step). The peak is measured when
    the meter is built: a peak measured at the first step ran beside a generator loading its
    engine and read up to 40 % low (the same step's MFU then read 0.39-0.66 across runs)."""

    def __init__(self, *, model_config: object, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device, tensor_parallel_degree: int) -> None:
        self.tensor_parallel_degree = tensor_parallel_degree
        weights = [p for n, p in model.named_parameters() if n.endswith("feed_forward.w1.weight")]
        intermediate, hidden = weights[0].shape if weights else (1024, 1024)
        self.peak_flops = measure_peak_flops(hidden=hidden, intermediate=intermediate,
                                             rows=PEAK_ROWS, dtype=dtype, device=device)
        self._dense_flops_per_token = flops_per_token(model_config, model, 0)
        # torchtitan's attention term is linear in the sequence length
        self._attention_flops_per_token_pair = (
            flops_per_token(model_config, model, 1) - self._dense_flops_per_token)
        self.num_tokens = 0
        """Real tokens of the current step."""
        self.step_flops = 0
        """Model FLOPs of the current step's real tokens (all of it, every tensor-parallel rank)."""
        self._start = 0.0

    def start(self) -> None:
        self.num_tokens = 0
        self.step_flops = 0
        self._start = time.perf_counter()

    def count(self, document_ids: torch.Tensor) -> None:
        """Real tokens and model FLOPs of one microbatch (document id -1 is padding; a document
        id is one sample, in one row)."""
        _, lengths = torch.unique(document_ids[document_ids >= 0], return_counts=True)
        num_tokens = int(lengths.sum())
        self.num_tokens += num_tokens
        self.step_flops += (self._dense_flops_per_token * num_tokens
                            + self._attention_flops_per_token_pair * int((lengths * lengths).sum()))

    def finish(self) -> dict[str, float]:
        seconds = time.perf_counter() - self._start
        if not self.peak_flops or seconds <= 0:
            return {}
        # A tensor-parallel rank computes 1/tp of every token's FLOPs.
        flops = self.step_flops / self.tensor_parallel_degree / seconds
        return {"trainer/mfu": flops / self.peak_flops, "trainer/tflops": flops / 1e12,
                "trainer/peak_tflops": self.peak_flops / 1e12}
