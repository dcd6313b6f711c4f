"""A tiny job whose generators run the stand-in engine (generator/stand_in_engine.py), as
bench/scale.py runs them: the real controller, trainer, push and Monarch procs, every pushed byte
loaded into each engine and read back equal (verify_weight_push), tokens labelled by version."""

from __future__ import annotations

import dataclasses

import pytest

from tests.controller.jobs import TINY_MODEL_BYTES, read_metrics, tiny_job
from torchtitan_rl.train import main


@pytest.mark.slow
def test_a_job_on_stand_in_engines_trains_and_every_push_lands_bit_for_bit(tmp_path):
    config = tiny_job(tmp_path, "stand_in", num_steps=2, max_staleness=1)
    config = dataclasses.replace(
        config, num_generators=2, verify_weight_push=True,
        generator=dataclasses.replace(config.generator, engine="stand_in",
                                      stand_in_tokens_per_s=500.0))
    summary = main(config)
    assert summary["steps"] == 2
    metrics = read_metrics(tmp_path / "stand_in")
    for step in range(2):
        assert metrics[step]["weight_sync/num_mismatched_tensors"] == 0
        assert metrics[step]["weight_sync/bytes_moved"] == 2 * TINY_MODEL_BYTES
        assert metrics[step]["rollout/num_rollouts"] == 8
        assert metrics[step]["rollout/num_special_tokens_in_replies"] == 0
        assert 0 <= metrics[step]["async/policy_age_max"] <= 1
    assert sum(metrics[s]["router/generator_1/num_routed"] for s in range(2)) > 0
