"""RunningSum episodes: a chain of additions, fixed by (seed, split, index).

    turn 1 asks  "What is 3 + 4?"     expects  7
    turn 2 asks  "Add 5 to that."     expects  12   (the model's turn-1 answer + 5)
"""

from __future__ import annotations

import dataclasses
import random
import zlib

VALIDATION_BUCKETS = 8
"""One problem in this many (by a hash of its numbers) is held out for validation."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunningSumEpisode:
    """One episode: its numbers and what each turn asks. Immutable, since the Rollouter hands the
    same episode to every sibling rollout of a group; the rollout log records its episode_id."""

    episode_id: str
    operands: tuple[int, ...]
    """Turn 1 adds the first two; each later turn adds one more."""
    prompts: tuple[str, ...]
    """The user message of each turn."""

    @property
    def num_turns(self) -> int:
        return len(self.prompts)

    @property
    def totals(self) -> tuple[int, ...]:
        """The correct answer of each turn: the running sums."""
        sums = [self.operands[0] + self.operands[1]]
        for operand in self.operands[2:]:
            sums.append(sums[-1] + operand)
        return tuple(sums)


def is_validation(operands: tuple[int, ...]) -> bool:
    # A hash of the numbers alone, not of the episode index: the same problem can never turn up
    # in both splits, so validation measures problems the policy was never trained on.
    return zlib.crc32(repr(operands).encode()) % VALIDATION_BUCKETS == 0


def make_episode(*, seed: int, split: str, index: int, num_turns: int,
                 max_operand: int) -> RunningSumEpisode:
    """The episode at (seed, split, index). Its RNG is keyed by them alone, so any index is built
    without the ones before it."""
    rng = random.Random(f"running_sum/{seed}/{split}/{index}")
    for _ in range(10_000):  # draw until the problem belongs to this split (1 in 8 for validation)
        operands = tuple(rng.randint(0, max_operand) for _ in range(num_turns + 1))
        if is_validation(operands) == (split == "validation"):
            break
    else:
        raise ValueError(f"found no {split} problem with max_operand={max_operand}: too few")
    prompts = [f"What is {operands[0]} + {operands[1]}?"]
    prompts += [f"Add {operand} to that." for operand in operands[2:]]
    return RunningSumEpisode(episode_id=f"{split}/{index}", operands=operands,
                             prompts=tuple(prompts))
