"""placement.kind = "slurm" on a real Slurm cluster: Debian's slurmctld and 3 slurmd nodes on
this machine (scripts/slurm_cluster.py, started here and stopped by pid at the module's end),
jobs submitted by Monarch's SlurmJob through the project's reader of squeue's JSON.

In CI the cluster must start (the packages are installed with apt when missing); elsewhere,
a machine where it cannot is a skip that says why."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.controller.jobs import (
    LETTERS_TOML,
    LETTERS_VALIDATION,
    REPO_ROOT,
    env_without_faults,
    read_metrics,
)
from tests.controller.lifetime_testlib import wait_for

pytestmark = pytest.mark.slow


def _cluster_module():
    spec = importlib.util.spec_from_file_location(
        "slurm_cluster", REPO_ROOT / "scripts" / "slurm_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_cluster"] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    slurm_cluster = _cluster_module()
    try:
        slurm_cluster.install_packages()
    except slurm_cluster.ClusterError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {e}")
        pytest.skip(f"no Slurm cluster on this machine: {e}")
    cluster = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), num_nodes=3)
    cluster.up(detach=False)
    try:
        yield cluster
    finally:
        cluster.down()


def _train_on_slurm(cluster, out: pathlib.Path, *args: str, fault: str | None = None,
                    env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m torchtitan_rl.train`` on the cluster's login node (where the nodes' names
    resolve), the tests' TOML job placed on Slurm."""
    cmd = [sys.executable, "-m", "torchtitan_rl.train", "--config", LETTERS_TOML,
           "--output_dir", str(out), "--placement.kind", "slurm",
           "--placement.slurm.log_dir", str(out / "sbatch"), *args]
    run_env = {**env_without_faults(fault), **cluster.env(), **(env or {}),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run_env.pop("TORCHTITAN_RL_LOG_LEVEL", None)
    return subprocess.Popen(cluster.exec_argv(cmd), cwd=REPO_ROOT, env=run_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _assert_nothing_left(cluster) -> None:
    """The allocation released and no process of the run on any node (only its slurmd)."""
    wait_for(lambda: cluster.squeue() == [], "empty squeue", timeout_s=60)
    pids = json.loads(cluster.pids_file.read_text())
    wait_for(lambda: all(cluster.node_pids(n) == [pids[n]] for n in cluster.node_names()),
             "nodes without the run's processes", timeout_s=60)


def test_the_job_on_slurm_trains_what_it_trains_on_one_host(slurm_cluster, letters_toml_run,
                                                            tmp_path):
    """S = 0, the same seed: the same groups, samples, losses and rewards at every step as the
    shared local run of the same TOML (tests/conftest.py), the trainer on one node and the
    generator on another; the console names them; the job is gone at the end."""
    local_dir, _ = letters_toml_run
    proc = _train_on_slurm(slurm_cluster, tmp_path, *LETTERS_VALIDATION)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert re.search(r"^slurm job \d+: the trainer on node1, the generators on node2$", stderr,
                     re.M), stderr[-3000:]
    assert stdout.splitlines()[-1].startswith("reward_before=")
    run_dir = tmp_path / "letters"
    assert [json.loads(line) for line in (run_dir / "trained_samples.jsonl").open()] == [
        json.loads(line) for line in (local_dir / "trained_samples.jsonl").open()]
    ours, local = read_metrics(run_dir), read_metrics(local_dir)
    assert sorted(ours) == sorted(local) == [0, 1, 2]
    for step in local:
        for key in ("loss/value", "trainer/grad_norm", "rollout_reward/mean", "validation/reward_mean"):
            assert ours[step].get(key) == local[step].get(key), (step, key)
    # the push crossed nodes in the message: no shared memory between two hosts
    assert ours[1]["weight_sync/generators_by_shared_memory"] == 0
    assert list((tmp_path / "sbatch").glob("slurm_*_letters*.out")) or list(
        (tmp_path / "sbatch").glob("slurm_*.out"))
    _assert_nothing_left(slurm_cluster)


def test_a_sigkilled_controller_leaves_no_allocation_and_no_process(slurm_cluster, tmp_path):
    """The controller SIGKILLs itself after 4 groups (a fault point): its reaper sidecar
    scancels the job, and Slurm ends the workers and their procs on every node."""
    proc = _train_on_slurm(slurm_cluster, tmp_path, "--loop.num_steps", "50",
                           "--generator.engine", "stand_in",
                           "--generator.stand_in_tokens_per_s", "20000",
                           fault="kill_controller_after_groups:4")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "slurm job" in stderr, stderr[-3000:]
    _assert_nothing_left(slurm_cluster)


def test_a_lost_node_retires_its_generator_and_the_run_goes_on(slurm_cluster, tmp_path):
    """node3 (generator_1's) fails for good after step 1: its slurmd and every process on it
    SIGKILLed. Slurm keeps the job on the other nodes (--no-kill), the lost generator's groups
    restart from their prompts on generator_0, its replacement cannot spawn on the dead node,
    and the run goes on with one generator, saying so once; every group is trained once."""
    from tests.controller.jobs import LogWatch, assert_every_group_trained_once

    num_steps = 8
    proc = _train_on_slurm(
        slurm_cluster, tmp_path, "--num_generators", "2", "--loop.num_steps", str(num_steps),
        "--loop.replace_dropped_groups", "0", "--log.level", "debug",
        "--generator.engine", "stand_in", "--generator.stand_in_tokens_per_s", "2000",
        # Monarch gives up on a host that stopped answering, and on a spawn there, after these
        # (defaults 1 min and 30 s); the run's reaction is the same.
        env={"HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "10s",
             "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE": "10s"})
    log = LogWatch(proc.stderr)
    try:
        log.wait_for(r"slurm job \d+: the trainer on node1, the generators on node2, node3")
        log.wait_for(r"generator generator_1 started")
        log.wait_for(r"step=1 ")
        assert slurm_cluster.kill_node("node3") >= 2  # slurmd, the worker, its procs
        proc.wait(timeout=600)
        log.wait_closed()
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_cluster.start_node("node3", detach=False)
    stderr = log.text()
    assert proc.returncode == 0, stderr[-4000:]
    retired = [line for line in stderr.splitlines() if "cannot be replaced on its host" in line]
    assert len(retired) == 1 and "goes on with 1 of 2 generators" in retired[0], stderr[-4000:]
    run_dir = tmp_path / "letters"
    assert_every_group_trained_once(run_dir, num_steps, num_steps * 2)
    assert read_metrics(run_dir)[num_steps - 1]["generator/num_retired"] == 1
    slurm_cluster.wait_idle(slurm_cluster.node_names())
    _assert_nothing_left(slurm_cluster)
