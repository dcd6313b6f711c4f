"""The main job beside another job of its size: how much slower than alone, per OpenMP spin policy?

    python bench/shared_box.py [--warm-start-steps 150] [--steps 3] [--policies spin,short,passive]

A job here is the main job (run_configs/alphabet_sort_cpu.toml) shortened so that one run takes a
few minutes and still runs every process the main job runs: a warm start of ``--warm-start-steps``
steps (in the controller, into a cache of its own, so it trains every time), ``--steps`` GRPO
steps (trainer and vLLM generator procs), a small validation, no checkpoints. For each policy
it times one job alone, then two started together; the ratio is the slower of the two over the
job alone (2.0: the two share the cores with nothing lost to their threads spinning).

The policies, as the job's processes get them in their environment:

- ``spin``: libgomp's default where nothing is set: an idle OpenMP thread spins about 300,000
  turns before it sleeps (given here as ``OMP_WAIT_POLICY=ACTIVE``, ``GOMP_SPINCOUNT=300000``: an
  explicit spin count wins over the policy's);
- ``short``: ``GOMP_SPINCOUNT=--short-spin-count``; its default is what the job sets when the user
  set neither (torchtitan_rl/threads.py);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``: an idle thread sleeps at once.

Last line::

    alone_<policy>_s=.. beside_<policy>_ratio=.. (for each policy run)
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from torchtitan_rl.threads import SPIN_COUNT  # noqa: E402 (stdlib only)

WARM_START_LINE = re.compile(r"warm start: wrote .* in (\d+) s")

POLICIES: dict[str, dict[str, str]] = {
    "spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"},
    "short": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": SPIN_COUNT},  # --short-spin-count
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": ""},
}


def start_job(name: str, out: pathlib.Path, policy: str, *, warm_start_steps: int,
              steps: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in POLICIES[policy]}
    env.update({k: v for k, v in POLICIES[policy].items() if v})
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    command = [
        sys.executable, "-m", "torchtitan_rl.train",
        "--config", "run_configs/alphabet_sort_cpu.toml",
        "--output_dir", str(out), "--name", name,
        "--warm_start.num_steps", str(warm_start_steps),
        "--warm_start.cache_dir", str(out / f"{name}-warmstart"),
        "--loop.num_steps", str(steps),
        "--validation.num_prompts", "16", "--validation.samples_per_prompt", "2",
        "--validation.every_steps", "0",
        "--checkpoint.every_steps", "0", "--checkpoint.export_hf", "false",
    ]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait(proc: subprocess.Popen, name: str) -> None:
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): "
                         f"{(stderr.strip().splitlines() or ['?'])[-1]}")


def warm_start_s(run_dir: pathlib.Path) -> float:
    """The warm start's seconds, from the run's log."""
    found = WARM_START_LINE.search((run_dir / "logs" / "train.log").read_text())
    return float(found.group(1)) if found else math.nan


def time_jobs(count: int, policy: str, out: pathlib.Path, tag: str,
              **sizes: int) -> list[tuple[float, float]]:
    """Start ``count`` jobs together; the wall time and warm-start time of each."""
    start = time.perf_counter()
    procs = [(f"{tag}-{i}", start_job(f"{tag}-{i}", out, policy, **sizes)) for i in range(count)]
    times = []
    for name, proc in procs:
        wait(proc, name)
        times.append((time.perf_counter() - start, warm_start_s(out / name)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--short-spin-count", type=int, default=int(SPIN_COUNT),
                        help="GOMP_SPINCOUNT of the short policy")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of: {', '.join(POLICIES)}")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    POLICIES["short"]["GOMP_SPINCOUNT"] = str(args.short_spin_count)
    sizes = {"warm_start_steps": args.warm_start_steps, "steps": args.steps}
    print(f"{'policy':<8} {'alone_s':>8} {'beside_s':>17} {'ratio':>6} {'warm_start_alone_s':>19} "
          f"{'warm_start_beside_s':>19}", flush=True)
    last = []
    with tempfile.TemporaryDirectory(prefix="shared_box-") as tmp:
        out = pathlib.Path(tmp)
        for policy in policies:
            ((alone, warm_alone),) = time_jobs(1, policy, out, f"{policy}-alone", **sizes)
            beside = time_jobs(2, policy, out, f"{policy}-beside", **sizes)
            ratio = max(wall for wall, _ in beside) / alone
            print(f"{policy:<8} {alone:8.0f} {beside[0][0]:8.0f} {beside[1][0]:8.0f} {ratio:6.2f} "
                  f"{warm_alone:19.0f} {beside[0][1]:9.0f} {beside[1][1]:9.0f}", flush=True)
            last.append(f"alone_{policy}_s={alone:.0f} beside_{policy}_ratio={ratio:.2f}")
    print(" ".join(last))


if __name__ == "__main__":
    main()
