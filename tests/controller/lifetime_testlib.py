"""Counting a real run's processes after it ends (controller/hosts/reaper.py): the run's controller is
started in a session of its own, and every process in that session or in a session one of its
descendants opened (a simulated host, the orphan reaper) must be gone within GONE_WITHIN_S of the
end. Used by the lifetime tests and by the fault tests whose run ends the way a lifetime test
needs (a SIGKILL, an error, a success on simulated hosts)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import psutil

GONE_WITHIN_S = 60.0
"""The bound docs/fault_tolerance.md states: after the controller's end, its processes are gone
within this long (attach: Monarch's orphan reaping, measured 30-45 s; the others: seconds)."""


def alive(pids: dict[int, float]) -> list[int]:
    """Which of ``pids`` (pid -> create time, against pid reuse) still run (zombies do not)."""
    running = []
    for pid, created in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_gone(pids: dict[int, float], timeout_s: float = GONE_WITHIN_S) -> list[int]:
    """Polls until none of ``pids`` runs or ``timeout_s`` passes; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while (running := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)  # poll interval: a process's end has no event this test can wait on
    return running


def in_sessions(sessions: set[int]) -> dict[int, float]:
    found = {}
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) in sessions:
                found[p.pid] = p.info["create_time"]
        except (ProcessLookupError, PermissionError):
            pass
    return found


def kill_all(pids: dict[int, float]) -> None:
    for pid in alive(pids):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def wait_for(condition, what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.5)  # poll interval: files and process exits have no event to wait on here


class RunSessions:
    """The processes of one run whose controller ``start`` launched in a session of its own, with
    a short temp dir of its own (a socket path has <= 107 bytes: ProcessJob's socket folder lies
    there). ``look`` while the run is up records the sessions its descendants opened;
    ``assert_all_gone`` after its end checks that nothing of it is left."""

    def __init__(self) -> None:
        self.temp_dir = pathlib.Path(tempfile.mkdtemp(prefix="ttrl"))
        self.controller: subprocess.Popen | None = None
        self.sessions: set[int] = set()
        self.tracked: dict[int, float] = {}

    def start(self, command: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        self.controller = subprocess.Popen(command, env={**env, "TMPDIR": str(self.temp_dir)},
                                           start_new_session=True, **kwargs)
        self.sessions = {self.controller.pid}
        return self.controller

    def look(self) -> None:
        """Records the sessions of the controller's descendants and every process in them (a run
        that ended already leaves only its own session to look in)."""
        try:
            children = psutil.Process(self.controller.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                self.sessions.add(os.getsid(child.pid))
            except ProcessLookupError:
                pass
        self.tracked.update(in_sessions(self.sessions))

    def assert_all_gone(self) -> None:
        """After the controller's end: every process of its sessions is gone within
        GONE_WITHIN_S, and so is the simulated hosts' socket folder (ProcessJob's kill or, after
        a SIGKILL, the orphan reaper removes it)."""
        assert self.controller.poll() is not None, "the run is still up"
        self.look()  # anything started since the last look
        assert wait_gone(self.tracked) == [], [psutil.Process(p).cmdline()
                                               for p in alive(self.tracked)]
        wait_for(lambda: not any(self.temp_dir.glob("monarch_process_job_*")),
                 "removal of the socket folder", timeout_s=GONE_WITHIN_S)

    def close(self) -> None:
        """Whatever happened: nothing of the run outlives the test."""
        if self.controller is not None:
            self.controller.kill()
            self.controller.wait()
            kill_all(in_sessions(self.sessions))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
