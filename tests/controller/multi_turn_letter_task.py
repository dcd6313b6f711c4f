"""LetterTask over several turns: after each reply but the last the env answers with a user
message (``Turn k: more words:``), so every rollout whose replies stop (not cut at max_tokens)
has exactly ``num_turns`` assistant turns, even with an untrained model. Reward: the share of
all replies' letters that are in a..m (spread even for a random tiny model); each turn reports
its own reply's share as the reward part ``a_to_m`` (per-turn credit, per-turn validation).

A test fixture (``[task] type = "tests.controller.multi_turn_letter_task:MultiTurnLetterTask"``),
not an example.
"""

from __future__ import annotations

import dataclasses

from tests.controller.letter_task import LetterEnv
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.message_env import EnvStep, Message
from torchtitan_rl.task import TaskConfig


def letter_share(reply: str) -> float:
    """This reply's share of letters in a..m (its per-turn reward part, ``a_to_m``)."""
    letters = [c for c in reply.lower() if c.isalpha()]
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.0


def env_message(turn: int) -> str:
    """The user message the env sends before assistant turn ``turn`` (1-based, >= 2)."""
    return f"Turn {turn}: more words:"


class MultiTurnLetterEnv(LetterEnv):
    def __init__(self, prompt: str, num_turns: int) -> None:
        super().__init__(prompt)
        self.num_turns = num_turns
        self.replies = 0

    async def step(self, assistant_message: Message) -> EnvStep:
        self.replies += 1
        parts = {"a_to_m": letter_share(assistant_message["content"])}
        if self.replies >= self.num_turns:
            return EnvStep(done=True, reward_parts=parts)
        return EnvStep(messages=[{"role": "user", "content": env_message(self.replies + 1)}],
                       reward_parts=parts)


class MultiTurnLetterTask(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        num_prompts: int = 64
        num_turns: int = 3
        """Assistant turns per episode (the env ends the episode after this many replies)."""

        def __post_init__(self) -> None:
            if self.num_turns < 1:
                raise ValueError(f"num_turns must be >= 1, got {self.num_turns}")

    def __init__(self, config: Config) -> None:
        self.config = config

    def dataset(self, split: str) -> list[str]:
        return [f"Write words, {split} prompt {i}:" for i in range(self.config.num_prompts)]

    def make_env(self, prompt: str) -> MultiTurnLetterEnv:
        return MultiTurnLetterEnv(prompt, self.config.num_turns)
