"""A single-turn task on which even a random tiny model gets a reward with spread, so short
end-to-end runs really train: reward = share of the reply's letters that are in a..m.

It is a `torchtitan_rl.task.Task` defined only in tests: a job names it in TOML as
``[task] type = "tests.controller.letter_task:LetterTask"``. A test fixture, not an example.
"""

from __future__ import annotations

import dataclasses

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv
from torchtitan_rl.task import TaskConfig


class LetterEnv(MessageEnv):
    def __init__(self, prompt: str, broken: bool = False) -> None:
        self.prompt = prompt
        self.broken = broken

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": self.prompt}]

    async def step(self, assistant_message: Message) -> EnvStep:
        return EnvStep(done=True)

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        if self.broken:
            raise ValueError("this prompt's scorer is broken on purpose")
        letters = [c for c in "".join(replies).lower() if c.isalpha()]
        return sum(c <= "m" for c in letters) / len(letters) if letters else 0.0


class LetterTask(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        num_prompts: int = 64
        system_prompt: str | None = None
        broken_score_every: int = 0
        """Prompts whose index is 1 more than a multiple of this raise in score() (a task
        author's mistake: the failing-task tests). 1: every prompt. 0: none."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def dataset(self, split: str) -> list[str]:
        return [f"Write words, {split} prompt {i}:" for i in range(self.config.num_prompts)]

    def make_env(self, prompt: str) -> LetterEnv:
        broken = self.config.broken_score_every
        index = int(prompt.rstrip(":").rsplit(" ", 1)[1])
        return LetterEnv(prompt, broken=bool(broken) and index % broken == 1 % broken)
