"""Which prompt a group gets: a pure function of (seed, group id), so resume needs one integer.

Group ids are issued 0, 1, 2, ... . Group ``g`` belongs to epoch ``g // N`` (N prompts in the
dataset) and takes position ``g % N`` of that epoch's seeded permutation. Every prompt of an epoch
is therefore issued exactly once per epoch, and a group restarted after a crash gets the same
prompt (and, with request seeds derived from the group id, the same samples).
"""

from __future__ import annotations

import random


class DataCursor:
    def __init__(self, *, num_prompts: int, seed: int) -> None:
        if num_prompts < 1:
            raise ValueError(f"the dataset has no prompts (num_prompts={num_prompts})")
        self.num_prompts = num_prompts
        self.seed = seed
        self._orders: dict[int, tuple[int, ...]] = {}  # the last few epochs' orders

    def _epoch_order(self, epoch: int) -> tuple[int, ...]:
        if epoch not in self._orders:
            order = list(range(self.num_prompts))
            random.Random(f"{self.seed}/epoch={epoch}").shuffle(order)
            if len(self._orders) >= 4:
                del self._orders[min(self._orders)]
            self._orders[epoch] = tuple(order)
        return self._orders[epoch]

    def prompt_index(self, group_id: int) -> int:
        """The dataset index of the prompt that group ``group_id`` rolls out."""
        if group_id < 0:
            raise ValueError(f"group_id must be >= 0, got {group_id}")
        epoch, position = divmod(group_id, self.num_prompts)
        return self._epoch_order(epoch)[position]
