"""Building one rank's engine loop: the engine (vLLM, the stand-in, or an import path's builder)
in a fresh engine thread, its puller (generator/pulls.py ``choose_puller``), the gloo decision
group (TP > 1), then ``EngineLoop(...).start()`` on the running event loop.

``start_engine_loop`` is the one code path of the Generator actor, tests, benchmarks and torchrun
launches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.generator.config import GeneratorConfig
from torchtitan_rl.generator.engine_loop import EngineLoop
from torchtitan_rl.generator.loop_decision import DecisionChannel
from torchtitan_rl.generator.pulls import choose_puller


async def start_engine_loop(config: GeneratorConfig) -> EngineLoop:
    """Build this rank's engine in a fresh engine thread and start its loop on the running event
    loop. With tensor_parallel_degree > 1 every rank calls this at the same time, with the torch
    elastic env set (WORLD_SIZE == tensor_parallel_degree)."""
    from torchtitan_rl.weight_sync.pull import is_cpu_platform

    tp = config.tensor_parallel_degree
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and world != tp:
        raise RuntimeError(
            f"tensor_parallel_degree={tp} needs WORLD_SIZE={tp} in the environment (torch "
            f"elastic env, e.g. monarch.spmd.setup_torch_elastic_env), got WORLD_SIZE={world}"
        )
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(executor, _build_engine_in_thread, config)
    # The stand-in holds plain tensors, and asking vLLM's platform would import vLLM.
    vllm_cpu_kernels = config.engine != "stand_in" and is_cpu_platform()
    puller = choose_puller(config, vllm_cpu_kernels=vllm_cpu_kernels)
    await loop.run_in_executor(executor, puller.setup, engine)
    channel = None
    if tp > 1:
        # After the engine: vLLM has initialised the default process group by now.
        channel = await loop.run_in_executor(executor, DecisionChannel.new_gloo_group)
    engine_loop = EngineLoop(
        engine,
        puller=puller,
        weight_sync=config.weight_sync,
        max_engine_steps_between_decisions=config.max_engine_steps_between_decisions,
        default_sampling=config.sampling,
        initial_policy_version=config.initial_policy_version,
        channel=channel,
        executor=executor,
    )
    engine_loop.start()
    return engine_loop


def _build_engine_in_thread(config: GeneratorConfig) -> Any:
    from torchtitan_rl.generator.vllm_engine import engine_builder

    threads = config.torch_num_threads
    if threads is None and config.tensor_parallel_degree > 1:
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    engine = engine_builder(config.engine)(config)
    if config.tensor_parallel_degree > 1:
        assert dist.is_initialized(), "vLLM's external_launcher left no default process group"
    return engine
