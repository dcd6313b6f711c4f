"""The asynchronous job end to end (real Monarch meshes, vLLM generators, torchtitan trainer):
staleness 0 is the synchronous loop bit for bit; a SIGKILLed controller resumes without losing or
repeating a prompt; partial rollouts over two generators respect the staleness bound; a generator
that dies fails the run with one clear error."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys

import pytest
import torch

from torchtitan_rl.controller.async_loop import AsyncLoop, resolve_trainer_config
from torchtitan_rl.controller.data_cursor import DataCursor
from torchtitan_rl.controller.router import GeneratorRouter
from torchtitan_rl.controller.staleness import StalenessGate
from torchtitan_rl.faults import ENV_VAR
from torchtitan_rl.train import main

from tests.controller.jobs import REPO_ROOT, read_hf_weights, read_metrics, tiny_job


def _async_job(output_dir: pathlib.Path, name: str, *, max_staleness: int, **kwargs):
    config = tiny_job(output_dir, name, mode="async", **kwargs)
    return dataclasses.replace(config, async_loop=AsyncLoop.Config(
        staleness=StalenessGate.Config(max_staleness=max_staleness),
        # The sync loop trains with the loss as configured; so must the run compared with it.
        off_policy_correction="none",
    ))


def test_staleness_zero_matches_sync(sync_tiny_run, tmp_path):
    sync_dir, _ = sync_tiny_run
    summary = main(_async_job(tmp_path, "async_s0", max_staleness=0))
    assert summary["steps"] == 3
    synced, asynced = read_metrics(sync_dir), read_metrics(tmp_path / "async_s0")
    for step in range(3):
        for key in ("loss/value", "trainer/grad_norm", "loss/num_valid_tokens",
                    "rollout_reward/mean"):
            assert asynced[step][key] == synced[step][key], (step, key)  # exact
        assert asynced[step]["async/policy_age_max"] == 0
    sync_weights = read_hf_weights(sync_dir / "hf")
    async_weights = read_hf_weights(tmp_path / "async_s0" / "hf")
    assert sync_weights.keys() == async_weights.keys()
    for name in sync_weights:
        assert torch.equal(sync_weights[name], async_weights[name]), name


def _run_tiny_job(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if fault is not None:
        env[ENV_VAR] = fault
    return subprocess.run(
        [sys.executable, "-m", "tests.controller.run_tiny_job", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def test_resume_after_sigkill_loses_nothing(tmp_path):
    num_prompts, prompts_per_step = 8, 2  # one epoch = 4 steps of 2 groups (tiny_job)
    kill_after = random.Random(20261123).randint(1, num_prompts - 1)
    args = [str(tmp_path), "killed", "async", str(num_prompts // prompts_per_step),
            "--num-prompts", str(num_prompts), "--staleness", "2"]

    killed = _run_tiny_job(*args, fault=f"kill_controller_after_groups:{kill_after}")
    assert killed.returncode == -signal.SIGKILL, (kill_after, killed.stderr[-2000:])
    resumed = _run_tiny_job(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    steps = [json.loads(line) for line in
             (tmp_path / "killed" / "trained_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(num_prompts // prompts_per_step))
    group_ids = [g for s in steps for g in s["group_ids"]]
    assert sorted(group_ids) == list(range(num_prompts)), (kill_after, group_ids)
    cursor = DataCursor(num_prompts=num_prompts, seed=0)
    assert sorted(cursor.prompt_index(g) for g in group_ids) == list(range(num_prompts))
    sample_ids = [i for s in steps for i in s["sample_ids"]]
    assert len(sample_ids) == len(set(sample_ids)), "a sample was trained twice"
    for step in steps:  # every sample belongs to a group its step consumed
        assert {int(i.split("/")[0].removeprefix("group=")) for i in step["sample_ids"]} <= set(
            step["group_ids"])


def test_async_partial_rollouts_over_two_generators_stay_within_staleness(tmp_path):
    config = tiny_job(tmp_path, "partial", mode="async", partial_rollout="abort")
    config = dataclasses.replace(
        config, num_generators=2,
        router=GeneratorRouter.Config(strategy="least_loaded"),
        verify_weight_push=True,  # each push is read back from both engines, bit for bit
        async_loop=AsyncLoop.Config(staleness=StalenessGate.Config(max_staleness=1)),
    )
    summary = main(config)
    assert summary["steps"] == 3
    metrics = read_metrics(tmp_path / "partial")
    for step in range(3):
        m = metrics[step]
        assert 0 <= m["async/policy_age_min"] <= m["async/policy_age_max"] <= 1, (step, m)
        assert "generator/num_aborted_at_pull" in m
        assert 0.0 <= m["time/generator_idle_ratio"] <= 1.0
        assert 0.0 <= m["time/trainer_idle_ratio"] <= 1.0
    # Truncated importance sampling is on by default in async mode: weights are pi/pi_gen, not 1.
    assert any(metrics[step]["loss/tis_weight_mean"] != 1.0 for step in range(3))
    last = metrics[2]
    assert last["router/generator_0/num_routed"] > 0 and last["router/generator_1/num_routed"] > 0
    assert last["async/groups_trained"] == 3 * config.loop.prompts_per_step


def test_async_mode_turns_truncated_importance_sampling_on_unless_configured(tmp_path):
    sync = tiny_job(tmp_path, "x")
    assert resolve_trainer_config(sync).loss.tis_cap is None
    asynced = tiny_job(tmp_path, "x", mode="async")
    assert resolve_trainer_config(asynced).loss.tis_cap == AsyncLoop.Config().tis_cap
    own = dataclasses.replace(asynced, trainer=dataclasses.replace(
        asynced.trainer, loss=dataclasses.replace(asynced.trainer.loss, tis_cap=5.0)))
    assert resolve_trainer_config(own).loss.tis_cap == 5.0
    off = dataclasses.replace(asynced, async_loop=AsyncLoop.Config(off_policy_correction="none"))
    assert resolve_trainer_config(off).loss.tis_cap is None


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generator_death_fails_the_run_with_a_clear_error(tmp_path, mode):
    proc = _run_tiny_job(str(tmp_path), "dies", mode, "3",
                         fault="kill_generator_after_requests:5")
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: actor mesh failure:")
    assert "generator_0" in errors[0] and "Killed(sig=9)" in errors[0]
