"""The stand-in engine (generator/stand_in_engine.py) through the real engine loop and weight
puller, no Monarch: seeded replies of ordinary tokens, paced by sleeping, per-token policy
versions across a pull, every pushed byte loaded and read back, aborts, prefix-cache hits; none of
it imports vLLM."""

from __future__ import annotations

import asyncio
import importlib.abc
import sys
import time

import pytest
import torch

from tests.generator.generator_testlib import req, run, tiny_config, tiny_dir
from torchtitan_rl.generator import Generator, start_engine_loop
from torchtitan_rl.generator.stand_in_engine import StandInEngine
from torchtitan_rl.types import Sampling
from torchtitan_rl.weight_sync import weight_mismatches

FAST = 1e6
"""tokens/s: pacing out of the way."""


@pytest.fixture(autouse=True)
def vllm_unimportable(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM cannot be imported while a test here runs (even if this worker imported it before):
    a stand-in generator's process must not pay vLLM's import (seconds of CPU)."""

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name.partition(".")[0] == "vllm":
                raise ImportError(f"the stand-in engine's path imported {name}")

    for name in [n for n in sys.modules if n.partition(".")[0] == "vllm"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])


def _config(**overrides) -> Generator.Config:
    return tiny_config(engine="stand_in", stand_in_tokens_per_s=overrides.pop("rate", FAST),
                       **overrides)


def _hf_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_dir() / "model.safetensors"))


def test_same_seed_same_reply_of_ordinary_tokens_ending_in_the_stop_token() -> None:
    from transformers import AutoTokenizer

    async def main():
        loop = await start_engine_loop(_config())
        sampling = [Sampling(max_tokens=40, seed=s, stop_token_ids=[2]) for s in (7, 7, 8)]
        outs = await asyncio.gather(*(loop.generate(req(f"r{i}", [5, 6, 7], s))
                                      for i, s in enumerate(sampling)))
        await loop.close()
        return outs

    a, b, c = run(main())
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir())
    special = set(tokenizer.all_special_ids)
    for out in (a, c):
        assert 1 <= len(out.token_ids) <= 40
        assert out.finish_reason in ("stop", "length")
        body = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert not special & set(body)
        assert out.finish_reason != "stop" or out.token_ids[-1] == 2
        assert len(out.token_logprobs) == len(out.token_ids)
        assert out.token_policy_versions == [0] * len(out.token_ids)
        assert isinstance(tokenizer.decode(body), str)


def test_a_step_sleeps_tokens_over_rate_and_burns_no_cpu() -> None:
    slept: list[float] = []
    engine = StandInEngine(tiny_dir(), tokens_per_s=1000.0, sleep=slept.append)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5, 6]},
                           Sampling(max_tokens=30, seed=i))
    engine.step()
    assert slept[0] == pytest.approx(4 / 1000.0, abs=1e-3)

    engine = StandInEngine(tiny_dir(), tokens_per_s=2000.0)
    params = Sampling(max_tokens=60, seed=0)
    for i in range(8):  # one seed, one reply (55 tokens: its drawn length), one token a step
        engine.add_request(f"r{i}", {"prompt_token_ids": [5, 6]}, params)
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert (engine.num_steps, engine.num_generated_tokens) == (55, 440)
    # a loaded machine may oversleep, never undersleep
    assert 0.95 * 440 / 2000.0 <= wall <= 3 * 440 / 2000.0
    assert cpu < 0.5 * wall


def test_a_pull_loads_every_byte_and_labels_later_tokens() -> None:
    pushed = {name: t + 1.0 for name, t in _hf_weights().items()}

    async def main():
        loop = await start_engine_loop(_config(rate=40.0))  # 56 tokens: 1.4 s
        long = Sampling(max_tokens=60, seed=2)  # seed 2 draws a reply of 56 tokens
        generating = asyncio.ensure_future(loop.generate(req("long", [5, 6, 7], long)))
        await asyncio.sleep(0.1)
        timings = await loop.pull_model_state_dict(1, pushed)
        out = await generating
        held = loop.engine.read_hf_weights()
        reloaded = loop.engine.num_reloaded_bytes
        await loop.close()
        return out, timings, held, reloaded

    out, timings, held, reloaded = run(main())
    versions = out.token_policy_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert set(timings) == {"convert_s", "load_s"}
    assert weight_mismatches(pushed, held, tied=True) == []
    assert reloaded == sum(t.numel() * t.element_size() for t in pushed.values())


def test_abort_returns_the_tokens_so_far() -> None:
    async def main():
        loop = await start_engine_loop(_config(rate=20.0))  # 56 tokens: 2.8 s
        long = Sampling(max_tokens=60, seed=2)  # 56 tokens
        generating = asyncio.ensure_future(loop.generate(req("a", [5, 6], long)))
        await asyncio.sleep(0.2)
        assert await loop.abort(["a"]) == 1
        out = await generating
        await loop.close()
        return out

    out = run(main())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 60


def test_a_next_turn_reuses_the_cached_blocks_of_its_history() -> None:
    async def main():
        loop = await start_engine_loop(_config(block_size=32))
        first = await loop.generate(req("t1", list(range(5, 45)), Sampling(max_tokens=30, seed=1)))
        history = first.prompt_token_ids + first.token_ids + [7, 8, 9]
        second = await loop.generate(req("t2", history, Sampling(max_tokens=4, seed=2)))
        await loop.close()
        return first, second

    first, second = run(main())
    assert first.metrics.num_cached_prompt_tokens == 0
    assert second.metrics.num_cached_prompt_tokens == \
        (len(first.prompt_token_ids) + len(first.token_ids)) // 32 * 32


def test_config_refuses_what_the_stand_in_cannot_do() -> None:
    for bad in (dict(tensor_parallel_degree=2), dict(stand_in_tokens_per_s=0.0),
                dict(engine="no_such_engine")):
        with pytest.raises(ValueError, match="engine|stand_in_tokens_per_s"):
            Generator.Config(**{"engine": "stand_in", **bad})
