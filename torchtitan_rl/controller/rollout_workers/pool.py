"""The controller's side of the rollout workers (rollouter.num_workers > 0): spawn them beside the
generators, hand each admitted group to the least loaded one, mirror the router to them.

    spawn:      worker i on hosts.generator_host(i mod num_generators) (this host when local),
                a proc of one shared mesh (shared_procs.py; else a mesh each, as a replacement
                gets) -> RolloutWorker(spec, [GeneratorRef of every generator])
                -> ready() (its pid; a worker that cannot build its parts fails the start)
                -> router.add_mirror(pool): set_in_push / take_out / put_back reach every worker
    run_group:  WorkerAssigner.acquire() -> the worker's BatchedCaller (batched_calls.py: the
                groups assigned to a worker in one event-loop turn leave in one message, come
                back in batches on one reply port) -> GroupOutcome
                (lost_reason set -> GeneratorLostError here, as the in-process path raises it;
                the caller cancelled -> worker.cancel_group(key))
    a worker's proc dies -> MeshFailureWatch -> mark_lost(i): its groups raise
                RolloutWorkerLostError (the loop restarts them whole on the others), no group
                goes to it; a replacement spawns on its host (that host gone: the next
                generator's host left), handed the generators out (lost, being replaced) without
                their meshes, so it starts with them taken out; once it is ready it is told what
                changed meanwhile (taken out, put back, in a push) and takes groups again
    a generator host gone (the generator pool's host watch) -> mark_host_lost(h): the workers
                on it are lost as above (Monarch may never report them), none spawned there
    close:      every worker closes (it never closes a generator), then its own mesh (or its
                actor, then the shared mesh) stops; before the generators (RunParts.close)

The controller's busy clock (generator idle ratio) counts a group's call as busy time, and the
``router/generator_i/num_routed`` metrics add the workers' counts to the controller's own
(validation): what the in-process router counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from torchtitan_rl.batched_calls import BatchedCaller, MessageCounts, open_channel
from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.controller.hosts.shared_procs import spawn_shared_procs
from torchtitan_rl.controller.rollout_workers.worker import (
    GeneratorRef,
    GroupAssignment,
    GroupOutcome,
    RolloutWorker,
    RolloutWorkerSpec,
)
from torchtitan_rl.controller.supervision import ReplaceableMeshes
from torchtitan_rl.generator import GeneratorHandle, GeneratorLostError
from torchtitan_rl.generator.router import BusyClock
from torchtitan_rl.types import GenerateFn, Sampling

logger = logging.getLogger(__name__)

SPAWN_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


class RolloutWorkerLostError(RuntimeError):
    """A rollout worker's process died under a group: the group restarts whole on another."""


class WorkerAssigner:
    """Picks the worker for the next group among those not ``down`` (lost, being replaced):
    the fewest groups in flight, ties to the one given the fewest groups so far, then the
    lowest index (round-robin while all are equally busy).

    Invariant: 0 <= in_flight[i] <= num_assigned[i], checked on every event.
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.in_flight = [0] * num_workers
        self.num_assigned = [0] * num_workers
        self.down: set[int] = set()

    def acquire(self) -> int:
        index = min((i for i in range(len(self.in_flight)) if i not in self.down),
                    key=lambda i: (self.in_flight[i], self.num_assigned[i], i))
        self.in_flight[index] += 1
        self.num_assigned[index] += 1
        return index

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1
        assert 0 <= self.in_flight[index] <= self.num_assigned[index], (index, self.in_flight)


class RolloutWorkerPool(ReplaceableMeshes):
    def __init__(self, workers: list[tuple[Any, Any]], *, generators: list[GeneratorRef],
                 busy_clock: BusyClock | None = None,
                 respawn: Callable[[int, str, list[GeneratorRef]],
                                   Awaitable[tuple[Any, Any]]] | None = None,
                 on_fatal: Callable[[str], None] | None = None,
                 open_channel: Callable[[], tuple[Any, Any]] = open_channel) -> None:
        """``workers``: (what stops it: its proc mesh, or its actor mesh on the shared proc
        mesh; RolloutWorker actor mesh) each, spawned as ``rollout_worker_<i>`` with
        ``generators``; ``respawn(i, name, handed)``: a replacement for worker ``i``, handed
        ``handed`` (None: a lost worker fails the run through ``on_fatal``); ``open_channel``: a
        (port, receiver) pair for a worker's outcomes."""
        super().__init__("rollout_worker", len(workers))
        self.workers = workers
        self.assigner = WorkerAssigner(len(workers))
        self.busy_clock = busy_clock or BusyClock()
        self._num_routed = [[0] * len(generators) for _ in workers]
        """Each worker's cumulative requests per generator, as its latest outcome said."""
        self._num_resumed = [0] * len(workers)
        """Each worker's cumulative resumed requests (partial rollouts), likewise."""
        self._respawn = respawn
        self._on_fatal = on_fatal
        self._open_channel = open_channel
        self.shared_procs: Any = None
        """The first workers' one proc mesh (shared_procs.py; None: a mesh each); stopped at
        close, once they have closed."""
        self.messages = MessageCounts()
        self._links: list[BatchedCaller[dict[str, Any], GroupOutcome] | None] = (
            [None] * len(workers))
        """How each worker (this incarnation) is called: the groups assigned to it in one
        event-loop turn leave in one one-way ``run_groups`` message, outcomes come back in
        batches on one reply port (batched_calls.py); made on first use."""
        self._changed: asyncio.Condition | None = None
        self.worker_hosts = [0] * len(workers)
        """The generator host each worker runs on (hosts.generator_host_index)."""
        self.lost_hosts: set[int] = set()
        """Generator hosts gone whole (mark_host_lost): no worker is spawned or stopped there."""
        # The router's state a replacement must start from (RouterMirror below).
        self._generators = list(generators)
        self._out: set[int] = set()
        self._in_push: set[int] = set()

    @classmethod
    async def spawn(cls, spec: RolloutWorkerSpec, num_workers: int, *,
                    generators: list[GeneratorHandle], hosts: RunHosts,
                    busy_clock: BusyClock | None = None,
                    on_fatal: Callable[[str], None] | None = None) -> RolloutWorkerPool:
        refs = [GeneratorRef.of(handle) for handle in generators]
        pool: RolloutWorkerPool | None = None

        async def respawn(index: int, name: str, handed: list[GeneratorRef],
                          procs: Any = None) -> tuple[Any, Any]:
            """Worker ``index`` handed ``handed``, on ``procs`` (a proc of the shared mesh) or
            on a mesh of its own on its generator's host (that host gone: the next generator's
            host left). Returns (what to stop when it goes: its own mesh, or its actor mesh on
            the shared one; its actor mesh)."""
            own_procs = procs is None
            if own_procs:
                lost = pool.lost_hosts if pool is not None else set()
                order = [(index + k) % len(refs) for k in range(len(refs))]
                generator = next((g for g in order
                                  if hosts.generator_host_index(g) not in lost), order[0])
                if pool is not None:
                    pool.worker_hosts[index] = hosts.generator_host_index(generator)
                procs = hosts.generator_host(generator).spawn_procs(
                    per_host={"procs": 1}, name=name)
            actor = procs.spawn(name, RolloutWorker, spec, handed, pool is None and index == 0)
            stops = procs if own_procs else actor
            try:
                pid = await asyncio.wait_for(actor.ready.call_one(), SPAWN_TIMEOUT_S)
            except BaseException:
                await asyncio.gather(stops.stop(), return_exceptions=True)
                raise
            logger.info("rollout worker %s started (pid %d)", name, pid)
            return stops, actor

        worker_hosts = [hosts.generator_host_index(i % len(refs)) for i in range(num_workers)]
        shared = spawn_shared_procs(hosts, worker_hosts, "rollout_workers")
        results = await asyncio.gather(
            *(respawn(i, f"rollout_worker_{i}", refs, shared[1](i) if shared else None)
              for i in range(num_workers)),
            return_exceptions=True)
        workers = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(stops.stop() for stops, _ in workers),
                                 *([shared[0].stop()] if shared else []), return_exceptions=True)
            raise errors[0]
        pool = cls(workers, generators=refs, busy_clock=busy_clock, respawn=respawn,
                   on_fatal=on_fatal)
        pool.worker_hosts = worker_hosts
        pool.shared_procs = shared[0] if shared else None
        return pool

    async def run_group(self, group_id: int, prompt_index: int, group_size: int,
                        sampling: Sampling, *, attempt: int = 0) -> GroupOutcome:
        """Group ``group_id`` rolled out by a worker. Raises GeneratorLostError when a
        generator serving it was lost, RolloutWorkerLostError when the worker was (restart it
        whole, as in the controller), the group's own error when it failed."""
        index = await self._acquire()
        self.busy_clock.enter()
        try:
            outcome = await self._link(index).call(dict(
                group_id=group_id, prompt_index=prompt_index, group_size=group_size,
                sampling=sampling, attempt=attempt))
        finally:
            self.busy_clock.exit()
            self.assigner.release(index)
        self._num_routed[index] = outcome.num_routed
        self._num_resumed[index] = outcome.num_resumed
        if outcome.error is not None:
            raise outcome.error
        if outcome.lost_reason is not None:
            raise GeneratorLostError(outcome.lost_reason)
        return outcome

    def _link(self, index: int) -> BatchedCaller[dict[str, Any], GroupOutcome]:
        link = self._links[index]
        if link is None:  # made in the event loop, on first use
            actor = self.workers[index][1]

            def run_groups(batch: list[tuple[int, dict[str, Any]]], replies: Any) -> None:
                actor.run_groups.broadcast(
                    [GroupAssignment(key=key, **fields) for key, fields in batch], replies)

            link = self._links[index] = BatchedCaller(
                send=run_groups, unpack=lambda outcome: (outcome.key, outcome, None),
                # The caller gave the group up: the worker stops generating for it.
                cancel=lambda key, _: actor.cancel_group.broadcast(key),
                on_port_failed=functools.partial(self.mark_lost, index), counts=self.messages,
                open_port=self._open_channel)
        return link

    async def _acquire(self) -> int:
        async with self._workers_changed():
            await self._workers_changed().wait_for(
                lambda: len(self.assigner.down) < len(self.workers))
        return self.assigner.acquire()

    def _workers_changed(self) -> asyncio.Condition:
        """Notified when a replacement takes groups (made in the event loop, on first use)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    # ---- losses (controller/supervision.py's MeshFailureWatch calls these) ---------------------
    def mark_lost(self, index: int, reason: str) -> None:
        """Worker ``index`` died: its groups fail here (they restart whole on the others), no
        group goes to it, a replacement is spawned on its host (once)."""
        if index in self.assigner.down:
            return
        logger.warning("rollout worker %d lost: %s", index, reason)
        self.assigner.down.add(index)
        link = self._links[index]
        if link is not None:
            link.fail(lambda: RolloutWorkerLostError(f"rollout worker {index} was lost: {reason}"))
        if self._respawn is None:
            if self._on_fatal is not None:
                self._on_fatal(f"rollout worker {index} was lost: {reason}")
            return
        self.start_replacement(index, reason)

    def mark_host_lost(self, host: int, reason: str) -> None:
        """Generator host ``host`` is gone whole (the generator pool's host watch): the workers
        on it are lost (Monarch may never report their procs, and calls to them may never
        return), and none is spawned there again."""
        self.lost_hosts.add(host)
        for index, worker_host in enumerate(self.worker_hosts):
            if worker_host == host:
                self.mark_lost(index, f"its host is gone: {reason}")

    async def _replace(self, index: int, name: str, reason: str) -> bool:
        assert self._respawn is not None
        old_stops = self.workers[index][0]
        host_gone = self.worker_hosts[index] in self.lost_hosts  # nothing there answers a stop
        # A generator out (lost, being replaced, or lost for good) is handed without its mesh,
        # which Monarch refuses once stopped: the worker starts with it taken out.
        handed = [GeneratorRef(name=ref.name, actors=None, config=ref.config)
                  if g in self._out else ref for g, ref in enumerate(self._generators)]
        try:
            procs, actor = await self._respawn(index, name, handed)
        except Exception as e:
            if self._on_fatal is not None:
                self._on_fatal(f"rollout worker {index} could not be replaced: {e}")
            return False
        finally:
            if not host_gone:
                await asyncio.gather(asyncio.wait_for(old_stops.stop(), STOP_TIMEOUT_S),
                                     return_exceptions=True)
        # The router's changes while it started (it is not mirrored yet), and any push under way.
        for g, ref in enumerate(self._generators):
            if g in self._out and handed[g].actors is not None:
                actor.take_out.broadcast(g, "lost while this worker started")
            elif g not in self._out and handed[g] is not ref:
                actor.put_back.broadcast(g, ref)
        if self._in_push:
            actor.set_in_push.broadcast(sorted(self._in_push), True)
        self.workers[index] = (procs, actor)
        self._links[index] = None
        self.assigner.down.discard(index)
        logger.info("rollout worker %d replaced (%s)", index, name)
        async with self._workers_changed():
            self._workers_changed().notify_all()
        return True

    # ---- RouterMirror (generator/router.py): the workers' routers follow the controller's ----
    def set_in_push(self, indices: list[int], in_push: bool) -> None:
        for index in indices:
            (self._in_push.add if in_push else self._in_push.discard)(index)
        for _, actor in self.workers:
            actor.set_in_push.broadcast(list(indices), in_push)

    def take_out(self, index: int, reason: str) -> None:
        self._out.add(index)
        for _, actor in self.workers:
            actor.take_out.broadcast(index, reason)

    def put_back(self, index: int, generator: GenerateFn) -> None:
        assert isinstance(generator, GeneratorHandle), generator
        ref = GeneratorRef.of(generator)
        self._out.discard(index)
        if index < len(self._generators):
            self._generators[index] = ref
        for _, actor in self.workers:
            actor.put_back.broadcast(index, ref)

    def metrics(self, controller_routed: list[int],
                controller_resumed: int | None = None) -> dict[str, float]:
        """Requests routed to each generator, and resumed after an abort (``controller_resumed``
        None: no partial rollouts): the controller's (validation) + the workers'."""
        metrics = {f"router/generator_{g}/num_routed":
                   float(n + sum(routed[g] for routed in self._num_routed if g < len(routed)))
                   for g, n in enumerate(controller_routed)}
        if controller_resumed is not None:
            metrics["generator/num_resumed_requests"] = float(
                controller_resumed + sum(self._num_resumed))
        metrics["rollout/workers_replaced"] = float(sum(self.num_restarts))
        metrics["rollout/worker_group_messages"] = float(self.messages.num_sent)
        metrics["rollout/worker_outcome_messages"] = float(self.messages.num_received)
        return metrics

    async def close(self) -> None:
        for link in self._links:
            if link is not None:
                link.fail(lambda: RolloutWorkerLostError("the pool closed"))
        await self.stop_replacing()

        async def close_one(stops: Any, actor: Any) -> None:
            try:
                await asyncio.wait_for(actor.close.call_one(), STOP_TIMEOUT_S)
            finally:
                await asyncio.wait_for(stops.stop(), STOP_TIMEOUT_S)

        results = await asyncio.gather(*(close_one(p, a) for p, a in self.workers),
                                       return_exceptions=True)
        if self.shared_procs is not None:  # once its workers have closed
            results += await asyncio.gather(
                asyncio.wait_for(self.shared_procs.stop(), STOP_TIMEOUT_S), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("closing a rollout worker: %r", result)
