"""A run's timeline drawn as a Gantt chart PNG, for a machine without a trace viewer.

    python -m torchtitan_rl.metrics.trace_plot RUN_DIR [--steps 3 4] [--out timeline.png]

Perfetto (ui.perfetto.dev) and chrome://tracing are the viewers for trace.json; this draws the same
tracks offline with matplotlib: one row per track of each process (controller, trainer ranks,
generators), the requests of each generator packed into as few rows as never overlap (at most
``MAX_REQUEST_ROWS``), over the steps asked for (from the first step's wait for its batch to the
last step's push end).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
from typing import Any

logger = logging.getLogger(__name__)

MAX_REQUEST_ROWS = 12
COLOURS = {"wait for batch": "tab:orange", "train": "tab:blue", "push": "tab:green",
           "validation": "tab:purple", "checkpoint": "tab:gray", "admit": "tab:brown",
           "forward": "tab:cyan", "backward": "tab:blue", "optimizer": "tab:red",
           "step": "tab:olive", "gather": "tab:pink", "send and pull": "tab:green",
           "send": "tab:green", "convert": "tab:purple", "load": "tab:red",
           "request": "lightsteelblue"}


def _read(path: pathlib.Path) -> list[dict[str, Any]]:
    text = path.read_text().rstrip()
    if not text.endswith("]"):  # a live or killed run's trace: the viewers accept it, json not
        text = text.rstrip(",") + "]"
    return json.loads(text)


def _window(events: list[dict[str, Any]], steps: tuple[int, int] | None) -> tuple[float, float]:
    phases = [e for e in events if e["ph"] == "X" and e["pid"] == 1
              and e["name"] in ("wait for batch", "push")]
    if steps is not None:
        phases = [e for e in phases if steps[0] <= e["args"]["step"] <= steps[1]]
    if not phases:
        raise ValueError(f"no step {steps} in the trace")
    return min(e["ts"] for e in phases), max(e["ts"] + e["dur"] for e in phases)


def plot(trace_path: pathlib.Path, out: pathlib.Path,
         steps: tuple[int, int] | None = None) -> pathlib.Path:
    """Draw ``trace_path``'s tracks over ``steps`` (first, last; None: the whole run) to
    ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = _read(trace_path)
    start, end = _window(events, steps)
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["name"] == "thread_name"}
    rows: dict[str, list[tuple[float, float, str]]] = {}
    for e in events:
        if e["ph"] == "X" and e["ts"] < end and e["ts"] + e["dur"] > start:
            row = f"{process.get(e['pid'], e['pid'])} / {thread.get((e['pid'], e['tid']), '')}"
            rows.setdefault(row, []).append((e["ts"], e["dur"], e["name"]))
    begins = {e["id"]: e for e in events if e["ph"] == "b"}
    lanes: dict[int, list[float]] = {}  # per generator: each request row's last end
    for e in events:
        if e["ph"] != "e" or (b := begins.get(e["id"])) is None:
            continue
        if not (b["ts"] < end and e["ts"] > start):
            continue
        ends = lanes.setdefault(b["pid"], [])
        lane = next((i for i, last in enumerate(ends) if last <= b["ts"]), len(ends))
        if lane == MAX_REQUEST_ROWS:
            continue
        ends[lane:lane + 1] = [e["ts"]]
        row = f"{process.get(b['pid'], b['pid'])} / requests {lane:02d}"
        rows.setdefault(row, []).append((b["ts"], e["ts"] - b["ts"], "request"))
    order = sorted(rows, key=lambda r: (_pid_order(r, process), r))
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(order) + 1.6))
    for y, row in enumerate(order):
        open_ends: list[float] = []  # the enclosing slices' ends: a slice inside is drawn inset
        for ts, dur, name in sorted(rows[row], key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= ts + 1.0:  # µs: the trace rounds to 0.1
                open_ends.pop()
            inset = 0.18 * min(len(open_ends), 2)
            ax.broken_barh([((ts - start) / 1e3, max(dur / 1e3, 0.05))],
                           (y - 0.4 + inset, 0.8 - inset), facecolors=_colour(name),
                           edgecolor="white",  # no edge on a sliver: it would hide the colour
                           linewidth=0.3 if dur / (end - start) > 0.003 else 0.0)
            if dur / (end - start) > 0.04 and not open_ends:
                ax.text((ts - start + dur / 2) / 1e3, y, name, ha="center", va="center",
                        fontsize=7, clip_on=True)
            open_ends.append(ts + dur)
    ax.set_yticks(range(len(order)), order, fontsize=7)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("milliseconds")
    ax.grid(axis="x", alpha=0.3)
    label = f"steps {steps[0]}-{steps[1]}" if steps is not None else "the whole run"
    ax.set_title(f"{trace_path.parent.name}/{trace_path.name}: {label}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _colour(name: str) -> str:
    return "#c7e9c0" if name.startswith("push v") else COLOURS.get(name, "tab:gray")


def _pid_order(row: str, process: dict[int, str]) -> int:
    name = row.split(" / ")[0]
    return next((pid for pid, p in process.items() if p == name), 1 << 30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--trace", default="trace.json", help="the trace file in RUN_DIR")
    parser.add_argument("--steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                        help="the steps to draw (default: the whole run)")
    parser.add_argument("--out", type=pathlib.Path, help="default: RUN_DIR/timeline.png")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "timeline.png"
    plot(args.run_dir / args.trace, out, tuple(args.steps) if args.steps else None)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
