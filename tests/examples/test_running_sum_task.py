"""RunningSum (examples/running_sum/, the task docs/tasks.md builds): episodes fixed
by (seed, split, index) with disjoint splits, the env's per-turn rewards, the warm start's solved
conversations scoring 1, and a whole group rolled out through Rollouter + TokenEnv in tokens."""

from __future__ import annotations

import asyncio
import pathlib
import pickle
from typing import Any

import pytest

from examples.running_sum import (
    RunningSumEnv,
    RunningSumEpisode,
    RunningSumTask,
    closeness,
    first_integer,
)
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.task import SupervisedTask
from torchtitan_rl.types import Completion, GenerateRequest, Sampling

RUN_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "run_configs"
EPISODE = RunningSumEpisode(episode_id="train/0", operands=(3, 4, 5),
                            prompts=("What is 3 + 4?", "Add 5 to that."))


def play(env: RunningSumEnv, replies: list[str]) -> tuple[list[dict[str, Any]], list[dict]]:
    """Drive ``env`` as TokenEnv would (stop at done); (messages seen, reward parts per reply)."""
    async def go() -> tuple[list[dict[str, Any]], list[dict]]:
        messages = list(await env.init())
        parts = []
        for reply in replies:
            step = await env.step({"role": "assistant", "content": reply})
            messages += [{"role": "assistant", "content": reply}, *step.messages]
            parts.append(step.reward_parts)
            if step.done:
                break
        await env.close()
        return messages, parts
    return asyncio.run(go())


def test_running_sum_episodes_are_fixed_by_seed_split_and_index() -> None:
    a, b = RunningSumTask.Config(seed=3).build(), RunningSumTask.Config(seed=3).build()
    other = RunningSumTask.Config(seed=4).build()
    late = b.dataset("train")[500]  # built first: no episode depends on the ones before it
    assert [a.dataset("train")[i] for i in range(501)][-1] == late
    assert [a.dataset("train")[i] for i in range(50)] == [b.dataset("train")[i] for i in range(50)]
    assert [a.dataset("train")[i] for i in range(50)] != [
        other.dataset("train")[i] for i in range(50)]
    episode = a.dataset("validation")[7]
    assert pickle.loads(pickle.dumps(episode)) == episode
    assert episode.episode_id == "validation/7"
    assert len(a.dataset("train")) == 100_000 and len(a.dataset("validation")) == 128
    with pytest.raises(IndexError):
        a.dataset("validation")[128]
    with pytest.raises(ValueError, match="split"):
        a.dataset("test")  # type: ignore[arg-type]


def test_running_sum_validation_problems_are_never_trained_on() -> None:
    task = RunningSumTask.Config(num_validation_episodes=500).build()
    train = {task.dataset("train")[i].operands for i in range(5000)}
    validation = {task.dataset("validation")[i].operands for i in range(500)}
    assert len(train) > 700 and len(validation) > 100  # of the 1000 problems with max_operand 9
    assert not train & validation


def test_running_sum_episode_shape() -> None:
    task = RunningSumTask.Config(num_turns=3, max_operand=20).build()
    for i in range(200):
        episode = task.dataset("train")[i]
        assert episode.num_turns == 3 and len(episode.operands) == 4
        assert all(0 <= n <= 20 for n in episode.operands)
        a, b, c, d = episode.operands
        assert episode.prompts == (f"What is {a} + {b}?", f"Add {c} to that.",
                                   f"Add {d} to that.")
        assert episode.totals == (a + b, a + b + c, a + b + c + d)
    with pytest.raises(ValueError, match="num_turns"):
        RunningSumTask.Config(num_turns=0)


def test_running_sum_reward_parsing() -> None:
    assert first_integer("12") == 12
    assert first_integer("it is 7, not 8") == 7
    assert first_integer("-3") == -3
    assert first_integer("seven") is None
    assert closeness(7, 7) == 1.0 and closeness(8, 7) == 0.5 and closeness(4, 7) == 0.25
    assert closeness(None, 7) == 0.0


def test_running_sum_env_judges_each_turn_on_its_own_addition() -> None:
    env = RunningSumEnv(EPISODE, system_prompt="Answer with a number.")
    messages, parts = play(env, ["7", "12"])
    assert messages == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Add 5 to that."},
        {"role": "assistant", "content": "12"},
    ]
    assert parts == [{"closeness": 1.0, "exact": 1.0}, {"closeness": 1.0, "exact": 1.0}]
    assert env.score(["7", "12"], parts) == 1.0

    # turn 1 wrong (8): "that" is 8, so 13 is turn 2's right answer and the true total 12 is not
    env = RunningSumEnv(EPISODE)
    _, parts = play(env, ["8", "13"])
    assert parts == [{"closeness": 0.5, "exact": 0.0}, {"closeness": 1.0, "exact": 1.0}]
    assert env.score(["8", "13"], parts) == 0.75
    assert env.turn_rewards(["8", "13"], parts) == [0.5, 1.0]
    _, parts = play(RunningSumEnv(EPISODE), ["8", "12"])
    assert parts[1] == {"closeness": 0.5, "exact": 0.0}

    # no number on turn 1: turn 2 is judged against the true running total
    _, parts = play(RunningSumEnv(EPISODE), ["no idea", "12"])
    assert parts == [{"closeness": 0.0, "exact": 0.0}, {"closeness": 1.0, "exact": 1.0}]


def test_running_sum_score_counts_turns_never_reached_as_zero() -> None:
    env = RunningSumEnv(EPISODE)
    # a reply cut at max_tokens is never stepped: the Rollouter passes it with empty parts
    parts = [{"closeness": 1.0, "exact": 1.0}, {}]
    assert env.score(["7", "1212121"], parts) == 0.5
    assert env.turn_rewards(["7", "1212121"], parts) == [1.0, 0.0]
    assert env.score(["7"], parts[:1]) == 0.5
    assert env.turn_rewards(["7"], parts[:1]) == [1.0]


def test_running_sum_solved_conversations_score_one() -> None:
    task = RunningSumTask.Config(num_turns=3, system_prompt="Add.").build()
    assert isinstance(task, SupervisedTask)
    for i in range(50):
        episode = task.dataset("train")[i]
        solved = task.solved_conversation(episode)
        assert solved[0] == {"role": "system", "content": "Add."}
        replies = [m["content"] for m in solved if m["role"] == "assistant"]
        env = task.make_env(episode)
        messages, parts = play(env, replies)
        assert messages == solved  # the env asks exactly what the warm start trains on
        assert env.score(replies, parts) == 1.0


def test_running_sum_toml_names_the_task_and_a_later_config_replaces_an_earlier_one() -> None:
    """scripts/train.sh passes --config run_configs/alphabet_sort_cpu.toml before the user's
    arguments: a second --config replaces the first (not merged into it)."""
    job = parse_args(RLJob.Config, ["--config", str(RUN_CONFIGS / "alphabet_sort_cpu.toml"),
                                    "--config", str(RUN_CONFIGS / "running_sum.toml"),
                                    "--task.max_operand", "5"]).config
    assert isinstance(job.task, RunningSumTask.Config)
    assert job.task.num_turns == 2 and job.task.max_operand == 5
    assert job.warm_start.group_by_length is False  # alphabet_sort_cpu.toml sets it true
    alone = parse_args(RLJob.Config, ["--config", str(RUN_CONFIGS / "running_sum.toml")]).config
    assert alone.task == RunningSumTask.Config(num_turns=2, max_operand=9)
    assert alone.rollouter.max_turns >= alone.task.num_turns


class ScriptedGenerate:
    """A GenerateFn that answers rollout r's turn t with ``replies[r][t]`` in tokens."""

    def __init__(self, tokenizer: Any, replies: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.replies = replies
        self.prompts: dict[str, list[int]] = {}

    async def __call__(self, request: GenerateRequest) -> Completion:
        _, rollout, turn = (int(part.split("=")[1]) for part in request.request_id.split("/"))
        self.prompts[request.request_id] = list(request.prompt_token_ids)
        text = self.replies[rollout][turn]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if len(ids) >= request.sampling.max_tokens:  # type: ignore[union-attr]
            ids, finish = ids[: request.sampling.max_tokens], "length"  # type: ignore[union-attr]
        else:
            ids.append(self.tokenizer.eos_token_id)
        return Completion(request_id=request.request_id,
                          prompt_token_ids=list(request.prompt_token_ids), token_ids=ids,
                          token_logprobs=[-1.0] * len(ids),
                          token_policy_versions=[0] * len(ids), finish_reason=finish)


def test_running_sum_group_through_rollouter_and_token_env(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = RunningSumTask.Config().build()
    episode = task.dataset("train")[0]
    a, b, c = episode.operands
    total = a + b
    rollouter = Rollouter.Config(group_size=4, max_turns=2, max_rollout_tokens=96,
                                 advantage_std="none", credit="turn",
                                 turn_discount=0.0).build(tokenizer=tokenizer,
                                                          make_env=task.make_env)
    generate = ScriptedGenerate(tokenizer, [
        [str(total), str(total + c)],            # right, right
        [str(total + 1), str(total + 1 + c)],    # off by one, then right about "that"
        ["no idea", str(total + c)],             # no number, then the true total
        [str(total), "1" * 20],                  # right, then cut at max_tokens
    ])
    group = asyncio.run(rollouter.run_group_rollouts(
        generate, episode, group_id=0, sampling=Sampling(max_tokens=8)))
    assert [r.reward for r in group.rollouts] == [1.0, 0.75, 0.5, 0.5]
    assert [[t.reward for t in r.turns] for r in group.rollouts] == [
        [1.0, 1.0], [0.5, 1.0], [0.0, 1.0], [1.0, 0.0]]
    # per-turn credit: each turn's own reward minus the mean of its siblings' same turn
    turn1_mean, turn2_mean = (1.0 + 0.5 + 0.0 + 1.0) / 4, (1.0 + 1.0 + 1.0 + 0.0) / 4
    assert [[t.advantage for t in r.turns] for r in group.rollouts] == [
        [pytest.approx(r1 - turn1_mean), pytest.approx(r2 - turn2_mean)]
        for r1, r2 in [(1.0, 1.0), (0.5, 1.0), (0.0, 1.0), (1.0, 0.0)]]

    # in tokens: turn 2's prompt is turn 1's prompt + the exact reply tokens + the env's message
    first = generate.prompts["group=0/rollout=0/turn=0"]
    second = generate.prompts["group=0/rollout=0/turn=1"]
    reply = group.rollouts[0].turns[0].completion_token_ids
    assert second[: len(first) + len(reply)] == first + reply
    assert tokenizer.decode(first) == (
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(second[len(first) + len(reply):]) == (
        f"\n<|im_start|>user\nAdd {c} to that.<|im_end|>\n<|im_start|>assistant\n")
