"""Does a resumed run train as the checkpoint's run did? Each checkpoint saves the run's config
(`JOB_CONFIG_FILE`, one dotted key a line, before the commit marker); a resume compares it with
its own and refuses a change to any key not in `RESUME_MAY_CHANGE` unless told to.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

from torchtitan_rl.config.convert import current_type_path
from torchtitan_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

JOB_CONFIG_FILE = "job_config.json"

RESUME_MAY_CHANGE: tuple[str, ...] = (
    "name", "output_dir",                  # where the run folder is (a moved folder resumes)
    "loop.num_steps",                      # extend (or end early) a run: no schedule reads it
    "loop.max_skipped_steps_in_row",       # when skipped steps fail the run, not what trains
    "validation.every_steps",              # how often to validate; what is measured stays
    "checkpoint.",                         # how often, how many kept, resume, export, this list
    "metrics.", "recorder.",               # what is logged and recorded
    "trainer.debug_batch_log",             # a debug log of the batches
    "placement.",                          # which hosts run the parts
    "rollouter.num_workers",               # which processes run the rollouts (same seeds)
    "generator.max_restarts",              # how often a lost generator is replaced
    "trainer.max_restarts",                # how often a lost trainer is restarted
    "verify_weight_push",                  # a read-back check of each push
    "model.assets_dir", "warm_start.cache_dir",  # where caches live (keyed by what made them)
)
"""The keys a resumed run may change without ``checkpoint.allow_config_change``: an allow-list
(a key ending in "." covers its section), so a key added later is checked until it is listed
here. Each changes where the run writes, what it logs or how it survives failures, never the
steps it trains: the lr warm-up counts optimizer steps from 0 and nothing decays towards
``loop.num_steps``, so extending a run trains the steps the longer run would have."""


def flat_config(config: Any) -> dict[str, Any]:
    """A config tree as ``{dotted.key: value}`` (TOML-able values, None kept; a polymorphic field
    gives its ``type`` key): what is saved with each checkpoint and compared on resume."""
    from torchtitan_rl.config.convert import (
        is_config_class,
        is_polymorphic,
        resolved_fields,
        to_data,
        type_path_of,
    )

    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if is_polymorphic(type(node)) and getattr(type(node), "_owner", None) is not None:
            out[f"{prefix}type"] = type_path_of(node)
        for name, _, _ in resolved_fields(type(node)):
            value = getattr(node, name)
            if is_config_class(type(value)):
                walk(value, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = None if value is None else to_data(value)

    walk(config, "")
    return out


def may_change_on_resume(key: str) -> bool:
    return any(key == allowed or (allowed.endswith(".") and key.startswith(allowed))
               for allowed in RESUME_MAY_CHANGE)


def config_changes(saved: dict[str, Any],
                   current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for each key whose value differs. A key only one side
    has is not a change: the code that wrote the checkpoint had no such field (or has it no
    more), and its default is what that code ran with."""
    saved = {key: current_type_path(value) if key.endswith("type") and isinstance(value, str)
             else value for key, value in saved.items()}
    return [(key, saved[key], current[key]) for key in current
            if key in saved and saved[key] != current[key]]


def check_resume_config(directory: pathlib.Path, job_config: dict[str, Any], *,
                        allow_change: bool) -> None:
    """Refuse (one ConfigError line) to resume ``directory`` with ``job_config`` where it trains
    differently from the checkpoint's, unless ``allow_change``; log the changes let through."""
    path = directory / JOB_CONFIG_FILE
    if not path.is_file():
        logger.warning("resume: %s has no %s (written before configs were saved): the "
                       "config cannot be compared with the checkpoint's", directory,
                       JOB_CONFIG_FILE)
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.resume: cannot read {path}: {e}") from None
    changes = config_changes(saved, job_config)
    refused = [c for c in changes if not may_change_on_resume(c[0])]
    for key, old, new in changes:
        if (key, old, new) not in refused:
            logger.info("resume: %s changed %r -> %r", key, old, new)
    if not refused:
        return
    listed = ", ".join(f"{key} ({old!r} -> {new!r})" for key, old, new in refused)
    if not allow_change:
        raise ConfigError(
            f"checkpoint.resume: the config differs from the checkpoint's ({directory}) in "
            f"{listed}, which change training: restore them, pass --checkpoint."
            f"allow_config_change true to resume anyway, or choose another --name")
    logger.warning("checkpoint.allow_config_change: resuming %s with %s", directory, listed)
