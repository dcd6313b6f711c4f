"""The main job's training step: model FLOPs utilization, today's batch shape vs alternatives.

    python bench/train_mfu.py [--config run_configs/alphabet_sort_cpu.toml] [--steps 6]

The samples are the main job's own: solved conversations of its task's training split, tokenized
with its model's chat template (the lengths GRPO trains on, one group of ``group_size`` per
prompt, ``groups_per_step`` groups a step). The trainer is the job's PolicyTrainerCore on this
process (its ``trainer.num_threads``), its batcher config as resolved. Each variant runs
``--steps`` steps after one warm-up step; the figure is the median step's ``trainer/mfu`` (model
FLOPs of real tokens over the measured matmul peak, see trainer/flops.py). Variants change only
the batch shape (rows per microbatch, row length), which decides padding and matmul sizes, or the
trainer's torch threads (1 vs every core: in synchronous GRPO the generator idles while the
trainer trains; the peak stays the one measured at the job's thread count, so compare their
step_s). Last line: the job's own shape against the best variant, key=value.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from torchtitan_rl.config.manager import parse_args  # noqa: E402
from torchtitan_rl.controller.job import RLJob  # noqa: E402
from torchtitan_rl.trainer.batcher import Batcher  # noqa: E402
from torchtitan_rl.trainer.core import PolicyTrainerCore  # noqa: E402
from torchtitan_rl.types import TrainingSample  # noqa: E402

logger = logging.getLogger("bench.train_mfu")


def job_samples(job: RLJob.Config, model_dir: str, num: int) -> list[TrainingSample]:
    """``num`` samples of the job's task: solved training conversations, the assistant turns
    trained (the mask a rollout's completion tokens get)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = job.task.build()
    train = task.dataset("train")
    samples = []
    group_size = job.rollouter.group_size
    for i in range(num):
        conversation = task.solved_conversation(train[i // group_size])
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            conversation[:-1], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        full = tokenizer.encode(tokenizer.apply_chat_template(conversation, tokenize=False),
                                add_special_tokens=False)
        n, p = len(full), len(prompt)
        samples.append(TrainingSample(
            sample_id=f"group={i // group_size}/rollout={i % group_size}/branch=0",
            group_id=i // group_size, token_ids=list(full), loss_mask=[0] * p + [1] * (n - p),
            generator_logprobs=[0.0] * p + [-1.0] * (n - p),
            advantages=[0.0] * p + [1.0 if i % 2 else -1.0] * (n - p),
            policy_versions=[-1] * p + [0] * (n - p),
        ))
    return samples


def median_mfu(core, batcher: Batcher, samples: list[TrainingSample], steps: int) -> dict:
    batch = batcher.pack(samples)
    core.forward_backward(batch)  # warm-up
    core.optim_step()
    mfus, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        core.forward_backward(batch)
        metrics = core.optim_step()
        seconds.append(time.perf_counter() - start)
        mfus.append(metrics["trainer/mfu"])
    return {"mfu": statistics.median(mfus), "step_s": statistics.median(seconds),
            "pct_pad": batch.metrics["batcher/pct_pad_in_batch"],
            "rows": int(batch.metrics["batcher/num_rows"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE.parent / "run_configs" /
                                                "alphabet_sort_cpu.toml"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.chdir(HERE.parent)
    job = parse_args(RLJob.Config, ["--config", args.config, "--warm_start.enabled", "false"]).config
    plan = RLJob(job).resolve()
    samples = job_samples(job, plan.model_dir, job.loop.groups_per_step * job.rollouter.group_size)
    core = PolicyTrainerCore(plan.trainer, model_dir=plan.model_dir)  # the actor's core, here
    own = plan.batcher
    longest = max(s.num_tokens for s in samples)
    variants = {"job": own}
    for rows in (1, 2, 4, 8, 16):
        variants[f"rows={rows}"] = dataclasses.replace(own, rows_per_microbatch=rows)
    variants["seq_len=longest"] = dataclasses.replace(own, seq_len=longest)
    results = {}
    for name, batcher in variants.items():
        results[name] = median_mfu(core, batcher.build(), samples, args.steps)
        r = results[name]
        print(f"variant={name} rows_per_microbatch={batcher.rows_per_microbatch} "
              f"seq_len={batcher.seq_len} rows={r['rows']} pct_pad={r['pct_pad']:.1f} "
              f"step_s={r['step_s']:.3f} mfu={r['mfu']:.4f}", flush=True)
    job_threads = torch.get_num_threads()
    by_threads = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        r = by_threads[threads] = median_mfu(core, own.build(), samples, args.steps)
        print(f"variant=threads={threads} step_s={r['step_s']:.3f} mfu={r['mfu']:.4f} "
              f"(peak measured at {job_threads} threads)", flush=True)
    torch.set_num_threads(job_threads)
    best = max(results, key=lambda k: results[k]["mfu"])
    print(f"bench=train_mfu threads={job_threads} job_mfu={results['job']['mfu']:.4f} "
          f"job_step_s={results['job']['step_s']:.3f} best={best} "
          f"best_mfu={results[best]['mfu']:.4f} best_step_s={results[best]['step_s']:.3f} "
          f"ratio={results[best]['mfu'] / results['job']['mfu']:.2f} "
          f"threads_speedup={by_threads[1]['step_s'] / by_threads[max(by_threads)]['step_s']:.2f}")


if __name__ == "__main__":
    main()
