"""Rank 0's one record of a generator's requests, from ``generate()`` to the caller's resolved
future, and the rule that turns it into the engine loop's next `LoopDecision` (no engine, no I/O).

    EngineLoop.generate()        -> submit()            queued      (a future the caller awaits)
    decide(): STEP admits it     -> admitted() | fail() in_engine
    decide(): ABORT of a marked one                     aborting    (its output is being read)
    a finished or aborted output -> resolve_output()    gone        (the future: a Completion)
    abort() of a queued one      -> request_abort()     gone        (no tokens, queue time only)
    loop failed or closed        -> fail_all()          every future fails; in-engine ids stay
                                                        for the CLOSE decision's abort

Priority of ``decide()``: CLOSE > PULL > ABORT > STEP; None when there is nothing to do (the loop
then waits for a wake-up instead of spinning). A PULL under ``drain_before_pull`` waits until no
request is in the engine; meanwhile STEP decisions keep stepping the running requests but admit
nothing. Pull versions are checked once, on every rank, by ``PendingPulls.check_new``
(generator/pulls.py) before rank 0 records them here.

Invariants, checked after every event (``_check``, constant time):
    num_submitted == num_gone + len(queued) + len(in_engine) + len(aborting)
    num_submitted - num_resolved <= len(queued) + len(in_engine) + len(aborting)
        (a request leaves only with its future resolved: no caller waits forever)
    len(pending_aborts) <= len(in_engine);  pending pull versions strictly increase
A late output for a request already resolved (failed, closed) is dropped, never raised.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any

from torchtitan_rl.generator.loop_decision import EngineRequest, LoopAction, LoopDecision
from torchtitan_rl.generator.vllm_engine import (
    completion_from_output,
    empty_abort_completion,
    first_token_latency_s,
)
from torchtitan_rl.types import Completion, CompletionMetrics


@dataclasses.dataclass(slots=True)
class _Entry:
    request: EngineRequest
    future: asyncio.Future[Completion]
    submitted_at: float
    admitted_at: float | None = None


class RequestLedger:
    """Rank 0's requests by state (queued | in_engine | aborting), their futures and timings,
    the pulls, aborts and close waiting for a decision, and ``decide()``."""

    def __init__(self, *, drain_before_pull: bool,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``loop``: the event loop the callers' futures belong to (default: the running one)."""
        self.drain_before_pull = drain_before_pull
        self._loop = loop
        self.queued: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        """Submitted, not yet added to the engine (FCFS order)."""
        self.in_engine: dict[str, _Entry] = {}
        """Added to the engine, not yet finished or aborted (insertion order)."""
        self.aborting: dict[str, _Entry] = {}
        """An ABORT decision is reading their outputs."""
        self.pending_pulls: collections.deque[int] = collections.deque()
        """Policy versions received and not yet decided (increasing)."""
        self.pending_aborts: dict[str, None] = {}
        """In-engine requests marked for abort."""
        self.close_requested = False
        self.num_submitted = 0
        self.num_resolved = 0
        """Futures resolved or failed."""
        self.num_gone = 0
        """Requests no longer held: finished, aborted, failed to be added, or dropped unstarted."""

    # ---- events -----------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> asyncio.Future[Completion]:
        rid = request.request_id
        if rid in self.queued or rid in self.in_engine or rid in self.aborting:
            raise ValueError(f"request_id {rid!r} is already in flight")
        loop = self._loop or asyncio.get_running_loop()
        entry = _Entry(request, loop.create_future(), submitted_at=time.monotonic())
        self.queued[rid] = entry
        self.num_submitted += 1
        self._check()
        return entry.future

    def request_pull(self, policy_version: int) -> None:
        """Record a pull for ``decide()`` (its version was checked by ``PendingPulls``)."""
        self.pending_pulls.append(policy_version)
        self._check()

    def request_abort(self, request_ids: list[str] | None
                      ) -> tuple[list[EngineRequest], list[str]]:
        """Abort requests (None: every request in flight). Queued ones leave at once, their
        callers answered with no tokens; in-engine ones are marked for the next ABORT decision.
        Returns the queued requests removed and the in-engine ids marked. Unknown ids (finished,
        never submitted) are ignored."""
        ids = list(self.queued) + list(self.in_engine) if request_ids is None else request_ids
        removed: list[EngineRequest] = []
        for rid in ids:
            if (entry := self.queued.pop(rid, None)) is not None:
                removed.append(entry.request)
                self.num_gone += 1
                metrics = CompletionMetrics(queue_time_s=time.monotonic() - entry.submitted_at)
                self._resolve(entry, empty_abort_completion(entry.request, metrics))
        marked = [rid for rid in ids if rid in self.in_engine]
        self.pending_aborts.update(dict.fromkeys(marked))
        self._check()
        return removed, marked

    def futures_of(self, request_ids: list[str]) -> list[asyncio.Future[Completion]]:
        """The callers' futures of these requests still unresolved."""
        entries = [self.queued.get(rid) or self.in_engine.get(rid) or self.aborting.get(rid)
                   for rid in request_ids]
        return [e.future for e in entries if e is not None and not e.future.done()]

    def request_close(self) -> None:
        self.close_requested = True

    def admitted(self, requests: list[EngineRequest], failures: dict[str, BaseException],
                 now: float) -> None:
        """The engine took ``requests`` (a STEP's), but for those in ``failures``."""
        for request in requests:
            rid = request.request_id
            if rid in failures:
                self.fail(rid, failures[rid])
            elif (entry := self.in_engine.get(rid)) is not None:
                entry.admitted_at = now

    def resolve_output(self, output: Any, num_in_engine: int) -> None:
        """A finished (or aborted) vLLM output: the request leaves, its caller gets the
        Completion (or the error of a malformed output)."""
        entry = self._leave_engine(output.request_id)
        if entry is None or entry.future.done():
            self._check()
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
            outcome: Completion | BaseException = completion_from_output(
                entry.request, output, metrics)
        except Exception as exc:
            outcome = exc
        self._resolve(entry, outcome)
        self._check()

    def fail(self, request_id: str, error: BaseException) -> None:
        """A request left the engine without an output (or never entered it): fail its caller."""
        entry = self._leave_engine(request_id)
        if entry is None and (entry := self.queued.pop(request_id, None)) is not None:
            self.num_gone += 1
        if entry is not None:
            self._resolve(entry, error)
        self._check()

    def fail_all(self, error: BaseException) -> None:
        """Fail every caller still waiting. Queued requests leave; requests in the engine stay
        recorded (resolved) until the engine lets go of them."""
        self.num_gone += len(self.queued)
        queued, self.queued = self.queued, collections.OrderedDict()
        for entry in [*queued.values(), *self.in_engine.values(), *self.aborting.values()]:
            self._resolve(entry, error)
        self._check()

    # ---- reading ----------------------------------------------------------------------------
    @property
    def num_unresolved(self) -> int:
        """generate() calls not yet resolved (queued or in the engine)."""
        return self.num_submitted - self.num_resolved

    @property
    def num_in_engine(self) -> int:
        """Requests the engine holds (running, or being aborted)."""
        return len(self.in_engine) + len(self.aborting)

    # ---- the rule ---------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """Admission is stopped until a pending pull is applied."""
        return self.drain_before_pull and bool(self.pending_pulls)

    @property
    def has_news(self) -> bool:
        """Whether ``decide()`` would now act on something besides stepping: a close, a pull it
        can apply, an abort, or a queued request it can admit."""
        return (self.close_requested
                or bool(self.pending_pulls and not (self.drain_before_pull and self.in_engine))
                or bool(self.pending_aborts) or bool(self.queued and not self.draining))

    def decide(self) -> LoopDecision | None:
        if self.close_requested:
            return LoopDecision(action=LoopAction.CLOSE, abort_request_ids=list(self.in_engine))
        if self.pending_pulls and not (self.drain_before_pull and self.in_engine):
            return LoopDecision(action=LoopAction.PULL, pull_version=self.pending_pulls.popleft())
        aborts = [rid for rid in self.pending_aborts if rid in self.in_engine]
        self.pending_aborts.clear()
        if aborts:
            for rid in aborts:
                self.aborting[rid] = self.in_engine.pop(rid)
            self._check()
            return LoopDecision(action=LoopAction.ABORT, abort_request_ids=aborts)
        admitted: list[EngineRequest] = []
        if not self.draining:
            admitted = [entry.request for entry in self.queued.values()]
            self.in_engine.update(self.queued)
            self.queued.clear()
        self._check()
        if admitted or self.in_engine:
            return LoopDecision(action=LoopAction.STEP, requests=admitted)
        return None

    # ---- helpers ----------------------------------------------------------------------------
    def _leave_engine(self, request_id: str) -> _Entry | None:
        self.pending_aborts.pop(request_id, None)
        entry = self.in_engine.pop(request_id, None) or self.aborting.pop(request_id, None)
        if entry is not None:
            self.num_gone += 1
        return entry

    def _resolve(self, entry: _Entry, outcome: Completion | BaseException) -> None:
        if entry.future.done():
            return
        self.num_resolved += 1
        if isinstance(outcome, BaseException):
            fail_future(entry.future, outcome)
        else:
            entry.future.set_result(outcome)

    def _check(self) -> None:
        held = len(self.queued) + len(self.in_engine) + len(self.aborting)
        assert self.num_submitted == self.num_gone + held, (
            f"request ledger: {self.num_submitted} submitted != {self.num_gone} gone + {held} held")
        assert self.num_submitted - self.num_resolved <= held, (
            f"request ledger: {self.num_submitted - self.num_resolved} unresolved futures but "
            f"only {held} requests held")
        assert len(self.pending_aborts) <= len(self.in_engine), (
            f"request ledger: {len(self.pending_aborts)} aborts pending for "
            f"{len(self.in_engine)} requests in the engine")
        assert len(self.pending_pulls) < 2 or self.pending_pulls[-2] < self.pending_pulls[-1], (
            f"request ledger: pull versions out of order: {list(self.pending_pulls)}")


def resolve_future(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def fail_future(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        # Mark it retrieved: nobody may be awaiting (a pull future on a peer rank, a cancelled call).
        future.exception()
