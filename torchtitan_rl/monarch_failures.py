"""Monarch's failures, classified in one place: is an error Monarch's word that the actor called
is dead? Every layer that calls actors (the generator's handle, the weight push, the trainer's
restart, the checkpointer, the job's one-line report) asks here.

    by type   SupervisionError (monarch._rust_bindings...supervision): a call in flight to an
              actor whose proc died
    by rule   Monarch 0.6 raises no type of its own for the rest, so one named rule reads the
              text (DEAD_ACTOR_MARKERS): a later call to a dead mesh ("failure on mesh ..."), a
              call to a stopped mesh ("... has already been stopped"), and an error raised in
              another actor that called a dead one (an ActorError carrying "SupervisionError")
"""

from __future__ import annotations

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

DEAD_ACTOR_MARKERS = ("SupervisionError", "failure on mesh", "has already been stopped")
"""The rule for what Monarch 0.6 reports without a type of its own."""


def is_supervision_error(error: BaseException) -> bool:
    """Whether ``error`` is Monarch's word that the actor it called is dead."""
    if isinstance(error, SupervisionError):
        return True
    text = f"{type(error).__name__}: {error}"
    return any(marker in text for marker in DEAD_ACTOR_MARKERS)
