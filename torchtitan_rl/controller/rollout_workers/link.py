"""One rollout worker as the pool talks to it: the groups assigned to it in one event-loop turn
leave in one message, their outcomes come back in batches on one reply port.

    RolloutWorkerPool.run_group -> WorkerLink.run_group: a future per group, keyed
        -> (next loop turn) _send_unsent: worker.run_groups(assignments, reply port), one-way
        <- _receive: a batch of GroupOutcome on the port -> each group's future
    the caller cancels a group -> worker.cancel_group(key) (or it never leaves)
    the worker is lost (or its port fails) -> fail(reason): every group out there raises
        RolloutWorkerLostError; the pool restarts them whole on the others
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from monarch.actor import Channel

from torchtitan_rl.controller.rollout_workers.worker import GroupAssignment, GroupOutcome
from torchtitan_rl.types import Sampling


class RolloutWorkerLostError(RuntimeError):
    """A rollout worker's process died under a group: the group restarts whole on another."""


def open_monarch_channel() -> tuple[Any, Any]:
    return Channel[list[GroupOutcome]].open()


@dataclasses.dataclass(kw_only=True, slots=True)
class MessageCounts:
    num_sent: int = 0
    """run_groups messages (each carries the groups assigned to a worker in one loop turn)."""
    num_received: int = 0
    """Outcome batches (each carries a worker's groups finished together)."""


class WorkerLink:
    """One worker (one incarnation) as the pool calls it: the groups assigned in one
    event-loop turn leave in one ``run_groups`` message (one-way), outcomes come back in
    batches on one reply port; ``fail`` ends every group still out there with
    RolloutWorkerLostError (a SIGKILLed actor never replies, monarch#3435)."""

    def __init__(self, actor: Any, open_channel: Callable[[], tuple[Any, Any]],
                 on_port_failed: Callable[[str], None], messages: MessageCounts) -> None:
        self.actor = actor
        self.messages = messages
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future[GroupOutcome]] = {}
        self._unsent: list[GroupAssignment] = []
        self._lost_reason: str | None = None
        self._replies, receiver = open_channel()
        self._on_port_failed = on_port_failed
        self._receiving = asyncio.ensure_future(self._receive(receiver))

    def run_group(self, group_id: int, prompt_index: int, group_size: int, sampling: Sampling,
                  attempt: int) -> asyncio.Future[GroupOutcome]:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[GroupOutcome] = loop.create_future()
        if self._lost_reason is not None:
            result.set_exception(RolloutWorkerLostError(self._lost_reason))
            return result
        key = next(self._keys)
        self._waiting[key] = result
        if not self._unsent:
            loop.call_soon(self._send_unsent)
        assignment = GroupAssignment(key=key, group_id=group_id, prompt_index=prompt_index,
                                     group_size=group_size, sampling=sampling, attempt=attempt)
        self._unsent.append(assignment)

        def forget(done: asyncio.Future[GroupOutcome]) -> None:
            self._waiting.pop(key, None)
            # The caller gave the group up: not sent yet, it never leaves; sent, the worker
            # stops generating for it (the cancel goes after its run_groups message).
            if done.cancelled() and self._lost_reason is None:
                if assignment in self._unsent:
                    self._unsent.remove(assignment)
                else:
                    self.actor.cancel_group.broadcast(key)

        result.add_done_callback(forget)
        return result

    def _send_unsent(self) -> None:
        batch, self._unsent = self._unsent, []
        if batch and self._lost_reason is None:
            self.actor.run_groups.broadcast(batch, self._replies)
            self.messages.num_sent += 1

    async def _receive(self, receiver: Any) -> None:
        try:
            while True:
                batch = await receiver.recv()
                self.messages.num_received += 1
                for outcome in batch:
                    waiting = self._waiting.pop(outcome.key, None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(outcome)
        except Exception as e:  # no outcome can reach the pool any more: never hang its groups
            self._on_port_failed(f"its reply port failed: {type(e).__name__}: {e}")

    def fail(self, reason: str) -> None:
        """The worker is lost: every group out there (and any later) raises."""
        if self._lost_reason is not None:
            return
        self._lost_reason = reason
        self._receiving.cancel()
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(RolloutWorkerLostError(reason))
