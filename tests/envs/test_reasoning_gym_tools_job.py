"""run_configs/reasoning_gym_tools.toml through the whole stack (Monarch meshes, vLLM generator,
torchtitan trainer, the run's OpenAI-compatible endpoint, the real `openai` client, vLLM's hermes
tool parser), shrunk to two GRPO steps on the tiny model: reasoning-gym's chain_sum questions, a
tokenizer made from the task's own text, a warm start on the calculator agent's demonstrations,
and then the model's own tool calls parsed, run by the agent and trained."""

from __future__ import annotations

import json

import pytest

from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.train import main

pytestmark = pytest.mark.slow  # a whole job

NUM_STEPS = 2
GROUPS_PER_STEP = 2
GROUP_SIZE = 4


def test_the_warm_started_model_calls_the_tool_and_its_calls_are_trained(tmp_path, tiny_model_dir):
    config = parse_args(RLJob.Config, [
        "--config", "run_configs/reasoning_gym_tools.toml", "--output_dir", str(tmp_path),
        "--model.size", "tiny", "--model.assets_dir", str(tiny_model_dir.parent),
        "--warm_start.num_steps", "300", "--warm_start.num_conversations", "256",
        "--warm_start.cache_dir", str(tmp_path / "warmstart"),
        "--rollouter.group_size", str(GROUP_SIZE), "--loop.num_steps", str(NUM_STEPS),
        "--loop.groups_per_step", str(GROUPS_PER_STEP), "--validation.num_prompts", "4",
        "--generator.kv_cache_bytes", str(32 << 20), "--trainer.num_threads", "1",
        "--checkpoint.every_steps", "0", "--checkpoint.export_hf", "false",
        "--recorder.every_k_steps", "1",
        # the tiny model rarely answers right after so short a warm start: groups of equal
        # rewards are trained too, so the tool calls' tokens reach the trainer either way
        "--rollouter.drop_zero_std_groups", "false",
    ]).config
    summary = main(config)
    assert summary["steps"] == NUM_STEPS
    assert 0.0 <= summary["reward_after"] <= 1.0

    run_dir = tmp_path / "reasoning_gym_tools"
    # the warm start trained the model made with the task's own tokenizer
    (warm_started,) = (tmp_path / "warmstart").glob("*/tokenizer.json")
    made = {p.read_bytes() for p in tiny_model_dir.parent.glob("tiny-corpus*/tokenizer.json")}
    assert warm_started.read_bytes() in made

    rollouts = [json.loads(line) for line in
                (run_dir / "rollouts" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == NUM_STEPS * GROUPS_PER_STEP * GROUP_SIZE
    # A tool call the parser read and the agent ran: the first call's reply holds the call, and
    # the second call's new tokens hold the tool's result (only a parsed call gets one).
    with_tool = [r for r in rollouts if r["num_turns"] == 2
                 and "<tool_call>" in r["turns"][0]["completion_text"]
                 and "<tool_response>" in r["turns"][1]["prompt_added_text"]]
    assert len(with_tool) > len(rollouts) / 2, [r["turns"][0]["completion_text"]
                                                for r in rollouts]
    assert all(r["prompt_text"].count("arithmetic problem") == 1 for r in rollouts)
    assert any('"name": "calculate"' in r["prompt_text"] for r in rollouts)  # the offered tool
    # ... and their tokens were trained: their samples are in the steps' trained samples
    trained = {sample for line in (run_dir / "trained_samples.jsonl").read_text().splitlines()
               for sample in json.loads(line)["sample_ids"]}
    assert all(r["group_dropped"] is None for r in with_tool)
    for rollout in with_tool:
        assert any(s.startswith(rollout["sample_id"] + "/") or s == rollout["sample_id"]
                   for s in trained), rollout["sample_id"]
