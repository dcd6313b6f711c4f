"""The metric trackers: each reads back, through its own library, the scalars, steps and run config
MetricsLogger gave it; a failing tracker is dropped with one warning and the others go on; a full
disk under metrics.jsonl stops the run in one line and leaves no torn line."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib

import pytest

from tests.metrics.trackers_testlib import same, wandb_records
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.metrics.logger import MetricsLogger
from torchtitan_rl.metrics.sinks import (
    TRACKER_RUNS_FILE,
    MlflowSink,
    RecordWriteError,
    WandbSink,
)

RUN_CONFIG = {"seed": 3, "trainer.optimizer.lr": 0.0005, "task.type": "examples.x:Task",
              "metrics.backends": ["tensorboard", "wandb", "trackio", "mlflow"]}
STEPS = {0: {"loss/value": 0.5, "rollout_reward/mean": 0.25},
         1: {"loss/value": 0.375, "rollout_reward/mean": 0.5},
         2: {"loss/value": float("nan"), "rollout_reward/mean": 0.75}}


def _log_steps(run_dir: pathlib.Path, backends: list[str], steps: dict, *,
               purge_step: int | None = None, **sink_settings) -> MetricsLogger:
    config = MetricsLogger.Config(backends=backends, **sink_settings)
    metrics = config.build(run_dir=run_dir, purge_step=purge_step, run_config=RUN_CONFIG)
    for step, values in steps.items():
        metrics.log(step, values)
    metrics.close()
    return metrics


def test_tensorboard_reads_back_the_scalars_steps_and_run_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = _log_steps(tmp_path, ["tensorboard"], STEPS)
    assert metrics.num_nonfinite == 1
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for key in ("loss/value", "rollout_reward/mean"):
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in read] == [0, 1, 2]
        assert all(same(v, STEPS[s][key]) for s, v in read)
    text = events.Tensors("run_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| trainer.optimizer.lr | 0.0005 |" in text


def test_wandb_offline_run_reads_back_through_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_steps(tmp_path, ["wandb"], STEPS)
    records = wandb_records(tmp_path)
    history = {r["history"]["step"]["num"]: r["history"]["item"]
               for r in records if r.get("type") == "history"}
    assert sorted(history) == [0, 1, 2]
    for step, values in STEPS.items():
        for key, value in values.items():
            assert same(float(history[step][key]), value)
    (run,) = [r["run"] for r in records if r.get("type") == "run"]
    assert run["config"]["update"]["trainer.optimizer.lr"] == 0.0005
    assert run["config"]["update"]["metrics.backends"] == RUN_CONFIG["metrics.backends"]
    assert run["run_id"] == json.loads((tmp_path / TRACKER_RUNS_FILE).read_text())["wandb"]
    assert run["display_name"] == tmp_path.name


def test_trackio_reads_back_from_its_local_store(tmp_path):
    import trackio.sqlite_storage as storage

    _log_steps(tmp_path / "run", ["trackio"], STEPS)
    name = json.loads((tmp_path / "run" / TRACKER_RUNS_FILE).read_text())["trackio"]
    # the tests' own store (tests/conftest.py), not the user's
    assert storage.SQLiteStorage.get_project_db_path("torchtitan_rl").is_relative_to(
        os.environ["TRACKIO_DIR"])
    logs = storage.SQLiteStorage.get_logs(project="torchtitan_rl", run=name)
    assert [row["step"] for row in logs] == [0, 1, 2]
    for row in logs:
        for key, value in STEPS[row["step"]].items():
            assert same(float(row[key]), value)
    assert storage.SQLiteStorage.get_run_config("torchtitan_rl", name)["seed"] == 3


def test_mlflow_reads_back_from_its_local_store_and_a_resume_continues_the_run(tmp_path):
    from mlflow.tracking import MlflowClient

    _log_steps(tmp_path, ["mlflow"], {0: STEPS[0], 1: STEPS[1]})
    _log_steps(tmp_path, ["mlflow"], {2: STEPS[2]}, purge_step=2)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((tmp_path / TRACKER_RUNS_FILE).read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert run.data.params["trainer.optimizer.lr"] == "0.0005"
    assert json.loads(run.data.params["metrics.backends"]) == RUN_CONFIG["metrics.backends"]
    for key in ("loss/value", "rollout_reward/mean"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [s for s, _ in history] == [0, 1, 2]
        assert all(same(v, STEPS[s][key]) for s, v in history)


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    class FlakySink:
        def __init__(self) -> None:
            self.logged: list[int] = []

        def log(self, step: int, metrics: dict[str, float]) -> None:
            if step == 1:
                raise OSError(28, "No space left on device")
            self.logged.append(step)

        def close(self) -> None:
            pass

    blocked = tmp_path / "not_a_folder"
    blocked.write_text("")
    config = MetricsLogger.Config(backends=["tensorboard", "mlflow"],
                                  mlflow=MlflowSink.Config(
                                      tracking_uri=f"sqlite:///{blocked}/mlflow.db"))
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.metrics.logger"):
        metrics = config.build(run_dir=tmp_path / "run", run_config=RUN_CONFIG)
        flaky = metrics.sinks["flaky"] = FlakySink()
        for step, values in STEPS.items():
            metrics.log(step, values)
        metrics.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("metrics backend mlflow failed (open)")
    assert "metrics backend flaky failed (step 1): OSError" in warnings[1]
    assert "the run goes on without it" in warnings[1]
    assert flaky.logged == [0]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("rollout_reward/mean")] == [0, 1, 2]


def test_backends_are_checked_when_the_config_is_made():
    with pytest.raises(ConfigError, match=r"metrics.backends: unknown backend 'wandbb'"):
        MetricsLogger.Config(backends=["wandbb"])
    with pytest.raises(ConfigError, match="names a backend twice"):
        MetricsLogger.Config(backends=["wandb", "wandb"])
    assert MetricsLogger.Config().backends == ["tensorboard"]


def test_a_tracker_whose_library_is_missing_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'mlflow' needs the mlflow package.*\.\[trackers\]"):
        MetricsLogger.Config(backends=["mlflow"])



def test_wandb_online_without_a_key_logs_offline_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))  # no `wandb login` either
    monkeypatch.setenv("HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        _log_steps(tmp_path / "run", ["wandb"], {0: STEPS[0]},
                   wandb=WandbSink.Config(mode="online"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no W&B key is set" in warnings[0], warnings
    assert len(list((tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb"))) == 1


class _FillingDisk:
    """metrics.jsonl's file on a disk with ``room`` bytes left: a write past it writes what fits
    and raises ENOSPC, as write(2) on a full disk does."""

    def __init__(self, real, room: int) -> None:
        self.real, self.room = real, room

    def write(self, data) -> int:
        fits = min(len(data), self.room)
        self.room -= self.real.write(data[:fits])
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_a_full_disk_while_writing_metrics_jsonl_stops_in_one_line_and_leaves_no_torn_line(
        tmp_path):
    metrics = MetricsLogger.Config(backends=[]).build(run_dir=tmp_path)
    metrics.log(0, {"loss/value": 0.5})
    metrics.log(1, {"loss/value": 0.25})
    metrics._jsonl._file = _FillingDisk(metrics._jsonl._file, room=10)
    with pytest.raises(RecordWriteError) as e:
        metrics.log(2, {"loss/value": 0.125})
    assert str(e.value) == (
        f"{tmp_path / 'metrics.jsonl'}: step 2 could not be written: No space left on device; the "
        "run stops (a full disk: free space, then run the same command: it resumes from its "
        "newest checkpoint)")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0, 1]  # the 10 bytes taken back
    assert all(line.endswith("\n") for line in lines)
    metrics._jsonl._file.room = 1 << 20  # space freed: the next write is whole
    metrics.log(2, {"loss/value": 0.125})
    metrics.close()
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
