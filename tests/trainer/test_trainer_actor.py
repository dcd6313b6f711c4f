"""The PolicyTrainer Monarch actor on two gloo ranks (FSDP): train steps, verified weight pushes
(Monarch message, then shared memory) into a vLLM generator actor, whose greedy output then equals
a fresh engine's on the trainer's HF export."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import pytest
import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint, this_host

from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.generator.launch import spawn_generator
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import PolicyTrainer, rank0_value, spawn_policy_trainer
from torchtitan_rl.types import GenerateRequest, Sampling, TrainingSample
from torchtitan_rl.weight_sync.shared_memory import StagedWeights, StagingProgress

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


class EngineActor(Actor):
    """A minimal generator for this test: a float32 vLLM engine that pulls weight pushes through
    weight_sync's WeightPuller and reads its weights back for verification."""

    def __init__(self, model_dir: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.set_num_threads(1)
        from torchtitan_rl.weight_sync import WeightPuller

        self.engine = _engine(model_dir)
        self.puller = WeightPuller(model_dir)
        self.version = 0
        self.staging: dict[int, StagingProgress] = {}

    @concurrent_endpoint
    async def pull_model_state_dict(self, version: int, state_dict: dict[str, torch.Tensor],
                                    streamed: bool = False) -> None:
        weights = self.puller.prepare(state_dict)
        if streamed:  # shared memory: copy each tensor once weights_staged covers it
            weights = StagedWeights(weights, self.staging.setdefault(version, StagingProgress()))
        await asyncio.to_thread(self.puller.apply, self.engine, weights)
        self.engine.reset_prefix_cache()
        self.version = version

    @concurrent_endpoint
    async def weights_staged(self, version: int, num_bytes: int) -> None:
        self.staging.setdefault(version, StagingProgress()).advance(num_bytes)

    @endpoint
    async def read_hf_weights(self) -> dict[str, torch.Tensor]:
        from torchtitan_rl.weight_sync import read_hf_weights

        return read_hf_weights(self.engine)

    @endpoint
    async def greedy(self, model_dir: str | None = None) -> list[list[int]]:
        return _greedy(self.engine if model_dir is None else _engine(model_dir))


def _engine(model_dir: str):
    from vllm import EngineArgs, LLMEngine

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


async def _scenario(model_dir: pathlib.Path, export_dir: pathlib.Path) -> dict:
    config = PolicyTrainer.Config(data_parallel_shard_degree=2, num_threads=1)
    config.optimizer.lr = 0.05
    trainer_procs = this_host().spawn_procs(per_host={"procs": 2})
    generator_procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        trainer = await spawn_policy_trainer(trainer_procs, config, model_dir=model_dir)
        generators = generator_procs.spawn("engine", EngineActor, str(model_dir))
        dp_size = rank0_value(await trainer.get_dp_size.call())
        batcher, samples = Batcher.Config(seq_len=32), _samples()
        before = rank0_value(await generators.greedy.call())
        step = await train_step(trainer, samples, batcher)
        sync = await push_weights(trainer, generators, version=1, verify=True)
        await train_step(trainer, samples, batcher)
        sync_shm = await push_weights(
            trainer, generators, version=2, verify=True, transport="shared_memory"
        )
        after = rank0_value(await generators.greedy.call())
        # the project's own Generator actor takes the same push (shared-memory references)
        real = await spawn_generator(Generator.Config(
            model_dir=str(model_dir), max_model_len=64, kv_cache_bytes=32 << 20,
            torch_num_threads=1, initial_policy_version=0,
        ))
        try:
            await push_weights(trainer, real.actors, version=2, transport="shared_memory")
            greedy = Sampling(max_tokens=10, temperature=0.0)
            real_after = [
                (await real.generate(GenerateRequest(
                    prompt_token_ids=p, request_id=f"r{i}", sampling=greedy))).token_ids
                for i, p in enumerate(PROMPTS)
            ]
        finally:
            await real.close()
        await trainer.export_hf.call(str(export_dir))
        fresh = rank0_value(await generators.greedy.call(str(export_dir)))
        return {"dp_size": dp_size, "step": step, "sync": sync, "sync_shm": sync_shm,
                "real_after": real_after, "before": before,
                "after": after, "fresh": fresh}
    finally:
        await trainer_procs.stop()
        await generator_procs.stop()


def test_trainer_actor_trains_and_pushes_verified_weights(tmp_path, monkeypatch):
    from torchtitan_rl.assets.make_model import ensure_model

    # The engine actor's class lives in this test module: its procs must be able to import it.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), *sys.path]))
    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()
    result = asyncio.run(asyncio.wait_for(_scenario(model_dir, tmp_path / "export"), 240))
    assert result["dp_size"] == 2
    assert result["step"]["trainer/policy_version"] == 1
    assert result["step"]["loss/num_valid_tokens"] == 4 * 6
    assert result["sync"]["weight_sync/num_mismatched_tensors"] == 0
    assert result["sync_shm"]["weight_sync/num_mismatched_tensors"] == 0
    assert "weight_sync/stage_s" in result["sync_shm"]
    assert result["after"] == result["fresh"]
    # the Generator stops at eos (id 2); the test engine ignores it
    assert result["real_after"] == [_until_eos(tokens) for tokens in result["fresh"]]
    assert result["after"] != result["before"]
