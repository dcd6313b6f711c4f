"""Fault injection, for tests that must prove recovery from a hard crash.

``TORCHTITAN_RL_FAULT=kill_after_groups:N`` sends SIGKILL to the controller process right after
the N-th rollout group finishes (no cleanup, no checkpoint: the same as a node dying). Unset in
normal runs; reading one environment variable per group is the whole cost.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

_ENV = "TORCHTITAN_RL_FAULT"


def maybe_kill_after_groups(num_finished_groups: int) -> None:
    spec = os.environ.get(_ENV, "")
    if not spec.startswith("kill_after_groups:"):
        return
    if num_finished_groups == int(spec.split(":", 1)[1]):
        logger.warning("fault injection: SIGKILL after %d finished groups", num_finished_groups)
        os.kill(os.getpid(), signal.SIGKILL)
