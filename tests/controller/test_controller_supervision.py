"""MeshFailureWatch's dispatch of Monarch's failure reports (no procs: reports are fed in): the
watched trainer's loss raises TrainerLostError, a replaced trainer's late reports and Monarch's
companion meshes change nothing, any other mesh fails the run."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.controller.supervision import (
    MeshFailureWatch,
    RunFailedError,
    TrainerLostError,
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
