"""The calculator agent (examples/calculator/, run_configs/reasoning_gym_tools.toml) and what it
needs from the library: `task.demonstration` as the warm start's data, solved conversations with
tools and tool calls rendered and masked as rollouts render them, and a tokenizer corpus that
holds the tools."""

from __future__ import annotations

import json

import pytest

from examples.calculator import TOOLS, calculate, demonstration
from torchtitan_rl.assets.tokenizer import load_tokenizer, task_corpus
from torchtitan_rl.assets.warm_start import _tokenize_with_assistant_mask
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob, _warm_start_fingerprint
from torchtitan_rl.rollout.agent_task import AgentTask

RUN_CONFIG = "run_configs/reasoning_gym_tools.toml"


def test_calculate_evaluates_integer_sums_only() -> None:
    assert calculate("4 - 1 - 7") == "-4"
    assert calculate("(12 + 30) - -3") == "45"
    assert calculate("2 * 3").startswith("error: not an expression of integers")
    assert calculate("__import__('os')").startswith("error:")
    assert calculate("4 -").startswith("error:")


def test_demonstrations_solve_the_run_configs_questions() -> None:
    from reasoning_gym import get_score_answer_fn

    job = parse_args(RLJob.Config, ["--config", RUN_CONFIG]).config
    task = job.task.build()
    assert isinstance(task, AgentTask)
    for episode in task.dataset("train")[:30]:
        solved = task.solved_conversation(episode)
        assert solved == demonstration(episode) and solved["tools"] == TOOLS
        user, call, result, answer = solved["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert expression in user["content"] and result["content"] == calculate(expression)
        entry = episode.entries[0]
        assert get_score_answer_fn("chain_sum")(answer["content"], entry) == 1.0
    # the warm start's cache is keyed by the agent's task (its demonstrations), not the episodes'
    assert _warm_start_fingerprint(job.task) != _warm_start_fingerprint(job.task.episodes)
    assert "examples.calculator:demonstration" in _warm_start_fingerprint(job.task)


def test_a_solved_conversation_with_tools_renders_and_masks_as_rollouts_do(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    job = parse_args(RLJob.Config, ["--config", RUN_CONFIG]).config
    task = job.task.build()
    solved = task.solved_conversation(task.dataset("train")[0])
    ids, mask = _tokenize_with_assistant_mask(tokenizer, solved)
    rendered = tokenizer.apply_chat_template(solved["messages"], tools=solved["tools"],
                                             tokenize=False)
    assert tokenizer.decode(ids) == rendered
    assert "# Tools" in rendered and '"name": "calculate"' in rendered
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    expression = solved["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert trained == ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
                       + expression + '"}}\n</tool_call><|im_end|>'
                       + solved["messages"][3]["content"] + "<|im_end|>")
    # the tool's result and the offered tools are the environment's tokens, never trained
    assert "<tool_response>" not in trained and "# Tools" not in trained


def test_task_corpus_holds_the_tools_and_tool_calls() -> None:
    job = parse_args(RLJob.Config, ["--config", RUN_CONFIG]).config
    task = job.task.build()
    train = task.dataset("train")
    corpus = task_corpus(lambda i: task.solved_conversation(train[i]), num_conversations=3)
    assert corpus[0] == json.dumps(TOOLS[0])
    assert any(line.startswith('assistant\n\n<tool_call>\n{"name": "calculate"') for line in corpus)


def test_demonstration_errors_name_the_key() -> None:
    from torchtitan_rl.envs.reasoning_gym import ReasoningGymTask

    episodes = ReasoningGymTask.Config(num_train_episodes=4, num_validation_episodes=4)
    with pytest.raises(ConfigError, match="task.demonstration = 'examples.calculator:nope'"):
        AgentTask.Config(agent="examples.calculator:run", episodes=episodes,
                         demonstration="examples.calculator:nope").build()
    with pytest.raises(ConfigError, match=r"task.demonstration = 'examples.calculator:run': it "
                                          r"must take \(episode\)"):
        AgentTask.Config(agent="examples.calculator:run", episodes=episodes,
                         demonstration="examples.calculator:run").build()
