"""How busy the generators and the trainer were: the idle ratios logged every step.

    router: busy_clock.enter() / exit() around every rollout/validation request
    loop (each step):
        generator idle ratio = 1 - (time with >= 1 request in flight) / step window
        trainer idle ratio   = 1 - (train + weight push time) / step window

The step window runs from the end of the previous step (or the loop's start) to the end of this
one, so the windows of a run tile its wall time. The sync loop leaves the generators idle while it
trains and the trainer idle while it generates; the async loop overlaps the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BusyClock:
    """Accumulates the wall time during which at least one unit of work was open."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._open = 0
        self._busy_s = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self._open == 0:
            self._since = self._clock()
        self._open += 1

    def exit(self) -> None:
        if self._open <= 0:
            raise RuntimeError("BusyClock.exit() without a matching enter()")
        self._open -= 1
        if self._open == 0:
            self._busy_s += self._clock() - self._since

    @property
    def num_open(self) -> int:
        return self._open

    def busy_seconds(self) -> float:
        """Busy time so far, counting an interval still open up to now."""
        return self._busy_s + (self._clock() - self._since if self._open else 0.0)


class IdleRatios:
    """Per-step idle ratios of the generators (from a BusyClock) and of the trainer."""

    def __init__(self, generator_clock: BusyClock | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._generator_clock = generator_clock
        self._clock = clock
        self._window_start = clock()
        self._generator_busy_at_start = generator_clock.busy_seconds() if generator_clock else 0.0

    def restart(self) -> None:
        """Start the next window now (the loop begins; time before it is set-up, not idling)."""
        self._window_start = self._clock()
        if self._generator_clock is not None:
            self._generator_busy_at_start = self._generator_clock.busy_seconds()

    def end_step(self, trainer_busy_s: float) -> dict[str, float]:
        now = self._clock()
        window = max(now - self._window_start, 1e-9)
        metrics = {"time/trainer_idle_ratio": max(0.0, 1.0 - trainer_busy_s / window)}
        if self._generator_clock is not None:
            busy = self._generator_clock.busy_seconds() - self._generator_busy_at_start
            metrics["time/generator_idle_ratio"] = max(0.0, 1.0 - busy / window)
        self.restart()
        return metrics
