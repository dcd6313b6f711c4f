"""Per-step metrics: TensorBoard scalars, a JSONL copy, and a reward-curve PNG at the end.

Keys are `area/component/name` (e.g. `rollout_reward/mean`, `loss/clipped_frac`, `time/generate_s`).
Non-finite values are written as they are (TensorBoard shows them) and counted in `num_nonfinite`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
from typing import Any

from torchtitan_rl.config.configurable import Configurable

logger = logging.getLogger(__name__)


class MetricsLogger(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        tensorboard: bool = True
        """Write TensorBoard event files under `<run_dir>/tensorboard`."""
        jsonl: bool = True
        """Also append every step's metrics to `<run_dir>/metrics.jsonl`."""
        log_every_steps: int = 1
        """Log one key=value INFO line every this many steps."""

        def __post_init__(self) -> None:
            if self.log_every_steps < 1:
                raise ValueError(f"log_every_steps must be >= 1, got {self.log_every_steps}")

    def __init__(self, config: Config, *, run_dir: pathlib.Path,
                 purge_step: int | None = None) -> None:
        """``purge_step``: a run resumed at this step; TensorBoard drops the events of the killed
        run at or after it (metrics.jsonl is truncated by the Checkpointer)."""
        self.config = config
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.num_nonfinite = 0
        self._history: dict[str, list[tuple[int, float]]] = {}
        self._writer = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                         purge_step=purge_step)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if config.jsonl else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            value = float(value)
            if not math.isfinite(value):
                self.num_nonfinite += 1
            self._history.setdefault(key, []).append((step, value))
            if self._writer is not None:
                self._writer.add_scalar(key, value, step)
        if self._writer is not None:
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
            self._jsonl.flush()
        if step % self.config.log_every_steps == 0:
            logger.info("step=%d %s", step, " ".join(
                f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())
            ))

    def history(self, key: str) -> list[tuple[int, float]]:
        return list(self._history.get(key, []))

    def plot(self, keys: list[str], path: pathlib.Path, title: str = "") -> pathlib.Path | None:
        """A PNG of the given keys over steps (the ones that were logged)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series = {k: self._history[k] for k in keys if self._history.get(k)}
        if not series:
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, points in series.items():
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=key)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
