"""Placement over hosts (real Monarch workers, vLLM, torchtitan on this machine): runs attach to
TCP workers (a tensor-parallel generator on one), a dead worker fails in one line, a
generator lost on its host is replaced on that host; and the placement's config checks."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.controller.jobs import (
    REPO_ROOT,
    TINY_MODEL_BYTES,
    LogWatch,
    assert_every_group_trained_once,
    env_without_faults,
    read_metrics,
    tiny_job,
)
from tests.controller.lifetime_testlib import RunSessions
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.hosts.cluster_jobs import SlurmPlacement, slurm_job_kwargs
from torchtitan_rl.controller.hosts.placement import Placement
from torchtitan_rl.train import main
from torchtitan_rl.trainer.critic import ValueCritic


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_worker(address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torchtitan_rl.worker", "--address", address],
                            cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _stop(worker: subprocess.Popen) -> None:
    """The worker and the procs it spawned (its session)."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.wait(timeout=60)


@pytest.mark.slow
def test_job_attached_to_tcp_workers_trains_with_the_message_transport(tmp_path):
    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    workers = [_start_worker(address) for address in addresses]
    try:
        config = tiny_job(tmp_path, "attached", num_steps=2, max_staleness=1)
        # One tensor-parallel-2 generator: its ranks decide in lockstep (the rank-0 LoopDecision
        # broadcast in a job), and a push reaches its host once (rank 0 shares it with rank 1).
        # Also PPO with a critic off-policy (S = 1): GAE from a value model trained beside the
        # policy, a k3 KL penalty in the rewards (the algorithms' real-stack run for "gae").
        config = dataclasses.replace(
            config, placement=Placement.Config(kind="attach", workers=addresses),
            generator_tensor_parallel_degrees=[2],
            rollouter=dataclasses.replace(config.rollouter, advantage="gae"),
            trainer=dataclasses.replace(
                config.trainer, weight_transport="message",
                critic=ValueCritic.Config(enabled=True, lr=1e-2),
                loss=dataclasses.replace(config.trainer.loss, kl_coef=0.05,
                                         kl_placement="reward")))
        summary = main(config)
        assert all(worker.poll() is None for worker in workers)  # the run stopped procs only
    finally:
        for worker in workers:
            _stop(worker)
    assert summary["steps"] == 2
    metrics = read_metrics(tmp_path / "attached")
    for step in range(2):
        assert metrics[step]["router/generator_0/num_routed"] > 0  # the TP-2 generator served
        assert metrics[step]["weight_sync/generators_by_shared_memory"] == 0
        assert metrics[step]["weight_sync/bytes_moved"] == TINY_MODEL_BYTES
        assert 0 <= metrics[step]["async/policy_age_max"] <= 1
        assert metrics[step]["critic/value_loss"] > 0 and metrics[step]["critic/grad_norm"] > 0
        assert math.isfinite(metrics[step]["loss/objective"])
    # the value head starts at 0 and has moved after the first update
    assert metrics[0]["critic/value_mean"] == 0.0 and metrics[1]["critic/value_mean"] != 0.0
    # the KL penalty: none before the policy moved, some after
    assert metrics[0]["loss/kl_mean"] == 0.0 and metrics[1]["loss/kl_mean"] > 0.0


@pytest.mark.slow
def test_a_worker_gone_before_the_run_fails_it_with_one_line(tmp_path):
    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    workers = [_start_worker(address) for address in addresses]
    _stop(workers[1])  # killed before the run starts
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torchtitan_rl.train",
             "--config", "tests/controller/tiny_letter_job.toml", "--output_dir", str(tmp_path),
             "--placement.kind", "attach", "--placement.workers", ",".join(addresses),
             "--placement.host_timeout_s", "5"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        _stop(workers[0])
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"placement.workers[1] {addresses[1]}: no worker answers there" in errors[0]


@pytest.mark.slow
def test_a_generator_lost_on_its_host_is_replaced_on_that_host(tmp_path):
    """Also a lifetime ending (test_controller_lifetime): a success on simulated hosts leaves no
    process and no socket folder behind."""
    run = RunSessions()
    proc = run.start(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(tmp_path), "lost", "12",
         "--num-prompts", "24", "--placement", "process", "--engine", "stand_in"],
        # 12 steps: long enough to read the new pid
        env_without_faults(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    log = LogWatch(proc.stderr)
    try:
        started = log.wait_for(r"generator generator_0 started \(tp=1, pids (\d+) ")
        controller_session = os.getsid(proc.pid)
        lost_pid = int(started.group(1))
        generator_host = os.getsid(lost_pid)  # the simulated host's worker session
        assert generator_host != controller_session
        log.wait_for(r"step=1 ")
        run.look()  # the run cannot end before the replacement: it is up
        assert len(run.sessions) >= 3, run.sessions  # 2 hosts (+ the reaper)
        os.kill(lost_pid, signal.SIGKILL)
        replaced = log.wait_for(r"generator generator_0_r1 started \(tp=1, pids (\d+) ")
        try:
            assert os.getsid(int(replaced.group(1))) == generator_host
        except ProcessLookupError:
            pytest.fail("the replacement ended before its host could be read")
        proc.wait(timeout=600)
        run.assert_all_gone()
    finally:
        run.close()
    assert proc.returncode == 0, log.text()[-4000:]
    assert_every_group_trained_once(tmp_path / "lost", 12, 24)
    assert read_metrics(tmp_path / "lost")[11]["generator/restarts"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("host, started, error", [
    ("generator", r"generator generator_0 started \(tp=1, pids (\d+) ",
     r"error: actor mesh failure: replacing generator_0 \(lost: its host is gone: its worker "
     r"at ipc://.*\) failed: HostUnreachableError\('its host 0 is gone'\)$"),
    ("trainer", r"trainer policy_trainer started \(pids (\d+)[ ,]",
     r"error: actor mesh failure: the trainer's host is gone: its worker at ipc://\S+ stopped "
     r"answering \(.*\); run the same command again to resume from the last checkpoint$"),
])
def test_a_host_lost_for_good_fails_the_run_with_one_line(tmp_path, host, started, error):
    """The generator's or the trainer's whole host (its worker and procs) dies: the host watch
    finds its worker's socket refused within two health polls; the only generator cannot be
    replaced (nothing is spawned on a gone host), the trainer cannot be restarted on it, so the
    run fails with one line instead of waiting for the host (Monarch reports none of its procs'
    deaths). Also a lifetime ending (test_controller_lifetime): an error on simulated hosts
    leaves no process and no socket folder behind."""
    run = RunSessions()
    proc = run.start(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(tmp_path), "host", "100",
         "--placement", "process", "--engine", "stand_in"],
        # one generator: the run cannot finish without its host
        env_without_faults(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    log = LogWatch(proc.stderr)
    try:
        pid = int(log.wait_for(started).group(1))
        log.wait_for(r"step=1 ")
        run.look()  # the run cannot end without this host: it is up
        assert len(run.sessions) >= 3, run.sessions  # 2 hosts (+ the reaper)
        os.killpg(os.getsid(pid), signal.SIGKILL)  # the host's worker session
        proc.wait(timeout=600)
        run.assert_all_gone()
    finally:
        run.close()
    assert proc.returncode == 1, log.text()[-4000:]
    errors = [line for line in log.text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log.text()[-4000:]
    assert re.match(error, errors[0]), errors[0]


@pytest.mark.parametrize("placement, message", [
    (Placement.Config(kind="attach", workers=["tcp://a:1"]),
     "placement.workers has 1 addresses; this job needs 2"),
    (Placement.Config(kind="attach", workers=["tcp://a:1", "a:2"]),
     "placement.workers[1]='a:2': a worker address is tcp://HOST:PORT"),
    (Placement.Config(kind="attach", workers=["tcp://a:1", "tcp://b"]),
     "placement.workers[1]='tcp://b': write tcp://HOST:PORT"),
    (Placement.Config(kind="process", workers=["tcp://a:1"]),
     "placement.workers is for kind 'attach'"),
    (Placement.Config(kind="local", trainer_hosts=2),
     "placement.trainer_hosts > 1 needs hosts"),
    (Placement.Config(kind="slurm", trainer_hosts=2),
     "num_trainer_ranks=1 must be a multiple of placement.trainer_hosts=2"),
    (Placement.Config(kind="process", generators_per_host=0),
     "placement.trainer_hosts (1) and placement.generators_per_host (0) must be >= 1"),
])
def test_placement_errors_name_the_key(placement, message):
    with pytest.raises(ConfigError) as e:
        placement.check(num_generators=1, num_trainer_ranks=1)
    assert str(e.value).startswith(message), str(e.value)


def test_generators_share_hosts_as_configured():
    placement = Placement.Config(kind="attach", generators_per_host=2,
                                 workers=["tcp://t:1", "tcp://g0:1", "tcp://g1:1"])
    placement.check(num_generators=3, num_trainer_ranks=1)  # 1 trainer host + ceil(3 / 2)
    assert placement.num_generator_hosts(3) == 2


def test_slurm_settings_reach_monarch_slurm_job():
    placement = Placement.Config(kind="slurm", host_timeout_s=900, slurm=SlurmPlacement(
        partition="gpu", time_limit="02:00:00", gpus_per_node=8, slurm_args=["--account=rl"]))
    kwargs = slurm_job_kwargs(placement.slurm, placement.host_timeout_s)
    assert kwargs["partition"] == "gpu" and kwargs["time_limit"] == "02:00:00"
    assert kwargs["gpus_per_node"] == 8 and kwargs["slurm_args"] == ("--account=rl",)
    assert kwargs["job_start_timeout"] == 900
    assert kwargs["mem"] is None and kwargs["cpus_per_task"] is None  # left to Slurm
    assert kwargs["python_exe"] == sys.executable
    # In a process of its own: monarch.job imports flask (see tests/controller/run_tiny_job.py).
    names = subprocess.run(
        [sys.executable, "-c", "import inspect; from monarch.job import SlurmJob; "
         "print(*inspect.signature(SlurmJob).parameters)"],
        capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert set(kwargs) <= set(names)


OPEN_SIMULATED_HOSTS = """
import asyncio
from torchtitan_rl.controller.hosts.placement import Placement
async def main():
    hosts = await Placement(Placement.Config(kind="process", host_timeout_s=60)).open(2)
    await hosts.close()
    print("hosts up")
asyncio.run(main())
"""


@pytest.mark.slow
def test_simulated_hosts_slow_to_listen_are_attached_once_they_listen(tmp_path):
    # Monarch drops an attach message sent before a worker listens once its delivery timeout
    # passes, and the attach never completes: on a loaded box a worker's Python start-up can
    # take that long. Here every worker starts 5 s late and the delivery timeout is 2 s.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('HYPERACTOR_PROCESS_NAME'):  # the ProcessJob's workers only\n"
        "    time.sleep(5)\n")
    env = {**env_without_faults(), "HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT": "2s",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    proc = subprocess.run([sys.executable, "-c", OPEN_SIMULATED_HOSTS], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "hosts up" in proc.stdout, proc.stderr[-3000:]
