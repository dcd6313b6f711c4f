"""The suite's short chaos run (bench/chaos.py is the long one): the asynchronous tiny job with a
2-rank FSDP trainer, a tensor-parallel-2 generator and 2 rollout workers, on real vLLM, loses a
rollout worker, one trainer rank and one TP rank, killed from outside by the pids its log names;
each is recovered inside the run and nothing is lost or trained twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.controller.jobs import (
    REPO_ROOT,
    LogWatch,
    assert_every_group_trained_once,
    env_without_faults,
    read_metrics,
)
from tests.controller.lifetime_testlib import RunSessions


def _after_the_next_step(log: LogWatch) -> None:
    """Until a step later than every step the log has reported so far ends."""
    done = [int(step) for step in re.findall(r"\bstep=(\d+) ", log.text())]
    log.wait_for(rf"\bstep={max(done, default=-1) + 1} ")


@pytest.mark.slow
def test_a_rollout_worker_a_trainer_rank_and_a_tp_rank_killed_lose_nothing(tmp_path):
    """Rollout worker 0 (replaced on its host, its groups restart from their prompts) and at once
    rank 1 of the 2-rank trainer (the whole trainer mesh respawned from the newest checkpoint;
    the steps after it trained again; the loop waits for it, so the run cannot end before the
    worker's replacement, a few seconds, is logged); once both are recovered and a step more has
    trained, rank 1 of the TP-2 generator (the generator replaced whole; the only generator, so
    the run waits for it). Also a lifetime ending: a success leaves no process of the run
    behind."""
    num_steps, num_prompts = 16, 32
    run = RunSessions()
    try:
        proc = run.start(
            [sys.executable, "-m", "tests.controller.run_tiny_job", str(tmp_path), "chaos",
             str(num_steps), "--num-prompts", str(num_prompts), "--num-trainer-ranks", "2",
             "--generator-tp", "2", "--staleness", "1", "--partial-rollout", "abort",
             "--num-workers", "2", "--checkpoint-every", "2"],
            env_without_faults(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        log = LogWatch(proc.stderr)
        generator = log.wait_for(r"generator generator_0 started \(tp=2, pids (\d+),(\d+) ")
        trainer = log.wait_for(r"trainer policy_trainer started \(pids (\d+),(\d+) ")
        worker = log.wait_for(r"rollout worker (rollout_worker_0) started \(pid (\d+)\)")
        run.look()
        _after_the_next_step(log)
        os.kill(int(worker.group(2)), signal.SIGKILL)
        os.kill(int(trainer.group(2)), signal.SIGKILL)
        log.wait_for(r"rollout worker 0 replaced ")
        log.wait_for(r"trainer restarted in ")
        _after_the_next_step(log)
        os.kill(int(generator.group(2)), signal.SIGKILL)
        log.wait_for(r"generator_0 replaced by generator_0_r1 ")
        proc.wait(timeout=900)
        log.wait_closed()
        run.assert_all_gone()
    finally:
        run.close()
    text = log.text()
    (tmp_path / "controller.log").write_text(text)  # kept for a post-mortem of a failed check
    assert proc.returncode == 0, text[-4000:]
    # The TP rank's loss is the generator's, never a failed group (which would fail the run):
    # rank 0 exits when its collective with the dead rank fails, or, idle, is stopped with the
    # mesh without sending its requests back as errors.
    run_dir = tmp_path / "chaos"
    assert_every_group_trained_once(run_dir, num_steps, num_prompts)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == num_steps and summary["trainer_restarts"] == 1
    (restored,) = summary["trainer_restored_from_steps"]
    assert restored % 2 == 0  # a checkpoint's step (every 2)
    last = read_metrics(run_dir)[num_steps - 1]
    assert last["generator/restarts"] == 1 and last["rollout/workers_replaced"] == 1
    assert last["generator/groups_restarted_after_loss"] >= 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "time/step_s" in r] == list(range(num_steps))
    metrics = read_metrics(run_dir)
    assert all(metrics[s]["async/policy_age_max"] <= 1 for s in range(num_steps))
