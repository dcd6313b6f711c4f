"""Resolve a run's config from its layers: defaults < TOML file < command-line overrides.

    python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml \\
        --trainer.optimizer.lr 1e-5 --checkpoint.resume must --print-config

Overrides are dotted paths into the config tree, typed by the dataclass annotations (lists are
comma-separated, a bare bool flag means true). ``--print-config`` prints the tree the user wrote
(defaults < TOML < CLI) as TOML, which loads back to an equal config; ``--print-resolved`` prints
what each part of the run gets (see controller/job.py).

A polymorphic field's ``type`` (``--task.type``) is applied before the other overrides, so the
command line can set the settings of the class it names.

``--help`` is not parsed here: the CLIs answer it before importing the config tree
(config/help.py reads the options from source). ``--log.level`` is a console setting, not part of
the config (it never changes what a run computes), so it is parsed here but kept out of the tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Any, TypeVar

import tomli
import tomli_w

from torchtitan_rl.config.convert import (
    dataclass_from_data,
    leaf_paths,
    moved_paths,
    parse_cli_value,
    polymorphic_type_paths,
    to_data,
    type_name,
    unknown_key_error,
)
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.run_name import check_run_name

ConfigT = TypeVar("ConfigT")


class _RaisingArgumentParser(argparse.ArgumentParser):
    """argparse, but errors raise ConfigError (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


LOG_LEVELS = ("info", "debug")
LOG_LEVEL_ENV = "TORCHTITAN_RL_LOG_LEVEL"

GLOBAL_OPTIONS: list[tuple[str, str]] = [
    ("-h, --help [SECTION]", "show this help (each option's type, default and docstring) and "
                             "exit; with a SECTION (e.g. trainer, generator.sampling), only that "
                             "section and its subsections"),
    ("--config TOML", "a run config file (defaults < TOML < command line); its values are "
                      "shown beside the defaults below"),
    ("--print-config", "print the config as written (defaults < TOML < CLI) as TOML and exit"),
    ("--print-resolved", "print what each part of the run gets, resolved, and exit"),
    ("--log.level info | debug", "info (default): a quiet console (the run folder, progress "
                                 "bars, validations, the last line), every log line in "
                                 "<run folder>/logs/; debug: every line on the console (and "
                                 f"our DEBUG lines). Also the env var {LOG_LEVEL_ENV}."),
]


@dataclasses.dataclass(kw_only=True, slots=True)
class ParsedArgs:
    config: Any
    """The fully resolved root config."""
    print_config: bool = False
    print_resolved: bool = False
    config_file: str | None = None
    log_level: str | None = None
    """``--log.level`` (None: not given; see `log_level`)."""


def log_level(given: str | None) -> str:
    """The console log level: ``--log.level``, else the env var, else "info"."""
    import os

    level = (given or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"log.level: expected one of {', '.join(map(repr, LOG_LEVELS))}, got "
                          f"{level!r}")
    return level


def load_toml(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a TOML file; a missing file or a syntax error names the file (and line)."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(
            f"{path}:{e.lineno}:{e.colno}: invalid TOML: {e.msg}"
        ) from None


def config_from_toml_text(root_cls: type[ConfigT], text: str, base: ConfigT | None = None) -> ConfigT:
    try:
        data = tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"<string>:{e.lineno}:{e.colno}: invalid TOML: {e.msg}") from None
    return dataclass_from_data(root_cls, data, base=base if base is not None else root_cls())


def config_to_toml(config: Any) -> str:
    """``config`` as TOML, with the comments its class lists in ``toml_comments`` (a dotted
    table or key -> one line of text) above the table header or key they are about."""
    return annotate_toml(tomli_w.dumps(to_data(config)),
                         getattr(type(config), "toml_comments", None) or {})


def annotate_toml(text: str, comments: dict[str, str]) -> str:
    """``text`` (tomli_w's output) with ``# comment`` lines above the tables (``[a.b]``,
    ``[[a]]``: every entry of the list) or keys that ``comments`` names by dotted path."""
    if not comments:
        return text
    out: list[str] = []
    table = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            table = stripped.strip("[]").strip()
            path = table
        else:
            key = stripped.split("=", 1)[0].strip() if "=" in stripped else None
            path = f"{table}.{key}" if table and key else key
        if path is not None and path in comments:
            out += [f"# {part}" for part in comments[path].splitlines()]
        out.append(line)
    return "\n".join(out) + "\n"


def apply_overrides(config: ConfigT, overrides: dict[str, Any]) -> ConfigT:
    """Set typed leaf values at dotted paths, e.g. ``{"trainer.optimizer.lr": 1e-5}``."""
    nested: dict[str, Any] = {}
    for path, value in overrides.items():
        node = nested
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return dataclass_from_data(type(config), nested, base=config)


def add_checkout_to_import_path(config_file: str | pathlib.Path) -> pathlib.Path | None:
    """Put the checkout a run config lives in (the nearest folder above the file with a
    ``pyproject.toml`` or ``.git``) first on the import path of this process and, through
    PYTHONPATH, of the processes the run starts: the task classes the config names
    (``examples.alphabet_sort:AlphabetSortTask``) import from any working directory. A regular
    package there wins over a namespace package of the same name in site-packages (torchmonarch
    installs one named ``examples``). Returns the folder (None: the file is in no checkout)."""
    folder = pathlib.Path(config_file).resolve().parent
    for candidate in (folder, *folder.parents):
        if (candidate / "pyproject.toml").is_file() or (candidate / ".git").exists():
            break
    else:
        return None
    root = str(candidate)
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return candidate


def parse_args(
    root_cls: type[ConfigT], argv: list[str], defaults: ConfigT | None = None
) -> ParsedArgs:
    """Resolve ``argv`` into a root config of type ``root_cls`` (raises ConfigError)."""
    config = defaults if defaults is not None else root_cls()
    # First pass: the TOML file and the polymorphic ``type`` keys, which decide the other keys.
    type_keys = polymorphic_type_paths(root_cls)
    first = _parser(root_cls, {p: str for p in type_keys})
    args, _ = first.parse_known_args(argv)
    if args._config_file:
        add_checkout_to_import_path(args._config_file)
        config = dataclass_from_data(root_cls, load_toml(args._config_file), base=config)
    types_given = {p: getattr(args, p) for p in type_keys if getattr(args, p) is not None}
    if types_given:
        config = apply_overrides(config, types_given)

    leaves = leaf_paths(root_cls, instance=config)
    parser = _parser(root_cls, leaves)
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            hint = moved_paths(root_cls).get(key)
            if hint is not None:
                raise ConfigError(f"{key} (command line): {hint}")
            raise unknown_key_error(key, list(leaves), where=" (command line)")
        raise ConfigError(f"unexpected command-line argument {token!r}")
    overrides = {
        path: parse_cli_value(leaves[path], getattr(args, path), path)
        for path in leaves
        if getattr(args, path) is not None and path not in types_given
    }
    if overrides:
        config = apply_overrides(config, overrides)
    if args._log_level is not None:
        log_level(args._log_level)  # a bad value is a one-line error now, before anything runs
    return ParsedArgs(
        config=config, print_config=args._print_config, print_resolved=args._print_resolved,
        config_file=args._config_file, log_level=args._log_level,
    )


def config_error_line(error: ConfigError, root_cls: type, argv: list[str], *,
                      command: str = "train") -> str:
    """The ``error:`` line for a config error of ``argv``. One caused by another exception (a
    task module that raised on import) appends that traceback to the run's log file
    (`run_dir_hint`) and names the file."""
    import traceback

    line = f"error: {error}"
    cause = error.__cause__
    run_dir = run_dir_hint(root_cls, argv) if cause is not None else None
    if cause is None or run_dir is None:
        return line
    from torchtitan_rl.console import append_to_run_log

    try:
        log_file = append_to_run_log(run_dir, command, "".join(
            traceback.format_exception(type(cause), cause, cause.__traceback__)))
    except OSError:  # an unwritable output folder: the line alone
        return line
    return f"{line} (traceback: {log_file})"


def run_dir_hint(root_cls: type, argv: list[str]) -> pathlib.Path | None:
    """The run folder ``argv`` names, read without building its config (which may have just
    failed): ``--name`` / ``--output_dir``, else the ``--config`` TOML's, else the defaults.
    None when the name is not one plain folder name."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--name")
    parser.add_argument("--output_dir")
    args, _ = parser.parse_known_args(argv)
    data: dict[str, Any] = {}
    if args.config:
        try:
            data = load_toml(args.config)
        except ConfigError:
            pass
    default = root_cls()
    name = args.name or data.get("name") or getattr(default, "name", None)
    output_dir = args.output_dir or data.get("output_dir") or getattr(default, "output_dir", None)
    if not (isinstance(name, str) and isinstance(output_dir, str)):
        return None
    try:
        check_run_name("name", name)
    except ConfigError:
        return None
    return pathlib.Path(output_dir) / name


def _parser(root_cls: type, leaves: dict[str, Any]) -> _RaisingArgumentParser:
    parser = _RaisingArgumentParser(
        prog="python -m torchtitan_rl.train", allow_abbrev=False, add_help=False
    )
    parser.add_argument("--config", dest="_config_file", metavar="TOML", default=None)
    parser.add_argument("--print-config", dest="_print_config", action="store_true")
    parser.add_argument("--print-resolved", dest="_print_resolved", action="store_true")
    parser.add_argument("--log.level", dest="_log_level", default=None)
    for path, tp in leaves.items():
        kwargs: dict[str, Any] = dict(dest=path, default=None, metavar=type_name(tp))
        if tp is bool:
            kwargs.update(nargs="?", const="true")
        parser.add_argument(f"--{path}", **kwargs)
    return parser
