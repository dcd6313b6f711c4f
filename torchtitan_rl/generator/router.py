"""Routing requests over N generator meshes, behind the same `GenerateFn` the rollout code calls.

Strategies:
- ``round_robin``: generators in turn.
- ``least_loaded``: the generator with the fewest requests in flight (ties: fewest routed so far).
- ``sticky_session``: every turn of a rollout (same session id) goes to the generator that served
  its first turn, so its prefix stays in that engine's KV cache; an LRU map bounds the sessions
  kept. While a generator takes a push, new sessions avoid it and its sessions are re-pinned to
  the least-loaded generator that is not in a push.

The router also keeps the generators' busy clock (time with at least one request in flight), from
which the loop logs the generator idle ratio (idle_ratios.py).

A generator that raises fails the request with that error; the router never retries silently. A
lost generator is taken out (``take_out``) until its replacement is put back (``put_back``): its
sessions are re-pinned, and with no generator left a request waits for one.

Mirrors (``add_mirror``): rollout workers keep routers of their own over the same generators
(controller/rollout_workers/worker.py); every change to which generators serve (``set_in_push``,
``take_out``, ``put_back``) is told to each mirror as it happens, so they route alike.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.metrics.trace import GENERATOR_PID, RunTrace
from torchtitan_rl.types import Completion, GenerateFn, GenerateRequest

logger = logging.getLogger(__name__)


class BusyClock:
    """Accumulates the wall time during which at least one unit of work was open."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._open = 0
        self._busy_s = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self._open == 0:
            self._since = self._clock()
        self._open += 1

    def exit(self) -> None:
        if self._open <= 0:
            raise RuntimeError("BusyClock.exit() without a matching enter()")
        self._open -= 1
        if self._open == 0:
            self._busy_s += self._clock() - self._since

    @property
    def num_open(self) -> int:
        return self._open

    def busy_seconds(self) -> float:
        """Busy time so far, counting an interval still open up to now."""
        return self._busy_s + (self._clock() - self._since if self._open else 0.0)


class RouterMirror(Protocol):
    """A copy of the router's serving set kept elsewhere (a rollout worker's router); each call
    returns at once (a message is sent, no reply awaited)."""

    def set_in_push(self, indices: list[int], in_push: bool) -> None: ...
    def take_out(self, index: int, reason: str) -> None: ...
    def put_back(self, index: int, generator: GenerateFn) -> None: ...


class GeneratorRouter(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        strategy: Literal["round_robin", "least_loaded", "sticky_session"] = "sticky_session"
        """Which generator serves a request. round_robin: the generators in turn.
        least_loaded: the one with the fewest requests in flight. sticky_session: every turn of
        a rollout goes to the generator that served its first turn (its prefix stays in that
        engine's KV cache); new sessions go to the least loaded one, and sessions move off a
        generator while it pulls weights."""
        max_sessions: int = 100_000
        """Sticky sessions remembered (least recently used are forgotten first)."""

        def __post_init__(self) -> None:
            if self.max_sessions < 1:
                raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")

    def __init__(self, config: Config, *, generators: Sequence[GenerateFn],
                 busy_clock: BusyClock | None = None) -> None:
        if not generators:
            raise ValueError("the router needs at least one generator")
        self.config = config
        self.generators = list(generators)
        self.busy_clock = busy_clock or BusyClock()
        """Open while any request is in flight on any generator."""
        self.inflight_requests = [0] * len(generators)
        self.num_routed = [0] * len(generators)
        self._in_push: set[int] = set()
        self._out: set[int] = set()
        """Generators taken out (lost, being replaced)."""
        self._any_in = asyncio.Event()
        self._any_in.set()
        self._round_robin = itertools.cycle(range(len(generators)))
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._mirrors: list[RouterMirror] = []
        self.trace: RunTrace | None = None
        """Each request's life on its generator's track (metrics/trace.py), when set."""

    def add_mirror(self, mirror: RouterMirror) -> None:
        """Tell ``mirror`` every later set_in_push / take_out / put_back."""
        self._mirrors.append(mirror)

    # ---- choosing ------------------------------------------------------------------------------
    def pick(self, session_id: str | None) -> int:
        strategy = self.config.strategy
        if strategy == "round_robin":
            for _ in range(len(self.generators)):
                index = next(self._round_robin)
                if index not in self._out:
                    return index
            raise RuntimeError("no generator in the router")
        if strategy == "least_loaded" or session_id is None:
            return self._least_loaded()
        index = self._sessions.get(session_id)
        if index is None or index in self._in_push or index in self._out:
            index = self._least_loaded()
        self._sessions[session_id] = index
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)
        return index

    def _least_loaded(self) -> int:
        serving = [i for i in range(len(self.generators)) if i not in self._out]
        available = [i for i in serving if i not in self._in_push]
        pool = available or serving
        return min(pool, key=lambda i: (self.inflight_requests[i], self.num_routed[i], i))

    def set_in_push(self, indices: list[int], in_push: bool) -> None:
        """Mark generators as pulling weights (sticky sessions move off them meanwhile); one
        message per mirror for the lot (a push marks every relayed generator at once)."""
        for index in indices:
            (self._in_push.add if in_push else self._in_push.discard)(index)
        for mirror in self._mirrors:
            mirror.set_in_push(indices, in_push)

    @property
    def mirrored(self) -> bool:
        """Rollout workers mirror this router (their generators are fixed at their spawn)."""
        return bool(self._mirrors)

    def add(self, generator: GenerateFn) -> int:
        """Serve with one more generator (added mid-run); returns its index."""
        if self._mirrors:
            raise RuntimeError("generators cannot be added while rollout workers mirror the "
                               "router (rollouter.num_workers > 0)")
        self.generators.append(generator)
        self.inflight_requests.append(0)
        self.num_routed.append(0)
        self._round_robin = itertools.cycle(range(len(self.generators)))
        self._any_in.set()
        return len(self.generators) - 1

    def num_serving(self) -> int:
        """Generators not taken out."""
        return len(self.generators) - len(self._out)

    def take_out(self, index: int) -> None:
        """Route nothing to generator ``index`` until ``put_back``."""
        self._out.add(index)
        if len(self._out) == len(self.generators):
            self._any_in.clear()
        if self._mirrors:  # a lost handle says why: the mirrors fail their calls with it
            reason = getattr(self.generators[index], "lost_reason", None) or "taken out"
            for mirror in self._mirrors:
                mirror.take_out(index, reason)

    def put_back(self, index: int, generator: GenerateFn) -> None:
        """Serve with ``generator`` (a replacement) at ``index`` again."""
        self.generators[index] = generator
        self._out.discard(index)
        self._any_in.set()
        for mirror in self._mirrors:
            mirror.put_back(index, generator)

    # ---- the GenerateFn ------------------------------------------------------------------------
    async def __call__(self, request: GenerateRequest) -> Completion | None:
        while len(self._out) == len(self.generators):  # all lost: wait for a replacement
            await self._any_in.wait()
        index = self.pick(request.session_id)
        self.inflight_requests[index] += 1
        self.num_routed[index] += 1
        self.busy_clock.enter()
        logger.debug("route %s (session %s) -> generator %d", request.request_id,
                     request.session_id, index)
        start = time.perf_counter()
        outcome = "error"
        try:
            completion = await self.generators[index](request)
            outcome = "done" if completion is not None else "aborted"
            return completion
        finally:
            self.inflight_requests[index] -= 1
            self.busy_clock.exit()
            if self.trace is not None:
                self.trace.async_span("request", "request", request.request_id, start,
                                      time.perf_counter(), pid=GENERATOR_PID + index,
                                      outcome=outcome)

    def metrics(self) -> dict[str, float]:
        return {f"router/generator_{i}/num_routed": float(n) for i, n in enumerate(self.num_routed)}
