"""binary_search: GuessTheNumber by halving the range the game's hints leave.

    TextArenaTask.solved_conversation(episode):
        move = binary_search(messages)      messages: the game's turns (user) and earlier moves
        ... until the game ends
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"between (\d+) and (\d+)")
_MOVE = re.compile(r"\[(\d+)\]")


def binary_search(messages: list[dict[str, str]]) -> str:
    """The middle of the range still possible, as the game's ``[number]`` move."""
    low, high = (int(n) for n in _RANGE.search(messages[0]["content"]).groups())
    for move, answer in zip(messages[1::2], messages[2::2]):
        guess = int(_MOVE.search(move["content"]).group(1))
        if "higher" in answer["content"]:
            low = max(low, guess + 1)
        elif "lower" in answer["content"]:
            high = min(high, guess - 1)
    return f"[{(low + high) // 2}]"
