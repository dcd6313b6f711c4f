"""The example tasks live at the repository's top (examples/), outside the library: a run config
names them by import path and they import from the checkout the config is in, from any working
directory; the installed package carries no `examples`; saved configs naming their old path
(torchtitan_rl.examples) still resolve."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tomllib

from torchtitan_rl.config.convert import current_type_path, import_config_class
from torchtitan_rl.controller.checkpoint.resume_config import config_changes
from torchtitan_rl.task import TaskConfig

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import examples
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
before = examples.__file__
del sys.modules["examples"]
config = parse_args(RLJob.Config, ["--config", sys.argv[1]]).config
import examples
import os
print(json.dumps({"task": type(config.task).__module__, "examples": examples.__file__,
                  "before": before, "pythonpath": os.environ.get("PYTHONPATH", "")}))
"""


def test_a_run_config_imports_its_checkouts_examples_from_another_working_directory(
        tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO_ROOT / "run_configs" / "alphabet_sort_cpu.toml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # Before the config is read, `examples` is torchmonarch's namespace package (no __file__);
    # the checkout's regular package wins once the config's checkout is on the path.
    assert found["before"] is None
    assert found["task"] == "examples.alphabet_sort.task"
    assert found["examples"] == str(REPO_ROOT / "examples" / "__init__.py")
    assert found["pythonpath"].split(os.pathsep)[0] == str(REPO_ROOT)  # the run's processes too


def test_the_library_installs_no_examples_package() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["torchtitan_rl*"]
    assert not (REPO_ROOT / "torchtitan_rl" / "examples").exists()


def test_a_saved_configs_old_task_path_resolves_and_is_no_change_on_resume() -> None:
    old = "torchtitan_rl.examples.alphabet_sort:AlphabetSortTask"
    new = "examples.alphabet_sort:AlphabetSortTask"
    assert current_type_path(old) == new
    assert current_type_path("torchtitan_rl.examples_other:X") == "torchtitan_rl.examples_other:X"
    from examples.alphabet_sort import AlphabetSortTask

    assert import_config_class(old, TaskConfig, "task.type") is AlphabetSortTask.Config
    assert config_changes({"task.type": old, "task.max_turns": 3},
                          {"task.type": new, "task.max_turns": 3}) == []
    assert config_changes({"task.type": old}, {"task.type": "examples.running_sum:X"}) == [
        ("task.type", new, "examples.running_sum:X")]
