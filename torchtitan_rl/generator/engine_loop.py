"""One rank's engine loop over one vLLM ``LLMEngine`` (plain class: no actor, testable in-process).

    start_engine_loop(config): engine thread -> the engine (vLLM, the stand-in, or an import
        path's builder) -> WeightPuller (load "auto" resolved here) .setup -> gloo decision group
        (TP > 1) -> EngineLoop(...).start() on the running event loop: the one code path of the
        Generator actor, tests, benchmarks and torchrun launches
    rank 0: generate(request)/pull/abort/close -> LoopInbox -> decide() -> LoopDecision
    every rank: decision --DecisionChannel (gloo, engine thread)--> same decision on every rank
    every rank: apply it in the engine thread: add + burst of <= K engine.step() | pull | abort
          (TP 1: the burst ends early when rank 0's inbox has new work)
    rank 0: finished outputs -> Completion -> resolve the generate() futures

A pull (weight_sync/pull.py): every rank's pull_model_state_dict() prepares the weights at once (a
bad state dict fails that call alone); rank 0's PULL decision then makes every rank apply them
between two engine steps and label later tokens with the new policy version.

Every engine call (and the gloo broadcast) runs in one engine thread per rank, in the same order
on every rank, so the asyncio event loop stays free to accept calls while the engine steps. With
nothing to do rank 0 awaits an event (no spinning); peers wait inside the broadcast.

The calls in flight (every future resolves exactly once; a late output for a request that was
failed or cancelled is dropped instead of raising in the engine loop):

    PendingRequests (rank 0):
    EngineLoop.generate()       -> add()                 (a future the caller awaits)
    admitted into vLLM          -> mark_admitted() | fail()
    finished or aborted output  -> resolve_output()      (Completion with its timings)
    aborted while still queued  -> resolve_unstarted_abort()
    loop failed or closed       -> fail_all()

    PendingPulls (every rank; the pull call and rank 0's PULL decision arrive in either order):
    EngineLoop.pull_model_state_dict() -> check_new(), deliver(prepared weights) -> await done
    EngineLoop.weights_staged()        -> entry().staging.advance()   (a streamed push)
    the loop's PULL decision           -> entry() -> await its weights -> apply -> finish(load_s)
    loop failed or closed              -> fail_all()

Failure: any exception in the loop fails every outstanding future (generate, pull, abort) with
that exception, and rank 0 tells peer ranks to stop; later calls raise at once. ``close()`` fails
the futures still pending with a RuntimeError. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.generator.config import GeneratorConfig, WeightSyncPolicy
from torchtitan_rl.generator.loop_decision import (
    DecisionChannel,
    EngineRequest,
    LoopAction,
    LoopDecision,
    LoopInbox,
)
from torchtitan_rl.generator.vllm_engine import (
    abort_with_outputs,
    add_requests,
    completion_from_output,
    empty_abort_completion,
    finished_outputs_of_step,
    first_token_latency_s,
)
from torchtitan_rl.types import Completion, CompletionMetrics, GenerateRequest, Sampling
from torchtitan_rl.weight_sync.lora_pull import AdapterPuller
from torchtitan_rl.weight_sync.pull import WeightPuller
from torchtitan_rl.weight_sync.shared_memory import StagedWeights, StagingProgress

logger = logging.getLogger(__name__)

_RANK0_FAILED = "rank 0's engine loop failed"

@dataclasses.dataclass(kw_only=True, slots=True)
class StepStats:
    """One engine step as rank 0 saw it (passed to ``on_step``)."""

    step_index: int
    num_requests_in_engine: int
    """Requests in the engine during this step (added, not finished or aborted before it)."""
    num_finished: int
    policy_version: int


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        *,
        puller: WeightPuller | AdapterPuller,
        weight_sync: WeightSyncPolicy | None = None,
        max_engine_steps_between_decisions: int = 16,
        default_sampling: Sampling | None = None,
        initial_policy_version: int = 0,
        channel: DecisionChannel | None = None,
        executor: concurrent.futures.ThreadPoolExecutor | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        if max_engine_steps_between_decisions < 1:
            raise ValueError("max_engine_steps_between_decisions must be >= 1, got "
                             f"{max_engine_steps_between_decisions}")
        self.engine = engine
        self.puller = puller
        """Turns a pulled state dict into the engine's weights (prepare: raises on a bad state
        dict) and loads them between engine steps (apply): weight_sync/pull.py."""
        self.weight_sync = weight_sync or WeightSyncPolicy()
        self.max_steps = max_engine_steps_between_decisions
        self.default_sampling = default_sampling or Sampling()
        self.rank = channel.rank if channel is not None else 0
        self.channel = channel
        self.on_step = on_step
        self.policy_version = initial_policy_version
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"engine-rank{self.rank}"
        )
        # ---- runtime state -------------------------------------------------------------------
        self._inbox = LoopInbox(drain_before_pull=self.weight_sync.drain_before_pull)
        self._pending = PendingRequests()
        self._pulls = PendingPulls()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped_error: BaseException | None = None
        self._burst_error: Exception | None = None
        """An exception of a step's outputs handled on the event loop during the current burst."""
        self._between_bursts = asyncio.Event()
        """Set while no burst runs: every step taken so far is counted (``settled``)."""
        self._between_bursts.set()
        # ---- counters (every rank) ---------------------------------------------------------
        self.num_steps = 0
        self.num_finished = 0
        self._finished_digest = hashlib.sha256()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop on the running event loop (every rank)."""
        if self._task is not None:
            raise RuntimeError("engine loop already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"engine-loop-rank{self.rank}"
        )

    async def close(self) -> None:
        """Stop the loop (call on every rank); pending requests fail with a RuntimeError."""
        # Every rank: a pull waiting for a streamed push's bytes wakes and fails.
        self._fail_pending(RuntimeError("generator closed before the request finished"))
        if self.rank == 0:
            self._inbox.request_close()
            self._wake.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        self._fail_pending(RuntimeError("generator closed before the request finished"))
        if self._stopped_error is None:
            self._stopped_error = RuntimeError("generator is closed")
        # Let queued engine work (a failed loop's clean-up abort) finish, off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    # ---- rank-0 calls ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion | None:
        """Enqueue one request and await its `Completion` (rank 0 only; the bound method is a
        `GenerateFn`).
        ``request.session_id`` is for routers; the engine ignores it. Never returns None here
        (the type leaves room for routers that drop requests)."""
        self._check_serving("generate")
        request_id = request.request_id
        if not request.prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids is empty")
        engine_request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling or self.default_sampling,
        )
        self._inbox.submit(engine_request)
        future = self._pending.add(engine_request)
        self._wake.set()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller gave up: free the engine slot (nobody awaits the partial completion).
            self._abort_now([request_id])
            raise

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort requests (None: all in flight); each future resolves with the tokens generated so
        far and finish reason ``abort``. Returns once every found request has resolved (finishing
        on its own meanwhile counts); the number found. Unknown ids are ignored."""
        self._check_serving("abort")
        num_found, futures = self._abort_now(request_ids)
        if futures:
            await asyncio.wait(futures)
        return num_found

    def _abort_now(self, request_ids: list[str] | None) -> tuple[int, list[asyncio.Future[Any]]]:
        """Resolve queued requests at once, mark in-engine ones for the next ABORT decision."""
        queued, marked = self._inbox.request_abort(request_ids)
        for request in queued:
            self._pending.resolve_unstarted_abort(request)
        self._wake.set()
        futures = [f for rid in marked if (f := self._pending.future(rid)) is not None]
        return len(queued) + len(marked), futures

    # ---- every-rank calls -----------------------------------------------------------------------
    async def pull_model_state_dict(
        self, policy_version: int, state_dict: dict[str, Any], streamed: bool = False
    ) -> dict[str, float]:
        """Pull ``state_dict`` as ``policy_version`` through the loop (call on every rank with
        the same version). A bad state dict raises here and leaves the loop untouched. Returns
        once this rank applied it: ``convert_s`` (prepare) and ``load_s`` (apply) seconds.
        ``streamed``: the tensors view a shared segment still being filled; each is applied
        once ``weights_staged`` says its bytes are there."""
        self._check_running("pull_model_state_dict")
        self._pulls.check_new(policy_version, self.policy_version)
        start = time.perf_counter()
        weights = self.puller.prepare(state_dict)
        if streamed:
            weights = StagedWeights(weights, self._pulls.entry(policy_version).staging)
        convert_s = time.perf_counter() - start
        if self.rank == 0:
            self._inbox.request_pull(policy_version, current_version=self.policy_version)
        done = self._pulls.deliver(policy_version, weights)
        self._wake.set()
        load_s = await asyncio.shield(done)
        return {"convert_s": convert_s, "load_s": load_s}

    def rewind(self, policy_version: int) -> None:
        """The run went back to an older policy (its trainer was restored from a checkpoint):
        the loaded weights count as older than ``policy_version``, so the next pull may be that
        version. Call on every rank with no request in flight and no pull pending (else this
        raises, and the caller replaces the generator)."""
        self._check_running("rewind")
        if len(self._pulls) or self._inbox.pending_pulls or len(self._pending):
            raise RuntimeError(f"rewind to version {policy_version}: {len(self._pending)} "
                               f"requests in flight, {len(self._pulls)} pulls pending")
        logger.info("rank %d: policy version %d -> %d (the trainer was restored)", self.rank,
                    self.policy_version, policy_version)
        self.policy_version = policy_version - 1

    def weights_staged(self, policy_version: int, num_bytes: int) -> None:
        """A streamed push of ``policy_version`` has staged its first ``num_bytes`` bytes."""
        if policy_version > self.policy_version and self._stopped_error is None:
            self._pulls.entry(policy_version).staging.advance(num_bytes)

    @property
    def num_inflight_requests(self) -> int:
        """Rank 0: generate() calls not yet resolved (queued or in the engine)."""
        return len(self._pending)

    async def settled(self) -> None:
        """Until this rank is between bursts: a follower rank (TP > 1) finishes a step's
        sampling and bookkeeping on its own time after rank 0 resolved the step's outputs, so
        its counters are read once its burst is over."""
        await self._between_bursts.wait()

    @property
    def finished_digest(self) -> str:
        """sha256 over (request id, token ids, finish reason) of every finished output in order:
        equal on every rank when the ranks generate identical tokens."""
        return self._finished_digest.hexdigest()

    # ---- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._in_thread(self.engine.set_weight_version, str(self.policy_version))
            while True:
                decision = await self._next_decision() if self.rank == 0 else None
                if self.channel is not None:
                    decision = await self._in_thread(self.channel.exchange, decision)
                assert decision is not None
                if decision.action is LoopAction.CLOSE:
                    await self._in_thread(self.engine.abort_request, decision.abort_request_ids)
                    if decision.error is not None:
                        raise RuntimeError(f"{_RANK0_FAILED}: {decision.error}")
                    logger.info("rank %d: engine loop closed", self.rank)
                    return
                await self._apply(decision)
        except asyncio.CancelledError:
            self._stop(RuntimeError("engine loop was cancelled"))
            raise
        except Exception as exc:
            logger.exception("rank %d: engine loop failed; failing every outstanding call", self.rank)
            in_engine = list(self._inbox.in_engine)
            self._stop(exc)
            if self.rank == 0:
                self._tell_peers_to_stop(exc)
                if self.channel is not None:
                    # A tensor-parallel group whose loop failed cannot serve again (a peer died
                    # in a collective, or stops on the error above): ending rank 0 makes Monarch
                    # report the mesh lost, so the controller replaces the whole generator and
                    # restarts its groups instead of failing them with this error.
                    logger.critical("rank 0: exiting so that the generator is replaced")
                    os._exit(1)
                # Leave the engine clean for whoever reuses it (best effort: it may be broken).
                self._executor.submit(self.engine.abort_request, in_engine)
            elif not str(exc).startswith(_RANK0_FAILED):
                # Rank 0 waits for this rank inside a collective and cannot hear about the error;
                # ending the process makes its gloo call raise, so its futures fail instead of hang.
                logger.critical("rank %d: exiting so that rank 0 stops waiting", self.rank)
                os._exit(1)

    async def _next_decision(self) -> LoopDecision:
        while True:
            self._wake.clear()
            decision = self._inbox.decide()
            if decision is not None:
                return decision
            await self._wake.wait()

    async def _apply(self, decision: LoopDecision) -> None:
        if decision.action is LoopAction.STEP:
            await self._admit(decision.requests)
            await self._step_burst()
        elif decision.action is LoopAction.PULL:
            assert decision.pull_version is not None
            await self._pull(decision.pull_version)
        elif decision.action is LoopAction.ABORT:
            await self._abort(decision.abort_request_ids)
        else:
            raise AssertionError(f"unexpected action {decision.action}")

    async def _admit(self, requests: list[EngineRequest]) -> None:
        if not requests:
            return
        salt = str(self.policy_version) if self.weight_sync.salts_prefix_cache_by_version else None
        failures = await self._in_thread(add_requests, self.engine, requests, salt,
                                         self.puller.lora_request)
        if self.rank != 0:
            return
        now = time.monotonic()
        for request in requests:
            rid = request.request_id
            if rid in failures:
                self._inbox.on_left_engine(rid)
                self._pending.fail(rid, failures[rid])
            else:
                self._pending.mark_admitted(rid, now)

    async def _step_burst(self) -> None:
        # The whole burst is one call into the engine thread: a round trip to the event loop
        # between two engine steps (two thread wake-ups) is what a step's outputs would cost
        # otherwise, and on a busy CPU each wake-up can wait for a core.
        self._burst_error = None
        self._between_bursts.clear()
        try:
            await self._in_thread(self._burst, asyncio.get_running_loop())
        finally:
            self._between_bursts.set()
        if self._burst_error is not None:
            raise self._burst_error
        if self.rank == 0 and self._inbox.in_engine and not await self._in_thread(
            self.engine.has_unfinished_requests
        ):
            # Bookkeeping drift would make decide() return STEP forever: fail loudly instead.
            lost = list(self._inbox.in_engine)
            for rid in lost:
                self._inbox.on_left_engine(rid)
                self._pending.fail(rid, RuntimeError(f"request {rid} left vLLM with no output"))
            logger.error("requests left vLLM with no output: %s", lost)

    def _burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Engine thread: up to ``max_steps`` engine steps; each step's finished outputs go to
        the event loop as soon as the step ends (callbacks run in order, all of them before
        ``_step_burst`` resumes)."""
        for _ in range(self.max_steps):
            finished = finished_outputs_of_step(self.engine)
            if finished is None:
                return
            loop.call_soon_threadsafe(self._on_step_in_loop, finished)
            # Alone (no tensor-parallel peers stepping in lockstep) rank 0 takes new work at the
            # next step, as vLLM's own loop does: a new turn or a push would otherwise wait for
            # the rest of the burst. TP ranks keep the fixed burst that every rank agreed on.
            if self.channel is None and self._inbox.has_news:
                return

    def _on_step_in_loop(self, finished: list[Any]) -> None:
        try:
            self._on_step(finished)
        except Exception as exc:  # fails the loop in _step_burst, as a failed step would
            if self._burst_error is None:
                self._burst_error = exc

    def _on_step(self, finished: list[Any]) -> None:
        self.num_steps += 1
        self.num_finished += len(finished)
        for output in finished:
            tokens = list(output.outputs[0].token_ids) if output.outputs else []
            reason = output.outputs[0].finish_reason if output.outputs else None
            self._finished_digest.update(f"{output.request_id}|{tokens}|{reason};".encode())
        if self.rank != 0:
            return
        num_in_engine = len(self._inbox.in_engine)
        for output in finished:
            self._resolve_output(output, num_in_engine)
        if self.on_step is not None:
            self.on_step(StepStats(
                step_index=self.num_steps, num_requests_in_engine=num_in_engine,
                num_finished=len(finished), policy_version=self.policy_version,
            ))

    def _resolve_output(self, output: Any, num_in_engine: int) -> None:
        self._inbox.on_left_engine(output.request_id)
        self._pending.resolve_output(output, num_in_engine)

    async def _pull(self, version: int) -> None:
        # A peer rank can see the decision before its own pull call arrives: wait for it.
        weights = await self._pulls.entry(version).weights
        start = time.perf_counter()
        await self._in_thread(self._apply_pull, version, weights)
        self.policy_version = version
        apply_s = time.perf_counter() - start
        self._pulls.finish(version, apply_s)
        logger.info("rank %d: pulled policy version %d in %.3f s", self.rank, version, apply_s)

    def _apply_pull(self, version: int, weights: Any) -> None:
        self.puller.apply(self.engine, weights)
        self.engine.set_weight_version(str(version))
        policy = self.weight_sync
        if policy.reset_prefix_cache and not policy.salts_prefix_cache_by_version:
            # Under hot swap this preempts the running requests; under drain none is running.
            if not self.engine.reset_prefix_cache(
                    reset_running_requests=not policy.drain_before_pull):
                logger.warning("rank %d: vLLM kept its prefix cache at the pull of version %d "
                               "(a request held blocks)", self.rank, version)

    async def _abort(self, request_ids: list[str]) -> None:
        outputs = await self._in_thread(abort_with_outputs, self.engine, request_ids)
        if self.rank != 0:
            return
        num_in_engine = len(self._inbox.in_engine) + len(request_ids)
        for rid, output in zip(request_ids, outputs):
            if output is None:
                self._inbox.on_left_engine(rid)
                self._pending.fail(rid, RuntimeError(f"request {rid} vanished from vLLM"))
                continue
            self._resolve_output(output, num_in_engine)

    # ---- helpers --------------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _check_running(self, call: str) -> None:
        if self._task is None:
            raise RuntimeError(f"{call}: the engine loop is not started")
        if self._stopped_error is not None:
            raise RuntimeError(f"{call}: the engine loop stopped: {self._stopped_error!r}")

    def _check_serving(self, call: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{call} is served by rank 0, called on rank {self.rank}")
        self._check_running(call)
        if self._inbox.close_requested:
            raise RuntimeError(f"{call}: the generator is closing")

    def _stop(self, error: BaseException) -> None:
        self._stopped_error = error
        self._fail_pending(error)

    def _fail_pending(self, error: BaseException) -> None:
        self._pending.fail_all(error)
        self._pulls.fail_all(error)

    def _tell_peers_to_stop(self, error: BaseException) -> None:
        if self.channel is None:
            return
        decision = LoopDecision(action=LoopAction.CLOSE, error=repr(error))
        # Best effort, in a daemon thread: a peer stuck in an engine collective never listens, and
        # that must not keep this process alive or block the futures failed above.
        threading.Thread(target=self.channel.exchange, args=(decision,), daemon=True).start()


# ---- building and starting one ------------------------------------------------------------------
async def start_engine_loop(
    config: GeneratorConfig,
    *,
    on_step: Callable[[StepStats], None] | None = None,
    wrap_engine: Callable[[Any], Any] | None = None,
) -> EngineLoop:
    """Build this rank's engine in a fresh engine thread and start its loop on the running event
    loop: the one code path of the actor, tests, benchmarks and torchrun launches.

    With tensor_parallel_degree > 1 every rank calls this at the same time, with the torch
    elastic env set (WORLD_SIZE == tensor_parallel_degree). ``wrap_engine`` wraps the built
    engine (tests inject faults with it)."""
    from torchtitan_rl.weight_sync.pull import is_cpu_platform

    tp = config.tensor_parallel_degree
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and world != tp:
        raise RuntimeError(
            f"tensor_parallel_degree={tp} needs WORLD_SIZE={tp} in the environment (torch "
            f"elastic env, e.g. monarch.spmd.setup_torch_elastic_env), got WORLD_SIZE={world}"
        )
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(executor, _build_engine_in_thread, config)
    # The stand-in holds plain tensors, and asking vLLM's platform would import vLLM.
    vllm_cpu_kernels = config.engine != "stand_in" and is_cpu_platform()
    load = config.weight_sync.load
    if load == "auto":  # the fast path where vLLM's CPU layout allows it
        load = "in_place" if (config.engine == "vllm" and tp == 1 and config.enforce_eager
                              and vllm_cpu_kernels) else "reload"
        logger.info("weight_sync.load='auto': %s", load)
    puller: WeightPuller | AdapterPuller = (
        AdapterPuller(config.model_dir, rank=config.lora_rank, alpha=config.lora_alpha)
        if config.lora_rank else
        WeightPuller(config.model_dir, load=load,  # type: ignore[arg-type]
                     repack_cpu_linears=config.weight_sync.repack_cpu_linears,
                     vllm_cpu_kernels=vllm_cpu_kernels))
    await loop.run_in_executor(executor, puller.setup, engine)
    channel = None
    if tp > 1:
        # After the engine: vLLM has initialised the default process group by now.
        channel = await loop.run_in_executor(executor, DecisionChannel.new_gloo_group)
    engine_loop = EngineLoop(
        wrap_engine(engine) if wrap_engine is not None else engine,
        puller=puller,
        weight_sync=config.weight_sync,
        max_engine_steps_between_decisions=config.max_engine_steps_between_decisions,
        default_sampling=config.sampling,
        initial_policy_version=config.initial_policy_version,
        channel=channel,
        executor=executor,
        on_step=on_step,
    )
    engine_loop.start()
    return engine_loop


def _build_engine_in_thread(config: GeneratorConfig) -> Any:
    from torchtitan_rl.generator.vllm_engine import engine_builder

    threads = config.torch_num_threads
    if threads is None and config.tensor_parallel_degree > 1:
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    engine = engine_builder(config.engine)(config)
    if config.tensor_parallel_degree > 1:
        assert dist.is_initialized(), "vLLM's external_launcher left no default process group"
    return engine


# ---- the calls in flight -------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class _Pending:
    request: EngineRequest
    future: asyncio.Future[Completion]
    submitted_at: float
    admitted_at: float | None = None


class PendingRequests:
    def __init__(self) -> None:
        self._entries: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request: EngineRequest) -> asyncio.Future[Completion]:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._entries[request.request_id] = _Pending(request, future, submitted_at=time.monotonic())
        return future

    def future(self, request_id: str) -> asyncio.Future[Completion] | None:
        entry = self._entries.get(request_id)
        return entry.future if entry is not None else None

    def mark_admitted(self, request_id: str, now: float) -> None:
        if (entry := self._entries.get(request_id)) is not None:
            entry.admitted_at = now

    def fail(self, request_id: str, error: BaseException) -> None:
        if (entry := self._entries.pop(request_id, None)) is not None:
            fail_future(entry.future, error)

    def resolve_unstarted_abort(self, request: EngineRequest) -> None:
        """An abort that caught the request before vLLM saw it: no tokens, queue time only."""
        entry = self._entries.pop(request.request_id)
        metrics = CompletionMetrics(queue_time_s=time.monotonic() - entry.submitted_at)
        resolve_future(entry.future, empty_abort_completion(request, metrics))

    def resolve_output(self, output: Any, num_in_engine: int) -> None:
        """A vLLM output that finished (or was aborted) -> the caller's Completion."""
        entry = self._entries.pop(output.request_id, None)
        if entry is None:
            return
        now = time.monotonic()
        admitted_at = entry.admitted_at if entry.admitted_at is not None else now
        metrics = CompletionMetrics(
            queue_time_s=admitted_at - entry.submitted_at,
            time_to_first_token_s=first_token_latency_s(output),
            generation_time_s=now - admitted_at,
            num_cached_prompt_tokens=output.num_cached_tokens or 0,
            num_inflight_requests=num_in_engine,
        )
        try:
            completion = completion_from_output(entry.request, output, metrics)
        except Exception as exc:
            fail_future(entry.future, exc)
            return
        resolve_future(entry.future, completion)

    def fail_all(self, error: BaseException) -> None:
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            fail_future(entry.future, error)


@dataclasses.dataclass(slots=True)
class _Pull:
    """One rank's pull of one policy version."""

    weights: asyncio.Future[Any]
    """The prepared weights (set by the pull call)."""
    done: asyncio.Future[float]
    """Set by the loop once applied: the seconds the apply took."""
    staging: StagingProgress = dataclasses.field(default_factory=StagingProgress)
    """A streamed push's progress (its ``weights_staged`` messages may come first)."""


class PendingPulls:
    def __init__(self) -> None:
        self._pulls: dict[int, _Pull] = {}

    def check_new(self, version: int, current_version: int) -> None:
        """Refuse a second call for one version, and versions not above the newest loaded or
        received (a PULL decision seen first on a peer rank is not a received pull)."""
        pull = self._pulls.get(version)
        if pull is not None and pull.weights.done():
            raise ValueError(f"a pull of version {version} is already pending")
        received = [v for v, p in self._pulls.items() if p.weights.done()]
        latest = max([current_version, *received])
        if pull is None and version <= latest:
            raise ValueError(
                f"pull version must be > {latest} (the newest version loaded or pending), "
                f"got {version}"
            )

    def entry(self, version: int) -> _Pull:
        if (pull := self._pulls.get(version)) is None:
            loop = asyncio.get_running_loop()
            pull = self._pulls[version] = _Pull(loop.create_future(), loop.create_future())
        return pull

    def deliver(self, version: int, weights: Any) -> asyncio.Future[float]:
        pull = self.entry(version)
        pull.weights.set_result(weights)
        return pull.done

    def finish(self, version: int, apply_s: float) -> None:
        resolve_future(self._pulls.pop(version).done, apply_s)

    def __len__(self) -> int:
        """Pulls received or announced and not applied yet."""
        return len(self._pulls)

    def fail_all(self, error: BaseException) -> None:
        pulls, self._pulls = self._pulls, {}
        for pull in pulls.values():
            pull.staging.fail(error)
            fail_future(pull.done, error)


def resolve_future(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def fail_future(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        # Mark it retrieved: nobody may be awaiting (a pull future on a peer rank, a cancelled call).
        future.exception()
