"""RunningSumTask: a `torchtitan_rl.task.SupervisedTask` (episodes, env, solved conversations).

    [task]
    type = "examples.running_sum:RunningSumTask"
    num_turns = 2
"""

from __future__ import annotations

from dataclasses import dataclass

from examples.running_sum.env import RunningSumEnv
from examples.running_sum.episode import RunningSumEpisode, make_episode
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.message_env import Message
from torchtitan_rl.task import EpisodeSplit, Split, TaskConfig


class RunningSumTask(Configurable):
    """Add numbers over several turns: "What is 3 + 4?", then "Add 5 to that."."""

    @dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        # Changing these does not change the training conversations: a cached warm start stays.
        warm_start_independent_fields = ("num_validation_episodes",)

        seed: int = 0
        """Fixes every episode's numbers."""
        num_turns: int = 2
        """Turn 1 asks for a sum of two numbers; each later turn adds one more to "that"."""
        max_operand: int = 9
        """Numbers are drawn uniformly from [0, max_operand]."""
        num_train_episodes: int = 100_000
        """Length of the training split (episodes repeat: max_operand 9 and 2 turns give 1000
        problems)."""
        num_validation_episodes: int = 128
        """Length of the validation split, drawn from the held-out eighth of the problems."""
        system_prompt: str | None = None
        """A system message opening every episode; None opens with the question."""

        def __post_init__(self) -> None:
            for name in ("num_turns", "max_operand", "num_train_episodes",
                         "num_validation_episodes"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def __init__(self, config: Config) -> None:
        self.config = config

    def dataset(self, split: Split) -> RunningSumDataset:
        sizes = {"train": self.config.num_train_episodes,
                 "validation": self.config.num_validation_episodes}
        if split not in sizes:
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        return RunningSumDataset(self.config, split, sizes[split])

    def make_env(self, episode: RunningSumEpisode) -> RunningSumEnv:
        return RunningSumEnv(episode, system_prompt=self.config.system_prompt)

    def solved_conversation(self, episode: RunningSumEpisode) -> list[Message]:
        """The warm start's data: the episode with every turn answered right."""
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        for prompt, total in zip(episode.prompts, episode.totals):
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": str(total)})
        return messages


class RunningSumDataset(EpisodeSplit[RunningSumEpisode]):
    """The episodes of one split, each built on demand from its index (`EpisodeSplit` checks
    the index and takes slices)."""

    def __init__(self, config: RunningSumTask.Config, split: Split, num_episodes: int) -> None:
        super().__init__(split, num_episodes)
        self._config = config

    def episode(self, index: int) -> RunningSumEpisode:
        return make_episode(seed=self._config.seed, split=self.split, index=index,
                            num_turns=self._config.num_turns,
                            max_operand=self._config.max_operand)
