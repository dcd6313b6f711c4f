"""Joining an aborted-and-resumed request: tokens, logprobs and versions line up, budget respected."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.controller.partial_rollout import ResumingGenerateFn, resume_seed
from torchtitan_rl.types import Completion, GenerateRequest, Sampling


class _AbortingGenerator:
    """Emits token ids counting up from the prompt length; aborts after `chunk` tokens the first
    `num_aborts` times (the version bumps at each abort, as a weight pull would)."""

    def __init__(self, chunk: int, num_aborts: int) -> None:
        self.chunk, self.num_aborts = chunk, num_aborts
        self.calls: list[tuple[list[int], int, str]] = []
        self.version = 0

    async def __call__(self, request: GenerateRequest):
        prompt, request_id, sampling = (request.prompt_token_ids, request.request_id,
                                        request.sampling)
        self.calls.append((list(prompt), sampling.max_tokens, request_id))
        aborted = len(self.calls) <= self.num_aborts
        n = min(self.chunk, sampling.max_tokens) if aborted else sampling.max_tokens
        start = len(prompt)
        toks = list(range(start, start + n))
        result = Completion(request_id=request_id, prompt_token_ids=list(prompt), token_ids=toks,
                            token_logprobs=[-0.1 * t for t in toks],
                            token_policy_versions=[self.version] * n,
                            finish_reason="abort" if aborted else "length")
        if aborted:
            self.version += 1
        return result


def test_partial_rollout_join_keeps_tokens_logprobs_versions_and_budget():
    inner = _AbortingGenerator(chunk=3, num_aborts=2)
    gen = ResumingGenerateFn(inner)
    prompt = [100, 101]
    out = asyncio.run(asyncio.wait_for(
        gen(GenerateRequest(prompt_token_ids=prompt, request_id="group=0/rollout=0/turn=0",
                            session_id="s", sampling=Sampling(max_tokens=10, seed=7))), 10))
    assert out.prompt_token_ids == prompt
    assert out.token_ids == list(range(2, 12))  # one contiguous continuation, 10 tokens
    assert out.token_logprobs == [-0.1 * t for t in range(2, 12)]
    assert out.token_policy_versions == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert out.finish_reason == "length"
    # each resume sends prompt + partial tokens with the remaining budget
    assert [(len(p), m) for p, m, _ in inner.calls] == [(2, 10), (5, 7), (8, 4)]
    assert inner.calls[1][0] == prompt + [2, 3, 4]
    assert inner.calls[2][2] == "group=0/rollout=0/turn=0/resume=2"
    assert gen.num_resumed == 2


def test_resumed_pieces_get_distinct_seeds_that_vllm_accepts():
    largest = 2**63 - 1  # request seeds are 63-bit hashes: resuming must not overflow them
    seeds = [resume_seed(largest, attempt) for attempt in range(1, 17)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert resume_seed(7, 1) == resume_seed(7, 1) != resume_seed(8, 1)
    for attempt in range(1, 3):
        Sampling(seed=resume_seed(largest, attempt))  # passes Sampling's own range check
    with pytest.raises(ValueError, match="seed must be in"):
        Sampling(seed=2**63)
