"""What the run's timeline (metrics/trace.py, on by default) costs a step.

    python bench/trace_cost.py [--pairs 2] [--steps 30] [--output-dir runs/trace_cost]

Two measurements, one run:
1. The writer alone: the time per event of RunTrace.span and async_span (100,000 of each into
   a temporary file), times the events a step of a run wrote (counted in its trace.json), over
   that run's median step time: the fraction of a step the trace takes.
2. Whole runs: the tests' TOML job (tests/controller/tiny_letter_job.toml: the tiny model, short
   steps, where the trace's share is largest) with ``--metrics.trace.enabled`` true and false,
   alternated ``--pairs`` times (ABBA...), each run's median ``time/step_s``.

Last line: ``events_per_step=<n> us_per_event=<...> trace_frac=<(1)> step_s_on=<median>
step_s_off=<median> ratio=<on / off>``. The whole-run ratio includes the box's noise between runs;
(1) is the trace's own cost.
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

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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


def run(out: pathlib.Path, name: str, steps: int, trace: bool) -> pathlib.Path:
    command = [sys.executable, "-m", "torchtitan_rl.train", "--config",
               "tests/controller/tiny_letter_job.toml", "--output_dir", str(out), "--name", name,
               "--loop.num_steps", str(steps), "--loop.replace_dropped_groups", "0",
               "--checkpoint.every_steps", "0", "--metrics.trace.enabled", str(trace).lower()]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out / name


def step_s(run_dir: pathlib.Path) -> float:
    values = [json.loads(line).get("time/step_s") for line in
              (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(v for v in values if v is not None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/trace_cost")
    a = parser.parse_args()
    out = pathlib.Path(a.output_dir)
    cost_us = us_per_event()
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
            print(f"run {run_dir.name}: median step_s {(on if trace else off)[-1]:.4f}")
    frac = events_per_step * cost_us * 1e-6 / statistics.median(on)
    print(f"events_per_step={events_per_step:.0f} us_per_event={cost_us:.2f} "
          f"trace_frac={frac:.4f} step_s_on={statistics.median(on):.4f} "
          f"step_s_off={statistics.median(off):.4f} "
          f"ratio={statistics.median(on) / statistics.median(off):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
