"""AlphabetSortTask: a `torchtitan_rl.task.SupervisedTask` (episodes, env factory, solutions).

    [task]
    type = "examples.alphabet_sort:AlphabetSortTask"     (a job names it in its TOML)

    controller: task = AlphabetSortTask.Config(...).build()
    controller: spec = task.dataset("train")[i]          (same spec for the same seed, split, i)
    Rollouter:  env = task.make_env(spec)                 (one MessageEnv per rollout)
    WarmStart:  task.solved_conversation(spec)            (training split only)

Validation episodes are held out (their own seed). Their names come from a pool reserved for
validation (``validation_names = "disjoint"``, the default: sorting names the policy never saw) or
from the training pool (``"shared"``, the main job's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from examples.alphabet_sort.env import AlphabetSortEnv
from examples.alphabet_sort.episode import (
    AlphabetSortEpisode,
    EpisodeShape,
    make_episode,
)
from examples.alphabet_sort.solutions import solved_conversation
from torchtitan_rl.assets.names import NameBank
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.message_env import Message
from torchtitan_rl.task import EpisodeSplit, TaskConfig

Split = Literal["train", "validation"]


class AlphabetSortDataset(EpisodeSplit[AlphabetSortEpisode]):
    """Episodes of one split; each built on demand from (seed, split, index)."""

    def __init__(self, pool: list[str], shape: EpisodeShape, *, seed: int, split: str,
                 num_episodes: int) -> None:
        super().__init__(split, num_episodes)
        self._pool = pool
        self._shape = shape
        self._seed = seed

    def episode(self, index: int) -> AlphabetSortEpisode:
        return make_episode(self._pool, self._shape, seed=self._seed, split=self.split,
                            index=index)


class AlphabetSortTask(Configurable):
    """Sort names alphabetically over 1..max_turns turns (see examples/alphabet_sort/episode.py)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        warm_start_independent_fields = ("validation_names", "num_validation_episodes",
                                         "similarity_power", "power_per_turn")

        seed: int = 0
        """Fixes every episode (turn counts, names, sort key, prompt placeholders)."""
        min_turns: int = 1
        """Fewest turns per episode (>= 1)."""
        max_turns: int = 3
        """Turns per episode, uniform in [min_turns, max_turns]."""
        min_names_per_turn: int = 1
        """Fewest new names per turn (>= 1)."""
        max_names_per_turn: int = 5
        """New names per turn, uniform in [min_names_per_turn, max_names_per_turn]."""
        similarity_power: int = 4
        """Exponent on the difflib similarity; higher = only near-perfect answers score."""
        power_per_turn: bool = True
        """Raise each turn's similarity to the power (then average), else average then raise."""
        num_train_episodes: int = 100_000
        """Episodes of the training split; training draws them in a shuffled order, epoch
        after epoch. >= 1."""
        num_validation_episodes: int = 256
        """Episodes of the held-out validation split; validation.num_prompts takes the first
        ones. >= 1."""
        names_seed: int = 0
        """Seed of the NameBank the name pools come from."""
        num_names: int = 2000
        """Names in the bank (train and validation pools together)."""
        validation_name_fraction: float = 0.2
        """Share of the bank reserved for validation episodes, in (0, 1)."""
        validation_names: Literal["disjoint", "shared"] = "disjoint"
        """disjoint: validation episodes use only the reserved names (no name was ever trained
        on: tests copying unseen strings). shared: validation episodes are still held out (their
        own seed, never trained on) but draw names from the training pool."""
        system_prompt: str | None = None
        """A system message opening every episode; None: no system message."""

        def __post_init__(self) -> None:
            for name in ("min_turns", "min_names_per_turn", "similarity_power",
                         "num_train_episodes", "num_validation_episodes"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.max_turns < self.min_turns:
                raise ValueError(f"max_turns must be >= min_turns ({self.min_turns}), "
                                 f"got {self.max_turns}")
            if self.max_names_per_turn < self.min_names_per_turn:
                raise ValueError(f"max_names_per_turn must be >= min_names_per_turn "
                                 f"({self.min_names_per_turn}), got {self.max_names_per_turn}")
            if not 0.0 < self.validation_name_fraction < 1.0:
                raise ValueError(f"validation_name_fraction must be in (0, 1), "
                                 f"got {self.validation_name_fraction}")
            need = self.max_turns * self.max_names_per_turn
            smallest = int(self.num_names * min(self.validation_name_fraction,
                                                1.0 - self.validation_name_fraction))
            if smallest < need:
                raise ValueError(f"num_names must give each split at least max_turns * "
                                 f"max_names_per_turn = {need} names, got {self.num_names} "
                                 f"(smaller split ~{smallest})")

    def __init__(self, config: Config) -> None:
        self.config = config
        bank = NameBank(seed=config.names_seed, num_names=config.num_names)
        train_pool, validation_pool = bank.split(config.validation_name_fraction)
        if config.validation_names == "shared":
            validation_pool = train_pool
        shape = EpisodeShape(
            min_turns=config.min_turns, max_turns=config.max_turns,
            min_names_per_turn=config.min_names_per_turn,
            max_names_per_turn=config.max_names_per_turn,
        )
        self._datasets = {
            "train": AlphabetSortDataset(train_pool, shape, seed=config.seed, split="train",
                                         num_episodes=config.num_train_episodes),
            "validation": AlphabetSortDataset(validation_pool, shape, seed=config.seed,
                                              split="validation",
                                              num_episodes=config.num_validation_episodes),
        }

    def dataset(self, split: Split) -> AlphabetSortDataset:
        if split not in self._datasets:
            raise ValueError(f"split must be one of {sorted(self._datasets)}, got {split!r}")
        return self._datasets[split]

    def solved_conversation(self, episode: AlphabetSortEpisode) -> list[Message]:
        return solved_conversation(episode, self.config.system_prompt)

    def make_env(self, episode: AlphabetSortEpisode) -> AlphabetSortEnv:
        return AlphabetSortEnv(
            episode, system_prompt=self.config.system_prompt,
            similarity_power=self.config.similarity_power,
            power_per_turn=self.config.power_per_turn,
        )
