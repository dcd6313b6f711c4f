"""Group advantages: the sample std (Bessel) by default, as verl and TRL divide; population and
mean-only (Dr. GRPO) by name; the old ``std_normalize`` key says where it went."""

from __future__ import annotations

import math
import random

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import config_from_toml_text, parse_args
from torchtitan_rl.rollout.advantage import STD_EPS, group_advantages
from torchtitan_rl.rollout.rollouter import Rollouter


def _by_hand(values: list[float], ddof: int) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))
    return [(v - mean) / (std + STD_EPS) for v in values]


def test_sample_std_matches_a_hand_computation() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25]
    # mean 0.4375; squared deviations 0.31640625 + 0.19140625 + 0.00390625 + 0.03515625 = 0.546875
    # sample variance 0.546875 / 3, std 0.4269563...
    std = math.sqrt(0.546875 / 3)
    advantages, reason = group_advantages(rewards, [True] * 4, advantage_std="sample")
    assert reason is None
    assert advantages == pytest.approx([(r - 0.4375) / (std + STD_EPS) for r in rewards],
                                       rel=1e-12)
    assert advantages == pytest.approx(_by_hand(rewards, ddof=1), rel=1e-12)


def test_population_and_none_and_random_groups() -> None:
    rng = random.Random(0)
    for _ in range(50):
        rewards = [rng.random() for _ in range(rng.randint(2, 9))]
        counted = [True] * len(rewards)
        sample, _ = group_advantages(rewards, counted, advantage_std="sample")
        population, _ = group_advantages(rewards, counted, advantage_std="population")
        none, _ = group_advantages(rewards, counted, advantage_std="none")
        assert sample == pytest.approx(_by_hand(rewards, ddof=1), rel=1e-9)
        assert population == pytest.approx(_by_hand(rewards, ddof=0), rel=1e-9)
        mean = sum(rewards) / len(rewards)
        assert none == pytest.approx([r - mean for r in rewards], rel=1e-12)


def test_uncounted_rollouts_and_signal_less_groups() -> None:
    # the docstring's example
    advantages, reason = group_advantages([1, 0, 0.5, 0.2], [True, True, True, False],
                                          advantage_std="none")
    assert advantages == [0.5, -0.5, 0.0, None] and reason is None
    advantages, _ = group_advantages([1, 0, 0.5, 0.2], [True, True, True, False],
                                     advantage_std="sample")
    assert advantages[:3] == pytest.approx([0.5 / (0.5 + STD_EPS), -0.5 / (0.5 + STD_EPS), 0.0])
    assert advantages[3] is None
    # one counted reward: zero spread (not an undefined sample std)
    assert group_advantages([0.7, 0.1], [True, False], advantage_std="sample") == (
        [0.0, None], "zero_std")
    assert group_advantages([0.3] * 4, [True] * 4, advantage_std="sample") == (
        [0.0] * 4, "zero_std")
    assert group_advantages([0.3, 0.1], [False, False], advantage_std="sample") == (
        [None, None], "all_errored")
    with pytest.raises(ValueError, match="advantage_std"):
        group_advantages([1.0, 0.0], [True, True], advantage_std="bessel")  # type: ignore[arg-type]


def test_default_is_sample_and_the_old_key_names_its_replacement() -> None:
    assert Rollouter.Config().advantage_std == "sample"
    from torchtitan_rl.controller.job import RLJob

    with pytest.raises(ConfigError) as e:
        config_from_toml_text(RLJob.Config, "[rollouter]\nstd_normalize = false\n")
    assert str(e.value).startswith("rollouter.std_normalize: renamed rollouter.advantage_std")
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--rollouter.std_normalize", "true"])
    assert "rollouter.advantage_std" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="expected one of 'sample', 'population', 'none'"):
        parse_args(RLJob.Config, ["--rollouter.advantage_std", "bessel"])


def test_the_main_job_keeps_the_mean_baseline() -> None:
    """The main job (docs/main_job.md) was measured with the mean baseline only: it stays so."""
    import pathlib

    from torchtitan_rl.controller.job import RLJob

    root = pathlib.Path(__file__).resolve().parents[2]
    config = parse_args(RLJob.Config,
                        ["--config", str(root / "run_configs" / "alphabet_sort_cpu.toml")]).config
    assert config.rollouter.advantage_std == "none"
