"""The trackers a run's scalars go to (`metrics.backends`), each through its own library.

    MetricsLogger.__init__  --> open_sink(name) for each backend: the tracker's run (resumed
                                when the run folder already has one), the run's config logged
    MetricsLogger.log       --> sink.log(step, scalars)     (every sink, the same step and keys)
    MetricsLogger.close     --> sink.close()

A tracker never stops a run: a sink that raises while opening, logging or closing is dropped
after one warning naming it and the error (MetricsLogger), and the run goes on with the others.
The ids of the trackers' runs are kept in `<run_dir>/tracker_runs.json`, so a resumed run (or a
trainer restart inside one) continues the same W&B, trackio and MLflow runs.

`metrics.jsonl` is the run's own record, not a tracker (JsonlLog): a line that cannot be written
(a full disk) is taken back whole and stops the run with one line; the resume writes it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import logging
import os
import pathlib
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal, Protocol

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

TRACKER_RUNS_FILE = "tracker_runs.json"
EXTRAS = {"wandb": "trackers", "mlflow": "trackers", "trackio": "trackio"}
"""The extra that installs each tracker's library (named as the backend)."""


class RecordWriteError(RuntimeError):
    """A record of the run could not be written (a full disk): the run stops; its message says
    which file, which step and why."""


class JsonlLog:
    """An append-only JSON-lines file of per-step records, written a whole line at a time: a
    write that fails (ENOSPC) is cut back to the last whole line and raises RecordWriteError,
    so the file never holds a torn line and every line on disk is a step that was logged."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        # Unbuffered: a failed write leaves nothing in a buffer to be flushed later.
        self._file = open(path, "ab", buffering=0)

    def append(self, step: int, record: dict[str, Any]) -> None:
        data = (json.dumps(record, allow_nan=True) + "\n").encode()
        start = self._file.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # a raw write may write part and return its count
                view = view[self._file.write(view):]
        except OSError as e:
            try:
                self._file.truncate(start)
            except OSError:
                logger.warning("%s: could not cut back a half-written line at byte %d (the "
                               "resume drops it)", self.path, start)
            raise RecordWriteError(
                f"{self.path}: step {step} could not be written: {e.strerror or e}; the run "
                f"stops (a full disk: free space, then run the same command: it resumes from "
                f"its newest checkpoint)") from e

    def close(self) -> None:
        self._file.close()


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class SinkContext:
    """What every sink opens with."""

    run_dir: pathlib.Path
    run_name: str
    run_config: dict[str, Any]
    """The run's config as ``{dotted.key: value}`` (what each checkpoint saves)."""
    purge_step: int | None
    """A run resumed at this step (None: a fresh run)."""

    def tracker_run_id(self, tracker: str, new_id: str) -> str:
        """The id this run has in ``tracker``: the one recorded in the run folder, else
        ``new_id`` (recorded)."""
        path = self.run_dir / TRACKER_RUNS_FILE
        ids = json.loads(path.read_text()) if path.is_file() else {}
        if tracker not in ids:
            ids[tracker] = new_id
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ids, indent=1) + "\n")
            os.replace(tmp, path)
        return ids[tracker]

    def recorded_run_id(self, tracker: str) -> str | None:
        path = self.run_dir / TRACKER_RUNS_FILE
        return json.loads(path.read_text()).get(tracker) if path.is_file() else None


class TensorBoardSink:
    """Event files under `<run_dir>/tensorboard`; the run's config as a text summary at step 0."""

    def __init__(self, context: SinkContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(context.run_dir / "tensorboard"),
                                     purge_step=context.purge_step)
        if context.purge_step is None:
            self._writer.add_text("run_config", _config_markdown(context.run_config), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink(Configurable):
    """A W&B run: offline files under `<run_dir>/wandb` unless `mode = "online"` and a key is
    set (`WANDB_API_KEY` or `wandb login`); `wandb sync <run_dir>/wandb/offline-run-*` uploads
    an offline run later."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        project: str = "torchtitan_rl"
        """The W&B project the run goes to."""
        entity: str | None = None
        """The W&B team or user (None: the key's default)."""
        mode: Literal["offline", "online"] = "offline"
        """"online" needs a key: without one the run logs offline, with one warning."""
        group: str | None = None
        """A W&B run group, e.g. the seeds of one recipe (None: no group)."""
        tags: list[str] = dataclasses.field(default_factory=list)
        """W&B run tags."""

    def __init__(self, config: Config, *, context: SinkContext) -> None:
        import wandb

        mode = config.mode
        if mode == "online" and not _wandb_has_key():
            logger.warning("metrics.wandb.mode = \"online\" but no W&B key is set "
                           "(WANDB_API_KEY or `wandb login`): logging offline under %s",
                           context.run_dir / "wandb")
            mode = "offline"
        self._wandb = wandb
        self._run = wandb.init(
            project=config.project, entity=config.entity, group=config.group,
            tags=config.tags or None, name=context.run_name,
            id=context.tracker_run_id("wandb", uuid.uuid4().hex[:12]), resume="allow",
            dir=str(context.run_dir), mode=mode, config=context.run_config,
            # The console is the run's: no W&B banner, no copy of stdout, no system-metrics
            # sampler competing for the box's cores.
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                    x_disable_meta=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # its wandb-core process ends with the run


class TrackioSink(Configurable):
    """A trackio run in trackio's local store (`TRACKIO_DIR`, default under the Hugging Face
    cache); `trackio show --project <project>` draws it."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        project: str = "torchtitan_rl"
        """The trackio project (one database in its store)."""
        space_id: str | None = None
        """A Hugging Face Space to sync to (None: local only; the Space needs the hub)."""

    def __init__(self, config: Config, *, context: SinkContext) -> None:
        import trackio

        name = context.tracker_run_id("trackio", f"{context.run_name}-{uuid.uuid4().hex[:8]}")
        with _prints_to_log("trackio"):
            # No CPU/GPU sampler of trackio's own competing for the box's cores.
            self._run = trackio.init(project=config.project, name=name,
                                     space_id=config.space_id, config=context.run_config,
                                     resume="allow", auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        from trackio import context_vars

        with _prints_to_log("trackio"):
            self._run.finish()
        if context_vars.current_run.get() is self._run:  # else trackio finishes it again at exit
            context_vars.current_run.set(None)


class MlflowSink(Configurable):
    """An MLflow run; its tracking server or store is `tracking_uri`, else `MLFLOW_TRACKING_URI`,
    else MLflow's local database store in the run folder, `sqlite:///<run_dir>/mlflow.db`
    (`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db` shows it)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        tracking_uri: str | None = None
        """An MLflow server or store (None: MLFLOW_TRACKING_URI, else the run folder's
        mlflow.db)."""
        experiment: str = "torchtitan_rl"
        """The MLflow experiment the run goes to (made when missing)."""

    def __init__(self, config: Config, *, context: SinkContext) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = (config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or f"sqlite:///{(context.run_dir / 'mlflow.db').resolve()}")
        self._client = MlflowClient(tracking_uri=uri)
        run_id = context.recorded_run_id("mlflow")
        if run_id is None:
            experiment = self._client.get_experiment_by_name(config.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(config.experiment))
            run_id = self._client.create_run(experiment_id, run_name=context.run_name).info.run_id
            context.tracker_run_id("mlflow", run_id)
            params = [Param(key, _param_value(value))
                      for key, value in context.run_config.items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                self._client.log_batch(run_id, params=params[start:start + 100])
        else:
            self._client.update_run(run_id, status="RUNNING")
        self._run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self._client.log_batch(self._run_id, metrics=batch[start:start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


BACKENDS = ("tensorboard", "wandb", "trackio", "mlflow")


def check_backends(backends: list[str]) -> None:
    """One ConfigError for an unknown backend or a tracker whose library is not installed."""
    for name in backends:
        if name not in BACKENDS:
            raise ConfigError(f"metrics.backends: unknown backend {name!r} "
                              f"(choose from {', '.join(BACKENDS)})")
        if name in EXTRAS and importlib.util.find_spec(name) is None:
            raise ConfigError(f"metrics.backends: {name!r} needs the {name} package, "
                              f"which is not installed (pip install -e '.[{EXTRAS[name]}]')")
    if len(set(backends)) != len(backends):
        raise ConfigError(f"metrics.backends: {backends} names a backend twice")


@contextlib.contextmanager
def _prints_to_log(library: str) -> Iterator[None]:
    """A library's print()s go to the run's log file, not the console."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        yield
    for line in printed.getvalue().splitlines():
        logger.info("%s: %s", library, line)


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit on a value


def _config_markdown(run_config: dict[str, Any]) -> str:
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| {key} | {json.dumps(value)} |" for key, value in run_config.items()]
    return "\n".join(lines)
