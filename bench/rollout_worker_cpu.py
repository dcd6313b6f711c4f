"""What one Monarch message carrying a rollout group costs the controller: the call and the
unpickling of its reply (the RolloutGroup, shipped whole, and its packed samples). The worker pool
sends many groups a message each way (controller/rollout_workers/pool.py); this is the unit it amortises.

    python bench/rollout_worker_cpu.py [--groups 64] [--concurrency 16] [--turns 2]

A stand-in worker actor (one proc on this host) returns a `GroupOutcome` the size of the main
job's (alphabet_sort_cpu: 8 rollouts, ~2 turns, ~35 reply tokens a turn, prompts that grow with
the history; built with the real types and `rollout_group_to_training_samples`). The controller
calls it ``--groups`` times, ``--concurrency`` at a time (a step's groups), and measures its own
CPU (time.process_time: every thread, Monarch's too). Its idle CPU (Monarch's runtime, measured
over ``--idle-s`` first) is subtracted: what is left is what each group costs. Lines are key=value.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from monarch.actor import Actor, endpoint, this_host

from torchtitan_rl.controller.rollout_workers.worker import GroupOutcome
from torchtitan_rl.rollout import rollout_group_to_training_samples
from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutStatus, RolloutTurn


def make_outcome(group_size: int, turns: int, first_prompt_tokens: int,
                 reply_tokens: int) -> GroupOutcome:
    rollouts = []
    for r in range(group_size):
        prompt = list(range(first_prompt_tokens))
        rollout = Rollout(group_id=0, rollout_index=r, status=RolloutStatus.COMPLETED,
                          reward=r / group_size, advantage=r - group_size / 2)
        for t in range(turns):
            reply = list(range(1000, 1000 + reply_tokens))
            rollout.turns.append(RolloutTurn(
                turn_index=t, request_id=f"group=0/rollout={r}/turn={t}",
                prompt_token_ids=list(prompt), completion_token_ids=reply,
                completion_logprobs=[-0.5 - i * 1e-3 for i in range(reply_tokens)],
                policy_versions=[3] * reply_tokens, finish_reason="stop",
                completion_text="Alice, Bob, Carol", reward_parts={"turn_score": 0.5},
                env_messages=[{"role": "user", "content": "Now add: Dave"}]))
            prompt = prompt + reply + list(range(20))  # the env's reply, rendered
        rollouts.append(rollout)
    group = RolloutGroup(group_id=0, episode={"episode_id": "e0", "names": ["Alice", "Bob"]},
                         rollouts=rollouts)
    return GroupOutcome(key=0, group_id=0, group=group,
                        samples=rollout_group_to_training_samples(group), num_routed=[16])


class StandInWorker(Actor):
    def __init__(self, outcome: GroupOutcome) -> None:
        self.outcome = outcome

    @endpoint
    async def run_group(self, group_id: int) -> GroupOutcome:
        return self.outcome


async def main(args: argparse.Namespace) -> None:
    outcome = make_outcome(args.group_size, args.turns, args.first_prompt_tokens,
                           args.reply_tokens)
    turns_per_group = sum(len(r.turns) for r in outcome.group.rollouts)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    worker = procs.spawn("stand_in_worker", StandInWorker, outcome)
    await worker.run_group.call_one(0)  # warm: the proc and the connection are up

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.sleep(args.idle_s)
    idle_ms_per_s = 1e3 * (time.process_time() - cpu) / (time.perf_counter() - wall)

    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(group_id: int) -> None:
        async with semaphore:
            await worker.run_group.call_one(group_id)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(g) for g in range(args.groups)))
    cpu_ms, wall_s = 1e3 * (time.process_time() - cpu), time.perf_counter() - wall
    per_group_ms = (cpu_ms - idle_ms_per_s * wall_s) / args.groups
    print(f"bench=rollout_worker_cpu groups={args.groups} concurrency={args.concurrency} "
          f"turns_per_group={turns_per_group} idle_cpu_ms_per_s={idle_ms_per_s:.2f} "
          f"cpu_ms={cpu_ms:.1f} wall_s={wall_s:.3f} controller_cpu_ms_per_group={per_group_ms:.3f} "
          f"controller_cpu_ms_per_turn={per_group_ms / turns_per_group:.4f}", flush=True)
    await procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--first-prompt-tokens", type=int, default=120)
    parser.add_argument("--reply-tokens", type=int, default=35)
    parser.add_argument("--idle-s", type=float, default=5.0)
    asyncio.run(main(parser.parse_args()))
