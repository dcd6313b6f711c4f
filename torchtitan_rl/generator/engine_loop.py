"""One rank's engine loop over one vLLM ``LLMEngine`` (plain class: no actor, testable in-process).

    rank 0: generate(request)/pull/abort/close -> RequestLedger -> decide() -> LoopDecision
    every rank: decision --DecisionChannel (gloo, engine thread)--> same decision on every rank
    every rank: apply it in the engine thread: add + burst of <= K engine.step() | pull | abort
          (TP 1: the burst ends early when rank 0's ledger has new work)
    rank 0: finished outputs -> RequestLedger.resolve_output -> the generate() futures

Built and started by ``start_engine_loop`` (generator/engine_setup.py). Rank 0's requests are in
one ledger (generator/request_ledger.py, its invariants checked on every event); every rank's
pulls in ``PendingPulls`` (generator/pulls.py). A pull: every rank's pull_model_state_dict()
prepares the weights at once (a bad state dict fails that call alone); rank 0's PULL decision
then makes every rank load them between two engine steps and label later tokens with the new
policy version.

Every engine call (and the gloo broadcast) runs in one engine thread per rank, in the same order
on every rank, so the asyncio event loop stays free to accept calls while the engine steps. With
nothing to do rank 0 awaits an event (no spinning); peers wait inside the broadcast.

Failure: any exception in the loop fails every outstanding future (generate, pull, abort) with
that exception, and rank 0 tells peer ranks to stop; later calls raise at once. ``close()`` fails
the futures still pending with a RuntimeError. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torchtitan_rl.generator.config import WeightSyncPolicy
from torchtitan_rl.generator.loop_decision import (
    DecisionChannel,
    EngineRequest,
    LoopAction,
    LoopDecision,
)
from torchtitan_rl.generator.pulls import PendingPulls, load_weights
from torchtitan_rl.generator.request_ledger import RequestLedger
from torchtitan_rl.generator.vllm_engine import (
    abort_with_outputs,
    add_requests,
    finished_outputs_of_step,
)
from torchtitan_rl.types import Completion, GenerateRequest, Sampling
from torchtitan_rl.weight_sync.lora_pull import AdapterPuller
from torchtitan_rl.weight_sync.pull import WeightPuller
from torchtitan_rl.weight_sync.shared_memory import StagedWeights

logger = logging.getLogger(__name__)

_RANK0_FAILED = "rank 0's engine loop failed"


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
    ) -> None:
        """The settings are `Generator.Config`'s (checked there)."""
        self.engine = engine
        self.puller = puller
        """Turns a pulled state dict into the engine's weights (prepare: raises on a bad state
        dict) and loads them between engine steps (apply): weight_sync/pull.py."""
        self.weight_sync = weight_sync or WeightSyncPolicy()
        self.max_steps = max_engine_steps_between_decisions
        self.default_sampling = default_sampling or Sampling()
        self.rank = channel.rank if channel is not None else 0
        self.channel = channel
        self.policy_version = initial_policy_version
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"engine-rank{self.rank}"
        )
        # ---- runtime state -------------------------------------------------------------------
        self._ledger = RequestLedger(drain_before_pull=self.weight_sync.drain_before_pull)
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
        self._finished_digest: Any = None
        """sha256 of the finished outputs, once ``record_finished_digest`` turned it on."""

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
            self._ledger.request_close()
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
        future = self._ledger.submit(engine_request)
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
        removed, marked = self._ledger.request_abort(request_ids)
        self._wake.set()
        return len(removed) + len(marked), self._ledger.futures_of(marked)

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
            self._ledger.request_pull(policy_version)
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
        num_requests = self._ledger.num_unresolved
        if len(self._pulls) or self._ledger.pending_pulls or num_requests:
            raise RuntimeError(f"rewind to version {policy_version}: {num_requests} "
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
        return self._ledger.num_unresolved

    async def settled(self) -> None:
        """Until this rank is between bursts: a follower rank (TP > 1) finishes a step's
        sampling and bookkeeping on its own time after rank 0 resolved the step's outputs, so
        its counters are read once its burst is over."""
        await self._between_bursts.wait()

    def record_finished_digest(self) -> None:
        """From now on hash (request id, token ids, finish reason) of every finished output, in
        order (tests: equal digests on every rank = identical tokens). Off by default: it costs
        every rank a pass over every output's tokens at every step."""
        if self._finished_digest is None:
            self._finished_digest = hashlib.sha256()

    @property
    def finished_digest(self) -> str:
        """The digest of the outputs finished since ``record_finished_digest``."""
        if self._finished_digest is None:
            raise RuntimeError("finished_digest: call record_finished_digest() first")
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
            in_engine = list(self._ledger.in_engine)
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
            decision = self._ledger.decide()
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
        if self.rank == 0:
            self._ledger.admitted(requests, failures, time.monotonic())

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
        if self.rank == 0 and self._ledger.in_engine and not await self._in_thread(
            self.engine.has_unfinished_requests
        ):
            # Bookkeeping drift would make decide() return STEP forever: fail loudly instead.
            lost = list(self._ledger.in_engine)
            for rid in lost:
                self._ledger.fail(rid, RuntimeError(f"request {rid} left vLLM with no output"))
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
            if self.channel is None and self._ledger.has_news:
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
        if self._finished_digest is not None:
            for output in finished:
                tokens = list(output.outputs[0].token_ids) if output.outputs else []
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._finished_digest.update(f"{output.request_id}|{tokens}|{reason};".encode())
        if self.rank != 0:
            return
        num_in_engine = self._ledger.num_in_engine
        for output in finished:
            self._ledger.resolve_output(output, num_in_engine)

    async def _pull(self, policy_version: int) -> None:
        # A peer rank can see the decision before its own pull call arrives: wait for it.
        weights = await self._pulls.entry(policy_version).weights
        start = time.perf_counter()
        await self._in_thread(load_weights, self.engine, self.puller, weights, policy_version,
                              self.weight_sync, self.rank)
        self.policy_version = policy_version
        apply_s = time.perf_counter() - start
        self._pulls.finish(policy_version, apply_s)
        logger.info("rank %d: pulled policy version %d in %.3f s", self.rank,
                    policy_version, apply_s)

    async def _abort(self, request_ids: list[str]) -> None:
        outputs = await self._in_thread(abort_with_outputs, self.engine, request_ids)
        if self.rank != 0:
            return
        num_in_engine = self._ledger.num_in_engine
        for rid, output in zip(request_ids, outputs):
            if output is None:
                self._ledger.fail(rid, RuntimeError(f"request {rid} vanished from vLLM"))
                continue
            self._ledger.resolve_output(output, num_in_engine)

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
        if self._ledger.close_requested:
            raise RuntimeError(f"{call}: the generator is closing")

    def _stop(self, error: BaseException) -> None:
        self._stopped_error = error
        self._fail_pending(error)

    def _fail_pending(self, error: BaseException) -> None:
        self._ledger.fail_all(error)
        self._pulls.fail_all(error)

    def _tell_peers_to_stop(self, error: BaseException) -> None:
        if self.channel is None:
            return
        decision = LoopDecision(action=LoopAction.CLOSE, error=repr(error))
        # Best effort, in a daemon thread: a peer stuck in an engine collective never listens, and
        # that must not keep this process alive or block the futures failed above.
        threading.Thread(target=self.channel.exchange, args=(decision,), daemon=True).start()
