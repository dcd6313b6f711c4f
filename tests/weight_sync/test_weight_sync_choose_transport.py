"""Which transport a push takes to a generator (weight_sync.push.choose_transport): pure logic."""

from __future__ import annotations

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.weight_sync.push import choose_transport


def _choose(setting: str, generator_machine: str = "m1", separate_machines: bool = False):
    return choose_transport(setting, generator="generator_0", generator_machine=generator_machine,
                            trainer_machine="m1", separate_machines=separate_machines)


def test_auto_takes_shared_memory_on_the_trainers_machine_and_the_relay_elsewhere() -> None:
    assert _choose("auto") == ("shared_memory", "auto: on the trainer's machine")
    assert _choose("auto", "m2") == ("message", "auto: m2 is not the trainer's m1")
    assert _choose("auto", separate_machines=True) == (
        "message", "auto: its host simulates another machine (placement.kind='process')")
    assert _choose("message") == ("message", "trainer.weight_transport")


def test_shared_memory_to_another_machine_is_an_error_naming_the_generator() -> None:
    """Found once the generator runs (its machine is known then): a RuntimeError naming the
    setting; the placement that makes every host a machine is refused before any spawn."""
    assert _choose("shared_memory") == ("shared_memory", "trainer.weight_transport")
    with pytest.raises(RuntimeError, match="cannot reach generator_0: m2 is not the trainer's m1"):
        _choose("shared_memory", "m2")
    with pytest.raises(RuntimeError, match="simulates another machine"):
        _choose("shared_memory", separate_machines=True)
    with pytest.raises(ConfigError, match=r"^trainer.weight_transport='shared_memory' cannot "
                                          r"reach the generators of placement.kind='process'"):
        parse_args(RLJob.Config, ["--trainer.weight_transport", "shared_memory",
                                  "--placement.kind", "process"])
