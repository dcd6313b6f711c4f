"""The run folder's lifecycle without a run (pure file logic; the real resumes are in
test_controller_loop_job.py, and a resume past a corrupted shard in test_controller_sync_job.py):
resume modes, overwrite, fallback past a broken newest checkpoint (incomplete, corrupt, not
matching its checksums), a full disk while saving, step logs truncated on resume."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import pathlib
import subprocess

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.checkpoint import checkpointer as checkpointer_module
from torchtitan_rl.controller.checkpoint.checkpointer import (
    CHECKSUMS_FILE,
    Checkpointer,
    ControllerState,
    complete_checkpoints,
    latest_complete_checkpoint,
    step_dir,
    truncate_step_log,
    write_controller_state,
)
from torchtitan_rl.controller.supervision import RunFailedError


def _checkpointer(run_dir: pathlib.Path, **config: object) -> Checkpointer:
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
    (run_dir / "trace.json").write_text("[]")  # the timeline, and a resumed part's
    (run_dir / "trace-1.json").write_text("[]")
    with pytest.raises(ConfigError, match="and no complete checkpoint to resume"):
        _checkpointer(run_dir).prepare_run_dir()
    assert _checkpointer(run_dir, overwrite=True).prepare_run_dir() is None
    assert not any(run_dir.iterdir())
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "trace-1.json",
                                                       "trace.json"]
    with pytest.raises(ValueError, match="overwrite=True contradicts resume='must'"):
        Checkpointer.Config(overwrite=True, resume="must")


def test_resume_drops_the_killed_runs_records_from_step_logs(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 2, 3))
                   + '{"step": 4, "x": "torn mid-wri')  # the killed run's last, half-written line
    assert truncate_step_log(log, 2) == 4
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1]
    assert truncate_step_log(tmp_path / "absent.jsonl", 2) == 0


class _ShardWriter:
    """Writes a DCP-shaped directory (.metadata and two shards) as the trainer's save does; with
    ``fail`` it writes half a shard and raises it (the disk filling up mid-write)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail

    async def save_checkpoint(self, directory: pathlib.Path) -> None:
        directory.mkdir(parents=True)
        (directory / ".metadata").write_bytes(b"dcp metadata")
        (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
        if self.fail is not None:
            (directory / "__1_0.distcp").write_bytes(bytes(100))
            raise self.fail
        (directory / "__1_0.distcp").write_bytes(bytes(range(255, -1, -1)) * 64)

    async def load_checkpoint(self, directory: pathlib.Path) -> None:
        pass


def _save_steps(run_dir: pathlib.Path, steps: list[int], **config) -> Checkpointer:
    checkpointer = _checkpointer(run_dir, **config)
    for step in steps:
        asyncio.run(checkpointer.save(_ShardWriter(), ControllerState(step=step,
                                                                      next_group_id=2 * step)))
    return checkpointer


def test_checksums_cover_every_file_and_sha256sum_reads_them(tmp_path):
    _save_steps(tmp_path, [1])
    directory = step_dir(tmp_path / "checkpoints", 1)
    listed = [line.split("  ", 1)[1] for line in
              (directory / CHECKSUMS_FILE).read_text().splitlines()]
    assert listed == ["controller.json", "trainer/.metadata", "trainer/__0_0.distcp",
                      "trainer/__1_0.distcp"]
    check = subprocess.run(["sha256sum", "--check", "--strict", CHECKSUMS_FILE], cwd=directory,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == 4


def test_a_flipped_bit_a_truncated_or_missing_shard_skips_to_the_previous_checkpoint(
        tmp_path, caplog):
    _save_steps(tmp_path, [1, 2, 3, 4], keep_last=0)
    root = tmp_path / "checkpoints"
    shard = step_dir(root, 4) / "trainer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x08  # one bit
    shard.write_bytes(bytes(data))
    truncated = step_dir(root, 3) / "trainer" / "__1_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    (step_dir(root, 2) / "trainer" / "__1_0.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        found = latest_complete_checkpoint(root)
    assert found is not None and found[0] == step_dir(root, 1) and found[1].step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("\n" not in w for w in warnings)
    assert "step-000004 is unusable (trainer/__0_0.distcp does not match its sha256" in warnings[0]
    assert "step-000003 is unusable (trainer/__1_0.distcp does not match" in warnings[1]
    assert "step-000002 is unusable (trainer/__1_0.distcp is missing" in warnings[2]
    # a checkpoint written without checksums (checkpoint.checksums false, or an older version)
    # is not verified
    _save_steps(tmp_path / "plain", [1], checksums=False)
    assert not (step_dir(tmp_path / "plain" / "checkpoints", 1) / CHECKSUMS_FILE).exists()
    assert latest_complete_checkpoint(tmp_path / "plain" / "checkpoints") is not None


@pytest.mark.parametrize("seam", ["trainer", "controller.json"])
def test_a_full_disk_while_saving_stops_the_run_in_one_line_and_keeps_the_previous_one(
        tmp_path, monkeypatch, seam):
    checkpointer = _save_steps(tmp_path, [1, 2], keep_last=2)
    root = tmp_path / "checkpoints"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    trainer = _ShardWriter(fail=full if seam == "trainer" else None)
    if seam == "controller.json":
        def no_space(*args, **kwargs):
            raise full

        monkeypatch.setattr(checkpointer_module, "write_controller_state", no_space)
    with pytest.raises(RunFailedError) as e:
        asyncio.run(checkpointer.save(trainer, ControllerState(step=3, next_group_id=6)))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint step 3 could not be written to {step_dir(root, 3)}: "
                           "[Errno 28] No space left on device; the previous checkpoint "
                           f"{step_dir(root, 2)} is intact; the run stops")
    assert not step_dir(root, 3).exists()  # the partial one is gone (its space freed)
    assert [d.name for d in complete_checkpoints(root)] == ["step-000001", "step-000002"]
    found = latest_complete_checkpoint(root)  # keep_last deleted nothing; step 2 verifies
    assert found is not None and found[1].step == 2


def test_a_trainer_that_died_while_saving_is_left_to_the_trainer_restart(tmp_path):
    died = RuntimeError("SupervisionError: failure on mesh policy_trainer-1")
    with pytest.raises(RuntimeError) as e:
        asyncio.run(_checkpointer(tmp_path).save(_ShardWriter(fail=died),
                                                 ControllerState(step=1, next_group_id=2)))
    assert e.value is died and not isinstance(e.value, RunFailedError)
    assert not step_dir(tmp_path / "checkpoints", 1).exists()
