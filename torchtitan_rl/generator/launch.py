"""Spawning a generator mesh and calling it with the right fan-out: the one code path the
controller and the tests share.

    handle = await spawn_generator(config)       # procs, torch elastic env, actors, start()
    completion = await handle(GenerateRequest(prompt_token_ids=ids, request_id=...))   # rank 0
    await WeightPusher(...).push(policy_version, state_dict, handle)   # every rank pulls
    await handle.abort(ids)                      # rank 0
    await handle.close()                         # every rank, then the procs stop

`GeneratorHandle` is a `GenerateFn` (rollout code and the router call it directly) and a
weight_sync `PullTarget` (``pull_model_state_dict`` and ``read_hf_weights`` on every rank). Its
methods send their message when called and return an awaitable (an asyncio Task for generate), so
calls made one after the other reach rank 0 in that order (a generate() then an abort() always
finds it). ``close()`` lets every outstanding generate() receive its "closed" error before the
procs stop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from monarch.actor import Future, HostMesh, ProcMesh, this_host

from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.types import Completion, GenerateRequest

logger = logging.getLogger(__name__)


class GeneratorHandle:
    """A started generator mesh: ``tensor_parallel_degree`` procs, one `Generator` actor each."""

    def __init__(self, *, procs: ProcMesh, actors: Any, config: Generator.Config) -> None:
        self.procs = procs
        self.actors = actors
        self.rank0 = actors.slice(procs=0)
        self.config = config
        self._outstanding: set[asyncio.Task[Completion | None]] = set()

    def generate(self, request: GenerateRequest) -> asyncio.Task[Completion | None]:
        """Rank 0 generates one completion (the message is sent now; await the task)."""
        task = asyncio.ensure_future(self.rank0.generate.call_one(request))
        self._outstanding.add(task)
        task.add_done_callback(self._outstanding.discard)
        return task

    __call__ = generate

    async def pull_model_state_dict(
        self, policy_version: int, state_dict: dict[str, Any]
    ) -> list[dict[str, float]]:
        """Every rank receives the full state dict (vLLM's loaders shard it for TP); returns once
        every rank has pulled it, with each rank's ``convert_s`` / ``load_s``, by rank."""
        values = await self.actors.pull_model_state_dict.call(policy_version, state_dict)
        return [value for _, value in sorted(values.items(), key=lambda kv: kv[0].rank)]

    async def read_hf_weights(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's weights by HF name, as its engine computes with them (TP 1 only)."""
        return [weights for _, weights in (await self.actors.read_hf_weights.call()).items()]

    def abort(self, request_ids: list[str] | None = None) -> Future[int]:
        """Abort requests (None: all in flight); resolves once they have resolved."""
        return self.rank0.abort.call_one(request_ids)

    def get_policy_version(self) -> Future[int]:
        """Rank 0's policy version (the last pull applied)."""
        return self.rank0.get_policy_version.call_one()

    def count_inflight_requests(self) -> Future[int]:
        """Rank 0's generate() calls not yet resolved (queued or in the engine)."""
        return self.rank0.count_inflight_requests.call_one()

    async def get_finished_digests(self) -> list[tuple[int, int, str]]:
        """(rank, finished outputs, token digest) per rank, by rank."""
        values = await self.actors.get_finished_digest.call()
        return sorted(value for _, value in values.items())

    async def close(self, *, stop_procs: bool = True) -> None:
        """Close every rank; outstanding generate() calls fail with "generator closed before the
        request finished"; then stop the procs."""
        try:
            await self.actors.close.call()
            if self._outstanding:
                await asyncio.wait(set(self._outstanding))
        finally:
            if stop_procs:
                await self.procs.stop()


async def spawn_generator(
    config: Generator.Config, *, name: str = "generator", host: HostMesh | None = None
) -> GeneratorHandle:
    """Spawn ``config.tensor_parallel_degree`` procs on ``host`` (default: this host), set the
    torch elastic env when TP > 1, spawn one `Generator` per proc and start every rank."""
    tp = config.tensor_parallel_degree
    procs = (host or this_host()).spawn_procs(per_host={"procs": tp})
    try:
        if tp > 1:
            from monarch.spmd import setup_torch_elastic_env_async

            await setup_torch_elastic_env_async(procs)
        actors = procs.spawn(name, Generator, config)
        await actors.start.call()
    except BaseException:
        await procs.stop()
        raise
    logger.info("generator %s started (tp=%d, model %s)", name, tp, config.model_dir)
    return GeneratorHandle(procs=procs, actors=actors, config=config)
