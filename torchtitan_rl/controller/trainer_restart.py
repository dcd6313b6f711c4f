"""A trainer rank lost inside the run: a new trainer mesh, restored from the newest checkpoint.

    job: watch.run_until_failure(the run) raises TrainerLostError (or a call to the dead trainer
         fails: lost_the_trainer waits for Monarch's report naming its mesh)
      -> restart_trainer(plan, parts, watch, restart=n):
           the lost mesh's procs stopped (bounded); a new one spawned on the same hosts
           (``policy_trainer_r<n>``) from the run's model; the watch follows the new mesh
           the newest complete checkpoint (or the run's start) -> ControllerState
           step logs past it dropped; metrics reopened (TensorBoard purges past it)
           continue_from(rewind=True): checkpoint restored into the trainer, every generator
           aborts and goes back to its version, its weights pushed
      -> the job runs the loop again from that state (trainer.max_restarts bounds it)

A resumed run (a rerun after the controller died) continues the same way (controller/resume.py),
without the rewind: its generators are new.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time

from torchtitan_rl.console import CONSOLE, short_report
from torchtitan_rl.controller.checkpoint.checkpointer import (
    ControllerState,
    latest_complete_checkpoint,
)
from torchtitan_rl.controller.fleet.generator_pool import SPAWN_TIMEOUT_S, STOP_TIMEOUT_S
from torchtitan_rl.controller.loop.loop import RunParts
from torchtitan_rl.controller.resolved_job import ResolvedJob
from torchtitan_rl.controller.resume import continue_from
from torchtitan_rl.controller.spawn import spawn_trainer_procs
from torchtitan_rl.controller.supervision import MeshFailureWatch, TrainerLostError
from torchtitan_rl.monarch_failures import is_supervision_error
from torchtitan_rl.trainer.trainer import MonarchTrainerClient

logger = logging.getLogger(__name__)

SUPERVISION_REPORT_WAIT_S = 30.0
"""How long a run whose call hit a dead actor waits for Monarch's report naming the mesh (it polls
every second; a loaded box can take tens of seconds)."""


async def lost_the_trainer(watch: MeshFailureWatch, error: Exception) -> bool:
    """Whether ``error`` ended the run's work because the watched trainer mesh died (a call to
    it can fail before Monarch's report names the mesh: wait for the report then)."""
    if isinstance(error, TrainerLostError):
        return True
    if watch.trainer_mesh is None or not is_supervision_error(error):
        return False
    await watch.wait_for_failure(timeout_s=SUPERVISION_REPORT_WAIT_S)
    return watch.trainer_lost is not None and not watch.failures


async def restart_trainer(plan: ResolvedJob, parts: RunParts, watch: MeshFailureWatch, *,
                          restart: int) -> ControllerState:
    """A new trainer mesh for the lost one, restored to what the run continues from: the newest
    complete checkpoint (or the run's start). The step logs past it are dropped (those steps
    are trained again, and each is logged once); the generators go back to its version after
    the restore (a generator replaced meanwhile gets the restored weights)."""
    start = time.perf_counter()
    logger.warning("trainer lost: %s; restarting it (%d of trainer.max_restarts=%d)",
                   short_report(watch.trainer_lost or ""), restart, plan.trainer.max_restarts,
                   extra=CONSOLE)
    await _respawn(plan, parts, restart)
    parts.metrics.trace.span("recoveries", "trainer respawned", start, time.perf_counter(),
                             restart=restart)
    watch.watch_trainer(parts.trainer.mesh_name)  # type: ignore[attr-defined]
    found = latest_complete_checkpoint(parts.checkpointer.root)
    resume_dir, state = found if found is not None else (
        None, ControllerState(step=0, next_group_id=0))
    parts.checkpointer.forget_steps_from(state.step)
    parts.metrics.close()
    parts.metrics = plan.metrics.build(run_dir=pathlib.Path(plan.run_dir), purge_step=state.step,
                                       run_config=parts.checkpointer.job_config)
    restoring = time.perf_counter()
    await continue_from(parts, resume_dir, state, rewind=True)
    parts.metrics.trace.span("recoveries", "trainer restored", restoring, time.perf_counter(),
                             step=state.step)  # in the reopened metrics' timeline
    logger.warning("trainer restarted in %.1f s; the run goes on from %s",
                   time.perf_counter() - start,
                   f"checkpoint step {state.step}" if resume_dir else "its start", extra=CONSOLE)
    return state


async def _respawn(plan: ResolvedJob, parts: RunParts, restart: int) -> None:
    """Stop the lost trainer's procs (bounded) and spawn its replacement on the same hosts from
    the run's model; the generator pool pushes from the new one."""
    try:
        await asyncio.wait_for(parts.trainer.close(), STOP_TIMEOUT_S)
    except Exception as e:  # a dead mesh may not stop cleanly: it is gone either way
        logger.warning("stopping the lost trainer: %r", e)
    procs = spawn_trainer_procs(plan, parts.hosts, restart)
    trainer = await asyncio.wait_for(MonarchTrainerClient.spawn(
        procs, plan.trainer, model_dir=pathlib.Path(plan.model_dir), batcher=plan.batcher,
        verify_push=plan.verify_weight_push, restart=restart), SPAWN_TIMEOUT_S)
    parts.trainer = parts.generators.trainer = trainer
