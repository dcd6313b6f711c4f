"""Fault injection, for tests that must prove recovery from (or a clean failure on) a hard crash.

``TORCHTITAN_RL_FAULT=<point>:N`` sends SIGKILL to the process that reaches ``point`` for the N-th
time: no cleanup, no checkpoint, the same as a node dying. Points:

- ``kill_controller_after_groups``: the controller, right after the N-th rollout group finishes.
- ``kill_controller_after_checkpoints``: the controller, right after its N-th checkpoint is
  written (so a resume from step N is certain).
- ``kill_generator_after_requests``: a generator proc, when its N-th generate request arrives.
- ``kill_generator_mid_relay``: the generator at position 1 of the first relay chain (the push of
  policy version 1, attempt 0), when that push's N-th chunk reaches it, before it forwards it:
  the generators after it never get the rest (weight_sync/relay.py).
- ``kill_rollout_worker_after_groups``: the first rollout worker (index 0, never its
  replacement), when it has finished its N-th group, before it replies.
- ``kill_trainer_after_steps``: every proc of the run's first trainer, when its N-th optimizer
  step is done (a restarted trainer trains that step again and is spared).

``TORCHTITAN_RL_FAULT=hold_controller_at_validations:N`` holds the controller at the start of its
N-th validation (an await that never returns, so a signal's cancellation still reaches it): a test
sends SIGTERM or Ctrl-C in that phase for certain.

``TORCHTITAN_RL_FAULT=nan_loss_at_steps:1,3`` makes the trainer's loss NaN at those steps (policy
versions before the step), as a numerically broken batch would.

Unset in normal runs; reading one environment variable per event is the whole cost. Monarch procs
inherit the controller's environment, so one variable reaches every actor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Literal

logger = logging.getLogger(__name__)

ENV_VAR = "TORCHTITAN_RL_FAULT"
FaultPoint = Literal["kill_controller_after_groups", "kill_controller_after_checkpoints",
                     "kill_generator_after_requests", "kill_generator_mid_relay",
                     "kill_rollout_worker_after_groups", "kill_trainer_after_steps"]


def maybe_kill(point: FaultPoint, count: int) -> None:
    """SIGKILL this process if ``TORCHTITAN_RL_FAULT`` is ``point:count``."""
    if _due(point, count):
        logger.warning("fault injection: SIGKILL at %s=%d (pid %d)", point, count, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


async def maybe_hold(point: Literal["hold_controller_at_validations"], count: int) -> None:
    """Never return if ``TORCHTITAN_RL_FAULT`` is ``point:count`` (cancellation ends the wait)."""
    if _due(point, count):
        logger.warning("fault injection: holding at %s=%d (pid %d)", point, count, os.getpid())
        await asyncio.Event().wait()


def _due(point: str, count: int) -> bool:
    spec = os.environ.get(ENV_VAR, "")
    if not spec.startswith(point + ":"):
        return False
    try:
        target = int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected {point}:<int>") from None
    return count == target


def nan_loss_due(step: int) -> bool:
    """Whether ``TORCHTITAN_RL_FAULT=nan_loss_at_steps:a,b,...`` names ``step``."""
    spec = os.environ.get(ENV_VAR, "")
    point = "nan_loss_at_steps:"
    if not spec.startswith(point):
        return False
    try:
        steps = {int(x) for x in spec[len(point):].split(",") if x}
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected {point}<int>,<int>,...") from None
    return step in steps
