"""GPU smoke test (marked `gpu`, skipped without CUDA): a few synchronous steps of the tiny job
with the trainer on the GPU and the generator on whatever vLLM build is installed (the CUDA one
with the `gpu` extra)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.controller.jobs import read_metrics, tiny_job
from torchtitan_rl.train import main

pytestmark = pytest.mark.slow  # a whole job (and a GPU)


@pytest.mark.gpu
def test_gpu_smoke_runs_a_few_steps(tmp_path):
    config = tiny_job(tmp_path, "gpu", num_steps=2)
    config = dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, device="cuda", dtype="bfloat16"),
    )
    summary = main(config)
    assert summary["steps"] == 2
    metrics = read_metrics(tmp_path / "gpu")
    for step in range(2):
        assert math.isfinite(metrics[step]["loss/value"])
        assert metrics[step]["loss/num_valid_tokens"] > 0
