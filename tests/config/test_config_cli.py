"""The config system: TOML < CLI layering, typed overrides, round trip, and every error message."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import (
    apply_overrides,
    config_from_toml_text,
    config_to_toml,
    parse_args,
)
from torchtitan_rl.controller.job import RLJob

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli_later_sources_win(tmp_path):
    toml = _write(tmp_path, "seed = 5\n[loop]\nnum_steps = 3\n[rollouter]\ngroup_size = 4\n")
    parsed = parse_args(RLJob.Config, ["--config", toml, "--rollouter.group_size", "6"])
    cfg = parsed.config
    assert cfg.seed == 5  # TOML over default
    assert cfg.loop.num_steps == 3  # TOML over default
    assert cfg.rollouter.group_size == 6  # CLI over TOML
    assert cfg.loop.groups_per_step == RLJob.Config().loop.groups_per_step  # untouched default


def test_cli_types_bool_flag_list_float_literal():
    cfg = parse_args(
        RLJob.Config,
        [
            "--checkpoint.overwrite",
            "--sampling.temperature", "0.5",
            "--sampling.stop_token_ids", "3,4",
            "--model.size", "demo",
        ],
    ).config
    assert cfg.checkpoint.overwrite is True
    assert cfg.sampling.temperature == 0.5
    assert cfg.sampling.stop_token_ids == [3, 4]
    assert cfg.model.size == "demo"
    assert parse_args(RLJob.Config, ["--checkpoint.overwrite", "false"]).config.checkpoint.overwrite is False
    assert parse_args(RLJob.Config, ["--checkpoint.resume", "must"]).config.checkpoint.resume == "must"


def test_print_config_round_trips_to_an_equal_config(tmp_path):
    cfg = parse_args(RLJob.Config, ["--loop.num_steps", "7", "--sampling.stop_token_ids", "9"]).config
    text = config_to_toml(cfg)
    assert config_from_toml_text(RLJob.Config, text) == cfg
    # and through a file, as a user would do it
    again = parse_args(RLJob.Config, ["--config", _write(tmp_path, text)]).config
    assert again == cfg


def test_python_composition_with_replace():
    base = RLJob.Config()
    cfg = dataclasses.replace(base, loop=dataclasses.replace(base.loop, num_steps=2), seed=3)
    assert cfg.loop.num_steps == 2 and cfg.seed == 3 and base.loop.num_steps != 2
    assert apply_overrides(cfg, {"rollouter.group_size": 4}).rollouter.group_size == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loop.num_step", "3"], "unknown config key 'loop.num_step' (command line); did you mean 'loop.num_steps'?"),
        (["--loop.num_steps", "abc"], "loop.num_steps: expected int, got 'abc'"),
        (["--checkpoint.overwrite", "maybe"], "checkpoint.overwrite: expected bool (true/false), got 'maybe'"),
        (["--checkpoint.resume", "maybe"], "checkpoint.resume: expected one of 'auto', 'never', 'must', got 'maybe'"),
        (["--model.size", "huge"], "model.size: expected one of 'tiny', 'demo', 'small', got 'huge'"),
        (["--rollouter.group_size", "1"], "rollouter: group_size must be >= 2 (GRPO compares siblings), got 1"),
        (["--config", "/nonexistent/run.toml"], "config file not found: /nonexistent/run.toml"),
        (["stray"], "unexpected command-line argument 'stray'"),
    ],
)
def test_cli_errors_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, argv)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "text, message",
    [
        ("[loop]\nnum_stepz = 3\n", "unknown config key 'loop.num_stepz'; did you mean 'loop.num_steps'?"),
        ("[loop]\nnum_steps = \"3\"\n", "loop.num_steps: expected int, got '3' (str)"),
        ("[loop]\nnum_steps = true\n", "loop.num_steps: expected int, got True (bool)"),
        ("loop = 3\n", "loop: expected a table for TrainingLoop.Config, got 3 (int)"),
        ("[sampling]\nstop_token_ids = [1, \"x\"]\n", "sampling.stop_token_ids[1]: expected int, got 'x' (str)"),
    ],
)
def test_toml_errors_name_the_dotted_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--config", _write(tmp_path, text)])
    assert str(e.value) == message


def test_malformed_toml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "name = \"x\"\n[loop\nnum_steps = 3\n")
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--config", path])
    assert str(e.value).startswith(f"{path}:2:")
    assert "invalid TOML" in str(e.value)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m torchtitan_rl.train ARGS`` in a process of its own (its exit code, streams)."""
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )


def _call_cli(capsys, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """The same command's ``cli()`` in this process, from the repository root: its exit code
    (SystemExit's, 0 when it returns) and what it printed. The printing commands start nothing,
    so a process of their own would only pay the imports again."""
    from torchtitan_rl.train import cli

    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    try:
        cli(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["torchtitan_rl.train", *args], code, out, err)


@pytest.mark.parametrize("run_config", sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "run_configs").glob("*.toml")))
def test_cli_print_config_exits_zero_with_loadable_toml(run_config, capsys, monkeypatch):
    proc = _call_cli(capsys, monkeypatch, "--config", run_config, "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert config_from_toml_text(RLJob.Config, proc.stdout) == _resolve_from_root(
        ["--config", run_config]
    )


def _resolve_from_root(argv: list[str]) -> RLJob.Config:
    import os

    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        return parse_args(RLJob.Config, argv).config
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_cli_unknown_key_exits_2_with_one_line():
    proc = _run_cli("--no_such.key", "1")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such.key" in lines[0] and "Traceback" not in proc.stderr


LETTER_TASK = "tests.controller.letter_task:LetterTask"


def test_task_type_selects_the_class_and_its_typed_settings(tmp_path):
    from tests.controller.letter_task import LetterTask

    toml = _write(tmp_path, f'[task]\ntype = "{LETTER_TASK}"\nnum_prompts = 5\n')
    cfg = parse_args(RLJob.Config, ["--config", toml, "--task.num_prompts", "7"]).config
    assert type(cfg.task) is LetterTask.Config and cfg.task.num_prompts == 7
    # the command line may name the class too, and set its settings in the same call
    cfg = parse_args(RLJob.Config, ["--task.type", LETTER_TASK, "--task.num_prompts", "3"]).config
    assert type(cfg.task) is LetterTask.Config and cfg.task.num_prompts == 3
    # round trip: the printed TOML names the class and loads back equal
    assert config_from_toml_text(RLJob.Config, config_to_toml(cfg)) == cfg
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--task.type", LETTER_TASK, "--task.max_turns", "2"])
    assert str(e.value).startswith("unknown config key 'task.max_turns' (command line)")


@pytest.mark.parametrize("type_path, message", [
    ("no_such_module:Task", "task.type: cannot import 'no_such_module:Task'"),
    ("torchtitan_rl.controller.job:RLJob", "task.type: 'torchtitan_rl.controller.job:RLJob' is "
                                           "not a TaskConfig"),
    # typos: the nearest module or name beside the one that does not exist
    ("exmaples.alphabet_sort:AlphabetSortTask", "task.type: cannot import 'exmaples.alphabet_sort:"
     "AlphabetSortTask' (No module named 'exmaples'); did you mean 'examples'?"),
    ("examples.alphabet_srot:AlphabetSortTask", "task.type: cannot import 'examples.alphabet_srot:"
     "AlphabetSortTask' (No module named 'examples.alphabet_srot'); did you mean "
     "'examples.alphabet_sort'?"),
    ("examples.alphabet_sort:AlphabetSrotTask", "task.type: cannot import 'examples.alphabet_sort:"
     "AlphabetSrotTask' (examples.alphabet_sort has no 'AlphabetSrotTask'; did you mean "
     "'AlphabetSortTask'?)"),
    # a misspelt short name: the short names this package ships
    ("reasoning_gim", "task.type: expected an import path 'package.module:Class', got "
                      "'reasoning_gim'; did you mean 'reasoning_gym'?"),
    ("gym", "task.type: expected an import path 'package.module:Class' or one of "
            "'reasoning_gym', 'textarena', got 'gym'"),
    # a file path: the dotted form Python imports it by
    ("examples/alphabet_sort/task.py:AlphabetSortTask", "task.type: 'examples/alphabet_sort/"
     "task.py:AlphabetSortTask' is a file path; expected an import path 'package.module:Class'; "
     "did you mean 'examples.alphabet_sort.task:AlphabetSortTask'?"),
    ("./examples/alphabet_sort/task.py", "task.type: './examples/alphabet_sort/task.py' is a file "
     "path; expected an import path 'package.module:Class' (the module "
     "'examples.alphabet_sort.task', then ':' and the class, e.g. "
     "'examples.alphabet_sort.task:MyTask')"),
])
def test_bad_task_type_is_one_line_naming_the_key(tmp_path, type_path, message):
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--config", _write(tmp_path, f'[task]\ntype = "{type_path}"\n')])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [
    ('[loop]\nmode = "sync"\n', "loop.mode: the loop is one loop now: set "
                                 "loop.staleness.max_staleness = 0 for synchronous training"),
    ("[loop]\nprompts_per_step = 4\n", "loop.prompts_per_step: renamed loop.groups_per_step"),
    ("[async_loop.staleness]\nmax_staleness = 1\n", "async_loop: moved into [loop]"),
    ("[metrics]\ntensorboard = false\n", "metrics.tensorboard: replaced by metrics.backends"),
])
def test_moved_keys_say_what_to_write(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--config", _write(tmp_path, text)])
    assert str(e.value).startswith(message)
    with pytest.raises(ConfigError, match="renamed loop.groups_per_step"):
        parse_args(RLJob.Config, ["--loop.prompts_per_step", "4"])


def test_print_resolved_shows_what_each_part_gets(capsys, monkeypatch):
    proc = _call_cli(capsys, monkeypatch, "--config", "run_configs/alphabet_sort_cpu.toml", "--seed", "7",
                    "--warm_start.enabled", "false", "--print-resolved")
    assert proc.returncode == 0, proc.stderr
    import tomli

    resolved = tomli.loads(proc.stdout)
    assert resolved["model_dir"] == resolved["base_model_dir"] == "assets/models/demo"
    generator = resolved["generators"][0]
    assert generator["model_dir"] == "assets/models/demo" and generator["seed"] == 7
    assert resolved["trainer"]["seed"] == resolved["rollouter"]["seed"] == 7
    assert resolved["sampling"]["seed"] == 7
    assert resolved["task"]["type"] == "examples.alphabet_sort.task:AlphabetSortTask"
    # and --print-config still prints what the user wrote: no derived values
    written = tomli.loads(_call_cli(capsys, monkeypatch, "--config",
                                    "run_configs/alphabet_sort_cpu.toml", "--print-config").stdout)
    assert "model_dir" not in written["generator"]


# ---- a task class that inherits its parent's Config --------------------------------------------
from examples.running_sum import RunningSumTask  # noqa: E402


class InheritsItsParentsConfig(RunningSumTask):
    """Overrides nothing of the config: without a Config of its own it would build its parent."""


class DeclaresItsOwnConfig(RunningSumTask):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(RunningSumTask.Config):
        pass


def test_the_task_class_named_is_the_one_that_runs_or_the_error_says_how():
    from torchtitan_rl.config.convert import import_config_class
    from torchtitan_rl.task import TaskConfig

    with pytest.raises(ConfigError, match=(
            r"task.type: 'tests.config.test_config_cli:InheritsItsParentsConfig' has no Config "
            r"of its own \(it inherits RunningSumTask.Config, which builds RunningSumTask\); "
            r"declare one in the class: .*class Config\(RunningSumTask.Config\): pass")):
        import_config_class("tests.config.test_config_cli:InheritsItsParentsConfig", TaskConfig,
                            "task.type")
    own = import_config_class("tests.config.test_config_cli:DeclaresItsOwnConfig", TaskConfig,
                              "task.type")
    assert type(own().build()).__qualname__ == "DeclaresItsOwnConfig"  # the class named runs
    assert import_config_class("examples.running_sum:RunningSumTask", TaskConfig,
                               "task.type") is RunningSumTask.Config


def test_a_function_setting_given_as_a_file_path_gets_the_dotted_form():
    from torchtitan_rl.config.convert import import_function

    with pytest.raises(ConfigError) as e:
        import_function("examples/guess_the_number/solver.py:binary_search", "task.solver")
    assert str(e.value) == ("task.solver: 'examples/guess_the_number/solver.py:binary_search' is a "
                            "file path; expected an import path 'package.module:function'; did you "
                            "mean 'examples.guess_the_number.solver:binary_search'?")
