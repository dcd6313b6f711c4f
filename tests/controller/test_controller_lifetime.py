"""Nothing left behind (controller/hosts/reaper.py): after any end of a run every process it started
is gone within the documented bound, and an attach worker keeps serving. The fast tests check
the mechanisms with sleeping stand-ins; the slow ones count a real run's processes after SIGTERM
and Ctrl-C (after a SIGKILL, an error or a success: on the fault tests' runs that end so, with
lifetime_testlib.RunSessions)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.controller.jobs import REPO_ROOT, LogWatch, env_without_faults
from tests.controller.lifetime_testlib import (
    RunSessions,
    kill_all,
    wait_for,
    wait_gone,
)
from torchtitan_rl.controller.hosts import reaper
from torchtitan_rl.controller.hosts.reaper import RUN_TOKEN_ENV, RunStopped, run_stoppable

SLEEPER_CODE = "import time; print('up', flush=True); time.sleep(600)"
SLEEPER = [sys.executable, "-c", SLEEPER_CODE]


def _start(command: list[str], **kwargs) -> subprocess.Popen:
    """Popen, returning once the child runs its own code. Popen returns when the child's exec
    has begun, and the kernel sets /proc/<pid>/environ and cmdline a moment later: a scan in
    between (a loaded box) would miss the child."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, **kwargs)
    assert process.stdout.readline() == b"up\n"
    return process


# ---- the mechanisms (fast) --------------------------------------------------------------------
def test_reap_ends_marked_processes_only():
    token = "t" + os.urandom(4).hex()
    marked = _start(SLEEPER, env={**os.environ, RUN_TOKEN_ENV: token}, start_new_session=True)
    other = _start(SLEEPER, start_new_session=True)
    try:
        assert reaper.marked_pids(token) == [marked.pid]
        assert reaper.reap(token) == 1
        assert marked.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for p in (marked, other):
            p.kill()
            p.wait()


def test_reap_removes_the_socket_folder_of_a_dead_controllers_process_job(tmp_path):
    """What ProcessJob.kill() would have removed: only a folder of sockets, never other files."""
    import socket

    token = "t" + os.urandom(4).hex()
    folders = []
    for name, extra in (("monarch_process_job_a", None), ("monarch_process_job_b", "notes.txt")):
        folder = tmp_path / name
        folder.mkdir()
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(folder / "generators_0"))
        listener.close()
        if extra:
            (folder / extra).write_text("a user's file")
        folders.append(folder)
    workers = [_start(
        [sys.executable, "-c", f'{SLEEPER_CODE}  # address="ipc://{f}/generators_0"'],
        env={**os.environ, RUN_TOKEN_ENV: token}, start_new_session=True) for f in folders]
    try:
        assert reaper.socket_dirs([w.pid for w in workers]) == set(folders)
        assert reaper.reap(token) == 2
        assert not folders[0].exists()
        assert sorted(p.name for p in folders[1].iterdir()) == ["generators_0", "notes.txt"]
    finally:
        for w in workers:
            w.kill()
            w.wait()


CONTROLLER = """
import os, subprocess, sys, time
from torchtitan_rl.controller.hosts.reaper import OrphanReaper
reaper = OrphanReaper()
host = subprocess.Popen([sys.executable, "-c", sys.argv[1]],  # SLEEPER_CODE
                        env={**os.environ, **reaper.env}, start_new_session=True,
                        stdout=subprocess.PIPE)
assert host.stdout.readline() == b"up\\n"  # its environ is set: the reaper will find it
print(reaper.pid, host.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("end", [signal.SIGKILL, signal.SIGTERM])
def test_the_reaper_ends_a_host_session_when_its_controller_dies(end):
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, SLEEPER_CODE],
                                  cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    sidecar, host = (int(pid) for pid in controller.stdout.readline().split())
    pids = {pid: psutil.Process(pid).create_time() for pid in (sidecar, host)}
    try:
        assert os.getsid(host) not in (os.getsid(controller.pid), os.getsid(sidecar))
        controller.send_signal(end)
        controller.wait(timeout=10)
        assert wait_gone(pids) == []  # the host and then the sidecar itself
    finally:
        controller.kill()
        controller.wait()
        kill_all(pids)


def test_sigterm_cancels_the_run_and_its_cleanup_runs():
    cleaned = []

    async def run() -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0)  # an awaiting cleanup, as parts.close() is
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped) as e:
        run_stoppable(run())
    assert cleaned == [True]
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # pytest's own handling is back


def test_sigterm_while_the_model_is_made_stops_the_run_before_anything_is_spawned(
        tmp_path, monkeypatch, caplog):
    """Model making (a missing model of the project's own sizes) with the signal injected in the
    middle of it: the model is finished, never half-written, and no part of the run starts."""
    import shutil

    from tests.controller.jobs import tiny_job
    from torchtitan_rl.assets import make_model as make_model_module
    from torchtitan_rl.assets.model_source import ModelSource
    from torchtitan_rl.controller import job as job_module
    from torchtitan_rl.controller.job import RLJob

    tiny = REPO_ROOT / "assets" / "models" / "tiny"
    made = []
    handled = threading.Event()

    class SetOnStop(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("stopping: SIGTERM"):
                handled.set()

    def make_model_signalled_midway(size: str, out_dir, *, seed: int = 0,
                                    corpus=None) -> pathlib.Path:
        os.kill(os.getpid(), signal.SIGTERM)
        # A real model takes seconds to make: the run has seen the signal before it is done.
        # Here the rest is a copy of milliseconds, so it waits for the run to see it first.
        assert handled.wait(timeout=60), "the run never handled the SIGTERM"
        shutil.copytree(tiny, out_dir)  # the rest of the making, as make_model writes it
        made.append(size)
        return pathlib.Path(out_dir)

    async def build_parts(*args, **kwargs):
        raise AssertionError("a part of the run was spawned after SIGTERM")

    monkeypatch.setattr(make_model_module, "make_model", make_model_signalled_midway)
    monkeypatch.setattr(job_module, "build_parts", build_parts)
    config = tiny_job(tmp_path, "stopped")
    config = dataclasses.replace(config, model=ModelSource.Config(
        size="tiny", assets_dir=str(tmp_path / "models")))
    caplog.set_level(logging.WARNING, logger="torchtitan_rl.controller.hosts.reaper")
    reaper_logger = logging.getLogger("torchtitan_rl.controller.hosts.reaper")
    set_on_stop = SetOnStop()
    reaper_logger.addHandler(set_on_stop)
    try:
        with pytest.raises(RunStopped) as e:
            RLJob(config).run()
    finally:
        reaper_logger.removeHandler(set_on_stop)
    assert e.value.exit_code == 128 + signal.SIGTERM and made == ["tiny"]
    assert (tmp_path / "models" / "tiny" / "model.safetensors").is_file()
    assert not (tmp_path / "stopped").exists()  # no run folder either
    assert [r.getMessage() for r in caplog.records] == [
        "stopping: SIGTERM (closing the run's processes)"]


def test_a_cleanup_that_hangs_is_cut_at_the_deadline():
    script = ("import asyncio, os, signal\n"
              "from torchtitan_rl.controller.hosts import reaper\n"
              "reaper.STOP_DEADLINE_S = 1.0\n"
              "async def run():\n"
              "    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)\n"
              "    try:\n"
              "        await asyncio.sleep(60)\n"
              "    finally:\n"
              "        await asyncio.shield(asyncio.sleep(60))  # a close that never returns\n"
              "reaper.run_stoppable(run())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-2000:]


# ---- real runs (slow) ---------------------------------------------------------------------------
TRAIN = [sys.executable, "-m", "torchtitan_rl.train", "--config",
         "tests/controller/tiny_letter_job.toml"]


def _train(out: pathlib.Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*TRAIN, "--output_dir", str(out), *args],
        cwd=REPO_ROOT, env=env_without_faults(fault), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


STAND_IN = ("--generator.engine", "stand_in", "--generator.stand_in_tokens_per_s", "20000")
"""The stand-in engine (generator/stand_in_engine.py) where the processes, not the tokens, are
what a test is about: the same actors and procs, without vLLM's start-up in each generator."""


# The other endings are asserted on the runs of the fault tests that end that way (RunSessions):
# a SIGKILLed controller on simulated hosts with vLLM and on one host with the stand-in
# (test_controller_loop_job's resume tests), an error on simulated hosts
# (test_controller_placement's host lost for good) and a success on simulated hosts
# (test_controller_placement's generator replaced on its host).
@pytest.mark.slow
@pytest.mark.parametrize("placement, end, phase", [("process", "sigterm", "steps"),
                                                   ("local", "ctrl-c", "validation")])
def test_every_process_of_a_run_is_gone_after_it_ends(tmp_path, placement, end, phase):
    """SIGTERM while it trains, on simulated hosts; Ctrl-C while it validates (held at the start
    of its second validation, at step 3, by an injected fault), on one host."""
    in_validation = phase == "validation"
    run = RunSessions()
    controller = run.start(
        [*TRAIN, "--output_dir", str(tmp_path), "--placement.kind", placement,
         "--loop.num_steps", "100", "--trainer.max_restarts", "0", *STAND_IN,
         *(("--validation.every_steps", "3") if in_validation else ())],
        env_without_faults("hold_controller_at_validations:2" if in_validation else None),
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = LogWatch(controller.stderr)
    try:
        if in_validation:
            log.wait_for(r"fault injection: holding at hold_controller_at_validations=2 ")
        else:
            # Any checkpoint: step-000001 alone is deleted three saves later (keep_last), which
            # a fast run does within one poll.
            checkpoints = tmp_path / "letters" / "checkpoints"
            wait_for(lambda: any(checkpoints.glob("step-*")) or controller.poll() is not None,
                     "a checkpoint")
        run.look()
        if placement == "process":
            # 2 hosts (+ the reaper): tracked; a controller that ended already says why
            assert len(run.sessions) >= 3, (run.sessions, controller.poll(), log.text()[-3000:])
        controller.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGINT)
        controller.wait(timeout=reaper.STOP_DEADLINE_S + 30)
        log.wait_closed()
        run.assert_all_gone()
    finally:
        run.close()
    stderr = log.text()
    name, signum = ("SIGTERM", signal.SIGTERM) if end == "sigterm" else ("SIGINT", signal.SIGINT)
    assert controller.returncode == 128 + signum, stderr[-3000:]
    lines = stderr.replace("\r", "\n").splitlines()
    assert [line.strip() for line in lines if name in line or "error" in line.lower()] == [
        f"stopping: {name} (closing the run's processes)"], stderr[-3000:]
    if in_validation:  # stopped inside it: its result never came
        assert "validation step=0 " in stderr and "validation step=3 " not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_an_attach_worker_stops_a_gone_clients_procs_and_keeps_serving(tmp_path):
    from tests.controller.test_controller_placement import _free_port, _start_worker, _stop

    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    workers = [_start_worker(address) for address in addresses]
    attach = ("--placement.kind", "attach", "--placement.workers", ",".join(addresses), *STAND_IN)

    def procs() -> dict[int, float]:
        return {p.pid: p.create_time() for w in workers
                for p in psutil.Process(w.pid).children(recursive=True)}

    try:
        first = _train(tmp_path, *attach, "--name", "first", "--loop.num_steps", "100",
                       fault="kill_controller_after_groups:4")
        first.communicate(timeout=600)
        assert first.returncode == -signal.SIGKILL
        assert procs(), "the killed client's procs should be there to reap"
        assert wait_gone(procs()) == [], "the gone client's procs are still running"
        second = _train(tmp_path, *attach, "--name", "second", "--loop.num_steps", "1")
        _, stderr = second.communicate(timeout=600)
        assert second.returncode == 0, stderr[-3000:]  # the workers served a new run
        assert wait_gone(procs()) == []
        assert all(worker.poll() is None for worker in workers)
    finally:
        for worker in workers:
            _stop(worker)
