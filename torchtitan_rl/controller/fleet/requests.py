"""Changing a running job's generators: requests dropped in its run folder, answered there.

    python -m torchtitan_rl.controller.fleet.requests RUN_DIR add             # one more generator
    python -m torchtitan_rl.controller.fleet.requests RUN_DIR remove generator_0   # drain one
        -> RUN_DIR/fleet/requests/<n>-<action>.json (written whole, then renamed into place)
    GeneratorPool (a task, every health poll) -> pending(RUN_DIR) -> add_generator() /
        remove_generator(name) -> answer(request, outcome) -> RUN_DIR/fleet/done/<same>.json
    the command waits for the answer (--timeout-s) and prints it; exit 0 when it was done

A file is the channel because the run folder is the one thing a user, a script and the
controller all reach (on a cluster: the shared file system), whatever the placement, and a
request outlives a controller that is restarting: a resumed run answers it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Literal

Action = Literal["add", "remove"]


@dataclasses.dataclass(frozen=True)
class FleetRequest:
    path: pathlib.Path
    action: Action
    generator: str | None = None
    """remove: the generator's name (generator_<i>, as the log and the metrics name it)."""


def requests_dir(run_dir: pathlib.Path) -> pathlib.Path:
    return run_dir / "fleet" / "requests"


def done_dir(run_dir: pathlib.Path) -> pathlib.Path:
    return run_dir / "fleet" / "done"


def submit(run_dir: pathlib.Path, action: Action, generator: str | None = None) -> pathlib.Path:
    """Write a request for the run in ``run_dir``; returns the path its answer will have."""
    if action == "remove" and not generator:
        raise ValueError("remove needs the generator's name, e.g. generator_0")
    folder = requests_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{action}.json"
    temporary = folder / f".{name}.tmp"  # pending() never reads a half-written request
    temporary.write_text(json.dumps({"action": action, "generator": generator}))
    os.replace(temporary, folder / name)
    return done_dir(run_dir) / name


def pending(run_dir: pathlib.Path) -> list[FleetRequest | tuple[pathlib.Path, str]]:
    """The requests not answered yet, oldest first; an unreadable one is (its path, why)."""
    folder = requests_dir(run_dir)
    if not folder.is_dir():
        return []
    found: list[FleetRequest | tuple[pathlib.Path, str]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            body = json.loads(path.read_text())
            action = body["action"]
            if action not in ("add", "remove"):
                raise ValueError(f"action {action!r} is neither 'add' nor 'remove'")
            found.append(FleetRequest(path, action, body.get("generator")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            found.append((path, f"unreadable request: {e!r}"))
    return found


def answer(path: pathlib.Path, outcome: str, *, done: bool) -> None:
    """Move the request to the done folder with its outcome (``done``: it was carried out)."""
    run_dir = path.parent.parent.parent
    done_dir(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        body = {}
    body.update(outcome=outcome, done=done)
    (done_dir(run_dir) / path.name).write_text(json.dumps(body))
    path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.controller.fleet.requests",
        description="Add a generator to a running job, or drain and remove one.")
    parser.add_argument("run_dir", type=pathlib.Path, help="the run folder (runs/<name>)")
    parser.add_argument("action", choices=("add", "remove"))
    parser.add_argument("generator", nargs="?", help="remove: its name, e.g. generator_0")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="how long to wait for the run's answer (0: do not wait)")
    a = parser.parse_args(argv)
    if not (a.run_dir / "metrics.jsonl").exists() and not (a.run_dir / "logs").is_dir():
        parser.error(f"{a.run_dir} is not a run folder (no logs/ or metrics.jsonl)")
    try:
        done = submit(a.run_dir, a.action, a.generator)
    except ValueError as e:
        parser.error(str(e))
    if a.timeout_s <= 0:
        print(f"requested: {a.action} (answer: {done})")
        return 0
    deadline = time.monotonic() + a.timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            print(f"no answer after {a.timeout_s:g} s: is the run up? (the request stays in "
                  f"{requests_dir(a.run_dir)})", file=sys.stderr)
            return 1
        time.sleep(0.5)  # the run answers at its next health poll
    body = json.loads(done.read_text())
    print(body["outcome"])
    return 0 if body["done"] else 1


if __name__ == "__main__":
    sys.exit(main())
