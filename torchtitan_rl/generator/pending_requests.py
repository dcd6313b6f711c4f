"""The engine loop's calls in flight: rank 0's generate() calls and every rank's weight pulls.

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

Every future resolves exactly once; resolving an already-done future is a no-op, so a late output
for a request that was failed or cancelled is dropped instead of raising in the engine loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from torchtitan_rl.generator.loop_decision import EngineRequest
from torchtitan_rl.generator.vllm_engine import (
    completion_from_output,
    empty_abort_completion,
    first_token_latency_s,
)
from torchtitan_rl.types import Completion, CompletionMetrics
from torchtitan_rl.weight_sync.shared_memory import StagingProgress


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
