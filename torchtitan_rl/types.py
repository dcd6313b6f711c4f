"""The messages that cross layers: generator -> rollout -> trainer.

    Rollout code  --GenerateRequest-->  GenerateFn (generator, router, ...)  --Completion-->  rollout code
    rollout code  --TrainingSample (one per packed multi-turn rollout)-->  batcher -> trainer

Everything here is plain data (lists, not tensors) so it pickles cheaply across Monarch actors.
Token lists of one object always have the same length.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(kw_only=True, slots=True)
class Sampling:
    """Per-request sampling settings (a subset of vLLM's SamplingParams the RL loop needs)."""

    max_tokens: int = 64
    """Most tokens to generate for this request."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities add up to
    top_p, in (0, 1]; 1 disables it."""
    top_k: int = -1
    """-1 disables top-k."""
    seed: int | None = None
    """Per-request seed: sampling is reproducible whatever else runs in the batch. None: in a
    job, the job's `seed` (each request's seed is derived from it and the request's group,
    rollout and turn); a request sent with None draws from the engine's seed."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Extra stop tokens beside the model's end-of-turn token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63) (vLLM seeds a torch.Generator with "
                             f"it), got {self.seed}")


@dataclasses.dataclass(kw_only=True, slots=True)
class GenerateRequest:
    """One generate call: a prompt in token ids and how to sample its completion."""

    prompt_token_ids: list[int]
    request_id: str
    """``group=G/rollout=R/turn=T``: unique per call (a resumed piece adds ``/resume=N``)."""
    session_id: str | None = None
    """``group=G/rollout=R``: the same for every turn of a rollout, so a router may pin a session
    to one generator and reuse its prefix cache. None: no session."""
    sampling: Sampling | None = None
    """None: the generator's default sampling."""


class GenerateFn(Protocol):
    """Generate one completion; the rollout code never knows what stands behind it (a generator
    actor, a router over several, a wrapper that times or resumes requests, a test function).
    ``torchtitan_rl.rollout.HttpGenerateFn`` is one over an OpenAI-compatible server (vLLM's).

    Returns None when the request was dropped or cancelled (the rollout then ends ERROR_ABORT).
    An exception is an infrastructure failure: it propagates and fails the whole group.
    Wrappers hold an ``inner: GenerateFn`` and implement this one method.
    """

    async def __call__(self, request: GenerateRequest) -> Completion | None: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class CompletionMetrics:
    queue_time_s: float = 0.0
    """From generate() being called to the request entering the engine."""
    time_to_first_token_s: float = 0.0
    """From entering the engine to the first output token."""
    generation_time_s: float = 0.0
    """From entering the engine to the final output."""
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose KV the engine took from its prefix cache (a multi-turn rollout's
    earlier turns), not computed again."""
    num_inflight_requests: int = 0
    """Requests in the engine (added, not yet finished or aborted) when this one finished,
    this one included."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Completion:
    """One generated turn. ``token_logprobs[i]`` is the logprob of ``token_ids[i]`` under the policy
    version ``token_policy_versions[i]`` that sampled it (versions differ inside one completion when
    weights were hot-swapped mid-request)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    token_logprobs: list[float]
    token_policy_versions: list[int]
    finish_reason: FinishReason
    metrics: CompletionMetrics = dataclasses.field(default_factory=CompletionMetrics)


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainingSample:
    """One training sequence: a rollout's turns merged while each prompt extends the previous
    prompt + completion. Loss applies where ``loss_mask`` is 1 (sampled completion tokens); prompt and
    environment tokens have mask 0, logprob 0.0, advantage 0.0 and policy version -1."""

    sample_id: str
    """``group=G/rollout=R/branch=B``: unique across a run, used to prove nothing is lost."""
    group_id: int
    token_ids: list[int]
    loss_mask: list[int]
    generator_logprobs: list[float]
    advantages: list[float]
    policy_versions: list[int]
    rewards: list[float] = dataclasses.field(default_factory=list)
    """The reward credited to each token (a turn's or the episode's, on its last generated
    token; 0 elsewhere): what a critic's GAE reads (trainer/critic.py). Empty: all 0."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "generator_logprobs", "advantages", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"TrainingSample {self.sample_id}: {name} has {len(getattr(self, name))} "
                    f"entries, token_ids has {n}"
                )
        if self.rewards and len(self.rewards) != n:
            raise ValueError(f"TrainingSample {self.sample_id}: rewards has {len(self.rewards)} "
                             f"entries, token_ids has {n}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def oldest_policy_version(self) -> int | None:
        versions = [v for v, m in zip(self.policy_versions, self.loss_mask) if m]
        return min(versions) if versions else None
