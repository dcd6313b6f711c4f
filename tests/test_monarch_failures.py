"""Monarch's failures are classified in one place (torchtitan_rl/monarch_failures.py): by type
where Monarch gives one, by its one named text rule where it does not."""

from __future__ import annotations

import pytest
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from torchtitan_rl.monarch_failures import is_supervision_error


@pytest.mark.parametrize("error, dead", [
    (SupervisionError("Actor generator_0 is unhealthy"), True),  # by type, whatever the text
    (RuntimeError("failure on mesh generator_0-AbC: Killed(sig=9)"), True),
    (RuntimeError("`ProcMesh` has already been stopped"), True),
    (RuntimeError("ActorError: ... SupervisionError: actor generator_1 failed"), True),
    (RuntimeError("CUDA out of memory"), False),
    (ValueError("max_tokens must be >= 1"), False),
    (TimeoutError(), False),
])
def test_an_error_is_a_dead_actor_by_type_or_by_the_named_rule(error, dead):
    assert is_supervision_error(error) is dead
