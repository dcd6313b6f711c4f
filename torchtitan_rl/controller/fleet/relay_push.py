"""The controller's side of one relayed push (weight_sync/relay.py): what it waits for, what it
counts, and how it tells the generators that got the version from those that did not.

    relay_once(trainer, chain, version, attempt):
      trainer.relay_weights(chain, version, attempt)      every trainer rank sends its shards
      chain[i].rank0.wait_weights(version, attempt)       per generator, raced against its loss
      a loss at position p: the ones before p still finish (they got every chunk); the ones
      after p never get the rest -> returned, for a new attempt on a chain without p
    PushTotals: bytes per sender over one push_weights (any attempts, any transport)

Invariant: a call to a lost generator is never awaited (monarch#3435): every wait races the
handle's ``lost_event`` (until_lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from torchtitan_rl.generator import GeneratorHandle, GeneratorLostError
from torchtitan_rl.generator.client import is_supervision_error
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
        metrics["weight_sync/bytes"] = self.model_bytes  # one push's payload, as a direct push logs it
        trainer_rank = self.busiest_trainer_rank + self.by_shared_memory_bytes
        metrics["weight_sync/busiest_trainer_rank_bytes"] = trainer_rank
        metrics["weight_sync/busiest_generator_bytes"] = self.busiest_generator
        metrics["weight_sync/busiest_sender_bytes"] = max(trainer_rank, self.busiest_generator)
        return metrics


async def relay_once(trainer: TrainerClient, chain: list[GeneratorHandle], version: int,
                     attempt: int, push: PushTotals,
                     on_pulled: Callable[[int, dict[str, float]], Awaitable[None]]) -> list[int]:
    """One relay of ``version`` down ``chain``; ``on_pulled(position, result)`` as each
    generator finishes. Returns the positions of serving generators that did not get it (after
    a generator lost mid-push). The trainer's own call failing raises: that is the trainer's
    death (its sends do not wait for generators, so a lost generator cannot fail it)."""
    waits = [asyncio.ensure_future(until_lost(h, h.rank0.wait_weights.call_one(version, attempt)))
             for h in chain]
    position_of = {wait: p for p, wait in enumerate(waits)}
    waiting = set(waits)
    try:
        push.by_trainer(await trainer.relay_weights(chain, version, attempt))
        cut = len(chain)  # chain positions past a lost generator never get the rest
        while active := {w for w in waiting if position_of[w] < cut}:
            finished, _ = await asyncio.wait(active, timeout=RELAY_TIMEOUT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
            if not finished:
                raise RuntimeError(f"relay of policy version {version}: no generator finished "
                                   f"in {RELAY_TIMEOUT_S:.0f} s")
            for wait in finished:
                waiting.discard(wait)
                p = position_of[wait]
                try:
                    result = wait.result()
                except Exception as e:
                    if not (isinstance(e, GeneratorLostError) or is_supervision_error(e)):
                        raise
                    chain[p].mark_lost(f"during the relay of v{version}: {e}")
                    logger.warning("relay v%d: %s was lost (chain position %d of %d)",
                                   version, chain[p].name, p, len(chain))
                    cut = min(cut, p)
                    continue
                push.by_generator(result)
                await on_pulled(p, result)
    finally:
        for wait in waits:
            wait.cancel()
    return sorted(position_of[w] for w in waiting if chain[position_of[w]].lost_reason is None)


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
