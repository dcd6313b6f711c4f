"""The quiet console: which lines reach the terminal, which only the run's log file, and the
upstream lines dropped at their source."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from torchtitan_rl import console
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import log_level

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_logging(monkeypatch):
    monkeypatch.delenv(console.LOG_LEVEL_ENV, raising=False)
    monkeypatch.delenv(console.LOG_FILE_ENV, raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.getLogger("torchtitan_rl").setLevel(logging.NOTSET)
    logging.captureWarnings(False)


def _emit() -> None:
    logging.getLogger("torchtitan_rl.metrics.logger").info("step=0 loss/value=0.1")
    logging.getLogger("torchtitan_rl.controller.loop").info(
        "validation step=0 reward=0.5000 +- 0.0100 (8 rollouts)", extra=console.CONSOLE)
    logging.getLogger("torchtitan_rl.controller.loop").warning("group 3 restarts")
    logging.getLogger("torchtitan_rl.train").error("traceback here", extra={"console": False})
    # An upstream library's warning (not vllm's logger here: once another test imported vllm,
    # vllm's own logging config stops its records from propagating to the root logger; in a
    # run, vLLM lives in the generator procs, whose stderr is the log file).
    logging.getLogger("an_upstream_library").warning("an upstream warning")
    logging.getLogger("torchtitan_rl.x").debug("a debug line")


def test_quiet_console_and_full_log_file(tmp_path, capsys, restore_logging):
    log_file = console.setup_run_logging(tmp_path / "run", "info", redirect=False)
    assert log_file == (tmp_path / "run" / "logs" / "train.log").resolve()
    assert os.environ[console.LOG_LEVEL_ENV] == "info"
    _emit()
    err = capsys.readouterr().err.splitlines()
    assert err == ["validation step=0 reward=0.5000 +- 0.0100 (8 rollouts)", "group 3 restarts"]
    text = log_file.read_text()
    for line in ("step=0 loss/value=0.1", "validation step=0", "group 3 restarts",
                 "traceback here", "an upstream warning"):
        assert line in text
    assert "a debug line" not in text


def test_debug_brings_every_line_to_the_console(tmp_path, capsys, restore_logging):
    console.setup_run_logging(tmp_path / "run", "debug", redirect=False)
    _emit()
    err = capsys.readouterr().err
    for line in ("step=0 loss/value=0.1", "validation step=0", "traceback here",
                 "an upstream warning", "a debug line"):
        assert line in err


def test_log_level_from_flag_or_env(monkeypatch):
    monkeypatch.delenv(console.LOG_LEVEL_ENV, raising=False)
    assert log_level(None) == "info" and log_level("DEBUG") == "debug"
    monkeypatch.setenv(console.LOG_LEVEL_ENV, "debug")
    assert log_level(None) == "debug" and log_level("info") == "info"
    with pytest.raises(ConfigError, match="log.level: expected one of 'info', 'debug', got 'loud'"):
        log_level("loud")


def test_known_harmless_vllm_lines_are_dropped_at_their_source(caplog):
    console.silence_known_upstream_noise()
    console.silence_known_upstream_noise()  # idempotent
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert sum(isinstance(f, console._DropMessages) for f in layerwise.filters) == 1
    with caplog.at_level(logging.INFO):
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "ParallelLMHead")  # not known harmless
        logging.getLogger("vllm.v1.core.block_pool").info("Successfully reset prefix cache")
        logging.getLogger("vllm.model_executor.model_loader.reload.inplace").info(
            "Reloading and processing weights took %.2f seconds", 0.01)
    assert [r.getMessage() for r in caplog.records] == ["ParallelLMHead: Failed to load weights"]


def test_monarch_actor_prefix_is_dropped_from_our_lines():
    formatter = console._Formatter("%(message)s")
    record = logging.LogRecord("torchtitan_rl.x", logging.INFO, __file__, 1,
                               "[actor=<root>] [actor=<root>] validation", None, None)
    record.actor_prefix = "[actor=<root>] "
    assert formatter.format(record) == "validation"


def test_file_descriptors_and_child_processes_go_to_the_log_file(tmp_path):
    """Whatever writes to fds 1 and 2 (print, C++ warnings, child processes such as Monarch
    procs, which inherit them) lands in the log file; the console keeps its own lines."""
    script = textwrap.dedent(f"""
        import logging, subprocess, sys
        from torchtitan_rl import console
        log = console.setup_run_logging({str(tmp_path / 'run')!r}, "info")
        print("a stray print")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); "
                        "print('child err', file=sys.stderr)"])
        logging.getLogger("transformers").warning("an upstream warning")
        console.console_line("run folder: somewhere")
        with console.progress_bar(total=2, desc="steps") as bar:
            bar.update(2)
        print("last line", file=console.console_out())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "last line\n"
    assert proc.stderr.startswith("run folder: somewhere\n")
    assert "steps: 100%" in proc.stderr
    for absent in ("stray", "child", "upstream"):
        assert absent not in proc.stdout + proc.stderr
    text = (tmp_path / "run" / "logs" / "train.log").read_text()
    for line in ("a stray print", "child out", "child err", "an upstream warning",
                 "run folder: somewhere"):
        assert line in text


def test_an_unexpected_failure_is_one_console_line_and_a_traceback_in_the_log(
        tmp_path, capsys, restore_logging):
    from torchtitan_rl.train import guarded

    log_file = console.setup_run_logging(tmp_path / "run", "info", redirect=False)

    def boom() -> int:
        raise RuntimeError("engine\nexploded")

    assert guarded(boom) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: RuntimeError: engine exploded (traceback: {log_file})"]
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: engine" in text
