"""Per-step metrics: the trackers of `backends` (metrics/sinks.py), a JSONL copy, and the run's
timeline (metrics/trace.py). Nothing is kept in memory per step (a long run stays flat:
bench/soak.py).

    controller loop --log(step, metrics)--> every open sink, metrics.jsonl, one INFO line
                    --trace.span(...)-->    the run's timeline, trace.json (metrics/trace.py)
                    --close()-->            every sink closed (a failing one dropped, warned once)

Keys are `area/component/name` (e.g. `rollout_reward/mean`, `loss/clipped_frac`, `time/generate_s`).
Non-finite values are written as they are (the trackers show them) and counted in `num_nonfinite`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
from collections.abc import Callable
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.metrics.sinks import (
    BACKENDS,
    JsonlLog,
    MetricSink,
    MlflowSink,
    SinkContext,
    TensorBoardSink,
    TrackioSink,
    WandbSink,
    check_backends,
)
from torchtitan_rl.metrics.trace import RunTrace

logger = logging.getLogger(__name__)


class MetricsLogger(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        moved_keys = {"tensorboard": "replaced by metrics.backends, a list of trackers "
                                     f"({', '.join(BACKENDS)}); [] writes none"}
        backends: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
        """The trackers each step's scalars go to, any of "tensorboard" (event files under
        `<run_dir>/tensorboard`), "wandb", "trackio", "mlflow" (the last three need
        `pip install -e '.[trackers]'`). Each gets the same scalars, steps and run config."""
        wandb: WandbSink.Config = dataclasses.field(default_factory=WandbSink.Config)
        trackio: TrackioSink.Config = dataclasses.field(default_factory=TrackioSink.Config)
        mlflow: MlflowSink.Config = dataclasses.field(default_factory=MlflowSink.Config)
        jsonl: bool = True
        """Also append every step's metrics to `<run_dir>/metrics.jsonl`."""
        log_every_steps: int = 1
        """Log one key=value INFO line every this many steps."""
        trace: RunTrace.Config = dataclasses.field(default_factory=RunTrace.Config)
        """The run's timeline (metrics/trace.py): `<run_dir>/trace.json` for Perfetto."""

        def __post_init__(self) -> None:
            if self.log_every_steps < 1:
                raise ValueError(f"log_every_steps must be >= 1, got {self.log_every_steps}")
            check_backends(self.backends)

    def __init__(self, config: Config, *, run_dir: pathlib.Path,
                 purge_step: int | None = None, run_config: dict[str, Any] | None = None) -> None:
        """``purge_step``: a run resumed at this step; TensorBoard drops the events of the killed
        run at or after it (metrics.jsonl is truncated by the Checkpointer). ``run_config``: the
        run's config as ``{dotted.key: value}``, logged to each tracker."""
        self.config = config
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.num_nonfinite = 0
        context = SinkContext(run_dir=self.run_dir, run_name=self.run_dir.name,
                              run_config=run_config or {}, purge_step=purge_step)
        self.sinks: dict[str, MetricSink] = {}
        for name in config.backends:
            sink = self._guarded(name, "open", self._open_sink, name, context)
            if sink is not None:
                self.sinks[name] = sink
        self._jsonl = JsonlLog(self.run_dir / "metrics.jsonl") if config.jsonl else None
        self.trace = config.trace.build(run_dir=self.run_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        scalars = {key: float(value) for key, value in metrics.items()}
        self.num_nonfinite += sum(not math.isfinite(value) for value in scalars.values())
        for name, sink in list(self.sinks.items()):
            self._guarded(name, f"step {step}", sink.log, step, scalars)
        if self._jsonl is not None:  # a full disk: RecordWriteError, the run stops in one line
            self._jsonl.append(step, {"step": step, **metrics})
        if step % self.config.log_every_steps == 0:
            logger.info("step=%d %s", step, " ".join(
                f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())
            ))

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            self._guarded(name, "close", sink.close)
        self.sinks.clear()
        if self._jsonl is not None:
            self._jsonl.close()
        self.trace.close()

    def _open_sink(self, name: str, context: SinkContext) -> MetricSink:
        if name == "tensorboard":
            return TensorBoardSink(context)
        sink_config = getattr(self.config, name)
        return sink_config.build(context=context)

    def _guarded(self, name: str, when: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``'s result; a tracker that raises is dropped with one warning and None
        returned (the run goes on)."""
        try:
            return call(*args)
        except Exception as e:
            sink = self.sinks.pop(name, None)
            logger.warning("metrics backend %s failed (%s): %s: %s; the run goes on without it",
                           name, when, type(e).__name__, e)
            if sink is not None and when != "close":
                try:
                    sink.close()
                except Exception:
                    logger.debug("closing the failed backend %s", name, exc_info=True)
            return None


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
