"""The run's generators: spawned, routed, given new weights, and replaced when one is lost.

    spawn:   spawn_generator_procs (shared_procs.py: one proc mesh over the generators' hosts,
             one proc a generator, or a mesh each) -> plan.generators[i] -> spawn_generator(
             name="generator_i", its proc or its placement host) -> GeneratorHandle; its weight
             transport (shared memory on the trainer's machine, else the message; logged once);
             a GeneratorRouter over them (wrapped in a ResumingGenerateFn with partial
             rollouts) is the GenerateFn the rollouts call
    push_weights(version): generators on the trainer's machine one at a time (the router keeps
             new sessions off it): trainer.push_full_weights(generator, version) (shared memory);
             the others at once: trainer.relay_weights(chain, version, attempt) (every trainer
             rank sends its shards to chain[0], each generator forwards to the next,
             weight_sync/relay.py), then wait_weights(version, attempt) on each, raced against
             its loss; a loss mid-relay: mark_lost, and the survivors after it in the chain get
             attempt + 1 on a chain without it. Each generator done: with partial rollouts,
             abort its running requests; verify_weight_push: trainer.verify_weights
    rewind(version): the trainer was restored to an older version (job.py): every generator
             aborts its requests and takes that version as its next pull
    loss:    a handle's call fails with Monarch's supervision error, or Monarch's fault hook names
             the mesh (supervision.py) -> lost(i):
               router.take_out(i); the handle fails its outstanding calls with GeneratorLostError
               (the loop restarts those groups from their prompts); in a task of its own:
               stop the dead procs (bounded; on the shared mesh, its actor) -> spawn
               "generator_i_r<n>", a mesh of its own, on the same host (a new
               name: late events of the dead mesh cannot match it) -> push the current policy
               version (verified when verify_weight_push) -> router.put_back(i)
             past generator.max_restarts, or when the replacement fails: the run fails, one line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from monarch.actor import ActorError, ProcMesh

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.console import short_report
from torchtitan_rl.controller.fleet.relay_push import (
    RELAY_TIMEOUT_S,
    REPLACEMENT_ATTEMPT,
    PushTotals,
    relay_once,
    until_lost,
)
from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.controller.hosts.shared_procs import spawn_generator_procs
from torchtitan_rl.controller.supervision import ReplaceableMeshes
from torchtitan_rl.generator import (
    Generator,
    GeneratorHandle,
    GeneratorLostError,
    spawn_generator,
)
from torchtitan_rl.generator.client import is_supervision_error
from torchtitan_rl.generator.partial_rollout import ResumingGenerateFn
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.trainer.trainer import TrainerClient
from torchtitan_rl.types import GenerateFn
from torchtitan_rl.weight_sync import WeightTransport

logger = logging.getLogger(__name__)


STOP_TIMEOUT_S = 60.0
SPAWN_TIMEOUT_S = 600.0
LOST_REASON_CHARS = 100
"""How much of a loss's reason a failed replacement's one-line error repeats."""


class GeneratorPool(ReplaceableMeshes):
    def __init__(self, configs: list[Generator.Config], router_config: GeneratorRouter.Config, *,
                 hosts: RunHosts, weight_transport: str, abort_on_pull: bool,
                 policy_version: int, on_fatal: Callable[[str], None]) -> None:
        """``hosts``: where each generator lives (placement.py); ``weight_transport``: the
        trainer's setting (auto | message | shared_memory); ``policy_version``: the version the
        generators start with (the trainer's weights); ``on_fatal``: how a failed replacement
        fails the run (supervision.MeshFailureWatch). The trainer comes with ``spawn``."""
        super().__init__("generator", len(configs))
        self.configs = configs
        self.router_config = router_config
        self.trainer: TrainerClient
        self.hosts = hosts
        self.weight_transport = weight_transport
        self.abort_on_pull = abort_on_pull
        self.policy_version = policy_version
        self.on_fatal = on_fatal
        self.handles: list[GeneratorHandle] = []
        self.router: GeneratorRouter | None = None
        self.resuming: ResumingGenerateFn | None = None
        """Partial rollouts (``abort_on_pull``): resumes requests a pull aborted."""
        self.last_recovery_s = 0.0
        self._served_by_others = 0
        """Requests the other generators took while one was being replaced (finished windows)."""
        self._others_routed_at_loss: dict[int, int] = {}
        self._push_lock = asyncio.Lock()
        self._push_reported: set[int] = set()
        self.shared_procs: ProcMesh | None = None
        """The first generators' one proc mesh (None: a mesh each); stopped at close."""

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
        same_machine = (handle.machine_id == self.trainer.machine_id
                        and not self.hosts.separate_machines)
        where = ("on the trainer's machine" if same_machine else
                 f"{handle.machine_id} is not the trainer's {self.trainer.machine_id}"
                 if handle.machine_id != self.trainer.machine_id else
                 "its host simulates another machine (placement.kind='process')")
        if self.weight_transport == "auto":
            return ("shared_memory" if same_machine else "message"), f"auto: {where}"
        if self.weight_transport == "shared_memory" and not same_machine:
            raise ConfigError(f"trainer.weight_transport='shared_memory' cannot reach "
                              f"{handle.name}: {where}; use 'auto' or 'message'")
        return self.weight_transport, "trainer.weight_transport"  # type: ignore[return-value]

    # ---- weights --------------------------------------------------------------------------------
    async def push_weights(self, version: int) -> dict[str, float]:
        """The trainer's weights to every serving generator, as policy ``version``: those on the
        trainer's machine one at a time by shared memory, the others down one relay chain
        (weight_sync/relay.py). Metrics: bytes (``bytes_moved`` summed over senders,
        ``busiest_sender_bytes``, ``model_bytes``), the last push's timings, the aborted
        requests summed over generators."""
        assert self.router is not None
        async with self._push_lock:
            self.policy_version = version
            push = PushTotals()
            serving = [i for i, h in enumerate(self.handles) if h.lost_reason is None]
            for index in serving:
                if self.handles[index].weight_transport == "shared_memory":
                    await self._push_by_shared_memory(index, version, push)
            await self._relay(version, [i for i in serving if
                                        self.handles[i].weight_transport != "shared_memory"], push)
        metrics = push.metrics(self.abort_on_pull)
        metrics["weight_sync/generators_by_shared_memory"] = float(sum(
            h.weight_transport == "shared_memory" for h in self.handles))
        return metrics

    async def _push_by_shared_memory(self, index: int, version: int, push: PushTotals) -> None:
        assert self.router is not None
        generator = self.handles[index]
        self.router.set_syncing([index], True)
        trainer_called = False
        try:
            metrics = await until_lost(generator, self.trainer.push_full_weights(generator, version))
            trainer_called = True
            push.timings.update(metrics)
            moved = metrics.get("weight_sync/bytes", 0.0)
            push.by_shared_memory(moved)
            await self._pulled(index, version, moved, push)
        except Exception as e:
            # The trainer's call failing by itself (not an error its endpoint raised) is the
            # trainer's death, not this generator's: the job restarts the trainer.
            trainer_died = not trainer_called and not isinstance(e, ActorError)
            if not (isinstance(e, GeneratorLostError)
                    or (is_supervision_error(e) and not trainer_died)):
                raise
            generator.mark_lost(f"during the push of v{version}: {e}")
            logger.warning("push v%d to %s failed: it was lost", version, generator.name)
        finally:
            self.router.set_syncing([index], False)

    async def _relay(self, version: int, indices: list[int], push: PushTotals) -> None:
        """Relay ``version`` down a chain of the generators ``indices``; a generator lost on the
        way is replaced (mark_lost), and the survivors downstream of it, which never get the
        rest, take a new attempt on a chain without it."""
        assert self.router is not None
        attempt = 0
        start = time.perf_counter()
        if indices:
            push.timings["weight_sync/num_relayed"] = float(len(indices))
        while indices:
            syncing = indices
            self.router.set_syncing(syncing, True)
            try:
                chain = [self.handles[i] for i in indices]
                if attempt:
                    logger.warning("relay v%d: attempt %d to %s", version, attempt,
                                   ",".join(h.name for h in chain))

                async def pulled(position: int, result: dict[str, float],
                                 chain_indices: list[int] = indices) -> None:
                    await self._pulled(chain_indices[position], version, result["sent_bytes"],
                                       push)

                missed = await relay_once(self.trainer, chain, version, attempt, push, pulled)
                indices = [indices[p] for p in missed]
            finally:
                self.router.set_syncing(syncing, False)
            attempt += 1
        if attempt:  # from the first send to the last generator's pull, attempts included
            push.timings["weight_sync/relay_s"] = time.perf_counter() - start

    async def _pulled(self, index: int, version: int, moved: float, push: PushTotals) -> None:
        """Generator ``index`` serves ``version`` now."""
        generator = self.handles[index]
        if index not in self._push_reported:
            self._push_reported.add(index)
            logger.info("%s: pushes by %s; v%d moved %.1f MB", generator.name,
                        generator.weight_transport, version, moved / 1e6)
        if self.abort_on_pull:
            # Partial rollouts: running requests return their tokens so far and are resumed
            # (prompt + partial) on the new weights (partial_rollout.py).
            push.num_aborted += await until_lost(generator, generator.abort(None))
        if self.trainer.verify_push and generator.weight_transport != "shared_memory":
            await self.trainer.verify_weights([generator], version)  # debug: gathers
            push.num_verified += 1

    async def rewind(self, version: int) -> None:
        """The trainer was restored to ``version`` (an older policy than the generators serve):
        every serving generator aborts what it runs (the run's rollouts were cancelled) and takes
        ``version`` as its next pull; one that cannot is replaced (it gets ``version`` then).
        ``push_weights(version)`` comes next."""
        async with self._push_lock:
            self.policy_version = version
            for generator in self.handles:
                if generator.lost_reason is not None:
                    continue
                try:
                    await until_lost(generator, generator.abort(None))
                    await until_lost(generator, generator.rewind_policy_version(version))
                except Exception as e:
                    if not isinstance(e, GeneratorLostError):
                        generator.mark_lost(f"rewinding to v{version}: {short_report(str(e))}")
                    logger.warning("%s could not go back to v%d: it is replaced",
                                   generator.name, version)

    # ---- loss and replacement -------------------------------------------------------------------
    def mark_lost(self, index: int, reason: str) -> None:
        """Generator ``index`` died: take it out, fail its calls, replace it (once)."""
        handle = self.handles[index]
        handle.mark_lost(reason)  # reports back through _on_handle_lost

    def _on_handle_lost(self, handle: GeneratorHandle, reason: str) -> None:
        if self.closing or handle not in self.handles:
            return  # a handle replaced already
        index = self.handles.index(handle)
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
        try:
            try:
                await old.close(timeout_s=STOP_TIMEOUT_S)
                if old.procs is None:  # a proc of the shared mesh: its actor must not linger
                    await asyncio.wait_for(old.actors.stop(), STOP_TIMEOUT_S)
            except Exception as e:  # a dead mesh may not stop cleanly: it is gone either way
                logger.warning("stopping lost %s: %r", old.name, e)
            try:
                new = await asyncio.wait_for(self._spawn(index, name), SPAWN_TIMEOUT_S)
                async with self._push_lock:  # not while the loop pushes: one version, once
                    if self.policy_version > 0:  # else it serves model_dir: version 0 already
                        await self._push_replacement(new, self.policy_version)
                    self.handles[index] = new
            except BaseException:
                if new is not None and self.handles[index] is not new:  # spawned, not serving
                    await asyncio.gather(new.close(timeout_s=STOP_TIMEOUT_S),
                                         return_exceptions=True)
                raise
            assert new is not None
            self.router.put_back(index, new)
        except Exception as e:
            logger.warning("replacing %s failed", old.name, exc_info=True)
            if not self.closing:  # else the run is over and closed the trainer under it
                # The loss was logged whole when it happened; the line keeps room for the cause.
                lost = short_report(reason, LOST_REASON_CHARS)
                self.on_fatal(f"replacing {old.name} (lost: {lost}) failed: {e!r}")
            return False
        self.last_recovery_s = time.perf_counter() - start
        self._served_by_others += (self._others_routed(index)
                                   - self._others_routed_at_loss.pop(index))
        logger.warning("%s replaced by %s (policy v%d) in %.1f s", old.name, name,
                       self.policy_version, self.last_recovery_s)
        return True

    async def _push_replacement(self, new: GeneratorHandle, version: int) -> None:
        """The current version into a replacement (not serving yet): shared memory, or a relay
        chain of one."""
        if new.weight_transport == "shared_memory":
            await until_lost(new, self.trainer.push_full_weights(new, version))
            return
        attempt = REPLACEMENT_ATTEMPT  # apart from the loop's attempts of the same version
        # The loop may be training meanwhile: no step between the send and the read-back.
        async with self.trainer.weights_lock:
            wait = until_lost(new, new.rank0.wait_weights.call_one(version, attempt))
            waiting = asyncio.ensure_future(wait)
            try:
                await self.trainer.relay_weights([new], version, attempt)
                await asyncio.wait_for(waiting, RELAY_TIMEOUT_S)
            finally:
                waiting.cancel()
            if self.trainer.verify_push:
                await self.trainer.verify_weights([new], version)

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
            "generator/recovery_s": self.last_recovery_s,
            "generator/requests_served_by_others_during_recovery": float(served),
        }
        if self.resuming is not None:
            metrics["generator/num_resumed_requests"] = float(self.resuming.num_resumed)
        return metrics

    async def close(self) -> None:
        await self.stop_replacing()
        results = await asyncio.gather(*(h.close(timeout_s=STOP_TIMEOUT_S) for h in self.handles),
                                       return_exceptions=True)
        if self.shared_procs is not None:  # once its generators have closed
            results += await asyncio.gather(
                asyncio.wait_for(self.shared_procs.stop(), STOP_TIMEOUT_S),
                return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result,
                                                                    asyncio.CancelledError):
                logger.warning("shutdown: %r", result)
