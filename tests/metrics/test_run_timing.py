"""The pieces behind a run's timing, without the stack: the engines' numbers window
(generator/engine_stats.py) on stats shaped as vLLM's, the step breakdown's reader and plot
(metrics/step_breakdown.py), a trainer rank's timeline (trainer/timeline.py) and the trace's
process tracks and wall-clock mapping (metrics/trace.py). The real stack's numbers:
tests/generator/test_generator_engine_loop.py and tests/controller/test_controller_sync_job.py."""

from __future__ import annotations

import json
import pathlib
import time
import types

import pytest

from torchtitan_rl.generator import engine_stats
from torchtitan_rl.generator.engine_stats import EngineStats, engine_metrics
from torchtitan_rl.metrics import step_breakdown, trace_plot
from torchtitan_rl.metrics.trace import GENERATOR_PID, RunTrace
from torchtitan_rl.trainer import timeline
from torchtitan_rl.trainer.timeline import RankTimeline, trace_trainer_ranks


def _scheduler(running: int, waiting: int, usage: float, queries: int = 0, hits: int = 0
               ) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting,
                                 kv_cache_usage=usage,
                                 prefix_cache_stats=types.SimpleNamespace(queries=queries,
                                                                          hits=hits))


def _iteration(prompt: int, generated: int, *, ttft: list[float] = (), itl: list[float] = (),
               preempted: int = 0, finished: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_prompt_tokens=prompt, num_generation_tokens=generated,
                                 num_preempted_reqs=preempted, finished_requests=[0] * finished,
                                 time_to_first_tokens_iter=list(ttft),
                                 inter_token_latencies_iter=list(itl))


def test_a_window_sums_vllms_counts_and_takes_nearest_rank_percentiles() -> None:
    stats = EngineStats()
    # a prefill of 3 requests (30 prompt tokens, 20 of them cached), then 2 decode steps
    stats.record(_scheduler(3, 1, 0.2, queries=30, hits=20), _iteration(30, 3, ttft=[0.1, 0.2,
                                                                                   0.3]))
    stats.timed(100.0, 100.5)
    stats.record(_scheduler(2, 0, 0.4), _iteration(0, 3, itl=[0.01, 0.02, 0.03], preempted=1,
                                                   finished=1))
    stats.timed(100.5, 100.75)
    stats.record(_scheduler(0, 0, 0.0), None)  # a step with no outputs: vLLM sends no iteration
    stats.timed(101.0, 101.25)
    report = stats.take()
    m = report.metrics
    assert m["num_steps"] == 3 and m["busy_s"] == 1.0
    assert (m["prompt_tokens"], m["generation_tokens"], m["num_preemptions"]) == (30, 6, 1)
    assert m["kv_cache_usage_mean"] == pytest.approx(0.2) and m["kv_cache_usage_max"] == 0.4
    assert (m["num_running_mean"], m["num_running_max"]) == (pytest.approx(5 / 3), 3)
    assert (m["num_waiting_mean"], m["num_waiting_max"]) == (pytest.approx(1 / 3), 1)
    assert m["prefix_cache_hit_rate"] == pytest.approx(20 / 30)
    # nearest rank: p50 of 3 is the 2nd, p90 and p99 the 3rd
    assert [m[f"time_to_first_token_s_p{p}"] for p in (50, 90, 99)] == [0.2, 0.3, 0.3]
    assert [m[f"inter_token_latency_s_p{p}"] for p in (50, 90, 99)] == [0.02, 0.03, 0.03]
    # each step with its span; its requests: those running after it and those it finished
    assert [(s.start_s, s.end_s, s.num_requests, s.num_tokens) for s in report.steps] == [
        (100.0, 100.5, 3, 33), (100.5, 100.75, 3, 3), (101.0, 101.25, 0, 0)]
    # the next window starts empty: no prefix queries, no latencies -> those keys are absent
    stats.record(_scheduler(1, 0, 0.1), _iteration(0, 1))
    m = stats.take().metrics
    assert m["num_steps"] == 1 and m["generation_tokens"] == 1
    assert "prefix_cache_hit_rate" not in m and "time_to_first_token_s_p50" not in m
    assert engine_metrics({2: engine_stats.EngineStatsReport(metrics={"num_steps": 1.0},
                                                             steps=[])}) == {
        "engine/generator_2/num_steps": 1.0}


def test_a_window_keeps_a_bounded_number_of_steps_and_counts_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(engine_stats, "MAX_STEPS_KEPT", 2)
    monkeypatch.setattr(engine_stats, "MAX_LATENCIES_KEPT", 3)
    stats = EngineStats()
    for i in range(5):
        stats.record(_scheduler(1, 0, 0.1), _iteration(0, 1, itl=[float(i)] * 2))
        stats.timed(float(i), i + 0.5)
    report = stats.take()
    assert report.metrics["num_steps"] == 5 and report.metrics["busy_s"] == 2.5
    assert len(report.steps) == 2 and report.num_steps_dropped == 3
    assert report.metrics["inter_token_latency_s_p99"] == 1.0  # kept: 0, 0, 1


def test_the_breakdown_is_read_per_step_and_plotted(tmp_path: pathlib.Path) -> None:
    parts = dict.fromkeys(step_breakdown.PARTS, 0.5)
    lines = [{"step": 0, "validation/reward_mean": 0.1},  # a validation line: no breakdown
             *({"step": s, **{f"time/breakdown/{p}_s": v for p, v in parts.items()}}
               for s in range(3))]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "time/br')  # killed
    assert step_breakdown.read_breakdowns(tmp_path / "metrics.jsonl") == [
        (s, parts) for s in range(3)]
    path = step_breakdown.plot(tmp_path)
    assert path == tmp_path / "step_breakdown.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert step_breakdown.plot(tmp_path / "no_run") is None


def test_trainer_spans_land_on_their_ranks_tracks_in_the_controllers_clock(
        tmp_path: pathlib.Path, monkeypatch) -> None:
    rank = RankTimeline()
    wall_start = time.time()
    with rank.span("forward", microbatch=0):
        pass
    with rank.span("optimizer"):
        pass
    events = rank.take()
    assert [(name, args) for name, _, _, args in events] == [("forward", {"microbatch": 0}),
                                                              ("optimizer", {})]
    assert rank.take() == []
    monkeypatch.setattr(timeline, "MAX_EVENTS", 1)
    for _ in range(3):
        with rank.span("backward"):
            pass
    assert len(rank.take()) == 1 and rank.num_dropped == 2

    trace = RunTrace(RunTrace.Config(), run_dir=tmp_path)
    trace_trainer_ranks(trace, {1: events})
    trace.close()
    written = json.loads((tmp_path / "trace.json").read_text())
    names = {(e["pid"], e["args"]["name"]) for e in written if e["name"] == "process_name"}
    assert names == {(1, "controller"), (11, "trainer rank 1")}
    spans = [e for e in written if e["ph"] == "X"]
    assert [(e["pid"], e["name"]) for e in spans] == [(11, "forward"), (11, "optimizer")]
    # wall clock mapped onto the trace's clock: the spans start after the trace began (it was
    # opened after them here, so at or below 0 by at most the test's own run time)
    assert all(-(time.time() - wall_start) * 1e6 <= e["ts"] <= 0 for e in spans)


def test_a_trace_is_drawn_offline_even_while_unclosed(tmp_path: pathlib.Path) -> None:
    trace = RunTrace(RunTrace.Config(), run_dir=tmp_path)
    t = trace.now()
    for step, name in enumerate(("wait for batch", "train", "push")):
        trace.span("steps", name, t + step, t + step + 1, step=0)
    trace.async_span("request", "request", "group=0/rollout=0/turn=0", t, t + 0.5,
                     pid=GENERATOR_PID, outcome="done")
    trace.close()
    path = tmp_path / "trace.json"
    path.write_text(path.read_text().rsplit("\n", 3)[0] + "\n")  # a live run's: no "]" yet
    out = trace_plot.plot(path, tmp_path / "timeline.png", (0, 0))
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no step"):
        trace_plot.plot(path, tmp_path / "none.png", (5, 6))
