"""The eval command line without an engine: every flag is used or refused in one line, --help lists
only what eval takes, --print-config / --print-resolved work and write nothing, and the eval's
folder is its own (never a training run's)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import tomli

from torchtitan_rl.eval.cli import check_eval_folder, cli, eval_folder, help_text
from torchtitan_rl.eval.options import uses

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO_ROOT / "run_configs" / "alphabet_sort_cpu.toml")


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty working directory: whatever the command writes (runs/...) shows up in it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):].strip()


def test_help_lists_only_what_eval_takes():
    text = help_text(["--config", CONFIG])
    for shown in ("--model HF_DIR", "--output_dir DIR", "--name NAME", "--pass-threshold X",
                  "--print-config", "--print-resolved", "--seed int",
                  "--validation.samples_per_prompt int  (default: 1; TOML: 4)",
                  "--task.max_names_per_turn int", "--generator.kv_cache_bytes int",
                  "--rollouter.max_rollout_tokens int", "--sampling.max_tokens int"):
        assert shown in text, shown
    for hidden in ("--trainer.", "--loop.", "--checkpoint.", "--model.path", "--warm_start.",
                   "--rollouter.advantage_std", "--validation.every_steps", "--placement.",
                   "--generator.weight_sync.", "--sampling.temperature", "--batcher."):
        assert hidden not in text, hidden
    assert "e.g. --help trainer" not in text
    assert len(text.splitlines()) < 200  # the job's help is ~450 lines
    section = help_text(["--help", "validation"])
    assert "--validation.temperature" in section and "--validation.every_steps" not in section


def test_help_of_a_training_section_is_one_error_line(capsys):
    message = _fails(["--help", "trainer"], capsys)
    assert message.startswith("--help trainer: no such section; the sections are job, task, ")


@pytest.mark.parametrize("flag, value", [
    ("--trainer.optimizer.lr", "1e-3"), ("--loop.num_steps", "3"),
    ("--checkpoint.overwrite", "true"), ("--validation.every_steps", "2"),
    ("--rollouter.advantage_std", "none"), ("--num_trainer_ranks", "2"),
])
def test_a_training_option_is_refused_naming_it(flag, value, workdir, capsys, tiny_model_dir):
    message = _fails(["--model", str(tiny_model_dir), flag, value], capsys)
    assert message.startswith(f"{flag[2:]}: a job's option that eval does not use")
    assert list(workdir.iterdir()) == []


def test_model_path_is_refused_for_model(workdir, capsys, tiny_model_dir):
    message = _fails(["--model.path", str(tiny_model_dir)], capsys)
    assert message.startswith("model.path: eval takes the model to evaluate as --model HF_DIR")
    assert list(workdir.iterdir()) == []


def test_a_bad_eval_name_is_refused_before_anything_is_written(workdir, capsys, tiny_model_dir):
    message = _fails(["--model", str(tiny_model_dir), "--name", "../x"], capsys)
    assert message.startswith("name: '../x' contains a path separator")
    assert list(workdir.iterdir()) == [] and not (workdir.parent / "x").exists()


def test_print_config_prints_the_keys_eval_uses_and_loads_back(workdir, capsys):
    cli(["--config", CONFIG, "--print-config", "--validation.num_prompts", "7"])
    out = capsys.readouterr().out
    assert out.startswith("# python -m torchtitan_rl.eval: the options eval uses")
    assert "eval folder: runs/alphabet_sort_cpu-eval" in out.splitlines()[0]
    data = tomli.loads(out)
    assert data["validation"] == {"num_prompts": 7, "samples_per_prompt": 4, "temperature": 1.0}
    assert "trainer" not in data and "loop" not in data and "model" not in data
    assert data["task"]["type"].endswith(":AlphabetSortTask")
    (workdir / "eval.toml").write_text(out)
    cli(["--config", str(workdir / "eval.toml"), "--print-config"])
    assert tomli.loads(capsys.readouterr().out) == data
    assert sorted(p.name for p in workdir.iterdir()) == ["eval.toml"]  # nothing else written


def test_print_resolved_shows_what_the_eval_gets(workdir, capsys, tiny_model_dir):
    cli(["--config", CONFIG, "--model", str(tiny_model_dir), "--print-resolved", "--seed", "3",
         "--name", "mine"])
    data = tomli.loads(capsys.readouterr().out)
    assert data["model_dir"] == str(tiny_model_dir) and data["eval_folder"] == "runs/mine"
    assert data["seed"] == 3 and data["generator"]["seed"] == 3
    assert data["generator"]["model_dir"] == str(tiny_model_dir)
    assert data["sampling"]["temperature"] == data["validation"]["temperature"] == 1.0
    assert data["sampling"]["seed"] == 3
    assert list(workdir.iterdir()) == []


def test_print_resolved_needs_the_model(workdir, capsys):
    assert _fails(["--print-resolved"], capsys).startswith("--model: name the HF model directory")


def test_the_eval_folder_is_its_own(tmp_path):
    from torchtitan_rl.config.errors import ConfigError
    from torchtitan_rl.controller.job import RLJob

    job = RLJob.Config(name="alphabet", output_dir=str(tmp_path))
    assert eval_folder(job, output_dir=None, name=None) == tmp_path / "alphabet-eval"
    assert eval_folder(RLJob.Config(), output_dir=None, name=None) == pathlib.Path("runs/run-eval")
    assert eval_folder(job, output_dir="elsewhere", name="x") == pathlib.Path("elsewhere/x")

    run_dir = tmp_path / "alphabet"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "hf").mkdir()
    with pytest.raises(ConfigError, match=r"^name: .*alphabet is a training run's folder \(it "
                                          r"holds checkpoints\)"):
        check_eval_folder(run_dir, tmp_path / "model")
    with pytest.raises(ConfigError, match="holds the model being evaluated"):
        check_eval_folder(tmp_path, run_dir / "hf")
    check_eval_folder(tmp_path / "alphabet-eval", run_dir / "hf")
    started = tmp_path / "started"  # a run killed before its first checkpoint: still a run's
    (started / "logs").mkdir(parents=True)
    (started / "logs" / "train.log").write_text("")
    with pytest.raises(ConfigError, match=r"is a training run's folder \(it holds logs/train.log"):
        check_eval_folder(started, run_dir / "hf")


def test_every_eval_key_is_a_job_key():
    from torchtitan_rl.config.convert import leaf_paths
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob
    from torchtitan_rl.eval.options import EVAL_KEYS

    keys = leaf_paths(RLJob.Config, instance=parse_args(RLJob.Config, ["--config", CONFIG]).config)
    for key in EVAL_KEYS:
        assert any(k == key or (key.endswith(".") and k.startswith(key)) for k in keys), key
    assert uses("task.max_turns") and uses("validation.num_prompts")
    assert not uses("model.path") and not uses("name") and not uses("sampling.temperature")


def test_the_eval_keys_are_what_the_eval_plan_reads(tiny_model_dir):
    """Each eval part is built from the job's resolve: a key eval refuses leaves them as is."""
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob
    from torchtitan_rl.eval.run import eval_plan

    config = parse_args(RLJob.Config, ["--config", CONFIG]).config
    plan = eval_plan(config, tiny_model_dir)
    assert plan.warm_start is None and plan.model_dir == str(tiny_model_dir)
    lr = dataclasses.replace(config.trainer.optimizer, lr=1.0)
    other = eval_plan(dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, optimizer=lr)), tiny_model_dir)
    for part in ("task", "validation", "rollouter", "sampling", "generators"):
        assert getattr(plan, part) == getattr(other, part), part
