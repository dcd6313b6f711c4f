"""The placement run configs load and print, and bad placement input is one line naming the key.

Nothing here starts a host: ``--print-config`` and ``--print-resolved`` stop before the run (the
placement's checks run at resolve time)."""

from __future__ import annotations

import pathlib

import pytest
import tomli

from torchtitan_rl.config.manager import config_from_toml_text, parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.train import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """``python -m torchtitan_rl.train ARGV`` in this process, from the repo root: (exit code,
    stdout, stderr)."""
    monkeypatch.chdir(REPO_ROOT)
    try:
        cli(list(argv))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _check_process(placement: dict, printed: dict) -> None:
    assert placement["trainer_hosts"] == 1 and placement["generators_per_host"] == 1
    assert placement["workers"] == []
    assert printed["num_generators"] == 2  # one simulated host each, the trainer on a third
    assert printed["name"] == "alphabet_sort_process_hosts"


def _check_attach(placement: dict, printed: dict) -> None:
    assert placement["workers"] == ["tcp://node0:26600", "tcp://node1:26600"]
    assert printed["num_generators"] == 1  # 1 trainer host + 1 generator host = 2 workers


def _check_slurm(placement: dict, printed: dict) -> None:
    slurm = placement["slurm"]
    assert slurm["partition"] == "gpu" and slurm["time_limit"] == "04:00:00"
    assert slurm["gpus_per_node"] == 2 and slurm["exclusive"] is True
    assert placement["trainer_hosts"] == 1 and placement["generators_per_host"] == 1
    assert printed["num_trainer_ranks"] == 2 and printed["num_generators"] == 2
    assert printed["generator"]["dtype"] == "bfloat16"  # the GPU config's values came along


def _check_slurm_cpu(placement: dict, printed: dict) -> None:
    """The main job on the project's own cluster (scripts/slurm_cluster.py): the main job's
    values, on nodes."""
    assert placement["slurm"]["log_dir"] == "runs/slurm" and placement["slurm"]["partition"] == ""
    assert placement["trainer_hosts"] == 1 and placement["generators_per_host"] == 1
    assert printed["num_generators"] == 2 and printed["loop"]["num_steps"] == 60
    assert printed["task"]["type"].endswith(":AlphabetSortTask")


def _check_kubernetes(placement: dict, printed: dict) -> None:
    k8s = placement["kubernetes"]
    assert k8s["namespace"] == "rl" and k8s["port"] == 26600
    assert k8s["trainer_label_selector"] == "app=qwen3-rl,role=trainer"
    assert k8s["generators_label_selector"] == "app=qwen3-rl,role=generator"
    assert printed["num_trainer_ranks"] == 2 and printed["num_generators"] == 2


RUN_CONFIGS = {
    "run_configs/alphabet_sort_process_hosts.toml": ("process", _check_process),
    "run_configs/alphabet_sort_attach.toml": ("attach", _check_attach),
    "run_configs/qwen3_0.6b_slurm.toml": ("slurm", _check_slurm),
    "run_configs/alphabet_sort_slurm.toml": ("slurm", _check_slurm_cpu),
    "run_configs/qwen3_0.6b_kubernetes.toml": ("kubernetes", _check_kubernetes),
}


@pytest.mark.parametrize("run_config", sorted(RUN_CONFIGS))
def test_placement_run_config_prints_loadable_toml(run_config, monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "--config", run_config, "--print-config")
    assert code == 0, err
    printed = tomli.loads(out)
    kind, check = RUN_CONFIGS[run_config]
    assert printed["placement"]["kind"] == kind
    check(printed["placement"], printed)
    # the printed TOML loads back to the config the file describes
    assert config_from_toml_text(RLJob.Config, out) == parse_args(
        RLJob.Config, ["--config", run_config]).config


@pytest.mark.parametrize("run_config", ["run_configs/alphabet_sort_process_hosts.toml",
                                        "run_configs/alphabet_sort_attach.toml"])
def test_alphabet_sort_copies_differ_from_the_main_job_only_in_placement(run_config, monkeypatch,
                                                                         capsys):
    """They copy the main job's values (TOML has no include): this keeps the copies in step."""
    def printed(path: str) -> dict:
        code, out, err = _cli(monkeypatch, capsys, "--config", path, "--print-config")
        assert code == 0, err
        config = tomli.loads(out)
        for key in ("name", "num_generators", "placement"):
            config.pop(key)
        return config

    assert printed(run_config) == printed("run_configs/alphabet_sort_cpu.toml")


def test_process_hosts_print_resolved_exits_zero(monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "--config",
                          "run_configs/alphabet_sort_process_hosts.toml", "--print-resolved")
    assert code == 0, err
    resolved = tomli.loads(out)
    assert resolved["placement"]["kind"] == "process"
    assert len(resolved["generators"]) == 2


# --print-resolved runs the placement's checks without spawning anything (tiny offline model).
BASE = ["--config", "run_configs/alphabet_sort_cpu.toml", "--model.size", "tiny",
        "--warm_start.enabled", "false", "--num_generators", "1"]


@pytest.mark.parametrize("argv, key, message", [
    (["--placement.kind", "attach", "--placement.workers", "tcp://127.0.0.1:1"],
     "placement.workers", "has 1 addresses; this job needs 2"),
    (["--placement.workers", "tcp://x:1", "--placement.kind", "local"],
     "placement.workers", "is for kind 'attach'"),
    (["--placement.kind", "attach", "--placement.workers", "foo,bar"],
     "placement.workers[0]", "a worker address is tcp://HOST:PORT"),
    (["--placement.kind", "attach", "--placement.workers", "tcp://foo,tcp://bar:1"],
     "placement.workers[0]", "write tcp://HOST:PORT"),
    (["--placement.kind", "process", "--placement.host_timeout_s", "0"],
     "placement.host_timeout_s", "must be > 0"),
    (["--placement.kind", "local", "--placement.trainer_hosts", "2", "--num_trainer_ranks", "2"],
     "placement.trainer_hosts", "needs hosts"),
    (["--placement.kind", "process", "--placement.trainer_hosts", "2"],
     "placement.trainer_hosts", "num_trainer_ranks=1 must be a multiple"),
])
def test_bad_placement_is_one_error_line_naming_the_key(argv, key, message, monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, *BASE, *argv, "--print-resolved")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and key in lines[0] and message in lines[0], lines[0]


def test_help_documents_the_placement_options(monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "--config",
                          "run_configs/alphabet_sort_process_hosts.toml", "--help")
    assert code == 0, err
    for header in ("placement options:", "placement.slurm options:",
                   "placement.kubernetes options:"):
        assert f"\n{header}\n" in out, header
    out = " ".join(out.split())  # the help wraps to the terminal's width
    for line in [
        "--placement.kind 'local' | 'process' | 'attach' | 'slurm' | 'kubernetes'  "
        "(default: local; TOML: process)",
        "--placement.workers list[str]  (default: [])",
        "attach: worker addresses, the trainer's hosts first, then the generator hosts",
        "--placement.slurm.partition str  (default: '')",
        'Slurm partition ("" = the cluster\'s default).',
        "--placement.kubernetes.namespace str  (default: default)",
        "--num_generators int  (default: 1; TOML: 2)",
        "--generator_tensor_parallel_degrees list[int]  (default: [])",
    ]:
        assert " ".join(line.split()) in out, line
