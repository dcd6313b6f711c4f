"""Fault injection: production code passes named points, tests configure what happens there.

Production code calls ``faults.point(name, count)`` where something a test may break happens
(``await faults.point_async(...)`` where the fault is a hold). With ``TORCHTITAN_RL_FAULT``
unset, a call is one environment lookup. A test sets ``TORCHTITAN_RL_FAULT=<fault>:<arg>``; each
fault acts at one point:

| fault (``<fault>:N``)              | point                                | action                  |
|------------------------------------|--------------------------------------|-------------------------|
| kill_controller_after_groups       | controller.group_finished            | SIGKILL at the N-th     |
| kill_controller_after_checkpoints  | controller.checkpoint_written        | SIGKILL at the N-th     |
| hold_controller_at_validations     | controller.validation_started        | hold at the N-th        |
| kill_generator_after_requests      | generator.request_received           | SIGKILL at the N-th     |
| kill_generator_mid_relay           | generator.relay_chunk_received       | SIGKILL at the N-th     |
|                                    | (key: position 1 of the chain, the push of policy version 1, attempt 0) |  |
| kill_rollout_worker_after_groups   | rollout_worker.group_finished        | SIGKILL at the N-th     |
|                                    | (key: the pool's first worker, never its replacement)                   |  |
| kill_trainer_after_steps           | trainer.optimizer_step_done          | SIGKILL at the N-th     |
|                                    | (key: restart 0, the run's first trainer: a restarted one is spared)    |  |
| nan_loss_at_steps (``:1,3``)       | trainer.loss                         | point() returns True    |

The count is the caller's (groups finished, checkpoints written, the trainer's policy version) or,
where the caller passes none, the number of times this process reached the point with the fault's
key. SIGKILL means no cleanup, no checkpoint: the same as a node dying. A hold is an await that
never returns, so a signal's cancellation still reaches it (a test sends SIGTERM or Ctrl-C in that
phase for certain). Monarch procs inherit the controller's environment, so one variable reaches
every actor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
from typing import Any, Literal

logger = logging.getLogger(__name__)

ENV_VAR = "TORCHTITAN_RL_FAULT"

PointName = Literal[
    "controller.group_finished", "controller.checkpoint_written",
    "controller.validation_started", "generator.request_received",
    "generator.relay_chunk_received", "rollout_worker.group_finished",
    "trainer.optimizer_step_done", "trainer.loss",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    point: PointName
    action: Literal["kill", "hold", "flag"]
    key: Any = None
    """Only calls with this key count (None: every call)."""
    many: bool = False
    """The argument is a comma-separated list of counts (else one count)."""


FAULTS: dict[str, Fault] = {
    "kill_controller_after_groups": Fault("controller.group_finished", "kill"),
    "kill_controller_after_checkpoints": Fault("controller.checkpoint_written", "kill"),
    "hold_controller_at_validations": Fault("controller.validation_started", "hold"),
    "kill_generator_after_requests": Fault("generator.request_received", "kill"),
    "kill_generator_mid_relay": Fault("generator.relay_chunk_received", "kill", key=(1, 1, 0)),
    "kill_rollout_worker_after_groups": Fault("rollout_worker.group_finished", "kill", key=True),
    "kill_trainer_after_steps": Fault("trainer.optimizer_step_done", "kill", key=0),
    "nan_loss_at_steps": Fault("trainer.loss", "flag", many=True),
}

_calls: collections.Counter[tuple[str, Any]] = collections.Counter()
"""Calls per (point, key) in this process, counted only while a fault is configured."""


def point(name: PointName, count: int | None = None, *, key: Any = None) -> bool:
    """Production code reached point ``name`` (the ``count``-th time; None: the seam counts
    this process's calls with this ``key``). SIGKILLs this process when a kill fault is due here;
    returns True when a flag fault is due here (the caller breaks its own result)."""
    due = _due(name, count, key)
    return due is not None and due[0].action == "flag"


async def point_async(name: PointName, count: int | None = None, *, key: Any = None) -> None:
    """As ``point``, where the fault may be a hold: one due here never returns (cancellation
    ends the wait)."""
    due = _due(name, count, key)
    if due is not None and due[0].action == "hold":
        logger.warning("fault injection: holding at %s=%d (pid %d)", due[1], due[2], os.getpid())
        await asyncio.Event().wait()


def _due(name: str, count: int | None, key: Any) -> tuple[Fault, str, int] | None:
    """The fault due at this call, with its name and the count; a kill happens here."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return None
    fault_name, _, arg = spec.partition(":")
    fault = FAULTS.get(fault_name)
    if fault is None:
        raise ValueError(f"{ENV_VAR}={spec!r}: unknown fault {fault_name!r} "
                         f"(one of {', '.join(FAULTS)})")
    if fault.point != name or (fault.key is not None and fault.key != key):
        return None
    try:
        targets = {int(x) for x in arg.split(",") if x} if fault.many else {int(arg)}
    except ValueError:
        form = "<int>,<int>,..." if fault.many else "<int>"
        raise ValueError(f"{ENV_VAR}={spec!r}: expected {fault_name}:{form}") from None
    if count is None:
        _calls[(name, key)] += 1
        count = _calls[(name, key)]
    if count not in targets:
        return None
    if fault.action == "kill":
        logger.warning("fault injection: SIGKILL at %s=%d (pid %d)", fault_name, count,
                       os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    return fault, fault_name, count
