"""The fault seam (torchtitan_rl/faults.py): production code names points, the variable picks
the fault; nothing happens at other points, counts and keys select the call. Pure logic: the
SIGKILL is caught before it is sent (the whole jobs that die by it: tests/controller)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from torchtitan_rl import faults


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(faults, "_calls", faults.collections.Counter())
    return sent


def test_without_the_variable_no_point_acts(monkeypatch, kills) -> None:
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    for name in ("controller.group_finished", "trainer.loss", "generator.request_received"):
        assert faults.point(name, 1) is False  # type: ignore[arg-type]
    assert kills == [] and not faults._calls


def test_a_kill_fault_acts_at_its_point_and_count_only(monkeypatch, kills) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "kill_controller_after_groups:3")
    faults.point("controller.group_finished", 2)
    faults.point("controller.checkpoint_written", 3)
    assert kills == []
    assert faults.point("controller.group_finished", 3) is False
    assert kills == [signal.SIGKILL]


def test_the_seam_counts_calls_per_key_where_the_caller_passes_no_count(monkeypatch,
                                                                         kills) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "kill_generator_mid_relay:2")
    faults.point("generator.relay_chunk_received", key=(1, 1, 0))
    faults.point("generator.relay_chunk_received", key=(2, 1, 0))  # another position: no count
    faults.point("generator.relay_chunk_received", key=(1, 1, 1))  # another attempt
    assert kills == []
    faults.point("generator.relay_chunk_received", key=(1, 1, 0))
    assert kills == [signal.SIGKILL]
    monkeypatch.setenv(faults.ENV_VAR, "kill_trainer_after_steps:3")
    faults.point("trainer.optimizer_step_done", 3, key=1)  # a restarted trainer is spared
    assert len(kills) == 1
    faults.point("trainer.optimizer_step_done", 3, key=0)
    assert len(kills) == 2


def test_a_flag_fault_is_returned_at_each_listed_count(monkeypatch, kills) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "nan_loss_at_steps:1,3")
    assert [faults.point("trainer.loss", step) for step in range(5)] == [
        False, True, False, True, False]
    assert kills == []


def test_a_hold_never_returns_until_cancelled(monkeypatch, kills) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "hold_controller_at_validations:2")

    async def scenario() -> None:
        await asyncio.wait_for(faults.point_async("controller.validation_started", 1), 5)
        held = asyncio.ensure_future(faults.point_async("controller.validation_started", 2))
        for _ in range(20):  # event-loop turns, not time: the hold has started and still waits
            await asyncio.sleep(0)
        assert not held.done()
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held

    asyncio.run(scenario())


@pytest.mark.parametrize(("spec", "message"), [
    ("kill_controller_after_group:1", "unknown fault 'kill_controller_after_group'"),
    ("kill_controller_after_groups:x", "expected kill_controller_after_groups:<int>"),
    ("nan_loss_at_steps:1,a", r"expected nan_loss_at_steps:<int>,<int>,\.\.\."),
])
def test_a_bad_fault_names_the_variable(monkeypatch, kills, spec: str, message: str) -> None:
    monkeypatch.setenv(faults.ENV_VAR, spec)
    with pytest.raises(ValueError, match=f"TORCHTITAN_RL_FAULT=.*{message}"):
        faults.point("controller.group_finished", 1)
        faults.point("trainer.loss", 1)
