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
    controller -abort(ids)-> rank 0;  -close()-> every rank;  then the procs are stopped

Use it through `spawn_generator` / `GeneratorHandle` (generator/client.py), which call the endpoints with the
right fan-out. Without Monarch (tests, benchmarks, a torchrun launch) `start_engine_loop(config)`
(engine_start.py) builds the same `EngineLoop` in-process.

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
from typing import Any, Literal

import torch
from monarch.actor import Actor, Port, concurrent_endpoint, current_rank

from torchtitan_rl.batched_calls import ReplyBatcher
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import configure_process_logging
from torchtitan_rl.faults import maybe_kill
from torchtitan_rl.generator.config import WeightSyncPolicy
from torchtitan_rl.generator.engine_loop import EngineLoop
from torchtitan_rl.generator.engine_start import start_engine_loop
from torchtitan_rl.generator.vllm_engine import unlink_cpu_tp_segments
from torchtitan_rl.types import Completion, GenerateRequest, Sampling
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
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        model_dir: str | None = None
        """HF model directory (config.json, safetensors, tokenizer). None: the controller fills it
        from the job's model source before spawning."""
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
        """Engine dtype. float32: generator logprobs within ~1e-6 of the trainer's on CPU.
        bfloat16, float16: half the memory, logprobs further from the trainer's. auto: vLLM's
        choice from the model's config.json."""
        tensor_parallel_degree: int = 1
        """Ranks (processes) per generator; > 1 uses vLLM's external_launcher backend."""
        max_model_len: int = 2048
        """Most tokens (prompt + output) per request."""
        max_num_seqs: int = 256
        """Most requests vLLM schedules in one step."""
        kv_cache_bytes: int = 256 << 20
        """KV cache size per rank, in bytes."""
        enforce_eager: bool = True
        """No CUDA graphs / torch.compile. False works on vLLM's CPU build too (a ~21 s first
        compile, then cached), but gained only 3-4 % per decode step on ``demo``, and the in-place
        weight pull needs eager modules."""
        enable_prefix_caching: bool = True
        """Reuse KV of shared prompt prefixes (multi-turn sessions)."""
        block_size: int | None = 32
        """Tokens per KV cache block; the prefix cache reuses whole blocks only, so a next turn
        recomputes up to ``block_size - 1`` tokens of its history. None: vLLM's platform default,
        128 on CPU, where histories under 128 tokens were never reused (``bench/async_vs_sync.py``
        prefilled twice the tokens). vLLM's CPU attention needs a multiple of 32."""
        max_engine_steps_between_decisions: int = 16
        """Engine steps per burst before rank 0 decides again (admits new requests, pulls,
        aborts). Higher: fewer broadcasts and prefill interruptions; lower: faster admission."""
        weight_sync: WeightSyncPolicy = dataclasses.field(default_factory=WeightSyncPolicy)
        sampling: Sampling = dataclasses.field(default_factory=Sampling)
        """Sampling for generate() calls that pass none. Unused in a job: every request a job
        sends carries the job's `sampling` (validation with validation.temperature), so a job
        refuses values here other than the defaults."""
        seed: int = 0
        """Engine seed (requests without Sampling.seed draw from it)."""
        initial_policy_version: int = 0
        """Policy version of the weights in model_dir."""
        max_restarts: int = 3
        """In a job: how often this generator may be replaced after its process died (each
        replacement is a new mesh on the same host with the current weights); once more fails
        the run. 0: a lost generator fails the run."""
        engine: str = "vllm"
        """Which engine each rank builds. "vllm": vLLM's ``LLMEngine`` (vllm_engine.py).
        "stand_in": no model compute, replies of seeded random tokens at
        ``stand_in_tokens_per_s``, every pushed weight byte still loaded (stand_in_engine.py;
        scale benchmarks: bench/scale.py; tensor_parallel_degree 1, weight_sync.load reload).
        Or an import path "package.module:function" of a ``(Generator.Config) -> engine``
        builder with the same engine API."""
        stand_in_tokens_per_s: float = 2000.0
        """engine = "stand_in": output tokens per second of the whole engine (each step emits one
        token per running request and sleeps as long as this rate allows)."""
        torch_num_threads: int | None = None
        """torch threads per rank, set before the engine is built (vLLM's CPU worker forbids
        changing it afterwards). None: torch's default with one rank, 1 per rank when
        tensor_parallel_degree > 1 (the ranks share the cores)."""

        def __post_init__(self) -> None:
            if self.tensor_parallel_degree < 1:
                raise ValueError(
                    f"tensor_parallel_degree must be >= 1, got {self.tensor_parallel_degree}"
                )
            for name in ("max_model_len", "max_num_seqs", "kv_cache_bytes",
                         "max_engine_steps_between_decisions"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.block_size is not None and self.block_size < 1:
                raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
            if self.max_restarts < 0:
                raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
            if self.torch_num_threads is not None and self.torch_num_threads < 1:
                raise ValueError(
                    f"torch_num_threads must be >= 1 or None, got {self.torch_num_threads}"
                )
            if self.initial_policy_version < 0:
                raise ValueError(
                    f"initial_policy_version must be >= 0, got {self.initial_policy_version}"
                )
            if self.engine not in ("vllm", "stand_in") and ":" not in self.engine:
                raise ValueError(f"engine must be 'vllm', 'stand_in' or 'package.module:function',"
                                 f" got {self.engine!r}")
            if self.stand_in_tokens_per_s <= 0:
                raise ValueError(
                    f"stand_in_tokens_per_s must be > 0, got {self.stand_in_tokens_per_s}")
            if self.engine != "vllm" and (self.tensor_parallel_degree, self.weight_sync.load) \
                    not in ((1, "auto"), (1, "reload")):
                raise ValueError(f"engine={self.engine!r} needs tensor_parallel_degree=1, "
                                 f"weight_sync.load 'auto' or 'reload', got "
                                 f"{self.tensor_parallel_degree}, {self.weight_sync.load!r}")
            if self.weight_sync.load == "in_place" and (
                    self.tensor_parallel_degree != 1 or not self.enforce_eager):
                # The CPU platform itself is checked at start (WeightPuller.setup).
                raise ValueError(
                    "weight_sync.load='in_place' needs tensor_parallel_degree=1 and "
                    "enforce_eager=True on a CPU engine, got tensor_parallel_degree="
                    f"{self.tensor_parallel_degree} enforce_eager={self.enforce_eager}: use "
                    "weight_sync.load='reload'"
                )

    def __init__(self, config: Config) -> None:
        configure_process_logging()  # this proc's log lines to the run's log file, vLLM quiet
        self.config = config
        self.rank = current_rank().rank
        self.loop: EngineLoop | None = None
        self._num_calls_waiting = 0
        self._no_calls_waiting = asyncio.Event()
        self._no_calls_waiting.set()
        self.num_generate_calls = 0
        self._host_stager: SharedMemoryStager | None = None
        self._relay: RelayNode | None = None
        self._mesh: Any = None
        """This generator's own actor mesh (from the relay's chain): rank 0 calls its peers."""
        self._num_first_relay_chunks = 0
        """Chunks of the first relayed push seen (the fault point kill_generator_mid_relay)."""
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
                self.num_generate_calls += 1
                maybe_kill("kill_generator_after_requests", self.num_generate_calls)
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
            if (position, chunk.policy_version, chunk.attempt) == (1, 1, 0):
                self._num_first_relay_chunks += 1
                maybe_kill("kill_generator_mid_relay", self._num_first_relay_chunks)
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
        from torchtitan_rl.weight_sync.pull import read_hf_weights

        if self.config.tensor_parallel_degree != 1:
            raise RuntimeError("read_hf_weights needs tensor_parallel_degree 1 (TP ranks hold "
                               f"shards), got {self.config.tensor_parallel_degree}")
        return read_hf_weights(self._loop().engine)

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
            outcome = (key, None, RuntimeError("generate was cancelled"))
        elif task.exception() is not None:
            outcome = (key, None, task.exception())
        else:
            outcome = (key, task.result(), None)
        self._outcomes.add(replies, outcome)

    def _loop(self) -> EngineLoop:
        if self.loop is None:
            raise RuntimeError("generator not started: call start() on every rank first")
        return self.loop
