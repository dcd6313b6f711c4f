"""Partial rollouts: a request aborted by a weight pull is resumed, not thrown away.

With ``partial_rollout = "abort"`` the generators abort their running requests when they pull new
weights. This `GenerateFn` wrapper resubmits each aborted request as prompt + the tokens generated so
far, with the remaining token budget, and joins the pieces into one `Completion` that keeps every
token's logprob and policy version (older tokens keep the version that sampled them). The resumed
piece gets a seed derived from the request's seed and the attempt, so runs stay reproducible.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

from torchtitan_rl.types import (
    Completion,
    CompletionMetrics,
    GenerateFn,
    GenerateRequest,
    Sampling,
)

logger = logging.getLogger(__name__)


def resume_seed(seed: int, attempt: int) -> int:
    """The seed of a request's ``attempt``-th resumed piece: 63 bits fixed by (seed, attempt)
    alone (vLLM seeds a torch.Generator, which takes a signed 64-bit int)."""
    key = f"{seed}/resume={attempt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class ResumingGenerateFn:
    def __init__(self, inner: GenerateFn, *, max_resumes: int = 16) -> None:
        self.inner = inner
        self.max_resumes = max_resumes
        self.num_resumed = 0
        """Requests resubmitted after an abort, over the wrapper's lifetime."""

    async def __call__(self, request: GenerateRequest) -> Completion | None:
        prompt_token_ids, request_id = request.prompt_token_ids, request.request_id
        sampling = request.sampling or Sampling()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        metrics = CompletionMetrics()
        for attempt in range(self.max_resumes + 1):
            piece_sampling = sampling
            if attempt:
                piece_sampling = dataclasses.replace(
                    sampling,
                    max_tokens=sampling.max_tokens - len(tokens),
                    seed=None if sampling.seed is None else resume_seed(sampling.seed, attempt),
                )
            piece = await self.inner(dataclasses.replace(
                request, prompt_token_ids=prompt_token_ids + tokens,
                request_id=request_id if attempt == 0 else f"{request_id}/resume={attempt}",
                sampling=piece_sampling,
            ))
            if piece is None:
                return None
            tokens += piece.token_ids
            logprobs += piece.token_logprobs
            versions += piece.token_policy_versions
            if attempt == 0:
                metrics = dataclasses.replace(piece.metrics)
            metrics.generation_time_s += piece.metrics.generation_time_s if attempt else 0.0
            metrics.num_output_tokens = len(tokens)
            metrics.num_inflight_requests = piece.metrics.num_inflight_requests
            finished = piece.finish_reason != "abort" or len(tokens) >= sampling.max_tokens
            if finished:
                reason = piece.finish_reason
                if reason == "abort" and len(tokens) >= sampling.max_tokens:
                    reason = "length"
                return Completion(
                    request_id=request_id, prompt_token_ids=prompt_token_ids, token_ids=tokens,
                    token_logprobs=logprobs, token_policy_versions=versions,
                    finish_reason=reason, metrics=metrics,
                )
            self.num_resumed += 1
            logger.debug("resuming %s after abort with %d tokens", request_id, len(tokens))
        logger.warning("request %s aborted %d times: returning it as aborted", request_id,
                       self.max_resumes + 1)
        return Completion(
            request_id=request_id, prompt_token_ids=prompt_token_ids, token_ids=tokens,
            token_logprobs=logprobs, token_policy_versions=versions, finish_reason="abort",
            metrics=metrics,
        )
