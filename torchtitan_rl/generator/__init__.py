"""vLLM generation behind a Monarch actor: continuous batching, weight pulls, aborts.

Public API:
    Generator (actor, Generator.Config), WeightSyncPolicy
    spawn_generator(config, *, name, host=None, procs=None, on_lost=None) -> GeneratorHandle
    GeneratorLostError: a request whose generator died (restart its group)
    start_engine_loop(config) -> EngineLoop   (in-process)
    EngineLoop, RequestLedger, LoopAction, LoopDecision

A GeneratorHandle (and a bound ``EngineLoop.generate``) is a ``GenerateFn``; weights are pushed to
its actor mesh (``handle.actors``). How pulled weights reach vLLM: torchtitan_rl/weight_sync/pull.py.
"""

from torchtitan_rl.generator.client import GeneratorHandle, GeneratorLostError, spawn_generator
from torchtitan_rl.generator.config import WeightSyncPolicy
from torchtitan_rl.generator.engine_loop import EngineLoop
from torchtitan_rl.generator.engine_setup import start_engine_loop
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.generator.loop_decision import LoopAction, LoopDecision
from torchtitan_rl.generator.request_ledger import RequestLedger

__all__ = [
    "EngineLoop",
    "Generator",
    "GeneratorHandle",
    "GeneratorLostError",
    "LoopAction",
    "LoopDecision",
    "RequestLedger",
    "WeightSyncPolicy",
    "spawn_generator",
    "start_engine_loop",
]
