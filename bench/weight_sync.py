"""Trainer -> generator weight sync vs one torch memcpy of the same bytes.

    python bench/weight_sync.py --size small --iters 5

Topology (what a run does): a PolicyTrainer actor on one Monarch proc and a vLLM engine actor on
another. One sync is the controller's ``push_weights(trainer, generators, version)``: the trainer
hands its torchtitan-named state dict to the generator's ``pull_model_state_dict`` endpoint
(no files), the generator renames it to HF (torchtitan's adapter, via the generator's
WeightLoader) and loads it into vLLM. Cases (transport x load):
  transport ``message``: tensors pickled into the Monarch message;
  transport ``shared_memory``: one copy into a shared segment, references in the message;
  load ``reload``: vLLM ``reload_weights`` (+ the CPU tied-lm_head fix), linears repacked;
  load ``inplace``: linears unpacked once at start (trainer/vllm_weights.py), each push a copy_.
``handoff_s`` is sync minus the generator's convert+load time.
``memcpy_s`` is one ``dst.copy_(src)`` of a flat buffer of the same number of bytes, in this
process. Both are medians over ``--iters`` after one warm-up. The last line is key=value:

    bench=weight_sync size=small transport=shared_memory load=inplace ... sync_s=... ratio=...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time

import torch
from monarch.actor import Actor, endpoint, this_host

HERE = pathlib.Path(__file__).resolve().parent
# (transport, generator load) cases; the last one is the bench's key=value last line.
CASES = (("message", "reload"), ("shared_memory", "reload"), ("shared_memory", "inplace"))
REPO_ROOT = HERE.parent


class SyncTarget(Actor):
    """A float32 vLLM engine that takes pushes and reports how long conversion + load took.
    ``load="reload"``: the generator's WeightLoader (vLLM reload_weights, linears repacked);
    ``load="inplace"``: linears unpacked once at start, each push copied into them."""

    def __init__(self, model_dir: str, num_threads: int, load: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.set_num_threads(num_threads)
        from vllm import EngineArgs, LLMEngine

        from torchtitan_rl.generator.weight_loader import WeightLoader

        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=model_dir, dtype="float32", max_model_len=256, enforce_eager=True,
            kv_cache_memory_bytes=64 * 2**20,
        ))
        self.loader = WeightLoader(model_dir)
        self.load = load
        self.load_s: list[float] = []
        if load == "inplace":
            from torchtitan_rl.trainer.vllm_weights import unpack_cpu_linears, vllm_model

            unpack_cpu_linears(vllm_model(self.engine))

    @endpoint
    async def pull_model_state_dict(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        from torchtitan_rl.trainer.vllm_weights import load_hf_weights_inplace, vllm_model

        start = time.perf_counter()
        weights = self.loader.prepare(state_dict)
        if self.load == "inplace":
            load_hf_weights_inplace(vllm_model(self.engine), dict(weights))
        else:
            self.loader.load(self.engine, weights)
        self.engine.reset_prefix_cache()
        self.load_s.append(time.perf_counter() - start)

    @endpoint
    async def load_times(self) -> list[float]:
        return self.load_s


def memcpy_s(num_bytes: int, iters: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _time_pushes(trainer, generators, transport: str, first_version: int, iters: int):
    from torchtitan_rl.trainer.client import push_weights

    await push_weights(trainer, generators, version=first_version, transport=transport)  # warm-up
    times, metrics = [], []
    for version in range(first_version + 1, first_version + 1 + iters):
        start = time.perf_counter()
        metrics.append(await push_weights(trainer, generators, version=version, transport=transport))
        times.append(time.perf_counter() - start)
    return times, metrics


async def run(size: str, iters: int, num_threads: int) -> dict[tuple[str, str], dict[str, float]]:
    from torchtitan_rl.assets.make_model import ensure_model
    from torchtitan_rl.trainer.client import rank0_value
    from torchtitan_rl.trainer.trainer import PolicyTrainer, spawn_policy_trainer

    model_dir = str(ensure_model(size, REPO_ROOT / "assets" / "models").resolve())
    # The SyncTarget class lives in this script: its proc must be able to import it.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *sys.path])
    trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
    generator_procs = {
        load: this_host().spawn_procs(per_host={"procs": 1}) for load in ("reload", "inplace")
    }
    try:
        config = PolicyTrainer.Config(num_threads=num_threads)
        trainer = await spawn_policy_trainer(trainer_procs, config, model_dir=model_dir)
        targets = {
            load: procs.spawn(f"sync_target_{load}", SyncTarget, model_dir, num_threads, load)
            for load, procs in generator_procs.items()
        }
        results = {}
        for index, (transport, load_mode) in enumerate(CASES):
            generators = targets[load_mode]
            times, metrics = await _time_pushes(
                trainer, generators, transport, index * (iters + 1), iters
            )
            load_times = rank0_value(await generators.load_times.call())[-iters:]
            load = statistics.median(load_times)
            results[(transport, load_mode)] = {
                "bytes": metrics[0]["weight_sync/bytes"],
                "sync_s": statistics.median(times),
                "load_s": load,
                "handoff_s": statistics.median(m["weight_sync/pull_s"] for m in metrics) - load,
            }
    finally:
        await trainer_procs.stop()
        for procs in generator_procs.values():
            await procs.stop()
    copy_s = memcpy_s(int(results[CASES[0]]["bytes"]), iters)
    for result in results.values():
        result["memcpy_s"] = copy_s
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "demo", "small"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per proc")
    args = parser.parse_args()
    results = asyncio.run(asyncio.wait_for(run(args.size, args.iters, args.num_threads), 600))
    for transport, load in CASES:
        r = results[(transport, load)]
        print(
            f"bench=weight_sync size={args.size} transport={transport} load={load} "
            f"bytes={int(r['bytes'])} "
            f"handoff_s={r['handoff_s']:.4f} convert_and_load_s={r['load_s']:.4f} "
            f"sync_s={r['sync_s']:.4f} memcpy_s={r['memcpy_s']:.4f} "
            f"ratio={r['sync_s'] / r['memcpy_s']:.2f}"
        )


if __name__ == "__main__":
    main()
