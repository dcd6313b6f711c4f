"""CamelCased two-part names ("MarcChardin"), generated offline and deterministically by seed.

Upstream AlphabetSort draws arXiv author names from a hub dataset; no hub is reachable here, so the
names are built from syllables. First and last name split at the first uppercase letter after index 0.
"""

from __future__ import annotations

import random

_ONSETS = ["b", "br", "c", "ch", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s",
           "sh", "st", "t", "th", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "rd", "th", "x"]


class NameBank:
    """A fixed pool of distinct CamelCased names, the same for the same seed."""

    def __init__(self, *, seed: int = 0, num_names: int = 2000) -> None:
        rng = random.Random(f"names-{seed}")
        names: set[str] = set()
        while len(names) < num_names:
            names.add(self._part(rng) + self._part(rng))
        self._names = sorted(names)
        random.Random(f"order-{seed}").shuffle(self._names)

    @staticmethod
    def _part(rng: random.Random) -> str:
        syllables = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 2))
        ) + rng.choice(_CODAS)
        return syllables.capitalize()

    def all_names(self) -> list[str]:
        return list(self._names)

    def split(self, validation_fraction: float = 0.2) -> tuple[list[str], list[str]]:
        """Disjoint (train, validation) name pools."""
        cut = int(len(self._names) * (1.0 - validation_fraction))
        return self._names[:cut], self._names[cut:]


def split_name(name: str) -> tuple[str, str]:
    """("Marc", "Chardin") for "MarcChardin": split at the first uppercase letter after index 0."""
    for i in range(1, len(name)):
        if name[i].isupper():
            return name[:i], name[i:]
    return name, ""
