"""What a task's own code did wrong, said in one line that points at it.

A task's environment, scorer or agent is user code: when it raises, or returns a reward that is not
a number, the rollout ends ERROR_ENV with ``Rollout.error`` set by ``describe_exception`` or
``reward_value``, both naming the user's file and line. The training loop counts these per step
and stops the run when too many rollouts fail (``loop.max_env_error_fraction``,
controller/loop/loop.py), so a broken task is reported on its first step, not trained on
silently.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import traceback
from collections.abc import Callable
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def exception_site(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside this package (the
    task's code), else the innermost frame; "" without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
    frame = (outside or frames)[-1]
    return f"{_short(frame.filename)}:{frame.lineno}"


def function_site(function: Callable[..., Any]) -> str:
    """``file:line (Qualified.name)`` where ``function`` is defined; its name alone when its source
    cannot be found."""
    function = inspect.unwrap(function)
    name = getattr(function, "__qualname__", repr(function))
    try:
        path = inspect.getsourcefile(function)
        line = inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        return name
    return f"{_short(path)}:{line} ({name})" if path else name


def describe_exception(what: str, exc: BaseException) -> str:
    """``<what> raised ValueError('...') at pkg/env.py:42``: Rollout.error of a failed call."""
    site = exception_site(exc)
    return f"{what} raised {exc!r:.200}" + (f" at {site}" if site else "")


class RewardTypeError(ValueError):
    """A task returned a reward that is not a finite number (the message says what and where)."""


def reward_value(value: Any, what: str, source: Callable[..., Any] | None = None) -> float:
    """``value`` as a float reward, or ValueError saying what came back and where from: a reward
    is an int or float (numpy's too), finite; not a bool, a string or None."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number):
            return number
    where = f" at {function_site(source)}" if source is not None else ""
    raise RewardTypeError(f"{what} returned {value!r:.80} ({type(value).__name__}); a finite int or "
                     f"float is required{where}")


def summarise_task_errors(errors: list[str], num_rollouts: int) -> str:
    """``3 of 32 rollouts failed in the task: <the most frequent error> (x2), and 1 other``."""
    counts: dict[str, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    top, top_count = max(counts.items(), key=lambda item: item[1])
    others = len(errors) - top_count
    return (f"{len(errors)} of {num_rollouts} rollouts failed in the task: {top}"
            + (f" (x{top_count})" if top_count > 1 else "")
            + (f", and {others} other{'s' if others > 1 else ''}" if others else ""))
