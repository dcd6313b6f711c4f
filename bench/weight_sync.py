"""Trainer -> generator weight sync vs one torch memcpy of the same bytes.

    python bench/weight_sync.py --size small --iters 5

Topology (what a run does): a PolicyTrainer actor on one Monarch proc and two Generator actors
(``spawn_generator``, float32, TP=1), one per ``weight_sync.load``, each on its own proc. One sync
is the trainer's ``push_weights(generator.actors, policy_version)``: the trainer
gathers its state dict, rank 0's WeightPusher sends it torchtitan-named to the generator's
``pull_model_state_dict`` (no files), and the generator's WeightPuller renames it to HF and writes
it into vLLM between engine steps (torchtitan_rl/weight_sync/). Cases (transport x load):
  transport ``message``: tensors pickled into the Monarch message;
  transport ``shared_memory``: one copy into a shared segment, references in the message;
  load ``reload``: vLLM ``reload_weights`` (+ the CPU tied-lm_head fix), linears repacked;
  load ``in_place``: linears unpacked once at engine start, each pull one copy_ per tensor, then
    vLLM's packed CPU kernels rebuilt from the copied weights (the shipped path);
  load ``in_place_plain``: the same without the rebuild (``repack_cpu_linears = false``): the
    linears then run as ``F.linear``, which generates 12-30 % slower (docs/weight_sync.md), for
    a cheaper push.
``gather_s`` is the trainer's state dict; ``stage_s`` its copy into shared memory, which the
generator's copy overlaps (a streamed push: the references go first and each chunk is announced);
``convert_s`` and ``convert_and_load_s`` are what the generator reports for its pull (HF names and
checks; then the write into vLLM, waiting for staged bytes, with the version label and
prefix-cache reset); ``handoff_s`` is the rest of the pull call (the message, the wait for the
engine loop). ``memcpy_s`` is one ``dst.copy_(src)`` of a flat buffer of the same number of bytes
with the actors' torch threads (``--num-threads``: each side of a push copies with that many).
All are medians over ``--iters`` after one warm-up. The lines are key=value; the last one is the path a run ships
with on one machine (``trainer.weight_transport = "auto"`` and ``generator.weight_sync.load =
"auto"`` pick shared memory and in-place copies there; across machines "auto" is the message):

    bench=weight_sync size=small transport=shared_memory load=in_place ... push_s=... ratio=...
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import statistics
import time
from typing import Any

import torch
from monarch.actor import this_host

HERE = pathlib.Path(__file__).resolve().parent
# (transport, generator weight_sync.load) cases, printed in this order.
CASES = (("message", "reload"), ("shared_memory", "reload"), ("shared_memory", "in_place_plain"),
         ("shared_memory", "in_place"))
REPO_ROOT = HERE.parent

logger = logging.getLogger("bench.weight_sync")


def memcpy_s(num_bytes: int, iters: int, num_threads: int) -> float:
    """One ``copy_`` of ``num_bytes`` with the actors' torch thread count (each side of a push
    copies with that many threads), median over ``iters`` after a warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        src = torch.empty(num_bytes, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: fault the pages in
        times = []
        for _ in range(max(iters, 7)):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


async def _time_pushes(trainer: Any, generators: Any, transport: str, versions: list[int]
                       ) -> tuple[list[float], list[dict[str, float]]]:
    """Push ``versions[0]`` (warm-up), then time one push per remaining version."""
    from torchtitan_rl.trainer.trainer import rank0_value

    async def push(version: int) -> dict[str, float]:
        # The PolicyTrainer endpoint: every trainer rank gathers, rank 0 pushes and reports.
        return rank0_value(await trainer.push_weights.call(generators, version, False, transport))

    await push(versions[0])
    times, metrics = [], []
    for version in versions[1:]:
        start = time.perf_counter()
        metrics.append(await push(version))
        times.append(time.perf_counter() - start)
    return times, metrics


def _generator_config(model_dir: str, num_threads: int, load: str) -> Any:
    from torchtitan_rl.generator import Generator, WeightSyncPolicy

    policy = WeightSyncPolicy(load="in_place", repack_cpu_linears=False) \
        if load == "in_place_plain" else WeightSyncPolicy(load=load)  # type: ignore[arg-type]
    return Generator.Config(
        model_dir=model_dir, dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20,
        torch_num_threads=num_threads, weight_sync=policy,
    )


async def run(size: str, iters: int, num_threads: int) -> dict[tuple[str, str], dict[str, float]]:
    from torchtitan_rl.assets.make_model import ensure_model
    from torchtitan_rl.generator import spawn_generator
    from torchtitan_rl.trainer.trainer import PolicyTrainer, spawn_policy_trainer

    model_dir = str(ensure_model(size, REPO_ROOT / "assets" / "models").resolve())
    trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
    handles: dict[str, Any] = {}
    try:
        trainer = await spawn_policy_trainer(
            trainer_procs, PolicyTrainer.Config(num_threads=num_threads), model_dir=model_dir)
        for load in dict.fromkeys(load for _, load in CASES):
            handles[load] = await spawn_generator(
                _generator_config(model_dir, num_threads, load), name=f"generator_{load}")
        next_version = dict.fromkeys(handles, 1)
        results = {}
        for transport, load in CASES:
            versions = list(range(next_version[load], next_version[load] + iters + 1))
            next_version[load] = versions[-1] + 1
            times, metrics = await _time_pushes(
                trainer, handles[load].actors, transport, versions)
            convert_and_load = [m["weight_sync/generator_convert_s"]
                                + m["weight_sync/generator_load_s"] for m in metrics]
            transport_s = [m["weight_sync/pull_s"] - cl for m, cl in zip(metrics, convert_and_load)]
            results[(transport, load)] = {
                "bytes": metrics[0]["weight_sync/model_bytes"],
                "push_s": statistics.median(times),
                "load_s": statistics.median(convert_and_load),
                "handoff_s": statistics.median(transport_s),
                "gather_s": statistics.median(m["weight_sync/gather_s"] for m in metrics),
                "stage_s": statistics.median(m.get("weight_sync/stage_s", 0.0) for m in metrics),
                "convert_s": statistics.median(m["weight_sync/generator_convert_s"] for m in metrics),
            }
            logger.info("%s/%s: %s", transport, load, results[(transport, load)])
    finally:
        for handle in handles.values():
            await handle.close()
        await trainer_procs.stop()
    copy_s = memcpy_s(int(results[CASES[0]]["bytes"]), iters, num_threads)
    for result in results.values():
        result["memcpy_s"] = copy_s
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "demo", "small"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per proc")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = asyncio.run(asyncio.wait_for(run(args.size, args.iters, args.num_threads), 600))
    for transport, load in CASES:
        r = results[(transport, load)]
        print(
            f"bench=weight_sync size={args.size} transport={transport} load={load} "
            f"bytes={int(r['bytes'])} "
            f"gather_s={r['gather_s']:.4f} stage_s={r['stage_s']:.4f} handoff_s={r['handoff_s']:.4f} convert_s={r['convert_s']:.4f} convert_and_load_s={r['load_s']:.4f} "
            f"push_s={r['push_s']:.4f} memcpy_s={r['memcpy_s']:.4f} "
            f"ratio={r['push_s'] / r['memcpy_s']:.2f}"
        )


if __name__ == "__main__":
    main()
