"""A resumed run's config is compared with its checkpoint's: a key that changes training is one
error line naming it (old and new values) unless checkpoint.allow_config_change; the keys of
RESUME_MAY_CHANGE (num_steps, logging, checkpointing, placement...) pass. Pure file logic with a
fake trainer; the command-line test runs the real CLI up to the refusal (nothing is spawned)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from tests.controller.letter_task import LetterTask
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.checkpoint.checkpointer import (
    CHECKSUMS_FILE,
    Checkpointer,
    ControllerState,
    step_dir,
)
from torchtitan_rl.controller.checkpoint.resume_config import (
    JOB_CONFIG_FILE,
    RESUME_MAY_CHANGE,
    config_changes,
    flat_config,
    may_change_on_resume,
)
from torchtitan_rl.controller.job import RLJob

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class FakeTrainer:
    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        directory.mkdir(parents=True)
        (directory / ".metadata").write_bytes(b"dcp")

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        pass


def _checkpointer(run_dir: pathlib.Path, config: RLJob.Config) -> Checkpointer:
    return config.checkpoint.build(run_dir=run_dir, num_steps=config.loop.num_steps,
                                   step_logs=[], job_config=flat_config(config))


def _with_lr(config: RLJob.Config, lr: float) -> RLJob.Config:
    trainer = config.trainer
    return dataclasses.replace(config, trainer=dataclasses.replace(
        trainer, optimizer=dataclasses.replace(trainer.optimizer, lr=lr)))


@pytest.fixture
def saved(tmp_path) -> tuple[pathlib.Path, RLJob.Config]:
    """A run folder with one complete checkpoint (step 2) of the default config at lr 1e-5."""
    config = _with_lr(RLJob.Config(), 1e-5)
    asyncio.run(_checkpointer(tmp_path, config).save(
        FakeTrainer(), ControllerState(step=2, next_group_id=4)))
    return tmp_path, config


def test_each_checkpoint_saves_the_config_before_its_commit_marker(saved):
    run_dir, config = saved
    directory = step_dir(run_dir / "checkpoints", 2)
    stored = json.loads((directory / JOB_CONFIG_FILE).read_text())
    assert stored == flat_config(config)
    assert stored["trainer.optimizer.lr"] == 1e-5 and stored["loop.num_steps"] == 10
    assert stored["rollouter.error_reward"] is None  # None kept: a later value is a change


def test_a_changed_lr_is_refused_naming_the_key_and_passes_with_the_flag(saved):
    run_dir, config = saved
    changed = _with_lr(config, 1e-3)
    with pytest.raises(ConfigError) as e:
        _checkpointer(run_dir, changed).prepare_run_dir()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("checkpoint.resume: the config differs from the checkpoint's")
    assert "trainer.optimizer.lr (1e-05 -> 0.001)" in message
    assert "--checkpoint.allow_config_change true" in message

    allowed = dataclasses.replace(changed, checkpoint=dataclasses.replace(
        changed.checkpoint, allow_config_change=True))
    found = _checkpointer(run_dir, allowed).prepare_run_dir()
    assert found is not None and found[1].step == 2


def test_every_refused_key_is_named(saved):
    run_dir, config = saved
    changed = dataclasses.replace(_with_lr(config, 1e-3), seed=3)
    with pytest.raises(ConfigError, match=r"in seed \(0 -> 3\), trainer.optimizer.lr "):
        _checkpointer(run_dir, changed).prepare_run_dir()


def test_extending_a_run_and_changing_logging_and_checkpointing_resumes(saved, caplog):
    run_dir, config = saved
    changed = dataclasses.replace(
        config,
        loop=dataclasses.replace(config.loop, num_steps=20),
        validation=dataclasses.replace(config.validation, every_steps=5),
        checkpoint=dataclasses.replace(config.checkpoint, every_steps=5, keep_last=1,
                                       resume="must"),
        metrics=dataclasses.replace(config.metrics, backends=[]),
        placement=dataclasses.replace(config.placement, host_timeout_s=30.0),
    )
    with caplog.at_level(logging.INFO):
        found = _checkpointer(run_dir, changed).prepare_run_dir()
    assert found is not None and found[1].step == 2
    assert "resume: loop.num_steps changed 10 -> 20" in caplog.text


def test_a_checkpoint_saved_without_a_config_resumes_with_a_warning(saved, caplog):
    run_dir, config = saved
    # as a checkpoint of an older version wrote it: no config and no checksums
    for name in (JOB_CONFIG_FILE, CHECKSUMS_FILE):
        (step_dir(run_dir / "checkpoints", 2) / name).unlink()
    with caplog.at_level(logging.WARNING):
        found = _checkpointer(run_dir, _with_lr(config, 1e-3)).prepare_run_dir()
    assert found is not None
    assert f"has no {JOB_CONFIG_FILE}" in caplog.text


def test_a_key_only_one_side_has_is_no_change():
    # a field added (or removed) since the checkpoint was written: its default is what ran
    assert config_changes({"a": 1, "gone": 2}, {"a": 1, "new": 3}) == []
    assert config_changes({"a": 1, "b": None}, {"a": 2, "b": 0.5}) == [("a", 1, 2),
                                                                      ("b", None, 0.5)]


def test_the_allow_list_names_real_keys_and_not_what_trains():
    keys = flat_config(RLJob.Config(task=LetterTask.Config()))
    for allowed in RESUME_MAY_CHANGE:  # no typo: each entry names a key or a section
        assert any(k == allowed or (allowed.endswith(".") and k.startswith(allowed))
                   for k in keys), allowed
    for trains in ("seed", "trainer.optimizer.lr", "loop.groups_per_step", "rollouter.group_size",
                   "sampling.temperature", "task.type", "model.size", "validation.num_prompts",
                   "generator.weight_sync.mode", "num_generators"):
        assert trains in keys and not may_change_on_resume(trains), trains
    for operational in ("loop.num_steps", "checkpoint.every_steps", "metrics.jsonl",
                        "placement.kind", "name", "checkpoint.allow_config_change"):
        assert may_change_on_resume(operational), operational


@pytest.mark.slow
def test_the_command_line_refuses_in_one_line_before_spawning(tmp_path):
    """A run folder holding a step-1 checkpoint of the tiny job; the same job at another lr."""
    job = "tests/controller/tiny_letter_job.toml"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TORCHTITAN_RL_LOG_LEVEL", None)
    from torchtitan_rl.config.manager import parse_args

    config = parse_args(RLJob.Config, ["--config", str(REPO_ROOT / job),
                                       "--output_dir", str(tmp_path)]).config
    asyncio.run(_checkpointer(config.run_dir, config).save(
        FakeTrainer(), ControllerState(step=1, next_group_id=2)))
    lr = config.trainer.optimizer.lr
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", "--config", job, "--output_dir",
         str(tmp_path), "--trainer.optimizer.lr", str(lr * 10)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: checkpoint.resume: the config differs from the checkpoint's")
    assert f"trainer.optimizer.lr ({lr!r} -> {lr * 10!r})" in last
