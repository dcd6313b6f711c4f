"""The trainer side of a weight sync: rank 0 pushes a full state dict to a generator mesh.

    every trainer rank: full_model_state_dict()   (a collective: the caller gathers first)
    rank 0: WeightPusher.push(policy_version, state_dict, target, transport=, verify=)
      transport "message":        the tensors travel in a call to the generator's host (any
                                  host): to rank 0 alone, which shares them with the other
                                  ranks of its host through shared memory (once per host)
      transport "shared_memory":  one copy into a POSIX shared segment, references in the call
                                  (same host only, shared_memory.py); streamed: the call goes
                                  first, then target.weights_staged(policy_version, bytes) after
                                  every chunk, and the ranks copy out while the copy goes on
      target.pull_model_state_dict(policy_version, payload)   every generator rank pulls
                                  (pull.py) and reports its convert/load seconds
      verify: target.read_hf_weights() -> every generator rank's HF weights, compared bitwise
              with the trainer's (weight_mismatches); any difference raises
    -> weight_sync/* metrics

The target is a `PullTarget`: a ``GeneratorHandle`` is one (the controller and a torchrun launch
push to it directly); inside a trainer actor the generator actor mesh it receives is wrapped in
`ActorMeshTarget`. Either way the pusher never imports the generator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal, Protocol

import torch

from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan
from torchtitan_rl.weight_sync.pull import weight_mismatches
from torchtitan_rl.weight_sync.shared_memory import SharedMemoryStager, SharedTensorRef

logger = logging.getLogger(__name__)

WeightTransport = Literal["message", "shared_memory"]
WEIGHT_TRANSPORTS: tuple[WeightTransport, ...] = ("message", "shared_memory")

PullTimings = dict[str, float]
"""What one generator rank reports for a pull: ``convert_s`` (names and checks) and ``load_s``
(writing into vLLM, between engine steps)."""


class PullTarget(Protocol):
    """Every rank of one generator: what a push needs from it."""

    async def pull_model_state_dict(
        self, policy_version: int, state_dict: dict[str, Any], streamed: bool = False
    ) -> list[PullTimings | None]:
        """Every rank pulls ``state_dict`` as ``policy_version``; returns once all have, with
        each rank's timings (None: the rank reports none). ``streamed``: shared-memory tensors
        still being staged; each rank copies a tensor once ``weights_staged`` covers it."""
        ...

    def weights_staged(self, policy_version: int, num_bytes: int) -> None:
        """Tell every rank (no reply) that the first ``num_bytes`` bytes of the segment are
        staged for ``policy_version``."""
        ...

    async def read_hf_weights(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's weights by HF name, as its engine computes with them."""
        ...


class ActorMeshTarget:
    """A Monarch actor mesh of generator ranks (each with ``pull_model_state_dict`` and
    ``read_hf_weights`` endpoints, as `Generator` has) seen as a `PullTarget`."""

    def __init__(self, actors: Any) -> None:
        self.actors = actors

    async def pull_model_state_dict(
        self, policy_version: int, state_dict: dict[str, Any], streamed: bool = False
    ) -> list[PullTimings | None]:
        values = await pull_once_per_host(self.actors, policy_version, state_dict, streamed)
        return [value for _, value in values.items()]

    def weights_staged(self, policy_version: int, num_bytes: int) -> None:
        self.actors.weights_staged.broadcast(policy_version, num_bytes)

    async def read_hf_weights(self) -> list[dict[str, torch.Tensor]]:
        return [weights for _, weights in (await self.actors.read_hf_weights.call()).items()]


class WeightPusher:
    """Rank 0's pusher; one per trainer (it owns the shared-memory segment, reused across pushes).
    Call ``close()`` when done (an atexit hook unlinks the segment otherwise)."""

    def __init__(self, *, model_config: Any) -> None:
        self.model_config = model_config
        """The trainer's torchtitan model config (HF names and tied embeddings for verify)."""
        self._stager: SharedMemoryStager | None = None

    async def push(
        self,
        policy_version: int,
        state_dict: dict[str, torch.Tensor],
        target: PullTarget,
        *,
        transport: WeightTransport = "message",
        verify: bool = False,
    ) -> dict[str, float]:
        """Push the full (plain, gathered) torchtitan-named ``state_dict`` to every rank of
        ``target`` as ``policy_version``; returns once every rank has pulled it (and, with
        ``verify``, its weights were read back equal). Raises RuntimeError on a difference."""
        if transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight_transport must be one of {WEIGHT_TRANSPORTS}, got {transport!r}"
            )
        sent = time.perf_counter()
        metrics: dict[str, float] = {}
        if transport == "shared_memory":
            # Streamed: the references go first and every generator rank copies each tensor
            # out as soon as its bytes are staged, so the two copies overlap.
            if self._stager is None:
                self._stager = SharedMemoryStager()
            refs, plan = self._stager.layout(state_dict)
            pull = asyncio.ensure_future(
                target.pull_model_state_dict(policy_version, refs, streamed=True))
            try:
                await asyncio.sleep(0)  # the pull call leaves before the copy holds this thread
                self._stager.copy(plan, lambda num_bytes: target.weights_staged(
                    policy_version, num_bytes))
            except BaseException:
                pull.cancel()
                raise
            metrics["weight_sync/stage_s"] = time.perf_counter() - sent
            results = await pull
        else:
            results = await target.pull_model_state_dict(policy_version, state_dict)
        timings = [t for t in results if t]
        metrics["weight_sync/pull_s"] = time.perf_counter() - sent
        metrics["weight_sync/bytes"] = float(num_bytes(state_dict))
        for key in ("convert_s", "load_s"):
            if any(key in t for t in timings):
                metrics[f"weight_sync/generator_{key}"] = max(t.get(key, 0.0) for t in timings)
        if verify:
            start = time.perf_counter()
            metrics["weight_sync/num_mismatched_tensors"] = float(
                await self._verify(policy_version, state_dict, target))
            metrics["weight_sync/verify_s"] = time.perf_counter() - start
        return metrics

    async def _verify(self, policy_version: int, state_dict: dict[str, torch.Tensor],
                      target: PullTarget) -> int:
        expected = hf_state_dict_from_torchtitan(state_dict, self.model_config)
        tied = self.model_config.enable_weight_tying
        bad = sorted({name for weights in await target.read_hf_weights()
                      for name in weight_mismatches(expected, weights, tied=tied)})
        if bad:
            raise RuntimeError(
                f"weight push of policy version {policy_version}: generator weights differ "
                f"from the trainer's in {len(bad)} tensors: {bad[:5]}"
            )
        return 0

    def close(self) -> None:
        """Unlink the shared-memory segment (if any)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


async def pull_once_per_host(actors: Any, policy_version: int,
                             state_dict: dict[str, Any], streamed: bool = False) -> Any:
    """Every rank of one generator (its ranks share a host) pulls ``state_dict``. Tensors (the
    message transport) go to rank 0 only, which puts them in shared memory for its host's
    ranks (``Generator.share_on_host``); references (already shared) go to every rank as they
    are. Returns the ranks' values (Monarch's ValueMesh)."""
    shared = any(isinstance(value, SharedTensorRef) for value in state_dict.values())
    if len(actors) > 1 and not shared:
        fields = await actors.slice(procs=0).share_on_host.call_one(state_dict)
        state_dict = {name: SharedTensorRef(*ref) for name, ref in fields.items()}
    return await actors.pull_model_state_dict.call(policy_version, state_dict, streamed)


def num_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors (a tied embedding counts once)."""
    seen: dict[int, int] = {}
    for tensor in state_dict.values():
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
