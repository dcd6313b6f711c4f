"""A short real job, then the eval command on its exported model: the console stays quiet (metric
and vLLM lines go to the run's log file) and the eval agrees with the job's final validation."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.controller.jobs import LETTERS_TOML, LETTERS_VALIDATION, run_module

pytestmark = pytest.mark.slow  # a job and eval runs in subprocesses

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_console_is_quiet_and_the_log_file_has_the_rest(letters_toml_run):
    run_dir, proc = letters_toml_run
    assert proc.stdout.splitlines()[-1].startswith("reward_before=")
    console = proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"run folder: {run_dir.resolve()} (log: ")
    assert "step=0 async/" not in console  # the per-step metric line
    assert "INFO" not in console and "(MainProcess" not in console  # vLLM's lines
    assert "Failed to load weights" not in console and "Monarch internal logs" not in console
    log = (run_dir / "logs" / "train.log").read_text()
    assert "torchtitan_rl.metrics.logger: step=0 async/" in log
    assert "INFO" in log and "Resolved architecture: Qwen3ForCausalLM" in log  # vLLM, in the proc
    assert "validation step=2 reward=" in log
    # the GRPO bar's last frame shows the final validation (it runs after the last step)
    summary = json.loads((run_dir / "summary.json").read_text())
    last_frame = proc.stderr.split("GRPO steps")[-1]
    assert f"val={summary['reward_after']:.3f}" in last_frame, last_frame


def test_eval_of_the_exported_model_agrees_with_the_jobs_final_validation(letters_toml_run,
                                                                       tmp_path):
    run_dir, _ = letters_toml_run
    summary = json.loads((run_dir / "summary.json").read_text())
    report_file = tmp_path / "eval.json"
    proc = run_module("torchtitan_rl.eval", "--model", str(run_dir / "hf"), "--config", LETTERS_TOML,
                "--output_dir", str(run_dir.parent), "--json", str(report_file), *LETTERS_VALIDATION)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["num_rollouts"] == 64 and report["samples_per_episode"] == 4
    # Same weights, episodes, request seeds and sampling: measured bit-equal on this CPU (vLLM
    # batches the same requests the same way), so asserted equal.
    assert report["reward_mean"] == summary["reward_after"]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"reward: {summary['reward_after']:.4f} +- ")
    assert lines[-1].startswith(f"reward_mean={summary['reward_after']:.4f} ")
    assert "pass@4=" in lines[-1]
    assert proc.stderr.startswith("evaluating ") and len(proc.stderr.splitlines()) == 1
    # the eval's own folder, beside the trained run's (<output_dir>/<the config's name>-eval);
    # the run's folder is only read
    eval_log = run_dir.parent / "letters-eval" / "logs" / "eval.log"
    assert f"log: {eval_log.resolve()})" in proc.stderr
    assert "evaluated" in eval_log.read_text()
    assert not (run_dir / "logs" / "eval.log").exists()


def test_eval_reports_per_turn_rewards_of_a_multi_turn_task(tmp_path, tiny_model_dir):
    # The random tiny model never ends a reply by itself (every turn would be cut at max_tokens
    # and end the rollout): make every token a stop token, so each reply is one token, the
    # environment scores it and the episode goes on to turn 2.
    every_token = ",".join(str(i) for i in range(3, 1024))
    proc = run_module("torchtitan_rl.eval", "--model", str(tiny_model_dir), "--config",
                "run_configs/alphabet_sort_cpu.toml", "--output_dir", str(tmp_path),
                "--task.min_turns", "2", "--task.max_turns", "2", "--rollouter.max_turns", "2",
                "--sampling.stop_token_ids", every_token,
                "--validation.num_prompts", "3", "--validation.samples_per_prompt", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("reward: ") and "(3 episodes x 2 samples = 6 rollouts)" in lines[0]
    assert lines[1].startswith("turn 1: turn_score ") and lines[1].endswith(
        "(6 rollouts reached it)")
    assert lines[2].startswith("turn 2: turn_score ") and lines[2].endswith(
        "(6 rollouts reached it)")
    assert "pass@2: " in lines[3]
    assert "turn1_turn_score=" in lines[-1] and "turn2_turn_score=" in lines[-1]
