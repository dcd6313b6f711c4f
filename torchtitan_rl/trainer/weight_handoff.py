"""Rank 0's half of a weight push, shared by the Monarch trainer actor and the torchrun launch.

    full state dict (already gathered on every rank) -> WeightHandoff.push(version, state_dict,
        pull=<the generators' pull_model_state_dict>, read_back=<their read_hf_weights> or None)
      transport "message":       the tensors travel in the call itself
      transport "shared_memory": one copy into a POSIX shared segment, references in the call
      read_back (verify):        the generators' weights, compared bitwise with the trainer's
    -> weight_sync/* metrics
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import torch

from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan
from torchtitan_rl.trainer.shm_transport import SharedMemoryStager
from torchtitan_rl.trainer.vllm_weights import weight_mismatches

logger = logging.getLogger(__name__)

PullFn = Callable[[int, dict[str, Any]], Awaitable[Any]]
"""(version, payload) -> awaitable: the generators load the weights."""
ReadBackFn = Callable[[], Awaitable[Iterable[dict[str, torch.Tensor]]]]
"""() -> every generator rank's HF-named weights."""


class WeightHandoff:
    def __init__(self, *, model_config: Any) -> None:
        self.model_config = model_config
        """The trainer's torchtitan model config (HF names and tied embeddings for verify)."""
        self._stager: SharedMemoryStager | None = None

    async def push(self, version: int, state_dict: dict[str, torch.Tensor], *, transport: str,
                   pull: PullFn, read_back: ReadBackFn | None = None) -> dict[str, float]:
        sent = time.perf_counter()
        metrics: dict[str, float] = {}
        payload: dict[str, Any] = state_dict
        if transport == "shared_memory":
            if self._stager is None:
                self._stager = SharedMemoryStager()
            payload = self._stager.stage(state_dict)
            metrics["weight_sync/stage_s"] = time.perf_counter() - sent
        elif transport != "message":
            raise ValueError(
                f"weight_transport must be 'message' or 'shared_memory', got {transport!r}"
            )
        await pull(version, payload)
        metrics["weight_sync/pull_s"] = time.perf_counter() - sent
        metrics["weight_sync/bytes"] = float(num_bytes(state_dict))
        if read_back is not None:
            metrics["weight_sync/num_mismatched_tensors"] = float(
                await self._verify(version, state_dict, read_back))
        return metrics

    async def _verify(self, version: int, state_dict: dict[str, torch.Tensor],
                      read_back: ReadBackFn) -> int:
        expected = hf_state_dict_from_torchtitan(state_dict, self.model_config)
        tied = self.model_config.enable_weight_tying
        bad = sorted({name for weights in await read_back()
                      for name in weight_mismatches(expected, weights, tied=tied)})
        if bad:
            raise RuntimeError(
                f"weight push v{version}: generator weights differ from the trainer's in "
                f"{len(bad)} tensors: {bad[:5]}"
            )
        return 0

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def num_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors (a tied embedding counts once)."""
    seen: dict[int, int] = {}
    for tensor in state_dict.values():
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
