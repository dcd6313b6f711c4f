"""Generator throughput: our generator vs the bare vLLM engine vs one blocking request at a time.

    python bench/generator_throughput.py                 # small model, 64 requests, via Monarch
    python bench/generator_throughput.py --via in_process --size tiny

The same requests (mixed prompt and output lengths, per-request seeds, so every side generates the
same tokens) run three ways; tokens/s = generated tokens / wall seconds:
  raw       one in-process LLMEngine, every request added up front, stepped to the end
  generator N concurrent generate() calls through our generator (Monarch actor, TP=1, or the
            in-process EngineLoop with --via in_process)
  blocking  the same generator, one generate() awaited at a time
Each side is warmed up first; raw and generator alternate --repeats times and the best run of each
counts (the machine may be shared). Goals: ratio_vs_raw >= 0.95, ratio_vs_blocking >= 8.
The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from torchtitan_rl.assets.make_model import ensure_model  # noqa: E402
from torchtitan_rl.generator import Generator, spawn_generator, start_engine_loop  # noqa: E402
from torchtitan_rl.generator.loop_decision import EngineRequest  # noqa: E402
from torchtitan_rl.types import GenerateFn, GenerateRequest, Sampling  # noqa: E402

logger = logging.getLogger("bench.generator_throughput")

Request = tuple[str, list[int], Sampling]


def to_request(rid: str, prompt: list[int], sampling: Sampling) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, request_id=rid, sampling=sampling)


def make_requests(n: int, *, seed: int, tag: str) -> list[Request]:
    rng = random.Random(seed)
    return [
        (f"{tag}-{i}", [rng.randrange(3, 1024) for _ in range(rng.randint(8, 128))],
         Sampling(max_tokens=rng.randint(16, 96), temperature=1.0, seed=seed * 100_000 + i))
        for i in range(n)
    ]


def run_raw(engine: Any, requests: list[Request]) -> tuple[float, dict[str, list[int]]]:
    from torchtitan_rl.generator.vllm_engine import add_request

    start = time.perf_counter()
    for rid, prompt, sampling in requests:
        add_request(engine, EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


async def run_concurrent(
    generate: GenerateFn, requests: list[Request]
) -> tuple[float, dict[str, list[int]]]:
    start = time.perf_counter()
    completions = await asyncio.gather(*[generate(to_request(*r)) for r in requests])
    return time.perf_counter() - start, {c.request_id: c.token_ids for c in completions}


async def run_blocking(
    generate: GenerateFn, requests: list[Request]
) -> tuple[float, dict[str, list[int]]]:
    start = time.perf_counter()
    tokens = {}
    for rid, prompt, sampling in requests:
        completion = await generate(to_request(rid, prompt, sampling))
        assert completion is not None, f"{rid} was dropped"
        tokens[rid] = completion.token_ids
    return time.perf_counter() - start, tokens


def num_tokens(tokens: dict[str, list[int]]) -> int:
    return sum(len(t) for t in tokens.values())


def same_tokens(a: dict[str, list[int]], b: dict[str, list[int]]) -> bool:
    strip = lambda d: {k.split("-", 1)[1]: v for k, v in d.items()}  # noqa: E731
    return strip(a) == strip(b)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from torchtitan_rl.generator.vllm_engine import build_engine

    model_dir = ensure_model(args.size)
    config = Generator.Config(
        model_dir=str(model_dir), max_model_len=512, kv_cache_bytes=args.kv_cache_mib << 20,
        max_engine_steps_between_decisions=args.steps_per_decision,
        # Every repeat sends the same prompts: a prefix cache would serve them from the last one.
        enable_prefix_caching=False,
    )
    engine = build_engine(config)
    if args.via == "actor":
        handle = await spawn_generator(config, name="bench_generator")
        generate, close = handle.generate, handle.close
    else:
        loop = await start_engine_loop(config)
        generate, close = loop.generate, loop.close
    try:
        warm = make_requests(8, seed=99, tag="warm")
        run_raw(engine, warm)
        await run_concurrent(generate, [(f"g{r}", p, s) for r, p, s in warm])
        raw_tps, gen_tps = [], []
        for repeat in range(args.repeats):
            requests = make_requests(args.num_requests, seed=1, tag=f"raw{repeat}")
            raw_s, raw_tokens = run_raw(engine, requests)
            raw_tps.append(num_tokens(raw_tokens) / raw_s)
            requests = make_requests(args.num_requests, seed=1, tag=f"gen{repeat}")
            gen_s, gen_tokens = await run_concurrent(generate, requests)
            gen_tps.append(num_tokens(gen_tokens) / gen_s)
            logger.info("repeat %d: raw %.1f tok/s, generator %.1f tok/s", repeat, raw_tps[-1],
                        gen_tps[-1])
        requests = make_requests(args.num_requests, seed=1, tag="blocking")
        blocking_s, blocking_tokens = await run_blocking(generate, requests)
        blocking_tps = num_tokens(blocking_tokens) / blocking_s
    finally:
        await close()
    return {
        "bench": "generator_throughput",
        "model": args.size,
        "via": args.via,
        "num_requests": args.num_requests,
        "generated_tokens": num_tokens(gen_tokens),
        "same_tokens": int(same_tokens(raw_tokens, gen_tokens) and same_tokens(gen_tokens, blocking_tokens)),
        "raw_tokens_per_s": round(max(raw_tps), 1),
        "tokens_per_s": round(max(gen_tps), 1),
        "blocking_tokens_per_s": round(blocking_tps, 1),
        "ratio_vs_raw": round(max(gen_tps) / max(raw_tps), 3),
        "ratio_vs_blocking": round(max(gen_tps) / blocking_tps, 2),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "demo", "small"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--via", default="actor", choices=["actor", "in_process"])
    parser.add_argument("--steps-per-decision", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = asyncio.run(main(parse_args(sys.argv[1:])))
    print(" ".join(f"{k}={v}" for k, v in result.items()))
