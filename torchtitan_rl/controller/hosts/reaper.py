"""Nothing left behind: every process a run starts ends when the run ends, however it ends.

    local       procs are the controller's children: Monarch's parent-death signal
                (mesh_bootstrap_enable_pdeathsig, on by default) ends them with it
    process     one worker session per simulated host: `OrphanReaper`, a sidecar that waits for
                the controller's end (a pipe's EOF: no polling) and kills every process that
                carries the run's token in its environment (the workers and their procs), then
                removes the socket folder the dead controller's ProcessJob left in the temp dir
    slurm       the same sidecar, told each Slurm job id as soon as sbatch returns it (a line on
                the pipe): at the controller's end it scancels them, and Slurm ends the job's
                processes on every node; queued jobs are cancelled too
    attach      the procs of a client that is gone: Monarch's host agent reaps procs whose client
                stopped renewing their keepalive for ``HYPERACTOR_MESH_ORPHAN_TIMEOUT``; the
                client pushes its config to the workers it attaches to, so the default set here
                reaches them. The worker keeps serving.
    SIGTERM     `run_stoppable`: cancels the run as Ctrl-C does (meshes closed, workers stopped),
                then ``RunStopped``; a cleanup that hangs is cut at ``STOP_DEADLINE_S`` and the
                mechanisms above finish the job

Cost in a normal run: one idle sidecar process (process placement only) and Monarch's own
keepalive messages; nothing per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("torchtitan_rl.controller.hosts.reaper")  # also as __main__ (sidecar)

T = TypeVar("T")

ORPHAN_TIMEOUT = "10s"
"""Monarch's default is 1 min (procs of a dead client measured alive > 5 min): 10 s of missed
keepalives (renewed every ~1 s while the client lives) ends a gone client's procs in < 1 min."""

RUN_TOKEN_ENV = "TORCHTITAN_RL_RUN_TOKEN"
"""Marks the processes of one run's simulated hosts (inherited by their procs)."""

REAP_GRACE_S = 3.0
"""SIGTERM, then SIGKILL after this long: a proc gets a moment to exit on its own."""

STOP_DEADLINE_S = 60.0
"""After SIGTERM or Ctrl-C, the cleanup gets this long; then the controller exits anyway."""


def set_monarch_defaults() -> None:
    """Before Monarch starts (procs and attached workers inherit it); a user's value wins."""
    os.environ.setdefault("HYPERACTOR_MESH_ORPHAN_TIMEOUT", ORPHAN_TIMEOUT)


# ---- process placement: the sidecar --------------------------------------------------------------
class OrphanReaper:
    """Kills this run's marked processes once the controller is gone (any exit, SIGKILL too).

    The sidecar holds the read end of a pipe whose write end only the controller has: the
    kernel closes it when the controller dies, and the sidecar's read returns. It runs in a
    session of its own, so a Ctrl-C (or a kill of the controller's process group) that ends the
    run does not end the sidecar before it has reaped.
    """

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.env = {RUN_TOKEN_ENV: self.token}
        """Give it to every process the sidecar must reap (ProcessJob(env=...))."""
        self._sidecar = subprocess.Popen(
            [sys.executable, "-m", "torchtitan_rl.controller.hosts.reaper", self.token],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, RUN_TOKEN_ENV: ""})  # never a token: it must not reap itself

    @property
    def pid(self) -> int:
        return self._sidecar.pid

    def cancel_slurm_job_at_exit(self, job_id: str) -> None:
        """Have the sidecar scancel ``job_id`` when the controller ends (however it ends)."""
        assert self._sidecar.stdin is not None
        self._sidecar.stdin.write(f"{job_id}\n".encode())
        self._sidecar.stdin.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """Reap now (after the run's own close) and wait for the sidecar."""
        if self._sidecar.stdin is not None:
            self._sidecar.stdin.close()
        try:
            self._sidecar.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the reaper (pid %d) did not finish in %g s", self.pid, timeout_s)


def marked_pids(token: str) -> list[int]:
    """Live processes whose environment holds ``RUN_TOKEN_ENV=token``."""
    needle = f"{RUN_TOKEN_ENV}={token}".encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue  # exited, not yet waited for by its parent
        except OSError:  # gone meanwhile, or not ours to read
            continue
        pids.append(int(entry))
    return pids


SOCKET_DIR_PREFIX = "monarch_process_job_"
"""`monarch.job.ProcessJob`'s folder of its workers' ipc:// sockets (removed by its ``kill``)."""


def socket_dirs(pids: list[int]) -> set[pathlib.Path]:
    """The ProcessJob socket folders that the workers among ``pids`` listen in (their command
    line holds ``address="ipc://<folder>/<host>"``)."""
    dirs = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        for address in re.findall(r'address="ipc://([^"]+)"', cmdline):
            folder = pathlib.Path(address).parent
            if folder.name.startswith(SOCKET_DIR_PREFIX):
                dirs.add(folder)
    return dirs


def remove_socket_dir(folder: pathlib.Path) -> bool:
    """Remove ``folder`` if it holds nothing but sockets (never anything else); True if removed."""
    try:
        entries = list(folder.iterdir())
        if not all(entry.is_socket() for entry in entries):
            return False
        for entry in entries:
            entry.unlink(missing_ok=True)
        folder.rmdir()
    except OSError:  # gone already, or not ours
        return False
    return True


def reap(token: str, grace_s: float = REAP_GRACE_S) -> int:
    """SIGTERM every marked process, SIGKILL what is left after ``grace_s``, then remove the
    socket folders they listened in; returns how many processes there were."""
    found = marked_pids(token)
    folders = socket_dirs(found)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in found if sig == signal.SIGTERM else marked_pids(token):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and marked_pids(token) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the processes' exit, bounded by grace_s
    for folder in folders:
        remove_socket_dir(folder)
    return len(found)


def cancel_slurm_jobs(job_ids: list[str]) -> None:
    """scancel each job (one that ended already is no error here)."""
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def _sidecar_main(token: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the controller's to handle
    slurm_job_ids = []
    for line in sys.stdin.buffer:  # ends only when the controller is gone (EOF)
        slurm_job_ids.append(line.decode().strip())
    cancel_slurm_jobs(slurm_job_ids)
    found = reap(token)
    if found:  # stderr is the controller's: its terminal or its log file
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logger.warning("reaped %d processes of a run whose controller ended", found)


# ---- SIGTERM and Ctrl-C: the normal cleanup, bounded ---------------------------------------------
class RunStopped(KeyboardInterrupt):
    """The run was stopped by a signal (its cleanup ran); ``exit_code`` is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def run_stoppable(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM and Ctrl-C cancel ``main`` (its ``finally`` blocks
    close the meshes and stop the workers), then raise RunStopped. A second signal acts at once
    (Python's default); a cleanup still running after STOP_DEADLINE_S ends the process
    (os._exit), and the placement's own mechanisms (above) end what is left."""
    got: list[int] = []
    deadline: list[threading.Timer] = []

    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            got.append(signum)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)  # the next one is Python's: immediate
            timer = threading.Timer(STOP_DEADLINE_S, _exit_now, args=(128 + signum,))
            timer.daemon = True
            timer.start()
            deadline.append(timer)
            logger.warning("stopping: %s (closing the run's processes)",
                           signal.Signals(signum).name)
            task.cancel()

        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
                pass
        try:
            return await main
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(guarded())
    except BaseException as e:
        if got and not isinstance(e, RunStopped):  # whatever the cancelled run raised
            logger.debug("the stopped run raised %r", e)
            raise RunStopped(got[0]) from None
        raise
    finally:
        for timer in deadline:
            timer.cancel()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _exit_now(code: int) -> None:
    logger.error("the cleanup did not finish in %g s: exiting", STOP_DEADLINE_S)
    os._exit(code)


if __name__ == "__main__":
    _sidecar_main(sys.argv[1])
