"""The PolicyTrainer Monarch actor on two gloo ranks (FSDP): train steps, verified weight pushes
(Monarch message, then shared memory) into the project's vLLM Generator actor, whose greedy output
then equals a fresh engine's on the trainer's HF export."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from monarch.actor import this_host

from torchtitan_rl.generator.client import spawn_generator
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import PolicyTrainer, rank0_value, spawn_policy_trainer
from torchtitan_rl.types import GenerateRequest, Sampling, TrainingSample

pytestmark = pytest.mark.slow  # Monarch procs, trainer ranks and vLLM engines

HERE = pathlib.Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PROMPTS = [[5, 17, 99, 250, 31], [400, 12, 7]]


async def train_step(trainer, samples, batcher) -> dict[str, float]:
    """One optimizer step on the whole trainer mesh: forward_backward (every rank packs the
    samples), then optim_step."""
    metrics = dict(rank0_value(await trainer.forward_backward.call(samples, batcher)))
    metrics.update(rank0_value(await trainer.optim_step.call()))
    return metrics


async def push_weights(trainer, generators, version: int, *, verify: bool = False,
                       transport: str | None = None) -> dict[str, float]:
    return rank0_value(await trainer.push_weights.call(generators, version, verify, transport))


def _engine(model_dir: str):
    import gc

    from vllm import EngineArgs, LLMEngine

    # An engine dropped earlier in this process, collected later, would tear down vLLM's
    # process-wide distributed state under this one (tests/generator/generator_testlib.py).
    gc.collect()
    return LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, dtype="float32", max_model_len=64, enforce_eager=True, seed=0,
        kv_cache_memory_bytes=32 * 2**20,
    ))


def _greedy(engine) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
    return [done[i] for i in range(len(PROMPTS))]


def _until_eos(tokens: list[int], eos: int = 2) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _samples() -> list[TrainingSample]:
    samples = []
    for i, prompt in enumerate(PROMPTS * 2):
        n = len(prompt) + 6
        samples.append(TrainingSample(
            sample_id=f"group=0/rollout={i}/branch=0", group_id=0,
            token_ids=prompt + [20 + i] * 6, loss_mask=[0] * len(prompt) + [1] * 6,
            generator_logprobs=[0.0] * len(prompt) + [-2.0] * 6,
            advantages=[0.0] * len(prompt) + [1.0 - i % 2 * 2] * 6,
            policy_versions=[-1] * len(prompt) + [0] * 6,
        ))
        assert len(samples[-1].token_ids) == n
    return samples


async def _generate_greedy(generator, tag: str) -> list[list[int]]:
    greedy = Sampling(max_tokens=10, temperature=0.0)
    return [(await generator.generate(GenerateRequest(
        prompt_token_ids=p, request_id=f"{tag}-{i}", sampling=greedy))).token_ids
        for i, p in enumerate(PROMPTS)]


async def _scenario(model_dir: pathlib.Path, export_dir: pathlib.Path) -> dict:
    config = PolicyTrainer.Config(data_parallel_shard_degree=2, num_threads=1)
    config.optimizer.lr = 0.05
    trainer_procs = this_host().spawn_procs(per_host={"procs": 2})
    generator = None
    try:
        trainer = await spawn_policy_trainer(trainer_procs, config, model_dir=model_dir)
        generator = await spawn_generator(Generator.Config(
            model_dir=str(model_dir), dtype="float32", max_model_len=64,
            kv_cache_bytes=32 << 20, torch_num_threads=1, initial_policy_version=0,
        ))
        dp_size = rank0_value(await trainer.get_dp_size.call())
        batcher, samples = Batcher.Config(seq_len=32), _samples()
        before = await _generate_greedy(generator, "before")
        step = await train_step(trainer, samples, batcher)
        sync = await push_weights(trainer, generator.actors, version=1, verify=True)
        await train_step(trainer, samples, batcher)
        sync_shm = await push_weights(  # shared-memory references, read back bit for bit
            trainer, generator.actors, version=2, verify=True, transport="shared_memory")
        after = await _generate_greedy(generator, "after")
        await trainer.export_hf.call(str(export_dir))
        return {"dp_size": dp_size, "step": step, "sync": sync, "sync_shm": sync_shm,
                "before": before, "after": after}
    finally:
        if generator is not None:
            await generator.close()
        await trainer_procs.stop()


def test_trainer_actor_trains_and_pushes_verified_weights(tmp_path):
    from torchtitan_rl.assets.make_model import ensure_model

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()
    result = asyncio.run(asyncio.wait_for(_scenario(model_dir, tmp_path / "export"), 240))
    assert result["dp_size"] == 2
    assert result["step"]["trainer/policy_version"] == 1
    assert result["step"]["loss/num_valid_tokens"] == 4 * 6
    assert result["sync"]["weight_sync/num_mismatched_tensors"] == 0
    assert result["sync_shm"]["weight_sync/num_mismatched_tensors"] == 0
    assert "weight_sync/stage_s" in result["sync_shm"]
    # A fresh engine (in this process) on the trainer's HF export: the same greedy tokens. The
    # Generator stops at eos (id 2); the bare engine ignores it.
    fresh = _greedy(_engine(str(tmp_path / "export")))
    assert result["after"] == [_until_eos(tokens) for tokens in fresh]
    assert result["after"] != result["before"]
