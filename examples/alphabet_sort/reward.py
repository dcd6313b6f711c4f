"""AlphabetSort reward: per-turn difflib similarity of the answer block to the expected lines.

Turn t's answer lives in ``<alphabetical_sorted>`` (t = 0) or ``<combined_alphabetical_sorted>``
(t > 0). Every block in a reply is an attempt, scored on its non-empty lines, stripped and lowercased,
against the expected lines (same cleaning): ``SequenceMatcher(None, pred, expected).ratio()``, 0 when
either side is empty. No block: 0. One block: its score. Several: the last score only if every attempt
strictly improves on the one before, else 0. With ``power_per_turn`` each turn's score is raised to
``similarity_power`` and the reward is their mean over the EXPECTED turns (a turn never reached
scores 0); without it the raw similarities are averaged and the power is applied once.

Example: expected [["AnaBo", "MarcChardin"]], reply "<alphabetical_sorted>\nAnaBo\nMarcChardin\n
</alphabetical_sorted>" -> 1.0; the same two lines swapped -> similarity < 1, then ** 4.
"""

from __future__ import annotations

import difflib
import re

FIRST_TAG = "alphabetical_sorted"
COMBINED_TAG = "combined_alphabetical_sorted"
NEW_NAME_MARK = " // new name!"


def answer_tag(turn_index: int) -> str:
    return FIRST_TAG if turn_index == 0 else COMBINED_TAG


def answer_blocks(reply: str, tag: str) -> list[str]:
    """The contents of every ``<tag>...</tag>`` block, in order."""
    return re.findall(f"<{tag}>(.*?)</{tag}>", reply, re.DOTALL)


def _clean(lines: list[str]) -> str:
    return "\n".join(line.strip().lower() for line in lines if line.strip())


def block_similarity(block: str, expected: list[str]) -> float:
    """difflib ratio of the block's cleaned lines to the expected lines; 0 if either is empty."""
    predicted, wanted = _clean(block.split("\n")), _clean(expected)
    if not predicted or not wanted:
        return 0.0
    return difflib.SequenceMatcher(None, predicted, wanted).ratio()


def turn_score(reply: str, expected: list[str], turn_index: int, *, power: int) -> float:
    """One turn's score (attempts rule included), each attempt raised to ``power`` first."""
    scores = [block_similarity(b, expected) ** power
              for b in answer_blocks(reply, answer_tag(turn_index))]
    if not scores:
        return 0.0
    if any(later <= earlier for earlier, later in zip(scores, scores[1:])):
        return 0.0
    return scores[-1]


def alphabet_sort_reward(
    replies: list[str],
    ground_truths: list[list[str]],
    *,
    similarity_power: int = 4,
    power_per_turn: bool = True,
) -> float:
    """The rollout's reward in [0, 1]; replies past the expected turns are ignored."""
    if similarity_power < 1:
        raise ValueError(f"similarity_power must be >= 1, got {similarity_power}")
    num_turns = len(ground_truths)
    if num_turns == 0:
        return 0.0
    power = similarity_power if power_per_turn else 1
    total = sum(
        turn_score(reply, list(expected), t, power=power)
        for t, (reply, expected) in enumerate(zip(replies, ground_truths))
    )
    mean = total / num_turns
    return mean if power_per_turn else mean ** similarity_power
