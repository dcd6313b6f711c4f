"""A run goes on from a checkpoint: a rerun of a stopped run (resume), or the run itself after a
lost trainer was replaced (controller/trainer_restart.py, with ``rewind``).

    checkpointer.restore(trainer, checkpoint)     the trainer's DCP state; the controller's state
    generators.rewind(step)                       restart only: they serve a newer version now
    generators.push_weights(step)                 the checkpoint's weights to every generator
    validation of that step logged again          its log lines went with the steps after it
"""

from __future__ import annotations

import pathlib

from torchtitan_rl.controller.checkpoint.checkpointer import ControllerState
from torchtitan_rl.controller.loop.loop import RunParts


async def continue_from(parts: RunParts, resume_dir: pathlib.Path | None,
                        state: ControllerState, *, rewind: bool = False) -> None:
    """The run goes on from checkpoint ``resume_dir`` (None: from its start, with the trainer's
    first weights): the trainer restored, the generators given its weights (``rewind``: they
    serve a newer version now, and go back first), its validation logged again."""
    if resume_dir is not None:
        await parts.checkpointer.restore(parts.trainer, resume_dir, state)
    if rewind:
        await parts.generators.rewind(state.step)
    await parts.generators.push_weights(state.step)
    for step, mean, stderr in state.validation_history:
        if step == state.step:  # its log lines were dropped with the lost run's
            parts.metrics.log(step, {"validation/reward_mean": mean,
                                     "validation/reward_stderr": stderr})
