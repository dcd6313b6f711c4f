"""Run a tiny job in its own process (for tests that kill it): python -m tests.controller.run_tiny_job
OUTPUT_DIR NAME NUM_STEPS [--resume] [--num-prompts N] [--staleness S] [--partial-rollout abort]
[--num-generators N] [--max-restarts N] [--trainer-max-restarts N] [--checkpoint-every N]
[--max-skipped-in-row N] [--placement KIND] [--generator-tp 1,2] [--num-trainer-ranks N]
[--relay-chunk-bytes N] [--verify] [--lora-rank R] [--num-workers N] [--engine vllm|stand_in]
[--stand-in-tokens-per-s R]. Staleness 0 (the
default) is synchronous training. Jobs on simulated hosts (--placement process) run here, never
in the pytest process: monarch.job imports flask, whose proxies break vLLM's kernel scan of
sys.modules for any later in-process engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys

from tests.controller.jobs import on_stand_in_engines, tiny_job
from tests.controller.letter_task import LetterTask
from torchtitan_rl.controller.hosts.placement import Placement
from torchtitan_rl.train import run_and_report
from torchtitan_rl.trainer.lora import LoRA


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=pathlib.Path)
    parser.add_argument("name")
    parser.add_argument("num_steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--partial-rollout", choices=["none", "abort"], default="none")
    parser.add_argument("--num-generators", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--trainer-max-restarts", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--max-skipped-in-row", type=int, default=3)
    parser.add_argument("--placement", default="local")
    parser.add_argument("--generator-tp", default="", help="one TP degree per generator")
    parser.add_argument("--num-trainer-ranks", type=int, default=1)
    parser.add_argument("--relay-chunk-bytes", type=int, default=None)
    parser.add_argument("--verify", action="store_true", help="verify_weight_push")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank (trainer.lora), alpha 2 x rank")
    parser.add_argument("--num-workers", type=int, default=0, help="rollouter.num_workers")
    parser.add_argument("--worker-outcome-interval-s", type=float, default=None,
                        help="rollouter.worker_outcome_interval_s")
    parser.add_argument("--engine", choices=["vllm", "stand_in"], default="vllm",
                        help="generator.engine: stand_in where the test is about the processes, "
                             "not the tokens (generator/stand_in_engine.py)")
    parser.add_argument("--stand-in-tokens-per-s", type=float, default=None,
                        help="the stand-in's pace: a low one makes steps last (sleeping), so "
                             "a replacement is up before the run ends")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = tiny_job(args.output_dir, args.name, num_steps=args.num_steps,
                      max_staleness=args.staleness, partial_rollout=args.partial_rollout,
                      max_skipped_steps_in_row=args.max_skipped_in_row)
    config = dataclasses.replace(
        config,
        task=LetterTask.Config(num_prompts=args.num_prompts),
        rollouter=dataclasses.replace(config.rollouter, num_workers=args.num_workers,
                                      **({} if args.worker_outcome_interval_s is None else {
                                          "worker_outcome_interval_s":
                                              args.worker_outcome_interval_s})),
        checkpoint=dataclasses.replace(config.checkpoint, every_steps=args.checkpoint_every,
                                       resume="must" if args.resume else "never"),
        trainer=dataclasses.replace(
            config.trainer, max_restarts=args.trainer_max_restarts,
            lora=LoRA.Config(enabled=args.lora_rank > 0, rank=max(args.lora_rank, 1),
                             alpha=2.0 * max(args.lora_rank, 1)),
            relay_chunk_bytes=args.relay_chunk_bytes or config.trainer.relay_chunk_bytes),
        num_trainer_ranks=args.num_trainer_ranks,
        verify_weight_push=args.verify,
        num_generators=args.num_generators,
        placement=Placement.Config(kind=args.placement),
        generator_tensor_parallel_degrees=[int(tp) for tp in args.generator_tp.split(",") if tp],
        generator=dataclasses.replace(config.generator, max_restarts=args.max_restarts),
    )
    if args.engine == "stand_in":
        config = on_stand_in_engines(config)
        if args.stand_in_tokens_per_s is not None:
            config = dataclasses.replace(config, generator=dataclasses.replace(
                config.generator, stand_in_tokens_per_s=args.stand_in_tokens_per_s))
    sys.exit(run_and_report(config))


if __name__ == "__main__":
    run()
