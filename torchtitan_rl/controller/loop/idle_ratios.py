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

from torchtitan_rl.generator.router import BusyClock


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
