"""Staleness control for asynchronous training: which groups may start, and which must be trained now.

Symbols: ``P`` prompt groups per training step, ``S`` = ``max_staleness``, ``t`` the number of
optimizer steps whose weights have been published to every generator (the policy version new
requests are served with). A group *admitted* at version ``w`` produces tokens of version >= w.

Admission (capacity)::

    num_admitted <= (S + 1 + t) * P                       (checked on every event)

Consumption: step ``t`` takes exactly P finished groups (trained, or dropped for zero reward spread:
both count). A group's deadline is ``admit_version + S``. Step t MUST take every group whose
deadline is t ("due"), waiting for it if it still runs; the rest are finished groups, earliest
deadline first, so finished groups overtake stragglers. A selection is taken only if it leaves every
later step feasible: for each d in (t, t + S], at most (d - t) * P unconsumed groups have deadline
<= d (later admissions have deadlines > t + S, and the capacity bounds those). Otherwise the step
waits for more groups to finish. Hence the guarantee::

    every group consumed at step t was admitted at version >= t - S      (asserted on consume)

Feasibility at step t - 1 (d = t) is exactly "at most P groups are due at step t", and when every
group has finished, earliest-deadline-first is feasible, so waiting always ends. With S = 0 the gate admits
exactly groups ``t*P .. (t+1)*P - 1`` at version t and step t consumes exactly those: the
synchronous loop, step for step. (The capacity formula is SkyRL's ``accepted + running <=
(S + step + 1) * B``; the "due" rule turns its aggregate bound into a per-group one.)

Dynamic sampling (DAPO's, ``replacements_per_version`` > 0): a group that finishes without a
learning signal (``finish(..., replaceable=True)``) leaves the gate at once, uncounted, and frees
its slot, so the producer admits a new group at the current version in its place; at most
``replacements_per_version`` such groups while the generators serve one version, after which a
dropped group counts toward its step as it does without replacement. The replaced groups drop out
of every count above (capacity: ``num_admitted - num_replaced``), so the guarantee holds as
stated. With S = 0 the groups a step trains are the first ones (by id) of version t that have a
signal, whatever order the groups finish in; only which dropped group stays once the
replacements run out depends on that order, and it trains nothing.

Invariant of the counters, checked on every event::

    num_admitted == (running + finished, not yet consumed) + num_consumed + num_replaced
    num_admitted - num_replaced <= capacity
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Generic, TypeVar

from torchtitan_rl.config.configurable import Configurable

ResultT = TypeVar("ResultT")


class GroupPhase(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CONSUMED = "consumed"


@dataclasses.dataclass(slots=True)
class _Entry(Generic[ResultT]):
    group_id: int
    admit_version: int
    phase: GroupPhase = GroupPhase.RUNNING
    result: ResultT | None = None


class StalenessGate(Configurable, Generic[ResultT]):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        max_staleness: int = 1
        """S: a group admitted at policy version v is trained at a step <= v + S. 0 = synchronous,
        1 = one-step-off."""

        def __post_init__(self) -> None:
            if self.max_staleness < 0:
                raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def __init__(self, config: Config, *, groups_per_step: int, policy_version: int = 0,
                 first_group_id: int = 0, replacements_per_version: int = 0) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.config = config
        self.groups_per_step = groups_per_step
        self.policy_version = policy_version
        """t: steps published to the generators."""
        self.num_consumed = policy_version * groups_per_step
        self.num_admitted = self.num_consumed
        self.num_replaced = 0
        """Groups that left without a signal and were replaced (dynamic sampling)."""
        self.replacements_per_version = replacements_per_version
        self._replacements_left = replacements_per_version
        self._next_group_id = first_group_id
        self._entries: dict[int, _Entry[ResultT]] = {}
        self._changed = asyncio.Condition()

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return (self.config.max_staleness + 1 + self.policy_version) * self.groups_per_step

    @property
    def num_admitted_live(self) -> int:
        """Admitted groups that were not replaced: each is or will be consumed by a step."""
        return self.num_admitted - self.num_replaced

    def can_admit(self) -> bool:
        return self.num_admitted_live < self.capacity

    @property
    def num_running(self) -> int:
        return sum(e.phase is GroupPhase.RUNNING for e in self._entries.values())

    # ---- events (every one re-checks the invariants and wakes waiters) -------------------------
    async def admit(self, limit: int | None = None) -> tuple[int, int]:
        """Wait for capacity (and, with ``limit``, for fewer than ``limit`` live groups: a run's
        last groups; a replaced one frees a slot again); returns (group_id, admit_version) of
        the newly admitted group."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.can_admit() and (limit is None or self.num_admitted_live < limit))
            group_id = self._next_group_id
            self._next_group_id += 1
            self._entries[group_id] = _Entry(group_id=group_id, admit_version=self.policy_version)
            self.num_admitted += 1
            self._check_unlocked()
            self._changed.notify_all()
            return group_id, self.policy_version

    async def readmit(self, group_id: int, admit_version: int) -> None:
        """Re-register a group that was in flight at a checkpoint (restarted from its prompt)."""
        async with self._changed:
            self._entries[group_id] = _Entry(group_id=group_id, admit_version=admit_version)
            self.num_admitted += 1
            self._next_group_id = max(self._next_group_id, group_id + 1)
            self._check_unlocked()
            self._changed.notify_all()

    async def finish(self, group_id: int, result: ResultT, *, replaceable: bool = False) -> bool:
        """Mark a group finished; True when it was ``replaceable`` (no learning signal) and left
        the gate for a new group (dynamic sampling), False when it waits for its step."""
        async with self._changed:
            entry = self._entries[group_id]
            assert entry.phase is GroupPhase.RUNNING, f"group {group_id} finished twice"
            replaced = replaceable and self._replacements_left > 0
            if replaced:
                del self._entries[group_id]
                self.num_replaced += 1
                self._replacements_left -= 1
            else:
                entry.phase, entry.result = GroupPhase.FINISHED, result
            self._check_unlocked()
            self._changed.notify_all()
            return replaced

    async def take_step_groups(self, step: int) -> list[tuple[int, int, ResultT]]:
        """The P groups step ``step`` trains on: every due group, then the oldest finished ones.
        Returns (group_id, admit_version, result) sorted by group id."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._selection_unlocked(step) is not None)
            chosen = self._selection_unlocked(step)
            assert chosen is not None
            taken = []
            for entry in chosen:
                assert entry.admit_version >= step - self.config.max_staleness, (
                    f"group {entry.group_id} admitted at v{entry.admit_version} trained at "
                    f"step {step} > v + S ({self.config.max_staleness})"
                )
                entry.phase = GroupPhase.CONSUMED
                del self._entries[entry.group_id]
                taken.append((entry.group_id, entry.admit_version, entry.result))
            self.num_consumed += len(taken)
            self._check_unlocked()
            self._changed.notify_all()
            return taken

    async def publish_policy_version(self, policy_version: int) -> None:
        """The generators now serve ``policy_version``: capacity grows by P per version."""
        async with self._changed:
            assert policy_version >= self.policy_version, (
                f"policy version went back: {self.policy_version} -> {policy_version}")
            self.policy_version = policy_version
            self._replacements_left = self.replacements_per_version
            self._check_unlocked()
            self._changed.notify_all()

    # ---- state for checkpoints -----------------------------------------------------------------
    def in_flight(self) -> list[tuple[int, int]]:
        """(group_id, admit_version) of every admitted, unconsumed group."""
        return sorted((e.group_id, e.admit_version) for e in self._entries.values())

    def finished_results(self) -> dict[int, ResultT]:
        return {g: e.result for g, e in self._entries.items() if e.phase is GroupPhase.FINISHED}

    @property
    def next_group_id(self) -> int:
        return self._next_group_id

    # ---- internals (the caller holds the condition's lock) -------------------------------------
    def _selection_unlocked(self, step: int) -> list[_Entry[ResultT]] | None:
        """Earliest-deadline-first over finished groups (deadline = admit_version + S), taking
        every due group, and only a selection that keeps every later step feasible."""
        S, P = self.config.max_staleness, self.groups_per_step
        entries = list(self._entries.values())
        due = [e for e in entries if e.admit_version + S <= step]
        if any(e.phase is GroupPhase.RUNNING for e in due):
            return None
        assert len(due) <= P, f"{len(due)} due groups exceed the {P} of a step"
        candidates = sorted(
            (e for e in entries if e.phase is GroupPhase.FINISHED and e.admit_version + S > step),
            key=lambda e: (e.admit_version, e.group_id),
        )
        if len(candidates) < P - len(due):
            return None
        chosen = due + candidates[: P - len(due)]
        chosen_ids = {e.group_id for e in chosen}
        remaining_deadlines = [e.admit_version + S for e in entries if e.group_id not in chosen_ids]
        # Groups admitted later have deadlines > step + S, so only these S steps can be at risk.
        for d in range(step + 1, step + S + 1):
            if sum(x <= d for x in remaining_deadlines) > (d - step) * P:
                return None  # a finished newcomer would overtake a straggler that must go first
        return sorted(chosen, key=lambda e: e.group_id)

    def _check_unlocked(self) -> None:
        assert self.num_admitted_live <= self.capacity, (
            f"admitted {self.num_admitted_live} (not replaced) > capacity {self.capacity}"
        )
        assert self.num_admitted == len(self._entries) + self.num_consumed + self.num_replaced, (
            f"admitted {self.num_admitted} != running+finished {len(self._entries)} + "
            f"consumed {self.num_consumed} + replaced {self.num_replaced}"
        )
