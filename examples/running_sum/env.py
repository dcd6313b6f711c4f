"""RunningSumEnv: the user side of one episode, and its reward.

    init()            -> [system?, user: "What is 3 + 4?"]
    step("7")         -> reward parts {"closeness": 1.0, "exact": 1.0}; user: "Add 5 to that."
    step("13")        -> reward parts {"closeness": 0.5, "exact": 0.0}; done
    score(...)        -> mean closeness over the episode's turns = 0.75
    turn_rewards(...) -> [1.0, 0.5]
"""

from __future__ import annotations

import re

from examples.running_sum.episode import RunningSumEpisode
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv


def first_integer(reply: str) -> int | None:
    match = re.search(r"-?\d+", reply)
    return int(match.group()) if match else None


def closeness(answer: int | None, expected: int) -> float:
    """1 when right, 1/2 when off by one, 1/3 when off by two, ...; 0 without a number. A wrong
    but close answer earns something, so a group of samples has a spread to learn from."""
    return 0.0 if answer is None else 1.0 / (1.0 + abs(answer - expected))


class RunningSumEnv(MessageEnv):
    def __init__(self, episode: RunningSumEpisode, *, system_prompt: str | None = None) -> None:
        self.episode = episode
        self._system_prompt = system_prompt
        self._turn = 0
        self._that: int | None = None  # what "that" is in the next prompt: the last answer

    async def init(self) -> list[Message]:
        messages: list[Message] = []
        if self._system_prompt:
            messages.append({"role": "system", "content": self._system_prompt})
        messages.append({"role": "user", "content": self.episode.prompts[0]})
        return messages

    async def step(self, assistant_message: Message) -> EnvStep:
        t = self._turn
        operands, totals = self.episode.operands, self.episode.totals
        # "Add 5 to that." adds to what the model said, right or wrong: each turn is judged on
        # its own addition, so a wrong first sum does not doom the second turn's reward. (After a
        # reply without a number, "that" is the true running total.)
        if t == 0 or self._that is None:
            expected = totals[t]
        else:
            expected = self._that + operands[t + 1]
        answer = first_integer(assistant_message["content"])
        self._that = answer
        self._turn += 1
        parts = {"closeness": closeness(answer, expected), "exact": float(answer == expected)}
        if self._turn == self.episode.num_turns:
            return EnvStep(done=True, reward_parts=parts)
        next_prompt = {"role": "user", "content": self.episode.prompts[self._turn]}
        return EnvStep(messages=[next_prompt], reward_parts=parts)

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        # "exact" is only logged (validation/turn_<t>/exact: the accuracy); the reward is the
        # closeness, averaged over every turn the episode has, so a rollout cut short (a reply
        # cut at max_tokens is never stepped: its parts are empty) scores 0 on the turns it lost.
        return sum(parts.get("closeness", 0.0) for parts in reward_parts) / self.episode.num_turns

    def turn_rewards(self, replies: list[str], reward_parts: list[dict[str, float]]) -> list[float]:
        # One value per turn reached, on the scale of a one-turn episode's score.
        return [parts.get("closeness", 0.0) for parts in reward_parts]
