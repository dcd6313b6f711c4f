"""AlphabetSort episodes: generated offline, fixed by (seed, split, index).

An episode has 1..max_turns turns; each turn brings new names (drawn without replacement from the
split's name pool) and asks for the whole list so far, sorted by FIRST or LAST name; from turn 2 on the
new names are to be marked `` // new name!``. The spec holds the prompts and the ground truth, so an
episode is replayed and scored the same way wherever it goes.

Example (2 turns, by FIRST name):
    turn 0 shows  MarcChardin, AnaBo          expects  AnaBo, MarcChardin
    turn 1 shows  BenDu                       expects  AnaBo, BenDu // new name!, MarcChardin
"""

from __future__ import annotations

import dataclasses
import random

from examples.alphabet_sort.reward import COMBINED_TAG, FIRST_TAG, NEW_NAME_MARK
from torchtitan_rl.assets.names import split_name


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlphabetSortEpisode:
    """One episode: what each turn shows and what it expects. Picklable and immutable."""

    episode_id: str
    """``{split}/{index}``."""
    split: str
    index: int
    sort_by: str
    """"FIRST" or "LAST"."""
    turn_names: tuple[tuple[str, ...], ...]
    """New names per turn, in the (shuffled) order the prompt shows them."""
    ground_truths: tuple[tuple[str, ...], ...]
    """Expected answer lines per turn: everything so far, sorted; turn > 0 marks its new names."""
    prompts: tuple[str, ...]
    """The user message of each turn."""

    @property
    def num_turns(self) -> int:
        return len(self.turn_names)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeShape:
    min_turns: int
    max_turns: int
    min_names_per_turn: int
    max_names_per_turn: int


def sort_key(name: str, sort_by: str) -> tuple[str, str]:
    """Lowercased (chosen part, other part): names sharing the chosen part get a fixed order."""
    first, last = split_name(name)
    first, last = first.lower(), last.lower()
    return (first, last) if sort_by == "FIRST" else (last, first)


def make_episode(
    pool: list[str], shape: EpisodeShape, *, seed: int, split: str, index: int
) -> AlphabetSortEpisode:
    """The episode at (seed, split, index); its RNG is keyed by them alone, so any index can be
    built without the ones before it (resume by data position)."""
    rng = random.Random(f"alphabet_sort/{seed}/{split}/{index}")
    num_turns = rng.randint(shape.min_turns, shape.max_turns)
    counts = [rng.randint(shape.min_names_per_turn, shape.max_names_per_turn)
              for _ in range(num_turns)]
    drawn = rng.sample(pool, sum(counts))
    sort_by = rng.choice(["FIRST", "LAST"])

    turn_names: list[tuple[str, ...]] = []
    ground_truths: list[tuple[str, ...]] = []
    prompts: list[str] = []
    seen: list[str] = []
    for t, count in enumerate(counts):
        new = drawn[len(seen): len(seen) + count]
        seen += new
        ordered = sorted(seen, key=lambda n: sort_key(n, sort_by))
        marked = set(new) if t > 0 else set()
        ground_truths.append(tuple(n + NEW_NAME_MARK if n in marked else n for n in ordered))
        shown = list(new)
        rng.shuffle(shown)
        turn_names.append(tuple(shown))
        prompts.append(_prompt(rng, t, sort_by, shown, len(seen), shape))
    return AlphabetSortEpisode(
        episode_id=f"{split}/{index}", split=split, index=index, sort_by=sort_by,
        turn_names=tuple(turn_names), ground_truths=tuple(ground_truths), prompts=tuple(prompts),
    )


def _prompt(rng: random.Random, turn: int, sort_by: str, shown: list[str],
            num_seen: int, shape: EpisodeShape) -> str:
    names = ", ".join(shown)
    if turn == 0:
        # A random number of placeholder lines, so the model does not learn a fixed count.
        count = rng.randint(shape.min_names_per_turn, shape.max_names_per_turn)
        lines = "\n".join(f"Name{i}" for i in range(1, count + 1))
        return (f"Sort these names in alphabetical order by {sort_by} name: {names}\n\n"
                f"Use exactly this format:\n<{FIRST_TAG}>\n{lines}\n</{FIRST_TAG}>")
    text = (f"Now sort ALL of these names alphabetically by {sort_by} name: {names}\n\n"
            "These are in addition to the prior list. Mark any NEW names (that weren't in the "
            "prior list) with `// new name!` at the end.")
    if turn > 1:
        return text + " Follow the same format as before."
    count = rng.randint(shape.min_names_per_turn, num_seen)
    marked_after = rng.randint(0, count - 1)
    lines = "\n".join(f"Name{i}" + (NEW_NAME_MARK if i > marked_after else "")
                      for i in range(1, count + 1))
    return text + f"\n\nUse exactly this format:\n<{COMBINED_TAG}>\n{lines}\n</{COMBINED_TAG}>"
