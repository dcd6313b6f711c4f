"""The run's generators: spawned, routed, given new weights, and replaced when one is lost.

    spawn:   spawn_generator_procs (shared_procs.py: one proc mesh over the generators' hosts,
             one proc a generator, or a mesh each) -> plan.generators[i] -> spawn_generator(
             name="generator_i", its proc or its placement host) -> GeneratorHandle; its weight
             transport (weight_sync.push.choose_transport; logged once);
             a GeneratorRouter over them (wrapped in a ResumingGenerateFn with partial
             rollouts) is the GenerateFn the rollouts call
    push_weights(version): WeightPush(trainer, router).run(every serving generator, version)
             (fleet/weight_push.py: shared memory on the trainer's machine, the relay elsewhere;
             choose_transport in weight_sync/push.py picked each generator's at spawn)
    rewind(version): the trainer was restored to an older version (job.py): every generator
             aborts its requests and takes that version as its next pull
    loss:    a handle's call fails with Monarch's supervision error, Monarch's fault hook names
             the mesh (supervision.py: ReplaceableMeshes), or its host's worker stops answering
             (host_watch.py: every generator on it, and on_host_lost: the rollout workers
             there) -> mark_lost(i):
               router.take_out(i); the handle fails its outstanding calls with GeneratorLostError
               (the loop restarts those groups from their prompts); in a task of its own:
               stop the dead procs (bounded; on the shared mesh, its actor) -> spawn
               "generator_i_r<n>", a mesh of its own, on the same host (a new
               name: late events of the dead mesh cannot match it) -> push the current policy
               version (verified when verify_weight_push) -> router.put_back(i)
             when the replacement fails (its host is gone: a lost node) while other generators
             serve: it stays out, one warning, and the run goes on with the others;
             past generator.max_restarts, or with no generator left: the run fails, one line.
    fleet requests (requests.py, read every health poll): add_generator() spawns one more on a
             new host (slurm: a one-node allocation) and pushes it the current version before it
             serves; remove_generator(name) drains one (nothing new routed, its requests finish)
             and closes it, never replaced.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable

from monarch.actor import ProcMesh

from torchtitan_rl.console import CONSOLE, short_report
from torchtitan_rl.controller.fleet import requests as fleet_requests
from torchtitan_rl.controller.fleet.weight_push import WeightPush, until_lost
from torchtitan_rl.controller.hosts.host_watch import HostWatch
from torchtitan_rl.controller.hosts.placement import HostUnreachableError, RunHosts
from torchtitan_rl.controller.hosts.shared_procs import spawn_generator_procs
from torchtitan_rl.controller.supervision import ReplaceableMeshes
from torchtitan_rl.generator import (
    Generator,
    GeneratorHandle,
    GeneratorLostError,
    spawn_generator,
)
from torchtitan_rl.generator.engine_stats import EngineStatsReport
from torchtitan_rl.generator.partial_rollout import ResumingGenerateFn
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.monarch_failures import is_supervision_error
from torchtitan_rl.trainer.trainer import TrainerClient
from torchtitan_rl.types import GenerateFn
from torchtitan_rl.weight_sync.push import WeightTransport, choose_transport

logger = logging.getLogger(__name__)


STOP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0
"""A generator removed on request: how long its requests in flight get to finish."""
SPAWN_TIMEOUT_S = 600.0
LOST_REASON_CHARS = 100
"""How much of a loss's reason a failed replacement's one-line error repeats."""
PUSH_ATTEMPTS = 3
"""Tries of the push into a replacement whose trainer died under it (restarted in between)."""


class FleetRequestRefused(RuntimeError):
    """A fleet request that cannot be carried out (its answer says why)."""


class GeneratorPool(ReplaceableMeshes):
    def __init__(self, configs: list[Generator.Config], router_config: GeneratorRouter.Config, *,
                 hosts: RunHosts, weight_transport: str, abort_on_pull: bool,
                 policy_version: int, on_fatal: Callable[[str], None],
                 host_poll_s: float = 2.0, run_dir: pathlib.Path | None = None) -> None:
        """``hosts``: where each generator lives (placement.py); ``weight_transport``: the
        trainer's setting (auto | message | shared_memory); ``policy_version``: the version the
        generators start with (the trainer's weights); ``on_fatal``: how a failed replacement
        fails the run (supervision.MeshFailureWatch); ``host_poll_s``: how often the generator
        hosts' workers are probed, where the placement names them (host_watch.py), and the
        run folder ``run_dir`` read for fleet requests (requests.py). The trainer comes with
        ``spawn``."""
        super().__init__("generator", len(configs))
        self.configs = configs
        self.router_config = router_config
        self._trainer: TrainerClient
        self._trainer_changed = asyncio.Event()
        """Set (and renewed) when a restarted trainer replaces the one pushes come from."""
        self.hosts = hosts
        self.weight_transport = weight_transport
        self.abort_on_pull = abort_on_pull
        self.policy_version = policy_version
        self.on_fatal = on_fatal
        self.handles: list[GeneratorHandle] = []
        self.router: GeneratorRouter | None = None
        self.num_retired = 0
        """Generators lost for good (their replacement failed while others served)."""
        self.resuming: ResumingGenerateFn | None = None
        """Partial rollouts (``abort_on_pull``): resumes requests a pull aborted."""
        self.last_recovery_s = 0.0
        self._served_by_others = 0
        """Requests the other generators took while one was being replaced (finished windows)."""
        self._others_routed_at_loss: dict[int, int] = {}
        self._push_lock = asyncio.Lock()
        self._push_reported: set[str] = set()
        self.host_poll_s = host_poll_s
        self.removed: set[int] = set()
        """Generators drained and closed on request (requests.py): never replaced."""
        self.lost_hosts: set[int] = set()
        """Generator hosts gone whole (host_watch.py): nothing is spawned or stopped there."""
        self.on_host_lost: list[Callable[[int, str], None]] = []
        """Told of each generator host gone whole, after its generators (the rollout workers
        on it are lost with it)."""
        self.run_dir = run_dir
        self._tasks: list[asyncio.Task[None]] = []
        """The host watch and the fleet requests' watch, cancelled at close."""
        self.shared_procs: ProcMesh | None = None
        """The first generators' one proc mesh (None: a mesh each); stopped at close."""

    @property
    def trainer(self) -> TrainerClient:
        """Where pushes come from; a restarted trainer replaces it (trainer_restart.py)."""
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: TrainerClient) -> None:
        self._trainer = trainer
        changed, self._trainer_changed = self._trainer_changed, asyncio.Event()
        changed.set()

    async def spawn(self, trainer: Awaitable[TrainerClient]) -> GenerateFn:
        """Spawn every generator while ``trainer`` (the trainer's spawn, started by the caller)
        comes up: the two start-ups overlap, and each generator's weight transport is chosen
        once both are up. Returns the GenerateFn the rollouts call: the router over them,
        behind a ResumingGenerateFn with partial rollouts. The caller closes ``trainer``."""
        try:
            shared = spawn_generator_procs(self.configs, self.hosts)
            if shared is not None:
                self.shared_procs, proc_of = shared
            for index in range(len(self.configs)):
                self.handles.append(await spawn_generator(
                    self.configs[index], name=self.names[index],
                    host=self.hosts.generator_host(index),
                    procs=proc_of(index) if shared else None, on_lost=self._on_handle_lost))
            self.trainer = await trainer
            for handle in self.handles:
                handle.weight_transport, why = self._transport_for(handle)
                logger.info("%s: weight pushes by %s (%s)", handle.name, handle.weight_transport,
                            why)
        except BaseException:
            await self.close()
            raise
        self.router = self.router_config.build(generators=list(self.handles))
        if self.hosts.generator_workers:
            watch = HostWatch(self.hosts.generator_workers, self._on_host_lost,
                              interval_s=self.host_poll_s)
            self._tasks.append(asyncio.create_task(watch.run(), name="generator-host-watch"))
        if self.run_dir is not None:
            self._tasks.append(asyncio.create_task(self.watch_requests(self.run_dir),
                                                   name="generator-fleet-requests"))
        if self.abort_on_pull:
            self.resuming = ResumingGenerateFn(self.router)
            return self.resuming
        return self.router

    async def _spawn(self, index: int, name: str) -> GeneratorHandle:
        """A replacement for generator ``index`` on its host (a mesh of its own), with the weight
        transport its first one had."""
        handle = await spawn_generator(self.configs[index], name=name,
                                       host=self.hosts.generator_host(index),
                                       on_lost=self._on_handle_lost)
        handle.weight_transport, _ = self._transport_for(handle)
        return handle

    def _transport_for(self, handle: GeneratorHandle) -> tuple[WeightTransport, str]:
        return choose_transport(self.weight_transport, generator=handle.name,
                                generator_machine=handle.machine_id,
                                trainer_machine=self.trainer.machine_id,
                                separate_machines=self.hosts.separate_machines)

    # ---- weights --------------------------------------------------------------------------------
    async def push_weights(self, policy_version: int) -> dict[str, float]:
        """The trainer's weights to every serving generator, as ``policy_version``: those on the
        trainer's machine one at a time by shared memory, the others down one relay chain
        (fleet/weight_push.py). Metrics: bytes (``bytes_moved`` summed over senders,
        ``busiest_sender_bytes``, ``model_bytes``), the last push's timings, the aborted
        requests summed over generators."""
        assert self.router is not None
        async with self._push_lock:
            self.policy_version = policy_version
            metrics = await self._weight_push().run(
                [(i, h) for i, h in enumerate(self.handles) if h.lost_reason is None],
                policy_version)
        metrics["weight_sync/generators_by_shared_memory"] = float(sum(
            h.weight_transport == "shared_memory" for h in self.handles))
        return metrics

    async def take_engine_stats(self) -> dict[int, EngineStatsReport]:
        """Each serving generator's engine numbers since the last call (generator/
        engine_stats.py) by router index; one lost meanwhile, or with an engine that reports
        none (the stand-in), is left out."""
        serving = [(i, h) for i, h in enumerate(self.handles) if h.lost_reason is None]
        results = await asyncio.gather(*(until_lost(h, h.rank0.take_engine_stats.call_one())
                                         for _, h in serving), return_exceptions=True)
        reports = {}
        for (index, handle), result in zip(serving, results):
            if isinstance(result, BaseException) and not isinstance(result, GeneratorLostError):
                logger.warning("%s: no engine stats this step: %s", handle.name,
                               short_report(repr(result)))
            elif isinstance(result, EngineStatsReport):
                reports[index] = result
        return reports

    def _weight_push(self) -> WeightPush:
        assert self.router is not None
        return WeightPush(self.trainer, self.router, abort_on_pull=self.abort_on_pull,
                          reported=self._push_reported)

    async def rewind(self, policy_version: int) -> None:
        """The trainer was restored to ``policy_version`` (an older policy than the generators
        serve): every serving generator aborts what it runs (the run's rollouts were cancelled)
        and takes ``policy_version`` as its next pull; one that cannot is replaced (it gets
        ``policy_version`` then). ``push_weights(policy_version)`` comes next."""
        async with self._push_lock:
            self.policy_version = policy_version
            for generator in self.handles:
                if generator.lost_reason is not None:
                    continue
                try:
                    await until_lost(generator, generator.abort(None))
                    await until_lost(generator, generator.rewind_policy_version(policy_version))
                except Exception as e:
                    if not isinstance(e, GeneratorLostError):
                        generator.mark_lost(
                            f"rewinding to v{policy_version}: {short_report(str(e))}")
                    logger.warning("%s could not go back to v%d: it is replaced",
                                   generator.name, policy_version)

    # ---- a fleet that changes mid-run (controller/fleet/requests.py) ----------------------------
    async def watch_requests(self, run_dir: pathlib.Path) -> None:
        """Answer the run folder's fleet requests, oldest first, every ``host_poll_s``."""
        while True:
            await asyncio.sleep(self.host_poll_s)  # the poll's period, not a synchronisation
            for request in fleet_requests.pending(run_dir):
                if isinstance(request, tuple):
                    fleet_requests.answer(*request, done=False)
                    continue
                try:
                    if request.action == "add":
                        outcome = await self.add_generator()
                    else:
                        outcome = await self.remove_generator(request.generator or "")
                    done = True
                except FleetRequestRefused as e:
                    outcome, done = f"refused: {e}", False
                except Exception as e:
                    logger.warning("fleet request %s failed", request.path.name, exc_info=True)
                    outcome, done = f"failed: {short_report(repr(e), 300)}", False
                if not done:
                    logger.warning("fleet request %s %s", request.action, outcome)
                fleet_requests.answer(request.path, outcome, done=done)

    async def add_generator(self) -> str:
        """One more generator (generator 0's config) on a host of its own where the placement
        makes hosts (slurm; the generators' host when local), given the current policy version,
        then routed to."""
        assert self.router is not None
        if self.router.mirrored:
            raise FleetRequestRefused("rollout workers hold the generators they were spawned "
                                      "with (rollouter.num_workers > 0)")
        index = len(self.handles)
        name = f"generator_{index}"
        try:
            host = await self.hosts.add_generator_host(index)
        except HostUnreachableError as e:
            raise FleetRequestRefused(str(e)) from None
        config = self.configs[0]
        handle = await asyncio.wait_for(
            spawn_generator(config, name=name, host=host, on_lost=self._on_handle_lost),
            SPAWN_TIMEOUT_S)
        handle.weight_transport, _ = self._transport_for(handle)
        async with self._push_lock:  # one version, once: not while the loop pushes
            if self.policy_version > 0:
                await self._weight_push().to_replacement(handle, self.policy_version)
            self.configs.append(config)
            self.names.append(name)
            self.num_restarts.append(0)
            self.handles.append(handle)
            self.router.add(handle)
        outcome = (f"{name} added (policy v{self.policy_version}): "
                   f"{self.router.num_serving()} generators serve")
        logger.info(outcome, extra=CONSOLE)
        return outcome

    async def remove_generator(self, name: str) -> str:
        """Drain generator ``name``: nothing new is routed to it, its requests in flight finish
        (those still running after ``DRAIN_TIMEOUT_S`` restart elsewhere from their prompts),
        then it is closed; the run goes on with the others."""
        assert self.router is not None
        index = next((i for i, h in enumerate(self.handles)
                      if name in (h.name, f"generator_{i}")), None)
        if index is None:
            raise FleetRequestRefused(f"no generator {name!r} (generator_0 .. "
                                      f"generator_{len(self.handles) - 1})")
        handle = self.handles[index]
        if handle.lost_reason is not None or self.replacing(index):
            why = handle.lost_reason or "being replaced"
            raise FleetRequestRefused(f"{name} does not serve ({why})")
        if self.router.num_serving() <= 1:
            raise FleetRequestRefused(f"{name} is the last generator serving")
        self.removed.add(index)
        self.router.take_out(index)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.router.inflight_requests[index] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # polling the drain: requests end on their own schedule
        left = self.router.inflight_requests[index]
        async with self._push_lock:  # a push in flight to it finishes first
            handle.detach(f"{name} was removed")  # what is left restarts from its prompts
        try:
            await handle.close(timeout_s=STOP_TIMEOUT_S)
            if handle.procs is None:  # a proc of the shared mesh: its actor must not linger
                await asyncio.wait_for(handle.actors.stop(), STOP_TIMEOUT_S)
        except Exception as e:
            logger.warning("closing removed %s: %r", name, e)
        outcome = (f"{name} removed ({left} requests restarted elsewhere): "
                   f"{self.router.num_serving()} generators serve")
        logger.info(outcome, extra=CONSOLE)
        return outcome

    # ---- loss and replacement -------------------------------------------------------------------
    def mark_lost(self, index: int, reason: str) -> None:
        """Generator ``index`` died: take it out, fail its calls, replace it (once)."""
        handle = self.handles[index]
        handle.mark_lost(reason)  # reports back through _on_handle_lost

    def _on_host_lost(self, host_index: int, reason: str) -> None:
        """A generator host is gone whole (host_watch.py): every generator on it is lost, and
        none is replaced there."""
        self.lost_hosts.add(host_index)
        for index, handle in enumerate(self.handles):
            if (self.hosts.generator_host_index(index) == host_index
                    and handle.lost_reason is None):
                logger.info("%s's host is gone: %s", handle.name, reason)
                self.mark_lost(index, f"its host is gone: {reason}")
        for listener in self.on_host_lost:
            listener(host_index, reason)

    def _on_handle_lost(self, handle: GeneratorHandle, reason: str) -> None:
        if self.closing or handle not in self.handles:
            return  # a handle replaced already
        index = self.handles.index(handle)
        if index in self.removed:
            return  # drained on request: not replaced
        if self.replacing(index):
            return
        assert self.router is not None
        self.router.take_out(index)
        self._others_routed_at_loss[index] = self._others_routed(index)
        limit = self.configs[index].max_restarts
        if self.num_restarts[index] >= limit:
            self.num_restarts[index] += 1
            self.on_fatal(f"{handle.name} was lost {self.num_restarts[index]} times "
                          f"(generator.max_restarts={limit}): {reason}")
            return
        self.start_replacement(index, reason)

    async def _replace(self, index: int, name: str, reason: str) -> bool:
        assert self.router is not None
        start = time.perf_counter()
        old = self.handles[index]
        new: GeneratorHandle | None = None
        host_gone = self._host_gone(index)
        try:
            try:
                if not host_gone:  # a gone host's procs cannot answer a stop
                    await old.close(timeout_s=STOP_TIMEOUT_S)
                    if old.procs is None:  # a proc of the shared mesh: its actor must not linger
                        await asyncio.wait_for(old.actors.stop(), STOP_TIMEOUT_S)
            except Exception as e:  # a dead mesh may not stop cleanly: it is gone either way
                logger.warning("stopping lost %s: %r", old.name, e)
            try:
                if host_gone:
                    raise HostUnreachableError(
                        f"its host {self.hosts.generator_host_index(index)} is gone")
                new = await asyncio.wait_for(self._spawn(index, name), SPAWN_TIMEOUT_S)
                await self._push_to_replacement(index, new)
            except BaseException:
                if new is not None and self.handles[index] is not new:  # spawned, not serving
                    await asyncio.gather(new.close(timeout_s=STOP_TIMEOUT_S),
                                         return_exceptions=True)
                raise
            assert new is not None
            self.router.put_back(index, new)
        except Exception as e:
            logger.info("replacing %s failed", old.name, exc_info=True)
            if self.closing:  # the run is over and closed the trainer under it
                return False
            # The loss was logged whole when it happened; the line keeps room for the cause.
            lost = short_report(reason, LOST_REASON_CHARS)
            if self.router.num_serving() == 0:
                self.on_fatal(f"replacing {old.name} (lost: {lost}) failed: {e!r}")
                return False
            self.num_retired += 1
            logger.warning("%s was lost and cannot be replaced on its host (%s): the run goes on "
                           "with %d of %d generators", old.name, short_report(repr(e), 160),
                           self.router.num_serving(), len(self.handles))
            return False
        self.last_recovery_s = time.perf_counter() - start
        self._served_by_others += (self._others_routed(index)
                                   - self._others_routed_at_loss.pop(index))
        logger.warning("%s replaced by %s (policy v%d) in %.1f s", old.name, name,
                       self.policy_version, self.last_recovery_s)
        if self.router.trace is not None:
            self.router.trace.span("recoveries", f"{old.name} replaced by {name}", start,
                                   start + self.last_recovery_s, policy_version=self.policy_version)
        return True

    async def _push_to_replacement(self, index: int, new: GeneratorHandle) -> None:
        """The current version into ``new``, which then is generator ``index``. A trainer that
        dies under this push is restarted by the job (trainer_restart.py), which then pushes
        its restored weights to every generator: the push is tried again from the new trainer
        rather than the replacement given up (with no other generator serving, the run would
        fail)."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            trainer_changed = self._trainer_changed
            try:
                async with self._push_lock:  # not while the loop pushes: one version, once
                    if self.policy_version > 0:  # else it serves model_dir: version 0 already
                        await self._weight_push().to_replacement(new, self.policy_version)
                    self.handles[index] = new
                return
            except Exception as e:
                if not is_supervision_error(e) or new.lost_reason is not None or \
                        attempt == PUSH_ATTEMPTS:
                    raise
                logger.warning("pushing to %s failed (%s): once the trainer is restarted, "
                               "again from it", new.name, short_report(repr(e)))
                waits = [asyncio.ensure_future(trainer_changed.wait()),
                         asyncio.ensure_future(new.lost_event.wait())]
                await asyncio.wait(waits, timeout=SPAWN_TIMEOUT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                if not trainer_changed.is_set() or new.lost_reason is not None:
                    raise

    def _host_gone(self, index: int) -> bool:
        return self.hosts.generator_host_index(index) in self.lost_hosts

    def _others_routed(self, index: int) -> int:
        assert self.router is not None
        return sum(n for i, n in enumerate(self.router.num_routed) if i != index)

    def metrics(self) -> dict[str, float]:
        assert self.router is not None
        served = self._served_by_others + sum(
            self._others_routed(i) - at_loss for i, at_loss in self._others_routed_at_loss.items())
        metrics = {
            **self.router.metrics(),
            "generator/restarts": float(sum(self.num_restarts)),
            "generator/num_retired": float(self.num_retired),
            "generator/num_serving": float(self.router.num_serving()),
            "generator/recovery_s": self.last_recovery_s,
            "generator/requests_served_by_others_during_recovery": float(served),
        }
        if self.resuming is not None:
            metrics["generator/num_resumed_requests"] = float(self.resuming.num_resumed)
        return metrics

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_replacing()
        results = await asyncio.gather(*(h.close(timeout_s=STOP_TIMEOUT_S)
                                         for i, h in enumerate(self.handles)
                                         if not self._host_gone(i)),
                                       return_exceptions=True)
        if self.shared_procs is not None and not self.lost_hosts:  # once its generators closed
            results += await asyncio.gather(
                asyncio.wait_for(self.shared_procs.stop(), STOP_TIMEOUT_S),
                return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result,
                                                                    asyncio.CancelledError):
                logger.warning("shutdown: %r", result)
