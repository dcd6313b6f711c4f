"""The torchrun launch (controller/torchrun.py): the torchrun processes are the trainer ranks (FSDP
over them), rank 0 is also the controller and spawns the generator with Monarch."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.controller.jobs import REPO_ROOT, read_metrics
from torchtitan_rl.controller.checkpoint.checkpointer import latest_complete_checkpoint

pytestmark = pytest.mark.slow  # torchrun ranks running a job

# The tiny job of jobs.tiny_job as a TOML file, on LetterTask (a task defined only in tests/).
TINY_ARGS = ["--config", "tests/controller/tiny_letter_job.toml", "--num_trainer_ranks", "2"]

MISMATCH_ERROR = ("error: num_trainer_ranks=1 must equal the torchrun world size WORLD_SIZE=2 "
                  "(set --num_trainer_ranks 2, or torchrun --nproc_per_node 1)")


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    # --standalone: a local rendezvous on a free port (no fixed MASTER_PORT to collide on).
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "-m", "torchtitan_rl.train", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_two_torchrun_ranks_train_with_fsdp_and_rank0_reports(tmp_path):
    proc = _torchrun(2, *TINY_ARGS, "--output_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("reward_before="), last
    assert "steps=2" in last.split()
    assert _error_lines(proc.stderr) == []

    # Both torchrun processes are trainer ranks of one FSDP group of 2 (their INFO lines are in
    # the run's log file: the console is quiet).
    run_dir = tmp_path / "letters"
    log = (run_dir / "logs" / "train.log").read_text()
    for rank in (0, 1):
        assert f"trainer rank {rank}/2 ready: dp 2 x tp 1" in log
    assert "trainer rank 1: stop" in log  # the follower left its loop on rank 0's stop

    metrics = read_metrics(run_dir)
    for step in (0, 1):
        for key in ("loss/value", "trainer/grad_norm"):
            assert math.isfinite(metrics[step][key]), (step, key, metrics[step])
        assert metrics[step]["loss/num_valid_tokens"] > 0
        assert metrics[step]["trainer/policy_version"] == step + 1
        assert metrics[step]["weight_sync/model_bytes"] > 0  # rank 0 pushed to the generator
    assert latest_complete_checkpoint(run_dir / "checkpoints") is not None
    assert (run_dir / "hf" / "config.json").exists()


def test_world_size_other_than_num_trainer_ranks_is_one_error_line(tmp_path):
    args = ["--config", "tests/controller/tiny_letter_job.toml", "--output_dir", str(tmp_path)]
    # One process with the environment torchrun gives rank 0: the check runs before any group.
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "test"}
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rl.train", *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert _error_lines(proc.stderr) == [MISMATCH_ERROR]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""

    # Through torchrun: rank 0 prints the one line and exits 2, rank 1 prints nothing; torchrun
    # itself always exits 1 when a worker fails, naming the worker's exit code in its report.
    proc = _torchrun(2, *args)
    assert proc.returncode == 1
    assert _error_lines(proc.stderr) == [MISMATCH_ERROR]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 2 ", proc.stderr), \
        proc.stderr[-2000:]
