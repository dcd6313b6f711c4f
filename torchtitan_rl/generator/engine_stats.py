"""The engines' own numbers: vLLM's scheduler and iteration stats, read once per training step.

    build_engine (vllm_engine.py): stats = EngineStats(); LLMEngine.from_engine_args(args,
        stat_loggers=[stats.stat_logger_factory()]); register(engine, stats)
    vLLM, inside each engine.step(): our StatLogger.record(scheduler_stats, iteration_stats)
        -> stats.record(...)          (vLLM's custom stat-logger interface, vllm.v1.metrics)
    finished_outputs_of_step (vllm_engine.py): the step's wall-clock start and end -> stats.timed
    Generator.take_engine_stats (rank 0) -> stats.take(): the window since the last take
    controller, after each step: engine_metrics(reports) -> engine/generator_<i>/<name> in
        metrics.jsonl and every tracker; trace_engine_steps -> the generator's "engine steps"
        track in trace.json

The numbers are vLLM's, not re-derived: its KV cache usage, running and waiting requests and
prefix-cache queries and hits (SchedulerStats, after every step), its preemptions, prompt and
generated tokens, time to first token and inter-token latencies (IterationStats). A window is
what the engine did between two reads (a training step, and the validation before it).

Invariant: ``record`` runs in the engine thread, ``take`` in the actor's event loop; one lock
guards the window, and a window holds at most ``MAX_*`` samples (later ones are counted, not
kept), so a read costs O(engine steps since the last read) and memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any

from torchtitan_rl.metrics.trace import GENERATOR_PID, RunTrace

MAX_STEPS_KEPT = 20_000
"""Engine steps a window keeps for the timeline (the metrics count every step)."""
MAX_LATENCIES_KEPT = 200_000
"""Time-to-first-token and inter-token samples a window keeps for its percentiles."""
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineStep:
    """One engine step as vLLM reported it, with its wall-clock span (time.time seconds)."""

    start_s: float
    end_s: float
    num_requests: int
    """Requests the step computed: running after it plus those it finished."""
    num_tokens: int
    """Prompt tokens it prefilled plus tokens it generated."""
    kv_cache_usage: float


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineStatsReport:
    """One window of one engine: scalar metrics (names without the generator's prefix) and its
    steps for the timeline."""

    metrics: dict[str, float]
    steps: list[EngineStep]
    num_steps_dropped: int = 0
    """Steps past MAX_STEPS_KEPT: in the metrics, not on the timeline."""


class _Window:
    __slots__ = ("num_steps", "kv_usage_sum", "kv_usage_max", "running_sum", "running_max",
                 "waiting_sum", "waiting_max", "prefix_queries", "prefix_hits", "preemptions",
                 "prompt_tokens", "generation_tokens", "busy_s", "ttft_s", "itl_s", "steps",
                 "num_steps_dropped", "pending")

    def __init__(self) -> None:
        self.num_steps = 0
        self.kv_usage_sum = self.kv_usage_max = 0.0
        self.running_sum = self.running_max = self.waiting_sum = self.waiting_max = 0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.busy_s = 0.0
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []
        self.steps: list[EngineStep] = []
        self.num_steps_dropped = 0
        self.pending: tuple[int, int, float] | None = None
        """The last record's (requests, tokens, kv usage), until ``timed`` gives its span."""


class EngineStats:
    """What one engine reported since the last ``take`` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = _Window()

    def stat_logger_factory(self) -> Any:
        """A factory for ``LLMEngine(stat_loggers=[...])``: vLLM calls it with its config and
        engine index and feeds the logger it returns from every engine step."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _StatLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _StatLogger

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """vLLM's stats of one engine step (engine thread)."""
        if scheduler_stats is None:
            return
        with self._lock:
            w = self._window
            w.num_steps += 1
            usage = float(scheduler_stats.kv_cache_usage)
            w.kv_usage_sum += usage
            w.kv_usage_max = max(w.kv_usage_max, usage)
            running, waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
            w.running_sum += running
            w.running_max = max(w.running_max, running)
            w.waiting_sum += waiting
            w.waiting_max = max(w.waiting_max, waiting)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                w.prefix_queries += prefix.queries
                w.prefix_hits += prefix.hits
            tokens, finished = 0, 0
            if iteration_stats is not None:
                w.preemptions += iteration_stats.num_preempted_reqs
                w.prompt_tokens += iteration_stats.num_prompt_tokens
                w.generation_tokens += iteration_stats.num_generation_tokens
                tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
                finished = len(iteration_stats.finished_requests)
                room = MAX_LATENCIES_KEPT - len(w.ttft_s)
                w.ttft_s.extend(iteration_stats.time_to_first_tokens_iter[:max(room, 0)])
                room = MAX_LATENCIES_KEPT - len(w.itl_s)
                w.itl_s.extend(iteration_stats.inter_token_latencies_iter[:max(room, 0)])
            w.pending = (running + finished, tokens, usage)

    def timed(self, start_s: float, end_s: float) -> None:
        """The wall-clock span (time.time) of the engine step ``record`` saw last."""
        with self._lock:
            w = self._window
            w.busy_s += end_s - start_s
            if w.pending is None:
                return
            num_requests, num_tokens, usage = w.pending
            w.pending = None
            if len(w.steps) < MAX_STEPS_KEPT:
                w.steps.append(EngineStep(start_s=start_s, end_s=end_s, num_requests=num_requests,
                                          num_tokens=num_tokens, kv_cache_usage=usage))
            else:
                w.num_steps_dropped += 1

    def take(self) -> EngineStatsReport:
        """The window since the last take, as metrics and steps; a new window starts."""
        with self._lock:
            w, self._window = self._window, _Window()
        metrics: dict[str, float] = {"num_steps": float(w.num_steps), "busy_s": w.busy_s,
                                     "num_preemptions": float(w.preemptions),
                                     "prompt_tokens": float(w.prompt_tokens),
                                     "generation_tokens": float(w.generation_tokens)}
        if w.num_steps:
            metrics.update({
                "kv_cache_usage_mean": w.kv_usage_sum / w.num_steps,
                "kv_cache_usage_max": w.kv_usage_max,
                "num_running_mean": w.running_sum / w.num_steps,
                "num_running_max": float(w.running_max),
                "num_waiting_mean": w.waiting_sum / w.num_steps,
                "num_waiting_max": float(w.waiting_max),
            })
        if w.prefix_queries:
            metrics["prefix_cache_hit_rate"] = w.prefix_hits / w.prefix_queries
        for name, samples in (("time_to_first_token_s", w.ttft_s),
                              ("inter_token_latency_s", w.itl_s)):
            samples.sort()
            for p in PERCENTILES if samples else ():
                metrics[f"{name}_p{p}"] = _nearest_rank(samples, p)
        return EngineStatsReport(metrics=metrics, steps=w.steps,
                                 num_steps_dropped=w.num_steps_dropped)


def _nearest_rank(ordered: list[float], percentile: int) -> float:
    return float(ordered[max(0, math.ceil(percentile / 100 * len(ordered)) - 1)])


_BY_ENGINE: weakref.WeakKeyDictionary[Any, EngineStats] = weakref.WeakKeyDictionary()


def register(engine: Any, stats: EngineStats) -> None:
    """``stats`` are ``engine``'s (its stat logger feeds them)."""
    _BY_ENGINE[engine] = stats


def stats_of(engine: Any) -> EngineStats | None:
    """The stats ``engine`` reports into; None for an engine without them (the stand-in)."""
    try:
        return _BY_ENGINE.get(engine)
    except TypeError:  # an engine that cannot be weakly referenced has none
        return None


def engine_metrics(reports: dict[int, EngineStatsReport]) -> dict[str, float]:
    """Each generator's window as ``engine/generator_<i>/<name>`` metrics."""
    return {f"engine/generator_{index}/{name}": value
            for index, report in sorted(reports.items())
            for name, value in report.metrics.items()}


def trace_engine_steps(trace: RunTrace, reports: dict[int, EngineStatsReport]) -> None:
    """Each generator's engine steps on its "engine steps" track of ``trace``."""
    if not trace.enabled:
        return
    for index, report in reports.items():
        for step in report.steps:
            trace.span("engine steps", "step", trace.from_wall(step.start_s),
                       trace.from_wall(step.end_s), pid=GENERATOR_PID + index,
                       requests=step.num_requests, tokens=step.num_tokens,
                       kv_cache_usage=round(step.kv_cache_usage, 4))
