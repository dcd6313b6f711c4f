"""Joining an aborted-and-resumed request: tokens, logprobs and versions line up, budget respected."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.generator.partial_rollout import ResumingGenerateFn, resume_seed
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


@pytest.mark.slow
def test_a_pull_mid_request_with_abort_resumes_on_the_new_weights_on_real_vllm(tmp_path):
    """The real path of partial rollouts: a pull at a chosen engine step, then abort (what
    GeneratorPool.push_weights does with partial_rollout = "abort"). The joined completion is the
    aborted piece followed by exactly what a fresh engine on the new weights generates from
    prompt + that piece, each token with the version and logprob of the weights that made it."""
    from tests.generator.generator_testlib import (
        build_engine,
        greedy,
        new_loop,
        perturbed_model_dir,
        raw_generate,
        tiny_config,
        tiny_dir,
    )

    new_weights = perturbed_model_dir(tiny_dir(), tmp_path / "new")
    config = tiny_config()
    engine = build_engine(config)
    prompt, max_tokens, pull_at_step = [5, 17, 99, 250, 31], 48, 6
    old_only = raw_generate(engine, [("old", prompt, greedy(max_tokens))])["old"]
    pieces: list[Completion] = []

    async def scenario() -> Completion:
        reached = asyncio.Event()
        loop = new_loop(engine, config,
                        on_step=lambda stats: stats.step_index >= pull_at_step and reached.set())

        async def recording(request: GenerateRequest) -> Completion | None:
            piece = await loop.generate(request)
            pieces.append(piece)
            return piece

        resuming = ResumingGenerateFn(recording)
        joined = asyncio.create_task(resuming(GenerateRequest(
            prompt_token_ids=prompt, request_id="r", sampling=greedy(max_tokens))))
        await reached.wait()
        await loop.pull_model_state_dict(1, new_weights)
        assert await loop.abort(None) == 1  # certain: the request was still running
        completion = await joined
        await loop.close()
        assert resuming.num_resumed == 1
        return completion

    completion = asyncio.run(asyncio.wait_for(scenario(), 120))
    aborted, resumed = pieces
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < max_tokens
    assert resumed.prompt_token_ids == prompt + aborted.token_ids
    assert completion.token_ids == aborted.token_ids + resumed.token_ids
    assert len(completion.token_ids) == max_tokens  # the budget spans both pieces
    assert completion.token_policy_versions == (aborted.token_policy_versions
                                                + [1] * len(resumed.token_ids))
    assert completion.token_logprobs == aborted.token_logprobs + resumed.token_logprobs
    # the tokens sampled before the pull are the old weights' own greedy tokens
    first_new = aborted.token_policy_versions.index(1) if 1 in aborted.token_policy_versions \
        else len(aborted.token_ids)
    assert first_new >= 1 and aborted.token_policy_versions[:first_new] == [0] * first_new
    assert aborted.token_ids[:first_new] == list(old_only.token_ids[:first_new])
    # after the pull: exactly what a fresh engine on the new weights generates
    fresh = build_engine(tiny_config(model_dir=str(tmp_path / "new")))
    expect = raw_generate(fresh, [
        ("new", prompt + aborted.token_ids[:first_new], greedy(max_tokens - first_new))])["new"]
    assert completion.token_ids[first_new:] == list(expect.token_ids)
    expected_logprobs = [pos[t].logprob for t, pos in zip(expect.token_ids, expect.logprobs)]
    assert completion.token_logprobs[first_new:] == pytest.approx(expected_logprobs, abs=1e-4)
