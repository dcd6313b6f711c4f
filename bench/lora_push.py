"""A LoRA adapter push against a full-weight push of the same model, in one run.

    python bench/lora_push.py --sizes demo small --rank 16 --iters 5

For each model size: two trainers on their own Monarch procs, one full-parameter (its pushes carry
every weight) and one training LoRA adapters of ``--rank`` (``trainer.lora.push = "adapter"``: its
pushes carry the adapters alone), each pushing to its own generator (float32, TP 1; the adapter's
engine built with vLLM's LoRA). One push is the trainer's ``push_weights`` as a run calls it,
over shared memory (what ``weight_transport = "auto"`` picks on one machine): the trainer gathers,
rank 0 stages the tensors, the generator loads them between engine steps (the full push with
``weight_sync.load = "auto"``: one copy per tensor into vLLM's parameters, then its packed CPU
kernels rebuilt; the adapter push: installed into vLLM's LoRA slot, weight_sync/lora_pull.py).
``push_s`` is the wall time of one push call, median over ``--iters`` after a warm-up. One line per
size, then the last line, for the last size:

    adapter_bytes_over_model=<adapter bytes / full bytes> push_time_ratio=<adapter push_s / full>
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import statistics
import time
from typing import Any

from monarch.actor import this_host

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

logger = logging.getLogger("bench.lora_push")


async def _time_pushes(trainer: Any, generator: Any, iters: int) -> tuple[float, float]:
    """(median push seconds, bytes of one push) over ``iters`` pushes after a warm-up."""
    from torchtitan_rl.trainer.trainer import rank0_value

    times, num_bytes = [], 0.0
    for version in range(1, iters + 2):
        start = time.perf_counter()
        metrics = rank0_value(await trainer.push_weights.call(
            generator, version, False, "shared_memory"))
        if version > 1:
            times.append(time.perf_counter() - start)
        num_bytes = metrics["weight_sync/model_bytes"]
    return statistics.median(times), num_bytes


async def run(size: str, rank: int, iters: int, num_threads: int) -> dict[str, float]:
    from torchtitan_rl.assets.make_model import ensure_model
    from torchtitan_rl.generator import Generator, spawn_generator
    from torchtitan_rl.trainer.lora import LoRA
    from torchtitan_rl.trainer.trainer import PolicyTrainer, spawn_policy_trainer

    model_dir = str(ensure_model(size, REPO_ROOT / "assets" / "models").resolve())
    lora = LoRA.Config(enabled=True, rank=rank, alpha=2.0 * rank)
    result: dict[str, float] = {}
    for case in ("full", "adapter"):
        procs = this_host().spawn_procs(per_host={"procs": 1})
        generator = None
        try:
            trainer = await spawn_policy_trainer(
                procs, PolicyTrainer.Config(num_threads=num_threads,
                                            lora=lora if case == "adapter" else LoRA.Config()),
                model_dir=model_dir)
            generator = await spawn_generator(Generator.Config(
                model_dir=model_dir, dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20,
                torch_num_threads=num_threads,
                lora_rank=rank if case == "adapter" else 0, lora_alpha=lora.alpha,
            ), name=f"generator_{case}")
            push_s, num_bytes = await _time_pushes(trainer, generator.actors, iters)
            result[f"{case}_push_s"], result[f"{case}_bytes"] = push_s, num_bytes
            logger.info("%s %s: push %.4f s, %d bytes", size, case, push_s, num_bytes)
        finally:
            if generator is not None:
                await generator.close()
            await procs.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["demo", "small"],
                        choices=["tiny", "demo", "small"])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per proc")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    last: dict[str, float] = {}
    for size in args.sizes:
        last = asyncio.run(asyncio.wait_for(
            run(size, args.rank, args.iters, args.num_threads), 900))
        print(f"bench=lora_push size={size} rank={args.rank} "
              f"full_bytes={int(last['full_bytes'])} adapter_bytes={int(last['adapter_bytes'])} "
              f"full_push_s={last['full_push_s']:.4f} adapter_push_s={last['adapter_push_s']:.4f}")
    print(f"adapter_bytes_over_model={last['adapter_bytes'] / last['full_bytes']:.4f} "
          f"push_time_ratio={last['adapter_push_s'] / last['full_push_s']:.3f}")


if __name__ == "__main__":
    main()
