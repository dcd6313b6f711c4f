"""What the run's timeline (metrics/trace.py, on by default) costs a step.

    python bench/trace_cost.py [--pairs 2] [--steps 30] [--output-dir runs/trace_cost]

Three measurements, one run:
1. The writer alone: the time per event of RunTrace.span and async_span (100,000 of each into
   a temporary file), times the events a step of a run wrote (counted in its trace.json), over
   that run's median step wall time: the fraction of a step the trace takes.
2. Whole runs: the tests' TOML job (tests/controller/tiny_letter_job.toml: the tiny model, short
   steps, where the trace's share is largest) with ``--metrics.trace.enabled`` true and false,
   alternated ``--pairs`` times (ABBA...), each run's median ``time/step_wall_s`` (the whole
   step: the trainer ranks' spans are read after the push, only with the trace on).
3. The engines' numbers (generator/engine_stats.py, always on): the time per engine step of
   EngineStats.record and timed (100,000 made-up steps), times the engine steps of a step (the
   run's engine/generator_*/num_steps), over the step wall time.

Last line: ``events_per_step=<n> us_per_event=<...> trace_frac=<(1)> step_s_on=<median>
step_s_off=<median> ratio=<on / off> engine_steps_per_step=<n> us_per_engine_step=<...>
engine_stats_frac=<(3)>``. The whole-run ratio includes the box's noise between runs; (1) is the
trace's own cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan_rl.generator.engine_stats import EngineStats  # noqa: E402
from torchtitan_rl.metrics.trace import GENERATOR_PID, RunTrace  # noqa: E402


def us_per_event(n: int = 100_000) -> float:
    with tempfile.TemporaryDirectory() as folder:
        trace = RunTrace(RunTrace.Config(), run_dir=pathlib.Path(folder))
        start = time.perf_counter()
        for i in range(n):
            t = trace.now()
            trace.span("steps", "train", t, t, step=i)
            trace.async_span("request", "request", f"group={i}/rollout=0/turn=0", t, t,
                             pid=GENERATOR_PID, outcome="done")
        elapsed = time.perf_counter() - start
        trace.close()
    return elapsed / (3 * n) * 1e6  # a span is one event, an async span two


def us_per_engine_step(n: int = 100_000) -> float:
    """EngineStats.record + timed per engine step, on stats shaped as vLLM's (a decode step of
    8 requests: 8 inter-token latencies)."""
    prefix = types.SimpleNamespace(queries=0, hits=0)
    scheduler = types.SimpleNamespace(kv_cache_usage=0.1, num_running_reqs=8, num_waiting_reqs=0,
                                      prefix_cache_stats=prefix)
    iteration = types.SimpleNamespace(num_preempted_reqs=0, num_prompt_tokens=0,
                                      num_generation_tokens=8, finished_requests=[],
                                      time_to_first_tokens_iter=[],
                                      inter_token_latencies_iter=[0.01] * 8)
    stats = EngineStats()
    start = time.perf_counter()
    for i in range(n):
        stats.record(scheduler, iteration)
        stats.timed(0.0, 0.001)
        if i % 1000 == 999:  # a read per 1,000 engine steps, as the controller reads per step
            stats.take()
    return (time.perf_counter() - start) / n * 1e6


def run(out: pathlib.Path, name: str, steps: int, trace: bool) -> pathlib.Path:
    command = [sys.executable, "-m", "torchtitan_rl.train", "--config",
               "tests/controller/tiny_letter_job.toml", "--output_dir", str(out), "--name", name,
               "--loop.num_steps", str(steps), "--loop.replace_dropped_groups", "0",
               "--checkpoint.every_steps", "0", "--metrics.trace.enabled", str(trace).lower()]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out / name


def records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_s(run_dir: pathlib.Path) -> float:
    return statistics.median(r["time/step_wall_s"] for r in records(run_dir)
                             if "time/step_wall_s" in r)


def engine_steps(run_dir: pathlib.Path) -> float:
    """The median over steps of the engine steps every generator took in the step."""
    return statistics.median(
        sum(v for k, v in r.items() if k.startswith("engine/") and k.endswith("/num_steps"))
        for r in records(run_dir) if "time/step_wall_s" in r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/trace_cost")
    a = parser.parse_args()
    out = pathlib.Path(a.output_dir)
    cost_us = us_per_event()
    engine_us = us_per_engine_step()
    steps_per_step = 0.0
    on: list[float] = []
    off: list[float] = []
    events_per_step = 0.0
    for i in range(a.pairs):
        for trace in ((True, False) if i % 2 == 0 else (False, True)):
            run_dir = run(out, f"{'on' if trace else 'off'}{i}", a.steps, trace)
            (on if trace else off).append(step_s(run_dir))
            if trace:
                events = json.loads((run_dir / "trace.json").read_text())
                events_per_step = sum(e["ph"] in ("X", "b", "e") for e in events) / a.steps
                steps_per_step = engine_steps(run_dir)
            print(f"run {run_dir.name}: median step_s {(on if trace else off)[-1]:.4f}")
    frac = events_per_step * cost_us * 1e-6 / statistics.median(on)
    engine_frac = steps_per_step * engine_us * 1e-6 / statistics.median(on)
    print(f"events_per_step={events_per_step:.0f} us_per_event={cost_us:.2f} "
          f"trace_frac={frac:.4f} step_s_on={statistics.median(on):.4f} "
          f"step_s_off={statistics.median(off):.4f} "
          f"ratio={statistics.median(on) / statistics.median(off):.3f} "
          f"engine_steps_per_step={steps_per_step:.0f} us_per_engine_step={engine_us:.2f} "
          f"engine_stats_frac={engine_frac:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
