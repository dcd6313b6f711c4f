"""The warm start's cache key: a task's warm-start-independent fields must be its own fields."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.job import _warm_start_fingerprint
from torchtitan_rl.task import TaskConfig


@dataclasses.dataclass(kw_only=True, slots=True)
class _Settings(TaskConfig):
    num_turns: int = 2
    num_validation_episodes: int = 8
    warm_start_independent_fields: ClassVar[tuple[str, ...]] = ("num_validation_episodes",)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Misspelt(_Settings):
    warm_start_independent_fields: ClassVar[tuple[str, ...]] = ("num_validation_episode",)


def test_an_independent_field_does_not_change_the_key_and_a_training_field_does() -> None:
    base = _warm_start_fingerprint(_Settings())
    assert _warm_start_fingerprint(_Settings(num_validation_episodes=99)) == base
    assert _warm_start_fingerprint(_Settings(num_turns=3)) != base


def test_a_misspelt_independent_field_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"_Misspelt.warm_start_independent_fields names "
                                          r"\['num_validation_episode'\]"):
        _warm_start_fingerprint(_Misspelt())
