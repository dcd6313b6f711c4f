"""What the engine loop does next: rank 0's inbox, the rule that turns it into a `LoopDecision`,
and the gloo channel that hands the decision to the other tensor-parallel ranks.

    generate / pull / abort / close (rank 0)  ->  LoopInbox  --decide()-->  LoopDecision
    LoopDecision  --DecisionChannel.exchange (gloo broadcast)-->  every rank applies the same one

Priority: CLOSE > PULL > ABORT > STEP. ``decide()`` returns None when there is nothing to do (the
loop then waits for a wake-up instead of spinning). A PULL under ``drain`` waits until no request is
in the engine; meanwhile STEP decisions keep stepping the running requests but admit nothing.

Request accounting on rank 0 (checked on every event):
    every submitted request is exactly one of: queued | in_engine | gone (finished, aborted, failed)
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.types import Sampling

logger = logging.getLogger(__name__)

# Peer ranks wait inside this group's broadcast while the generator idles; the default gloo
# timeout (30 min) would turn a quiet generator into a failed one.
DECISION_GROUP_TIMEOUT = timedelta(days=7)


class LoopAction(enum.Enum):
    STEP = "step"
    """Admit ``requests`` (FCFS order), then run a burst of engine steps."""
    PULL = "pull"
    """Load the weights of ``pull_version`` (between steps)."""
    ABORT = "abort"
    """Abort ``abort_request_ids`` (they are in the engine on every rank)."""
    CLOSE = "close"
    """Abort what is left in the engine and stop the loop."""


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineRequest:
    """One generate call on its way into the engine (plain data: it is broadcast to every rank)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling


@dataclasses.dataclass(kw_only=True, slots=True)
class LoopDecision:
    """Rank 0's choice for one loop iteration; every rank applies it identically."""

    action: LoopAction
    requests: list[EngineRequest] = dataclasses.field(default_factory=list)
    """STEP: requests to add before the burst, in FCFS order."""
    abort_request_ids: list[str] = dataclasses.field(default_factory=list)
    """ABORT, CLOSE: requests in the engine to abort."""
    pull_version: int | None = None
    """PULL: the policy version to load."""
    error: str | None = None
    """CLOSE sent after rank 0 failed: peers stop with this message."""


class LoopInbox:
    """Rank 0's pending work and the pure rule that picks the next decision (no engine, no I/O)."""

    def __init__(self, *, drain_before_pull: bool) -> None:
        self.drain_before_pull = drain_before_pull
        self.queued: collections.OrderedDict[str, EngineRequest] = collections.OrderedDict()
        """Submitted, not yet added to the engine (FCFS order)."""
        self.in_engine: dict[str, None] = {}
        """Added to the engine, not yet finished or aborted (insertion order)."""
        self.pending_pulls: collections.deque[int] = collections.deque()
        self.pending_aborts: dict[str, None] = {}
        """In-engine requests marked for abort."""
        self.close_requested = False

    # ---- events -----------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self.queued or rid in self.in_engine:
            raise ValueError(f"request_id {rid!r} is already in flight")
        self.queued[rid] = request

    def request_pull(self, version: int, *, current_version: int) -> None:
        latest = self.pending_pulls[-1] if self.pending_pulls else current_version
        if version <= latest:
            raise ValueError(
                f"pull version must be > {latest} (the newest version loaded or pending), "
                f"got {version}"
            )
        self.pending_pulls.append(version)

    def request_abort(self, request_ids: list[str] | None) -> tuple[list[EngineRequest], list[str]]:
        """Mark requests for abort (None: every request in flight). Returns the queued requests,
        removed here (they never reach the engine), and the in-engine ids now marked. Unknown ids
        (already finished, never submitted) are ignored."""
        ids = list(self.queued) + list(self.in_engine) if request_ids is None else request_ids
        removed = [self.queued.pop(rid) for rid in ids if rid in self.queued]
        marked = [rid for rid in ids if rid in self.in_engine]
        self.pending_aborts.update(dict.fromkeys(marked))
        return removed, marked

    def request_close(self) -> None:
        self.close_requested = True

    def on_left_engine(self, request_id: str) -> None:
        """A request finished, was aborted or failed to be added."""
        self.in_engine.pop(request_id, None)
        self.pending_aborts.pop(request_id, None)

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
                del self.in_engine[rid]
            return LoopDecision(action=LoopAction.ABORT, abort_request_ids=aborts)
        admitted: list[EngineRequest] = []
        if not self.draining:
            admitted = list(self.queued.values())
            self.queued.clear()
            self.in_engine.update(dict.fromkeys(r.request_id for r in admitted))
        if admitted or self.in_engine:
            return LoopDecision(action=LoopAction.STEP, requests=admitted)
        return None


class DecisionChannel:
    """Hands rank 0's decision to every rank of the generator mesh over a gloo group.

    ``exchange`` blocks (a collective): the engine loop calls it from its engine thread so the
    actor's event loop stays free.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)

    @classmethod
    def new_gloo_group(cls) -> DecisionChannel:
        """A fresh gloo group over the default world (every rank must call this, in the same
        order as any other group creation)."""
        return cls(dist.new_group(backend="gloo", timeout=DECISION_GROUP_TIMEOUT))

    def exchange(self, decision: LoopDecision | None) -> LoopDecision:
        box: list[LoopDecision | None] = [decision if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=torch.device("cpu"))
        assert box[0] is not None, "rank 0 broadcast no decision"
        return box[0]
