"""What a task is: the episodes to train and validate on, and the environment that plays one.

    [task]                                        # the job config names the task class
    type = "examples.alphabet_sort:AlphabetSortTask"
    max_turns = 2                                 # and its own typed settings

    task = job.task.build()                       # a Configurable whose Config subclasses TaskConfig
    task.dataset("train")[i]   -> an episode spec (picklable)
    task.make_env(episode)     -> a MessageEnv the Rollouter plays against a GenerateFn
    task.solved_conversation(episode)             optional: the supervised warm start's data

The library never imports a task: the job's ``task`` field holds any subclass of `TaskConfig`, and
the config loader imports the class that ``type`` names (see config/convert.py).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeVar,
    overload,
    runtime_checkable,
)

from torchtitan_rl.config.configurable import Configurable

if TYPE_CHECKING:  # annotations only: the rollout package imports this module
    from torchtitan_rl.rollout.message_env import Message, MessageEnv

Split = Literal["train", "validation"]
EpisodeT = TypeVar("EpisodeT")


@dataclasses.dataclass(kw_only=True, slots=True)
class TaskConfig(Configurable.Config):
    """Base of every task's Config. In a TOML file, ``type`` names the task class."""

    polymorphic: ClassVar[bool] = True
    short_type_names: ClassVar[dict[str, str]] = {
        "reasoning_gym": "torchtitan_rl.envs.reasoning_gym:ReasoningGymTask",
        "textarena": "torchtitan_rl.envs.textarena:TextArenaTask",
    }
    """``type`` values that name the tasks this package ships (docs/environments.md)."""
    warm_start_independent_fields: ClassVar[tuple[str, ...]] = ()
    """Settings that do not change the training split's solved conversations (validation-only or
    reward-only ones): changing them keeps a cached warm start."""

    def warm_start_config(self) -> TaskConfig:
        """The config whose settings key the warm start's cache: this one; a task that takes
        its solved conversations from another task's (AgentTask) returns that one's, so both
        share one cached warm start."""
        return self


class Task(Protocol):
    def dataset(self, split: Split) -> Sequence[Any]:
        """The episode specs of a split, indexable; the same spec for the same (config, index)."""

    def make_env(self, episode: Any) -> MessageEnv:
        """A fresh environment for one rollout of ``episode``."""


@runtime_checkable
class SupervisedTask(Task, Protocol):
    """A task that can also solve its own episodes: what `WarmStart` trains on."""

    def solved_conversation(self, episode: Any) -> list[Message]:
        """The episode's conversation with every assistant turn answered correctly."""


class EpisodeSplit(Sequence[EpisodeT]):
    """The episodes of one split, each built on demand from its index by `episode`: nothing is
    held in memory, and a resumed run reads episode 5000 without making the ones before it.
    Indexing checks the bounds and takes slices."""

    def __init__(self, split: str, num_episodes: int) -> None:
        self.split = split
        self._len = num_episodes

    @abc.abstractmethod
    def episode(self, index: int) -> EpisodeT:
        """Episode ``index`` (0 <= index < len) of this split."""

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> EpisodeT: ...

    @overload
    def __getitem__(self, index: slice) -> list[EpisodeT]: ...

    def __getitem__(self, index: int | slice) -> EpisodeT | list[EpisodeT]:
        if isinstance(index, slice):
            return [self.episode(i) for i in range(*index.indices(self._len))]
        if not 0 <= index < self._len:
            raise IndexError(f"{self.split} episode index must be in [0, {self._len}), "
                             f"got {index}")
        return self.episode(index)
