"""The environment a task writes: it speaks chat messages and never sees tokens.

    TokenEnv --init()--> MessageEnv --prompt messages--> TokenEnv
    TokenEnv --step(assistant message)--> MessageEnv --EnvStep(messages, done, reward_parts)--> TokenEnv
    Rollouter --score(replies, reward_parts)--> MessageEnv --float--> Rollouter
    Rollouter --turn_rewards(replies, reward_parts)--> MessageEnv --[float per turn]--> Rollouter
              (only with rollouter.credit = "turn")
    Rollouter --close()--> MessageEnv (always, also after an error)

One MessageEnv serves exactly one rollout.
"""

from __future__ import annotations

import abc
import dataclasses

Message = dict[str, str]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str}."""


@dataclasses.dataclass(kw_only=True, slots=True)
class EnvStep:
    """The environment's answer to one assistant turn."""

    messages: list[Message] = dataclasses.field(default_factory=list)
    """New user/tool messages appended after the assistant message (empty when done)."""
    done: bool = False
    """True ends the rollout as COMPLETED."""
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Reward signals for this turn, recorded on the turn; score() decides what counts."""

    def __post_init__(self) -> None:
        for message in self.messages:
            if message.get("role") == "assistant":
                raise ValueError("EnvStep.messages may not hold assistant messages: the "
                                 "assistant's turns come from the generator")


class MessageEnv(abc.ABC):
    """A task's environment for one rollout."""

    @abc.abstractmethod
    async def init(self) -> list[Message]:
        """The opening messages (e.g. [system, user])."""

    @abc.abstractmethod
    async def step(self, assistant_message: Message) -> EnvStep:
        """React to one assistant message (its content is the decoded completion)."""

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        """The rollout's final reward from the assistant's reply per turn and the per-turn reward
        parts (one dict per reply; empty where the env was not stepped). Default: sum of all parts."""
        return float(sum(sum(parts.values()) for parts in reward_parts))

    def turn_rewards(self, replies: list[str], reward_parts: list[dict[str, float]]) -> list[float]:
        """Each turn's own reward, for per-turn credit (`rollouter.credit = "turn"`): one value
        per reply, on the scale of a one-turn episode's score (an env whose score averages its
        turns returns the turn scores, not their shares). Default: the sum of each turn's parts
        (what the default score sums)."""
        return [float(sum(parts.values())) for parts in reward_parts]

    async def close(self) -> None:  # noqa: B027 (optional hook: most envs hold nothing)
        """Release what the env holds. Default: nothing. Must be idempotent."""
