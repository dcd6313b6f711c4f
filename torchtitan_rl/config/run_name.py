"""What a run name may be: one folder name inside the output folder."""

from __future__ import annotations

from torchtitan_rl.config.errors import ConfigError


def check_run_name(key: str, name: str) -> None:
    """A run name is one folder name inside the output folder: one ConfigError line naming
    ``key`` and the value otherwise. Checked where the config is built (before a log file or a
    folder exists): "../x" would put the run beside the checkout, "" or "." make the output
    folder itself the run folder and ".." its parent (which `checkpoint.overwrite` would move
    aside); a leading "-" reads as an option to every shell tool."""
    problem = ("is empty" if not name.strip() else
               "is '.' or '..'" if name in (".", "..") else
               "contains a path separator" if "/" in name or "\\" in name else
               "contains a NUL byte" if "\0" in name else
               "starts with '-'" if name.startswith("-") else
               "has leading or trailing spaces" if name != name.strip() else None)
    if problem is not None:
        raise ConfigError(f"{key}: {name!r} {problem}; a run name is one folder name (the run "
                          f"folder is <output_dir>/<name>)")
