"""A real job (the shared TOML run, `letters_toml_run`, with every tracker on) gives each tracker the
scalars of metrics.jsonl, at the same steps, and the run's config; each read back through its own
library."""

from __future__ import annotations

import json

import pytest

from tests.controller.jobs import read_metrics
from tests.metrics.trackers_testlib import same, wandb_records

pytestmark = pytest.mark.slow  # the shared job runs in a subprocess


def test_every_tracker_holds_the_runs_scalars_steps_and_config(letters_toml_run):
    run_dir, _ = letters_toml_run
    expected = read_metrics(run_dir)  # {step: {key: value}}
    keys = ("rollout_reward/mean", "loss/value", "validation/reward_mean")
    want = {key: {s: v[key] for s, v in expected.items() if key in v} for key in keys}
    assert want["loss/value"] and sorted(want["validation/reward_mean"]) == [0, 2]
    ids = json.loads((run_dir / "tracker_runs.json").read_text())

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tensorboard = {key: {e.step: e.value for e in events.Scalars(key)} for key in keys}

    records = wandb_records(run_dir)
    wandb = {key: {} for key in keys}
    for record in records:
        if record.get("type") == "history":
            item = record["history"]["item"]
            for key in keys:
                if key in item:
                    wandb[key][int(item["_step"])] = float(item[key])
    (wandb_run,) = [r["run"] for r in records if r.get("type") == "run"]

    import trackio.sqlite_storage as storage

    trackio = {key: {row["step"]: float(row[key]) for row in storage.SQLiteStorage.get_logs(
        project="torchtitan_rl", run=ids["trackio"]) if key in row} for key in keys}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    mlflow = {key: {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
              for key in keys}
    mlflow_run = client.get_run(ids["mlflow"])

    for name, read in (("tensorboard", tensorboard), ("wandb", wandb), ("trackio", trackio),
                       ("mlflow", mlflow)):
        for key in keys:
            assert sorted(read[key]) == sorted(want[key]), (name, key, read[key])
            assert all(same(read[key][s], v, rel_tol=1e-6)
                       for s, v in want[key].items()), (name, key)
    # the run's config, as each checkpoint saves it
    saved = json.loads(next((run_dir / "checkpoints").glob("step-*/job_config.json")).read_text())
    assert saved["metrics.backends"] == ["tensorboard", "wandb", "trackio", "mlflow"]
    assert wandb_run["config"]["update"]["trainer.optimizer.lr"] == saved["trainer.optimizer.lr"]
    assert mlflow_run.data.params["seed"] == json.dumps(saved["seed"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == run_dir.name
    assert storage.SQLiteStorage.get_run_config("torchtitan_rl", ids["trackio"])["seed"] \
        == saved["seed"]
