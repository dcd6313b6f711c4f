"""Reading trackers back in tests: W&B's offline transaction log through W&B's own reader."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
from typing import Any


def wandb_records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The records of the run folder's one offline W&B run, through `wandb leet inspect --json`
    (the wandb-core binary's reader of its transaction log), one record a line."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    printed = subprocess.run([str(pathlib.Path(sys.executable).with_name("wandb")), "leet",
                              "inspect", "--json", str(run_file)],
                             capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in printed.splitlines() if line.startswith("{")]


def same(a: float, b: float, rel_tol: float = 0.0) -> bool:
    """Equal as logged (NaN equals NaN); ``rel_tol`` for values that went through float32
    (TensorBoard's)."""
    return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel_tol)
