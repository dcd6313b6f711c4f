"""A run name is one folder name: a bad one is one ``error:`` line naming ``name`` and its value,
exit 2, before any folder or log file exists (pure config logic: nothing is spawned)."""

from __future__ import annotations

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.job import RLJob, check_run_name

BAD_NAMES = ["../x", "../../elsewhere", "a/b", "", " ", ".", "..", "a\\b", "a\0b", "-x", " x"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_name_is_one_line_and_nothing_is_written(name, tmp_path, monkeypatch, capsys):
    from torchtitan_rl.train import cli

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as exit_:
        cli([f"--name={name}", "--checkpoint.overwrite", "true"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: name: {name!r} ") and err.count("\n") == 1, err
    assert list(tmp_path.rglob("*")) == [work]  # no runs/, no logs/, nothing beside it


def test_the_config_refuses_a_bad_name_from_python_too():
    with pytest.raises(ConfigError, match=r"^name: '\.\.' is '\.' or '\.\.'; a run name is one "):
        RLJob.Config(name="..")


@pytest.mark.parametrize("name", ["run", "alphabet_sort_cpu", "qwen3_0.6b", "a-b", ".hidden"])
def test_ordinary_names_pass(name):
    check_run_name("name", name)
    assert RLJob.Config(name=name).run_dir.name == name
