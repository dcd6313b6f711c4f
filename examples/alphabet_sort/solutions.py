"""Solved AlphabetSort conversations: the supervised warm start's training data.

Each assistant turn is exactly the expected answer in the format the prompt asks for, so a model
fine-tuned on these learns the format and the copying; RL then has a signal to improve on.
"""

from __future__ import annotations

from examples.alphabet_sort.episode import AlphabetSortEpisode
from examples.alphabet_sort.reward import answer_tag


def solved_reply(episode: AlphabetSortEpisode, turn: int) -> str:
    tag = answer_tag(turn)
    lines = "\n".join(episode.ground_truths[turn])
    return f"<{tag}>\n{lines}\n</{tag}>"


def solved_conversation(
    episode: AlphabetSortEpisode, system_prompt: str | None = None
) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for turn, prompt in enumerate(episode.prompts):
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": solved_reply(episode, turn)})
    return messages
