"""The generator actor: one per rank of a generator mesh, each owning one vLLM `LLMEngine`.

    controller -spawn_generator(config)-> procs (tp) -> Generator actors -start()-> every rank:
        build engine (external_launcher when tp > 1), WeightPuller.setup (in_place: unpack
        linears), gloo decision group, engine loop task
    controller -submit([(key, GenerateRequest)], replies)-> rank 0: enqueue each, await futures
    rank 0 loop: decide -gloo bcast-> all ranks: add + engine.step() x<=K (vLLM TP collectives)
    rank 0: finished outputs -> [(key, Completion, error)] -replies port-> controller (one
        message per loop turn); submit() returns once its requests' outcomes are sent
    trainer rank 0 -pull_model_state_dict(policy_version, sd)-> EVERY rank (each pulls full
        tensors; vLLM shards; weight_sync/pull.py) -> {convert_s, load_s} per rank
        (shared memory: -weights_staged(policy_version, bytes)-> every rank as the copy goes)
    relay (weight_sync/relay.py): trainer ranks / the previous generator -receive_chunk(chunk,
        chain, i)-> rank 0: forward to chain[i + 1], store; when whole: pull on every rank
        (others read rank 0's host copy); controller -wait_weights(version, attempt)-> rank 0
    trainer rank 0 -read_hf_weights()-> every rank (verify a push bit for bit, TP 1)
    controller -abort(ids)-> rank 0;  -take_engine_stats()-> rank 0 (each step: vLLM's numbers)
    controller -close()-> every rank;  then the procs are stopped

Use it through `spawn_generator` / `GeneratorHandle` (generator/client.py), which call the endpoints with the
right fan-out. Without Monarch (tests, benchmarks, a torchrun launch) `start_engine_loop(config)`
(generator/engine_setup.py) builds the same `EngineLoop` in-process.

Invariants: rank 0 alone decides; every rank applies the same decisions in the same order; every
engine call of a rank runs in that rank's one engine thread; every future resolves or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import torch
from monarch.actor import Actor, Port, concurrent_endpoint, current_rank

from torchtitan_rl import faults
from torchtitan_rl.batched_calls import ReplyBatcher
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import configure_process_logging
from torchtitan_rl.generator.config import GeneratorConfig
from torchtitan_rl.generator.engine_loop import EngineLoop
from torchtitan_rl.generator.engine_setup import start_engine_loop
from torchtitan_rl.generator.engine_stats import EngineStatsReport
from torchtitan_rl.generator.engine_stats import stats_of as engine_stats_of
from torchtitan_rl.generator.vllm_engine import unlink_cpu_tp_segments
from torchtitan_rl.types import Completion, GenerateRequest
from torchtitan_rl.weight_sync.relay import RelayChunk, RelayNode
from torchtitan_rl.weight_sync.shared_memory import SharedMemoryStager, machine_id

logger = logging.getLogger(__name__)

GenerateOutcome = tuple[int, Completion | None, BaseException | None]
"""What submit() sends back for one request: (the caller's key, the completion, the error)."""


def _error_as_text(outcome: GenerateOutcome) -> GenerateOutcome:
    key, completion, error = outcome
    return key, completion, None if error is None else RuntimeError(
        f"{type(error).__name__}: {error}")


class Generator(Actor, Configurable):
    Config = GeneratorConfig

    def __init__(self, config: Config) -> None:
        configure_process_logging()  # this proc's log lines to the run's log file, vLLM quiet
        self.config = config
        self.rank = current_rank().rank
        self.loop: EngineLoop | None = None
        self._num_calls_waiting = 0
        self._no_calls_waiting = asyncio.Event()
        self._no_calls_waiting.set()
        self._host_stager: SharedMemoryStager | None = None
        self._relay: RelayNode | None = None
        self._mesh: Any = None
        """This generator's own actor mesh (from the relay's chain): rank 0 calls its peers."""
        self._outcomes: ReplyBatcher[GenerateOutcome] = ReplyBatcher(_error_as_text)
        """submit() outcomes, sent per reply port at the end of the event-loop turn."""

    # ---- endpoints, in call order ---------------------------------------------------------------
    @concurrent_endpoint
    async def start(self) -> int:
        """Every rank: build the engine and start the loop (the torch elastic env must be set when
        tensor_parallel_degree > 1). Returns this rank's process id (for logs and fault tests)."""
        if self.loop is not None:
            raise RuntimeError("generator already started")
        self.loop = await start_engine_loop(self.config)
        return os.getpid()

    @concurrent_endpoint
    async def get_machine_id(self) -> str:
        """This rank's machine (hostname/boot id): whether a push can use shared memory."""
        return machine_id()

    @concurrent_endpoint
    async def submit(self, requests: list[tuple[int, GenerateRequest]], replies: Port) -> None:
        """Rank 0: generate each ``(key, request)``; its outcome goes to ``replies`` as
        ``(key, completion, error)`` once ready, and outcomes ready together (one engine step's
        finished requests) travel in one message. Returns when every outcome is sent, so a dead
        generator fails this call. Batching keeps the Monarch messages (each costs CPU on both
        sides) per event-loop turn rather than per request."""
        async with self._waiting_call():
            generating = []
            for key, request in requests:
                faults.point("generator.request_received")
                task = asyncio.ensure_future(self._loop().generate(request))
                task.add_done_callback(functools.partial(self._queue_outcome, replies, key))
                generating.append(task)
            if generating:
                await asyncio.wait(generating)
            self._outcomes.flush()

    @concurrent_endpoint
    async def share_on_host(self, state_dict: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        """Rank 0 of a tensor-parallel generator: copy weights that came by message into a
        shared segment on this host and return references, so the message crosses to the host
        once and every rank reads the one copy (weight_sync/push.py ``pull_on_every_rank``).
        The segment is reused at the next push, after every rank has pulled this one. The
        references travel as plain fields (a SharedTensorRef would attach wherever the reply is
        unpickled: on the pusher's host)."""
        if self._host_stager is None:
            self._host_stager = SharedMemoryStager()
        return {name: dataclasses.astuple(ref)
                for name, ref in self._host_stager.stage(state_dict).items()}

    @concurrent_endpoint
    async def pull_model_state_dict(
        self, policy_version: int, state_dict: dict[str, Any], streamed: bool = False
    ) -> dict[str, float]:
        """Every rank: pull ``state_dict`` (torchtitan or HF names, full tensors) as
        ``policy_version``, between engine steps (hot swap) or after running requests finish
        (drain). ``streamed``: shared-memory tensors still being staged (``weights_staged``).
        Returns this rank's ``convert_s`` and ``load_s`` (the pusher reports them as
        ``weight_sync/generator_*`` metrics)."""
        return await self._loop().pull_model_state_dict(policy_version, state_dict, streamed)

    @concurrent_endpoint
    async def weights_staged(self, policy_version: int, num_bytes: int) -> None:
        """Every rank: a streamed push of ``policy_version`` has staged its first ``num_bytes``
        bytes. Sent by broadcast (no reply), so it must not raise: that would fail the actor."""
        try:
            self._loop().weights_staged(policy_version, num_bytes)
        except Exception:
            logger.exception("weights_staged(%d, %d) ignored", policy_version, num_bytes)

    @concurrent_endpoint
    async def receive_chunk(self, chunk: RelayChunk, chain: list[Any] | None,
                            position: int) -> None:
        """Rank 0 of ``chain[position]``: a chunk of a relayed push (weight_sync/relay.py),
        forwarded at once to ``chain[position + 1]`` and stored; when the push is whole, every
        rank pulls it. Sent by broadcast (no reply), so it must not raise."""
        try:
            faults.point("generator.relay_chunk_received",
                         key=(position, chunk.policy_version, chunk.attempt))
            if chain is not None:  # a sender's first chunk of a push
                self._mesh = chain[position]
            if self._relay is None:
                self._relay = RelayNode(self._pull_relayed)
            self._relay.receive(chunk, chain, position)
        except Exception:
            logger.exception("relay chunk of policy version %d dropped", chunk.policy_version)

    @concurrent_endpoint
    async def wait_weights(self, policy_version: int, attempt: int) -> dict[str, float]:
        """Rank 0: returns once relayed push ``(policy_version, attempt)`` is pulled on every
        rank: ``sent_bytes`` (forwarded down the chain), ``convert_s``, ``load_s``."""
        if self._relay is None:
            self._relay = RelayNode(self._pull_relayed)
        return await self._relay.wait(policy_version, attempt)

    @concurrent_endpoint
    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Rank 0: abort requests (None: all in flight); their generate() calls return the tokens
        so far with finish reason 'abort'. Returns the number of requests found."""
        async with self._waiting_call():
            return await self._loop().abort(request_ids)

    @concurrent_endpoint
    async def close(self) -> None:
        """Every rank: stop the loop; pending requests fail with a RuntimeError, and their
        outcomes are sent before this reply (the caller may stop the procs next)."""
        if self.loop is not None:
            await self.loop.close()
        await self._no_calls_waiting.wait()
        if self.config.tensor_parallel_degree > 1:
            unlink_cpu_tp_segments()
        if self._host_stager is not None:
            self._host_stager.close()

    @concurrent_endpoint
    async def rewind_policy_version(self, policy_version: int) -> None:
        """Every rank: the run went back to ``policy_version`` (its trainer was restored from a
        checkpoint); the next pull may be that version. Abort every request first (``abort``)."""
        self._loop().rewind(policy_version)
        self._relay = None  # its (version, attempt) order would drop a relay of the older version

    @concurrent_endpoint
    async def get_policy_version(self) -> int:
        """The policy version of the weights this rank serves (the last pull applied)."""
        return self._loop().policy_version

    @concurrent_endpoint
    async def count_inflight_requests(self) -> int:
        """Rank 0: requests not yet resolved (queued or in the engine)."""
        return self._loop().num_inflight_requests

    @concurrent_endpoint
    async def take_engine_stats(self) -> EngineStatsReport | None:
        """Rank 0: vLLM's own numbers since the last call (generator/engine_stats.py); None for
        an engine that reports none (the stand-in)."""
        stats = engine_stats_of(self._loop().engine)
        return stats.take() if stats is not None else None

    @concurrent_endpoint
    async def record_finished_digest(self) -> None:
        """Every rank (tests): hash every output finished from now on (``get_finished_digest``)."""
        self._loop().record_finished_digest()

    @concurrent_endpoint
    async def get_finished_digest(self) -> tuple[int, int, str]:
        """(rank, finished outputs, digest of their tokens): equal digests = identical tokens.
        Read once the rank's burst in flight is over (a follower may still be counting)."""
        loop = self._loop()
        await loop.settled()
        return self.rank, loop.num_finished, loop.finished_digest

    @concurrent_endpoint
    async def read_hf_weights(self) -> dict[str, torch.Tensor]:
        """Every rank: this engine's weights as full HF-named tensors (verifying a push bit for
        bit, see WeightPusher.push(verify=True)). Tensor parallel 1 only: a TP rank holds
        shards."""
        if self.config.tensor_parallel_degree != 1:
            raise RuntimeError("read_hf_weights needs tensor_parallel_degree 1 (TP ranks hold "
                               f"shards), got {self.config.tensor_parallel_degree}")
        loop = self._loop()
        return loop.puller.read_weights(loop.engine)

    # ---- helpers --------------------------------------------------------------------------------
    async def _pull_relayed(self, policy_version: int, state_dict: dict[str, torch.Tensor]
                            ) -> dict[str, float]:
        if policy_version == self._loop().policy_version:
            # An earlier attempt of this push completed here after the controller gave up on it
            # (a generator upstream was lost): the re-push finds the version served already.
            return {"convert_s": 0.0, "load_s": 0.0}
        tp = self.config.tensor_parallel_degree
        if tp == 1:
            return await self._loop().pull_model_state_dict(policy_version, state_dict)
        # The other ranks share this host: they read one shared copy (as share_on_host).
        if self._host_stager is None:
            self._host_stager = SharedMemoryStager()
        refs = self._host_stager.stage(state_dict)
        others = self._mesh.slice(procs=slice(1, tp)).pull_model_state_dict.call(
            policy_version, refs)
        mine = await self._loop().pull_model_state_dict(policy_version, state_dict)
        await others
        return mine

    def _handle_undeliverable_message(self, message: Any) -> bool:
        # A relay chunk forwarded to a generator that just died bounces; Monarch's default would
        # fail this generator for it. The controller re-pushes past the dead one instead.
        logger.warning("undeliverable message (a lost generator?): %s", message.error_msg())
        return True

    @contextlib.asynccontextmanager
    async def _waiting_call(self) -> AsyncIterator[None]:
        # Monarch sends an endpoint's reply as soon as its body returns, in the same task step:
        # once the count is back to 0 every waiting call has replied.
        self._num_calls_waiting += 1
        self._no_calls_waiting.clear()
        try:
            yield
        finally:
            self._num_calls_waiting -= 1
            if self._num_calls_waiting == 0:
                self._no_calls_waiting.set()

    def _queue_outcome(self, replies: Port, key: int, task: asyncio.Task[Completion | None]
                       ) -> None:
        if task.cancelled():
            # This proc is being stopped (its generator was lost: a rank died): the caller hears
            # of the loss from Monarch or, in a rollout worker, from the router, and restarts
            # the group; an error outcome here would reach it first and fail the group.
            return
        if task.exception() is not None:
            outcome = (key, None, task.exception())
        else:
            outcome = (key, task.result(), None)
        self._outcomes.add(replies, outcome)

    def _loop(self) -> EngineLoop:
        if self.loop is None:
            raise RuntimeError("generator not started: call start() on every rank first")
        return self.loop
