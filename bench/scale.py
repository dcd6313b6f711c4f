"""The controller, the rollouts, the weight push and Monarch at N generators on simulated hosts,
each generator's engine a stand-in that answers at a set rate and loads every pushed byte.

    python bench/scale.py [--generators 1,2,4,8,16,32] [--model-size demo] [--tokens-per-s 2000]
                          [--num-workers K] [--link-mbps X] [--output-dir runs/scale]

For each N, a short real job (``RLJob``) runs in a child process that is its controller:
``placement.kind = "process"`` (one Monarch worker process per simulated host, one generator per
host, the trainer on a host of its own), ``generator.engine = "stand_in"`` (no model compute:
seeded replies at ``--tokens-per-s`` per engine, every pushed tensor copied into the engine's own;
torchtitan_rl/generator/stand_in_engine.py), the multi-turn RunningSum task (``--turns`` turns a
rollout), ``--groups-per-generator`` x N groups a step so every generator is busy, real GRPO
training on ``--model-size`` and the real push after every step. The child stamps each step's
metrics line with its own CPU seconds (``time.process_time``: every thread of the controller,
Monarch's included) and wall clock; steps before ``--warmup-steps`` are skipped.

Per N: controller CPU ms per turn (CPU seconds over the measured steps / the turns they generated:
rollouts x turns, from metrics.jsonl) and two parts of it, the main thread's (``loop``: the event
loop running the controller's code) and Monarch's runtime threads' (``monarch``; per thread /proc
counts 10 ms ticks: few measured steps make these two coarse), the controller's CPU per turn while
it waits for the groups alone (``rollouts``: the loop's ``rollout/controller_cpu_ms_per_turn``,
median of the steps), turns/s sustained (the same turns / the steps' ``time/generate_s``: with the
default synchronous loop, ``--max-staleness 0``, generation runs alone, so the trainer's speed on
this machine does not bound it), bytes sent by the busiest process per push
(``weight_sync/busiest_sender_bytes`` when the push reports it, else ``weight_sync/bytes_moved``:
the serial push sends everything from trainer rank 0), the model's bytes, push wall seconds
(``time/push_s``, median of the measured steps) and the peak RSS of the whole job (summed over the
child and every process under it, shared library pages counted in each, sampled each second); then,
over the N, the controller's CPU split into per turn and per step (a least-squares line).
``--num-workers`` sets ``rollouter.num_workers`` (rollout-worker actors) where this code has the
field; ``--health-poll-s`` sets ``placement.health_poll_s`` (default 0: the run's auto poll; a
long poll, 100, shows what Monarch's health checks cost the controller); ``--link-mbps`` sets
``TORCHTITAN_RL_SIMULATED_LINK_MBPS``, which paces each process's sends to a simulated NIC where
the relay push reads it (on 2 cores, wall time cannot show network scaling otherwise). Before
each N the bench estimates the memory it needs from the previous N and stops there (saying so)
if this machine has not that much available; a failed N stops it too. Each job's console and
logs go to ``<output-dir>/n<N>/``.

The last line:
``controller_ms_per_turn=<largest N reached> busiest_sender_over_model=<max over N>
push_growth_1_to_16=<push wall at N=16, or the largest N reached, / at N=1>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
LINK_ENV = "TORCHTITAN_RL_SIMULATED_LINK_MBPS"
GIB = 1 << 30


@dataclasses.dataclass(kw_only=True)
class CaseResult:
    """One N's figures (the measured steps only)."""

    num_generators: int
    controller_ms_per_turn: float
    turns_per_s: float
    num_turns: int
    num_steps: int
    busiest_sender_bytes: float
    model_bytes: float
    push_s: float
    step_s: float
    peak_rss_gib: float = 0.0
    loop_ms_per_turn: float = 0.0
    """Of controller_ms_per_turn: the controller's main thread (its event loop: the training
    loop, the gate, the pools, the calls' Python side, metrics)."""
    monarch_ms_per_turn: float = 0.0
    rollouts_ms_per_turn: float = 0.0
    """The controller's CPU per turn while it waits for a step's groups alone (the loop's
    ``rollout/controller_cpu_ms_per_turn``, median of the measured steps): the training call,
    the push and the metrics left out."""
    """Of controller_ms_per_turn: Monarch's runtime threads (``monarch-*``: its tokio workers)."""


# ---- the child: one job, this process its controller ----------------------------------------
def job_config(args: argparse.Namespace, n: int, run_dir: pathlib.Path):
    from examples.running_sum import RunningSumTask
    from torchtitan_rl.assets.model_source import ModelSource
    from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
    from torchtitan_rl.controller.hosts.placement import Placement
    from torchtitan_rl.controller.job import RLJob
    from torchtitan_rl.controller.loop.loop import TrainingLoop
    from torchtitan_rl.controller.loop.staleness import StalenessGate
    from torchtitan_rl.controller.loop.validation import Validator
    from torchtitan_rl.generator.generator import Generator
    from torchtitan_rl.metrics.logger import MetricsLogger
    from torchtitan_rl.rollout.recorder import RolloutRecorder
    from torchtitan_rl.rollout.rollouter import Rollouter
    from torchtitan_rl.trainer.batcher import Batcher
    from torchtitan_rl.trainer.core import OptimizerConfig
    from torchtitan_rl.trainer.trainer import PolicyTrainer
    from torchtitan_rl.types import Sampling

    rollouter = {}
    if args.num_workers is not None:
        if "num_workers" not in Rollouter.Config.__dataclass_fields__:
            raise SystemExit("--num-workers: this code has no rollouter.num_workers")
        rollouter["num_workers"] = args.num_workers
    placement = {"health_poll_s": args.health_poll_s} if args.health_poll_s else {}
    # A turn is a question of ~15 tokens and a reply of up to --max-tokens: whole conversations
    # fit 48 tokens a turn.
    seq_len = 48 * args.turns
    return RLJob.Config(
        name=run_dir.name, output_dir=str(run_dir.parent), seed=0, num_generators=n,
        model=ModelSource.Config(size=args.model_size, assets_dir=str(REPO / "assets" / "models")),
        task=RunningSumTask.Config(num_turns=args.turns),
        rollouter=Rollouter.Config(group_size=args.group_size, max_turns=args.turns,
                                   max_rollout_tokens=seq_len, credit="turn",
                                   drop_zero_std_groups=False, **rollouter),
        sampling=Sampling(max_tokens=args.max_tokens, temperature=1.0),
        generator=Generator.Config(engine="stand_in", stand_in_tokens_per_s=args.tokens_per_s,
                                   max_model_len=seq_len, max_restarts=0),
        placement=Placement.Config(kind="process", generators_per_host=1, host_timeout_s=300.0,
                                   **placement),
        batcher=Batcher.Config(seq_len=seq_len),
        trainer=PolicyTrainer.Config(optimizer=OptimizerConfig(lr=1e-5), max_restarts=0,
                                     relay_chunk_bytes=args.relay_chunk_bytes),
        loop=TrainingLoop.Config(
            num_steps=args.warmup_steps + args.steps,
            groups_per_step=args.groups_per_generator * n,
            staleness=StalenessGate.Config(max_staleness=args.max_staleness)),
        validation=Validator.Config(num_prompts=0),
        checkpoint=Checkpointer.Config(every_steps=0, export_hf=False, resume="never",
                                       overwrite=True),
        metrics=MetricsLogger.Config(tensorboard=False),
        recorder=RolloutRecorder.Config(every_k_steps=0),
    )


def thread_cpu_s() -> tuple[float, float]:
    """(this process's main thread, its ``monarch-*`` threads) CPU seconds, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    main_s = monarch_s = 0.0
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if int(task.name) == os.getpid():
            main_s += seconds
        elif name.startswith("monarch-"):
            monarch_s += seconds
    return main_s, monarch_s


def run_case(args: argparse.Namespace, n: int) -> None:
    """Child mode: run the job for ``n`` generators, write ``result.json`` in its folder."""
    sys.path.insert(0, str(REPO))
    from torchtitan_rl.console import configure_process_logging
    from torchtitan_rl.controller.job import RLJob
    from torchtitan_rl.metrics.logger import MetricsLogger

    case_dir = pathlib.Path(args.output_dir) / f"n{n}"
    configure_process_logging()
    log = MetricsLogger.log

    window_ends = (args.warmup_steps - 1, args.warmup_steps + args.steps - 1)

    def stamped(self, step: int, metrics: dict[str, float]) -> None:
        # The controller's own CPU and wall clock at the end of each step (after its push);
        # per thread (from /proc) only where the measured window starts and ends, the reading
        # itself outside the window.
        stamp = {"bench/wall_s": time.perf_counter()}
        if step in window_ends:
            if step == window_ends[1]:
                stamp["bench/controller_cpu_s"] = time.process_time()
            main_s, monarch_s = thread_cpu_s()
            stamp |= {"bench/controller_loop_cpu_s": main_s,
                      "bench/controller_monarch_cpu_s": monarch_s}
            stamp.setdefault("bench/controller_cpu_s", time.process_time())
        log(self, step, {**metrics, **stamp})

    MetricsLogger.log = stamped  # type: ignore[method-assign]
    main_s, monarch_s = thread_cpu_s()
    start = (time.process_time(), time.perf_counter(), main_s, monarch_s)
    RLJob(job_config(args, n, case_dir / "job")).run()
    steps = [json.loads(line) for line in (case_dir / "job" / "metrics.jsonl").read_text()
             .splitlines()]
    result = figures(n, steps, args.warmup_steps, start)
    (case_dir / "result.json").write_text(json.dumps(dataclasses.asdict(result)))


def figures(n: int, steps: list[dict], warmup_steps: int,
            start: tuple[float, float, float, float]) -> CaseResult:
    """The measured steps' figures: from the end of the last warm-up step (or the job's start)
    to the end of the last step."""
    steps = sorted(steps, key=lambda s: s["step"])
    measured = [s for s in steps if s["step"] >= warmup_steps]
    if not measured:
        raise RuntimeError(f"no step after the {warmup_steps} warm-up steps")
    before = [s for s in steps if s["step"] == warmup_steps - 1]
    keys = ("bench/controller_cpu_s", "bench/wall_s", "bench/controller_loop_cpu_s",
            "bench/controller_monarch_cpu_s")
    cpu0, wall0, loop0, monarch0 = [before[0][k] for k in keys] if before else start
    cpu_s = measured[-1]["bench/controller_cpu_s"] - cpu0
    loop_s = measured[-1]["bench/controller_loop_cpu_s"] - loop0
    monarch_s = measured[-1]["bench/controller_monarch_cpu_s"] - monarch0
    generate_s = sum(s["time/generate_s"] for s in measured)
    turns = sum(round(s.get("rollout/num_rollouts", 0) * s.get("rollout/num_turns", 0))
                for s in measured)

    def mean(key: str, fallback: str = "") -> float:
        values = [s.get(key, s.get(fallback, 0.0)) for s in measured]
        return sum(values) / len(values)

    return CaseResult(
        num_generators=n, controller_ms_per_turn=1e3 * cpu_s / max(turns, 1),
        loop_ms_per_turn=1e3 * loop_s / max(turns, 1),
        monarch_ms_per_turn=1e3 * monarch_s / max(turns, 1),
        rollouts_ms_per_turn=statistics.median(
            s.get("rollout/controller_cpu_ms_per_turn", 0.0) for s in measured),
        turns_per_s=turns / generate_s, num_turns=turns, num_steps=len(measured),
        busiest_sender_bytes=mean("weight_sync/busiest_sender_bytes", "weight_sync/bytes_moved"),
        model_bytes=mean("weight_sync/model_bytes"),
        # the median: on a shared 2-core box one push in a few waits for a core (0.04-1.3 s)
        push_s=statistics.median(s["time/push_s"] for s in measured),
        step_s=(measured[-1]["bench/wall_s"] - wall0) / len(measured))


# ---- the parent: N after N, within the memory there is ---------------------------------------
def available_gib() -> float:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


class TreeRss:
    """Peak resident memory of a process and everything under it (simulated hosts start their
    own sessions but stay its descendants), sampled every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.peak_bytes = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(self.interval_s):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / GIB


def run_child(args: argparse.Namespace, n: int) -> CaseResult | str:
    """The case in a child process; its result, or why it failed (one line)."""
    case_dir = pathlib.Path(args.output_dir) / f"n{n}"
    case_dir.mkdir(parents=True, exist_ok=True)
    (case_dir / "result.json").unlink(missing_ok=True)
    command = [sys.executable, __file__, "--case", str(n), *sys.argv[1:]]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if args.link_mbps:
        env[LINK_ENV] = str(args.link_mbps)
    with (case_dir / "console.txt").open("w") as console:  # a file: a pipe could fill
        proc = subprocess.Popen(command, env=env, stdout=console,
                                stderr=subprocess.STDOUT, start_new_session=True)
        rss = TreeRss(proc.pid)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:  # as Ctrl-C: the job stops its hosts, then the rest
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
        peak = rss.stop()
    if code != 0:
        tail = (case_dir / "console.txt").read_text().strip().splitlines()[-1:] or [""]
        why = "timed out" if code is None else f"exit {code}"
        return f"{why} (peak {peak:.1f} GiB): {tail[0][:200]}"
    result = CaseResult(**json.loads((case_dir / "result.json").read_text()))
    result.peak_rss_gib = peak
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generators", default="1,2,4,8,16,32",
                        help="comma-separated N, run in order")
    parser.add_argument("--model-size", default="demo", choices=("tiny", "demo", "small"))
    parser.add_argument("--tokens-per-s", type=float, default=2000.0,
                        help="each stand-in engine's output tokens per second")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (RunningSum)")
    parser.add_argument("--max-tokens", type=int, default=8, help="most tokens per reply")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-generator", type=int, default=4,
                        help="groups a step per generator (loop.groups_per_step = this x N)")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="0 (synchronous): generation alone in time/generate_s, so turns/s "
                             "is not bounded by the trainer")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    parser.add_argument("--num-workers", type=int, default=2,
                        help="rollouter.num_workers (0: rollouts in the controller)")
    parser.add_argument("--relay-chunk-bytes", type=int, default=64 << 10,
                        help="trainer.relay_chunk_bytes: ~70 chunks of the demo model, the ratio "
                             "of a 600 MB model in the default 4 MiB chunks is ~150")
    parser.add_argument("--link-mbps", type=float, default=2.0,
                        help=f"sets {LINK_ENV} for the job (0: unset, no pacing)")
    parser.add_argument("--health-poll-s", type=float, default=0.0,
                        help="placement.health_poll_s (0: the run's auto poll, N / 2 s in "
                             "[2, 10]); a long poll (100) shows what Monarch's health checks "
                             "cost")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="memory left to the rest of the machine: an N needing more stops")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per N")
    parser.add_argument("--output-dir", default="runs/scale")
    parser.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        return run_case(args, args.case)
    if args.num_workers is not None:
        sys.path.insert(0, str(REPO))
        from torchtitan_rl.rollout.rollouter import Rollouter

        if "num_workers" not in Rollouter.Config.__dataclass_fields__:
            parser.error("--num-workers: this code has no rollouter.num_workers yet")

    results: list[CaseResult] = []
    stopped = ""
    gib_per_generator, base_gib = 1.0, 3.0  # first guesses, replaced by each N's measurement
    for n in [int(x) for x in args.generators.split(",")]:
        need, free = base_gib + gib_per_generator * n, available_gib()
        if need > free - args.reserve_gib:
            stopped = (f"stopped before N={n}: it needs ~{need:.1f} GiB, {free:.1f} GiB available "
                       f"and {args.reserve_gib:g} GiB reserved")
            break
        print(f"N={n}: running (needs ~{need:.1f} GiB of {free:.1f} available)", flush=True)
        start = time.monotonic()
        result = run_child(args, n)
        if isinstance(result, str):
            stopped = f"stopped at N={n}: {result} (see {args.output_dir}/n{n}/console.txt)"
            break
        results.append(result)
        if n > 1 and len(results) > 1:
            prev = results[-2]
            gib_per_generator = max(0.3, (result.peak_rss_gib - prev.peak_rss_gib)
                                    / (n - prev.num_generators))
        else:
            gib_per_generator = max(gib_per_generator, result.peak_rss_gib / 3)
        base_gib = max(0.5, result.peak_rss_gib - gib_per_generator * n)
        print(f"N={n}: done in {time.monotonic() - start:.0f} s: "
              f"{result.controller_ms_per_turn:.3f} ms/turn, {result.turns_per_s:.1f} turns/s, "
              f"push {result.push_s:.2f} s, peak {result.peak_rss_gib:.1f} GiB", flush=True)
    if stopped:
        print(stopped, flush=True)
    if not results:
        raise SystemExit("no N completed")
    print_table(results)
    if len(results) > 1:
        per_turn_ms, per_step_ms = cpu_split(results)
        print(f"controller CPU, a line through the N: {per_turn_ms:.3f} ms per turn + "
              f"{per_step_ms:.0f} ms per step")
    first, last = results[0], results[-1]
    at16 = next((r for r in results if r.num_generators == 16), last)
    if at16.num_generators != 16 or first.num_generators != 1:
        print(f"push_growth_1_to_16 below: N={first.num_generators} -> N={at16.num_generators} "
              f"(the N reached)")
    print(f"controller_ms_per_turn={last.controller_ms_per_turn:.4f} "
          f"busiest_sender_over_model="
          f"{max(r.busiest_sender_bytes / r.model_bytes for r in results):.2f} "
          f"push_growth_1_to_16={at16.push_s / first.push_s:.2f}")


def cpu_split(results: list[CaseResult]) -> tuple[float, float]:
    """Least squares of the controller's CPU per step against the turns per step over the N:
    (ms per turn, ms per step). Per-step work (the train call, the push, the metrics) shared
    by more turns makes ms per turn fall with N even when the per-turn cost is flat."""
    xs = [r.num_turns / r.num_steps for r in results]
    ys = [r.controller_ms_per_turn * x for r, x in zip(results, xs)]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / max(
        sum((x - mean_x) ** 2 for x in xs), 1e-12)
    return slope, mean_y - slope * mean_x


def print_table(results: list[CaseResult]) -> None:
    print(f"{'N':>3} {'ctl ms/turn':>11} {'loop':>6} {'monarch':>7} {'rollouts':>8} "
          f"{'turns/s':>8} {'turns':>6} "
          f"{'busiest MB':>10} {'model MB':>9} {'busiest/model':>13} {'push s':>7} {'step s':>7} "
          f"{'peak GiB':>8}")
    for r in results:
        print(f"{r.num_generators:>3} {r.controller_ms_per_turn:>11.4f} "
              f"{r.loop_ms_per_turn:>6.3f} {r.monarch_ms_per_turn:>7.3f} "
              f"{r.rollouts_ms_per_turn:>8.3f} {r.turns_per_s:>8.1f} "
              f"{r.num_turns:>6} {r.busiest_sender_bytes / 1e6:>10.1f} {r.model_bytes / 1e6:>9.1f} "
              f"{r.busiest_sender_bytes / r.model_bytes:>13.2f} {r.push_s:>7.2f} "
              f"{r.step_s:>7.2f} {r.peak_rss_gib:>8.1f}")


if __name__ == "__main__":
    main()
