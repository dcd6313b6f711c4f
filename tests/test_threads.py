"""Every entry point sets how long idle OpenMP threads spin before torch is loaded, and a user's
choice wins (torchtitan_rl/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchtitan_rl.threads import SPIN_COUNT

ENTRY_POINTS = ["torchtitan_rl.train", "torchtitan_rl.worker", "torchtitan_rl.eval.cli"]

PROBE = """
import importlib, os, sys
importlib.import_module(sys.argv[1])
print(os.environ.get("GOMP_SPINCOUNT", "-"), "torch" in sys.modules)
"""


def spin_count_after_import(module: str, **env: str) -> tuple[str, bool]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE, module], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1] == "True"


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_sets_the_spin_before_torch_loads(module: str) -> None:
    spin_count, torch_loaded = spin_count_after_import(module)
    assert spin_count == SPIN_COUNT
    # libgomp reads it once, when torch loads it: set after that, it would do nothing
    assert not torch_loaded


@pytest.mark.parametrize("user_env, expected", [
    ({"GOMP_SPINCOUNT": "300000"}, "300000"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "-"),  # the user's policy decides the spin
])
def test_a_users_openmp_setting_wins(user_env: dict[str, str], expected: str) -> None:
    spin_count, _ = spin_count_after_import("torchtitan_rl.train", **user_env)
    assert spin_count == expected
