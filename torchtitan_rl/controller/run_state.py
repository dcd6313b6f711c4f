"""The controller's part of a checkpoint: everything besides model and optimizer that a resumed run
needs to continue as if it had never stopped.

    <run_dir>/checkpoints/step-000002/
        trainer/            torch DCP: model, optimizer, lr schedule, step   (written first)
        controller.json     this file: the commit marker                    (written last, atomically)

A checkpoint directory without controller.json is incomplete (the process died while writing it)
and is ignored. Finished-but-untrained groups are stored as their training samples, so resume
trains them without regenerating; groups still in flight are restarted from their prompts (the
same group id gives the same prompt and the same request seeds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import random
import re
from typing import Any

import torch

from torchtitan_rl.types import TrainingSample

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(kw_only=True, slots=True)
class FinishedGroup:
    """A group that finished generating but was not trained yet when the checkpoint was taken."""

    group_id: int
    admit_version: int
    samples: list[TrainingSample]
    rewards: list[float]
    dropped: bool
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True, slots=True)
class ControllerState:
    step: int
    """Optimizer steps completed (= the policy version of the trainer's weights)."""
    next_group_id: int
    """The next group id to issue; every id below it was admitted."""
    in_flight: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(group_id, admit_version) of groups still generating: restarted on resume."""
    finished: list[FinishedGroup] = dataclasses.field(default_factory=list)
    trained_group_ids: list[int] = dataclasses.field(default_factory=list)
    """Every group consumed by a training step so far, in order (for the loses-nothing proof)."""
    reward_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    validation_history: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    """(step, reward mean, stderr)."""
    rng_state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str) -> "ControllerState":
        try:
            data = json.loads(text)
            data["in_flight"] = [tuple(x) for x in data["in_flight"]]
            data["finished"] = [
                FinishedGroup(**{**f, "samples": [TrainingSample(**s) for s in f["samples"]]})
                for f in data["finished"]
            ]
            data["reward_history"] = [tuple(x) for x in data["reward_history"]]
            data["validation_history"] = [tuple(x) for x in data["validation_history"]]
            return cls(**data)
        except (KeyError, TypeError, ValueError) as e:
            raise RuntimeError(f"corrupt controller checkpoint {source}: {e}") from e


def capture_rng_state() -> dict[str, Any]:
    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def restore_rng_state(state: dict[str, Any]) -> None:
    if not state:
        return
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def step_dir(checkpoint_root: pathlib.Path, step: int) -> pathlib.Path:
    return checkpoint_root / f"step-{step:06d}"


def write_controller_state(directory: pathlib.Path, state: ControllerState) -> None:
    """Write controller.json atomically: it marks the checkpoint complete."""
    tmp = directory / "controller.json.tmp"
    tmp.write_text(state.to_json())
    os.replace(tmp, directory / "controller.json")


def latest_complete_checkpoint(checkpoint_root: pathlib.Path) -> pathlib.Path | None:
    if not checkpoint_root.is_dir():
        return None
    complete = [
        (int(m.group(1)), d) for d in checkpoint_root.iterdir()
        if (m := _STEP_DIR.match(d.name)) and (d / "controller.json").is_file()
    ]
    return max(complete)[1] if complete else None


def read_controller_state(directory: pathlib.Path) -> ControllerState:
    path = directory / "controller.json"
    return ControllerState.from_json(path.read_text(), str(path))
