"""Controller-side calls on a PolicyTrainer actor mesh: one train step, one weight push.

    metrics = await train_step(trainer, batch)                  # forward_backward, then optim_step
    metrics = await push_weights(trainer, generators, version)  # trainer ranks -> generators

Both call the whole trainer mesh (every rank takes part in the collectives) and return rank 0's
metrics (every rank reports the same reduced training metrics; only rank 0 talks to generators).
"""

from __future__ import annotations

from typing import Any

from torchtitan_rl.trainer.batcher import TrainingBatch


def rank0_value(values: Any) -> Any:
    """The value rank 0 returned, from a Monarch ValueMesh of a ``.call()``."""
    items = list(values.items())
    if not items:
        raise RuntimeError("empty ValueMesh: the trainer mesh has no ranks")
    return min(items, key=lambda item: item[0].rank)[1]


async def train_step(trainer: Any, batch: TrainingBatch) -> dict[str, float]:
    """One optimizer step on ``batch``: metrics of forward_backward and optim_step together."""
    metrics = dict(rank0_value(await trainer.forward_backward.call(batch)))
    metrics.update(rank0_value(await trainer.optim_step.call()))
    return metrics


async def push_weights(
    trainer: Any,
    generators: Any,
    version: int,
    *,
    verify: bool = False,
    transport: str | None = None,
) -> dict[str, float]:
    """Push the trainer's weights as policy ``version`` into every generator of ``generators``
    (an actor mesh with ``pull_model_state_dict(version, state_dict)``; with ``verify`` also
    ``read_hf_weights()``). ``transport`` overrides the trainer's ``weight_transport``.
    Raises RuntimeError when verify finds a tensor that differs."""
    return rank0_value(await trainer.push_weights.call(generators, version, verify, transport))
