"""What a task's own code did wrong, said in one line that points at it.

A task's environment, scorer or agent is user code: when it raises, returns a reward that is not
a finite number (NaN, a string, None), or returns something of the wrong type (``init()`` not a
list of messages, ``step()`` not an EnvStep), the rollout ends ERROR_ENV with ``Rollout.error``
set by ``describe_exception``, ``reward_value``, ``messages_value`` or ``env_step_value``, each
naming the call, the field and the user's file and line: never a silent zero. The training loop
counts these per step (``rollout/status/error_env``) and stops the run when too many rollouts
fail (``loop.max_task_error_fraction``, controller/loop/loop.py), so a broken task is reported on
its first step, not trained on silently.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

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
    """A task returned a reward that is not a finite number, or a value of the wrong type (the
    message says what, which field and where)."""


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


def _wrong(what: str, value: Any, required: str, source: Callable[..., Any] | None) -> NoReturn:
    where = f" at {function_site(source)}" if source is not None else ""
    raise RewardTypeError(f"{what} returned {value!r:.80} ({type(value).__name__}); {required} is "
                          f"required{where}")


def messages_value(value: Any, what: str, source: Callable[..., Any] | None = None
                 ) -> list[dict[str, Any]]:
    """``value`` (what ``init()`` returned, or an EnvStep's messages) as a list of chat messages,
    or RewardTypeError naming the message and field that is not one: a message is a dict with a
    string ``role`` and a string ``content``."""
    if not isinstance(value, list | tuple):
        _wrong(what, value, "a list of messages ({'role': str, 'content': str})", source)
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            _wrong(f"{what}[{i}]", message, "a message dict", source)
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                _wrong(f"{what}[{i}][{key!r}]", message.get(key), "a string", source)
    return list(value)


def env_step_value(value: Any, source: Callable[..., Any] | None = None) -> Any:
    """``value`` (what ``step()`` returned) when it is an EnvStep whose messages are messages and
    whose reward parts a dict; RewardTypeError naming the field otherwise (a reward part's value
    is checked by reward_value)."""
    from torchtitan_rl.rollout.message_env import EnvStep

    if not isinstance(value, EnvStep):
        _wrong("step()", value, "an EnvStep(messages=..., done=..., reward_parts=...)", source)
    messages_value(value.messages, "step() EnvStep.messages", source)
    if not isinstance(value.reward_parts, dict):
        _wrong("step() EnvStep.reward_parts", value.reward_parts,
               "a dict of part name -> number", source)
    if not isinstance(value.done, bool | int) and type(value.done).__name__ != "bool_":
        _wrong("step() EnvStep.done", value.done, "a bool", source)
    return value


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
