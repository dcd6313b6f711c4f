"""Where each step's wall time went: the ``time/breakdown/*`` metrics and their stacked plot.

    TrainingLoop._breakdown, at each step's push end: one metric per part, summing to
        time/step_wall_s (the previous step's push end to this one's)
    RLJob, at the run's end: plot(run_dir) -> <run_dir>/step_breakdown.png from metrics.jsonl

A step's wall time runs from the end of the previous step's weight push to the end of its own, so
every second of the training loop after the first validation belongs to exactly one step. The
validation and checkpoint that run between two pushes belong to the later step: the one whose
weights they validate and save (validation at step N is logged at step N; checkpoint step-N holds
the weights step N starts from).
"""

from __future__ import annotations

import json
import logging
import pathlib

logger = logging.getLogger(__name__)

BREAKDOWN_PREFIX = "time/breakdown/"
PARTS: dict[str, str] = {
    "validate": "validation of the weights this step starts from",
    "checkpoint": "checkpoint of those weights",
    "wait_for_batch": "waiting for the step's groups (generation, as the trainer sees it)",
    "train": "forward, backward and optimizer on every trainer rank",
    "push": "the new weights to every generator (and the engines' numbers read)",
    "bookkeeping": "the previous step's metrics, rollout records and viewer page",
}
"""Each part of ``time/breakdown/<part>_s``, in the plot's stacking order, and what it holds."""
COLOURS = ("tab:purple", "tab:gray", "tab:orange", "tab:blue", "tab:green", "tab:olive")


def read_breakdowns(metrics_path: pathlib.Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {part: seconds}) of every step in ``metrics.jsonl`` that has a breakdown."""
    rows: dict[int, dict[str, float]] = {}
    with metrics_path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a killed run's half-written last line
                continue
            parts = {part: record[f"{BREAKDOWN_PREFIX}{part}_s"] for part in PARTS
                     if f"{BREAKDOWN_PREFIX}{part}_s" in record}
            if len(parts) == len(PARTS):
                rows[int(record["step"])] = parts
    return sorted(rows.items())


def plot(run_dir: pathlib.Path) -> pathlib.Path | None:
    """``step_breakdown.png``: each step's wall time stacked by part; None (and one info line)
    when metrics.jsonl is not written or has no step."""
    metrics_path = run_dir / "metrics.jsonl"
    rows = read_breakdowns(metrics_path) if metrics_path.is_file() else []
    if not rows:
        logger.info("no step_breakdown.png: %s has no step's time/breakdown", metrics_path)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stackplot(steps, *([parts[p] for _, parts in rows] for p in PARTS),
                 labels=[p.replace("_", " ") for p in PARTS], colors=COLOURS,
                 step="mid" if len(steps) > 1 else None, alpha=0.85)
    if len(steps) == 1:  # a stack plot of one point is invisible: draw it as a bar
        bottom = 0.0
        for part, colour in zip(PARTS, COLOURS):
            ax.bar(steps, [rows[0][1][part]], bottom=bottom, color=colour, width=0.6)
            bottom += rows[0][1][part]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("where each step's wall time went")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", ncol=3)
    ax.set_ylim(0, max(sum(parts.values()) for _, parts in rows) * 1.3)
    fig.tight_layout()
    path = run_dir / "step_breakdown.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
