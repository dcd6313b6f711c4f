"""Validation asks for no more episodes than the task's validation split holds."""

from __future__ import annotations

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.loop.validation import Validator


def test_num_prompts_beyond_the_validation_split_is_one_error_naming_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"validation.num_prompts=5: .* only 3 episodes"):
        Validator.Config(num_prompts=5).build(rollouter=None, dataset=["a", "b", "c"])


def test_num_prompts_up_to_the_split_is_accepted() -> None:
    validator = Validator.Config(num_prompts=3).build(rollouter=None, dataset=["a", "b", "c"])
    assert validator.enabled and validator.config.num_prompts == 3
