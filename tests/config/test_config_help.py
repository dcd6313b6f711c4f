"""``--help``: each option's type, default and docstring by section, read from source (fast, no torch),
agreeing with the imported config classes."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from torchtitan_rl.config.help import ROOT_CONFIG, help_text, live_sections, static_sections
from torchtitan_rl.config.manager import GLOBAL_OPTIONS
from torchtitan_rl.config.source_schema import SourceSchemaError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = [None, "examples.alphabet_sort:AlphabetSortTask", "tests.controller.letter_task:LetterTask"]


@pytest.mark.parametrize("task_type", TASKS)
def test_source_reader_agrees_with_the_imported_classes(task_type):
    """Every option: same dotted path, type name, default and docstring, in the same order."""
    static = [dataclasses.asdict(s) for s in static_sections(ROOT_CONFIG, task_type)]
    live = [dataclasses.asdict(s) for s in live_sections(ROOT_CONFIG, task_type)]
    assert [s["path"] for s in static] == [s["path"] for s in live]
    assert static == live
    from torchtitan_rl.config.convert import leaf_paths
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob

    argv = ["--task.type", task_type] if task_type else []
    config = parse_args(RLJob.Config, argv).config
    options = [o["path"] for s in static for o in s["options"]]
    assert sorted(options) == sorted(leaf_paths(RLJob.Config, instance=config))


def _cli(*argv: str) -> subprocess.CompletedProcess:
    code = ("import sys; from torchtitan_rl.train import cli; cli(sys.argv[1:]); "
            "print('heavy:', sorted(m for m in ('torch', 'vllm', 'monarch', 'transformers') "
            "if m in sys.modules), file=sys.stderr)")
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_help_is_fast_imports_nothing_heavy_and_explains_each_option():
    start = time.perf_counter()
    proc = _cli("--help")
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "heavy: []" in proc.stderr
    assert wall < 5.0, wall  # ~0.2 s measured; importing the job alone takes ~6 s
    out = proc.stdout
    for header in ("options:", "job options:", "model options:", "trainer.optimizer options:",
                   "rollouter options:", "loop.staleness options:", "task options:"):
        assert f"\n{header}\n" in out, header
    # a field's type, default and docstring
    assert "--rollouter.advantage_std 'sample' | 'population' | 'none'  (default: sample)" in out
    assert "with Bessel's correction" in out
    assert "--trainer.optimizer.lr float  (default: 1e-05)" in out
    assert "--generator.kv_cache_bytes int  (default: 268435456)" in out
    assert "--sampling.stop_token_ids list[int]  (default: [])" in out
    assert "--log.level info | debug" in out
    # without a task named, only its type
    assert "--task.type str  (default: required)" in out and "--task.max_turns" not in out


def test_help_shows_the_toml_values_and_the_named_tasks_options():
    proc = _cli("--config", "run_configs/alphabet_sort_cpu.toml", "-h")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--rollouter.advantage_std 'sample' | 'population' | 'none'  (default: sample; " \
           "TOML: none)" in out
    assert "--task.max_names_per_turn int  (default: 5; TOML: 2)" in out
    assert "Turns per episode, uniform in [min_turns, max_turns]." in out
    assert "--task.validation_names 'disjoint' | 'shared'  (default: disjoint; TOML: shared)" \
        in out
    # the command line's --task.type wins over the TOML's
    out = _cli("--config", "run_configs/alphabet_sort_cpu.toml", "--task.type",
               "tests.controller.letter_task:LetterTask", "--help").stdout
    assert "--task.num_prompts int  (default: 64)" in out and "--task.max_turns" not in out


def test_help_errors_are_one_line():
    proc = _cli("--config", "/nonexistent/run.toml", "--help")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config file not found: /nonexistent/run.toml"
    proc = _cli("--task.type", "no_such_module:Task", "--help")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: task.type: cannot import 'no_such_module:Task' (No module named "
        "'no_such_module')"]


def test_eval_help_lists_its_own_options_and_the_config():
    code = ("import sys; from torchtitan_rl.eval.cli import cli; cli(['--help']); "
            "print('heavy:', sorted(m for m in ('torch', 'vllm', 'monarch', 'transformers') "
            "if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "heavy: []" in proc.stderr
    assert "--model HF_DIR" in proc.stdout and "--pass-threshold X" in proc.stdout
    assert "--validation.samples_per_prompt int  (default: 1)" in proc.stdout
    # eval's --print-config prints the keys eval uses; the job's options eval refuses are not listed
    assert "--print-config" in proc.stdout and "--trainer." not in proc.stdout


def test_what_the_source_reader_cannot_evaluate_falls_back_to_imports(tmp_path, monkeypatch):
    (tmp_path / "odd_config.py").write_text(textwrap.dedent('''
        import dataclasses

        def compute() -> int:
            return 6 * 7

        @dataclasses.dataclass(kw_only=True)
        class Config:
            answer: int = compute()
            """Computed at import time."""
            name: str = "x"
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SourceSchemaError, match="cannot evaluate compute()"):
        static_sections("odd_config:Config", None)
    text = help_text([], usage="usage: x", description="d", global_options=GLOBAL_OPTIONS,
                     root="odd_config:Config")
    assert "--answer int  (default: 42)" in text and "Computed at import time." in text


def _task_types() -> list[str]:
    """Every task class of the package and of examples/ (`package.module:Class` whose nested
    Config subclasses TaskConfig), found in source: the polymorphic `task` reaches each of them."""
    import ast

    found = []
    paths = [*(REPO_ROOT / "torchtitan_rl").rglob("*.py"), *(REPO_ROOT / "examples").rglob("*.py")]
    for path in sorted(paths):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(inner, ast.ClassDef) and inner.name == "Config" and any(
                        ast.unparse(b).endswith("TaskConfig") for b in inner.bases)
                    for inner in node.body):
                module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
                found.append(f"{module.removesuffix('.__init__')}:{node.name}")
    return found


@pytest.mark.parametrize("task_type", [None, *_task_types()])
def test_every_option_is_explained(task_type):
    """Every field of every config class reachable from the job's root config has help text;
    a Literal field's text names each of its choices, an optional field's says what None means."""
    import re

    sections = static_sections(ROOT_CONFIG, task_type)
    assert any(s.path == "task" for s in sections)
    undocumented = [o.path for s in sections for o in s.options if not o.doc.strip()]
    assert undocumented == [], f"options without a field docstring: {undocumented}"
    assert [s.path for s in sections if s.path and not s.doc.strip()] == []
    for section in sections:
        for option in section.options:
            choices = re.findall(r"'([^']*)'", option.type) if option.type.startswith("'") else []
            missing = [c for c in choices if c not in option.doc]
            assert not missing, f"{option.path}: the help names no {missing}"
            if option.type.endswith("| None"):
                assert "None" in option.doc, f"{option.path}: the help says nothing of None"


def test_the_task_types_are_found():
    assert "examples.alphabet_sort.task:AlphabetSortTask" in _task_types()


def _help(*argv: str) -> str:
    from torchtitan_rl.train import DESCRIPTION, USAGE

    return help_text(list(argv), usage=USAGE, description=DESCRIPTION,
                     global_options=GLOBAL_OPTIONS)


def _headers(text: str) -> list[str]:
    return [line.removesuffix(" options:") for line in text.splitlines()
            if line.endswith(" options:") and not line.startswith(" ")]


def test_help_section_shows_that_section_and_its_subsections_only():
    assert _headers(_help("--help", "trainer")) == ["trainer", "trainer.optimizer",
                                                    "trainer.loss", "trainer.loss.off_policy",
                                                    "trainer.critic", "trainer.lora"]
    out = _help("--help", "generator.sampling")
    assert _headers(out) == ["generator.sampling"]
    assert out.startswith("generator.sampling options:\n")
    assert "--generator.sampling.top_p float  (default: 1.0)" in out
    assert "--sampling.top_p" not in out and "usage:" not in out
    assert _headers(_help("-h", "job")) == ["job"]
    assert _headers(_help("--help=placement")) == ["placement", "placement.slurm",
                                                   "placement.kubernetes"]
    # one option by its dotted path
    out = _help("--help", "sampling.top_p")
    assert _headers(out) == ["sampling"] and out.count("\n  --") == 1
    # the TOML's values and its task, as in the whole help
    out = _help("--config", "run_configs/alphabet_sort_cpu.toml", "--help", "task")
    assert _headers(out) == ["task"]
    assert "--task.max_names_per_turn int  (default: 5; TOML: 2)" in out


def test_whole_help_starts_with_an_index_of_the_sections():
    out = _help("--help")
    index = out.split("sections (--help SECTION", 1)[1].split("\n\n", 1)[0]
    for name in ("job", "model", "trainer.optimizer", "generator.sampling", "recorder"):
        assert f" {name}," in index or index.endswith(f" {name}"), name
    assert _headers(out)[:3] == ["job", "model", "warm_start"]


def test_an_unknown_help_section_is_one_error_line_listing_the_sections(capsys):
    from torchtitan_rl.config.help import print_help

    with pytest.raises(SystemExit) as exit_info:
        print_help(["--help", "trainer.optimiser"], usage="usage: x", description="d",
                   global_options=GLOBAL_OPTIONS)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: --help trainer.optimiser: no such section; the sections "
                               "are job, model, warm_start, task, ")
    assert "trainer.optimizer" in lines[0]


def test_help_for_an_agent_task_lists_its_episode_tasks_options():
    out = _help("--config", "run_configs/alphabet_sort_agent.toml", "--help", "task.episodes")
    assert "--task.episodes.min_turns int  (default: 1; TOML: 1)" in out
    assert "--task.episodes.max_names_per_turn" in out
    # named on the command line too, and the same from source and from the imported classes
    argv = ["--task.type", "torchtitan_rl.rollout.agent_task:AgentTask",
            "--task.episodes.type=examples.alphabet_sort:AlphabetSortTask"]
    assert "--task.episodes.min_turns int  (default: 1)" in _help(*argv, "--help", "task")
    types = {"task": "torchtitan_rl.rollout.agent_task:AgentTask",
             "task.episodes": "examples.alphabet_sort:AlphabetSortTask"}
    assert ([dataclasses.asdict(s) for s in static_sections(ROOT_CONFIG, types)]
            == [dataclasses.asdict(s) for s in live_sections(ROOT_CONFIG, types)])
