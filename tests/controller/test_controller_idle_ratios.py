"""Idle ratios from a fake clock: overlapping requests count once, windows tile the run."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.controller.loop.idle_ratios import IdleRatios
from torchtitan_rl.generator.router import BusyClock, GeneratorRouter
from torchtitan_rl.types import GenerateRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_work_counts_once_and_open_intervals_count_up_to_now():
    t = FakeClock()
    busy = BusyClock(t)
    busy.enter()          # 0: first request
    t.now = 1.0
    busy.enter()          # 1: a second one overlaps
    t.now = 3.0
    busy.exit()
    assert busy.busy_seconds() == 3.0  # still open: counted up to now
    t.now = 4.0
    busy.exit()           # 4: idle from here
    t.now = 10.0
    assert busy.busy_seconds() == 4.0
    with pytest.raises(RuntimeError, match="without a matching enter"):
        busy.exit()


def test_idle_ratios_per_step_window():
    t = FakeClock()
    busy = BusyClock(t)
    ratios = IdleRatios(busy, clock=t)
    busy.enter()
    t.now = 6.0           # generating 0..6
    busy.exit()
    t.now = 10.0          # the trainer worked 6..10
    first = ratios.end_step(trainer_busy_s=4.0)
    assert first == {"time/trainer_idle_ratio": pytest.approx(0.6),
                     "time/generator_idle_ratio": pytest.approx(0.4)}
    t.now = 15.0          # next window 10..15: both idle, then
    second = ratios.end_step(trainer_busy_s=0.0)
    assert second["time/generator_idle_ratio"] == 1.0 and second["time/trainer_idle_ratio"] == 1.0


def test_router_times_its_generators_calls_and_passes_results_through():
    t = FakeClock()

    async def inner(request: GenerateRequest):
        t.now += 2.0
        if request.request_id == "boom":
            raise RuntimeError("engine died")
        return request.prompt_token_ids[::-1]

    fn = GeneratorRouter(GeneratorRouter.Config(), generators=[inner], busy_clock=BusyClock(t))
    assert asyncio.run(fn(GenerateRequest(prompt_token_ids=[1, 2], request_id="a"))) == [2, 1]
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(fn(GenerateRequest(prompt_token_ids=[1], request_id="boom")))
    assert fn.busy_clock.busy_seconds() == 4.0 and fn.busy_clock.num_open == 0
