"""One push of the trainer's weights to the generators, run in one direction: pool -> trainer
ranks -> transport -> generators, and back to the pool as metrics.

    GeneratorPool.push_weights(version) -> WeightPush(trainer, router).run(serving, version):
      each generator on the trainer's machine, one at a time (the router keeps new sessions off
        it): trainer.push_weights(generator, version): every rank gathers, rank 0 copies
        once into shared memory and sends references (weight_sync/push.py, shared_memory.py)
      the others at once, down one chain: trainer.relay_weights(chain, version, attempt): every
        rank sends its own shards to chain[0], each generator forwards them to the next
        (weight_sync/relay.py); each generator's wait_weights(version, attempt), raced against
        its loss; a loss at chain position p: the ones before p finish, the ones after p take
        attempt + 1 on a chain without it
      each generator done (pulled): with partial rollouts, abort its running requests (they
        resume on the new weights); with verify_weight_push, read its weights back bitwise
    -> PushTotals.metrics(): bytes per sender, the last timings, aborted and verified counts
    WeightPush.to_replacement(new, version): a replacement, before it serves

Invariant: a call to a lost generator is never awaited (monarch#3435): every wait races the
handle's ``lost_event`` (until_lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from monarch.actor import ActorError

from torchtitan_rl.generator import GeneratorHandle, GeneratorLostError
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.metrics.trace import GENERATOR_PID
from torchtitan_rl.monarch_failures import is_supervision_error
from torchtitan_rl.trainer.trainer import TrainerClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

RELAY_TIMEOUT_S = 600.0
"""The most a relayed push waits for its next generator to finish (a loss is seen sooner)."""
REPLACEMENT_ATTEMPT = 1 << 20
"""A replacement's push attempt number: above any attempt of the loop's relay."""


class PushTotals:
    """What one push_weights moved: bytes per sender (shared-memory copies count as trainer rank
    0's), the last timings, the requests aborted and the generators verified."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.model_bytes = 0.0
        self.bytes_moved = 0.0
        self.busiest_trainer_rank = 0.0
        self.by_shared_memory_bytes = 0.0
        self.busiest_generator = 0.0
        self.num_aborted = 0
        self.num_verified = 0
        """Relayed generators read back bit-exact (verify_weight_push; a difference raises)."""

    def by_shared_memory(self, num_bytes: float) -> None:
        self.model_bytes = num_bytes
        self.bytes_moved += num_bytes
        self.by_shared_memory_bytes += num_bytes

    def by_trainer(self, sent: dict[str, float]) -> None:
        self.model_bytes = sent["model_bytes"]
        self.bytes_moved += sent["sent_bytes"]
        self.busiest_trainer_rank = max(self.busiest_trainer_rank, sent["busiest_sender_bytes"])
        self.timings["weight_sync/send_s"] = sent["send_s"]

    def by_generator(self, result: dict[str, float]) -> None:
        self.bytes_moved += result["sent_bytes"]
        self.busiest_generator = max(self.busiest_generator, result["sent_bytes"])
        for key in ("convert_s", "load_s"):
            self.timings[f"weight_sync/generator_{key}"] = result[key]

    def metrics(self, abort_on_pull: bool) -> dict[str, float]:
        metrics = dict(self.timings)
        if abort_on_pull:
            metrics["generator/num_aborted_at_pull"] = float(self.num_aborted)
        metrics["weight_sync/bytes_moved"] = self.bytes_moved
        if self.num_verified:
            metrics["weight_sync/relayed_generators_verified"] = float(self.num_verified)
        metrics["weight_sync/model_bytes"] = self.model_bytes
        trainer_rank = self.busiest_trainer_rank + self.by_shared_memory_bytes
        metrics["weight_sync/busiest_trainer_rank_bytes"] = trainer_rank
        metrics["weight_sync/busiest_generator_bytes"] = self.busiest_generator
        metrics["weight_sync/busiest_sender_bytes"] = max(trainer_rank, self.busiest_generator)
        return metrics


class WeightPush:
    """Pushes the trainer's weights as one policy version to generators (see the module
    docstring). ``reported``: the generators whose transport was logged already (once each)."""

    def __init__(self, trainer: TrainerClient, router: GeneratorRouter, *, abort_on_pull: bool,
                 reported: set[str]) -> None:
        self.trainer = trainer
        self.router = router
        self.abort_on_pull = abort_on_pull
        self.reported = reported
        self.totals = PushTotals()

    async def run(self, generators: list[tuple[int, GeneratorHandle]],
                  policy_version: int) -> dict[str, float]:
        """``policy_version`` to ``generators`` (their router indices and handles): shared memory
        first, then the relay. A generator lost on the way is marked lost (the pool replaces it)."""
        for index, generator in generators:
            if generator.weight_transport == "shared_memory":
                await self._by_shared_memory(index, generator, policy_version)
        await self._relay([(i, g) for i, g in generators
                           if g.weight_transport != "shared_memory"], policy_version)
        return self.totals.metrics(self.abort_on_pull)

    async def _by_shared_memory(self, index: int, generator: GeneratorHandle,
                                policy_version: int) -> None:
        self.router.set_in_push([index], True)
        trainer_called = False
        start = time.perf_counter()
        try:
            metrics = await until_lost(generator,
                                       self.trainer.push_weights(generator, policy_version))
            trainer_called = True
            self._trace(index, policy_version, start, time.perf_counter(), metrics, relayed=False)
            self.totals.timings.update(metrics)
            moved = metrics.get("weight_sync/model_bytes", 0.0)
            self.totals.by_shared_memory(moved)
            await self._pulled(generator, policy_version, moved)
        except Exception as e:
            # The trainer's call failing by itself (not an error its endpoint raised) is the
            # trainer's death, not this generator's: the job restarts the trainer.
            trainer_died = not trainer_called and not isinstance(e, ActorError)
            if not (isinstance(e, GeneratorLostError)
                    or (is_supervision_error(e) and not trainer_died)):
                raise
            generator.mark_lost(f"during the push of v{policy_version}: {e}")
            logger.warning("push v%d to %s failed: it was lost", policy_version, generator.name)
        finally:
            self.router.set_in_push([index], False)

    async def _relay(self, generators: list[tuple[int, GeneratorHandle]],
                     policy_version: int) -> None:
        """Relay ``policy_version`` down a chain of ``generators``; a generator lost on the way is
        marked lost, and the survivors downstream of it, which never get the rest, take a new
        attempt on a chain without it."""
        attempt = 0
        start = time.perf_counter()
        if generators:
            self.totals.timings["weight_sync/num_relayed"] = float(len(generators))
        while generators:
            indices = [index for index, _ in generators]
            chain = [generator for _, generator in generators]
            self.router.set_in_push(indices, True)
            try:
                if attempt:
                    logger.warning("relay v%d: attempt %d to %s", policy_version, attempt,
                                   ",".join(h.name for h in chain))
                pulled: set[int] = set()
                async with contextlib.aclosing(_relay_once(
                        self.trainer, chain, policy_version, attempt, self.totals)) as relayed:
                    async for position, result in relayed:
                        pulled.add(position)
                        sent_s = self.totals.timings.get("weight_sync/send_s", 0.0)
                        self._trace(indices[position], policy_version, start, time.perf_counter(), {
                            "weight_sync/send_s": sent_s,
                            **{f"weight_sync/generator_{k}": v for k, v in result.items()}},
                            relayed=True)
                        await self._pulled(chain[position], policy_version, result["sent_bytes"])
                # Serving generators that did not get it: downstream of one lost on the way.
                generators = [(i, h) for p, (i, h) in enumerate(generators)
                              if p not in pulled and h.lost_reason is None]
            finally:
                self.router.set_in_push(indices, False)
            attempt += 1
        if attempt:  # from the first send to the last generator's pull, attempts included
            self.totals.timings["weight_sync/relay_s"] = time.perf_counter() - start

    def _trace(self, index: int, policy_version: int, start: float, end: float,
               timings: dict[str, float], *, relayed: bool) -> None:
        """Generator ``index``'s part of the push on its "weight push" track: the whole push as
        the controller saw it (its args: the timings), and in it the phases with the durations
        the trainer and the generator measured, placed one after another: gather, send (shared
        memory: until every rank pulled, convert and load ending there; relay: the trainer's
        sends, convert and load ending at the generator's reply)."""
        trace = self.router.trace
        if trace is None:
            return
        pid = GENERATOR_PID + index
        trace.span("weight push", f"push v{policy_version}", start, end, pid=pid,
                   **{k.removeprefix("weight_sync/"): round(v, 6) for k, v in timings.items()})
        gather_end = min(end, start + timings.get("weight_sync/gather_s", 0.0))
        if gather_end > start:
            trace.span("weight push", "gather", start, gather_end, pid=pid)
        sent = timings.get("weight_sync/send_s" if relayed else "weight_sync/pull_s", 0.0)
        sent_end = min(end, gather_end + sent)
        trace.span("weight push", "send" if relayed else "send and pull", gather_end, sent_end,
                   pid=pid)
        load_end = end if relayed else sent_end
        floor = sent_end if relayed else gather_end
        load_start = max(floor, load_end - timings.get("weight_sync/generator_load_s", 0.0))
        convert_start = max(floor,
                            load_start - timings.get("weight_sync/generator_convert_s", 0.0))
        trace.span("weight push", "convert", convert_start, load_start, pid=pid)
        trace.span("weight push", "load", load_start, load_end, pid=pid)

    async def _pulled(self, generator: GeneratorHandle, policy_version: int, moved: float) -> None:
        """``generator`` serves ``policy_version`` now."""
        if generator.name not in self.reported:
            self.reported.add(generator.name)
            logger.info("%s: pushes by %s; v%d moved %.1f MB", generator.name,
                        generator.weight_transport, policy_version, moved / 1e6)
        if self.abort_on_pull:
            # Partial rollouts: running requests return their tokens so far and are resumed
            # (prompt + partial) on the new weights (partial_rollout.py).
            try:
                self.totals.num_aborted += await until_lost(generator, generator.abort(None))
            except Exception as e:  # it pulled, then died: the pool replaces it
                if not (isinstance(e, GeneratorLostError) or is_supervision_error(e)):
                    raise
                generator.mark_lost(f"after the push of v{policy_version}: {e}")
                logger.warning("%s was lost after the push of v%d", generator.name, policy_version)
                return
        if self.trainer.verify_push and generator.weight_transport != "shared_memory":
            await self.trainer.verify_weights([generator], policy_version)  # debug: gathers
            self.totals.num_verified += 1

    async def to_replacement(self, new: GeneratorHandle, policy_version: int) -> None:
        """``policy_version`` into a replacement (not serving yet): shared memory, or a relay
        chain of one."""
        if new.weight_transport == "shared_memory":
            await until_lost(new, self.trainer.push_weights(new, policy_version))
            return
        attempt = REPLACEMENT_ATTEMPT  # apart from the loop's attempts of the same version
        # The loop may be training meanwhile: no step between the send and the read-back.
        async with self.trainer.weights_lock:
            wait = until_lost(new, new.rank0.wait_weights.call_one(policy_version, attempt))
            waiting = asyncio.ensure_future(wait)
            try:
                await self.trainer.relay_weights([new], policy_version, attempt)
                await asyncio.wait_for(waiting, RELAY_TIMEOUT_S)
            finally:
                waiting.cancel()
            if self.trainer.verify_push:
                await self.trainer.verify_weights([new], policy_version)


async def _relay_once(trainer: TrainerClient, chain: list[GeneratorHandle], policy_version: int,
                      attempt: int, push: PushTotals
                      ) -> AsyncIterator[tuple[int, dict[str, float]]]:
    """One relay of ``policy_version`` down ``chain``: yields ``(position, result)`` as each
    generator finishes; a generator lost on the way is marked lost, and the ones after it in the
    chain never finish. The trainer's own call failing raises: that is the trainer's death (its
    sends do not wait for generators, so a lost generator cannot fail it)."""
    waits = [asyncio.ensure_future(
                 until_lost(h, h.rank0.wait_weights.call_one(policy_version, attempt)))
             for h in chain]
    position_of = {wait: p for p, wait in enumerate(waits)}
    waiting = set(waits)
    try:
        push.by_trainer(await trainer.relay_weights(chain, policy_version, attempt))
        cut = len(chain)  # chain positions past a lost generator never get the rest
        while active := {w for w in waiting if position_of[w] < cut}:
            finished, _ = await asyncio.wait(active, timeout=RELAY_TIMEOUT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
            if not finished:
                raise RuntimeError(f"relay of policy version {policy_version}: no generator "
                                   f"finished in {RELAY_TIMEOUT_S:.0f} s")
            for wait in finished:
                waiting.discard(wait)
                p = position_of[wait]
                try:
                    result = wait.result()
                except Exception as e:
                    if not (isinstance(e, GeneratorLostError) or is_supervision_error(e)):
                        raise
                    chain[p].mark_lost(f"during the relay of v{policy_version}: {e}")
                    logger.warning("relay v%d: %s was lost (chain position %d of %d)",
                                   policy_version, chain[p].name, p, len(chain))
                    cut = min(cut, p)
                    continue
                push.by_generator(result)
                yield p, result
    finally:
        for wait in waits:
            wait.cancel()


async def until_lost(generator: GeneratorHandle, call: Awaitable[T]) -> T:
    """Await ``call`` unless ``generator`` is lost first: then GeneratorLostError, without
    waiting for a reply that may never come from the dead actor (monarch#3435)."""
    task = asyncio.ensure_future(call)
    lost = asyncio.ensure_future(generator.lost_event.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the caller gave up (a relay past a lost generator): drop its reply
        raise
    finally:
        lost.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise GeneratorLostError(f"{generator.name} was lost: {generator.lost_reason}")
