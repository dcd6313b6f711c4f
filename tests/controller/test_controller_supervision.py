"""MeshFailureWatch's dispatch of Monarch's failure reports (no procs: reports are fed in): the
watched trainer's loss raises TrainerLostError, a replaced trainer's late reports and Monarch's
companion meshes change nothing, any other mesh fails the run. How often Monarch checks
(placement.health_poll_s): the auto value, the environment's precedence."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller import supervision
from torchtitan_rl.controller.hosts.placement import Placement
from torchtitan_rl.controller.supervision import (
    HEALTH_POLL_ENV,
    MeshFailureWatch,
    RunFailedError,
    TrainerLostError,
    apply_health_poll,
    auto_health_poll_s,
)


async def _forever() -> None:
    await asyncio.Event().wait()


def test_the_watched_trainers_loss_raises_trainer_lost_and_a_replaced_ones_is_ignored() -> None:
    async def scenario() -> None:
        watch = MeshFailureWatch(cancel_grace_s=5)
        watch.watch_trainer("policy_trainer")
        loop = asyncio.get_running_loop()
        loop.call_soon(watch._dispatch, "spmdactor-Ab1", "companion died with the proc")
        loop.call_soon(watch._dispatch, "logger-Cd2", "companion died with the proc")
        loop.call_soon(watch._dispatch, "policy_trainer-Ef3", "Killed(sig=9)")
        with pytest.raises(TrainerLostError, match="Killed"):
            await watch.run_until_failure(_forever())
        assert watch.failures == []

        watch.watch_trainer("policy_trainer_r1")  # the replacement
        assert watch.trainer_lost is None
        watch._dispatch("policy_trainer-Ef3", "a late report of the lost mesh")
        assert watch.trainer_lost is None and watch.failures == []
        assert await watch.run_until_failure(asyncio.sleep(0, result="done")) == "done"

        loop.call_soon(watch._dispatch, "policy_trainer_r1-Gh4", "Killed(sig=9) again")
        with pytest.raises(TrainerLostError, match="again"):
            await watch.run_until_failure(_forever())

    asyncio.run(scenario())


def test_an_unwatched_trainer_or_another_mesh_fails_the_run() -> None:
    async def scenario() -> None:
        watch = MeshFailureWatch(cancel_grace_s=5)  # trainer.max_restarts = 0, or torchrun
        asyncio.get_running_loop().call_soon(
            watch._dispatch, "policy_trainer-Ef3",
            "torchtitan_rl.trainer.trainer.PolicyTrainer: Killed(sig=9)")
        with pytest.raises(RunFailedError, match="actor mesh failure: .*Killed"):
            await watch.run_until_failure(_forever())

        watch = MeshFailureWatch(cancel_grace_s=5)
        watch.watch_trainer("policy_trainer")
        asyncio.get_running_loop().call_soon(watch._dispatch, "something_else-Ij5", "boom")
        with pytest.raises(RunFailedError, match="boom"):
            await watch.run_until_failure(_forever())

    asyncio.run(scenario())


@pytest.mark.parametrize("num_generators, seconds", [(1, 2.0), (4, 2.0), (6, 3.0), (16, 8.0), (20, 10.0),
                                                     (1024, 10.0)])
def test_the_auto_health_poll_grows_with_the_generators_up_to_monarchs_default(
        num_generators, seconds):
    assert auto_health_poll_s(num_generators) == seconds


def test_the_health_poll_is_applied_unless_the_environment_sets_it(monkeypatch):
    from monarch._rust_bindings.monarch_hyperactor import config as monarch_config

    reloads: list[str] = []  # Monarch's own config stays as it was for the tests after this one
    monkeypatch.setattr(monarch_config, "reload_config_from_env",
                        lambda: reloads.append(os.environ[HEALTH_POLL_ENV]))
    monkeypatch.delenv(HEALTH_POLL_ENV, raising=False)
    monkeypatch.setattr(supervision, "_poll_set_here", None)
    assert apply_health_poll(1.0) == "1000ms" and os.environ[HEALTH_POLL_ENV] == "1000ms"
    assert apply_health_poll(8.0) == "8000ms"  # a later run of this process: its own value
    assert os.environ[HEALTH_POLL_ENV] == "8000ms"
    assert reloads == ["1000ms", "8000ms"]  # Monarch re-read each value

    monkeypatch.setenv(HEALTH_POLL_ENV, "3s")  # the user's
    assert apply_health_poll(1.0) == "3s" and os.environ[HEALTH_POLL_ENV] == "3s"
    assert reloads == ["1000ms", "8000ms"]  # nothing of ours to read


def test_a_negative_health_poll_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^placement.health_poll_s must be >= 0"):
        Placement.Config(health_poll_s=-1).check(num_generators=1, num_trainer_ranks=1)


@pytest.mark.parametrize("seconds, warned", [(0.0, False), (1.0, True), (1.9, True), (2.0, False),
                                             (8.0, False)])
def test_a_health_poll_under_two_seconds_is_warned_about(seconds, warned, caplog):
    caplog.set_level(logging.WARNING, logger="torchtitan_rl.controller.hosts.placement")
    Placement.Config(health_poll_s=seconds).check(num_generators=1, num_trainer_ranks=1)
    messages = [r.getMessage() for r in caplog.records]
    assert bool(messages) == warned, messages
    if warned:
        assert messages[0].startswith(f"placement.health_poll_s = {seconds}: under 2.0 s")
