"""Building one rank's engine and starting its `EngineLoop` (``config``: a ``Generator.Config``,
not imported here: the actor module imports this one): the one code path of the `Generator`
actor, tests, benchmarks and torchrun launches.

    start_engine_loop(config): engine thread -> engine_builder(config.engine)(config) (vLLM or
        the stand-in) -> WeightPuller (load "auto" resolved here) .setup -> gloo decision group
        (TP > 1) -> EngineLoop(...).start() on the running event loop
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.generator.engine_loop import EngineLoop, StepStats

logger = logging.getLogger(__name__)


async def start_engine_loop(
    config: Any,
    *,
    on_step: Callable[[StepStats], None] | None = None,
    wrap_engine: Callable[[Any], Any] | None = None,
) -> EngineLoop:
    """Build this rank's engine in a fresh engine thread and start its loop on the running event
    loop: the one code path of the actor, tests, benchmarks and torchrun launches.

    With tensor_parallel_degree > 1 every rank calls this at the same time, with the torch
    elastic env set (WORLD_SIZE == tensor_parallel_degree). ``wrap_engine`` wraps the built
    engine (tests inject faults with it)."""
    from torchtitan_rl.generator.loop_decision import DecisionChannel
    from torchtitan_rl.weight_sync.pull import WeightPuller, is_cpu_platform

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
    load = config.weight_sync.load
    if load == "auto":  # the fast path where vLLM's CPU layout allows it
        load = "in_place" if (config.engine == "vllm" and tp == 1 and config.enforce_eager
                              and vllm_cpu_kernels) else "reload"
        logger.info("weight_sync.load='auto': %s", load)
    puller = WeightPuller(config.model_dir, load=load,  # type: ignore[arg-type]
                          repack_cpu_linears=config.weight_sync.repack_cpu_linears,
                          vllm_cpu_kernels=vllm_cpu_kernels)
    await loop.run_in_executor(executor, puller.setup, engine)
    channel = None
    if tp > 1:
        # After the engine: vLLM has initialised the default process group by now.
        channel = await loop.run_in_executor(executor, DecisionChannel.new_gloo_group)
    engine_loop = EngineLoop(
        wrap_engine(engine) if wrap_engine is not None else engine,
        puller=puller,
        weight_sync=config.weight_sync,
        max_engine_steps_between_decisions=config.max_engine_steps_between_decisions,
        default_sampling=config.sampling,
        initial_policy_version=config.initial_policy_version,
        channel=channel,
        executor=executor,
        on_step=on_step,
    )
    engine_loop.start()
    return engine_loop


def _build_engine_in_thread(config: Any) -> Any:
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
