"""Spawning a generator mesh and calling it with the right fan-out: the one code path the
controller and the tests share.

    handle = await spawn_generator(config)       # procs, torch elastic env, actors, start()
    completion = await handle(GenerateRequest(prompt_token_ids=ids, request_id=...))   # rank 0
    await WeightPusher(...).push(policy_version, state_dict, handle.actors)  # every rank pulls
    await handle.abort(ids)                      # rank 0
    await handle.close()                         # every rank, then the procs stop

`GeneratorHandle` is a `GenerateFn` (rollout code and the router call it directly); weight pushes
go to its actor mesh (``handle.actors``, weight_sync/push.py).
generate() requests leave together at the end of the event-loop turn (one ``submit`` message;
outcomes come back on one reply port, batched the same way); every other method sends its message
when called, after any generate() not yet sent, and returns an awaitable: calls made one after
the other reach rank 0 in that order (a generate() then an abort() always finds it). ``close()``
lets every outstanding generate() receive its "closed" error before the procs stop.

A lost generator (a proc died): ``mark_lost`` fails every outstanding generate() with
`GeneratorLostError` at once, without waiting for replies from the dead actor (Monarch 0.6 can
leave such a call pending forever, monarch#3435); a call that fails with Monarch's supervision
error marks the handle lost too and reports it through ``on_lost``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from monarch.actor import Future, HostMesh, Port, ProcMesh, this_host

from torchtitan_rl.batched_calls import BatchedCaller
from torchtitan_rl.generator.generator import GenerateOutcome, Generator
from torchtitan_rl.monarch_failures import is_supervision_error
from torchtitan_rl.types import Completion, GenerateRequest
from torchtitan_rl.weight_sync.push import WeightTransport

logger = logging.getLogger(__name__)


class GeneratorLostError(RuntimeError):
    """The generator serving a request died; the request never finished (restart its group)."""


class GeneratorHandle:
    """A started generator mesh: ``tensor_parallel_degree`` procs, one `Generator` actor each."""

    def __init__(self, *, procs: ProcMesh | None, actors: Any, config: Generator.Config,
                 name: str = "generator", pids: list[int] | None = None,
                 machine_id: str = "",
                 on_lost: Callable[[GeneratorHandle, str], None] | None = None) -> None:
        self.procs = procs
        """None: procs owned elsewhere (a rollout worker's borrowed handle; a generator on the
        pool's one proc mesh): their owner stops them."""
        self.actors = actors
        """None: a rollout worker's handle for a generator out when the worker was spawned
        (detached at once; put_back gives it the replacement's)."""
        self.rank0 = actors.slice(procs=0) if actors is not None else None
        self.config = config
        self.name = name
        """The actor mesh's spawn name (Monarch's failure reports name it ``<name>-<suffix>``)."""
        self.pids = pids or []
        self.machine_id = machine_id
        """The machine its ranks run on (hostname/boot id; TP ranks share one host)."""
        self.weight_transport: WeightTransport | None = None
        """How pushes reach it (set by whoever spawned it; None: the trainer's setting)."""
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        """Why the generator was lost (None while it serves)."""
        self.lost_event = asyncio.Event()
        """Set when the generator is lost: calls other than generate() race against it."""
        self._calls: BatchedCaller[GenerateRequest, Completion | None] = BatchedCaller(
            send=self._submit, unpack=lambda outcome: outcome, on_port_failed=self.mark_lost,
            # The caller gave a sent request up (its group failed elsewhere): free the engine
            # slot rather than generate for nobody.
            cancel=lambda key, request: self.rank0.abort.call_one([request.request_id]))

    def generate(self, request: GenerateRequest) -> asyncio.Future[Completion | None]:
        """Rank 0 generates one completion (await the future). The request leaves at the end of
        this event-loop turn with every other request made in the turn, in one ``submit``
        message (batched_calls.py), or before this handle's next other message."""
        return self._calls.call(request)

    __call__ = generate

    def _submit(self, batch: list[tuple[int, GenerateRequest]],
                replies: Port[list[GenerateOutcome]]) -> None:
        call = asyncio.ensure_future(self.rank0.submit.call_one(batch, replies))

        def settle(done: asyncio.Future[None]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is None:
                return
            if is_supervision_error(error):
                self.mark_lost(f"{type(error).__name__}: {error}")
            else:
                self._calls.fail_calls([key for key, _ in batch], error)

        call.add_done_callback(settle)

    def mark_lost(self, reason: str) -> None:
        """Fail every outstanding generate() with GeneratorLostError now; report the loss once."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        self.lost_event.set()
        logger.warning("%s lost: %s", self.name, reason)
        self._calls.fail(lambda: GeneratorLostError(f"{self.name} was lost: {reason}"))
        if self.on_lost is not None:
            self.on_lost(self, reason)

    def abort(self, request_ids: list[str] | None = None) -> Future[int]:
        """Abort requests (None: all in flight); resolves once they have resolved."""
        self._calls.flush()
        return self.rank0.abort.call_one(request_ids)

    async def rewind_policy_version(self, version: int) -> None:
        """Every rank: the next pull may be ``version``, older than the loaded one (the trainer
        was restored); call after ``abort(None)``."""
        await self.actors.rewind_policy_version.call(version)

    def get_policy_version(self) -> Future[int]:
        """Rank 0's policy version (the last pull applied)."""
        self._calls.flush()
        return self.rank0.get_policy_version.call_one()

    def count_inflight_requests(self) -> Future[int]:
        """Rank 0's generate() calls not yet resolved (queued or in the engine)."""
        self._calls.flush()
        return self.rank0.count_inflight_requests.call_one()

    async def close(self, *, stop_procs: bool = True, timeout_s: float = 60.0) -> None:
        """Close every rank; outstanding generate() calls fail with "generator closed before the
        request finished"; then stop the procs. A lost generator's procs are only stopped. Every
        wait is bounded by ``timeout_s``."""
        try:
            if self.lost_reason is None:
                self._calls.flush()
                await asyncio.wait_for(self.actors.close.call(), timeout_s)
                if outstanding := self._calls.outstanding():
                    await asyncio.wait(outstanding, timeout=timeout_s)
        finally:
            self._calls.stop_receiving()
            if stop_procs and self.procs is not None:
                await asyncio.wait_for(self.procs.stop(), timeout_s)

    def detach(self, reason: str) -> None:
        """Stop using the generator without closing it (a borrowed handle: its mesh serves
        others): outstanding generate() calls fail with GeneratorLostError(``reason``)."""
        if self.lost_reason is None:
            self.lost_reason = reason
            self.lost_event.set()
        self._calls.fail(lambda: GeneratorLostError(f"{self.name}: {reason}"))


async def _start_every_rank(actors: Any, tp: int) -> list[int]:
    """Start every rank; their pids by rank. The first rank to fail fails the start at once: its
    peers would wait for it in torch's rendezvous forever."""
    starts = [asyncio.ensure_future(actors.slice(procs=rank).start.call_one())
              for rank in range(tp)]
    try:
        done, _ = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        for start in done:
            if start.exception() is not None:
                raise start.exception()  # type: ignore[misc]
        return [start.result() for start in starts]
    finally:
        for start in starts:
            start.cancel()


async def spawn_generator(
    config: Generator.Config, *, name: str = "generator", host: HostMesh | None = None,
    procs: ProcMesh | None = None,
    on_lost: Callable[[GeneratorHandle, str], None] | None = None,
) -> GeneratorHandle:
    """Spawn ``config.tensor_parallel_degree`` procs on ``host`` (default: this host), set the
    torch elastic env when TP > 1, spawn one `Generator` per proc and start every rank.
    ``procs``: a one-proc slice of a mesh the caller owns and stops (TP 1 only), used instead of
    spawning procs. ``name`` names the actor mesh; ``on_lost`` hears when the handle finds its
    generator dead."""
    tp = config.tensor_parallel_degree
    owned = procs is None
    if owned:
        procs = (host or this_host()).spawn_procs(per_host={"procs": tp})
    elif tp != 1:
        raise ValueError(f"{name}: a borrowed proc slice holds TP 1 only, not {tp}")
    try:
        if tp > 1:
            from monarch.spmd import setup_torch_elastic_env_async

            await setup_torch_elastic_env_async(procs)
        actors = procs.spawn(name, Generator, config)
        pids = await _start_every_rank(actors, tp)
        machine = await actors.slice(procs=0).get_machine_id.call_one()
    except BaseException:
        if owned:
            await asyncio.wait_for(procs.stop(), 60.0)
        raise
    logger.info("generator %s started (tp=%d, pids %s on %s, model %s)", name, tp,
                ",".join(map(str, pids)), machine, config.model_dir)
    return GeneratorHandle(procs=procs if owned else None, actors=actors, config=config,
                           name=name, pids=pids, machine_id=machine, on_lost=on_lost)
