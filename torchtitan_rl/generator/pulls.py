"""A weight pull on one generator rank: the pulls pending (with the one pull-version rule), which
puller loads them (``weight_sync.load``), and the load between two engine steps.

    EngineLoop.pull_model_state_dict() -> check_new(), deliver(prepared weights) -> await done
    EngineLoop.weights_staged()        -> entry().staging.advance()   (a streamed push)
    rank 0's PULL decision             -> entry() -> await its weights -> load_weights -> finish()
    loop failed or closed              -> fail_all()

The pull call and rank 0's PULL decision reach a peer rank in either order, so either creates the
entry. How a state dict becomes the engine's weights: weight_sync/pull.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from torchtitan_rl.generator.config import GeneratorConfig, WeightSyncPolicy
from torchtitan_rl.generator.request_ledger import fail_future, resolve_future
from torchtitan_rl.weight_sync.lora_pull import AdapterPuller
from torchtitan_rl.weight_sync.pull import WeightPuller
from torchtitan_rl.weight_sync.shared_memory import StagingProgress

logger = logging.getLogger(__name__)


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
    """One rank's pulls received or announced and not yet applied, by policy version."""

    def __init__(self) -> None:
        self._pulls: dict[int, _Pull] = {}

    def check_new(self, policy_version: int, current_version: int) -> None:
        """The pull-version rule: refuse a second call for one version, and versions not above
        the newest loaded or received (a PULL decision seen first on a peer rank is not a
        received pull)."""
        pull = self._pulls.get(policy_version)
        if pull is not None and pull.weights.done():
            raise ValueError(f"a pull of version {policy_version} is already pending")
        received = [v for v, p in self._pulls.items() if p.weights.done()]
        latest = max([current_version, *received])
        if pull is None and policy_version <= latest:
            raise ValueError(
                f"pull version must be > {latest} (the newest version loaded or pending), "
                f"got {policy_version}"
            )

    def entry(self, policy_version: int) -> _Pull:
        if (pull := self._pulls.get(policy_version)) is None:
            loop = asyncio.get_running_loop()
            pull = self._pulls[policy_version] = _Pull(loop.create_future(), loop.create_future())
        return pull

    def deliver(self, policy_version: int, weights: Any) -> asyncio.Future[float]:
        pull = self.entry(policy_version)
        pull.weights.set_result(weights)
        return pull.done

    def finish(self, policy_version: int, apply_s: float) -> None:
        resolve_future(self._pulls.pop(policy_version).done, apply_s)

    def __len__(self) -> int:
        """Pulls received or announced and not applied yet."""
        return len(self._pulls)

    def fail_all(self, error: BaseException) -> None:
        pulls, self._pulls = self._pulls, {}
        for pull in pulls.values():
            pull.staging.fail(error)
            fail_future(pull.done, error)


def choose_puller(config: GeneratorConfig, *, vllm_cpu_kernels: bool
                  ) -> WeightPuller | AdapterPuller:
    """The puller of this generator: LoRA adapters, or full weights loaded as ``weight_sync.load``
    says ('auto': in place where vLLM's CPU layout allows it, else vLLM's reload)."""
    if config.lora_rank:
        return AdapterPuller(config.model_dir, rank=config.lora_rank, alpha=config.lora_alpha)
    load = config.weight_sync.load
    if load == "auto":
        load = "in_place" if (config.engine == "vllm" and config.tensor_parallel_degree == 1
                              and config.enforce_eager and vllm_cpu_kernels) else "reload"
        logger.info("weight_sync.load='auto': %s", load)
    return WeightPuller(config.model_dir, load=load,  # type: ignore[arg-type]
                        repack_cpu_linears=config.weight_sync.repack_cpu_linears,
                        vllm_cpu_kernels=vllm_cpu_kernels)


def load_weights(engine: Any, puller: WeightPuller | AdapterPuller, weights: Any,
                 policy_version: int, policy: WeightSyncPolicy, rank: int) -> None:
    """Engine thread, between two engine steps: load prepared ``weights``, label later tokens
    with ``policy_version``, and reset the prefix cache where the policy says so."""
    puller.apply(engine, weights)
    engine.set_weight_version(str(policy_version))
    if policy.reset_prefix_cache and not policy.salts_prefix_cache_by_version:
        # Under hot swap this preempts the running requests; under drain none is running.
        if not engine.reset_prefix_cache(reset_running_requests=not policy.drain_before_pull):
            logger.warning("rank %d: vLLM kept its prefix cache at the pull of version %d "
                           "(a request held blocks)", rank, policy_version)
