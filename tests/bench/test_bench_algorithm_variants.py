"""bench/algorithms.py's and bench/off_policy.py's variants are valid jobs: each variant's config
lines, on the main job's run config (the benches' default), parse into a job config and resolve
(no process starts), so a bench run does not fail on a variant's options after its first hour."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _variants(script: str) -> dict[str, list[str]]:
    sys.path.insert(0, str(REPO_ROOT / "bench"))  # off_policy.py imports algorithms.py beside it
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{script}",
                                                      REPO_ROOT / "bench" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    return module.VARIANTS


CASES = [(script, name, overrides) for script in ("algorithms", "off_policy")
         for name, overrides in _variants(script).items()]


def test_every_bench_variant_is_a_valid_job() -> None:
    config = str(REPO_ROOT / "run_configs" / "alphabet_sort_cpu.toml")
    assert len(CASES) > 20
    for script, name, overrides in CASES:
        parsed = parse_args(RLJob.Config, ["--config", config, *overrides])
        resolved = RLJob(parsed.config).resolve()  # the cross-field checks, nothing spawned
        assert resolved.trainer.num_minibatches >= 1, (script, name)
