"""Turns per second through the agent endpoint vs the in-process environment, same episodes.

    python bench/agent_endpoint.py --groups 32 --group-size 8 --latency-ms 20

Both sides play the same AlphabetSort episodes (3 turns each) with the same Rollouter and the
same scripted GenerateFn (each call answers the turn's correct list after ``--latency-ms``, the
stand-in for a generator's time per call, 0 measures the endpoint's overhead alone):
  in_process: AlphabetSortTask.make_env -> TokenEnv (the Rollouter's own loop, no HTTP);
  endpoint:   AgentTask with examples/alphabet_sort/agent.py: the `openai` client
              the run gives it, over HTTP on 127.0.0.1 to the run's endpoint, which renders,
              captures and generates (the agent's client work runs in the same process, as in a
              job, so it counts);
  endpoint_own_client (``--own-client``): the same agent building its own ``AsyncOpenAI`` per
              episode from ``client.base_url`` / ``client.api_key``, as an agent library given a
              URL would: ~30 ms of CPU per episode (httpx builds an SSL context).
``--concurrency`` groups run at a time. Each side runs once to warm up, then ``--iters`` times;
turns/s is the median (figures on 2 shared cores: docs/agents.md, "Overhead"). The lines are
key=value; the last is ``ratio=<endpoint / in_process>``.

    python bench/agent_endpoint.py --jobs [--steps 15] [--repeats 2]

The same comparison with the real generator: the main job (run_configs/alphabet_sort_cpu.toml)
and its agent version (run_configs/alphabet_sort_agent.toml), ``--steps`` steps each (no
validation, no checkpoints; the cached warm start both share), ``--repeats`` runs a side in ABBA
order. Same seeds and episodes: the runs generate the same tokens (the bench checks the turns and
trained tokens of every step, and the losses). turns/s is a run's turns over its
``time/generate_s`` (the first step, a warm-up, left out), the median of a side's runs. On this
box the controller shares the cores with vLLM, so its extra CPU per turn
(``rollout/controller_cpu_ms_per_turn``, printed too) slows generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from examples.alphabet_sort import AlphabetSortTask  # noqa: E402
from torchtitan_rl.assets.make_model import ensure_model  # noqa: E402
from torchtitan_rl.rollout.agent_task import AgentTask  # noqa: E402
from torchtitan_rl.rollout.rollouter import Rollouter  # noqa: E402
from torchtitan_rl.types import Completion, GenerateRequest, Sampling  # noqa: E402


async def own_client_agent(episode: Any, client: Any) -> Any:
    """examples/alphabet_sort/agent.py with a client of its own per episode."""
    from openai import AsyncOpenAI

    from examples.alphabet_sort.agent import run

    async with AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key) as own:
        return await run(episode, own)


class OracleGenerate:
    """Answers each turn with the episode's correct list (looked up by the prompt's last user
    message) after ``latency_s``."""

    def __init__(self, tokenizer: Any, episodes: list[Any], latency_s: float) -> None:
        self.tokenizer = tokenizer
        self.latency_s = latency_s
        self.answers: dict[str, list[int]] = {}
        for episode in episodes:
            for t, prompt in enumerate(episode.prompts):
                tag = "alphabetical_sorted" if t == 0 else "combined_alphabetical_sorted"
                text = f"<{tag}>\n" + "\n".join(episode.ground_truths[t]) + f"\n</{tag}>"
                self.answers[prompt[-200:]] = tokenizer.encode(text, add_special_tokens=False)
        self.decoded: dict[tuple[int, ...], str] = {}

    async def __call__(self, request: GenerateRequest) -> Completion:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        key = tuple(request.prompt_token_ids[-120:])
        if key not in self.decoded:
            self.decoded[key] = self.tokenizer.decode(list(key))
        text = self.decoded[key]
        ids = next((v for k, v in self.answers.items() if k[-60:] in text), [])
        ids = ids[: request.sampling.max_tokens - 1] + [self.tokenizer.eos_token_id]
        return Completion(request_id=request.request_id,
                          prompt_token_ids=list(request.prompt_token_ids), token_ids=ids,
                          token_logprobs=[-0.1] * len(ids), token_policy_versions=[0] * len(ids),
                          finish_reason="stop")


async def _play(rollouter: Rollouter, generate: OracleGenerate, episodes: list[Any],
                group_size: int, concurrency: int) -> tuple[int, float]:
    """(turns played, seconds) for every episode, ``concurrency`` groups at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(group_id: int, episode: Any) -> int:
        async with gate:
            group = await rollouter.run_group_rollouts(generate, episode, group_id, group_size,
                                                       Sampling(max_tokens=200))
        assert all(not r.status.is_error for r in group.rollouts), [r.error for r in group.rollouts]
        return sum(len(r.turns) for r in group.rollouts)

    start = time.perf_counter()
    turns = await asyncio.gather(*(one(g, e) for g, e in enumerate(episodes)))
    return sum(turns), time.perf_counter() - start


JOB_CONFIGS = {"in_process": "run_configs/alphabet_sort_cpu.toml",
               "endpoint": "run_configs/alphabet_sort_agent.toml"}


def run_jobs(steps: int, repeats: int, output_dir: pathlib.Path) -> None:
    """--jobs: both real jobs, ``steps`` steps each, ``repeats`` times in ABBA order (the box's
    speed drifts between runs); prints a line per run, then the ratio of the medians."""
    output_dir = output_dir / time.strftime("%Y%m%d-%H%M%S")
    rates: dict[str, list[float]] = {side: [] for side in JOB_CONFIGS}
    per_step: list[list[tuple[float, float, float]]] = []  # every run's (turns, tokens, loss)
    for repeat in range(repeats):
        for side in (list(JOB_CONFIGS) if repeat % 2 == 0 else list(JOB_CONFIGS)[::-1]):
            name = f"{side}_{repeat}"
            command = [sys.executable, "-m", "torchtitan_rl.train", "--config", JOB_CONFIGS[side],
                       "--output_dir", str(output_dir), "--name", name,
                       "--loop.num_steps", str(steps), "--validation.num_prompts", "0",
                       "--checkpoint.every_steps", "0"]
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            print(f"running {name}: {' '.join(command[1:])}", flush=True)
            subprocess.run(command, cwd=REPO_ROOT, env=env, check=True)
            rows = [json.loads(line) for line in
                    (output_dir / name / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in sorted(rows, key=lambda r: r["step"])
                    if r["step"] >= 1 and "rollout/num_rollouts" in r]
            turns = sum(r["rollout/num_rollouts"] * r["rollout/num_turns"] for r in rows)
            generate_s = sum(r["time/generate_s"] for r in rows)
            cpu_ms = statistics.median(r["rollout/controller_cpu_ms_per_turn"] for r in rows)
            per_step.append([(round(r["rollout/num_rollouts"] * r["rollout/num_turns"]),
                              r["loss/num_valid_tokens"], r["loss/value"]) for r in rows])
            rates[side].append(turns / generate_s)
            print(f"bench=agent_endpoint side={side} via=jobs steps={len(rows)} turns={turns:.0f} "
                  f"generate_s={generate_s:.1f} turns_per_s={rates[side][-1]:.1f} "
                  f"controller_cpu_ms_per_turn={cpu_ms:.2f}", flush=True)
    # Every run the same tokens: the same turns and trained tokens each step, losses equal to
    # float noise.
    first = per_step[0]
    same_tokens = all([a[:2] for a in run] == [b[:2] for b in first] for run in per_step)
    same_losses = all(len(run) == len(first) and all(
        math.isclose(a[2], b[2], rel_tol=1e-3, abs_tol=1e-7) for a, b in zip(run, first))
        for run in per_step)
    medians = {side: statistics.median(values) for side, values in rates.items()}
    print(f"bench=agent_endpoint same_tokens={same_tokens} same_losses={same_losses} "
          f"in_process_turns_per_s={medians['in_process']:.1f} "
          f"endpoint_turns_per_s={medians['endpoint']:.1f} run_dir={output_dir}")
    print(f"ratio={medians['endpoint'] / medians['in_process']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--own-client", action="store_true",
                        help="also time an agent that builds its own client per episode")
    parser.add_argument("--jobs", action="store_true",
                        help="compare the real main job with its agent version instead")
    parser.add_argument("--steps", type=int, default=15, help="--jobs: steps of each job")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--jobs: runs of each job, in ABBA order")
    parser.add_argument("--output-dir", default="runs/agent_endpoint",
                        help="--jobs: a new folder under it holds both runs")
    args = parser.parse_args()
    if args.jobs:
        return run_jobs(args.steps, args.repeats, REPO_ROOT / args.output_dir)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_model("tiny", REPO_ROOT / "assets" / "models"))
    episodes_config = AlphabetSortTask.Config(min_turns=3, max_turns=3, max_names_per_turn=2)
    episodes = [episodes_config.build().dataset("train")[i] for i in range(args.groups)]
    generate = OracleGenerate(tokenizer, episodes, args.latency_ms / 1000)
    agent_task = AgentTask.Config(agent="examples.alphabet_sort.agent:run",
                                  episodes=episodes_config).build()
    own_task = AgentTask.Config(agent="bench.agent_endpoint:own_client_agent",
                                episodes=episodes_config).build()
    sides = {"in_process": episodes_config.build().make_env, "endpoint": agent_task.make_env}
    if args.own_client:
        sides["endpoint_own_client"] = own_task.make_env
    rates: dict[str, float] = {}

    async def run_all() -> None:
        try:
            for name, make_env in sides.items():
                rollouter = Rollouter.Config(max_turns=3, max_rollout_tokens=1024).build(
                    tokenizer=tokenizer, make_env=make_env)
                samples = []
                for i in range(args.iters + 1):
                    turns, seconds = await _play(rollouter, generate, episodes, args.group_size,
                                                 args.concurrency)
                    if i:  # the first run warms up (imports, connections, caches)
                        samples.append(turns / seconds)
                rates[name] = statistics.median(samples)
                print(f"bench=agent_endpoint side={name} turns={turns} "
                      f"turns_per_s={rates[name]:.1f} latency_ms={args.latency_ms:g} "
                      f"concurrency={args.concurrency * args.group_size}", flush=True)
        finally:
            await agent_task.aclose()
            await own_task.aclose()

    asyncio.run(run_all())
    if args.own_client:
        print(f"bench=agent_endpoint ratio_own_client="
              f"{rates['endpoint_own_client'] / rates['in_process']:.3f}")
    print(f"ratio={rates['endpoint'] / rates['in_process']:.3f}")


if __name__ == "__main__":
    main()
