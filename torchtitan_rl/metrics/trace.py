"""A timeline of the run: Chrome trace events in the run folder, for Perfetto or chrome://tracing.

    MetricsLogger builds RunTrace(run_dir) -> <run_dir>/trace.json (trace-<n>.json after a resume)
    TrainingLoop: span("steps", "wait for batch" | "train" | "push", ...), validation, checkpoint,
                  span("staleness gate", "admit wait") while the producer waits for capacity
    GeneratorRouter: each request's life, queued to done, on its generator's track (async events)
    MetricsLogger.close -> close(): the array closed

Format: the JSON Array Format of the Trace Event Format (one event a line; "X" complete events,
"b"/"e" async events, "M" metadata naming each track). The file is valid JSON once closed, and
both viewers also read it while the run writes it (the closing "]" is optional there), so a live
or killed run's timeline opens too. Times are microseconds since the run's start.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from torchtitan_rl.config.configurable import Configurable

CONTROLLER_PID = 1
"""The controller's process in the trace; trainer rank r is TRAINER_PID + r, generator i is
GENERATOR_PID + i."""
TRAINER_PID = 10
GENERATOR_PID = 100


def process_name(pid: int) -> str:
    """The name a process's track group has in the viewers."""
    if pid >= GENERATOR_PID:
        return f"generator_{pid - GENERATOR_PID}"
    if pid >= TRAINER_PID:
        return f"trainer rank {pid - TRAINER_PID}"
    return "controller" if pid == CONTROLLER_PID else str(pid)


class RunTrace(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = True
        """Write the run's timeline (trace.json in the run folder; docs/reading_a_run.md)."""

    def __init__(self, config: Config, *, run_dir: pathlib.Path) -> None:
        self.config = config
        self.path: pathlib.Path | None = None
        self._file: IO[str] | None = None
        self._start = time.perf_counter()
        self._wall_minus_perf = time.time() - self._start
        """time.time() - time.perf_counter(): other processes' events come in wall-clock time."""
        self._tracks: dict[tuple[int, str], int] = {}
        self._named_pids: set[int] = set()
        self._num_async = 0
        if not config.enabled:
            return
        run_dir = pathlib.Path(run_dir)
        path, n = run_dir / "trace.json", 0
        while path.exists():  # a resumed run keeps the earlier parts' timelines
            n += 1
            path = run_dir / f"trace-{n}.json"
        self.path = path
        self._file = path.open("w", buffering=1 << 16)
        self._file.write("[\n")
        self._name_process(CONTROLLER_PID)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def now(self) -> float:
        """The clock spans are given in (time.perf_counter)."""
        return time.perf_counter()

    def from_wall(self, wall_s: float) -> float:
        """A wall-clock time (time.time, another process's) as a ``now()`` value (hosts' clocks
        are assumed in step, as NTP keeps them: to a few milliseconds)."""
        return wall_s - self._wall_minus_perf

    def span(self, track: str, name: str, start: float, end: float, *,
             pid: int = CONTROLLER_PID, **args: Any) -> None:
        """A complete event on ``track`` from ``start`` to ``end`` (``now()`` values)."""
        if self._file is None:
            return
        self._name_process(pid)
        self._write({"ph": "X", "name": name, "pid": pid, "tid": self._tid(pid, track),
                     "ts": self._us(start), "dur": max(0.0, (end - start) * 1e6),
                     **({"args": args} if args else {})})

    @contextmanager
    def timed(self, track: str, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(track, name, start, time.perf_counter(), **args)

    def async_span(self, category: str, name: str, key: str, start: float, end: float, *,
                   pid: int, **args: Any) -> None:
        """An async slice (a request's life): overlapping slices of one process get rows of
        their own in the viewers."""
        if self._file is None:
            return
        self._name_process(pid)
        self._num_async += 1  # a key may come back (validation's episodes): ids must not
        common = {"cat": category, "name": name, "id": self._num_async, "pid": pid, "tid": 0}
        self._write({**common, "ph": "b", "ts": self._us(start), "args": {"key": key, **args}})
        self._write({**common, "ph": "e", "ts": self._us(end)})

    def close(self) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"ph": "M", "name": "trace_end", "pid": CONTROLLER_PID,
                                     "tid": 0, "args": {}}) + "\n]\n")
        self._file.close()
        self._file = None

    def _us(self, t: float) -> float:
        return round((t - self._start) * 1e6, 1)

    def _tid(self, pid: int, track: str) -> int:
        key = (pid, track)
        if key not in self._tracks:
            self._tracks[key] = tid = len(self._tracks) + 1
            self._write({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                         "args": {"name": track}})
        return self._tracks[key]

    def _name_process(self, pid: int) -> None:
        if pid not in self._named_pids:
            self._named_pids.add(pid)
            self._write({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                         "args": {"name": process_name(pid)}})

    def _write(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
