"""The rollout layer's records: group -> rollout -> turn.

    Rollouter --GenerateRequest--> GenerateFn --Completion--> Rollouter --completion--> TokenEnv
    one RolloutTurn per generate call; one Rollout per sibling; one RolloutGroup per prompt (episode)

Everything is plain data (lists, not tensors) so a group pickles cheaply across Monarch actors.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Any

from torchtitan_rl.types import FinishReason


class RolloutStatus(enum.StrEnum):
    """How a rollout ended."""

    COMPLETED = "completed"
    """The environment said done."""
    TRUNCATED_LENGTH = "truncated_length"
    """A completion hit its max_tokens, or the next prompt left no room in the rollout token budget."""
    TRUNCATED_MAX_TURNS = "truncated_max_turns"
    """The environment wanted another turn past the turn cap."""
    ERROR_TIMEOUT = "error_timeout"
    """An environment call ran past step_timeout_s."""
    ERROR_ENV = "error_env"
    """The environment raised (in init, step or scoring)."""
    ERROR_ABORT = "error_abort"
    """The generator dropped or aborted the request."""

    @property
    def is_error(self) -> bool:
        return self.value.startswith("error_")


def request_seed(base_seed: int, group_id: int, rollout_index: int, turn_index: int) -> int:
    """A 63-bit seed fixed by (base seed, group, rollout, turn) alone."""
    key = f"{base_seed}/{group_id}/{rollout_index}/{turn_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def request_id(group_id: int, rollout_index: int, turn_index: int) -> str:
    return f"group={group_id}/rollout={rollout_index}/turn={turn_index}"


def session_id(group_id: int, rollout_index: int) -> str:
    return f"group={group_id}/rollout={rollout_index}"


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutTurn:
    """One generate call and what the environment made of it."""

    turn_index: int
    request_id: str
    prompt_token_ids: list[int]
    """Exactly the tokens the generator received."""
    completion_token_ids: list[int]
    """Exactly the tokens the generator returned (the end-of-turn token included when sampled)."""
    completion_logprobs: list[float]
    """One per completion token, as the generator gave them (NaN kept: the trainer counts them)."""
    policy_versions: list[int]
    """Policy version that sampled each completion token."""
    finish_reason: FinishReason
    completion_text: str = ""
    """The completion decoded without special tokens: the assistant message the env saw."""
    env_messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """The environment's reply to this turn (empty when it was not stepped)."""
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per-turn reward signals the environment reported (empty when it was not stepped)."""
    drift: bool = False
    """True when re-rendering the whole history after this turn would not extend
    prompt + completion tokens (what a re-tokenising loop would have broken)."""
    reward: float | None = None
    """This turn's share of the rollout's reward (`MessageEnv.turn_rewards`); set with per-turn
    credit only."""
    advantage: float | None = None
    """This turn's own advantage (per-turn credit); None: its tokens take the rollout's."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens the generator took from its prefix cache (`CompletionMetrics`)."""
    num_special_tokens: int = 0
    """Special tokens (the tokenizer's, e.g. the pad <|endoftext|> or <|im_start|>) sampled inside
    the reply; the end-of-turn token that ends a stopped reply does not count. They are trained on
    like any token (banning them would change the sampled distribution the logprobs describe),
    so they are counted: `rollout/num_special_tokens_in_replies`."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Rollout:
    """One sibling of a group: its turns, how it ended, its score."""

    group_id: int
    rollout_index: int
    status: RolloutStatus
    turns: list[RolloutTurn] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    """The environment's final score; for errored rollouts the Rollouter's error_reward (or 0.0
    when they are excluded from training)."""
    advantage: float | None = None
    """Filled by the Rollouter; None means the rollout is excluded from training."""
    num_drift_events: int = 0
    error: str | None = None
    """One line saying what went wrong, for ERROR_* statuses."""

    @property
    def session_id(self) -> str:
        return session_id(self.group_id, self.rollout_index)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.completion_token_ids) for t in self.turns)

    @property
    def replies(self) -> list[str]:
        return [t.completion_text for t in self.turns]

    @property
    def num_special_tokens(self) -> int:
        return sum(t.num_special_tokens for t in self.turns)


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutGroup:
    """Siblings rolled out from one episode spec, scored, with group-relative advantages."""

    group_id: int
    episode: Any
    """The episode spec the group was built from (picklable; e.g. an AlphabetSortEpisode)."""
    rollouts: list[Rollout]
    dropped: bool = False
    """True when the group carries no learning signal; it then yields no training samples."""
    drop_reason: str | None = None
    """"zero_std" (all counted rewards equal) or "all_errored" (no rollout counted)."""

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def advantages(self) -> list[float | None]:
        return [r.advantage for r in self.rollouts]
