"""Checkpoints of a run: the trainer's DCP state plus the controller's state, and resume.

    <run_dir>/checkpoints/step-000002/
        trainer/            torch DCP: model, optimizer, lr schedule, step   (written first)
        job_config.json     the run's config, one dotted key a line: compared on resume
        checksums.sha256    sha256 of every other file (`sha256sum -c` reads it)
        controller.json     ControllerState: the commit marker               (written last, atomically)

    job:  checkpointer.prepare_run_dir() -> the checkpoint to resume from (or a fresh folder)
          checkpointer.forget_steps_from(k): step logs of the killed run past k are dropped
          checkpointer.restore(trainer, directory) -> state
    loop: checkpointer.due(step) -> checkpointer.save(trainer, state): trainer DCP, fsync,
          job_config.json, checksums.sha256, controller.json (fsynced, atomic: the commit
          marker), then older ones past keep_last go

A run folder is never silently wiped: ``resume = "auto"`` continues from its newest complete
checkpoint, and starting over an earlier run's outputs needs ``overwrite`` (they are moved aside,
not deleted). A resume whose config differs from the checkpoint's in a key that changes training
(any key not in `RESUME_MAY_CHANGE`, resume_config.py) is refused in one line naming the keys, old and new values,
unless ``allow_config_change``. A checkpoint without controller.json (the process died while
writing it), whose files do not match their checksums (a flipped bit, a truncated or missing
shard) or do not read back, is skipped with one logged line: the previous complete one is used.
A checkpoint that cannot be written (a full disk) stops the run with one line; the previous
checkpoints are untouched and the partial one is removed, so a rerun resumes from the newest.
Finished-but-untrained groups are stored as their training samples, so resume trains them
without regenerating; groups still in flight are restarted from their prompts (the same group id
gives the same prompt and the same request seeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import random
import re
import shutil
import time
from typing import Any, Literal, Protocol

import torch

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.checkpoint.resume_config import JOB_CONFIG_FILE, check_resume_config
from torchtitan_rl.controller.supervision import RunFailedError
from torchtitan_rl.types import TrainingSample

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
CHECKSUMS_FILE = "checksums.sha256"
_CONTROLLER_FILE = "controller.json"
_RUN_OUTPUTS = ("checkpoints", "tensorboard", "metrics.jsonl", "rollouts", "hf",
                "reward_curve.png", "step_breakdown.png", "rollout_viewer.html", "summary.json",
                "trained_samples.jsonl",
                "wandb", "mlflow.db", "tracker_runs.json")


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
    replaced_group_ids: list[int] = dataclasses.field(default_factory=list)
    """Groups dropped without a signal and replaced by new ones (``loop.replace_dropped_groups``)."""
    untrained_steps: list[int] = dataclasses.field(default_factory=list)
    """The steps that trained nothing (no training sample, or a skipped update: run_health.py)."""
    reward_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    validation_history: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    """(step, reward mean, stderr)."""
    greedy_reward: float | None = None
    """The first validation's greedy reference (`validation.greedy_reference`), if measured."""
    validation_per_turn: dict[str, float] = dataclasses.field(default_factory=dict)
    """The newest validation's per-turn rewards (`ValidationResult.per_turn`), for the summary."""
    first_validation_episode_means: list[float] = dataclasses.field(default_factory=list)
    last_validation_episode_means: list[float] = dataclasses.field(default_factory=list)
    """The first and the newest validation's episode means: the summary's rise, paired by
    episode (empty in checkpoints written before they were kept: the summary has no rise)."""
    rng_state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str) -> ControllerState:
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


def write_controller_state(directory: pathlib.Path, state: ControllerState,
                           text: str | None = None) -> None:
    """Write controller.json durably and atomically: it marks the checkpoint complete.
    ``text``: ``state.to_json()`` already made (the checksums cover exactly these bytes)."""
    _write_durably(directory / _CONTROLLER_FILE, state.to_json() if text is None else text)


def _write_durably(path: pathlib.Path, text: str) -> None:
    """``path`` holds ``text`` (fsynced) or is as it was: written aside, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checksums_text(directory: pathlib.Path, controller_text: str) -> str:
    """checksums.sha256 of a checkpoint being written: ``<sha256>  <path>`` for every file under
    ``directory`` and for controller.json as ``controller_text`` (written after it)."""
    lines = [f"{_sha256(path)}  {path.relative_to(directory).as_posix()}"
             for path in sorted(directory.rglob("*")) if path.is_file()
             and path.name != CHECKSUMS_FILE]
    controller = hashlib.sha256(controller_text.encode()).hexdigest()
    return "\n".join(sorted([*lines, f"{controller}  {_CONTROLLER_FILE}"],
                            key=lambda line: line.split("  ", 1)[1])) + "\n"


def verify_checksums(directory: pathlib.Path) -> None:
    """RuntimeError naming the first file of ``directory`` that is missing or whose sha256 is
    not the one checksums.sha256 lists; nothing to check in a checkpoint without the file."""
    path = directory / CHECKSUMS_FILE
    if not path.is_file():
        return
    for number, line in enumerate(path.read_text().splitlines(), 1):
        expected, _, name = line.partition("  ")
        if not name or len(expected) != 64:
            raise RuntimeError(f"{path}:{number} is not a '<sha256>  <file>' line")
        file = directory / name
        if not file.is_file():
            raise RuntimeError(f"{name} is missing (listed in {CHECKSUMS_FILE})")
        if _sha256(file) != expected:
            raise RuntimeError(f"{name} does not match its sha256 in {CHECKSUMS_FILE} "
                               f"({file.stat().st_size} bytes): the file is corrupt")


def read_controller_state(directory: pathlib.Path) -> ControllerState:
    path = directory / "controller.json"
    return ControllerState.from_json(path.read_text(), str(path))


def complete_checkpoints(checkpoint_root: pathlib.Path) -> list[pathlib.Path]:
    """Checkpoint directories with a commit marker, oldest first."""
    if not checkpoint_root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in checkpoint_root.iterdir()
             if (m := _STEP_DIR.match(d.name)) and (d / "controller.json").is_file()]
    return [d for _, d in sorted(found)]


def latest_complete_checkpoint(
        checkpoint_root: pathlib.Path) -> tuple[pathlib.Path, ControllerState] | None:
    """The newest checkpoint that reads back whole and matches its checksums, with its controller
    state; a newer one that does not (a partial write, a corrupt or truncated file) is skipped
    with one logged line."""
    if checkpoint_root.is_dir():
        for d in sorted((d for d in checkpoint_root.iterdir() if _STEP_DIR.match(d.name)),
                        reverse=True):
            problem = "no controller.json (incomplete)"
            if (d / "controller.json").is_file():
                try:
                    verify_checksums(d)
                    state = read_controller_state(d)
                    if not (d / "trainer" / ".metadata").is_file():
                        raise RuntimeError("trainer/.metadata is missing")
                    return d, state
                except (OSError, RuntimeError) as e:
                    problem = str(e)
            logger.warning("checkpoint %s is unusable (%s): falling back to an older one", d,
                           problem)
    return None


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: pathlib.Path) -> None:
    for path in sorted(directory.rglob("*"), reverse=True):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(directory)


def truncate_step_log(path: pathlib.Path, step: int) -> int:
    """Drop the JSONL records of ``path`` whose "step" is >= ``step``; returns how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (record := _record(line)) is not None
            and record["step"] < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _record(line: str) -> dict[str, Any] | None:
    """A JSONL record, or None for a line the killed run tore mid-write (or a blank one)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


class CheckpointableTrainer(Protocol):
    async def save_checkpoint(self, directory: pathlib.Path) -> None: ...
    async def load_checkpoint(self, directory: pathlib.Path) -> None: ...


class Checkpointer(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every_steps: int = 0
        """Write a checkpoint every this many steps (and at the last); 0 disables."""
        resume: Literal["auto", "never", "must"] = "auto"
        """auto: continue from the run folder's newest complete checkpoint when there is one.
        never: always start fresh. must: fail when there is nothing to resume. Starting fresh
        over an earlier run's outputs needs ``overwrite``."""
        overwrite: bool = False
        """Start fresh even over an earlier run's outputs: they are moved to
        `<run_dir>.replaced-<time>` (one logged line), never deleted."""
        keep_last: int = 3
        """Complete checkpoints kept (older ones are deleted after each save); 0 keeps all."""
        checksums: bool = True
        """Write the sha256 of every file with each checkpoint (`checksums.sha256`); a checkpoint
        whose files no longer match is skipped on resume, for the previous one. Hashing reads
        each checkpoint once when it is written (in a thread, beside the rollouts) and once on
        resume (~0.9 GB/s on a 2-core AMD EPYC); false writes none (nothing to verify)."""
        export_hf: bool = True
        """Export the final weights as an HF model directory `<run_dir>/hf`."""
        allow_config_change: bool = False
        """Resume even when the config differs from the checkpoint's in keys that change
        training (each is logged as a warning). Without it such a resume is one error line naming
        the keys, old and new values. Always allowed: where the run writes (name, output_dir),
        loop.num_steps (extend a run), loop.max_skipped_steps_in_row, validation.every_steps,
        checkpoint.*, metrics.*, recorder.*, trainer.debug_batch_log, placement.*,
        generator.max_restarts, verify_weight_push and the cache folders (model.assets_dir,
        warm_start.cache_dir); every other key, resources such as num_generators included
        (they change the numerics), needs this."""

        def __post_init__(self) -> None:
            for name in ("every_steps", "keep_last"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
            if self.overwrite and self.resume == "must":
                raise ValueError("overwrite=True contradicts resume='must'")

    def __init__(self, config: Config, *, run_dir: pathlib.Path, num_steps: int,
                 step_logs: list[pathlib.Path], job_config: dict[str, Any] | None = None) -> None:
        """``job_config``: the run's `flat_config`, saved with each checkpoint and compared with
        the checkpoint's on resume (None: neither)."""
        self.config = config
        self.job_config = job_config
        self.run_dir = pathlib.Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.trained_log_path = self.run_dir / "trained_samples.jsonl"
        """One line per trained step: its group ids and sample ids (written by the loop)."""
        self.step_logs = [self.trained_log_path, *step_logs]
        """JSONL files of per-step records (a "step" key), truncated on resume."""
        self.num_steps = num_steps

    def prepare_run_dir(self) -> tuple[pathlib.Path, ControllerState] | None:
        """The checkpoint to resume from (and its controller state), or None for a fresh run in
        a folder that holds no earlier run's outputs."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mode = self.config.resume
        found = None if self.config.overwrite else latest_complete_checkpoint(self.root)
        if mode == "must" and found is None:
            raise ConfigError(f"checkpoint.resume='must': no complete checkpoint in {self.root}")
        if mode != "never" and found is not None:
            self._check_config(found[0])
            self._set_aside_newer_than(found[1].step)
            return found
        outputs = [name for name in _RUN_OUTPUTS if (self.run_dir / name).exists()] + sorted(
            path.name for path in self.run_dir.glob("trace*.json"))  # metrics/trace.py's
        if outputs and not self.config.overwrite:
            why = "and no complete checkpoint to resume" if mode == "auto" else \
                "and checkpoint.resume='never'"
            raise ConfigError(
                f"run folder {self.run_dir} holds an earlier run's outputs ({', '.join(outputs)}) "
                f"{why}: pass --checkpoint.overwrite true to move them aside, or choose another "
                f"--name"
            )
        if outputs:
            aside = self.run_dir.with_name(
                f"{self.run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            aside.mkdir(parents=True)
            for name in outputs:
                shutil.move(str(self.run_dir / name), str(aside / name))
            logger.warning("checkpoint.overwrite: moved the earlier run's outputs to %s", aside)
        return None

    def _check_config(self, directory: pathlib.Path) -> None:
        if self.job_config is not None:
            check_resume_config(directory, self.job_config,
                                allow_change=self.config.allow_config_change)

    def _set_aside_newer_than(self, step: int) -> None:
        """Checkpoints newer than the one resumed from could not be used (see
        latest_complete_checkpoint): renamed ``<dir>.unusable`` (kept, one logged line each), so
        this run's own saves and keep_last never meet them."""
        for directory in sorted(self.root.iterdir()):
            if (m := _STEP_DIR.match(directory.name)) and int(m.group(1)) > step:
                aside = directory.with_name(f"{directory.name}.unusable-{time.strftime('%H%M%S')}")
                directory.rename(aside)
                logger.warning("checkpoint %s could not be used: renamed %s", directory, aside.name)

    def forget_steps_from(self, step: int) -> None:
        """Resuming at ``step``: drop every step log's records of steps >= ``step`` (the killed
        run's; they are trained and logged again), so each step appears once."""
        for path in self.step_logs:
            dropped = truncate_step_log(path, step)
            if dropped:
                logger.info("resume: dropped %d records of steps >= %d from %s", dropped, step,
                            path)

    def due(self, step: int) -> bool:
        every = self.config.every_steps
        return bool(every) and (step % every == 0 or step == self.num_steps)

    async def save(self, trainer: CheckpointableTrainer, state: ControllerState) -> pathlib.Path:
        """Write the checkpoint of ``state.step``; RunFailedError (one line) when it cannot be
        written: the partial directory is removed, the previous checkpoints are untouched."""
        directory = step_dir(self.root, state.step)
        if directory.exists():  # a stale one (a step trained again after a resume): never mix
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        try:
            await self._write(trainer, state, directory)
        except Exception as e:
            shutil.rmtree(directory, ignore_errors=True)
            from torchtitan_rl.monarch_failures import is_supervision_error  # imports Monarch

            if is_supervision_error(e):  # the trainer died: the job restarts it
                raise
            previous = complete_checkpoints(self.root)
            kept = (f"the previous checkpoint {previous[-1]} is intact" if previous
                    else "there is no earlier checkpoint")
            raise RunFailedError(
                f"checkpoint step {state.step} could not be written to {directory}: "
                f"{' '.join(str(e).split()) or type(e).__name__}; {kept}; the run stops (a "
                f"full disk: free space, then run the same command to resume)") from e
        logger.info("checkpoint: %s", directory)
        keep = self.config.keep_last
        if keep:  # the newest `keep` up to this one, by step; nothing newer is touched
            older = [d for d in complete_checkpoints(self.root) if d.name < directory.name]
            for old in older[:max(0, len(older) - (keep - 1))]:
                shutil.rmtree(old)
        return directory

    async def _write(self, trainer: CheckpointableTrainer, state: ControllerState,
                     directory: pathlib.Path) -> None:
        await trainer.save_checkpoint(directory / "trainer")
        _fsync_tree(directory / "trainer")
        if self.job_config is not None:  # before controller.json: the commit marker covers it
            with (directory / JOB_CONFIG_FILE).open("w") as f:
                f.write(json.dumps(self.job_config, indent=0) + "\n")
                f.flush()
                os.fsync(f.fileno())
        state.rng_state = capture_rng_state()
        controller_text = state.to_json()
        if self.config.checksums:  # hashing reads every byte: off the event loop
            text = await asyncio.to_thread(checksums_text, directory, controller_text)
            _write_durably(directory / CHECKSUMS_FILE, text)
        write_controller_state(directory, state, controller_text)

    async def restore(self, trainer: CheckpointableTrainer, directory: pathlib.Path,
                      state: ControllerState) -> ControllerState:
        """Load the trainer's state and the RNGs of the checkpoint ``prepare_run_dir`` found."""
        await trainer.load_checkpoint(directory / "trainer")
        restore_rng_state(state.rng_state)
        logger.info("resumed from %s at step %d", directory, state.step)
        return state
