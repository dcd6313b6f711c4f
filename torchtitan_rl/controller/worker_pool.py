"""The controller's side of the rollout workers (rollouter.num_workers > 0): spawn them beside the
generators, hand each admitted group to the least loaded one, mirror the router to them.

    spawn:      worker i on hosts.generator_host(i mod num_generators) (this host when local),
                one proc each -> RolloutWorker(spec, [GeneratorRef of every generator])
                -> ready() (its pid; a worker that cannot build its parts fails the start)
                -> router.add_mirror(pool): set_syncing / take_out / put_back reach every worker
    run_group:  WorkerAssigner.acquire() -> worker.run_group(...) -> GroupOutcome
                (lost_reason set -> GeneratorLostError here, as the in-process path raises it;
                the caller cancelled -> worker.cancel_group(group_id))
    close:      every worker closes (it never closes a generator), then its proc stops;
                before the generators (RunParts.close)

The controller's busy clock (generator idle ratio) counts a group's call as busy time, and the
``router/generator_i/num_routed`` metrics add the workers' counts to the controller's own
(validation): what the in-process router counted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from torchtitan_rl.controller.idle_ratios import BusyClock
from torchtitan_rl.controller.placement import RunHosts
from torchtitan_rl.controller.rollout_worker import (
    GeneratorRef,
    GroupOutcome,
    RolloutWorker,
    RolloutWorkerSpec,
)
from torchtitan_rl.generator import GeneratorHandle, GeneratorLostError
from torchtitan_rl.types import GenerateFn, Sampling

logger = logging.getLogger(__name__)

SPAWN_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


class WorkerAssigner:
    """Picks the worker for the next group: the fewest groups in flight, ties to the one given
    the fewest groups so far, then the lowest index (round-robin while all are equally busy).

    Invariant: 0 <= in_flight[i] <= num_assigned[i], checked on every event.
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.in_flight = [0] * num_workers
        self.num_assigned = [0] * num_workers

    def acquire(self) -> int:
        index = min(range(len(self.in_flight)),
                    key=lambda i: (self.in_flight[i], self.num_assigned[i], i))
        self.in_flight[index] += 1
        self.num_assigned[index] += 1
        return index

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1
        assert 0 <= self.in_flight[index] <= self.num_assigned[index], (index, self.in_flight)


class RolloutWorkerPool:
    def __init__(self, workers: list[tuple[Any, Any]], *, num_generators: int,
                 busy_clock: BusyClock | None = None) -> None:
        """``workers``: (proc mesh, RolloutWorker actor mesh) each."""
        self.workers = workers
        self.assigner = WorkerAssigner(len(workers))
        self.busy_clock = busy_clock or BusyClock()
        self._num_routed = [[0] * num_generators for _ in workers]
        """Each worker's cumulative requests per generator, as its latest outcome said."""
        self._num_resumed = [0] * len(workers)
        """Each worker's cumulative resumed requests (partial rollouts), likewise."""

    @classmethod
    async def spawn(cls, spec: RolloutWorkerSpec, num_workers: int, *,
                    generators: list[GeneratorHandle], hosts: RunHosts,
                    busy_clock: BusyClock | None = None) -> RolloutWorkerPool:
        refs = [GeneratorRef.of(handle) for handle in generators]
        workers: list[tuple[Any, Any]] = []
        try:
            for i in range(num_workers):
                name = f"rollout_worker_{i}"
                procs = hosts.generator_host(i % len(generators)).spawn_procs(
                    per_host={"procs": 1}, name=name)
                workers.append((procs, procs.spawn(name, RolloutWorker, spec, refs)))
            pids = await asyncio.wait_for(asyncio.gather(
                *(actor.ready.call_one() for _, actor in workers)), SPAWN_TIMEOUT_S)
        except BaseException:
            await asyncio.gather(*(procs.stop() for procs, _ in workers), return_exceptions=True)
            raise
        logger.info("%d rollout workers started (pids %s)", num_workers, ",".join(map(str, pids)))
        return cls(workers, num_generators=len(generators), busy_clock=busy_clock)

    async def run_group(self, group_id: int, prompt_index: int, group_size: int,
                        sampling: Sampling, *, attempt: int = 0) -> GroupOutcome:
        """Group ``group_id`` rolled out by a worker. Raises GeneratorLostError when a
        generator serving it was lost (restart it whole, as in the controller)."""
        index = self.assigner.acquire()
        actor = self.workers[index][1]
        self.busy_clock.enter()
        try:
            outcome: GroupOutcome = await actor.run_group.call_one(
                group_id, prompt_index, group_size, sampling, attempt)
        except asyncio.CancelledError:
            actor.cancel_group.broadcast(group_id)  # else it generates for nobody
            raise
        finally:
            self.busy_clock.exit()
            self.assigner.release(index)
        self._num_routed[index] = outcome.num_routed
        self._num_resumed[index] = outcome.num_resumed
        if outcome.lost_reason is not None:
            raise GeneratorLostError(outcome.lost_reason)
        return outcome

    # ---- RouterMirror (controller/router.py): the workers' routers follow the controller's ----
    def set_syncing(self, index: int, syncing: bool) -> None:
        for _, actor in self.workers:
            actor.set_syncing.broadcast(index, syncing)

    def take_out(self, index: int, reason: str) -> None:
        for _, actor in self.workers:
            actor.take_out.broadcast(index, reason)

    def put_back(self, index: int, generator: GenerateFn) -> None:
        assert isinstance(generator, GeneratorHandle), generator
        ref = GeneratorRef.of(generator)
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
        return metrics

    async def close(self) -> None:
        async def close_one(procs: Any, actor: Any) -> None:
            try:
                await asyncio.wait_for(actor.close.call_one(), STOP_TIMEOUT_S)
            finally:
                await asyncio.wait_for(procs.stop(), STOP_TIMEOUT_S)

        results = await asyncio.gather(*(close_one(p, a) for p, a in self.workers),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("closing a rollout worker: %r", result)
