"""run_configs/running_sum.toml through the real stack (Monarch, vLLM, torchtitan) as
docs/tasks.md runs it, `python -m torchtitan_rl.train --config ...`, shrunk to two GRPO steps on
the tiny model: the warm start trains on RunningSum's solved conversations, rollouts have both
turns, and validation reports each turn's reward parts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_STEPS = 2


@pytest.mark.slow
def test_running_sum_toml_trains_two_steps_on_the_tiny_model(tmp_path, tiny_model_dir):
    command = [
        sys.executable, "-m", "torchtitan_rl.train", "--config", "run_configs/running_sum.toml",
        "--output_dir", str(tmp_path / "runs"),
        "--model.size", "tiny", "--model.assets_dir", str(tiny_model_dir.parent),
        "--warm_start.num_steps", "40", "--warm_start.num_conversations", "256",
        "--warm_start.cache_dir", str(tmp_path / "warmstart"),
        "--rollouter.group_size", "4", "--loop.num_steps", str(NUM_STEPS),
        "--loop.groups_per_step", "2", "--validation.num_prompts", "2",
        "--generator.kv_cache_bytes", str(32 << 20), "--trainer.num_threads", "1",
        "--checkpoint.every_steps", "0", "--checkpoint.export_hf", "false",
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    run_dir = tmp_path / "runs" / "running_sum"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == NUM_STEPS
    # the summary's reward is the last validation's, as logged
    final_validation = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                        .splitlines() if "validation/reward_mean" in line][-1]
    assert final_validation["step"] == NUM_STEPS
    assert summary["reward_after"] == final_validation["validation/reward_mean"]
    # validation logs every reward part of every turn: closeness (the reward) and exact
    assert sorted(summary["reward_after_per_turn"]) == [
        "turn_1/closeness", "turn_1/exact", "turn_2/closeness", "turn_2/exact"]
    for key, value in summary["reward_after_per_turn"].items():
        assert final_validation[f"validation/{key}"] == value, key
    assert "reward_before=" in proc.stdout + proc.stderr
    assert f"trained_steps={summary['trained_steps']}/{NUM_STEPS}" in proc.stdout
    assert summary["wall_s_breakdown"]["warm_start"] > 0  # trained here, not cached

    # the warm start trained on the task's conversations and the run used it
    assert len(list((tmp_path / "warmstart").glob("*/config.json"))) == 1
    # ... and its loss is in the run's metrics (every tracker's too) at step 0
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["warm_start/num_steps"] == 40
    assert first["warm_start/loss_last"] < first["warm_start/loss_first"]
    rollouts = [json.loads(line) for line in
                (run_dir / "rollouts" / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["episode_id"].startswith("train/") for r in rollouts)
    assert all(r["prompt_text"].endswith("<|im_start|>assistant\n") for r in rollouts)
    assert any("What is " in r["prompt_text"] for r in rollouts)
