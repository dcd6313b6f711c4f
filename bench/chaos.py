"""A job with its processes killed at seeded random moments, next to an undisturbed run of the same
seed: does every step and every group train exactly once, is anything left running, and where
does the reward end?

    python bench/chaos.py [--config run_configs/alphabet_sort_cpu.toml] [--kills 4] [--seed 0]
                          [--kinds generator,trainer,...] [--output-dir runs/chaos]
                          [--num-steps N] [--skip-undisturbed] [-- more train.py flags]
    python bench/chaos.py --config bench/chaos_async.toml --kills 24     # the asynchronous job

Both runs are ``python -m torchtitan_rl.train`` on the same config and seed, one after the other.
The kinds of kill (``--kinds``; default: every kind the config has):

    generator        SIGKILL of a tensor-parallel-1 generator's proc (replaced on its host)
    generator_rank   SIGKILL of one rank (not 0) of a tensor-parallel generator (the generator
                     is replaced whole)
    trainer          SIGKILL of one rank of the trainer (the whole trainer mesh is respawned
                     from the newest checkpoint)
    rollout_worker   SIGKILL of a rollout worker (rollouter.num_workers > 0; replaced)
    host             SIGKILL of a simulated host's whole session (placement.kind = "process"):
                     a tensor-parallel-1 generator's worker and its procs; the run goes on with
                     the generators left until a controller kill reruns it
    controller       SIGKILL of the controller; the same command is run again and resumes
    sigterm          SIGTERM of the controller: it must stop with exit 143, then the same command
                     resumes
    trainer_host     SIGKILL of the trainer's simulated host's whole session (placement.kind =
                     "process"): the run must end with one line saying the trainer's host is
                     gone and to run the same command again (exit code not 0), which resumes

The kills go in rounds: the kinds other than host and the ones that end the run, in a seeded
order, then host, then a rollout worker again (its replacement must not wait for the lost
generator), then one that ends the run (a rerun brings a lost host back): the controller's
SIGKILL, the second round's a SIGTERM, the third's the trainer's host. Kill i comes once 1 or 2
more steps (seeded) have trained since kill i - 1, a seeded fraction of the last step's duration
into the next, so kills land in generation, training and weight pushes alike. The target is drawn (seeded) among the newest pids the run's log names
(``trainer ... started (pids ...)``, ``generator ... started (tp=..., pids ...)``, ``rollout
worker ... started (pid ...)``), leaving out a target whose recovery is under way. A kill is
recovered when the log reports it (``<generator> replaced by ...``, ``trainer restarted in ...``,
``rollout worker N replaced``, ``<generator> was lost and cannot be replaced on its host``) or,
for one that ends the run, when the rerun has trained a step. Recoveries of generators and
rollout workers may overlap later kills; a trainer kill waits for the previous trainer's restart,
and a host kill or one that ends the run for every recovery under way. The run may restart each
part as often as there are kills (``--trainer.max_restarts``, ``--generator.max_restarts`` raised
to ``--kills``).
Each part of the disturbed run carries a marker in its environment, which its processes inherit:
after a controller's end the next part starts once none is left (at most 60 s), and at the end
``leftover`` counts the marked processes still alive 60 s after the last part exited.

Printed: the kill table (kind, target, moment, recovery and its seconds), the steps and groups
trained (trained_samples.jsonl: each step's line, each group id), the final validation reward
of both runs, and the last line
``kills=<n> duplicates=<n> missing=<n> leftover=<n> reward_delta=<disturbed - undisturbed>``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parents[1]
MARKER_ENV = "TORCHTITAN_RL_CHAOS_RUN"
GENERATOR_STARTED = re.compile(r"generator (\S+) started \(tp=(\d+), pids ([\d,]+)")
TRAINER_STARTED = re.compile(r"trainer (\S+) started \(pids ([\d,]+)")
WORKER_STARTED = re.compile(r"rollout worker (\S+) started \(pid (\d+)\)")
KINDS = ("generator", "generator_rank", "trainer", "rollout_worker", "host", "controller",
         "sigterm", "trainer_host")
ENDS_THE_RUN = ("controller", "sigterm", "trainer_host")
TRAINER_HOST_GONE = re.compile(r"the trainer's host is gone: .*run the same command again")
RECOVERY_TIMEOUT_S = 900.0
GONE_WITHIN_S = 60.0
MONARCH_HOST_TIMEOUTS = {"HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "10s",
                         "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE": "10s"}
"""How long Monarch waits on a host that stopped answering (defaults 1 min and 30 s): a host
kill is noticed sooner (as tests/controller/test_controller_placement.py sets them)."""


@dataclass
class Kill:
    kind: str
    target: str = ""
    pid: int = 0
    after_steps: int = 0
    seconds_into_step: float = 0.0
    recovery: str = ""
    recovery_s: float = 0.0
    killed_at: float = 0.0
    log_mark: int = 0
    """Where in the part's log its recovery is looked for."""


@dataclass
class Disturbed:
    """The disturbed run: its parts (one per controller), its log and trained steps."""

    args: argparse.Namespace
    run_dir: pathlib.Path
    command: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    parts: int = 0
    log_offset: int = 0
    part_text: str = ""
    """The log since the current part started."""
    lost_generators: set[str] = field(default_factory=set)
    seen_trained: int = 0
    step_started: float = 0.0
    last_step_s: float = 0.0
    steps_since: int = 0

    def start_part(self) -> None:
        console = self.run_dir.parent.parent / f"disturbed.console.{self.parts}.txt"
        with console.open("w") as out:  # a file: a pipe could fill
            self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self.parts += 1
        self.lost_generators.clear()
        self.read_log()
        self.part_text = ""

    def read_log(self) -> str:
        """The log since the current part started (every part appends to one file)."""
        log = self.run_dir / "logs" / "train.log"
        if log.exists():
            with log.open(errors="replace") as f:
                f.seek(self.log_offset)
                self.part_text += f.read()
                self.log_offset = f.tell()
        return self.part_text

    def poll_steps(self) -> None:
        """Count steps trained (trained_samples.jsonl growing; a restore shortens it)."""
        path = self.run_dir / "trained_samples.jsonl"
        trained = len(path.read_text().splitlines()) if path.exists() else 0
        if trained > self.seen_trained:
            now = time.monotonic()
            self.last_step_s, self.step_started = now - self.step_started, now
            self.steps_since += trained - self.seen_trained
        self.seen_trained = trained


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARKER_ENV=marker`` (not zombies)."""
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes() and \
                    " Z " not in (entry / "stat").read_text().rsplit(")", 1)[1][:4]:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_gone(marker: str, timeout_s: float = GONE_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)  # a process's end has no event a bench can wait on
    return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _newest(pattern: re.Pattern, text: str) -> dict[str, re.Match]:
    """The newest match per name (the first group)."""
    return {m.group(1): m for m in pattern.finditer(text)}


def _target(kind: str, run: Disturbed, pick: float, pending: list[Kill]
            ) -> tuple[str, int] | None:
    """(name, pid) to kill for ``kind`` in the current part, chosen by ``pick`` in [0, 1) among
    the candidates not already killed and waiting for their recovery; None while there is
    none."""
    busy = {kill.target.split(" ")[0] for kill in pending}

    def choose(candidates: list):
        return sorted(candidates)[int(pick * len(candidates))]

    text = run.read_log()
    generators = {name: m for name, m in _newest(GENERATOR_STARTED, text).items()
                  if name not in run.lost_generators and name not in busy
                  and not _replaced(name, text)}
    if kind in ("generator", "host"):
        pids = sorted((name, int(m.group(3).split(",")[0])) for name, m in generators.items()
                      if m.group(2) == "1")
        return choose(pids) if pids else None
    if kind == "generator_rank":
        tp = [(name, m.group(3).split(",")) for name, m in generators.items() if m.group(2) != "1"]
        if not tp:
            return None
        name, pids = choose(tp)
        rank = 1 + int(pick * (len(pids) - 1))
        return f"{name} rank {rank}", int(pids[rank])
    if kind in ("trainer", "trainer_host"):
        trainers = list(_newest(TRAINER_STARTED, text).values())
        if not trainers or any(kill.kind == "trainer" for kill in pending):
            return None
        pids = trainers[-1].group(2).split(",")
        rank = int(pick * len(pids))
        if kind == "trainer_host":  # its ranks' host: one session (placement.trainer_hosts 1)
            return "trainer host", int(pids[rank])
        return f"{trainers[-1].group(1)} rank {rank}", int(pids[rank])
    if kind == "rollout_worker":
        workers = [(n, int(m.group(2))) for n, m in _newest(WORKER_STARTED, text).items()
                   if _alive(int(m.group(2))) and _worker_index(n) not in
                   {_worker_index(k.target) for k in pending if k.kind == "rollout_worker"}]
        return choose(workers) if workers else None
    assert run.proc is not None
    return "controller", run.proc.pid


def _worker_index(name: str) -> str:
    return re.sub(r"^rollout_worker_(\d+).*", r"\1", name)


def _replaced(name: str, text: str) -> bool:
    return f"{name} replaced by " in text or f"{name} was lost and cannot be replaced" in text


def _recovered(kill: Kill, run: Disturbed) -> str | None:
    """The log's word (since the kill) that ``kill`` was recovered, or None yet."""
    text = run.read_log()[kill.log_mark:]
    if kill.kind in ("generator", "generator_rank"):
        name = re.escape(kill.target.split(" ")[0])
        if m := re.search(rf"{name} replaced by (\S+) \(policy v\d+\) in ([\d.]+) s", text):
            return f"replaced by {m.group(1)} in {m.group(2)} s"
    elif kill.kind == "host":
        if f"{kill.target} was lost and cannot be replaced on its host" in text:
            return "lost for good; the run goes on with the other generator"
    elif kill.kind == "trainer":
        if m := re.search(r"trainer restarted in ([\d.]+) s; the run goes on from (.*)", text):
            return f"restarted in {m.group(1)} s from {m.group(2).strip()}"
    elif kill.kind == "rollout_worker":
        index = _worker_index(kill.target)
        if m := re.search(rf"rollout worker {index} replaced \((\S+)\)", text):
            return f"replaced by {m.group(1)}"
    return None


def _end_run(kill: Kill, run: Disturbed) -> None:
    """Signal the controller (or kill the trainer's host), wait for the controller's end and its
    processes', then run the same command again and wait for its first trained step."""
    assert run.proc is not None
    killed_at = time.monotonic()
    if kill.kind == "trainer_host":
        _kill_session(kill.pid, run)
    else:
        run.proc.send_signal(signal.SIGKILL if kill.kind == "controller" else signal.SIGTERM)
    code = run.proc.wait(timeout=RECOVERY_TIMEOUT_S)
    expected_exit = {"controller": code == -signal.SIGKILL,
                     "sigterm": code == 128 + signal.SIGTERM,
                     "trainer_host": code not in (0, -signal.SIGKILL)}[kill.kind]
    said = ""
    if kill.kind == "trainer_host":  # and its last word is the one line that says what to do
        console = run.run_dir.parent.parent / f"disturbed.console.{run.parts - 1}.txt"
        errors = [line for line in console.read_text(errors="replace").splitlines()
                  if line.startswith("error:")]
        expected_exit &= bool(errors) and TRAINER_HOST_GONE.search(errors[-1]) is not None
        said = f" ({errors[-1] if errors else 'no error: line'})"
    left = _wait_gone(run.env[MARKER_ENV])
    run.poll_steps()  # the steps the ended part wrote after the last poll are not the rerun's
    run.start_part()
    run.steps_since = 0
    while run.steps_since == 0:
        if run.proc.poll() is not None:
            sys.exit(f"the rerun after the {kill.kind} ended (exit {run.proc.returncode})")
        time.sleep(0.2)  # polling the run's files: no event to wait on
        run.poll_steps()
    resumed = re.search(r"resumed from \S+ at step (\d+)", run.read_log())
    kill.recovery = (f"exit {code}{'' if expected_exit else ' UNEXPECTED'}{said}, "
                     f"{len(left)} processes left; the rerun resumed from step "
                     f"{resumed.group(1) if resumed else 'NONE'} and trained a step")
    kill.recovery_s = time.monotonic() - killed_at


def _kill_session(pid: int, run: Disturbed) -> None:
    """SIGKILL of ``pid``'s whole session: a simulated host's worker and every proc on it."""
    assert run.proc is not None
    session = os.getsid(pid)
    assert session != os.getsid(run.proc.pid), "a host kill in the controller's session"
    os.killpg(session, signal.SIGKILL)


def _schedule(kinds: list[str], num_kills: int, rng: random.Random) -> list[str]:
    """Rounds of the kinds: the others in a seeded order, then host and a rollout worker again,
    then one that ends the run: the controller's SIGKILL, the second round's a SIGTERM, the
    third's the trainer's host (a kind not asked for: the controller's, else one asked)."""
    others = [k for k in kinds if k not in ("host", *ENDS_THE_RUN)]
    ends = [k for k in ENDS_THE_RUN if k in kinds]
    plan: list[str] = []
    round_index = 0
    while len(plan) < num_kills:
        turn = rng.sample(others, len(others))
        if "host" in kinds:
            turn += ["host"] + [k for k in ("rollout_worker",) if k in kinds]
        if ends:
            end = {1: "sigterm", 2: "trainer_host"}.get(round_index, "controller")
            if end not in ends:
                end = "controller" if "controller" in ends else ends[round_index % len(ends)]
            turn.append(end)
        plan += turn
        round_index += 1
    return plan[:num_kills]


def _settle(pending: list[Kill], run: Disturbed, *, final: bool = False) -> None:
    """Note the recoveries the log reports; ``final``: the rest were not recovered."""
    for kill in list(pending):
        recovery = _recovered(kill, run)
        if recovery is None and not final and \
                time.monotonic() - kill.killed_at < RECOVERY_TIMEOUT_S:
            continue
        kill.recovery = recovery or "NOT RECOVERED"
        kill.recovery_s = time.monotonic() - kill.killed_at
        pending.remove(kill)
        print(f"  {kill.kind} {kill.target}: {kill.recovery} ({kill.recovery_s:.1f} s after "
              f"the kill)", flush=True)


def _disturb(run: Disturbed, plan: list[str], rng: random.Random) -> list[Kill]:
    """Kill as ``plan`` says. A generator's, rollout worker's or host's recovery may overlap the
    next kills (not of the same target); a trainer kill waits for the previous trainer's
    restart, and a host or controller kill for every recovery under way."""
    kills: list[Kill] = []
    pending: list[Kill] = []
    run.start_part()
    run.step_started = time.monotonic()
    run.steps_since = 0
    for kind in plan:
        gap = rng.randint(1, 2)
        fraction, pick = rng.random(), rng.random()
        kill = Kill(kind)
        while True:  # wait for the moment and a target
            assert run.proc is not None
            _settle(pending, run)
            if run.proc.poll() is not None:
                _settle(pending, run, final=True)
                return kills  # the run ended (or failed) before this kill
            run.poll_steps()
            if run.steps_since >= gap and \
                    time.monotonic() - run.step_started >= fraction * run.last_step_s and \
                    not (pending and kind in ("host", *ENDS_THE_RUN)):
                target = _target(kind, run, pick, pending)
                if target is not None and (kind in ("controller", "sigterm") or _alive(target[1])):
                    break
            time.sleep(0.1)  # polling the run's files: no event to wait on
        kill.target, kill.pid = target
        kill.after_steps = run.seen_trained
        kill.seconds_into_step = round(time.monotonic() - run.step_started, 2)
        print(f"kill {len(kills) + 1}: {kind} {kill.target} (pid {kill.pid}) after "
              f"{kill.after_steps} steps, {kill.seconds_into_step} s into the next", flush=True)
        kill.killed_at, kill.log_mark = time.monotonic(), len(run.read_log())
        kills.append(kill)
        if kind in ENDS_THE_RUN:
            _end_run(kill, run)
            print(f"  {kill.recovery} ({kill.recovery_s:.1f} s after the kill)", flush=True)
        else:
            if kind == "host":
                _kill_session(kill.pid, run)
                run.lost_generators.add(kill.target)
            else:
                os.kill(kill.pid, signal.SIGKILL)
            pending.append(kill)
        run.steps_since = 0
    while pending and run.proc.poll() is None:
        _settle(pending, run)
        time.sleep(0.2)  # polling the run's log: no event to wait on
    _settle(pending, run, final=True)
    return kills


def _trained(run_dir: pathlib.Path) -> tuple[list[int], list[int]]:
    records = [json.loads(line) for line in
               (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [g for r in records for g in r["group_ids"]]


def _check_exit(proc: subprocess.Popen, console: pathlib.Path, name: str) -> None:
    if proc.wait() != 0:
        text = console.read_text()
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        sys.exit(f"the {name} run failed (exit {proc.returncode}): "
                 f"{errors[-1] if errors else text[-2000:]}")


def _cpu() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="run_configs/alphabet_sort_cpu.toml")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--kinds", default="",
                        help=f"comma-separated, of {', '.join(KINDS)} (default: every kind the "
                             "config has)")
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
    has = {"generator": 1 in (config.generator_tensor_parallel_degrees or
                              [config.generator.tensor_parallel_degree]),
           "generator_rank": any(tp > 1 for tp in (config.generator_tensor_parallel_degrees or
                                                   [config.generator.tensor_parallel_degree])),
           "trainer": True, "rollout_worker": config.rollouter.num_workers > 0,
           "host": config.placement.kind == "process" and config.num_generators > 1,
           "controller": True, "sigterm": True,
           "trainer_host": config.placement.kind == "process"}
    kinds = args.kinds.split(",") if args.kinds else [k for k in KINDS if has[k]]
    if unknown := [k for k in kinds if k not in KINDS or not has[k]]:
        sys.exit(f"--kinds: {unknown} not among this config's kinds "
                 f"{[k for k in KINDS if has[k]]}")
    output = pathlib.Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    name = config.name
    base = [sys.executable, "-m", "torchtitan_rl.train", "--config", args.config, "--seed",
            str(args.seed), "--loop.num_steps", str(num_steps), *args.train_args]
    env = {**os.environ, **MONARCH_HOST_TIMEOUTS}
    print(f"cpu: {_cpu()}; config {args.config}, {num_steps} steps, seed {args.seed}; kinds "
          f"{','.join(kinds)}", flush=True)

    calm_dir = output / "undisturbed" / name
    if not args.skip_undisturbed:
        shutil.rmtree(calm_dir.parent, ignore_errors=True)
        start = time.monotonic()
        console = output / "undisturbed.console.txt"
        with console.open("w") as out:
            proc = subprocess.Popen([*base, "--output_dir", str(calm_dir.parent)], cwd=REPO,
                                    stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        _check_exit(proc, console, "undisturbed")
        print(f"undisturbed run: {time.monotonic() - start:.0f} s", flush=True)

    chaos_dir = output / "disturbed" / name
    shutil.rmtree(chaos_dir.parent, ignore_errors=True)  # each part then runs the same command
    marker = uuid.uuid4().hex
    restarts = ["--trainer.max_restarts", str(args.kills),
                "--generator.max_restarts", str(args.kills)]
    run = Disturbed(args, chaos_dir, [*base, "--output_dir", str(chaos_dir.parent), *restarts],
                    {**env, MARKER_ENV: marker})
    rng = random.Random(args.seed)
    plan = _schedule(kinds, args.kills, rng)
    start = time.monotonic()
    kills = _disturb(run, plan, rng)
    assert run.proc is not None
    _check_exit(run.proc, run.run_dir.parent.parent / f"disturbed.console.{run.parts - 1}.txt",
                "disturbed")
    leftover = _wait_gone(marker)
    print(f"disturbed run: {time.monotonic() - start:.0f} s in {run.parts} parts", flush=True)

    print(f"\n{'#':>3} {'kind':<15}{'target':<28}{'after step':>11}{'s into next':>12}"
          f"{'recovered s':>12}  recovery")
    for i, kill in enumerate(kills, start=1):
        print(f"{i:>3} {kill.kind:<15}{kill.target:<28}{kill.after_steps:>11}"
              f"{kill.seconds_into_step:>12.1f}{kill.recovery_s:>12.1f}  {kill.recovery}")
    steps, groups = _trained(chaos_dir)
    calm_steps, calm_groups = _trained(calm_dir)
    duplicates = (len(steps) - len(set(steps))) + (len(groups) - len(set(groups)))
    missing = len(set(range(num_steps)) - set(steps)) + len(set(calm_groups) - set(groups))
    unrecovered = sum("NOT RECOVERED" in k.recovery or "UNEXPECTED" in k.recovery
                      for k in kills)
    print(f"steps trained once: {len(set(steps))} of {num_steps}; groups trained: {len(groups)} "
          f"(undisturbed: {len(calm_groups)}); same groups as undisturbed: "
          f"{sorted(groups) == sorted(calm_groups)}; kills not recovered: {unrecovered}; "
          f"processes left: {leftover}")
    summaries = [json.loads((d / "summary.json").read_text()) for d in (calm_dir, chaos_dir)]
    calm_reward, chaos_reward = (s["reward_after"] for s in summaries)
    print(f"reward_after: undisturbed {calm_reward:.4f}, disturbed {chaos_reward:.4f}")
    print(f"kills={len(kills)} duplicates={duplicates} missing={missing} "
          f"leftover={len(leftover)} reward_delta={chaos_reward - calm_reward:+.4f}")


if __name__ == "__main__":
    main()
