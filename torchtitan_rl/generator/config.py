"""How a generator pulls new weights: the weight-sync policy (a plain config dataclass, no imports
of vLLM or torch, so config code stays light). The pull itself is torchtitan_rl/weight_sync/pull.py."""

from __future__ import annotations

import dataclasses
from typing import Literal

WEIGHT_SYNC_MODES = ("hot_swap", "drain")
WEIGHT_LOADS = ("auto", "reload", "in_place")


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSyncPolicy:
    """What happens to running requests when a weight pull arrives, and how it writes into vLLM.

    ``hot_swap``: the pull is applied between two engine steps; running requests continue and every
    output token records the policy version that sampled it. ``drain``: admission stops, running
    requests finish, then the pull is applied and admission resumes.
    """

    mode: Literal["hot_swap", "drain"] = "hot_swap"
    """'hot_swap' (pull between steps, requests keep running) or 'drain' (finish them first)."""
    reset_prefix_cache: bool = True
    """At each pull no new request reuses KV computed by older weights: the prefix cache is
    dropped, or, under hot swap without ``reset_running_requests`` (vLLM resets its cache only
    when no request holds a block), every request's cache keys carry the policy version it was
    admitted under. Off (with ``reset_running_requests`` off too), the whole cache is kept: a
    block such as a shared system prompt's can outlive any number of pulls, so new requests may
    attend to KV of weights older than ``max_staleness`` (each token's recorded logprob is still
    what was sampled, which the off-policy correction weighs by)."""
    reset_running_requests: bool = True
    """At a hot-swap pull, preempt the running requests so their KV is recomputed with the new
    weights (tokens after the pull are then exactly what the new weights give for prompt + tokens
    so far). Off, running requests keep their KV over the pull, as PipelineRL's in-flight updates
    do (faster async: docs/async.md, ``bench/async_vs_sync.py --kv-at-pull``). Needs
    ``reset_prefix_cache``; no effect under ``drain`` (nothing runs at the pull)."""

    load: Literal["auto", "reload", "in_place"] = "auto"
    """How a pull writes into vLLM. 'reload': vLLM's ``reload_weights`` (any device, any
    tensor_parallel_degree; on CPU it repacks every linear, ~5 memcpys of the weights). 'in_place':
    the CPU linears are unpacked once at engine start and each pull is one ``copy_`` per tensor
    into the live parameters; CPU engines with tensor_parallel_degree 1 and enforce_eager only.
    'auto': in_place where it works, else reload (decided at engine start, logged)."""
    repack_cpu_linears: bool = True
    """With 'in_place': after each pull, rebuild vLLM's packed CPU GEMM kernel of every linear from
    its (just copied) plain weight. Off, the linears run as plain ``F.linear``: the push is one
    copy, but generation is slower (measured 12 % on ``demo``, 30 % on ``small``;
    docs/weight_sync.md)."""

    def __post_init__(self) -> None:
        if self.load not in WEIGHT_LOADS:
            raise ValueError(f"weight_sync.load must be one of {WEIGHT_LOADS}, got {self.load!r}")
        if self.mode not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync.mode must be one of {WEIGHT_SYNC_MODES}, got {self.mode!r}"
            )
        if self.reset_running_requests and not self.reset_prefix_cache:
            raise ValueError(
                "weight_sync.reset_running_requests=True needs weight_sync.reset_prefix_cache=True "
                "(vLLM resets running requests as part of a cache reset), got False"
            )

    @property
    def drain_before_pull(self) -> bool:
        return self.mode == "drain"

    @property
    def salts_prefix_cache_by_version(self) -> bool:
        """Whether requests' prefix-cache keys carry their admission's policy version instead of
        a reset at each pull: vLLM resets its cache only when no request holds a block, and
        running requests keep theirs over a hot-swap pull without ``reset_running_requests``."""
        return self.reset_prefix_cache and not self.reset_running_requests \
            and not self.drain_before_pull
