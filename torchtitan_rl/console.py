"""A quiet console: what a person running a job sees, and where everything else goes.

By default (``--log.level info``) the console shows one line naming the run folder, a progress bar
for the warm start and one for the GRPO steps, one line per validation, warnings and errors of
this project, and the job's last line. Everything else (vLLM, Monarch, transformers, torch
warnings, the per-step metric lines, the actor processes' output) goes to
``<run folder>/logs/<command>.log``. ``--log.level debug`` (or ``TORCHTITAN_RL_LOG_LEVEL=debug``)
brings every line back to the console, with this project's DEBUG lines (fds 1 and 2 are left
alone then: the log file keeps this process's log records, the procs' output goes to the console).

How: before anything is spawned, file descriptors 1 and 2 of this process are pointed at the log
file, so whatever writes to them (C++ warnings, tqdm bars inside vLLM, print) lands there, and the
Monarch procs and torchrun ranks started afterwards inherit that file as their stdout/stderr. The
terminal stays reachable through duplicates of the original descriptors: `console_err` (bars and
lines) and `console_out` (the last line). A log record reaches the console when it carries
``extra=CONSOLE`` or is a warning or error of a ``torchtitan_rl`` logger.

An error is one console line of at most `ERROR_LINE_LIMIT` characters (`error_line`): what failed
(the actor call, the module) and the exception's last line, even when the error carries a remote
traceback (Monarch's ActorError, a supervision report); the whole text goes to the log file.

Actor processes call `configure_process_logging` once (it reads the level from the environment
this module sets) so their own INFO lines reach the log file and vLLM's known-harmless lines are
dropped at their source (`silence_known_upstream_noise`).
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import sys
import time
from typing import Any, TextIO

CONSOLE = {"console": True}
"""``logger.info(..., extra=CONSOLE)``: this line is for the console too (validation results)."""

LOG_LEVEL_ENV = "TORCHTITAN_RL_LOG_LEVEL"
LOG_FILE_ENV = "TORCHTITAN_RL_LOG_FILE"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_console_out: TextIO | None = None
_console_err: TextIO | None = None


def console_out() -> TextIO:
    """The terminal's stdout (the job's last line), whatever fd 1 points at now."""
    return _console_out or sys.stdout


def console_err() -> TextIO:
    """The terminal's stderr (progress bars, console lines, ``error:`` lines)."""
    return _console_err or sys.stderr


def console_line(text: str) -> None:
    """One line on the console, above any progress bar (and in the log file)."""
    logging.getLogger("torchtitan_rl").info(text, extra=CONSOLE)


def progress_bar(total: int, desc: str, **kwargs: Any) -> Any:
    """A tqdm bar on the console (the terminal even when fds 1 and 2 go to the log file)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=console_err(), dynamic_ncols=True, **kwargs)


class _Formatter(logging.Formatter):
    """Drops the ``[actor=<root>] `` prefix Monarch's log filter writes into every record's
    message once the controller runs as Monarch's root actor (once per handler: twice with a file
    and a console handler); the controller is the only actor of this process, so it says
    nothing."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        prefix = getattr(record, "actor_prefix", "")
        message = record.message
        while prefix and message.startswith(prefix):
            message = message[len(prefix):]
        saved, record.message = record.message, message
        try:
            return super().formatMessage(record)
        finally:
            record.message = saved


ERROR_LINE_LIMIT = 300
"""Most characters of an ``error:`` line (and of a quiet console's line about a failure)."""

_TRACEBACK = re.compile(r"Traceback (?:of where the remote call failed )?"
                        r"\(most recent call last\):")
_FRAME = re.compile(r'File "([^"]*)", line (\d+)')
_EXCEPTION = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)*[A-Z]\w*"
                        r"(?:Error|Exception|Exit|Interrupt|Failure|Warning|Fault)(?=: |:?$)")


def split_report(text: str) -> tuple[str, str, str | None]:
    """A failure's text (one line or many, with Python tracebacks in it, e.g. a remote one) as
    (what failed: the text before the first traceback, the exception's last line: what follows
    the last traceback's frames, where: ``file:line`` of the innermost frame or None). Without a
    traceback: (the text, "", None)."""
    folded = " ".join(text.split())
    tracebacks = list(_TRACEBACK.finditer(folded))
    if not tracebacks:
        return folded, "", None
    head = folded[:tracebacks[0].start()].strip(" :")
    tail = folded[tracebacks[-1].end():]
    frames = list(_FRAME.finditer(tail))
    where = None
    if frames:
        where = f"{pathlib.Path(frames[-1].group(1)).name}:{frames[-1].group(2)}"
        tail = tail[frames[-1].end():]
    exception = _EXCEPTION.search(tail)
    return head, (tail[exception.start():] if exception else tail).strip(), where


def short_report(text: str, limit: int = ERROR_LINE_LIMIT) -> str:
    """``text`` in at most ``limit`` characters on one line: what failed and the exception's
    last line, each clipped as needed."""
    head, last, _ = split_report(text)
    if not last:
        return _clip(head, limit)
    if not head:
        return _clip(last, limit)
    if len(head) + 2 + len(last) > limit:
        head = _clip(head, max(limit // 3, limit - len(last) - 2))
        last = _clip(last, limit - len(head) - 2)
    return f"{head.rstrip('.')}: {last}"


def error_line(error: BaseException, *, log_file: str | os.PathLike[str] | None = None,
               name_type: bool = True, limit: int = ERROR_LINE_LIMIT) -> str:
    """``error: <Type>: <what failed>: <the exception's last line> (traceback: <log file>)`` in
    at most ``limit`` characters; ``name_type`` False leaves the type out (an error whose text
    says it all, e.g. RunFailedError's ``actor mesh failure: ...``)."""
    suffix = f" (traceback: {log_file})" if log_file else ""
    budget = max(80, limit - len("error: ") - len(suffix))
    name = type(error).__name__
    text = str(error)
    if name_type:
        budget -= len(name) + 2
    body = short_report(text, budget) if text.strip() else ""
    if name_type:
        body = f"{name}: {body}" if body else name
    return f"error: {body or name}{suffix}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(0, limit - 3)].rstrip() + "..."


class _ConsoleHandler(logging.Handler):
    """Writes a record as one line above the progress bars (``tqdm.write``)."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        super().__init__()
        self.stream = stream
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        """Quiet: records marked ``console`` True, and this project's warnings and errors unless
        marked ``console`` False (a traceback the console shows as one ``error:`` line)."""
        console = getattr(record, "console", None)
        if self.quiet and not (console if console is not None else (
                record.levelno >= logging.WARNING and record.name.startswith("torchtitan_rl"))):
            return False
        return super().filter(record)

    def format(self, record: logging.LogRecord) -> str:
        """Quiet: a record about a failure (a traceback, a folded remote report) is one short
        line (the log file keeps the whole record); a multi-line record without a traceback
        (e.g. where every task waits) stays whole."""
        text = super().format(record)
        if self.quiet and (record.exc_info or _TRACEBACK.search(text) or (
                "\n" not in text and len(text) > ERROR_LINE_LIMIT)):
            return short_report(text)
        return text

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_run_logging(run_dir: pathlib.Path | str, level: str, *, command: str = "train",
                      redirect: bool = True) -> pathlib.Path:
    """Send this process's output to ``<run_dir>/logs/<command>.log`` (appended, one header line
    per invocation) and keep the console quiet (``level`` "info") or verbatim ("debug"). Returns
    the log file. ``redirect`` False keeps fds 1 and 2 (tests in one process)."""
    global _console_out, _console_err

    log_file = append_to_run_log(run_dir, command, "")
    quiet = level != "debug"
    if quiet and redirect and _console_err is None:
        sys.stdout.flush()
        sys.stderr.flush()
        _console_out = os.fdopen(os.dup(1), "w", buffering=1)
        _console_err = os.fdopen(os.dup(2), "w", buffering=1)
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    root = logging.getLogger()
    for handler in list(root.handlers):  # a second run in one process replaces its handlers
        if getattr(handler, "_torchtitan_rl", False):
            root.removeHandler(handler)
            handler.close()
    file_handler = logging.FileHandler(log_file)
    console = _ConsoleHandler(console_err(), quiet=quiet)
    console.setFormatter(_Formatter("%(message)s" if quiet else _FORMAT))
    file_handler.setFormatter(_Formatter(_FORMAT))
    for handler in (file_handler, console):
        handler._torchtitan_rl = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("torchtitan_rl").setLevel(logging.DEBUG if not quiet else logging.INFO)
    logging.captureWarnings(True)  # Python warnings: the log file, not the console
    os.environ[LOG_LEVEL_ENV] = level  # inherited by the Monarch procs and torchrun ranks
    os.environ[LOG_FILE_ENV] = str(log_file)
    silence_known_upstream_noise()
    return log_file


def append_to_run_log(run_dir: pathlib.Path | str, command: str, text: str) -> pathlib.Path:
    """Append this invocation's header line and ``text`` to ``<run_dir>/logs/<command>.log``
    (made as needed); returns the file. Also where a failure found before logging is set up
    (a task module that raised on import) leaves its traceback."""
    log_dir = pathlib.Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = (log_dir / f"{command}.log").resolve()
    with log_file.open("a") as f:
        f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                f"{' '.join(sys.argv)}\n{text}")
    return log_file


def configure_process_logging() -> None:
    """In an actor process (generator, trainer): log INFO lines of every logger to this process's
    stderr (the run's log file, inherited; the console with ``--log.level debug``) and drop the
    known-harmless upstream lines. Idempotent; does nothing to a process that configured logging
    already (a test, the controller)."""
    silence_known_upstream_noise()
    root = logging.getLogger()
    if root.handlers:
        return
    debug = os.environ.get(LOG_LEVEL_ENV, "info").lower() == "debug"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("torchtitan_rl").setLevel(logging.DEBUG if debug else logging.INFO)


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(s) for s in self.starts)


_SILENCED: list[tuple[str, tuple[str, ...]]] = [
    # Every weight push reloads the model in place; vLLM then warns for each module that got no
    # tensor from the pushed state dict. RotaryEmbedding holds only its cos/sin cache, a buffer
    # computed from the config and never part of a checkpoint, so vLLM keeps its own copy: correct,
    # and one alarming line per push.
    ("vllm.model_executor.model_loader.reload.layerwise",
     ("RotaryEmbedding: Failed to load weights",)),
    # Each push resets the prefix cache (weight_sync.reset_prefix_cache) and reloads: INFO lines
    # that say the push worked, one set per step (the push's own metrics say it too).
    ("vllm.v1.core.block_pool", ("Successfully reset prefix cache",)),
    ("vllm.model_executor.model_loader.reload.inplace",
     ("Reloading weights inplace", "Reloading and processing weights took")),
]


# HTTP clients that log every request at INFO: the `openai` client an agent task's episodes use
# (httpx2: a line per generate call) and the external-server GenerateFn (httpx). Per-request
# lines belong at debug level; failures still reach the log as the callers' own errors.
_PER_REQUEST_LOGGERS = ("httpx", "httpx2")


def silence_known_upstream_noise() -> None:
    """Filters on the upstream loggers themselves (their source), so the lines are dropped in
    every handler, file included; per-request loggers at WARNING. Idempotent."""
    for name in _PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, starts in _SILENCED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(*starts))
