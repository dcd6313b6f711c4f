"""What the engine loop does next: the `LoopDecision` rank 0 takes (generator/request_ledger.py
``RequestLedger.decide``) and the gloo channel that hands it to the other tensor-parallel ranks.

    generate / pull / abort / close (rank 0)  ->  RequestLedger  --decide()-->  LoopDecision
    LoopDecision  --DecisionChannel.exchange (gloo broadcast)-->  every rank applies the same one

A decision is plain data: every rank applies it identically.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.types import Sampling

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
