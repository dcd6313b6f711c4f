"""placement.kind = "slurm" on a real Slurm cluster: Debian's slurmctld and 4 slurmd nodes on
this machine (scripts/slurm_cluster.py, started here and stopped by pid at the module's end),
jobs submitted by Monarch's SlurmJob through the project's reader of squeue's JSON. The last
test is the elastic one's twin on one host (no cluster).

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
from typing import Any

import pytest

from tests.controller.jobs import (
    LETTERS_TOML,
    LETTERS_VALIDATION,
    REPO_ROOT,
    env_without_faults,
    read_metrics,
    run_module,
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
    # ports and addresses of its own: a cluster started by hand (scripts/slurm_cluster.sh up,
    # the defaults) may be up on this machine meanwhile
    cluster = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), num_nodes=4, port=6917,
                                    address=30)
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


def test_the_job_on_slurm_trains_what_it_trains_on_one_host(slurm_cluster, tmp_path):
    """S = 0, the same seed: the same groups, samples, losses and rewards at every step as the
    shared local run of the same TOML (tests/conftest.py), the trainer on one node and the
    generator on another; the console names them; the job is gone at the end."""
    # the local run is this test's own (not the session's shared one): a test using a session
    # fixture is scheduled with that fixture's other users, away from this module's cluster
    local = run_module("torchtitan_rl.train", "--config", LETTERS_TOML, "--output_dir",
                       str(tmp_path / "local"), *LETTERS_VALIDATION)
    assert local.returncode == 0, local.stderr[-3000:]
    local_dir = tmp_path / "local" / "letters"
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


def _run_elastic(proc: subprocess.Popen, run_dir: pathlib.Path, *,
                 lose: tuple[Any, str] | None = None) -> tuple[str, int]:
    """After step 1: (``lose`` = (cluster, node): that node fails for good, and its generator's
    retirement is awaited), then a generator is added, then generator_0 is removed once the
    new one serves; the run is SIGTERMed two steps later. Returns its stderr and the last step
    logged before the removal's answer."""
    import signal

    from tests.controller.jobs import LogWatch
    from torchtitan_rl.controller.fleet import requests

    log = LogWatch(proc.stderr)
    try:
        log.wait_for(r"step=1 ")
        if lose is not None:
            cluster, node = lose
            assert cluster.kill_node(node) >= 2  # slurmd, the worker, its procs
            log.wait_for(r"cannot be replaced on its host")
        added = requests.submit(run_dir, "add")
        wait_for(added.exists, "the add request's answer", timeout_s=300)
        assert json.loads(added.read_text())["done"], added.read_text()
        removed = requests.submit(run_dir, "remove", "generator_0")
        wait_for(removed.exists, "the remove request's answer", timeout_s=300)
        assert json.loads(removed.read_text())["done"], removed.read_text()
        removed_at = max(read_metrics(run_dir))
        log.wait_for(rf"step={removed_at + 2} ")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.wait_closed()
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.text(), removed_at


def _assert_elastic_run(run_dir: pathlib.Path, stderr: str, removed_at: int, returncode: int,
                        added: str) -> None:
    """SIGTERMed (its cleanup ran); every step once, no group twice; ``added`` serves alone
    at the end, generator_0 got nothing after its removal."""
    assert returncode == 128 + 15, stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "trained_samples.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(len(steps)))  # every step once
    group_ids = [g for s in steps for g in s["group_ids"]]
    assert len(group_ids) == len(set(group_ids))  # no group twice
    metrics = read_metrics(run_dir)
    last = metrics[max(metrics)]
    assert last["generator/num_serving"] == 1
    assert last[f"router/{added}/num_routed"] > 0  # it took the weights and served
    assert (metrics[removed_at + 1]["router/generator_0/num_routed"]
            == last["router/generator_0/num_routed"])
    assert f"{added} added (policy v" in stderr and "generator_0 removed (" in stderr


def test_a_lost_node_then_a_generator_added_on_a_new_node_and_one_removed(slurm_cluster,
                                                                          tmp_path):
    """Generators on node2 and node3. node3 fails for good after step 1 (its slurmd and every
    process on it SIGKILLed): Slurm keeps the job on the other nodes (--no-kill), the host watch
    notices, generator_1's groups restart from their prompts on generator_0, nothing is spawned
    on the dead node, and the run goes on with one generator, saying so once. Then an add
    request gets a one-node allocation (node4) for generator_2, which takes the current weights
    and serves; generator_0 is drained and removed; generator_2 serves alone. Every step once,
    no group twice; both allocations cancelled and nothing left on any node at the end."""
    proc = _train_on_slurm(
        slurm_cluster, tmp_path, "--num_generators", "2", "--loop.num_steps", "500",
        "--loop.replace_dropped_groups", "0", "--log.level", "debug",
        "--generator.engine", "stand_in", "--generator.stand_in_tokens_per_s", "2000")
    try:
        stderr, removed_at = _run_elastic(proc, tmp_path / "letters",
                                          lose=(slurm_cluster, "node3"))
    finally:
        slurm_cluster.start_node("node3", detach=False)
    assert re.search(r"slurm job \d+: the trainer on node1, the generators on node2, node3",
                     stderr), stderr[-4000:]
    assert re.search(r"slurm job \d+: generator_2 on node4", stderr), stderr[-4000:]
    retired = [line for line in stderr.splitlines() if "cannot be replaced on its host" in line]
    assert len(retired) == 1 and "goes on with 1 of 2 generators" in retired[0], stderr[-4000:]
    run_dir = tmp_path / "letters"
    _assert_elastic_run(run_dir, stderr, removed_at, proc.returncode, added="generator_2")
    assert read_metrics(run_dir)[removed_at]["generator/num_retired"] == 1
    slurm_cluster.wait_idle(slurm_cluster.node_names())
    _assert_nothing_left(slurm_cluster)


def test_a_lost_trainer_node_fails_the_run_with_one_line_and_a_rerun_resumes(slurm_cluster,
                                                                               tmp_path):
    """node1 (the trainer's) fails for good after step 2: the trainer host watch fails the run
    with one line naming the way back; the same command again resumes from the last checkpoint
    on the nodes Slurm gives now (node1 is down), and every step is trained once."""
    from tests.controller.jobs import LogWatch

    args = ("--loop.num_steps", "6", "--loop.replace_dropped_groups", "0", "--log.level", "debug",
            "--generator.engine", "stand_in", "--generator.stand_in_tokens_per_s", "300")
    first = _train_on_slurm(slurm_cluster, tmp_path, *args)
    log = LogWatch(first.stderr)
    try:
        log.wait_for(r"step=2 ")
        assert slurm_cluster.kill_node("node1") >= 2  # slurmd, the worker, the trainer's proc
        first.wait(timeout=300)
        log.wait_closed()
    finally:
        if first.poll() is None:
            first.kill()
    errors = [line for line in log.text().splitlines() if line.startswith("error:")]
    assert first.returncode == 1 and len(errors) == 1, log.text()[-4000:]
    assert "the trainer's host is gone: its worker at tcp://node1:22222" in errors[0]
    assert "run the same command again to resume" in errors[0]
    try:
        rerun = _train_on_slurm(slurm_cluster, tmp_path, *args)
        _, stderr = rerun.communicate(timeout=600)
    finally:
        slurm_cluster.start_node("node1", detach=False)
    assert rerun.returncode == 0, stderr[-4000:]
    assert re.search(r"slurm job \d+: the trainer on node[234],", stderr), stderr[-4000:]
    run_dir = tmp_path / "letters"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 2
    steps = [json.loads(line)["step"] for line in (run_dir / "trained_samples.jsonl").open()]
    assert steps == list(range(6))  # every step once across both runs
    slurm_cluster.wait_idle(slurm_cluster.node_names())
    _assert_nothing_left(slurm_cluster)


def test_a_generator_added_and_one_removed_mid_run_on_one_host(tmp_path):
    """The same requests on the local placement (no cluster): generator_1 joins on this host."""
    cmd = [sys.executable, "-m", "torchtitan_rl.train", "--config", LETTERS_TOML,
           "--output_dir", str(tmp_path), "--loop.num_steps", "500",
           "--loop.replace_dropped_groups", "0", "--log.level", "debug",
           "--generator.engine", "stand_in", "--generator.stand_in_tokens_per_s", "2000"]
    env = {**env_without_faults(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TORCHTITAN_RL_LOG_LEVEL", None)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    stderr, removed_at = _run_elastic(proc, tmp_path / "letters")
    _assert_elastic_run(tmp_path / "letters", stderr, removed_at, proc.returncode,
                        added="generator_1")
