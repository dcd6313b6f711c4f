"""The one-line descriptions of a task's mistakes: where it raised, what a reward was."""

from __future__ import annotations

import numpy as np
import pytest

from torchtitan_rl.rollout.task_errors import (
    RewardTypeError,
    describe_exception,
    reward_value,
    summarise_task_errors,
)


def _user_code() -> None:
    raise ValueError("bad episode")  # the site the description names


def test_an_exception_is_described_at_the_users_line() -> None:
    try:
        _user_code()
    except ValueError as e:
        text = describe_exception("step()", e)
    line = _user_code.__code__.co_firstlineno + 1
    assert text == ("step() raised ValueError('bad episode') at "
                    f"tests/rollout/test_rollout_task_errors.py:{line}")


@pytest.mark.parametrize("value", [None, "0.5", b"1", True, float("nan"), float("inf"), [1.0]])
def test_a_reward_that_is_not_a_finite_number_is_refused(value: object) -> None:
    with pytest.raises(RewardTypeError, match=r"score\(\) returned .*; a finite int or float is "
                                              r"required at .*test_rollout_task_errors.py:\d+ "):
        reward_value(value, "score()", _user_code)


def test_numbers_of_any_real_type_are_rewards() -> None:
    assert reward_value(1, "score()") == 1.0
    assert reward_value(np.float32(0.25), "score()") == 0.25
    assert reward_value(np.int64(3), "score()") == 3.0


def test_errors_are_summarised_by_the_most_frequent() -> None:
    errors = ["a raised X at f.py:1"] * 3 + ["b raised Y at g.py:2"]
    assert summarise_task_errors(errors, 10) == (
        "4 of 10 rollouts failed in the task: a raised X at f.py:1 (x3), and 1 other")
    assert summarise_task_errors(["e"], 2) == "1 of 2 rollouts failed in the task: e"
