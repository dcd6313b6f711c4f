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
    logging.getLogger("torchtitan_rl.controller.loop.loop").info(
        "validation step=0 reward=0.5000 +- 0.0100 (8 rollouts)", extra=console.CONSOLE)
    logging.getLogger("torchtitan_rl.controller.loop.loop").warning("group 3 restarts")
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


def test_http_clients_per_request_lines_stay_out_of_the_log(caplog):
    """The `openai` client logs each request at INFO (httpx2): an agent job's log would hold
    one line per generate call."""
    console.silence_known_upstream_noise()
    with caplog.at_level(logging.INFO):
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).info('HTTP Request: POST http://127.0.0.1/v1 "200 OK"')
            logging.getLogger(name).warning("connection refused")
    assert [r.getMessage() for r in caplog.records] == ["connection refused"] * 2


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


# ---- one error line, however long the remote traceback --------------------------------------
def _deep_error(depth: int = 60) -> ValueError:
    """A ValueError raised under ``depth`` distinct frames, chained to a KeyError (as a remote
    vLLM failure is: thousands of characters of traceback)."""
    source = "\n".join(
        [f"def f{i}():\n    return f{i + 1}()" for i in range(depth)]
        + [f"def f{depth}():\n    try:\n        {{}}['block_size']\n    except KeyError as e:\n"
           "        raise ValueError('No common block size for 17 (CPU_ATTN: "
           "[MultipleOf(32)]).') from e"])
    namespace: dict = {}
    exec(compile(source, "/opt/site-packages/vllm/v1/worker/utils.py", "exec"), namespace)
    try:
        namespace["f0"]()
    except ValueError as e:
        return e
    raise AssertionError("f0 did not raise")


def test_an_actor_error_with_a_long_remote_traceback_is_one_short_line():
    from monarch._src.actor.actor_mesh import ActorError

    error = ActorError(_deep_error(), "Actor call generator_0.start failed.")
    assert len(str(error)) > 4000
    line = console.error_line(error, log_file="/runs/x/logs/train.log")
    assert line == ("error: ActorError: Actor call generator_0.start failed: ValueError: No common "
                    "block size for 17 (CPU_ATTN: [MultipleOf(32)]). (traceback: "
                    "/runs/x/logs/train.log)")
    assert len(line) <= console.ERROR_LINE_LIMIT


# Monarch's report of an actor whose constructor raised (SupervisionError's text, measured), with
# more frames: what a run's failure summary (RunFailedError) folds into one line.
SUPERVISION_REPORT = """Endpoint call generator_0.start() failed, The actor <root>.<__main__.Dies \
generator_0{'procs': 0/1}> and all its descendants have failed:
  actor explicitly aborted due to: Traceback (most recent call last):
    File "/venv/site-packages/monarch/_src/actor/actor_mesh.py", line 1275, in _dispatch_loop
      await _handle_queued_message(actor, msg)
    File "/venv/site-packages/monarch/_src/actor/actor_mesh.py", line 1367, in handle
      self.instance = Class(*args, **kwargs)
                      ^^^^^^^^^^^^^^^^^^^^^^
""" + "".join(f"""    File "/work/torchtitan_rl/generator/generator.py", line {100 + i}, in build
      return build(depth - 1)
""" for i in range(40)) + """    [Previous line repeated 17 more times]
    File "/work/torchtitan_rl/generator/generator.py", line 9, in build
      raise ValueError(f"model dir {model_dir} has no config.json")
  ValueError: model dir /nope has no config.json"""


def test_a_supervision_error_report_is_one_short_line():
    class SupervisionError(RuntimeError):
        pass

    line = console.error_line(SupervisionError(SUPERVISION_REPORT))
    assert len(line) <= console.ERROR_LINE_LIMIT and "\n" not in line
    assert line.startswith("error: SupervisionError: Endpoint call generator_0.start() failed, ")
    assert line.endswith(": ValueError: model dir /nope has no config.json")
    # the run's summary: Monarch's report folded after "actor mesh failure: ", no type name
    from torchtitan_rl.controller.supervision import RunFailedError

    folded = RunFailedError("actor mesh failure: " + " ".join(SUPERVISION_REPORT.split()))
    line = console.error_line(folded, name_type=False)
    assert line.startswith("error: actor mesh failure: Endpoint call generator_0.start() ")
    assert line.endswith("ValueError: model dir /nope has no config.json")
    assert len(line) <= console.ERROR_LINE_LIMIT


def test_long_lines_without_a_traceback_are_clipped():
    line = console.error_line(RuntimeError("x" * 5000), log_file="/runs/x/logs/train.log")
    assert len(line) <= console.ERROR_LINE_LIMIT
    assert line.startswith("error: RuntimeError: xxx") and "...(traceback: " not in line
    assert line.endswith("... (traceback: /runs/x/logs/train.log)")
    assert console.error_line(RuntimeError()) == "error: RuntimeError"
    assert console.error_line(RuntimeError("engine\nexploded")) == (
        "error: RuntimeError: engine exploded")


def test_the_quiet_console_shows_a_failure_report_as_one_line(tmp_path, capsys,
                                                             restore_logging):
    log_file = console.setup_run_logging(tmp_path / "run", "info", redirect=False)
    log = logging.getLogger("torchtitan_rl.controller.supervision")
    log.error("actor mesh failure: %s", " ".join(SUPERVISION_REPORT.split()))
    try:
        raise _deep_error()
    except ValueError:
        log.error("push failed", exc_info=True)
    long_line = "generator_0 was lost: " + "why " * 200
    log.warning(long_line)
    waits = "where the run waits:\nStack for <Task pending> (most recent call last):\n  File x"
    log.warning(waits)  # several lines, no traceback: whole
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("actor mesh failure: Endpoint call generator_0.start() failed")
    assert lines[0].endswith("ValueError: model dir /nope has no config.json")
    assert lines[1] == ("push failed: ValueError: No common block size for 17 (CPU_ATTN: "
                        "[MultipleOf(32)]).")
    assert lines[2].startswith("generator_0 was lost: why why") and lines[2].endswith("...")
    assert all(len(line) <= console.ERROR_LINE_LIMIT for line in lines[:3])
    assert err.endswith(waits + "\n")
    text = log_file.read_text()  # the log file keeps every record whole
    assert "Previous line repeated 17 more times" in text and "KeyError: 'block_size'" in text
    assert long_line in text


def test_a_task_module_that_raises_on_import_is_one_line_and_a_traceback_in_the_run_log(
        tmp_path, capsys, monkeypatch):
    from torchtitan_rl.train import cli

    (tmp_path / "raising_task_module.py").write_text(textwrap.dedent('''
        import json

        def _load_names():
            return json.loads("{not json")

        NAMES = _load_names()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "raising_task_module", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli(["--task.type", "raising_task_module:Task", "--output_dir", str(tmp_path / "runs"),
             "--name", "r1"])
    assert exit_info.value.code == 2
    log_file = (tmp_path / "runs" / "r1" / "logs" / "train.log").resolve()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: task.type: importing 'raising_task_module:Task' raised JSONDecodeError: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
        f"(raising_task_module.py:5) (traceback: {log_file})"]
    assert len(lines[0]) <= console.ERROR_LINE_LIMIT
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text
    assert 'raising_task_module.py", line 7, in <module>' in text


def test_a_module_that_does_not_parse_is_one_line_in_help_and_run(tmp_path, capsys,
                                                                   monkeypatch):
    from torchtitan_rl.train import cli

    (tmp_path / "unparsable_task_module.py").write_text("def broken(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for argv in (["--help", "task"], ["--output_dir", str(tmp_path / "runs")]):
        with pytest.raises(SystemExit) as exit_info:
            cli(["--task.type", "unparsable_task_module:Task", *argv])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "error: task.type: importing 'unparsable_task_module:Task' raised SyntaxError: "
            "invalid syntax (unparsable_task_module.py:1)"), lines


@pytest.mark.slow
def test_a_real_actor_error_through_the_run_guard_is_one_line(tmp_path, capsys, restore_logging):
    """A Monarch actor whose endpoint raises under a deep stack: the ActorError the controller
    gets is what `guarded` prints, in one line, the traceback in the log file."""
    import asyncio

    from tests.config.raising_actor import call_raising_actor
    from torchtitan_rl.train import guarded

    log_file = console.setup_run_logging(tmp_path / "run", "info", redirect=False)
    assert guarded(lambda: asyncio.run(call_raising_actor())) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: ActorError: Actor call generator_0.start failed: ValueError: No common block "
        f"size for 17 (CPU_ATTN: [MultipleOf(32)]). (traceback: {log_file})"]
    assert "Traceback of where the remote call failed" in log_file.read_text()
