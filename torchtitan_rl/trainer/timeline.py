"""Each trainer rank's own timeline for the run's trace: forward, backward and optimizer spans.

    PolicyTrainerCore.forward_backward: with timeline.span("forward" | "backward", microbatch=i)
    PolicyTrainer.optim_step: with timeline.span("optimizer")
    controller, after each step with the trace on: TrainerClient.take_timeline() -> every rank's
        timeline.take() -> trace_trainer_ranks(trace, ...) -> track "steps" of process
        "trainer rank r" in trace.json

Times are wall clock (time.time): the controller maps them onto its own clock (RunTrace.from_wall).
A rank keeps at most MAX_EVENTS between two reads (later ones are counted, not kept): a run whose
trace is off, which never reads, stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torchtitan_rl.metrics.trace import TRAINER_PID, RunTrace

MAX_EVENTS = 10_000

TimelineEvent = tuple[str, float, float, dict[str, Any]]
"""(name, start, end, args): a span in wall-clock seconds."""


class RankTimeline:
    def __init__(self) -> None:
        self._events: list[TimelineEvent] = []
        self.num_dropped = 0

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            if len(self._events) < MAX_EVENTS:
                self._events.append((name, start, time.time(), args))
            else:
                self.num_dropped += 1

    def take(self) -> list[TimelineEvent]:
        """The spans since the last take."""
        events, self._events = self._events, []
        return events


def trace_trainer_ranks(trace: RunTrace, events_by_rank: dict[int, list[TimelineEvent]]) -> None:
    """Every rank's spans on its own process track of ``trace``."""
    for rank, events in sorted(events_by_rank.items()):
        for name, start, end, args in events:
            trace.span("steps", name, trace.from_wall(start), trace.from_wall(end),
                       pid=TRAINER_PID + rank, **args)
