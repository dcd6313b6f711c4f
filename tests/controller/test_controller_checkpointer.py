"""The run folder's lifecycle without a run (pure file logic; the real resumes are in
test_controller_loop_job.py): resume modes, overwrite, fallback past a broken newest checkpoint,
step logs truncated on resume."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.checkpoint.checkpointer import (
    Checkpointer,
    ControllerState,
    latest_complete_checkpoint,
    step_dir,
    truncate_step_log,
    write_controller_state,
)


def _checkpointer(run_dir: pathlib.Path, **config) -> Checkpointer:
    return Checkpointer.Config(**config).build(run_dir=run_dir, num_steps=10, step_logs=[])


def _write_checkpoint(run_dir: pathlib.Path, step: int, *, complete: bool = True) -> pathlib.Path:
    directory = step_dir(run_dir / "checkpoints", step)
    (directory / "trainer").mkdir(parents=True)
    (directory / "trainer" / ".metadata").write_bytes(b"dcp")
    if complete:
        write_controller_state(directory, ControllerState(step=step, next_group_id=2 * step))
    return directory


def test_a_broken_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    good = _write_checkpoint(tmp_path, 2)
    corrupt = _write_checkpoint(tmp_path, 3)
    (corrupt / "controller.json").write_text("{not json")
    _write_checkpoint(tmp_path, 4, complete=False)  # died while writing
    with caplog.at_level(logging.WARNING):
        found = latest_complete_checkpoint(tmp_path / "checkpoints")
    assert found is not None and found[0] == good and found[1].step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "step-000004" in warnings[0] and "incomplete" in warnings[0]
    assert "step-000003" in warnings[1] and "corrupt controller checkpoint" in warnings[1]

    # resuming from step 2 sets the unusable newer ones aside (kept, renamed), so this run's
    # saves of steps 3 and 4 and keep_last never meet them
    found = _checkpointer(tmp_path).prepare_run_dir()
    assert found is not None and found[0] == good
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names[0] == "step-000002" and len(names) == 3
    assert all(n.startswith(("step-000003.unusable-", "step-000004.unusable-")) for n in names[1:])


def test_resume_modes(tmp_path):
    assert _checkpointer(tmp_path / "new").prepare_run_dir() is None  # auto, empty folder
    with pytest.raises(ConfigError, match="checkpoint.resume='must': no complete checkpoint"):
        _checkpointer(tmp_path / "new", resume="must").prepare_run_dir()

    run_dir = tmp_path / "run"
    _write_checkpoint(run_dir, 5)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    found = _checkpointer(run_dir).prepare_run_dir()
    assert found is not None and found[1].step == 5
    assert _checkpointer(run_dir, resume="must").prepare_run_dir() is not None
    with pytest.raises(ConfigError) as e:
        _checkpointer(run_dir, resume="never").prepare_run_dir()
    assert "holds an earlier run's outputs (checkpoints, metrics.jsonl)" in str(e.value)
    assert "--checkpoint.overwrite" in str(e.value) and "\n" not in str(e.value)
    assert (run_dir / "metrics.jsonl").exists()  # refused, nothing touched


def test_outputs_without_a_checkpoint_are_never_wiped_and_overwrite_moves_them(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="and no complete checkpoint to resume"):
        _checkpointer(run_dir).prepare_run_dir()
    assert _checkpointer(run_dir, overwrite=True).prepare_run_dir() is None
    assert not (run_dir / "metrics.jsonl").exists()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 0}\n'
    with pytest.raises(ValueError, match="overwrite=True contradicts resume='must'"):
        Checkpointer.Config(overwrite=True, resume="must")


def test_resume_drops_the_killed_runs_records_from_step_logs(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 2, 3))
                   + '{"step": 4, "x": "torn mid-wri')  # the killed run's last, half-written line
    assert truncate_step_log(log, 2) == 4
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1]
    assert truncate_step_log(tmp_path / "absent.jsonl", 2) == 0
