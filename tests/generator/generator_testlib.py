"""Shared set-up for the generator tests: the tiny model's config, engines, loops, raw-engine runs."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import torch

from torchtitan_rl.generator import EngineLoop, Generator
from torchtitan_rl.types import GenerateRequest, Sampling
from torchtitan_rl.weight_sync import WeightPuller

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_dir() -> pathlib.Path:
    from torchtitan_rl.assets.make_model import ensure_model

    return ensure_model("tiny", REPO_ROOT / "assets" / "models")


def tiny_config(**overrides: Any) -> Generator.Config:
    fields: dict[str, Any] = dict(
        model_dir=str(tiny_dir()), max_model_len=512, kv_cache_bytes=64 << 20,
        max_engine_steps_between_decisions=4,
    )
    fields.update(overrides)
    return Generator.Config(**fields)


def build_engine(config: Generator.Config) -> Any:
    """An engine in this process. Engines dropped earlier are collected first: an in-process
    engine's shutdown tears down vLLM's process-wide distributed state (EngineCore.shutdown), so
    one collected later would break the engine built here."""
    import gc

    from torchtitan_rl.generator.vllm_engine import build_engine as build

    gc.collect()
    return build(config)


@dataclasses.dataclass(kw_only=True, slots=True)
class StepStats:
    """One engine step as rank 0 saw it (passed to ``on_step``)."""

    step_index: int
    num_requests_in_engine: int
    """Requests in the engine during this step (added, not finished or aborted before it)."""
    num_finished: int
    policy_version: int


class ObservedEngineLoop(EngineLoop):
    """An EngineLoop that calls ``on_step`` on the event loop after each engine step's finished
    outputs are resolved: the tests' hook to act at a chosen step."""

    def __init__(self, engine: Any, *, on_step: Callable[[StepStats], None], **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.on_step = on_step

    def _on_step(self, finished: list[Any]) -> None:
        num_in_engine = self._ledger.num_in_engine
        super()._on_step(finished)
        if self.rank == 0:
            self.on_step(StepStats(
                step_index=self.num_steps, num_requests_in_engine=num_in_engine,
                num_finished=len(finished), policy_version=self.policy_version,
            ))


def new_loop(engine: Any, config: Generator.Config, *, steps: list[StepStats] | None = None,
             on_step: Callable[[StepStats], None] | None = None, **overrides: Any) -> EngineLoop:
    """An EngineLoop over an existing engine, started on the running event loop ('reload' pulls:
    an in_place engine is set up by start_engine_loop, see tests/weight_sync/test_weight_sync_in_place_pull.py).
    ``steps`` collects each step's StepStats; ``on_step`` is called with them."""
    puller = WeightPuller(config.model_dir)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(
        puller=puller,
        weight_sync=config.weight_sync,
        max_engine_steps_between_decisions=config.max_engine_steps_between_decisions,
        default_sampling=config.sampling,
    )
    kwargs.update(overrides)
    if steps is not None:
        on_step = steps.append
    loop = (EngineLoop(engine, **kwargs) if on_step is None
            else ObservedEngineLoop(engine, on_step=on_step, **kwargs))
    loop.start()
    return loop


async def finished_digests(handle: Any) -> list[tuple[int, int, str]]:
    """(rank, finished outputs, token digest) per rank of a generator, by rank (the digest once
    its ``record_finished_digest`` endpoint was called on every rank)."""
    values = await handle.actors.get_finished_digest.call()
    return sorted(value for _, value in values.items())


def req(request_id: str, prompt: list[int], sampling: Sampling | None = None) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, request_id=request_id, sampling=sampling)


def run(coro: Any, timeout_s: float = 120.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def raw_generate(engine: Any, requests: list[tuple[str, list[int], Sampling]]) -> dict[str, Any]:
    """All requests added up front to the bare engine, stepped to the end: request id -> output."""
    from torchtitan_rl.generator.loop_decision import EngineRequest
    from torchtitan_rl.generator.vllm_engine import add_request

    for rid, prompt, sampling in requests:
        add_request(engine, EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0]
    return outputs


def greedy(max_tokens: int) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0.0)


def perturbed_model_dir(source: pathlib.Path, out: pathlib.Path, *, seed: int = 1,
                        scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Copy ``source`` to ``out`` with every weight perturbed; returns the new HF state dict."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(str(source / "model.safetensors"))
    new = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    save_file(new, str(out / "model.safetensors"))
    return new


def replace(config: Generator.Config, **changes: Any) -> Generator.Config:
    return dataclasses.replace(config, **changes)
