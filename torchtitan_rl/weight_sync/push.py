"""The trainer side of a weight sync: rank 0 pushes a full state dict to a generator mesh.

A job uses it for generators on the trainer's machine (shared memory); generators elsewhere get
their weights through the relay (relay.py: no gather, each trainer rank sends its own shards, the
generators forward them down a chain). The message transport here pushes to one mesh (benchmarks,
tests, a single generator).

    every trainer rank: full_model_state_dict()   (a collective: the caller gathers first)
    rank 0: WeightPusher.push(policy_version, state_dict, generators, transport=, verify=)
      torchtitan names -> HF names (a rename, no copy: the generators need no torchtitan model)
      transport "message":        the tensors travel in a call to the generator's host (any
                                  host): to rank 0 alone, which shares them with the other
                                  ranks of its host through shared memory (once per host)
      transport "shared_memory":  one copy into a POSIX shared segment, references in the call
                                  (same host only, shared_memory.py); streamed: the call goes
                                  first, then generators.weights_staged(policy_version, bytes)
                                  after every chunk, and the ranks copy out while the copy goes on
      generators.pull_model_state_dict(policy_version, payload)   every generator rank pulls
                                  (pull.py) and reports its convert/load seconds
      verify: generators.read_hf_weights() -> every generator rank's HF weights, compared
              bitwise with the trainer's (weight_mismatches); any difference raises
    -> weight_sync/* metrics

``generators`` is one generator's Monarch actor mesh (``GeneratorHandle.actors``): the pusher
calls its endpoints by name and never imports the generator package.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import torch

from torchtitan_rl.weight_sync.pull import weight_mismatches
from torchtitan_rl.weight_sync.shared_memory import SharedMemoryStager, SharedTensorRef

logger = logging.getLogger(__name__)

WeightTransport = Literal["message", "shared_memory"]
WEIGHT_TRANSPORTS: tuple[WeightTransport, ...] = ("message", "shared_memory")



def choose_transport(setting: str, *, generator: str, generator_machine: str,
                     trainer_machine: str, separate_machines: bool) -> tuple[WeightTransport, str]:
    """How pushes reach one generator, and why: ``setting`` is ``trainer.weight_transport``
    (auto | message | shared_memory). Shared memory needs the trainer's machine; a host the
    placement makes a machine of its own (``separate_machines``: placement.kind='process')
    counts as another machine. ``setting`` 'shared_memory' with a placement that makes hosts
    machines of their own is refused by the job's config (controller/job.py) before anything is
    spawned; a generator the placement put on another machine is known only once it runs, and
    raises RuntimeError here, naming the setting."""
    same_machine = generator_machine == trainer_machine and not separate_machines
    where = ("on the trainer's machine" if same_machine else
             f"{generator_machine} is not the trainer's {trainer_machine}"
             if generator_machine != trainer_machine else
             "its host simulates another machine (placement.kind='process')")
    if setting == "auto":
        return ("shared_memory" if same_machine else "message"), f"auto: {where}"
    if setting == "shared_memory" and not same_machine:
        raise RuntimeError(f"trainer.weight_transport='shared_memory' cannot reach {generator}: "
                           f"{where}; use 'auto' or 'message'")
    assert setting in WEIGHT_TRANSPORTS, setting
    return setting, "trainer.weight_transport"  # type: ignore[return-value]


PullTimings = dict[str, float]
"""What one generator rank reports for a pull: ``convert_s`` (names and checks) and ``load_s``
(writing into vLLM, between engine steps)."""


class WeightPusher:
    """Rank 0's pusher; one per trainer (it owns the shared-memory segment, reused across pushes).
    Call ``close()`` when done (an atexit hook unlinks the segment otherwise)."""

    def __init__(self, *, model_config: Any, lora_scaling: float | None = None) -> None:
        self.model_config = model_config
        """The trainer's torchtitan model config (HF names and tied embeddings for verify)."""
        self.lora_scaling = lora_scaling
        """Pushes carry LoRA adapters (weight_sync/lora_pull.py): the alpha / rank the engine
        multiplies B by, which a verify expects. None: pushes carry weights."""
        self._stager: SharedMemoryStager | None = None

    async def push(
        self,
        policy_version: int,
        state_dict: dict[str, torch.Tensor],
        generators: Any,
        *,
        transport: WeightTransport = "message",
        verify: bool = False,
    ) -> dict[str, float]:
        """Push the full (plain, gathered) torchtitan-named ``state_dict`` to every rank of
        ``generators`` (one generator's `Generator` actor mesh) as ``policy_version``; returns
        once every rank has pulled it (and, with ``verify``, its weights were read back equal).
        Raises RuntimeError on a difference."""
        if transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight_transport must be one of {WEIGHT_TRANSPORTS}, got {transport!r}"
            )
        from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan

        sent = time.perf_counter()
        metrics: dict[str, float] = {}
        # HF names here, where torchtitan's model is imported already: the generators then never
        # import it (seconds at their first pull).
        hf_state_dict = hf_state_dict_from_torchtitan(state_dict, self.model_config)
        if transport == "shared_memory":
            # Streamed: the references go first and every generator rank copies each tensor
            # out as soon as its bytes are staged, so the two copies overlap.
            if self._stager is None:
                self._stager = SharedMemoryStager()
            refs, plan = self._stager.layout(hf_state_dict)
            pull = asyncio.ensure_future(
                pull_on_every_rank(generators, policy_version, refs, streamed=True))
            try:
                await asyncio.sleep(0)  # the pull call leaves before the copy holds this thread
                self._stager.copy(plan, lambda num_bytes: generators.weights_staged.broadcast(
                    policy_version, num_bytes))
            except BaseException:
                pull.cancel()
                raise
            metrics["weight_sync/stage_s"] = time.perf_counter() - sent
            results = await pull
        else:
            results = await pull_on_every_rank(generators, policy_version, hf_state_dict)
        timings = [t for t in results if t]
        metrics["weight_sync/pull_s"] = time.perf_counter() - sent
        metrics["weight_sync/model_bytes"] = float(num_bytes(state_dict))
        for key in ("convert_s", "load_s"):
            if any(key in t for t in timings):
                metrics[f"weight_sync/generator_{key}"] = max(t.get(key, 0.0) for t in timings)
        if verify:
            start = time.perf_counter()
            metrics["weight_sync/num_mismatched_tensors"] = float(
                await self.verify(policy_version, state_dict, generators))
            metrics["weight_sync/verify_s"] = time.perf_counter() - start
        return metrics

    async def verify(self, policy_version: int, state_dict: dict[str, torch.Tensor],
                     generators: Any) -> int:
        """Read every rank of ``generators`` back and compare bitwise with the full
        ``state_dict``; raises RuntimeError on a difference, else returns 0."""
        # torchtitan's model package costs seconds to import; the controller and the generators
        # import this module and never push or verify.
        from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan

        expected = hf_state_dict_from_torchtitan(state_dict, self.model_config)
        tied = self.model_config.enable_weight_tying and self.lora_scaling is None
        if self.lora_scaling is not None:  # vLLM holds B * (alpha / rank), float32, as computed here
            expected = {name: t.float() * self.lora_scaling if name.endswith(".lora_B.weight")
                        else t for name, t in expected.items()}
        read_back = await generators.read_hf_weights.call()
        bad = sorted({name for _, weights in read_back.items()
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


async def pull_on_every_rank(generators: Any, policy_version: int, state_dict: dict[str, Any],
                             streamed: bool = False) -> list[PullTimings]:
    """Every rank of one generator (its ranks share a host) pulls ``state_dict``; returns each
    rank's timings, by rank. Tensors (the message transport) go to rank 0 only, which puts them
    in shared memory for its host's ranks (``Generator.share_on_host``), so they cross to the
    host once; references (already shared) go to every rank as they are."""
    shared = any(isinstance(value, SharedTensorRef) for value in state_dict.values())
    if len(generators) > 1 and not shared:
        fields = await generators.slice(procs=0).share_on_host.call_one(state_dict)
        state_dict = {name: SharedTensorRef(*ref) for name, ref in fields.items()}
    values = await generators.pull_model_state_dict.call(policy_version, state_dict, streamed)
    return [value for _, value in sorted(values.items(), key=lambda kv: kv[0].rank)]


def num_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors (a tied embedding counts once)."""
    seen: dict[int, int] = {}
    for tensor in state_dict.values():
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
