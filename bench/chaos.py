"""The main job with its trainer and generator procs killed (SIGKILL) at random moments, next to an
undisturbed run of the same seed: does every step train exactly once, and where does the reward
end?

    python bench/chaos.py [--config run_configs/alphabet_sort_cpu.toml] [--kills 4] [--seed 0]
                          [--output-dir runs/chaos] [-- more train.py flags]

Both runs are ``python -m torchtitan_rl.train`` on the same config and seed, one after the other.
In the disturbed one, kill i waits until the run has trained a step drawn at random (distinct,
sorted, seeded), then a random fraction of the previous step's duration, so kills land in
generation, training and weight pushes alike; its target alternates trainer, generator, ...
(a proc whose pid the run's log names as started: ``trainer ... started (pids ...)``,
``generator ... started (... pids ...)``, the newest of each). The run may restart each as often
as there are kills (``--trainer.max_restarts`` and ``--generator.max_restarts`` are raised to
``--kills``).

Printed: each kill (target, step, moment), the recoveries the log reports (trainer restarts
from a checkpoint, generator replacements, seconds each), the steps trained once, duplicates and
missing (trained_samples.jsonl: each step's line, each group id), the final validation reward of
both runs, and the last line
``kills=<n> duplicates=<n> missing=<n> reward_delta=<disturbed - undisturbed>``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
STARTED = re.compile(r"(trainer|generator) (\S+) started \(.*?pids ([\d,]+)")
TRAINER_RESTARTED = re.compile(r"trainer restarted in ([\d.]+) s; the run goes on from (.*)")
GENERATOR_REPLACED = re.compile(r"(\S+) replaced by (\S+) \(policy v\d+\) in ([\d.]+) s")


def _train(args: argparse.Namespace, name: str, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torchtitan_rl.train", "--config", args.config,
               "--name", name, "--output_dir", args.output_dir, "--seed", str(args.seed),
               "--checkpoint.overwrite", "true", *extra, *args.train_args]
    console = pathlib.Path(args.output_dir) / f"{name}.console.txt"  # a file: a pipe could fill
    console.parent.mkdir(parents=True, exist_ok=True)
    with console.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _num_trained(run_dir: pathlib.Path) -> int:
    path = run_dir / "trained_samples.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _newest_pids(log: pathlib.Path) -> dict[str, int]:
    """The newest started trainer's and generator's rank-0 pids the run's log names."""
    pids: dict[str, int] = {}
    if log.exists():
        for match in STARTED.finditer(log.read_text()):
            pids[match.group(1)] = int(match.group(3).split(",")[0])
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _disturb(args: argparse.Namespace, proc: subprocess.Popen, run_dir: pathlib.Path,
             num_steps: int) -> list[dict]:
    """Kill trainer and generator procs at seeded random moments while ``proc`` trains."""
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(1, num_steps), min(args.kills, num_steps - 1)))
    log = run_dir / "logs" / "train.log"
    kills: list[dict] = []
    killed_pids: set[int] = set()
    step_started = time.monotonic()
    seen = 0
    for i, step in enumerate(steps):
        target = ("trainer", "generator")[i % 2]
        delay = None
        while proc.poll() is None:
            trained = _num_trained(run_dir)
            if trained != seen:  # a step ended: the next one starts now
                seen, step_started, step_s = trained, time.monotonic(), time.monotonic() - step_started
                if trained >= step and delay is None:
                    delay = rng.random() * step_s
            pid = _newest_pids(log).get(target)
            if delay is not None and time.monotonic() - step_started >= delay and pid \
                    and pid not in killed_pids and _alive(pid):
                os.kill(pid, signal.SIGKILL)
                killed_pids.add(pid)
                kills.append({"target": target, "pid": pid, "after_step": trained,
                              "seconds_into_step": round(time.monotonic() - step_started, 2)})
                print(f"kill {len(kills)}: {target} pid {pid} after {trained} steps, "
                      f"{kills[-1]['seconds_into_step']} s into the next", flush=True)
                break
            time.sleep(0.1)  # a bench polling files, not a test: no event to wait on
    return kills


def _trained_steps(run_dir: pathlib.Path) -> tuple[list[int], list[int]]:
    records = [json.loads(line) for line in
               (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [g for r in records for g in r["group_ids"]]


def _finish(proc: subprocess.Popen, args: argparse.Namespace, name: str) -> None:
    if proc.wait() != 0:
        console = (pathlib.Path(args.output_dir) / f"{name}.console.txt").read_text()
        errors = [line for line in console.splitlines() if line.startswith("error:")]
        sys.exit(f"the {name} run failed (exit {proc.returncode}): "
                 f"{errors[-1] if errors else console[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="run_configs/alphabet_sort_cpu.toml")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/chaos")
    parser.add_argument("--num-steps", type=int, default=0,
                        help="loop.num_steps for both runs (0: the config's)")
    parser.add_argument("--skip-undisturbed", action="store_true",
                        help="reuse the undisturbed run already in --output-dir")
    parser.add_argument("train_args", nargs="*", help="more train.py flags (after --)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob

    config = parse_args(RLJob.Config, ["--config", args.config, *args.train_args]).config
    num_steps = args.num_steps or config.loop.num_steps
    steps_flag = ["--loop.num_steps", str(num_steps)]
    output = pathlib.Path(args.output_dir)
    calm_dir, chaos_dir = output / "undisturbed", output / "disturbed"

    if not args.skip_undisturbed:
        start = time.monotonic()
        _finish(_train(args, "undisturbed", steps_flag), args, "undisturbed")
        print(f"undisturbed run: {time.monotonic() - start:.0f} s", flush=True)
    restarts = ["--trainer.max_restarts", str(args.kills),
                "--generator.max_restarts", str(args.kills)]
    start = time.monotonic()
    proc = _train(args, "disturbed", steps_flag + restarts)
    kills = _disturb(args, proc, chaos_dir, num_steps)
    _finish(proc, args, "disturbed")
    print(f"disturbed run: {time.monotonic() - start:.0f} s", flush=True)

    log = (chaos_dir / "logs" / "train.log").read_text()
    for match in TRAINER_RESTARTED.finditer(log):
        print(f"recovery: trainer restarted in {match.group(1)} s, from {match.group(2)}")
    for match in GENERATOR_REPLACED.finditer(log):
        print(f"recovery: {match.group(1)} replaced by {match.group(2)} in {match.group(3)} s")
    steps, groups = _trained_steps(chaos_dir)
    duplicates = (len(steps) - len(set(steps))) + (len(groups) - len(set(groups)))
    missing = len(set(range(num_steps)) - set(steps))
    calm_steps, calm_groups = _trained_steps(calm_dir)
    print(f"steps trained once: {len(set(steps))} of {num_steps}; groups trained: {len(groups)} "
          f"(undisturbed: {len(calm_groups)}); same groups as undisturbed: "
          f"{sorted(groups) == sorted(calm_groups)}")
    summaries = [json.loads((d / "summary.json").read_text()) for d in (calm_dir, chaos_dir)]
    calm_reward, chaos_reward = (s["reward_after"] for s in summaries)
    print(f"reward_after: undisturbed {calm_reward:.4f}, disturbed {chaos_reward:.4f} "
          f"(trainer restarts {summaries[1]['trainer_restarts']}, from steps "
          f"{summaries[1]['trainer_restored_from_steps']})")
    print(f"kills={len(kills)} duplicates={duplicates} missing={missing} "
          f"reward_delta={chaos_reward - calm_reward:+.4f}")


if __name__ == "__main__":
    main()
