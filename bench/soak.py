"""A long asynchronous run, sampled: does anything grow that should not?

    python bench/soak.py [--steps 1000] [--every 10] [--output-dir runs/soak] [-- train.py flags]

The run: the asynchronous job on simulated hosts (placement.kind = "process": a trainer host and
2 generator hosts, each push relayed from one to the other; S = 2, partial rollouts, 2 rollout
workers), on a smaller model and shorter episodes than the main job's: the `tiny` model on the
tests' letter task (tests/controller/tiny_letter_job.toml, 2 groups of 4 a step, 12 tokens a
reply), which the untrained model scores on, at a learning rate that keeps the rewards spread
(SOAK_FLAGS), so every step trains and pushes changed weights and 1,000 steps take minutes, not
hours (AlphabetSort gives the untrained tiny model no reward: every step would train nothing).
The first line says how many steps trained anything. Every ``--every`` steps it samples each process of the run (the
controller and everything under it: the reaper, the simulated hosts, their procs, the rollout
workers) for RSS, open file descriptors (each one's target: a path, ``socket:[inode]``, a pipe)
and threads; the controller's Python heap (its
``controller/python_allocated_blocks`` metric, pymalloc blocks in use); the shared-memory
segments the run's processes map (/dev/shm); the run folder's size, split into checkpoints
(bounded by ``checkpoint.keep_last``) and logs (metrics, rollouts, the log file, TensorBoard:
growing with the steps by design).

Written to the output folder: ``soak_samples.jsonl`` (one line a sample), ``soak.png`` (each
series over steps), the run folder. Printed: a table of each series at the first sample after
warm-up and at the end, its growth per 100 steps over the steps after ``--warmup`` (a least-squares
slope), and the last line

    rss_mb=<per 100 steps> fds=<...> fds_held=<...> threads=<...> heap_blocks=<...>
    shm_segments=<...> checkpoints_mb=<...> logs_mb=<...> flat=True|False

flat: RSS grows < 1 % of its post-warm-up value per 100 steps; the descriptors held, threads and
segments never rise above their post-warm-up count; the checkpoints' size is bounded (< 1 %
growth per 100 steps); the heap grows < 1 % per 100 steps. The logs' growth is reported, not
judged.

Held descriptors: a sample comes when a step's line reaches metrics.jsonl, while the controller
goes on writing (a ``with open(...)`` append, the TensorBoard writer's flush, the rollout viewer's
rewrite every ``recorder.every_k_steps``, which reads metrics.jsonl), so a sample now and then
catches a file open for one write. A descriptor that was not held at the previous sample is held
only if the process still has it (same number, same target) ``RECHECK_S`` later, the sampler
re-reading /proc/<pid>/fd meanwhile; a leaked one always is, and is counted. The files caught
open for a moment are printed (``descriptors open at a sample and closed within``), and every
sample records, per process (named by its role), its RSS and descriptor count, what it opened
and closed since the previous sample (``fds_opened``, ``fds_closed``) and which new ones closed
at once (``fds_closed_soon``), so a rise names its process and file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

import psutil

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "tests/controller/tiny_letter_job.toml"
SOAK_FLAGS = [
    "--placement.kind", "process", "--placement.generators_per_host", "1", "--num_generators", "2",
    "--loop.staleness.max_staleness", "2", "--loop.partial_rollout", "abort",
    "--rollouter.num_workers", "2", "--task.num_prompts", "64", "--loop.replace_dropped_groups", "0",
    "--checkpoint.every_steps", "50", "--validation.num_prompts", "8",
    # The job's learning rate (1e-2) saturates the task in ~30 steps: every group then scores 1.0,
    # has no spread and is dropped, and the steps after train nothing. At 3e-5 the reward keeps
    # its spread for the 1,000 steps.
    "--trainer.optimizer.lr", "3e-5",
]
RECHECK_S = 2.0
"""How long a descriptor new at a sample may take to close and still not count as held: a file
open for one write (a JSON line, a TensorBoard flush, the rollout viewer's page) closes well
within it."""
SERIES = ("rss_mb", "fds", "fds_held", "threads", "heap_blocks", "shm_segments",
          "checkpoints_mb", "logs_mb")


def _folder_mb(path: pathlib.Path) -> float:
    total = 0
    for file in path.rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:  # removed meanwhile (a checkpoint rotated out)
            continue
    return total / 2**20


def _processes(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _role(proc: psutil.Process, root: psutil.Process) -> str:
    """What a process of the run is, from its command line: the controller, the reaper, a
    simulated host's worker (named by its socket: trainer_0, generators_1), a proc on a host, a
    rollout worker."""
    if proc.pid == root.pid:
        return "controller"
    command = " ".join(proc.cmdline())
    if "run_worker_loop_forever" in command:
        return "host " + command.rsplit("/", 1)[-1].split('"', 1)[0]
    if "bootstrap_main" in command:
        return f"proc on {_role(proc.parent(), root)}"
    for module in ("reaper", "rollout_workers"):
        if module in command:
            return module
    return command[:60]


def _fd_targets(pid: int) -> dict[str, str]:
    """What each open descriptor of ``pid`` points to (a file's path, ``socket:[inode]``,
    ``pipe:[inode]``, ``anon_inode:[eventfd]``), by descriptor number."""
    targets = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed between the listing and the read
            continue
    return targets


def _closed_within(pid: int, new: dict[str, str], seconds: float) -> dict[str, str]:
    """Those of ``new`` (descriptor -> target) that ``pid`` closes (or points elsewhere) within
    ``seconds``, re-reading its descriptors until all of them are closed or the time is up."""
    closed: dict[str, str] = {}
    deadline = time.monotonic() + seconds
    while len(closed) < len(new) and time.monotonic() < deadline:
        time.sleep(0.05)  # re-reading /proc: a process's descriptors have no event to wait on
        try:
            now = _fd_targets(pid)
        except OSError:  # the process ended
            break
        closed.update({fd: t for fd, t in new.items() if now.get(fd) != t})
    return closed


def _sample(root: psutil.Process, run_dir: pathlib.Path, step: int, heap_blocks: float,
            targets_before: dict[int, dict[str, str]], held_before: dict[int, dict[str, str]]
            ) -> dict:
    """One sample of the run. ``targets_before`` and ``held_before`` hold each process's
    descriptors and held descriptors at the previous sample; both are updated. The sample records
    what each process opened and closed since, and which of its new descriptors it closed within
    RECHECK_S (not held)."""
    rss = fds = fds_held = threads = 0
    segments: set[str] = set()
    fds_by_process: dict[str, int] = {}
    rss_mb_by_process: dict[str, float] = {}
    fds_opened: dict[str, list[str]] = {}
    fds_closed: dict[str, list[str]] = {}
    fds_closed_soon: dict[str, list[str]] = {}
    procs = _processes(root)
    for proc in procs:
        try:
            with proc.oneshot():
                name = f"{proc.pid} {_role(proc, root)}"
                rss_mb_by_process[name] = round(proc.memory_info().rss / 2**20, 1)
                rss += proc.memory_info().rss
                threads += proc.num_threads()
            # Counted from the listing (not num_fds, read at another instant), so the count and
            # the descriptors named below are the same set.
            targets = _fd_targets(proc.pid)
            fds_by_process[name] = len(targets)
            fds += len(targets)
            held = held_before.get(proc.pid, targets)  # a new process: all of it held
            new = {fd: t for fd, t in targets.items() if held.get(fd) != t}
            soon = _closed_within(proc.pid, new, RECHECK_S) if new else {}
            if soon:
                fds_closed_soon[name] = [f"{fd} {t}" for fd, t in soon.items()]
            held_before[proc.pid] = {fd: t for fd, t in targets.items() if fd not in soon}
            fds_held += len(held_before[proc.pid])
            before = targets_before.get(proc.pid, targets)
            if proc.pid in targets_before:
                opened = [f"{fd} {t}" for fd, t in targets.items() if before.get(fd) != t]
                closed = [f"{fd} {t}" for fd, t in before.items() if targets.get(fd) != t]
                if opened:
                    fds_opened[name] = opened
                if closed:
                    fds_closed[name] = closed
            targets_before[proc.pid] = targets
            with open(f"/proc/{proc.pid}/maps") as maps:
                segments.update(line.split()[-1] for line in maps if "/dev/shm/" in line)
        except (psutil.NoSuchProcess, OSError):
            continue
    checkpoints = run_dir / "checkpoints"
    return {
        "step": step, "time": time.time(), "processes": len(procs), "rss_mb": rss / 2**20,
        "fds": fds, "fds_held": fds_held, "threads": threads, "heap_blocks": heap_blocks,
        "shm_segments": len(segments),
        "checkpoints_mb": _folder_mb(checkpoints) if checkpoints.exists() else 0.0,
        "logs_mb": _folder_mb(run_dir) - (_folder_mb(checkpoints) if checkpoints.exists() else 0),
        "fds_by_process": fds_by_process,  # which process holds a file a later sample has more
        "rss_mb_by_process": rss_mb_by_process,  # which process's memory grew
        "fds_opened": fds_opened,  # per process: "fd target" opened (or reused) since last sample
        "fds_closed": fds_closed,
        "fds_closed_soon": fds_closed_soon,  # new at this sample, closed within RECHECK_S
    }


def _slope_per_100(samples: list[dict], key: str) -> float:
    xs = [s["step"] for s in samples]
    ys = [s[key] for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return 100 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0


def _plot(samples: list[dict], path: pathlib.Path, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(SERIES), 1, figsize=(8, 2.0 * len(SERIES)), sharex=True)
    steps = [s["step"] for s in samples]
    for ax, key in zip(axes, SERIES):
        ax.plot(steps, [s[key] for s in samples], marker=".", linewidth=1)
        ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step (dotted: end of warm-up)")
    fig.suptitle("bench/soak.py: the run's processes and folder over steps")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _heap_blocks(metrics: pathlib.Path, offset: int, latest: dict[int, float]) -> tuple[int, int]:
    """Read metrics.jsonl from ``offset``: the trained steps' heap figures into ``latest``;
    returns (new offset, the newest trained step or -1)."""
    newest = -1
    with metrics.open() as f:
        f.seek(offset)
        for line in f:
            if not line.endswith("\n"):
                break  # a line still being written: read it next time
            offset += len(line.encode())
            record = json.loads(line)
            if "time/step_s" in record:
                newest = max(newest, record["step"])
                latest[record["step"]] = record.get("controller/python_allocated_blocks", 0.0)
    return offset, newest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10, help="sample every N steps")
    parser.add_argument("--warmup", type=int, default=200,
                        help="steps before the growth is judged (first checkpoints, caches)")
    parser.add_argument("--output-dir", default="runs/soak")
    parser.add_argument("train_args", nargs="*", help="more train.py flags (after --)")
    args = parser.parse_args()
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "soak"
    command = [sys.executable, "-m", "torchtitan_rl.train", "--config", CONFIG, "--name", "soak",
               "--output_dir", str(out), "--loop.num_steps", str(args.steps),
               "--checkpoint.overwrite", "true", *SOAK_FLAGS, *args.train_args]
    console = (out / "soak.console.txt").open("w")
    proc = subprocess.Popen(command, cwd=REPO, stdout=console, stderr=subprocess.STDOUT,
                            start_new_session=True)
    root = psutil.Process(proc.pid)
    samples: list[dict] = []
    heap: dict[int, float] = {}
    fd_targets: dict[int, dict[str, str]] = {}
    fds_held: dict[int, dict[str, str]] = {}
    offset, next_sample = 0, 0
    started = time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(0.5)  # polling the run's metrics file: it has no event to wait on
            metrics = run_dir / "metrics.jsonl"
            if not metrics.exists():
                continue
            offset, newest = _heap_blocks(metrics, offset, heap)
            while newest >= next_sample:  # a sample per --every steps, taken as soon as seen
                samples.append(_sample(root, run_dir, next_sample, heap.get(next_sample, 0.0),
                                       fd_targets, fds_held))
                next_sample += args.every
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        console.close()
    with (out / "soak_samples.jsonl").open("w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    if proc.returncode != 0 or not samples:
        print(f"the run failed (exit {proc.returncode}): {out / 'soak.console.txt'}")
        return 1
    judged = [s for s in samples if s["step"] >= args.warmup] or samples
    _plot(samples, out / "soak.png", args.warmup)
    growth = {key: _slope_per_100(judged, key) for key in SERIES}
    first = judged[0]
    print(f"cpu: {_cpu()}; {args.steps} steps in {time.monotonic() - started:.0f} s "
          f"({_steps_trained(run_dir / 'metrics.jsonl')} of them trained anything); "
          f"samples every {args.every} steps; judged from step {first['step']}")
    print(f"{'series':<16}{'after warm-up':>15}{'end':>15}{'per 100 steps':>16}")
    for key in SERIES:
        print(f"{key:<16}{first[key]:>15.1f}{samples[-1][key]:>15.1f}{growth[key]:>+16.3f}")

    def within(key: str, fraction: float) -> bool:
        return growth[key] < fraction * max(first[key], 1e-9)

    # never above their first value after warm-up; fds: those held (a file the run has open for
    # one write when a sample comes is closed a moment later: no leak)
    steady = all(max(s[k] for s in judged) <= first[k]
                 for k in ("fds_held", "threads", "shm_segments"))
    transient = _transient_fds(judged)
    if transient:
        print(f"descriptors open at a sample and closed within {RECHECK_S:g} s (not held): "
              + "; ".join(f"{target} x{n}" for target, n in transient.most_common()))
    flat = (steady and within("rss_mb", 0.01) and within("heap_blocks", 0.01)
            and within("checkpoints_mb", 0.01))
    print(" ".join(f"{key}={growth[key]:+.3f}" for key in SERIES) + f" flat={flat}")
    return 0


def _steps_trained(metrics: pathlib.Path) -> int:
    """The run's ``run/steps_trained`` at its last step (a step whose groups all had one reward
    trains nothing: a soak of such steps exercises no training)."""
    trained = 0
    with metrics.open() as f:
        for line in f:
            trained = int(json.loads(line).get("run/steps_trained", trained))
    return trained


def _transient_fds(samples: list[dict]) -> collections.Counter:
    """How often each file was caught open for a moment (closed within RECHECK_S)."""
    counts: collections.Counter = collections.Counter()
    for sample in samples:
        for entries in sample["fds_closed_soon"].values():
            counts.update(entry.split(" ", 1)[1] for entry in entries)
    return counts


def _cpu() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
