"""Model FLOPs utilization: torchtitan's FLOPs per token, a measured peak, trainer/mfu per step."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_trainer_checkpoint import model_dir  # noqa: F401 (fixture)
from tests.trainer.trainer_testlib import random_batch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.flops import flops_per_token, measure_peak_flops


def test_flops_per_token_is_torchtitans_dense_formula(model_dir):  # noqa: F811
    core = PolicyTrainerCore.Config(num_threads=1).build(model_dir=model_dir)
    cfg = core.model_config
    params = sum(p.numel() for p in core.model.parameters())
    embedding = core.model.tok_embeddings.weight.numel()
    layers, heads = len(cfg.layers), cfg.layers[0].attention.n_heads
    head_dim, seq_len = cfg.layers[0].attention.head_dim, 32
    # 6 FLOPs per non-embedding parameter (forward 2, backward 4) + attention scores/values
    expected = 6 * (params - embedding) + 6 * layers * heads * 2 * head_dim * seq_len
    tied = core.model_config.enable_weight_tying
    if tied:  # the tied output projection still multiplies: torchtitan counts it back
        expected += 6 * embedding
    assert flops_per_token(cfg, core.model, seq_len) == expected


def test_each_step_reports_mfu_against_the_measured_peak(model_dir):  # noqa: F811
    core = PolicyTrainerCore.Config(num_threads=1).build(model_dir=model_dir)
    peak = core.utilization.peak_flops  # measured when the trainer is built, before any step
    assert peak > 0
    core.forward_backward(random_batch(0))
    metrics = core.optim_step()
    assert core.utilization.peak_flops == peak  # once, not again at the first step
    assert metrics["trainer/peak_tflops"] == pytest.approx(peak / 1e12)
    assert 0 < metrics["trainer/mfu"]
    assert metrics["trainer/tflops"] == pytest.approx(metrics["trainer/mfu"] * peak / 1e12)
    # 4 samples of 12 tokens: the padding of the 32-token rows is not counted, and attention
    # is counted within each sample (seq_len 12), not over the 32-token row
    assert core.utilization.num_tokens == 48
    cfg = core.model_config
    assert core.utilization.step_flops == 48 * flops_per_token(cfg, core.model, 12)
    assert core.utilization.step_flops < 48 * flops_per_token(cfg, core.model, 32)


def test_peak_is_a_positive_rate():
    rng_before = torch.get_rng_state()
    peak = measure_peak_flops(hidden=64, intermediate=128, rows=256, dtype=torch.float32,
                              device=torch.device("cpu"))
    assert peak > 0
    assert torch.equal(torch.get_rng_state(), rng_before)  # the matmul used its own RNG
