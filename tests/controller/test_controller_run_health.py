"""Runs that look fine but are not: steps that trained nothing are counted and summed up in one
warning at the run's end; answers that collapse onto one are called out once; the
constant-answer baseline of a task with repeated answers (the real reasoning-gym task)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from torchtitan_rl.console import ERROR_LINE_LIMIT
from torchtitan_rl.controller.loop.constant_answer import constant_answer_baseline
from torchtitan_rl.controller.loop.run_health import (
    _ANSWER_CHARS,
    COLLAPSE_STEPS,
    RunHealth,
    answer_metrics,
)
from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutStatus, RolloutTurn

LOGGER = "torchtitan_rl.controller.loop.run_health"


def _group(group_id: int, answers: list[str], rewards: list[float], *,
           drop_reason: str | None = None, logprob: float = -0.5) -> RolloutGroup:
    rollouts = [Rollout(group_id=group_id, rollout_index=i, status=RolloutStatus.COMPLETED,
                        reward=reward, turns=[RolloutTurn(
                            turn_index=0, request_id=f"{group_id}/{i}", prompt_token_ids=[1],
                            completion_token_ids=[2, 3], completion_logprobs=[logprob, logprob],
                            policy_versions=[0, 0], finish_reason="stop",
                            completion_text=f" {answer}\n")])
                for i, (answer, reward) in enumerate(zip(answers, rewards, strict=True))]
    return RolloutGroup(group_id=group_id, episode=None, rollouts=rollouts,
                        dropped=drop_reason is not None, drop_reason=drop_reason)


def test_answer_metrics_count_distinct_answers_per_group_the_top_share_and_the_entropy():
    groups = [_group(0, ["a", "b", "a", "a"], [1, 0, 1, 1], logprob=-0.5),
              _group(1, ["a", "c", "d", "e"], [1, 0, 0, 0], logprob=-1.5)]
    metrics = answer_metrics(groups)
    assert metrics["rollout/answers_distinct_per_group"] == 3.0  # (2 + 4) / 2, stripped
    assert metrics["rollout/answers_top_share"] == 4 / 8  # "a"
    assert metrics["rollout/entropy_estimate"] == 1.0  # -mean(logprob) over the 16 tokens


def test_steps_that_train_nothing_are_counted_and_the_run_ends_with_one_warning(caplog):
    untrained: list[int] = []
    health = RunHealth(untrained)
    caplog.set_level(logging.INFO, logger=LOGGER)
    zero = [_group(0, ["x"] * 4, [0.0] * 4, drop_reason="zero_std"),
            _group(1, ["y"] * 4, [0.0] * 4, drop_reason="zero_std")]
    signal = [_group(2, ["x", "y", "z", "w"], [1.0, 0.0, 0.0, 0.0]),
              _group(3, ["x", "y", "z", "w"], [0.0, 1.0, 0.0, 0.0])]
    steps = [(zero, 0, False), (zero, 0, False), (signal, 8, False), (zero, 0, False),
             (signal, 8, True)]  # the last: a non-finite loss, the trainer kept the weights
    trained = [health.end_step(step, groups, num_samples=n, skipped=skipped)
               for step, (groups, n, skipped) in enumerate(steps)]
    assert untrained == [0, 1, 3, 4]
    assert [m["run/step_trained"] for m in trained] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [m["run/steps_trained"] for m in trained] == [0.0, 0.0, 1.0, 1.0, 1.0]
    per_step = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(per_step) == 4 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    health.warn_if_hollow()
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert message == (
        "4 of 5 steps trained nothing (3: zero reward spread in every group; 1: a non-finite loss "
        "(update skipped)): every rollout of a question got the same reward (mean 0.000): the "
        "task gives this model no learning signal; see "
        "docs/environments.md#which-datasets-give-the-demo-model-a-signal")
    assert len(message) <= ERROR_LINE_LIMIT  # the console shows it whole


def test_a_run_that_mostly_trained_says_nothing_at_its_end(caplog):
    health = RunHealth([])
    signal = [_group(0, ["x", "y"], [1.0, 0.0]), _group(1, ["x", "y"], [0.0, 1.0])]
    zero = [_group(0, ["x", "x"], [0.0, 0.0], drop_reason="zero_std")]
    for step, (groups, n) in enumerate([(signal, 4), (zero, 0), (signal, 4)]):
        health.end_step(step, groups, num_samples=n, skipped=False)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    health.warn_if_hollow()
    assert not caplog.records


def test_answers_collapsing_onto_one_across_questions_warn_once(caplog):
    health = RunHealth([])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    varied = [_group(0, ["1", "2", "1", "3"], [1, 0, 1, 0]), _group(1, ["1", "4", "5", "1"],
                                                                    [0, 1, 0, 0])]
    collapsed = [_group(0, ["1"] * 4, [1.0] * 4, drop_reason="zero_std"),
                 _group(1, ["1"] * 3 + ["2"], [0, 0, 0, 1])]  # 7 of 8 answer "1": 0.875
    fully = [_group(0, ["1"] * 4, [1.0] * 4, drop_reason="zero_std"),
             _group(1, ["1"] * 4, [0.0] * 4, drop_reason="zero_std")]
    health.end_step(0, varied, num_samples=8, skipped=False)
    health.end_step(1, collapsed, num_samples=4, skipped=False)  # below the share: not counted
    for step in range(2, 2 + COLLAPSE_STEPS - 1):
        health.end_step(step, fully, num_samples=0, skipped=False)
    assert not caplog.records and health.collapse is None  # one step short
    metrics = health.end_step(2 + COLLAPSE_STEPS - 1, fully, num_samples=0, skipped=False)
    assert metrics["rollout/answers_top_share"] == 1.0
    assert metrics["rollout/answers_distinct_per_group"] == 1.0
    [warning] = caplog.records
    assert warning.getMessage() == (
        "step 4: the answers collapsed: 100% of the rollouts answered '1' (1.0 distinct answers "
        "per group) whatever the question, 3 steps in a row; the reward (0.500) is what that "
        "answer scores (see validation's constant-answer baseline)")
    assert len(warning.getMessage()) + _ANSWER_CHARS <= ERROR_LINE_LIMIT  # a long answer too
    assert health.collapse is not None and health.collapse.to_data() == {
        "step": 2 + COLLAPSE_STEPS - 1, "answer": "1", "share": 1.0}
    health.end_step(10, fully, num_samples=0, skipped=False)
    assert len(caplog.records) == 1  # once a run


def test_the_constant_answer_baseline_plays_the_most_frequent_answer_through_the_env():
    from torchtitan_rl.envs.reasoning_gym import DatasetSpec, ReasoningGymTask

    task = ReasoningGymTask.Config(datasets=[DatasetSpec(name="letter_counting")]).build()
    episodes = task.dataset("validation")[:64]
    baseline = asyncio.run(asyncio.wait_for(constant_answer_baseline(task, episodes), 60))
    answers = [str(e.entries[0]["answer"]) for e in episodes]
    top = max(set(answers), key=answers.count)
    assert baseline is not None and baseline.answers == (top,)
    # letter_counting scores an exact count 1 and anything else 0: the share of that answer
    assert baseline.reward == pytest.approx(answers.count(top) / len(answers))
    assert baseline.describe() == f"the constant answer {top!r} scores {baseline.reward:.4f}"


def test_a_task_whose_every_answer_is_its_own_gives_no_baseline():
    from examples.alphabet_sort import AlphabetSortTask
    from tests.controller.letter_task import LetterTask

    sort_task = AlphabetSortTask.Config().build()
    assert asyncio.run(constant_answer_baseline(sort_task, sort_task.dataset("validation")[:16])
                       ) is None
    letters = LetterTask.Config().build()  # not a SupervisedTask: it cannot solve its episodes
    assert asyncio.run(constant_answer_baseline(letters, letters.dataset("validation")[:4])) is None
