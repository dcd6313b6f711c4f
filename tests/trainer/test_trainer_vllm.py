"""Trainer -> vLLM: a push makes the engine generate like a fresh engine loaded from the same
weights, the read-back is bitwise, and float32 logprobs agree with the trainer's."""

from __future__ import annotations

import os
import pathlib

import pytest

from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.types import TrainingSample
from torchtitan_rl.weight_sync.pull import (
    WeightPuller,
    load_hf_weights_in_place,
    read_vllm_hf_weights,
    unpack_cpu_linears,
    vllm_model,
    weight_mismatches,
)

pytestmark = pytest.mark.slow  # vLLM engines

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 250, 31], [400, 12, 7], [3, 3, 600, 701, 702, 9, 44]]


def _engine(model_dir: pathlib.Path, **lora):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True,
            seed=0, kv_cache_memory_bytes=64 * 2**20, enable_chunked_prefill=False, **lora,
        )
    )


def _generate(engine, *, temperature: float, max_tokens: int = 12, lora_request=None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=1, ignore_eos=True
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params,
                           lora_request=lora_request)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0]
    return [done[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A trainer moved off the initial weights, an engine of the initial weights after a push of
    the trainer's weights, and a fresh engine loaded from the trainer's HF export."""
    from torchtitan_rl.assets.make_model import ensure_model

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()
    core = _trained(PolicyTrainerCore.Config(num_threads=1), model_dir, lr=0.05, steps=2)
    hf_sd = core.hf_state_dict()
    export_dir = tmp_path_factory.mktemp("export")
    core.export_hf(export_dir)
    engine = _engine(model_dir)
    before = [o.token_ids for o in _generate(engine, temperature=0.0)]
    puller = WeightPuller(model_dir)
    puller.apply(engine, puller.prepare(hf_sd))
    engine.reset_prefix_cache()
    return {"core": core, "hf_sd": hf_sd, "engine": engine, "fresh": _engine(export_dir),
            "before": before, "model_dir": model_dir}


def _trained(config: PolicyTrainerCore.Config, model_dir: pathlib.Path, *, lr: float,
             steps: int) -> PolicyTrainerCore:
    """A trainer moved off its initial weights: ``steps`` updates on the prompts continued."""
    config.optimizer.lr = lr
    core = config.build(model_dir=model_dir)
    batch = Batcher.Config(seq_len=32).build().pack(
        [_sample(p + [11, 12, 13, 14], 1.0) for p in PROMPTS])
    for _ in range(steps):
        core.forward_backward(batch)
        core.optim_step()
    return core


def _sample(tokens: list[int], advantage: float, prompt_len: int | None = None,
            logprobs: list[float] | None = None) -> TrainingSample:
    n = len(tokens)
    p = prompt_len if prompt_len is not None else n // 2
    return TrainingSample(
        sample_id=f"s{tokens[0]}-{n}", group_id=0, token_ids=tokens,
        loss_mask=[0] * p + [1] * (n - p),
        generator_logprobs=[0.0] * p + (logprobs if logprobs is not None else [-1.0] * (n - p)),
        advantages=[0.0] * p + [advantage] * (n - p), policy_versions=[-1] * p + [0] * (n - p),
    )


def test_trainer_push_then_greedy_generation_equals_a_fresh_engine(pushed):
    after = [o.token_ids for o in _generate(pushed["engine"], temperature=0.0)]
    fresh = [o.token_ids for o in _generate(pushed["fresh"], temperature=0.0)]
    assert after == fresh
    assert after != pushed["before"], "the push did not change generation (weights not loaded?)"


def test_trainer_push_read_back_is_bitwise_including_the_tied_head(pushed):
    actual = read_vllm_hf_weights(vllm_model(pushed["engine"]))
    assert weight_mismatches(pushed["hf_sd"], actual, tied=True) == []
    # the check can fail: the fresh engine's head against a perturbed expectation
    perturbed = dict(pushed["hf_sd"])
    perturbed["model.embed_tokens.weight"] = perturbed["model.embed_tokens.weight"] + 1e-6
    assert "lm_head.weight" in weight_mismatches(perturbed, actual, tied=True)


def test_trainer_inplace_load_into_unpacked_engine_is_bitwise_and_generates_like_fresh(pushed):
    # Reuses the pushed engine and leaves it holding the trainer's weights again, so the other
    # tests see the same engine state whatever the order (a third engine in one process breaks
    # vLLM's process-wide parallel state for the others).
    from torchtitan_rl.models.qwen3 import load_hf_state_dict

    engine = pushed["engine"]
    model = vllm_model(engine)
    unpack_cpu_linears(model)
    assert model.model.layers[0].self_attn.qkv_proj.weight.numel() > 0
    load_hf_weights_in_place(model, load_hf_state_dict(pushed["model_dir"]))
    engine.reset_prefix_cache()
    assert [o.token_ids for o in _generate(engine, temperature=0.0)] == pushed["before"]
    load_hf_weights_in_place(model, pushed["hf_sd"])
    engine.reset_prefix_cache()
    assert weight_mismatches(pushed["hf_sd"], read_vllm_hf_weights(model), tied=True) == []
    after = [o.token_ids for o in _generate(engine, temperature=0.0)]
    assert after == [o.token_ids for o in _generate(pushed["fresh"], temperature=0.0)]
    with pytest.raises(ValueError, match="state dict has no"):
        load_hf_weights_in_place(model, {"model.norm.weight": pushed["hf_sd"]["model.norm.weight"]})


def test_trainer_logprobs_match_vllm_float32(pushed):
    outputs = _generate(pushed["engine"], temperature=1.0, max_tokens=16)
    samples = []
    for prompt, out in zip(PROMPTS, outputs):
        gen_lp = [lp[tok].logprob for tok, lp in zip(out.token_ids, out.logprobs)]
        samples.append(_sample(prompt + list(out.token_ids), 0.0, len(prompt), gen_lp))
    batch = Batcher.Config(seq_len=64).build().pack(samples)
    trainer_lp = pushed["core"].compute_logprobs(batch)
    mask = batch.loss_mask
    diff = (trainer_lp[mask] - batch.generator_logprobs[mask]).abs()
    print(f"trainer vs vLLM float32 logprobs over {int(mask.sum())} tokens: "
          f"mean|diff|={diff.mean():.3g} max|diff|={diff.max():.3g}")
    assert int(mask.sum()) == 3 * 16
    assert diff.mean().item() <= 1e-5
    assert diff.max().item() <= 1e-4


def test_an_adapter_push_generates_like_a_fresh_engine_of_the_merged_weights(tmp_path):
    """trainer.lora.push = "adapter": the engine serves the pushed adapters over its base model
    (weight_sync/lora_pull.py) and generates, greedy, as an engine loaded with the merged export
    does; what it holds reads back bit for bit (B times alpha / rank, as vLLM scales it)."""
    from torchtitan_rl.assets.make_model import ensure_model
    from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan
    from torchtitan_rl.trainer.lora import LoRA
    from torchtitan_rl.weight_sync.lora_pull import AdapterPuller

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()
    core = _trained(PolicyTrainerCore.Config(
        num_threads=1, lora=LoRA.Config(enabled=True, rank=8, alpha=16.0)), model_dir,
        lr=0.01, steps=3)
    core.export_hf(tmp_path / "merged")
    adapters = core.pushed_state_dict()
    assert adapters and all(".lora_" in name for name in adapters)

    engine = _engine(model_dir, enable_lora=True, max_lora_rank=8, max_loras=1)
    base = [o.token_ids for o in _generate(engine, temperature=0.0)]
    puller = AdapterPuller(str(model_dir), rank=8, alpha=16.0)
    assert puller.lora_request is None
    puller.apply(engine, puller.prepare(hf_state_dict_from_torchtitan(adapters, core.model_config)))
    engine.reset_prefix_cache()
    served = _generate(engine, temperature=0.0, lora_request=puller.lora_request)
    fresh = _generate(_engine(tmp_path / "merged"), temperature=0.0)
    assert [o.token_ids for o in served] == [o.token_ids for o in fresh]
    assert [o.token_ids for o in served] != base, "the adapter did not change generation"
    for mine, theirs in zip(served, fresh):
        for step, token in enumerate(mine.token_ids):
            assert abs(mine.logprobs[step][token].logprob
                       - theirs.logprobs[step][token].logprob) < 1e-4

    expected = hf_state_dict_from_torchtitan(adapters, core.model_config)
    expected = {n: t * core.pushed_lora_scaling if n.endswith(".lora_B.weight") else t
                for n, t in expected.items()}
    assert weight_mismatches(expected, puller.read_weights(engine), tied=False) == []
    wrong = {n: t + 1e-6 if n.endswith(".lora_A.weight") else t for n, t in expected.items()}
    assert weight_mismatches(wrong, puller.read_weights(engine), tied=False)
